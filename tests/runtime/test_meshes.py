"""The meshes torchtitan's ``ParallelDims`` builds, read right by ``fully_shard``.

torchtitan 0.2.0 (``_build_mesh_without_ep`` / ``_with_ep``) calls ``init_device_mesh``
over ``(pp, dp_replicate, dp_shard, cp, tp)`` (size-1 dims dropped, except
``dp_shard_mod_ep`` under EP) and flattens ``dp``, ``dp_shard_cp``, ``dp_cp`` (and ``ep``);
blocks get ``mesh["dp_shard_cp"]``, or ``mesh["dp_replicate", "dp_shard_cp"]`` for HSDP;
experts ``mesh["dp_shard_mod_ep"]``. torchtitan 0.2.1 to 0.3.0 (``partial_dtensor``)
unflatten a 1-D ``("world",)`` mesh into ``(pp, dp_replicate, fsdp, tp)`` with every dim
kept, size-1 ones on the ``fake`` backend, and pass ``dense["fsdp"]`` or
``dense["dp_replicate", "fsdp"]``. Users also build the 0.3 shapes with
``init_device_mesh`` directly, size-1 dims kept.

Each accepted layout trains GPT 3 steps with ``mf.fully_shard`` + ``mf.Muon`` (fp32 NS)
and is compared with ``torch.optim.Muon`` + ``AdamW`` on one process (PARITY_TOL); each
refused one (a data-parallel dim of size > 1 the mesh leaves out) must name that dim.
One 4-rank and one 8-rank spawn run them all.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from helpers.parity import ADAMW, MUON, ODD, muon_groups
from helpers.rank_pool import spawn
from helpers.reference import (
    PARITY_TOL,
    assert_params_close,
    batches,
    is_muon_name,
    rank_slice,
    train_reference,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.train.models import GPT, GPTConfig

STEPS, PER_RANK, SEQ = 3, 2, 16


def _init(dims: dict[str, int], flat: dict[str, tuple[str, ...]] | None = None):
    """``init_device_mesh`` over ``dims`` (in order), then each flattened dim of ``flat``."""
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    for name, of in (flat or {}).items():
        mesh[of]._flatten(name)
    return mesh


def _unflatten(dims: dict[str, int]):
    """torchtitan 0.3's ``unflatten_mesh``: the world mesh unflattened, size-1 dims but
    ``fsdp`` on the fake backend."""
    world = init_device_mesh("cpu", (torch.distributed.get_world_size(),),
                             mesh_dim_names=("world",))
    fake = {n: "fake" for n, s in dims.items() if s == 1 and n != "fsdp"}
    return world._unflatten(0, tuple(dims.values()), tuple(dims), backend_override=fake)


# name: (builder, its arguments, the dims of the mesh passed to fully_shard)
TRAIN4 = {
    "(pp=1, dp_replicate=1, fsdp=4, tp=1) init_device_mesh: mesh['fsdp']":
        (_init, (dict(pp=1, dp_replicate=1, fsdp=4, tp=1),), ("fsdp",)),
    "0.3 unflattened (pp=1, dp_replicate=1, fsdp=4, tp=1), fake size-1 dims: dense['fsdp']":
        (_unflatten, (dict(pp=1, dp_replicate=1, fsdp=4, tp=1),), ("fsdp",)),
    "0.3 unflattened (pp=1, dp_replicate=2, fsdp=2, tp=1): dense['dp_replicate', 'fsdp']":
        (_unflatten, (dict(pp=1, dp_replicate=2, fsdp=2, tp=1),), ("dp_replicate", "fsdp")),
    "0.2 (dp_replicate=2, dp_shard=2) + dp, dp_shard_cp, dp_cp: "
    "mesh['dp_replicate', 'dp_shard_cp']":
        (_init, (dict(dp_replicate=2, dp_shard=2),
                 dict(dp=("dp_replicate", "dp_shard"), dp_shard_cp=("dp_shard",),
                      dp_cp=("dp_replicate", "dp_shard"))), ("dp_replicate", "dp_shard_cp")),
    "(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1) + dp_shard_cp: mesh['dp_shard_cp']":
        (_init, (dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1),
                 dict(dp_shard_cp=("dp_shard", "cp"))), ("dp_shard_cp",)),
    "0.2 (dp_shard=2, cp=2) + dp_shard_cp, dp_cp: mesh['dp_shard_cp']":
        (_init, (dict(dp_shard=2, cp=2), dict(dp_shard_cp=("dp_shard", "cp"),
                                              dp_cp=("dp_shard", "cp"))), ("dp_shard_cp",)),
}
TRAIN8 = {  # two pipeline stages of 4 ranks, each trains the whole model (its own replica set)
    "(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=1) + dp_shard_cp: "
    "mesh['dp_replicate', 'dp_shard_cp'] per stage":
        (_init, (dict(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=1),
                 dict(dp_shard_cp=("dp_shard", "cp"))), ("dp_replicate", "dp_shard_cp")),
}
# name: (builder, arguments, mesh dims, the dims the error must name, or None: accepted)
CHECK4 = {
    "(pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=1): mesh['dp_shard']":
        (_init, (dict(pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=1),), ("dp_shard",),
         ["dp_replicate"]),
    "0.2 (dp_replicate=2, dp_shard=2) + dp_shard_cp: mesh['dp_shard_cp']":
        (_init, (dict(dp_replicate=2, dp_shard=2), dict(dp_shard_cp=("dp_shard",))),
         ("dp_shard_cp",), ["dp_replicate"]),
    "(dp_shard=2, cp=2): mesh['dp_shard']":
        (_init, (dict(dp_shard=2, cp=2),), ("dp_shard",), ["cp"]),
    "(dp_replicate=2, dp_shard=2): mesh['dp_replicate']":
        (_init, (dict(dp_replicate=2, dp_shard=2),), ("dp_replicate",), ["dp_shard"]),
    "(dp_replicate=2, dp_shard=1, cp=2): mesh['dp_replicate', 'dp_shard']":
        (_init, (dict(dp_replicate=2, dp_shard=1, cp=2),), ("dp_replicate", "dp_shard"), ["cp"]),
    "(pp=2, dp_shard=2): mesh['dp_shard']":
        (_init, (dict(pp=2, dp_shard=2),), ("dp_shard",), None),
    "(dp_shard=2, tp=2): mesh['dp_shard']":
        (_init, (dict(dp_shard=2, tp=2),), ("dp_shard",), None),
    "(dp_shard=2, ep=2): mesh['dp_shard']":
        (_init, (dict(dp_shard=2, ep=2),), ("dp_shard",), None),
    # torchtitan 0.2 with EP (ep=2 borrowing cp=2): the experts' mesh; cp is inside ep
    "0.2 EP (dp_shard_mod_ep=2, cp=2) + ep=(cp,): mesh['dp_shard_mod_ep']":
        (_init, (dict(dp_shard_mod_ep=2, cp=2), dict(dp_shard_cp=("dp_shard_mod_ep", "cp"),
                                                     ep=("cp",))), ("dp_shard_mod_ep",), None),
    "(dp_shard_mod_ep=2, cp=2), no ep dim: mesh['dp_shard_mod_ep']":
        (_init, (dict(dp_shard_mod_ep=2, cp=2),), ("dp_shard_mod_ep",), ["cp"]),
}


def _train(rank: int, build, args, dims) -> dict:
    mesh = build(*args)[dims]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**ODD))
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    with warnings.catch_warnings():  # a pipeline stage's mesh covers part of the world
        warnings.simplefilter("ignore")
        mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(muon_groups(model, MUON, ADAMW, torch.float32))
    data_rank = mf.get_root(model).groups.world_rank  # this rank's place in the mesh
    for x in batches(STEPS, mesh.size(), PER_RANK, SEQ):
        x = rank_slice(x, data_rank, PER_RANK, False)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return dict(params=mf.full_state_dict(model), size=mesh.size())


def _check(build, args, dims) -> str | None:
    mesh = build(*args)[dims]
    try:
        mf.fully_shard(nn.Linear(4, 4), mesh=mesh)
    except ValueError as e:
        mf.fully_shard(nn.Linear(4, 4), mesh=mesh, independent_replicas=True)  # the opt-out
        return str(e)
    return None


def _worker(rank, world, train, check, out_dir):
    with warnings.catch_warnings():  # torch: slicing a flattened dim from the root mesh
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        out = {name: _train(rank, *job) for name, job in train.items()}
        out.update({name: _check(*job[:3]) for name, job in check.items()})
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _spawned(tmp_path_factory, world, train, check):
    out = tmp_path_factory.mktemp(f"meshes{world}")
    spawn(_worker, world, train, check, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _spawned(tmp_path_factory, 4, TRAIN4, CHECK4)


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    return _spawned(tmp_path_factory, 8, TRAIN8, {})


@pytest.fixture(scope="module")
def reference():
    """torch on one process over the 4 data-parallel ranks' batches."""
    return train_reference(GPTConfig(**ODD), batches(STEPS, 4, PER_RANK, SEQ), muon_kw=MUON,
                           adamw_kw=ADAMW, ns_fp32=True, rule=is_muon_name)


@pytest.mark.parametrize("name", list(TRAIN4))
def test_torchtitan_layouts_train_as_one_process(name, four_ranks, reference):
    """Size-1 dims are one replica (before: (pp=1, dp_replicate=1, fsdp=4, tp=1)'s
    mesh['fsdp'] was refused), a flattened dim covers the dims it was made from, and the
    2-D (dp_replicate, dp_shard_cp) / (dp_replicate, fsdp) sub-meshes are HSDP."""
    assert four_ranks[0][name]["size"] == 4
    for r, res in enumerate(four_ranks):  # every rank holds the same model
        assert all(torch.equal(a, b) for a, b in zip(res[name]["params"].values(),
                                                     four_ranks[0][name]["params"].values())), r
    assert_params_close(four_ranks[0][name]["params"], reference, PARITY_TOL, what=f"{name}: ")


def test_pipeline_stages_each_train_as_one_process(eight_ranks, reference):
    """Each pp stage's (dp_replicate, dp_shard_cp) mesh covers 4 of the 8 ranks (HSDP over
    part of the world); pp is not a replica dim. Both stages equal one process."""
    for name, stage_rank in ((n, r) for n in TRAIN8 for r in (0, 4)):
        assert eight_ranks[stage_rank][name]["size"] == 4
        assert_params_close(eight_ranks[stage_rank][name]["params"], reference, PARITY_TOL,
                            what=f"{name}, stage of rank {stage_rank}: ")


@pytest.mark.parametrize("name", list(CHECK4))
def test_left_out_data_dims_are_named(name, four_ranks):
    """Refused exactly when a data-parallel dim of size > 1 (dp_replicate, dp_shard, cp) is
    left out, naming it and its size on every rank; pp, tp, ep and cp inside a flattened ep
    pass. independent_replicas=True accepts every refused one."""
    want = CHECK4[name][3]
    for r, res in enumerate(four_ranks):
        message = res[name]
        if want is None:
            assert message is None, (r, message)
            continue
        assert message is not None, f"rank {r}: accepted"
        assert f"over its {want} dim ({want[0]}=2) the replicas would train apart" in message, \
            message
        assert "independent_replicas=True" in message, message
        if want == ["dp_replicate"]:
            dims = CHECK4[name][2]
            assert f"pass the 2-D mesh mesh[{('dp_replicate', *dims)!r}]" in message, message
        if want == ["cp"]:
            assert "_flatten('dp_shard_cp')" in message, message
