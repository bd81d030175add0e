#!/usr/bin/env bash
# Tokenizer test data (tests/suite/tokenizer.rs).
#
#   tools/make_tokenizer_refs.sh vocabs   Write the vocabulary-only GGUF variants models/vocab-*.gguf
#                                         from the real models (run tools/fetch_models.sh first).
#                                         Needs only Python 3 and the `gguf` package; CI runs this.
#   tools/make_tokenizer_refs.sh refs     Also run llama.cpp's llama-tokenize over
#                                         tests/fixtures/tokenizer/corpus.json for every tokenizer
#                                         and rewrite tests/fixtures/tokenizer/refs/*.json (committed).
#
# LLAMA_TOKENIZE: path of llama-tokenize (default: the vendored llama.cpp build of
# llama-cpp-python under /work/dl). Deterministic: the same inputs give the same files.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
cmd=${1:-vocabs}

if ! $py -c 'import gguf' 2>/dev/null; then
  echo "the Python 'gguf' package is required: $py -m pip install gguf" >&2
  exit 1
fi

$py tools/tokenizer_refs.py vocabs

if [ "$cmd" = refs ]; then
  lt=${LLAMA_TOKENIZE:-/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-tokenize}
  if [ ! -x "$lt" ]; then
    echo "llama-tokenize not found at $lt (set LLAMA_TOKENIZE)" >&2
    exit 1
  fi
  export LD_LIBRARY_PATH="$(dirname "$lt")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  $py tools/tokenizer_refs.py refs "$lt"
elif [ "$cmd" != vocabs ]; then
  echo "usage: $0 [vocabs|refs]" >&2
  exit 2
fi
