"""SQuAD: official answer normalization and EM/F1 on hand-checked cases; window and span decoding."""
import numpy as np
import pytest

from fastbert.data.squad import SquadExample
from fastbert.tasks.squad import char_span_to_tokens, postprocess, window_starts
from fastbert.tasks.squad_metrics import exact_match, f1, normalize_answer, squad_scores


@pytest.mark.parametrize("raw, normalized", [
    ("The  Denver Broncos!", "denver broncos"),
    ("an apple, a pear and the plum.", "apple pear and plum"),
    ("Theater", "theater"),            # articles only as whole words
    ("24–10", "24–10"),                # the official scripts strip ASCII punctuation only
    ("U.S.A.", "usa"),
    ("  \tA\n", ""),
])
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_exact_match_and_f1_hand_checked():
    assert exact_match("the Denver Broncos", "Denver Broncos") == 1.0
    assert f1("Broncos", "Denver Broncos") == pytest.approx(2 / 3)           # P=1, R=1/2
    assert f1("Denver Broncos won", "Broncos") == pytest.approx(0.5)         # P=1/3, R=1
    assert f1("x x y", "x y") == pytest.approx(0.8)                          # P=2/3, R=1 (counts clipped)
    assert f1("Carolina Panthers", "Denver Broncos") == 0.0
    # Both sides normalize to nothing: 0 under v1.1's rule, a match under v2.0's.
    assert f1("The", "a", v2=False) == 0.0
    assert f1("The", "a", v2=True) == 1.0
    assert f1("", "Paris", v2=True) == 0.0


def test_squad_scores_v1_max_over_golds_and_missing_predictions():
    refs = {"q1": ["Denver Broncos", "Broncos"], "q2": ["Santa Clara, California"], "q3": ["gold"]}
    preds = {"q1": "Broncos", "q2": "Santa Clara"}  # q3 unanswered -> 0
    s = squad_scores(preds, refs)
    assert s["exact_match"] == pytest.approx(100 / 3)
    # q2: P = 1, R = 2/3 -> F1 = 0.8
    assert s["f1"] == pytest.approx(100 * (1 + 0.8 + 0) / 3)
    assert s["total"] == 3


def test_squad_scores_v2_no_answer():
    refs = {"q1": [], "q2": ["Paris"], "q3": ["the"]}   # q3's only answer normalizes to "": unanswerable
    s = squad_scores({"q1": "", "q2": "Paris", "q3": ""}, refs, v2=True)
    assert s["exact_match"] == s["f1"] == 100.0
    assert s["HasAns_total"] == 1 and s["NoAns_total"] == 2
    s = squad_scores({"q1": "London", "q2": "Paris", "q3": ""}, refs, v2=True)
    assert s["NoAns_exact"] == 50.0 and s["HasAns_exact"] == 100.0
    assert s["exact_match"] == pytest.approx(200 / 3)


@pytest.mark.parametrize("n, window, stride", [(10, 4, 1), (11, 4, 2), (4, 4, 1), (3, 8, 2), (1000, 61, 20)])
def test_windows_cover_every_token_with_the_overlap(n, window, stride):
    starts = window_starts(n, window, stride)
    covered = set()
    for s in starts:
        covered |= set(range(s, min(n, s + window)))
        assert s + window <= max(n, window)
    assert covered == set(range(n))
    for a, b in zip(starts, starts[1:]):
        assert b > a and a + window - b >= stride  # consecutive windows overlap by >= stride tokens


def test_char_span_to_tokens():
    offsets = [(0, 5), (6, 9), (9, 12), (13, 17)]   # "Super Bow ##l1 game"-like
    assert char_span_to_tokens(offsets, 6, 12) == (1, 2)
    assert char_span_to_tokens(offsets, 10, 11) == (2, 2)   # inside one token
    assert char_span_to_tokens(offsets, 12, 13) is None     # only the space


def _feature(offsets, example_index=0):
    return {"example_index": example_index, "offsets": offsets}


def test_postprocess_picks_best_valid_span_across_windows():
    context = "alpha beta gamma delta epsilon"
    ex = SquadExample("q", "t", "?", context, ["gamma delta"], [11])
    # Window 1: [CLS] q [SEP] alpha beta gamma [SEP]; window 2: [CLS] q [SEP] gamma delta epsilon [SEP]
    w1 = [None, None, None, (0, 5), (6, 10), (11, 16), None]
    w2 = [None, None, None, (11, 16), (17, 22), (23, 30), None]
    s1 = np.array([0, 9, 0, 1, 1, 2, 9.0])   # high scores on non-context positions must be ignored
    e1 = np.array([0, 9, 0, 1, 1, 1, 9.0])
    s2 = np.array([0, 0, 0, 5, 0, 0, 0.0])
    e2 = np.array([0, 0, 0, 0, 4, 3, 0.0])
    feats = [_feature(w1), _feature(w2)]
    answers, _ = postprocess([ex], feats, [s1, s2], [e1, e2], n_best=5, max_answer_len=30)
    assert answers["q"] == "gamma delta"
    # With max_answer_len=1 the two-token span is not allowed: best single token wins.
    answers, _ = postprocess([ex], feats, [s1, s2], [e1, e2], n_best=5, max_answer_len=1)
    assert answers["q"] == "gamma"


def test_postprocess_v2_null_threshold():
    ex = SquadExample("q", "t", "?", "alpha beta", [], [], is_impossible=True)
    offs = [None, None, (0, 5), (6, 10), None]
    s = np.array([3.0, 0, 1, 0, 0])
    e = np.array([3.0, 0, 1, 0, 0])
    answers, odds = postprocess([ex], [_feature(offs)], [s], [e], v2=True, null_threshold=0.0)
    assert answers["q"] == "" and odds["q"] == pytest.approx(6.0 - 2.0)
    answers, _ = postprocess([ex], [_feature(offs)], [s], [e], v2=True, null_threshold=5.0)
    assert answers["q"] == "alpha"
