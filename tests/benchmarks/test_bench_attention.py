"""``benchmarks/bench_attention.py``'s length distributions (the timing itself needs a GPU)."""
import numpy as np
import pytest

from benchmarks.bench_attention import DISTS, sample_lengths


@pytest.mark.parametrize("seq", [128, 512])
@pytest.mark.parametrize("dist,fill", [("full", 1.0), ("uniform", 0.65), ("fill60", 0.60)])
def test_uniform_fills(dist, fill, seq):
    """fill60 is issue 18's 60%-fill condition: lengths uniform in [0.2 S, S]."""
    lengths = np.array(sample_lengths(dist, 20000, seq, np.random.default_rng(0)))
    assert lengths.min() >= 1 and lengths.max() == seq
    assert lengths.mean() / seq == pytest.approx(fill, abs=0.01)


def test_wiki_lengths_are_clipped():
    lengths = sample_lengths("wiki", 5000, 128, np.random.default_rng(0))
    assert min(lengths) >= 3 and max(lengths) <= 128
    assert set(DISTS) == {"full", "uniform", "fill60", "wiki"}


def test_sweep_applies_each_setting_to_its_own_table():
    """``--sweep`` keeps one forward winner with dropout and one without, each in its own launch table; the
    backward kernels have one table for both settings."""
    from benchmarks.bench_attention import _apply, _restore, _state
    from fastbert.ops import attention as attn
    state = _state()
    try:
        _apply("fwd", "short", (1, 2, 3, 4), True)
        _apply("fwd", "short", (5, 6, 7, 8), False)
        assert attn._GPU_CONFIGS[("fwd_dropout", 64, "short")] == (1, 2, 3, 4)
        assert attn._GPU_CONFIGS[("fwd", 64, "short")] == (5, 6, 7, 8)
        _apply("bwd128", "short", (9, 9, 9), True)
        _apply("bwd64", "short", (7, 7, 7), False)
        assert attn._SHORT_BWD_LAUNCH[128] == (9, 9, 9) and attn._SHORT_BWD_LAUNCH[64] == (7, 7, 7)
        assert attn._SHORT_BWD_LAUNCH[32] == state[1][32]
        _apply("dkdv", "long", (3, 3, 3, 3), False)
        assert attn._GPU_CONFIGS[("dkdv", 64, "long")] == (3, 3, 3, 3)
    finally:
        _restore(state)
    assert (attn._GPU_CONFIGS, attn._SHORT_BWD_LAUNCH) == state
