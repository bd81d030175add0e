// block_q5_0 (22 B: d f16, qh u32, qs[16]; value (q-16)*d) x block_q8_0: (d_w * d_a) * sumi.
const WB: u32 = 22u;
const AB: u32 = 34u;
fn block_dot(w: u32, a: u32) -> f32 {
    let qh = wu32(w + 2u);
    var s = 0;
    for (var j = 0u; j < 16u; j++) {
        let q = wb(w + 6u + j);
        let lo = i32((q & 15u) | (((qh >> j) & 1u) << 4u)) - 16;
        let hi = i32((q >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u)) - 16;
        s += lo * ai8(a + 2u + j) + hi * ai8(a + 18u + j);
    }
    return (wf16(w) * af16(a)) * f32(s);
}
