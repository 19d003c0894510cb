"""The SM clock and board power of a CUDA device while a block of work runs, sampled by ``nvidia-smi``.

On the H200s this project measures on, every long kernel runs at the 700 W power cap and the SM clock is what
moves (1,480-1,970 MHz between GEMMs of one shape, and with the data: random operands draw more power than a
model's activations; benchmarks/RESULTS.md, thirty-fifth session). A step time read beside the clock it ran at
tells a slower host from slower code::

    with ClockSampler(device) as clocks:
        ...                      # the timed work
    clocks.result                # {"sm_mhz": median, "power_w": median, "power_mean_w": mean, "samples": n,
                                 #  "power_field": ..., "temp_start_c": first, "temp_max_c": highest} or None

The GPU's temperature is there because at a power cap it can move the clock too: a hotter chip leaks more of the
same watts. In the forty-fifth session's calls the card ran at 43-59 C, and the same run's two rounds matched within
0.2 ms.

The power is nvidia-smi's ``power.draw.instant`` where the tool has that field. Its ``power.draw`` is the average
over the last second on these GPUs (NVML's power usage on Ampere and newer, equal to ``power.draw.average``), which
lags the work by that second: a window of one or two seconds read its start at whatever ran before. On an H200 the
BERT-large step's 20-step window began at 212 W on ``power.draw`` while the instant readings were at the limit, so the
thirty-sixth to forty-third sessions' 588-660 W for steps that in fact ran at the cap were the sampler's lag
(RESULTS.md, forty-fourth session). The instant readings swing tens of watts (up to ~90) around the limit's 1-s
average, so the mean (``power_mean_w``, what an energy figure takes) is steadier than the median. Older tools that
lack the field give ``power.draw``; ``result["power_field"]`` says which.

``result`` is None where there is nothing to sample (no ``nvidia-smi``, a CPU device, fewer than two samples, a
run shorter than the sampling interval), the tool's output cannot be read, or ``FASTBERT_BENCH_CLOCKS=0`` turns the
sampling off (to time a run without the sampler beside it): the sampler never fails the work it watches. The
device is named to ``nvidia-smi`` as ``CUDA_VISIBLE_DEVICES`` names it (an index or a UUID), else by torch's index.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from typing import Optional

OFF = "FASTBERT_BENCH_CLOCKS"  # "0": no sampling


def smi_id(index: int) -> str:
    """How ``nvidia-smi -i`` names torch's CUDA device ``index``: its entry in ``CUDA_VISIBLE_DEVICES`` when that is
    set (the physical index or UUID), else the index itself."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


_FIELDS: dict = {}  # (tool, device id) -> the power field nvidia-smi answers for it


def power_field(tool: str, device: str) -> str:
    """``power.draw.instant`` when ``tool`` answers a query for it with a number, else ``power.draw`` (asked once per
    tool and device in a process)."""
    key = (tool, device)
    if key not in _FIELDS:
        field = "power.draw"
        try:
            query = [tool, "-i", device, "--query-gpu=power.draw.instant", "--format=csv,noheader,nounits"]
            done = subprocess.run(query, capture_output=True, text=True, timeout=10)
            float(done.stdout.strip().splitlines()[0])
            if done.returncode == 0:
                field = "power.draw.instant"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
        _FIELDS[key] = field
    return _FIELDS[key]


def parse(text: str) -> Optional[dict]:
    """The medians (and the power's mean) of ``nvidia-smi --query-gpu=clocks.sm,<power field>,temperature.gpu
    --format=csv,noheader,nounits`` lines (lines whose clock and power are not numbers are skipped), with the GPU's
    temperature at the first sample and its highest (where the tool gave one); None below two samples."""
    rows, temps = [], []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            mhz, watt = float(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            continue
        rows.append((mhz, watt))
        try:
            temps.append(float(parts[2]))
        except (ValueError, IndexError):
            pass
    if len(rows) < 2:
        return None
    out = {"sm_mhz": statistics.median(r[0] for r in rows), "power_w": statistics.median(r[1] for r in rows),
           "power_mean_w": round(statistics.fmean(r[1] for r in rows), 2), "samples": len(rows)}
    if temps:
        out.update(temp_start_c=temps[0], temp_max_c=max(temps))
    return out


class ClockSampler:
    """A context manager that samples ``device``'s SM clock and power every ``interval_ms`` while its block runs
    (``result`` afterwards; see the module docstring). ``device``: a ``torch.device`` or its string ("cuda:1"); with
    no index, torch's current device."""

    def __init__(self, device, interval_ms: int = 50):
        self.result: Optional[dict] = None
        self.power_field: Optional[str] = None
        self._proc = None
        if isinstance(device, str):
            kind, _, number = device.partition(":")
            index = int(number) if number else None
        else:
            kind, index = device.type, device.index
        tool = shutil.which("nvidia-smi") if kind == "cuda" and os.environ.get(OFF, "") != "0" else None
        if tool is None:
            self._cmd = None
            return
        if index is None:
            import torch
            index = torch.cuda.current_device()
        device = smi_id(index)
        self.power_field = power_field(tool, device)
        self._cmd = [tool, "-i", device, f"--query-gpu=clocks.sm,{self.power_field},temperature.gpu",
                     "--format=csv,noheader,nounits", "-lms", str(interval_ms)]

    def __enter__(self) -> "ClockSampler":
        if self._cmd is not None:
            try:
                self._proc = subprocess.Popen(self._cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.result = parse(out or "")
        if self.result is not None:
            self.result["power_field"] = self.power_field
