"""``matrixfsdp plan`` and ``matrixfsdp calibrate``: the search over the (replicate, shard, tp,
pp) layouts of a cluster and its advice (:mod:`.search`, :mod:`.layout_eval`,
:mod:`.evaluated`, :mod:`.advice`, :mod:`.torchtitan_flags`), the model as each layout sees
it (:mod:`.model_shapes`; from a transformers config: :mod:`.hf_config`), the peers it
compares against (:mod:`.peers`), the command line (:mod:`.cli`) and the constants measured
on a machine (:mod:`.calibrate`). Each layout is planned by the planner the runtime uses
(:mod:`matrixfsdp.layout`) and costed and timed by :mod:`matrixfsdp.costs`; nothing in the
library imports this room, ``import matrixfsdp`` included."""
