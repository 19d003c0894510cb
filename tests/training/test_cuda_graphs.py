"""CUDA graphs of the static-shape step (training/cuda_graphs.py): a replay gives the eager step's
loss and gradients, draws new dropout masks each time, accumulates gradients over micro-batches
correctly, and falls back to eager (with a reason) where it cannot work."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastbert import BertConfig, BertForSequenceClassification
from fastbert.data.static_batch import pack_examples
from fastbert.ops import cublaslt
from fastbert.training.cuda_graphs import GraphedModel, grad_views, unsupported_reason

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SEQ = 32


def test_reasons_for_eager():
    assert unsupported_reason(torch.device("cpu"), "fp32", 0) == "CUDA graphs need a CUDA device"
    cuda = torch.device("cuda")
    assert "fp16" in unsupported_reason(cuda, "fp16", 0)
    assert "ZeRO-0" in unsupported_reason(cuda, "bf16", 2)
    assert "kernels='triton'" in unsupported_reason(cuda, "bf16", 0, kernels="torch")
    assert "wall_clock_breakdown" in unsupported_reason(cuda, "bf16", 0, ds_profiling=True)
    assert unsupported_reason(cuda, "bf16", 0) is None and unsupported_reason(cuda, "fp32", 0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulated_gradients_start_on_16_bytes(dtype):
    """own_grads()'s buffer: a zeroed view per parameter, none overlapping, each on 16 bytes even after odd-sized
    tensors (BERT's 30,522-entry decoder bias), so the fused AdamW takes its vector loads (ops/adamw.py)."""
    from fastbert.ops.adamw import _aligned
    params = [torch.empty(n, dtype=dtype) for n in ((30522,), (3, 5), (1024, 7), (1,), (64, 64), (2,))]
    flat, views = grad_views(params)
    assert [v.shape for v in views] == [p.shape for p in params]
    assert all(v.data_ptr() % 16 == 0 for v in views) and _aligned(views)
    assert not flat.any() and flat.numel() < sum(p.numel() for p in params) + 8 * len(params)
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert all((v == i + 1).all() for i, v in enumerate(views))    # no view overlaps another


@pytest.fixture(autouse=True)
def default_stream_after():
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.set_stream(torch.cuda.default_stream())


def _graphed(model, precision):
    graphed = GraphedModel(model, precision)
    graphed.activate()
    return graphed


def _model(dropout: float):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=SEQ, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout, num_labels=3, kernels="triton")
    return BertForSequenceClassification(cfg).cuda().train()


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(8):
        n = int(rng.integers(5, SEQ))
        rows.append({"input_ids": [1] + rng.integers(5, 101, size=n - 2).tolist() + [2],
                     "token_type_ids": [0] * n, "labels": int(rng.integers(0, 3))})
    packed = {k: torch.as_tensor(v).cuda(non_blocking=False) for k, v in pack_examples(rows, SEQ).items()}
    packed["max_seqlen"] = SEQ
    return packed


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_replay_equals_eager_step(precision):
    model = _model(0.0)
    graphed = _graphed(model, precision)
    packed = _batch(0)
    assert torch.cuda.current_stream() == graphed.stream
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        ref = model(packed=packed)
    ref.loss.backward()
    g_ref = _grads(model)
    outs = []
    for _ in range(3):                       # eager (first sight), capture + replay, replay
        model.zero_grad(set_to_none=True)
        with autocast:
            out = graphed(packed) or model(packed=packed)
        out.loss.backward()
        outs.append((out.loss.detach().clone(), _grads(model)))
    assert graphed.replays == 2 and len(graphed.graphs) == 1
    # The same kernels replayed; cuBLAS may pick another algorithm inside a capture (fp32: ~1e-6), and
    # bf16 rounds each GEMM's inputs (the eager reference ran under autocast too, so only the order differs).
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    for loss, g in outs:
        torch.testing.assert_close(loss, ref.loss.detach(), **tol)
        for name in g_ref:
            torch.testing.assert_close(g[name], g_ref[name], **tol, msg=name)


@gpu
@needs_cuda
def test_replays_draw_new_dropout_masks():
    model = _model(0.1)
    graphed = _graphed(model, "fp32")
    packed = _batch(1)
    losses = []
    for _ in range(4):
        out = graphed(packed) or model(packed=packed)
        out.loss.backward()
        losses.append(float(out.loss))
    assert graphed.replays == 3
    assert len(set(losses[1:])) == 3, losses   # every replay another mask


@gpu
@needs_cuda
def test_accumulated_gradients_over_replays():
    """Two micro-batches per step from graphs: .grad is the sum of both (own_grads), not the last."""
    model = _model(0.0)
    graphed = _graphed(model, "fp32")
    a, b = _batch(2), _batch(2)
    b["labels"] = (b["labels"] + 1) % 3                        # same shapes, another loss
    for _ in range(2):                                         # first sight, then capture
        graphed(a) or model(packed=a)
    model.zero_grad(set_to_none=True)
    model(packed=a).loss.backward()
    model(packed=b).loss.backward()
    g_ref = _grads(model)
    for _ in range(2):                                         # two steps, both from replays
        model.zero_grad(set_to_none=True)
        graphed.own_grads()
        graphed(a).loss.backward()
        graphed(b).loss.backward()
        for name in g_ref:
            torch.testing.assert_close(model.get_parameter(name).grad, g_ref[name], rtol=1e-5, atol=1e-6, msg=name)


@gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("accumulate", [True, False])
def test_graphs_captured_after_own_grads_add_gradients_themselves(precision, accumulate, monkeypatch):
    """Gradient accumulation as the engine runs it (own_grads() at each step's first micro-batch, before the
    capture): the graph adds each micro-batch's gradients into .grad itself (the fused ops' weight-gradient
    GEMMs with beta = 1, one multi-tensor addition the rest) and hands autograd none; .grad is the eager sum.
    FASTBERT_GRAPH_ACCUMULATE=0: the graph returns them and autograd adds them (what ran before)."""
    monkeypatch.setenv("FASTBERT_GRAPH_ACCUMULATE", "1" if accumulate else "0")
    calls, real = [], cublaslt.accumulate

    def counted(*args):  # the weight gradients cuBLASLt added into their buffers
        done = real(*args)
        calls.extend([args[0].shape] if done else [])
        return done

    monkeypatch.setattr(cublaslt, "accumulate", counted)
    model = _model(0.0)
    graphed = _graphed(model, precision)
    a, b = _batch(4), _batch(4)
    b["labels"] = (b["labels"] + 1) % 3
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")
    model.zero_grad(set_to_none=True)
    for packed in (a, b):
        with autocast:
            model(packed=packed).loss.backward()
    g_ref = _grads(model)
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    for step in range(3):            # step 0: a eager (first sight), b captured and replayed; then replays
        model.zero_grad(set_to_none=True)
        graphed.own_grads()
        for packed in (a, b):
            with autocast:
                out = graphed(packed) or model(packed=packed)
            out.loss.backward()
        for name in g_ref:
            torch.testing.assert_close(model.get_parameter(name).grad, g_ref[name], **tol, msg=f"{step} {name}")
    assert graphed.replays == 5 and len(graphed.graphs) == 1
    cap = next(iter(graphed.graphs.values()))
    assert all(g is None for g in cap.grads) == accumulate
    # bf16: the encoder's weights went through cuBLASLt's accumulating GEMM (fp32 operands add as they come)
    assert bool(calls) == (accumulate and precision == "bf16"), calls


@gpu
@needs_cuda
def test_replays_read_the_weight_copies_the_engine_refreshes():
    """The engine's weight casts (ops/weight_casts.py) with graphs: the copies refreshed before each optimizer step's
    first micro-batch, the captured steps read them; four AdamW steps of two micro-batches give the losses of eager
    steps that cast in every forward, while the weights move far more than the tolerance between steps."""
    import copy
    from fastbert.ops.weight_casts import WeightCasts
    model = _model(0.0)
    ref = copy.deepcopy(model)
    graphed, casts = _graphed(model, "bf16"), WeightCasts()
    a, b = _batch(6), _batch(6)
    b["labels"] = (b["labels"] + 1) % 3
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-2) for m in (model, ref)]
    losses, ref_losses = [], []
    for step in range(4):            # step 0: a eager (first sight), b captured and replayed; then replays
        model.zero_grad(set_to_none=True)
        graphed.own_grads()
        for m, packed in enumerate((a, b)):
            with casts.active():
                if m == 0:
                    casts.refresh()
                with autocast:
                    out = graphed(packed) or model(packed=packed)
            out.loss.backward()
            losses.append(float(out.loss))
        ref.zero_grad(set_to_none=True)
        for packed in (a, b):
            with autocast:
                out = ref(packed=packed)
            out.loss.backward()
            ref_losses.append(float(out.loss))
        for opt in opts:
            opt.step()
    assert graphed.replays == 7 and len(casts) > 0
    assert abs(ref_losses[-1] - ref_losses[0]) > 0.2, ref_losses     # a stale copy would show
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=2e-3)


@gpu
@needs_cuda
def test_eval_mode_runs_eagerly():
    model = _model(0.1)
    graphed = _graphed(model, "fp32")
    packed = _batch(3)
    model.eval()
    assert graphed(packed) is None and graphed(packed) is None and not graphed.graphs


@gpu
@needs_cuda
def test_finetune_loop_replays_graphs():
    """The fine-tuning loop through DeepSpeed (the `fastbert finetune` path) on token-bucketed batches:
    shapes seen twice are captured, later steps replay, the losses stay finite and learn."""
    pytest.importorskip("deepspeed")
    from fastbert.tasks.trainer import TrainArgs, build_finetune_engine, param_groups, train
    model = _model(0.1)
    args = TrainArgs(epochs=4, batch_size=8, lr=1e-3, log_every=5, progress=False, precision="bf16", seed=0)
    engine = build_finetune_engine(model, param_groups(model, args.lr, None, args.weight_decay, False), args)
    assert engine.graphs is not None and torch.cuda.current_stream() == engine.graphs.stream
    rng = np.random.default_rng(5)
    features = []
    for _ in range(64):
        n = int(rng.integers(5, SEQ))
        label = int(rng.integers(0, 3))
        features.append({"input_ids": [1, 5 + label] + rng.integers(10, 101, size=n - 3).tolist() + [2],
                         "token_type_ids": [0] * n, "labels": label})

    def collate(rows):
        return {"packed": {**pack_examples(rows, SEQ), "max_seqlen": SEQ}}
    result = train(engine, features, collate, args)
    assert result.steps == 32 and engine.graphs.replays > 0 and len(engine.graphs.graphs) >= 1
    losses = [v for _, v in result.losses]
    assert all(np.isfinite(losses)) and np.mean(losses[-8:]) < np.mean(losses[:8])
