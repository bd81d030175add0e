// block_iq4_xs (136 B: d f16@0, scales_h u16@2, scales_l[4]@4, qs[128]@8) x block_q8_K:
// d_w * d_a * sum(scale_ib * sumi_ib), scale = 6 bits minus 32 per 32 elements.
const WB: u32 = 136u;
const AB: u32 = 292u;
const KV = array<i32, 16>(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
fn block_dot(w: u32, a: u32) -> f32 {
    let sh = wu16(w + 2u);
    var isum = 0;
    for (var ib = 0u; ib < 8u; ib++) {
        var s = 0;
        for (var j = 0u; j < 16u; j += 4u) {
            let q = ww(w + 8u + 16u * ib + j);
            s += dot4I8Packed(lut4(q, 0u), aw(a + 4u + 32u * ib + j)) + dot4I8Packed(lut4(q, 4u), aw(a + 20u + 32u * ib + j));
        }
        let sc = i32(((wb(w + 4u + ib / 2u) >> (4u * (ib % 2u))) & 15u) | (((sh >> (2u * ib)) & 3u) << 4u)) - 32;
        isum += sc * s;
    }
    return (wf16(w) * af32(a)) * f32(isum);
}
