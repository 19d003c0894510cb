"""``fastbert prepare`` on a slice of the real Wikipedia sample: sequence lengths and segment
boundaries, NSP balance, no document bleed, determinism (also across worker counts), resumability,
and clear errors for corrupt / empty / malformed inputs."""
from __future__ import annotations

import hashlib
import json
import lzma
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastbert.data.corpus import CorpusError, read_documents, split_sentences
from fastbert.data.prepare import PrepareConfig, prepare, split_documents, tokenize_documents
from fastbert.data.shards import ShardError, open_split

WIKI = "pretrain/enwiki_wikiextractor"
VOCAB = "vocab/bert-base-uncased/vocab.txt"
CLS, SEP = 101, 102
SEQ = 128


def files(data_dir, n=2):
    return [str(p) for p in sorted((data_dir / WIKI).glob("*.xz"))[:n]]


def run_prepare(data_dir, out, nsp, workers=1, n=2, **kw):
    cfg = PrepareConfig(corpus=files(data_dir, n), vocab=str(data_dir / VOCAB), out=str(out), seq_len=SEQ, nsp=nsp,
                        workers=workers, val_fraction=0.05, **kw)
    return prepare(cfg, progress=False)


@pytest.fixture(scope="module")
def mlm_dir(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mlm") / "data"
    run_prepare(data_dir, out, nsp=False)
    return out


@pytest.fixture(scope="module")
def nsp_dir(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("nsp") / "data"
    run_prepare(data_dir, out, nsp=True, workers=2)
    return out


def all_sequences(out, split="train"):
    for shard in open_split(out, split):
        for i in range(len(shard)):
            yield shard, i, np.asarray(shard.sequence(i)).tolist()


def as_text(ids) -> str:
    return "," + ",".join(map(str, ids)) + ","


@pytest.fixture(scope="module")
def documents(data_dir):
    """Tokenized train documents of each input file, split exactly as prepare splits them."""
    from fastbert.tokenization import load_tokenizer
    tok = load_tokenizer(str(data_dir / VOCAB), lowercase=True)
    out = {}
    for number, f in enumerate(files(data_dir)):
        docs = tokenize_documents(tok, read_documents(f))
        out[number] = split_documents(docs, 12345, number, 0.05)
    return out


def test_index_and_counts(mlm_dir):
    index = json.loads((mlm_dir / "index.json").read_text())
    assert index["seq_len"] == SEQ and index["nsp"] is False and index["vocab_size"] == 30522
    assert index["ids_dtype"] == "uint16" and index["lowercase"] is True
    train, val = index["splits"]["train"], index["splits"]["val"]
    assert train["num_sequences"] > 3000 and val["num_sequences"] > 50
    assert val["num_documents"] / (val["num_documents"] + train["num_documents"]) == pytest.approx(0.05, abs=0.02)
    counts = np.load(mlm_dir / "unigram.npy")
    assert counts.sum() == train["num_tokens"] and counts[CLS] == counts[SEP] == train["num_sequences"]
    assert (mlm_dir / "vocab.txt").read_bytes()[:5] == b"[PAD]"


def test_mlm_sequences_lengths_and_segments(mlm_dir):
    lengths = []
    for shard, i, ids in all_sequences(mlm_dir):
        assert 3 <= len(ids) <= SEQ
        assert ids[0] == CLS and ids[-1] == SEP and CLS not in ids[1:] and SEP not in ids[:-1]
        assert shard.bstart[i] == 0 and shard.nsp[i] == 0
        lengths.append(len(ids))
    lengths = np.array(lengths)
    assert (lengths >= 0.8 * SEQ).mean() > 0.4    # whole sentences up to the target: most fill it closely
    assert lengths.mean() > 64


def test_short_seq_prob_controls_target_length(data_dir, tmp_path):
    mean = {}
    for p in (0.0, 1.0):
        run_prepare(data_dir, tmp_path / str(p), nsp=True, n=1, short_seq_prob=p)
        mean[p] = np.mean([len(ids) for _, _, ids in all_sequences(tmp_path / str(p))])
    assert mean[1.0] < 0.75 * mean[0.0]


def test_nsp_pairs_segments_and_balance(nsp_dir):
    n = random_next = 0
    for shard, i, ids in all_sequences(nsp_dir):
        b = int(shard.bstart[i])
        assert len(ids) <= SEQ and ids[0] == CLS and ids[-1] == SEP
        assert b >= 3 and ids[b - 1] == SEP and b < len(ids) - 1           # A and B both non-empty
        assert SEP not in ids[1:b - 1] and SEP not in ids[b:-1] and CLS not in ids[1:]
        n += 1
        random_next += int(shard.nsp[i])
    index = json.loads((nsp_dir / "index.json").read_text())
    assert random_next == index["splits"]["train"]["num_random_next"]
    assert random_next / n == pytest.approx(0.5, abs=0.02)


def test_no_document_bleed(mlm_dir, nsp_dir, documents):
    for number, split_docs in documents.items():
        docs = [as_text([t for s in d for t in s]) for d in split_docs["train"]]
        name = f"part-{number:05d}"
        for shard in open_split(mlm_dir, "train"):
            if shard.name != name:
                continue
            for i in range(len(shard)):
                body = np.asarray(shard.sequence(i)).tolist()[1:-1]
                assert as_text(body) in docs[int(shard.arrays["doc"][i])], (name, i)
        for shard in open_split(nsp_dir, "train"):
            if shard.name != name:
                continue
            for i in range(len(shard)):
                ids, b = np.asarray(shard.sequence(i)).tolist(), int(shard.bstart[i])
                doc = docs[int(shard.arrays["doc"][i])]
                a_seg, b_seg = ids[1:b - 1], ids[b:-1]
                assert as_text(a_seg) in doc
                if not shard.nsp[i]:                 # actual next: B follows A in the same document
                    if len(ids) < SEQ:               # not truncated: A then B, contiguous
                        assert as_text(a_seg + b_seg) in doc
                    else:                            # trimmed at either end of A or B
                        assert doc.rfind(as_text(b_seg)) > doc.find(as_text(a_seg))


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.rglob("*.npy")):
        h.update(p.relative_to(out).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_deterministic_and_independent_of_workers(data_dir, nsp_dir, tmp_path):
    run_prepare(data_dir, tmp_path / "w1", nsp=True, workers=1)
    assert digest(tmp_path / "w1") == digest(nsp_dir)                       # nsp_dir used 2 workers
    run_prepare(data_dir, tmp_path / "seed", nsp=True, seed=7)
    assert digest(tmp_path / "seed") != digest(nsp_dir)


def test_rerun_skips_finished_shards(data_dir, tmp_path):
    out = tmp_path / "d"
    run_prepare(data_dir, out, nsp=False)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*.npy")}
    (out / "train" / "part-00001.json").unlink()          # as if killed while writing file 1
    (out / "index.json").unlink()
    run_prepare(data_dir, out, nsp=False)
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*.npy")}
    redone = {p.name for p in before if after[p] != before[p] and p.parent.name in ("train", "val")}
    assert redone and all(n.startswith("part-00001.") for n in redone)
    assert (out / "index.json").is_file()
    with pytest.raises(ShardError, match="other settings"):
        run_prepare(data_dir, out, nsp=True)


def test_sentence_splitter():
    text = ('Mr. Smith went to Washington, D.C. in 1990. He met J. R. R. Tolkien there! "Was it fun?" '
            "Yes. The U.S. Army (est. 1775) agreed.")
    assert split_sentences(text) == ["Mr. Smith went to Washington, D.C. in 1990.", "He met J. R. R. Tolkien there!",
                                     '"Was it fun?"', "Yes.", "The U.S. Army (est. 1775) agreed."]


# ---------------------------------------------------------------------------------------- bad input
def cli(*args):
    """``fastbert prepare ARGS`` in this process (the same main() as the console script)."""
    import contextlib
    import io
    import types
    from fastbert.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["prepare", *args])
    return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.mark.parametrize("kind", ["corrupt_xz", "empty", "latin1", "unclosed_doc", "text_outside_doc"])
def test_bad_input_gives_one_clear_error(data_dir, tmp_path, kind):
    bad = tmp_path / {"corrupt_xz": "bad.xz", "empty": "empty.txt", "latin1": "latin.txt",
                      "unclosed_doc": "wiki_99", "text_outside_doc": "wiki_98"}[kind]
    if kind == "corrupt_xz":
        good = lzma.compress(b"<doc id=1 title=\"A\">\nA\nSome text here.\n</doc>\n" * 50)
        bad.write_bytes(good[:len(good) // 2] + bytes(random.Random(0).randrange(256) for _ in range(64)))
    elif kind == "empty":
        bad.write_text("\n\n")
    elif kind == "latin1":
        bad.write_bytes("Caf\u00e9 au lait.\n".encode("latin-1"))
    elif kind == "unclosed_doc":
        bad.write_text('<doc id="1" title="T">\nT\nText without an end.\n')
    else:
        bad.write_text('<doc id="1" title="T">\nT\nText.\n</doc>\nstray line\n')
    out = tmp_path / "out"
    res = cli("--corpus", str(bad), "--vocab", str(data_dir / VOCAB), "--out", str(out), "--quiet")
    assert res.returncode != 0
    err = [line for line in res.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and str(bad) in err[0], res.stderr
    expected = {"corrupt_xz": "corrupt", "empty": "no text", "latin1": "not UTF-8", "unclosed_doc": "never closed",
                "text_outside_doc": "outside any <doc>"}[kind]
    assert expected in err[0]
    assert not (out / "index.json").exists()


def test_missing_inputs(data_dir, tmp_path):
    res = cli("--corpus", str(tmp_path / "nope"), "--vocab", str(data_dir / VOCAB), "--out", str(tmp_path / "o"))
    assert res.returncode != 0 and "corpus path not found" in res.stderr
    res = cli("--corpus", files(data_dir, 1)[0], "--vocab", str(tmp_path / "v.txt"), "--out", str(tmp_path / "o"))
    assert res.returncode != 0 and "vocabulary not found" in res.stderr
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(CorpusError, match="holds no files"):
        prepare(PrepareConfig(corpus=[str(tmp_path / "emptydir")], vocab=str(data_dir / VOCAB),
                              out=str(tmp_path / "o2")), progress=False)


def test_cli_prints_summary(data_dir, tmp_path):
    """Through the installed entry point, in a fresh process."""
    res = subprocess.run([sys.executable, "-m", "fastbert.cli", "prepare", "--corpus", files(data_dir, 1)[0], "--vocab", str(data_dir / VOCAB), "--out", str(tmp_path / "o"),
              "--nsp", "--seq-len", "64", "--quiet"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["nsp"] is True and summary["seq_len"] == 64 and summary["train"]["num_sequences"] > 0
