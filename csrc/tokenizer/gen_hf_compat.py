"""Write hf_unicode_compat.txt: where HF tokenizers' BERT normalizer disagrees with Python's unicodedata.

HF's Rust BertNormalizer / BertPreTokenizer compile in their own Unicode tables: character categories
(control, punctuation, non-spacing marks) from Unicode 9.0, NFD from an older unicode-normalization
fork, lowercase and White_Space from the Rust standard library (newer than most Pythons). The build
(gen_unicode.py) takes everything from unicodedata and then applies this file, so the C++ tokenizer
matches HF on every code point whatever Python builds it.

This is a maintainer tool, run by hand when HF or the supported Pythons change (needs `tokenizers`):

    python csrc/tokenizer/gen_hf_compat.py --python python3.10 --python python3.12 --python python3.13

It probes HF on every code point and records HF's answer for each code point where HF differs from
the unicodedata of *any* of the given interpreters (plus this one), so the overrides are absolute
answers, valid for each of those Unicode versions. `--baseline` is the helper mode those
interpreters run (it needs nothing but the standard library).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from gen_unicode import PREDICATES, baseline, code_points  # same directory

OUT = Path(__file__).with_name("hf_unicode_compat.txt")
# Two combining marks HF's NFD knows (Unicode 3.1) that canonical ordering swaps: probes for ccc.
PROBE_HIGH, PROBE_LOW = "\U0001D16D", "\U0001D165"  # ccc 226, ccc 216; both Mc, so never stripped


def probe_hf(candidates: dict) -> dict:
    """HF's answer for every code point in the candidate sets."""
    from tokenizers.normalizers import NFD, BertNormalizer, Lowercase
    from tokenizers.pre_tokenizers import BertPreTokenizer

    clean = BertNormalizer(clean_text=True, handle_chinese_chars=False, strip_accents=False, lowercase=False)
    strip = BertNormalizer(clean_text=False, handle_chinese_chars=False, strip_accents=True, lowercase=False)
    nfd, low, pre = NFD(), Lowercase(), BertPreTokenizer()
    assert strip.normalize_str("a" + PROBE_HIGH + PROBE_LOW) == "a" + PROBE_LOW + PROBE_HIGH
    hf = {name: set() for name in PREDICATES}
    for cp in code_points():
        c = chr(cp)
        cleaned = clean.normalize_str(c)
        if cleaned == "":
            hf["control"].add(cp)
        elif cleaned == " ":
            hf["whitespace"].add(cp)
        if len(pre.pre_tokenize_str("a" + c + "a")) == 3:
            hf["punctuation"].add(cp)
        if nfd.normalize_str(c) == c and strip.normalize_str(c) == "":
            hf["nonspacing_mark"].add(cp)
    answers = {"sets": hf, "nfd_unknown": set(), "lower": {}}
    for cp in candidates["nfd"] | candidates["ccc"]:
        c = chr(cp)
        d = nfd.normalize_str(c)
        if cp in candidates["nfd"] and d == c:
            answers["nfd_unknown"].add(cp)
        elif cp in candidates["ccc"] and d == c:
            # A non-starter lets the two probes around it be reordered; a starter blocks them.
            out = strip.normalize_str("a" + PROBE_HIGH + c + PROBE_LOW)
            if out.index(PROBE_HIGH) < out.index(PROBE_LOW):
                answers["nfd_unknown"].add(cp)
    for cp in candidates["lower"]:
        answers["lower"][cp] = [ord(x) for x in low.normalize_str(chr(cp))]
    return answers


def ranges(cps) -> str:
    cps = sorted(cps)
    out, i = [], 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        out.append(f"{cps[i]:04X}" if i == j else f"{cps[i]:04X}..{cps[j]:04X}")
        i = j + 1
    return " ".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", action="store_true", help="print this interpreter's unicodedata view (JSON)")
    parser.add_argument("--python", action="append", default=[], help="another interpreter to cover (repeatable)")
    args = parser.parse_args()
    if args.baseline:
        json.dump(baseline(), sys.stdout)
        return 0

    import tokenizers

    bases = [baseline()]
    for exe in args.python:
        out = subprocess.run([exe, __file__, "--baseline"], check=True, capture_output=True, text=True).stdout
        bases.append(json.loads(out))
    bases = [{"version": b["version"], "sets": {k: set(v) for k, v in b["sets"].items()},
              "nfd": {int(k): v for k, v in b["nfd"].items()}, "ccc": {int(k): v for k, v in b["ccc"].items()},
              "lower": {int(k): v for k, v in b["lower"].items()}} for b in bases]
    candidates = {"nfd": set().union(*(b["nfd"] for b in bases)), "ccc": set().union(*(b["ccc"] for b in bases))}
    # Lowercase: Rust may know mappings no Python here knows, so probe every code point.
    candidates["lower"] = set(code_points())
    hf = probe_hf(candidates)

    lines = [
        "# HF tokenizers' Unicode where it differs from Python's unicodedata: absolute HF answers for the",
        "# listed code points (hex). Generated by gen_hf_compat.py; do not edit by hand.",
        f"# tokenizers {tokenizers.__version__}; unicodedata versions covered: "
        + ", ".join(sorted({b['version'] for b in bases})),
        "# '<property> + CPS': HF has the property; '<property> - CPS': HF has not.",
        "# 'nfd_unknown CPS': HF's NFD does not know these: no decomposition, combining class 0.",
        "# 'lowercase CP>CP,CP': HF's lowercase mapping of CP.",
    ]
    decomposable = candidates["nfd"] - hf["nfd_unknown"]
    for name in PREDICATES:
        ours = [b["sets"][name] - (decomposable if name == "nonspacing_mark" else set()) for b in bases]
        theirs = hf["sets"][name] - (decomposable if name == "nonspacing_mark" else set())
        plus = set().union(*(theirs - s for s in ours))
        minus = set().union(*(s - theirs for s in ours))
        if plus:
            lines.append(f"{name} + {ranges(plus)}")
        if minus:
            lines.append(f"{name} - {ranges(minus)}")
    if hf["nfd_unknown"]:
        lines.append(f"nfd_unknown {ranges(hf['nfd_unknown'])}")
    lower_diff = sorted(cp for cp, m in hf["lower"].items()
                        if any(b["lower"].get(cp, [cp]) != m for b in bases))
    for i in range(0, len(lower_diff), 8):
        chunk = lower_diff[i:i + 8]
        lines.append("lowercase " + " ".join(f"{cp:04X}>" + ",".join(f"{x:04X}" for x in hf["lower"][cp])
                                             for cp in chunk))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT} ({len(lines)} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
