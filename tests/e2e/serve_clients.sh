#!/usr/bin/env bash
# `les serve` with real clients: curl and the `openai` Python package (PyPI), streamed and not;
# then a server with a vision tower (--mmproj), to which the `openai` client sends an image as a
# data URL. Needs $LES_BIN_DIR/les (default target/release/les), models/SmolLM2-135M-Instruct.Q4_1.gguf
# and the vision fixtures models/rand-qwen35-vl.gguf + models/rand-minicpmv-mmproj.gguf (./build.sh test makes them all).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -c "import openai" 2>/dev/null || python3 -m pip install -q "openai==3.57.0"
les="${LES_BIN_DIR:-target/release}/les"
log=$(mktemp)
vlog=$(mktemp)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -f "$log" "$vlog"' EXIT
# serve LOG ARGS...: start `les serve ARGS` logging to LOG; sets $addr once it listens.
serve() {
  local l=$1
  shift
  "$les" serve --port 0 -t 2 "$@" 2>"$l" &
  local pid=$!
  pids+=($pid)
  addr=
  for _ in $(seq 1 300); do
    addr=$(sed -n 's/^les serve: listening on //p' "$l")
    [ -n "$addr" ] && return
    kill -0 $pid 2>/dev/null || { cat "$l" >&2; exit 1; }
    sleep 0.2
  done
  echo "les serve did not start" >&2; cat "$l" >&2; exit 1
}
serve "$log" --model models/SmolLM2-135M-Instruct.Q4_1.gguf -c 512
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

# Images: the openai client sends a PNG as a data URL and gets llama.cpp's greedy text
# (tests/data/vision/refs.json); the next turn reuses the cache past the image; a remote URL is refused.
serve "$vlog" --model models/rand-qwen35-vl.gguf --mmproj models/rand-minicpmv-mmproj.gguf -c 256
curl -sf "$addr/v1/models" | grep -q '"multimodal"'
python3 - "$addr" <<'EOF'
import base64, json, sys

import openai
from openai import OpenAI

client = OpenAI(base_url=f"{sys.argv[1]}/v1", api_key="not-needed")
model = client.models.list().data[0].id
run = next(r for r in json.load(open("tests/data/vision/refs.json"))["runs"]["qwen35"] if r["name"] == "square_224")
with open("tests/data/vision/square_224.png", "rb") as f:
    url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe"}]}]
r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
text = r.choices[0].message.content
assert text and run["text"].startswith(text), (text, run["text"])
turn2 = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
second = client.chat.completions.create(model=model, messages=turn2, max_tokens=4, temperature=0)
cached = second.usage.prompt_tokens_details.cached_tokens
assert cached > 20, second.usage  # the image's rows end at position 20
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}], max_tokens=2)
    raise AssertionError("a remote image URL accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "fetches nothing" in str(e), e
print(f"openai {openai.__version__}: image as a data URL ({text!r}), second turn ({cached} cached tokens), remote URL refused: ok")
EOF
