"""The runtime, the hot path in FSDP2's shape: FSDP2's module methods and the look-ups
(:mod:`.module`), the state of one sharded model (:mod:`.root`), a communication unit
(FSDP2's param group, :mod:`.unit`), the per-parameter record (:mod:`.param`), a unit's
storage and data movement (:mod:`.storage`), collectives, overlap, HSDP, tensor
parallelism, mixed precision, lazy initialisation and the set-up checks. Builds on
:mod:`matrixfsdp.layout` and :mod:`matrixfsdp.diagnosis`."""
