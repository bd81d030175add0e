// block_q5_0 (22 B: d f16, qh u32, qs[16]; value (q-16)*d) x block_q8_0: (d_w * d_a) * sumi.
// Bit i of qh is the fifth bit of element i.
const WB: u32 = 22u;
const AB: u32 = 34u;
// The fifth bits of elements j..j+3 as bit 4 of four bytes.
fn qh4(qh: u32, j: u32) -> u32 {
    return (((qh >> j) & 1u) | (((qh >> (j + 1u)) & 1u) << 8u) | (((qh >> (j + 2u)) & 1u) << 16u) | (((qh >> (j + 3u)) & 1u) << 24u)) << 4u;
}
fn block_dot(w: u32, a: u32) -> f32 {
    let qh = ww(w + 2u);
    var s = 0;
    for (var j = 0u; j < 16u; j += 4u) {
        let q = ww(w + 6u + j);
        let y0 = aw(a + 2u + j);
        let y1 = aw(a + 18u + j);
        s += dot4I8Packed((q & 0x0f0f0f0fu) | qh4(qh, j), y0) + dot4I8Packed(((q >> 4u) & 0x0f0f0f0fu) | qh4(qh, j + 16u), y1) - 16 * (lanesum(y0) + lanesum(y1));
    }
    return (wf16(w) * af16(a)) * f32(s);
}
