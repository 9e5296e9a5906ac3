"""Running ranks, shared by every entry point (``matrixfsdp train``, ``matrixfsdp bench``
and the bench tools) and kept out of the CLI so that the benchmark can use it without
importing it: the launcher (:func:`launch`: local processes, or in place under torchrun),
the device a local rank runs on, waiting for that device before reading host clocks, and
the argument type of ``--timeout`` (and ``--clip``) and the ``--help`` format that shows
every default."""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import math
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from ..diagnosis.arrival import CollectiveTimeout, lost_peer, ranks_text, timed_out
from ..diagnosis.flight import hung_ranks, read_dumps, recorder_env
from ..runtime.exit import exit_rank
from ..state.integrity import CheckpointError
from .nonfinite import NonFiniteError
from .rank_process import FromLauncher, ranks_started
from .report import SummaryError
from .resume import Refused

DEFAULT_TIMEOUT_S = 300.0  # process-group timeout of `train`, spawned and under torchrun alike
STOP_GRACE_S = 5.0  # after SIGTERM, how long a rank may take to end before SIGKILL
PR_SET_PDEATHSIG = 1  # prctl(2) option (linux/prctl.h)
# This process's parent when this module was imported: under torchrun, the agent that
# started this rank (it starts its workers from its main thread, directly: python or the
# console script); the nearest to the process's start that a rank can read it.
_PARENT_AT_IMPORT = os.getppid()


def device_for(local_rank: int) -> torch.device:
    """The device of local rank ``local_rank``: GPU ``local_rank % count`` (made the current
    device) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for queued device work, so host clocks time it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def positive_float(text: str) -> float:
    """``argparse`` type: a finite number > 0 (seconds of a timeout, a clipping norm)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that shows every option's default: argparse's own form ``(default: X)``,
    ``off`` for a switch or an unset option, nothing more where the help already says it."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings:  # argparse shows nothing: say the default
            action = copy.copy(action)
            action.help = ""
            action.help = self._get_help_string(action)
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is None or action.default is False:
            return f"{text} (default: off)".strip()
        return f"{text} (default: %(default)s)".strip()




# ---- launching ---------------------------------------------------------------------------
REPORT_DIR_ENV = "MATRIXFSDP_RANK_REPORTS"  # where spawned ranks leave their failure reports
# A rank that timed out waiting for a peer that hung stays this long before it leaves, so that
# the other ranks waiting there time out on their own and name the peer, rather than lose
# the connection to this rank first.
LINGER_S = 1.0
# After the first rank ends in failure, how long the others may take to end on their own
# (the ranks that waited with it, about to report the same hang) before they are stopped.
END_GRACE_S = 2.0


def failure_line(rank: int, exc: BaseException) -> str:
    """``rank R failed: Type: first line of the message``: what a failed rank is known by."""
    text = str(exc).strip().splitlines()
    return f"rank {rank} failed: {type(exc).__name__}" + (f": {text[0]}" if text else "")


def run_rank(fn, args, rank: int) -> NoReturn:
    """``fn(args)`` on this rank, then leave (see runtime/exit.py). On an exception the rank says
    so first (``rank R failed: ...``, then the traceback; a
    :class:`~matrixfsdp.state.integrity.CheckpointError`'s one line needs none; a rank that
    waited for a peer that hung says ``rank R stopped: ...`` naming the peer), leaves a report
    for the launcher (the time it failed, so the launcher names the first rank to fail,
    not a peer that failed because of it) and exits 1 at once through ``exit_rank``: the
    interpreter's normal exit after a failure (torch's error file, finalization with gloo's
    worker threads alive) took about 7 s here while the other ranks hung."""
    try:
        fn(args)
    except BaseException as e:  # noqa: BLE001 (reported, then the process ends)
        if isinstance(e, SystemExit) and e.code in (0, None):
            dist.destroy_process_group()
            exit_rank(0)
        if isinstance(e, Refused):  # the command's usage error, found once the ranks started
            _report_refusal(rank, e, f"matrixfsdp {getattr(args, 'cmd', None) or 'train'}")
            exit_rank(2)
        if _report_failure(rank, e):
            time.sleep(LINGER_S)
        exit_rank(130 if isinstance(e, KeyboardInterrupt) else 1)
    dist.destroy_process_group()
    exit_rank(0)  # finished: leave without interpreter finalization (see runtime/exit.py)


def _report_refusal(rank: int, exc: Refused, prog: str) -> None:
    """A refusal every rank raised alike (:class:`~matrixfsdp.train.resume.Refused`): for
    the launcher, a report it says as its own usage error; under torchrun, rank 0 says it
    (``prog: error: ...``)."""
    where = os.environ.get(REPORT_DIR_ENV)
    if where:
        try:
            with open(os.path.join(where, f"rank{rank}.json"), "w") as f:
                json.dump({"rank": rank, "time": time.time(), "refused": True, "waited": False,
                           "line": f"{prog}: error: {exc}", "message": str(exc)}, f)
            return
        except OSError:
            pass
    if rank == 0 or where:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)


def _report_failure(rank: int, exc: BaseException) -> bool:
    """Say why this rank stops (stderr, and a report for the launcher); True for a rank
    that timed out waiting (for a peer that hung, which it names where it can: it failed
    nothing itself)."""
    # a wait that timed out, named (a CollectiveTimeout) or not (a collective the library
    # does not watch: NCCL's, another group's): this rank failed nothing itself
    waited = isinstance(exc, CollectiveTimeout) or timed_out(exc)
    hung = getattr(exc, "missing", [])
    # a lost peer is a consequence (of a rank that ended, or of the peers that timed out on
    # a hung rank and left): its report never decides the launcher's line
    secondary = getattr(exc, "lost", False) or (not waited and lost_peer(exc))
    line = failure_line(rank, exc)
    if waited:  # the peer that hung is the story, and this rank is not "failed" for waiting
        line = f"rank {rank} stopped: {str(exc).strip()}"
    elif secondary:  # one line: the peer that died is the story
        line = f"rank {rank} stopped: it lost a peer ({line.split(': ', 1)[-1][:160]})"
    one_line = waited or secondary or isinstance(exc, (CheckpointError, NonFiniteError, SummaryError))
    tb = "" if one_line else "".join(traceback.format_exception(exc))
    print(f"\n{line}\n{tb}", end="", file=sys.stderr, flush=True)
    where = os.environ.get(REPORT_DIR_ENV)
    if where:
        try:
            with open(os.path.join(where, f"rank{rank}.json"), "w") as f:
                json.dump({"rank": rank, "time": time.time(), "line": line, "secondary": secondary,
                           "waited": waited, "hung": hung, "message": str(exc).strip()}, f)
        except OSError:
            pass  # the launcher falls back to torch's exit status
    return waited


def _reports(report_dir: str) -> list[dict]:
    reports = []
    for name in os.listdir(report_dir):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(report_dir, name)) as f:
                    reports.append(json.load(f))
            except (OSError, ValueError):
                continue
    return reports


def first_report(report_dir: str) -> dict | None:
    """:func:`verdict` on the reports :func:`run_rank` left in ``report_dir``."""
    return verdict(_reports(report_dir))


def verdict(reports: list[dict]) -> dict | None:
    """What the ranks' reports (left by :func:`run_rank`) say ended the run: the earliest report
    of a rank that failed of its own accord; else, if ranks timed out waiting, the one
    naming the ranks that hung, which are those the waiting ranks named less those that
    reported a wait themselves (a rank that timed out was alive: a ring or a reduce
    completes on some ranks before others, so a rank may see a peer that waits for the
    same hung rank as missing); None if no rank did either (reports of ranks that only
    lost a peer do not count). The hang's report has ``hung``: the ranks to name."""
    reports = [r for r in reports if not r.get("secondary")]
    failed = [r for r in reports if not r.get("waited")]
    if failed:
        return min(failed, key=lambda r: r["time"])
    if not reports:
        return None
    named = {h for r in reports for h in r.get("hung", [])}
    hung = sorted(named - {r["rank"] for r in reports}) or sorted(named)
    exact = [r for r in reports if sorted(r.get("hung", [])) == hung]
    some = [r for r in reports if set(r.get("hung", [])) & set(hung)]
    return {**min(exact or some or reports, key=lambda r: r["time"]), "hung": hung}


def _killed(processes) -> tuple[int, int, str] | None:
    """(index, pid, signal name) of a rank killed by a signal other than the launcher's own
    SIGTERM (the OOM killer, ``kill -9``), if any."""
    for i, p in enumerate(processes):
        code = p.exitcode
        if code is not None and code < 0 and -code != signal.SIGTERM:
            return i, p.pid, signal.Signals(-code).name
    return None


def die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent ends (however it ends:
    SIGKILL by a scheduler or the OOM killer included), then check that ``parent`` is still
    the parent, in case it ended before this call (the signal would never come); if it is
    not, leave at once. A no-op elsewhere.

    SIGKILL, not torch's SIGINT (``torch.multiprocessing`` sets ``PR_SET_PDEATHSIG`` to
    SIGINT): a process started with SIGINT ignored (a background job of a non-interactive
    shell, ``nohup cmd &``) ignores it, and the rank trained on; a KeyboardInterrupt only
    comes between Python bytecodes, after a C++ collective returns. A SIGKILLed rank
    commits nothing more: a checkpoint is committed by one rename after all its data is
    written, so a rank killed before it leaves only a ``.partial`` directory."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return  # refused (never seen): the rank runs as before
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        print(f"rank process {os.getpid()}: its launcher (pid {parent}) has ended; leaving",
              file=sys.stderr, flush=True)
        os._exit(1)


def _spawned(rank: int, from_launcher: FromLauncher, fn, world_size: int, init_file: str, args,
             timeout_s: float, held=None) -> None:
    """One local rank, forked from the preloaded server (:mod:`.rank_process`), which dies
    with its launcher. ``held``: kept for the process's life (the ``--out`` lock, whose
    file descriptor the rank inherits: :mod:`matrixfsdp.train.outlock`)."""
    from_launcher.adopt()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device_for(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    run_rank(fn, args, rank)


class _Stopped(BaseException):
    """The launcher received SIGTERM: stop the ranks, then exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(p) -> None:
    """SIGTERM, with SIGCONT so that a stopped rank handles it at once (as systemd does)."""
    if p.is_alive():
        p.terminate()
        try:
            os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _stop_ranks(processes, grace: float = 0.0, hung: tuple[int, ...] = ()) -> None:
    """SIGTERM the ranks ``hung`` at once; let the others end on their own for ``grace``
    seconds, then SIGTERM each one still alive; SIGKILL those still alive after
    :data:`STOP_GRACE_S`, and reap all."""
    for i in hung:
        if 0 <= i < len(processes):
            _terminate(processes[i])
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        _terminate(p)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _first_to_fail(processes) -> int | None:
    """Wait until every rank has ended (None) or one ends with a non-zero status (its index)."""
    live = {p.sentinel: i for i, p in enumerate(processes)}
    while live:
        for sentinel in multiprocessing.connection.wait(list(live), timeout=1.0):
            i = live.pop(sentinel)
            processes[i].join()
            if processes[i].exitcode != 0:
                return i
    return None


def _failure_line(ctx, failed: int, killed, report_dir: str | None) -> str:
    """The launcher's one line: the first rank to end, where a signal ended it; else the
    rank that failed first by its report, or the rank that hung (named by those that
    waited for it, or, on NCCL, by the flight records its watchdog dumped beside the
    reports: :mod:`.flight`); else a rank a signal ended (``killed``), or the exit status."""
    p = ctx.processes[failed]
    first = first_report(report_dir) if report_dir and p.exitcode > 0 else None
    records = os.path.join(os.path.dirname(report_dir), "flight") if report_dir else None
    found = hung_ranks(read_dumps(records)) if records and os.path.isdir(records) else None
    if found is not None and (first is None or first.get("waited") or killed is not None
                              or "timeout" in first.get("message", "").lower()):
        return (f"{ranks_text(found[0])} hung: {found[1]}; every rank was stopped (SIGTERM, "
                f"then SIGKILL after {STOP_GRACE_S:g} s)")
    if first is not None and first.get("hung"):
        return (f"{ranks_text(first['hung'])} hung: {first['message']}; every rank was stopped "
                f"(SIGTERM, then SIGKILL after {STOP_GRACE_S:g} s)")
    if first is not None:
        return f"{first['line']}; the other ranks were stopped"
    if killed is not None:
        return (f"rank {killed[0]} (pid {killed[1]}) was killed by signal {killed[2]}; the other "
                "ranks were stopped")
    error_file = ctx.error_files[failed]
    if os.access(error_file, os.R_OK):  # it raised before run_rank (torch's process wrapper)
        with open(error_file, "rb") as f:
            trace = pickle.load(f).strip()
        print(trace, file=sys.stderr)
        last = trace.splitlines()[-1] if trace else "an exception"
        return f"rank {failed} (pid {p.pid}) failed: {last}; the other ranks were stopped"
    return f"rank {failed} (pid {p.pid}) exited with code {p.exitcode}; the other ranks were stopped"


def _join_ranks(ctx, prog: str, report_dir: str | None = None) -> None:
    """Wait for every rank. The first rank to fail ends the others (those still running
    after :data:`END_GRACE_S` get SIGTERM, then SIGKILL: :func:`_stop_ranks`, about
    :data:`STOP_GRACE_S` + 2 s at most) and this launcher with a one-line error naming it
    (the earliest report of a rank that raised, or of one that timed out waiting for a rank
    that hung, which it names; a rank killed by a signal by that signal); SIGTERM or Ctrl-C
    to the launcher ends every rank before the launcher exits, so no rank outlives it."""

    def on_sigterm(signum, frame):
        raise _Stopped(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        failed = _first_to_fail(ctx.processes)
        if failed is None:
            return
        exited = ctx.processes[failed].exitcode
        killed = (failed, ctx.processes[failed].pid, signal.Signals(-exited).name) if exited < 0 \
            else _killed(ctx.processes)
        first = first_report(report_dir) if report_dir else None
        _stop_ranks(ctx.processes, END_GRACE_S, tuple((first or {}).get("hung") or ()))
        if first is not None and first.get("refused"):  # every rank refused the run alike
            print(first["line"], file=sys.stderr, flush=True)
            raise SystemExit(2)
        raise SystemExit(f"\n{prog}: {_failure_line(ctx, failed, killed, report_dir)}")
    except (KeyboardInterrupt, _Stopped) as e:
        _stop_ranks(ctx.processes)
        signum = e.signum if isinstance(e, _Stopped) else signal.SIGINT
        print(f"\n{prog}: stopped by {signal.Signals(signum).name}; all ranks ended", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def launch(fn, args, world_size: int, timeout_s: float | None = None, held=None) -> None:
    """Run ``fn(args)`` on ``world_size`` ranks: in place under torchrun (RANK is set),
    else as local processes (gloo on CPU, NCCL on CUDA). ``timeout_s`` (default
    ``args.timeout``, else :data:`DEFAULT_TIMEOUT_S`) is the process group's timeout in both
    cases: a collective waiting longer for a peer fails instead of hanging. A rank that
    raises ends the run at once, named first (:func:`run_rank`). Every rank dies with the
    process that started it: this launcher (:mod:`.rank_process`), or torchrun's agent
    (:func:`die_with_parent`).
    ``held`` goes to every local rank, which keeps it as long as it lives (the ``--out``
    lock of ``train``, so that the lock lasts as long as the last process of the run)."""
    if timeout_s is None:
        timeout_s = getattr(args, "timeout", None) or DEFAULT_TIMEOUT_S
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent started this process
            die_with_parent(_PARENT_AT_IMPORT)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        device_for(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        run_rank(fn, args, int(os.environ["RANK"]))
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        raise SystemExit(f"--ranks {world_size} needs {world_size} GPUs, found "
                         f"{torch.cuda.device_count()}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        reports = os.path.join(tmp, "reports")
        os.mkdir(reports)
        os.environ[REPORT_DIR_ENV] = reports  # inherited by the spawned ranks
        recorded = {}
        if torch.cuda.is_available():  # NCCL: each rank's watchdog dumps its flight record
            os.mkdir(os.path.join(tmp, "flight"))
            recorded = recorder_env(os.path.join(tmp, "flight"))
            os.environ.update(recorded)
        try:
            with ranks_started(_spawned, (fn, world_size, os.path.join(tmp, "init"), args,
                                          timeout_s, held), world_size) as ctx:
                _join_ranks(ctx, f"matrixfsdp {getattr(args, 'cmd', None) or 'launch'}", reports)
        finally:
            os.environ.pop(REPORT_DIR_ENV, None)
            for name in recorded:
                os.environ.pop(name, None)
