"""Tokenizer fuzz: generated strings through fastbert's C++ ``WordPieceTokenizer`` and HF
``BertTokenizerFast``; counts crashes, errors and mismatches (ids, token types and offsets).

    python scripts/fuzz_tokenizer.py --count 1000000                    # both standard vocabularies
    python scripts/fuzz_tokenizer.py --count 20000 --vocab bert-base-uncased --out fuzz.json

Every string comes from one of these generators (chosen at random, seeded):

* ``codepoints``  random code points from all of Unicode (unassigned, private use, noncharacters incl.)
* ``scripts``     runs of letters from many scripts (Latin, Greek, Cyrillic, Arabic, Devanagari, Thai,
                  CJK, Hangul, kana, fullwidth) with punctuation and spaces
* ``combining``   base letters followed by 1-30 combining marks (stacked, reordered by NFD)
* ``emoji``       emoji with skin tones, ZWJ family sequences, flags, keycaps, tag sequences, VS15/16
* ``long_word``   a 10,000-character word (letters, vocabulary pieces repeated, marks or CJK)
* ``controls``    control, format and zero-width characters, every Unicode space, NUL
* ``words``       vocabulary tokens joined by random separators (realistic text)
* ``surrogates``  valid text with lone surrogates inserted: INVALID text (no UTF-8 form)

Valid text must give exactly HF's output. Invalid text (lone surrogates) must raise a clean Python
``ValueError`` naming the position (HF raises a ``TypeError``); anything else counts as an error.
A crash (segfault, abort) ends this process: finishing the run IS the "0 crashes" result.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
VOCABS = {"bert-base-uncased": True, "bert-base-multilingual-cased": False}   # name -> lowercase

SCRIPT_RANGES = [(0x41, 0x5A), (0x61, 0x7A), (0xC0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x5D0, 0x5EA),
                 (0x620, 0x64A), (0x900, 0x97F), (0xE01, 0xE5B), (0x3041, 0x3096), (0x30A1, 0x30FA),
                 (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFF01, 0xFF5E), (0x20000, 0x2A6DF), (0x1D400, 0x1D7FF)]
PUNCT = list(".,;:!?'\"()[]{}<>-_/\\|@#$%^&*+=~`") + ["\u2013", "\u2014", "\u2026", "\u00bf", "\u3002", "\u300c"]
MARK_RANGES = [(0x300, 0x36F), (0x483, 0x489), (0x591, 0x5BD), (0x64B, 0x65F), (0x93C, 0x94D), (0xE31, 0xE3A),
               (0x1AB0, 0x1ACE), (0x1DC0, 0x1DFF), (0x20D0, 0x20F0), (0xFE20, 0xFE2F), (0x1D165, 0x1D169)]
EMOJI = [0x1F600, 0x1F469, 0x1F468, 0x1F467, 0x1F466, 0x1F44D, 0x2764, 0x1F3F3, 0x1F308, 0x1F9D1, 0x1F4BB,
         0x1F52C, 0x1F680, 0x2708, 0x1F3F4, 0x1F431, 0x1F98A]
SKIN = [0x1F3FB, 0x1F3FC, 0x1F3FD, 0x1F3FE, 0x1F3FF]
CONTROLS = ([chr(c) for c in range(0x00, 0x20)] + [chr(c) for c in range(0x7F, 0xA0)] +
            [chr(c) for c in (0xAD, 0x200B, 0x200C, 0x200D, 0x200E, 0x200F, 0x2060, 0x2061, 0x2066, 0x2069,
                              0xFEFF, 0xFFF9, 0xFFFB, 0xFFFC, 0xFFFD, 0x180E, 0x034F, 0x061C, 0xE0001)])
SPACES = [chr(c) for c in (0x20, 0x09, 0x0A, 0x0D, 0xA0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005,
                           0x2006, 0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000, 0x85,
                           0x0B, 0x0C, 0x1C, 0x1D, 0x1E, 0x1F)]


def _cp(rng: random.Random, ranges) -> str:
    lo, hi = ranges[rng.randrange(len(ranges))]
    return chr(rng.randint(lo, hi))


def _valid_cp(rng: random.Random) -> str:
    c = rng.randrange(0x110000 - 0x800)
    return chr(c if c < 0xD800 else c + 0x800)         # skip the surrogate block


class Generators:
    """Seeded string generators; ``vocab`` supplies realistic word pieces."""

    def __init__(self, vocab: list[str], seed: int):
        self.rng = random.Random(seed)
        self.vocab_words = [t for t in vocab if not (t.startswith("[") and t.endswith("]"))]
        self.pieces = [t for t in self.vocab_words if not t.startswith("##")]
        self.names = ["codepoints", "scripts", "combining", "emoji", "long_word", "controls", "words", "surrogates"]
        # long words are slow for both tokenizers; keep them ~0.5% of the stream
        self.weights = [20, 20, 12, 12, 0.5, 10, 20, 5.5]

    def __call__(self) -> tuple[str, str]:
        name = self.rng.choices(self.names, self.weights)[0]
        return name, getattr(self, name)()

    def codepoints(self) -> str:
        return "".join(_valid_cp(self.rng) for _ in range(self.rng.randrange(0, 40)))

    def scripts(self) -> str:
        r, out = self.rng, []
        for _ in range(r.randrange(1, 12)):
            out.append("".join(_cp(r, SCRIPT_RANGES) for _ in range(r.randrange(1, 10))))
            out.append(r.choice(PUNCT) if r.random() < 0.3 else " ")
        return "".join(out)

    def combining(self) -> str:
        r, out = self.rng, []
        for _ in range(r.randrange(1, 6)):
            out.append(_cp(r, SCRIPT_RANGES[:9]) + "".join(_cp(r, MARK_RANGES) for _ in range(r.randrange(1, 31))))
            out.append(" " if r.random() < 0.5 else "")
        return "".join(out)

    def emoji(self) -> str:
        r, out = self.rng, []
        for _ in range(r.randrange(1, 6)):
            kind = r.randrange(5)
            if kind == 0:    # ZWJ sequence with optional skin tones and VS16
                parts = [chr(r.choice(EMOJI)) + (chr(r.choice(SKIN)) if r.random() < 0.4 else "")
                         + ("\ufe0f" if r.random() < 0.3 else "") for _ in range(r.randrange(2, 6))]
                out.append("\u200d".join(parts))
            elif kind == 1:  # flag: two regional indicators
                out.append(chr(0x1F1E6 + r.randrange(26)) + chr(0x1F1E6 + r.randrange(26)))
            elif kind == 2:  # keycap
                out.append(r.choice("0123456789#*") + "\ufe0f\u20e3")
            elif kind == 3:  # tag sequence (subdivision flag)
                out.append("\U0001F3F4" + "".join(chr(0xE0061 + r.randrange(26)) for _ in range(5)) + "\U000E007F")
            else:            # VS15 / VS16 presentation selectors on text-default emoji
                out.append(chr(r.choice([0x2764, 0x263A, 0x2708, 0x00A9])) + r.choice(["\ufe0e", "\ufe0f"]))
            out.append(r.choice(["", " ", "a", "."]))
        return "".join(out)

    def long_word(self) -> str:
        r = self.rng
        kind = r.randrange(4)
        if kind == 0:
            return "".join(chr(r.randint(0x61, 0x7A)) for _ in range(10_000))
        if kind == 1:
            piece = r.choice(self.pieces)
            return (piece * (10_000 // max(1, len(piece)) + 1))[:10_000]
        if kind == 2:
            return "".join("e" + chr(r.randint(0x300, 0x36F)) for _ in range(5_000))
        return "x " + "".join(_cp(r, SCRIPT_RANGES[11:12]) for _ in range(10_000)) + " y"

    def controls(self) -> str:
        r = self.rng
        pool = CONTROLS + SPACES + ["a", "b", "hello", "[MASK]", "##", "\u00e9", "\u4e2d"]
        return "".join(r.choice(pool) for _ in range(r.randrange(0, 40)))

    def words(self) -> str:
        r, out = self.rng, []
        for _ in range(r.randrange(1, 20)):
            w = r.choice(self.vocab_words)
            if r.random() < 0.2:
                w = w.upper() if r.random() < 0.5 else w.capitalize()
            out.append(w)
            out.append(r.choice([" ", " ", " ", "", "-", ", ", ". ", "'", "\t", "  "]))
        return "".join(out)

    def surrogates(self) -> str:
        base = list(self.words() or "a")
        for _ in range(self.rng.randrange(1, 4)):
            base.insert(self.rng.randrange(len(base) + 1), chr(self.rng.randint(0xD800, 0xDFFF)))
        return "".join(base)


def is_valid(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _rows(enc: dict) -> list:
    offsets = [[tuple(o) for o in row] for row in enc["offset_mapping"]]
    return list(zip(enc["input_ids"], enc["token_type_ids"], offsets))


def compare(ours, hf, texts: list[str]) -> list[int]:
    """Indices of ``texts`` (all valid) where ids, token types or offsets differ."""
    a = _rows(ours(texts, return_offsets_mapping=True))
    b = _rows(hf(texts, return_offsets_mapping=True))
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


def fuzz(vocab_name: str, count: int, seed: int = 0, batch: int = 2000, progress: bool = False,
         data_dir: Path = DATA) -> dict:
    """Run ``count`` generated strings for one vocabulary; returns the counts and the first mismatches."""
    import transformers
    from fastbert.tokenization.wordpiece import WordPieceTokenizer
    lowercase = VOCABS[vocab_name]
    directory = data_dir / "vocab" / vocab_name
    ours = WordPieceTokenizer(directory / "vocab.txt", lowercase=lowercase)
    hf = transformers.BertTokenizerFast.from_pretrained(str(directory), do_lower_case=lowercase)
    gen = Generators(ours.convert_ids_to_tokens(list(range(ours.vocab_size))), seed)
    stats = {"vocab": vocab_name, "strings": 0, "valid": 0, "invalid": 0, "chars": 0, "mismatches": 0,
             "errors": 0, "invalid_rejected_cleanly": 0, "by_generator": {}, "examples": []}
    t0 = time.perf_counter()
    while stats["strings"] < count:
        n = min(batch, count - stats["strings"])
        items = [gen() for _ in range(n)]
        valid = []
        for name, text in items:
            stats["by_generator"][name] = stats["by_generator"].get(name, 0) + 1
            stats["chars"] += len(text)
            if is_valid(text):
                valid.append((name, text))
                continue
            stats["invalid"] += 1
            try:
                ours(text)
                stats["errors"] += 1           # invalid text must not be tokenized silently
                _example(stats, name, text, "invalid text accepted")
            except ValueError as e:
                if "surrogate" in str(e):
                    stats["invalid_rejected_cleanly"] += 1
                else:
                    stats["errors"] += 1
                    _example(stats, name, text, f"ValueError without a clear message: {e}")
            except Exception as e:  # noqa: BLE001 - any other exception type is a finding
                stats["errors"] += 1
                _example(stats, name, text, f"{type(e).__name__}: {e}")
        texts = [t for _, t in valid]
        stats["valid"] += len(texts)
        try:
            bad = compare(ours, hf, texts)
        except Exception:  # noqa: BLE001 - locate the failing string(s) one by one
            bad = []
            for i, t in enumerate(texts):
                try:
                    bad += [i] if compare(ours, hf, [t]) else []
                except Exception as e:  # noqa: BLE001
                    stats["errors"] += 1
                    _example(stats, valid[i][0], t, f"{type(e).__name__}: {e}")
        stats["mismatches"] += len(bad)
        for i in bad:
            o = ours(texts[i], return_offsets_mapping=True)
            h = hf(texts[i], return_offsets_mapping=True)
            _example(stats, valid[i][0], texts[i], f"ours {o['input_ids'][:12]} / hf {h['input_ids'][:12]}")
        stats["strings"] += n
        if progress:
            rate = stats["strings"] / (time.perf_counter() - t0)
            print(f"\r{vocab_name}: {stats['strings']:,}/{count:,} strings, {stats['mismatches']} mismatches, "
                  f"{stats['errors']} errors, {rate:,.0f} strings/s", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    return stats


def _example(stats: dict, generator: str, text: str, what: str) -> None:
    if len(stats["examples"]) < 20:
        stats["examples"].append({"generator": generator, "text": ascii(text[:200]), "length": len(text),
                                  "problem": what})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=1_000_000, help="strings per vocabulary (default 1,000,000)")
    p.add_argument("--vocab", choices=sorted(VOCABS), action="append",
                   help="vocabulary under ../shared/data/vocab (default: both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=2000)
    p.add_argument("--data", type=Path, default=DATA, help="shared data folder (default ../shared/data)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON summary here too")
    args = p.parse_args(argv)
    results = [fuzz(v, args.count, args.seed, args.batch, progress=True, data_dir=args.data)
               for v in (args.vocab or sorted(VOCABS))]
    text = json.dumps(results, indent=1, ensure_ascii=True)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = all(r["mismatches"] == 0 and r["errors"] == 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
