"""Optimizers on the owner layout: Muon with AdamW routing, any per-matrix optimizer on
the owners, and the global gradient norm. Builds on the runtime."""
