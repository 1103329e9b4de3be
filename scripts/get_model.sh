#!/usr/bin/env bash
# Generate (once) and cache a model of a real model's shape and size, random Q8_0 weights
# (scripts/make_sized_model.py): for benchmarks, where loading and prefill must cost what
# a real model's do.
#
#   PATH_=$(scripts/get_model.sh realistic)   # path on stdout, logs on stderr
#
# Presets: small (~0.17 GB), realistic (~1.17 GB), tiny-q8. The cache is keyed by the
# generator's source, so a changed generator makes a new file. Env: MODEL_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${1:?usage: get_model.sh PRESET}
PY=${PYTHON:-$PWD/.venv/bin/python}
CACHE=${MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/models}
KEY=$(cat scripts/make_sized_model.py scripts/make_tiny_model.py | sha256sum | cut -c1-12)
OUT=$CACHE/$PRESET-$KEY.gguf
if [[ -f $OUT ]]; then echo "$OUT"; exit 0; fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"; flock 9
if [[ -f $OUT ]]; then echo "$OUT"; exit 0; fi
rm -f "$CACHE/$PRESET"-*.gguf "$CACHE/$PRESET"-*.gguf.part   # older generators' files
t0=$SECONDS
(cd scripts && "$PY" make_sized_model.py --preset "$PRESET" --name "$PRESET" "$OUT") >&2
echo "get_model: $PRESET in $((SECONDS - t0)) s: $OUT ($(du -h "$OUT" | cut -f1))" >&2
echo "$OUT"
