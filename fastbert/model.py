"""BERT encoder: embeddings, fused-QKV attention, FFN, Post-LN / Pre-LN layers, unpadded encoder, pooler.

The modules hold the parameters (HF's names, one fused QKV); the computation of the embeddings and
of a layer is ``fastbert.encoder_fn``'s, the same functions that ``fastbert.patch`` runs HF's weights through.

The public API takes ``(batch, seq)`` ids and an ``attention_mask`` like HF's (any 0/1 mask). The
encoder unpads once on entry and every layer works on ``(total_tokens, hidden)`` with int32
``cu_seqlens``, plus the masked positions a result reads as HF computes them (``fastbert.padding_rows``);
outputs are padded back only on exit. Every op goes through ``fastbert.ops.get_ops(kernels)``,
so ``kernels="torch"`` (reference) and ``kernels="triton"`` (fused) share one model.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

from fastbert import encoder_fn
from fastbert.config import BertConfig, gelu_approximate
from fastbert.encoder_fn import EmbeddingWeights, LayerDropout, LayerNormWeights, LayerWeights
from fastbert.ops import get_ops
from fastbert.ops._common import seed_draws
from fastbert.ops.fp8 import AmaxHistory
from fastbert.padding import pad, unpad_mask
from fastbert.padding_rows import Rows, padding_need_counts, pooled_position, position_rows, select_rows


class ModelOutput(OrderedDict):
    """HF-style output: attribute and key access; indexing and iteration skip fields that are None."""

    def __init__(self, **fields):
        super().__init__((k, v) for k, v in fields.items() if v is not None)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            if name.startswith("__"):
                raise AttributeError(name) from None
            return None

    def __getitem__(self, key):
        if isinstance(key, (int, slice)):
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def to_tuple(self):
        return tuple(self.values())


class InputError(ValueError):
    """Bad model input (ids out of range, sequence too long...); the message says how to fix it."""


FP8_ROWS_PER_LAYER = 12  # amax history rows: input, weight, output gradient of each of a layer's 4 linears


# ---------------------------------------------------------------------------------- modules
class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, ops, input_ids, position_ids, token_type_ids):
        """All inputs ``(tokens,)``; returns ``(tokens, hidden)``."""
        ln = self.LayerNorm
        w = EmbeddingWeights(self.word_embeddings.weight, self.position_embeddings.weight,
                             self.token_type_embeddings.weight,
                             LayerNormWeights(ln.weight, ln.bias, self.config.layer_norm_eps),
                             self.word_embeddings.padding_idx)
        return encoder_fn.embed(ops, w, input_ids, position_ids, token_type_ids,
                                dropout_p=self.config.hidden_dropout_prob if self.training else 0.0)


class BertSelfAttention(nn.Module):
    """One fused QKV projection; ``qkv.weight`` is ``cat(query, key, value)`` of HF's layout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertLayer(nn.Module):
    """Post-LN (original BERT) or Pre-LN (academic-budget recipe), chosen by ``config.prenorm``; the
    computation is ``fastbert.encoder_fn.layer``.

    Parameter names follow HF's. In Pre-LN, ``attention.output.LayerNorm`` normalizes the block
    input before attention and ``output.LayerNorm`` the residual stream before the FFN.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.attention = BertAttention(config)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def weights(self, fp8: tuple | None = None) -> LayerWeights:
        cfg = self.config
        qkv, attn_out, ln_attn = self.attention.self.qkv, self.attention.output.dense, self.attention.output.LayerNorm
        up, down, ln_out = self.intermediate.dense, self.output.dense, self.output.LayerNorm
        return LayerWeights(cfg.num_attention_heads, qkv.weight, qkv.bias, attn_out.weight, attn_out.bias,
                            LayerNormWeights(ln_attn.weight, ln_attn.bias, cfg.layer_norm_eps),
                            up.weight, up.bias, down.weight, down.bias,
                            LayerNormWeights(ln_out.weight, ln_out.bias, cfg.layer_norm_eps), fp8)

    def forward(self, ops, x, cu_seqlens, max_seqlen, output_attentions=False, rows: Rows | None = None,
                fp8: tuple | None = None, normed=None, next_norm: nn.LayerNorm | None = None, keep=None):
        """``x``: ``(T, hidden)``, the real tokens then ``rows``' padding rows (if any); ``fp8``: see
        ``LayerWeights.fp8``; Pre-LN's ``normed`` and ``next_norm`` (the LayerNorm after this layer) and
        ``keep`` (the output rows): see ``encoder_fn.layer``. Returns (x, attention maps or None, x normalized
        by ``next_norm`` or None)."""
        cfg = self.config
        p_attn, p = (cfg.attention_probs_dropout_prob, cfg.hidden_dropout_prob) if self.training else (0.0, 0.0)
        return encoder_fn.layer(ops, x, self.weights(fp8), cu_seqlens, max_seqlen, rows,
                                activation=gelu_approximate(cfg.hidden_act), softmax_scale=cfg.head_dim ** -0.5,
                                dropout=LayerDropout(p_attn, p, p), prenorm=cfg.prenorm,
                                output_attentions=output_attentions, normed=normed,
                                next_norm=None if next_norm is None else
                                LayerNormWeights(next_norm.weight, next_norm.bias, cfg.layer_norm_eps), keep=keep)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        # Pre-LN needs a final LayerNorm on the residual stream; Post-LN ends normalized already.
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.prenorm else None
        self._fp8_history: AmaxHistory | None = None

    def fp8_history(self, device) -> AmaxHistory | None:
        """With ``config.fp8``, in a training forward: the amax history of this encoder's FP8 casts (made
        on first use, on ``device``), advanced to a new slot; else None (16/32-bit GEMMs)."""
        if not (self.config.fp8 and self.training and torch.is_grad_enabled()):
            return None
        if self._fp8_history is None or self._fp8_history.amax.device != torch.device(device):
            self._fp8_history = AmaxHistory(FP8_ROWS_PER_LAYER * len(self.layer), device)
        self._fp8_history.advance()
        return self._fp8_history

    def forward(self, ops, x, cu_seqlens, max_seqlen, output_hidden_states=False, output_attentions=False,
                rows: Rows | None = None, keep: torch.Tensor | None = None):
        """``x``: ``(tokens, hidden)`` (with ``rows``: the real tokens, then the padding rows). Returns
        (last hidden, all hidden states or None, attentions or None); attention maps are
        ``(batch, nh, seq, seq)`` at the tokens' positions with ``rows``, packed per sequence without.
        ``keep``: the rows of the last hidden state wanted (int64 indices); the last layer computes only
        those (``encoder_fn.layer``), so the last hidden state (and the last of the hidden states) is
        ``(len(keep), hidden)``."""
        hidden_states = [x] if output_hidden_states else None
        attentions = [] if output_attentions else None
        history = self.fp8_history(x.device)
        # Pre-LN: each layer's last residual add also applies the LayerNorm that follows it (the next layer's
        # first, the final one after the last layer) and hands the normalized x on (encoder_fn.layer).
        after = [layer.attention.output.LayerNorm for layer in self.layer[1:]] + [self.final_layer_norm] \
            if self.config.prenorm else [None] * len(self.layer)
        normed = None
        last = len(self.layer) - 1
        for i, (layer, next_norm) in enumerate(zip(self.layer, after)):
            fp8 = (history, FP8_ROWS_PER_LAYER * i) if history is not None else None
            x, probs, normed = layer(ops, x, cu_seqlens, max_seqlen, output_attentions, rows, fp8, normed, next_norm,
                                     keep if i == last else None)
            if output_hidden_states:
                hidden_states.append(x)
            if output_attentions:
                attentions.append(probs)
        if self.final_layer_norm is not None:
            x = normed  # the last layer's sum through the final LayerNorm
            if output_hidden_states:
                hidden_states[-1] = x
        return x, hidden_states, attentions


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_token):
        return torch.tanh(self.dense(first_token))


# ---------------------------------------------------------------------------------- base class
class BertPreTrainedModel(nn.Module):
    """Init, HF checkpoint I/O and helpers shared by BertModel and the task heads."""

    base_model_prefix = "bert"
    # Parameters of the task head (newly initialized when loading a checkpoint that lacks them).
    head_prefixes: tuple[str, ...] = ()

    def __init__(self, config: BertConfig):
        super().__init__()
        config.validate()
        self.config = config

    @property
    def ops(self):
        return get_ops(self.config.kernels)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def init_weights(self):
        self.apply(self._init_weights)
        self.tie_weights()

    def tie_weights(self):
        """Heads with a decoder tie it to the word embeddings (overridden there)."""

    def set_kernels(self, kernels: str):
        """Switch between ``"torch"`` and ``"triton"`` kernels in place."""
        self.config.kernels = kernels
        self.config.validate()
        return self

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for m in self.modules():
                if isinstance(m, nn.Embedding):
                    params.pop(id(m.weight), None)
        return sum(p.numel() for p in params.values())

    @classmethod
    def from_pretrained(cls, directory, config: BertConfig | None = None, **config_overrides):
        from fastbert.hf import load_pretrained
        return load_pretrained(cls, directory, config=config, **config_overrides)

    def save_pretrained(self, directory, safe_serialization: bool = True):
        from fastbert.hf import save_pretrained
        save_pretrained(self, directory)


class BertModel(BertPreTrainedModel):
    """HF-compatible ``BertModel`` with an unpadded encoder."""

    # Check token ids against the vocabulary on every call (one small device sync, shared with the
    # length lookup that unpadding needs anyway).
    validate_inputs = True

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.init_weights()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    # ------------------------------------------------------------------ input checks
    def _check_and_unpad(self, input_ids, attention_mask, token_type_ids, position_ids, need=None) -> Rows:
        """Validate the inputs and describe the rows to compute: the real tokens, and a padding row
        for every masked position in ``need`` (``(batch, seq)`` bool, or None). Shape checks are free;
        the value checks (id ranges), the longest length and the padding-row count come back from the
        device in ONE transfer, and with ``validate_inputs = False`` (set by trainers whose data was
        validated when it was prepared) only the lengths are fetched."""
        cfg = self.config
        if input_ids is None:
            raise InputError("input_ids is required (fastbert does not take inputs_embeds)")
        if input_ids.dim() != 2:
            raise InputError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        seq = input_ids.shape[1]
        if seq > cfg.max_position_embeddings and position_ids is None:
            raise InputError(
                f"sequence length {seq} exceeds max_position_embeddings={cfg.max_position_embeddings}; "
                f"truncate inputs to {cfg.max_position_embeddings} tokens (tokenizer max_length)")
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                        ("position_ids", position_ids)):
            if t is not None and t.shape != input_ids.shape:
                raise InputError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        info = unpad_mask(attention_mask, max_seqlen=0)  # the real value comes with the stats below
        if not input_ids.numel():
            return select_rows(info, attention_mask, None)
        stats = [info.cu_seqlens.diff().max()]
        counts = padding_need_counts(attention_mask, need)
        stats.append(counts.max() if counts is not None else stats[0].new_zeros(()))
        if self.validate_inputs:
            types = token_type_ids if token_type_ids is not None else input_ids.new_zeros(1)
            stats += [input_ids.min(), input_ids.max(), types.min(), types.max()]
        stats = torch.stack([t.to(torch.int64) for t in stats]).tolist()  # the one device -> host sync
        info = info._replace(max_seqlen=int(stats[0]))
        if self.validate_inputs:
            lo, hi, tlo, thi = stats[2:]
            if lo < 0 or hi >= cfg.vocab_size:
                raise InputError(
                    f"token id {hi if hi >= cfg.vocab_size else lo} is outside the vocabulary [0, {cfg.vocab_size}); "
                    "the tokenizer's vocab does not match this model (use the model's own vocab.txt)")
            if tlo < 0 or thi >= cfg.type_vocab_size:
                raise InputError(f"token_type_ids must lie in [0, type_vocab_size={cfg.type_vocab_size})")
        return select_rows(info, attention_mask, need, max_extra=int(stats[1]))

    # ------------------------------------------------------------------ forward
    def encode_unpadded(self, input_ids, cu_seqlens, max_seqlen, token_type_ids=None, position_ids=None,
                        output_hidden_states=False, output_attentions=False, rows: Rows | None = None,
                        keep: torch.Tensor | None = None):
        """Run the encoder on already-unpadded ``(tokens,)`` ids; returns ``(tokens, hidden)`` and extras.

        ``position_ids`` default to each token's index within its sequence. ``rows`` (from ``run``):
        the ids are the real tokens followed by padding rows, which attend to the real tokens only.
        ``keep``: only these rows of the output are computed (``BertEncoder.forward``).
        """
        ops = self.ops
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if position_ids is None:
            starts = torch.repeat_interleave(cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long(),
                                             output_size=input_ids.shape[0])
            position_ids = torch.arange(input_ids.shape[0], device=input_ids.device) - starts
        # every dropout site's seed from one draw (the embeddings' and three a layer; ops/_common.seed_draws)
        with seed_draws(input_ids.device, 3 * self.config.num_hidden_layers + 1):
            x = self.embeddings(ops, input_ids, position_ids, token_type_ids)
            return self.encoder(ops, x, cu_seqlens, max_seqlen, output_hidden_states, output_attentions, rows, keep)

    def encode_packed(self, packed: dict, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder on a static-shape batch (``data/static_batch.py``): ``input_ids``,
        ``token_type_ids``, ``position_ids`` (any shape, flattened), ``cu_seqlens`` and ``max_seqlen``
        (an int). Returns ``(tokens, hidden)``, or with ``keep`` (int64 token indices) those rows alone
        ``(len(keep), hidden)``: the heads pass the rows they read, so the last layer computes nothing else
        (its attention reads every token). Nothing is read back from the device."""
        flat = lambda name: packed[name].reshape(-1)  # noqa: E731
        x, _, _ = self.encode_unpadded(flat("input_ids"), packed["cu_seqlens"], int(packed["max_seqlen"]),
                                       flat("token_type_ids"), flat("position_ids"), keep=keep)
        return x

    def run(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
            output_attentions=False, output_hidden_states=False, need=None, first_only=False):
        """Check, unpad, encode. ``need``: ``(batch, seq)`` bool of the positions a result reads (HF
        computes masked positions too; those in ``need`` get padding rows). Returns ``(rows, hidden)``
        (the real tokens, then the padding rows), the Rows, hidden states and attention maps (or None).
        ``first_only`` (``need`` holding every position 0): the last layer computes each batch row's position 0
        alone (``BertEncoder.forward``'s ``keep``), so the first result is ``(batch, hidden)`` in batch order."""
        rows = self._check_and_unpad(input_ids, attention_mask, token_type_ids, position_ids, need)
        index = rows.placed.indices
        flat = lambda t: None if t is None else t.reshape(-1).index_select(0, index)  # noqa: E731
        if position_ids is None:  # HF's: the index in the padded row, whatever the mask
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x, hidden, attn = self.encode_unpadded(
            flat(input_ids), rows.real.cu_seqlens, rows.real.max_seqlen, flat(token_type_ids), flat(position_ids),
            output_hidden_states, output_attentions, rows, position_rows(rows, 0) if first_only else None)
        return x, rows, hidden, (tuple(attn) if attn is not None else None)

    def pooled(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
               output_attentions=False, output_hidden_states=False, **unused):
        """What the pooled heads (sequence classification, multiple choice, next sentence) read: ``(pooler_output,
        hidden_states, attentions)``, HF's values. Unless hidden states are asked for, the last layer computes each
        row's position 0 alone (HF pools it, masked or not): everything after its attention runs on one row a
        sequence (``run(..., first_only=True)``)."""
        if output_hidden_states:
            out = self(input_ids, attention_mask, token_type_ids, position_ids, output_attentions, True, **unused)
            return out.pooler_output, out.hidden_states, out.attentions
        _reject_unsupported(unused)
        x, _, _, attn = self.run(input_ids, attention_mask, token_type_ids, position_ids, output_attentions, False,
                                 pooled_position(input_ids), first_only=True)
        return self.pooler(x), None, attn

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                output_attentions=False, output_hidden_states=False, return_dict=True, **unused):
        _reject_unsupported(unused)
        need = pooled_position(input_ids) if self.pooler is not None else None  # HF pools position 0, masked or not
        x, rows, hidden, attn = self.run(input_ids, attention_mask, token_type_ids, position_ids,
                                         output_attentions, output_hidden_states, need)
        seq = pad(x, rows.placed)  # (B, S, H)
        out = ModelOutput(last_hidden_state=seq,
                          pooler_output=self.pooler(seq[:, 0]) if self.pooler is not None else None,
                          hidden_states=padded_hidden_states(hidden, rows), attentions=attn)
        return out if return_dict else out.to_tuple()


def padded_hidden_states(hidden, rows: Rows):
    return tuple(pad(h, rows.placed) for h in hidden) if hidden is not None else None


def _reject_unsupported(kwargs: dict):
    ignored_none = {k for k, v in kwargs.items() if v is None}
    bad = sorted(set(kwargs) - ignored_none - {"use_cache"})
    if bad:
        raise InputError(f"unsupported argument(s) {bad}: fastbert's BERT takes input_ids, attention_mask, "
                         "token_type_ids, position_ids, labels and the output_* flags")


def mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence-BERT mean pooling over real tokens: ``(B, S, H) -> (B, H)``."""
    m = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    return (last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1e-9)

