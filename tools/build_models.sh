#!/usr/bin/env bash
# Build LES's MoE test models into models/ (git-ignored) with tools/make_moe.py.
#
#   tools/build_models.sh [small|smolmoe|all] [--check] [--force]
#
#   small   models/rand-{llama-moe,qwen2moe,qwen3moe,olmoe,qwen35moe,qwen35moe-mtp,qwen3next,gpt-oss}.gguf (19-45 MB, ~3 s each)
#           and the vision-language fixtures (tools/make_vlm.py, issue 36: 4-7 MB each):
#           models/rand-minicpmv-mmproj.gguf, rand-qwen35-vl.gguf, rand-qwen35moe-vl.gguf
#   smolmoe small + models/smolmoe-32x2.gguf                        (1.6 GB, ~1-2 min)
#   all     smolmoe + models/smolmoe-64x4.gguf                      (3.3 GB, ~3-4 min)
#
# Needs python3 with numpy and gguf (the PyPI package, pinned: gguf==0.19.0), and
# models/SmolLM2-135M-Instruct.Q4_1.gguf (fetched with tools/fetch_models.sh when missing).
# No llama.cpp needed.
#
# Deterministic: tests/fixtures/moe/sha256.txt holds every output's sha256.
#   --check  verify the selected outputs against it (exit 1 on mismatch or missing file)
#   --force  rebuild even when an output exists
# Small models that exist but do not match their committed hash are rebuilt; existing SmolMoE files
# are kept unless --force (hashing 1.6-3.3 GB takes a few seconds; --check does it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SUMS=tests/fixtures/moe/sha256.txt
what=small check=0 force=0
for a in "$@"; do
  case "$a" in
    small|smolmoe|all) what=$a ;;
    --check) check=1 ;;
    --force) force=1 ;;
    *) echo "usage: $0 [small|smolmoe|all] [--check] [--force]" >&2; exit 2 ;;
  esac
done

small=(rand-llama-moe rand-qwen2moe rand-qwen3moe rand-olmoe rand-qwen35moe rand-qwen35moe-mtp rand-qwen3next rand-gpt-oss rand-smallthinker rand-lfm2moe)
vlm=(rand-minicpmv-mmproj rand-qwen35-vl rand-qwen35moe-vl)
big=()
[ "$what" = smolmoe ] && big=(smolmoe-32x2)
[ "$what" = all ] && big=(smolmoe-32x2 smolmoe-64x4)

committed_sum() { [ -f "$SUMS" ] && awk -v f="models/$1.gguf" '$2 == f { print $1 }' "$SUMS" || true; }
actual_sum() { sha256sum "models/$1.gguf" | cut -d' ' -f1; }

if [ "$check" = 1 ]; then
  bad=0
  for m in "${small[@]}" "${vlm[@]}" "${big[@]}"; do
    want=$(committed_sum "$m")
    if [ ! -f "models/$m.gguf" ]; then echo "MISSING  models/$m.gguf" >&2; bad=1; continue; fi
    got=$(actual_sum "$m")
    if [ -n "$want" ] && [ "$got" = "$want" ]; then echo "OK       models/$m.gguf"
    else echo "MISMATCH models/$m.gguf: $got (committed: ${want:-none})" >&2; bad=1; fi
  done
  exit $bad
fi

$PY -c "import numpy, gguf" 2>/dev/null || {
  echo "build_models: python3 needs numpy and gguf: $PY -m pip install numpy gguf==0.19.0" >&2; exit 1; }
gv=$($PY -c "import importlib.metadata as m; print(m.version('gguf'))")
[ "$gv" = 0.19.0 ] || echo "build_models: warning: gguf $gv (hashes were made with 0.19.0)" >&2

SRC=models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -s "$SRC" ] || LES_SKIP_GEMMA=1 tools/fetch_models.sh
mkdir -p models

build() {  # name, make_moe args...
  local m=$1; shift
  $PY tools/make_moe.py "$@" --src "$SRC" --out "models/$m.gguf.part"
  finish "$m"
}

finish() {  # name: move the part file in place, compare with the committed hash
  local m=$1
  mv "models/$m.gguf.part" "models/$m.gguf"
  local want got
  want=$(committed_sum "$m"); got=$(actual_sum "$m")
  if [ -z "$want" ]; then echo "built models/$m.gguf ($got; no committed hash)" >&2
  elif [ "$got" != "$want" ]; then echo "build_models: WARNING models/$m.gguf sha256 $got != committed $want" >&2
  else echo "built models/$m.gguf (sha256 OK)" >&2; fi
}

for m in "${small[@]}"; do
  arch=${m#rand-}; arch=${arch%-moe}
  if [ "$force" = 0 ] && [ -f "models/$m.gguf" ] && [ "$(actual_sum "$m")" = "$(committed_sum "$m")" ]; then
    continue
  fi
  build "$m" random --arch "$arch"
done
for m in "${vlm[@]}"; do
  if [ "$force" = 0 ] && [ -f "models/$m.gguf" ] && [ "$(actual_sum "$m")" = "$(committed_sum "$m")" ]; then
    continue
  fi
  case $m in
    rand-minicpmv-mmproj) $PY tools/make_vlm.py mmproj --out "models/$m.gguf.part" ;;
    rand-qwen35-vl) $PY tools/make_vlm.py text --arch qwen35 --src "$SRC" --out "models/$m.gguf.part" ;;
    rand-qwen35moe-vl) $PY tools/make_vlm.py text --arch qwen35moe --src "$SRC" --out "models/$m.gguf.part" ;;
  esac
  finish "$m"
done
for m in "${big[@]}"; do
  if [ "$force" = 0 ] && [ -f "models/$m.gguf" ]; then echo "kept models/$m.gguf (--force rebuilds, --check verifies)" >&2; continue; fi
  case $m in
    smolmoe-32x2) build "$m" smolmoe --experts 32 --top-k 2 ;;
    smolmoe-64x4) build "$m" smolmoe --experts 64 --top-k 4 ;;
  esac
done
