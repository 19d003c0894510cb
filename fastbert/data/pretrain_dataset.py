"""Feeding prepared shards to training: a global sequence order, rank slicing, batching, prefetch.

Order: epoch ``e`` visits the train sequences in the permutation drawn from ``(seed, e)``; the last
incomplete global batch of an epoch is dropped. Global optimizer step ``s`` consumes the sequences at
positions ``[s * G, (s + 1) * G)`` of that stream (``G`` = global batch). Inside a global batch,
micro-step ``m`` of rank ``r`` takes the block ``(m * world + r) * micro`` .. ``+ micro``: which
sequences form a global batch does not depend on how it is split over ranks and accumulation.

The loader's whole state is one integer, the stream position (sequences consumed), so resuming is
O(1) with no replay, and a different rank count with the same global batch continues the same stream.
"""
from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from fastbert.data.shards import Shard, ShardError, load_index, open_split


class PretrainData:
    """All sequences of one split, addressed by a global index."""

    def __init__(self, data_dir, split: str = "train"):
        self.data_dir = Path(data_dir)
        self.index = load_index(self.data_dir)
        self.split = split
        self.shards: list[Shard] = open_split(self.data_dir, split)
        counts = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.pad_id = int(self.index["special_ids"]["pad"])
        self.seq_len = int(self.index["seq_len"])
        self.nsp = bool(self.index["nsp"])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, i: int) -> tuple[Shard, int]:
        s = int(np.searchsorted(self.starts, i, side="right") - 1)
        return self.shards[s], int(i - self.starts[s])

    def batch(self, indices, pad_to: Optional[int] = None, multiple_of: int = 8) -> dict:
        """Padded (batch, seq) numpy arrays for global sequence ``indices``: ``input_ids`` (int64),
        ``attention_mask``, ``token_type_ids`` and, with NSP data, ``next_sentence_label``."""
        seqs, bstarts, nsp = [], [], []
        for i in indices:
            shard, j = self.locate(int(i))
            seqs.append(shard.sequence(j))
            bstarts.append(int(shard.bstart[j]))
            nsp.append(int(shard.nsp[j]))
        longest = max(len(s) for s in seqs)
        width = pad_to or min(self.seq_len, -(-longest // multiple_of) * multiple_of)
        ids = np.full((len(seqs), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(seqs), width), dtype=np.int64)
        types = np.zeros((len(seqs), width), dtype=np.int64)
        for row, (s, b) in enumerate(zip(seqs, bstarts)):
            ids[row, :len(s)] = s
            mask[row, :len(s)] = 1
            if b:
                types[row, b:len(s)] = 1
        out = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        if self.nsp:
            out["next_sentence_label"] = np.asarray(nsp, dtype=np.int64)
        return out


class GlobalOrder:
    """Maps stream positions to sequence indices (see the module docstring)."""

    def __init__(self, num_sequences: int, global_batch: int, seed: int):
        if num_sequences < global_batch:
            raise ShardError(f"the training split holds {num_sequences} sequences, fewer than one global batch "
                             f"({global_batch}); prepare more text or lower train.global_batch_size")
        self.n = num_sequences
        self.global_batch = global_batch
        self.per_epoch = num_sequences // global_batch * global_batch
        self.seed = seed
        self._epoch, self._perm = None, None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            perm = np.arange(self.n, dtype=np.int64 if self.n >= 2 ** 31 else np.int32)
            np.random.default_rng([self.seed, epoch]).shuffle(perm)
            self._epoch, self._perm = epoch, perm
        return self._perm

    def epoch_of(self, position: int) -> int:
        return position // self.per_epoch

    def micro_batch(self, step: int, micro: int, rank: int, world: int, micro_batch: int) -> np.ndarray:
        """Indices of micro-batch ``micro`` of rank ``rank`` in global step ``step``."""
        position = step * self.global_batch + (micro * world + rank) * micro_batch
        epoch, offset = divmod(position, self.per_epoch)
        return self.permutation(epoch)[offset:offset + micro_batch]


class PretrainLoader:
    """Yields this rank's micro-batches (dicts of CPU tensors, pinned when CUDA is used) from a start
    step on, prepared by a background thread a few batches ahead."""

    def __init__(self, data: PretrainData, order: GlobalOrder, *, rank: int, world: int, micro_batch: int,
                 grad_accum: int, start_step: int = 0, prefetch: int = 4, pin: bool = False,
                 pad_to: Optional[int] = None):
        if micro_batch * world * grad_accum != order.global_batch:
            raise ValueError(f"micro_batch {micro_batch} x world {world} x grad_accum {grad_accum} != "
                             f"global batch {order.global_batch}")
        self.data, self.order = data, order
        self.rank, self.world, self.micro_batch, self.grad_accum = rank, world, micro_batch, grad_accum
        self.step = start_step
        self.prefetch, self.pin, self.pad_to = prefetch, pin, pad_to
        self._queue: Optional[queue.Queue] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _make(self, step: int, micro: int) -> dict:
        idx = self.order.micro_batch(step, micro, self.rank, self.world, self.micro_batch)
        batch = {k: torch.from_numpy(v) for k, v in self.data.batch(idx, self.pad_to).items()}
        if self.pin:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    def _worker(self, first_step: int) -> None:
        step = first_step
        try:
            while not self._stop.is_set():
                for micro in range(self.grad_accum):
                    item = (step, micro, self._make(step, micro))
                    while not self._stop.is_set():
                        try:
                            self._queue.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                step += 1
        except BaseException as e:  # surface loader errors in the training thread
            self._queue.put(e)

    def __iter__(self) -> Iterator[tuple[int, int, dict]]:
        """Yields ``(step, micro, batch)`` forever (the training loop decides when to stop)."""
        self.close()
        self._stop.clear()
        self._queue = queue.Queue(maxsize=max(1, self.prefetch))
        self._thread = threading.Thread(target=self._worker, args=(self.step,), daemon=True, name="fastbert-loader")
        self._thread.start()
        while True:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            step, micro, batch = item
            self.step = step + (1 if micro == self.grad_accum - 1 else 0)
            yield step, micro, batch

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None


def eval_batches(data: PretrainData, *, rank: int, world: int, micro_batch: int, max_batches: int,
                 pad_to: Optional[int] = None) -> list[dict]:
    """A fixed evaluation set: the first ``max_batches * world * micro_batch`` validation sequences
    in order, split over ranks (the same batches at every evaluation). Ranks get equal counts."""
    per_round = world * micro_batch
    rounds = min(max_batches, len(data) // per_round)
    out = []
    for b in range(rounds):
        start = b * per_round + rank * micro_batch
        out.append({k: torch.from_numpy(v) for k, v in data.batch(range(start, start + micro_batch), pad_to).items()})
    return out
