"""A bounded sample of scripts/fuzz_tokenizer.py in CI: generated strings (random code points, many
scripts, stacked combining marks, emoji ZWJ sequences, 10,000-character words, control characters,
lone surrogates) through the C++ WordPieceTokenizer and HF BertTokenizerFast: no crash, no error,
no mismatch on valid text, a clean ValueError for invalid text. The full run is 1,000,000 strings
per vocabulary (see benchmarks/RESULTS.md)."""
from __future__ import annotations

import importlib.util

import pytest

from reliability_harness import REPO

pytest.importorskip("transformers")


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_tokenizer", REPO / "scripts" / "fuzz_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("vocab", ["bert-base-uncased", "bert-base-multilingual-cased"])
def test_fuzz_sample_matches_hf(vocab, data_dir):
    fuzz = _fuzz_module()
    stats = fuzz.fuzz(vocab, count=4000, seed=7, batch=1000, data_dir=data_dir)
    assert stats["strings"] == 4000 and stats["valid"] + stats["invalid"] == 4000
    assert set(stats["by_generator"]) == set(fuzz.Generators([], 0).names)   # every generator ran
    assert stats["mismatches"] == 0 and stats["errors"] == 0, stats["examples"]
    assert stats["invalid"] > 0 and stats["invalid_rejected_cleanly"] == stats["invalid"]


def test_generators_produce_what_they_promise():
    fuzz = _fuzz_module()
    gen = fuzz.Generators(["hello", "##lo", "[CLS]"], seed=3)
    assert len(gen.long_word()) >= 10_000
    assert not fuzz.is_valid(gen.surrogates())
    assert all(fuzz.is_valid(gen.codepoints()) for _ in range(200))
    assert any("\u200d" in gen.emoji() for _ in range(50))
