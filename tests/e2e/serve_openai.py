"""`les serve` with the official `openai` Python client (PyPI): chat and completions, whole and
streamed, a second turn reusing the cache, and an API error surfacing as the client's typed
exception. Usage: python3 tests/e2e/serve_openai.py http://HOST:PORT"""
import sys

import openai
from openai import OpenAI

base = sys.argv[1].rstrip("/")
client = OpenAI(base_url=f"{base}/v1", api_key="not-needed")

models = client.models.list()
model = models.data[0].id
assert model.endswith(".gguf"), model

msgs = [{"role": "user", "content": "What is the capital of France?"}]
whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
text = whole.choices[0].message.content
assert text, whole
assert whole.choices[0].finish_reason in ("stop", "length"), whole
assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

parts = []
finish = None
for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.choices and chunk.choices[0].finish_reason:
        finish = chunk.choices[0].finish_reason
assert "".join(parts) == text, (parts, text)
assert finish in ("stop", "length")

turn2 = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "And of Italy?"}]
second = client.chat.completions.create(model=model, messages=turn2, max_tokens=8, temperature=0)
cached = second.usage.prompt_tokens_details.cached_tokens
assert cached >= 10, second.usage

comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
assert comp.choices[0].text, comp
streamed = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
assert streamed == comp.choices[0].text, (streamed, comp.choices[0].text)

try:
    client.chat.completions.create(model=model, messages=msgs, temperature=9)
    raise AssertionError("temperature 9 accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "temperature" in str(e), e

try:
    client.completions.create(model=model, prompt="word " * 4000, max_tokens=4)
    raise AssertionError("a prompt longer than the context accepted")
except openai.BadRequestError as e:
    assert "context" in str(e), e

print(f"openai {openai.__version__}: chat, chat stream, second turn ({cached} cached tokens), completions, errors: ok")
