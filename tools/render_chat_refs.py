#!/usr/bin/env python3
"""Reference renderings of chat templates, made with jinja2 as Hugging Face's
`apply_chat_template` makes them (transformers `utils/chat_template_utils.py`:
ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`,
`strftime_now`, a `tojson` filter of json.dumps with ensure_ascii=False), so that
`tests/suite/chat_templates.rs` checks minijinja's output against the renderer the templates are
written for.

    tools/render_chat_refs.py   # writes tests/fixtures/templates/*.expected.txt

Inputs: tests/fixtures/templates/<name>.jinja (copied from llama.cpp's `models/templates/`) and
the conversations below; `strftime_now` returns the fixed date 2026-12-02 (the Rust test puts
the same date in place of today's).
"""
import json
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DIR = os.path.join(ROOT, "tests", "fixtures", "templates")
DATE = "2026-12-02"

CONVERSATIONS = {
    "openai-gpt-oss-120b": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
}


def render(template: str, messages) -> str:
    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: DATE
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")


def main():
    for name, messages in CONVERSATIONS.items():
        with open(os.path.join(DIR, name + ".jinja")) as f:
            out = render(f.read(), messages)
        with open(os.path.join(DIR, name + ".expected.txt"), "w") as f:
            f.write(out)
        print(f"{name}: {len(out)} chars")


if __name__ == "__main__":
    main()
