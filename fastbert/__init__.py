"""fastbert: fast, correct BERT pretraining and fine-tuning.

Two kernel paths, one model: ``kernels="torch"`` (plain PyTorch reference, any device) and
``kernels="triton"`` (fused kernels; needs the optional triton package). Public shapes follow HF
transformers; inside the encoder tokens are unpadded to ``(total_tokens, hidden)``.
"""
__version__ = "0.1.0"

from fastbert.config import BertConfig
from fastbert.model import BertModel
from fastbert.heads import (
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from fastbert.patch import patch, unpatch

__all__ = [
    "patch",
    "unpatch",
    "__version__",
    "BertConfig",
    "BertModel",
    "BertForPreTraining",
    "BertForMaskedLM",
    "BertForNextSentencePrediction",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertForQuestionAnswering",
    "BertForMultipleChoice",
]
