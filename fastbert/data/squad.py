"""SQuAD v1.1 / v2.0 JSON reader.

Layout (both versions): ``{"version": ..., "data": [{"title", "paragraphs": [{"context", "qas":
[{"id", "question", "answers": [{"text", "answer_start"}], "is_impossible"?}]}]}]}``. v2.0 adds
``is_impossible`` (and ``plausible_answers``, ignored); a file is read as v2.0 when its version
says so or any question carries ``is_impossible``. ``--data`` may be a JSON file or a folder with
``train-v*.json`` / ``dev-v*.json``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fastbert.errors import DataError


@dataclass
class SquadExample:
    qid: str
    title: str
    question: str
    context: str
    answers: list[str] = field(default_factory=list)         # gold texts (all annotators)
    answer_starts: list[int] = field(default_factory=list)   # character offsets into context
    is_impossible: bool = False


def find_split(data: Path, split: str) -> Path | None:
    """``data`` if it is a file (for ``dev``), else ``<data>/<split>-v2.0.json`` or ``-v1.1.json``."""
    data = Path(data)
    if data.is_file():
        return data if split == "dev" else None
    for name in (f"{split}-v2.0.json", f"{split}-v1.1.json", f"{split}.json"):
        if (data / name).is_file():
            return data / name
    return None


def split_file(data, split: str, explicit=None) -> Path:
    """The SQuAD file of ``split``: ``explicit`` (--train-file / --eval-file) when given, else ``find_split``'s."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise DataError(f"SQuAD {split} file not found: {path}")
        return path
    path = find_split(data, split)
    if path is None:
        raise DataError(f"no SQuAD {split} file: expected {data}/{split}-v1.1.json (or -v2.0.json), "
                        f"or pass --{'train' if split == 'train' else 'eval'}-file")
    return path


def read_squad(path: Path, max_questions: int | None = None) -> tuple[list[SquadExample], bool]:
    """All questions of ``path`` in file order and whether the file is SQuAD v2.0."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); expected a SQuAD file") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise DataError(f"{path}: expected a SQuAD JSON object with a 'data' list of articles")
    v2 = str(doc.get("version", "")).startswith("v2") or str(doc.get("version", "")).startswith("2")
    examples: list[SquadExample] = []
    for a, article in enumerate(doc["data"]):
        where = f"{path}: data[{a}]"
        paragraphs = _get(article, "paragraphs", list, where)
        for p, para in enumerate(paragraphs):
            pwhere = f"{where}.paragraphs[{p}]"
            context = _get(para, "context", str, pwhere)
            for q, qa in enumerate(_get(para, "qas", list, pwhere)):
                qwhere = f"{pwhere}.qas[{q}]"
                impossible = bool(qa.get("is_impossible", False)) if isinstance(qa, dict) else False
                v2 = v2 or (isinstance(qa, dict) and "is_impossible" in qa)
                answers = _get(qa, "answers", list, qwhere)
                texts, starts = [], []
                for i, ans in enumerate(answers):
                    text = _get(ans, "text", str, f"{qwhere}.answers[{i}]")
                    start = _get(ans, "answer_start", int, f"{qwhere}.answers[{i}]")
                    if not 0 <= start <= len(context) - len(text):
                        raise DataError(f"{qwhere}.answers[{i}]: answer_start {start} lies outside the context")
                    texts.append(text)
                    starts.append(start)
                if not texts and not impossible:
                    raise DataError(f"{qwhere}: question has no answers and is not marked is_impossible")
                examples.append(SquadExample(str(_get(qa, "id", (str, int), qwhere)), str(article.get("title", "")),
                                             _get(qa, "question", str, qwhere), context, texts, starts,
                                             impossible))
                if max_questions is not None and len(examples) >= max_questions:
                    return examples, v2
    if not examples:
        raise DataError(f"{path} holds no questions")
    return examples, v2


def _get(obj, key, typ, where):
    if not isinstance(obj, dict) or key not in obj:
        raise DataError(f"{where}: missing '{key}' (not the SQuAD JSON layout)")
    value = obj[key]
    if not isinstance(value, typ) or isinstance(value, bool):
        raise DataError(f"{where}.{key}: expected {getattr(typ, '__name__', typ)}, got {type(value).__name__}")
    return value
