"""The demo that ``matrixfsdp train`` runs: a byte-level corpus (the Python standard
library's own sources, nothing downloaded) and a small sharded model (matrixfsdp's GPT or
a randomly initialised Hugging Face Llama)."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..fully_shard import fully_shard
from ..integrations.huggingface import shard_model
from .models import GPT, GPTConfig


# ---- data ---------------------------------------------------------------------------------
def stdlib_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Bytes of the Python standard library's own source files (sorted, so every rank and
    every run reads the same corpus). Nothing is downloaded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise SystemExit(f"no Python sources found under {root} for the demo corpus")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batch_at(corpus: torch.Tensor, step: int, rank: int, world: int, batch: int, seq: int,
             seed: int, split: str = "train") -> torch.Tensor:
    """``batch`` windows of ``seq + 1`` bytes for one rank: ranks read different windows of
    the same global batch. The last 5% of the corpus is held out for validation."""
    cut = int(len(corpus) * 0.95)
    lo, hi = (0, cut) if split == "train" else (cut, len(corpus))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + (split == "val"))
    starts = torch.randint(lo, hi - seq - 1, (world * batch,), generator=g)[rank * batch:(rank + 1) * batch]
    return torch.stack([corpus[s:s + seq + 1] for s in starts.tolist()])


# ---- model --------------------------------------------------------------------------------
def apply_gpt_tp(model: nn.Module, tp_mesh) -> None:
    """torchtitan's Llama plan on :class:`~matrixfsdp.train.models.GPT`'s blocks: Colwise
    q/k/v and MLP fc (gate), Rowwise o and proj (each tp rank computes whole heads and its
    columns of the MLP); embeddings, norms and head stay whole on every tp rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
        if hasattr(attn, "qkv"):
            raise ValueError("--tp: a fused qkv projection cannot be split by heads with ColwiseParallel")
        if getattr(mlp, "gated", False):
            plan["mlp.gate"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)


def data_rank(mesh) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel size): tp ranks read the same rows."""
    if "tp" in (mesh.mesh_dim_names or ()):
        return mesh["dp"].get_local_rank(), mesh["dp"].size()
    return mesh.get_local_rank(), mesh.size()


def checkpoint_forward(block: nn.Module) -> None:
    """Activation checkpointing the way transformers does it: the block's ``forward`` runs
    inside torch's non-reentrant ``checkpoint``, its MatrixFSDP hooks stay outside, so
    backward recomputes the block with the parameters its pre-backward gathered. Parameter
    names do not change."""
    from torch.utils.checkpoint import checkpoint
    forward = block.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    block.forward = checkpointed


def build_model(args, device: torch.device, mesh) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The sharded model of ``args.model`` and its loss: ``loss_fn(x)`` with ``x`` of shape
    ``(batch, seq + 1)`` bytes, the mean cross-entropy of predicting ``x[:, 1:]`` from the
    prefixes (``seq`` targets per row, for both models)."""

    shard_kw: dict[str, Any] = {}
    if args.mp == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        shard_kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float32)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.model == "hf-llama":
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as e:
            raise SystemExit(f"--model hf-llama needs transformers: {e}") from None
        cfg = LlamaConfig(vocab_size=256, hidden_size=args.d_model, num_attention_heads=args.heads,
                          num_key_value_heads=args.heads, num_hidden_layers=args.layers,
                          intermediate_size=args.mlp, max_position_embeddings=args.seq + 1,
                          tie_word_embeddings=False, use_cache=False)
        model = LlamaForCausalLM(cfg).to(device)
        if args.activation_checkpointing:  # HF's own switch: each decoder layer's whole call
            kw = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        shard_model(model, mesh=mesh, debug=args.debug, **shard_kw)

        # HF shifts the labels itself (logits[:, t] predicts labels[:, t + 1]), so the seq + 1
        # bytes go in as both input and labels: the targets are x[:, 1:], as for the GPT.
        def loss_fn(x: torch.Tensor) -> torch.Tensor:
            return model(input_ids=x, labels=x, use_cache=False).loss
        return model, loss_fn

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=args.heads,
                    n_layers=args.layers, d_mlp=args.mlp)
    model = GPT(cfg).to(device)
    if "tp" in (mesh.mesh_dim_names or ()):  # --tp: the TP plan first, then fully_shard over dp
        apply_gpt_tp(model, mesh["tp"])
        mesh = mesh["dp"]
    for block in model.layers:
        fully_shard(block, mesh=mesh, **shard_kw)
        if args.activation_checkpointing:
            checkpoint_forward(block)
    fully_shard(model, mesh=mesh, debug=args.debug, **shard_kw)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        return model.loss(x[:, :-1], x[:, 1:])
    return model, loss_fn
