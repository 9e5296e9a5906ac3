"""torchtitan's optimizer container on MatrixFSDP: one ``mf.Muon`` per model part from
torchtitan's own param groups (``Muon`` / ``DistMuon`` groups as Muon groups, ``AdamW`` as
AdamW), its flat FQN-keyed state holding the group keys torch's own optimizers hold, and
Moonlight's Muon + AdamW split over a config's AdamW groups (:func:`muon_optimizer`). Part
of :mod:`matrixfsdp.integrations.torchtitan`, the one line's module."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..diagnosis.agree import object_device
from ..optim.groups import ADAMW_DEFAULTS, MUON_DEFAULTS
from ..optim.muon import Muon
from ..optim.plan_stamp import PLAN_KEYS
from ..optim.state_dict_hooks import check_decoupled
from ..optim.watch import watch
from ..runtime.param import placement_of

try:  # torchtitan is optional: this module is only for its users
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, load_flat_optim_state_dict
    from torchtitan.distributed.flex_shard import BlockShard
except ImportError as e:  # pragma: no cover (torchtitan is a test dependency)
    raise ImportError("matrixfsdp.integrations.torchtitan needs torchtitan (tested with 0.3.0)") from e

__all__ = ["BLOCK_MATRICES", "MUON_NAMES", "MatrixOptimizersContainer", "muon_optimizer"]

MUON_NAMES = ("Muon", "DistMuon")  # torchtitan's optimizer names that become Muon groups
# The matrices of a decoder's blocks, as its param-group patterns match names (re.search):
# torchtitan's attention and feed-forward projections, fused or not (``wqkv``, ``wo``,
# ``w1``, MLA's ``wkv_a``, a MoE's shared experts: modules named ``w...``), and the routed
# experts' stacks (``w1_EFD``); not the norms inside attention (qwen3's ``q_norm``), nor
# MoE routers (``router.gate``) and MTP's ``eh_proj``, which stay on AdamW.
BLOCK_MATRICES = r"(?:attention|feed_forward|moe)\.(?:.*\.)?(?:w\w*\.weight|w\d\w*)$"


# ---- the optimizer ------------------------------------------------------------------------
def _heads(fqn: str, layout: Any, shape: torch.Size) -> int | None:
    """DistMuon's compute layout of one matrix as ``mf.Muon``'s ``num_heads``: a
    ``BlockShard(dim=0, block_size=r)`` on any mesh axis steps each ``r`` rows as a matrix of
    its own, which is per-head Muon with ``rows / r`` heads; ``Owned``, ``Replicate`` and
    ``Shard(0)`` of an expert stack step whole matrices."""
    shardings = getattr(layout, "shardings_by_mesh_axis", {}) or {}
    blocks = {s.block_size for s in shardings.values() if isinstance(s, BlockShard) and s.dim == 0}
    bad = [s for s in shardings.values() if isinstance(s, BlockShard) and s.dim != 0]
    if bad or len(blocks) > 1:
        raise NotImplementedError(f"matrixfsdp: DistMuon compute layout of '{fqn}' ({layout}) "
                                  "splits it other than into row blocks of one size")
    if not blocks:
        return None
    r = blocks.pop()
    if shape[-2] % r:
        raise ValueError(f"matrixfsdp: DistMuon BlockShard(block_size={r}) of '{fqn}' does not "
                         f"divide its {shape[-2]} rows")
    return shape[-2] // r if shape[-2] // r > 1 else None


def _muon_group(group: dict, layouts: dict, name: str) -> list[dict]:
    """torchtitan's group (``params``, ``param_names``, its kwargs) as ``mf.Muon`` groups:
    one per head count, Muon's options only."""
    extra = sorted(k for k in group if k not in MUON_DEFAULTS and k not in
                   ("params", "param_names", "fused", "foreach"))
    if extra:
        raise ValueError(f"matrixfsdp: {name} group of '{group['param_names'][0]}' has option(s) "
                         f"{extra}, which Muon does not take")
    opts = {k: v for k, v in group.items() if k in MUON_DEFAULTS}
    if isinstance(opts.get("ns_dtype"), str):
        opts["ns_dtype"] = getattr(torch, opts["ns_dtype"])
    by_heads: dict[int | None, tuple[list, list]] = {}
    for p, fqn in zip(group["params"], group["param_names"]):
        shape = placement_of(p).spec.shape if placement_of(p) is not None else p.shape  # the whole
        heads = _heads(fqn, layouts[fqn], shape) if fqn in layouts else opts.get("num_heads")
        ps, ns = by_heads.setdefault(heads, ([], []))
        ps.append(p)
        ns.append(fqn)
    return [dict(params=ps, param_names=ns, use_muon=True, **{**opts, "num_heads": h})
            for h, (ps, ns) in by_heads.items()]


def _adamw_group(group: dict, name: str) -> dict:
    if name == "Adam" and group.get("weight_decay", 0):
        raise NotImplementedError(
            f"matrixfsdp: an Adam group with weight_decay={group['weight_decay']} (L2 in the "
            f"gradient) for '{group['param_names'][0]}': matrixfsdp.Muon steps AdamW (decoupled "
            "decay); use optimizer_name='AdamW', or Adam with weight_decay=0 (the same update)")
    extra = sorted(k for k in group if k not in ADAMW_DEFAULTS and k not in ("params", "param_names"))
    if extra:
        raise ValueError(f"matrixfsdp: {name} group of '{group['param_names'][0]}' has option(s) "
                         f"{extra}, which AdamW does not take")
    return dict(group, use_muon=False)


# torch's own group keys, which a checkpoint of torch.optim.Muon / AdamW (FSDP2) holds:
# torchtitan's flat optimizer state keeps these only, so that it loads either way
_TORCH_KEYS = {True: set(MUON_DEFAULTS) - {"ns_dtype", "num_heads", "batch_ns"},
               False: set(ADAMW_DEFAULTS) | {"decoupled_weight_decay"}}
_SCHEDULER_KEYS = {"initial_lr"}


def unmatched_anywhere(param_groups: list[Any], matched: set[int]) -> list[str]:
    """The patterns of ``param_groups`` that no rank's model parts have a parameter for
    (``matched``: the ids of those this rank's parts match). A pipeline rank holds some parts
    only, so a pattern may match on another rank: one set-up all-reduce (MAX over the world)
    gives every rank the same answer, and the same error where there is one."""
    flags = [int(id(g) in matched) for g in param_groups]
    if flags and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor(flags, dtype=torch.int32, device=object_device(None))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flags = t.tolist()
    return [g.pattern for g, f in zip(param_groups, flags) if not f]


class MatrixOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer``, building ``matrixfsdp.Muon`` from its param
    groups (one per model part): ``Muon`` / ``DistMuon`` groups as Muon groups (DistMuon's
    per-matrix ``compute_sharding_by_fqn`` row blocks as ``num_heads``), ``AdamW`` (and
    ``Adam`` without weight decay) as AdamW groups. Its flat, FQN-keyed state holds the
    group keys torch's own ``Muon`` / ``AdamW`` hold, so a checkpoint crosses to and from
    torchtitan on FSDP2; this library's own group options (``ns_dtype``, ``num_heads``,
    ``batch_ns``) come from the config on load."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        impl = self._build_impl_kwargs(config)
        self._impl = impl  # torchtitan gives every group these (fused, foreach): saved as such
        self.optimizers, self.model_parts = [], model_parts
        all_params = []
        matched: set[int] = set()
        for model in model_parts:
            part_groups = _groups_matching(model, config.param_groups)
            matched.update(map(id, part_groups))
            if not part_groups:  # a pipeline part with no trainable parameter
                continue
            by_name, _ = self._build_param_groups(model, part_groups, impl)
            groups = []
            for name, opt_groups in by_name.items():
                if name in MUON_NAMES:
                    layouts = config.optimizer_factory_kwargs_by_name.get(name, {}).get(
                        "compute_sharding_by_fqn", {})
                    groups += [g for og in opt_groups for g in _muon_group(og, layouts, name)]
                elif name in ("AdamW", "Adam"):
                    groups += [_adamw_group(og, name) for og in opt_groups]
                else:
                    raise NotImplementedError(
                        f"matrixfsdp: optimizer '{name}' in torchtitan's param groups: "
                        f"MatrixOptimizersContainer builds {', '.join(MUON_NAMES)} (Muon on whole "
                        "matrices) and AdamW; for another optimizer on the matrices use "
                        "mf.matrix_optimizer (docs/optimizers.md)")
            self.optimizers.append(Muon(groups))
            all_params += [p for g in groups for p in g["params"]]
        unmatched = unmatched_anywhere(config.param_groups, matched)
        if unmatched:  # torchtitan's own error, for a pattern no part has a parameter for
            raise ValueError(f"Optimizer param_groups pattern '{unmatched[0]}' matched no "
                             "parameters")
        self._validate_params(all_params)
        self._post_init(all_params)
        # it steps its mf.Muon, which checks its own groups: the container's own step
        # pre-hook does the step's bookkeeping only
        watch(self, checks_itself=True)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for opt in self.optimizers:
            opt.init_state()
            flat = get_flat_optim_state_dict(opt)
            for g in opt.param_groups:
                keep = _TORCH_KEYS[bool(g["use_muon"])] | _SCHEDULER_KEYS
                drop = [k for k in (*g, *PLAN_KEYS) if k not in keep]
                for fqn in g["param_names"]:
                    for key in drop:
                        flat.pop(f"param_groups.{fqn}.{key}", None)
                    if g["use_muon"]:
                        flat.update({f"param_groups.{fqn}.{k}": v for k, v in self._impl.items()})
            out.update(flat)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt in self.optimizers:
            opt.init_state()
            flat = dict(state_dict)
            for g in opt.param_groups:
                fqn = g["param_names"][0]
                saved = flat.get(f"param_groups.{fqn}.decoupled_weight_decay")
                check_decoupled({"decoupled_weight_decay": saved}, g,
                                f"matrixfsdp: torchtitan checkpoint, the group of '{fqn}'")
                for key, value in g.items():  # this library's own options: from the config
                    if key not in ("params", "param_names"):
                        flat.setdefault(f"param_groups.{fqn}.{key}", value)
            load_flat_optim_state_dict(opt, flat)


def _groups_matching(model: nn.Module, configs: list) -> list:
    """torchtitan's param-group configs that get a parameter of ``model`` (first match wins,
    as it assigns them): under pipeline parallelism a part may hold no Muon matrix (the
    embedding alone), where torchtitan's container would refuse the Muon pattern as
    matching nothing; here that part's optimizer has AdamW groups only."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    claimed: set[str] = set()
    out = []
    for pg in configs:
        pattern = re.compile(pg.pattern)
        mine = [n for n in names if n not in claimed and pattern.search(n)]
        if mine:
            out.append(pg)
            claimed.update(mine)
    return out


def muon_optimizer(adamw: OptimizersContainer.Config, *, muon_pattern: str = BLOCK_MATRICES,
                   **muon_kwargs: Any) -> MatrixOptimizersContainer.Config:
    """Moonlight's Muon + AdamW split over a config's AdamW groups: parameters matching
    ``muon_pattern`` (torchtitan's regex, searched in the parameter name; default: the
    blocks' projection matrices) get Muon with ``adjust_lr_fn="match_rms_adamw"`` and the
    AdamW groups' lr and weight decay (overridden by ``muon_kwargs``); the rest keep ``adamw``."""
    base = next((g for g in adamw.param_groups if g.optimizer_name == "AdamW"), None)
    if base is None:
        raise ValueError("matrixfsdp: muon_optimizer needs a config with an AdamW group")
    kw = base.optimizer_kwargs
    muon = {"lr": kw.get("lr", MUON_DEFAULTS["lr"]), "weight_decay": kw.get("weight_decay", 0.1),
            "adjust_lr_fn": "match_rms_adamw", **muon_kwargs}
    return MatrixOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=muon_pattern, optimizer_name="Muon",
                                       optimizer_kwargs=muon), *adamw.param_groups],
        implementation=adamw.implementation,
        optimizer_factory_kwargs_by_name=dict(adamw.optimizer_factory_kwargs_by_name))
