"""`pip install matrixfsdp` into a bare virtualenv, then `matrixfsdp train` with a checkpoint
and `matrixfsdp plan`: every module they import must be a declared dependency (matplotlib
and transformers are not; numpy is, for torch.distributed.checkpoint).

The package's declared dependencies and theirs (read from pyproject.toml and the installed
metadata, recursively) are linked into the venv from this environment rather than unpacked
again (torch alone took ~21 s of the test's 29-46 s): the venv sees exactly that closure,
pip sees it installed, and nothing else is there."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest
import tomllib
from helpers import REPO
from packaging.markers import Marker


def _pip(venv: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``pip install`` into ``venv``: this environment's pip, run for the venv's interpreter
    (``--python``), so the venv needs no pip of its own (``ensurepip`` took 3 s)."""
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                           "install", "-q", *args],
                          capture_output=True, text=True, timeout=timeout, env=_clean_env())


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "OMP_NUM_THREADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _closure(requirement: str, seen: dict) -> dict:
    """The installed distributions ``requirement`` needs, itself included (extras and
    requirements whose markers do not hold here left out)."""
    name = re.split(r"[\s;\[<>=!~(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
    if name not in seen:
        seen[name] = dist = distribution(name)
        for req in dist.requires or []:
            marker = req.split(";", 1)[1] if ";" in req else None
            if marker is None or Marker(marker).evaluate():
                _closure(req, seen)
    return seen


def _link_closure(venv: Path, requirements: list[str]) -> None:
    """Make ``requirements`` and their dependency closure importable (and known to pip) in
    ``venv`` through one directory of links to this environment's installed files."""
    linked = venv / "linked"
    linked.mkdir()
    seen: dict = {}
    for requirement in requirements:
        _closure(requirement, seen)
    for dist in seen.values():
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops - {"..", "__pycache__"}:
            target = Path(dist.locate_file(top))
            if target.exists() and not top.endswith(".pth") and not (linked / top).exists():
                (linked / top).symlink_to(target)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "linked.pth").write_text(str(linked) + "\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="venv layout of Linux")
def test_installed_with_declared_dependencies_only_it_trains_and_writes_the_summary(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120, env=_clean_env())  # not --system-site-packages: nothing leaks in
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    _link_closure(venv, declared)  # this environment's torch (its CPU build), numpy, tqdm, ...
    # A copy of the project, so the build leaves nothing in the working tree.
    src = tmp_path / "project"
    shutil.copytree(REPO / "src", src / "src",
                    ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    got = _pip(venv, str(src))  # its declared dependencies come from the index
    assert got.returncode == 0, got.stderr[-3000:]
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import matplotlib"],
                           capture_output=True, env=_clean_env())
    assert probe.returncode != 0, "matplotlib is in the bare venv: this test no longer checks its absence"

    run = subprocess.run(
        [str(venv / "bin" / "matrixfsdp"), "train", "--ranks", "2", "--steps", "3", "--save-every", "3",
         "--layers", "1",
         "--d-model", "32", "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "2",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env=_clean_env(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["optimizer_step_ms_median"]["max"] > 0
    saved = [c["path"] for c in summary["checkpoints"]]  # DCP and the checksums ran, numpy-free or not
    assert saved == [str(tmp_path / "run" / "checkpoints" / "step_00000003")], saved
    assert "loss.png skipped: matplotlib is not installed" in run.stdout
    plan = subprocess.run([str(venv / "bin" / "matrixfsdp"), "plan", "--model", "llama3-8b"],
                          capture_output=True, text=True, timeout=120, env=_clean_env(), cwd=tmp_path)
    assert plan.returncode == 0 and "Muon matrices" in plan.stdout, plan.stderr[-3000:]
    # the installed package is the library: no benchmark or report code; `bench` says where it runs
    site = next((venv / "lib").glob("python3*/site-packages"))
    installed = {p.relative_to(site).as_posix() for p in (site / "matrixfsdp").rglob("*.py")}
    assert not [f for f in installed if "bench" in f or "docs_figures" in f or "gpu_check" in f], installed
    bench = subprocess.run([str(venv / "bin" / "matrixfsdp"), "bench"], capture_output=True, text=True,
                           timeout=120, env=_clean_env(), cwd=tmp_path)
    assert bench.returncode == 1 and "from a checkout of the repository" in bench.stderr, bench.stderr
