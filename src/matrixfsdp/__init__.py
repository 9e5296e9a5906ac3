"""MatrixFSDP: fully sharded data parallelism that keeps every Muon matrix whole on one
owner rank, so the optimizer step runs exact Muon with no communication."""

from __future__ import annotations

from torch import nn

from ._exit import exit_rank
from .checkpoint import full_state_dict, get_state_dict, load_full_state_dict, set_state_dict
from .checkpoint_io import latest_checkpoint, load_checkpoint, save_checkpoint, wait_for_checkpoint
from .clip import clip_grad_norm_, nonfinite_grad_names, total_grad_norm
from .dcp import RowShard
from .hf import shard_model
from .init import init_weights
from .integrity import CheckpointError, verify_checkpoint
from .interop import load_full_checkpoint, save_pretrained
from .matrix_optim import matrix_optimizer, matrix_params, register_elementwise, shard_params
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from .optim import Muon, muon_param_groups, zeropower_via_newtonschulz
from .plan import Plan, format_report, make_plan
from .runtime import (
    fully_shard,
    get_root,
    plan_of,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
)

__all__ = ["CheckpointError", "clip_grad_norm_", "comm_stats", "exit_rank", "FSDPModule",
           "full_state_dict", "fully_shard", "get_state_dict", "init_weights",
           "latest_checkpoint", "load_checkpoint", "load_full_checkpoint", "load_full_state_dict",
           "make_plan", "matrix_optimizer", "matrix_params", "Muon", "muon_param_groups",
           "nonfinite_grad_names", "Plan", "plan_of", "plan_report", "register_elementwise",
           "register_fsdp_forward_method", "RowShard", "save_checkpoint", "save_pretrained",
           "set_modules_to_backward_prefetch", "set_modules_to_forward_prefetch",
           "set_state_dict", "shard_model", "shard_params", "total_grad_norm", "UnshardHandle",
           "verify_checkpoint", "wait_for_checkpoint", "zeropower_via_newtonschulz"]
__version__ = "0.1.0"


def plan_report(model: nn.Module, max_rows: int = 32) -> str:
    """Who owns what: per rank, matrices owned, bytes held, NS cost, and the balance."""
    return format_report(plan_of(model), max_rows=max_rows)


def comm_stats(model: nn.Module):
    """The :class:`~matrixfsdp.comm.CommStats` counting this model's collectives."""
    return get_root(model).stats
