"""``matrixfsdp bench``: MatrixFSDP against FSDP2 and the Muon peers, side by side (entry point
:mod:`.main`)."""
