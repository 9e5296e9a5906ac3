"""Ranks that leave through a plain ``dist.destroy_process_group()`` abort now and then: a
torch race at interpreter exit, which FSDP2 meets alike (issue 52, item 7).

``python -m studies.exit_abort [--runs 100] [--parallel 2] [--burners 1]
[--shard mf|fsdp2] [--exit plain|exit_rank|collect] [--scope module|function]
[--starve-gloo] [--fresh] [--out runs/exit_abort]``

One run is the case of ``tests/state/test_torch_state_dict.py`` as a user's script would
do it: 2 gloo ranks build the checkpoint tests' odd-shaped GPT, shard it (``mf.fully_shard``
per block then the root, ``mf.Muon``; or torch's ``fully_shard`` and ``AdamW`` with
``--shard fsdp2``), train 2 steps, save through torch's ``get_state_dict`` + ``dcp.save``;
then 3 ranks load it through ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``, train a
step. Every rank of both launches ends with ``dist.destroy_process_group()`` and falls off
the end of its script (``--exit exit_rank``: then ``mf.exit_rank()``; ``--exit collect``:
``gc.collect()`` once the rank's function has returned). ``--scope module`` keeps the
model, optimizer, mesh and state dicts until finalization, as a script's globals.

A launch's ranks are forked from a zygote that imported torch and the library once and
started no thread; each leaves by raising ``SystemExit`` up to the interpreter's own exit,
finalization included (``--fresh``: each rank its own interpreter, as torchrun starts
them). ``faulthandler`` is on for every thread and core dumps are unlimited, each rank in
its own directory (``/proc/sys/kernel/core_pattern`` is ``core`` here). Runs go
``--parallel`` at a time, beside ``--burners`` busy-looping processes. A run whose ranks all
exit 0 is deleted; any other keeps its directory: each rank's stdout, stderr (the C++
message and faulthandler's stacks) and core file. Writes ``DIR/results.json`` (per run, the
exit code of every rank) and prints the count of runs with a rank that died. A core's
native stacks: ``gdb -batch -ex 'thread apply all bt' .venv/bin/python DIR/run_N/save_R/core``.

Measured (torch 2.13 CPU, CPython 3.11.7, 2 cores shared with other jobs, load average 4
to 10; ``--parallel 2 --burners 1``; runs with a rank that did not exit 0):

=============================================================  ==========  ==========
mode                                                           mf          fsdp2
=============================================================  ==========  ==========
``--exit plain``                                               0 of 100    0 of 100
``--exit plain --starve-gloo``                                 26 of 30    7 of 10
``--exit exit_rank --starve-gloo``                             0 of 40
``--exit collect --scope function --starve-gloo``              0 of 40     7 of 10
=============================================================  ==========  ==========

Every rank that died died of SIGABRT, "terminate called without an active exception" (one
FSDP2 rank reported SIGSEGV: faulthandler crashing as it dumped that abort). In every core
read, a gloo worker (``ProcessGroupGloo::runLoop``) destroys a finished work
(``~AsyncAllreduceWork`` / ``~AsyncBroadcastWork`` -> ``~AsyncWork``) whose thread-local
state (``~ThreadLocalState``: autograd's stashed context, a collective issued in backward)
or output tensors (``TensorImpl::decref_pyobject``) release a Python object: ``take_gil`` ->
``PyThread_exit_thread`` -> ``pthread_exit``, a forced unwind through a ``noexcept``
destructor -> ``std::terminate``; the main thread is in ``Py_FinalizeEx``'s garbage
collection. The group outlives ``destroy_process_group()`` because the mesh holds it (under
FSDP2 DTensor's sharding caches hold the mesh too, so freeing one's own objects does not
free it). ``--starve-gloo`` holds open the window that load opens now and then. What a user
does about it: docs/troubleshooting.md, "A rank aborts at exit".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ODD = dict(vocab_size=256, d_model=35, n_heads=5, n_layers=2, d_mlp=55, seq_len=17)
SEQ, GLOBAL = 16, 12  # 12 rows a step: 6 per rank at 2, 4 at 3


_KEPT: dict = {}  # --scope module: what a script's top level would hold until the end


# ---- one rank -------------------------------------------------------------------------------------
def _rank(args) -> None:
    import faulthandler
    faulthandler.enable(all_threads=True)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp as mf
    from matrixfsdp.train.models import GPT, GPTConfig

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=rank, world_size=world)
    torch.manual_seed(0 if args.phase == "save" else 123)
    model = GPT(GPTConfig(**ODD))
    mesh = init_device_mesh("cpu", (world,))
    if args.shard == "mf":
        for block in model.layers:
            mf.fully_shard(block, mesh=mesh)
        mf.fully_shard(model, mesh=mesh)
        opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, weight_decay=0.1, momentum=0.95,
                                           adamw_lr=3e-3))
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (GLOBAL, SEQ + 1), generator=g) for _ in range(3)]
    per_rank = GLOBAL // world

    def step(i):
        x = data[i][rank * per_rank:(rank + 1) * per_rank]
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    if args.phase == "save":
        step(0)
        if args.starve_gloo:
            _starve_gloo()
        step(1)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.ckpt)
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=args.ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if args.starve_gloo:
            _starve_gloo()
        step(2)
    print(f"rank {rank}/{world} {args.phase}: done", flush=True)
    if args.scope == "module":  # as a script's globals: alive until the interpreter's finalization
        _KEPT.update(locals())
    dist.destroy_process_group()
    if args.exit == "exit_rank":
        mf.exit_rank()


def _rank_and_leave(args) -> None:
    """:func:`_rank`; with ``--exit collect``, a full garbage collection once it has returned
    (with ``--scope function``: the model, optimizer, mesh and their process group freed, so
    the group's gloo threads are joined before the interpreter finalizes)."""
    _rank(args)
    if args.exit == "collect":
        import gc
        gc.collect()


def _starve_gloo() -> None:
    """What a loaded machine does now and then, made the rule: every thread of this rank on
    one CPU, torch's gloo worker threads (``pt_gloo_runloop``) at ``SCHED_IDLE``: a worker
    that has just finished a collective runs again only once the main thread blocks or
    sleeps, not while it goes on computing (the main thread, woken by the collective's
    end, takes the CPU first)."""
    cpu = min(os.sched_getaffinity(0))
    for task in os.listdir("/proc/self/task"):
        tid = int(task)
        try:
            os.sched_setaffinity(tid, {cpu})
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == "pt_gloo_runloop":
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, ProcessLookupError):  # a thread that ended meanwhile
            pass


# ---- the runs -----------------------------------------------------------------------------------
def _prepare(args) -> None:
    """In a rank's process before it runs: core dumps unlimited; pinned to ``--cpus``."""
    _core_unlimited()
    if args.cpus:
        os.sched_setaffinity(0, _cpu_list(args.cpus))


def _cpu_list(spec: str) -> set[int]:
    """"0" -> {0}; "0-1,3" -> {0, 1, 3}."""
    cpus = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _core_unlimited() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _rank_argv(run_dir: Path, phase: str, world: int, r: int, args) -> list[str]:
    return ["--rank", str(r), "--world", str(world), "--phase", phase,
            "--init", str(run_dir / f"init_{phase}"), "--ckpt", str(run_dir / "ckpt"),
            "--shard", args.shard, "--exit", args.exit, "--scope", args.scope,
            *(["--starve-gloo"] if args.starve_gloo else [])]


def _forked(run_dir: Path, phase: str, world: int, args) -> list[int | None]:
    """The ranks of one launch forked from this process (a zygote that imported torch and
    the library once, and started no thread): each child runs :func:`_rank` and then leaves
    as a script does, raising ``SystemExit`` up to the interpreter's own exit (finalization
    included). Exit codes as ``subprocess`` gives them (-6: SIGABRT)."""
    import signal
    pids = []
    sys.stdout.flush()
    sys.stderr.flush()
    for r in range(world):
        cwd = run_dir / f"{phase}_{r}"
        cwd.mkdir()
        pid = os.fork()
        if pid == 0:  # the rank
            os.chdir(cwd)
            for fd, name in ((1, "stdout"), (2, "stderr")):
                f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            _prepare(args)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            code = 0
            try:
                _rank_and_leave(_PARSER.parse_args(_rank_argv(run_dir, phase, world, r, args)))
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            raise _RankExit(code)  # up through the zygote's frames to the interpreter's exit
        pids.append(pid)
    codes: list[int | None] = []
    deadline = time.monotonic() + args.timeout
    for pid in pids:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes.append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes.append(None)
                break
            time.sleep(0.2)
    return codes


class _RankExit(SystemExit):
    """A forked rank's end: nothing of the zygote's catches it."""


def _launch(run_dir: Path, phase: str, world: int, args) -> list[int | None]:
    """The ranks of one launch, each a fresh interpreter (``--fresh``), as torchrun starts them."""
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    for r in range(world):
        cwd = run_dir / f"{phase}_{r}"  # its own directory: the core file is "core"
        cwd.mkdir()
        cmd = [sys.executable, "-m", "studies.exit_abort",
               *_rank_argv(run_dir, phase, world, r, args)]
        with open(cwd / "stdout", "w") as out, open(cwd / "stderr", "w") as err:
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err,
                                          preexec_fn=lambda: _prepare(args)))
    codes: list[int | None] = []
    deadline = time.monotonic() + args.timeout
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes


def _one(i: int, args, launch) -> dict:
    """Run ``i``: save at 2 ranks, then (if all 2 exited 0) load at 3."""
    run_dir = Path(args.out) / f"run_{i}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    t = time.monotonic()
    save = launch(run_dir, "save", 2, args)
    load = launch(run_dir, "load", 3, args) if all(c == 0 for c in save) else []
    ok = all(c == 0 for c in save) and len(load) == 3 and all(c == 0 for c in load)
    if ok and not args.keep:
        shutil.rmtree(run_dir)
    return {"run": i, "save": save, "load": load, "ok": ok,
            "seconds": round(time.monotonic() - t, 1)}


def _zygote(args) -> None:
    """Runs ``args.first``, ``args.first + args.parallel``, ... one after the other, each
    launch's ranks forked from this process; one JSON line per run on stdout."""
    import torch  # noqa: F401 (imported once, before any fork)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import matrixfsdp  # noqa: F401
    import matrixfsdp.train.models  # noqa: F401
    for i in range(args.first, args.runs, args.parallel):
        print(json.dumps(_one(i, args, _forked)), flush=True)


def _run_zygote(first: int, args) -> list[dict]:
    cmd = [sys.executable, "-m", "studies.exit_abort", "--zygote", "--first", str(first),
           "--runs", str(args.runs), "--parallel", str(args.parallel), "--shard", args.shard,
           "--scope", args.scope, *(["--cpus", args.cpus] if args.cpus else []),
           *(["--starve-gloo"] if args.starve_gloo else []),
           "--exit", args.exit, "--out", args.out, "--timeout", str(args.timeout),
           *(["--keep"] if args.keep else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    results = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as z:
        for line in z.stdout:
            if line.startswith("{"):
                results.append(json.loads(line))
                print(line, end="", flush=True)
    return results


ROOT = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--parallel", type=int, default=2, help="runs at once")
    p.add_argument("--burners", type=int, default=1, help="busy-looping processes beside the runs")
    p.add_argument("--shard", choices=["mf", "fsdp2"], default="mf")
    p.add_argument("--exit", choices=["plain", "exit_rank", "collect"], default="plain",
                   help="after dist.destroy_process_group(): nothing (plain), mf.exit_rank(), "
                        "or gc.collect() once the rank's function has returned (collect)")
    p.add_argument("--scope", choices=["module", "function"], default="module",
                   help="the rank's model, optimizer, mesh, state dicts: freed at the "
                        "interpreter's finalization, as a script's globals (module), or when "
                        "the rank's function returns")
    p.add_argument("--cpus", default=None,
                   help="pin every rank (all its threads) to these CPUs, e.g. 0: its gloo "
                        "threads then wait for the main thread's time slice")
    p.add_argument("--starve-gloo", action="store_true",
                   help="before the last step of each launch, every thread of a rank on one CPU "
                        "and gloo's worker threads at SCHED_IDLE (see _starve_gloo)")
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for one launch's ranks")
    p.add_argument("--fresh", action="store_true",
                   help="each rank a fresh interpreter (default: forked from one that imported torch)")
    p.add_argument("--keep", action="store_true", help="keep every run's directory")
    p.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    # a rank's own arguments
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--world", type=int)
    p.add_argument("--phase", choices=["save", "load"])
    p.add_argument("--init")
    p.add_argument("--ckpt")
    return p


_PARSER = _parser()


def main(argv=None) -> None:
    args = _PARSER.parse_args(argv)
    if args.rank is not None:
        _rank_and_leave(args)
        return
    if args.zygote:
        _zygote(args)
        return
    args.out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="exit_abort_"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.burners)]
    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            if args.fresh:
                def fresh(i):
                    result = _one(i, args, _launch)
                    print(json.dumps(result), flush=True)
                    return result
                results = list(pool.map(fresh, range(args.runs)))
            else:
                results = [r for rs in pool.map(lambda k: _run_zygote(k, args), range(args.parallel))
                           for r in rs]
    finally:
        for b in burners:
            b.kill()
            b.wait()
    failed = [r for r in results if not r["ok"]]
    results.sort(key=lambda r: r["run"])
    summary = {"runs": len(results), "failed": len(failed), "shard": args.shard, "exit": args.exit,
               "scope": args.scope, "cpus": args.cpus, "starve_gloo": args.starve_gloo,
               "fresh": args.fresh,
               "parallel": args.parallel, "burners": args.burners,
               "codes": sorted({c for r in failed for c in r["save"] + r["load"] if c != 0}, key=str),
               "results": results}
    (Path(args.out) / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(failed)} of {len(results)} runs with a rank that did not exit 0 "
          f"(shard={args.shard}, exit={args.exit}, scope={args.scope}, cpus={args.cpus}, "
          f"starve_gloo={args.starve_gloo}, fresh={args.fresh}, parallel={args.parallel}, "
          f"burners={args.burners}); kept in {args.out}")


if __name__ == "__main__":
    main()
