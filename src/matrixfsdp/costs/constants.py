"""The constants ``matrixfsdp plan`` needs, as measured on a machine by ``matrixfsdp
calibrate`` (:mod:`matrixfsdp.advisor.calibrate`), read back by ``plan --constants FILE``: so
that the step-time model runs on this machine's numbers, not on an H100's datasheet.

Pure Python over a JSON file (the planning layer imports no torch.distributed):

* ``gemm[dtype]``: matmul rates, ``[m, k, n, FLOP/s]`` of ``(m x k) @ (k x n)``, each rank
  measured while every rank of the machine runs the same (so a shared CPU's contention is
  in the number);
* ``ns[dtype]``: Newton-Schulz rates, ``[rows, cols, FLOP/s]`` of torch.optim.Muon's
  iteration (:func:`~matrixfsdp.layout.assign.ns_flops` FLOPs over the measured time);
* ``elementwise``: the optimizer's element-wise updates, bytes per second counted as the
  model counts them (AdamW 7 fp32 accesses per element, Muon's momentum and update 5);
* ``collectives[kind]``: ``[ranks, latency s, bytes/s]`` per collective the runtime issues
  (``all_gather``, ``reduce_scatter``, ``broadcast``, ``reduce``, ``all_reduce``,
  ``all_to_all``) at each group size measured: one op's time is ``latency + busiest / bw``,
  ``busiest`` the most loaded rank's bytes (:mod:`matrixfsdp.costs.links`' rule);
  ``launch``: what one launch costs beyond its ops' own latency (where the group coalesces
  several ops into one launch; 0 where each op is its own launch, its latency holding it);
  ``coalesced``: whether the groups coalesce.

A rate between measured shapes comes from the nearest four (log distance), their seconds per
FLOP weighted by inverse squared distance; a collective's latency between measured group
sizes is interpolated linearly in the size (beyond them, extrapolated from the two largest,
with the largest's bandwidth). ``calibrate --model`` adds a model's own matmul shapes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

OP_KINDS = ("all_gather", "reduce_scatter", "broadcast", "reduce", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class OpFit:
    """One collective at one group size: ``latency`` (s) and ``bandwidth`` (bytes/s of its
    most loaded rank)."""

    ranks: int
    latency: float
    bandwidth: float


@dataclass
class Constants:
    """A machine's measured constants (module docstring)."""

    device: str
    backend: str
    ranks: int
    coalesced: bool
    launch: float
    gemm: dict[str, list[tuple[int, int, int, float]]]
    ns: dict[str, list[tuple[int, int, float]]]
    adamw_bytes_per_s: float
    muon_bytes_per_s: float
    collectives: dict[str, list[OpFit]]
    machine: dict = field(default_factory=dict)
    source: str = ""  # the file it was read from

    # ---- lookups ----------------------------------------------------------------------
    def gemm_rate(self, dtype: str, m: int, k: int, n: int) -> float:
        """FLOP/s of an ``(m x k) @ (k x n)`` matmul in ``dtype``: the measured shapes
        nearest to it (log distance), their times weighted by inverse squared distance."""
        rows = self._rows(self.gemm, dtype)
        return _interpolate([((r[0], r[1], r[2]), r[3]) for r in rows], (m, k, n))

    def ns_rate(self, dtype: str, rows: int, cols: int) -> float:
        """FLOP/s of Newton-Schulz on a ``rows x cols`` matrix, as :meth:`gemm_rate`
        (orientation ignored: torch's iteration transposes a tall matrix)."""
        table = self._rows(self.ns, dtype)
        return _interpolate([(tuple(sorted(r[:2])), r[2]) for r in table],
                            tuple(sorted((rows, cols))))

    def op(self, kind: str, ranks: int) -> OpFit | None:
        """The fit of collective ``kind`` over ``ranks`` ranks (None: not measured)."""
        fits = sorted(self.collectives.get(kind, []), key=lambda f: f.ranks)
        if not fits or ranks <= 1:
            return None
        for f in fits:
            if f.ranks == ranks:
                return f
        lo = [f for f in fits if f.ranks < ranks]
        hi = [f for f in fits if f.ranks > ranks]
        if lo and hi:
            a, b = lo[-1], hi[0]
        elif len(fits) > 1:
            a, b = (fits[-2], fits[-1]) if lo else (fits[0], fits[1])
        else:
            return OpFit(ranks, fits[0].latency, fits[0].bandwidth)
        t = (ranks - a.ranks) / (b.ranks - a.ranks)
        lat = max(0.0, a.latency + t * (b.latency - a.latency))
        bw = b.bandwidth if ranks > b.ranks else a.bandwidth + t * (b.bandwidth - a.bandwidth)
        return OpFit(ranks, lat, bw)

    def model_rates(self, matrices: list[tuple[int, int, int]], tokens: int, dtype: str
                    ) -> tuple[float, float]:
        """(matmul FLOP/s, Newton-Schulz FLOP/s) for a model whose linear layers are
        ``matrices`` (``(rows, cols, count)``: ``rows x cols`` weights, ``count`` of each)
        with ``tokens`` tokens per micro-batch, in ``dtype``: FLOP-weighted harmonic means
        over each layer's three matmuls (forward ``tokens x cols @ cols x rows``, input
        gradient, weight gradient) and over its Newton-Schulz (bf16)."""
        work = secs = ns_work = ns_secs = 0.0
        for rows, cols, count in matrices:
            f = 2.0 * tokens * rows * cols * count
            for shape in ((tokens, cols, rows), (tokens, rows, cols), (rows, tokens, cols)):
                work += f
                secs += f / self.gemm_rate(dtype, *shape)
            g = float(count) * _ns(rows, cols)
            ns_work += g
            ns_secs += g / self.ns_rate("bfloat16", rows, cols)
        return (work / secs if secs else self._rows(self.gemm, dtype)[0][3],
                ns_work / ns_secs if ns_secs else self._rows(self.ns, "bfloat16")[0][2])

    @property
    def largest_group(self) -> int:
        return max((f.ranks for fits in self.collectives.values() for f in fits), default=1)

    @staticmethod
    def _rows(table: dict, dtype: str) -> list:
        rows = table.get(dtype) or table.get("bfloat16") or next(iter(table.values()), None)
        if not rows:
            raise ValueError(f"calibrated constants: no matmul rates for {dtype}")
        return rows

    # ---- files ------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("source")
        out["collectives"] = {k: [[f.ranks, f.latency, f.bandwidth] for f in v]
                              for k, v in self.collectives.items()}
        return out

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> Constants:
        where = source or "calibrated constants"
        need = ("device", "backend", "ranks", "coalesced", "launch", "gemm", "ns",
                "adamw_bytes_per_s", "muon_bytes_per_s", "collectives")
        missing = [k for k in need if k not in data]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)} (written by "
                             "`matrixfsdp calibrate`?)")
        try:
            colls = {k: [OpFit(int(r), float(lat), float(bw)) for r, lat, bw in v]
                     for k, v in data["collectives"].items()}
            gemm = {d: [(int(m), int(k), int(n), float(f)) for m, k, n, f in v]
                    for d, v in data["gemm"].items()}
            ns = {d: [(int(a), int(b), float(f)) for a, b, f in v] for d, v in data["ns"].items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: malformed table ({e})") from None
        bad = [k for k, v in colls.items() for f in v if f.bandwidth <= 0 or f.latency < 0]
        bad += [d for d, v in {**gemm, **ns}.items() for row in v if row[-1] <= 0]
        if bad:
            raise ValueError(f"{where}: non-positive rate or negative latency in {sorted(set(bad))}")
        return cls(str(data["device"]), str(data["backend"]), int(data["ranks"]),
                   bool(data["coalesced"]), float(data["launch"]), gemm, ns,
                   float(data["adamw_bytes_per_s"]), float(data["muon_bytes_per_s"]), colls,
                   dict(data.get("machine", {})), source)

    @classmethod
    def load(cls, path: str) -> Constants:
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"--constants {path}: cannot read it ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--constants {path}: not JSON ({e})") from None
        return cls.from_json(data, f"--constants {path}")

    def describe(self) -> str:
        m = self.machine.get("gpu") or self.machine.get("cpu_model") or self.device
        joins = "coalesce" if self.coalesced else "do not coalesce"
        return (f"measured by matrixfsdp calibrate ({self.source or 'constants'}): {m}, "
                f"{self.ranks} {self.backend} ranks, groups {joins}")


def _ns(rows: int, cols: int, steps: int = 5) -> float:
    a, b = min(rows, cols), max(rows, cols)
    return float(steps * (4 * a * a * b + 2 * a ** 3))


def _dist(a: tuple, b: tuple) -> float:
    return math.sqrt(sum((math.log(max(x, 1)) - math.log(max(y, 1))) ** 2 for x, y in zip(a, b)))


def _interpolate(points: list[tuple[tuple, float]], at: tuple, nearest: int = 4) -> float:
    """A rate at ``at`` from measured ``(shape, rate)`` points: the ``nearest`` ones, their
    seconds per FLOP weighted by inverse squared log distance (an exact shape: its own)."""
    near = sorted(points, key=lambda p: _dist(p[0], at))[:nearest]
    weights = []
    for shape, rate in near:
        d = _dist(shape, at)
        if d < 1e-9:
            return rate
        weights.append((1.0 / (d * d), rate))
    total = sum(w for w, _ in weights)
    return total / sum(w / rate for w, rate in weights)
