"""``matrixfsdp bench`` (entry point :mod:`.harness`) and the benchmark tools (:mod:`.step_ops`,
:mod:`.init_memory`). Nothing in the library imports this package; the CLI imports
:mod:`.harness` only when the ``bench`` subcommand runs."""
