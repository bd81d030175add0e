#!/usr/bin/env python3
"""Compare LES's tensor dumps with llama.cpp's, element by element (a numerics-debugging aid).

    LES_DEBUG_DUMP_DIR=/tmp/les cargo run --release --example dbg_ref -- STEM PROMPT
    target/tools/llama_ref MODEL PROMPTS x.json x.bin --dump /tmp/ref --dump-prompt PROMPT
    tools/cmp_dumps.py /tmp/les /tmp/ref [STEP ...]

Prints, in LES's op order, each tensor's max |diff|, the number of differing elements and
whether it is bit-identical, so the first op where the two engines part shows at a glance.
"""
import os
import sys

import numpy as np

ALTERNATES = {
    "ffn_out": ["ffn_out", "ffn_moe_out"],
    "ffn_moe_weights": ["ffn_moe_weights_scaled", "ffn_moe_weights_norm", "ffn_moe_weights"],
}
RENAME = {"Qrope": ("Qcur", 2), "Krope": ("Kcur", 2), "Qcur": ("Qcur", 0), "Kcur": ("Kcur", 0)}  # fallbacks


def ops(ref_dir):
    """File name -> op, from llama_ref's index.txt."""
    out = {}
    with open(os.path.join(ref_dir, "index.txt")) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2:
                out[parts[0]] = parts[1]
    return out


def ref_file(ref_dir, name):
    base, il = name.rsplit("-", 1)
    if base in ("Qrope", "Krope"):  # the ROPE node among Qcur-il#k (biases add nodes before it)
        idx = ops(ref_dir)
        stem = "Qcur" if base == "Qrope" else "Kcur"
        for k in range(8):
            f = f"{stem}-{il}#{k}.f32"
            if idx.get(f) == "ROPE":
                return os.path.join(ref_dir, f)
    if base in ("result_norm", "result_output", "embd"):
        return os.path.join(ref_dir, f"{base}#0.f32")
    b, k = RENAME.get(base, (base, 0))
    # MoE layers name some tensors differently; the first that exists wins.
    for name in ALTERNATES.get(b, []) + [b]:
        path = os.path.join(ref_dir, f"{name}-{il}#{k}.f32")
        if os.path.exists(path):
            break
    return path


def order(les_dir):
    files = sorted(os.listdir(les_dir), key=lambda f: os.stat(os.path.join(les_dir, f)).st_mtime_ns)
    return [f[:-4] for f in files if f.endswith(".f32")]


def main():
    les_root, ref_root = sys.argv[1], sys.argv[2]
    steps = sys.argv[3:] or sorted(os.listdir(les_root), key=int)
    for step in steps:
        ld, rd = os.path.join(les_root, step), os.path.join(ref_root, step)
        print(f"== step {step}")
        for name in order(ld):
            rf = ref_file(rd, name)
            a = np.fromfile(os.path.join(ld, name + ".f32"), dtype="<f4")
            if not os.path.exists(rf):
                print(f"{name:24s} (no llama.cpp tensor)")
                continue
            b = np.fromfile(rf, dtype="<f4")
            if a.size != b.size:
                n = min(a.size, b.size)  # the last layer keeps only the output rows in llama.cpp
                a, b = a[-n:], b[-n:]
            d = np.abs(a.astype(np.float64) - b)
            ndiff = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
            scale = float(np.abs(b).max()) or 1.0
            tag = "==" if ndiff == 0 else "  "
            print(f"{tag} {name:24s} n={a.size:7d} diff={ndiff:7d} max|d|={d.max():.3e} rel={d.max() / scale:.3e} at={int(d.argmax())}")


if __name__ == "__main__":
    main()
