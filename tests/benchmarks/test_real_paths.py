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


def test_table_shows_the_large_recipe_beside_its_own_hf_loop():
    """Each BERT-large run's ratio is against HF's bare loop at the same accumulation, not BERT-base's loop."""
    res = {"card": "X", "hf_bare_loop": {"seq_per_s": 2200.0},
           "hf_bare_loop_large_accum32": {"seq_per_s": 1000.0},
           "fastbert_pretrain_large_accum32": {"ok": True, "seq_per_s": 2200.0, "min_over_median": 0.95,
                                               "vs_hf": 2.2}}
    rows = table(res).splitlines()
    assert "1000" in next(r for r in rows if r.startswith("HF BertForMaskedLM BERT-large bare loop, accum32"))
    large = next(r for r in rows if r.startswith("fastbert pretrain academic-budget-large, accum32"))
    assert "2200 (min window 95% of median)" in large and "2.20x HF" in large
    assert not any(r.startswith("fastbert pretrain large") for r in rows)
    res["fastbert_pretrain_large_gpus2"] = {"ok": True, "seq_per_s": 4300.0, "min_over_median": 0.9, "vs_hf": 4.3,
                                            "scaling_efficiency": 4300 / 4400}
    two = next(r for r in table(res).splitlines() if r.startswith("fastbert pretrain academic-budget-large, gpus2"))
    assert "weak-scaling efficiency 98%" in two and "4.30x HF (1 GPU)" in two


def test_a_variants_environment_reaches_the_command(tmp_path):
    """``no-sm90`` is an environment setting, not a config override: run_logged sets it for the command only."""
    import os
    import sys

    from benchmarks.real_paths import VARIANTS
    from gpu_pretrain_check import run_logged
    assert VARIANTS["no-sm90"] == ([], {"FASTBERT_GEMM_SM90": "0"})
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-c", "import os; print('sm90=' + os.environ.get('FASTBERT_GEMM_SM90', 'unset'))"]
    ok, _ = run_logged(cmd, log, VARIANTS["no-sm90"][1])
    assert ok and "sm90=0" in log.read_text()
    ok, _ = run_logged(cmd, log)  # without the variant: this process's environment, unchanged
    assert ok and ("sm90=" + os.environ.get("FASTBERT_GEMM_SM90", "unset")) in log.read_text()


def test_an_unknown_variant_stops_before_any_run(tmp_path):
    """A misspelt variant is one clear error at the start, not a KeyError after HF's baseline has run."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "real_paths.py"
    r = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "o"), "--large-variants", "default,nope"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown variants ['nope']" in r.stderr and "no-sm90" in r.stderr
    assert not (tmp_path / "o").exists()
