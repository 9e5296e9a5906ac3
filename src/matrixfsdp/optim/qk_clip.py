"""QK-clip (Kimi K2's MuonClip): after each optimizer step, shrink W_q and W_k of every
attention head whose largest pre-softmax logit in the step exceeded ``tau``.

For head h with largest logit ``S_h`` over the step's batch on every data-parallel rank,
``eta_h = min(1, tau / S_h)``; then ``W_q[h] *= eta_h ** alpha`` and ``W_k[h] *= eta_h **
(1 - alpha)`` (biases too), so the head's logits scale by ``eta_h`` and its largest is at
most ``tau``. Under GQA a k head shared by several q heads takes the smallest ``eta`` of
its q heads (the largest logit over them). Multi-head latent attention (MLA) as Kimi K2
clips it: each head's q no-rope rows by ``eta ** alpha``, its q rope rows by ``eta``, its
k rows of the kv up-projection by ``eta ** (1 - alpha)``; the shared rope key stays.

Where the work runs: each attention forward reduces its per-head maxima over the model's
data-parallel ranks with one all-reduce (MAX) of ``heads`` floats, issued and waited for in
forward (on NCCL an enqueue on the stream, no host wait), so ``optimizer.step()`` stays free
of collectives. It was once left in flight until the step's post-hook, and a gloo rank's
heap was corrupted now and then under HSDP 2x2 (``malloc(): unsorted double linked list
corrupted``). The cause was torch's profiler, not this code: the tests' profiler window
closed while this gloo all-reduce was still in flight, and gloo's worker thread then wrote
the op's profiler record after the profiler had stopped (docs/design.md, "QK-clip's
all-reduce"). Waiting in forward costs nothing measurable and stays. The rescaling is
element-wise on whatever rows of W_q / W_k a rank holds: the whole matrix on
its owner, its rows of a row-sharded one, nothing elsewhere; under HSDP the replica that
stepped a matrix scales it and the broadcast before its next gather carries that.

Attention reports its logits through :meth:`QKClip.observe`. transformers models need no
change (an attention function registered with transformers' ``AttentionInterface``
computes the maxima, then runs torch's SDPA); any other attention calls
``self.qk_clip.observe(self, q, k)`` in its forward when ``qk_clip`` is set (this
library's GPT does). The maxima are computed in blocks of query rows, never the whole
score matrix at once.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .._compat import in_backward
from ..runtime.module import get_root
from ..runtime.param import placement_of, sharded_param

__all__ = ["QKClip", "max_logits"]

HF_IMPLEMENTATION = "matrixfsdp_qk_clip"
_CLIPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> QKClip


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, *,
               causal: bool = True, mask: torch.Tensor | None = None,
               block: int = 256) -> torch.Tensor:
    """The largest pre-softmax logit of each q head: ``q (B, H, T, d)``, ``k (B, G, S, d)``
    with ``G`` dividing ``H`` (GQA), over the positions attention reads (``causal``: key
    ``j <= i + S - T``; ``mask``: boolean, True = attend, or additive), computed ``block``
    query rows at a time. Returns ``(H,)`` float32."""
    B, H, T, d = q.shape
    G, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = k.float().repeat_interleave(H // G, dim=1) if G != H else k.float()
    out = torch.full((H,), -math.inf, dtype=torch.float32, device=q.device)
    keys = torch.arange(S, device=q.device)
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        s = torch.matmul(q[:, :, t0:t1].float(), k.mT) * scale  # (B, H, t, S)
        if causal:
            rows = torch.arange(t0, t1, device=q.device) + (S - T)
            s.masked_fill_(keys[None, :] > rows[:, None], -math.inf)
        if mask is not None:
            m = mask[..., t0:t1, :]
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
        out = torch.maximum(out, s.amax(dim=(0, 2, 3)))
    return out


# What a block of rows is scaled by: "q" blocks by their own q head's eta, "k" blocks by the
# smallest eta of the q heads sharing that k head; to the power alpha, 1 - alpha, or 1.
POWERS = {"alpha": lambda a: a, "1-alpha": lambda a: 1.0 - a, "1": lambda a: 1.0}


@dataclass
class _Rows:
    """Head blocks of one projection: head ``h`` spans rows ``row0 + h * stride`` on; each
    ``(start, length, eta, power)`` of ``segments`` is a range inside it and its factor."""

    params: list[torch.Tensor]  # weight (and bias)
    row0: int
    stride: int
    heads: int
    segments: list[tuple[int, int, str, str]]

    def factors(self, eta_q: torch.Tensor, eta_k: torch.Tensor, alpha: float) -> torch.Tensor:
        out = torch.ones(self.heads, self.stride, device=eta_q.device)
        for start, length, which, power in self.segments:
            eta = eta_q if which == "q" else eta_k
            out[:, start:start + length] = (eta ** POWERS[power](alpha))[:, None]
        return out.flatten()


@dataclass
class _Layer:
    """One attention module: its q heads, the k heads they share, where their rows lie,
    and this step's pending maxima."""

    name: str
    heads: int
    kv_heads: int
    rows: list[_Rows]
    pending: list[torch.Tensor] = field(default_factory=list)


def _params(lin: nn.Linear) -> list[torch.Tensor]:
    return [t for t in (lin.weight, lin.bias) if t is not None]


def _mla(name: str, attn: nn.Module) -> _Layer | None:
    """Multi-head latent attention (DeepSeek's, transformers' names): Kimi K2's rule for it
    scales each head's unshared parts, q's no-rope rows by eta^alpha and its rope rows by
    eta, the kv up-projection's k rows by eta^(1 - alpha); the shared rope key stays."""
    q = getattr(attn, "q_b_proj", None) or getattr(attn, "q_proj", None)
    kv = getattr(attn, "kv_b_proj", None)
    heads = getattr(attn, "num_heads", None)
    nope, rope, v = (getattr(attn, a, None) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if not (isinstance(q, nn.Linear) and isinstance(kv, nn.Linear) and heads and nope and rope and v):
        return None
    return _Layer(name, heads, heads, [
        _Rows(_params(q), 0, nope + rope, heads, [(0, nope, "q", "alpha"), (nope, rope, "q", "1")]),
        _Rows(_params(kv), 0, nope + v, heads, [(0, nope, "q", "1-alpha")])])


def _layer(name: str, attn: nn.Module) -> _Layer | None:
    """The q/k layout of an attention module (transformers', torchtitan's, this library's
    GPT's names, GQA, a fused qkv and MLA included), None if it is not one."""
    mla = _mla(name, attn)
    if mla is not None:
        return mla
    hd = getattr(attn, "head_dim", None)
    for q, k in (("q_proj", "k_proj"), ("wq", "wk"), ("q", "k")):
        lq, lk = getattr(attn, q, None), getattr(attn, k, None)
        if isinstance(lq, nn.Linear) and isinstance(lk, nn.Linear):
            heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None)
            hd = hd or (lq.out_features // heads if heads else None)
            if not hd:
                return None
            h, g = lq.out_features // hd, lk.out_features // hd
            return _Layer(name, h, g, [_Rows(_params(lq), 0, hd, h, [(0, hd, "q", "alpha")]),
                                       _Rows(_params(lk), 0, hd, g, [(0, hd, "k", "1-alpha")])])
    fused = getattr(attn, "qkv", None)
    heads = getattr(attn, "n_heads", None)
    if isinstance(fused, nn.Linear) and heads:
        g = getattr(attn, "n_kv_heads", heads)
        hd = hd or (fused.out_features // (heads + 2 * g))
        return _Layer(name, heads, g, [
            _Rows(_params(fused), 0, hd, heads, [(0, hd, "q", "alpha")]),
            _Rows(_params(fused), heads * hd, hd, g, [(0, hd, "k", "1-alpha")])])
    return None


class QKClip:
    """QK-clip for a model sharded by :func:`matrixfsdp.fully_shard` (module docstring).

    ``QKClip(model, tau=100.0, alpha=0.5)`` finds the attention modules (q/k projections
    by name), hooks itself after ``optimizer``'s step if given (else call :meth:`apply`
    after each ``optimizer.step()``), and for transformers models switches the attention
    implementation to one that reports the logits (then SDPA). ``last_max`` holds, per
    attention module name, the reduced per-head maxima of the last step (before clipping).
    """

    def __init__(self, model: nn.Module, *, tau: float = 100.0, alpha: float = 0.5,
                 optimizer: torch.optim.Optimizer | None = None):
        if not tau > 0 or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"matrixfsdp.QKClip: tau={tau} must be > 0, alpha={alpha} in [0, 1]")
        self.root = get_root(model)
        if self.root.tp is not None:
            raise NotImplementedError(
                "matrixfsdp.QKClip under tensor parallelism: each tp rank sees its own heads' "
                "logits; not supported yet (docs/optimizers.md#qk-clip)")
        self.tau, self.alpha = float(tau), float(alpha)
        self.layers: dict[int, _Layer] = {}
        self.last_max: dict[str, torch.Tensor] = {}
        hf = []
        for name, mod in model.named_modules():
            layer = _layer(name, mod)
            if layer is None:
                continue
            self.layers[id(mod)] = layer
            _CLIPS[mod] = self
            if getattr(getattr(mod, "config", None), "_attn_implementation", None) is not None:
                hf.append(mod)
            else:
                mod.qk_clip = self
        if not self.layers:
            raise ValueError(f"matrixfsdp.QKClip: no attention module with q/k projections in "
                             f"{type(model).__name__}")
        if hf:
            _use_hf_attention(model)
        if optimizer is not None:
            optimizer.register_step_post_hook(lambda *_: self.apply())

    def observe(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
                *, causal: bool = True, mask: torch.Tensor | None = None) -> None:
        """From ``attn``'s forward: its q ``(B, H, T, d)`` and k ``(B, G, S, d)`` as the
        softmax sees them (after rotary embedding and any q/k norm). All-reduces (MAX) the
        per-head maxima over the data-parallel ranks. Skipped in eval mode,
        without grad (a validation forward), and when activation checkpointing recomputes the
        forward inside backward."""
        if not attn.training or not torch.is_grad_enabled() or in_backward():
            return
        layer = self.layers[id(attn)]
        m = max_logits(q.detach(), k.detach(), scale, causal=causal, mask=mask)
        group = self.root.groups.world
        if dist.get_world_size(group) > 1:  # waited for here: see the module's docstring
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        layer.pending.append(m)

    @torch.no_grad()
    def apply(self) -> None:
        """After the optimizer step: scale the W_q / W_k head blocks (and biases) this rank
        holds, for every head whose largest logit this step exceeded ``tau``."""
        silent = [layer.name for layer in self.layers.values() if not layer.pending]
        if silent and len(silent) < len(self.layers):
            raise RuntimeError(
                f"matrixfsdp.QKClip: attention modules {silent[:4]} reported no logits this "
                "step while others did: call self.qk_clip.observe(self, q, k) in their forward")
        etas = []
        for layer in self.layers.values():
            if not layer.pending:
                continue
            s = torch.stack(layer.pending).amax(0)
            layer.pending.clear()
            self.last_max[layer.name] = s
            etas.append((layer, (self.tau / s).clamp(max=1.0)))
        if not etas:
            return
        # one host read per step (which layers have a head over tau), not one per layer
        clipped = torch.stack([(eta < 1.0).any() for _, eta in etas]).tolist()
        for (layer, eta), hit in zip(etas, clipped):
            if not hit:
                continue
            eta_k = eta.view(layer.kv_heads, -1).amin(1)  # a shared k head: its q heads' max
            for rows in layer.rows:
                factors = rows.factors(eta, eta_k, self.alpha)
                for p in rows.params:
                    _scale_rows(p, rows.row0, factors)


def _scale_rows(p: torch.Tensor, row0: int, factors: torch.Tensor) -> None:
    """Multiply the global rows ``[row0, row0 + len(factors))`` of parameter ``p`` by
    ``factors``, on the rows this rank holds and steps."""
    info, pl = sharded_param(p), placement_of(p)
    if info is None:  # not sharded: the whole tensor is here
        start, stop = 0, p.shape[0]
    else:
        if not p.numel() or not info.steps_here():
            return
        start, stop = pl.row_ranges[info.shard_rank]
    lo, hi = max(start, row0), min(stop, row0 + len(factors))
    if lo >= hi:
        return
    f = factors[lo - row0:hi - row0].to(device=p.device, dtype=p.dtype)
    p[lo - start:hi - start].mul_(f.view(-1, *[1] * (p.dim() - 1)))


def _use_hf_attention(model: nn.Module) -> None:
    """Switch a transformers model to an attention function that reports each call's
    logits to the module's QKClip, then runs transformers' SDPA attention."""
    from transformers import AttentionInterface  # optional dependency
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        clip = _CLIPS.get(module)
        if clip is not None:
            causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
            mask = attention_mask[..., :key.shape[2]] if attention_mask is not None else None
            clip.observe(module, query, key, kwargs.get("scaling"), causal=causal, mask=mask)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(HF_IMPLEMENTATION, attention)
    AttentionMaskInterface.register(HF_IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(HF_IMPLEMENTATION)
