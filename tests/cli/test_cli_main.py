"""The `fastbert` command: subcommand discovery, launcher arguments, error reporting."""
import os
import subprocess
import sys

import pytest

from fastbert.cli import _strip_launcher_local_rank, build_parser, main


def test_subcommands_are_registered():
    names = set(build_parser()._subparsers._group_actions[0].choices)
    assert {"embed", "prepare", "pretrain", "tokenize", "vocab", "finetune"} <= names


def test_kernels_flag_takes_the_training_config_choices():
    """Every command with --kernels takes auto | torch | triton, as model.kernels and BertConfig do."""
    choices = build_parser()._subparsers._group_actions[0].choices
    with_flag = {name for name, p in choices.items() if any("--kernels" in a.option_strings for a in p._actions)}
    assert {"finetune", "embed", "features", "attention", "cluster"} <= with_flag
    for name in with_flag:
        (flag,) = [a for a in choices[name]._actions if "--kernels" in a.option_strings]
        assert tuple(flag.choices) == ("auto", "torch", "triton") and flag.default is None, name


def test_deepspeed_local_rank_is_moved_to_the_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _strip_launcher_local_rank(["--local_rank=3", "pretrain", "--config", "x"]) == ["pretrain", "--config", "x"]
    assert os.environ["LOCAL_RANK"] == "3"
    assert _strip_launcher_local_rank(["--local-rank", "1", "embed"]) == ["embed"]


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


_NO_TORCH = """
import sys
from fastbert.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:  # argparse's --help / --version / usage errors
    code = e.code
loaded = sorted(m for m in ("torch", "triton", "deepspeed", "transformers") if m in sys.modules)
print("LOADED", loaded, file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("argv, code, says", [
    (["--help"], 0, "COMMAND"),
    (["--version"], 0, "fastbert 0.1.0"),
    (["finetune", "--help"], 0, "multiple-choice"),
    (["pretrain", "--config", "missing.json"], 2, "config file not found: missing.json"),
    (["pretrain", "--config", "configs/tiny.json", "train.foo=1"], 2, "unknown config key 'train.foo'"),
    (["pretrain", "--show-config"], 0, "train.max_steps"),
    (["finetune", "--task", "nope", "--model", "m", "--data", "d"], 2, "unknown task 'nope'; choose one of: cola"),
    (["finetune", "--task", "sst2", "--model", "m", "--data", "d", "--batch-size", "0"], 2, "--batch-size must be"),
    (["finetune", "--task", "mc", "--model", "missing", "--data", "d"], 2, "checkpoint folder not found: missing"),
    (["finetune", "--task", "sst2", "--model", "configs", "--data", "d"], 2, "configs has no config.json"),
    (["sbert-train", "--model", "missing", "--data", "d", "--objective", "regression"], 2, "folder not found"),
])
def test_help_and_usage_errors_load_no_torch(argv, code, says):
    """``fastbert --help``, ``--version``, a subcommand's help, pretraining's config errors and fine-tuning's
    argument and checkpoint-folder errors answer in a fraction of a second: nothing on their path imports torch
    (the package's names load on first use; the commands check their input before loading the rest)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, cwd=root)
    assert r.returncode == code, r.stderr
    assert says in r.stdout + r.stderr
    assert "LOADED []" in r.stderr


@pytest.mark.parametrize("task, files, extra, says", [
    ("sst2", {}, [], "no GLUE sst2 data under"),
    ("sst2", {"train.tsv": "gj04\t1\t\tA sentence.\n", "dev.tsv": "gj04\t1\t\tA sentence.\n"}, [],
     "header has no 'sentence' column"),
    ("mnli", {"train.tsv": "index\tsentence1\tsentence2\tgold_label\n"}, [], "dev_matched.tsv not found"),
    ("cola", {"train.tsv": "index\tsentence\n", "dev.tsv": "gj04\t1\t\tA sentence.\n"}, [], "has a header row"),
    ("squad", {"dev-v1.1.json": "{}"}, [], "no SQuAD train file"),
    ("squad", {}, ["--train-file", "nope.json"], "SQuAD train file not found: nope.json"),
    ("ner", {"train.txt": ""}, [], "no dev file in"),
    ("mc", {"train.jsonl": ""}, [], "no dev file for multiple-choice"),
])
def test_finetune_data_errors_load_no_torch(tmp_path, task, files, extra, says):
    """A missing split file or a GLUE file of another layout is answered before torch loads, with the error the
    task's reader gives (exit 1); the readers check every row later."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 8}')
    (model / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    data = tmp_path / "data"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_text(text)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _NO_TORCH, "finetune", "--task", task, "--model", str(model),
                        "--data", str(data), *extra], capture_output=True, text=True, cwd=root)
    assert r.returncode == 1, r.stderr
    assert "fastbert finetune: error: " in r.stderr and says in r.stderr
    assert "LOADED []" in r.stderr


@pytest.mark.parametrize("files, extra, says", [
    ({}, [], "sentence-pair file not found"),
    ({"train.tsv": ""}, [], "needs a header row and at least one pair"),
    ({"train.tsv": "a\tb\tc\nx\ty\t1\n"}, [], "cannot tell the sentence-pair layout from the header (a, b, c)"),
    ({"train.tsv": "sentence1\tsentence2\tscore\nx\ty\t1\n"}, ["--eval-data", "dev.tsv"],
     "sentence-pair file not found"),
])
def test_sbert_data_errors_load_no_torch(tmp_path, files, extra, says):
    """``fastbert sbert-train``'s missing pair files and headers of no layout are answered before torch loads, with
    read_pairs's own errors (exit 1)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 8}')
    (model / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    extra = [str(tmp_path / a) if a.endswith(".tsv") else a for a in extra]
    r = subprocess.run([sys.executable, "-c", _NO_TORCH, "sbert-train", "--model", str(model), "--data",
                        str(tmp_path / "train.tsv"), "--objective", "regression", *extra],
                       capture_output=True, text=True, cwd=root)
    assert r.returncode == 1, r.stderr
    assert "fastbert sbert-train: error: " in r.stderr and says in r.stderr
    assert "LOADED []" in r.stderr


def test_package_names_load_on_first_use():
    import fastbert
    assert set(fastbert.__all__) <= set(dir(fastbert))
    from fastbert import BertModel, UnsupportedModelError, patch
    from fastbert.hf_patch import patch as patch_fn
    assert patch is patch_fn and fastbert.patch is patch_fn and BertModel.__module__ == "fastbert.model"
    assert issubclass(UnsupportedModelError, ValueError)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fastbert.nope
    import fastbert.training
    from fastbert.training import OptimizerSpec, parse_duration
    assert fastbert.training.OptimizerSpec is OptimizerSpec and parse_duration("2m") == 120.0
    assert not hasattr(fastbert.training, "nope") and "build_engine" in dir(fastbert.training)


def test_embed_bad_input_is_one_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastbert.cli", "embed", "--model", str(tmp_path), "--corpus", "x.txt"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("fastbert embed: error:") and "vocab.txt" in r.stderr


def test_embed_end_to_end(minilm_dir, data_dir, tmp_path):
    out = tmp_path / "emb.npy"
    r = subprocess.run([sys.executable, "-m", "fastbert.cli", "embed", "--model", str(minilm_dir), "--corpus",
                        str(data_dir / "pretrain/enwiki_wikiextractor/wiki_00.xz"), "--max-lines", "40",
                        "--query", "a football club", "--top-k", "2", "--json", "--save", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import json
    import numpy as np
    res = json.loads(r.stdout)
    assert res[0]["query"] == "a football club" and len(res[0]["hits"]) == 2
    assert res[0]["hits"][0]["score"] >= res[0]["hits"][1]["score"]
    emb = np.load(out)
    assert emb.shape == (40, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
