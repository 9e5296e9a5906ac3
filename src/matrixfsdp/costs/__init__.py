"""What a layout costs, before any rank exists: a plan's model state, buffers, Newton-Schulz
and collectives per rank (:mod:`.predict`, ``mf.plan_costs``; :mod:`.summary`), one pipeline
stage of a layout costed (:mod:`.layout_costs`, :mod:`.comm_costs`, :mod:`.ns_costs`,
:mod:`.state_costs`, :mod:`.passes`) and timed on a two-level link model (:mod:`.links`,
:mod:`.steptime`; a machine's measured constants: :mod:`.constants`). Pure arithmetic over the
layout the runtime reads (:mod:`matrixfsdp.layout`), with no ``torch.distributed``:
``import matrixfsdp`` imports it for ``mf.plan_costs``, the advisor
(:mod:`matrixfsdp.advisor`) searches with it, and it imports neither."""
