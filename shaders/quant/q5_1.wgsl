// block_q5_1 (24 B: d, m f16, qh u32, qs[16]; value q*d+m) x block_q8_1:
// (d_w * d_a) * sumi + m_w * s_a.
const WB: u32 = 24u;
const AB: u32 = 36u;
fn qh4(qh: u32, j: u32) -> u32 {
    return (((qh >> j) & 1u) | (((qh >> (j + 1u)) & 1u) << 8u) | (((qh >> (j + 2u)) & 1u) << 16u) | (((qh >> (j + 3u)) & 1u) << 24u)) << 4u;
}
fn block_dot(w: u32, a: u32) -> f32 {
    let qh = ww(w + 4u);
    var s = 0;
    for (var j = 0u; j < 16u; j += 4u) {
        let q = ww(w + 8u + j);
        s += dot4I8Packed((q & 0x0f0f0f0fu) | qh4(qh, j), aw(a + 4u + j)) + dot4I8Packed(((q >> 4u) & 0x0f0f0f0fu) | qh4(qh, j + 16u), aw(a + 20u + j));
    }
    return keep((wf16(w) * af16(a)) * f32(s)) + keep(wf16(w + 2u) * af16(a + 2u));
}
