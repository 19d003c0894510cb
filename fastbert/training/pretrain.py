"""The pretraining loop: prepared shards -> dynamic masking -> BertForPreTraining / BertForMaskedLM
through the DeepSpeed engine, with a step or wall-clock budget, evaluation, checkpoints, exact resume
and an HF export at the end.

Exact resume: a checkpoint holds the model and optimizer (DeepSpeed), the schedule (elapsed time),
the step (which fixes the data position: the loader needs nothing else), and per rank the masking
generator and the CPU/CUDA RNGs (dropout). Resumed with the same number of ranks, the loss
trajectory is bit-identical to an uninterrupted run on the same hardware.

All decisions that lead to collectives (stop, evaluate, checkpoint) are taken identically on every
rank: from the step count, or from values all-reduced at log steps (time-based triggers).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from fastbert.training import checkpoint as ckpt
from fastbert.training.engine import (DistInfo, TrainEngine, all_reduce_sum, barrier, build_engine, init_distributed,
                                     load_ds_config)
from fastbert.training.logging import MetricsLogger, peak_tflops, train_flops_per_sequence
from fastbert.training.schedules import (StepSchedule, TimeBudgetSchedule, make_clock, parse_duration,
                                         torch_all_reduce_max)


# ------------------------------------------------------------------------------------------ set-up
def ensure_prepared(cfg: dict, dist: DistInfo, log: MetricsLogger) -> Path:
    """Prepare ``data.dir`` from ``data.prepare`` if it is not prepared yet (local rank 0 of each node
    does it; preparation is deterministic and writes atomically, so nodes sharing a disk agree)."""
    from fastbert.data.shards import ShardError, load_index
    data_dir = Path(cfg["data"]["dir"])
    if not (data_dir / "index.json").is_file():
        if not cfg["data"]["auto_prepare"]:
            raise ShardError(f"{data_dir} is not prepared; run `fastbert prepare --out {data_dir} ...` or set "
                             "data.auto_prepare=true")
        if dist.local_rank == 0:
            from fastbert.data.prepare import PrepareConfig, prepare
            p = dict(cfg["data"]["prepare"])
            log.print(f"[fastbert] preparing {data_dir} from {p['corpus']} (one-time)")
            corpus = p.pop("corpus")
            prepare(PrepareConfig(corpus=corpus if isinstance(corpus, list) else [corpus], out=str(data_dir), **p),
                    progress=dist.is_main)
        barrier()
    load_index(data_dir)
    return data_dir


def build_model(cfg: dict, index: dict, device: torch.device):
    import fastbert
    from fastbert.config import BertConfig
    m = cfg["model"]
    kernels = m["kernels"]
    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" else "torch"
    overrides = dict(m["overrides"])
    overrides.setdefault("max_position_embeddings", max(512, index["seq_len"]))
    config = BertConfig.preset(m["preset"], prenorm=m["prenorm"], kernels=kernels, vocab_size=index["vocab_size"],
                               pad_token_id=index["special_ids"]["pad"], **overrides)
    head = m["head"]
    if head == "auto":
        head = "pretraining" if index["nsp"] else "masked_lm"
    if head == "pretraining":
        return fastbert.BertForPreTraining(config)
    if head == "masked_lm":
        return fastbert.BertForMaskedLM(config)
    raise ValueError(f"model.head={head!r} is not known; use auto, pretraining or masked_lm")


def choose_resume(resume, ckpt_dir: Path, dist: DistInfo, ds_config: dict, log) -> tuple[Optional[str], dict]:
    """The checkpoint tag to resume from (None = fresh start) and the DeepSpeed config to build with.
    A checkpoint written by another number of ranks is converted to DeepSpeed's universal format
    once (rank 0) and loaded from there."""
    if resume == "never":
        return None, ds_config
    tag = resume if resume not in ("auto", "must") else ckpt.find_latest(ckpt_dir)
    if tag is None:
        if resume == "must":
            raise FileNotFoundError(f"checkpoint.resume=must but {ckpt_dir} holds no complete checkpoint")
        return None, ds_config
    if not (ckpt_dir / tag / ckpt.MARKER).is_file():
        raise FileNotFoundError(f"checkpoint {ckpt_dir / tag} not found or incomplete; complete checkpoints: "
                                f"{[t for _, t in ckpt.complete_tags(ckpt_dir)] or 'none'}")
    universal = dict(ds_config, checkpoint=dict(ds_config.get("checkpoint", {}), load_universal=True))
    if tag.endswith(ckpt.UNIVERSAL_SUFFIX):
        return tag, universal
    saved_world = ckpt.checkpoint_world_size(ckpt_dir, tag)
    if saved_world == dist.world_size:
        return tag, ds_config
    log.print(f"[fastbert] {tag} was written by {saved_world} ranks; converting it to DeepSpeed's universal "
              f"format to resume on {dist.world_size}")
    if dist.is_main:
        ckpt.convert_to_universal(ckpt_dir, tag)
    barrier()
    return tag + ckpt.UNIVERSAL_SUFFIX, universal


def _seed_all(seed: int) -> None:
    import random
    import numpy as np
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------ loop pieces
class Accumulator:
    """Device-side sums over a logging window (no host sync until ``reduce``)."""

    KEYS = ("loss", "micro", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "tokens")

    def __init__(self, device):
        self.device = device
        self.reset()

    def reset(self):
        self.t = torch.zeros(len(self.KEYS), dtype=torch.float64, device=self.device)

    def add(self, out, next_sentence_label, tokens: int):
        vals = [out.loss.detach().double(), 1.0]
        correct, count = getattr(out, "mlm_correct", None), getattr(out, "mlm_count", None)
        vals += [correct if correct is not None else 0.0, count if count is not None else 0.0]
        nsp = getattr(out, "nsp_correct", None)
        if nsp is not None and next_sentence_label is not None:
            vals += [nsp, float(next_sentence_label.numel())]
        else:
            vals += [0.0, 0.0]
        vals.append(float(tokens))
        self.t += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in vals])

    def reduce(self, extra: list[float]) -> tuple[dict, list[float]]:
        """All-reduce (sum) the window and ``extra`` values in one collective."""
        import torch.distributed as dist
        t = torch.cat([self.t, torch.tensor(extra, dtype=torch.float64, device=self.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        vals = t.tolist()
        self.reset()
        return dict(zip(self.KEYS, vals[:len(self.KEYS)])), vals[len(self.KEYS):]


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def evaluate(engine: TrainEngine, batches: list, collator, collator_state: dict) -> dict:
    """MLM loss / accuracy (and NSP accuracy) on the fixed validation batches, all ranks together.
    The eval collator restarts from the same state each time: the same tokens are masked every eval."""
    collator.load_state_dict(collator_state)
    engine.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=engine.device)
    with torch.no_grad():
        for batch in batches:
            b = _to_device(batch, engine.device)
            ids, labels = collator(b["input_ids"], b["attention_mask"])
            kw = dict(input_ids=ids, attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"],
                      labels=labels)
            nsl = b.get("next_sentence_label")
            if nsl is not None and getattr(engine.module, "has_nsp", False):
                kw["next_sentence_label"] = nsl
            out = engine(**kw)
            count = out.mlm_count.double()
            mlm_loss = out.mlm_loss if getattr(out, "mlm_loss", None) is not None else out.loss
            nsp_c = out.nsp_correct.double() if getattr(out, "nsp_correct", None) is not None else count * 0
            nsp_n = float(nsl.numel()) if "next_sentence_label" in kw else 0.0
            sums += torch.stack([mlm_loss.detach().double() * count, out.mlm_correct.double(), count, nsp_c,
                                 torch.tensor(nsp_n, dtype=torch.float64, device=engine.device)])
    engine.train()
    loss_x_n, correct, n, nsp_c, nsp_n = all_reduce_sum(sums.tolist(), engine.device)
    result = {"mlm_loss": loss_x_n / max(n, 1), "mlm_acc": correct / max(n, 1), "mlm_tokens": n}
    if nsp_n:
        result["nsp_acc"] = nsp_c / nsp_n
    return result


def export_hf(engine: TrainEngine, model_cls, config, out_dir: Path, ckpt_dir: Path, tag: Optional[str],
              data_dir: Path) -> Optional[Path]:
    """Write an HF-loadable folder (config.json, model.safetensors, vocab.txt, tokenizer_config.json)
    from the fp32 weights: the module itself in fp32 runs without ZeRO-3, else DeepSpeed's fp32
    consolidation of the final checkpoint. Rank 0 writes."""
    import shutil
    target = out_dir / "hf"
    if engine.precision == "fp32" and engine.zero_stage < 3:
        model = engine.module
    else:
        model = None
        if engine.dist.is_main:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
            model = model_cls(config)
            missing, unexpected = model.load_state_dict(state, strict=False)
            # The decoder weight is the tied word embedding: absent from DeepSpeed's de-duplicated dict.
            missing = [k for k in missing if not k.endswith("predictions.decoder.weight")]
            if missing or unexpected:
                raise RuntimeError(f"HF export: checkpoint/model mismatch (missing {missing}, unexpected {unexpected})")
    if engine.dist.is_main:
        model.save_pretrained(target)
        for name in ("vocab.txt", "tokenizer_config.json"):
            if (data_dir / name).is_file():
                shutil.copyfile(data_dir / name, target / name)
    barrier()
    return target


# ------------------------------------------------------------------------------------------ main
def run_pretraining(cfg: dict) -> dict:
    """Train per ``cfg`` (see training/config.py); returns the final summary (rank 0 has the metrics)."""
    import warnings
    # DeepSpeed 0.19 calls torch.distributed collectives that torch 2.13 marks deprecated, once per bucket.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    dist = init_distributed()
    out_dir = Path(cfg["output_dir"])
    log = MetricsLogger(out_dir, enabled=dist.is_main, tensorboard=cfg["log"]["tensorboard"])
    try:
        return _run(cfg, dist, out_dir, log)
    finally:
        log.close()


def _run(cfg: dict, dist: DistInfo, out_dir: Path, log: MetricsLogger) -> dict:
    from fastbert.data.masking import collator_for
    from fastbert.data.pretrain_dataset import GlobalOrder, PretrainData, PretrainLoader, eval_batches

    t_cfg, d_cfg = cfg["train"], cfg["data"]
    data_dir = ensure_prepared(cfg, dist, log)
    train_data = PretrainData(data_dir, "train")
    index = train_data.index
    seed = int(t_cfg["seed"])
    _seed_all(seed)                                   # identical initial weights on every rank
    model = build_model(cfg, index, dist.device)
    num_params = model.num_parameters()               # before ZeRO-3 partitions the parameters
    ckpt_dir = out_dir / "checkpoints"
    c_cfg = cfg["checkpoint"]
    resume_tag, ds_config = choose_resume(c_cfg["resume"], ckpt_dir, dist, load_ds_config(t_cfg["deepspeed"]), log)
    engine = build_engine(model, ds_config, optimizer=t_cfg["optimizer"],
                          micro_batch_size=t_cfg["micro_batch_size"], global_batch_size=t_cfg["global_batch_size"],
                          precision=t_cfg["precision"], gradient_clipping=t_cfg["gradient_clipping"],
                          zero_stage=t_cfg["zero_stage"], dist=dist)
    _seed_all(seed + 1000 * (dist.rank + 1))          # per-rank dropout streams
    if dist.is_main:
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        (out_dir / "ds_config.json").write_text(json.dumps(engine.ds_config, indent=1) + "\n")

    # Schedule: wall-clock budget (LR follows time) or steps.
    lr = float(t_cfg["optimizer"]["lr"])
    max_steps = t_cfg["max_steps"]
    if t_cfg["time_budget"] is not None:
        schedule = TimeBudgetSchedule(lr, parse_duration(t_cfg["time_budget"]), t_cfg["warmup"], t_cfg["schedule"],
                                      clock=make_clock(t_cfg["clock"], dist.rank),
                                      all_reduce_max=torch_all_reduce_max(dist.device))
    else:
        schedule = StepSchedule(lr, max_steps, t_cfg["warmup"], t_cfg["schedule"])

    m_cfg = d_cfg["masking"]
    mk = dict(rate=m_cfg["rate"], mask_prob=m_cfg["mask_prob"], random_prob=m_cfg["random_prob"],
              random_tokens=m_cfg["random_tokens"], whole_word=m_cfg["whole_word"], device=dist.device, index=index)
    collator = collator_for(data_dir, seed=seed * 7919 + dist.rank, **mk)
    eval_collator = collator_for(data_dir, seed=seed * 7919 + 104729 + dist.rank, **mk)
    eval_state = eval_collator.state_dict()

    # Resume (the tag was chosen before the engine was built: another rank count needs the universal format).
    if resume_tag is not None:
        client, rank_state = ckpt.load_checkpoint(engine, ckpt_dir, resume_tag)
        schedule.load_state_dict(client["schedule"])
        if rank_state is not None:
            collator.load_state_dict(rank_state["masking"])
        else:
            log.print(f"[fastbert] checkpoint was written by {client.get('world_size')} ranks, this run has "
                      f"{dist.world_size}: model, optimizer, schedule and data position resume exactly; "
                      "masking and dropout streams are re-seeded")
        log.print(f"[fastbert] resumed from {ckpt_dir / resume_tag} at step {engine.global_steps}")
        log.log("resume", engine.global_steps, tag=resume_tag, world_size=dist.world_size)
    start_step = engine.global_steps

    order = GlobalOrder(len(train_data), engine.global_batch_size, seed)
    loader = PretrainLoader(train_data, order, rank=dist.rank, world=dist.world_size,
                            micro_batch=engine.micro_batch_size, grad_accum=engine.grad_accum,
                            start_step=start_step, prefetch=d_cfg["prefetch"], pin=dist.device.type == "cuda",
                            pad_to=d_cfg["pad_to"])
    e_cfg = cfg["eval"]
    val_batches = []
    try:
        val_data = PretrainData(data_dir, "val")
        if len(val_data):
            val_batches = eval_batches(val_data, rank=dist.rank, world=dist.world_size,
                                       micro_batch=e_cfg["micro_batch_size"] or engine.micro_batch_size,
                                       max_batches=e_cfg["batches"], pad_to=d_cfg["pad_to"])
    except Exception as e:  # a missing split is reported, not fatal
        log.print(f"[fastbert] no evaluation: {e}")
    if not val_batches:
        log.print("[fastbert] the validation split is empty or smaller than one eval round: evaluation is off")

    mc = model.config
    avg_len = index["splits"]["train"]["num_tokens"] / max(1, index["splits"]["train"]["num_sequences"])
    peak = peak_tflops(dist.device, cfg["log"]["peak_tflops"])
    log.print(f"[fastbert] {type(model).__name__} {cfg['model']['preset']} ({num_params / 1e6:.1f}M params, "
              f"kernels={mc.kernels}, prenorm={mc.prenorm}) | {dist.world_size} rank(s) on {dist.num_nodes} node(s), "
              f"{dist.device.type} | ZeRO-{engine.zero_stage} {engine.precision} | global batch "
              f"{engine.global_batch_size} = {engine.micro_batch_size} x {dist.world_size} x {engine.grad_accum} | "
              f"{len(train_data)} train sequences")

    log.log("start", start_step, world_size=dist.world_size, num_nodes=dist.num_nodes,
            local_world_size=dist.local_world_size, zero_stage=engine.zero_stage, precision=engine.precision,
            grad_accum=engine.grad_accum, global_batch_size=engine.global_batch_size, device=str(dist.device),
            train_sequences=len(train_data))
    acc = Accumulator(dist.device)
    log_every = cfg["log"]["every_steps"]
    want_eval_at, want_ckpt_at = _next_deadline(e_cfg["every_minutes"]), _next_deadline(c_cfg["every_minutes"])
    window_t0, window_steps = time.perf_counter(), 0
    last_ckpt_step, last_eval, train_metrics = start_step, None, {}
    step = start_step
    schedule_start = False
    has_nsp_head = getattr(model, "has_nsp", False)
    try:
        for step, micro, batch in loader:
            if micro == 0:
                if not schedule_start:
                    schedule.start()
                    schedule_start = True
                if isinstance(schedule, TimeBudgetSchedule):
                    step_lr = schedule.tick(step)
                    if schedule.done(step) or (max_steps is not None and step >= max_steps):
                        break
                else:
                    if schedule.done(step):
                        break
                    step_lr = schedule.lr(step)
                engine.set_lr(step_lr)
            tokens = int(batch["attention_mask"].sum())
            b = _to_device(batch, dist.device)
            ids, labels = collator(b["input_ids"], b["attention_mask"])
            kw = dict(input_ids=ids, attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"],
                      labels=labels)
            if has_nsp_head and "next_sentence_label" in b:
                kw["next_sentence_label"] = b["next_sentence_label"]
            out = engine(**kw)
            engine.backward(out.loss)
            engine.step()
            acc.add(out, kw.get("next_sentence_label"), tokens)
            if micro != engine.grad_accum - 1:
                continue
            done_steps = step + 1
            window_steps += 1
            # ---- logging (+ agreement on time-based triggers, in the same collective)
            if done_steps % log_every == 0:
                now = time.monotonic()
                flags = [float(want_eval_at is not None and now >= want_eval_at),
                         float(want_ckpt_at is not None and now >= want_ckpt_at)]
                sums, flags = acc.reduce(flags)
                dt = time.perf_counter() - window_t0
                train_metrics = _train_metrics(sums, engine, step_lr, window_steps, dt, mc, avg_len, peak)
                eta = _eta(schedule, max_steps, done_steps, dt / max(1, window_steps))
                log.progress(done_steps, max_steps, train_metrics, eta)
                log.log("train", done_steps, **train_metrics, **_schedule_info(schedule))
                window_t0, window_steps = time.perf_counter(), 0
                eval_due_time, ckpt_due_time = flags[0] > 0, flags[1] > 0
            else:
                eval_due_time = ckpt_due_time = False
            # ---- evaluation
            if val_batches and (eval_due_time or _every(e_cfg["every_steps"], done_steps)):
                last_eval = evaluate(engine, val_batches, eval_collator, eval_state)
                log.log("eval", done_steps, **last_eval)
                log.print(f"[eval] step {done_steps} | " + " | ".join(f"{k} {v:.4f}" for k, v in last_eval.items()))
                want_eval_at = _next_deadline(e_cfg["every_minutes"])
            # ---- checkpoint
            if ckpt_due_time or _every(c_cfg["every_steps"], done_steps):
                _save(engine, ckpt_dir, done_steps, schedule, collator, c_cfg["keep"], log)
                last_ckpt_step = done_steps
                want_ckpt_at = _next_deadline(c_cfg["every_minutes"])
                window_t0 = time.perf_counter()
    finally:
        loader.close()
    final_step = engine.global_steps
    if val_batches and e_cfg["at_end"]:
        last_eval = evaluate(engine, val_batches, eval_collator, eval_state)
        log.log("eval", final_step, final=True, **last_eval)
        log.print(f"[eval] final step {final_step} | " + " | ".join(f"{k} {v:.4f}" for k, v in last_eval.items()))
    tag = None
    if c_cfg["at_end"] or cfg["export"]["hf"]:
        if final_step != last_ckpt_step or ckpt.find_latest(ckpt_dir) is None:
            _save(engine, ckpt_dir, final_step, schedule, collator, c_cfg["keep"], log)
        tag = ckpt.find_latest(ckpt_dir)
    hf_dir = None
    if cfg["export"]["hf"]:
        hf_dir = export_hf(engine, type(model), model.config, out_dir, ckpt_dir, tag, data_dir)
        log.print(f"[fastbert] HF checkpoint: {hf_dir}")
    summary = {"steps": final_step, "skipped_steps": engine.skipped_steps, "eval": last_eval,
               "train": train_metrics, "hf_dir": str(hf_dir) if hf_dir else None,
               "elapsed_s": getattr(schedule, "elapsed", None)}
    log.log("done", final_step, **{k: v for k, v in summary.items() if k != "train"})
    if dist.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _save(engine, ckpt_dir, step, schedule, collator, keep, log):
    client = {"schedule": schedule.state_dict()}
    t0 = time.perf_counter()
    path = ckpt.save_checkpoint(engine, ckpt_dir, step, client, {"masking": collator.state_dict()}, keep=keep)
    log.log("checkpoint", step, path=str(path), seconds=time.perf_counter() - t0)
    log.print(f"[fastbert] checkpoint {path} ({time.perf_counter() - t0:.1f}s)")


def _every(n, step) -> bool:
    return bool(n) and step % n == 0


def _next_deadline(minutes) -> Optional[float]:
    return time.monotonic() + 60.0 * minutes if minutes else None


def _schedule_info(schedule) -> dict:
    if isinstance(schedule, TimeBudgetSchedule):
        return {"elapsed_s": schedule.elapsed, "budget_s": schedule.budget_s}
    return {}


def _eta(schedule, max_steps, done_steps, step_time) -> float:
    if isinstance(schedule, TimeBudgetSchedule):
        eta = schedule.remaining_s()
        if max_steps is not None:
            eta = min(eta, (max_steps - done_steps) * step_time)
        return eta
    return (schedule.total_steps - done_steps) * step_time


def _train_metrics(s: dict, engine: TrainEngine, lr: float, steps: int, dt: float, mc, avg_len, peak) -> dict:
    seqs = steps * engine.global_batch_size
    seq_per_s = seqs / dt if dt > 0 else 0.0
    tokens_per_s = s["tokens"] / dt if dt > 0 else 0.0
    m = {"loss": s["loss"] / max(1.0, s["micro"]), "lr": lr, "seq_per_s": seq_per_s, "tokens_per_s": tokens_per_s,
         "skipped_steps": engine.skipped_steps, "grad_norm": engine.grad_norm()}
    if s["mlm_count"]:
        m["mlm_acc"] = s["mlm_correct"] / s["mlm_count"]
    if s["nsp_count"]:
        m["nsp_acc"] = s["nsp_correct"] / s["nsp_count"]
    if engine.loss_scale is not None:
        m["loss_scale"] = engine.loss_scale
    if peak and seq_per_s:
        seq_len = s["tokens"] / max(1.0, seqs)
        masked = s["mlm_count"] / max(1.0, seqs)
        flops = train_flops_per_sequence(mc.hidden_size, mc.num_hidden_layers, mc.intermediate_size, mc.vocab_size,
                                         seq_len or avg_len, masked)
        m["mfu"] = flops * seq_per_s / (peak * 1e12 * engine.dist.world_size)
    return m
