#!/usr/bin/env python3
"""Vocabulary-only GGUF files and llama.cpp reference token ids for tests/suite/tokenizer.rs.

    tokenizer_refs.py vocabs            write models/vocab-*.gguf (needs only Python + gguf)
    tokenizer_refs.py refs LLAMA_TOKENIZE [DIR]
                                        run llama.cpp's llama-tokenize over DIR/corpus.json for
                                        every tokenizer; write DIR/refs/*.json
                                        (DIR: tests/fixtures/tokenizer)
    tokenizer_refs.py fuzz-corpus DIR N SEED
                                        write DIR/corpus.json with N random strings, for a
                                        differential run: refs LLAMA_TOKENIZE DIR, then
                                        LES_TOKENIZER_REFS=DIR cargo test --profile ci --test suite -- tokenizer:: --ignored

Run through tools/make_tokenizer_refs.sh. The vocab files copy the metadata (no tensors) of the
two real models in models/ and change a few tokenizer keys, so one real vocabulary exercises
several pre-tokenizers and BOS/EOS settings. Output is deterministic.
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"

# name -> (source model, metadata changes: key -> (value, type) or None to delete)
# Types are gguf.GGUFValueType member names.
VARIANTS = {
    # Qwen 2 pre-tokenizer; no add_bos key: BPE default (no BOS).
    "vocab-qwen2.gguf": (SMOL, {"tokenizer.ggml.pre": ("qwen2", "STRING"), "tokenizer.ggml.add_bos_token": None}),
    # Llama 3 pre-tokenizer; no add_bos key: llama-bpe's default is to add BOS.
    "vocab-llama-bpe.gguf": (SMOL, {"tokenizer.ggml.pre": ("llama-bpe", "STRING"), "tokenizer.ggml.add_bos_token": None}),
    # OLMo (GPT-2 expression) with BOS and EOS added.
    "vocab-olmo.gguf": (
        SMOL,
        {
            "tokenizer.ggml.pre": ("olmo", "STRING"),
            "tokenizer.ggml.add_bos_token": (True, "BOOL"),
            "tokenizer.ggml.add_eos_token": (True, "BOOL"),
        },
    ),
    # llama.cpp's default BPE pre-tokenizer.
    "vocab-default.gguf": (SMOL, {"tokenizer.ggml.pre": ("default", "STRING")}),
    # GPT-2.
    "vocab-gpt2.gguf": (SMOL, {"tokenizer.ggml.pre": ("gpt-2", "STRING")}),
    # Gemma's SentencePiece vocabulary with llama.cpp's SPM defaults: space prefix on, and EOS.
    "vocab-gemma-prefix.gguf": (
        GEMMA,
        {"tokenizer.ggml.add_space_prefix": None, "tokenizer.ggml.add_eos_token": (True, "BOOL")},
    ),
}

# Tokenizers under test: name -> model file in models/.
TOKENIZERS = {
    "smollm": SMOL,
    "gemma": GEMMA,
    "qwen2": "vocab-qwen2.gguf",
    "llama-bpe": "vocab-llama-bpe.gguf",
    "olmo": "vocab-olmo.gguf",
    "default": "vocab-default.gguf",
    "gpt2": "vocab-gpt2.gguf",
    "gemma-prefix": "vocab-gemma-prefix.gguf",
}


def need(path, hint):
    if not os.path.exists(path):
        sys.exit(f"missing {path}: {hint}")


def write_variant(name, source, changes):
    import gguf

    src = os.path.join(MODELS, source)
    need(src, "run tools/fetch_models.sh first")
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    out = os.path.join(MODELS, name)
    tmp = out + ".part"
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in changes:
            continue
        types = field.types
        value = field.contents()
        if types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, types[0], sub_type=types[-1])
        else:
            writer.add_key_value(key, value, types[0])
    for key, change in changes.items():
        if change is not None:
            value, vtype = change
            writer.add_key_value(key, value, gguf.GGUFValueType[vtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    print(f"wrote models/{name}", file=sys.stderr)


def vocabs():
    for name, (source, changes) in VARIANTS.items():
        write_variant(name, source, changes)


def llama_cpp_commit(llama_tokenize):
    # build/bin/llama-tokenize -> the llama.cpp source tree two levels up
    tree = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(llama_tokenize))))
    try:
        commit = subprocess.check_output(["git", "-C", tree, "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        commit = "unknown"
    env = dict(os.environ)
    version = subprocess.run([llama_tokenize, "--version"], capture_output=True, text=True, env=env)
    return commit, (version.stdout + version.stderr).strip().splitlines()


def run(cmd):
    p = subprocess.run(cmd, capture_output=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr.decode(errors='replace')}")
    return p.stdout


def parse_pieces(out, ids):
    """Pieces from llama-tokenize's default output ("%6d -> '%s'\\n" per token), guided by ids."""
    pieces = []
    pos = 0
    for i, tid in enumerate(ids):
        head = ("%6d -> '" % tid).encode()
        if not out.startswith(head, pos):
            raise ValueError(f"unexpected output at token {i}: {out[pos:pos + 40]!r}")
        start = pos + len(head)
        if i + 1 < len(ids):
            end = out.find(b"'\n" + ("%6d -> '" % ids[i + 1]).encode(), start)
        else:
            end = len(out) - 2
            if not out.endswith(b"'\n"):
                raise ValueError("unexpected end of output")
        if end < 0:
            raise ValueError(f"cannot find end of piece {i}")
        pieces.append(out[start:end])
        pos = end + 2
    return pieces


def write_json(doc, path):
    """JSON with one line per case."""
    head = {k: v for k, v in doc.items() if k != "cases"}
    text = json.dumps(head, ensure_ascii=False, indent=1)[:-2]
    lines = [json.dumps(c, ensure_ascii=False) for c in doc["cases"]]
    text += ',\n "cases": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n"
    assert json.loads(text) == doc
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def refs(llama_tokenize, fixtures=FIXTURES):
    with open(os.path.join(fixtures, "corpus.json"), encoding="utf-8") as f:
        corpus = json.load(f)
    commit, version = llama_cpp_commit(llama_tokenize)
    os.makedirs(os.path.join(fixtures, "refs"), exist_ok=True)
    base = ["llama-tokenize", "-m", "MODEL", "-f", "TEXT_FILE", "--no-escape", "--log-disable"]
    modes = [
        # (add_special flag or None = model default, parse_special, extra args)
        ("model", True, []),
        (False, True, ["--no-bos"]),
        ("model", False, ["--no-parse-special"]),
    ]
    # Subsets for quick differential runs: TOKREFS_TOKENIZERS=smollm,gemma TOKREFS_MODES=0,2
    only = os.environ.get("TOKREFS_TOKENIZERS")
    if os.environ.get("TOKREFS_MODES"):
        modes = [modes[int(i)] for i in os.environ["TOKREFS_MODES"].split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in TOKENIZERS.items():
            if only and name not in only.split(","):
                continue
            path = os.path.join(MODELS, model)
            need(path, "run tools/fetch_models.sh and tools/make_tokenizer_refs.sh vocabs")
            cases = []
            for i, text in enumerate(corpus):
                tf = os.path.join(tmp, f"{i}.txt")
                with open(tf, "wb") as f:
                    f.write(text.encode("utf-8"))
                for add_special, parse_special, extra in modes:
                    cmd = [llama_tokenize, "-m", path, "-f", tf, "--no-escape", "--log-disable"] + extra
                    ids = json.loads(run(cmd + ["--ids"]).decode())
                    pieces = parse_pieces(run(cmd), ids)
                    cases.append(
                        {
                            "text": i,
                            "add_special": add_special,
                            "parse_special": parse_special,
                            "ids": ids,
                            "pieces_hex": [p.hex() for p in pieces],
                        }
                    )
            doc = {
                "tokenizer": name,
                "model": "models/" + model,
                "llama_cpp_commit": commit,
                "llama_cpp_version": version,
                "commands": {
                    "ids": " ".join(base + ["--ids", "[EXTRA]"]),
                    "pieces": " ".join(base + ["[EXTRA]"]),
                    "extra": {"model/parse": "", "no-bos/parse": "--no-bos", "model/no-parse": "--no-parse-special"},
                    "note": "TEXT_FILE holds corpus.json[text] as UTF-8 without a trailing newline; "
                    "add_special 'model' means llama-tokenize's default (add_special = the model's add_bos); "
                    "pieces are common_token_to_piece(ctx, id) (special=true), parsed from the default output; "
                    "llama-tokenize prints them with printf(\"%s\"), so a piece ends at its first NUL byte",
                },
                "cases": cases,
            }
            out = os.path.join(fixtures, "refs", f"{name}.json")
            write_json(doc, out)
            print(f"wrote {os.path.relpath(out, ROOT)} ({len(cases)} cases)", file=sys.stderr)


# Pieces random strings are made of.
FUZZ_PIECES = [
    " ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\n\n", " \n", "\u00a0", "\u3000", "\u2003", "\u0085", "\u2028",
    "\u200b", "\u200d", "\u200c", "\ufeff", "a", "Z", "hello", "World", "the", "I", "'s", "'S", "'t", "'re", "'ll",
    "'LL", "'ve", "'d", "'m", "'", "''", "0", "7", "12", "123", "2024", "1234567", "٣", "४", "５", "½", "²", "Ⅻ",
    ".", ",", "!", "?", "...", "-", "--", "_", "$", "+", "=", "<", ">", "^", "~", "|", "`", "\\", "/", "#", "@",
    "(", ")", "[", "]", "{", "}", "\"", "*", "&", "%", "é", "e\u0301", "ñ", "ß", "ﬁ", "Å", "日本", "語", "中文",
    "한국", "ไทย", "مرحبا", "नमस्ते", "Привет", "Ωμέγα", "עברית", "😀", "👍🏽", "👨‍👩‍👧", "🏳️‍🌈", "𝄞", "𐍈",
    "\u1c89", "\U000e0080", "\x00", "\x07", "\x1b", "\x7f", "▁", "▁▁", "<0x41>", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<s>",
    "</s>", "<fim_prefix>", "<unused0>", "<|im_start", "im_end|>",
]


def fuzz_corpus(out_dir, n, seed):
    import random

    rng = random.Random(seed)
    corpus = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 24)):
            r = rng.random()
            if r < 0.8:
                parts.append(rng.choice(FUZZ_PIECES))
            else:
                # any scalar value, weighted toward the BMP
                hi = 0x10000 if r < 0.95 else 0x110000
                while True:
                    c = rng.randrange(1, hi)
                    if not 0xD800 <= c < 0xE000:
                        break
                parts.append(chr(c))
        corpus.append("".join(parts))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump(corpus, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "vocabs":
        vocabs()
    elif len(sys.argv) >= 3 and sys.argv[1] == "refs":
        refs(sys.argv[2], *sys.argv[3:4])
    elif len(sys.argv) == 5 and sys.argv[1] == "fuzz-corpus":
        fuzz_corpus(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
