#!/usr/bin/env bash
# Runs the dot-product tests (tests/suite/quant.rs) on an emulated AArch64 CPU (qemu user mode): the NEON
# kernels (src/quant/neon.rs) must give the portable kernels' bits, with `sdot` (QEMU_CPU=max, which
# has FEAT_DotProd) and without it (cortex-a53, ARMv8.0). Then whole models: the logits of
# examples/logits_hash.rs on the fixtures (tests/fixtures/refs) under emulation must hash as the
# native portable kernels' (LES_NO_SIMD=1). Not part of `./build.sh test` (the aarch64 build of
# the tests' dependencies takes ~12 minutes on 2 cores); run it after changing src/quant or the
# CPU ops. Needs Debian's qemu-user and the aarch64 cross linker, installed here if missing, and
# the fixtures (`./build.sh test` builds them).
#   tools/test_arm.sh [extra cargo test args]      MODELS="rand-gpt-oss ..." picks the models
set -euo pipefail
cd "$(dirname "$0")/.."
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
command -v qemu-aarch64 >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null || {
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null
}
rustup target list --installed | grep -qx aarch64-unknown-linux-gnu || rustup target add aarch64-unknown-linux-gnu
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
for cpu in max cortex-a53; do
  echo "== QEMU_CPU=$cpu"
  QEMU_CPU=$cpu cargo test --no-default-features --target aarch64-unknown-linux-gnu --test suite -- quant:: "$@"
done

# The test profile (optimised, as the tests above built it).
cargo build -q --profile test --no-default-features --example logits_hash
cargo build -q --profile test --no-default-features --target aarch64-unknown-linux-gnu --example logits_hash
dir=${CARGO_TARGET_DIR:-target}
fail=0
for m in ${MODELS:-rand-gpt-oss rand-qwen35moe rand-llama-moe SmolLM2-135M-Instruct.Q4_1}; do
  native=$(LES_NO_SIMD=1 "$dir/debug/examples/logits_hash" "models/$m.gguf" "tests/fixtures/refs/$m.json")
  arm=$(qemu-aarch64 -L /usr/aarch64-linux-gnu "$dir/aarch64-unknown-linux-gnu/debug/examples/logits_hash" "models/$m.gguf" "tests/fixtures/refs/$m.json")
  if [ "$(sed 's/ (.*//' <<<"$native")" = "$(sed 's/ (.*//' <<<"$arm")" ]; then echo "$m: same logits"; else echo "$m: DIFFERENT logits"; fail=1; fi
  printf '  native: %s\n  arm:    %s\n' "${native//$'\n'/ | }" "${arm//$'\n'/ | }"
done
exit $fail
