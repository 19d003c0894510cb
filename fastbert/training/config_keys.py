"""Every pretraining config key with its default, type and meaning: the one table that
``training/config.py`` builds DEFAULTS from, validates every value against at load (before anything is
created), and ``fastbert pretrain --show-config`` prints.

Types: ``int``, ``number``, ``bool``, ``str``, ``path``, ``paths`` (a path or a list of them),
``fraction`` (a number in [0, 1]), ``duration`` (seconds or "90s", "5m", "24h", "1h30m"),
``choice:a|b|c``, ``list[int>=0]``, ``factor`` (> 1, or 0 = off), and the structured ``optimizer`` and
``overrides``; bounds are written after the name (``int>0``); a trailing ``?`` means null is allowed.
"""
from __future__ import annotations

import re

# (dotted key, default, type, meaning)
KEYS: list[tuple[str, object, str, str]] = [
    ("output_dir", "runs/pretrain", "path",
     "folder for checkpoints/, metrics.jsonl, tensorboard/, the HF export hf/ and loss_curve.png"),
    # model
    ("model.preset", "base", "choice:tiny|mini|small|medium|base|large", "model size (fastbert.config.PRESETS)"),
    ("model.prenorm", False, "bool", "Pre-LN (academic-budget recipe) instead of Post-LN (original BERT, HF-loadable)"),
    ("model.kernels", "auto", "choice:auto|torch|triton", "auto = triton on CUDA, torch on the CPU"),
    ("model.head", "auto", "choice:auto|pretraining|masked_lm",
     "auto = pretraining (MLM + NSP) when the data has NSP pairs, else masked_lm"),
    ("model.overrides", {}, "overrides", 'any BertConfig field, e.g. {"hidden_dropout_prob": 0.0}'),
    # data
    ("data.dir", "runs/data/enwiki-128", "path", "prepared shards (index.json + .npy)"),
    ("data.auto_prepare", True, "bool", "prepare data.dir from data.prepare when it is not prepared yet"),
    ("data.prepare.corpus", ["../shared/data/pretrain/enwiki_wikiextractor"], "paths",
     "text files or folders to prepare (.txt/.xz/.gz, WikiExtractor <doc> files)"),
    ("data.prepare.vocab", "../shared/data/vocab/bert-base-uncased/vocab.txt", "path", "WordPiece vocab.txt"),
    ("data.prepare.seq_len", 128, "int>0", "tokens per sequence incl. [CLS]/[SEP]"),
    ("data.prepare.nsp", False, "bool", "build [CLS] A [SEP] B [SEP] pairs with next-sentence labels"),
    ("data.prepare.val_fraction", 0.01, "fraction", "fraction of documents held out for evaluation"),
    ("data.prepare.short_seq_prob", 0.1, "fraction", "probability of a shorter random target length (as BERT)"),
    ("data.prepare.seed", 12345, "int>=0", "seed of the packing and the split"),
    ("data.prepare.workers", 2, "int>0", "parallel processes, one input file each"),
    ("data.masking.rate", 0.15, "fraction", "fraction of tokens per sequence to predict"),
    ("data.masking.mask_prob", 0.8, "fraction", "of those, replaced by [MASK]"),
    ("data.masking.random_prob", 0.1, "fraction", "of those, replaced by a random token (the rest kept)"),
    ("data.masking.random_tokens", "uniform", "choice:uniform|unigram", "distribution of the random tokens"),
    ("data.masking.whole_word", False, "bool", "mask all pieces of a word together"),
    ("data.packing", "pack", "choice:pack|none",
     "static-shape rows of seq_len tokens: pack = up to data.per_row sequences a row (global batch counts rows); "
     "none = one sequence a row"),
    ("data.per_row", 4, "int>0", "most prepared sequences packed into one row (data.packing=pack)"),
    ("data.pack_span", 4, "int>0", "rows one packing bin spans (data.packing=pack): a sequence may continue into "
     "the next row of its bin; the span used is gcd(data.pack_span, train.micro_batch_size)"),
    ("data.prefetch", 4, "int>=0", "batches prepared ahead by the loader thread"),
    # train
    ("train.micro_batch_size", 32, "int>0", "sequences per rank per forward/backward"),
    ("train.global_batch_size", 256, "int>0", "sequences per optimizer step (gradient accumulation fills the gap)"),
    ("train.max_steps", None, "int>0?", "step budget (and a hard cap when time_budget is set)"),
    ("train.time_budget", None, "duration?",
     "wall-clock budget of training time, e.g. '3m', '24h'; the LR schedule then follows time"),
    ("train.warmup", 0.06, "fraction", "warmup as a fraction of the budget"),
    ("train.schedule", "linear", "choice:linear|constant", "after warmup: linear decay to 0, or constant"),
    ("train.optimizer", {"type": "adamw", "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01},
     "optimizer", "type (adamw | lamb), peak lr, betas, eps, weight_decay"),
    ("train.gradient_clipping", 1.0, "number>=0?", "global gradient-norm clipping (0/null = off)"),
    ("train.precision", "auto", "choice:auto|fp32|bf16|fp16|fp8",
     "auto = bf16 on CUDA (fp16 without bf16), fp32 on CPU; fp8 = bf16 with the encoder's GEMMs in FP8 "
     "(delayed scaling; Ada/Hopper)"),
    ("train.deepspeed", None, "path?", "DeepSpeed JSON (ZeRO, offload); null = ZeRO stage train.zero_stage"),
    ("train.zero_stage", "auto", "choice:auto|0|1|2|3?",
     "ZeRO stage: auto = 0 on one rank (fastest measured) unless the JSON offloads or asks for ZeRO-3, else the "
     "JSON's; a number overrides the JSON's; null = the JSON's"),
    ("train.cuda_graphs", True, "bool",
     "replay forward + backward from CUDA graphs (static shapes, ZeRO-0, bf16/fp32 on CUDA; else eager, "
     "with the reason logged)"),
    ("train.seed", 42, "int>=0", "seed of the initial weights, the data order, masking and dropout"),
    ("train.deterministic", False, "bool", "bit-identical loss curves for the same seed and hardware (slower)"),
    ("train.clock", "monotonic", "clock", "time source of the schedule; tests: 'fake:TICK[:SKEW]'"),
    # guard
    ("guard.enabled", True, "bool", "skip non-finite / spiking steps, roll back on repeats (training/guard.py)"),
    ("guard.window", 50, "int>0", "running statistics over the last N steps"),
    ("guard.min_history", 10, "int>0", "spike checks start after this many steps (<= window)"),
    ("guard.warmup_steps", 50, "int>=0", "no spike checks before this optimizer step (early training moves fast)"),
    ("guard.loss_factor", 3.0, "factor?",
     "loss spike: above factor x median AND median + noise_sigmas x its noise (0/null = off)"),
    ("guard.grad_norm_factor", 1000.0, "factor?",
     "gradient-norm spike: above factor x median AND median + noise_sigmas x its noise (0/null = off)"),
    ("guard.noise_sigmas", 8.0, "number>=0", "how many robust standard deviations (1.4826 x MAD) a spike must exceed"),
    ("guard.rollback_after", 3, "int>0", "consecutive bad steps before rolling back to the last good checkpoint"),
    ("guard.max_rollbacks", 5, "int>=0", "then stop with an error"),
    ("guard.inject_nan_steps", [], "list[int>=0]", "drills: multiply the loss by NaN at these data steps (rank 0)"),
    ("guard.inject_spike_steps", [], "list[int>=0]", "drills: multiply the loss by inject_spike_factor at these steps"),
    ("guard.inject_spike_factor", 100.0, "number>0", "size of the injected spikes"),
    # dist
    ("dist.preflight", True, "bool", "check every rank (versions, devices, clocks) before training"),
    ("dist.connect_timeout_s", 120.0, "number>0", "seconds to wait for all ranks to join"),
    ("dist.collective_timeout_s", 1800.0, "number>0", "seconds before a stuck collective is an error"),
    ("dist.heartbeat_s", 5.0, "number>=0", "liveness ring period (0 = no watchdog)"),
    ("dist.heartbeat_timeout_s", 120.0, "number>0", "a rank silent this long is declared lost (>= 2 x heartbeat_s)"),
    # eval
    ("eval.every_steps", None, "int>0?", "evaluate every N steps"),
    ("eval.every_minutes", None, "number>0?", "evaluate every N minutes"),
    ("eval.batches", 50, "int>0", "held-out batches per evaluation"),
    ("eval.micro_batch_size", None, "int>0?", "null = train.micro_batch_size"),
    ("eval.at_end", True, "bool", "evaluate once more at the end"),
    # checkpoint
    ("checkpoint.every_steps", None, "int>0?", "save every N steps"),
    ("checkpoint.every_minutes", 30, "number>0?", "save every N minutes"),
    ("checkpoint.keep", 2, "int>0", "checkpoints kept (the newest good one is never deleted)"),
    ("checkpoint.resume", "auto", "resume",
     "auto (newest, if any) | never (start over) | must (fail without one) | a tag like step_00000100"),
    ("checkpoint.at_end", True, "bool", "save at the end"),
    ("checkpoint.hf", True, "bool", "HF-loadable weights in every checkpoint (step_N/hf/)"),
    ("checkpoint.interrupt_timeout_s", 300.0, "number>0",
     "after Ctrl-C / SIGTERM: seconds to reach the next step boundary and save before exiting anyway"),
    # log, export
    ("log.every_steps", 10, "int>0", "console / metrics.jsonl / TensorBoard line every N steps"),
    ("log.tensorboard", True, "bool", "write OUTPUT_DIR/tensorboard"),
    ("log.peak_tflops", None, "number>0?", "the device's peak for MFU (null = known cards)"),
    ("export.hf", True, "bool", "write the final model to OUTPUT_DIR/hf (fp32, consolidated from ZeRO)"),
]

OPEN = {"model.overrides", "train.optimizer"}      # leaves whose value is a dict with keys of its own


def defaults() -> dict:
    """The nested DEFAULTS dict."""
    import copy
    out: dict = {}
    for key, default, _, _ in KEYS:
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = copy.deepcopy(default)
    return out


def leaves(cfg: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of a merged config (open dicts are leaves)."""
    for k, v in cfg.items():
        key = prefix + k
        if isinstance(v, dict) and key not in OPEN:
            yield from leaves(v, key + ".")
        else:
            yield key, v


# ------------------------------------------------------------------------------------------ checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    import math
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_BOUND = re.compile(r"^(int|number)(>=|>)(-?\d+(?:\.\d+)?)$")


def problem(key: str, value, typ: str):
    """None when ``value`` fits ``typ``, else what is wrong (without the key)."""
    if typ.endswith("?"):
        if value is None:
            return None
        typ = typ[:-1]
    m = _BOUND.match(typ)
    if m:
        kind, op, bound = m.group(1), m.group(2), float(m.group(3))
        ok = (_is_int if kind == "int" else _is_number)(value)
        if ok and (value > bound if op == ">" else value >= bound):
            return None
        what = "an integer" if kind == "int" else "a number"
        return f"must be {what} {op} {m.group(3)}"
    if typ == "int":
        return None if _is_int(value) else "must be an integer"
    if typ == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if typ in ("str", "path"):
        return None if isinstance(value, str) and value else "must be a non-empty string"
    if typ == "paths":
        ok = (isinstance(value, str) and value) or (isinstance(value, list) and value
                                                    and all(isinstance(p, str) and p for p in value))
        return None if ok else 'must be a path or a non-empty list of paths, e.g. ["/data/wiki"]'
    if typ == "fraction":
        return None if _is_number(value) and 0 <= value <= 1 else "must be a number in [0, 1]"
    if typ == "factor":
        return None if _is_number(value) and (value == 0 or value > 1) else "must be > 1 (or 0/null to turn it off)"
    if typ == "duration":
        from fastbert.training.schedules import parse_duration
        try:
            seconds = parse_duration(value)
        except ValueError:
            return "is not a duration: use seconds or e.g. '90s', '5m', '24h', '1h30m'"
        return None if seconds > 0 else "must be longer than 0 seconds"
    if typ.startswith("choice:"):
        options = typ[len("choice:"):].split("|")
        return None if str(value) in options and not isinstance(value, bool) and \
            (isinstance(value, str) or _is_int(value)) else f"must be one of {' | '.join(options)}"
    if typ.startswith("list[") and typ.endswith("]"):
        inner = typ[5:-1]
        if not isinstance(value, list) or any(problem(key, v, inner) for v in value):
            return f"must be a list of {inner.replace('int', 'integers ')}"
        return None
    if typ == "clock":
        ok = isinstance(value, str) and re.fullmatch(r"monotonic|fake:\d+(\.\d+)?(:\d+(\.\d+)?)?", value)
        return None if ok else "must be 'monotonic' (or 'fake:TICK[:SKEW]' in tests)"
    if typ == "resume":
        return None if isinstance(value, str) and value else "must be auto, never, must or a checkpoint tag"
    if typ == "optimizer":
        return _optimizer_problem(value)
    if typ == "overrides":
        return _overrides_problem(value)
    raise AssertionError(f"unknown config type {typ!r} for {key}")


def _optimizer_problem(value):
    if not isinstance(value, dict):
        return 'must be an object, e.g. {"type": "adamw", "lr": 1e-3}'
    from fastbert.training.optim_spec import OptimizerSpec
    for k in ("lr", "eps", "weight_decay"):
        if k in value and not (_is_number(value[k]) and value[k] >= 0):
            return f"has {k}={value[k]!r}; it must be a number >= 0"
    if "betas" in value and not (isinstance(value["betas"], list) and all(_is_number(b) for b in value["betas"])):
        return f"has betas={value['betas']!r}; use two numbers, e.g. [0.9, 0.98]"
    if "type" in value and not isinstance(value["type"], str):
        return "has a type that is not a string (adamw | lamb)"
    try:
        OptimizerSpec.from_dict(value)
    except (TypeError, ValueError) as e:
        return f"is not valid: {e}"
    return None


def _overrides_problem(value):
    if not isinstance(value, dict):
        return 'must be an object of BertConfig fields, e.g. {"hidden_dropout_prob": 0.0}'
    from dataclasses import fields

    from fastbert.config import BertConfig
    known = {f.name for f in fields(BertConfig)}
    unknown = sorted(set(value) - known)
    return f"has unknown BertConfig field(s) {unknown}; known: {sorted(known)}" if unknown else None


def describe(cfg: dict | None = None, source: str = "this config") -> str:
    """The table ``fastbert pretrain --show-config`` prints; with ``cfg``, each value it changes too."""
    import json
    values = dict(leaves(cfg)) if cfg is not None else {}
    width = max(len(k) for k, *_ in KEYS)
    lines = ["Pretraining config keys: set them in the JSON file given with --config, or as KEY=VALUE on the "
             "command line", "(values are JSON: numbers, true/false, null, [lists], {objects}; anything else is a "
             "string). A trailing '?' on a type means null is allowed.", ""]
    section = None
    for key, default, typ, meaning in KEYS:
        top = key.split(".")[0]
        if top != section and section is not None:
            lines.append("")
        section = top
        lines.append(f"{key:<{width}}  {typ}, default {json.dumps(default)}")
        lines.append(f"{'':<{width}}  {meaning}")
        if key in values and values[key] != default:
            lines.append(f"{'':<{width}}  {source}: {json.dumps(values[key])}")
    return "\n".join(lines)
