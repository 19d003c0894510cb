"""Feeding prepared shards to training: a global sequence order, rank slicing, batching, prefetch.

Order: epoch ``e`` visits the train sequences in the permutation drawn from ``(seed, e)``; the last
incomplete global batch of an epoch is dropped. Global optimizer step ``s`` consumes the sequences at
positions ``[s * G, (s + 1) * G)`` of that stream (``G`` = global batch). Inside a global batch,
micro-step ``m`` of rank ``r`` takes the block ``(m * world + r) * micro`` .. ``+ micro``: which
sequences form a global batch does not depend on how it is split over ranks and accumulation.

The loader's whole state is one integer, the stream position (sequences consumed), so resuming is
O(1) with no replay, and a different rank count with the same global batch continues the same stream.

Static shapes (``static=True``, what ``fastbert pretrain`` uses): every micro-batch is
``micro_batch`` rows of ``seq_len`` tokens laid out by ``data/static_batch.py``. Without packing a
row holds one sequence (BERT's layout); with packing (``PackedOrder``) each epoch's permuted
sequences are first packed into rows of up to ``per_row`` sequences, and a global batch is then
``global_batch`` ROWS: the stream position counts rows, and the state is still one integer. With a
``span`` > 1 the packing bins are ``span`` rows (a sequence may continue into the next row of its bin,
``static_batch.py``), and micro-batches are whole bins.
"""
from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from fastbert.data.shards import Shard, ShardError, load_index, open_split
from fastbert.data.static_batch import build_rows, pack_rows


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

    def lengths(self) -> np.ndarray:
        """Token count of every sequence, in global index order."""
        if getattr(self, "_lengths", None) is None:
            self._lengths = np.concatenate([s.lengths() for s in self.shards]) if self.shards else np.zeros(0, int)
        return self._lengths

    def static_batch(self, rows, per_row: int, span: int = 1) -> dict:
        """Static-shape arrays for ``rows`` (each a list of global sequence indices; a bin of ``span`` rows);
        see static_batch.py."""
        seqs = []
        for row in rows:
            items = []
            for i in row:
                shard, j = self.locate(int(i))
                items.append((shard.sequence(j), int(shard.bstart[j]), int(shard.nsp[j])))
            seqs.append(items)
        return build_rows(seqs, self.seq_len, per_row, self.pad_id, self.nsp, span)

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

    def micro_rows(self, step: int, micro: int, rank: int, world: int, micro_batch: int) -> list[list[int]]:
        """The same micro-batch as rows of one sequence each."""
        return [[int(i)] for i in self.micro_batch(step, micro, rank, world, micro_batch)]


class PackedOrder:
    """Packed rows: epoch ``e`` packs the permutation of ``(seed, e)`` into bins of ``span`` rows, at most
    ``span * seq_len`` tokens and ``span * per_row`` sequences (first fit, see ``pack_rows``, over windows of
    ``window`` sequences so packing stays local and fast); global step ``s`` takes rows ``[s * G, (s + 1) * G)``
    of that list (``G`` = global batch in rows, a multiple of ``span``), the incomplete last batch of an epoch is
    dropped. Which rows form a global batch does not depend on the rank/accumulation split (micro-batches are
    whole bins: every split's micro batch a multiple of ``span``)."""

    def __init__(self, lengths: np.ndarray, global_batch: int, seed: int, seq_len: int, per_row: int,
                 window: int = 256, span: int = 1):
        self.lengths = np.asarray(lengths)
        if global_batch % span:
            raise ValueError(f"global batch {global_batch} is not a multiple of the packing span {span}")
        if len(self.lengths) and int(self.lengths.max()) > seq_len:
            raise ValueError(f"a sequence has {int(self.lengths.max())} tokens, more than seq_len={seq_len}")
        self.order = GlobalOrder(len(self.lengths), 1, seed)   # the permutation per epoch
        self.global_batch, self.seq_len, self.per_row, self.window = global_batch, seq_len, per_row, window
        self.span = span
        self._epoch, self._bins = None, None
        self._steps: dict[int, int] = {}          # epoch -> global steps in it (packing each epoch once)
        rows = len(self.bins(0)) * span
        if rows < global_batch:
            raise ShardError(f"the training split packs into {rows} rows of {seq_len} tokens, fewer than one "
                             f"global batch ({global_batch}); prepare more text or lower train.global_batch_size")
        self.steps_first_epoch = rows // global_batch

    def bins(self, epoch: int) -> list[list[int]]:
        """The epoch's packing bins (``span`` rows each), as lists of sequence indices."""
        if epoch != self._epoch:
            perm = self.order.permutation(epoch)
            out = []
            for start in range(0, len(perm), self.window):
                chunk = perm[start:start + self.window]
                out += [[int(chunk[k]) for k in row] for row in
                        pack_rows(self.lengths[chunk].tolist(), self.span * self.seq_len, self.span * self.per_row)]
            self._epoch, self._bins = epoch, out
        return self._bins

    def steps_in(self, epoch: int) -> int:
        if epoch not in self._steps:
            self._steps[epoch] = len(self.bins(epoch)) * self.span // self.global_batch
        return self._steps[epoch]

    def _locate(self, step: int) -> tuple[int, int]:
        """(epoch, first row of the step in that epoch's list)."""
        epoch = 0
        while step >= self.steps_in(epoch):
            step -= self.steps_in(epoch)
            epoch += 1
        return epoch, step * self.global_batch

    def micro_rows(self, step: int, micro: int, rank: int, world: int, micro_batch: int) -> list[list[int]]:
        """The micro-batch's bins (``micro_batch / span`` of them)."""
        if micro_batch % self.span:
            raise ValueError(f"micro batch {micro_batch} is not a multiple of the packing span {self.span}")
        epoch, first = self._locate(step)
        start = first + (micro * world + rank) * micro_batch
        return self.bins(epoch)[start // self.span:(start + micro_batch) // self.span]


class PretrainLoader:
    """Yields this rank's micro-batches (dicts of CPU tensors, pinned when CUDA is used) from a start
    step on, prepared by a background thread a few batches ahead."""

    def __init__(self, data: PretrainData, order, *, rank: int, world: int, micro_batch: int,
                 grad_accum: int, start_step: int = 0, prefetch: int = 4, pin: bool = False,
                 pad_to: Optional[int] = None, per_row: Optional[int] = None):
        """``per_row`` set: static-shape batches (``order`` a GlobalOrder or PackedOrder); None: padded
        batches of ``order.micro_batch`` (pad to the longest, or to ``pad_to``)."""
        if micro_batch * world * grad_accum != order.global_batch:
            raise ValueError(f"micro_batch {micro_batch} x world {world} x grad_accum {grad_accum} != "
                             f"global batch {order.global_batch}")
        self.data, self.order = data, order
        self.rank, self.world, self.micro_batch, self.grad_accum = rank, world, micro_batch, grad_accum
        self.step = start_step
        self.prefetch, self.pin, self.pad_to, self.per_row = prefetch, pin, pad_to, per_row
        self.span = getattr(order, "span", 1)     # rows a packing bin spans (PackedOrder)
        self._queue: Optional[queue.Queue] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _make(self, step: int, micro: int) -> dict:
        if self.per_row is not None:
            rows = self.order.micro_rows(step, micro, self.rank, self.world, self.micro_batch)
            arrays = self.data.static_batch(rows, self.per_row, self.span)
        else:
            idx = self.order.micro_batch(step, micro, self.rank, self.world, self.micro_batch)
            arrays = self.data.batch(idx, self.pad_to)
        batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
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
                 pad_to: Optional[int] = None, per_row: Optional[int] = None) -> list[dict]:
    """A fixed evaluation set: the first ``max_batches * world * micro_batch`` validation sequences
    in order, split over ranks (the same batches at every evaluation). Ranks get equal counts.
    ``per_row`` set: static-shape batches (one sequence a row, the training shapes)."""
    per_round = world * micro_batch
    rounds = min(max_batches, len(data) // per_round)
    out = []
    for b in range(rounds):
        start = b * per_round + rank * micro_batch
        if per_row is not None:
            arrays = data.static_batch([[i] for i in range(start, start + micro_batch)], per_row)
        else:
            arrays = data.batch(range(start, start + micro_batch), pad_to)
        out.append({k: torch.from_numpy(v) for k, v in arrays.items()})
    return out
