"""The ``kernels="triton"`` op table: the fused Triton entry points, one per op file."""
from __future__ import annotations

import torch


def triton_ops():
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("kernels='triton' needs the triton package: pip install triton "
                           "(or use kernels='torch')") from e
    from fastbert.ops import Ops
    from fastbert.ops import attention
    from fastbert.ops.embeddings import bert_embeddings, bert_embeddings_ref
    from fastbert.ops.ffn import linear_bias_gelu
    from fastbert.ops.layer_norm import dropout_add_layer_norm
    from fastbert.ops.mlm_loss import sparse_mlm_loss
    # The fused embedding backward accumulates with atomics (not bitwise run to run): deterministic mode
    # (torch.use_deterministic_algorithms) takes the reference, whose index_add is deterministic there.
    embeddings = bert_embeddings_ref if torch.are_deterministic_algorithms_enabled() else bert_embeddings
    return Ops(embeddings, dropout_add_layer_norm, linear_bias_gelu, attention.varlen_attention,
               sparse_mlm_loss, attention.varlen_attention_qkvpacked)
