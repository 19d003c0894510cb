"""``fastbert tokenize``: text files -> token id arrays, streaming, with the C++ tokenizer on all cores.

For each input file, ``OUT/<name>.npy`` holds the WordPiece ids of all its paragraphs back to back
(no [CLS]/[SEP]; uint16 when the vocabulary has at most 65536 tokens, else int32), and
``OUT/index.json`` lists every file with its token count and ``doc_offsets`` (where each document
starts in the array, plus the end). Inputs are plain text (documents separated by blank lines, one
sentence or paragraph per line) or WikiExtractor output (``<doc ...>`` blocks, the repeated title
line dropped): the conventions of ``fastbert prepare``. .xz, .gz and .bz2 are read as they stream
(detected from their first bytes). Arrays are written into a staging folder inside OUT and moved into
place only when every input succeeded; index.json is written last. On an error nothing is left.
"""
from __future__ import annotations

import argparse
import bz2
import gzip
import io
import json
import lzma
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

_MAGIC = {b"\xfd7zXZ\x00": "xz", b"\x1f\x8b": "gzip", b"BZh": "bzip2"}
_DOC_OPEN = re.compile(r'^<doc\b[^>]*>\s*$')
_TITLE = re.compile(r'\btitle="([^"]*)"')
_SUFFIXES = (".xz", ".gz", ".bz2", ".txt")
_NPY_HEADER = 128  # bytes reserved for the .npy header, patched with the final length


def add_parser(sub):
    p = sub.add_parser("tokenize", help="tokenize text files into token id arrays (.npy) with the C++ tokenizer",
                       description="Tokenize text files (plain or WikiExtractor, optionally .xz/.gz/.bz2) into one "
                                   "array of WordPiece ids per file plus OUT/index.json with document offsets. "
                                   "Streams each file; tokenizes on all cores.")
    p.add_argument("--vocab", required=True, help="vocab.txt, or a tokenizer / checkpoint directory holding one")
    p.add_argument("--input", required=True, nargs="+", metavar="FILE",
                   help="input files or folders (searched recursively)")
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                   help="lowercase and strip accents (uncased vocabularies); default: from tokenizer_config.json, "
                        "else guessed from the vocabulary")
    p.add_argument("--threads", type=int, default=None, help="tokenizer threads (default: all cores)")
    p.add_argument("--batch-mb", type=float, default=8.0, help="text per tokenizer call in MB (default 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from fastbert.errors import UsageError

    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1")
    if args.batch_mb <= 0:
        raise UsageError("--batch-mb must be > 0")
    files = _input_files(args.input)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; pass a directory")
    tok, lowercase, vocab = _load_tokenizer(args.vocab, args.lowercase)
    dtype = "uint16" if len(tok) <= 1 << 16 else "int32"
    names = _output_names(files)
    total_bytes = sum(f.stat().st_size for f in files)
    bar = _progress(total_bytes, not args.no_progress)
    start = time.perf_counter()
    stats = {"text_bytes": 0, "tokens": 0}
    entries = []
    made = _mkdirs(out)
    staging = Path(tempfile.mkdtemp(prefix=".tokenize-", dir=out))  # all or nothing: moved into place at the end
    ahead = max(1, min(8, args.threads or os.cpu_count() or 1))  # files read (decompressed) in parallel
    readers: dict[int, _Reader] = {}
    try:
        for i, (path, name) in enumerate(zip(files, names)):
            for j in range(i, min(i + ahead, len(files))):
                if j not in readers:
                    readers[j] = _Reader(files[j], int(args.batch_mb * 1e6))
            entries.append(_tokenize_file(tok, readers.pop(i), staging, name, dtype, args, bar, stats, start))
        for name in names:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, out / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for d in made:  # folders this run created, deepest first: an error leaves no empty OUT behind
            try:
                d.rmdir()
            except OSError:
                break
        raise
    finally:
        bar.close()
        shutil.rmtree(staging, ignore_errors=True)
    seconds = time.perf_counter() - start
    index = {
        "format": "fastbert-token-ids/1",
        "vocab": str(vocab), "vocab_size": len(tok), "lowercase": lowercase, "dtype": dtype,
        "special_tokens": {name: getattr(tok, name) for name in
                           ("cls_token", "sep_token", "pad_token", "mask_token", "unk_token")},
        "tokens": stats["tokens"], "text_bytes": stats["text_bytes"], "seconds": round(seconds, 3),
        "files": entries,
    }
    from fastbert.io import atomic_write_text
    atomic_write_text(out / "index.json", json.dumps(index, indent=1) + "\n")
    rate = stats["text_bytes"] / max(seconds, 1e-9) / 1e6
    print(f"tokenized {len(files)} file(s): {stats['text_bytes'] / 1e6:.1f} MB of text, {stats['tokens']:,} tokens "
          f"in {seconds:.1f} s ({rate:.1f} MB/s) -> {out / 'index.json'}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------
# Inputs and outputs
# ------------------------------------------------------------------------------------------------

def _input_files(paths: list[str]) -> list[Path]:
    from fastbert.errors import UsageError
    from fastbert.data.corpus import expand_files
    files = expand_files(
        paths, missing=lambda p: UsageError(f"input not found: {p}"),
        empty_folder=lambda p: UsageError(f"input folder {p} holds no files; pass text files (.txt, .xz, .gz, .bz2)"))
    if not files:
        raise UsageError("no input files; pass --input FILE [FILE ...]")
    return [f.resolve() for f in files]


def _mkdirs(path: Path) -> list[Path]:
    """mkdir -p; returns the folders it created, deepest first."""
    made, p = [], path
    while not p.exists():
        made.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    return made


def _output_names(files: list[Path]) -> list[str]:
    """File names with compression / .txt suffixes replaced by .npy; paths relative to the inputs'
    common folder when two inputs share a name (AA/wiki_00, AB/wiki_00)."""
    def strip(rel: str) -> str:
        while rel.endswith(_SUFFIXES):
            rel = rel[: rel.rfind(".")]
        return rel

    names = [strip(f.name) for f in files]
    if len(set(names)) < len(names):
        root = Path(os.path.commonpath([str(f.parent) for f in files]))
        names = [strip(str(f.relative_to(root))) for f in files]
    out, seen = [], set()
    for rel in names:
        name, k = rel + ".npy", 1
        while name in seen:  # a.txt and a.xz side by side
            k += 1
            name = f"{rel}.{k}.npy"
        seen.add(name)
        out.append(name)
    return out


def _load_tokenizer(vocab_arg: str, lowercase):
    from fastbert.errors import UsageError
    from fastbert.tokenization.wordpiece import WordPieceTokenizer

    vocab = Path(vocab_arg)
    directory = vocab if vocab.is_dir() else vocab.parent
    vocab_file = vocab / "vocab.txt" if vocab.is_dir() else vocab
    if not vocab_file.is_file():
        raise UsageError(f"vocab file not found: {vocab_file}; pass a BERT vocab.txt or a directory holding one")
    config = directory / "tokenizer_config.json"
    if lowercase is None and config.is_file():
        try:
            lowercase = json.loads(config.read_text(encoding="utf-8")).get("do_lower_case")
        except json.JSONDecodeError as e:
            raise UsageError(f"{config} is not valid JSON ({e}); fix it or pass --lowercase / --no-lowercase") from None
    if lowercase is None:  # uncased vocabularies hold no upper-case letters outside [SPECIAL] tokens
        words = [t for t in vocab_file.read_text(encoding="utf-8").split("\n")
                 if t and not (t.startswith("[") and t.endswith("]"))]
        lowercase = sum(any(c.isupper() for c in t) for t in words) < 0.01 * max(1, len(words))
    try:
        if vocab.is_dir():
            tok = WordPieceTokenizer.from_pretrained(vocab, lowercase=bool(lowercase))
        else:
            tok = WordPieceTokenizer(vocab_file, lowercase=bool(lowercase))
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    return tok, bool(lowercase), vocab_file


def _open_text(path: Path):
    """(raw binary file, text stream): compressed position for progress, decoded lines."""
    raw = open(path, "rb")
    head = raw.read(6)
    raw.seek(0)
    kind = next((k for magic, k in _MAGIC.items() if head.startswith(magic)), "plain")
    stream = {"xz": lambda: lzma.LZMAFile(raw), "gzip": lambda: gzip.GzipFile(fileobj=raw),
              "bzip2": lambda: bz2.BZ2File(raw), "plain": lambda: raw}[kind]()
    return raw, io.TextIOWrapper(stream, encoding="utf-8", errors="strict"), kind


def _paragraphs(text, path: Path):
    """(paragraph, starts_document) for every non-empty line, in order (see the module docstring)."""
    from fastbert.errors import UsageError
    wiki = None
    in_doc, title, new_doc, opened_at = False, None, True, 0
    for n, line in enumerate(text, 1):
        s = line.strip()
        if wiki is None:
            if not s:
                continue
            wiki = s.startswith("<doc") and bool(_DOC_OPEN.match(s))
        if not wiki:
            if s:
                yield s, new_doc
                new_doc = False
            else:
                new_doc = True
            continue
        if not in_doc:
            if s.startswith("<doc") and _DOC_OPEN.match(s):
                m = _TITLE.search(s)
                in_doc, title, new_doc, opened_at = True, (m.group(1).strip() if m else None), True, n
            elif s:
                raise UsageError(f"{path}: line {n} is outside any <doc> ... </doc> block of this WikiExtractor "
                                 f"file; the file is damaged (or mixes formats): fix or remove it")
        elif s == "</doc>":
            in_doc = False
        elif s.startswith("<doc") and _DOC_OPEN.match(s):
            raise UsageError(f"{path}: <doc> at line {n} opens before the one at line {opened_at} is closed; "
                             f"the file is damaged: fix or remove it")
        elif s:
            if new_doc and title is not None and s == title:
                title = None  # WikiExtractor repeats the title as the first line
                continue
            title = None
            yield s, new_doc
            new_doc = False
    if wiki and in_doc:
        raise UsageError(f"{path}: <doc> opened at line {opened_at} is never closed (truncated file?); fix or remove it")


class _Reader:
    """Reads, decompresses and splits one file in a background thread (xz/gzip/bz2 release the GIL,
    so several files decompress in parallel). Iterating yields (paragraphs, doc_start_flags,
    compressed_position, text_bytes_so_far); a reading error is raised by the iteration."""

    def __init__(self, path: Path, batch_chars: int):
        self.path, self.batch_chars = path, batch_chars
        self.queue: queue.Queue = queue.Queue(maxsize=4)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            raw, text, kind = _open_text(self.path)
            with raw, text:
                stream = text.buffer
                lines, starts, size = [], [], 0
                for s, new_doc in _paragraphs(text, self.path):
                    lines.append(s)
                    starts.append(new_doc)
                    size += len(s)
                    if size >= self.batch_chars:
                        self.queue.put((lines, starts, raw.tell(), stream.tell()))
                        lines, starts, size = [], [], 0
                self.queue.put((lines, starts, raw.tell(), stream.tell()))
        except BaseException as e:  # noqa: BLE001 - re-raised by __iter__
            self.error = e
        finally:
            self.queue.put(None)

    def __iter__(self):
        while (item := self.queue.get()) is not None:
            yield item
        self.thread.join()
        if self.error is not None:
            raise self.error


def _tokenize_file(tok, reader: _Reader, out: Path, name: str, dtype: str, args, bar, stats: dict,
                   start: float) -> dict:
    import numpy as np

    from fastbert.errors import UsageError
    from fastbert.textio import not_utf8

    path = reader.path
    tokens = text_bytes = lines = 0
    doc_offsets: list[int] = []
    read_pos = 0
    target = out / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as f:
        f.write(b"\0" * _NPY_HEADER)
        try:
            for batch, starts, pos, decoded in reader:
                if batch:
                    ids, splits = tok.encode_flat(batch, num_threads=args.threads)
                    for j in np.flatnonzero(np.asarray(starts)):
                        doc_offsets.append(tokens + int(splits[j]))
                    f.write(ids.astype(dtype, copy=False).tobytes())
                    tokens += len(ids)
                    lines += len(batch)
                    stats["tokens"] += len(ids)
                stats["text_bytes"] += decoded - text_bytes
                text_bytes = decoded
                bar.update(pos - read_pos)
                read_pos = pos
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{stats['text_bytes'] / elapsed / 1e6:.1f} MB/s text, "
                                    f"{stats['tokens'] / elapsed / 1e6:.2f} Mtok/s", refresh=False)
        except UsageError:
            raise
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: {not_utf8(e)}") from None
        except (lzma.LZMAError, gzip.BadGzipFile, EOFError, OSError) as e:
            raise UsageError(f"{path}: cannot read it ({e.__class__.__name__}: {e}); the file is corrupt or "
                             f"truncated: re-create it or leave it out") from None
        if not lines:
            raise UsageError(f"{path}: empty, no text to tokenize; leave it out of --input")
        f.seek(0)
        f.write(_npy_header(dtype, tokens))
        f.flush()
        os.fsync(f.fileno())
    doc_offsets.append(tokens)
    return {"input": str(path), "ids": name, "tokens": tokens, "text_bytes": text_bytes, "paragraphs": lines,
            "documents": len(doc_offsets) - 1, "doc_offsets": doc_offsets}


def _npy_header(dtype: str, length: int) -> bytes:
    """A .npy (format 1.0) header of exactly _NPY_HEADER bytes for a 1-D little-endian array."""
    descr = {"uint16": "<u2", "int32": "<i4"}[dtype]
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({length},), }}"
    body = text.ljust(_NPY_HEADER - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


def _progress(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="tokenize", disable=not enabled,
                dynamic_ncols=True, file=sys.stderr)
