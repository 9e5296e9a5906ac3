"""The main job and the planner, as a user types them; bad arguments end before any rank
starts, with one line saying why."""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

import pytest
import torch
from helpers.cli import run_cli

import matrixfsdp.train.launch as ranks
from benchmarks.harness.main import parse_args as bench_args
from matrixfsdp.__main__ import main

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--mlp", "64", "--seq", "32",
        "--batch", "2"]


def _run(*args):
    out = run_cli(*args, env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, f"matrixfsdp {' '.join(args)} exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


def test_train_runs_and_learns(tmp_path):
    out = _run("train", "--ranks", "2", "--steps", "12", "--layers", "1", "--d-model", "32",
               "--heads", "2", "--mlp", "64", "--seq", "32", "--batch", "4",
               "--out", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ranks"] == 2 and len(summary["losses"]) == 12
    assert summary["loss_end"] < summary["loss_start"]
    # Per step: the root unit gathered once, the block twice (forward, backward), each one
    # all-gather; each unit's reduce one reduce-scatter (with a flag per parameter: which
    # ranks had a gradient). The block's 6 matrices make two equal chunks of whole matrices
    # on the 2 ranks, so even gloo's path needs no broadcast or reduce per matrix.
    assert summary["collectives_per_step"] == {"all_gather": 3, "reduce_scatter": 2}
    step_ms = summary["optimizer_step_ms_median"]  # over the ranks, O(1) at any world size
    assert 0 < step_ms["min"] <= step_ms["mean"] <= step_ms["max"]
    assert "== summary ==" in out.stdout and "plan balance" in out.stdout
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_train_accumulates_clips_and_skips_nonfinite_steps(tmp_path):
    # An AdamW lr of 1e30 makes step 1's update overflow the weights, so from step 2 on
    # (1-based) every gradient is NaN: those steps are skipped on both ranks, not applied.
    # The run says how many it skipped and, its last loss not finite, exits 1.
    out = run_cli("train", "--ranks", "2", "--steps", "3", *TINY, "--grad-accum", "2",
                  "--clip", "1.0", "--skip-nonfinite", "--adamw-lr", "1e30", "--timeout", "60",
                  "--out", str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 1, out.stderr[-3000:]
    assert ("steps skipped for a non-finite loss or gradients (--skip-nonfinite): 2 of 3 "
            "(steps 2, 3)") in out.stdout
    assert ("NonFiniteError: the last step's loss (step 3) is not finite; 2 of 3 steps were "
            "skipped") in out.stderr, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())  # strict JSON: NaN -> null
    assert summary["grad_accum"] == 2
    assert summary["collectives_per_step"] == {"all_gather": 6,  # 2 micro-batches
                                               "reduce_scatter": 4}
    norms = summary["grad_norms"]
    assert len(norms) == 3 and norms[0] > 0 and norms[1:] == [None, None]
    assert [s["step"] for s in summary["skipped_steps"]] == [2, 3]
    assert "layers.0.attn.q.weight" in summary["skipped_steps"][0]["nonfinite"]
    assert "step 2: gradient norm is not finite, step skipped on every rank" in out.stdout
    assert "clipped to 1.0" in out.stdout


def test_plan_paper_model():
    out = _run("plan", "--model", "paper", "--world-size", "8").stdout
    assert "192 Muon matrices" in out  # 32 layers x (q, k, v, o, fc, proj)
    assert "NS cost imbalance (max/mean): 1.000" in out


@pytest.mark.parametrize("argv, message", [
    (["train", "--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
    (["train", "--ranks", "-1"], "argument --ranks: must be >= 1, got -1"),
    (["train", "--ranks", "1", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["train", "--ranks", "1", "--steps", "-5"], "argument --steps: must be >= 1, got -5"),
    (["train", "--ranks", "1", "--grad-accum", "0"], "argument --grad-accum: must be >= 1, got 0"),
    (["train", "--ranks", "1", "--steps", "2", "--d-model", "30", "--heads", "4"],
     "--d-model 30 is not divisible by --heads 4"),
    (["train", "--ranks", "1", "--steps", "2", "--model", "hf-llama", "--d-model", "6",
      "--heads", "2"], "--model hf-llama needs an even head size"),
    (["train", "--ranks", "1", "--timeout", "0"], "argument --timeout: must be a finite number > 0"),
    (["train", "--ranks", "1", "--clip", "-1"], "argument --clip: must be a finite number > 0"),
    (["train", "--ranks", "1", "--mp", "fp16"], "argument --mp: invalid choice: 'fp16'"),
    (["train", "--lr", "-1"], "argument --lr: must be a finite number > 0, got -1"),
    (["train", "--adamw-lr", "nan"], "argument --adamw-lr: must be a finite number > 0, got nan"),
    (["train", "--keep-last", "2"], "--keep-last needs --save-every N"),
    (["train", "--resume-fallback"], "--resume-fallback needs --resume"),
    (["plan", "--world-size", "0"], "argument --world-size: must be >= 1, got 0"),
    (["bench", "--timeout", "-3"], "argument --timeout: must be a finite number > 0"),
])
def test_bad_arguments_exit_with_one_line_before_any_rank_starts(argv, message, capsys, tmp_path):
    full = [argv[0], *(TINY if argv[0] == "train" else []), *argv[1:]]  # later flags win
    if argv[0] != "plan":
        full += ["--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main(full)
    err = capsys.readouterr().err
    assert e.value.code not in (0, None)
    assert message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "summary.json").exists()


def test_out_ranks_and_the_checkpoint_folder_are_checked_before_any_rank_starts(
        tmp_path, capsys, monkeypatch):
    """--out "" (before: results written into the current folder), --ranks under torchrun
    (before: silently ignored), an unwritable checkpoint folder (before: found at the first
    save, after the first steps)."""
    def error_of(argv):
        with pytest.raises(SystemExit) as e:
            main(["train", *TINY, *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err.strip().splitlines()[-1] if "note:" not in err else err
    assert error_of(["--out", ""]).endswith("--out must name a directory (it is empty)")
    assert "note: --lr 1e+30 is above 10; the first step will likely overflow" in \
        error_of(["--lr", "1e30", "--out", ""])  # (before: accepted without a word)
    (tmp_path / "checkpoints").write_text("")  # a file where the checkpoint folder goes
    assert f"--save-every: cannot write checkpoints under {tmp_path / 'checkpoints'}" in \
        error_of(["--out", str(tmp_path), "--save-every", "2"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "--ranks 3 under torchrun, which runs 2 ranks (WORLD_SIZE): drop --ranks" in \
        error_of(["--ranks", "3", "--out", str(tmp_path / "x")])


def test_unwritable_out_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out in (blocker, blocker / "run"):  # a file, and a directory that cannot be created
        with pytest.raises(SystemExit) as e:
            main(["train", "--ranks", "1", "--steps", "2", *TINY, "--out", str(out)])
        assert e.value.code not in (0, None)
        err = capsys.readouterr().err
        assert f"--out {out}: cannot write there" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["bench", "--world-size", "1", "--out", str(blocker / "bench")])
    assert e.value.code not in (0, None)
    assert f"--out {blocker / 'bench'}: cannot write there" in capsys.readouterr().err


def test_timeout_reaches_the_process_group_in_both_launch_paths(monkeypatch):
    """--timeout is the process group's timeout under torchrun and in spawned ranks alike."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # restored afterwards, whatever _spawned sets
        monkeypatch.setenv(var, "0")
    seen = []
    monkeypatch.setattr(ranks.dist, "init_process_group", lambda *a, **k: seen.append(k.get("timeout")))
    monkeypatch.setattr(ranks.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(ranks, "die_with_parent", lambda parent: None)  # the ranks run in this process
    monkeypatch.setattr(ranks.FromLauncher, "adopt", lambda self: None)

    class Finished(Exception):
        pass

    def exit_rank(code):
        raise Finished(code)

    monkeypatch.setattr(ranks, "exit_rank", exit_rank)
    args = argparse.Namespace(cmd="train", timeout=42.0)
    with pytest.raises(Finished):  # torchrun: RANK and WORLD_SIZE are set
        ranks.launch(lambda a: None, args, 1)

    class Ctx:  # spawned: run the rank entry point here, as start_processes would
        processes: list = []

        def join(self, timeout=None):
            return True

    started = {}
    monkeypatch.setattr(torch.multiprocessing, "start_processes",
                        lambda fn, args, **kw: started.update(fn=fn, args=args) or Ctx())
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    ranks.launch(lambda a: None, args, 1)
    with pytest.raises(Finished):
        started["fn"](0, *started["args"])
    assert seen == [timedelta(seconds=42)] * 2
    assert bench_args(["--world-size", "1", "--timeout", "7"]).timeout_s == 7.0
