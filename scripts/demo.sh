#!/usr/bin/env bash
# Install (idempotent, into .venv/) and run fastbert's main job on the default input: prepare the English
# Wikipedia sample from ../shared/data/pretrain (one-time) and pretrain the tiny BERT for 3 minutes (GPU if
# present, else CPU), then report MLM accuracy beside its expected range, fill-mask predictions and a loss
# curve, and write an HF-loadable checkpoint to runs/tiny/hf. Ctrl-C saves a checkpoint; running it again
# resumes. DATA overrides where ../shared/data is; extra arguments are KEY=VALUE config overrides
# (e.g. train.time_budget=10m output_dir=runs/me).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source "${FASTBERT_VENV:-.venv}/bin/activate"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
DATA=${DATA:-../shared/data}
exec fastbert pretrain --config configs/tiny.json \
  "data.prepare.corpus=[\"$DATA/pretrain/enwiki_wikiextractor\"]" \
  "data.prepare.vocab=$DATA/vocab/bert-base-uncased/vocab.txt" "$@"
