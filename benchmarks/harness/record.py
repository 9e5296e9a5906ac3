"""Recording one training step's collectives, per rank, for the byte benches
(:mod:`.tp`, :mod:`.ep`): torch.distributed's collective functions are wrapped for the
measured step (FSDP2 and the runtime look them up at call time, as ``tests/runtime/test_most_loaded_rank.py``
relies on), each call charged by NCCL's algorithms
(:func:`charge`), and MatrixFSDP's calls tagged with the unit pass they serve
(:func:`tagging`). The analysis of the records is :mod:`.tp_report`'s."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import matrixfsdp as mf
from matrixfsdp.layout.loads import op_load
from matrixfsdp.runtime.storage import UnitStorage
from matrixfsdp.train.launch import launch
from matrixfsdp.train.machine import machine_info

# ---- recording torch.distributed's collectives ----------------------------------------------
_RECORDED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor", "all_reduce", "broadcast", "reduce", "all_to_all_single",
             "all_gather", "all_to_all", "reduce_scatter", "gather", "scatter")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def _arg(args, kwargs, i: int, name: str):
    return kwargs[name] if name in kwargs else (args[i] if len(args) > i else None)


def charge(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """One call of ``torch.distributed.<name>`` on this rank: its group (ranks and name,
    which identify it on every member), buffer bytes and this rank's (sent, received) bytes
    under NCCL's algorithms."""
    group = kwargs.get("group") or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    P, me = len(ranks), dist.get_rank(group)
    tensors = _tensors(args, kwargs)
    n = max((_nbytes(t) for t in tensors), default=0)  # all-gather output, reduce-scatter input
    if name == "all_to_all_single":
        out, inp = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input")
        es = inp.element_size()
        outs = _arg(args, kwargs, 2, "output_split_sizes") or [out.numel() // P] * P
        ins = _arg(args, kwargs, 3, "input_split_sizes") or [inp.numel() // P] * P
        sent, received = (sum(ins) - ins[me]) * es, (sum(outs) - outs[me]) * es
    elif name in ("broadcast", "reduce"):
        root = kwargs.get("group_src", kwargs.get("group_dst"))
        if root is None:
            src = _arg(args, kwargs, 1, "src" if name == "broadcast" else "dst")
            root = dist.get_group_rank(group, src)
        load = op_load(name, n, P, me, root)
        sent, received = load.sent, load.received
    else:  # ring collectives (and the rarely used list forms, charged alike)
        load = op_load("all_reduce" if name == "all_reduce" else "all_gather", n, P, me)
        sent, received = load.sent, load.received
    return {"op": name, "group": group.group_name, "ranks": ranks, "bytes": n,
            "sent": sent, "received": received}


@contextmanager
def recording(calls: list[dict], state: dict[str, Any]):
    """Wrap torch.distributed's collectives on this rank: each call appends
    :func:`charge`'s record, with the phase (``state["phase"]``: forward, backward, step) it
    was issued in and the unit pass (``state["tag"]``) it belongs to, if known."""
    def wrap(name, fn):
        def recorded(*args, **kwargs):
            calls.append({**charge(name, args, kwargs), "phase": state["phase"],
                          "tag": state["tag"]})
            return fn(*args, **kwargs)
        return recorded
    with _replaced(dist, {name: wrap(name, getattr(dist, name))
                          for name in _RECORDED if hasattr(dist, name)}):
        yield


@contextmanager
def _replaced(owner: Any, attributes: dict[str, Any]):
    """``owner``'s ``attributes`` set for the ``with`` body, then put back."""
    saved = {name: getattr(owner, name) for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


@contextmanager
def tagging(model: nn.Module, state: dict[str, Any]):
    """MatrixFSDP: tag every collective with the unit pass it serves, ``[unit, "gather" |
    "reduce", n]`` (the unit's n-th gather of the step; its reduce's last hop, the
    all-to-all of :meth:`UnitStorage.start_split_reduce`, issued later, belongs to its
    reduce), by wrapping the storage's three entry points (all issue their collectives
    before returning). FSDP2 needs none: each of its collectives is one unit pass."""
    names = {id(u.storage): u.name for u in mf.get_root(model).units}
    seen: dict[tuple[str, str], int] = {}
    saved = {m: getattr(UnitStorage, m) for m in ("start_unshard", "start_reduce",
                                                   "start_split_reduce")}

    def wrap(method, kind):
        def tagged(self, *args, **kwargs):
            key = (names.get(id(self), "?"), kind)
            if method == "start_split_reduce":
                n = seen.get(key, 1) - 1  # the hop of the last reduce of this unit
            else:
                n = seen.get(key, 0)
                seen[key] = n + 1
            before, state["tag"] = state["tag"], [*key, n]
            try:
                return saved[method](self, *args, **kwargs)
            finally:
                state["tag"] = before
        return tagged
    with _replaced(UnitStorage, {method: wrap(method, kind) for method, kind in (
            ("start_unshard", "gather"), ("start_reduce", "reduce"),
            ("start_split_reduce", "reduce"))}):
        yield


def train_step(model, opt, x: torch.Tensor, state: dict[str, Any]) -> None:
    state["phase"] = "forward"
    loss = model.loss(x[:, :-1], x[:, 1:])
    state["phase"] = "backward"
    loss.backward()
    state["phase"] = "step"
    opt.step()
    opt.zero_grad(set_to_none=True)
    state["phase"] = "after"



def record_step(model: nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor],
                ours: bool) -> dict[str, Any]:
    """Train on ``data[:-1]`` (warm-up: lazy initialisation), then record the step on
    ``data[-1]``: its calls (:func:`charge`'s records with phase and tag), its wall time and,
    for MatrixFSDP (``ours``), the runtime's own counters over that step."""
    state: dict[str, Any] = {"phase": "warmup", "tag": None}
    for x in data[:-1]:
        train_step(model, opt, x, state)
    calls: list[dict] = []
    stats = mf.comm_stats(model) if ours else None
    if stats is not None:
        stats.reset()
    dist.barrier()
    t0 = time.perf_counter()
    with recording(calls, state), \
            (tagging(model, state) if ours else contextlib.nullcontext()):
        train_step(model, opt, data[-1], state)
    r: dict[str, Any] = {"calls": calls, "step_wall_ms": (time.perf_counter() - t0) * 1e3}
    if stats is not None:
        r["comm_stats"] = stats.summary()
    return r


# ---- running the grids ------------------------------------------------------------------------
def _grid_rank(args: tuple) -> None:
    measure, cfg, a, b, path = args
    res = measure(cfg, a, b)
    if dist.get_rank() == 0:
        res["machine"] = machine_info()  # as a rank sees it (its threads)
        Path(path).write_text(json.dumps(res))


def parse_grids(parser: argparse.ArgumentParser, text: str, dims: tuple[str, str]) -> list[tuple[int, int]]:
    """``--grids``: a comma list of ``AxB`` grids, each size >= 2 (``dims`` names A and B in
    the messages); a bad one is the parser's error."""
    grids = []
    for item in (g for g in text.split(",") if g.strip()):
        try:
            a, b = (int(v) for v in item.lower().split("x"))
        except ValueError:
            parser.error(f"--grids: expected {dims[0]}x{dims[1]} (e.g. 2x2), got {item!r}")
        if a < 2 or b < 2:
            parser.error(f"--grids: {dims[0]} and {dims[1]} must be >= 2, got {item!r}")
        grids.append((a, b))
    if not grids:
        parser.error("--grids: no grid")
    return grids


def run_grids(name: str, cfg: Any, measure: Callable, render: Callable[[dict], str],
              method: str | None, label: Callable[[int, int], str]) -> int:
    """Run ``measure(cfg, a, b)`` on ``a * b`` local ranks for every grid ``(a, b)`` of
    ``cfg.grids``; write ``<name>.json`` (everything) and ``<name>.md`` (``render``'s
    tables) into ``cfg.out`` and print the tables. ``measure`` is a module-level function
    (the ranks unpickle it)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    grids = []
    for a, b in cfg.grids:
        path = out / f".grid_{a}x{b}.json"
        print(f"[bench --{name}] {label(a, b)} ...", flush=True)
        launch(_grid_rank, (measure, cfg, a, b, str(path)), a * b, timeout_s=cfg.timeout)
        grids.append(json.loads(path.read_text()))
        path.unlink()
    results = {"config": asdict(cfg), "torch": torch.__version__, "machine": grids[0]["machine"],
               "wall_s": time.perf_counter() - t0, "method": method, "grids": grids}
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    md = render(results)
    (out / f"{name}.md").write_text(md)
    print(md)
    print(f"total wall time {results['wall_s']:.1f} s; results in {out}")
    return 0
