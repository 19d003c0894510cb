"""`fastbert features` and `fastbert attention` on all-MiniLM-L6-v2 equal HF's output_hidden_states /
output_attentions (fp32, torch kernels: same math, different op order -> tolerance 1e-4 on hidden
states of norm ~10, 1e-5 on probabilities)."""
import json

import numpy as np
import pytest
import torch

from fastbert.analysis.features import combine_layers, parse_layers
from fastbert.cli import main

TEXTS = ["The quick brown fox jumps over the lazy dog.", "BERT looks at [SEP] a lot.",
         "Short one", "A sentence pair ||| with a second segment."]


@pytest.fixture(scope="module")
def hf_model(minilm_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel.from_pretrained(str(minilm_dir), attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    from fastbert.tokenization import load_tokenizer
    return load_tokenizer(minilm_dir)


def hf_hidden(hf_model, tokenizer, text, pair=None):
    enc = tokenizer.encode(text, pair, max_length=128, truncation=True)
    ids = torch.tensor([list(enc["input_ids"])])
    with torch.no_grad():
        out = hf_model(input_ids=ids, token_type_ids=torch.tensor([list(enc["token_type_ids"])]),
                       attention_mask=torch.ones_like(ids), output_hidden_states=True, output_attentions=True)
    return out


def test_layer_specs():
    assert parse_layers("last", 6) == ([6], "one")
    assert parse_layers("second-to-last", 6) == ([5], "one")
    assert parse_layers("sum-last-4", 6) == ([6, 5, 4, 3], "sum")
    assert parse_layers("-1", 6) == ([6], "one") and parse_layers("0", 6) == ([0], "one")
    for bad in ("7", "-8", "first", "sum-last-4x"):
        with pytest.raises(ValueError, match="--layers"):
            parse_layers(bad, 6)
    with pytest.raises(ValueError, match="at least 4 layers"):
        parse_layers("concat-last-4", 2)
    hs = [torch.full((1, 2, 3), float(i)) for i in range(7)]
    assert combine_layers(hs, "sum-last-4").flatten()[0] == 6 + 5 + 4 + 3
    assert combine_layers(hs, "concat-last-4").shape == (1, 2, 12)
    assert combine_layers(hs, "concat-last-4")[0, 0, ::3].tolist() == [6, 5, 4, 3]


@pytest.mark.parametrize("layers, pool", [("last", "none"), ("second-to-last", "mean"), ("sum-last-4", "cls"),
                                          ("concat-last-4", "none"), ("2", "none")])
def test_features_cli_equals_hf(tmp_path, minilm_dir, hf_model, tokenizer, layers, pool):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(TEXTS) + "\n\n")
    out = tmp_path / "f.npy"
    assert main(["features", "--model", str(minilm_dir), "--input", str(inp), "--layers", layers, "--pool", pool,
                 "--out", str(out), "--batch-size", "3"]) == 0
    feats = np.load(out)
    tokens = json.loads(out.with_suffix(".tokens.json").read_text()) if pool == "none" else None
    for i, line in enumerate(TEXTS):
        a, _, b = line.partition(" ||| ")
        hs = hf_hidden(hf_model, tokenizer, a, b or None).hidden_states
        ref = combine_layers(hs, layers)[0]                       # (S, D)
        n = ref.shape[0]
        if pool == "none":
            assert len(tokens[i]) == n and tokens[i][0] == "[CLS]"
            np.testing.assert_allclose(feats[i, :n], ref.numpy(), atol=1e-4, rtol=1e-4)
            assert not feats[i, n:].any()                         # padding rows are zero
        else:
            want = ref.mean(0) if pool == "mean" else ref[0]
            np.testing.assert_allclose(feats[i], want.numpy(), atol=1e-4, rtol=1e-4)


def test_attention_cli_equals_hf(tmp_path, minilm_dir, hf_model, tokenizer, capsys):
    out = tmp_path / "attn"
    text, pair = "The cat sat on the mat.", "It was happy."
    assert main(["attention", "--model", str(minilm_dir), "--text", text, "--pair", pair, "--out", str(out)]) == 0
    maps = np.load(out / "attentions.npy")
    ref = torch.stack([a[0] for a in hf_hidden(hf_model, tokenizer, text, pair).attentions]).numpy()
    assert maps.shape == ref.shape == (6, 12, 14, 14)
    np.testing.assert_allclose(maps, ref, atol=1e-5)
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)
    heads = json.loads((out / "heads.json").read_text())
    tokens = json.loads((out / "tokens.json").read_text())
    assert len(heads["heads"]) == 72 and tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2
    for h in heads["heads"][:5]:
        received = ref[h["layer"] - 1, h["head"] - 1].mean(0)
        assert h["position"] == int(received.argmax()) and h["most_attended"] == tokens[h["position"]]
        assert h["weight"] == pytest.approx(float(received.max()), abs=1e-5)
    assert sum(heads["summary"]["most_attended_kind"].values()) == 72
    assert (out / "attention_grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("layer head") and len(printed) == 1 + 72


# ------------------------------------------------------------------ tab-separated input (issue 15, item 7)
@pytest.mark.parametrize("name, count, first, pair", [
    ("SST-2/dev.tsv", 872, "it 's a charming and often affecting journey . ", None),
    ("MRPC/dev.tsv", 408, "He said the foodservice pie business doesn 't fit",
     "\" The foodservice pie business does not fit"),
    ("CoLA/dev.tsv", 1043, "The sailors rode the breeze clear of the rocks.", None),   # no header row
    ("QNLI/dev.tsv", 5463, "What came into force after the new constitution was herald?", "As of that day"),
])
def test_read_inputs_glue_layout(data_dir, name, count, first, pair):
    """GLUE files are read by their text column(s): no header row, no label, no id becomes an input."""
    from fastbert.analysis.loading import read_inputs
    from fastbert.data.glue import TASKS, read_examples
    texts, pairs = read_inputs(data_dir / "glue" / name)
    assert len(texts) == len(pairs) == count
    assert texts[0].startswith(first.strip()) and (pairs[0] is None) == (pair is None)
    assert pair is None or pairs[0].startswith(pair)
    task = next(t for t in TASKS.values() if name.startswith(t.folder + "/"))
    examples = read_examples(task, data_dir / "glue" / name)
    assert texts == [e.text_a.strip() for e in examples]      # the same texts the fine-tuning reader takes
    assert pairs == [None if e.text_b is None else e.text_b.strip() for e in examples]


def test_read_inputs_columns_and_errors(tmp_path, data_dir):
    from fastbert.analysis.loading import read_inputs
    from fastbert.errors import UsageError
    mrpc = data_dir / "glue" / "MRPC" / "dev.tsv"
    texts, pairs = read_inputs(mrpc, column="#2 String", pair_column="#1 String")
    assert len(texts) == 408 and texts[0].startswith("\" The foodservice") and pairs[0].startswith("He said")
    texts, pairs = read_inputs(data_dir / "glue" / "CoLA" / "dev.tsv", column="3")
    assert len(texts) == 1043 and texts[0].startswith("The sailors") and pairs[0] is None
    other = tmp_path / "scores.tsv"
    other.write_text("id\ttext\tscore\n1\tgood film\t0.9\n2\tbad film\t0.1\n")
    with pytest.raises(UsageError, match="cannot tell which tab-separated column.*--column NAME"):
        read_inputs(other)
    assert read_inputs(other, column="text") == (["good film", "bad film"], [None, None])
    assert read_inputs(other, column="1") == (["text", "good film", "bad film"], [None] * 3)  # a number: no header
    with pytest.raises(UsageError, match="no column 'txt' \\(columns: id, text, score\\)"):
        read_inputs(other, column="txt")
    with pytest.raises(UsageError, match="both be header names or both 0-based numbers"):
        read_inputs(other, column="text", pair_column="2")
    with pytest.raises(UsageError, match="--pair-column needs --column"):
        read_inputs(other, pair_column="text")
    with pytest.raises(UsageError, match=r"scores.tsv:1: expected at least 4 tab-separated columns, got 3"):
        read_inputs(other, column="3")
    one = tmp_path / "lines.tsv"          # a .tsv of one column is plain lines
    one.write_text("first line\nsecond ||| line\n")
    assert read_inputs(one) == (["first line", "second ||| line"], [None, None])
    plain = tmp_path / "plain.txt"        # plain text keeps its ' ||| ' pairs, tabs and all
    plain.write_text("a\tb ||| c\n\nd\n")
    assert read_inputs(plain) == (["a\tb", "d"], ["c", None])


def test_features_cli_reads_glue_tsv(tmp_path, data_dir, minilm_dir, tokenizer, hf_model):
    """The README's `fastbert features --input .../SST-2/dev.tsv`, on the first rows: one row of features
    per example, tokens without the header or the label, and HF's hidden states."""
    lines = (data_dir / "glue" / "SST-2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[:6]
    inp = tmp_path / "dev.tsv"
    inp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "f.npy"
    assert main(["features", "--model", str(minilm_dir), "--input", str(inp), "--out", str(out)]) == 0
    feats, tokens = np.load(out), json.loads(out.with_suffix(".tokens.json").read_text())
    assert feats.shape[0] == len(tokens) == 5
    sentence = lines[1].split("\t")[0]
    assert tokens[0] == ["[CLS]"] + tokenizer.tokenize(sentence) + ["[SEP]"]
    assert all(t.count("[SEP]") == 1 and "label" not in t for t in tokens)
    ref = hf_hidden(hf_model, tokenizer, sentence).hidden_states[-1][0]
    np.testing.assert_allclose(feats[0, :ref.shape[0]], ref.numpy(), atol=1e-4, rtol=1e-4)
