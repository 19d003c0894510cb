"""Multiple-choice JSONL reader (SWAG / RACE / ARC style data in one documented format).

One JSON object per line::

    {"context": "She opened the fridge.", "question": "Then she", "choices": ["took out milk.", "flew away."], "label": 0}

``context`` and ``question`` are optional (at least one is required); ``choices`` is a list of
two or more strings, the same number on every line of a file; ``label`` is the 0-based index of
the right choice (optional only for unlabelled prediction files). Each choice is scored as the
pair ``(context, question + " " + choice)``; without a context, ``(question, choice)``; without a
question, ``(context, choice)``. Splits are ``train.jsonl`` and ``dev.jsonl`` in the data folder.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fastbert.errors import DataError


@dataclass
class ChoiceExample:
    first: str           # the first segment shared by every choice
    seconds: list[str]   # the second segment of each choice
    label: Optional[int]


def find_split(data: Path, split: str) -> Path:
    data = Path(data)
    names = {"train": ("train.jsonl",), "dev": ("dev.jsonl", "validation.jsonl", "valid.jsonl")}[split]
    for name in names:
        if (data / name).is_file():
            return data / name
    raise DataError(f"no {split} file for multiple-choice in {data}: expected {' or '.join(names)}")


def read_jsonl(path: Path, max_samples: Optional[int] = None, require_label: bool = True) -> list[ChoiceExample]:
    path = Path(path)
    examples: list[ChoiceExample] = []
    n_choices = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object with 'choices' and 'label'")
            context, question = obj.get("context"), obj.get("question")
            for key, value in (("context", context), ("question", question)):
                if value is not None and not isinstance(value, str):
                    raise DataError(f"{where}: '{key}' must be a string")
            if not context and not question:
                raise DataError(f"{where}: needs a 'context' or a 'question' (or both)")
            choices = obj.get("choices")
            if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
                raise DataError(f"{where}: 'choices' must be a list of at least two strings")
            if n_choices is None:
                n_choices = len(choices)
            elif len(choices) != n_choices:
                raise DataError(f"{where}: {len(choices)} choices but earlier lines have {n_choices}; every line "
                                "of a file needs the same number of choices")
            label = obj.get("label")
            if label is None and require_label:
                raise DataError(f"{where}: missing 'label' (the 0-based index of the right choice)")
            if label is not None and (not isinstance(label, int) or isinstance(label, bool)
                                      or not 0 <= label < len(choices)):
                raise DataError(f"{where}: label {label!r} must be an integer in [0, {len(choices)})")
            if context:
                first = context
                seconds = [f"{question} {c}" if question else c for c in choices]
            else:
                first, seconds = question, list(choices)
            examples.append(ChoiceExample(first, seconds, label))
            if max_samples is not None and len(examples) >= max_samples:
                break
    if not examples:
        raise DataError(f"{path} holds no examples")
    return examples
