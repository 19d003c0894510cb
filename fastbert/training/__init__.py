"""Training through DeepSpeed: the engine wrapper (``engine.build_engine``), learning-rate schedules
over steps or a wall-clock budget (``schedules``), checkpoints with exact resume (``checkpoint``,
``resume``) and HF weights in every checkpoint (``hf_export``), logging (``logging``), optimizers
(``optim``), the pretraining loop (``pretrain``, ``pretrain_metrics``), and reliability: the spike /
NaN guard (``guard``), multi-node preflight and heartbeat watchdog (``preflight``), deterministic
mode (``determinism``), run manifests (``manifest``) and seed sweeps (``seeds``).

DeepSpeed is imported only when an engine is built, so importing this package is cheap."""
from fastbert.training.engine import DistInfo, TrainEngine, build_engine, init_distributed
from fastbert.training.optim import OptimizerSpec
from fastbert.training.schedules import StepSchedule, TimeBudgetSchedule, make_clock, parse_duration

__all__ = ["DistInfo", "TrainEngine", "build_engine", "init_distributed", "OptimizerSpec",
           "StepSchedule", "TimeBudgetSchedule", "make_clock", "parse_duration"]
