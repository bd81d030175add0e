// block_q2_K (84 B: scales[16]@0 (scale | min << 4), qs[64]@16, d@80, dmin@82) x block_q8_K
// (292 B: d f32@0, qs[256]@4, bsums i16[16]@260): d_a*d*sum(scale*dot) - d_a*dmin*sum(min*bsum).
// Element n*128 + j*32 + l is bits 2j..2j+1 of qs[n*32 + l]; group g = element / 16.
const WB: u32 = 84u;
const AB: u32 = 292u;
fn block_dot(w: u32, a: u32) -> f32 {
    let yd = af32(a);
    var isum = 0;
    var summs = 0;
    for (var g = 0u; g < 16u; g++) {
        let n = g / 8u;
        let j = (g % 8u) / 2u;
        let l0 = (g % 2u) * 16u;
        var dg = 0;
        for (var l = 0u; l < 16u; l += 4u) {
            let q = (ww(w + 16u + n * 32u + l0 + l) >> (2u * j)) & 0x03030303u;
            dg += dot4I8Packed(q, aw(a + 4u + g * 16u + l));
        }
        let sc = wb(w + g);
        isum += i32(sc & 15u) * dg;
        summs += i32(sc >> 4u) * ai16(a + 260u + 2u * g);
    }
    return keep((yd * wf16(w + 80u)) * f32(isum)) - keep((yd * wf16(w + 82u)) * f32(summs));
}
