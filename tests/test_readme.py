"""Every shell and Python block in README.md runs as written, unless the line before it says why it is
not run here (`<!-- readme-test: skip: REASON -->`, pointing at the test that covers it instead)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```\n", re.S | re.M)
SKIP = re.compile(r"<!-- readme-test: skip: (.+?) -->\n$")


def readme_blocks():
    text = (REPO / "README.md").read_text()
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        skip = SKIP.search(text[:m.start()][-400:])
        blocks.append(pytest.param(m.group(1), m.group(2), skip.group(1) if skip else None, id=f"line{line}"))
    return blocks


def env():
    e = dict(os.environ)
    e.pop("TRITON_INTERPRET", None)  # README commands run as a user would run them
    e["PYTHONUNBUFFERED"] = "1"
    return e


@pytest.mark.parametrize("lang,code,skip", readme_blocks())
def test_readme_block(lang, code, skip, data_dir):
    if skip:
        assert len(skip.split()) >= 4, "a skipped README block must say why, and what covers it"
        pytest.skip(skip)
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    res = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"README {lang} block failed:\n{code}\n--- stdout\n{res.stdout[-2000:]}\n" \
                                f"--- stderr\n{res.stderr[-4000:]}"


@pytest.mark.slow
def test_demo_script_runs_the_main_job(data_dir, tmp_path):
    """scripts/demo.sh as in the Quick start, with a short step budget instead of 3 minutes."""
    res = subprocess.run(["bash", "scripts/demo.sh", "train.time_budget=null", "train.max_steps=4",
                          "eval.every_steps=2", "eval.batches=2", "checkpoint.resume=never",
                          f"output_dir={tmp_path / 'out'}"],
                         cwd=REPO, env=env(), capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert any(line.startswith("final:") and "MLM accuracy" in line for line in res.stdout.splitlines())
    assert (tmp_path / "out" / "hf" / "model.safetensors").is_file()
