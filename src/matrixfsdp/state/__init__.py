"""State: state dicts by parameter name (model and optimizers), DCP placement objects,
checkpoint files and their integrity, interop with full-tensor files, and meta-device
initialisation."""
