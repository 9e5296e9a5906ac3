"""The Plan and the layout the runtime reads: which rank owns each Muon matrix and how the
rest is split (:mod:`.planner`, :mod:`.assign`, :mod:`.types`), where every piece of a unit
lives and the ops that move it (:mod:`.units`), what each op moves (:mod:`.loads`), the
runtime's counts redone from the plan (:mod:`.traffic`) and the plan's report. Computed
once, read by the runtime and by the advisor alike. Pure Python over shapes: no tensor
data, no ``torch.distributed``."""
