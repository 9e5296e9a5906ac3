"""The repository's own tools, outside the package: ``make docs-figures`` (every measured
figure of README.md and docs/ from the command that produces it), ``make docs-map``
(docs/architecture.md's file map from the tree) and ``make gpu-check`` (what only a GPU
shows, one prepared script for a lent machine)."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def tests_on_path() -> None:
    """The checkout's ``tests/`` importable: its helpers (``helpers.reference``: torch's
    references the GPU check compares against; torchtitan's CPU shim) serve the checks too."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
