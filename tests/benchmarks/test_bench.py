"""`matrixfsdp bench` end to end on a tiny model (numbers are not asserted: timing belongs
in docs/benchmarks.md, not in tests)."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist
from helpers.rank_pool import spawn

import matrixfsdp as mf
from benchmarks.harness.main import main
from matrixfsdp import testing
from matrixfsdp.testing import Link


def test_bench_tiny_runs_and_checks_exactness(tmp_path):
    """Every system runs; MatrixFSDP ends within config.EXACT_BOUND (5e-3) of torch's Muon
    (measured 6.6e-4; with its Muon step skipped, 2.7e-2: this fails); its step issues no
    collective; the machine (CPU model, AMX, threads per rank) is in the JSON and the table."""
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
    machine = results["machine"]
    assert machine["cpu_model"] and machine["cpu_capability"], machine
    assert isinstance(machine["bf16_matmul_amx"], bool) and machine["torch_threads"] == 1, machine
    table = (tmp_path / "results.md").read_text()
    assert f"Machine: {machine['cpu_model']} (" in table and "bf16 matmuls on AMX: " in table


def test_bench_link_sweep_runs(tmp_path):
    """`matrixfsdp bench --link` writes its table and one row per link speed, with FSDP2
    timed under the same modelled link (its collectives delayed by their bytes)."""
    rc = main(["--link", "0.1,1", "--ranks", "2", "--layers", "1", "--d-model", "32", "--heads", "2",
               "--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "link.json").read_text())
    assert [r["gbps"] for r in result["rows"]] == [0.1, 1.0]
    keys = ("matrixfsdp_on_ms", "matrixfsdp_off_ms", "matrixfsdp_on_gloo_path_ms", "fsdp2_off_ms")
    assert all(r[k] > 0 for r in result["rows"] for k in keys)
    # FSDP2 under the same link, charged alike: its all-gathers and reduce-scatters counted
    assert result["fsdp2_critical_bytes_per_step"] > 0 and result["critical_bytes_per_step"] > 0
    # the same NCCL model charges both: at most issue 13's bound, 1.05 x P/(P-1) (2 ranks: a
    # rank that owns none of a matrix receives all of it, where FSDP2's holds half already)
    ratio = result["critical_bytes_per_step"] / result["fsdp2_critical_bytes_per_step"]
    assert 1.0 < ratio <= 1.05 * 2, ratio
    # one call per unit and direction on NCCL's path: FSDP2's launches (one block, a root)
    calls = result["launches_per_step"]
    assert calls["matrixfsdp_on"] == calls["fsdp2_off"] <= calls["matrixfsdp_on_gloo_path"], calls
    assert result["machine"]["cpu_model"] and "Machine: " in (tmp_path / "link.md").read_text()


def _link_worker(rank, world_size):
    """A group made after register(link=...) delays each call by its launch latency and its
    most loaded rank's bytes; the world group (made before) is not delayed."""
    testing.register("grouped_gloo", link=Link(bytes_per_s=1e6, latency_s=0.05))
    slow = dist.new_group(backend="grouped_gloo")
    t = torch.zeros(150_000 // 4)  # a broadcast of 150 kB: the root's link carries it once
    t0 = time.perf_counter()
    work = dist.broadcast(t, group_src=0, group=slow, async_op=True)
    assert not work.is_completed()
    work.wait()
    assert time.perf_counter() - t0 >= 0.05 + 0.15 - 0.01
    t0 = time.perf_counter()
    dist.broadcast(t, src=0)
    assert time.perf_counter() - t0 < 0.15


def test_link_delay_wraps_the_process_group(tmp_path):
    """The bench's link model lives in a process group wrapped around gloo (bench/grouped_gloo),
    outside the runtime: a call on it is not done, and its wait() does not return, before the
    launch latency and the bytes have passed."""
    spawn(_link_worker, 2, backend="grouped_gloo")


def test_bench_hsdp_mode_runs_and_matches_fsdp2_hsdp_bytes(tmp_path):
    """`matrixfsdp bench --replicas 2`: FSDP2 HSDP beside MatrixFSDP's on a (2, 1) mesh; the
    replicate-dim bytes sent are FSDP2 HSDP's, the step issues no collective, and each
    matrix's NS runs on one rank of the world."""
    from benchmarks.harness.report import replicate_dim_bytes

    rc = main(["--world-size", "2", "--replicas", "2", "--layers", "1", "--d-model", "32",
               "--heads", "2", "--mlp", "64", "--seq", "16", "--batch", "2", "--steps", "1",
               "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    systems = results["systems"]
    assert set(systems) == {"fsdp2_adamw", "fsdp2_torch_muon", "matrixfsdp"}
    assert all(s["status"] == "ok" for s in systems.values()), systems
    ours, fsdp2 = (replicate_dim_bytes(systems[n], 2) for n in ("matrixfsdp", "fsdp2_adamw"))
    # FSDP2 HSDP's bytes, and what the layout adds: a gradient flag per parameter (all-reduced)
    # and the matrices' alignment in their runs (test_hsdp's count from the plan's layouts)
    from helpers.replicate_bytes import replicate_bytes_from_layout

    from matrixfsdp.train.models import GPT, GPTConfig
    with torch.device("meta"):
        twin = GPT(GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=2, n_layers=1,
                             d_mlp=64))
    plan = mf.plan_costs(twin, (2, 1), coalesced=False).plan
    extra = sum(replicate_bytes_from_layout(plan, r)["extra"] for r in range(2)) / 2
    assert fsdp2["wire"] > 0 and ours["wire"] == fsdp2["wire"] + extra > fsdp2["wire"], (ours, fsdp2)
    assert ours["c10d::reduce_"] > 0 and ours["c10d::broadcast_"] > 0
    m = systems["matrixfsdp"]
    assert m["exactness"]["ok"] and m["collectives"]["step"]["calls"] == 0
    owned = m["matrixfsdp"]["ns_owned_matrices_per_rank"]
    assert len(owned) == 2 and min(owned) > 0, owned  # split over the replicas, not repeated
    assert "Across the replicate dim" in (tmp_path / "results.md").read_text()


def test_bench_hsdp_refuses_systems_without_hsdp(capsys):
    import pytest
    with pytest.raises(SystemExit):
        main(["--world-size", "2", "--replicas", "2", "--systems", "fsdp2_dist_muon"])
    assert "do not run with --replicas 2" in capsys.readouterr().err


def test_bench_soap_systems_are_optional_and_exact(tmp_path):
    """The SOAP row (fsdp2_soap gathers, matrixfsdp_soap steps on owners) runs when asked
    for, compares the two with each other, and stays out of the default system list."""
    from benchmarks.harness.config import OPTIONAL_SYSTEMS, SYSTEMS
    assert not set(OPTIONAL_SYSTEMS) & set(SYSTEMS)
    rc = main(["--world-size", "2", "--layers", "1", "--d-model", "32", "--heads", "2",
               "--mlp", "64", "--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "1",
               "--systems", "fsdp2_soap,matrixfsdp_soap", "--out", str(tmp_path)])
    assert rc == 0
    systems = json.loads((tmp_path / "results.json").read_text())["systems"]
    ours = systems["matrixfsdp_soap"]
    assert systems["fsdp2_soap"]["status"] == "ok" and ours["status"] == "ok", ours["error"]
    assert ours["exactness"]["reference"] == "fsdp2_soap" and ours["exactness"]["ok"]
    assert ours["collectives"]["step"]["calls"] == 0
    assert systems["fsdp2_soap"]["collectives"]["step"]["calls"] > 0


def test_exactness_bound_flags_a_skipped_muon_step_and_allows_bf16_rounding():
    """:func:`compare` against the bound's two parts (config.EXACT_BOUND's reasoning): a
    difference of one Muon step's size (9e-3 per step in the tiny run) fails; bf16 NS's
    rounding (6.6e-4 in the tiny run) passes; a bf16 parameter near 1.0 one bf16 rounding
    away (7.8e-3) passes, as does no difference; a missing parameter fails."""
    import torch

    from benchmarks.harness.config import EXACT_BOUND
    from benchmarks.harness.measure import compare

    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 0.05
    ln = torch.ones(8, dtype=torch.bfloat16)
    ref = {"w": w, "ln": ln}
    assert compare(dict(ref), "ref", ref)["ok"]
    assert compare({"w": w + 6.6e-4, "ln": ln}, "ref", ref)["ok"]
    assert compare({"w": w, "ln": ln + 2**-7}, "ref", ref)["ok"]  # one bf16 rounding at 1.0
    skipped = compare({"w": w + 9e-3, "ln": ln}, "ref", ref)
    assert not skipped["ok"] and skipped["worst_param"] == "w" and skipped["bound"] == EXACT_BOUND
    assert not compare({"w": w}, "ref", ref)["ok"]
