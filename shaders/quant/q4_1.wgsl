// block_q4_1 (20 B: d, m f16, qs[16] nibbles, value q*d+m) x block_q8_1 (36 B: d, s = d*sum(q), qs):
// (d_w * d_a) * sumi + m_w * s_a.
const WB: u32 = 20u;
const AB: u32 = 36u;
fn block_dot(w: u32, a: u32) -> f32 {
    var s = 0;
    for (var j = 0u; j < 16u; j++) {
        let q = wb(w + 4u + j);
        s += i32(q & 15u) * ai8(a + 4u + j) + i32(q >> 4u) * ai8(a + 20u + j);
    }
    return (wf16(w) * af16(a)) * f32(s) + wf16(w + 2u) * af16(a + 2u);
}
