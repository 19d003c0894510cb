"""The end-of-run report (training/report.py): the expected-range line, fill-mask lines from an
exported model, and the loss curve drawn from metrics.jsonl across a resume."""
from __future__ import annotations

import json

import pytest
import torch

from fastbert.training import report


def test_expected_line_places_the_run_in_the_measured_range():
    lo, hi = report.REFERENCE["tiny"][-1][1:]
    line = report.expected_line("tiny", 330, (lo + hi) / 2, {"time_budget": "3m"})
    assert "within the range" in line and "train.time_budget=10m" in line
    assert "BELOW" in report.expected_line("tiny", 330, 0.0, {"time_budget": None, "max_steps": 330})
    assert "no reference measured for preset 'large'" in report.expected_line("large", 100, 0.5, {"time_budget": "1h"})
    assert "measured up to" in report.expected_line("tiny", 50_000, 0.5, {"time_budget": "1h"})


def test_loss_curve_spans_resumed_runs(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    recs = [{"event": "train", "step": s, "loss": 10 - s / 10, "run": "a"} for s in (2, 4, 6)]
    recs += [{"event": "resume", "step": 6, "run": "b"}, {"event": "train", "step": 8, "loss": 9.0, "run": "b"},
             {"event": "eval", "step": 8, "mlm_loss": 9.1, "mlm_acc": 0.05, "run": "b"}]
    metrics.write_text("\n".join(json.dumps(r) for r in recs) + "\n{cut sho")
    train, evals, resumes = report.read_curve(metrics)
    assert [s for s, _ in train] == [2, 4, 6, 8] and evals == [(8, 9.1)] and resumes == [6]
    png = report.write_loss_curve(metrics, tmp_path / "loss_curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.write_loss_curve(tmp_path / "none.jsonl", tmp_path / "x.png") is None


def test_fill_mask_lines_from_an_exported_model(tmp_path, data_dir):
    import shutil

    import fastbert
    cfg = fastbert.BertConfig.preset("tiny", vocab_size=30522, num_hidden_layers=1)
    torch.manual_seed(0)
    fastbert.BertForMaskedLM(cfg).save_pretrained(tmp_path)
    shutil.copyfile(data_dir / "vocab/bert-base-uncased/vocab.txt", tmp_path / "vocab.txt")
    lines = report.fill_mask_lines(tmp_path)
    assert lines[0].startswith("fill-mask") and len(lines) == 1 + len(report.SENTENCES)
    assert all("->" in line and line.count(",") >= 2 for line in lines[1:])


@pytest.mark.parametrize("steps", [80, 500])
def test_expected_range_never_reaches_beyond_the_run(steps):
    ref = report.expected_range("tiny", steps)
    assert ref is not None and ref[0] <= steps * 1.1
