"""The ``matrixfsdp`` command (``matrixfsdp train | plan | calibrate | bench``, or ``python -m
matrixfsdp``): one parser whose subcommands live in their rooms (:mod:`matrixfsdp.train.cli`,
:mod:`matrixfsdp.advisor.cli`, :mod:`matrixfsdp.advisor.calibrate`) and, from a checkout of
the repository, the benchmarks (``benchmarks/``, not part of the installed package)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .advisor.calibrate import main as calibrate_main
from .advisor.cli import add_plan_args, model_matrices, run_plan
from .runtime.exit import exit_rank
from .train.cli import add_train_args, run_train, writable_dir_error


def _benchmarks_main():
    """The bench command (``benchmarks.harness.main``) of the checkout this package runs
    from: the benchmarks are not installed with the package (as torch's and torchtitan's
    are not)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "harness" / "main.py").is_file():
        raise SystemExit("matrixfsdp bench: the benchmarks are not part of the installed package; "
                         "run it from a checkout of the repository (make bench)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks.harness.main import main
    return main


def _bench_out_error(rest: list[str]) -> str | None:
    """``--out`` of ``bench`` (its default too) checked before its ranks start."""
    if "-h" in rest or "--help" in rest:
        return None
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--out", default="runs/bench")  # the bench's own default
    known, _ = pre.parse_known_args(rest)
    return writable_dir_error(known.out)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(prog="matrixfsdp", description=__doc__, allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = add_train_args(sub)
    pl = add_plan_args(sub)
    bp = sub.add_parser("bench", help="benchmark against FSDP2 peers, from a checkout (see --help)",
                        add_help=False)
    sub.add_parser("calibrate", help="measure this machine's constants for plan --constants "
                   "(see --help)", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "calibrate":
        return calibrate_main(rest, model_matrices)
    if args.cmd == "bench":
        problem = _bench_out_error(rest)
        if problem:
            bp.error(problem)
        return _benchmarks_main()(rest)
    if rest:  # a misspelt flag (abbreviations are off): refused by its subcommand's parser
        (tr if args.cmd == "train" else pl).error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "train":
        run_train(tr, args, sys.argv[1:] if argv is None else argv)
    else:
        run_plan(args)
    return 0


def run() -> None:
    """The ``matrixfsdp`` command (and ``python -m matrixfsdp``): :func:`main`, then leave
    without interpreter finalization, which takes seconds with torch loaded (about 3 s here
    after a failed run), so that a failure ends the command in about a second."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):  # SystemExit("message"): as Python prints it, exit status 1
        print(code, file=sys.stderr)
        code = 1
    exit_rank(0 if code is None else int(code))


if __name__ == "__main__":
    run()
