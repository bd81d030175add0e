#!/usr/bin/env python3
"""Write tests/fixtures/gguf/tiny.gguf with the `gguf` package (the reference writer):
one metadata key of every GGUF value type, and tensors of several ggml types.
Deterministic: fixed values, no randomness. Run: python3 tools/make_gguf_fixture.py"""
import numpy as np
import gguf, os

out = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf", "tiny.gguf")
w = gguf.GGUFWriter(out, "llama")
w.add_uint8("t.u8", 200)
w.add_int8("t.i8", -100)
w.add_uint16("t.u16", 60000)
w.add_int16("t.i16", -30000)
w.add_uint32("t.u32", 4000000000)
w.add_int32("t.i32", -2000000000)
w.add_float32("t.f32", 1.5)
w.add_bool("t.bool", True)
w.add_string("t.str", "héllo ✓")
w.add_array("t.arr_i32", [1, -2, 3])
w.add_array("t.arr_str", ["a", "bc", ""])
w.add_uint64("t.u64", 2**63 + 5)
w.add_int64("t.i64", -(2**62))
w.add_float64("t.f64", -0.25)
w.add_tensor("a.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
w.add_tensor("b.f16", np.linspace(-1, 1, 64, dtype=np.float32).astype(np.float16).reshape(2, 32))
q = gguf.quants.quantize(np.linspace(-2, 2, 64, dtype=np.float32).reshape(2, 32), gguf.GGMLQuantizationType.Q8_0)
w.add_tensor("c.q8_0", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(out, os.path.getsize(out), "bytes")
