"""The one training path: process-group set-up and ``deepspeed.initialize``, shared by pretraining
and fine-tuning.

    from fastbert.training.engine import build_engine
    engine = build_engine(model, "configs/ds_zero2.json", optimizer={"type": "adamw", "lr": 1e-4},
                          micro_batch_size=32, global_batch_size=256, precision="bf16")
    for batch in batches:                      # one micro-batch per iteration on this rank
        if engine.at_step_start():
            engine.set_lr(schedule.lr(engine.global_steps))
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()                          # applies the update every grad_accum micro-batches

Works the same from one CPU process (gloo; DeepSpeed's CPU accelerator is selected automatically when
there is no CUDA) to many nodes (NCCL; launched by ``deepspeed``/``torchrun``, which set RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). ZeRO stage, offload and precision come from the
DeepSpeed JSON; batch sizes, precision, clipping and the optimizer are filled in here so a config file
never disagrees with the run.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

from fastbert.ops import weight_casts
from fastbert.training.optim import AdamW, build_client_optimizer, param_groups
from fastbert.training.optim_spec import OptimizerSpec, ds_optimizer_entry

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "auto")


class EngineConfigError(ValueError):
    """A training set-up that cannot work; the message names the setting and the fix."""


# ---------------------------------------------------------------------------------------- distributed
@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set when this process made itself a world of one: "pid:MASTER_PORT". Child processes inherit the
# environment; without the marker a child (a test's subprocess, a shell-out from a notebook) would take
# RANK/MASTER_PORT for a launcher's and try to bind the port its parent's process group holds. A launcher
# between the two (torchrun, deepspeed) sets its own port: then the values no longer match and are kept.
_OWN_WORLD = "FASTBERT_WORLD_OF_ONE"
_WORLD_OF_ONE = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def _forget_inherited_world() -> None:
    owner = os.environ.get(_OWN_WORLD)
    if not owner:
        return
    pid, _, port = owner.partition(":")
    if pid == str(os.getpid()):
        return
    del os.environ[_OWN_WORLD]
    env = os.environ
    if env.get("MASTER_PORT") == port and all(env.get(k) == v for k, v in _WORLD_OF_ONE.items()):
        for key in (*_WORLD_OF_ONE, "MASTER_PORT"):
            env.pop(key, None)


def init_distributed(timeout_s: float = 1800.0) -> DistInfo:
    """Initialise (once) the default process group through DeepSpeed and pick this rank's device.

    Without a launcher (plain ``fastbert pretrain``) this is a world of one on 127.0.0.1.
    """
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        # DeepSpeed picks its accelerator at import time; without CUDA it must be told "cpu".
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # before the world's variables are set: a missing DeepSpeed leaves them as they were

    if not has_cuda:
        from fastbert.training import ds_ops
        ds_ops.announce_cpu_build(lambda text: print(text, flush=True) if os.environ.get("LOCAL_RANK", "0") == "0"
                                  else None)
    _forget_inherited_world()
    own_port = alone = False
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        alone = True
        os.environ.update(_WORLD_OF_ONE)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        own_port = "MASTER_PORT" not in os.environ
        if own_port:
            os.environ["MASTER_PORT"] = str(_free_port())
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if has_cuda:
        torch.cuda.set_device(local_rank)
    for attempt in range(5):
        if dist.is_initialized():
            break
        try:
            deepspeed.init_distributed(dist_backend="nccl" if has_cuda else "gloo",
                                       timeout=timedelta(seconds=timeout_s), verbose=False)
        except RuntimeError as e:
            # A world of one picks a free port itself; another process can take it between the pick and
            # the bind (EADDRINUSE): pick another. A launcher's port is never changed.
            if not (own_port and "EADDRINUSE" in str(e) and attempt < 4):
                raise
            os.environ["MASTER_PORT"] = str(_free_port())
    if alone:
        os.environ[_OWN_WORLD] = f"{os.getpid()}:{os.environ['MASTER_PORT']}"
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
    device = torch.device("cuda", local_rank) if has_cuda else torch.device("cpu")
    return DistInfo(dist.get_rank(), world, local_rank, local_world, device)


def barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float], device) -> list[float]:
    """Sum a few floats over all ranks (float64; one collective)."""
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


# ---------------------------------------------------------------------------------------- DS config
def to_device(batch: dict, device: torch.device) -> dict:
    """A batch's tensors and numpy arrays (also one level down, as in ``{"packed": {...}}``) onto
    ``device``; on CUDA from pinned memory without waiting (a copy from pageable memory would wait
    for the GPU to drain first; pinned tensors are used as they are). Other values pass through."""
    def move(v):
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(v)
        if not torch.is_tensor(v):
            return v
        if device.type == "cuda" and not v.is_cuda:
            return v.pin_memory().to(device, non_blocking=True)
        return v.to(device)
    return move(batch)


def resolve_precision(precision: str, device: torch.device) -> str:
    """The engine's precision (fp32 / bf16 / fp16) for a setting. ``fp8`` is bf16 autocast with the encoder's
    GEMMs in FP8 (``BertConfig.fp8``, set by ``build_engine``): it needs FP8 tensor cores (compute capability
    8.9+); on the CPU it runs fp32 with torch's FP8 GEMM emulation (slow: for tests)."""
    if precision not in PRECISIONS:
        raise EngineConfigError(f"precision {precision!r} is not known; use one of {PRECISIONS}")
    if precision == "fp8":
        if device.type != "cuda":
            return "fp32"
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise EngineConfigError(f"precision=fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper); "
                                    f"{torch.cuda.get_device_name(device)} has none: use precision=bf16")
        return "bf16"
    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if precision in ("bf16", "fp16") and device.type != "cuda":
        raise EngineConfigError(f"precision={precision} needs a CUDA device; on the CPU use precision=fp32 "
                                "(or 'auto')")
    return precision


def use_fp8(model: torch.nn.Module, precision: str) -> None:
    """With ``precision == "fp8"``, turn on ``model.config.fp8`` (the encoder's training GEMMs in FP8); a model
    without that switch (not a fastbert model) is refused."""
    if precision == "fp8":
        if not hasattr(getattr(model, "config", None), "fp8"):
            raise EngineConfigError("precision=fp8 needs a fastbert model (BertConfig.fp8); use precision=bf16")
        model.config.fp8 = True


def load_ds_config(ds_config: Union[str, os.PathLike, dict, None]) -> dict:
    if ds_config is None:
        return {}
    if isinstance(ds_config, dict):
        return json.loads(json.dumps(ds_config))  # deep copy
    path = Path(ds_config)
    if not path.is_file():
        raise EngineConfigError(f"DeepSpeed config not found: {path}; pass one of configs/ds_zero*.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EngineConfigError(f"DeepSpeed config {path} is not valid JSON: {e}") from None


def build_ds_config(base, *, micro_batch_size: int, global_batch_size: int, world_size: int,
                    precision: str, gradient_clipping: float, optimizer: OptimizerSpec,
                    device: torch.device, zero_stage: Optional[int] = None,
                    client_optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """The full DeepSpeed config for this run: ``base`` (ZeRO, offload, ...) plus the values fastbert
    owns (batch sizes, precision, clipping, optimizer). Conflicting entries in ``base`` are errors.
    ``client_optimizer``: the optimizer instance handed to ``deepspeed.initialize``, if any."""
    cfg = load_ds_config(base)
    for key in ("scheduler",):
        if key in cfg:
            raise EngineConfigError(f"the DeepSpeed config has a '{key}' section; fastbert schedules the "
                                    "learning rate itself (train.schedule / train.time_budget): remove it")
    if "optimizer" in cfg and not _all_auto(cfg["optimizer"].get("params", {})):
        raise EngineConfigError("the DeepSpeed config has an 'optimizer' section; set the optimizer in the "
                                "fastbert config (train.optimizer) instead and remove it")
    cfg.pop("optimizer", None)
    if micro_batch_size <= 0 or global_batch_size <= 0:
        raise EngineConfigError("micro_batch_size and global_batch_size must be positive")
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise EngineConfigError(
            f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size} x "
            f"{world_size} ranks = {per_step}; pick a global batch divisible by {per_step}")
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = global_batch_size // per_step
    cfg["train_batch_size"] = global_batch_size
    cfg["gradient_clipping"] = float(gradient_clipping)
    cfg["fastbert_clipping"] = 0.0
    cfg.setdefault("steps_per_print", 2 ** 31 - 1)
    cfg.setdefault("wall_clock_breakdown", False)
    # DeepSpeed's throughput timer synchronizes the device at every forward (and would break a CUDA graph
    # capture); fastbert measures throughput itself.
    cfg.setdefault("timers", {"throughput": {"enabled": False}})
    precision = resolve_precision(precision, device)
    fp16 = dict(cfg.get("fp16", {}))
    bf16 = dict(cfg.get("bf16", {}))
    fp16["enabled"] = precision == "fp16"
    # bf16 runs as torch.autocast over fp32 weights (as HF Trainer's bf16=True and the bare loop do), through
    # DeepSpeed's torch_autocast section (its forward would otherwise switch an outer autocast off), not
    # DeepSpeed's bf16 wrappers: those check every gradient tensor for overflow each step (hundreds of small
    # kernels and a device sync per parameter on ZeRO-0, benchmarks/RESULTS.md), which bf16 never needs.
    # Gradients are reduced in fp32 (no module is declared safe for lower-precision communication).
    bf16["enabled"] = False
    if precision == "bf16":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    if precision == "fp16":
        fp16.setdefault("loss_scale", 0)          # 0 = dynamic loss scaling
        fp16.setdefault("initial_scale_power", 16)
        fp16.setdefault("loss_scale_window", 1000)
        fp16.setdefault("hysteresis", 2)
        fp16.setdefault("min_loss_scale", 1)
    cfg["fp16"], cfg["bf16"] = fp16, bf16
    zero = dict(cfg.get("zero_optimization", {}))
    if zero_stage is not None:
        zero["stage"] = int(zero_stage)
    zero.setdefault("stage", 0)
    if zero["stage"] not in (0, 1, 2, 3):
        raise EngineConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero['stage']}")
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    if offload and device.type != "cuda":
        raise EngineConfigError("ZeRO CPU offload needs CUDA devices; on the CPU the optimizer already "
                                "runs on the CPU: remove offload_optimizer")
    if optimizer.type == "lamb" and zero["stage"] >= 1:
        raise EngineConfigError(
            "LAMB computes a trust ratio per parameter tensor, but ZeRO stage >= 1 gives the optimizer "
            "flat partitions that cut across tensors; use optimizer adamw with ZeRO, or zero stage 0 with lamb")
    cfg["zero_optimization"] = zero
    if zero["stage"] == 0 and precision != "fp16":
        # ZeRO-0 without loss scaling: fastbert clips (one fused norm, no device sync) instead of
        # DeepSpeed's per-parameter loop that reads the norm back.
        cfg["fastbert_clipping"], cfg["gradient_clipping"] = cfg["gradient_clipping"], 0.0
    if client_optimizer is None:
        cfg["optimizer"] = ds_optimizer_entry(optimizer)
    elif type(client_optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        # DeepSpeed's ZeRO checks the exact type: fastbert's AdamW (torch's with its own step), LAMB
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def deepspeed_view(cfg: dict) -> dict:
    """The config without fastbert's own entries (what ``deepspeed.initialize`` gets)."""
    return {k: v for k, v in cfg.items() if not k.startswith("fastbert_")}


def _all_auto(params: dict) -> bool:
    return all(v == "auto" for v in params.values())


# ---------------------------------------------------------------------------------------- engine
class TrainEngine:
    """A DeepSpeed engine plus what a training loop needs around it (rank info, LR setting, counters)."""

    def __init__(self, ds_engine, dist: DistInfo, ds_config: dict, optimizer: OptimizerSpec, precision: str):
        if ds_engine.zero_optimization_stage() == 0 and ds_engine.dp_world_size == 1:
            # One data-parallel rank: DeepSpeed's backward would still flatten every gradient into a buffer,
            # all-reduce it over that one rank and copy it back, an identity (~1 ms of GPU and ~2 ms of host
            # time a step at BERT-base on an H100, benchmarks/RESULTS.md).
            ds_engine.enable_backward_allreduce = False
        self.ds = ds_engine
        self.dist = dist
        self.ds_config = ds_config
        self.optimizer_spec = optimizer
        self.precision = precision
        self._micro = 0
        self.clipping = float(ds_config.get("fastbert_clipping", 0.0))
        self._grad_norm: Optional[torch.Tensor] = None
        self._clipped = False                    # the guard clipped this step already (to read the norm)
        self.graphs = None                       # a GraphedModel once enable_cuda_graphs succeeded
        # The 16-bit casts of the fp32 weights, made once per optimizer step (ops/weight_casts.py) when a step
        # has several micro-batches, or written by the optimizer step itself (training/optim.AdamW, driven
        # directly at ZeRO-0 without fp16's wrapper). With one micro-batch and another optimizer, the refresh
        # would redo every cast each step (the same bytes; measured level with casting inside the forward, for
        # ~0.67 GB more at BERT-large). Not with ZeRO-3: its parameters are gathered and released module by
        # module inside the forward. With several micro-batches they also keep the FP8 linears' weight casts
        # (``derived``: ops/fp8.weight_fp8), made at the step's first micro-batch.
        writes = isinstance(ds_engine.optimizer, AdamW)
        keep = (self.grad_accum > 1 or writes) and self.zero_stage < 3 and weight_casts.enabled()
        self.casts = weight_casts.WeightCasts(derived=self.grad_accum > 1) if keep else None
        if writes:
            ds_engine.optimizer.weight_casts = self.casts

    @property
    def precision_name(self) -> str:
        """What the run uses, for logs: the engine's precision, with "+fp8" when the model's GEMMs are FP8."""
        fp8 = getattr(getattr(self.module, "config", None), "fp8", False)
        return f"{self.precision}+fp8" if fp8 else self.precision

    def enable_cuda_graphs(self, enabled: bool = True, say: Optional[Callable[[str], None]] = None) -> Optional[str]:
        """Replay static-shape (``packed=...``) training steps from CUDA graphs
        (``training/cuda_graphs.py``). Returns None when on, else the one-line reason it is off, which
        ``say`` prints on a GPU (on the CPU eager is the only way, nothing to say)."""
        from fastbert.training.cuda_graphs import GraphedModel, unsupported_reason
        reason = "off (cuda_graphs=false)" if not enabled else \
            unsupported_reason(self.device, self.precision, self.zero_stage,
                               getattr(getattr(self.module, "config", None), "kernels", "triton"),
                               bool(self.ds.wall_clock_breakdown() or self.ds.flops_profiler_enabled()))
        self.graphs = GraphedModel(self.module, self.precision) if reason is None else None
        if self.graphs is not None:
            self.graphs.activate()
        elif say is not None and self.device.type == "cuda":
            say(f"[fastbert] CUDA graphs: {reason}; running eagerly")
        return reason

    # -- forwarding ---------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def grad_accum(self) -> int:
        return int(self.ds_config["gradient_accumulation_steps"])

    @property
    def micro_batch_size(self) -> int:
        return int(self.ds_config["train_micro_batch_size_per_gpu"])

    @property
    def global_batch_size(self) -> int:
        return int(self.ds_config["train_batch_size"])

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config["zero_optimization"]["stage"])

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (including fp16 steps skipped for overflow)."""
        return int(self.ds.global_steps)

    @property
    def skipped_steps(self) -> int:
        return int(getattr(self.ds, "skipped_steps", 0))

    @property
    def loss_scale(self) -> Optional[float]:
        if self.precision != "fp16":
            return None
        opt = self.ds.optimizer
        scale = getattr(opt, "cur_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
        return float(scale) if scale is not None else None

    def grad_norm(self) -> Optional[float]:
        """Global gradient norm of the last optimizer step (before clipping), if DeepSpeed kept it."""
        if self._grad_norm is not None:
            return float(self._grad_norm)
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def __call__(self, *args, **kwargs):
        """The model's forward. The first micro-batch of an optimizer step (and any forward between steps: evaluation)
        first rewrites the weights' 16-bit copies from the weights, which can only have changed before it (the
        optimizer step, a checkpoint load); the later micro-batches of the step reuse them."""
        if self.casts is None:
            return self._forward(*args, **kwargs)
        if self._micro == 0:
            self.casts.refresh()
        with self.casts.active():
            return self._forward(*args, **kwargs)

    def _forward(self, *args, **kwargs):
        if self.graphs is not None and not args and "packed" in kwargs:
            out = self.graphs(kwargs["packed"])
            if out is not None:
                return out
        return self.ds(*args, **kwargs)

    def train(self, mode: bool = True):
        self.ds.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- the step -----------------------------------------------------------------------------
    def at_step_start(self) -> bool:
        """True before the first micro-batch of an optimizer step (the place to set the LR)."""
        return self._micro == 0

    def set_lr(self, lr: float) -> None:
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> float:
        return float(self.ds.optimizer.param_groups[0]["lr"])

    def backward(self, loss: torch.Tensor) -> None:
        if self.graphs is not None and self.grad_accum > 1 and self._micro == 0:
            self.graphs.own_grads()
        self.ds.backward(loss)

    def clip_gradients(self) -> Optional[torch.Tensor]:
        """ZeRO-0: clip the (already reduced) gradients to ``gradient_clipping`` with one fused norm and
        keep the norm on the device. Runs inside ``step`` at the accumulation boundary."""
        if not self.clipping:
            return None
        params = [p for p in self.module.parameters() if p.grad is not None]
        self._grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clipping)  # fused (foreach) on CUDA
        self._clipped = True
        return self._grad_norm

    def step(self) -> bool:
        """Call after every micro-batch's backward; returns True when an optimizer step happened."""
        boundary = self.ds.is_gradient_accumulation_boundary()
        if boundary and self.clipping and not self._clipped:
            self.clip_gradients()              # unless the guard already did, to read the norm
        self.ds.step()
        self._clipped = False
        self._micro = 0 if boundary else self._micro + 1
        return boundary

    def step_was_applied(self) -> bool:
        """False when the last optimizer step was skipped (fp16 overflow)."""
        return bool(self.ds.was_step_applied())


def build_engine(model: torch.nn.Module, ds_config=None, *, optimizer: Union[dict, OptimizerSpec, None] = None,
                 micro_batch_size: int = 8, global_batch_size: Optional[int] = None,
                 precision: str = "auto", gradient_clipping: float = 1.0,
                 zero_stage: Optional[int] = None, dist: Optional[DistInfo] = None) -> TrainEngine:
    """Wrap ``model`` in DeepSpeed (the single training path). ``ds_config``: a path or dict with the
    ZeRO / offload settings (configs/ds_zero{1,2,3}.json); ``global_batch_size`` defaults to
    ``micro_batch_size x world_size`` (no accumulation)."""
    dist = dist or init_distributed()
    import deepspeed

    spec = optimizer if isinstance(optimizer, OptimizerSpec) else OptimizerSpec.from_dict(optimizer or {})
    global_batch_size = global_batch_size or micro_batch_size * dist.world_size
    resolved = resolve_precision(precision, dist.device)
    use_fp8(model, precision)
    model = model.to(dist.device)
    # Marks checkpoints as convertible to DeepSpeed's universal format (resume on another rank count).
    if getattr(model, "universal_checkpoint_info", None) is None:
        model.universal_checkpoint_info = {}
    groups = param_groups(model, spec.weight_decay)
    zero = load_ds_config(ds_config).get("zero_optimization", {})
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    client = build_client_optimizer(spec, groups, dist.device.type, offload=offload)
    cfg = build_ds_config(ds_config, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                          world_size=dist.world_size, precision=resolved, gradient_clipping=gradient_clipping,
                          optimizer=spec, device=dist.device, zero_stage=zero_stage,
                          client_optimizer=client)
    ds_engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client,
                                              model_parameters=groups if client is None else None,
                                              config=deepspeed_view(cfg), dist_init_required=False)
    return TrainEngine(ds_engine, dist, cfg, spec, resolved)
