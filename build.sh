#!/usr/bin/env bash
# LES build entry point.
#   ./build.sh demo    fetch the default real model and run the main job on it
#   ./build.sh test    install what the tests need, prepare fixtures, run every test
#   ./build.sh models  fetch real models and build the MoE test models
set -euo pipefail
cd "$(dirname "$0")"
cmd=${1:-demo}

need_python_pkgs() {
  python3 -c "import gguf, numpy" 2>/dev/null || python3 -m pip install -q "gguf==0.19.0" numpy
}

case "$cmd" in
  demo)
    need_python_pkgs
    tools/fetch_models.sh
    cargo build --release --bin les
    ./target/release/les run --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --prompt "The three primary colors are" -n 64 --temp 0
    ;;
  models)
    need_python_pkgs
    tools/fetch_models.sh
    if [ -x tools/build_models.sh ]; then tools/build_models.sh "${2:-small}"; fi
    ;;
  test)
    need_python_pkgs
    rustup target list --installed 2>/dev/null | grep -q wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown
    tools/fetch_models.sh
    if [ -x tools/build_models.sh ]; then tools/build_models.sh small; fi
    if [ -x tools/make_tokenizer_refs.sh ]; then tools/make_tokenizer_refs.sh --vocab-only; fi
    cargo build --lib --target wasm32-unknown-unknown
    cargo test --release
    ;;
  *)
    echo "usage: ./build.sh demo|test|models" >&2
    exit 2
    ;;
esac
