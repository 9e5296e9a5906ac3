"""MatrixFSDP: fully sharded data parallelism that keeps every Muon matrix whole on one
owner rank, so the optimizer step runs exact Muon with no communication."""

from __future__ import annotations

from .costs.predict import PlanPrediction, plan_costs
from .fully_shard import fully_shard
from .integrations import pipelining
from .integrations.huggingface import shard_model
from .layout.planner import make_plan
from .layout.report import format_report
from .layout.types import Plan
from .optim.clip import clip_grad_norm_, nonfinite_grad_names, total_grad_norm
from .optim.matrix import matrix_optimizer, matrix_params, shard_params
from .optim.muon import Muon, muon_param_groups, zeropower_via_newtonschulz
from .optim.policy import check_same_optimizer as check_optimizer
from .optim.policy import register_elementwise
from .optim.qk_clip import QKClip, max_logits
from .runtime.exit import exit_rank
from .runtime.module import (
    FSDPModule,
    UnshardHandle,
    comm_stats,
    get_root,
    plan_of,
    plan_report,
    register_fsdp_forward_method,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
)
from .state.files import latest_checkpoint, load_checkpoint, save_checkpoint, wait_for_checkpoint
from .state.init import init_weights
from .state.integrity import CheckpointError, verify_checkpoint
from .state.interop import load_full_checkpoint, save_pretrained
from .state.state_dict import full_state_dict, get_state_dict, load_full_state_dict, set_state_dict
from .tensors.row_shard import RowShard

__all__ = ["check_optimizer", "CheckpointError", "clip_grad_norm_", "comm_stats", "exit_rank",
           "format_report", "FSDPModule",
           "full_state_dict", "fully_shard", "get_root", "get_state_dict", "init_weights",
           "latest_checkpoint", "load_checkpoint", "load_full_checkpoint", "load_full_state_dict",
           "make_plan", "matrix_optimizer", "matrix_params", "max_logits", "Muon",
           "muon_param_groups", "nonfinite_grad_names", "pipelining", "Plan", "plan_costs",
           "plan_of", "PlanPrediction",
           "plan_report", "QKClip", "register_elementwise",
           "register_fsdp_forward_method", "RowShard", "save_checkpoint", "save_pretrained",
           "set_modules_to_backward_prefetch", "set_modules_to_forward_prefetch",
           "set_state_dict", "shard_model", "shard_params", "total_grad_norm", "UnshardHandle",
           "verify_checkpoint", "wait_for_checkpoint", "zeropower_via_newtonschulz"]
__version__ = "0.1.0"
