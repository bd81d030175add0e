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
    # The main job: SmolMoE-32x2 (1.6 GB, upcycled from real SmolLM2 weights) under a 400 MiB
    # memory budget, experts streamed from disk with lookahead prefetching.
    need_python_pkgs
    LES_SKIP_GEMMA=1 tools/fetch_models.sh
    tools/build_models.sh smolmoe
    cargo build --release --bin les
    ./target/release/les run --model models/smolmoe-32x2.gguf --memory-budget 400MiB \
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
    tools/build_models.sh smolmoe
    tools/make_tokenizer_refs.sh vocabs
    cargo build --lib --target wasm32-unknown-unknown
    cargo test --release
    ;;
  *)
    echo "usage: ./build.sh demo|test|models" >&2
    exit 2
    ;;
esac
