"""Tokenizer throughput on the English Wikipedia sample (wiki_00..04): fastbert (C++, 1 thread and all
threads; CUDA when present) vs HF tokenizers (``BertWordPieceTokenizer(...).encode_batch``, 1 thread
and all threads) vs the pure-Python reference, in MB/s of UTF-8 text and tokens/s, bert-base-uncased.

    python benchmarks/bench_tokenizer.py [--data DIR] [--files 5] [--repeat 3] [--gpu-copies 10] [--json OUT]
    pytest benchmarks/bench_tokenizer.py --benchmark-only      (pytest-benchmark)

Input: every paragraph (non-empty line outside the <doc> tags) as one text of one batch. Times are
medians of --repeat runs after a warm-up; the 1-thread rows also report CPU time (process_time), which
is what to compare on a shared machine. The GPU row tokenizes --gpu-copies copies of the sample in
one batch (a large batch), timed with torch.cuda.synchronize.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = Path(os.environ.get("FASTBERT_DATA", REPO.parent / "shared" / "data"))


def load_lines(data: Path, files: int) -> list[str]:
    lines: list[str] = []
    for i in range(files):
        path = data / "pretrain" / "enwiki_wikiextractor" / f"wiki_{i:02d}.xz"
        with lzma.open(path, "rt", encoding="utf-8") as f:
            lines += [s for s in f.read().split("\n") if s.strip() and not s.startswith(("<doc", "</doc"))]
    return lines


def text_bytes(lines: list[str]) -> int:
    return sum(len(s.encode("utf-8")) for s in lines)


def timed(fn, repeat: int, sync=None):
    """(median wall seconds, median CPU seconds, tokens) of fn() after one warm-up run."""
    tokens = fn()
    walls, cpus = [], []
    for _ in range(repeat):
        if sync:
            sync()
        w, c = time.perf_counter(), time.process_time()
        fn()
        if sync:
            sync()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus), tokens


# --- the implementations: each returns a callable that tokenizes `lines` and returns the token count

def fastbert_flat(vocab: Path, lines, threads):
    from fastbert.tokenization.wordpiece import WordPieceTokenizer
    tok = WordPieceTokenizer(vocab)
    return lambda: len(tok.encode_flat(lines, num_threads=threads)[0])


def fastbert_batch(vocab: Path, lines, threads):
    from fastbert.tokenization.wordpiece import WordPieceTokenizer
    tok = WordPieceTokenizer(vocab)
    return lambda: sum(len(r) for r in tok.encode_batch(lines, num_threads=threads, truncation=False)["input_ids"])


def fastbert_cuda(vocab: Path, lines, copies):
    from fastbert.tokenization.wordpiece import WordPieceTokenizer
    tok = WordPieceTokenizer(vocab)
    batch = lines * copies
    return lambda: int(tok.encode_flat(batch, device="cuda")[0].numel())


def fastbert_cuda_padded(vocab: Path, lines, copies, max_length=128):
    from fastbert.tokenization.wordpiece import WordPieceTokenizer
    tok = WordPieceTokenizer(vocab)
    batch = lines * copies
    return lambda: int(tok.encode_batch(batch, max_length=max_length, padding="max_length", device="cuda")
                       ["attention_mask"].sum())


def hf(vocab: Path, lines, parallel: bool):
    from tokenizers import BertWordPieceTokenizer
    tok = BertWordPieceTokenizer(str(vocab), lowercase=True)

    def run():
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
        return sum(len(e.ids) for e in tok.encode_batch(lines))
    return run


def reference(vocab: Path, lines):
    from fastbert.tokenization.reference import ReferenceTokenizer
    tok = ReferenceTokenizer(vocab)
    return lambda: sum(len(r) for r in tok.encode_batch(lines, truncation=False)["input_ids"])


def machine() -> dict:
    info = {"python": platform.python_version(), "cpu_cores": os.cpu_count(), "platform": platform.platform()}
    try:
        model = [s for s in Path("/proc/cpuinfo").read_text().splitlines() if s.startswith("model name")]
        info["cpu"] = model[0].split(":", 1)[1].strip() if model else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    import tokenizers
    info["tokenizers"] = tokenizers.__version__
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--files", type=int, default=5, help="wiki_00 .. wiki_{files-1}")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpu-copies", type=int, default=10, help="copies of the sample in the GPU batch")
    parser.add_argument("--reference-lines", type=int, default=3000, help="the slow reference runs on a prefix")
    parser.add_argument("--skip", nargs="*", default=[], help="rows to skip (hf, reference, cuda, batch)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from fastbert._wordpiece import hardware_threads
    vocab = args.data / "vocab" / "bert-base-uncased" / "vocab.txt"
    lines = load_lines(args.data, args.files)
    nbytes = text_bytes(lines)
    all_threads = hardware_threads()
    print(f"{len(lines):,} paragraphs, {nbytes / 1e6:.2f} MB; {json.dumps(machine())}", flush=True)
    rows = []

    def row(name, threads, fn, size=nbytes, repeat=args.repeat, sync=None):
        wall, cpu, tokens = timed(fn, repeat, sync)
        rows.append({"name": name, "threads": threads, "MB/s": size / wall / 1e6, "Mtok/s": tokens / wall / 1e6,
                     "cpu MB/s": size / cpu / 1e6 if cpu > 0 and threads == 1 else None, "tokens": tokens,
                     "seconds": wall})
        r = rows[-1]
        cpu_rate = f"{r['cpu MB/s']:7.1f}" if r["cpu MB/s"] else "      -"
        print(f"{name:34s} {threads:>4}  {r['MB/s']:8.1f} MB/s  {cpu_rate} MB/s cpu  {r['Mtok/s']:7.2f} Mtok/s",
              flush=True)

    if "hf" not in args.skip:
        row("hf tokenizers encode_batch", 1, hf(vocab, lines, False))
        row("hf tokenizers encode_batch", all_threads, hf(vocab, lines, True))
    row("fastbert encode_flat", 1, fastbert_flat(vocab, lines, 1))
    row("fastbert encode_flat", all_threads, fastbert_flat(vocab, lines, all_threads))
    if "batch" not in args.skip:
        row("fastbert encode_batch (arrays)", 1, fastbert_batch(vocab, lines, 1))
        row("fastbert encode_batch (arrays)", all_threads, fastbert_batch(vocab, lines, all_threads))
    if "reference" not in args.skip:
        prefix = lines[:args.reference_lines]
        row("reference (pure Python)", 1, reference(vocab, prefix), size=text_bytes(prefix), repeat=1)
    if "cuda" not in args.skip:
        try:
            import torch
            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
        if cuda:
            size = nbytes * args.gpu_copies
            row(f"fastbert cuda encode_flat x{args.gpu_copies}", 0, fastbert_cuda(vocab, lines, args.gpu_copies),
                size=size, sync=torch.cuda.synchronize)
            row(f"fastbert cuda padded-128 x{args.gpu_copies}", 0,
                fastbert_cuda_padded(vocab, lines, args.gpu_copies), size=size, sync=torch.cuda.synchronize)
            # the CPU on the same large batch, all threads, for the same-machine comparison
            row(f"fastbert encode_flat x{args.gpu_copies}", all_threads,
                fastbert_flat(vocab, lines * args.gpu_copies, all_threads), size=size)
    base = next((r for r in rows if r["name"].startswith("hf") and r["threads"] == 1), None)
    if base:
        print("speed-up over HF 1 thread (wall):")
        for r in rows:
            print(f"  {r['name']:34s} {r['threads']:>4}  {r['MB/s'] / base['MB/s']:6.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "text_bytes": nbytes, "rows": rows}, indent=1))
    return 0


# --- pytest-benchmark --------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="module")
    def sample():
        if not DEFAULT_DATA.is_dir():
            pytest.skip(f"shared data not found at {DEFAULT_DATA} (set FASTBERT_DATA)")
        lines = load_lines(DEFAULT_DATA, 5)
        return DEFAULT_DATA / "vocab" / "bert-base-uncased" / "vocab.txt", lines, text_bytes(lines)

    def _report(benchmark, nbytes, tokens):
        mean = benchmark.stats.stats.mean
        benchmark.extra_info.update({"MB/s": nbytes / mean / 1e6, "Mtok/s": tokens / mean / 1e6})

    @pytest.mark.parametrize("threads", [1, None], ids=["1-thread", "all-threads"])
    def test_fastbert(benchmark, sample, threads):
        vocab, lines, nbytes = sample
        tokens = benchmark(fastbert_flat(vocab, lines, threads))
        _report(benchmark, nbytes, tokens)

    @pytest.mark.parametrize("parallel", [False, True], ids=["1-thread", "all-threads"])
    def test_hf_tokenizers(benchmark, sample, parallel):
        pytest.importorskip("tokenizers")
        vocab, lines, nbytes = sample
        tokens = benchmark.pedantic(hf(vocab, lines, parallel), rounds=2, iterations=1)
        _report(benchmark, nbytes, tokens)

    def test_reference(benchmark, sample):
        vocab, lines, _ = sample
        prefix = lines[:2000]
        tokens = benchmark.pedantic(reference(vocab, prefix), rounds=1, iterations=1)
        _report(benchmark, text_bytes(prefix), tokens)

    @pytest.mark.gpu
    def test_fastbert_cuda(benchmark, sample):
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        vocab, lines, nbytes = sample
        fn = fastbert_cuda(vocab, lines, 10)

        def run():  # noqa: E306
            out = fn()
            torch.cuda.synchronize()
            return out
        tokens = benchmark(run)
        _report(benchmark, 10 * nbytes, tokens)


if __name__ == "__main__":
    sys.exit(main())
