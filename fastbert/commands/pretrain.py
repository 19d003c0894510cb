"""``fastbert pretrain``: BERT pretraining through DeepSpeed (fastbert/training/pretrain.py).

Launch it directly (one process), or under a launcher, which sets RANK / WORLD_SIZE / LOCAL_RANK:

    fastbert pretrain --config configs/tiny.json
    torchrun --nproc_per_node 8 -m fastbert.commands.pretrain --config configs/base.json
    deepspeed --num_gpus 8 --module fastbert.commands.pretrain --config configs/base.json
    deepspeed --hostfile hosts --module fastbert.commands.pretrain --config configs/academic-budget-large.json
"""
from __future__ import annotations

import sys


def add_parser(sub):
    p = sub.add_parser(
        "pretrain", help="pretrain BERT (MLM/NSP) with DeepSpeed on prepared shards",
        description="Pretrain BERT from a JSON config (configs/*.json) with KEY=VALUE overrides, e.g. "
                    "`fastbert pretrain --config configs/tiny.json train.time_budget=5m output_dir=runs/x`. "
                    "Prepares data.dir first when it is missing. Resumes from the newest checkpoint in "
                    "OUTPUT_DIR/checkpoints unless checkpoint.resume=never. Ctrl-C (or SIGTERM) saves a "
                    "checkpoint at the next step and stops; a second Ctrl-C stops at once. --show-config lists "
                    "every config key with its type, default and meaning. Exit status: 0 done, 1 runtime failure, "
                    "2 usage or config error, 130/143 stopped by SIGINT/SIGTERM.")
    _add_arguments(p)


def _add_arguments(p):
    p.add_argument("--config", default=None, help="JSON config (see configs/); defaults apply to missing keys")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. train.max_steps=1000 data.dir=/scratch/wiki (values parsed as JSON)")
    p.add_argument("--output-dir", default=None, help="same as output_dir=PATH")
    p.add_argument("--show-config", action="store_true",
                   help="list every config key with its type, default and meaning (and what --config and the "
                        "overrides change), then exit")
    p.add_argument("--deterministic", action="store_true",
                   help="same seed + same hardware -> bit-identical loss curve (train.deterministic=true; slower on "
                        "GPUs: deterministic kernels, reference embedding backward)")
    # Launchers add these; ranks come from the environment, so they are accepted and ignored.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="(set by launchers)")


def run(args) -> int:
    import json
    import os

    from fastbert.errors import UsageError
    from fastbert.training.config import ConfigError, load_config
    from fastbert.training.config_keys import describe

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={json.dumps(args.output_dir)}")
    if args.deterministic:
        overrides.append("train.deterministic=true")
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as e:
        if args.show_config and isinstance(e, ConfigError) and "set a budget" in str(e):
            cfg = None                      # listing the keys needs no budget
        else:
            raise UsageError(str(e)) from None
    if args.show_config:
        print(describe(cfg.to_dict() if cfg is not None and (args.config or overrides) else None,
                       source=args.config or "overrides"))
        return 0

    from fastbert.training.interrupt import terminate_as_interrupt
    from fastbert.training.pretrain import run_pretraining
    terminate_as_interrupt()
    try:
        summary = run_pretraining(cfg)
    except RuntimeError as e:
        message = known_failure(e)
        if message is None:
            raise
        # The CLI prints ValueErrors as one "error:" line with exit status 1.
        raise ValueError(message) from None
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if summary.get("interrupted"):
        if main_rank:
            print(f"stopped at step {summary['steps']}: checkpoint {summary['checkpoint']}. Run the same command "
                  "again to resume from there (checkpoint.resume=never starts over).")
        return summary["exit_code"]
    ev = summary.get("eval") or {}
    if ev and main_rank:
        print(f"final: step {summary['steps']} | MLM accuracy {ev['mlm_acc']:.4f} | MLM loss {ev['mlm_loss']:.4f}"
              + (f" | NSP accuracy {ev['nsp_acc']:.4f}" if "nsp_acc" in ev else "")
              + (f" | HF checkpoint {summary['hf_dir']}" if summary.get("hf_dir") else ""))
    if main_rank:
        from fastbert.training.report import final_report
        for line in final_report(cfg, summary):
            print(line)
    return 0


def main(argv=None) -> int:
    """Entry point for launchers: ``python -m fastbert.commands.pretrain --config ...``."""
    import argparse
    parser = argparse.ArgumentParser(prog="fastbert pretrain")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    from fastbert.errors import UsageError
    from fastbert.training.interrupt import Terminated
    try:
        return run(args)
    except UsageError as e:
        print(f"fastbert pretrain: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"fastbert pretrain: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print("fastbert pretrain: " + ("terminated" if isinstance(e, Terminated) else "interrupted"), file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130


def known_failure(e: BaseException):
    """The one-line message for failures fastbert diagnoses itself (preflight, guard), else None."""
    from fastbert.training.guard import GuardError
    from fastbert.training.preflight import PeerLostError, PreflightError
    return str(e) if isinstance(e, (GuardError, PeerLostError, PreflightError)) else None


if __name__ == "__main__":
    sys.exit(main())
