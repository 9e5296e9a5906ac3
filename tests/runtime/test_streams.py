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
* the parameters are bit-identical to the run without streams."""

from __future__ import annotations

import contextlib

import torch
from helpers.rank_pool import spawn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.runtime import collectives, root
from matrixfsdp.runtime.streams import Streams
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


def _train(mesh, device: _Device | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.layers:
        mf.fully_shard(block, mesh=mesh)
    mf.fully_shard(model, mesh=mesh)
    opt = mf.Muon(mf.muon_param_groups(model, lr=0.02, adamw_lr=1e-3))
    g = torch.Generator().manual_seed(mesh.get_rank())
    for step in range(2):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
        if device is not None:  # the second, steady step (the first one also sets up)
            device.recording = step == 1
        model.loss(x, x).backward()
        opt.step()
        opt.zero_grad()
    if device is not None:
        device.recording = False
    return mf.full_state_dict(model)


def _worker(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    plain = _train(mesh, None)
    device = _Device()
    issue, wait = collectives.Comm._issue, collectives.Pending.wait

    def issued(comm, kind, *args, **kwargs):
        if device.recording:
            device.log.append(("issue", device.now.name, comm.prefix + kind))
        return issue(comm, kind, *args, **kwargs)

    def waited(pending):
        if pending.label and device.recording:
            device.log.append(("wait", device.now.name, pending.label))
        return wait(pending)
    made = root.Streams
    root.Streams = lambda dev: Streams(dev, module=device)
    collectives.Comm._issue, collectives.Pending.wait = issued, waited
    try:
        ours = _train(mesh, device)
    finally:
        root.Streams = made
        collectives.Comm._issue, collectives.Pending.wait = issue, wait
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


def test_communication_waits_on_the_side_stream_and_compute_waits_only_by_event():
    spawn(_worker, 4)
