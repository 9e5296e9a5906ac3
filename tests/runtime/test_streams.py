"""Communication off the compute stream (``runtime/streams.py``), its order checked on CPU
with a stand-in device module that records every stream's waits and events and the stream
each collective is issued and waited on (CPU has no streams: the library's own path is a
no-op there, and this stand-in runs the stream path on gloo, whose ``wait()`` blocks the
host; the order is what a GPU would see). On 4 gloo ranks, HSDP 2 x 2, two steps of a GPT:

* the gathers, the replicas' broadcasts they wait for and HSDP's replicate-dim reduces
  are issued from the side stream, and their waits stall the side stream, never compute;
* the shard group's reduces are issued on the compute stream (after the gradients) and
  chained at once on the side stream: their follow-ups start as soon as they are done;
* the compute stream waits only by event (``wait_event``), at a unit's ``unshard`` and where
  the schedule finishes a reduce, never for the whole side stream, and each event it
  waits for was recorded on the side stream;
* the parameters are bit-identical to the run without streams.

The same on 8 ranks, HSDP 2 x 2 x tp 2 (``tp_ownership="rank"``: the gradients' tp hop
between the shard group's reduce and the replicate-dim reduce): the hop and the
replicate-dim reduce after it are issued from the side stream too, each chained there."""

from __future__ import annotations

import contextlib

import torch
from helpers.rank_pool import spawn
from helpers.tp_models import apply_tp, build_llama
from helpers.tp_training import PER, tp_data
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime import collectives, root
from matrixfsdp.runtime.streams import Ready, Streams
from matrixfsdp.train.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=3, d_mlp=64, seq_len=8)


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait_event", self.name, event.name))


class _Event:
    count = 0

    def __init__(self, log: list):
        self.log, self.name = log, None

    def record(self, stream: _Stream) -> None:
        _Event.count += 1
        self.name = f"e{_Event.count}"
        self.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return True


class _Device:
    """A device module's stream API (``torch.cuda``'s names), recording."""

    def __init__(self):
        self.log: list = []
        self.now = _Stream("compute", self.log)
        self.recording = False

    def Stream(self, device=None) -> _Stream:  # noqa: N802 (torch.cuda.Stream)
        return _Stream("side", self.log)

    def Event(self) -> _Event:  # noqa: N802
        return _Event(self.log)

    def current_stream(self) -> _Stream:
        return self.now

    @contextlib.contextmanager
    def stream(self, s: _Stream):
        before, self.now = self.now, s
        try:
            yield
        finally:
            self.now = before


def _gpt(mesh):
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(mesh.get_rank())
    data = [torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g) for _ in range(2)]
    return model, [(x, x) for x in data]


def _tp_llama(mesh):
    dp = mesh["replicate", "shard"]
    model = apply_tp(build_llama(), mesh["tp"], True)
    for block in model.layers:
        mf.fully_shard(block, mesh=dp)
    mf.fully_shard(model, mesh=dp, tp_ownership="rank")
    rank = dp._flatten().get_local_rank()
    return model, [(x[rank * PER:(rank + 1) * PER, :-1], x[rank * PER:(rank + 1) * PER, 1:])
                   for x in tp_data(4)[:2]]


def _train(mesh, build, device: _Device | None) -> dict[str, torch.Tensor]:
    model, data = build(mesh)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=1e-3))
    for step, (x, y) in enumerate(data):
        if device is not None:  # the second, steady step (the first one also sets up)
            device.recording = step == 1
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    if device is not None:
        device.recording = False
    return mf.full_state_dict(model)


def _worker(rank, world):
    shape, build = ((2, 2), _gpt) if world == 4 else ((2, 2, 2), _tp_llama)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp")[:len(shape)])
    plain = _train(mesh, build, None)
    device = _Device()
    issue, wait = collectives.Comm._issue, collectives.Pending.wait
    all_to_all = collectives.Comm.all_to_all  # tensor parallelism's, which counts itself

    def issued(comm, kind, *args, **kwargs):
        if device.recording:
            device.log.append(("issue", device.now.name, comm.prefix + kind))
        return issue(comm, kind, *args, **kwargs)

    def issued_all_to_all(comm, *args, **kwargs):
        if device.recording:
            device.log.append(("issue", device.now.name, comm.prefix + "all_to_all"))
        return all_to_all(comm, *args, **kwargs)

    def waited(pending):  # a collective's own wait (not a chain's event, which stands in for it)
        if pending.label and device.recording and not isinstance(pending._work, Ready):
            device.log.append(("wait", device.now.name, pending.label))
        return wait(pending)
    made = root.Streams
    root.Streams = lambda dev: Streams(dev, module=device)
    collectives.Comm._issue, collectives.Pending.wait = issued, waited
    collectives.Comm.all_to_all = issued_all_to_all
    try:
        ours = _train(mesh, build, device)
    finally:
        root.Streams = made
        collectives.Comm._issue, collectives.Pending.wait = issue, wait
        collectives.Comm.all_to_all = all_to_all
    assert all(torch.equal(plain[k], ours[k]) for k in plain)  # the same numbers
    log = device.log
    on = {}
    for kind, stream, what in log:
        on.setdefault((kind, what), set()).add(stream)
    for what in ("all_gather", "broadcast", "replicate_reduce", "replicate_all_reduce",
                 "replicate_broadcast"):
        assert on.get(("issue", what), {"side"}) == {"side"}, (what, on.get(("issue", what)))
    shard_reduces = [w for w in ("reduce", "reduce_scatter") if ("issue", w) in on]
    assert shard_reduces, on.keys()
    for what in shard_reduces:
        assert on[("issue", what)] == {"compute"}, (what, on[("issue", what)])
        assert on[("wait", what)] == {"side"}, (what, on[("wait", what)])
    assert on[("wait", "replicate_broadcast")] == {"side"}, on[("wait", "replicate_broadcast")]
    assert ("issue", "replicate_reduce") in on or ("issue", "replicate_all_reduce") in on
    assert not [e for e in log if e[0] == "wait_stream" and e[1] == "compute"], "waited for all of side"
    recorded = {e[2] for e in log if e[0] == "record" and e[1] == "side"}
    compute_waits = [e[2] for e in log if e[0] == "wait_event" and e[1] == "compute"]
    assert compute_waits and set(compute_waits) <= recorded
    side_waits = [e for e in log if e[0] == "wait_stream" and e[1] == "side"]
    assert side_waits and all(e[2] == "compute" for e in side_waits)
    if world == 8:  # the gradients' hop, then the replicate-dim reduce: both from the side stream
        hops = [w for w in on if w[0] == "issue" and w[1].startswith("tp_grad_")]
        assert hops and all(on[w] == {"side"} for w in hops), {w: on[w] for w in hops}
        assert all(on.get(("wait", w[1]), {"side"}) == {"side"} for w in hops)
        reps = [w for w in on if w[0] == "issue" and w[1].startswith("replicate_")]
        assert reps and all(on[w] == {"side"} for w in reps), {w: on[w] for w in reps}


def test_communication_waits_on_the_side_stream_and_compute_waits_only_by_event():
    spawn(_worker, 4)


def test_under_tensor_parallelism_the_hop_and_the_replicate_reduce_chain_on_the_side_stream():
    spawn(_worker, 8)
