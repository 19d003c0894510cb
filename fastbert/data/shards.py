"""Token shards on disk: the format ``fastbert prepare`` writes and training memory-maps.

A prepared folder::

    index.json                  written LAST (atomically): settings, splits, shard list, token counts
    vocab.txt                   the vocabulary the ids refer to (copied, so the folder is self-contained)
    unigram.npy                 token counts of the train split (int64, vocab_size): random replacements
    train/part-00000.ids.npy    all token ids of the shard, concatenated (uint16, or uint32 when vocab > 65536)
    train/part-00000.offsets.npy  int64 (n + 1): sequence i is ids[offsets[i]:offsets[i+1]]
    train/part-00000.bstart.npy uint16 (n): index of segment B's first token (0 = one segment)
    train/part-00000.nsp.npy    uint8 (n): 1 = B is a random next sentence (HF's next_sentence_label)
    train/part-00000.doc.npy    int32 (n): document number within the source file (provenance)
    train/part-00000.json       written last for the shard: counts, source file, settings fingerprint
    val/...                     the held-out split, same layout

Sequences include ``[CLS]`` and ``[SEP]``; token type ids are 0 before ``bstart`` and 1 from it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from fastbert.io import atomic_path, atomic_write_text

ARRAYS = ("ids", "offsets", "bstart", "nsp", "doc")
FORMAT_VERSION = 1


class ShardError(ValueError):
    """A prepared folder that is missing, incomplete or inconsistent."""


def ids_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


def save_array(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)


def write_shard(split_dir: Path, name: str, sequences, vocab_size: int, meta: dict) -> dict:
    """Write one shard from ``packing.Sequence`` items; the ``.json`` marker goes last."""
    split_dir.mkdir(parents=True, exist_ok=True)
    lengths = np.fromiter((len(s.ids) for s in sequences), dtype=np.int64, count=len(sequences))
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter((t for s in sequences for t in s.ids), dtype=ids_dtype(vocab_size), count=int(offsets[-1]))
    arrays = {
        "ids": ids,
        "offsets": offsets,
        "bstart": np.fromiter((s.b_start for s in sequences), dtype=np.uint16, count=len(sequences)),
        "nsp": np.fromiter((s.is_random_next for s in sequences), dtype=np.uint8, count=len(sequences)),
        "doc": np.fromiter((s.doc for s in sequences), dtype=np.int32, count=len(sequences)),
    }
    for key, arr in arrays.items():
        save_array(split_dir / f"{name}.{key}.npy", arr)
    info = dict(meta, name=name, num_sequences=len(sequences), num_tokens=int(offsets[-1]),
                num_random_next=int(arrays["nsp"].sum()))
    atomic_write_text(split_dir / f"{name}.json", json.dumps(info, indent=1) + "\n")
    return info


def read_shard_info(split_dir: Path, name: str) -> Optional[dict]:
    """The shard's marker, or None if the shard is not complete."""
    path = split_dir / f"{name}.json"
    if not path.is_file() or not all((split_dir / f"{name}.{k}.npy").is_file() for k in ARRAYS):
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


class Shard:
    """Memory-mapped view of one shard."""

    def __init__(self, split_dir: Path, name: str):
        self.name = name
        try:
            self.arrays = {k: np.load(split_dir / f"{name}.{k}.npy", mmap_mode="r") for k in ARRAYS}
        except (OSError, ValueError) as e:
            raise ShardError(f"shard {split_dir / name} is unreadable ({e}); re-run fastbert prepare") from None
        self.offsets = np.asarray(self.arrays["offsets"])
        self.bstart = np.asarray(self.arrays["bstart"])
        self.nsp = np.asarray(self.arrays["nsp"])
        self.ids = self.arrays["ids"]
        if self.offsets[-1] != len(self.ids):
            raise ShardError(f"shard {split_dir / name}: offsets end at {self.offsets[-1]} but it holds "
                             f"{len(self.ids)} ids; it is damaged: delete it and re-run fastbert prepare")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def load_index(data_dir) -> dict:
    data_dir = Path(data_dir)
    path = data_dir / "index.json"
    if not path.is_file():
        hint = (" (shards are there but index.json is missing: the prepare run did not finish; re-run it, "
                "finished shards are kept)") if (data_dir / "train").is_dir() else ""
        raise ShardError(f"{data_dir} is not a prepared data folder{hint}; run `fastbert prepare --out {data_dir}`")
    index = json.loads(path.read_text())
    if index.get("format_version") != FORMAT_VERSION:
        raise ShardError(f"{path} has format version {index.get('format_version')}, this fastbert reads "
                         f"{FORMAT_VERSION}; re-run fastbert prepare")
    return index


def open_split(data_dir, split: str) -> list[Shard]:
    data_dir = Path(data_dir)
    index = load_index(data_dir)
    if split not in index["splits"]:
        raise ShardError(f"{data_dir} has no {split!r} split (has {sorted(index['splits'])})")
    return [Shard(data_dir / split, s["name"]) for s in index["splits"][split]["shards"] if s["num_sequences"] > 0]
