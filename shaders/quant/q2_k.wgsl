// block_q2_K (84 B: scales[16]@0 (scale | min << 4), qs[64]@16, d@80, dmin@82) x block_q8_K
// (292 B: d f32@0, qs[256]@4, bsums i16[16]@260): d_a*d*sum(scale*dot) - d_a*dmin*sum(min*bsum).
const WB: u32 = 84u;
const AB: u32 = 292u;
fn block_dot(w: u32, a: u32) -> f32 {
    let yd = af32(a);
    var isum = 0;
    var summs = 0;
    for (var g = 0u; g < 16u; g++) {
        var dg = 0;
        for (var i = 0u; i < 16u; i++) {
            let e = g * 16u + i;
            let n = e / 128u;
            let j = (e % 128u) / 32u;
            let l = e % 32u;
            let q = i32((wb(w + 16u + n * 32u + l) >> (2u * j)) & 3u);
            dg += q * ai8(a + 4u + e);
        }
        let sc = wb(w + g);
        isum += i32(sc & 15u) * dg;
        summs += i32(sc >> 4u) * ai16(a + 260u + 2u * g);
    }
    return (yd * wf16(w + 80u)) * f32(isum) - (yd * wf16(w + 82u)) * f32(summs);
}
