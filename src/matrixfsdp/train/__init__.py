"""The ``matrixfsdp`` command: the CLI, the rank launcher, the training loop and resume,
the run report, the demo corpus and models, and the ``plan`` command's cluster presets."""
