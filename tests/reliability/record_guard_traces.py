"""Record real per-step loss and gradient-norm traces of the demo config (configs/tiny.json) for the
guard's false-alarm test (tests/reliability/test_guard_traces.py), which replays them through
SpikeGuard in milliseconds instead of training ten models in CI.

    python tests/reliability/record_guard_traces.py --data ../shared/data --seeds 10 --steps 160 \
        --out tests/reliability/guard_traces.json

The runs use the demo's model, batch, optimizer and 3-minute wall-clock schedule, read from a
deterministic clock (``train.clock=fake:TICK``, TICK = the seconds a step takes at the issue's
~114 seq/s), on a prepared slice of the Wikipedia sample; the guard's spike checks are off while
recording (non-finite values would still be caught), so the traces are what a healthy run sees.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def record(data: Path, seed: int, steps: int, tick: float, out_dir: Path) -> dict:
    from fastbert.training import guard as guard_mod
    from fastbert.training.config import load_config
    from fastbert.training.pretrain import run_pretraining

    trace = {"loss": [], "grad_norm": []}
    original = guard_mod.SpikeGuard.end_step

    def end_step(self, engine, step, data_step, settle=True):
        trace["loss"].append(float(self._loss_t))
        trace["grad_norm"].append(None if self._norm_t is None else float(self._norm_t))
        return original(self, engine, step, data_step, settle)

    guard_mod.SpikeGuard.end_step = end_step
    try:
        cfg = load_config(REPO / "configs" / "tiny.json", [
            f"data.dir={data}", f"output_dir={out_dir}", f"train.seed={seed}", f"train.max_steps={steps}",
            f"train.clock=fake:{tick}", "guard.loss_factor=0", "guard.grad_norm_factor=0",
            "eval.every_steps=null", "eval.at_end=false", "checkpoint.every_minutes=null", "checkpoint.at_end=false",
            "export.hf=false", "log.tensorboard=false", "log.every_steps=40", "checkpoint.resume=never"])
        run_pretraining(cfg)
    finally:
        guard_mod.SpikeGuard.end_step = original
    return trace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--files", type=int, default=4, help="Wikipedia files to prepare (of 32)")
    ap.add_argument("--tick", type=float, default=64 / 113.6, help="fake seconds per optimizer step")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("guard_traces.json")))
    args = ap.parse_args()
    from fastbert.data.prepare import PrepareConfig, prepare
    work = Path(args.work or tempfile.mkdtemp(prefix="guard-traces-"))
    data = work / "data"
    if not (data / "index.json").is_file():
        files = sorted((Path(args.data) / "pretrain" / "enwiki_wikiextractor").glob("*.xz"))[:args.files]
        print(f"preparing {len(files)} Wikipedia files into {data}", flush=True)
        prepare(PrepareConfig(corpus=[str(f) for f in files], vocab=str(Path(args.data) / "vocab/bert-base-uncased/vocab.txt"),
                              out=str(data), seq_len=128, workers=1), progress=False)
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {}
    result.update({"config": "configs/tiny.json", "tick_s": args.tick,
                   "files": args.files})
    traces = result.setdefault("traces", {})
    for seed in range(args.seeds):
        if str(seed) in traces:
            continue
        t0 = time.perf_counter()
        print(f"seed {seed}: {args.steps} steps", flush=True)
        traces[str(seed)] = record(data, seed, args.steps, args.tick, work / f"run{seed}")
        out.write_text(json.dumps(result, indent=None) + "\n")      # after every seed: a stopped run keeps what it has
        print(f"seed {seed}: done in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
