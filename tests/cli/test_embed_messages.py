"""``fastbert embed`` messages: an out-of-vocabulary model error gets its own line (the progress bar is
cleared first), and a pretraining output folder passed as --model points at its hf/ export."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _embed(*args, tmp_path):
    return subprocess.run([sys.executable, "-m", "fastbert.cli", "embed", "--query", "hi", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_out_of_vocabulary_error_is_not_inside_the_progress_bar(tmp_path, data_dir):
    import fastbert
    model_dir = tmp_path / "small_vocab"
    torch.manual_seed(0)
    fastbert.BertModel(fastbert.BertConfig.preset("tiny", vocab_size=1000, num_hidden_layers=1)).save_pretrained(model_dir)
    shutil.copyfile(data_dir / "vocab/bert-base-uncased/vocab.txt", model_dir / "vocab.txt")
    corpus = tmp_path / "c.txt"
    corpus.write_text("a zebra crossed the xylophone road\nanother line here\n")
    res = _embed("--model", str(model_dir), "--corpus", str(corpus), tmp_path=tmp_path)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    segments = re.split(r"[\r\n]", res.stderr)
    errors = [s for s in segments if "error:" in s]
    assert len(errors) == 1 and errors[0].startswith("fastbert embed: error: "), res.stderr
    assert "outside the vocabulary" in errors[0]


def test_pretraining_output_folder_points_at_its_hf_export(tmp_path):
    run = tmp_path / "runs" / "tiny"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    (run / "hf" / "vocab.txt").write_text("[PAD]\n")
    corpus = tmp_path / "c.txt"
    corpus.write_text("one line\n")
    res = _embed("--model", "runs/tiny", "--corpus", str(corpus), tmp_path=tmp_path)
    assert res.returncode == 2
    assert "runs/tiny has no vocab.txt" in res.stderr and "use --model runs/tiny/hf" in res.stderr
