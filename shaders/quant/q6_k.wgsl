// block_q6_K (210 B: ql[128]@0, qh[64]@128, scales i8[16]@192, d@208) x block_q8_K:
// d_w * d_a * sum(scale * dot), quants in -32..31. Element n*128 + r*32 + l: nibble r / 2 of
// ql[n*64 + 32*(r % 2) + l] with bits 2r..2r+1 of qh[n*32 + l] on top.
const WB: u32 = 210u;
const AB: u32 = 292u;
fn block_dot(w: u32, a: u32) -> f32 {
    var isum = 0;
    for (var g = 0u; g < 16u; g++) {
        let n = g / 8u;
        let r = (g % 8u) / 2u;
        let l0 = (g % 2u) * 16u;
        var dg = 0;
        for (var l = 0u; l < 16u; l += 4u) {
            let lo = (ww(w + n * 64u + 32u * (r % 2u) + l0 + l) >> (4u * (r / 2u))) & 0x0f0f0f0fu;
            let hi = ((ww(w + 128u + n * 32u + l0 + l) >> (2u * r)) & 0x03030303u) << 4u;
            let y = aw(a + 4u + g * 16u + l);
            dg += dot4I8Packed(lo | hi, y) - 32 * lanesum(y);
        }
        isum += wi8(w + 192u + g) * dg;
    }
    return (wf16(w + 208u) * af32(a)) * f32(isum);
}
