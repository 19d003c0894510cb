"""The `fastbert` command: subcommand discovery, launcher arguments, error reporting."""
import os
import subprocess
import sys


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
