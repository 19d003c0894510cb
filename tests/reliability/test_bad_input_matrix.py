"""The bad-input matrix: every CLI entry point (prepare, tokenize, vocab, pretrain, finetune, embed,
features, attention) against missing / empty / corrupt files, a vocabulary that does not fit the
model, sequences beyond the model's positions, unknown tasks, labels and config keys.

Each row is one test running ``python -m fastbert.cli ...`` in a subprocess, and passes when the
command exits non-zero with ONE ``fastbert <command>: error: ...`` message containing the expected
text, prints no traceback, and leaves nothing half-written (its output path does not exist, or an
existing output folder is unchanged). The rows run concurrently (one fixture) to keep CI short.
Rows that fail in code this suite's owner does not own are strict xfails naming the problem.
``markdown_table`` renders the README table (input -> message) from the results.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from reliability_harness import TINY_MODEL, cpu_env, prepare_slice, tiny_config, write_config

pytestmark = pytest.mark.slow          # one module fixture runs every row (~2.5 min on two cores)

VOCAB = "vocab/bert-base-uncased/vocab.txt"


@dataclass
class Row:
    id: str
    what: str                     # the bad input, for the README table
    args: list                    # after `python -m fastbert.cli`; "{x}" placeholders name fixture paths
    expect: str                   # text the error message must contain
    out: Optional[str] = "{out}"  # must not exist afterwards (None: nothing to check)
    xfail: Optional[str] = None


def _rows() -> list[Row]:
    P = ["prepare", "--vocab", "{vocab}", "--out", "{out}", "--quiet", "--corpus"]
    T = ["tokenize", "--vocab", "{vocab}", "--out", "{out}", "--no-progress", "--input"]
    V = ["vocab", "--out", "{out}/vocab.txt", "--quiet", "--corpus"]
    R = ["pretrain", "--config", "{config}", "output_dir={out}"]
    F = ["finetune", "--task", "sst2", "--output", "{out}", "--epochs", "1", "--model"]
    E = ["embed", "--query", "hi", "--save", "{out}", "--model"]
    X = ["features", "--out", "{out}", "--model"]
    A = ["attention", "--out", "{out}", "--no-png", "--model"]
    return [
        Row("prepare-missing-corpus", "missing corpus file", P + ["{missing}"], "corpus path not found"),
        Row("prepare-empty-corpus", "empty corpus file", P + ["{empty}"], "the file holds no text"),
        Row("prepare-corrupt-xz", "corrupt .xz corpus", P + ["{corrupt_xz}"], "cannot read this xz file"),
        Row("prepare-not-utf8", "non-UTF-8 corpus", P + ["{binary}"], "not UTF-8 text"),
        Row("prepare-missing-vocab", "missing vocab.txt",
            ["prepare", "--vocab", "{missing}", "--out", "{out}", "--corpus", "{text}"], "vocabulary not found"),
        Row("prepare-empty-vocab", "empty vocab.txt",
            ["prepare", "--vocab", "{empty}", "--out", "{out}", "--corpus", "{text}"], "is empty"),
        Row("prepare-seq-len", "--seq-len beyond the shard format", P + ["{text}", "--seq-len", "70000"],
            "--seq-len must be in [8, 65535]"),
        Row("tokenize-missing-input", "missing input file", T + ["{missing}"], "input not found"),
        Row("tokenize-empty-input", "empty input file", T + ["{empty}"], "empty"),
        Row("tokenize-corrupt-xz", "corrupt .xz input", T + ["{corrupt_xz}"], "corrupt or truncated"),
        Row("tokenize-not-utf8", "non-UTF-8 input", T + ["{binary}"], "not UTF-8 text"),
        Row("tokenize-missing-vocab", "missing vocab.txt",
            ["tokenize", "--vocab", "{missing}", "--out", "{out}", "--input", "{text}"], "vocab file not found"),
        Row("tokenize-empty-vocab", "empty vocab.txt",
            ["tokenize", "--vocab", "{empty}", "--out", "{out}", "--input", "{text}"], "is empty"),
        Row("vocab-missing-corpus", "missing corpus file", V + ["{missing}"], "corpus file not found"),
        Row("vocab-empty-corpus", "empty corpus file", V + ["{empty}"], "no words to train on"),
        Row("vocab-corrupt-xz", "corrupt .xz corpus", V + ["{corrupt_xz}"], "cannot read corpus file"),
        Row("vocab-not-utf8", "non-UTF-8 corpus", V + ["{binary}"], "is not UTF-8 text"),
        Row("vocab-too-small", "--vocab-size below specials + alphabet", V + ["{text}", "--vocab-size", "3"],
            "is too small"),
        Row("pretrain-missing-config", "missing config file",
            ["pretrain", "--config", "{missing}", "output_dir={out}"], "config file not found"),
        Row("pretrain-corrupt-config", "config that is not JSON",
            ["pretrain", "--config", "{bad_json}", "output_dir={out}"], "is not valid JSON"),
        Row("pretrain-unknown-key", "misspelt config key", R + ["train.max_step=3"],
            "unknown config key 'train.max_step'"),
        Row("pretrain-not-prepared", "data.dir never prepared", R + ["data.dir={missing}"], "is not prepared"),
        Row("pretrain-corrupt-shard", "truncated shard file", R + ["data.dir={corrupt_data}"], "is unreadable"),
        Row("pretrain-beyond-positions", "data longer than max_position_embeddings",
            R + ["model.overrides.max_position_embeddings=16"], "max_position_embeddings=16"),
        Row("pretrain-wrong-vocab", "model vocab_size that is not the data's",
            R + ["model.overrides.vocab_size=1000"], "was tokenized with a 30522-token vocabulary"),
        Row("pretrain-foreign-checkpoint", "output_dir holding another model's checkpoint",
            ["pretrain", "--config", "{config}", "output_dir={foreign_run}"], "belongs to a different model",
            out=None),
        Row("finetune-unknown-task", "unknown task", F + ["{model}", "--data", "{sst_ok}", "--task", "sst3"],
            "unknown task 'sst3'"),
        Row("finetune-missing-data", "missing task data", F + ["{model}", "--data", "{missing}"], "no GLUE sst2 data"),
        Row("finetune-missing-model", "missing checkpoint folder", F + ["{missing}", "--data", "{sst_ok}"],
            "model checkpoint folder not found"),
        Row("finetune-beyond-positions", "--max-seq-len beyond max_position_embeddings",
            F + ["{model}", "--data", "{sst_ok}", "--max-seq-len", "1024"],
            "exceeds the model's max_position_embeddings 512"),
        Row("finetune-unknown-label", "label outside the task's label set",
            F + ["{model}", "--data", "{sst_bad_label}"], "label '7' is not one of sst2's 2 labels"),
        Row("finetune-empty-data", "empty train.tsv", F + ["{model}", "--data", "{sst_empty}"], "train.tsv is empty"),
        Row("finetune-wrong-vocab", "vocab.txt larger than the model's vocab_size",
            F + ["{bad_vocab_model}", "--data", "{sst_ok}"], "outside the vocabulary"),
        Row("embed-missing-model", "missing checkpoint folder", E + ["{missing}", "--corpus", "{text}"],
            "has no vocab.txt"),
        Row("embed-missing-corpus", "missing corpus file", E + ["{model}", "--corpus", "{missing}"],
            "input file not found"),
        Row("embed-empty-corpus", "empty corpus file", E + ["{model}", "--corpus", "{empty}"], "no text lines"),
        Row("embed-corrupt-xz", "corrupt .xz corpus", E + ["{model}", "--corpus", "{corrupt_xz}"], "corrupt"),
        Row("embed-beyond-positions", "--max-length beyond max_position_embeddings on a long line",
            E + ["{model}", "--corpus", "{long_text}", "--max-length", "1024"], "exceeds max_position_embeddings=512"),
        Row("embed-wrong-vocab", "vocab.txt larger than the model's vocab_size",
            E + ["{bad_vocab_model}", "--corpus", "{text}"], "outside the vocabulary"),
        Row("features-missing-input", "missing input file", X + ["{model}", "--input", "{missing}"],
            "input file not found"),
        Row("features-empty-input", "empty input file", X + ["{model}", "--input", "{empty}"], "has no text lines"),
        Row("features-corrupt-xz", "corrupt .xz input", X + ["{model}", "--input", "{corrupt_xz}"], "corrupt"),
        Row("features-beyond-positions", "--max-seq-len beyond max_position_embeddings",
            X + ["{model}", "--input", "{text}", "--max-seq-len", "1024"],
            "exceeds the model's max_position_embeddings 512"),
        Row("features-unknown-layer", "--layers beyond the model's layers",
            X + ["{model}", "--input", "{text}", "--layers", "99"], "--layers 99"),
        Row("features-wrong-vocab", "vocab.txt larger than the model's vocab_size",
            X + ["{bad_vocab_model}", "--input", "{text}"], "outside the vocabulary"),
        Row("attention-missing-model", "missing checkpoint folder", A + ["{missing}", "--text", "hello"],
            "model checkpoint folder not found"),
        Row("attention-empty-text", "empty --text", A + ["{model}", "--text", ""], "--text is empty"),
        Row("attention-beyond-positions", "--max-seq-len beyond max_position_embeddings",
            A + ["{model}", "--text", "hello", "--max-seq-len", "1024"],
            "exceeds the model's max_position_embeddings 512"),
        Row("attention-wrong-vocab", "vocab.txt larger than the model's vocab_size",
            A + ["{bad_vocab_model}", "--text", "hello there"], "outside the vocabulary"),
    ]


ROWS = _rows()


# ----------------------------------------------------------------------------------------- inputs
def _model(path: Path, vocab_size: int, vocab: Path) -> Path:
    import fastbert
    from fastbert.config import BertConfig
    fastbert.BertForMaskedLM(BertConfig.preset("tiny", vocab_size=vocab_size)).save_pretrained(path)
    shutil.copyfile(vocab, path / "vocab.txt")
    return path


def _inputs(root: Path, data_dir: Path) -> dict:
    vocab = data_dir / VOCAB
    p = {"vocab": str(vocab), "missing": str(root / "does-not-exist")}
    (root / "empty.txt").write_text("")
    (root / "text.txt").write_text("the quick brown fox.\njumps over the lazy dog.\n\nanother document here.\n")
    (root / "long.txt").write_text(" ".join(["word"] * 2000) + "\nshort line\n")
    (root / "corrupt.xz").write_bytes(b"\xfd7zXZ\x00" + bytes(range(7, 250)))
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "bad.json").write_text("{ not json")
    for name in ("empty", "text", "long", "binary"):
        p[name if name != "long" else "long_text"] = str(root / f"{name}.txt")
    p["corrupt_xz"], p["bad_json"] = str(root / "corrupt.xz"), str(root / "bad.json")
    p["model"] = str(_model(root / "model", 30522, vocab))
    p["bad_vocab_model"] = str(_model(root / "bad_vocab_model", 1000, vocab))
    for name, train in (("sst_ok", "sentence\tlabel\ngood movie\t1\nbad movie\t0\n"),
                        ("sst_bad_label", "sentence\tlabel\ngood movie\t1\nbad movie\t7\n"), ("sst_empty", "")):
        (root / name).mkdir()
        (root / name / "train.tsv").write_text(train)
        (root / name / "dev.tsv").write_text(train)
        p[name] = str(root / name)
    data = prepare_slice(data_dir, root / "data", num_files=1, seq_len=32)
    corrupt = root / "corrupt_data"
    shutil.copytree(data, corrupt)
    ids = corrupt / "train" / "part-00000.ids.npy"
    ids.write_bytes(ids.read_bytes()[:ids.stat().st_size // 2])
    p["corrupt_data"] = str(corrupt)
    p["config"] = str(write_config(root / "cfg.json", tiny_config(data, root / "unused", steps=2)))
    foreign = root / "foreign_run" / "checkpoints" / "step_00000005"
    foreign.mkdir(parents=True)
    sig = dict(TINY_MODEL["overrides"], vocab_size=1000, max_position_embeddings=512, type_vocab_size=2,
               prenorm=False, head="BertForMaskedLM")
    (foreign / "fastbert_complete.json").write_text(
        '{"step": 5, "tag": "step_00000005", "world_size": 1, "good": true, "model": %s}' % __import__("json").dumps(sig))
    p["foreign_run"] = str(root / "foreign_run")
    return p


def _listing(path: Path) -> list:
    return sorted(str(q.relative_to(path)) for q in path.rglob("*")) if path.exists() else []


def _run_row(row: Row, inputs: dict, root: Path) -> dict:
    out = root / "out" / (row.id + (".npy" if row.args[0] in ("embed", "features") else ""))
    values = dict(inputs, out=str(out))
    args = [a.format(**values) for a in row.args]
    watched = Path(values["foreign_run"]) if row.out is None else out
    before = _listing(watched)
    env = dict(cpu_env(), COLUMNS="120")
    res = subprocess.run([sys.executable, "-m", "fastbert.cli", *args], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    return {"rc": res.returncode, "stderr": res.stderr, "stdout": res.stdout, "args": args,
            "exists": out.exists() if row.out is not None else None, "unchanged": _listing(watched) == before,
            "listing": _listing(watched)}


@pytest.fixture(scope="module")
def results(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    inputs = _inputs(root, data_dir)
    (root / "out").mkdir()
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        futures = {row.id: pool.submit(_run_row, row, inputs, root) for row in ROWS}
        out = {k: f.result() for k, f in futures.items()}
    (root / "bad_input_table.md").write_text(markdown_table(out, root) + "\n")   # for the README
    return out


def error_message(row: Row, r: dict) -> str:
    marker = f"fastbert {row.args[0]}: error: "
    text = r["stderr"]
    return text[text.rindex(marker) + len(marker):].splitlines()[0] if marker in text else ""


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=[pytest.mark.xfail(strict=True, reason=r.xfail)]
                                              if r.xfail else []) for r in ROWS])
def test_bad_input(row, results):
    r = results[row.id]
    marker = f"fastbert {row.args[0]}: error: "
    assert r["rc"] != 0, f"exit 0 for {r['args']}:\n{r['stdout'][-1500:]}{r['stderr'][-1500:]}"
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    assert r["stderr"].count(marker) == 1, r["stderr"][-3000:]
    assert row.expect in error_message(row, r), r["stderr"][-2000:]
    if row.out is not None:
        assert not r["exists"], f"{row.id} left {r['listing']}"
    else:
        assert r["unchanged"], f"{row.id} changed the existing output folder: {r['listing']}"


def markdown_table(results: dict, root: Optional[Path] = None) -> str:
    """README rows: command | bad input | exit | message (first 160 characters; paths under ``root``
    shown relative to it)."""
    lines = ["| command | bad input | exit | message |", "|---|---|---|---|"]
    for row in ROWS:
        r = results[row.id]
        msg = error_message(row, r) or "(no error message: " + (r["stderr"].strip().splitlines() or ["-"])[-1][:80] + ")"
        msg = msg.replace(f"{root}/", "") if root is not None else msg
        msg = msg.replace("|", "\\|")
        lines.append(f"| {row.args[0]} | {row.what} | {r['rc']} | {msg[:160]}{'...' if len(msg) > 160 else ''} |")
    return "\n".join(lines)
