#!/usr/bin/env bash
# `les serve` with real clients: curl and the `openai` Python package (PyPI), streamed and not.
# Needs $LES_BIN_DIR/les (default target/release/les) and models/SmolLM2-135M-Instruct.Q4_1.gguf (./build.sh test makes both).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -c "import openai" 2>/dev/null || python3 -m pip install -q "openai==3.57.0"
log=$(mktemp)
"${LES_BIN_DIR:-target/release}/les" serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --port 0 -c 512 -t 2 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
addr=
for _ in $(seq 1 300); do
  addr=$(sed -n 's/^les serve: listening on //p' "$log")
  [ -n "$addr" ] && break
  kill -0 $pid 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.2
done
[ -n "$addr" ] || { echo "les serve did not start" >&2; cat "$log" >&2; exit 1; }
json=(-H 'Content-Type: application/json')
curl -sf "$addr/health" | grep -q '"ok"'
curl -sf "$addr/v1/models" | grep -q 'SmolLM2'
curl -sf "$addr/v1/chat/completions" "${json[@]}" \
  -d '{"messages":[{"role":"user","content":"Say hi"}],"max_tokens":8,"temperature":0}' \
  | python3 -c 'import json,sys; v=json.load(sys.stdin); assert v["choices"][0]["message"]["content"] and v["object"] == "chat.completion", v'
curl -sfN "$addr/v1/chat/completions" "${json[@]}" \
  -d '{"messages":[{"role":"user","content":"Say hi"}],"max_tokens":8,"temperature":0,"stream":true}' \
  | grep -q '^data: \[DONE\]'
code=$(curl -s -o /dev/null -w '%{http_code}' "$addr/v1/chat/completions" "${json[@]}" -d '{"messages": [')
[ "$code" = 400 ] || { echo "invalid JSON answered $code" >&2; exit 1; }
echo "curl: health, models, chat, chat stream, invalid JSON: ok"
python3 tests/e2e/serve_openai.py "$addr"
