#!/usr/bin/env bash
# Assemble the npm package from www/les (+ the wasm build in www/les/pkg) into target/npm/package
# and pack it: target/npm/les-engine-<version>.tgz (the crate's version).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f www/les/pkg/les_bg.wasm ] || { echo "build the wasm engine first: ./build.sh web" >&2; exit 1; }
version=$(awk -F'"' '/^version = /{print $2; exit}' Cargo.toml)
out=target/npm/package
rm -rf target/npm && mkdir -p "$out/pkg"
cp www/les/index.js www/les/index.d.ts www/les/worker.js www/les/store.js www/les/README.md "$out/"
cp www/les/pkg/les.js www/les/pkg/les.d.ts www/les/pkg/les_bg.wasm www/les/pkg/les_bg.wasm.d.ts "$out/pkg/"
sed "s/\"version\": \"0.0.0\"/\"version\": \"$version\"/" www/les/package.json > "$out/package.json"
(cd target/npm && npm pack ./package --silent >/dev/null)
ls target/npm/les-engine-"$version".tgz
