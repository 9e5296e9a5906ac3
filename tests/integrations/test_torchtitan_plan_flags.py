"""``matrixfsdp plan ... --torchtitan`` prints the advice as torchtitan's command line, and
torchtitan's own parser (``ConfigManager``, 0.3.0) takes it: the degrees, the batch and
activation checkpointing land in its config as the advice says."""

from __future__ import annotations

import contextlib
import io

import pytest

pytest.importorskip("torchtitan")


def _printed_args(text: str) -> list[str]:
    """The arguments after ``-m torchtitan.train`` of the printed command."""
    lines = text.split("-m torchtitan.train \\\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [word for line in lines for word in line.strip().rstrip("\\").split()]


def test_plan_prints_torchtitan_flags_that_torchtitan_parses():
    from helpers.titan_cpu import import_torchtitan

    from matrixfsdp.__main__ import main
    import_torchtitan()
    from torchtitan.config.manager import ConfigManager
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the 70B advice, its search kept to tp 4 and pp 1
        main(["plan", "--model", "llama3-70b", "--ranks", "1024", "--tp", "4", "--pp", "1",
              "--torchtitan"])
    text = out.getvalue()
    assert "torchrun --nnodes 128 --nproc-per-node 8" in text, text[-2000:]
    args = _printed_args(text)
    assert args[:4] == ["--module", "matrixfsdp.integrations.torchtitan", "--config", "llama3_70b"]
    cfg = ConfigManager().parse_args(args)
    p = cfg.parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
            p.tensor_parallel_degree, p.pipeline_parallel_degree) == (4, 64, 4, 1)
    assert (cfg.training.seq_len, cfg.training.global_batch_size,
            cfg.training.local_batch_size) == (8192, 2048, 1)
    assert cfg.activation_checkpoint is None  # activation_checkpoint:none, as advised
    assert "tp_ownership" in text
