#!/usr/bin/env bash
# Every test `./build.sh test` runs, with the long matrices its default run shortens to fit CI
# (issue 35): LES_FULL_TESTS=1 makes tests/portable/wgpu_model.rs run all 8 committed prompts x
# 32 greedy steps per architecture (hybrids 4 x 16, gpt-oss 4 x 20) and two prompts per streamed
# budget, tests/suite/streaming.rs SmolMoE-32x2 under every fraction x policy (36 runs), and the
# browser SmolMoE test on 32 CPU + 24 WebGPU tokens. Measured 2026-12-04 on a quiet
# 2-core machine: the cargo tests 444 s instead of 170 s (tests/portable 316 s instead of 66 s).
#   tools/test_full.sh          the whole of ./build.sh test, long matrices
#   tools/test_full.sh cargo    the cargo suites only (fixtures already built)
set -euo pipefail
cd "$(dirname "$0")/.."
export LES_FULL_TESTS=1
if [ "${1:-}" = cargo ]; then
  exec cargo test --profile ci
fi
exec ./build.sh test
