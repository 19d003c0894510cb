"""Task heads with HF's names, call signatures, output fields and losses.

Every head gives HF's results for any 0/1 ``attention_mask``: labels on masked positions count as
in HF (those positions are computed as HF computes them, ``fastbert.padding_rows``), poolers read
position 0. Pretraining / MLM return HF's dense ``logits`` / ``prediction_logits``; with
``config.sparse_prediction`` and labels they return only the sparse MLM loss (only labelled
positions are predicted, the (tokens x vocab) logits never exist), the speed path of ``fastbert pretrain``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastbert.config import BertConfig, gelu_approximate
from fastbert.model import (BertModel, BertPreTrainedModel, InputError, ModelOutput, _reject_unsupported,
                            padded_hidden_states)
from fastbert.ops.mlm_loss import mlm_transform_ref
from fastbert.padding import pad
from fastbert.padding_rows import at_position, label_positions, pooled_position, union


def token_label_positions(labels, input_ids):
    """Positions holding a token label (``labels`` shaped like ``input_ids``), or None without labels."""
    if labels is None or input_ids is None:
        return None
    if labels.numel() != input_ids.numel():
        raise InputError(f"labels has shape {tuple(labels.shape)} but input_ids has {tuple(input_ids.shape)}: "
                         "token labels need one label (or -100) per position")
    return label_positions(labels.reshape(input_ids.shape))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertLMPredictionHead(nn.Module):
    """Transform + decoder tied to the word embeddings: ``decoder.weight`` IS the embedding Parameter
    (registered under both names, as in HF, so ZeRO-3 and state dicts see the tie)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.transform = BertPredictionHeadTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.decoder = nn.Module()  # .weight is set by the model's tie_weights()

    def logits(self, h):
        t = self.transform
        h = mlm_transform_ref(h, t.dense.weight, t.dense.bias, t.LayerNorm.weight, t.LayerNorm.bias,
                              self.config.layer_norm_eps, gelu_approximate(self.config.hidden_act))
        return F.linear(h, self.decoder.weight, self.bias)

    def loss(self, ops, h, labels, positions=None):
        t = self.transform
        return ops.mlm_loss(h, labels, t.dense.weight, t.dense.bias, t.LayerNorm.weight, t.LayerNorm.bias,
                            self.config.layer_norm_eps, self.decoder.weight, self.bias,
                            gelu_approximate(self.config.hidden_act), positions=positions)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig, nsp: bool = True):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        if nsp:
            self.seq_relationship = nn.Linear(config.hidden_size, 2)


class _MLMModel(BertPreTrainedModel):
    """Shared MLM plumbing: tie the decoder, sparse loss on unpadded tokens, dense logits on request."""

    head_prefixes = ("cls.",)
    has_nsp = False

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=self.has_nsp)
        self.cls = BertPreTrainingHeads(config, nsp=self.has_nsp)
        self.init_weights()

    def tie_weights(self):
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def get_output_embeddings(self):
        return self.cls.predictions

    def _forward_packed(self, packed: dict, return_dict: bool = True):
        """The static-shape step of ``fastbert pretrain`` (``data/static_batch.py``): ``packed`` holds
        ``input_ids``, ``token_type_ids``, ``position_ids`` (rows, seq_len), ``cu_seqlens``,
        ``max_seqlen``, the masking collator's ``mlm_positions`` / ``mlm_targets`` slots and, with an
        NSP head, ``cls_positions`` / ``next_sentence_label`` slots (-100 where empty). Every shape is
        fixed by the batch geometry and nothing is read back from the device. The last layer computes only
        the rows the heads read: the MLM slots' tokens, then the NSP slots' first tokens."""
        positions, labels = packed["mlm_positions"], packed.get("next_sentence_label")
        nsp = self.has_nsp and labels is not None
        slots = positions.shape[0]
        x = self.bert.encode_packed(packed, torch.cat([positions, packed["cls_positions"]]) if nsp else positions)
        mlm_loss, correct, count = self.cls.predictions.loss(self.ops, x, packed["mlm_targets"],
                                                             positions=torch.arange(slots, device=x.device))
        loss, nsp_logits, nsp_correct, nsp_count = mlm_loss, None, None, None
        if nsp:
            pooled = self.bert.pooler(x[slots:])
            nsp_logits = self.cls.seq_relationship(pooled)                           # (slots, 2)
            valid = labels != -100
            nsp_count = valid.sum()
            per_slot = F.cross_entropy(nsp_logits.float(), labels.clamp(min=0), reduction="none")
            loss = loss + (per_slot * valid).sum() / nsp_count.clamp(min=1)
            nsp_correct = ((nsp_logits.argmax(-1) == labels) & valid).sum()
        out = ModelOutput(loss=loss, seq_relationship_logits=nsp_logits, mlm_loss=mlm_loss, mlm_correct=correct,
                          mlm_count=count, nsp_correct=nsp_correct, nsp_count=nsp_count)
        return out if return_dict else out.to_tuple()

    def _mlm(self, x, rows, labels):
        """(loss, dense padded logits, correct, count) for ``x`` (rows, hidden). Dense logits unless
        ``config.sparse_prediction`` with labels (then the sparse loss, never the full logits)."""
        head = self.cls.predictions
        if labels is None:
            return None, pad(head.logits(x), rows.placed), None, None
        flat_labels = labels.reshape(-1).index_select(0, rows.placed.indices)
        if self.config.sparse_prediction:
            loss, correct, count = head.loss(self.ops, x, flat_labels)
            return loss, None, correct, count
        logits = head.logits(x)  # (rows, vocab): HF's loss over these; unlabelled rows are ignored
        loss = F.cross_entropy(logits.float(), flat_labels, ignore_index=-100)
        keep = flat_labels != -100
        correct = ((logits.argmax(-1) == flat_labels) & keep).sum()
        return loss, pad(logits, rows.placed), correct, keep.sum()


class BertForPreTraining(_MLMModel):
    """MLM (tied decoder) + NSP on the pooled position 0. Either label is optional (HF returns a loss
    only when both are given; fastbert returns the one it has)."""

    has_nsp = True

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                next_sentence_label=None, output_attentions=False, output_hidden_states=False, return_dict=True,
                packed=None, **unused):
        _reject_unsupported(unused)
        if packed is not None:
            return self._forward_packed(packed, return_dict)
        need = union(pooled_position(input_ids), token_label_positions(labels, input_ids))
        x, rows, hidden, attn = self.bert.run(input_ids, attention_mask, token_type_ids, position_ids,
                                              output_attentions, output_hidden_states, need)
        nsp_logits = self.cls.seq_relationship(self.bert.pooler(at_position(x, rows, 0)))  # (B, 2)
        mlm_loss, logits, correct, count = self._mlm(x, rows, labels)
        loss = mlm_loss
        nsp_correct = None
        if next_sentence_label is not None:
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label.view(-1))
            loss = nsp_loss if loss is None else loss + nsp_loss
            nsp_correct = (nsp_logits.argmax(-1) == next_sentence_label.view(-1)).sum()
        out = ModelOutput(loss=loss, prediction_logits=logits, seq_relationship_logits=nsp_logits,
                          hidden_states=padded_hidden_states(hidden, rows), attentions=attn,
                          mlm_loss=mlm_loss, mlm_correct=correct, mlm_count=count, nsp_correct=nsp_correct)
        return out if return_dict else out.to_tuple()


class BertForMaskedLM(_MLMModel):
    has_nsp = False

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_attentions=False, output_hidden_states=False, return_dict=True, packed=None, **unused):
        _reject_unsupported(unused)
        if packed is not None:
            return self._forward_packed(packed, return_dict)
        x, rows, hidden, attn = self.bert.run(input_ids, attention_mask, token_type_ids, position_ids,
                                              output_attentions, output_hidden_states,
                                              token_label_positions(labels, input_ids))
        loss, logits, correct, count = self._mlm(x, rows, labels)
        out = ModelOutput(loss=loss, logits=logits, hidden_states=padded_hidden_states(hidden, rows),
                          attentions=attn, mlm_correct=correct, mlm_count=count)
        return out if return_dict else out.to_tuple()


class BertForNextSentencePrediction(BertPreTrainedModel):
    """NSP alone (HF's ``cls.seq_relationship`` on the pooled position 0); ``labels``: 0 = is next."""

    head_prefixes = ("cls.",)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = nn.Module()
        self.cls.seq_relationship = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_attentions=False, output_hidden_states=False, return_dict=True, **unused):
        pooled, hidden, attn = self.bert.pooled(input_ids, attention_mask, token_type_ids, position_ids,
                                                output_attentions, output_hidden_states, **unused)
        logits = self.cls.seq_relationship(pooled)  # (B, 2)
        loss = F.cross_entropy(logits.float(), labels.view(-1)) if labels is not None else None
        res = ModelOutput(loss=loss, logits=logits, hidden_states=hidden, attentions=attn)
        return res if return_dict else res.to_tuple()


def _classifier_dropout(config: BertConfig) -> nn.Dropout:
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return nn.Dropout(p)


class BertForSequenceClassification(BertPreTrainedModel):
    """Classification (cross-entropy), regression (``num_labels == 1``, MSE) or multi-label (BCE)."""

    head_prefixes = ("classifier.",)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_attentions=False, output_hidden_states=False, return_dict=True, packed=None, **unused):
        if packed is not None:
            return self._forward_packed(packed, return_dict)
        pooled, hidden, attn = self.bert.pooled(input_ids, attention_mask, token_type_ids, position_ids,
                                                output_attentions, output_hidden_states, **unused)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = sequence_classification_loss(self.config, logits, labels)
        res = ModelOutput(loss=loss, logits=logits, hidden_states=hidden, attentions=attn)
        return res if return_dict else res.to_tuple()

    def _forward_packed(self, packed: dict, return_dict: bool = True):
        """The static-shape step of ``fastbert finetune`` (``data/static_batch.pack_examples``):
        examples back to back, each pooled at its first token (``cls_positions``); the loss is HF's
        over the batch's ``labels``. The last layer computes the pooled rows alone."""
        x = self.bert.encode_packed(packed, packed["cls_positions"])
        logits = self.classifier(self.dropout(self.bert.pooler(x)))
        labels = packed.get("labels")
        loss = sequence_classification_loss(self.config, logits, labels) if labels is not None else None
        res = ModelOutput(loss=loss, logits=logits)
        return res if return_dict else res.to_tuple()


def sequence_classification_loss(config: BertConfig, logits, labels):
    """HF's rule: regression when num_labels == 1, single-label for integer labels, else multi-label."""
    problem = config.problem_type
    if problem is None:
        if config.num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        return F.mse_loss(logits.squeeze(-1).float(), labels.squeeze(-1).float()) if config.num_labels == 1 \
            else F.mse_loss(logits.float(), labels.float())
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels).float(), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


class BertForTokenClassification(BertPreTrainedModel):
    head_prefixes = ("classifier.",)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_attentions=False, output_hidden_states=False, return_dict=True, **unused):
        _reject_unsupported(unused)
        x, rows, hidden, attn = self.bert.run(input_ids, attention_mask, token_type_ids, position_ids,
                                              output_attentions, output_hidden_states,
                                              token_label_positions(labels, input_ids))
        token_logits = self.classifier(self.dropout(x))  # (rows, num_labels): real tokens + labelled padding
        loss = None
        if labels is not None:
            flat = labels.reshape(-1).index_select(0, rows.placed.indices)
            loss = F.cross_entropy(token_logits.float(), flat, ignore_index=-100)
        res = ModelOutput(loss=loss, logits=pad(token_logits, rows.placed),
                          hidden_states=padded_hidden_states(hidden, rows), attentions=attn)
        return res if return_dict else res.to_tuple()


class BertForQuestionAnswering(BertPreTrainedModel):
    """Span start/end logits. With start/end positions the loss is HF's: a softmax over every position,
    padding included (so the padding positions are computed, and their logits returned); without,
    masked positions are not computed and get the dtype's lowest value, so they are never chosen."""

    head_prefixes = ("qa_outputs.",)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                start_positions=None, end_positions=None, output_attentions=False, output_hidden_states=False,
                return_dict=True, **unused):
        _reject_unsupported(unused)
        with_loss = start_positions is not None and end_positions is not None
        need = torch.ones_like(input_ids, dtype=torch.bool) if with_loss and input_ids is not None else None
        x, rows, hidden, attn = self.bert.run(input_ids, attention_mask, token_type_ids, position_ids,
                                              output_attentions, output_hidden_states, need)
        logits = pad(self.qa_outputs(x), rows.placed, value=torch.finfo(x.dtype).min)  # (B, S, 2)
        start_logits, end_logits = logits[..., 0].contiguous(), logits[..., 1].contiguous()
        loss = None
        if with_loss:
            ignored = start_logits.shape[1]
            s = start_positions.view(-1).clamp(0, ignored)
            e = end_positions.view(-1).clamp(0, ignored)
            loss = (F.cross_entropy(start_logits.float(), s, ignore_index=ignored)
                    + F.cross_entropy(end_logits.float(), e, ignore_index=ignored)) / 2
        res = ModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                          hidden_states=padded_hidden_states(hidden, rows), attentions=attn)
        return res if return_dict else res.to_tuple()


class BertForMultipleChoice(BertPreTrainedModel):
    """Inputs ``(batch, choices, seq)``; logits ``(batch, choices)``."""

    head_prefixes = ("classifier.",)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.init_weights()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_attentions=False, output_hidden_states=False, return_dict=True, **unused):
        num_choices = input_ids.shape[1]
        flat = lambda t: None if t is None else t.reshape(-1, t.shape[-1])  # noqa: E731  (B*C, S)
        pooled, hidden, attn = self.bert.pooled(flat(input_ids), flat(attention_mask), flat(token_type_ids),
                                                flat(position_ids), output_attentions, output_hidden_states, **unused)
        logits = self.classifier(self.dropout(pooled)).view(-1, num_choices)  # (B, C)
        loss = F.cross_entropy(logits.float(), labels.view(-1)) if labels is not None else None
        res = ModelOutput(loss=loss, logits=logits, hidden_states=hidden, attentions=attn)
        return res if return_dict else res.to_tuple()


HEADS = {cls.__name__: cls for cls in (BertModel, BertForPreTraining, BertForMaskedLM, BertForNextSentencePrediction,
                                       BertForSequenceClassification, BertForTokenClassification,
                                       BertForQuestionAnswering, BertForMultipleChoice)}
