#!/usr/bin/env bash
# Reference continuations and logits from llama.cpp for LES's conformance tests.
#
#   tools/make_refs.sh MODEL.gguf [MODEL.gguf ...]
#
# For each model writes tests/fixtures/refs/<model-stem>.json and <model-stem>.logits.bin (see
# tests/fixtures/refs/README.md for the format), using tests/fixtures/prompts.txt, 32 greedy tokens,
# 2 threads, context 512. It also runs `llama-completion -p <prompt 1> -n 32 --temp 0 -no-cnv` and
# records in the JSON ("sanity") whether its text equals the reference text for prompt 1.
#
# Needs a llama.cpp build (not needed by CI: the results are committed). Default: the llama.cpp
# vendored in the PyPI sdist llama-cpp-python==0.3.36, built as in ../shared/ENVIRONMENT.md:
#   LLAMA_CPP_DIR=/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp  (build in $LLAMA_CPP_DIR/build)
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp}
BIN=$LLAMA_CPP_DIR/build/bin
OUT=${REFS_OUT:-tests/fixtures/refs}
PROMPTS=${PROMPTS:-tests/fixtures/prompts.txt}
THREADS=${THREADS:-2}
N_GEN=${N_GEN:-32}
mkdir -p target/tools "$OUT"

# ---- compile tools/llama_ref.cpp against llama.h / libllama (shared libs in build/bin) ----
REF=target/tools/llama_ref
if [ ! -x "$REF" ] || [ tools/llama_ref.cpp -nt "$REF" ] || [ tools/ref_json.h -nt "$REF" ]; then
  g++ -O2 -std=c++17 -o "$REF" tools/llama_ref.cpp \
    -I"$LLAMA_CPP_DIR/include" -I"$LLAMA_CPP_DIR/ggml/include" \
    -L"$BIN" -lllama -lggml -lggml-base -Wl,-rpath,"$BIN"
fi

# ---- llama.cpp version stamp: "version: N (commit)" from llama-completion --version ----
ver=$("$BIN/llama-completion" --version 2>&1 | grep -m1 "^version:" || true)
built=$("$BIN/llama-completion" --version 2>&1 | grep -m1 '^built with' || true)
VERSION="llama.cpp ${ver#version: } ${built}, vendored in PyPI sdist llama-cpp-python==0.3.36"

for model in "$@"; do
  stem=$(basename "$model" .gguf)
  json=$OUT/$stem.json
  bin=$OUT/$stem.logits.bin
  cmd="tools/make_refs.sh models/$stem.gguf  # = $REF models/$stem.gguf $PROMPTS $json $bin --n-gen $N_GEN --threads $THREADS --ctx 512 --top 32"
  echo "== $stem" >&2
  if [ "${SKIP_REF:-0}" != 1 ]; then  # SKIP_REF=1: only redo the llama-completion sanity record
    "$REF" "$model" "$PROMPTS" "$json" "$bin" --n-gen "$N_GEN" --threads "$THREADS" --ctx 512 --top 32 \
      --version "$VERSION" --command "$cmd"
  fi

  # ---- sanity: llama-completion's greedy text for prompt 1 must equal ours ----
  p1=$(head -n1 "$PROMPTS")
  printf -v scmd '%q ' llama-completion -m "models/$stem.gguf" -p "$p1" -n "$N_GEN" --temp 0 -no-cnv -t "$THREADS" --no-display-prompt
  "$BIN/llama-completion" -m "$model" -p "$p1" -n "$N_GEN" --temp 0 -no-cnv -t "$THREADS" --no-display-prompt \
      </dev/null >"target/tools/$stem.completion.txt" 2>"target/tools/$stem.completion.log" || true
  python3 - "$json" "target/tools/$stem.completion.txt" "${scmd% }" <<'EOF'
import json, sys
path, comp_path, cmd = sys.argv[1], sys.argv[2], sys.argv[3]
ref = json.load(open(path))
p0 = ref["prompts"][0]
comp = open(comp_path, "rb").read()
ours = bytes.fromhex(p0["text_hex"])
# llama-completion stops at EOS/EOG: compare up to the text produced before the first EOG
# (llama-completion prints "\n\n" after the generated text, or " [end of text]\n" when it stops at
# EOS; that trailer is not compared; it does not print the EOG token, our text does)
for trailer in (b" [end of text]\n\n\n", b" [end of text]\n", b"\n\n"):
    if comp.endswith(trailer):
        comp = comp[:-len(trailer)]
        break
if p0["first_eog"] >= 0:
    ok = ours.startswith(comp)
else:
    ok = comp == ours
sanity = {"command": cmd, "text": comp.decode("utf-8", "replace"), "equals_prompt0_text": ok,
          "note": "stdout of the command without the trailing \"\\n\\n\" or \" [end of text]\\n\" llama-completion prints at exit"}
s = open(path).read().rstrip()
if ',\n"sanity_llama_completion"' in s:  # SKIP_REF=1 rerun: replace the old record
    s = s[:s.index(',\n"sanity_llama_completion"')] + "\n}"
assert s.endswith("}")
s = s[:-1].rstrip() + ',\n"sanity_llama_completion": ' + json.dumps(sanity, ensure_ascii=False) + "\n}\n"
json.loads(s)
open(path, "w").write(s)
print(f"sanity (llama-completion prompt 1): {'OK' if ok else 'MISMATCH'}: {comp!r}", file=sys.stderr)
EOF
  ls -l "$json" "$bin" >&2
done
