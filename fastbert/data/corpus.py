"""Reading a pretraining corpus: files and folders -> documents -> sentences.

Inputs: plain text, xz, gzip or bzip2 (detected from the first bytes, not the name), either

* WikiExtractor output: ``<doc id=... title=...>`` ... ``</doc>`` blocks; the first line of each
  block repeats the title and is dropped; every other non-empty line is a paragraph; or
* plain text: documents separated by one or more blank lines, each line a sentence or paragraph
  (google-research/bert's input convention).

Paragraphs are split into sentences by ``split_sentences``: a rule-based splitter (terminal
punctuation followed by space and an upper-case letter, digit or opening quote) that does not split
after common abbreviations or single-letter initials. It needs no model and is deterministic.
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import os
import re
from pathlib import Path
from typing import Callable, Iterator

MAGIC = {b"\xfd7zXZ\x00": "xz", b"\x1f\x8b": "gzip", b"BZh": "bzip2"}


class CorpusError(ValueError):
    """Bad corpus input; the message names the file and the fix."""


# ------------------------------------------------------------------------------------- files
def files_under(folder: Path) -> list[Path]:
    """The files below ``folder``, recursively and sorted; hidden files and folders (".name") are
    skipped."""
    return sorted(f for f in folder.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(folder).parts))


def expand_files(paths, missing: Callable[[Path], Exception], empty_folder: Callable[[Path], Exception]) -> list[Path]:
    """Files as given and folders expanded by :func:`files_under`, each file once (the first spelling
    of it is kept). ``missing(p)`` / ``empty_folder(p)`` build the error raised for a path that does
    not exist / a folder without files (each command words its own)."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = files_under(p)
            if not found:
                raise empty_folder(p)
            files.extend(found)
        else:
            raise missing(p)
    # One file listed twice (a file and its folder) would be read twice.
    unique: dict[Path, Path] = {}
    for f in files:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def list_corpus_files(paths) -> list[Path]:
    """Expand files and folders (recursively, hidden entries skipped) into a sorted file list."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = expand_files(
        paths, missing=lambda p: CorpusError(f"corpus path not found: {p}"),
        empty_folder=lambda p: CorpusError(f"corpus folder {p} holds no files; point --corpus at .txt/.xz/.gz "
                                           "files or WikiExtractor output"))
    if not files:
        raise CorpusError("no corpus files given; pass --corpus FILE_OR_DIR")
    return files


def compression_of(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(6)
    for magic, kind in MAGIC.items():
        if head.startswith(magic):
            return kind
    return "plain"


def read_text(path) -> str:
    """The whole file as text, decompressed; corrupt archives and non-UTF-8 bytes are CorpusErrors."""
    path = Path(path)
    kind = compression_of(path)
    opener = {"xz": lzma.open, "gzip": gzip.open, "bzip2": bz2.open, "plain": open}[kind]
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (lzma.LZMAError, gzip.BadGzipFile, OSError, EOFError) as e:
        raise CorpusError(f"{path}: cannot read this {kind} file ({e.__class__.__name__}: {e}); it is corrupt or "
                          "truncated: re-create it or leave it out of --corpus") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise CorpusError(f"{path}: not UTF-8 text (byte {e.start}, line {line}: {data[e.start:e.start + 4]!r}); "
                          "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


# ------------------------------------------------------------------------------------- documents
_DOC_OPEN = re.compile(r'^<doc\b[^>]*>\s*$')
_TITLE = re.compile(r'\btitle="([^"]*)"')


def iter_documents(text: str, source: str = "<text>") -> Iterator[list[str]]:
    """Documents as lists of paragraphs (non-empty, stripped lines)."""
    lines = text.splitlines()
    if any(_DOC_OPEN.match(line) for line in lines[:1000]) or text.lstrip().startswith("<doc"):
        yield from _wikiextractor_documents(lines, source)
    else:
        yield from _blank_line_documents(lines)


def _wikiextractor_documents(lines: list[str], source: str) -> Iterator[list[str]]:
    doc: list[str] | None = None
    title = None
    opened_at = 0
    for n, line in enumerate(lines, 1):
        if doc is None:
            if _DOC_OPEN.match(line):
                m = _TITLE.search(line)
                title = m.group(1).strip() if m else None
                doc, opened_at = [], n
            elif line.strip():
                raise CorpusError(f"{source}: line {n} is outside any <doc> ... </doc> block in a WikiExtractor file; "
                                  "the file is damaged (or mixes formats): fix or remove it")
            continue
        if line.strip() == "</doc>":
            if doc and title is not None and doc[0] == title:
                doc = doc[1:]
            if doc:
                yield doc
            doc = None
        elif _DOC_OPEN.match(line):
            raise CorpusError(f"{source}: <doc> at line {n} opens before the one at line {opened_at} is closed; "
                              "the file is damaged: fix or remove it")
        else:
            s = line.strip()
            if s:
                doc.append(s)
    if doc is not None:
        raise CorpusError(f"{source}: <doc> opened at line {opened_at} is never closed (truncated file?); "
                          "fix or remove it")


def _blank_line_documents(lines: list[str]) -> Iterator[list[str]]:
    doc: list[str] = []
    for line in lines:
        s = line.strip()
        if s:
            doc.append(s)
        elif doc:
            yield doc
            doc = []
    if doc:
        yield doc


# ------------------------------------------------------------------------------------- sentences
_ABBREVIATIONS = frozenset("""
mr mrs ms dr prof st jr sr rev gen col lt sgt capt maj cmdr adm gov sen rep hon fr
vs etc e.g i.e cf al approx ca inc ltd co corp bros dept univ est fig figs vol vols no nos pp ed eds
jan feb mar apr jun jul aug sep sept oct nov dec mt ft u.s u.k u.n a.m p.m
""".split())

# Terminal punctuation, optional closing quotes/brackets, whitespace, then what can start a sentence.
_BOUNDARY = re.compile(r'([.!?]+)(["\'\u201d\u2019)\]]*)(\s+)(?=["\'\u201c\u2018(\[]?[A-Z0-9\u00C0-\u024F])')


def split_sentences(paragraph: str) -> list[str]:
    """Split one paragraph into sentences (whitespace-stripped, never empty)."""
    out, start = [], 0
    for m in _BOUNDARY.finditer(paragraph):
        end = m.end(2)
        if m.group(1) == ".":
            words = paragraph[start:m.start(1)].split()
            last = words[-1].lower().lstrip("(\"'") if words else ""
            # "J. R. R. Tolkien", "Mr. Smith", "U.S. Army": not sentence ends.
            if (len(last) == 1 and last.isalpha()) or last in _ABBREVIATIONS:
                continue
        piece = paragraph[start:end].strip()
        if piece:
            out.append(piece)
        start = m.end(3)
    tail = paragraph[start:].strip()
    if tail:
        out.append(tail)
    return out


def read_documents(path) -> list[list[str]]:
    """All documents of one file as lists of sentences (documents with no text are dropped)."""
    text = read_text(path)
    docs = []
    for paragraphs in iter_documents(text, str(path)):
        sentences = [s for p in paragraphs for s in split_sentences(p)]
        if sentences:
            docs.append(sentences)
    return docs
