"""benchmarks/e2e_train_step.py on the CPU: each contender, in its own worker process or all in one,
starts from the same weights and batches (equal eval losses and input digests); a failed worker is
reported and the others go on; fb-graphs' conversion of a benchmark batch into the pretrain loader's
static-shape form gives the padded call's loss; --probe-order's report (no fastbert kernel autotunes)."""
import importlib.util
import json
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "e2e_train_step.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("e2e_train_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("where", [[], ["--same-process"]], ids=["workers", "same-process"])
def test_cpu_smoke(tmp_path, where):
    out = tmp_path / "not" / "made"  # the script makes its --out folder
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--preset", "tiny", "--seq", "32", "--batch", "4",
           "--steps", "2", "--warmup", "1", "--contenders", "hf-sdpa,fb-torch", "--profile", "fb-torch",
           "--out", str(out), *where]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "e2e_tiny_s32_b4_packed.json").read_text())
    hf, fb = report["results"]
    assert (hf["contender"], fb["contender"]) == ("hf-sdpa", "fb-torch")
    assert hf["inputs_digest"] == fb["inputs_digest"]          # (two processes) the same weights and batches
    assert abs(hf["check_loss"] - fb["check_loss"]) < 1e-3     # fp32, eval mode
    assert hf["ms_per_step"] > 0 and fb["ms_per_step"] > 0
    assert "| fb-torch |" in res.stdout
    # --profile: the profiler's table beside the JSON (CPU self time here), its top on stdout
    assert "Self CPU" in (out / "profile_fb-torch.txt").read_text() and "--- profile fb-torch" in res.stdout


def test_failed_worker_is_reported_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    bench = load_bench()
    monkeypatch.setattr(bench, "NEEDS_GPU", {})              # let fb-graphs reach a worker, which fails on the CPU
    bench.main(["--device", "cpu", "--preset", "tiny", "--seq", "32", "--batch", "4", "--steps", "1", "--warmup", "0",
                "--contenders", "fb-graphs,hf-sdpa", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "fb-graphs: FAILED (worker exit code 1)" in out and "CUDA" in out   # with the worker's stderr tail
    report = json.loads((tmp_path / "e2e_tiny_s32_b4_packed.json").read_text())
    assert [r["contender"] for r in report["results"]] == ["hf-sdpa"]


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_packed_batch_gives_the_padded_loss(mode):
    """The same tokens, masked positions and NSP labels reach the model: in fp32 the losses differ only by
    summation order (both are HF's means: MLM over the masked tokens, NSP over the sequences), measured at
    up to 2e-6, two float32 ulps of a loss near 11."""
    import transformers
    bench = load_bench()
    hcfg, fcfg = bench.hf_config("tiny", 128)
    torch.manual_seed(0)
    state = transformers.BertForPreTraining(hcfg).state_dict()
    model, _ = bench.build("fb-torch", state, hcfg, fcfg, torch.device("cpu"))
    batches = bench.make_batches(3, 6, 128, fcfg.vocab_size, mode, "cpu")
    slots = bench.mlm_slots(batches, fcfg.vocab_size)
    assert slots >= 6 * (int(128 * 0.15) + 1)                  # at least the masking collator's capacity
    for batch in batches:
        packed = bench.packed_batch(batch, slots)
        assert int((packed["mlm_targets"] != -100).sum()) == int((batch["labels"] != -100).sum())
        padded_loss = bench.first_loss(model, batch, nullcontext())
        packed_loss = bench.first_loss(model, {"packed": packed}, nullcontext())
        assert abs(packed_loss - padded_loss) < 1e-5, (packed_loss, padded_loss)


def test_probe_report_without_a_gpu(capsys):
    """--probe-order's GPU-free parts: no fastbert kernel picks its launch configuration by timing at run time
    (the MLM loss's Triton GEMMs, the last autotuned kernels, gave way to cuBLAS in the thirty-second session: a
    speed that could depend on what ran before in the process, the issue's question), the two fb-triton runs are
    put side by side (the GEMM probe and the runs themselves need a GPU)."""
    pytest.importorskip("triton")
    bench = load_bench()
    tuned = bench.autotuned_configs()
    assert tuned == {}
    state = bench.process_state()
    assert state["threads"] >= 1 and state["torch_threads"] == torch.get_num_threads()
    run = dict(contender="fb-triton", ms_per_step=85.0, issue_ms_per_step=60.0, gemm_tflops=700.0, **state,
               autotune={"ffn.k": {"(1,)": "BLOCK_M: 64"}})
    bench.print_probe([run, dict(run, contender="hf-compile"),
                       dict(run, ms_per_step=121.0, autotune={"ffn.k": {"(1,)": "BLOCK_M: 128"}})])
    out = capsys.readouterr().out
    assert "| ms/step | 85.00 | 121.00 |" in out and "differ in ffn.k" in out


def test_gpu_idle_counts_gaps_once_and_by_the_kernel_after_them():
    bench = load_bench()
    # two steps: a GEMM, a Triton kernel 2 us later, a memset overlapping it, a cuBLAS kernel 3 us after both end
    step = [("nvjet_gemm", 0.0, 10.0), ("_ln_fwd_kernel", 12.0, 5.0), ("Memset (Device)", 14.0, 1.0),
            ("nvjet_gemm", 20.0, 4.0)]
    trace = step + [(n, t + 30.0, d) for n, t, d in step]        # 6 us between the steps
    r = bench.gpu_idle(trace, 2)
    assert r["activities_per_step"] == 4 and r["busy_ms"] == 0.019 and r["span_ms"] == 0.027
    assert r["idle_ms"] == 0.008                                  # (2 + 3 + 6 + 2 + 3) / 2 us
    assert r["idle_before_triton_ms"] == 0.002 and r["idle_before_other_ms"] == 0.006
    assert r["median_gap_us"] == 3.0                              # of 2, 3, 6, 2, 3
    assert bench.gpu_idle([], 3) is None


def test_accumulate_steps_the_optimizer_every_n_micro_batches(monkeypatch):
    """--accumulate N: one call of the step is a micro-batch, the optimizer steps after every N-th (warm-up rounded
    up to whole optimizer steps, so the timed micro-batches start one); --steps must be a multiple of N."""
    bench = load_bench()
    steps = []
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(1) or real_step(self, *a, **k))
    args = bench.parse_args(["--device", "cpu", "--preset", "tiny", "--seq", "16", "--batch", "2", "--steps", "4",
                             "--warmup", "1", "--accumulate", "2"])
    r = bench.run_contender("fb-torch", bench.Inputs.make(args, torch.device("cpu")), args.warmup, args.steps,
                            torch.device("cpu"), accumulate=args.accumulate)
    assert len(steps) == (2 + 4) // 2 and r["ms_per_step"] > 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--steps", "5", "--accumulate", "2"])
