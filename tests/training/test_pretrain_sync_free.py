"""`fastbert pretrain`'s step reads nothing back from the device between log steps (issue 14, item 2).

The loop runs in a child process (a world of one, ZeRO-0 with fastbert's fused clipping, gradient
accumulation 2, Triton kernels in the interpreter, the spike guard on and judging from the first step) with
Tensor.item / tolist / __bool__ / __int__ / __float__ / nonzero instrumented, and the ops that read a value on the
host (``_local_scalar_dense``, ``nonzero``, ``is_nonzero``, ``equal``) watched by a dispatch mode wherever they are
called from, inside torch's ops too (a foreach op given one tensor reads it: the twenty-sixth session's finding in
benchmarks/RESULTS.md, which Python-level instrumentation could not see). The optimizer is fastbert's AdamW,
the one ``fastbert pretrain`` uses on CUDA (on the CPU it uses torch's foreach AdamW, which reads its step counters
and makes the guard read its verdict: there is no device to wait for); in fp32 it runs torch's fused step, and its
own kernel's step is checked for reads in tests/ops/test_adamw.py. Reads are allowed only at log
steps (the window's metrics, the guard's verdicts) and of host tensors by design: the loader's batches
(token and sequence counts), and the guard's verdict of the step before, which on CUDA is a pinned host
copy read after that step's event (the GPU has finished it; the step just launched keeps it busy);
tests/reliability/test_guard.py checks that path under torch.cuda.set_sync_debug_mode("error")."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pretrain_harness import REPO, cpu_env, prepare_slice, write_config  # noqa: E402

CHILD = r"""
import json, sys
import torch
import fastbert.training.engine as engine_mod
from fastbert.training.config import load_config
from fastbert.training.pretrain import run_pretraining

from fastbert.training.optim import AdamW
def fused_adamw(spec, groups, device_type, offload=False):     # what CUDA runs, here on the CPU (the interpreter)
    return AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
engine_mod.build_client_optimizer = fused_adamw

steps, reads, started = [0], [], [False]
step = engine_mod.TrainEngine.step
def counted(self):
    started[0] = True
    boundary = step(self)
    steps[0] += boundary
    return boundary
engine_mod.TrainEngine.step = counted

HOST = ("pretrain_dataset.py", "static_batch.py")           # the loader's numpy / CPU tensors
def record(caller, what):
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
    late = caller.f_code.co_name == "_judge"          # the guard reading the previous step's verdict
    if started[0] and not where.split(":")[0].endswith(HOST) and "/torch/optim/" not in where and not late:
        reads.append([steps[0], f"{what} at {where} ({caller.f_code.co_name})"])
for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
    def read(self, *a, _orig=getattr(torch.Tensor, name), _name=name, **k):
        record(sys._getframe(1), _name)
        return _orig(self, *a, **k)
    setattr(torch.Tensor, name, read)

# Reads inside torch's ops too (a foreach op given one tensor reads it on the host): attributed to the innermost
# caller outside torch, judged as above (torch's optimizers' own reads of their CPU step counts are theirs).
from torch.utils._python_dispatch import TorchDispatchMode
TORCH = torch.__file__.rsplit("/", 1)[0] + "/"
class DeviceReads(TorchDispatchMode):
    OPS = (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.is_nonzero, torch.ops.aten.equal)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.OPS:
            frame, in_optim = sys._getframe(1), False
            while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code is read.__code__):
                in_optim |= "/torch/optim/" in frame.f_code.co_filename
                frame = frame.f_back
            if frame is not None and not in_optim:
                record(frame, f"aten.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))
with DeviceReads():
    summary = run_pretraining(load_config(sys.argv[1]))
print("RESULT " + json.dumps({"steps": steps[0], "reads": reads, "summary_steps": summary["steps"]}))
"""


def test_pretrain_steps_read_nothing_back_between_logs(tmp_path, data_dir):
    data = prepare_slice(data_dir, tmp_path / "data", num_files=1, seq_len=32)
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "model": {"preset": "tiny", "kernels": "triton",
                  "overrides": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "intermediate_size": 64}},
        "data": {"dir": str(data), "auto_prepare": False},
        "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 4, "precision": "fp32",
                  "zero_stage": 0, "optimizer": {"type": "adamw", "lr": 1e-3}},
        "eval": {"every_steps": None, "at_end": False},
        "checkpoint": {"every_steps": None, "every_minutes": None, "at_end": False},
        "log": {"every_steps": 2, "tensorboard": False},
        "guard": {"warmup_steps": 1, "min_history": 1},
        "export": {"hf": False},
    }
    config = write_config(tmp_path / "config.json", cfg)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(config)], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=850)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["steps"] == 4 and result["summary_steps"] == 4
    # Reads happen after the step that completes a log window (2, 4), before the next step starts.
    inside = [r for r in result["reads"] if r[0] not in (2, 4)]
    assert not inside, inside[:5]
    assert any(r[0] == 2 for r in result["reads"])        # the instrumentation sees the log step's reads
