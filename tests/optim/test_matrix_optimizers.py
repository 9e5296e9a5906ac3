"""Any per-matrix optimizer on mf.matrix_params (pytorch-optimizer's Shampoo, SOAP, NorMuon,
AdaMuon; heavyball's SOAP, compile off; torch's Muon and Adafactor), AdamW on
mf.shard_params, against the same optimizers on one process (never against our code):

* equal data on every rank: bit-identical at 1, 2 and 3 ranks;
* own data per rank: within 1e-6 of one process on the whole batch for the optimizers that
  are not sensitive to the gradient's summation order; the sensitive ones move by no more
  than one process moves when it splits the same batch into accumulated micro-batches;
* a non-element-wise optimizer on row shards is refused on every rank before anything moves;
* DCP at 3 ranks, loaded at 2 (Shampoo, SOAP): the run continues exactly.

One spawn per world size holds all optimizers (spawning is the expensive part)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.rank_pool import spawn
from helpers.reference import PARITY_TOL
from torch import nn

import matrixfsdp as mf
from matrixfsdp.runtime.param import sharded_param

po = pytest.importorskip("pytorch_optimizer")
hb = pytest.importorskip("heavyball")

D, H, BLOCKS, PER_RANK, STEPS = 8, 12, 2, 4, 4


def _heavyball_soap(ps):
    import heavyball.utils
    heavyball.utils.compile_mode = None  # compile off: eager kernels on both sides
    return hb.SOAP(ps, lr=3e-3, compile_step=False, precondition_frequency=2)


OPTIMIZERS = {
    "Shampoo": lambda ps: po.Shampoo(ps, lr=0.05, matrix_eps=1e-3),
    "SOAP": lambda ps: po.SOAP(ps, lr=3e-3, precondition_frequency=2),
    "heavyball SOAP": _heavyball_soap,
    "NorMuon": lambda ps: po.NorMuon([dict(params=ps, use_muon=True)], lr=0.02),
    "AdaMuon": lambda ps: po.AdaMuon([dict(params=ps, use_muon=True)], lr=0.02),
    "torch Muon": lambda ps: torch.optim.Muon(ps, lr=0.02),
    "torch Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
}
# Own data per rank: one process on the whole batch is matched within 1e-6 (fp32 rounding
# of a sum of P partial gradients, ~1e-7 relative, through 4 steps) by these. SOAP amplifies
# the summation order itself (see test_summation_order_sensitive), and so does Shampoo with
# a small matrix_eps (1e-6: rank-deficient preconditioners' inverse roots; 1e-3 here).
# AdaMuon is sensitive on some data and not on other: its Newton-Schulz runs in bf16, where a
# summation order that crosses a rounding boundary moves the result by ~1e-2 (seen at 2
# ranks with own data: exactly as far as one process moves splitting its batch in two).
ORDER_INSENSITIVE = ("Shampoo", "NorMuon", "torch Muon", "torch Adafactor")
DATA_DEPENDENT = ("AdaMuon",)
OWN_DATA_BOUND = 1e-6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _model(seed: int = 0, blocks: int = BLOCKS) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(blocks)], nn.Linear(D, 1))


def _data(world: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(world * PER_RANK, D, generator=g), torch.randn(world * PER_RANK, 1, generator=g))
            for _ in range(STEPS)]


def _is_matrix(name: str, p: torch.Tensor, blocks: int = BLOCKS) -> bool:  # the default plan's rule
    return p.dim() == 2 and not name.startswith(f"{blocks}.")


def _reference(make, batches, split: int = 1, steps: int = STEPS,
               blocks: int = BLOCKS) -> dict[str, torch.Tensor]:
    """One process: ``make`` on the matrices, AdamW on the rest; each batch's mean loss,
    optionally accumulated over ``split`` micro-batches."""
    model = _model(blocks=blocks)
    named = list(model.named_parameters())
    opts = [make([p for n, p in named if _is_matrix(n, p, blocks)]),
            torch.optim.AdamW([p for n, p in named if not _is_matrix(n, p, blocks)], lr=1e-2)]
    for x, y in batches[:steps]:
        for xs, ys in zip(x.chunk(split), y.chunk(split)):
            (nn.functional.mse_loss(model(xs), ys) / split).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded(world: int, blocks: int = BLOCKS):
    model = _model(blocks=blocks)
    for block in list(model)[:blocks]:
        mf.fully_shard(block)
    mf.fully_shard(model)
    return model


def _train(model, opts, batches, rank, same, steps):
    for x, y in batches[steps[0]:steps[1]]:
        i = 0 if same else rank
        xs, ys = x[i * PER_RANK:(i + 1) * PER_RANK], y[i * PER_RANK:(i + 1) * PER_RANK]
        nn.functional.mse_loss(model(xs), ys).backward()
        for o in opts:
            o.step()
            o.zero_grad()


def _max_diff(model, ref) -> float:
    full = mf.full_state_dict(model)
    return max((full[n] - ref[n]).abs().max().item() for n in ref)


def _optimizers(model, make):
    return [mf.matrix_optimizer(make, model), torch.optim.AdamW(mf.shard_params(model), lr=1e-2)]


def _parity(rank, world, out_dir):
    batches = _data(world)
    diffs = {}
    for name, make in OPTIMIZERS.items():
        for same in (True, False):
            ref = _reference(make, [(x[:PER_RANK], y[:PER_RANK]) for x, y in batches] if same else batches)
            model = _sharded(world)
            _train(model, _optimizers(model, make), batches, rank, same, (0, STEPS))
            diffs[f"{name}|{'equal' if same else 'own'}"] = _max_diff(model, ref)
        if rank == 0 and world > 1:  # one process splitting the batch into `world` micro-batches
            split = _reference(make, batches, world)
            diffs[f"{name}|split"] = max((split[n] - ref[n]).abs().max().item() for n in ref)
    if world == 2:
        _refusals(rank, world)
    if world == 3:
        _owner_of_nothing(rank, world)
        # Shampoo built by hand on matrix_params (no matrix_optimizer): the ranks' parameter
        # lists differ by design; own data per rank
        ref = _reference(OPTIMIZERS["Shampoo"], batches)
        model = _sharded(world)
        _train(model, _by_hand(model), batches, rank, False, (0, STEPS))
        diffs["by hand|own"] = _max_diff(model, ref)
    if rank == 0:
        with open(os.path.join(out_dir, f"parity{world}.json"), "w") as f:
            json.dump(diffs, f)


def _refusals(rank, world):
    """SOAP on every parameter (row shards too) is refused on every rank before the step
    moves anything; a user's own element-wise class is refused until registered."""
    model = _sharded(world)
    before = {n: t.clone() for n, t in mf.full_state_dict(model).items()}
    x = torch.randn(PER_RANK, D)
    model(x).sum().backward()
    my_sgd = type("MySGD", (torch.optim.SGD,), {})
    for opt in (po.SOAP(model.parameters()), my_sgd(model.parameters(), lr=0.1)):
        with pytest.raises(RuntimeError, match=r"not on matrixfsdp's element-wise allow-list.*"
                                               r"'0\.norm\.weight'.*matrix_params"):
            opt.step()
    after = mf.full_state_dict(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    mf.register_elementwise(type(opt))
    opt.step()  # allowed now


def _by_hand(model) -> list[torch.optim.Optimizer]:
    """Shampoo on ``mf.matrix_params`` built by hand (none on a rank owning no matrix), then
    AdamW on the row shards, stepped in that order."""
    mats = mf.matrix_params(model)
    return ([OPTIMIZERS["Shampoo"](mats)] if mats else []) + \
        [torch.optim.AdamW(mf.shard_params(model), lr=1e-2)]


def _step_all(model, opts) -> None:
    model(torch.randn(PER_RANK, D)).sum().backward()
    for o in opts:
        o.step()
        o.zero_grad()


def _owners_of_nothing_by_hand(rank, world, out_dir):
    """4 ranks, one block (2 matrices): two ranks own none and build no Shampoo. Training
    is exact: nothing issues a collective for Shampoo, and those ranks have nothing of it to
    step (its settings are compared among the ranks holding it, at AdamW's first step). A
    rank that owns a matrix and builds no Shampoo is refused on every rank."""
    batches = _data(world)
    model = _sharded(world, blocks=1)
    opts = _by_hand(model)
    counts = [None] * world
    dist.all_gather_object(counts, len(opts))
    assert sorted(counts) == [1, 1, 2, 2], counts
    _train(model, opts, batches, rank, False, (0, STEPS))
    ref = _reference(OPTIMIZERS["Shampoo"], batches, blocks=1)
    diff = _max_diff(model, ref)
    # settings still compared, among the ranks holding one: another lr on one owner is
    # refused on every rank at the first step of the AdamW after it
    model = _sharded(world, blocks=1)
    mats = mf.matrix_params(model)
    opts = ([po.Shampoo(mats, lr=0.05 + 0.01 * rank)] if mats else []) + \
        [torch.optim.AdamW(mf.shard_params(model), lr=1e-2)]
    model(torch.randn(PER_RANK, D)).sum().backward()
    with pytest.raises(ValueError, match=r"matrix optimizer Shampoo \(on matrix_params\) param group 0 lr"):
        for o in opts:
            o.step()
    # an owner that forgets its Shampoo: its matrices would never train. Refused on every
    # rank, naming it, at the next forward (when every optimizer of the step has stepped),
    # in either order; with the Shampoo first the AdamW's first step settles nothing alone
    for shampoo_first in (True, False):
        model = _sharded(world, blocks=1)
        owners = [None] * world
        dist.all_gather_object(owners, bool(mf.matrix_params(model)))
        forgetful = owners.index(True)
        opts = _by_hand(model)[(rank == forgetful):]
        _step_all(model, opts if shampoo_first else opts[::-1])
        refused = (rf"rank {forgetful} owns Muon matrices that no optimizer stepped "
                   r".*matrixfsdp\.matrix_optimizer\(cls, model")
        with pytest.raises(RuntimeError, match=refused):
            model(torch.randn(PER_RANK, D))
    # not refused: each matrix stepped by an optimizer of its own, one before the AdamW and
    # one after it (the AdamW's first step cannot settle it; the next forward does)
    model = _sharded(world, blocks=1)
    ups = [p for p in mf.matrix_params(model) if sharded_param(p).name.endswith("up.weight")]
    downs = [p for p in mf.matrix_params(model) if sharded_param(p).name.endswith("down.weight")]
    _step_all(model, ([torch.optim.SGD(ups, lr=0.1)] if ups else [])
              + [torch.optim.AdamW(mf.shard_params(model), lr=1e-2)]
              + ([torch.optim.SGD(downs, lr=0.1)] if downs else []))
    model(torch.randn(PER_RANK, D))
    if rank == 0:
        with open(os.path.join(out_dir, "nothing4.json"), "w") as f:
            json.dump(diff, f)


def _owner_of_nothing(rank, world):
    """One block (2 matrices) on 3 ranks: one rank owns none. matrix_optimizer gives it the
    same class on an empty placeholder; it steps, keeps the group counters of the others,
    and checkpoints with them."""
    model = _sharded(world, blocks=1)
    opts = _optimizers(model, OPTIMIZERS["SOAP"])
    owned = len(mf.matrix_params(model))
    counts = [None] * world
    dist.all_gather_object(counts, owned)
    assert sorted(counts) == [0, 1, 1], counts
    assert isinstance(opts[0], po.SOAP)
    for _ in range(2):
        model(torch.randn(PER_RANK, D)).sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    steps = [None] * world
    dist.all_gather_object(steps, opts[0].param_groups[0]["step"])
    assert steps == [2] * world, steps
    state = mf.get_state_dict(model, opts)
    assert len(state["optim"]["param_groups"]) == 2 and "params" not in state["optim"]["param_groups"][0]
    assert sum(n.endswith("weight") and n[0] == "0" and n.split(".")[1] in ("up", "down")
               for n in state["optim"]["state"]) == owned


def _dcp(rank, world, ckpt, out_dir):
    """Train 2 steps at world 3 and save; at world 2 load into fresh optimizers, train 2
    more and write the full parameters (equal data per rank: the world-2 steps are exact)."""
    batches = _data(3)
    for name in ("Shampoo", "SOAP", "Shampoo by hand"):
        model = _sharded(world)
        opts = _by_hand(model) if name.endswith("by hand") else _optimizers(model, OPTIMIZERS[name])
        path = os.path.join(ckpt, name)
        if world == 3:
            _train(model, opts, batches, rank, True, (0, 2))
            dcp.save(mf.get_state_dict(model, opts), checkpoint_id=path)
            continue
        state = mf.get_state_dict(model, opts)
        dcp.load(state, checkpoint_id=path)
        mf.set_state_dict(model, opts, state)
        _train(model, opts, batches, rank, True, (2, STEPS))
        full = mf.full_state_dict(model)
        if rank == 0:
            torch.save(full, os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()


def _copied(old, new):
    if isinstance(new, list):
        return [_copied(o, v) for o, v in zip(old, new)]
    if torch.is_tensor(new) and torch.is_tensor(old) and old.shape == new.shape:
        return old.copy_(new)
    return new


def _continue_from_checkpoint(name: str, path: str, tmp) -> dict[str, torch.Tensor]:
    """One process: the checkpoint as full tensors (torch's dcp_to_torch_save) into a plain
    model and plain optimizers, by name, then the last 2 steps on one rank's batches."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, tmp / f"{name}.full")
    ckpt = torch.load(tmp / f"{name}.full", weights_only=False)
    model = _model()
    model.load_state_dict(ckpt["model"])
    named = list(model.named_parameters())
    split = [[(n, p) for n, p in named if _is_matrix(n, p)],
             [(n, p) for n, p in named if not _is_matrix(n, p)]]
    opts = [OPTIMIZERS[name.removesuffix(" by hand")]([p for _, p in split[0]]),
            torch.optim.AdamW([p for _, p in split[1]], lr=1e-2)]
    for opt, group, members in zip(opts, ckpt["optim"]["param_groups"], split):
        # as torch's get_state_dict + dcp.load would: state made by a step with zero grads
        # and lr 0 (eigh's column-major Q included: layouts change BLAS rounding), then the
        # checkpoint's values copied into it
        lr = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = 0.0
        for _, p in members:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        opt.param_groups[0].update({k: v for k, v in group.items() if k != "params"}, lr=group.get("lr", lr))
        for n, p in members:
            saved = ckpt["optim"]["state"][n]
            opt.state[p] = {k: _copied(opt.state[p].get(k), v) for k, v in saved.items()}
    torch.set_num_threads(1)
    for x, y in _data(3)[2:STEPS]:
        nn.functional.mse_loss(model(x[:PER_RANK]), y[:PER_RANK]).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_matrix_optimizers_on_owners(world, tmp_path):
    spawn(_parity, world, str(tmp_path), timeout=600)
    diffs = json.loads((tmp_path / f"parity{world}.json").read_text())
    print(f"world {world}:", diffs)
    if world == 3:  # built by hand (no aligned gradients): measured 2.7e-7, own data
        assert diffs.pop("by hand|own") <= PARITY_TOL, diffs
    for key, d in diffs.items():
        name, data = key.split("|")
        if world in (1, 2) and data != "split":  # 1 process; equal data: (g + g) / 2 == g
            assert d == 0.0 if (data == "equal" or world == 1) else True, (key, d)
        if data == "split" or (world == 2 and data == "equal") or world == 1:
            continue
        # own data, or equal data at 3 ranks ((g + g + g) / 3 rounds in fp32)
        if name in ORDER_INSENSITIVE:
            assert d <= OWN_DATA_BOUND, (key, d)
        else:  # as far as one process's own micro-batch split moves it
            assert d <= 10 * diffs[f"{name}|split"], (key, d, diffs[f"{name}|split"])


def test_summation_order_sensitive():
    """One process, no MatrixFSDP: splitting each batch into 2 or 3 accumulated
    micro-batches moves the order-sensitive optimizers by about what own data per rank
    moves them (pinned in docs/optimizers.md), the insensitive ones by < 1e-6."""
    torch.set_num_threads(1)
    batches = _data(3)
    for name, make in OPTIMIZERS.items():
        whole = _reference(make, batches)
        moved = max(max((a - whole[n]).abs().max().item() for n, a in _reference(make, batches, s).items())
                    for s in (2, 3))
        print(name, moved)
        if name in ORDER_INSENSITIVE:
            assert moved <= OWN_DATA_BOUND, (name, moved)
        elif name not in DATA_DEPENDENT:
            assert moved > OWN_DATA_BOUND, (name, moved)


def test_dcp_save_at_3_load_at_2(tmp_path):
    spawn(_dcp, 3, str(tmp_path / "ckpt"), str(tmp_path), timeout=600)
    spawn(_dcp, 2, str(tmp_path / "ckpt"), str(tmp_path), timeout=600)
    for name in ("Shampoo", "SOAP", "Shampoo by hand"):
        ours = torch.load(tmp_path / f"{name}.pt")
        ref = _continue_from_checkpoint(name, str(tmp_path / "ckpt" / name), tmp_path)
        diff = max((ours[n] - ref[n]).abs().max().item() for n in ref)
        print(name, diff)
        # by hand: without matrix_optimizer's aligned gradients BLAS may round otherwise
        assert diff <= (PARITY_TOL if name.endswith("by hand") else 0.0), (name, diff)


def test_shampoo_by_hand_where_two_ranks_own_nothing(tmp_path):
    """4 ranks, one block: the two ranks owning no matrix build no Shampoo. Trains within
    PARITY_TOL of one process (Shampoo on the matrices, AdamW on the rest), no hang."""
    spawn(_owners_of_nothing_by_hand, 4, str(tmp_path), timeout=120)
    diff = json.loads((tmp_path / "nothing4.json").read_text())
    print("4 ranks, two own nothing:", diff)
    assert diff <= PARITY_TOL, diff


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 5))
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        return self.fc(x)


def test_matrix_params_refuses_expert_stacks(world1):
    """An expert stack is split by experts over ranks: a matrix optimizer would treat this
    rank's slice as one tensor, so matrix_params names it instead of returning it."""
    model = nn.Sequential(_Experts())
    mf.fully_shard(model[0])
    mf.fully_shard(model)
    with pytest.raises(ValueError, match=r"'0\.w' \(3, 4, 5\) is an expert stack"):
        mf.matrix_params(model)
    assert [p.shape for p in mf.shard_params(model)] == [torch.Size([5])]  # fc.bias; fc.weight is a matrix


def test_heavyball_checkpoint_is_refused_at_save(world1, tmp_path):
    """heavyball's optimizers step exactly but their state does not load back (a resumed
    step fails inside heavyball): ``mf.get_state_dict`` refuses them before anything is
    written, in words, whether on the owners' matrices or, declared element-wise, on the
    row shards; the model alone still saves."""
    model = _sharded(1)
    matrices = mf.matrix_optimizer(_heavyball_soap, model)
    mf.register_elementwise(hb.AdamW)
    rest = hb.AdamW(mf.shard_params(model), lr=1e-2, compile_step=False)
    x, y = _data(1)[0]
    nn.functional.mse_loss(model(x[:PER_RANK]), y[:PER_RANK]).backward()
    for opt in (matrices, rest):
        opt.step()
    for opts, name in (([matrices, torch.optim.AdamW(mf.shard_params(model))], "SOAP"), (rest, "AdamW")):
        with pytest.raises(ValueError, match=rf"heavyball's {name} cannot be checkpointed: its state "
                                             "does not load back"):
            mf.get_state_dict(model, opts)
    dcp.save(mf.get_state_dict(model), checkpoint_id=str(tmp_path))


@pytest.mark.parametrize("name", ["PSGDKron", "PSGDPRO", "Muon", "Scion", "SOAP"])
def test_heavyball_refusal_claims_no_exactness_it_lacks(name):
    """The refusal at save names the optimizer and claims nothing false of its steps:
    heavyball's PSGDKron, PSGDPRO, Muon and Scion differ from one process (by 5e-3 to 0.73
    with equal data: docs/optimizers.md), so the message says which of them do not match one
    process instead of "Its steps are exact"."""
    from matrixfsdp.state.optim_state_dict import refuse_unloadable

    cls = type(name, (torch.optim.SGD,), {"__module__": "heavyball.chainable"})
    with pytest.raises(ValueError) as refused:
        refuse_unloadable(cls([nn.Parameter(torch.zeros(2))], lr=0.1))
    text = str(refused.value)
    assert f"heavyball's {name} cannot be checkpointed: its state does not load back" in text
    assert "steps are exact" not in text
    assert "its PSGD (Kron, PRO), Muon and Scion do not" in text, text
