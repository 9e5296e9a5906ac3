"""Which rank a hang on NCCL waited for, read from torch's flight recorder.

On NCCL a collective's ``wait()`` does not block the host, so a rank that never arrives shows
nowhere in Python: the others' kernels wait until NCCL's watchdog times out and ends their
processes (the runtime's own naming, :mod:`matrixfsdp.diagnosis.arrival`, watches gloo groups
only). torch's flight recorder keeps each rank's last collectives (their sequence numbers
per process group, kind, sizes and state) and, with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, the
watchdog writes them to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`` before it ends the
process. ``matrixfsdp train``'s launcher sets both (:func:`recorder_env`, where the user has
not) and, when ranks end, reads the dumps (:func:`hung_ranks`): in the group where ranks got
different numbers of collectives, those with the fewest are the ones the others waited for.

Under torchrun, set the same variables and read the dumps with
``python -m matrixfsdp.diagnosis.flight DIR`` (or torch's ``torch.distributed.flight_recorder``).
"""

from __future__ import annotations

import os
import pickle
import re
import sys
from pathlib import Path

from .arrival import ranks_text

PREFIX = "rank_"
BUFFER = "2000"  # entries kept per rank: ample for the last steps of a large model


def recorder_env(folder: str) -> dict[str, str]:
    """The variables that make NCCL dump each rank's flight record into ``folder`` when its
    watchdog times out, for those the environment does not set already."""
    want = {"TORCH_NCCL_TRACE_BUFFER_SIZE": BUFFER, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(folder, PREFIX)}
    return {k: v for k, v in want.items() if k not in os.environ}


def read_dumps(folder: str | Path, prefix: str = PREFIX) -> dict[int, list[dict]]:
    """Each rank's flight-record entries from ``folder/<prefix><rank>`` (the pickles torch
    writes; unreadable files are skipped)."""
    out: dict[int, list[dict]] = {}
    pattern = re.compile(re.escape(prefix) + r"(\d+)$")
    for path in Path(folder).glob(f"{prefix}*"):
        m = pattern.match(path.name)
        if not m:
            continue
        try:
            with open(path, "rb") as f:
                out[int(m.group(1))] = pickle.load(f).get("entries", [])
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError):
            continue
    return out


def hung_ranks(dumps: dict[int, list[dict]]) -> tuple[list[int], str] | None:
    """The ranks the others waited for, and a sentence saying where: in each process group,
    every rank's highest collective sequence number; in the first group where they differ,
    the ranks with the lowest never issued the next collective, which the others did.
    None if every rank got as far in every group (or no dump says anything)."""
    last: dict[str, dict[int, dict]] = {}
    for rank, entries in dumps.items():
        for e in entries:
            if e.get("is_p2p"):
                continue
            group = str(e.get("process_group", ("", "?"))[-1])
            seen = last.setdefault(group, {})
            if rank not in seen or e["collective_seq_id"] > seen[rank]["collective_seq_id"]:
                seen[rank] = e
    for group, seen in sorted(last.items()):
        counts = {r: e["collective_seq_id"] for r, e in seen.items()}
        low, high = min(counts.values()), max(counts.values())
        if low == high:
            continue
        behind = sorted(r for r, c in counts.items() if c == low)
        ahead = sorted(r for r, c in counts.items() if c > low)
        nxt = min((e for r, e in seen.items() if r in ahead), key=lambda e: e["collective_seq_id"])
        what = f"{nxt.get('profiling_name', 'a collective')} #{low + 1} of group '{group}'"
        return behind, (f"{ranks_text(behind)} never issued {what}, which {ranks_text(ahead)} "
                        f"issued (their last there: #{low}, "
                        f"{seen[behind[0]].get('profiling_name', '?')}; NCCL's flight recorder)")
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m matrixfsdp.diagnosis.flight DIR [PREFIX]", file=sys.stderr)
        return 2
    found = hung_ranks(read_dumps(args[0], *args[1:2]))
    print(found[1] if found else "every rank issued the same collectives in every group")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
