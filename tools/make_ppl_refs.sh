#!/usr/bin/env bash
# llama.cpp's perplexity of tests/fixtures/eval/heldout.txt (chunks of 256 tokens) for the models
# tests/suite/eval.rs checks LES against. Needs a llama.cpp build (see ../shared/ENVIRONMENT.md):
#   LLAMA_BIN=/path/to/llama.cpp/build/bin tools/make_ppl_refs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=${LLAMA_BIN:?set LLAMA_BIN to llama.cpp build/bin}
out=tests/fixtures/eval/ppl_refs.json
echo "{" > "$out.tmp"
echo "  \"comment\": \"llama-perplexity -f tests/fixtures/eval/heldout.txt -c 256 -b 256 -t 2 (tools/make_ppl_refs.sh)\"," >> "$out.tmp"
echo "  \"llama_cpp\": \"$(cd "$B/../.." && git rev-parse --short HEAD 2>/dev/null || echo 0c1e570)\"," >> "$out.tmp"
first=1
for m in SmolLM2-135M-Instruct.Q4_1.gguf smolmoe-32x2.gguf rand-olmoe.gguf; do
  ppl=$(LD_LIBRARY_PATH=$B "$B/llama-perplexity" -m "models/$m" -f tests/fixtures/eval/heldout.txt -c 256 -b 256 -t 2 2>&1 | sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p')
  [ $first = 1 ] || echo "," >> "$out.tmp"
  printf '  "%s": %s' "$m" "$ppl" >> "$out.tmp"
  first=0
done
printf '\n}\n' >> "$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
