"""Planning: which rank owns each Muon matrix and how the rest is split, and what that
costs (bytes, memory, Newton-Schulz FLOPs). Pure Python over shapes: no tensor data, no
``torch.distributed``."""
