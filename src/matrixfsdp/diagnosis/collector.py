"""After a timeout, one rank reads what every rank posted and the others read its finding,
so that no rank's failure path reads O(P) store keys.

When a collective times out at 16384 ranks, every rank that waited fails at about the same
moment. Had each of them read every peer's post (two reads a peer), one TCPStore would
answer ~5e8 requests at once. Instead the ranks that fail at the same *point* (a key the
caller builds, the same on every rank: the group, the point's number, what it is) share one
finding (:func:`shared`): the first of them to ask claims the point (one ``compare_set``),
reads every post once (:func:`read_all`: in batches of :data:`BATCH` keys, a check and a
``multi_get`` each) and publishes what it found under the point's key; each other rank
waits for that key (bounded) and reads it: three store requests, whatever P. What must grow
with P: the collector's read (P keys, once per point, not per rank; about P / 1024 round
trips when every rank posted), the bound on the others' wait for it
(:func:`collect_limit_s`), and what a finding holds where many ranks did not arrive (each
caller lists at most a fixed number of them in full and the rest as spans of ranks).

Messages name many ranks as spans (:func:`ranks_text`: ``ranks 0-4, 6-16383``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

BATCH = 1024  # keys per check and multi_get of the collector's read
COLLECT_S = 10.0  # what the others wait for the collector beyond its own delay, plus per rank:
PER_RANK_S = 1e-3  # about 15 x a TCPStore check + get measured here (66 us), for a slower network


def collect_limit_s(world: int, delay_s: float = 0.0) -> float:
    """How long a rank waits for the collector's finding: the collector's ``delay_s`` (it
    lets late posts land before it reads), :data:`COLLECT_S`, and :data:`PER_RANK_S` for each
    of the ``world`` posts it reads (this bound grows with P because that read does)."""
    return delay_s + COLLECT_S + PER_RANK_S * world


def spans(ranks: Sequence[int]) -> list[list[int]]:
    """Sorted ``ranks`` as ``[first, last]`` runs of consecutive ranks: a finding's size
    follows the number of gaps (the ranks that did not arrive), not P."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def ranks_of(runs: Sequence[Sequence[int]]) -> list[int]:
    """The ranks of :func:`spans`' runs."""
    return [r for first, last in runs for r in range(first, last + 1)]


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1`` / ``ranks 0, 1`` / ``ranks 0-4, 6-16383`` (every message that names ranks
    says them so): a run of three or more consecutive ranks is said as ``first-last``."""
    parts = []
    for first, last in spans(ranks):
        if last - first >= 2:
            parts.append(f"{first}-{last}")
        else:
            parts += [str(r) for r in range(first, last + 1)]
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(parts)}"


def read_all(store: Any, keys: Sequence[str]) -> list[bytes | None]:
    """Every key's value, None where a key is absent: per :data:`BATCH` keys one ``check``
    and one ``multi_get`` when all are there; a batch with absent keys is halved until its
    parts are (a few absent keys cost a few checks each), and a part of at most 16 keys is
    checked key by key (one ``multi_get`` for those there)."""
    out: list[bytes | None] = [None] * len(keys)
    multi = getattr(store, "multi_get", None)

    def fetch(at: list[int]) -> None:
        names = [keys[i] for i in at]
        for i, v in zip(at, multi(names) if multi is not None else [store.get(k) for k in names]):
            out[i] = v

    def visit(lo: int, hi: int) -> None:
        if store.check(list(keys[lo:hi])):
            fetch(list(range(lo, hi)))
        elif hi - lo <= 16:
            there = [i for i in range(lo, hi) if store.check([keys[i]])]
            if there:
                fetch(there)
        else:
            mid = (lo + hi) // 2
            visit(lo, mid)
            visit(mid, hi)

    for lo in range(0, len(keys), BATCH):
        visit(lo, min(lo + BATCH, len(keys)))
    return out


def shared(store: Any, key: str, me: int, collect: Callable[[], dict],
           limit_s: float) -> tuple[dict | None, int | None]:
    """``(finding, collector)`` for the point ``key``: the first rank to ask claims it
    (``compare_set``), runs ``collect()`` and publishes its result (a JSON-able dict) under
    ``key``; every other rank waits at most ``limit_s`` for it and reads it. The finding is
    None where the store cannot answer, the collector's ``collect`` failed, or it did not
    publish in time (``collector`` then says who was to)."""
    try:
        by = int(store.compare_set(key + "/by", "", str(me)))
    except Exception:  # noqa: BLE001 (no store: the caller says less)
        return None, None
    if by == me:
        try:
            found: dict | None = collect()
            text = json.dumps(found)
        except Exception as e:  # noqa: BLE001 (published, so that the others do not wait)
            found, text = None, json.dumps({"failed": f"{type(e).__name__}: {e}"})
        try:
            store.set(key, text)
        except Exception:  # noqa: BLE001
            pass
        return found, by
    try:
        store.wait([key], timedelta(seconds=limit_s))
        found = json.loads(store.get(key))
    except Exception:  # noqa: BLE001 (the collector did not answer in time)
        return None, by
    return (None if "failed" in found else found), by
