// block_q8_0 (34 B: d f16, qs[32] i8) x block_q8_0: sumi * (d_w * d_a).
const WB: u32 = 34u;
const AB: u32 = 34u;
fn block_dot(w: u32, a: u32) -> f32 {
    var s = 0;
    for (var j = 0u; j < 32u; j += 4u) { s += dot4I8Packed(ww(w + 2u + j), aw(a + 2u + j)); }
    return f32(s) * (wf16(w) * af16(a));
}
