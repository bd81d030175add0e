// block_mxfp4 (17 B: e E8M0, qs[16] nibbles indexing kvalues_mxfp4 = 2 x E2M1) x block_q8_0:
// (d_a * 2^(e-128)) * sumi (ggml_e8m0_to_fp32_half).
const WB: u32 = 17u;
const AB: u32 = 34u;
const KV = array<i32, 16>(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
fn e8m0_half(e: u32) -> f32 {
    if (e < 2u) { return bitcast<f32>(0x00200000u << e); }
    return bitcast<f32>((e - 1u) << 23u);
}
fn block_dot(w: u32, a: u32) -> f32 {
    var s = 0;
    for (var j = 0u; j < 16u; j += 4u) {
        let q = ww(w + 1u + j);
        s += dot4I8Packed(lut4(q, 0u), aw(a + 2u + j)) + dot4I8Packed(lut4(q, 4u), aw(a + 18u + j));
    }
    return (af16(a) * e8m0_half(wb(w))) * f32(s);
}
