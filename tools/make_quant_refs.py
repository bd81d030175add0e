#!/usr/bin/env python3
"""Reference bytes for LES's weight quantizers (src/quant/quantize.rs) from llama.cpp's llama-quantize.

1. Dequantize every tensor of a model (default: models/rand-llama-moe.gguf) to F32 with gguf-py and
   write that F32 GGUF.
2. Run `llama-quantize --pure F32.gguf OUT.gguf TYPE` for each TYPE (no importance matrix: the
   `quantize_row_<type>_ref` quantizers).
3. Keep a few rows of a few tensors: the F32 input rows and llama-quantize's bytes, in
   tests/fixtures/quantize/<type>.bin with an index in tests/fixtures/quantize/index.json.

Usage: tools/make_quant_refs.py LLAMA_BIN_DIR [MODEL]
"""
import json, os, subprocess, sys, tempfile
import numpy as np
import gguf
sys.path.insert(0, os.path.dirname(__file__))
from make_moe import StreamWriter, copy_kv  # noqa: E402

T = gguf.GGMLQuantizationType
TYPES = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0, "q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_k": T.Q4_K}
ROWS = 6
OUT = "tests/fixtures/quantize"


def main():
    bin_dir = sys.argv[1]
    src = sys.argv[2] if len(sys.argv) > 2 else "models/rand-llama-moe.gguf"
    r = gguf.GGUFReader(src)
    tmp = tempfile.mkdtemp()
    f32_path = os.path.join(tmp, "f32.gguf")
    sw = StreamWriter(f32_path, r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue
        copy_kv(sw, f)
    sw.u32("general.file_type", 0)
    f32 = {}
    for t in r.tensors:
        ne = tuple(int(x) for x in t.shape)
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(ne)))
        f32[t.name] = a
        sw.tensor(t.name, T.F32, ne, (lambda a=a: a))
    sw.write()
    os.makedirs(OUT, exist_ok=True)
    index = {"source": os.path.basename(src), "command": "llama-quantize --pure F32.gguf OUT.gguf TYPE", "llama_cpp": "llama-cpp-python==0.3.36 vendored llama.cpp", "types": {}}
    for name, ty in TYPES.items():
        q_path = os.path.join(tmp, f"{name}.gguf")
        subprocess.run([os.path.join(bin_dir, "llama-quantize"), "--pure", f32_path, q_path, name], check=True, capture_output=True,
                       env={**os.environ, "LD_LIBRARY_PATH": bin_dir})
        q = gguf.GGUFReader(q_path)
        blob = bytearray()
        entries = []
        picked, n_dense = [], 0
        for t in q.tensors:
            if t.tensor_type != ty or len(t.shape) < 2:
                continue
            if "_exps" in t.name:
                if any("_exps" in p.name for p in picked):
                    continue
            elif n_dense == 2:
                continue
            else:
                n_dense += 1
            picked.append(t)
        for t in picked:
            cols = int(t.shape[0])
            rows = f32[t.name].reshape(-1, cols)[:ROWS]
            raw = np.asarray(t.data).reshape(-1).view(np.uint8)
            rb = cols // gguf.GGML_QUANT_SIZES[ty][0] * gguf.GGML_QUANT_SIZES[ty][1]
            qb = raw[: ROWS * rb].tobytes()
            entries.append({"tensor": t.name, "cols": cols, "rows": ROWS, "f32_offset": len(blob), "q_offset": len(blob) + rows.nbytes, "q_bytes": len(qb)})
            blob += rows.astype("<f4").tobytes() + qb
        assert entries, f"llama-quantize wrote no {name} tensor"
        open(os.path.join(OUT, f"{name}.bin"), "wb").write(bytes(blob))
        index["types"][name] = {"ggml_type": int(ty), "entries": entries}
        print(name, [(e["tensor"], e["cols"]) for e in entries])
    json.dump(index, open(os.path.join(OUT, "index.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
