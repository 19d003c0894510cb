"""Dropout seeds drawn once per forward (ops/_common.seed_draws): the sites of a model's forward take their seeds
from one draw, in order, each its own; outside a forward each site draws its own, as before."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastbert import BertConfig, BertForPreTraining
from fastbert.ops._common import dropout_seed, seed_draws


def test_sites_take_successive_seeds_of_one_draw():
    torch.manual_seed(0)
    with seed_draws("cpu", 3):
        seeds = [dropout_seed(0.1, None, "cpu") for _ in range(2)]
        assert dropout_seed(0.0, None, "cpu") is None                 # no dropout: nothing taken
        assert int(dropout_seed(0.1, 1234, "cpu")) == 1234            # a fixed seed stays fixed
        seeds += [dropout_seed(0.1, None, "cpu") for _ in range(2)]   # the third of the draw, then a new draw
    assert [s.shape for s in seeds] == [(1,)] * 4 and all(s.dtype == torch.int64 for s in seeds)
    base = seeds[0].untyped_storage().data_ptr()
    assert [s.untyped_storage().data_ptr() == base for s in seeds] == [True, True, True, False]
    assert len({int(s) for s in seeds}) == 4
    torch.manual_seed(0)
    assert torch.equal(torch.cat(seeds[:3]), torch.randint(0, 2**31 - 1, (3,), dtype=torch.int64))  # torch's draw
    outside = dropout_seed(0.1, None, "cpu")
    assert outside.untyped_storage().data_ptr() not in {s.untyped_storage().data_ptr() for s in seeds}


class _Draws(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket is torch.ops.aten.randint
        return func(*args, **(kwargs or {}))


def test_a_training_forward_draws_its_dropout_seeds_once():
    torch.manual_seed(0)
    cfg = BertConfig.preset("tiny", vocab_size=64, max_position_embeddings=16, kernels="triton")
    model = BertForPreTraining(cfg).train()
    ids = torch.randint(5, 64, (2, 9))
    losses = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        with _Draws() as draws:
            out = model(input_ids=ids, labels=ids)
        assert draws.n == 1, draws.n                       # 2 layers x 3 sites + the embeddings' from one draw
        losses.append(float(out.loss.detach()))
    assert losses[0] == losses[1] and losses[2] != losses[0]  # torch.manual_seed fixes the masks
    model.eval()
    with _Draws() as draws:
        model(input_ids=ids)
    assert draws.n == 0
