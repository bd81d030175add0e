// block_q5_1 (24 B: d, m f16, qh u32, qs[16]; value q*d+m) x block_q8_1:
// (d_w * d_a) * sumi + m_w * s_a.
const WB: u32 = 24u;
const AB: u32 = 36u;
fn block_dot(w: u32, a: u32) -> f32 {
    let qh = wu32(w + 4u);
    var s = 0;
    for (var j = 0u; j < 16u; j++) {
        let q = wb(w + 8u + j);
        let lo = i32((q & 15u) | (((qh >> j) & 1u) << 4u));
        let hi = i32((q >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u));
        s += lo * ai8(a + 4u + j) + hi * ai8(a + 20u + j);
    }
    return (wf16(w) * af16(a)) * f32(s) + wf16(w + 2u) * af16(a + 2u);
}
