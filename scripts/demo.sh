#!/usr/bin/env bash
# Install (idempotent) and run fastbert's main job on the default input: prepare the English Wikipedia
# sample from ../shared/data/pretrain (one-time) and pretrain the tiny BERT for 3 minutes (GPU if present,
# else CPU), then print MLM accuracy and write an HF-loadable checkpoint to runs/tiny/hf.
# DATA overrides where ../shared/data is; extra arguments are KEY=VALUE config overrides
# (e.g. train.time_budget=10m output_dir=runs/me).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
DATA=${DATA:-../shared/data}
exec fastbert pretrain --config configs/tiny.json \
  "data.prepare.corpus=[\"$DATA/pretrain/enwiki_wikiextractor\"]" \
  "data.prepare.vocab=$DATA/vocab/bert-base-uncased/vocab.txt" "$@"
