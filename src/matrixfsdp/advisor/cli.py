"""``matrixfsdp plan``: its options, and the search they run (:mod:`.search`, reported by
:mod:`.advice`) over a preset or a transformers ``config.json`` on the meta device."""

from __future__ import annotations

import argparse
import json

import torch

from ..costs.constants import Constants
from ..costs.links import Links
from ..costs.steptime import Workload
from ..layout.assign import TP_OWNERSHIPS
from ..layout.traffic import Dtypes
from ..train.cli import int_at_least
from ..train.cluster import DTYPE_BYTES, parse_bytes
from ..train.launch import DefaultsHelp, positive_float
from ..train.models import GPT, PRESETS
from .advice import SUMMARY_HEAD, Setting, format_search, search_json, summary_row
from .hf_config import config_path, meta_model
from .model_shapes import ModelShapes, shapes_of
from .search import LLAMA3_TOKENS, default_global_batch, search, sensitivity
from .torchtitan_flags import torchtitan_text

PLAN_PRESETS = sorted(PRESETS)


def _plan_model(name: str):
    """(label, model on meta, its units) for a preset name or a transformers config.json."""
    cfg = PRESETS.get(name)
    if cfg is not None:
        with torch.device("meta"):
            net = GPT(cfg)
        return name, net, list(net.layers)
    path = config_path(name)
    if path is None:
        raise SystemExit(f"--model {name}: neither a preset ({', '.join(PLAN_PRESETS)}) nor "
                         "a transformers config.json on disk (a file, or a directory holding one)")
    net, units, label = meta_model(path)
    return label, net, units


def _workload(args, constants: Constants | None, shapes: ModelShapes) -> Workload:
    """The work per rank: the flags' rates, or the ones ``--constants`` measured (at this
    model's matmul and Newton-Schulz shapes, in ``--param-dtype``)."""
    if constants is None:
        return Workload(args.seq, args.micro_batch, args.tflops * 1e12, args.hbm_gbs * 1e9)
    count: dict[tuple[int, int], int] = {(shapes.vocab, shapes.d_model): 1} if shapes.vocab \
        else {}  # the head
    for s in shapes.specs:
        if len(s.shape) == 2 and s.muon:
            count[tuple(s.shape)] = count.get(tuple(s.shape), 0) + 1
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.param_dtype]
    mm, ns = constants.model_rates([(r, c, n) for (r, c), n in count.items()],
                                   args.seq * args.micro_batch, dtype)
    return Workload(args.seq, args.micro_batch, mm, constants.adamw_bytes_per_s, ns_tflops=ns,
                    adamw_hbm=constants.adamw_bytes_per_s, muon_hbm=constants.muon_bytes_per_s)


def model_matrices(name: str) -> list[tuple[int, int]]:
    """The ``(rows, cols)`` of a model's 2-D weights (``calibrate --model``)."""
    _, net, _ = _plan_model(name)
    return [tuple(p.shape) for p in net.parameters() if p.ndim == 2]


def run_plan(args) -> None:
    for n in args.world_size:
        if args.shard_size is not None and n % args.shard_size:
            raise SystemExit(f"--shard-size {args.shard_size} must divide --ranks {n}")
    try:
        constants = Constants.load(args.constants) if args.constants else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    links = Links(args.gpus_per_node, args.nvlink_gbs * 1e9, args.ib_gbs * 1e9,
                  args.latency_us * 1e-6, args.nvlink_hop_us * 1e-6, args.ib_hop_us * 1e-6,
                  constants=constants)
    dtypes = Dtypes(4, DTYPE_BYTES[args.param_dtype], DTYPE_BYTES[args.reduce_dtype])
    checkpointing = {"auto": ("fit",), "on": ("all",), "off": ("off",)}[
        args.activation_checkpointing]
    global_batch = args.global_batch or default_global_batch(args.seq, args.global_tokens)
    done = []
    for name in args.model:
        label, net, units = _plan_model(name)
        shapes = shapes_of(net, units)
        setting = Setting(links, _workload(args, constants, shapes), dtypes, args.device_memory)
        n_params = sum(p.numel() for p in net.parameters())
        for world in args.world_size:
            found = search(shapes, world, args.device_memory, links=links,
                           workload=setting.workload, dtypes=setting.dtypes,
                           global_batch=global_batch, tp=args.tp, pp=args.pp,
                           shard=[args.shard_size] if args.shard_size else None,
                           checkpointing=checkpointing, tp_ownership=args.tp_ownership,
                           peak=args.peak_tflops * 1e12)
            rates = [] if len(args.model) * len(args.world_size) > 1 else sensitivity(
                shapes, found, args.device_memory, [r * 1e12 for r in args.sensitivity_tflops],
                setting.workload, links=links, dtypes=dtypes)
            done.append((label, n_params, shapes.blocks, found, setting, rates))
    if args.json:
        out = [search_json(label, n, s, st, r) for label, n, _, s, st, r in done]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
    elif len(done) > 1:
        print("\n".join([*SUMMARY_HEAD, *(summary_row(x[0], x[3]) for x in done)]))
    else:
        label, n, blocks, s, st, r = done[0]
        print(format_search(label, n, blocks, s, st, args.top, args.max_rows, r))
    if args.torchtitan:
        _print_torchtitan(args, done, global_batch)


def _print_torchtitan(args, done, global_batch: int) -> None:
    """``--torchtitan``: each advice as torchtitan's command line (a llama3 preset's
    torchtitan config function: ``llama3-70b`` -> ``llama3_70b``)."""
    for label, _, _, s, _, _ in done:
        if not label.startswith("llama3-"):
            raise SystemExit(f"--torchtitan: {label} has no torchtitan config function; the "
                             "llama3 presets do (llama3-8b, llama3-70b, llama3-405b)")
        if s.recommended is None:
            raise SystemExit(f"--torchtitan: no layout of {label} fits at {s.world_size} ranks")
        print(f"\n{label} @ {s.world_size}, torchtitan's trainer on MatrixFSDP:\n")
        print(torchtitan_text(s.recommended, label.replace("-", "_"), args.seq, global_batch,
                              args.gpus_per_node))


def add_plan_args(sub) -> argparse.ArgumentParser:
    """``matrixfsdp plan``'s options, with their defaults (``--help``)."""
    pos = int_at_least(1)
    pl = sub.add_parser("plan",
        allow_abbrev=False, help="advise a layout (replicate x shard x tp x pp) for a model "
                        "on a cluster: the fitting one with the lowest modelled step time, next "
                        "to FSDP2 + torch.optim.Muon and DistMuon (docs/plan.md)",
                        formatter_class=DefaultsHelp)

    def size(text: str) -> int:
        try:
            return parse_bytes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    real = positive_float
    pl.add_argument("--model", nargs="+", default=["paper"], metavar="NAME|CONFIG",
                    help=f"a preset ({', '.join(PLAN_PRESETS)}) or a transformers config.json "
                         "on disk (or its directory); several models and/or world sizes: one "
                         "summary row each")
    pl.add_argument("--ranks", dest="world_size", nargs="+", type=pos, default=[8], metavar="N",
                    help="GPUs (ranks) of each layout searched; several: one summary row each "
                         "(--world-size is another name for it)")
    pl.add_argument("--world-size", dest="world_size", nargs="+", type=pos,
                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    pl.add_argument("--shard-size", type=pos, default=None,
                    help="search only this HSDP shard size (default: every divisor)")
    pl.add_argument("--tp", nargs="+", type=pos, default=None,
                    help="search only these tensor-parallel sizes (default: up to a node)")
    pl.add_argument("--pp", nargs="+", type=pos, default=None,
                    help="search only these pipeline sizes (default: powers of two up to 16)")
    pl.add_argument("--device-memory", type=size, default="80GiB",
                    help="memory per device; a layout whose largest rank needs more is never "
                         "advised while one fits (default 80GiB)")
    pl.add_argument("--param-dtype", choices=("fp32", "bf16"), default="bf16",
                    help="dtype of the gathers and gather buffers (MixedPrecisionPolicy "
                         "param_dtype; default bf16); storage and optimizer state stay fp32")
    pl.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="dtype of the gradient reduce (MixedPrecisionPolicy reduce_dtype)")
    pl.add_argument("--seq", type=pos, default=8192, help="tokens per sequence (default 8192)")
    pl.add_argument("--micro-batch", type=pos, default=1,
                    help="sequences per micro-batch per data-parallel rank (default 1)")
    pl.add_argument("--global-batch", type=pos, default=None,
                    help="sequences per step (default: --global-tokens / --seq)")
    pl.add_argument("--global-tokens", type=pos, default=LLAMA3_TOKENS,
                    help="tokens per step when --global-batch is not given (default 2^24, "
                         "Llama 3's 16M)")
    pl.add_argument("--constants", default=None, metavar="FILE",
                    help="rates and collective costs measured by `matrixfsdp calibrate` "
                         "(replace --tflops, --hbm-gbs and the latency and bandwidth of "
                         "groups inside a node)")
    pl.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto",
                    help="auto: per layout and system the fewest blocks that fit (none where "
                         "the layout fits without); on: every block; off: none")
    pl.add_argument("--tp-ownership", choices=TP_OWNERSHIPS[::-1], default="auto",
                    help="who owns a tensor-parallel-split Muon matrix (fully_shard's "
                         "tp_ownership): rank (whole on one tp rank), group (its tp group, "
                         "each rank its slice), auto (the cheaper per matrix by the model)")
    pl.add_argument("--tflops", type=real, default=400.0,
                    help="bf16 TFLOP/s reached by the matmuls and Newton-Schulz (default 400)")
    pl.add_argument("--peak-tflops", type=real, default=989.0,
                    help="the GPU's dense bf16 peak, TFLOP/s, for MFU (default 989: H100 SXM)")
    pl.add_argument("--sensitivity-tflops", type=real, nargs="*", default=[400.0, 700.0],
                    metavar="TFLOPS", help="kernel rates of the sensitivity rows: each "
                    "system's best layout again at each (default 400 700; none: no rows)")
    pl.add_argument("--hbm-gbs", type=real, default=3350.0,
                    help="memory bandwidth for the element-wise optimizer updates, GB/s")
    pl.add_argument("--gpus-per-node", type=pos, default=8)
    pl.add_argument("--nvlink-gbs", type=real, default=450.0,
                    help="NVLink GB/s per GPU and direction (default 450: H100 SXM)")
    pl.add_argument("--ib-gbs", type=real, default=50.0,
                    help="InfiniBand GB/s per GPU and direction (default 50)")
    pl.add_argument("--latency-us", type=real, default=14.0,
                    help="base latency per collective, microseconds (NCCL's LL128 ring: 14)")
    pl.add_argument("--nvlink-hop-us", type=real, default=1.9,
                    help="latency per ring step inside a node (NCCL's LL128: 1.9)")
    pl.add_argument("--ib-hop-us", type=real, default=4.0,
                    help="latency per ring step across nodes (NCCL's LL128: 4.0)")
    pl.add_argument("--torchtitan", action="store_true",
                    help="also print the advice as torchtitan's command line (its trainer on "
                         "MatrixFSDP's one line: --parallelism.*, --training.*, activation "
                         "checkpointing; llama3 presets)")
    pl.add_argument("--json", action="store_true",
                    help="print the advice and every layout searched as JSON")
    pl.add_argument("--top", type=pos, default=12, help="layouts shown in the table")
    pl.add_argument("--max-rows", type=int_at_least(1), default=16)
    return pl
