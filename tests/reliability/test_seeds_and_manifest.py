"""Seed sweeps (fastbert/training/seeds.py, behind ``fastbert finetune --seeds N``) and the manifest
helpers: median and spread over seeds, resumable sweeps, what a manifest records."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from fastbert.training.manifest import build_manifest, package_versions, seed_summary
from fastbert.training.seeds import run_seeds


def test_seed_summary_median_and_spread():
    s = seed_summary({1: {"acc": 0.80, "f1": 0.7}, 2: {"acc": 0.90, "f1": 0.9}, 3: {"acc": 0.86, "note": "x"}})
    assert s["acc"]["median"] == 0.86 and s["acc"]["min"] == 0.80 and s["acc"]["max"] == 0.90
    assert s["acc"]["std"] == pytest.approx(statistics.stdev([0.8, 0.9, 0.86])) and s["acc"]["n"] == 3
    assert s["f1"]["n"] == 2 and "note" not in s              # only numbers are summarised
    assert seed_summary({7: {"acc": 0.5}})["acc"]["std"] == 0.0


def test_run_seeds_writes_report_and_resumes(tmp_path):
    calls = []

    def run_one(seed, out):
        calls.append(seed)
        out.mkdir(parents=True)
        metrics = {"accuracy": 0.8 + seed / 1000}
        (out / "metrics.json").write_text(json.dumps({"metrics": metrics}))
        return metrics

    report = run_seeds(run_one, [1, 2, 3], tmp_path, config={"task": "sst2"}, log=lambda s: None)
    assert calls == [1, 2, 3]
    assert report["summary"]["accuracy"]["median"] == pytest.approx(0.802)
    saved = json.loads((tmp_path / "seeds.json").read_text())
    assert saved["per_seed"]["3"]["accuracy"] == pytest.approx(0.803)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["kind"] == "finetune-seeds" and manifest["seeds"] == [1, 2, 3]
    # an interrupted sweep continues: finished seeds are read back, not rerun
    report = run_seeds(run_one, [1, 2, 3, 4], tmp_path, log=lambda s: None)
    assert calls == [1, 2, 3, 4] and report["summary"]["accuracy"]["n"] == 4
    with pytest.raises(ValueError, match="distinct"):
        run_seeds(run_one, [5, 5], tmp_path, log=lambda s: None)


def test_manifest_fields():
    m = build_manifest("pretrain", config={"a": 1}, seed=3, step=7, throughput={"seq_per_s": 1.0})
    assert m["kind"] == "pretrain" and m["seed"] == 3 and m["step"] == 7 and m["config"] == {"a": 1}
    assert m["packages"]["torch"] == torch.__version__ == package_versions()["torch"]
    assert m["hardware"]["cpu_count"] >= 1 and "hostname" in m["hardware"]
    assert m["git"] is None or (len(m["git"]["commit"]) == 40 and isinstance(m["git"]["dirty"], bool))
