#!/usr/bin/env python3
"""Generate the reference fixtures for tests/suite/quant.rs under tests/fixtures/quant/.

Every expected value comes from gguf-py (`gguf.quants.dequantize` / `gguf.quants.quantize`, the
Python port of ggml's reference code), never from LES:

1. Synthetic rows: for each GGML type, one row of N_SYNTH elements of random but valid blocks
   (f16 scales with |d| in [0.001, 0.1], random quant bits), its bytes (`weights_<T>.bin`) and
   gguf-py's dequantization (`weights_<T>.f32`, little-endian f32).
2. Activations: a deterministic f32 vector `act_x.f32` (with a block of exact rounding ties and
   a block of zeros) and its conversion to every vec-dot format (`act_<fmt>.bin`, dequantized
   in `act_<fmt>.f32`): F16 by numpy (round to nearest even), BF16 by gguf-py, Q8_K by a numpy
   transcription of ggml's `quantize_row_q8_K_ref`, Q8_0 / Q8_1 by a numpy transcription of
   ggml's x86 `quantize_row_q8_0` / `_q8_1` (multiplier 127/amax, ties to even: what llama.cpp
   runs on x86 and LES's `quantize_activation` mirrors). Q8_0 / Q8_1 in ggml's portable reference
   rounding (`quantize_row_q8_*_ref`, ties away from zero) are in `act_<fmt>_ref.bin`: gguf-py's
   `quantize` for Q8_0, the numpy transcription (checked against gguf-py's Q8_0) for Q8_1.
3. Dot products: for each synthetic row and each real row, the f64 dot of the gguf-py weights with
   the dequantized activation (`dot_ref` in the manifest), plus `dot_abs` (sum of |terms|) to
   scale the tolerance. For Q4_1/Q5_1 the reference uses the activation's stored f16 sum `s` as
   ggml does (`m * s` instead of `m * d * sum(q)`).
4. Real tensors: a few rows of one tensor per type from the two test models (see
   tools/fetch_models.sh), dequantized by gguf-py from `gguf.GGUFReader`'s tensor data
   (`real_<model>_<type>.f32`).

The manifest `manifest.json` records the gguf-py and numpy versions, the seed and every file.
Run from anywhere: `python3 tools/gen_quant_fixtures.py` (needs the models in models/).
Deterministic: the same gguf-py version and seed reproduce identical files.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

SEED = 0x1E5_0A17
N_SYNTH = 1024  # elements per synthetic row (4 super-blocks, 32 small blocks)
N_ACT = 2048  # activation length (>= every real row length used below)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "quant"
MODELS = ROOT / "models"

# Synthetic types, with the byte offsets of their f16 scale fields inside a block.
SYNTH_TYPES: dict[str, list[int]] = {
    "F32": [],
    "F16": [],
    "BF16": [],
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
    "MXFP4": [],  # E8M0 exponent byte, handled separately
}

VEC_DOT_TYPE = {
    "F32": "F32", "F16": "F16", "BF16": "BF16",
    "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "IQ4_NL": "Q8_0", "MXFP4": "Q8_0",
    "Q4_1": "Q8_1", "Q5_1": "Q8_1",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K", "IQ4_XS": "Q8_K",
}

# Real tensors: (file stem used in fixture names, model file, tensor name, type name).
REAL = [
    ("smol", "SmolLM2-135M-Instruct.Q4_1.gguf", "blk.0.ffn_down.weight", "Q4_1"),
    ("smol", "SmolLM2-135M-Instruct.Q4_1.gguf", "token_embd.weight", "Q8_0"),
    ("gemma", "gemma-3-270m-q4_k_m.gguf", "blk.0.attn_output.weight", "Q4_K"),
    ("gemma", "gemma-3-270m-q4_k_m.gguf", "blk.0.ffn_down.weight", "Q6_K"),
    ("gemma", "gemma-3-270m-q4_k_m.gguf", "blk.0.attn_q.weight", "Q5_0"),
    ("gemma", "gemma-3-270m-q4_k_m.gguf", "blk.0.attn_v.weight", "Q8_0"),
    ("gemma", "gemma-3-270m-q4_k_m.gguf", "output_norm.weight", "F32"),
]


def qtype(name: str) -> T:
    return T[name]


def f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def random_scales(rng: np.random.Generator, k: int) -> np.ndarray:
    """k f16 scales with magnitude log-uniform in [0.001, 0.1] and random sign."""
    mag = np.exp(rng.uniform(np.log(0.001), np.log(0.1), size=k))
    sign = np.where(rng.random(k) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.float16)


def synth_row(rng: np.random.Generator, name: str) -> np.ndarray:
    """Bytes of one row of N_SYNTH elements of type `name`."""
    if name == "F32":
        return rng.normal(0, 0.5, N_SYNTH).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.normal(0, 0.5, N_SYNTH).astype(np.float16).view(np.uint8)
    if name == "BF16":
        f = rng.normal(0, 0.5, N_SYNTH).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = gguf.GGML_QUANT_SIZES[qtype(name)]
    nb = N_SYNTH // block
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for off in SYNTH_TYPES[name]:
        raw[:, off:off + 2] = f16_bytes(random_scales(rng, nb))
    if name == "MXFP4":
        raw[:, 0] = rng.integers(118, 131, size=nb, dtype=np.uint8)
        raw[0, 0] = 0  # subnormal scales (2^-128, 2^-127)
        raw[1, 0] = 1
    return raw.reshape(-1)


def dequant(name: str, data: np.ndarray) -> np.ndarray:
    out = dequantize(np.ascontiguousarray(data, dtype=np.uint8), qtype(name))
    return np.asarray(out, dtype=np.float32).reshape(-1)


def np_roundf(v: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero."""
    a = np.abs(v)
    f = np.floor(a)
    return np.sign(v) * (f + np.floor(2 * (a - f)))


def quant_q8(x: np.ndarray, x86: bool, with_sum: bool) -> bytes:
    """Q8_0 (`with_sum` False) or Q8_1 blocks in f32 arithmetic, as ggml's portable
    quantize_row_q8_{0,1}_ref (`x86` False: multiplier 1/d, roundf) or its x86 AVX/AVX2
    quantize_row_q8_{0,1} in ggml-cpu/arch/x86/quants.c (`x86` True: multiplier 127/amax,
    round half to even, saturating pack to int8)."""
    out = bytearray()
    for blk in x.reshape(-1, 32).astype(np.float32):
        amax = np.float32(np.max(np.abs(blk)))
        d = np.float32(amax / np.float32(127))
        if x86:
            inv = np.float32(np.float32(127) / amax) if amax != 0 else np.float32(0)
            q = np.clip(np.rint((blk * inv).astype(np.float32)), -128, 127).astype(np.int8)
        else:
            inv = np.float32(1) / d if d != 0 else np.float32(0)
            q = np_roundf((blk * inv).astype(np.float32)).astype(np.int8)
        out += np.float16(d).tobytes()
        if with_sum:
            out += np.float16(np.float32(np.float32(int(q.astype(np.int32).sum())) * d)).tobytes()
        out += q.tobytes()
    return bytes(out)


def quant_q8_k(x: np.ndarray) -> bytes:
    """ggml quantize_row_q8_K_ref in f32 arithmetic (round half to even, clamp at 127)."""
    out = bytearray()
    for blk in x.reshape(-1, 256).astype(np.float32):
        j = int(np.argmax(np.abs(blk)))  # first index of the largest magnitude
        if np.abs(blk[j]) == 0:
            out += bytes(292)
            continue
        iscale = np.float32(np.float32(-127) / blk[j])
        q = np.minimum(np.rint((iscale * blk).astype(np.float32)), 127).astype(np.int8)
        bsums = q.astype(np.int32).reshape(16, 16).sum(axis=1).astype(np.int16)
        out += np.float32(np.float32(1) / iscale).tobytes() + q.tobytes() + bsums.astype("<i2").tobytes()
    return bytes(out)


def act_dequant(fmt: str, raw: bytes, n: int) -> np.ndarray:
    b = np.frombuffer(raw, dtype=np.uint8)
    if fmt == "F32":
        return b.view(np.float32)[:n].copy()
    if fmt in ("F16", "BF16", "Q8_0"):
        return dequant(fmt, b)
    if fmt == "Q8_1":
        blk = b.reshape(-1, 36)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
        return (blk[:, 4:].view(np.int8).astype(np.float32) * d).reshape(-1)
    if fmt == "Q8_K":
        blk = b.reshape(-1, 292)
        d = blk[:, 0:4].copy().view(np.float32)
        return (d * blk[:, 4:260].view(np.int8).astype(np.float32)).reshape(-1)
    raise ValueError(fmt)


def make_activation(rng: np.random.Generator) -> np.ndarray:
    x = rng.normal(0, 1, N_ACT).astype(np.float32)
    # Vary the magnitude per 32-block so the block scales differ.
    x *= np.repeat(np.exp(rng.uniform(-3, 1, N_ACT // 32)), 32).astype(np.float32)
    # Block 0: amax 127 with a negative extreme, so Q8_0 has d = 1 and Q8_K iscale = 1 in the
    # first super-block: the values below are exact ties (Q8_0 rounds them away from zero,
    # Q8_K to even).
    x[0:256] = np.clip(x[0:256], -20, 20)
    ties = [-127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 3.5, 4.5, -4.5, 126.5, -126.5]
    x[0:len(ties)] = ties
    # Block 8: all zeros (d = 0 path).
    x[256:288] = 0
    return x


def row_bytes(name: str, n: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype(name)]
    return n // block * size


def dot_reference(wname: str, w_bytes: np.ndarray, w_deq: np.ndarray, act: dict, n: int) -> tuple[float, float]:
    fmt = VEC_DOT_TYPE[wname]
    a = act[fmt]["deq"][:n].astype(np.float64)
    w = w_deq.astype(np.float64)
    terms = w * a
    ref = float(terms.sum())
    absum = float(np.abs(terms).sum())
    if fmt == "Q8_1":
        # ggml adds m_w * s_a with s_a = f16(d_a * sum(q_a)) instead of m_w * d_a * sum(q_a).
        wsize = 20 if wname == "Q4_1" else 24
        wb = w_bytes.reshape(-1, wsize)
        m = wb[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(-1)
        ab = np.frombuffer(act[fmt]["raw"], dtype=np.uint8)[: n // 32 * 36].reshape(-1, 36)
        d = ab[:, 0:2].copy().view(np.float16).astype(np.float64).reshape(-1)
        s = ab[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(-1)
        qsum = ab[:, 4:].view(np.int8).astype(np.float64).sum(axis=1)
        ref += float((m * (s - d * qsum)).sum())
        absum += float(np.abs(m * s).sum())
    return ref, absum


def write(name: str, data: bytes) -> str:
    (OUT / name).write_bytes(data)
    return name


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        if old.suffix in (".bin", ".f32", ".json", ".md"):
            old.unlink()
    rng = np.random.default_rng(SEED)

    # Activations.
    x = make_activation(rng)
    # Q8_0 / Q8_1 in ggml's portable reference rounding: gguf-py's quantize for Q8_0, and the
    # numpy transcription for Q8_1, checked against gguf-py's Q8_0 (same d and quants).
    q8_0_ref = np.asarray(quantize(x.reshape(1, -1), T.Q8_0), dtype=np.uint8).tobytes()
    assert quant_q8(x, x86=False, with_sum=False) == q8_0_ref, "Q8_0 transcription disagrees with gguf-py"
    q8_1_ref = quant_q8(x, x86=False, with_sum=True)
    b0 = np.frombuffer(q8_0_ref, dtype=np.uint8).reshape(-1, 34)
    b1 = np.frombuffer(q8_1_ref, dtype=np.uint8).reshape(-1, 36)
    assert (b0[:, 0:2] == b1[:, 0:2]).all() and (b0[:, 2:] == b1[:, 4:]).all(), "Q8_1 oracle disagrees with gguf-py Q8_0"
    # ... and in ggml's x86 rounding (what LES's quantize_activation produces).
    q8_0_x86 = quant_q8(x, x86=True, with_sum=False)
    q8_1_x86 = quant_q8(x, x86=True, with_sum=True)
    n_diff = int((np.frombuffer(q8_0_x86, np.uint8) != b0.reshape(-1)).sum())
    print(f"Q8_0: x86 and reference rounding differ in {n_diff} of {len(q8_0_ref)} bytes")
    acts_raw = {
        "F32": x.tobytes(),
        "F16": x.astype(np.float16).tobytes(),
        "BF16": np.asarray(quantize(x.reshape(1, -1), T.BF16), dtype=np.uint8).tobytes(),
        "Q8_0": q8_0_x86,
        "Q8_1": q8_1_x86,
        "Q8_K": quant_q8_k(x),
    }
    reference_raw = {"Q8_0": q8_0_ref, "Q8_1": q8_1_ref}
    act = {}
    act_manifest = {"n": N_ACT, "x": write("act_x.f32", x.astype("<f4").tobytes()), "formats": {}}
    for fmt, raw in acts_raw.items():
        deq = act_dequant(fmt, raw, N_ACT)
        act[fmt] = {"raw": raw, "deq": deq}
        source = {
            "F32": "identity", "F16": "numpy float16 (round to nearest even)", "BF16": "gguf.quants.quantize",
            "Q8_0": "numpy transcription of ggml x86 quantize_row_q8_0",
            "Q8_1": "numpy transcription of ggml x86 quantize_row_q8_1",
            "Q8_K": "numpy transcription of quantize_row_q8_K_ref",
        }[fmt]
        act_manifest["formats"][fmt] = {
            "bytes": write(f"act_{fmt}.bin", raw),
            "dequantized": write(f"act_{fmt}.f32", deq.astype("<f4").tobytes()),
            "source": source,
        }
        if fmt in reference_raw:
            act_manifest["formats"][fmt]["reference_bytes"] = write(f"act_{fmt}_ref.bin", reference_raw[fmt])
            act_manifest["formats"][fmt]["reference_source"] = {
                "Q8_0": "gguf.quants.quantize (= quantize_row_q8_0_ref)",
                "Q8_1": "numpy transcription of quantize_row_q8_1_ref",
            }[fmt]

    # Synthetic rows.
    synth = []
    for name in SYNTH_TYPES:
        wb = synth_row(rng, name)
        wd = dequant(name, wb)
        assert wd.shape == (N_SYNTH,), (name, wd.shape)
        assert np.isfinite(wd).all(), name
        ref, absum = dot_reference(name, wb, wd, act, N_SYNTH)
        synth.append({
            "type": name,
            "n": N_SYNTH,
            "bytes": write(f"weights_{name}.bin", wb.tobytes()),
            "dequantized": write(f"weights_{name}.f32", wd.astype("<f4").tobytes()),
            "vec_dot_type": VEC_DOT_TYPE[name],
            "dot_ref": ref,
            "dot_abs": absum,
        })

    # Real tensors.
    real = []
    readers: dict[str, gguf.GGUFReader] = {}
    for stem, model, tname, tyname in REAL:
        path = MODELS / model
        if not path.exists():
            print(f"error: {path} is missing; run tools/fetch_models.sh first", file=sys.stderr)
            return 1
        if model not in readers:
            readers[model] = gguf.GGUFReader(str(path))
        t = next(t for t in readers[model].tensors if t.name == tname)
        assert t.tensor_type == qtype(tyname), (tname, t.tensor_type)
        ne0 = int(t.shape[0])
        n_rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        rows = sorted({0, n_rows // 2, n_rows - 1})
        rb = row_bytes(tyname, ne0)
        data = np.asarray(t.data)
        flat = data.view(np.uint8).reshape(-1)
        entries = []
        deq_all = []
        for r in rows:
            wb = flat[r * rb:(r + 1) * rb]
            wd = dequant(tyname, wb)
            assert wd.shape == (ne0,)
            deq_all.append(wd)
            ref, absum = dot_reference(tyname, wb, wd, act, ne0)
            entries.append({"row": r, "dot_ref": ref, "dot_abs": absum})
        real.append({
            "model": model,
            "tensor": tname,
            "type": tyname,
            "ne0": ne0,
            "n_rows": n_rows,
            "rows": entries,
            "dequantized": write(f"real_{stem}_{tyname}.f32", np.concatenate(deq_all).astype("<f4").tobytes()),
        })

    manifest = {
        "comment": "Generated by tools/gen_quant_fixtures.py; expected values from gguf-py (do not edit).",
        "gguf_version": importlib.metadata.version("gguf"),
        "numpy_version": np.__version__,
        "seed": SEED,
        "activation": act_manifest,
        "synthetic": synth,
        "real": real,
    }
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (OUT / "README.md").write_text(
        "# Quant fixtures\n\n"
        f"Generated by `tools/gen_quant_fixtures.py` with gguf-py (`gguf` package) {manifest['gguf_version']} "
        f"and numpy {manifest['numpy_version']}, seed {SEED:#x}; do not edit.\n"
        "Every expected value is gguf-py's (`gguf.quants.dequantize` / `quantize`), except activation bytes\n"
        "gguf-py cannot produce (Q8_1, Q8_K, and Q8_0 in ggml's x86 rounding): those come from the script's\n"
        "numpy transcriptions of ggml's quantizers (see its docstring).\n\n"
        "- `manifest.json`: versions, file list, dot-product references (`dot_ref`, f64) and term magnitudes (`dot_abs`).\n"
        "- `weights_<T>.bin` / `.f32`: one synthetic row per type and its dequantized values (little-endian f32).\n"
        "- `act_x.f32`, `act_<F>.bin` / `.f32`: the activation vector, its vec-dot formats (as\n"
        "  `quant::quantize_activation` makes them) and their dequantized values; `act_Q8_0_ref.bin`,\n"
        "  `act_Q8_1_ref.bin`: Q8_0 / Q8_1 in ggml's portable reference rounding (`quantize_activation_reference`).\n"
        "- `real_<model>_<T>.f32`: dequantized rows of real tensors (names and rows in the manifest) of the models\n"
        "  fetched by `tools/fetch_models.sh`.\n\n"
        "Used by `tests/suite/quant.rs`.\n"
    )
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {len(list(OUT.iterdir()))} files, {total} bytes, to {OUT} (gguf {manifest['gguf_version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
