"""fastbert.tasks: fine-tuning tasks (GLUE, SQuAD, NER, multiple choice, sentence embeddings) and the loop that
trains them. This file stays free of torch: the ``fastbert`` command lists the task names without loading it."""
from fastbert.data.glue import TASKS as _GLUE_TASKS

TASK_NAMES = tuple(_GLUE_TASKS) + ("squad", "ner", "multiple-choice")
