"""The runtime, in FSDP2's shape: ``fully_shard`` and the FSDPModule methods, the state of
one sharded model (root), a communication unit (FSDP2's param group), the per-parameter
record, storage and layout, collectives, overlap, HSDP, mixed precision, lazy
initialisation and the checks. Builds on :mod:`matrixfsdp.planning` only."""
