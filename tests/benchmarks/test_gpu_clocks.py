"""benchmarks/gpu_clocks.py: the medians of what nvidia-smi prints while a block runs (a stand-in nvidia-smi on
PATH here), the device named as CUDA_VISIBLE_DEVICES names it, and nothing at all (result None, the block unharmed)
without the tool, on a CPU device, with unreadable output or when turned off."""
import importlib.util
import os
import stat
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("gpu_clocks", REPO / "benchmarks" / "gpu_clocks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_smi(folder: Path, lines: list, record: Path, instant: bool = True) -> None:
    """An ``nvidia-smi`` that writes its arguments to ``record``, prints ``lines`` and then waits to be stopped, as
    the real one does with ``-lms``. Asked once for ``power.draw.instant`` (no ``-lms``) it answers a number, or
    (``instant=False``) refuses the field with exit code 2, as a tool older than the field does."""
    script = folder / "nvidia-smi"
    body = "".join(f"print({line!r}, flush=True)\n" for line in lines)
    head = f"#!{sys.executable}\nimport sys, time\n"
    once = ("print('701.25')\n" if instant else
            "print('Field \"power.draw.instant\" is not a valid field to query.')\nsys.exit(2)\n")
    head += f"if '-lms' not in sys.argv:\n    {once.replace(chr(10), chr(10) + '    ').rstrip()}\n    sys.exit(0)\n"
    head += f"open({str(record)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
    script.write_text(f"{head}{body}time.sleep(60)\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("instant", [True, False], ids=["instant", "older-tool"])
def test_medians_of_the_samples(tmp_path, monkeypatch, instant):
    gc = load()
    record = tmp_path / "args.txt"
    fake_smi(tmp_path, ["1605, 689.5, 41", "1710, 691.0, 48", "[N/A], 12.0, 50", "1500, 700.25, 46", "garbage"],
             record, instant)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc")
    with gc.ClockSampler("cuda:1") as clocks:
        deadline = time.time() + 10
        while not record.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    field = "power.draw.instant" if instant else "power.draw"   # the instant reading where the tool has it
    assert clocks.result == {"sm_mhz": 1605.0, "power_w": 691.0, "power_mean_w": 693.58, "samples": 3,
                             "power_field": field, "temp_start_c": 41.0, "temp_max_c": 48.0}
    args = record.read_text().split()
    assert args[:2] == ["-i", "GPU-abc"] and f"--query-gpu=clocks.sm,{field},temperature.gpu" in args and "-lms" in args


def test_temperature_is_optional():
    """A tool that leaves the temperature out (or answers [N/A]) still gives the clock and power."""
    gc = load()
    assert gc.parse("1605, 689.5\n1710, 691.0, [N/A]\n") == {"sm_mhz": 1657.5, "power_w": 690.25,
                                                            "power_mean_w": 690.25, "samples": 2}


@pytest.mark.parametrize("lines", [[], ["1605, 689.5"], ["not a number"]], ids=["none", "one", "unreadable"])
def test_too_few_samples_give_none(tmp_path, monkeypatch, lines):
    gc = load()
    fake_smi(tmp_path, lines, tmp_path / "args.txt")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gc.smi_id(2) == "2"
    with gc.ClockSampler("cuda:0") as clocks:
        time.sleep(0.3)
    assert clocks.result is None


def test_nothing_to_sample(tmp_path, monkeypatch):
    gc = load()
    with gc.ClockSampler("cpu") as clocks:  # a CPU device: never looks for the tool
        pass
    assert clocks.result is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    with gc.ClockSampler("cuda") as clocks:
        pass
    assert clocks.result is None
    fake_smi(tmp_path, ["1605, 689.5", "1710, 691.0"], tmp_path / "args.txt")  # there, but turned off
    monkeypatch.setenv("FASTBERT_BENCH_CLOCKS", "0")
    with gc.ClockSampler("cuda:0") as clocks:
        time.sleep(0.3)
    assert clocks.result is None and not (tmp_path / "args.txt").exists()
