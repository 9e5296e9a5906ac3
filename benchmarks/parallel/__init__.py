"""``matrixfsdp bench --tp / --ep / --link``: the most loaded rank's bytes under tensor and
expert parallelism, and step time against a modelled link."""
