// block_q3_K (110 B: hmask[32]@0, qs[64]@32, scales[12]@96 (16 x 6 bit, minus 32), d@108) x
// block_q8_K: d_w * d_a * sum(scale * dot). Element n*128 + j*32 + l: bits 2j..2j+1 of
// qs[n*32 + l], minus 4 when bit 4n + j of hmask[l] is 0.
const WB: u32 = 110u;
const AB: u32 = 292u;
fn q3k_scale(w: u32, i: u32) -> i32 {
    var lo: u32;
    if (i < 8u) { lo = wb(w + 96u + i) & 15u; } else { lo = wb(w + 96u + i - 8u) >> 4u; }
    let hi = (wb(w + 104u + i % 4u) >> (2u * (i / 4u))) & 3u;
    return i32(lo | (hi << 4u)) - 32;
}
fn block_dot(w: u32, a: u32) -> f32 {
    var isum = 0;
    for (var g = 0u; g < 16u; g++) {
        let n = g / 8u;
        let j = (g % 8u) / 2u;
        let l0 = (g % 2u) * 16u;
        var dg = 0;
        for (var l = 0u; l < 16u; l += 4u) {
            let lo = (ww(w + 32u + n * 32u + l0 + l) >> (2u * j)) & 0x03030303u;
            let hb = (ww(w + l0 + l) >> (4u * n + j)) & 0x01010101u;
            let y = aw(a + 4u + g * 16u + l);
            dg += dot4I8Packed(lo | (hb << 2u), y) - 4 * lanesum(y);
        }
        isum += q3k_scale(w, g) * dg;
    }
    return (wf16(w + 108u) * af32(a)) * f32(isum);
}
