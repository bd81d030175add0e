// block_q6_K (210 B: ql[128]@0, qh[64]@128, scales i8[16]@192, d@208) x block_q8_K:
// d_w * d_a * sum(scale * dot), quants in -32..31.
const WB: u32 = 210u;
const AB: u32 = 292u;
fn q6k_quant(w: u32, e: u32) -> i32 {
    let n = e / 128u;
    let r = (e % 128u) / 32u;
    let l = e % 32u;
    let qlb = wb(w + n * 64u + l + 32u * (r & 1u));
    let lo = (qlb >> (4u * (r / 2u))) & 15u;
    let h = (wb(w + 128u + n * 32u + l) >> (2u * r)) & 3u;
    return i32(lo | (h << 4u)) - 32;
}
fn block_dot(w: u32, a: u32) -> f32 {
    var isum = 0;
    for (var g = 0u; g < 16u; g++) {
        var dg = 0;
        for (var i = 0u; i < 16u; i++) {
            let e = g * 16u + i;
            dg += q6k_quant(w, e) * ai8(a + 4u + e);
        }
        isum += wi8(w + 192u + g) * dg;
    }
    return (wf16(w + 208u) * af32(a)) * f32(isum);
}
