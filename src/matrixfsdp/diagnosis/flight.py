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

import argparse
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
    """``python -m matrixfsdp.diagnosis.flight DIR [PREFIX]``: the ranks a hang waited for,
    from the dumps in ``DIR``. Exit 1 with the sentence naming them; 0 when every rank got as
    far in every group; 2, naming what is missing, when there is nothing to read (no such
    directory, no dump in it, or none readable): an empty read is not a verdict."""
    ap = argparse.ArgumentParser(
        prog="python -m matrixfsdp.diagnosis.flight", allow_abbrev=False,
        description="Name the ranks an NCCL hang waited for, from the flight-recorder dumps "
                    "NCCL's watchdog wrote (TORCH_NCCL_DUMP_ON_TIMEOUT=1, "
                    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE=DIR/rank_). Exit status: 1 ranks named, "
                    "0 every rank issued the same collectives, 2 nothing to read.")
    ap.add_argument("dir", metavar="DIR", help="the folder holding the dumps")
    ap.add_argument("prefix", metavar="PREFIX", nargs="?", default=PREFIX,
                    help=f"the dumps' file names before the rank (default: {PREFIX})")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    folder = Path(args.dir)
    if not folder.is_dir():
        ap.error(f"{folder} is not a directory: nothing to read (the dumps are where "
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE points)")
    named = sorted(p.name for p in folder.glob(f"{args.prefix}*")
                   if re.fullmatch(re.escape(args.prefix) + r"\d+", p.name))
    dumps = read_dumps(folder, args.prefix)
    if not dumps:
        ap.error(f"no flight-recorder dump in {folder}: no file named {args.prefix}<rank>"
                 if not named else
                 f"none of the {len(named)} dumps in {folder} ({', '.join(named[:3])}"
                 f"{', ...' if len(named) > 3 else ''}) could be read as a flight record")
    unread = len(named) - len(dumps)
    found = hung_ranks(dumps)
    print(found[1] if found else
          f"every rank issued the same collectives in every group ({len(dumps)} dumps read"
          f"{f', {unread} unreadable' if unread else ''}: {ranks_text(sorted(dumps))})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
