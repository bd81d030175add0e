// block_q4_1 (20 B: d, m f16, qs[16] nibbles, value q*d+m) x block_q8_1 (36 B: d, s = d*sum(q), qs):
// (d_w * d_a) * sumi + m_w * s_a.
const WB: u32 = 20u;
const AB: u32 = 36u;
fn block_dot(w: u32, a: u32) -> f32 {
    var s = 0;
    for (var j = 0u; j < 16u; j += 4u) {
        let q = ww(w + 4u + j);
        s += dot4I8Packed(q & 0x0f0f0f0fu, aw(a + 4u + j)) + dot4I8Packed((q >> 4u) & 0x0f0f0f0fu, aw(a + 20u + j));
    }
    return keep((wf16(w) * af16(a)) * f32(s)) + keep(wf16(w + 2u) * af16(a + 2u));
}
