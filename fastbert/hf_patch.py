"""Drop-in speed-up for an existing HF ``transformers`` BERT: ``patch(model)`` / ``unpatch(model)``.

``patch`` replaces the ``forward`` of the model's ``BertModel`` (on the instance, not the class)
with an unpadded one that runs on fastbert's fused ops, reading HF's own parameters: no copy, the
same ``state_dict`` keys, the optimizer and checkpoints untouched. The task heads (MLM / NSP /
classification / QA ...) stay HF's and call the patched ``BertModel`` as before.

Inside: unpad once at entry (``fastbert.padding``), then HF's parameters go through the encoder
functions that fastbert's own ``BertModel`` runs (``fastbert.encoder_fn``: embeddings + LayerNorm,
then per layer one QKV GEMM (HF's query / key / value weights concatenated at call time), varlen
attention, output projection, fused bias + dropout + residual + LayerNorm, fused bias + GELU FFN);
pad back on exit. This module only adapts HF's modules, arguments and outputs to those functions.

Any 0/1 mask gives HF's results: positions where the mask is 0 are computed as HF computes them
when something reads them (``fastbert.padding_rows``): position 0 for the pooler, and, through a
wrapper around the head's ``forward``, the positions holding token labels (masked LM, pretraining,
token classification) and every position for a question-answering loss. So HF's heads compute
HF's losses and gradients on labels anywhere.

Differences from HF that no loss sees: hidden states at masked positions nothing reads are 0 (HF
computes values there), attention maps are the maps before dropout (0 on those positions' rows),
and dropout draws different random masks. Forward hooks on HF's inner modules (layers, attention)
no longer fire; hooks on ``BertModel`` and the heads do.
"""
from __future__ import annotations

import functools
import inspect
import math
import threading
import types
from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from fastbert import encoder_fn
from fastbert.config import gelu_approximate
from fastbert.encoder_fn import EmbeddingWeights, LayerDropout, LayerNormWeights, LayerWeights
from fastbert.ops import get_ops, resolve_kernels
from fastbert.padding import pad, unpad
from fastbert.padding_rows import Rows, label_positions, pooled_position, union, unpad_rows

_STATE = "_fastbert_patch"  # attribute on the patched BertModel: kernels and what unpatch restores
_HEAD_STATE = "_fastbert_patch_head"  # attribute on a patched BertFor* head: what unpatch restores
_KERNELS = (None, "torch", "triton")


class UnsupportedModelError(ValueError):
    """A model or input fastbert.patch cannot run exactly; the message says what and what to do."""


# ---------------------------------------------------------------------------------- public API
def patch(model, kernels: Optional[str] = None):
    """Make an HF ``BertModel`` / ``BertFor*`` instance run on fastbert's kernels, in place.

    ``kernels``: ``"triton"`` (fused, CUDA), ``"torch"`` (reference ops, any device) or ``None``
    (default): ``"triton"`` for CUDA inputs, ``"torch"`` otherwise, decided at each call.
    Returns ``model``. Patching a patched model only changes ``kernels``. Patch the model you call
    (the head): its forward tells the encoder which masked positions its loss reads.
    """
    if kernels not in _KERNELS:
        raise ValueError(f"kernels={kernels!r}: use 'triton', 'torch' or None (triton on CUDA, torch otherwise)")
    bert = _find_bert(model)
    _check_config(bert, kernels)
    if kernels is not None:
        get_ops(kernels)  # fail now, not at the first batch, if triton is missing
    state = getattr(bert, _STATE, None)
    if state is None:
        state = _replace_forward(bert, _patched_forward)
        setattr(bert, _STATE, state)
    if model is not bert and getattr(model, _HEAD_STATE, None) is None:
        setattr(model, _HEAD_STATE, _replace_forward(model, _head_forward(type(model))))
    state["kernels"] = kernels
    return model


def unpatch(model):
    """Restore HF's forward exactly as it was before ``patch``; returns ``model``."""
    bert = _find_bert(model)
    for module, name in ((model, _HEAD_STATE), (bert, _STATE)):
        saved = getattr(module, name, None)
        if saved is not None:
            if saved["had_own_forward"]:
                module.forward = saved["forward"]
            else:
                del module.forward
            delattr(module, name)
    return model


def is_patched(model) -> bool:
    return getattr(_find_bert(model), _STATE, None) is not None


def _replace_forward(module, function):
    """Bind ``function`` as ``module``'s forward (a bound method on the instance, so ``copy.deepcopy``
    rebinds it to the copy); returns what ``unpatch`` restores."""
    saved = {"had_own_forward": "forward" in module.__dict__, "forward": module.__dict__.get("forward")}
    module.forward = types.MethodType(function, module)
    return saved


# ---------------------------------------------------------------------------------- heads
# The positions a head's loss reads, handed from the head's forward to the patched BertModel's
# forward during one call: {id(bert): (batch, seq) bool}, per thread.
_PENDING = threading.local()


def _head_forward(cls):
    """The forward of a patched HF head of class ``cls``: HF's own, after handing the positions its
    loss reads to the patched encoder. It carries ``cls.forward``'s signature (HF Trainer reads it to
    pick the input columns)."""

    @functools.wraps(cls.forward)
    def forward(self, *args, **kwargs):
        saved = getattr(self, _HEAD_STATE)
        original = saved["forward"] if saved["had_own_forward"] else types.MethodType(cls.forward, self)
        try:
            given = inspect.signature(original).bind_partial(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)  # HF's own error
        reads = _loss_positions_reader(self)
        need = reads(given) if reads is not None else None
        if need is None:
            return original(*args, **kwargs)
        pending = getattr(_PENDING, "needs", {})
        _PENDING.needs = {**pending, id(_find_bert(self)): need}
        try:
            return original(*args, **kwargs)
        finally:
            _PENDING.needs = pending
    return forward


def _loss_positions_reader(model):
    """A function of the bound forward arguments giving the ``(batch, seq)`` positions the head's loss
    reads (None: only the pooler's position 0, which the patched BertModel adds itself)."""
    mb = _bert_classes()

    def shape(given):
        ref = given.get("input_ids")
        ref = ref if ref is not None else given.get("inputs_embeds")
        return None if ref is None else (ref.shape[:2], ref.device)

    if isinstance(model, mb.BertForQuestionAnswering):  # HF's span softmax runs over every position
        def reads(given):
            if given.get("start_positions") is None or given.get("end_positions") is None or shape(given) is None:
                return None
            size, device = shape(given)
            return torch.ones(size, dtype=torch.bool, device=device)
        return reads
    shift = 1 if isinstance(model, getattr(mb, "BertLMHeadModel", ())) else 0  # causal LM: labels shifted left
    if shift or isinstance(model, (mb.BertForMaskedLM, mb.BertForPreTraining, mb.BertForTokenClassification)):
        def reads(given):
            labels, s = given.get("labels"), shape(given)
            if labels is None or s is None or labels.numel() != s[0].numel():
                return None
            need = label_positions(labels.reshape(s[0]).to(s[1]))
            if shift:
                need = F.pad(need[:, shift:], (0, shift), value=False)
            return need
        return reads
    return None


# ---------------------------------------------------------------------------------- checks
def _bert_classes():
    try:
        from transformers.models.bert import modeling_bert
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("fastbert.patch needs HF transformers: pip install transformers") from e
    return modeling_bert


def _find_bert(model):
    mb = _bert_classes()
    if isinstance(model, mb.BertModel):
        return model
    bert = getattr(model, "bert", None)
    if isinstance(model, mb.BertPreTrainedModel) and isinstance(bert, mb.BertModel):
        return bert
    raise UnsupportedModelError(
        f"fastbert.patch takes a transformers BertModel or BertFor* model, got {type(model).__name__}; "
        "other architectures (RoBERTa, DistilBERT...) are not supported")


def _check_config(bert, kernels):
    cfg = bert.config
    name = type(bert).__name__
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise UnsupportedModelError(
            f"{name} is configured as a decoder (is_decoder / add_cross_attention): fastbert.patch runs "
            "bidirectional encoders only; use the model unpatched")
    pos = getattr(cfg, "position_embedding_type", "absolute")
    if pos != "absolute":
        raise UnsupportedModelError(
            f"position_embedding_type={pos!r}: fastbert.patch supports absolute position embeddings only; "
            "relative position embeddings need the unpatched model")
    for i, layer in enumerate(bert.encoder.layer):
        sa = layer.attention.self
        if getattr(layer.attention, "is_cross_attention", False) or hasattr(layer, "crossattention"):
            raise UnsupportedModelError(f"layer {i} has cross-attention: fastbert.patch runs encoders only")
        if getattr(sa, "position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"layer {i} uses {sa.position_embedding_type!r} position embeddings: only 'absolute' is supported")
        if kernels == "triton" and sa.attention_head_size > 128:
            raise UnsupportedModelError(
                f"head_dim {sa.attention_head_size} > 128 is beyond the Triton attention kernel; "
                "use patch(model, kernels='torch')")


def _check_call(attention_mask, kwargs):
    for key in ("head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_values", "cache"):
        if kwargs.get(key) is not None:
            raise UnsupportedModelError(
                f"{key} is not supported by a fastbert-patched BERT; call fastbert.unpatch(model) to use it")
    if kwargs.get("use_cache"):
        raise UnsupportedModelError("use_cache=True needs a decoder; a fastbert-patched BERT is an encoder")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UnsupportedModelError(
            f"attention_mask must be a (batch, seq) 0/1 mask, got shape {tuple(attention_mask.shape)}; "
            "custom 3-D/4-D masks need the unpatched model")


# ---------------------------------------------------------------------------------- forward
def _p(dropout: torch.nn.Module) -> float:
    return dropout.p if dropout.training else 0.0


def _norm(ln: torch.nn.LayerNorm) -> LayerNormWeights:
    return LayerNormWeights(ln.weight, ln.bias, ln.eps)


def _embed(emb, ops, rows: Rows, input_ids, token_type_ids, position_ids, inputs_embeds):
    """``(rows, hidden)`` embeddings of the real tokens, then of the padding rows, from HF's
    ``(batch, seq)`` arguments."""
    info = rows.placed
    if inputs_embeds is not None:  # user-supplied vectors: HF's module on the padded batch, then unpad
        out = emb(input_ids=None, token_type_ids=token_type_ids, position_ids=position_ids,
                  inputs_embeds=inputs_embeds)
        return unpad(out, info)
    batch, seq = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    elif position_ids.shape != input_ids.shape:
        position_ids = position_ids.expand(batch, seq)
    if token_type_ids is None:
        token_type_ids = torch.zeros_like(input_ids)
    flat = lambda t: t.reshape(-1).index_select(0, info.indices)  # noqa: E731  (B, S) -> (tokens,)
    w = EmbeddingWeights(emb.word_embeddings.weight, emb.position_embeddings.weight, emb.token_type_embeddings.weight,
                         _norm(emb.LayerNorm), emb.word_embeddings.padding_idx)
    return encoder_fn.embed(ops, w, flat(input_ids), flat(position_ids), flat(token_type_ids),
                            dropout_p=_p(emb.dropout))


def _cat_or_none(*tensors):
    return None if any(t is None for t in tensors) else torch.cat(tensors)


def _layer_weights(layer) -> LayerWeights:
    """An HF ``BertLayer``'s parameters in fastbert's roles. The QKV weight is concatenated per call
    (one GEMM for Q, K and V) so that HF's parameters stay the leaves the optimizer sees."""
    sa, so, inter, out = layer.attention.self, layer.attention.output, layer.intermediate, layer.output
    return LayerWeights(sa.num_attention_heads, torch.cat((sa.query.weight, sa.key.weight, sa.value.weight)),
                        _cat_or_none(sa.query.bias, sa.key.bias, sa.value.bias), so.dense.weight, so.dense.bias,
                        _norm(so.LayerNorm), inter.dense.weight, inter.dense.bias, out.dense.weight, out.dense.bias,
                        _norm(out.LayerNorm))


def _layer(layer, ops, x, rows: Rows, hidden_act, output_attentions):
    """One HF ``BertLayer`` (Post-LN) through ``fastbert.encoder_fn.layer`` on ``(rows, hidden)`` (real
    tokens, then padding rows); returns the new x and the ``(batch, nh, seq, seq)`` maps or None."""
    sa, inter = layer.attention.self, layer.intermediate
    approx = gelu_approximate(hidden_act)
    fused = approx is not None and inter.dense.bias is not None  # else HF's own function after a plain GEMM
    scale = getattr(sa, "scaling", None) or 1.0 / math.sqrt(sa.attention_head_size)
    dropout = LayerDropout(_p(sa.dropout), _p(layer.attention.output.dropout), _p(layer.output.dropout))
    return encoder_fn.layer(ops, x, _layer_weights(layer), rows.real.cu_seqlens, rows.real.max_seqlen, rows,
                            activation=approx if fused else inter.intermediate_act_fn, softmax_scale=scale,
                            dropout=dropout, output_attentions=output_attentions)[:2]


def _run_layer(layer, ops, x, rows: Rows, hidden_act, output_attentions):
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        # Recompute in backward; checkpoint restores the RNG state, so the dropout seeds drawn
        # inside the layer are drawn again identically.
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        run = lambda t: _layer(layer, ops, t, rows, hidden_act, output_attentions)  # noqa: E731
        if fn is None:
            return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
        return fn(run, x)
    return _layer(layer, ops, x, rows, hidden_act, output_attentions)


def _patched_forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                     inputs_embeds=None, output_attentions=None, output_hidden_states=None, return_dict=None,
                     **kwargs):
    """The patched ``BertModel.forward``: HF's arguments and outputs, an unpadded encoder inside."""
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

    _check_call(attention_mask, kwargs)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    cfg = self.config
    output_attentions = bool(cfg.output_attentions if output_attentions is None else output_attentions)
    if output_hidden_states is None:
        output_hidden_states = cfg.output_hidden_states
    # True, or (transformers >= 5.2x) an index / list of indices of the hidden states to keep.
    want_hidden = output_hidden_states is not None and output_hidden_states is not False
    if return_dict is None:
        return_dict = getattr(cfg, "return_dict", True)
    ref = input_ids if input_ids is not None else inputs_embeds
    batch, seq = ref.shape[:2]
    if attention_mask is None:
        attention_mask = torch.ones((batch, seq), dtype=torch.long, device=ref.device)

    kernels = resolve_kernels(getattr(self, _STATE)["kernels"], ref.device)
    ops = get_ops(kernels)
    # Masked positions something reads: the head's loss positions (from its wrapped forward) and
    # position 0 for the pooler, computed as HF computes them.
    need = getattr(_PENDING, "needs", {}).get(id(self))
    if need is not None and need.shape != (batch, seq):
        need = None
    if self.pooler is not None:
        need = union(need, pooled_position(ref))
    rows = unpad_rows(attention_mask, need)
    x = _embed(self.embeddings, ops, rows, input_ids, token_type_ids, position_ids, inputs_embeds)  # (T, H)

    hidden, maps = [x] if want_hidden else None, [] if output_attentions else None
    for layer in self.encoder.layer:
        x, probs = _run_layer(layer, ops, x, rows, cfg.hidden_act, output_attentions)
        if hidden is not None:
            hidden.append(x)
        if maps is not None:
            maps.append(probs)

    sequence_output = pad(x, rows.placed)  # (B, S, H), zeros at the masked positions nothing reads
    pooled = self.pooler(sequence_output) if self.pooler is not None else None
    all_hidden = None
    if hidden is not None:
        all_hidden = [pad(h, rows.placed) for h in hidden[:-1]] + [sequence_output]
        if not isinstance(output_hidden_states, bool):
            chosen = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
            chosen = {i % len(all_hidden) for i in chosen}
            all_hidden = [h if i in chosen else None for i, h in enumerate(all_hidden)]
        all_hidden = tuple(all_hidden)
    out = BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=sequence_output, pooler_output=pooled, hidden_states=all_hidden,
        attentions=tuple(maps) if maps is not None else None)
    return out if return_dict else out.to_tuple()
