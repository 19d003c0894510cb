"""GLUE readers for the standard TSV layout written by GLUE's ``download_glue_data.py``.

One folder per task (``CoLA/``, ``SST-2/``, ``MRPC/``, ``STS-B/``, ``QQP/``, ``MNLI/``, ``QNLI/``,
``RTE/``, ``WNLI/``) holding ``train.tsv`` and ``dev.tsv`` (MNLI: ``dev_matched.tsv`` and
``dev_mismatched.tsv``). Files are tab-separated without quoting. CoLA has no header row
(columns: source, label, original mark, sentence); every other task has one, and columns are
found by name. ``--data`` may name the task folder itself or the GLUE root above it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fastbert.data.tsv import read_first_row, read_tsv
from fastbert.errors import DataError

log = logging.getLogger("fastbert")


@dataclass(frozen=True)
class GlueTask:
    name: str
    folder: str                       # folder name in the GLUE layout
    labels: Optional[tuple[str, ...]]  # None: regression (STS-B)
    text_a: str | int                 # header name, or column index for header-less files
    text_b: Optional[str | int]
    label: str | int
    header: bool = True
    dev_splits: tuple[str, ...] = ("dev",)
    skip_malformed: bool = False       # QQP's train.tsv has a few broken rows; GLUE loaders drop them

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)


TASKS: dict[str, GlueTask] = {t.name: t for t in (
    GlueTask("cola", "CoLA", ("0", "1"), 3, None, 1, header=False),
    GlueTask("sst2", "SST-2", ("0", "1"), "sentence", None, "label"),
    GlueTask("mrpc", "MRPC", ("0", "1"), "#1 String", "#2 String", "Quality"),
    GlueTask("stsb", "STS-B", None, "sentence1", "sentence2", "score"),
    GlueTask("qqp", "QQP", ("0", "1"), "question1", "question2", "is_duplicate", skip_malformed=True),
    GlueTask("mnli", "MNLI", ("contradiction", "entailment", "neutral"), "sentence1", "sentence2", "gold_label",
             dev_splits=("dev_matched", "dev_mismatched")),
    GlueTask("qnli", "QNLI", ("entailment", "not_entailment"), "question", "sentence", "label"),
    GlueTask("rte", "RTE", ("entailment", "not_entailment"), "sentence1", "sentence2", "label"),
    GlueTask("wnli", "WNLI", ("0", "1"), "sentence1", "sentence2", "label"),
)}


@dataclass
class Example:
    guid: str
    text_a: str
    text_b: Optional[str]
    label: Optional[float | int]  # class index, or the score for regression


def get_task(name: str) -> GlueTask:
    key = name.lower().replace("-", "")
    if key not in TASKS:
        raise DataError(f"unknown GLUE task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[key]


def task_dir(task: GlueTask, data: Path) -> Path:
    """``data`` itself when it holds the task's train/dev files, else ``data/<Folder>``."""
    data = Path(data)
    for cand in (data, data / task.folder):
        if any((cand / f"{s}.tsv").is_file() for s in ("train",) + task.dev_splits):
            return cand
    raise DataError(f"no GLUE {task.name} data under {data}: expected {data}/{task.folder}/train.tsv and "
                    f"{', '.join(s + '.tsv' for s in task.dev_splits)} (the download_glue_data.py layout)")


def split_path(task: GlueTask, data: Path, split: str) -> Path:
    path = task_dir(task, data) / f"{split}.tsv"
    if not path.is_file():
        raise DataError(f"{path} not found: GLUE {task.name} needs {split}.tsv in {path.parent}")
    return path


def _resolve_column(task: GlueTask, header: list[str], col: str | int, path: Path) -> int:
    if isinstance(col, int):
        return col
    if col in header:
        # MNLI repeats no names, but take the last occurrence to be safe for "label" style columns.
        return len(header) - 1 - header[::-1].index(col)
    raise DataError(f"{path}: header has no {col!r} column (found: {', '.join(header) or 'nothing'}); "
                    f"is this the {task.name} file of the standard GLUE layout?")


def _layout(task: GlueTask, first_row: list[str] | None, path: Path) -> list[int | None]:
    """The columns of text_a, text_b and the label in ``path``, told from its first row (None: the file is empty);
    DataError when that row does not fit the task's layout."""
    if first_row is None:
        raise DataError(f"{path} is empty")
    header = first_row if task.header else []
    if not task.header and first_row and first_row[0] == "index":
        raise DataError(f"{path} has a header row; GLUE's {task.name} train/dev files have none "
                        "(test.tsv files are unlabelled and cannot be used for training or evaluation)")
    return [_resolve_column(task, header, c, path) if c is not None else None
            for c in (task.text_a, task.text_b, task.label)]


def check_layout(task: GlueTask, path: Path) -> None:
    """``path``'s first row fits the task's layout (read_examples reads and checks every row)."""
    _layout(task, read_first_row(path), Path(path))


def read_examples(task: GlueTask, path: Path, max_samples: int | None = None) -> list[Example]:
    """Labelled examples of one split; raises DataError on a row that does not fit the layout."""
    path = Path(path)
    rows = read_tsv(path)
    cols = _layout(task, rows[0] if rows else None, path)
    body, first_line = (rows[1:], 2) if task.header else (rows, 1)
    need = max(c for c in cols if c is not None) + 1
    label_index = {lab: i for i, lab in enumerate(task.labels)} if task.labels else None
    examples: list[Example] = []
    skipped = 0
    for lineno, row in enumerate(body, start=first_line):
        if not row or row == [""]:
            continue
        try:
            if len(row) < need:
                raise DataError(f"{path}:{lineno}: expected at least {need} tab-separated columns, got {len(row)}")
            a, b, raw = (row[c] if c is not None else None for c in cols)
            label = _parse_label(task, raw, label_index, path, lineno)
        except DataError:
            if task.skip_malformed:
                skipped += 1
                continue
            raise
        examples.append(Example(f"{path.stem}-{lineno}", a, b, label))
        if max_samples is not None and len(examples) >= max_samples:
            break
    if skipped:
        log.warning("%s: skipped %d malformed rows (as GLUE's reference loaders do for %s)", path, skipped, task.name)
    if not examples:
        raise DataError(f"{path} holds no examples")
    return examples


def text_columns(first_row: list[str]) -> tuple[int, Optional[int], bool] | None:
    """Where a GLUE TSV file (any split, test.tsv included) keeps its text, told from its first row:
    ``(text column, pair column or None, has a header row)``, or None when the row fits no GLUE
    layout. Header files are matched by column names (a task whose two text columns are both
    present wins over a one-sentence task); CoLA's header-less train/dev files by their shape
    (4 columns, a 0/1 label in the second)."""
    best: list[str] = []
    for task in TASKS.values():
        names = [c for c in (task.text_a, task.text_b) if c is not None]
        if task.header and all(n in first_row for n in names) and len(names) > len(best):
            best = names
    if best:
        return first_row.index(best[0]), first_row.index(best[1]) if len(best) > 1 else None, True
    cola = TASKS["cola"]
    if len(first_row) == 4 and first_row[cola.label] in cola.labels:
        return cola.text_a, None, False
    return None


def _parse_label(task, raw: str, label_index, path, lineno):
    raw = raw.strip()
    if task.is_regression:
        try:
            return float(raw)
        except ValueError:
            raise DataError(f"{path}:{lineno}: {task.name} score {raw!r} is not a number") from None
    if raw not in label_index:
        raise DataError(f"{path}:{lineno}: label {raw!r} is not one of {task.name}'s {len(task.labels)} labels "
                        f"{list(task.labels)}")
    return label_index[raw]
