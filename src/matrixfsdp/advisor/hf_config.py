"""A transformers model from its ``config.json`` on disk, on the meta device, for planning.

``matrixfsdp plan --model path/to/config.json`` (or a directory holding one): the model is
built by ``AutoModelForCausalLM.from_config`` on the meta device (shapes only, nothing
downloaded: ``local_files_only``), its parameters in fp32 (the master weights a
``MixedPrecisionPolicy`` keeps), and its units are the blocks its ``_no_split_modules``
names (``matrixfsdp.shard_model``'s rule), else ``model.model.layers``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def config_path(text: str) -> Path | None:
    """The ``config.json`` that ``text`` names (the file, or a directory holding it), or
    None if there is none on disk."""
    p = Path(text).expanduser()
    if p.is_dir():
        p = p / "config.json"
    return p if p.is_file() else None


def _blocks(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if found:
        return found
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules and has no "
                         "model.layers: its blocks are unknown")
    return list(layers)


def meta_model(path: Path) -> tuple[nn.Module, list[nn.Module], str]:
    """(model on meta in fp32, its blocks, a name) from ``path`` (a ``config.json``)."""
    try:
        import transformers  # an optional dependency, needed only here
    except ImportError as e:
        raise SystemExit(f"--model {path}: reading a transformers config needs transformers "
                         "(pip install transformers)") from e
    cfg = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.float()
    name = getattr(cfg, "name_or_path", "") or ""
    if not name or name.endswith(".json") or Path(name) in (path, path.parent):
        # the file and its folder (path/to/config.json: "to/config.json"): a folder's name
        # alone read as a model's name ("to")
        name = f"{path.parent.name}/{path.name}" if path.parent.name else path.name
    return model, _blocks(model), name
