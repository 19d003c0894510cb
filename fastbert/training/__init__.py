"""Training through DeepSpeed: the engine wrapper (``engine.build_engine``), learning-rate schedules
over steps or a wall-clock budget (``schedules``), checkpoints with exact resume (``checkpoint``),
logging (``logging``), optimizers (``optim``) and the pretraining loop (``pretrain``).

DeepSpeed is imported only when an engine is built, so importing this package is cheap."""
from fastbert.training.engine import DistInfo, TrainEngine, build_engine, init_distributed
from fastbert.training.optim import OptimizerSpec
from fastbert.training.schedules import StepSchedule, TimeBudgetSchedule, make_clock, parse_duration

__all__ = ["DistInfo", "TrainEngine", "build_engine", "init_distributed", "OptimizerSpec",
           "StepSchedule", "TimeBudgetSchedule", "make_clock", "parse_duration"]
