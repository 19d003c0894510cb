"""Bad input to the task commands: one clear `error:` line naming the problem, a non-zero exit, and no
output written. Uses a tiny random BERT with MiniLM's vocabulary so nothing here trains."""
import json
import shutil

import pytest

from fastbert.cli import main


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, minilm_dir):
    from fastbert import BertConfig, BertForSequenceClassification, BertModel
    root = tmp_path_factory.mktemp("ckpt")
    cfg = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    base = root / "base"
    BertModel(BertConfig(**cfg)).save_pretrained(base)
    three = root / "three_labels"
    BertForSequenceClassification(BertConfig(**cfg, num_labels=3)).save_pretrained(three)
    for d in (base, three):
        shutil.copyfile(minilm_dir / "vocab.txt", d / "vocab.txt")
        shutil.copyfile(minilm_dir / "tokenizer_config.json", d / "tokenizer_config.json")
    return {"base": base, "three": three}


def run_cli(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("fastbert ")]
    return code, lines


def expect_error(capsys, argv, message, out=None):
    code, lines = run_cli(capsys, argv)
    assert code != 0
    assert len(lines) == 1 and ": error: " in lines[0], lines
    assert message in lines[0], lines[0]
    if out is not None:
        assert not out.exists(), f"{out} was written despite the error"


def sst2_dir(tmp_path, rows):
    d = tmp_path / "SST-2"
    d.mkdir()
    for split in ("train", "dev"):
        (d / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{a}\t{b}\n" for a, b in rows))
    return d


def test_finetune_unknown_task(tmp_path, capsys, tiny_ckpt):
    out = tmp_path / "out"
    expect_error(capsys, ["finetune", "--task", "sts", "--data", str(tmp_path), "--model", str(tiny_ckpt["base"]),
                          "--output", str(out)], "unknown task 'sts'", out)


def test_finetune_malformed_tsv(tmp_path, capsys, tiny_ckpt):
    data = sst2_dir(tmp_path, [("a fine film", "1"), ("a bad film", "negative")])
    out = tmp_path / "out"
    expect_error(capsys, ["finetune", "--task", "sst2", "--data", str(data), "--model", str(tiny_ckpt["base"]),
                          "--output", str(out)], "train.tsv:3: label 'negative' is not one of sst2's 2 labels", out)


def test_finetune_label_count_mismatch(tmp_path, capsys, tiny_ckpt):
    data = sst2_dir(tmp_path, [("a fine film", "1"), ("a bad film", "0")])
    out = tmp_path / "out"
    expect_error(capsys, ["finetune", "--task", "sst2", "--data", str(data), "--model", str(tiny_ckpt["three"]),
                          "--output", str(out)], "label count mismatch: the checkpoint is a "
                                                 "BertForSequenceClassification with 3 labels but task sst2 has 2", out)


def test_finetune_bad_model_and_flags(tmp_path, capsys, tiny_ckpt):
    data = sst2_dir(tmp_path, [("a fine film", "1")])
    out = tmp_path / "out"
    expect_error(capsys, ["finetune", "--task", "sst2", "--data", str(data), "--model", str(tmp_path / "nope"),
                          "--output", str(out)], "model checkpoint folder not found", out)
    common = ["finetune", "--task", "sst2", "--data", str(data), "--model", str(tiny_ckpt["base"]), "--output", str(out)]
    expect_error(capsys, common + ["--max-seq-len", "1024"], "exceeds the model's max_position_embeddings", out)
    expect_error(capsys, common + ["--batch-size", "0"], "--batch-size must be >= 1", out)
    expect_error(capsys, common + ["--train-file", "x.json"], "--train-file / --eval-file are for --task squad", out)


def test_finetune_bad_squad_ner_mc_data(tmp_path, capsys, tiny_ckpt):
    out = tmp_path / "out"
    model = ["--model", str(tiny_ckpt["base"]), "--output", str(out)]
    (tmp_path / "squad").mkdir()
    (tmp_path / "squad" / "train-v1.1.json").write_text('{"data": [')
    (tmp_path / "squad" / "dev-v1.1.json").write_text('{"data": []}')
    expect_error(capsys, ["finetune", "--task", "squad", "--data", str(tmp_path / "squad")] + model,
                 "train-v1.1.json is not valid JSON", out)
    (tmp_path / "ner").mkdir()
    (tmp_path / "ner" / "train.txt").write_text("EU B-ORG\n")
    expect_error(capsys, ["finetune", "--task", "ner", "--data", str(tmp_path / "ner")] + model, "no dev file", out)
    (tmp_path / "mc").mkdir()
    (tmp_path / "mc" / "train.jsonl").write_text(json.dumps({"context": "c", "choices": ["a", "b"], "label": 5}) + "\n")
    (tmp_path / "mc" / "dev.jsonl").write_text("")
    expect_error(capsys, ["finetune", "--task", "multiple-choice", "--data", str(tmp_path / "mc")] + model,
                 "train.jsonl:1: label 5 must be an integer in [0, 2)", out)


def test_features_attention_cluster_errors(tmp_path, capsys, tiny_ckpt):
    model = str(tiny_ckpt["base"])
    inp = tmp_path / "in.txt"
    inp.write_text("one line\nanother line\n")
    out = tmp_path / "f.npy"
    expect_error(capsys, ["features", "--model", model, "--input", str(inp), "--layers", "3", "--out", str(out)],
                 "this model has layers 0..2", out)
    expect_error(capsys, ["features", "--model", model, "--input", str(inp), "--out", str(tmp_path / "f.txt")],
                 "must end in .npy")
    expect_error(capsys, ["features", "--model", model, "--input", str(tmp_path / "missing.txt"), "--out", str(out)],
                 "input file not found", out)
    (tmp_path / "empty.txt").write_text("\n \n")
    expect_error(capsys, ["features", "--model", model, "--input", str(tmp_path / "empty.txt"), "--out", str(out)],
                 "has no text lines", out)
    expect_error(capsys, ["attention", "--model", model, "--text", "  ", "--out", str(tmp_path / "a")], "--text is empty",
                 tmp_path / "a")
    expect_error(capsys, ["cluster", "--model", model, "--input", str(inp), "--k", "3"],
                 "--k 3 must be between 1 and the number of lines (2)")


def test_sbert_errors(tmp_path, capsys, tiny_ckpt, data_dir):
    out = tmp_path / "out"
    sts = tmp_path / "sts.tsv"
    sts.write_text("sentence1\tsentence2\tscore\na\tb\t4.0\nc\td\t1.0\n")
    expect_error(capsys, ["sbert-train", "--model", str(tiny_ckpt["base"]), "--data", str(sts), "--objective",
                          "classification", "--output", str(out)],
                 "--objective classification needs class labels", out)
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\nx\ty\n")
    expect_error(capsys, ["sbert-train", "--model", str(tiny_ckpt["base"]), "--data", str(bad), "--objective",
                          "regression", "--output", str(out)], "cannot tell the sentence-pair layout", out)
