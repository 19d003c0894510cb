"""Training through DeepSpeed: the engine wrapper (``engine.build_engine``), learning-rate schedules
over steps or a wall-clock budget (``schedules``), checkpoints with exact resume (``checkpoint``,
``resume``) and HF weights in every checkpoint (``hf_export``), logging (``logging``), optimizers
(``optim``), the pretraining loop (``pretrain``, ``pretrain_metrics``), and reliability: the spike /
NaN guard (``guard``), multi-node preflight and heartbeat watchdog (``preflight``), deterministic
mode (``determinism``), run manifests (``manifest``) and seed sweeps (``seeds``).

DeepSpeed is imported only when an engine is built, and the names below load on first use (PEP 562): importing
this package, or its torch-free modules (``config``, ``config_keys``, ``schedules``), does not load torch."""
import importlib

_WHERE = {
    "DistInfo": "fastbert.training.engine",
    "TrainEngine": "fastbert.training.engine",
    "build_engine": "fastbert.training.engine",
    "init_distributed": "fastbert.training.engine",
    "OptimizerSpec": "fastbert.training.optim_spec",
    "StepSchedule": "fastbert.training.schedules",
    "TimeBudgetSchedule": "fastbert.training.schedules",
    "make_clock": "fastbert.training.schedules",
    "parse_duration": "fastbert.training.schedules",
}
__all__ = list(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'fastbert.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
