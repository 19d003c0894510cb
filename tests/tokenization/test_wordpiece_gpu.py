"""The CUDA batch tokenizer (``encode_batch(..., device="cuda")``) on a GPU: the same arrays as the CPU
path, as CUDA tensors, for the BERT vocabularies, on real text and awkward inputs; errors as on the CPU.
Without CUDA these tests are skipped; test_wordpiece.py runs the same kernels emulated on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fastbert.tokenization.wordpiece import WordPieceTokenizer  # noqa: E402
from tokenizer_testing import wiki_lines  # noqa: E402

pytestmark = pytest.mark.gpu

TRICKY = ["", " ", "a[SEP]b[CLS] [MASK]x [UNK]", "\u0300\U0001D16D z", "x\U0001D16D\u0301\U0001D165y",
          "\x00ctrl\u200b zero \U0001F600 \U00020000\u4E2D \uAC00 Ünïcödé İstanbul", "word " * 60 + "x" * 150]
CASES = [
    dict(padding=True),
    dict(padding=False),
    dict(padding="max_length", max_length=128, truncation=True),
    dict(padding="longest", max_length=24, truncation=True, pad_to_multiple_of=8),
    dict(padding=False, add_special_tokens=False, truncation=False),
]


N_TEXTS = 6000  # real lines per side of test_cuda_equals_cpu, plus TRICKY as texts


@pytest.fixture(scope="module")
def lines(data_dir) -> list[str]:
    """Texts and as many pair texts for test_cuda_equals_cpu (more than wiki_00 + wiki_01 hold)."""
    return wiki_lines(data_dir, 2 * N_TEXTS + len(TRICKY))


def _same(cpu, gpu):
    assert set(cpu) == set(gpu)
    for key in cpu:
        if isinstance(cpu[key], list):
            assert len(cpu[key]) == len(gpu[key])
            for a, b in zip(cpu[key], gpu[key]):
                assert b.is_cuda
                np.testing.assert_array_equal(a, b.cpu().numpy(), err_msg=key)
        else:
            assert gpu[key].is_cuda and gpu[key].dtype == torch.int64
            np.testing.assert_array_equal(cpu[key], gpu[key].cpu().numpy(), err_msg=key)


@pytest.mark.parametrize("name,lowercase", [("bert-base-uncased", True), ("bert-base-cased", False),
                                            ("bert-base-multilingual-cased", False), ("bert-base-chinese", False)])
def test_cuda_equals_cpu(data_dir, lines, name, lowercase):
    tok = WordPieceTokenizer(data_dir / "vocab" / name / "vocab.txt", lowercase=lowercase)
    texts = lines[:N_TEXTS] + TRICKY
    pairs = lines[N_TEXTS:N_TEXTS + len(texts)]
    assert len(texts) == len(pairs) == N_TEXTS + len(TRICKY)
    for i, kwargs in enumerate(CASES):
        text_pairs = pairs if i % 2 else None
        cpu = tok.encode_batch(texts, text_pairs, return_offsets=True, **kwargs)
        gpu = tok.encode_batch(texts, text_pairs, return_offsets=True, device="cuda", **kwargs)
        _same(cpu, gpu)


def test_cuda_api(data_dir, lines):
    tok = WordPieceTokenizer(data_dir / "vocab" / "bert-base-uncased" / "vocab.txt")
    pt = tok.encode_batch(lines[:64], padding=True, return_tensors="pt", device="cuda")
    assert pt["input_ids"].is_cuda and pt["input_ids"].shape[0] == 64
    np_out = tok.encode_batch(lines[:64], padding=True, return_tensors="np", device="cuda")
    np.testing.assert_array_equal(np_out["input_ids"], tok.encode_batch(lines[:64], padding=True)["input_ids"])
    called = tok(lines[:8], padding=True, return_tensors="pt", device="cuda:0")
    assert called["input_ids"].device == torch.device("cuda", 0)
    empty = tok.encode_batch([], padding=True, device="cuda")
    assert empty["input_ids"].shape == (0, 0)
    with pytest.raises(ValueError, match=r"texts\[1\] contains a lone surrogate U\+D800 at character 1"):
        tok.encode_batch(["fine", "a\ud800"], device="cuda")
    with pytest.raises(ValueError, match="more than max_length"):
        tok.encode_batch(lines[:4], padding="max_length", max_length=3, truncation=False, device="cuda")
