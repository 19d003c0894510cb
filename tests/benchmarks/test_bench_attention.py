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
