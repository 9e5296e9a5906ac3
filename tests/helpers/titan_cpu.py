"""torchtitan 0.3.0's own Trainer on CPU, for the tests only: this file exists so that
torchtitan runs on a machine without a GPU. Nothing here is MatrixFSDP's; the library never
imports it, and none of it is needed on CUDA.

torchtitan 0.3.0 lacks, on CPU (each named where it is patched or replaced below):

* imports it does not declare: ``torchdata``, ``datasets``, ``tensorboard`` and an
  unconditional ``import triton`` (its minimal-async-EP kernels). Stub modules stand in
  while torchtitan is imported, and are removed from ``sys.modules`` afterwards;
* a CPU device: ``torchtitan.tools.utils`` picks ``"cuda"`` when no accelerator is found,
  and its device module (``torch.cuda``) for memory statistics and ``set_device``;
* gloo's limits: ``set_pg_timeouts`` calls ``barrier(device_ids=...)`` (NCCL only) and
  ``dist.set_timeout`` after step 1; its FSDP2 path sets a gradient divide factor, which
  makes FSDP2 reduce with ``PREMUL_SUM`` (gloo has none): the FSDP2 reference sets
  ``set_force_sum_reduction_for_comms(True)`` (:func:`fsdp2_parallelize`);
* flex attention's backward (no CPU kernel): layers take ``ScaledDotProductAttention``
  (:func:`on_cpu`), which torchtitan still ships;
* DistMuon's CUDA-only construction (the benchmark's shim,
  :func:`benchmarks.harness.peers._dist_muon_cpu_shim`);
* a tokenizer and a dataset without downloads: :class:`TinyTokenizer` and
  :class:`TinyData`, through torchtitan's own tokenizer and dataloader configs;
* a model small enough for a test: the config that ``--module`` / ``--config`` load goes
  through ``ADAPT["config"]`` (the test's :func:`on_cpu`), so a test runs the one line
  itself, ``--module matrixfsdp.integrations.torchtitan --config llama3_debugmodel``;
* the 2 s its trainer sleeps on rank 0 after training, which a test need not wait.

:class:`RecordingMetrics` is torchtitan's ``MetricsProcessor`` writing each logged step's
loss and grad norm to a JSON file, so a test can read them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


# ---- imports torchtitan does not declare ----------------------------------------------------
def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


class _StatefulDataLoader(torch.utils.data.DataLoader):
    """torchdata's ``StatefulDataLoader`` as far as torchtitan's import needs it."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _Anything:
    """``triton`` / ``triton.language``: decorators and type names its kernels use at import."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str) -> _Anything:
        return _Anything(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @triton.jit
        return _Anything(self._name)  # @triton.jit(...), tl.pointer_type(...)


def _stubs() -> dict[str, types.ModuleType]:
    triton_lang = _Anything("triton.language")
    triton = _stub("triton", jit=_Anything("triton.jit"), language=triton_lang)
    return {
        "triton": triton, "triton.language": triton_lang,
        "torchdata": _stub("torchdata"),
        "torchdata.stateful_dataloader": _stub("torchdata.stateful_dataloader",
                                               StatefulDataLoader=_StatefulDataLoader),
        "datasets": _stub("datasets", Dataset=object, load_dataset=None),
        "datasets.distributed": _stub("datasets.distributed", split_dataset_by_node=None),
        "torch.utils.tensorboard": _stub("torch.utils.tensorboard", SummaryWriter=None),
    }


class _CPUDevice:
    """torchtitan's device module (``torch.cuda`` there) for the CPU."""

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE")
                                     * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def memory_stats(device: Any = None) -> dict:
        return {}


_IMPORTED = False


def _installed(name: str) -> bool:
    """Whether module ``name`` imports for real (a GPU machine's ``triton``): then no stub
    stands in for it."""
    import importlib
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def import_torchtitan() -> None:
    """Import torchtitan's trainer and llama3 with the stubs in place (once per process; a
    module that is installed is imported for real)."""
    global _IMPORTED
    if _IMPORTED:
        return
    import importlib
    for name in ("torch._inductor.codecache", "torch._inductor.compile_fx",
                 "torch._functorch.partitioners", "torch.nn.attention.flex_attention"):
        importlib.import_module(name)  # torch's own look for triton, before the stub is there
    stubs = {k: v for k, v in _stubs().items() if k not in sys.modules and not _installed(k)}
    sys.modules.update(stubs)
    try:
        import torchtitan.models.llama3.config_registry  # noqa: F401
        import torchtitan.train  # noqa: F401
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
    _IMPORTED = True


# ---- the patches, for the duration of one run --------------------------------------------------
def _set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
    """torchtitan's, without what gloo lacks: a plain barrier (no ``device_ids``) and no
    ``dist.set_timeout``."""
    dist.barrier()


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def titan_on_cpu() -> Iterator[None]:
    """Every patch above for the ``with`` block (one torchtitan run), undone after it: the
    test's rank processes run other tests next."""
    import_torchtitan()
    import torchtitan.distributed.utils as dutils
    import torchtitan.trainer as trainer

    from benchmarks.harness.peers import _dist_muon_cpu_shim
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("torchtitan") and m is not None]
    with contextlib.ExitStack() as stack:
        for m in mods:  # each module that imported the device type or module by name
            if getattr(m, "device_type", None) == "cuda":
                stack.enter_context(_patched(m, "device_type", "cpu"))
            if getattr(m, "device_module", None) is torch.cuda:
                stack.enter_context(_patched(m, "device_module", _CPUDevice))
        stack.enter_context(_patched(dutils, "set_pg_timeouts", _set_pg_timeouts))
        stack.enter_context(_patched(trainer, "time", types.SimpleNamespace(
            perf_counter=trainer.time.perf_counter, monotonic=trainer.time.monotonic,
            time=trainer.time.time, sleep=lambda s: None)))
        stack.enter_context(_dist_muon_cpu_shim())
        from torchtitan.config.manager import ConfigManager
        stack.enter_context(_patched(ConfigManager, "_load_config",
                                     _adapting(ConfigManager._load_config)))
        stack.enter_context(_process_state())
        yield


@contextlib.contextmanager
def _process_state() -> Iterator[None]:
    """What torchtitan's run changes for the whole process, put back for the tests that use
    these rank processes next: garbage collection (its GarbageCollection disables it), the
    root logger (its init_logger replaces the handlers), dynamo's settings (apply_compile
    sets two; activation checkpointing turns off dynamo's LRU cache)."""
    import logging

    import torch._dynamo
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    dynamo = {k: getattr(torch._dynamo.config, k) for k in
              ("capture_scalar_outputs", "skip_fwd_side_effects_in_bwd_under_checkpoint")}
    try:
        yield
    finally:
        gc.enable()
        root.setLevel(level)
        root.handlers[:] = handlers
        for k, v in dynamo.items():
            setattr(torch._dynamo.config, k, v)
        torch._C._dynamo.eval_frame._set_lru_cache(True)


def run_main(args: list[str], env: dict[str, str] | None = None) -> None:
    """torchtitan's own entry point, ``torchtitan.train.main()``, with ``args`` as its
    command line, on this rank of the process group the test made (torchtitan uses it as
    it is: ``init_distributed`` skips an initialised one)."""
    with titan_on_cpu():
        from torchtitan.train import main
        argv, environ = sys.argv, dict(os.environ)
        sys.argv = ["torchtitan.train", *args]
        os.environ.update({"LOCAL_RANK": str(dist.get_rank()), "RANK": str(dist.get_rank()),
                           "WORLD_SIZE": str(dist.get_world_size()), **(env or {})})
        try:
            main()
        finally:
            sys.argv = argv
            os.environ.clear()
            os.environ.update(environ)


# ---- torchtitan components of the tests' own (through torchtitan's configs) -------------------
def _components():
    """The classes below, defined once torchtitan is importable."""
    import_torchtitan()
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.tokenizer import BaseTokenizer

    class TinyTokenizer(BaseTokenizer):
        """Token ids are the vocabulary (no text here)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 2048

        def __init__(self, config: Config, *, tokenizer_path: str | None = None):
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("TinyTokenizer has no text")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("TinyTokenizer has no text")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class TinyData(BaseDataLoader):
        """Batches that are a function of the step: step ``s`` draws the global batch
        ``(local_batch_size * dp, seq_len + 1)`` from a generator seeded ``seed + s``;
        data-parallel rank ``r`` takes rows ``r * local_batch_size ...``. Its state is the
        step, so a resumed run reads what the uninterrupted one read. A token repeats its
        predecessor half the time, so that there is something to learn."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 2048
            seed: int = 0
            positions: bool = False  # also yield each token's position (MTP needs them)

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any,
                     seq_len: int, local_batch_size: int, **kwargs: Any):
            self.config, self.dp, self.rank = config, dp_world_size, dp_rank
            self.seq_len, self.batch, self.step = seq_len, local_batch_size, 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(self.config.seed * 100_003 + self.step)
                shape = (self.batch * self.dp, self.seq_len + 1)
                x = torch.randint(0, self.config.vocab_size, shape, generator=g)
                repeat = torch.rand(shape, generator=g) < 0.5
                repeat[:, 0] = False
                for j in range(1, shape[1]):
                    x[:, j] = torch.where(repeat[:, j], x[:, j - 1], x[:, j])
                x = x[self.rank * self.batch:(self.rank + 1) * self.batch]
                self.step += 1
                inputs = {"input": x[:, :-1].contiguous()}
                if self.config.positions:  # one document per row
                    inputs["positions"] = torch.arange(self.seq_len).expand(self.batch, -1).clone()
                yield inputs, x[:, 1:].contiguous()

        def state_dict(self) -> dict:
            return {f"dp_rank_{self.rank}": self.step}

        def load_state_dict(self, state: dict) -> None:
            if state:
                self.step = int(state[f"dp_rank_{self.rank}"])

    class RecordingMetrics(MetricsProcessor):
        """torchtitan's metrics, and each logged step's loss and grad norm in ``path``
        (written by ``rank``), with the FLOPs per token its MFU uses and the sum of the MoE
        layers' expert biases (torchtitan's load-balancing hook moves them)."""

        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            path: str = ""
            rank: int = 0  # the rank that writes it (pipeline parallelism: a last stage's)

        def __init__(self, config: Config, **kwargs: Any):
            super().__init__(config, **kwargs)
            self.steps: dict[int, dict] = {}

        def log(self, step: int, global_avg_loss: float, global_max_loss: float,
                grad_norm: float, extra_metrics: dict | None = None) -> None:
            super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
            bias = sum(float(b.abs().sum()) for part in (self.model_parts or [])
                       for name, b in part.named_buffers() if name.endswith("expert_bias_E"))
            self.steps[step] = dict(loss=global_avg_loss, grad_norm=grad_norm,
                                    flops_per_token=self.num_flops_per_token, expert_bias=bias)

        def close(self) -> None:
            super().close()
            if self.config.path and dist.get_rank() == self.config.rank:
                # written whole, then renamed: the other ranks read it once it exists
                with open(self.config.path + ".tmp", "w") as f:
                    json.dump(self.steps, f)
                os.replace(self.config.path + ".tmp", self.config.path)

    return TinyTokenizer, TinyData, RecordingMetrics


_CLASSES: tuple | None = None


def components():
    """(TinyTokenizer, TinyData, RecordingMetrics), made once per process."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _components()
    return _CLASSES


def on_cpu(config: Any, *, dim: int = 128, n_layers: int = 2, n_heads: int = 4, seq_len: int = 32,
           local_batch_size: int = 2, steps: int = 10, seed: int = 0, dump_folder: str = "",
           metrics_path: str = "", metrics_rank: int = 0, positions: bool = False) -> Any:
    """A llama3 ``Trainer.Config`` made to run here, at a test's size: the debug model's
    shape scaled to ``dim`` / ``n_layers`` / ``n_heads`` (its vocabulary, RoPE and init as
    torchtitan builds them), causal SDPA for flex attention, the tiny tokenizer and data,
    recorded metrics, no validation, deterministic; ``positions``: the data gives each
    token's position too (context parallelism needs them). Another model family (qwen3,
    deepseek_v3: their MoE configs) goes to :func:`on_cpu_moe`."""
    if config.model_spec.name != "llama3":
        return on_cpu_moe(config, seq_len=seq_len, local_batch_size=local_batch_size, steps=steps,
                          seed=seed, dump_folder=dump_folder, metrics_path=metrics_path,
                          metrics_rank=metrics_rank)
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import _build_llama3_layers

    m = config.model_spec.model
    vocab = m.vocab_size
    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=128),
        rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=4 * seq_len, theta=500000,
                                scaling="llama"),
        attn_backend="flex")
    m.dim, m.layers = dim, _sdpa(layers)
    m.tok_embeddings = Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=m.tok_embeddings.param_init)
    m.norm = RMSNorm.Config(normalized_shape=dim, param_init=m.norm.param_init)
    s = dim ** -0.5
    from functools import partial
    m.lm_head = Linear.Config(in_features=dim, out_features=vocab, param_init={
        "weight": partial(torch.nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s),
        "bias": torch.nn.init.zeros_})
    return _run_here(config, vocab, seq_len=seq_len, local_batch_size=local_batch_size,
                     steps=steps, seed=seed, dump_folder=dump_folder, metrics_path=metrics_path,
                     metrics_rank=metrics_rank, positions=positions)


def _sdpa(layers: list) -> list:
    """Causal SDPA for each layer's flex attention (flex attention has no CPU backward)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def _run_here(config: Any, vocab: int, *, seq_len: int, local_batch_size: int, steps: int,
              seed: int, dump_folder: str, metrics_path: str, metrics_rank: int = 0,
              positions: bool = False) -> Any:
    """The parts of a config that are not the model, made to run here: the tiny tokenizer
    and data (with ``positions``, as torchtitan's own dataloaders give them: MTP needs
    them), recorded metrics, no validation, deterministic."""
    tok, data, metrics = components()
    config.tokenizer = tok.Config(vocab_size=vocab)
    config.dataloader = data.Config(vocab_size=vocab, seed=seed, positions=positions)
    config.metrics = metrics.Config(log_freq=1, path=metrics_path, rank=metrics_rank)
    config.validator.enable = False
    config.training.seq_len, config.training.local_batch_size = seq_len, local_batch_size
    config.training.steps = steps
    config.debug.seed, config.debug.deterministic = seed, True
    config.dump_folder = dump_folder
    config.checkpoint.enable = False
    return config


def on_cpu_moe(config: Any, *, dim: int = 64, n_layers: int = 2, n_heads: int = 4,
               head_dim: int = 16, moe_hidden: int = 64, experts: int = 8, top_k: int = 2,
               seq_len: int = 32, local_batch_size: int = 2, steps: int = 10, seed: int = 0,
               dump_folder: str = "", metrics_path: str = "", metrics_rank: int = 0) -> Any:
    """torchtitan's MoE configs (``qwen3_moe_debug``, ``deepseek_v3_debugmodel`` and its MTP
    variant) at a test's size: ``n_layers`` blocks of ``experts`` routed experts (top
    ``top_k``; dims multiples of 8, as ``torch._grouped_mm`` needs in bf16), built by
    torchtitan's own layer builders with its inits, load balancing and (DeepSeek-V3) its
    first block dense, a shared expert, MLA and as many MTP layers as the config has;
    causal SDPA for flex attention; the rest as :func:`on_cpu`."""
    from torchtitan.models.common import Embedding, Linear

    m, family = config.model_spec.model, config.model_spec.name
    vocab = m.vocab_size
    if family == "qwen3":
        from torchtitan.models.common import CosSinRoPE
        from torchtitan.models.qwen3 import _build_qwen3_moe_layers, _qwen3_norm
        m.layers = _sdpa(_build_qwen3_moe_layers(
            n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_heads // 2,
            head_dim=head_dim, moe_hidden_dim=moe_hidden, num_experts=experts, top_k=top_k,
            attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4 * seq_len, theta=1000000.0)))
        m.norm = _qwen3_norm(dim)
    elif family == "deepseek_v3":
        import dataclasses

        from torchtitan.models.common import RMSNorm
        from torchtitan.models.deepseek_v3 import (
            _build_dsv3_layers,
            _build_mtp_layers,
            _output_linear_init,
        )
        rope = dataclasses.replace(m.layers[0].attention.rope, dim=head_dim // 2,
                                   max_seq_len=4 * seq_len)
        m.layers = _sdpa(_build_dsv3_layers(
            n_layers=n_layers, n_dense_layers=1, dim=dim, n_heads=n_heads, q_lora_rank=0,
            kv_lora_rank=2 * head_dim, qk_nope_head_dim=head_dim, qk_rope_head_dim=head_dim // 2,
            v_head_dim=head_dim, mscale=0.70, dense_hidden_dim=2 * moe_hidden,
            moe_hidden_dim=moe_hidden, num_experts=experts, num_shared_experts=1,
            router_top_k=top_k, router_score_func="softmax", attn_backend="flex",
            moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope))
        m.mtp_layers = _sdpa(_build_mtp_layers(m.layers[-1], dim=dim,
                                               num_mtp_layers=len(m.mtp_layers)))
        m.norm = RMSNorm.Config(normalized_shape=dim, param_init=m.norm.param_init)
        m.lm_head.param_init = _output_linear_init(dim)
    else:
        raise NotImplementedError(f"titan_cpu.on_cpu_moe: model family {family!r}")
    m.dim = dim
    m.tok_embeddings = Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=m.tok_embeddings.param_init)
    m.lm_head = Linear.Config(in_features=dim, out_features=vocab, param_init=m.lm_head.param_init)
    return _run_here(config, vocab, seq_len=seq_len, local_batch_size=local_batch_size,
                     steps=steps, seed=seed, dump_folder=dump_folder, metrics_path=metrics_path,
                     metrics_rank=metrics_rank, positions=bool(getattr(m, "mtp_layers", None)))


# ---- the config a run loads, made to run here ----------------------------------------------------
ADAPT: dict[str, Any] = {}  # "config": applied to the config torchtitan's registry loads


def _adapting(load: Any) -> Any:
    """torchtitan's ``ConfigManager._load_config`` (``--module`` / ``--config``), then the
    test's ``ADAPT["config"]`` on what it loaded (the test's size and what CPU needs)."""
    def adapted(self: Any, args: list[str]) -> tuple[Any, list[str]]:
        config, rest = load(self, args)
        return (ADAPT["config"](config) if "config" in ADAPT else config), rest
    return adapted
