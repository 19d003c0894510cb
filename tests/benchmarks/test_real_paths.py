"""``benchmarks/real_paths.py``'s summary table (the runs themselves need a GPU and DeepSpeed there)."""
from benchmarks.real_paths import table


def test_table_shows_bare_loops_warm_and_first_pass():
    """The bare loops' steady state sets the ratio; the first pass (new token counts compiling) is shown beside it."""
    res = {"card": "X",
           "hf_bare_loop": {"seq_per_s": 2200.0, "first_pass_seq_per_s": 2100.0},
           "fastbert_bare_loop": {"seq_per_s": 2700.0, "first_pass_seq_per_s": 600.0},
           "fastbert_pretrain_default": {"ok": True, "seq_per_s": 5400.0, "min_over_median": 0.9, "guard_events": 0}}
    rows = table(res).splitlines()
    bare = next(r for r in rows if r.startswith("fastbert model"))
    assert "2700 (first pass 600)" in bare and "1.23x" in bare
    assert "2200 (first pass 2100)" in next(r for r in rows if r.startswith("HF BertForPreTraining"))
    assert "2.45x HF, 200% of bare" in next(r for r in rows if r.startswith("fastbert pretrain"))
    assert "first pass" not in table({"card": "X", "hf_bare_loop": {"seq_per_s": 1.0}})
