#!/usr/bin/env bash
# Assemble the npm package from www/les (+ the wasm builds in www/les/pkg, pkg-mt, pkg-relaxed, pkg-mt-relaxed) into target/npm/package
# and pack it: target/npm/les-engine-<version>.tgz (the crate's version).
set -euo pipefail
cd "$(dirname "$0")/.."
for d in pkg pkg-mt pkg-relaxed pkg-mt-relaxed; do [ -f "www/les/$d/les_bg.wasm" ] || { echo "build the wasm engine first: ./build.sh web" >&2; exit 1; }; done
version=$(awk -F'"' '/^version = /{print $2; exit}' Cargo.toml)
out=target/npm/package
rm -rf target/npm && mkdir -p "$out/pkg"
cp www/les/index.js www/les/index.d.ts www/les/worker.js www/les/store.js www/les/io.js www/les/io-worker.js www/les/device.js www/les/README.md "$out/"
cp www/les/pkg/les.js www/les/pkg/les.d.ts www/les/pkg/les_bg.wasm www/les/pkg/les_bg.wasm.d.ts "$out/pkg/"
# The threaded build with wasm-bindgen-rayon's worker snippet.
cp -r www/les/pkg-mt "$out/pkg-mt"
mkdir -p "$out/pkg-relaxed"
cp www/les/pkg-relaxed/les.js www/les/pkg-relaxed/les.d.ts www/les/pkg-relaxed/les_bg.wasm www/les/pkg-relaxed/les_bg.wasm.d.ts "$out/pkg-relaxed/"
cp -r www/les/pkg-mt-relaxed "$out/pkg-mt-relaxed"
sed "s/\"version\": \"0.0.0\"/\"version\": \"$version\"/" www/les/package.json > "$out/package.json"
(cd target/npm && npm pack ./package --silent >/dev/null)
ls target/npm/les-engine-"$version".tgz
