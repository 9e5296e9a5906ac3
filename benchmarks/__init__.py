"""``matrixfsdp bench``: the library against FSDP2 and the Muon peers (:mod:`.harness`), and
under tensor and expert parallelism and a modelled link (:mod:`.parallel`). Nothing in the
library imports this package; the CLI imports :mod:`.harness` only when the ``bench``
subcommand runs."""
