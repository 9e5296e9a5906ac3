"""``matrixfsdp plan`` and ``matrixfsdp calibrate``: what a layout of a cluster would cost
(:mod:`.predict`, ``mf.plan_costs``; :mod:`.costs`, :mod:`.layout_costs`, :mod:`.comm_costs`,
:mod:`.ns_costs`, :mod:`.passes`, :mod:`.state_costs`), the step time on a link model
(:mod:`.links`, :mod:`.steptime`), the peers' costs (:mod:`.peers`), the search over
(replicate, shard, tp, pp) layouts and its report (:mod:`.search`, :mod:`.layout_eval`,
:mod:`.evaluated`, :mod:`.advice`), and the constants measured on a machine
(:mod:`.calibrate`). Reads the layout the runtime reads (:mod:`matrixfsdp.layout`); the
library's runtime never imports it, ``import matrixfsdp`` only its cost model (for
``mf.plan_costs``)."""
