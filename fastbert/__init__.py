"""fastbert: fast, correct BERT pretraining and fine-tuning.

Two kernel paths, one model: ``kernels="torch"`` (plain PyTorch reference, any device) and
``kernels="triton"`` (fused kernels; needs the optional triton package). Public shapes follow HF
transformers; inside the encoder tokens are unpadded to ``(total_tokens, hidden)``.

The names below load on first use (PEP 562), so ``import fastbert`` and the ``fastbert`` command's
``--help``, argument checks and usage errors do not wait seconds for torch; ``from fastbert import
BertModel`` works as always.
"""
from fastbert.lazy import lazy_names

__version__ = "0.1.0"

_WHERE = {
    "BertConfig": "fastbert.config",
    "BertModel": "fastbert.model",
    "BertForPreTraining": "fastbert.heads",
    "BertForMaskedLM": "fastbert.heads",
    "BertForNextSentencePrediction": "fastbert.heads",
    "BertForSequenceClassification": "fastbert.heads",
    "BertForTokenClassification": "fastbert.heads",
    "BertForQuestionAnswering": "fastbert.heads",
    "BertForMultipleChoice": "fastbert.heads",
    "patch": "fastbert.hf_patch",
    "unpatch": "fastbert.hf_patch",
    "UnsupportedModelError": "fastbert.hf_patch",
}
__all__ = ["__version__", *_WHERE]

__getattr__, __dir__ = lazy_names(__name__, _WHERE)
