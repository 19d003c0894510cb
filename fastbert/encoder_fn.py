"""BERT's embeddings and encoder layer as functions of explicit weights, on unpadded rows.

``embed`` and ``layer`` own no parameters: they take the weights (``EmbeddingWeights``,
``LayerWeights``), the ops (``fastbert.ops.get_ops``), the rows and the dropout probabilities.
``fastbert.model``'s modules call them with their own parameters and ``fastbert.patch`` with an HF
``BertModel``'s, so fastbert has one encoder whoever holds the weights.

Rows are ``(rows, hidden)``: the real tokens (``cu_seqlens``, ``max_seqlen``), then any padding rows
``fastbert.padding_rows`` adds for masked positions a result reads.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Union

import torch

from fastbert.ops.fp8 import fp8_ffn, fp8_linear
from fastbert.padding_rows import Rows, attention_maps_or_packed, with_padding_rows


class LayerNormWeights(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float


class EmbeddingWeights(NamedTuple):
    word: torch.Tensor        # (vocab, hidden)
    position: torch.Tensor    # (max_positions, hidden)
    token_type: torch.Tensor  # (type_vocab, hidden)
    norm: LayerNormWeights
    padding_idx: int | None   # the word row that gets no gradient


class LayerWeights(NamedTuple):
    """One layer's parameters in HF's roles; ``qkv_weight`` is ``cat(query, key, value)``."""
    num_heads: int
    qkv_weight: torch.Tensor             # (3 * hidden, hidden)
    qkv_bias: torch.Tensor | None        # (3 * hidden,)
    attention_out_weight: torch.Tensor   # (hidden, hidden)
    attention_out_bias: torch.Tensor
    attention_norm: LayerNormWeights     # Pre-LN: normalizes the layer's input
    intermediate_weight: torch.Tensor    # (intermediate, hidden)
    intermediate_bias: torch.Tensor | None
    output_weight: torch.Tensor          # (hidden, intermediate)
    output_bias: torch.Tensor
    output_norm: LayerNormWeights        # Pre-LN: normalizes the residual stream before the FFN
    # FP8 GEMMs (``ops/fp8.py``): the model's amax history and this layer's first row of it (three rows
    # per linear: qkv, attention output, intermediate, output), or None for 16/32-bit GEMMs.
    fp8: tuple | None = None


class LayerDropout(NamedTuple):
    """Dropout probabilities of a layer's three sites (0 in eval)."""
    attention: float = 0.0         # on the attention probabilities
    attention_output: float = 0.0  # on the attention block's output, before its residual add
    output: float = 0.0            # on the FFN's output, before its residual add


# torch's GELU ``approximate`` ("none" / "tanh") for the fused bias + GELU, or any activation function.
Activation = Union[str, Callable[[torch.Tensor], torch.Tensor]]


def embed(ops, w: EmbeddingWeights, input_ids, position_ids, token_type_ids, dropout_p: float = 0.0):
    """Word + position + token-type embeddings, LayerNorm, dropout: ``(tokens,)`` ids -> ``(tokens, hidden)``."""
    return ops.embeddings(input_ids, position_ids, token_type_ids, w.word, w.position, w.token_type,
                          w.norm.weight, w.norm.bias, w.norm.eps, dropout_p=dropout_p, padding_idx=w.padding_idx)


def layer(ops, x, w: LayerWeights, cu_seqlens, max_seqlen: int, rows: Rows | None = None, *,
          activation: Activation, softmax_scale: float, dropout: LayerDropout = LayerDropout(),
          prenorm: bool = False, output_attentions: bool = False, normed: torch.Tensor | None = None,
          next_norm: LayerNormWeights | None = None, keep: torch.Tensor | None = None):
    """One encoder layer on ``x`` ``(rows, hidden)``: Post-LN (original BERT) or Pre-LN. Returns the new
    x, the attention maps (``attention_maps_or_packed``'s) when ``output_attentions`` else None, and (Pre-LN)
    the new x normalized by ``next_norm``, else None.

    ``keep`` (int64 row indices, repeats allowed): the layer's outputs are these rows only, in this order.
    Attention still reads every row's keys and values; everything after it (the output projection, the
    residual adds and LayerNorms, the FFN) runs on the kept rows alone. A kept row's arithmetic is what it is
    without ``keep`` (every op after attention works row by row); its dropout draws differ (they follow the
    row's place). The encoder's last layer keeps the rows the heads read (``BertModel.encode_packed``).

    Pre-LN chains its LayerNorms into the residual adds: ``normed`` is x already normalized by this layer's
    first LayerNorm (the previous layer's last op made it; None: normalized here), and ``next_norm`` (required)
    is the LayerNorm that follows the layer (the next layer's first, or the encoder's final one), applied by
    the op that adds the FFN's output to the residual stream (bias, dropout, add and LayerNorm in one pass,
    both the sum and its normalization out)."""
    nh = w.num_heads
    hd = w.qkv_weight.shape[0] // (3 * nh)  # spelled out: a batch may have no tokens at all

    def linear(h, weight, bias, index):  # -> (output, h for a residual); index: the linear's place in the layer
        if w.fp8 is None:  # F.linear, its weight gradient written in the parameter's dtype (ops/linear.py)
            return ops.linear_residual(h, weight, bias)
        history, first = w.fp8  # its FP8 history rows
        return fp8_linear(h, weight, bias, history, first + 3 * index, residual=True)

    # Post-LN: the layer's input feeds the QKV projection and the residual add, the attention block's output
    # the FFN and the next residual add; those ops hand their input back as a second output for the residual,
    # so its gradient joins theirs inside a GEMM instead of an addition kernel (16-bit and FP8 alike).
    def kept(t):
        return t if keep is None else t.index_select(0, keep)

    def attention(h):  # -> (output of the kept rows, probs, h for the residual)
        tokens = h.shape[0]
        p = dropout.attention
        if ops.qkv_attention is not None and not output_attentions and (rows is None or not rows.num_extra):
            # one op: the attention backward writes the bias gradient (with FP8, the gradient's FP8 operands)
            ctx, h = ops.qkv_attention(h, w.qkv_weight, w.qkv_bias, nh, cu_seqlens, max_seqlen, dropout_p=p,
                                       softmax_scale=softmax_scale, fp8=w.fp8)
            return linear(kept(ctx.reshape(tokens, nh * hd)), w.attention_out_weight, None, 1)[0], None, h
        qkv, h = linear(h, w.qkv_weight, w.qkv_bias, 0)
        qkv = qkv.view(tokens, 3, nh, hd)  # (T, 3, nh, hd)
        ctx = with_padding_rows(
            lambda t: ops.attention_qkvpacked(t, cu_seqlens, max_seqlen, dropout_p=p, softmax_scale=softmax_scale),
            qkv, rows, softmax_scale, p)  # (T, nh, hd)
        probs = (attention_maps_or_packed(qkv, rows, cu_seqlens, max_seqlen, softmax_scale)
                 if output_attentions else None)
        out = linear(kept(ctx.reshape(tokens, nh * hd)), w.attention_out_weight, None, 1)[0]  # bias: in add + norm
        return out, probs, h

    def ffn(h):  # -> (output, h for the residual); the output bias is left to the caller
        if not isinstance(activation, str):
            z, h = linear(h, w.intermediate_weight, w.intermediate_bias, 2)
            return linear(activation(z), w.output_weight, None, 3)[0], h
        if w.fp8 is not None:  # GELU and its derivative inside the FP8 casts
            history, first = w.fp8
            return fp8_ffn(h, w.intermediate_weight, w.intermediate_bias, w.output_weight, history, first + 6,
                           activation, residual=True)
        # up-projection, GELU, down-projection in one op, so that GELU's derivative can join a GEMM
        return ops.ffn(h, w.intermediate_weight, w.intermediate_bias, w.output_weight, approximate=activation,
                       residual=True)

    def add_norm(y, residual, norm, y_bias, p, also_sum=False):  # also_sum: (normalized, residual sum)
        return ops.dropout_add_layer_norm(y, residual, norm.weight, norm.bias, norm.eps, x_bias=y_bias,
                                          dropout_p=p, prenorm=also_sum)

    if not prenorm:
        y, probs, x = attention(x)
        x = add_norm(y, kept(x), w.attention_norm, w.attention_out_bias, dropout.attention_output)
        y, x = ffn(x)
        x = add_norm(y, x, w.output_norm, w.output_bias, dropout.output)
        return x, probs, None
    if next_norm is None:
        raise ValueError("encoder_fn.layer: a Pre-LN layer needs next_norm, the LayerNorm that follows it")
    if normed is None:
        norm = w.attention_norm
        normed = ops.dropout_add_layer_norm(x, None, norm.weight, norm.bias, norm.eps)
    y, probs, _ = attention(normed)
    h, x = add_norm(y, kept(x), w.output_norm, w.attention_out_bias, dropout.attention_output, also_sum=True)
    # Pre-LN: the FFN's output joins the residual stream un-normalized; the sum is normalized for what follows
    normed, x = add_norm(ffn(h)[0], x, next_norm, w.output_bias, dropout.output, also_sum=True)
    return x, probs, normed
