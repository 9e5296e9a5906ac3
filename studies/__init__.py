"""The design's one-question studies, each run as ``python -m studies.<name>``: asynchronous
saves, batched and per-head Newton-Schulz, init memory, the step's operations, one rank of
16384, the exact gather's cost, runs side by side, a plain exit's abort. Beside the
benchmarks (which compare the library against its peers) and outside the package: they
import the library, and nothing in it imports them."""
