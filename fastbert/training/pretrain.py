"""The pretraining loop: prepared shards -> dynamic masking -> BertForPreTraining / BertForMaskedLM
through the DeepSpeed engine, with a step or wall-clock budget, evaluation, checkpoints (each with
HF-loadable weights and a run manifest), exact resume, a spike/NaN guard with rollback, and an HF
export at the end.

Exact resume: a checkpoint holds the model and optimizer (DeepSpeed), the schedule (elapsed time),
the step and the data offset (which fix the data position: the loader needs nothing else), and per
rank the masking generator and the CPU/CUDA RNGs (dropout). Resumed with the same number of ranks,
the loss trajectory is bit-identical to an uninterrupted run on the same hardware; on another rank
count see training/resume.py for what stays identical.

Data position: optimizer step ``s`` reads global batch ``s + data_skip`` of the stream. ``data_skip``
is 0 until the guard rolls back: the model returns to the last good checkpoint and ``data_skip`` grows
so that training continues AFTER the batches that made it fail instead of replaying them.

All decisions that lead to collectives (stop, evaluate, checkpoint, skip, roll back) are taken
identically on every rank: from the step count, or from values all-reduced at log steps (time-based
triggers) and at every step (the guard's loss check).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fastbert.io import atomic_write_text
from fastbert.ops import resolve_kernels
from fastbert.training import checkpoint as ckpt
from fastbert.training.config import PretrainConfig, as_dict
from fastbert.training import determinism, hf_export, preflight
from fastbert.training.engine import DistInfo, all_reduce_sum, barrier, build_engine, load_ds_config
from fastbert.training.guard import SpikeGuard, Verdict, install as install_guard
from fastbert.training.interrupt import StopRequest
from fastbert.training.host_copy import LaggedAllReduceMax
from fastbert.training.logging import MetricsLogger, peak_tflops
from fastbert.training.manifest import build_manifest, write_manifest
from fastbert.training.pretrain_metrics import Accumulator, evaluate, host_counts, static_inputs, train_metrics
from fastbert.training.resume import choose_resume, model_signature, reseed, universal_if_needed
from fastbert.training.schedules import Schedule, StepSchedule, TimeBudgetSchedule, make_clock


# ------------------------------------------------------------------------------------------ set-up
def ensure_prepared(cfg: PretrainConfig, dist: DistInfo, log: MetricsLogger) -> Path:
    """Prepare ``data.dir`` from ``data.prepare`` if it is not prepared yet (local rank 0 of each node
    does it; preparation is deterministic and writes atomically, so nodes sharing a disk agree)."""
    from fastbert.data.shards import ShardError, load_index
    data_dir = Path(cfg.data.dir)
    if not (data_dir / "index.json").is_file():
        if not cfg.data.auto_prepare:
            raise ShardError(f"{data_dir} is not prepared; run `fastbert prepare --out {data_dir} ...` or set "
                             "data.auto_prepare=true")
        if dist.local_rank == 0:
            from fastbert.data.prepare import PrepareConfig, prepare
            p = as_dict(cfg.data.prepare)
            log.print(f"[fastbert] preparing {data_dir} from {p['corpus']} (one-time)")
            corpus = p.pop("corpus")
            prepare(PrepareConfig(corpus=corpus if isinstance(corpus, list) else [corpus], out=str(data_dir), **p),
                    progress=dist.is_main)
        barrier()
    load_index(data_dir)
    return data_dir


def build_model(cfg: PretrainConfig, index: dict, device: torch.device):
    import fastbert
    from fastbert.config import BertConfig
    m = cfg.model
    kernels = resolve_kernels(m.kernels, device)
    overrides = dict(m.overrides)
    vocab = overrides.pop("vocab_size", index["vocab_size"])
    if vocab != index["vocab_size"]:
        raise ValueError(f"model.overrides.vocab_size={vocab} but {cfg.data.dir} was tokenized with a "
                         f"{index['vocab_size']}-token vocabulary; drop the override (the data decides) or "
                         "re-prepare the data with the model's vocab.txt")
    overrides.setdefault("max_position_embeddings", max(512, index["seq_len"]))
    overrides.setdefault("sparse_prediction", True)  # MLM loss on the masked rows only, no dense logits
    if overrides["max_position_embeddings"] < index["seq_len"]:
        raise ValueError(f"{cfg.data.dir} holds sequences of up to {index['seq_len']} tokens but the model has "
                         f"max_position_embeddings={overrides['max_position_embeddings']}; raise "
                         "model.overrides.max_position_embeddings or prepare the data with a smaller --seq-len")
    config = BertConfig.preset(m.preset, prenorm=m.prenorm, kernels=kernels, vocab_size=index["vocab_size"],
                               pad_token_id=index["special_ids"]["pad"], **overrides)
    head = m.head
    if head == "auto":
        head = "pretraining" if index["nsp"] else "masked_lm"
    if head == "pretraining":
        return fastbert.BertForPreTraining(config)
    if head == "masked_lm":
        return fastbert.BertForMaskedLM(config)
    raise ValueError(f"model.head={head!r} is not known; use auto, pretraining or masked_lm")


def resolve_zero_stage(stage, ds_config: dict, world_size: int, saved="fresh", state_bytes: Optional[int] = None,
                       device_bytes: Optional[int] = None):
    """``train.zero_stage``: a number, None (the DeepSpeed JSON's stage) or "auto". ``saved``: the stage
    the checkpoint being resumed was written with ("fresh": no checkpoint; None: not recorded).

    "auto" keeps a resumed run on its checkpoint's stage (the optimizer state's layout). A fresh run gets
    ZeRO-0, the fastest measured (BERT-base on H100s, benchmarks/RESULTS.md: ZeRO-0 / 1 / 2 at 4,652 /
    1,948 / 1,716 seq/s on one GPU and 8,771 / 3,674 / 3,023 on two: ZeRO-1/2 only add per-step work and
    turn CUDA graphs off), unless the JSON offloads or asks for ZeRO-3 (choices for memory), and, on
    several ranks, only where the replicated training state fits: ``state_bytes`` (fp32 weights,
    gradients and Adam moments) at most half of one device's ``device_bytes`` (unknown, as on CPU
    ranks: the JSON's stage). Otherwise the JSON's stage."""
    if stage != "auto":
        return stage
    if saved != "fresh":
        return saved
    zero = ds_config.get("zero_optimization", {})
    offload = any((zero.get(k) or {}).get("device", "none") not in ("none", None)
                  for k in ("offload_optimizer", "offload_param"))
    if offload or zero.get("stage", 0) == 3:
        return None
    fits = state_bytes is not None and device_bytes is not None and state_bytes <= device_bytes // 2
    return 0 if world_size == 1 or fits else None


def saved_zero_stage(ckpt_dir: Path, resume):
    """The ZeRO stage of the checkpoint ``resume`` would pick: "fresh" when there is none (or resume is
    never), None when the checkpoint does not record it."""
    if resume == "never":
        return "fresh"
    tag = resume if resume not in ("auto", "must") else ckpt.find_latest(ckpt_dir)
    if tag is None or not (ckpt_dir / tag / ckpt.MARKER).is_file():
        return "fresh"
    return ckpt.read_marker(ckpt_dir, tag).get("zero_stage")


def _seed_all(seed: int) -> None:
    import random
    import numpy as np
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------ main
def run_pretraining(cfg: PretrainConfig) -> dict:
    """Train per ``cfg`` (see training/config.py); returns the final summary (rank 0 has the metrics)."""
    import os
    import warnings
    # DeepSpeed 0.19 calls torch.distributed collectives that torch 2.13 marks deprecated, once per bucket.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    det = determinism.enable() if cfg.train.deterministic else None
    is_main_env = int(os.environ.get("RANK", "0")) == 0
    dist, pre = preflight.start(as_dict(cfg.dist), log=lambda text: print(text, flush=True) if is_main_env else None)
    watchdog = pre.pop("watchdog")
    out_dir = Path(cfg.output_dir)
    log = MetricsLogger(out_dir, enabled=dist.is_main, tensorboard=cfg.log.tensorboard)
    try:
        if det is not None:
            log.print("[fastbert] deterministic mode: " + ", ".join(f"{k}={v}" for k, v in det.items()))
        summary = train(setup(cfg, dist, out_dir, log, pre, det))
    except BaseException as e:
        if watchdog is not None:
            watchdog.abort(f"{e.__class__.__name__}: {e}"[:500])
        lost = preflight.describe_collective_failure(e)
        if lost is not None:
            raise preflight.PeerLostError(lost) from e
        raise
    finally:
        log.close()
    if watchdog is not None:
        watchdog.stop()
    return summary


@dataclass
class Run:
    """One pretraining run: what ``setup`` builds and ``train`` drives, with the checkpoint, resume
    and rollback operations the loop calls."""
    cfg: PretrainConfig
    dist: DistInfo
    out_dir: Path
    log: MetricsLogger
    pre: dict                          # preflight report (ranks, timings) for the manifest
    det: Optional[dict]                # deterministic-mode settings, None when off
    data_dir: Path
    index: dict
    train_data: Any
    model: torch.nn.Module
    num_params: int                    # counted before ZeRO-3 partitions the parameters
    engine: Any
    guard: SpikeGuard
    schedule: Schedule
    collator: Any                      # training masking stream (per rank)
    eval_collator: Any
    eval_state: dict                   # eval_collator's state before the first evaluation
    resume_tag: Optional[str] = None
    start_step: int = 0
    loader: Any = None                 # built once the resume fixed the data position
    val_batches: list = field(default_factory=list)
    data_skip: int = 0
    last_eval: Optional[dict] = None
    train_metrics: dict = field(default_factory=dict)
    train_s: float = 0.0               # seconds in training steps (evaluation and checkpoints left out)

    @property
    def ckpt_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    # -- manifest ---------------------------------------------------------------------------------
    def manifest(self, step: int, final: bool = False) -> dict:
        d = self.dist
        dist_info = {"world_size": d.world_size, "num_nodes": d.num_nodes, "local_world_size": d.local_world_size,
                     "ranks": self.pre.get("ranks"),
                     "preflight_s": self.pre.get("preflight_s")}
        tm = self.train_metrics
        throughput = {k: tm[k] for k in ("seq_per_s", "tokens_per_s", "mfu", "loss", "lr") if k in tm} or None
        return build_manifest(
            "pretrain", config=self.cfg.to_dict(), seed=self.cfg.train.seed, step=step, throughput=throughput,
            distributed=dist_info, deterministic=self.det, final=final, eval=self.last_eval,
            data={"dir": str(self.data_dir), "settings": self.index.get("settings"), "seq_len": self.index["seq_len"],
                  "train_sequences": self.index["splits"]["train"]["num_sequences"], "data_skip": self.data_skip},
            model={**model_signature(self.model), "num_parameters": self.num_params, "kernels": self.model.config.kernels},
            engine={"zero_stage": self.engine.zero_stage, "precision": self.engine.precision_name,
                    "global_batch_size": self.engine.global_batch_size, "micro_batch_size": self.engine.micro_batch_size,
                    "grad_accum": self.engine.grad_accum},
            guard={"skipped_steps": self.guard.skipped_total, "rollbacks": self.guard.rollbacks})

    # -- checkpoints --------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        engine, c_cfg = self.engine, self.cfg.checkpoint
        t0 = time.perf_counter()
        finite = all_reduce_sum([0.0 if hf_export.all_finite(engine.module) else 1.0], engine.device)[0] == 0
        good = finite and self.guard.healthy
        info = {"good": good, "finite": finite, "model": model_signature(self.model), "zero_stage": engine.zero_stage,
                "data_settings": self.index.get("settings"), "data_skip": self.data_skip}
        if self.dist.is_main:
            info["weights_sha256"] = hf_export.weights_fingerprint(engine.module)
        client = {"schedule": self.schedule.state_dict(), "data_skip": self.data_skip,
                  "guard": self.guard.state_dict()}

        def extra(tag_dir: Path) -> None:
            if not self.dist.is_main:
                return
            if c_cfg.hf:
                model = hf_export.consolidated_model(engine, type(self.model), self.model.config, self.ckpt_dir,
                                                     tag_dir.name)
                hf_export.write_hf_dir(model, tag_dir / "hf", self.data_dir)
            m = self.manifest(step)
            write_manifest(tag_dir / "manifest.json", m)
            write_manifest(self.out_dir / "manifest.json", m)

        path = ckpt.save_checkpoint(engine, self.ckpt_dir, step, client, {"masking": self.collator.state_dict()},
                                    keep=c_cfg.keep, info=info, extra=extra)
        seconds = time.perf_counter() - t0
        self.log.log("checkpoint", step, path=str(path), seconds=seconds, good=good,
                     hf=c_cfg.hf)
        self.log.print(f"[fastbert] checkpoint {path}{'' if good else ' (marked BAD)'} ({seconds:.1f}s)")
        return path

    def load(self, tag: str, rollback: bool = False) -> tuple[dict, Optional[bool]]:
        """Load checkpoint ``tag``: model, optimizer, RNGs, masking stream, data offset and (on a resume)
        the guard's statistics; a rollback keeps the guard's counters. Returns the client state and
        whether the weights match the fingerprint saved with them (None: not checkable)."""
        engine, dist = self.engine, self.dist
        client, rank_state = ckpt.load_checkpoint(engine, self.ckpt_dir, tag)
        self.data_skip = int(client.get("data_skip", 0))
        if not rollback:
            self.guard.load_state_dict(client.get("guard", {}))
        step = engine.global_steps
        if rank_state is not None:
            self.collator.load_state_dict(rank_state["masking"])
        else:
            reseed(self.cfg.train.seed, dist.rank, step, self.collator)
            self.log.print(f"[fastbert] checkpoint was written by {client.get('world_size')} ranks, this run has "
                           f"{dist.world_size}: weights, optimizer, schedule and data stream resume exactly; "
                           "masking and dropout streams are re-seeded from (seed, rank, step)")
        saved_fp = ckpt.read_marker(self.ckpt_dir, tag).get("weights_sha256")
        match = None
        if dist.is_main and saved_fp:
            now = hf_export.weights_fingerprint(engine.module)
            match = None if now is None else now == saved_fp
            if match is False:
                self.log.print(f"[fastbert] WARNING: the weights loaded from {tag} differ from the ones saved "
                               "(SHA-256 mismatch)")
        return client, match

    # -- guard ----------------------------------------------------------------------------------------
    def rollback(self, verdict: Verdict) -> bool:
        """Back to the last good checkpoint, past the offending data. False when there is none."""
        tag = ckpt.find_latest_good(self.ckpt_dir)
        self.guard.rolled_back()
        if tag is None:
            self.log.print("[guard] no good checkpoint to roll back to yet; continuing with skipped steps")
            self.log.log("guard_rollback_unavailable", verdict.step + 1, data_step=verdict.data_step)
            return False
        ds_cfg = self.engine.ds._config
        tag, cfg = universal_if_needed(self.ckpt_dir, tag, self.dist, {}, self.log)
        universal = bool(cfg.get("checkpoint", {}).get("load_universal"))
        before = ds_cfg.load_universal_checkpoint
        ds_cfg.load_universal_checkpoint = universal or before
        try:
            _, match = self.load(tag, rollback=True)
        finally:
            ds_cfg.load_universal_checkpoint = before
        # Next data: the batch after the one that failed last.
        self.data_skip = verdict.data_step + 1 - self.engine.global_steps
        self.log.log("guard_rollback", self.engine.global_steps, tag=tag, from_step=verdict.step + 1,
                     skipped_data_until=verdict.data_step, data_skip=self.data_skip, weights_match=match,
                     rollbacks=self.guard.rollbacks)
        self.log.print(f"[guard] rolled back to {tag} (step {self.engine.global_steps}); the data continues after "
                       f"stream position {verdict.data_step} (data_skip {self.data_skip})")
        return True


def setup(cfg: PretrainConfig, dist: DistInfo, out_dir: Path, log: MetricsLogger, pre: dict,
          det: Optional[dict]) -> Run:
    """Everything before the first step: data, model, engine, guard, schedule, masking streams, the
    resume, the loader and the evaluation batches."""
    from fastbert.data.masking import collator_for
    from fastbert.data.pretrain_dataset import PretrainData

    t_cfg, c_cfg = cfg.train, cfg.checkpoint
    ckpt_dir = out_dir / "checkpoints"
    data_dir = ensure_prepared(cfg, dist, log)
    train_data = PretrainData(data_dir, "train")
    index = train_data.index
    seed = t_cfg.seed
    _seed_all(seed)                                   # identical initial weights on every rank
    model = build_model(cfg, index, dist.device)
    num_params = model.num_parameters()               # before ZeRO-3 partitions the parameters
    if det is not None:
        for problem in determinism.check_ops(model.config.kernels):
            log.print(f"[fastbert] WARNING: deterministic mode, but this op is not deterministic yet: {problem}")
    ds_json = load_ds_config(t_cfg.deepspeed)
    device_bytes = torch.cuda.get_device_properties(dist.device).total_memory if dist.device.type == "cuda" else None
    zero_stage = resolve_zero_stage(t_cfg.zero_stage, ds_json, dist.world_size,
                                    saved_zero_stage(ckpt_dir, c_cfg.resume), state_bytes=16 * num_params,
                                    device_bytes=device_bytes)
    if zero_stage is not None:
        ds_json["zero_optimization"] = dict(ds_json.get("zero_optimization", {}), stage=int(zero_stage))
    resume_tag, ds_config = choose_resume(c_cfg.resume, ckpt_dir, dist, ds_json, log,
                                          signature=model_signature(model))
    engine = build_engine(model, ds_config, optimizer=t_cfg.optimizer, micro_batch_size=t_cfg.micro_batch_size,
                          global_batch_size=t_cfg.global_batch_size, precision=t_cfg.precision,
                          gradient_clipping=t_cfg.gradient_clipping, zero_stage=zero_stage, dist=dist)
    engine.enable_cuda_graphs(t_cfg.cuda_graphs, say=log.print)
    guard = SpikeGuard(as_dict(cfg.guard), dist.rank, dist.device)
    install_guard(engine, guard)
    _seed_all(seed + 1000 * (dist.rank + 1))          # per-rank dropout streams
    if dist.is_main:
        atomic_write_text(out_dir / "config.json", json.dumps(cfg.to_dict(), indent=1) + "\n")
        atomic_write_text(out_dir / "ds_config.json", json.dumps(engine.ds_config, indent=1) + "\n")

    mk = dict(**as_dict(cfg.data.masking), device=dist.device, index=index)
    schedule = build_schedule(t_cfg, dist)
    collator = collator_for(data_dir, seed=seed * 7919 + dist.rank, **mk)
    eval_collator = collator_for(data_dir, seed=seed * 7919 + 104729 + dist.rank, **mk)
    r = Run(cfg, dist, out_dir, log, pre, det, data_dir=data_dir, index=index, train_data=train_data, model=model,
            num_params=num_params, engine=engine, guard=guard, schedule=schedule, collator=collator,
            eval_collator=eval_collator, eval_state=eval_collator.state_dict(), resume_tag=resume_tag)
    # Resume (the tag was chosen before the engine was built: another rank count needs the universal format).
    if resume_tag is not None:
        client, match = r.load(resume_tag)
        r.schedule.load_state_dict(client["schedule"])
        log.log("resume", engine.global_steps, tag=resume_tag, world_size=dist.world_size, data_skip=r.data_skip,
                weights_match=match)
        log.print(f"[fastbert] resuming from step {engine.global_steps} ({ckpt_dir / resume_tag})")
    r.start_step = engine.global_steps
    r.loader = build_loader(r)
    r.val_batches = build_val_batches(r)
    return r


def build_schedule(t_cfg, dist: DistInfo) -> Schedule:
    """A wall-clock budget (the LR follows time; max_steps, when set, caps the steps) or a step budget."""
    lr = float(t_cfg.optimizer["lr"])
    if t_cfg.time_budget_s is not None:
        return TimeBudgetSchedule(lr, t_cfg.time_budget_s, t_cfg.warmup, t_cfg.schedule,
                                  clock=make_clock(t_cfg.clock, dist.rank),
                                  all_reduce_max=LaggedAllReduceMax(dist.device), max_steps=t_cfg.max_steps)
    return StepSchedule(lr, t_cfg.max_steps, t_cfg.warmup, t_cfg.schedule)


def build_loader(r: Run):
    """Static shapes: rows of seq_len tokens, several sequences a row when packing (data/static_batch.py),
    from the data position of step ``r.start_step``."""
    from fastbert.data.pretrain_dataset import GlobalOrder, PackedOrder, PretrainLoader
    d_cfg, engine, seed, train_data = r.cfg.data, r.engine, r.cfg.train.seed, r.train_data
    per_row = d_cfg.sequences_per_row
    if d_cfg.packing == "pack":               # "pack" | "none", checked at load (config_keys.py)
        order = PackedOrder(train_data.lengths(), engine.global_batch_size, seed, train_data.seq_len, per_row,
                            span=d_cfg.span_for(engine.micro_batch_size))
    else:
        order = GlobalOrder(len(train_data), engine.global_batch_size, seed)
    return PretrainLoader(train_data, order, rank=r.dist.rank, world=r.dist.world_size,
                          micro_batch=engine.micro_batch_size, grad_accum=engine.grad_accum,
                          start_step=r.start_step + r.data_skip, prefetch=d_cfg.prefetch,
                          pin=r.dist.device.type == "cuda", per_row=per_row)


def build_val_batches(r: Run) -> list:
    """This rank's held-out batches (empty: evaluation is off)."""
    from fastbert.data.pretrain_dataset import PretrainData, eval_batches
    e_cfg, log = r.cfg.eval, r.log
    val_batches = []
    try:
        val_data = PretrainData(r.data_dir, "val")
        if len(val_data):
            val_batches = eval_batches(val_data, rank=r.dist.rank, world=r.dist.world_size,
                                       micro_batch=e_cfg.micro_batch_size or r.engine.micro_batch_size,
                                       max_batches=e_cfg.batches, per_row=r.cfg.data.sequences_per_row)
    except Exception as e:  # a missing split is reported, not fatal
        log.print(f"[fastbert] no evaluation: {e}")
    if not val_batches:
        log.print("[fastbert] the validation split is empty or smaller than one eval round: evaluation is off")
    return val_batches


def train(r: Run) -> dict:
    """The step loop from ``r.start_step`` until the budget is spent or a signal stops it, then the
    tear-down (``_finish``); returns the summary."""
    cfg, dist, log, engine, guard, schedule, model = r.cfg, r.dist, r.log, r.engine, r.guard, r.schedule, r.model
    collator, loader, val_batches, eval_collator, eval_state = (r.collator, r.loader, r.val_batches, r.eval_collator,
                                                               r.eval_state)
    index, train_data, det, pre = r.index, r.train_data, r.det, r.pre
    e_cfg, c_cfg, max_steps, start_step = cfg.eval, cfg.checkpoint, cfg.train.max_steps, r.start_step
    per_row = cfg.data.sequences_per_row
    mc = model.config
    avg_len = index["splits"]["train"]["num_tokens"] / max(1, index["splits"]["train"]["num_sequences"])
    peak = peak_tflops(dist.device, cfg.log.peak_tflops)
    log.print(f"[fastbert] {type(model).__name__} {cfg.model.preset} ({r.num_params / 1e6:.1f}M params, "
              f"kernels={mc.kernels}, prenorm={mc.prenorm}) | {dist.world_size} rank(s) on {dist.num_nodes} node(s), "
              f"{dist.device.type} | ZeRO-{engine.zero_stage} {engine.precision_name} | global batch "
              f"{engine.global_batch_size} = {engine.micro_batch_size} x {dist.world_size} x {engine.grad_accum} | "
              f"{len(train_data)} train sequences")

    log.log("start", start_step, world_size=dist.world_size, num_nodes=dist.num_nodes,
            local_world_size=dist.local_world_size, zero_stage=engine.zero_stage, precision=engine.precision_name,
            grad_accum=engine.grad_accum, global_batch_size=engine.global_batch_size, device=str(dist.device),
            train_sequences=len(train_data), pack_span=loader.span, deterministic=det is not None,
            data_skip=r.data_skip,
            preflight_s=pre.get("preflight_s"))
    acc, step_acc = Accumulator(dist.device), Accumulator(dist.device)
    log_every = cfg.log.every_steps
    want_eval_at, want_ckpt_at = _next_deadline(e_cfg.every_minutes), _next_deadline(c_cfg.every_minutes)
    window_t0, window_steps = time.perf_counter(), 0
    last_ckpt_step = start_step
    schedule_started = False
    has_nsp_head = getattr(model, "has_nsp", False)
    stop, stopped = StopRequest(log.print, c_cfg.interrupt_timeout_s).install(), False
    batches = iter(loader)

    def guard_events(verdicts: list) -> bool:
        """Log the guard's verdicts; True when one rolled back (the data then restarts past it)."""
        nonlocal batches, last_ckpt_step
        for verdict in verdicts:
            log.log("guard", verdict.step + 1, **verdict.record())
            log.print(guard.describe(verdict))
            if verdict.rollback and r.rollback(verdict):
                loader.step = engine.global_steps + r.data_skip
                batches = iter(loader)
                last_ckpt_step = engine.global_steps
                return True
        return False
    try:
        while True:
            data_step, micro, batch = next(batches)
            step = data_step - r.data_skip                 # optimizer step index (== engine.global_steps)
            if micro == 0:
                if not schedule_started:
                    schedule.start()
                    schedule_started = True
                step_lr = schedule.tick(step)
                if schedule.done(step):
                    if guard_events(guard.flush()):          # the last step's verdict, read before stopping
                        continue
                    break
                engine.set_lr(step_lr)
            tokens, sequences = host_counts(batch, per_row, loader.span)
            kw = static_inputs(batch, collator, dist.device, loader.span)
            if not has_nsp_head:
                kw["packed"].pop("next_sentence_label", None)
            out = engine(**kw)
            loss = guard.inject(out.loss, data_step)
            engine.backward(loss)
            guard.add_micro_loss(loss)
            step_acc.add(out, kw["packed"].get("next_sentence_label"), tokens, sequences)
            last_micro = micro == engine.grad_accum - 1
            if last_micro:
                guard.check_loss(engine)                   # collective: the same verdict on every rank
            engine.step()
            if not last_micro:
                continue
            done_steps = step + 1
            eval_due_steps = _every(e_cfg.every_steps, done_steps)
            ckpt_due_steps = _every(c_cfg.every_steps, done_steps)
            # The guard's verdicts reach the host a step late, except where the host needs them now.
            settle = done_steps % log_every == 0 or eval_due_steps or ckpt_due_steps or stop.requested
            verdicts = guard.end_step(engine, step, data_step, settle=settle)
            acc.merge(step_acc, guard.last_ok)             # a skipped step's metrics weigh 0 (on the device)
            if guard_events(verdicts):
                continue
            window_steps += 1
            # ---- logging (+ agreement on time-based triggers, in the same collective)
            if done_steps % log_every == 0:
                now = time.monotonic()
                flags = [float(want_eval_at is not None and now >= want_eval_at),
                         float(want_ckpt_at is not None and now >= want_ckpt_at), float(stop.requested)]
                sums, flags = acc.reduce(flags)
                dt = time.perf_counter() - window_t0
                r.train_s += dt
                r.train_metrics = train_metrics(sums, engine, step_lr, window_steps, dt, mc, avg_len, peak)
                r.train_metrics["train_s"] = r.train_s     # training seconds so far (no eval, no checkpoints)
                if guard.enabled:      # every skipped step, DeepSpeed's own overflow skips included
                    r.train_metrics["skipped_steps"] = guard.skipped_total
                log.progress(done_steps, max_steps, r.train_metrics,
                             schedule.eta(done_steps, dt / max(1, window_steps)))
                log.log("train", done_steps, **r.train_metrics, **schedule.info())
                window_t0, window_steps = time.perf_counter(), 0
                eval_due_time, ckpt_due_time, stop_due = flags[0] > 0, flags[1] > 0, flags[2] > 0
            else:
                eval_due_time = ckpt_due_time = False
                stop_due = dist.world_size == 1 and stop.requested      # one rank: no agreement needed
            # ---- evaluation
            if val_batches and (eval_due_time or eval_due_steps):
                r.last_eval = evaluate(engine, val_batches, eval_collator, eval_state)
                log.log("eval", done_steps, **r.last_eval)
                log.print(f"[eval] step {done_steps} | " + " | ".join(f"{k} {v:.4f}" for k, v in r.last_eval.items()))
                want_eval_at = _next_deadline(e_cfg.every_minutes)
                window_t0 = time.perf_counter()
            # ---- checkpoint
            if ckpt_due_time or ckpt_due_steps:
                r.save(done_steps)
                last_ckpt_step = done_steps
                want_ckpt_at = _next_deadline(c_cfg.every_minutes)
                window_t0 = time.perf_counter()
            # ---- SIGINT / SIGTERM: a checkpoint at this step boundary, then stop (training/interrupt.py)
            if stop_due:
                if last_ckpt_step != done_steps:
                    r.save(done_steps)
                    last_ckpt_step = done_steps
                stopped = True
                break
    finally:
        loader.close()
        stop.remove()
    if window_steps:
        r.train_s += time.perf_counter() - window_t0
    if stopped:
        return _stopped(r, stop, engine.global_steps)
    return _finish(r, last_ckpt_step)


def _finish(r: Run, last_ckpt_step: int) -> dict:
    """After the last step: final evaluation, checkpoint, HF export, manifest and summary."""
    cfg, log, engine, guard, out_dir = r.cfg, r.log, r.engine, r.guard, r.out_dir
    e_cfg, c_cfg = cfg.eval, cfg.checkpoint
    final_step = engine.global_steps
    if final_step == r.start_step and r.resume_tag is not None:
        _say_budget_spent(r, final_step)
    if r.val_batches and e_cfg.at_end:
        r.last_eval = evaluate(engine, r.val_batches, r.eval_collator, r.eval_state)
        log.log("eval", final_step, final=True, **r.last_eval)
        log.print(f"[eval] final step {final_step} | " + " | ".join(f"{k} {v:.4f}" for k, v in r.last_eval.items()))
    tag = None
    if c_cfg.at_end or cfg.export.hf:
        if final_step != last_ckpt_step or ckpt.find_latest(r.ckpt_dir) is None:
            r.save(final_step)
        tag = ckpt.find_latest(r.ckpt_dir)
    hf_dir = None
    if cfg.export.hf:
        hf_dir = _export_hf(r, tag)
        log.print(f"[fastbert] HF checkpoint: {hf_dir}")
    summary = {"steps": final_step, "skipped_steps": engine.skipped_steps, "guard_skipped": guard.skipped_total,
               "rollbacks": guard.rollbacks, "eval": r.last_eval, "train": r.train_metrics,
               "hf_dir": str(hf_dir) if hf_dir else None, "elapsed_s": r.schedule.info().get("elapsed_s"),
               "train_s": r.train_s}
    log.log("done", final_step, **{k: v for k, v in summary.items() if k != "train"})
    if r.dist.is_main:
        write_manifest(out_dir / "manifest.json", r.manifest(final_step, final=True))
        atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary


def _stopped(r: Run, stop: StopRequest, step: int) -> dict:
    """The summary of a run stopped by a signal after its checkpoint at ``step``."""
    tag = ckpt.find_latest(r.ckpt_dir)
    r.log.log("interrupted", step, signal=int(stop.signum), checkpoint=tag)
    summary = {"steps": step, "interrupted": int(stop.signum), "exit_code": stop.exit_code,
               "checkpoint": str(r.ckpt_dir / tag) if tag else None, "eval": None, "hf_dir": None}
    if r.dist.is_main:
        write_manifest(r.out_dir / "manifest.json", r.manifest(step))
    return summary


def _say_budget_spent(r: Run, step: int) -> None:
    """A resumed run with nothing left to train says so, and how to train longer."""
    t = r.cfg.train
    if r.schedule.spent(step) == "train.time_budget":
        what, longer = f"train.time_budget={t.time_budget}", "train.time_budget=<longer> (e.g. 10m; the schedule " \
                                                             "stretches to the new budget)"
    else:
        what, longer = f"train.max_steps={t.max_steps}", f"train.max_steps=<more than {step}>"
    r.log.print(f"[fastbert] {what} is already spent: the checkpoint at step {step} in {r.ckpt_dir} finished it, so "
                f"there is nothing left to train. To train longer, run again with {longer}; to start over, "
                "checkpoint.resume=never (or another output_dir)")


def _export_hf(r: Run, tag: Optional[str]) -> Path:
    """OUTPUT_DIR/hf: the final checkpoint's hf/ folder when it has one, else consolidated now."""
    target = r.out_dir / "hf"
    if r.dist.is_main:
        source = r.ckpt_dir / tag / "hf" if tag else None
        if source is not None and source.is_dir() and tag == ckpt.tag_for(r.engine.global_steps):
            hf_export.copy_hf_dir(source, target)
        else:
            model = hf_export.consolidated_model(r.engine, type(r.model), r.model.config, r.ckpt_dir, tag)
            hf_export.write_hf_dir(model, target, r.data_dir)
    barrier()
    return target


def _every(n, step) -> bool:
    return bool(n) and step % n == 0


def _next_deadline(minutes) -> Optional[float]:
    return time.monotonic() + 60.0 * minutes if minutes else None
