"""`matrixfsdp bench` end to end on a tiny model (numbers are not asserted: timing belongs
in docs/benchmarks.md, not in tests)."""

from __future__ import annotations

import json

from matrixfsdp.bench.harness import main


def test_bench_tiny_runs_and_checks_exactness(tmp_path):
    rc = main(["--world-size", "2", "--layers", "1", "--d-model", "32", "--heads", "2",
               "--mlp", "64", "--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "1",
               "--systems", "fsdp2_adamw,fsdp2_torch_muon,fsdp2_dist_muon,matrixfsdp",
               "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    systems = results["systems"]
    assert set(systems) == {"fsdp2_adamw", "fsdp2_torch_muon", "fsdp2_dist_muon", "matrixfsdp"}
    mf = systems["matrixfsdp"]
    assert mf["status"] == "ok", mf["error"]
    assert mf["exactness"]["ok"], mf["exactness"]
    assert mf["collectives"]["step"]["calls"] == 0
    assert (tmp_path / "results.md").exists()
