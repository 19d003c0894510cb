"""``fastbert prepare``: corpus files -> tokenized, packed, sharded pretraining data (see shards.py).

One input file gives one train shard and one validation shard (``part-<file number>``), so files
are processed in parallel (``workers``) and a rerun skips every shard already finished with the same
settings. Results do not depend on the number of workers: each file draws from its own RNG seeded by
(seed, file number). Documents, not sequences, are held out for validation, so no text is shared
between the splits; NSP random-next segments come from documents of the same file and split.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from fastbert.data.corpus import CorpusError, list_corpus_files, read_documents, read_text
from fastbert.data.packing import pack_documents
from fastbert.data.shards import (FORMAT_VERSION, ShardError, ids_dtype, read_shard_info, save_array, write_shard)
from fastbert.io import atomic_write_text

SPLITS = ("train", "val")


@dataclass
class PrepareConfig:
    corpus: list
    vocab: str
    out: str
    seq_len: int = 128
    nsp: bool = False
    workers: int = 1
    val_fraction: float = 0.01
    short_seq_prob: float = 0.1
    seed: int = 12345
    lowercase: Optional[bool] = None     # None: from tokenizer_config.json, else guessed from the vocabulary
    files: list = field(default_factory=list, repr=False)

    def validate(self) -> None:
        if not 8 <= self.seq_len <= 65535:
            raise ValueError(f"--seq-len must be in [8, 65535], got {self.seq_len}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        vocab = Path(self.vocab)
        if vocab.is_dir():
            vocab = vocab / "vocab.txt"
        if not vocab.is_file():
            raise FileNotFoundError(f"vocabulary not found: {self.vocab}; pass a vocab.txt or a folder holding one")


def vocab_file(vocab) -> Path:
    p = Path(vocab)
    return p / "vocab.txt" if p.is_dir() else p


def guess_lowercase(vocab_path: Path) -> bool:
    """Uncased BERT vocabularies hold no upper-case letters outside [BRACKETED] special tokens."""
    cfg = vocab_path.parent / "tokenizer_config.json"
    if cfg.is_file():
        try:
            value = json.loads(cfg.read_text()).get("do_lower_case")
            if value is not None:
                return bool(value)
        except json.JSONDecodeError:
            pass
    tokens = vocab_path.read_text(encoding="utf-8").splitlines()
    words = [t for t in tokens if not (t.startswith("[") and t.endswith("]"))]
    upper = sum(any(c.isupper() for c in t) for t in words)
    return upper < 0.01 * max(1, len(words))


def fingerprint(cfg: PrepareConfig, files: list[Path]) -> dict:
    vocab = vocab_file(cfg.vocab)
    return {
        "format_version": FORMAT_VERSION,
        "seq_len": cfg.seq_len, "nsp": cfg.nsp, "short_seq_prob": cfg.short_seq_prob, "seed": cfg.seed,
        "val_fraction": cfg.val_fraction, "lowercase": cfg.lowercase,
        "vocab_sha256": hashlib.sha256(vocab.read_bytes()).hexdigest(),
        "files": [[str(f), f.stat().st_size] for f in files],
    }


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------- worker side
_TOKENIZER = None


def _init_worker(vocab: str, lowercase: bool) -> None:
    global _TOKENIZER
    from fastbert.tokenization import load_tokenizer
    _TOKENIZER = load_tokenizer(str(vocab_file(vocab)), lowercase=lowercase)


def tokenize_documents(tok, docs: list[list[str]]) -> list[list[list[int]]]:
    out = []
    for doc in docs:
        ids = tok.encode_batch(doc, add_special_tokens=False, truncation=False)["input_ids"]
        sentences = [list(s) for s in ids if len(s)]
        if sentences:
            out.append(sentences)
    return out


def split_documents(docs: list, seed: int, number: int, val_fraction: float) -> dict:
    """Assign whole documents to train / val (per-file RNG: independent of worker count)."""
    rng = random.Random(f"{seed}:split:{number}")
    by_split = {s: [] for s in SPLITS}
    for d in docs:
        by_split["val" if rng.random() < val_fraction else "train"].append(d)
    return by_split


def process_file(task: dict) -> dict:
    """Read, split, tokenize, pack and write the shards of one input file (runs in a worker)."""
    tok = _TOKENIZER
    path, number, out = Path(task["path"]), task["number"], Path(task["out"])
    name = f"part-{number:05d}"
    if not read_text(path).strip():
        raise CorpusError(f"{path}: the file holds no text; remove it from --corpus")
    docs = tokenize_documents(tok, read_documents(path))
    by_split = split_documents(docs, task["seed"], number, task["val_fraction"])
    infos = {}
    for split in SPLITS:
        rng = random.Random(f"{task['seed']}:pack:{split}:{number}")
        seqs = pack_documents(by_split[split], task["seq_len"], task["nsp"], task["short_seq_prob"],
                              tok.cls_token_id, tok.sep_token_id, rng)
        meta = {"source": str(path), "settings": task["digest"], "num_documents": len(by_split[split])}
        infos[split] = write_shard(out / split, name, seqs, task["vocab_size"], meta)
    return {"number": number, "bytes": task["bytes"], "infos": infos}


# ----------------------------------------------------------------------------------- driver
def prepare(cfg: PrepareConfig, progress: bool = True) -> dict:
    """Run the whole preparation; returns the index. Safe to rerun: finished shards are skipped.

    On failure nothing half-written stays behind: shards are written atomically (a shard counts only
    once its ``.json`` marker exists) and ``index.json`` comes last; if the run finished no shard at
    all, what it created (the output folder, or ``prepare.json`` in an existing one) is removed."""
    cfg.validate()
    files = list_corpus_files(cfg.corpus)
    vocab = vocab_file(cfg.vocab)
    if cfg.lowercase is None:
        cfg.lowercase = guess_lowercase(vocab)
    from fastbert.tokenization import load_tokenizer
    tok = load_tokenizer(str(vocab), lowercase=cfg.lowercase)
    out = Path(cfg.out)
    settings = fingerprint(cfg, files)
    digest = _digest(settings)
    created_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    recorded = out / "prepare.json"
    wrote_record = False
    if recorded.is_file():
        old = json.loads(recorded.read_text())
        if _digest(old) != digest:
            changed = sorted(k for k in settings if old.get(k) != settings[k])
            raise ShardError(f"{out} holds data prepared with other settings (changed: {', '.join(changed)}); "
                             "use a new --out folder or delete this one")
    else:
        atomic_write_text(recorded, json.dumps(settings, indent=1) + "\n")
        wrote_record = True

    tasks, done = [], {}
    for number, path in enumerate(files):
        name = f"part-{number:05d}"
        infos = {s: read_shard_info(out / s, name) for s in SPLITS}
        if all(i is not None and i.get("settings") == digest for i in infos.values()):
            done[number] = infos
            continue
        tasks.append({"path": str(path), "number": number, "out": str(out), "seed": cfg.seed,
                      "val_fraction": cfg.val_fraction, "seq_len": cfg.seq_len, "nsp": cfg.nsp,
                      "short_seq_prob": cfg.short_seq_prob, "vocab_size": tok.vocab_size, "digest": digest,
                      "bytes": path.stat().st_size})
    bar = _progress_bar(sum(t["bytes"] for t in tasks), len(done), len(files), progress)
    try:
        for result in _run_tasks(tasks, cfg, bar):
            done[result["number"]] = result["infos"]
        return write_index(out, cfg, tok, vocab, [done[n] for n in range(len(files))], digest)
    except BaseException as e:
        if not done:
            if created_out:
                shutil.rmtree(out, ignore_errors=True)
            elif wrote_record:
                recorded.unlink(missing_ok=True)
        elif isinstance(e, ValueError) and e.args:
            # Finished shards are complete and kept: say so, the re-run continues from them.
            e.args = (f"{e.args[0]} ({len(done)} of {len(files)} files finished; their shards in {out} are kept "
                      "and a re-run skips them)",) + e.args[1:]
        raise
    finally:
        bar.close()


def _progress_bar(total_bytes: int, skipped: int, num_files: int, enabled: bool):
    from tqdm import tqdm
    desc = "prepare" + (f" ({skipped}/{num_files} files already done)" if skipped else "")
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=not enabled or total_bytes == 0,
                file=sys.stderr, dynamic_ncols=True)


def _run_tasks(tasks, cfg: PrepareConfig, bar):
    if not tasks:
        return
    if cfg.workers == 1 or len(tasks) == 1:
        _init_worker(cfg.vocab, cfg.lowercase)
        for t in tasks:
            r = process_file(t)
            bar.update(r["bytes"])
            yield r
        return
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(min(cfg.workers, len(tasks)), initializer=_init_worker,
                  initargs=(cfg.vocab, cfg.lowercase)) as pool:
        for r in pool.imap_unordered(process_file, tasks):
            bar.update(r["bytes"])
            yield r


def write_index(out: Path, cfg: PrepareConfig, tok, vocab: Path, per_file: list[dict], digest: str) -> dict:
    splits = {}
    for split in SPLITS:
        shards = [{"name": f[split]["name"], "num_sequences": f[split]["num_sequences"],
                   "num_tokens": f[split]["num_tokens"], "source": f[split]["source"]} for f in per_file]
        splits[split] = {"num_sequences": sum(s["num_sequences"] for s in shards),
                         "num_tokens": sum(s["num_tokens"] for s in shards),
                         "num_documents": sum(f[split]["num_documents"] for f in per_file),
                         "num_random_next": sum(f[split]["num_random_next"] for f in per_file),
                         "shards": shards}
    if splits["train"]["num_sequences"] == 0:
        raise CorpusError(f"no training sequences came out of {len(per_file)} file(s): the documents are empty or "
                          "all held out; check --corpus and --val-fraction")
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    for s in splits["train"]["shards"]:
        if s["num_sequences"]:
            ids = np.load(out / "train" / f"{s['name']}.ids.npy", mmap_mode="r")
            counts += np.bincount(ids, minlength=tok.vocab_size)[:tok.vocab_size]
    save_array(out / "unigram.npy", counts)
    if vocab.resolve() != (out / "vocab.txt").resolve():
        tmp = out / ".vocab.txt.tmp"
        shutil.copyfile(vocab, tmp)
        os.replace(tmp, out / "vocab.txt")
    atomic_write_text(out / "tokenizer_config.json", json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": cfg.lowercase}, indent=1) + "\n")
    index = {
        "format_version": FORMAT_VERSION, "settings": digest,
        "seq_len": cfg.seq_len, "nsp": cfg.nsp, "short_seq_prob": cfg.short_seq_prob, "seed": cfg.seed,
        "val_fraction": cfg.val_fraction, "lowercase": cfg.lowercase,
        "vocab_size": tok.vocab_size, "ids_dtype": np.dtype(ids_dtype(tok.vocab_size)).name,
        "special_ids": {"pad": tok.pad_token_id, "unk": tok.unk_token_id, "cls": tok.cls_token_id,
                        "sep": tok.sep_token_id, "mask": tok.mask_token_id},
        "splits": splits,
    }
    atomic_write_text(out / "index.json", json.dumps(index, indent=1) + "\n")
    return index


def config_dict(cfg: PrepareConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k != "files"}
