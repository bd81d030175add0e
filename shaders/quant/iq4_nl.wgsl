// block_iq4_nl (18 B: d f16, qs[16] nibbles indexing kvalues_iq4nl) x block_q8_0: (d_a * d_w) * sumi.
const WB: u32 = 18u;
const AB: u32 = 34u;
const KV = array<i32, 16>(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
fn block_dot(w: u32, a: u32) -> f32 {
    var s = 0;
    for (var j = 0u; j < 16u; j += 4u) {
        let q = ww(w + 2u + j);
        s += dot4I8Packed(lut4(q, 0u), aw(a + 2u + j)) + dot4I8Packed(lut4(q, 4u), aw(a + 18u + j));
    }
    return (af16(a) * wf16(w)) * f32(s);
}
