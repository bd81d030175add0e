#!/usr/bin/env bash
# Runs the dot-product tests (tests/quant.rs) on an emulated AArch64 CPU (qemu user mode): the NEON
# kernels (src/quant/neon.rs) must give the portable kernels' bits, with `sdot` (QEMU_CPU=max, which
# has FEAT_DotProd) and without it (cortex-a53, ARMv8.0). Not part of `./build.sh test` (the
# aarch64 build of the test's dependencies takes ~12 minutes on 2 cores); run it after changing
# src/quant. Needs Debian's qemu-user and the aarch64 cross linker, installed here if missing.
#   tools/test_arm.sh [extra cargo test args]
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
  QEMU_CPU=$cpu cargo test --no-default-features --target aarch64-unknown-linux-gnu --test quant "$@"
done
