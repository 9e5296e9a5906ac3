"""Test helper, run as a script: ``python tests/helpers/stop_in_dcp.py ARGS...`` runs ``matrixfsdp
ARGS...`` with one rank stopping itself (SIGSTOP) inside torch's own DCP classes, as a rank
whose storage or host hangs would: ``STOP_IN_DCP=WHERE:RANK:STEP:DIR``, WHERE one of
``saveplan`` (``FileSystemWriter.prepare_local_plan``, DCP's save planning) or ``loadread``
(``FileSystemReader.read_data``, the resume's read), for the checkpoint ``step_<STEP>``;
the rank writes ``time pid`` into ``DIR/stopped`` first.

The fault comes from outside the library: torch's classes are patched in the ranks' fork
server, which imports this file as its main module before it forks any rank (the server is
started here, with ``__main__`` preloaded, before the command starts it without)."""

from __future__ import annotations

import os
import signal
import sys
import time

VARIABLE = "STOP_IN_DCP"


def _install() -> None:
    spec = os.environ.get(VARIABLE)
    if not spec:
        return
    where, rank, step, out = spec.split(":", 3)
    import torch.distributed.checkpoint as dcp
    cls, name = {"saveplan": (dcp.FileSystemWriter, "prepare_local_plan"),
                 "loadread": (dcp.FileSystemReader, "read_data")}[where]
    original = getattr(cls, name)

    def stopped(self, *args, **kwargs):
        if os.environ.get("RANK") == rank and f"step_{int(step):08d}" in str(self.path):
            with open(os.path.join(out, "stopped"), "w") as f:
                f.write(f"{time.time()} {os.getpid()}")
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(self, *args, **kwargs)

    setattr(cls, name, stopped)


if __name__ == "__main__":
    import multiprocessing.forkserver

    from matrixfsdp.train.rank_process import PRELOAD
    multiprocessing.forkserver.set_forkserver_preload(["__main__", *PRELOAD])
    multiprocessing.forkserver.ensure_running()
    from matrixfsdp.__main__ import run
    sys.argv = ["matrixfsdp", *sys.argv[1:]]
    run()
else:  # the fork server, importing this file as its main module
    _install()
