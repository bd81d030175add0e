#!/usr/bin/env bash
# Build the npm tarball, install it into a scratch app (a plain page with an import map), and run
# that app in headless Chromium: tokens must equal the native engine's.
set -euo pipefail
cd "$(dirname "$0")/.."
tgz=$(tools/make_npm.sh)
app=$(mktemp -d)
trap 'rm -rf "$app"' EXIT
cp tests/e2e/npm-app/index.html "$app/"
(cd "$app" && npm init -y >/dev/null && npm install --silent --no-audit --no-fund "$OLDPWD/$tgz")
[ -f "$app/node_modules/les-engine/pkg/les_bg.wasm" ] || { echo "the tarball lacks the wasm engine" >&2; exit 1; }
for d in pkg-mt pkg-relaxed pkg-mt-relaxed; do
  [ -f "$app/node_modules/les-engine/$d/les_bg.wasm" ] || { echo "the tarball lacks the wasm engine's $d build" >&2; exit 1; }
done
node tests/e2e/npm-app/run.mjs "$app"
