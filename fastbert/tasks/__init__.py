"""fastbert.tasks: fine-tuning tasks (GLUE, SQuAD, NER, multiple choice, sentence embeddings) and the loop that
trains them. This file stays free of torch: the ``fastbert`` command lists the task names without loading it."""
from fastbert.data.glue import TASKS as _GLUE_TASKS

TASK_NAMES = tuple(_GLUE_TASKS) + ("squad", "ner", "multiple-choice")


def canonical_task(name: str):
    """The task ``name`` stands for, one of TASK_NAMES (case-insensitive; GLUE names with or without '-';
    'multiple_choice' and 'mc' for multiple choice), else None."""
    key = name.lower()
    if key.replace("-", "") in _GLUE_TASKS:
        return key.replace("-", "")
    if key in ("squad", "ner"):
        return key
    return "multiple-choice" if key in ("multiple-choice", "multiple_choice", "mc") else None
