"""The failure and debug paths at 16384 ranks, in one process: what a rank reads from the
store after a timeout, what a debug-mode check moves, and what the asynchronous save's
group costs to make do not grow with P (measured against P = 64).

- A timeout: every rank but the first to fail at that point reads three store keys (the
  claim, the wait for the finding, the finding), at 64 ranks and at 16384 (before: two
  reads per peer, 32766 a rank at 16384); the first reads every post once, in batches, and
  all of them name the silent rank alone.
- Debug mode: a check hands 80 bytes to one all-reduce at 64 ranks and at 16384 (before: an
  all-gather of P x 5 int64s, 655 KiB received per check at 16384), and writes nothing to the
  store when its wait is quick (before: one write per check and rank).
- The asynchronous save's gloo group over 16384 ranks is made with one store write and no
  connection (before: gloo's full mesh, 16383 connections and store reads a rank; in one
  process that waits for peers that never come).

(b) and (c) need a process group of 16384 ranks: torch's fake backend, in a fresh
interpreter (the test process may hold a real one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from matrixfsdp.diagnosis import arrival


class Counting:
    """One rank's view of a shared store, counting its requests (``reads``: every request
    that asks the store something; ``writes``: ``set``)."""

    def __init__(self, inner):
        self.inner, self.reads, self.writes = inner, 0, 0

    def set(self, key, value):
        self.writes += 1
        self.inner.set(key, value)

    def get(self, key):
        self.reads += 1
        return self.inner.get(key)

    def check(self, keys):
        self.reads += 1
        return self.inner.check(keys)

    def multi_get(self, keys):
        self.reads += 1
        return self.inner.multi_get(keys)

    def compare_set(self, key, expected, desired):
        self.reads += 1
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout):
        self.reads += 1
        return self.inner.wait(keys, timeout)


def _rank_view(me: int, world: int, store) -> arrival._Group:
    """Rank ``me``'s watched group of ``world`` ranks, as after completing point 31."""
    g = object.__new__(arrival._Group)
    g.count, g.ranks, g.watched, g.name = 32, list(range(world)), True, "world"
    g.me, g.timeout, g.slow, g.store = me, 5.0, timedelta(0), store
    g.last = {"index": 31, "kind": "all_gather", "step": 5, "phase": "forward and backward", "local": False}
    return g


@pytest.mark.parametrize("world", [64, 16384])
def test_a_timeout_reads_o1_store_keys_on_every_rank_but_one(world):
    """Every rank but rank 5 waits at the all_gather #32; rank 5 never posted. Rank 0 fails
    first and collects; rank P-1 reads its finding: three requests at 64 ranks and at
    16384. Both name rank 5 alone, where it was last seen, and the rest as arrived."""
    shared = dist.HashStore()
    post = json.dumps({"index": 32, "kind": "all_gather", "state": "waiting", "since": time.time() - 4,
                       "step": 6, "phase": "forward and backward", "local": False})
    for r in range(world):
        if r != 5:
            shared.set(f"matrixfsdp-wait/world/{r}", post)
    exc = RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    found = {}
    for me in (0, world - 1):
        store = Counting(shared)
        g = _rank_view(me, world, store)
        t = time.monotonic()
        e = arrival.failure(g, 32, f"the all_gather #32 on ranks 0-{world - 1}", t - 5.0,
                            (6, "forward and backward"), exc)
        found[me] = (e, store.reads, time.monotonic() - t)
    (first, first_reads, first_s), (other, reads, _) = found[0], found[world - 1]
    for e, me in ((first, 0), (other, world - 1)):
        assert e.missing == [5], str(e)
        text = str(e)
        assert text.startswith(f"rank 5 did not arrive at the all_gather #32 on ranks 0-{world - 1} "
                               "(step 6, forward and backward): last seen at the all_gather #31 (step 5, "
                               f"forward and backward), the last collective rank {me} completed with "
                               "it"), text
        others = f"1-4, 6-{world - 1}" if me == 0 else f"0-4, 6-{world - 2}"
        assert text.endswith(f"ranks {others} arrived and waited too"), text
    assert reads == 3, reads  # the claim, the wait for the finding, the finding: whatever P
    # the collector: P posts once, a check and a multi_get per 1024 (rank 5's batch halved
    # down to 16 keys, checked one by one)
    assert first_reads <= 2 * (world // 1024 + 1) + 48, first_reads
    print(f"P={world}: the collector {first_reads} store requests ({first_s:.2f} s), every other "
          f"rank {reads} (before: {2 * (world - 1)} each)")


def _fake_world(world: int) -> dict:
    """In a fresh interpreter: rank P-1 of P on torch's fake backend, over a counting store."""
    import torch

    import matrixfsdp.diagnosis.debug as debug
    from matrixfsdp.diagnosis.timeouts import twin_group

    class Store(dist.Store):
        def __init__(self):
            super().__init__()
            self.inner, self.reads, self.writes = dist.HashStore(), 0, 0

        def set(self, key, value):
            self.writes += 1
            self.inner.set(key, value)

        def get(self, key):
            self.reads += 1
            return self.inner.get(key)

        def add(self, key, value):
            self.writes += 1
            return self.inner.add(key, value)

        def check(self, keys):
            self.reads += 1
            return self.inner.check(keys)

        def wait(self, keys, timeout=None):
            self.reads += 1
            return self.inner.wait(keys, timeout) if timeout is not None else self.inner.wait(keys)

        def compare_set(self, key, expected, desired):
            self.reads += 1
            return self.inner.compare_set(key, expected, desired)

        def set_timeout(self, timeout):
            self.inner.set_timeout(timeout)

    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers "fake"
    store = Store()
    store.set_timeout(timedelta(seconds=5))
    dist.init_process_group("fake", store=store, rank=world - 1, world_size=world)
    moved: list[int] = []
    for name in ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather"):
        original = getattr(dist, name, None)
        if original is not None:
            def counted(*args, _original=original, **kwargs):
                moved.extend(t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor))
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
    check = debug.CollectiveCheck(dist.group.WORLD, torch.device("cpu"), ["<root>", "layers.0"], timeout=5)
    before = store.writes
    for unit in (1, 0, 1):
        check(unit, debug.FORWARD_GATHER, 4096, 0x1234abcd)
    out = {"check_bytes": sum(moved) / 3, "check_store_writes": store.writes - before}

    from studies.async_save import open_sockets as sockets
    reads, writes, fds, t = store.reads, store.writes, sockets(), time.monotonic()
    twin = twin_group(dist.group.WORLD, backend="gloo")
    out.update(twin_s=time.monotonic() - t, twin_reads=store.reads - reads, twin_writes=store.writes - writes,
               twin_sockets=sockets() - fds, twin_size=dist.get_world_size(twin),
               twin_backend=dist.get_backend(twin))
    dist.destroy_process_group()
    return out


def _main() -> None:
    print(json.dumps({world: _fake_world(world) for world in (64, 16384)}))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd")
def test_debug_checks_and_the_async_save_group_do_not_grow_with_p():
    here, name = os.path.split(os.path.splitext(__file__)[0])  # this file, imported by its name
    run = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); "
                          f"import {name} as t; t._main()"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = {int(w): m for w, m in json.loads(run.stdout.strip().splitlines()[-1]).items()}
    assert sorted(got) == [64, 16384]
    for world, m in got.items():
        assert m["check_bytes"] == 80, (world, m)  # 2 x 5 int64 lanes (before: P x 40 received)
        assert m["check_store_writes"] == 0, (world, m)  # a quick check posts nothing
        assert m["twin_size"] == world and m["twin_backend"] == "gloo", (world, m)
        assert m["twin_reads"] == 0 and m["twin_writes"] <= 2, (world, m)  # its own address
        assert m["twin_sockets"] <= 1, (world, m)  # gloo's listening socket, no peer
        print(f"P={world}: {m}")
