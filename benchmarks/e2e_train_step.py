"""End-to-end training-step benchmark: full optimizer steps of BertForPreTraining, fastbert vs HF.

One card, the same batches for every contender: 15% of real tokens masked (80/10/10 is irrelevant to
speed, so masked ids are kept), NSP labels, and either
  padded: lengths drawn from real Wikipedia paragraph lengths (benchmarks/data), padded to --seq, or
  packed: every sequence full (what `fastbert prepare` produces: packed segments),
  sst2:   real SST-2 sentence lengths padded to --seq (the fine-tuning shape).
Contenders: hf-eager, hf-sdpa, hf-compile (SDPA + torch.compile), fb-torch, fb-triton, fb-compile
(fb-triton under torch.compile: Inductor fuses the glue around the fastbert custom ops), fb-graphs
(fb-triton's model stepped as the `fastbert pretrain` loop steps it: each batch in the loader's
static-shape `packed=` form, one sequence a row, MLM targets in the masking collator's fixed slots, the
sparse MLM head, forward + backward replayed from CUDA graphs, training/cuda_graphs.py; no DeepSpeed and
no clipping, as for the others; rows are encoded whole, padding included as its own segments, so in
padded / sst2 mode it does more work than fb-triton), hf-patch (HF SDPA model + fastbert.patch),
fb-fp8 / fb-fp8-graphs (fb-triton / fb-graphs with BertConfig.fp8: the encoder's GEMMs in FP8 with delayed
scaling, what `train.precision=fp8` runs; asked for by name). All run bf16 autocast over fp32 weights with
torch's fused AdamW, except fb-graphs and fb-fp8-graphs, which step as the engine does: fastbert's AdamW
(training/optim.py), which also writes the weights' bf16 copies the forward reads (ops/weight_casts.py), and
is handed a found_inf flag each step as the spike guard hands it.

Isolation: every contender runs in a fresh worker process (this script with --worker), since what one
contender leaves in a process slows the next (fb-triton: 85 ms/step alone, 121 right after hf-compile).
Each worker rebuilds the shared initial weights (HF's init on the CPU after torch.manual_seed(0)) and
the batches (numpy seed 0), so all see the same ones; each result carries a digest of both and the
parent warns if they differ. A failed worker is reported with its stderr tail; the others go on.
--same-process runs every contender in this process, one after another.

--probe-order looks for the cause of that slowdown, in one process: fb-triton, hf-compile, fb-triton,
recording before each run a cuBLAS bf16 GEMM's TFLOP/s (a throttled clock shows there), torch's thread
count, live child processes (Inductor keeps a compile-worker pool) and this process's threads, and
after it the host time to issue a step and the configs Triton's autotuner chose for fastbert's kernels (none
since the thirty-second session: no fastbert kernel autotunes, so the row reads "0 entries").
Prints the two fb-triton runs side by side; writes e2e_probe_<preset>_s<seq>_b<batch>_<mode>.json.

--device cpu is a smoke test of the plumbing: fp32 (no autocast), wall-clock timing, only the
contenders that run on a CPU (hf-eager, hf-sdpa, fb-torch; the others are skipped with a line each).

Before timing, every contender's first-batch loss (eval mode, shared weights) is checked against
HF SDPA's (fb-graphs: its packed forward's). Timing: CUDA events around --steps full steps after
--warmup steps (fb-graphs at least 3: a shape runs eagerly when first seen, is captured the second time).

Model FLOPs per step (the same for every contender; padding is never counted):
  6 * T * L * (4H^2 + 2HI)              dense matmuls, T real tokens
  + 12 * L * H * sum_i len_i^2          attention scores and context (fwd 4*len*H per token, x3)
  + 6 * M * (H^2 + H*V)                 MLM head on the M masked tokens
MFU divides by the card's dense bf16 peak (989 TFLOP/s for H100/H200 SXM).

--accumulate N steps the optimizer every N micro-batches, as `fastbert pretrain` does with gradient accumulation
(the academic-budget recipes: 32): the graph contenders then add each micro-batch's gradients into buffers of their own
inside the graphs (training/cuda_graphs.py); the table's "step" is a micro-batch with its share of the optimizer step.

Memory (CUDA): "peak GB" is the most the timed steps had allocated (torch's max_memory_allocated, reset after the
warm-up). A graph contender's replays allocate nothing, their activations living in the graphs' private pool made at
capture, so its peak is mostly weights, optimizer state and gradients: "held GB" (max_memory_reserved, the pools
included) is the figure to set beside HF's. "SM MHz, W, C": the card's median SM clock and board power over the timed
steps and its temperature, first -> highest (``gpu_clocks.py``, nvidia-smi every 50 ms): at a power cap the clock
moves with the work, the data and the chip's temperature, and hosts differ. "mJ/seq": the mean power over the
sequences a second, the energy a sequence costs; a step that runs at the cap goes faster only by costing less of it.

  python3 benchmarks/e2e_train_step.py --preset large --seq 128 --batch 128 --mode packed
  python3 benchmarks/e2e_train_step.py --preset large --seq 128 --batch 128 --probe-order
  python3 benchmarks/e2e_train_step.py --preset large --prenorm --contenders fb-graphs --accumulate 4 --steps 24
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks.* as the other benchmarks import it, also through runpy/importlib
from benchmarks.gpu_clocks import ClockSampler  # noqa: E402
PEAK_BF16 = 989.4e12
CONTENDERS = ("hf-eager", "hf-sdpa", "hf-compile", "fb-torch", "fb-triton", "fb-compile", "fb-graphs", "hf-patch",
              "fb-fp8", "fb-fp8-graphs")
NEEDS_GPU = {"hf-compile": "torch.compile", "fb-triton": "Triton kernels", "fb-compile": "Triton kernels",
             "fb-graphs": "CUDA graphs", "hf-patch": "Triton kernels", "fb-fp8": "FP8 tensor cores",
             "fb-fp8-graphs": "FP8 tensor cores and CUDA graphs"}
DEFAULT = [c for c in CONTENDERS if "fp8" not in c]   # FP8 needs an Ada/Hopper card: asked for by name
PROBE_ORDER = ("fb-triton", "hf-compile", "fb-triton")
GRAPH_WARMUP = 3         # eager (first sight of the shape), capture + replay, replay
STDERR_TAIL = 30         # lines of a failed worker's stderr to show
BERT_SPECIAL_IDS, MASK_ID = (0, 100, 101, 102, 103), 103    # [PAD] [UNK] [CLS] [SEP] [MASK] of BERT's vocabulary


def lengths_for(mode: str, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    if mode == "packed":
        return np.full(batch, seq)
    source = {"padded": "wiki_paragraph_lengths.json", "sst2": "sst2_lengths.json"}[mode]
    counts = np.array(json.loads((HERE / "data" / source).read_text())["counts"], dtype=np.float64)
    counts[:3] = 0  # a sequence has at least [CLS] x [SEP]
    lengths = rng.choice(len(counts), size=batch, p=counts / counts.sum())
    return np.minimum(lengths, seq)


def make_batches(n, batch, seq, vocab, mode, device, seed=0):
    """HF-style batches; drawn from one numpy generator, so every process gets the same ones."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = lengths_for(mode, batch, seq, rng)
        mask = (np.arange(seq)[None] < lengths[:, None])
        ids = rng.integers(1000, vocab, size=(batch, seq)) * mask
        ids[:, 0] = 101
        ids[np.arange(batch), lengths - 1] = 102
        types = (np.arange(seq)[None] >= (lengths[:, None] // 2)) & mask
        pick = (rng.random((batch, seq)) < 0.15) & mask
        pick[:, 0] = False
        labels = np.where(pick, ids, -100)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).long().to(device)  # noqa: E731
        out.append(dict(input_ids=t(ids), attention_mask=t(mask), token_type_ids=t(types), labels=t(labels),
                        next_sentence_label=t(rng.integers(0, 2, size=batch))))
    return out


def mlm_slots(batches, vocab_size: int) -> int:
    """One MLM slot count for all batches (one captured shape): what the masking collator gives this batch
    geometry (``MaskingCollator.capacity``, what the pretrain loader pads to), raised where the benchmark's
    per-token 15% draw picked more tokens than the collator's per-row rule ever does."""
    from fastbert.data.masking import MaskingCollator
    rows, seq = batches[0]["input_ids"].shape
    capacity = MaskingCollator(vocab_size, BERT_SPECIAL_IDS, MASK_ID).capacity(rows, seq)
    return max(capacity, max(int((b["labels"] != -100).sum()) for b in batches))


def packed_batch(batch: dict, slots: int) -> dict:
    """``batch`` in the static-shape form the pretrain loader feeds ``model(packed=...)``: rows built by
    ``data/static_batch.build_rows`` (one sequence a row, per_row=1: the same tokens, token types and NSP
    labels), the masked positions laid out as ``MaskingCollator.masked_slots`` lays them out (flat
    positions in order, then unused slots at 0 with target -100). Built on the host, once."""
    from fastbert.data.static_batch import build_rows
    ids, mask, labels, nsp = (batch[k].cpu().numpy() for k in ("input_ids", "attention_mask", "labels",
                                                               "next_sentence_label"))
    seq = ids.shape[1]
    # make_batches starts segment B (token type 1) at half the length
    rows = [[(ids[r, :n], n // 2, nsp[r])] for r, n in enumerate(mask.sum(1))]
    arrays = build_rows(rows, seq, per_row=1, pad_id=0, nsp=True)
    chosen = np.flatnonzero(labels.reshape(-1) != -100)
    positions = np.zeros(slots, dtype=np.int64)
    targets = np.full(slots, -100, dtype=np.int64)
    positions[:len(chosen)], targets[:len(chosen)] = chosen, labels.reshape(-1)[chosen]
    t = lambda a: torch.as_tensor(a, device=batch["input_ids"].device)  # noqa: E731
    return dict(input_ids=t(arrays["input_ids"]), token_type_ids=t(arrays["token_type_ids"]),
                position_ids=t(arrays["position_ids"]), cu_seqlens=t(arrays["cu_seqlens"]), max_seqlen=seq,
                mlm_positions=t(positions), mlm_targets=t(targets), cls_positions=t(arrays["cls_positions"]),
                next_sentence_label=t(arrays["next_sentence_label"]))


def model_flops(batch, cfg) -> float:
    L, H, I, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    lengths = batch["attention_mask"].sum(1).double()
    T = float(lengths.sum())
    M = float((batch["labels"] != -100).sum())
    return 6 * T * L * (4 * H * H + 2 * H * I) + 12 * L * H * float((lengths ** 2).sum()) + 6 * M * (H * H + H * V)


def hf_config(preset: str, seq: int, act: str = "gelu", prenorm: bool = False):
    import transformers
    from fastbert import BertConfig
    fb = BertConfig.preset(preset, max_position_embeddings=max(512, seq), hidden_act=act, prenorm=prenorm)
    d = fb.to_dict()
    d.pop("fastbert_prenorm", None)
    return transformers.BertConfig(**d), fb


@dataclass
class Inputs:
    """What every contender starts from: the same in every process (fixed seeds; weights drawn on the CPU)."""
    hcfg: object                  # transformers.BertConfig
    fcfg: object                  # fastbert.BertConfig
    hf_state: dict                # HF's initial weights
    batches: list
    digest: str                   # of the weights and batches: equal across workers, or the parent warns

    @classmethod
    def make(cls, args, device) -> "Inputs":
        import transformers
        hcfg, fcfg = hf_config(args.preset, args.seq, args.act, args.prenorm)
        torch.manual_seed(0)
        hf_state = transformers.BertForPreTraining(hcfg).state_dict()
        batches = make_batches(8, args.batch, args.seq, fcfg.vocab_size, args.mode, device)
        h = hashlib.sha1()
        for name, t in sorted(hf_state.items()):
            h.update(name.encode())
            h.update(t.detach().contiguous().view(torch.uint8).numpy())
        for b in batches:
            for k in sorted(b):
                h.update(b[k].cpu().numpy().tobytes())
        return cls(hcfg, fcfg, hf_state, batches, h.hexdigest()[:16])


def build(name, hf_state, hcfg, fcfg, device):
    import transformers
    import fastbert
    from fastbert.hf import load_converted
    if name.startswith("hf"):
        impl = "eager" if name == "hf-eager" else "sdpa"
        model = transformers.BertForPreTraining(hcfg, attn_implementation=impl) if _takes_impl() \
            else transformers.BertForPreTraining(hcfg)
        model.config._attn_implementation = impl
        model.load_state_dict(hf_state, strict=False)
        model = model.to(device)
        if name == "hf-patch":
            fastbert.patch(model, kernels="triton")
        step_model = torch.compile(model) if name == "hf-compile" else model
        return model, step_model
    cfg = fcfg.replace(kernels="torch" if name == "fb-torch" else "triton", fp8=name.startswith("fb-fp8"))
    model = fastbert.BertForPreTraining(cfg)
    if cfg.prenorm:  # HF has no Pre-LN: the same weights, the final LayerNorm as initialized (ones, zeros)
        ln = model.bert.encoder.final_layer_norm
        hf_state = {**hf_state, "bert.encoder.final_layer_norm.weight": ln.weight.detach().clone(),
                    "bert.encoder.final_layer_norm.bias": ln.bias.detach().clone()}
    load_converted(model, hf_state)
    model = model.to(device)
    return model, (torch.compile(model) if name == "fb-compile" else model)


def _takes_impl():
    import inspect
    import transformers
    return "attn_implementation" in inspect.signature(transformers.BertForPreTraining.__init__).parameters


def autocast_for(device: torch.device):
    """bf16 autocast on the GPU; fp32 on the CPU (the smoke test checks plumbing, not speed)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def first_loss(step_model, kwargs, autocast):
    step_model.eval()
    with torch.no_grad(), autocast:
        loss = step_model(**kwargs).loss.float().item()
    step_model.train()
    return loss


def timed_steps(step, inputs, steps, device):
    """(ms per step, host ms per step to issue them, last loss). On the GPU the issue time is the wall time
    of the loop before the final synchronize (it includes any wait for the allocator or a full launch
    queue); on the CPU both are the wall time."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(inputs[i % len(inputs)])
    issue_ms = (time.perf_counter() - t0) * 1e3 / steps
    if device.type != "cuda":
        return issue_ms, issue_ms, loss
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, issue_ms, loss


def trace_kernels(prof) -> list:
    """(name, start us, duration us) of every GPU activity (kernels, memsets, copies) the profiler recorded."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    return [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]


def gpu_idle(kernels: list, steps: int) -> Optional[dict]:
    """Where the GPU waits between its own work, a step's share: the span from the first activity's start to the
    last one's end, the time some activity runs (overlaps counted once), the rest idle; the idle time before
    fastbert's Triton kernels (names ``_*_kernel``) apart from the rest, and the median gap."""
    if not kernels:
        return None
    kernels = sorted(kernels, key=lambda k: k[1])
    busy, idle_triton, idle_other, gaps, end = 0.0, 0.0, 0.0, [], kernels[0][1]
    for name, start, dur in kernels:
        gap = max(0.0, start - end)
        if gap > 0:
            gaps.append(gap)
            if name.startswith("_") and name.endswith("_kernel"):
                idle_triton += gap
            else:
                idle_other += gap
        busy += max(0.0, start + dur - max(start, end))
        end = max(end, start + dur)
    span = end - kernels[0][1]
    ms = lambda us: round(us / steps / 1e3, 3)  # noqa: E731
    return dict(activities_per_step=round(len(kernels) / steps), span_ms=ms(span), busy_ms=ms(busy),
                idle_ms=ms(span - busy), idle_before_triton_ms=ms(idle_triton), idle_before_other_ms=ms(idle_other),
                median_gap_us=round(statistics.median(gaps), 2) if gaps else 0.0)


def run_contender(name, inp: Inputs, warmup, steps, device, profile=False, out_dir=None, accumulate: int = 1):
    model, step_model = build(name, inp.hf_state, inp.hcfg, inp.fcfg, device)
    autocast = autocast_for(device)
    graphs, batches = None, inp.batches
    if name in ("fb-graphs", "fb-fp8-graphs"):
        from fastbert.training.cuda_graphs import GraphedModel
        graphs = GraphedModel(model, "bf16")
        graphs.activate()  # the training stream, before any backward makes gradient accumulators (as the engine)
        slots = mlm_slots(batches, inp.fcfg.vocab_size)
        batches = [{"packed": packed_batch(b, slots)} for b in batches]
        warmup = max(warmup, GRAPH_WARMUP)
    warmup = -(-warmup // accumulate) * accumulate  # the timed micro-batches start an optimizer step
    try:
        # fb-graphs: the packed forward. Its loss is normalised as HF's (MLM mean over the masked tokens, unused
        # slots weigh 0; NSP mean over the sequences), so it differs from HF's padded loss only by arithmetic
        # (other kernels, summation order, bf16): ~1e-2 at most here, ~1e-6 in fp32 (tests/benchmarks).
        check = first_loss(step_model, batches[0], autocast)
        hyper = dict(lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
        casts = None
        if graphs is not None:   # TrainEngine's optimizer, which writes the weights' 16-bit copies it keeps
            from fastbert.ops.weight_casts import WeightCasts
            from fastbert.training.optim import AdamW
            opt, casts = AdamW(model.parameters(), **hyper), WeightCasts(derived=accumulate > 1)
            opt.weight_casts = casts
            # the spike guard's verdict, as `fastbert pretrain` hands it to the optimizer every step (a device flag)
            opt.found_inf = torch.zeros((), device=device)
        else:
            opt = torch.optim.AdamW(model.parameters(), **hyper, fused=True)

        micro = [0]  # micro-batches of the optimizer step so far

        def step(kw):
            # As TrainEngine: a graph's output, else the eager model (first sight of a shape, eval); no outer
            # autocast around the graphs, they capture under their own; the 16-bit copies active around the
            # forward and refreshed before an optimizer step's first one (nothing to copy once the optimizer wrote
            # them). With accumulation the graphs own the gradients from the step's first backward on
            # (graphs.own_grads(), as the engine calls it) and add each micro-batch's into them; without,
            # DeepSpeed's ZeRO-0 step sets them to None. One call is one micro-batch; the optimizer steps after
            # every ``accumulate``-th.
            first = micro[0] == 0
            with casts.active() if casts is not None else contextlib.nullcontext():
                if casts is not None and first:
                    casts.refresh()
                out = graphs(kw["packed"]) if graphs is not None else None
                if out is None:
                    with autocast:
                        out = step_model(**kw)
            if graphs is not None and accumulate > 1 and first:
                graphs.own_grads()
            out.loss.backward()
            micro[0] = (micro[0] + 1) % accumulate
            if micro[0] == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
            return out.loss

        t0 = time.time()
        for i in range(warmup):
            step(batches[i % len(batches)])
        synchronize(device)
        compile_s = time.time() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        replays = graphs.replays if graphs is not None else 0
        with ClockSampler(device) as clocks:
            ms, issue_ms, loss = timed_steps(step, batches, steps, device)
        replays = graphs.replays - replays if graphs is not None else 0    # == steps when every step replayed
        gaps = None
        if profile:
            from torch.profiler import ProfilerActivity, profile as torch_profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch_profile(activities=activities) as prof:
                for i in range(3):
                    step(batches[i % len(batches)])
                synchronize(device)
            gaps = gpu_idle(trace_kernels(prof), 3) if device.type == "cuda" else None
            if gaps:
                print(f"--- GPU idle {name}: " + ", ".join(f"{k} {v}" for k, v in gaps.items()), flush=True)
            sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
            if out_dir:  # the whole table beside the JSON; the top of it on stdout
                (Path(out_dir) / f"profile_{name}.txt").write_text(table)
            print(f"--- profile {name} (3 steps; self time, top 25 of 60"
                  f"{' in ' + str(Path(out_dir) / f'profile_{name}.txt') if out_dir else ''}) ---")
            print("\n".join(table.splitlines()[:28]), flush=True)
        res = dict(contender=name, ms_per_step=ms, issue_ms_per_step=issue_ms, check_loss=check,
                   final_loss=float(loss.detach()), warmup_s=compile_s, inputs_digest=inp.digest,
                   peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                   held_mem_gb=torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None,
                   clocks=clocks.result)
        if graphs is not None:
            res["graph_replays"] = replays
        if profile and gaps:
            res["gpu_idle"] = gaps
    finally:
        if graphs is not None:
            synchronize(device)
            torch.cuda.set_stream(torch.cuda.default_stream())
    del model, step_model, graphs, opt, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------------------- order probe
def gemm_tflops(n: int = 8192, reps: int = 10) -> float:
    """cuBLAS bf16 n^3 GEMM TFLOP/s now (median of ``reps`` after warm-up): a throttled clock shows here."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del a, b, c
    torch.cuda.empty_cache()
    return 2 * n ** 3 / (statistics.median(times) * 1e-3) / 1e12


def process_state() -> dict:
    """What a previous contender can leave in the process: threads, child processes (Inductor's pool)."""
    try:
        import psutil
        psutil_children = len(psutil.Process().children(recursive=True))
    except ImportError:
        psutil_children = None
    return dict(torch_threads=torch.get_num_threads(), mp_children=len(multiprocessing.active_children()),
                psutil_children=psutil_children, threads=len(os.listdir("/proc/self/task")))


def autotuned_configs() -> dict:
    """Triton's chosen config per key for every autotuned kernel in ``fastbert.ops``."""
    import importlib
    import pkgutil
    import fastbert.ops
    from triton.runtime.autotuner import Autotuner
    out, seen = {}, set()
    for info in pkgutil.iter_modules(fastbert.ops.__path__):
        module = importlib.import_module(f"fastbert.ops.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, Autotuner) and id(value) not in seen:
                seen.add(id(value))
                out[f"{info.name}.{attr}"] = {str(key): str(config) for key, config in value.cache.items()}
    return out


def print_probe(runs: list) -> None:
    fb = [r for r in runs if r["contender"] == "fb-triton"]
    if len(fb) < 2:
        print("probe: fewer than two fb-triton runs finished, nothing to compare", flush=True)
        return
    rows = [("ms/step", "ms_per_step", "{:.2f}"), ("host issue ms/step", "issue_ms_per_step", "{:.2f}"),
            ("bf16 GEMM TFLOP/s before", "gemm_tflops", "{:.0f}"), ("torch threads", "torch_threads", "{}"),
            ("child processes (multiprocessing)", "mp_children", "{}"),
            ("child processes (psutil)", "psutil_children", "{}"), ("process threads", "threads", "{}")]
    print("\n| fb-triton | first run | after hf-compile |\n|---|---:|---:|")
    for label, key, fmt in rows:
        print(f"| {label} | " + " | ".join(fmt.format(r[key]) if r[key] is not None else "-" for r in fb[:2]) + " |")
    first, second = fb[0]["autotune"], fb[1]["autotune"]
    changed = [k for k in sorted(set(first) | set(second)) if first.get(k) != second.get(k)]
    print(f"| autotune configs | {sum(map(len, first.values()))} entries | "
          f"{'the same' if not changed else 'differ in ' + ', '.join(changed)} |", flush=True)


# ----------------------------------------------------------------------------------------- runners
def run_here(names, args, device, probe=False):
    """Every contender in this process, in order; yields each result (None for a failed one)."""
    inp = Inputs.make(args, device)
    for name in names:
        before = dict(gemm_tflops=gemm_tflops(), **process_state()) if probe else None
        try:
            r = run_contender(name, inp, args.warmup, args.steps, device, profile=name in args.profile.split(","),
                              out_dir=args.out, accumulate=args.accumulate)
        except Exception as e:  # report and go on: one broken contender must not hide the others
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            yield None
            continue
        if probe:
            r["probe"] = dict(before, autotune=autotuned_configs())
        yield r


def run_in_worker(name: str, argv: list) -> Optional[dict]:
    """One contender in a fresh process (this script with ``--worker``); None, with its stderr tail, if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", name, "--worker-out", str(out)]
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        if proc.returncode == 0 and out.is_file():
            return json.loads(out.read_text())
    tail = "\n".join("    " + line for line in proc.stderr.rstrip().splitlines()[-STDERR_TAIL:])
    print(f"{name}: FAILED (worker exit code {proc.returncode})\n{tail}", flush=True)
    return None


def temps(clocks: dict, unit: str = "") -> str:
    """The GPU's temperature over the timed steps, first -> highest (``gpu_clocks``), where the tool gave it."""
    return f", {clocks['temp_start_c']:.0f}->{clocks['temp_max_c']:.0f}{unit}" if "temp_max_c" in clocks else ""


def print_table(results: list) -> None:
    base = {r["contender"]: r for r in results}
    ref = base.get("hf-sdpa")
    # The check loss is an eval forward (FP8 GEMMs run in training forwards only); the last training loss
    # (same batches, init and step count everywhere) is where FP8's rounding would show.
    print("\n| contender | ms/step | seq/s | tokens/s | model TFLOP/s | MFU | peak GB | held GB | SM MHz, W, C "
          "| mJ/seq | loss diff vs hf-sdpa | last train loss | x hf-sdpa | x hf-compile | x fb-triton |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        sp = lambda k: f"{base[k]['ms_per_step'] / r['ms_per_step']:.2f}" if k in base else "-"  # noqa: E731
        diff = f"{abs(r['check_loss'] - ref['check_loss']):.4f}" if ref else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        peak = f"{r['peak_mem_gb']:.1f}" if r["peak_mem_gb"] is not None else "-"
        held = f"{r['held_mem_gb']:.1f}" if r.get("held_mem_gb") is not None else "-"
        c = r.get("clocks")
        clk = f"{c['sm_mhz']:.0f}, {c['power_w']:.0f}{temps(c)}" if c else "-"
        mj = f"{r['mj_per_seq']:.1f}" if r.get("mj_per_seq") is not None else "-"
        print(f"| {r['contender']} | {r['ms_per_step']:.2f} | {r['seq_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['tflops']:.0f} | {mfu} | {peak} | {held} | {clk} | {mj} | {diff} | {r['final_loss']:.4f} | "
              f"{sp('hf-sdpa')} | {sp('hf-compile')} | {sp('fb-triton')} |", flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="large")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--mode", choices=("packed", "padded", "sst2"), default="packed")
    p.add_argument("--act", choices=("gelu", "gelu_tanh"), default="gelu",
                   help="every model's hidden_act: BERT's erf GELU, or the tanh approximation (HF's "
                        "gelu_pytorch_tanh; Google's original BERT), which fastbert runs inside cuBLASLt's GEMMs")
    p.add_argument("--prenorm", action="store_true",
                   help="fastbert's models Pre-LN (the academic-budget recipe's layout; HF's stay Post-LN, having no "
                        "Pre-LN BERT): the same weights, one more LayerNorm")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches an optimizer step (gradient accumulation, as `fastbert pretrain`'s "
                        "gradient_accumulation_steps: the graph contenders add each micro-batch's gradients into "
                        "buffers of their own, the others through autograd); the table's \"step\" is then a "
                        "micro-batch, with its share of the optimizer step; --steps a multiple of it")
    p.add_argument("--contenders", default=",".join(DEFAULT))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--same-process", action="store_true",
                   help="run every contender in this process, one after another (no worker processes)")
    p.add_argument("--probe-order", action="store_true",
                   help="fb-triton, hf-compile, fb-triton in one process, with what may differ between the runs")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--profile", default="", help="comma-separated contenders to profile (torch profiler, 3 steps; "
                   "on a GPU also the GPU's idle time between its kernels, gpu_idle in the JSON)")
    p.add_argument("--worker", help=argparse.SUPPRESS)       # run this one contender (spawned by the parent)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)   # where the worker writes its result
    args = p.parse_args(argv)
    unknown = [n for n in args.contenders.split(",") if n not in CONTENDERS]
    if unknown:
        p.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    if args.accumulate < 1 or args.steps % args.accumulate:
        p.error(f"--accumulate must be at least 1 and divide --steps ({args.steps})")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device; --device cpu runs the smoke test")
    if args.probe_order and args.device != "cuda":
        p.error("--probe-order needs --device cuda")
    if args.worker and not args.worker_out:
        p.error("--worker needs --worker-out")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.out:  # made before the runs: a missing folder must not lose them at the end
        Path(args.out).mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.worker:      # errors propagate: the parent shows the traceback's tail
        r = run_contender(args.worker, Inputs.make(args, device), args.warmup, args.steps, device,
                          profile=args.worker in args.profile.split(","), out_dir=args.out,
                          accumulate=args.accumulate)
        Path(args.worker_out).write_text(json.dumps(r))
        return
    import transformers
    hcfg, fcfg = hf_config(args.preset, args.seq, args.act, args.prenorm)
    batches = make_batches(8, args.batch, args.seq, fcfg.vocab_size, args.mode, "cpu")
    flops = np.mean([model_flops(b, fcfg) for b in batches])
    real = np.mean([float(b["attention_mask"].sum()) for b in batches])
    card = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# {card}, torch {torch.__version__}, transformers {transformers.__version__}; {args.preset} "
          f"({args.act}) seq {args.seq} batch {args.batch} mode {args.mode}: {real / args.batch:.1f} real tokens/seq, "
          f"{flops / 1e12:.2f} model TFLOP/step", flush=True)
    names = list(PROBE_ORDER) if args.probe_order else args.contenders.split(",")
    if device.type == "cpu":
        for name in [n for n in names if n in NEEDS_GPU]:
            print(f"{name}: skipped on --device cpu (needs {NEEDS_GPU[name]} on a GPU)", flush=True)
        names = [n for n in names if n not in NEEDS_GPU]
    if args.same_process or args.probe_order:
        runs = run_here(names, args, device, probe=args.probe_order)
    else:
        runs = (run_in_worker(name, argv) for name in names)
    results = []

    def write(stem: str, **extra) -> None:
        if args.out:
            report = dict(card=card, args=vars(args), flops_per_step=flops, results=results, **extra)
            act = ("" if args.act == "gelu" else f"_{args.act}") + ("_prenorm" if args.prenorm else "")
            path = Path(args.out) / f"{stem}_{args.preset}{act}_s{args.seq}_b{args.batch}_{args.mode}.json"
            path.write_text(json.dumps(report, indent=2))

    for r in runs:
        if r is None:
            continue
        r.update(seq_per_s=args.batch / r["ms_per_step"] * 1e3, tokens_per_s=real / r["ms_per_step"] * 1e3,
                 tflops=flops / r["ms_per_step"] / 1e9)
        r["mfu"] = r["tflops"] * 1e12 / PEAK_BF16 if device.type == "cuda" else None
        # energy a sequence: the card's mean board power over the timed steps (at the power cap, what the speed is
        # bought with) over the sequences a second
        power = (r.get("clocks") or {}).get("power_mean_w")
        r["mj_per_seq"] = power / r["seq_per_s"] * 1e3 if power else None
        results.append(r)
        peak = f"{r['peak_mem_gb']:.1f} GB" if r["peak_mem_gb"] is not None else "-"
        held = f", held {r['held_mem_gb']:.1f} GB" if r.get("held_mem_gb") is not None else ""
        clk = r.get("clocks")
        clk = f"  {clk['sm_mhz']:.0f} MHz {clk['power_w']:.0f} W{temps(clk, ' C')}" if clk else ""
        print(f"{r['contender']:11s} {r['ms_per_step']:8.2f} ms/step  {r['seq_per_s']:8.0f} seq/s  check loss "
              f"{r['check_loss']:.4f}  peak {peak}{held}{clk}", flush=True)
        if r.get("graph_replays", args.steps) != args.steps:
            print(f"WARNING: {r['contender']} replayed CUDA graphs in {r['graph_replays']} of {args.steps} timed steps")
        if not args.probe_order:  # after every contender: a run cut short keeps what it measured
            write("e2e")
    digests = {r["inputs_digest"] for r in results}
    if len(digests) > 1:
        print(f"WARNING: the contenders started from different weights or batches (digests {sorted(digests)})")
    if args.probe_order:
        probe = [dict(contender=r["contender"], ms_per_step=r["ms_per_step"],
                      issue_ms_per_step=r["issue_ms_per_step"], **r.pop("probe")) for r in results]
        print_probe(probe)
        write("e2e_probe", probe=dict(order=list(PROBE_ORDER), runs=probe))
    else:
        print_table(results)
        write("e2e")


if __name__ == "__main__":
    main()
