"""One-question studies run as ``python -m benchmarks.studies.<name>``: asynchronous saves,
batched and per-head Newton-Schulz, init memory, the step's operations, one rank of 16384,
the exact gather's cost, runs side by side, a plain exit's abort."""
