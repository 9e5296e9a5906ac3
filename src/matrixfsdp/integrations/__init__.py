"""Integrations with other libraries' models and loops (transformers)."""
