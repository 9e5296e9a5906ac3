"""A sharded model's tensors as torch sees them outside training: :class:`RowShard` (a
DTensor for DCP and torch's state-dict helpers), its exact gather, a value's piece for this
rank, and torch's ``state_dict`` / ``load_state_dict`` on the sharded modules."""
