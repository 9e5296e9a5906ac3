"""What the tests share, and nothing else: no test file imports another.

Imported as ``helpers.<module>`` (``tests/`` is on ``sys.path``: tests/conftest.py puts it
there, and the rank processes of :mod:`helpers.rank_pool` and of the launcher inherit it).
Three modules also run as scripts in processes of their own (``python
tests/helpers/<name>.py ARGS...``: :mod:`.inject_faults`, :mod:`.open_audit`,
:mod:`.stop_in_dcp`); those import nothing from this package at module level.

* :mod:`.rank_pool`: ``spawn(fn, world_size, ...)``, a function on N local gloo ranks;
* :mod:`.cli`: ``matrixfsdp ...`` run in the test process (``run_cli``);
* :mod:`.collectives`: counting the collectives a stretch of code issues;
* :mod:`.reference`: one-process reference training with torch's own optimizers;
* :mod:`.parity`: the parity runs' settings (``ODD``, ``MUON``, ``ADAMW``, ``muon_groups``)
  and the N-rank run against one process;
* :mod:`.checkpointing`: the checkpoint tests' model, optimizer, schedule and reference;
* :mod:`.per_head`: torch.optim.Muon on each head block, the per-head reference;
* :mod:`.moe_models`, :mod:`.tp_models`, :mod:`.tp_training`, :mod:`.ep_models`,
  :mod:`.pp_models`, :mod:`.pp_training`, :mod:`.diverging_model`: models and their runs;
* :mod:`.replicate_bytes`: HSDP's replicate-dim bytes read off a plan's layouts;
* :mod:`.titan_cpu`, :mod:`.titan_hf`: torchtitan on CPU, torchtitan's HF export;
* :mod:`.inject_faults`, :mod:`.open_audit`, :mod:`.stop_in_dcp`: faults and recordings
  from outside the library;
* :mod:`.processes`: the launcher's processes, read from /proc;
* :mod:`.docs_pages`: the docs' pages and the commands' ``--help``.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent  # tests/helpers
TESTS = HERE.parent  # tests
REPO = TESTS.parent  # the repository root
