// block_q4_0 (18 B: d f16, qs[16] nibbles, value (q-8)*d) x block_q8_0: sumi * d_w * d_a.
const WB: u32 = 18u;
const AB: u32 = 34u;
fn block_dot(w: u32, a: u32) -> f32 {
    var s = 0;
    for (var j = 0u; j < 16u; j++) {
        let q = wb(w + 2u + j);
        s += (i32(q & 15u) - 8) * ai8(a + 2u + j) + (i32(q >> 4u) - 8) * ai8(a + 18u + j);
    }
    return f32(s) * wf16(w) * af16(a);
}
