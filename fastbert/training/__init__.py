"""Training through DeepSpeed: the engine wrapper (``engine.build_engine``), learning-rate schedules
over steps or a wall-clock budget (``schedules``), checkpoints with exact resume (``checkpoint``,
``resume``) and HF weights in every checkpoint (``hf_export``), logging (``logging``), optimizers
(``optim``), the pretraining loop (``pretrain``, ``pretrain_metrics``), and reliability: the spike /
NaN guard (``guard``), multi-node preflight and heartbeat watchdog (``preflight``), deterministic
mode (``determinism``), run manifests (``manifest``) and seed sweeps (``seeds``).

DeepSpeed is imported only when an engine is built, and the names below load on first use (PEP 562): importing
this package, or its torch-free modules (``config``, ``config_keys``, ``schedules``), does not load torch."""
from fastbert.lazy import lazy_names

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

__getattr__, __dir__ = lazy_names(__name__, _WHERE)
