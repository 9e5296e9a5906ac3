"""The set-up checks' failure paths on 4 real gloo ranks: when the digests differ, each check
still names the first item, parameter or rank that differs, with every rank's value, as the
gather of every rank's description did (the success path, one small all-reduce, is what
tests/runtime/test_16384_ranks.py measures at 16384 ranks)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from helpers.rank_pool import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from matrixfsdp.diagnosis.agree import check_same_setup
from matrixfsdp.runtime.checks import agree_on_local_checks, agree_on_matrix_coverage, check_same_init
from matrixfsdp.train.nonfinite import clip_and_check

TAIL = ". Every rank must build the same model and optimizer"
OPT = "matrix optimizer SGD (on matrix_params) "


def _message(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
        return "no error"
    except (ValueError, RuntimeError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"


def _setups(rank: int) -> dict[str, list]:
    """Per case, this rank's items (4 ranks)."""
    base = [("a", 1), ("b", (2, 3)), ("c", "x")]
    return {
        "agree": base,
        "values": base[:2] + [("c", "x" if rank < 2 else "y")],
        "first in order": [("a", 9 if rank == 3 else 1), ("b", (2, 4) if rank == 1 else (2, 3)), base[2]],
        "equal under ==": [("a", 1.0 if rank % 2 else 1)] + base[1:],
        "missing": [i for i in base if not (rank == 2 and i[0] == "b")],
        "extra": base + ([("z", 5)] if rank == 3 else []),
        "optional alike": ([(OPT + "lr", 0.1)] if rank >= 2 else []) + base,
        "optional differ": ([(OPT + "lr", 0.1 * (rank - 1))] if rank >= 2 else []) + base,
        # rank 0 holds none; "A" is alike where held (settled), "B" differs
        "optional settled": {0: [], 1: [(OPT + "A", 1)], 2: [(OPT + "A", 1), (OPT + "B", 2)],
                             3: [(OPT + "B", 3)]}[rank] + base,
    }


def _setup_worker(rank, world, out):
    found = {case: _message(check_same_setup, items, None, "the thing")
             for case, items in _setups(rank).items()}
    flags = check_same_setup(_setups(rank)["equal under =="], None, "the thing", any_of=[rank == 2, 0])
    found["flags"] = flags
    with open(os.path.join(out, f"setup{rank}.json"), "w") as f:
        json.dump(found, f)


def test_a_differing_set_up_is_named_as_before(tmp_path):
    """Each rank's first differing item, the first over all ranks picked, only its values
    moved: the messages of the gather of every rank's items (before), on every rank."""
    spawn(_setup_worker, 4, str(tmp_path))
    ranks = [json.loads((tmp_path / f"setup{r}.json").read_text()) for r in range(4)]
    lacks = " (this rank lacks it)"
    expect = {
        "agree": "no error",
        "equal under ==": "no error",  # 1 and 1.0: another digest, equal under ==
        "optional alike": "no error",  # compared among the ranks that hold it only
        "optional settled": [f"ValueError: matrixfsdp: ranks set up the thing differently: {OPT}B: (missing) "
                             f"on ranks 0, 1; 2 on rank 2; 3 on rank 3{TAIL}" + (lacks if r < 2 else "")
                             for r in range(4)],
        "values": "ValueError: matrixfsdp: ranks set up the thing differently: c: x on ranks 0, 1; y on "
                  f"ranks 2, 3{TAIL}",
        "first in order": "ValueError: matrixfsdp: ranks set up the thing differently: a: 1 on ranks 0, "
                          f"1, 2; 9 on rank 3{TAIL}",
        "missing": [f"ValueError: matrixfsdp: ranks set up the thing differently: b: (2, 3) on ranks 0, 1, "
                    f"3; (missing) on rank 2{TAIL}" + (lacks if r == 2 else "") for r in range(4)],
        "extra": [f"ValueError: matrixfsdp: ranks set up the thing differently: z: (missing) on ranks 0, 1, "
                  f"2; 5 on rank 3{TAIL}" + (lacks if r < 3 else "") for r in range(4)],
        "optional differ": [f"ValueError: matrixfsdp: ranks set up the thing differently: {OPT}lr: (missing) "
                            f"on ranks 0, 1; 0.1 on rank 2; 0.2 on rank 3{TAIL}" + (lacks if r < 2 else "")
                            for r in range(4)],
    }
    for case, text in expect.items():
        for r in range(4):
            want = text[r] if isinstance(text, list) else text
            assert ranks[r][case] == want, (case, r, ranks[r][case])
    assert all(found["flags"] == [1, 0] for found in ranks)  # reduced in the same all-reduce


def _params(rank: int, differ: dict[int, list[int]], extra: bool = False) -> list:
    """Three parameters, alike on every rank except parameter i on the ranks differ[i]."""
    out = []
    for i, shape in enumerate([(4, 3), (5,), (2, 2)] + ([(3,)] if extra else [])):
        t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + i
        out.append((f"p{i}", nn.Parameter(t + (rank in differ.get(i, [])))))
    return out


def _init_worker(rank, world, out):
    found = {
        "alike": check_same_init(_params(rank, {})),
        "first": _message(check_same_init, _params(rank, {1: [1, 3], 2: [2]})),
        "later": _message(check_same_init, _params(rank, {2: [2]})),
        "count": _message(check_same_init, _params(rank, {}, extra=rank == 3)),
    }
    odd = dist.new_group([1, 3])  # group ranks 0 and 1: the message numbers ranks by the group
    if rank in (1, 3):
        found["group"] = _message(check_same_init, _params(rank, {0: [3]}), odd)
    synced = _params(rank, {0: [1, 2, 3]})
    check_same_init(synced, sync=True)
    found["synced"] = check_same_init(synced)
    with open(os.path.join(out, f"init{rank}.json"), "w") as f:
        json.dump(found, f)


def test_check_same_init_names_the_first_parameter_and_its_ranks(tmp_path):
    spawn(_init_worker, 4, str(tmp_path))
    ranks = [json.loads((tmp_path / f"init{r}.json").read_text()) for r in range(4)]
    assert all(r == {k: v for k, v in ranks[0].items() if k != "group"} | ({"group": r["group"]}
                                                                         if "group" in r else {})
               for r in ranks)
    found = ranks[0]
    assert found["alike"] == 3 and found["synced"] == 3
    assert found["first"].startswith("ValueError: matrixfsdp: parameter 'p1' differs between ranks at "
                                     "set-up (ranks [1, 3] hold other initial values than rank 0)")
    assert found["later"].startswith("ValueError: matrixfsdp: parameter 'p2' differs between ranks at "
                                     "set-up (ranks [2] hold")
    assert found["count"] == ("ValueError: matrixfsdp: ranks hold different numbers of parameters at set-up "
                              "(rank 0: 3, rank 1: 3, rank 2: 3, rank 3: 4); every rank must build the "
                              "same model")
    assert ranks[1]["group"] == ranks[3]["group"]
    assert ranks[1]["group"].startswith("ValueError: matrixfsdp: parameter 'p0' differs between ranks at "
                                        "set-up (ranks [1] hold")


def _local_worker(rank, world, out):
    square = init_device_mesh("cpu", (2, 2))
    line = init_device_mesh("cpu", (4,))
    problems = {
        "none": (line, None),
        "rank 3 of a line": (line, TypeError("three") if rank == 3 else None),
        # ranks 2 and 3 (the second row): the lowest is named, hop by hop along the mesh dims
        "ranks 2, 3 of a square": (square, {2: ValueError("two"), 3: TypeError("three")}.get(rank)),
        "rank 1 of a square": (square, NotImplementedError("one") if rank == 1 else None),
    }
    found = {case: _message(agree_on_local_checks, problem, mesh)
             for case, (mesh, problem) in problems.items()}
    with open(os.path.join(out, f"local{rank}.json"), "w") as f:
        json.dump(found, f)


def test_a_local_problem_is_raised_on_every_rank_of_the_mesh(tmp_path):
    spawn(_local_worker, 4, str(tmp_path))
    ranks = [json.loads((tmp_path / f"local{r}.json").read_text()) for r in range(4)]
    assert all(r == ranks[0] for r in ranks), ranks
    tail = "every rank of it raises this)"
    assert ranks[0] == {
        "none": "no error",
        "rank 3 of a line": f"TypeError: three (found on rank 3 of the mesh [0, 1, 2, 3]; {tail}",
        "ranks 2, 3 of a square": f"ValueError: two (found on rank 2 of the mesh [[0, 1], [2, 3]]; {tail}",
        "rank 1 of a square": "NotImplementedError: one (found on rank 1 of the mesh [[0, 1], [2, 3]]; "
                              + tail,
    }


def _coverage_worker(rank, world, out):
    owned = {0: ([], True), 1: ([("a", (2, 2)), ("b", (3, 3))], False), 2: ([], False),
             3: ([("c", (4, 4))], False)}
    found = {
        "idle while rank 0 steps": _message(agree_on_matrix_coverage, owned[rank], None),
        "nobody steps": _message(agree_on_matrix_coverage, (owned[rank][0], False), None),
        "everyone steps": _message(agree_on_matrix_coverage, (owned[rank][0], True), None),
    }
    with open(os.path.join(out, f"coverage{rank}.json"), "w") as f:
        json.dump(found, f)


def test_ranks_that_step_none_of_their_matrices_are_named(tmp_path):
    spawn(_coverage_worker, 4, str(tmp_path))
    ranks = [json.loads((tmp_path / f"coverage{r}.json").read_text()) for r in range(4)]
    assert all(r == ranks[0] for r in ranks), ranks
    assert ranks[0]["nobody steps"] == ranks[0]["everyone steps"] == "no error"
    assert ranks[0]["idle while rank 0 steps"].startswith(
        "RuntimeError: matrixfsdp: ranks 1, 3 own Muon matrices that no optimizer stepped (2 on rank 1: "
        "'a' (2, 2), 'b' (3, 3)), while rank 0 step theirs: ")


def _nonfinite_worker(rank, world, out):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    loss = model(torch.ones(1, 3)).sum()
    loss.backward()
    bad = clip_and_check(model, None, False, loss * (math.inf if rank in (1, 3) else 1.0))
    good = clip_and_check(model, None, False, loss)
    with open(os.path.join(out, f"nonfinite{rank}.json"), "w") as f:
        json.dump({"bad": bad.nonfinite.loss_ranks, "sum": good.loss_sum, "loss": loss.item(),
                   "good": good.nonfinite is None}, f)


@pytest.mark.parametrize("world", [4])
def test_the_step_check_sums_the_loss_and_names_nonfinite_ranks(tmp_path, world):
    """One all-reduce per step: the loss summed over the ranks; where one is not finite,
    the ranks whose loss is not are named."""
    spawn(_nonfinite_worker, world, str(tmp_path))
    ranks = [json.loads((tmp_path / f"nonfinite{r}.json").read_text()) for r in range(world)]
    for found in ranks:
        assert found["bad"] == [1, 3] and found["good"]
        assert found["sum"] == pytest.approx(world * found["loss"], rel=1e-6)
