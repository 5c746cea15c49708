#!/usr/bin/env bash
# fedax's GPU run: one command on a single-GPU machine without a network (benchmarks/gpu/README.md).
#
#   bash benchmarks/gpu/run.sh OUT_DIR            # the GPU run, about 8 minutes in all
#   bash benchmarks/gpu/run.sh --smoke OUT_DIR    # the same on the CPU at toy sizes, < 1 minute
#
# Options after OUT_DIR are passed to run_all.py (--only PARTS, --budget S,
# --shakespeare-cells CELLS); FEDAX_GPU_WORK=DIR keeps the scratch folder. GPU mode expects JAX with CUDA, PyTorch and optax installed;
# everything else comes from the working tree: the wheels in benchmarks/gpu/wheels and the data
# in benchmarks/gpu/data (both made by prepare.sh). It installs the missing dependencies and
# fedax into a folder of their own (never touching the machine's packages), unpacks the data
# into the scratch folder, and runs the parts (run_all.py). Smoke mode installs nothing: it
# uses the current Python ($PYTHON, else the repository's .venv, else python3) and fedax's
# usual data cache (FEDAX_DATA_DIR or the user cache), or the carried data when present.
set -uo pipefail

FEDAX_GPU_RUN_STARTED=$(date +%s)
export FEDAX_GPU_RUN_STARTED
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

SMOKE=0
ARGS=()
OUT=""
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE=1 ;;
    -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) if [ -z "$OUT" ] && [ "${arg#-}" = "$arg" ]; then OUT="$arg"; else ARGS+=("$arg"); fi ;;
  esac
done
if [ -z "$OUT" ]; then
  echo "usage: bash benchmarks/gpu/run.sh [--smoke] OUT_DIR [run_all.py options]" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
if [ -n "${FEDAX_GPU_WORK:-}" ]; then
  WORK="$FEDAX_GPU_WORK"
else  # scratch of our own: removed at the end (what matters is in OUT_DIR by then)
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/fedax-gpu-work.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK"

if [ "$SMOKE" = 1 ]; then
  if [ -n "${PYTHON:-}" ]; then :
  elif [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"
  else PYTHON=python3; fi
else
  PYTHON="${PYTHON:-python3}"
fi
export PYTHONUNBUFFERED=1

# The carried data (prepare.sh): gzipped cache files, unpacked into the scratch folder's cache.
DATA="$HERE/data"
if [ -d "$DATA" ] && [ -n "$(ls -A "$DATA" 2>/dev/null)" ]; then
  CACHE="$WORK/data"
  for gz in "$DATA"/*/*.gz; do
    [ -e "$gz" ] || continue
    dest="$CACHE/$(basename "$(dirname "$gz")")"
    mkdir -p "$dest"
    gzip -dc "$gz" > "$dest/$(basename "$gz" .gz)"
  done
  export FEDAX_DATA_DIR="$CACHE"
  echo "data: unpacked $(find "$CACHE" -type f | wc -l) files from $DATA into $CACHE"
elif [ "$SMOKE" = 0 ]; then
  echo "warning: no carried data in $DATA (run prepare.sh where there is a network);" \
       "fedax will look in its cache and try to fetch, which fails without a network" >&2
fi

if [ "$SMOKE" = 0 ]; then
  # Dependencies fedax needs and this Python lacks, then fedax itself, into SITE only.
  SITE="$WORK/site"
  mkdir -p "$SITE"
  export FEDAX_GPU_INSTALL_REPORT="$WORK/install.json"
  if [ -d "$HERE/wheels" ]; then
    "$PYTHON" "$HERE/install.py" --wheels "$HERE/wheels" --target "$SITE" \
      --report "$FEDAX_GPU_INSTALL_REPORT" 2>&1 | tee -a "$OUT/run.log"
  else
    echo "warning: no wheels in $HERE/wheels (run prepare.sh); using fedax from src/ with" \
         "whatever this Python has" | tee -a "$OUT/run.log" >&2
  fi
  # fedax from SITE when it installed there, else from the tree's src/ (the same code).
  export PYTHONPATH="$SITE:$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
fi

FLAGS=(--work "$WORK")
[ "$SMOKE" = 1 ] && FLAGS+=(--smoke)
"$PYTHON" "$HERE/run_all.py" "$OUT" "${FLAGS[@]}" "${ARGS[@]}"
