// block_q3_K (110 B: hmask[32]@0, qs[64]@32, scales[12]@96 (16 x 6 bit, minus 32), d@108) x
// block_q8_K: d_w * d_a * sum(scale * dot); a quant is its 2 low bits minus 4 when its hmask bit is 0.
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
        var dg = 0;
        for (var i = 0u; i < 16u; i++) {
            let e = g * 16u + i;
            let n = e / 128u;
            let j = (e % 128u) / 32u;
            let l = e % 32u;
            var q = i32((wb(w + 32u + n * 32u + l) >> (2u * j)) & 3u);
            if ((wb(w + l) & (1u << (4u * n + j))) == 0u) { q -= 4; }
            dg += q * ai8(a + 4u + e);
        }
        isum += q3k_scale(w, g) * dg;
    }
    return (wf16(w + 108u) * af32(a)) * f32(isum);
}
