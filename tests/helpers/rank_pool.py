"""Run a function on N local gloo ranks: a persistent pool of rank processes per world size.

Starting a rank costs 4-7 s here (a fresh interpreter importing torch), while a test's work
on it is often under a second. So, as torch's ``MultiProcContinuousTest`` does, the ranks of
each world size are started once per session (forked from a server that imported torch
once) and reused: :func:`spawn` hands every rank of
the pool one job, ``fn(rank, world_size, *args)``, and waits for all of them.

Each job gets a fresh default process group (a new file rendezvous, the 60 s timeout tests
rely on) that is destroyed when the job ends, so every sub-group, mesh and pending
collective of one test is gone before the next; the library's process-wide state is reset
the same way (:func:`_reset`). A job that fails on some ranks ends the others too: when
a failed rank destroys its group, peers blocked on it get a closed connection. A pool that
does not answer in time is killed and started anew, so one hung test never stalls the suite.

Tests that kill ranks or test the launcher itself (``matrixfsdp train``, torchrun) start
their own processes, through the launcher they test.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from matrixfsdp.runtime.exit import exit_rank

GROUP_TIMEOUT = timedelta(seconds=60)
GRACE_S = 30.0  # after one rank failed, how long the others may take to report


def _init(rank: int, world_size: int, init_file: str, backend: str) -> None:
    if backend != "gloo":  # grouped_gloo: gloo with NCCL's uneven collectives (the NCCL path)
        from matrixfsdp import testing
        testing.register("grouped_gloo")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=GROUP_TIMEOUT)


def _settle() -> None:
    """What a job leaves running finishes before the job is reported done: an asynchronous
    save in flight (the test may read the checkpoint next)."""
    from matrixfsdp.state import files as _files
    try:
        _files.wait_for_checkpoint()
    except Exception:  # noqa: BLE001 (the job that started the save has reported it)
        pass


def _reset() -> None:
    """Leave the process as a fresh rank would be for the next job: the job's process group
    destroyed, the library's process-wide state (units never sharded), torch's global
    switches, compiled graphs and caches, the job's garbage collected. Runs after the job
    is reported done, while the test goes on: most of its time is waiting for the process
    groups' threads to end (measured up to 0.45 s a job, of which 0.08 s CPU)."""
    from matrixfsdp.runtime import module as _fs
    if dist.is_initialized():
        dist.destroy_process_group()
    _fs._UNSHARDED_UNITS.clear()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(False)
    dynamo = getattr(torch, "_dynamo", None)
    if dynamo is not None and hasattr(dynamo, "reset"):
        dynamo.reset()
        dynamo.utils.counters.clear()  # graph and break counts, read by the compile tests
    _clear_dtensor_caches()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """DTensor caches its sharding decisions per process, keyed by meshes that compare by
    ranks and names, and the cached results hold the mesh they were made with: after the
    job's process groups are destroyed, the next job's equal mesh would find the old one
    (and its dead groups). A fresh rank has no cache."""
    from torch.distributed.tensor import DTensor
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ fast path's cache (torch >= 2.10)
        native()
    prop = DTensor._op_dispatcher.sharding_propagator
    for name in dir(prop):
        fn = getattr(prop, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _job_loop(rank: int, world_size: int, jobs, results, session: int, crash_log: str) -> None:
    """A pool rank: run jobs until told to stop, or until the test session (``session``,
    a pid) is gone. Not its parent's death: the parent is the fork server, which itself
    lives as long as any rank it forked holds its liveness pipe. A native crash writes every
    thread's stack to ``crash_log``, which the test that finds the rank dead reports (the
    rank's stderr is the fork server's, often a finished test's captured output)."""
    crash = open(crash_log, "w")  # noqa: SIM115 (open for the process's life)
    faulthandler.enable(file=crash, all_threads=True)
    # What the server imported (torch, transformers, the library: some 400,000 objects)
    # lives as long as the rank: kept out of every garbage collection, so that a full one
    # (each job's reset, and the interpreter's own) scans only what jobs made (0.16 s -> ms).
    gc.freeze()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    env, cwd = dict(os.environ), os.getcwd()
    reset_failed = None
    while True:
        try:
            job = jobs.get(timeout=2.0)
        except queue.Empty:
            if not _alive(session):  # the test session is gone: so is this rank
                exit_rank(0)
            continue
        if job is None:
            exit_rank(0)  # leave without interpreter finalization (see matrixfsdp.runtime.exit)
        job_id, init_file, backend, fn, args = job
        error = None
        try:
            if init_file is not None:
                _init(rank, world_size, init_file, backend)
            fn(rank, world_size, *args)
        except BaseException as e:  # noqa: BLE001 (reported to the parent)
            error = f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            if dist.is_initialized():  # at once: peers blocked on this rank see it leave
                dist.destroy_process_group()
        finally:
            _settle()
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
        error = "\n".join(e for e in (reset_failed, error) if e) or None
        reset_failed = None
        results.put((job_id, rank, error))
        try:  # a failed rank's group is destroyed here too: its peers see the connection close
            _reset()
        except BaseException as e:  # noqa: BLE001 (reported with the next job: a pool rank
            # left half reset could fail it)
            reset_failed = (f"rank {rank}: resetting after {fn.__name__} failed: {e}\n"
                            f"{traceback.format_exc()}")


def _context():
    """Rank processes forked from a server that has imported torch and the library once
    (``forkserver`` with preloading): a rank starts in a fraction of a second instead of
    importing torch anew. The server is single-threaded, so forking it is safe."""
    ctx = multiprocessing.get_context("forkserver")
    # what most ranks import anyway (a module missing here is skipped by the server)
    # (transformers' model code too: importing its first model, 0.7 s, was paid by every
    # rank that built one, of every pool)
    ctx.set_forkserver_preload(["torch", "torch.distributed", "matrixfsdp", "helpers.rank_pool",
                                "transformers", "transformers.models.llama.modeling_llama",
                                "pytorch_optimizer", "heavyball", "torch._dynamo"])
    return ctx


class _Pool:
    def __init__(self, world_size: int):
        ctx = _context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        session = os.getpid()
        self.logs = tempfile.mkdtemp(prefix=f"pool{world_size}-")
        self.procs = [ctx.Process(target=_job_loop, name=f"rank{r}-of-{world_size}",
                                  args=(r, world_size, self.jobs[r], self.results, session,
                                        os.path.join(self.logs, f"crash{r}")))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.next_id = 0
        # The jobs' rendezvous directories, removed when the pool is: a rank's FileStore
        # touches its file when collected, which may be after the job reported done (a
        # FileStore whose directory is gone aborts the process from its destructor).
        self.tmps: list[str] = []

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args: tuple, timeout: float, init: bool = True, backend: str = "gloo"
            ) -> None:
        self.next_id += 1
        job_id = self.next_id
        tmp = tempfile.mkdtemp()
        self.tmps.append(tmp)
        init_file = os.path.join(tmp, "init") if init else None
        for q in self.jobs:
            q.put((job_id, init_file, backend, fn, args))
        errors: dict[int, str | None] = {}
        deadline = time.monotonic() + timeout
        while len(errors) < self.world_size:
            if any(e is not None for e in errors.values()):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            try:
                got_id, rank, error = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.alive():
                    raise RuntimeError(f"{fn.__name__}: {self.deaths()}") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(errors))
                    failed = "\n".join(e for e in errors.values() if e)
                    raise TimeoutError(
                        f"{fn.__name__} on {self.world_size} ranks: ranks {missing} did not "
                        f"finish in time\n{failed}") from None
                continue
            if got_id == job_id:
                errors[rank] = error
        failed = [e for e in errors.values() if e]
        if failed:
            raise RuntimeError(f"{fn.__name__} failed on {len(failed)} of {self.world_size} ranks:\n"
                               + "\n".join(failed))

    def deaths(self) -> str:
        """The dead ranks: how each ended (its exit code or signal) and its crash log."""
        lines = []
        for r, p in enumerate(self.procs):
            if p.is_alive():
                continue
            code = p.exitcode
            how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exit code {code}")
            try:
                with open(os.path.join(self.logs, f"crash{r}")) as f:
                    log = f.read()[-4000:]
            except OSError:
                log = ""
            lines.append(f"rank process {p.name} died ({how})" + (f":\n{log}" if log else ""))
        return "\n".join(lines)

    def _forget_tmps(self) -> None:
        while self.tmps:
            shutil.rmtree(self.tmps.pop(), ignore_errors=True)

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.jobs):
            if not kill and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join()
        self._forget_tmps()
        shutil.rmtree(self.logs, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}


@atexit.register
def close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def spawn(fn, world_size: int, *args, timeout: float = 240.0, init: bool = True,
          backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (a module-level
    function, each rank with its own default process group); raise if any rank fails or the
    whole run exceeds ``timeout`` seconds (never hang the suite). ``init=False``: no process
    group is made for ``fn`` (it makes its own, as a script under torchrun does; the pool
    destroys it after). ``backend="grouped_gloo"``: gloo with NCCL's uneven all-gather and
    reduce-scatter (:mod:`matrixfsdp.testing.grouped_gloo`), so the runtime takes NCCL's path."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        pool.run(fn, args, timeout, init, backend)
    except (TimeoutError, RuntimeError) as e:
        if isinstance(e, TimeoutError) or not pool.alive():
            pool.close(kill=True)  # a rank may be stuck: the next job starts a new pool
            del _POOLS[world_size]
        raise
