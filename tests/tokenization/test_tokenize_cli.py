"""``fastbert tokenize``: arrays equal the tokenizer's ids paragraph by paragraph, document offsets follow
the ``fastbert prepare`` conventions, compressed and WikiExtractor inputs stream, bad input fails cleanly
with no output left behind (not even the inputs that succeeded)."""
from __future__ import annotations

import gzip
import json
import lzma

import numpy as np
import pytest

from fastbert.cli import main
from fastbert.tokenization.wordpiece import WordPieceTokenizer

PLAIN = "Hello world.\nSecond line, here!\n\n\nNew document: Ünïcödé 中文 [MASK]\n"
WIKI = ('<doc id="1" url="?curid=1" title="First Title">\nFirst Title\n\nIt has a paragraph.\nAnd another one.\n'
        '</doc>\n<doc id="2" url="?curid=2" title="Only Title">\nOnly Title\n</doc>\n'
        '<doc id="3" url="?curid=3" title="Third">\nThird\nText of the third document.\n</doc>\n')


@pytest.fixture(scope="module")
def vocab(data_dir):
    return data_dir / "vocab" / "bert-base-uncased"


@pytest.fixture(scope="module")
def tok(vocab):
    return WordPieceTokenizer(vocab / "vocab.txt")


def _ids(tok, paragraphs):
    ids, _ = tok.encode_flat(paragraphs)
    return ids.astype(np.uint16)


def test_plain_wiki_and_compressed_inputs(tmp_path, vocab, tok, capsys):
    (tmp_path / "plain.txt").write_text(PLAIN, encoding="utf-8")
    with lzma.open(tmp_path / "wiki_00.xz", "wt", encoding="utf-8") as f:
        f.write(WIKI)
    with gzip.open(tmp_path / "more.txt.gz", "wt", encoding="utf-8") as f:
        f.write(PLAIN * 3)
    out = tmp_path / "out"
    inputs = [str(tmp_path / n) for n in ("plain.txt", "wiki_00.xz", "more.txt.gz")]
    assert main(["tokenize", "--vocab", str(vocab), "--input", *inputs, "--out", str(out), "--no-progress"]) == 0
    assert "tokenized 3 file(s)" in capsys.readouterr().err
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["lowercase"] is True and index["vocab_size"] == 30522
    files = {f["ids"]: f for f in index["files"]}
    assert set(files) == {"plain.npy", "wiki_00.npy", "more.npy"}

    plain = np.load(out / "plain.npy")
    assert plain.dtype == np.uint16
    docs = [["Hello world.", "Second line, here!"], ["New document: Ünïcödé 中文 [MASK]"]]
    np.testing.assert_array_equal(plain, _ids(tok, docs[0] + docs[1]))
    assert files["plain.npy"]["doc_offsets"] == [0, len(_ids(tok, docs[0])), len(plain)]
    assert files["plain.npy"]["documents"] == 2 and files["plain.npy"]["paragraphs"] == 3
    assert tok.mask_token_id in plain.tolist()  # special tokens written in the text stay whole

    wiki = np.load(out / "wiki_00.npy")
    wiki_docs = [["It has a paragraph.", "And another one."], ["Text of the third document."]]  # titles dropped
    np.testing.assert_array_equal(wiki, _ids(tok, wiki_docs[0] + wiki_docs[1]))
    assert files["wiki_00.npy"]["doc_offsets"] == [0, len(_ids(tok, wiki_docs[0])), len(wiki)]

    more = np.load(out / "more.npy")
    np.testing.assert_array_equal(more, np.tile(plain, 3))
    assert files["more.npy"]["documents"] == 4  # no blank line between the copies: they run together
    assert index["tokens"] == len(plain) + len(wiki) + len(more)


def test_real_wikiextractor_file_in_small_batches(tmp_path, data_dir, vocab, tok):
    """Batches split anywhere give the same arrays; documents match fastbert.data.corpus's reader."""
    from fastbert.data.corpus import iter_documents, read_text

    source = data_dir / "pretrain" / "enwiki_wikiextractor" / "wiki_03.xz"
    for batch_mb, out in ((0.05, tmp_path / "small"), (64, tmp_path / "big")):
        assert main(["tokenize", "--vocab", str(vocab / "vocab.txt"), "--input", str(source), "--out", str(out),
                     "--batch-mb", str(batch_mb), "--threads", "2", "--no-progress"]) == 0
    small, big = np.load(tmp_path / "small" / "wiki_03.npy"), np.load(tmp_path / "big" / "wiki_03.npy")
    np.testing.assert_array_equal(small, big)
    offsets = json.loads((tmp_path / "small" / "index.json").read_text())["files"][0]["doc_offsets"]
    docs = list(iter_documents(read_text(source), str(source)))
    assert len(offsets) == len(docs) + 1 > 100
    for i in (0, 1, len(docs) // 2, len(docs) - 1):
        np.testing.assert_array_equal(small[offsets[i]:offsets[i + 1]], _ids(tok, docs[i]))


def test_same_names_in_two_folders_and_large_vocab(tmp_path, data_dir):
    for sub in ("AA", "AB"):
        (tmp_path / "in" / sub).mkdir(parents=True)
        (tmp_path / "in" / sub / "wiki_00").write_text(f"Text from {sub}.\n", encoding="utf-8")
    out = tmp_path / "out"
    vocab = data_dir / "vocab" / "bert-base-multilingual-cased"
    assert main(["tokenize", "--vocab", str(vocab), "--input", str(tmp_path / "in"), "--out", str(out),
                 "--no-progress"]) == 0
    index = json.loads((out / "index.json").read_text())
    assert [f["ids"] for f in index["files"]] == ["AA/wiki_00.npy", "AB/wiki_00.npy"]
    assert index["dtype"] == "int32" and index["lowercase"] is False  # 119547 tokens; cased vocabulary guessed
    assert np.load(out / "AB" / "wiki_00.npy").dtype == np.int32


@pytest.mark.parametrize("case", ["missing-input", "missing-vocab", "not-utf8", "corrupt-xz", "damaged-wiki",
                                  "bad-threads"])
def test_bad_input_fails_cleanly(tmp_path, vocab, capsys, case):
    good = tmp_path / "good.txt"
    good.write_text("fine text\n", encoding="utf-8")
    bad = tmp_path / "bad.txt"
    args = ["--vocab", str(vocab)]
    if case == "missing-input":
        inputs, expect = [str(tmp_path / "nope.txt")], "input not found"
    elif case == "missing-vocab":
        args = ["--vocab", str(tmp_path / "vocab.txt")]
        inputs, expect = [str(good)], "vocab file not found"
    elif case == "not-utf8":
        bad.write_bytes(b"caf\xe9 latin-1\n")
        inputs, expect = [str(good), str(bad)], "not UTF-8"
    elif case == "corrupt-xz":
        bad = tmp_path / "bad.xz"
        bad.write_bytes(lzma.compress(b"some text\n" * 100)[:40])
        inputs, expect = [str(good), str(bad)], "corrupt or truncated"
    elif case == "damaged-wiki":
        bad.write_text('<doc id="1" title="T">\nT\ntext\n', encoding="utf-8")
        inputs, expect = [str(good), str(bad)], "never closed"
    else:
        args += ["--threads", "0"]
        inputs, expect = [str(good)], "--threads must be >= 1"
    out = tmp_path / "out"
    code = main(["tokenize", *args, "--input", *inputs, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and expect in err and err.count("error:") == 1, err
    leftovers = [p.name for p in out.rglob("*")] if out.exists() else []
    assert leftovers == [], leftovers  # all or nothing: not even good.npy stays
