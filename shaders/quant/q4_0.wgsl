// block_q4_0 (18 B: d f16, qs[16] nibbles, value (q-8)*d) x block_q8_0: sumi * d_w * d_a.
// Byte j holds element j (low nibble) and j + 16 (high nibble).
const WB: u32 = 18u;
const AB: u32 = 34u;
fn block_dot(w: u32, a: u32) -> f32 {
    var s = 0;
    for (var j = 0u; j < 16u; j += 4u) {
        let q = ww(w + 2u + j);
        let y0 = aw(a + 2u + j);
        let y1 = aw(a + 18u + j);
        s += dot4I8Packed(q & 0x0f0f0f0fu, y0) + dot4I8Packed((q >> 4u) & 0x0f0f0f0fu, y1) - 8 * (lanesum(y0) + lanesum(y1));
    }
    return f32(s) * wf16(w) * af16(a);
}
