"""The WordPiece vocabulary trainer (C++ fastbert._vocab + fastbert/tokenization/vocab_trainer.py):
BERT's layout, merges against hand-computed scores and against a brute-force re-implementation,
word counting against the reference basic tokenizer, determinism, round trip through the
tokenizers, the CLI and bad input."""
from __future__ import annotations

import gzip
import lzma
import math
import zipfile
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("fastbert._vocab", reason="extension fastbert._vocab not built")

from fastbert.cli import main as cli_main  # noqa: E402
from fastbert.tokenization.reference import BasicTokenizer, ReferenceTokenizer  # noqa: E402
from fastbert.tokenization.vocab_trainer import (  # noqa: E402
    count_words, save_vocab, special_layout, train_from_counts, train_wordpiece_vocab,
)


@pytest.fixture(scope="module")
def wiki_file(data_dir) -> Path:
    return data_dir / "pretrain" / "enwiki_wikiextractor" / "wiki_00.xz"


@pytest.fixture(scope="module")
def wiki_lines(wiki_file) -> list[str]:
    with lzma.open(wiki_file, "rt", encoding="utf-8") as f:
        return f.read().split("\n")


@pytest.fixture(scope="module")
def multilingual_lines(data_dir) -> list[str]:
    lines = []
    for name in ("ja_gsd_test.txt", "zh_simplified_gsd_test.txt"):
        lines += (data_dir / "multilingual" / "ud_gsd" / "text" / name).read_text(encoding="utf-8").split("\n")
    with zipfile.ZipFile(data_dir / "multilingual" / "udhr2.zip") as z:
        for name in sorted(z.namelist())[::4]:
            if name.endswith(".txt"):
                lines += z.read(name).decode("utf-8").split("\n")[:30]
    return lines


def brute_force_merges(counts: dict[str, int], n_new: int, min_frequency: int, score: str) -> list[tuple]:
    """The training algorithm written the slow, obvious way: recount everything every step."""
    words = sorted(counts.items())
    initial = sorted({w[0] for w, _ in words})
    continuation = sorted({ch for w, _ in words for ch in w[1:]})
    symbols = initial + ["##" + ch for ch in continuation]
    ids = {s: i for i, s in enumerate(symbols)}
    segs = [[ids[w[0]]] + [ids["##" + ch] for ch in w[1:]] for w, _ in words]
    merges, added = [], 0
    while added < n_new:
        pair_count, sym_count = Counter(), Counter()
        for seg, (_, c) in zip(segs, words):
            for s in seg:
                sym_count[s] += c
            for pair in zip(seg, seg[1:]):
                pair_count[pair] += c
        total = sum(sym_count.values())

        def score_of(cnt, a, b):
            ratio = cnt / (sym_count[a] * sym_count[b])
            return ratio if score == "ratio" else cnt * (math.log(ratio * total) - 1.0)

        candidates = [(score_of(cnt, a, b), cnt, -a, -b) for (a, b), cnt in pair_count.items() if cnt >= min_frequency]
        if not candidates:
            break
        best, cnt, a, b = max(candidates)
        a, b = -a, -b
        token = symbols[a] + symbols[b][2:]
        is_new = token not in ids
        if is_new:
            ids[token] = len(symbols)
            symbols.append(token)
            added += 1
        c = ids[token]
        merges.append((symbols[a], symbols[b], token, best, cnt, is_new))
        for k, seg in enumerate(segs):
            out, i = [], 0
            while i < len(seg):
                if i + 1 < len(seg) and seg[i] == a and seg[i + 1] == b:
                    out.append(c)
                    i += 2
                else:
                    out.append(seg[i])
                    i += 1
            segs[k] = out
    return merges


# ----------------------------------------------------------------------------------------------
# Layout and merge order
# ----------------------------------------------------------------------------------------------

def test_special_layout_is_berts(data_dir):
    bert = (data_dir / "vocab" / "bert-base-uncased" / "vocab.txt").read_text(encoding="utf-8").split("\n")
    layout = special_layout()
    assert layout == bert[:len(layout)] and len(layout) == 999
    assert (layout[0], layout[100], layout[101], layout[102], layout[103]) == ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    assert special_layout(0) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert special_layout(3) == ["[PAD]", "[unused0]", "[unused1]", "[unused2]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_ratio_merges_on_a_hand_built_corpus():
    # Initial counts: h 15, p 17, b 4, ##u 36, ##g 20, ##n 16, ##s 5.
    # 1. (##g, ##s): 5 / (20 * 5) = 1/20, every other pair scores 1/36.
    # 2. all pairs tie at 1/36; the most frequent, (p, ##u) with 17, wins.
    # 3. ##u drops to 19: (h, ##u) 15/(15*19), (b, ##u) 4/(4*19), (##u, ##gs) 5/(19*5) tie at 1/19;
    #    (h, ##u) is the most frequent.
    counts = {"hug": 10, "pug": 5, "pun": 12, "bun": 4, "hugs": 5}
    result = train_from_counts(counts, vocab_size=5 + 7 + 3, min_frequency=1, num_unused=0, progress=False)
    assert result.alphabet == ["b", "h", "p", "##g", "##n", "##s", "##u"]
    assert [m[:3] for m in result.merges] == [("##g", "##s", "##gs"), ("p", "##u", "pu"), ("h", "##u", "hu")]
    assert [m[3] for m in result.merges] == [1 / 20, 1 / 36, 1 / 19]
    assert [m[4] for m in result.merges] == [5, 17, 15]
    assert result.vocab == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *result.alphabet, "##gs", "pu", "hu"]


def test_gain_prefers_frequent_pairs():
    # Symbols: a 2000, f 1000, c 2, ##b 2000, ##e 1000, ##d 2 (N = 6004). (c, ##d) is rare but
    # always together: the ratio prefers it (2 / (2 * 2)); the gain 1000 * (log(N * 1000 / (2000 * 1000)) - 1)
    # of (a, ##e) and (f, ##b) beats 2 * (log(N * 0.5) - 1) of (c, ##d); (a, ##e) has the older ids.
    counts = {"ab": 1000, "ae": 1000, "fb": 1000, "cd": 2}
    ratio = train_from_counts(counts, 5 + 6 + 1, min_frequency=1, num_unused=0, progress=False)
    gain = train_from_counts(counts, 5 + 6 + 1, min_frequency=1, num_unused=0, score="gain", progress=False)
    assert ratio.new_tokens == ["cd"] and ratio.merges[0][3] == 2 / (2 * 2)
    assert gain.new_tokens == ["ae"]
    assert gain.merges[0][3] == pytest.approx(1000 * (math.log(6004 * 1000 / (2000 * 1000)) - 1))


@pytest.mark.parametrize("score", ["ratio", "gain"])
@pytest.mark.parametrize("min_frequency", [1, 3])
def test_merges_equal_brute_force(wiki_lines, score, min_frequency):
    """Incremental updates + lazy heap give exactly the merges (and scores) of recounting every step."""
    basic = BasicTokenizer()
    counts = Counter(w for line in wiki_lines[:400] for w, _ in basic.split(line))
    # Run to exhaustion first: every token is distinct (a merge reaching an existing string reuses it).
    result = train_from_counts(dict(counts), vocab_size=10**6, min_frequency=min_frequency, num_unused=0,
                               limit_alphabet=None, score=score, progress=False)
    assert len(set(result.vocab)) == len(result.vocab) and len(result.new_tokens) > 1000
    n_new = 120
    fast = train_from_counts(dict(counts), 5 + len(result.alphabet) + n_new, min_frequency, None, 0,
                             score=score, progress=False)
    slow = brute_force_merges(dict(counts), n_new, min_frequency, score)
    assert len(fast.new_tokens) == n_new
    assert fast.merges == slow


# ----------------------------------------------------------------------------------------------
# Word counting
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lowercase", [True, False])
def test_counts_equal_reference_split(tmp_path, multilingual_lines, wiki_lines, lowercase):
    """C++ counting (threads, lazily filled normalization table) == the reference basic tokenizer."""
    lines = multilingual_lines + wiki_lines[:2000]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    basic = BasicTokenizer(lowercase)
    expected = Counter(w for line in lines if not _is_doc_line(line) for w, _ in basic.split(line))
    assert count_words([path], lowercase=lowercase, num_threads=3, progress=False) == expected


def _is_doc_line(line: str) -> bool:
    s = line.rstrip(" \r")
    return s == "</doc>" or (s.startswith(("<doc ", "<doc>")) and s.endswith(">"))


def test_reads_xz_gz_txt_and_skips_wikiextractor_markup(tmp_path):
    text = '<doc id="1" url="?curid=1" title="Caf\u00e9">\nCaf\u00e9 Caf\u00e9\n\nSome text.\n</doc>\n<docx> stays\n'
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "b.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    with lzma.open(tmp_path / "c.xz", "wt", encoding="utf-8") as f:
        f.write(text)
    expected = {"cafe": 2, "some": 1, "text": 1, ".": 1, "<": 1, "docx": 1, ">": 1, "stays": 1}
    for name in ("a.txt", "b.gz", "c.xz"):
        assert count_words([tmp_path / name], progress=False) == expected, name
    assert count_words([tmp_path], progress=False) == {k: 3 * v for k, v in expected.items()}  # a directory
    assert count_words([tmp_path / "a.txt"], lowercase=False, progress=False)["Caf\u00e9"] == 2


# ----------------------------------------------------------------------------------------------
# Training on real text
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(wiki_file):
    return train_wordpiece_vocab([wiki_file], vocab_size=3000, score="gain", num_threads=2, progress=False)


def test_trained_vocab_layout(trained):
    assert len(trained) == 3000 and len(set(trained)) == 3000
    assert trained[:999] == special_layout()
    body = trained[999:]
    n_chars = next(i for i, t in enumerate(body) if len(t.removeprefix("##")) > 1)
    chars = body[:n_chars]
    initial = [t for t in chars if not t.startswith("##")]
    assert chars == initial + [t for t in chars if t.startswith("##")]  # characters, then ## characters
    assert initial == sorted(initial, key=ord)
    assert all(len(t.removeprefix("##")) > 1 for t in body[n_chars:])  # then merged pieces


def test_training_is_deterministic(wiki_file, trained):
    again = train_wordpiece_vocab([wiki_file], vocab_size=3000, score="gain", num_threads=1, progress=False)
    assert again == trained


def test_trained_vocab_round_trips_through_tokenizers(tmp_path, trained, data_dir):
    path = save_vocab(trained, tmp_path / "vocab.txt")
    ref = ReferenceTokenizer(path)
    assert ref.convert_ids_to_tokens(list(range(len(trained)))) == trained
    with lzma.open(data_dir / "pretrain" / "enwiki_wikiextractor" / "wiki_31.xz", "rt", encoding="utf-8") as f:
        held_out = [line for line in f.read().split("\n")[:3000] if line and not line.startswith("<")]
    enc = ref.encode_batch(held_out)
    n_tokens = sum(len(ids) - 2 for ids in enc["input_ids"])
    n_words = sum(len(ref.basic.split(line)) for line in held_out)
    n_unk = sum(ids.count(ref.unk_token_id) for ids in enc["input_ids"])
    assert n_unk / n_tokens < 0.01  # characters of English text are in the alphabet
    assert 1.0 < n_tokens / n_words < 2.0  # 1.76 measured: ~2,000 real tokens learnt from 1 MB of text
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertTokenizerFast.from_pretrained(str(tmp_path))
    assert hf(held_out[:200])["input_ids"] == enc["input_ids"][:200]


# ----------------------------------------------------------------------------------------------
# CLI and bad input
# ----------------------------------------------------------------------------------------------

def test_cli_writes_vocab_and_config(tmp_path, wiki_file):
    out = tmp_path / "tok"
    out.mkdir()
    rc = cli_main(["vocab", "--corpus", str(wiki_file), "--vocab-size", "1500", "--out", str(out), "--cased",
                   "--min-frequency", "3", "--threads", "2", "--score", "gain", "--quiet"])
    assert rc == 0
    tok = ReferenceTokenizer.from_pretrained(out)
    assert len(tok) == 1500 and not tok.lowercase
    assert tok.tokenize("The") == ["The"]
    rc = cli_main(["vocab", "--corpus", str(wiki_file), "--vocab-size", "1200", "--out", str(tmp_path / "v.txt"),
                   "--quiet"])
    assert rc == 0 and len((tmp_path / "v.txt").read_text(encoding="utf-8").split("\n")) == 1201


def test_cli_bad_input_writes_nothing(tmp_path, wiki_file, capsys):
    out = tmp_path / "vocab.txt"
    assert cli_main(["vocab", "--corpus", str(tmp_path / "missing.txt"), "--out", str(out), "--quiet"]) == 2
    assert "corpus file not found" in capsys.readouterr().err
    assert cli_main(["vocab", "--corpus", str(wiki_file), "--vocab-size", "1000", "--out", str(out), "--quiet"]) == 1
    assert "too small" in capsys.readouterr().err
    assert cli_main(["vocab", "--corpus", str(wiki_file), "--min-frequency", "0", "--out", str(out)]) == 2
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bad_input_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        train_wordpiece_vocab([tmp_path / "nope.txt"], progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\t\n")
    with pytest.raises(ValueError, match="no words"):
        train_wordpiece_vocab([empty], progress=False)
    broken = tmp_path / "broken.xz"
    broken.write_bytes(b"not xz at all")
    with pytest.raises(ValueError, match="cannot read corpus file.*broken.xz"):
        train_wordpiece_vocab([broken], progress=False)
    with pytest.raises(ValueError, match="score"):
        train_from_counts({"ab": 2}, 100, score="bpe", progress=False)
    with pytest.raises(ValueError, match="min_frequency"):
        train_from_counts({"ab": 2}, 100, min_frequency=0, progress=False)
    with pytest.raises(ValueError, match="too small"):
        train_from_counts({"ab": 2}, 6, num_unused=0, progress=False)
    with pytest.raises(ValueError, match="repeated"):
        save_vocab(["a", "a"], tmp_path / "v.txt")
