"""The ``kernels="triton"`` op table: the fused Triton entry points, one per op file."""
from __future__ import annotations


def triton_ops():
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("kernels='triton' needs the triton package: pip install triton "
                           "(or use kernels='torch')") from e
    from fastbert.ops import Ops
    from fastbert.ops import attention
    from fastbert.ops.embeddings import bert_embeddings
    from fastbert.ops.ffn import linear_bias_gelu
    from fastbert.ops.layer_norm import dropout_add_layer_norm
    from fastbert.ops.mlm_loss import sparse_mlm_loss
    return Ops(bert_embeddings, dropout_add_layer_norm, linear_bias_gelu, attention.varlen_attention,
               sparse_mlm_loss, attention.varlen_attention_qkvpacked)
