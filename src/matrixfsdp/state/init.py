"""Initialising a model built on the meta device, one module at a time.

FSDP2's recipe is: build the model under ``torch.device("meta")``, ``fully_shard`` it,
``to_empty``, then ``reset_parameters``. MatrixFSDP allocates this rank's shards itself
(uninitialised) when the root is planned; :func:`init_weights` then fills them.

How: the modules are visited in a fixed order. For a visited module, every parameter of
its own (``module._parameters``, not its children's) is replaced by a temporary *full*
tensor on the mesh device, the module's init runs on it exactly as it would in one process,
this rank's rows are copied into its shard, and the shard is registered again. Meta
buffers of the module are materialised (full, replicated) and initialised by the same call.

* Memory: this rank's shards plus the full parameters of ONE module at a time (the largest
  is usually the embedding or the output head), never the whole model.
* No communication: every rank runs every init on the full tensor, from the same seed, in
  the same order, so every rank computes the same full tensor and keeps its own rows. A
  Muon matrix is generated on every rank and kept by its owner only. The price is compute:
  every rank draws the random numbers of the whole model (see docs/init.md).
* Exactness: the shards equal, bit for bit, the rows of a one-process model initialised by
  the same calls in the same order after the same ``torch.manual_seed`` on the same device
  type, at any world size.

Rules the init must follow (checked where cheap, see :func:`init_weights`): on each visit it
writes all of a parameter or none of it, without reading its previous value, and it writes
no parameter of another module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._compat import tensor_version
from ..runtime.module import get_root
from ..runtime.param import placement_of, sharded_param
from ..runtime.root import Root
from ..runtime.storage import local_rows
from ..runtime.tp import global_ok

InitFn = Callable[[nn.Module], object]
_CHUNK = 1 << 22  # elements per chunk of the NaN scan: a 4 MiB boolean temporary


def init_weights(model: nn.Module, init_fn: InitFn | None = None) -> None:
    """Initialise the shards of a ``fully_shard``-ed model, one module's parameters at a time.

    Call it on every rank, after ``fully_shard`` on the blocks and the root, typically on a
    model built under ``torch.device("meta")``; seed first (``torch.manual_seed``). It issues
    no collective. Peak memory per rank: its shards plus the full (unsharded) parameters of
    the largest single module, on the mesh device.

    Args:
        model: the root module passed to the last ``fully_shard`` call.
        init_fn: called as ``init_fn(module)`` on every module in ``model.modules()`` order
            (parents before children), as in ``for m in model.modules(): init_fn(m)`` on one
            process; e.g. a Hugging Face model's ``model._init_weights``. ``None``:
            - a ``transformers.PreTrainedModel``: the order ``from_config`` runs on one process
              (torch's constructor inits, then the nested ``post_init`` passes: each
              ``PreTrainedModel``'s ``_initialize_weights``, children before parents; a tied
              copy's init is drawn and dropped, as ``tie_weights`` drops it); the result
              equals ``torch.manual_seed(s); AutoModel.from_config(config)``;
            - any other model: each module's ``reset_parameters()`` (and
              ``nn.MultiheadAttention._reset_parameters``, which its constructor calls), in
              the order construction runs them (children before parents; for leaf modules
              such as ``nn.Linear`` that is module order): the result equals building the
              model on the device after the same seed.

    During each ``init_fn(module)`` call the module's own parameters are full-size tensors
    (plain ``nn.Parameter``\\ s filled with NaN) and its meta buffers real full-size tensors;
    the parameters of every other module are this rank's shards.

    Raises:
        ValueError: ``model`` is not a root; an init wrote only part of a parameter or a meta
            buffer (or read its value: it has none yet); a parameter or meta buffer is left
            uninitialised at the end (e.g. a module without ``reset_parameters``: pass
            ``init_fn``); a parameter is on meta and not sharded.
        NotImplementedError: an init wrote another module's parameter (it would see only
            this rank's rows).
    """
    root = get_root(model)
    if root.module is not model:
        raise ValueError(f"matrixfsdp.init_weights: pass the root module "
                         f"({type(root.module).__name__}), not a {type(model).__name__} inside it")
    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    # The shards as registered on the modules (a tied shard appears at several places).
    pending = {id(p): p for m in model.modules() for p in m._parameters.values()
               if placement_of(p) is not None}  # not initialised yet
    steps, discard = _steps(model, init_fn)
    with torch.no_grad():
        for module, fn in steps:
            _visit(module, fn, root, names, pending, discard)
    if pending:
        left = sorted(placement_of(p).spec.name for p in pending.values())
        raise ValueError(
            f"matrixfsdp.init_weights: {len(left)} parameter(s) were not initialised: "
            f"{', '.join(left[:8])}{', ...' if len(left) > 8 else ''}. Their modules have no "
            "reset_parameters (or the init skipped them); pass init_fn that writes them")
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ValueError(f"matrixfsdp.init_weights: buffer(s) {', '.join(meta[:8])} are still on the "
                         "meta device; pass init_fn that sets them (e.g. recompute rotary inv_freq)")
    for u in root.units:
        u.needs_init = False


# ---- visiting order ----------------------------------------------------------------------
Steps = Iterable[tuple[nn.Module, InitFn]]


def _steps(model: nn.Module, init_fn: InitFn | None) -> tuple[Steps, set[tuple[int, str]]]:
    """The (module, init) calls in order, and the (id(module), attribute) places whose init
    result is dropped (the tied copies Hugging Face ties only after its init)."""
    if init_fn is not None:
        return ((m, init_fn) for m in model.modules()), set()
    pretrained = _pretrained_model_class()
    if pretrained is not None and isinstance(model, pretrained):
        return hf_from_config_steps(model), _hf_tied_copies(model)
    return _constructor_steps(model), set()


def _reset(module: nn.Module) -> None:
    if isinstance(module, nn.MultiheadAttention):
        module._reset_parameters()
    else:
        module.reset_parameters()


def _has_reset(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or callable(getattr(module, "reset_parameters", None))


def _constructor_steps(module: nn.Module) -> list[tuple[nn.Module, InitFn]]:
    """``reset_parameters`` in the order construction calls it: a torch module calls it at the
    end of its ``__init__``, after its children were built (post-order)."""
    steps = [s for child in module.children() for s in _constructor_steps(child)]
    if _has_reset(module):
        steps.append((module, _reset))
    return steps


def _pretrained_model_class() -> type | None:
    mod = sys.modules.get("transformers.modeling_utils")  # never import transformers ourselves
    return getattr(mod, "PreTrainedModel", None)


def hf_from_config_steps(model: nn.Module) -> list[tuple[nn.Module, InitFn]]:
    """The init calls ``from_config`` makes on one process (transformers 5.x), in order.

    Construction runs torch's constructor inits (``reset_parameters``, post-order) and, at the
    end of each ``PreTrainedModel.__init__``, ``post_init()`` -> ``initialize_weights()``:
    ``smart_apply`` visits that submodel's modules children-first and calls the nearest
    ``PreTrainedModel``'s ``_initialize_weights``, which skips modules already flagged
    ``_is_hf_initialized`` (those of an inner submodel, done by its own ``post_init``).
    The flags are cleared first, so this always initialises from scratch.
    """
    pretrained = _pretrained_model_class()
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    steps: list[tuple[nn.Module, InitFn]] = []

    def hf_init(owner: nn.Module) -> InitFn:
        custom = owner.is_custom_code() if hasattr(owner, "is_custom_code") else False
        return lambda m: owner._initialize_weights(m, custom)

    def smart_apply(module: nn.Module, fn: InitFn) -> None:
        for child in module.children():
            smart_apply(child, hf_init(child) if isinstance(child, pretrained) else fn)
        steps.append((module, fn))

    def construct(module: nn.Module) -> None:
        for child in module.children():
            construct(child)
        if _has_reset(module):
            steps.append((module, _reset))
        if isinstance(module, pretrained):
            smart_apply(module, hf_init(module))

    construct(model)
    return steps


def _hf_tied_copies(model: nn.Module) -> set[tuple[int, str]]:
    """On one process ``from_config`` initialises a tied copy (``lm_head.weight``) as a
    parameter of its own, then ``tie_weights()`` points it at its source: the copy's random
    numbers are drawn and thrown away. The meta model is tied already, so its init at the
    copy's place must be drawn and dropped the same way."""
    out = set()
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        try:
            same = model.get_parameter(target) is model.get_parameter(source)
        except AttributeError:
            continue
        if same:
            prefix, _, attr = target.rpartition(".")
            out.add((id(model.get_submodule(prefix)), attr))
    return out


# ---- one visit -------------------------------------------------------------------------
def _visit(module: nn.Module, fn: InitFn, root: Root, names: dict[int, str],
           pending: dict[int, nn.Parameter], discard: set[tuple[int, str]]) -> None:
    """Run ``fn(module)`` with full tensors in place of the module's shards; keep this rank's rows."""
    mname = names.get(id(module), type(module).__name__)
    shards, scratch = _full_params(module, mname, discard)
    meta_buffers = {a: b for a, b in module._buffers.items() if b is not None and b.is_meta}
    new_buffers: dict[str, torch.Tensor] = {}
    for attr, b in meta_buffers.items():
        fill = float("nan") if b.is_floating_point() or b.is_complex() else 0
        device = root.units[0].local.device
        if isinstance(b, DTensor):  # a tensor-parallel buffer (a RoPE cache): a DTensor still
            local = torch.full(b.to_local().shape, fill, dtype=b.dtype, device=device)
            new_buffers[attr] = DTensor.from_local(local, b.device_mesh, b.placements,
                                                   run_check=False, shape=b.shape, stride=b.stride())
        else:
            new_buffers[attr] = torch.full(b.shape, fill, dtype=b.dtype, device=device)
    module._buffers.update(new_buffers)
    written = [f for _, f, _ in shards.values()] + list(new_buffers.values())
    before = {id(t): tensor_version(t) for t in written}
    local_versions = [tensor_version(u.local) for u in root.units]
    values = _call_init(module, fn, shards, scratch, meta_buffers)
    for u, v in zip(root.units, local_versions):
        if tensor_version(u.local) != v:
            raise NotImplementedError(
                f"matrixfsdp.init_weights: the init of module '{mname}' ({type(module).__name__}) "
                f"wrote a parameter of another module (in unit '{u.name}'), where it sees only this "
                "rank's rows of it; make each module's init write only its own parameters")
    _keep_params(mname, shards, values, before, root, pending)
    _keep_buffers(module, mname, meta_buffers, new_buffers, before)


def _full_params(module: nn.Module, mname: str, discard: set[tuple[int, str]]):
    """The module's shards, each with a NaN-filled full tensor and the attributes it sits at,
    and the discarded places (a full tensor of their own, dropped after the init)."""
    shards: dict[int, tuple[nn.Parameter, nn.Parameter, list[str]]] = {}  # id -> (shard, full, attrs)
    scratch: dict[str, nn.Parameter] = {}
    for attr, p in module._parameters.items():
        if p is None:
            continue
        if (id(module), attr) in discard:
            scratch[attr] = p
            continue
        if placement_of(p) is None:
            if p.is_meta:
                raise ValueError(f"matrixfsdp.init_weights: parameter '{mname}.{attr}' is on the meta "
                                 "device and not sharded by matrixfsdp (is it outside the root?)")
            continue  # a plain tensor: the init writes it in place, as on one process
        if id(p) not in shards:
            shards[id(p)] = (p, _nan_full(p), [])
        shards[id(p)][2].append(attr)
    return shards, scratch


def _call_init(module: nn.Module, fn: InitFn, shards: dict, scratch: dict, meta_buffers: dict
               ) -> dict[int, torch.Tensor]:
    """``fn(module)`` with the full tensors registered; the shards back afterwards. Returns
    what each full tensor's places hold then (an init may replace a tensor, not write it)."""
    for _, full, attrs in shards.values():
        for attr in attrs:
            module._parameters[attr] = full
    for attr, p in scratch.items():
        module._parameters[attr] = _nan_full(p)
    try:
        fn(module)
    except BaseException:
        module._buffers.update(meta_buffers)
        raise
    finally:
        values = {i: next((v for v in (module._parameters[a] for a in attrs) if v is not full), full)
                  for i, (_, full, attrs) in shards.items()}
        for p, _, attrs in shards.values():
            for attr in attrs:
                module._parameters[attr] = p
        module._parameters.update(scratch)
    return values


def _keep_params(mname: str, shards: dict, values: dict, before: dict, root: Root,
                 pending: dict[int, nn.Parameter]) -> None:
    for i, (p, full, _) in shards.items():
        value, name = values[i], placement_of(p).spec.name
        if tuple(value.shape) != tuple(full.shape):
            raise ValueError(f"matrixfsdp.init_weights: the init of '{mname}' set parameter '{name}' "
                             f"to shape {tuple(value.shape)}, expected {tuple(full.shape)}")
        written = _written(value, before.get(id(value)))
        if written is None:  # untouched: the shard keeps what it holds
            continue
        if not written:
            raise ValueError(
                f"matrixfsdp.init_weights: the init of module '{mname}' wrote only part of parameter "
                f"'{name}', or read its previous value. Each visit must write all of a parameter or "
                "none of it, without reading it: no rank holds its previous value whole")
        full, info = value.detach(), sharded_param(p)
        if _tp_slice(info):  # this tp rank's slice of the whole tensor, as the TP plan cut it
            dim, mesh = info.tp.shard_dim, info.tp.mesh
            n = full.shape[dim] // mesh.size()
            full = full.narrow(dim, mesh.get_local_rank() * n, n)
        p.copy_(local_rows(full, placement_of(p), info.shard_rank))
        pending.pop(id(p), None)


def _keep_buffers(module: nn.Module, mname: str, meta_buffers: dict, new_buffers: dict,
                  before: dict) -> None:
    for attr, meta in meta_buffers.items():
        value = module._buffers.get(attr)
        if value is not new_buffers[attr]:
            continue  # replaced (or removed) by the init: its own choice
        written = _written(value, before[id(value)])
        if written is None:  # untouched: back on meta, a later step may set it
            module._buffers[attr] = meta
        elif not written:
            raise ValueError(f"matrixfsdp.init_weights: buffer '{mname}.{attr}' is on the meta device "
                             f"and the init of '{mname}' set only part of it, or read it")


def _nan_full(shard: nn.Parameter) -> nn.Parameter:
    """A full-size parameter for ``shard`` on its device, filled with NaN."""
    info = sharded_param(shard)
    shape = info.placement.spec.shape if info is not None else shard.shape
    if _tp_slice(info):
        shape = info.tp.shape  # the whole DTensor: the init draws what one process draws
    return nn.Parameter(torch.full(shape, float("nan"), dtype=shard.dtype, device=shard.device),
                        requires_grad=shard.requires_grad)


def _tp_slice(info) -> bool:
    """Tensor parallelism: whether shard ``info`` holds rows of its tp rank's slice only (a
    DTensor split along a dim > 0 that is no tp-split Muon matrix, e.g. an embedding under
    ColwiseParallel), not rows of the whole tensor (:func:`~matrixfsdp.runtime.tp.global_ok`).
    Its init then runs on the whole tensor and each rank keeps its slice's rows: an init on
    the slice alone would draw other random numbers, for it and every module after it."""
    return info is not None and not global_ok(info.placement, info.tp)


def _written(t: torch.Tensor, version: int | None) -> bool | None:
    """Did the init write ``t`` (filled with NaN, at ``version`` before; None: a tensor the
    init created)? True: all of it; None: untouched; False: part of it, or it read the NaN.

    In-place writes bump the version counter; writes through ``.data`` do not, but they
    replace the NaN. Integer tensors hold no NaN: any write counts as a full one.
    """
    touched = version is None or tensor_version(t) != version
    if not (t.is_floating_point() or t.is_complex()):
        return True if touched else None
    if t.numel() == 0:
        return True
    if not torch.isnan(t.detach().sum()):  # one pass, no temporary: the common case
        return True
    any_nan, all_nan = False, True  # exact scan (the sum is also NaN for +inf and -inf)
    for chunk in t.detach().reshape(-1).split(_CHUNK):
        nan = torch.isnan(chunk)  # no .sum(): it would promote to int64 (8 bytes per element)
        any_nan = any_nan or bool(nan.any())
        all_nan = all_nan and bool(nan.all())
    if not any_nan:
        return True
    return None if all_nan and not touched else False
