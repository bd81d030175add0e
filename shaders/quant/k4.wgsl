// Shared by Q4_K and Q5_K: the 6-bit scale and min of sub-block j packed in 12 bytes at s
// (get_scale_min_k4, ggml-quants.c).
fn k4_scale(s: u32, j: u32) -> u32 {
    if (j < 4u) { return wb(s + j) & 63u; }
    return (wb(s + j + 4u) & 15u) | ((wb(s + j - 4u) >> 6u) << 4u);
}
fn k4_min(s: u32, j: u32) -> u32 {
    if (j < 4u) { return wb(s + j + 4u) & 63u; }
    return (wb(s + j + 4u) >> 4u) | ((wb(s + j) >> 6u) << 4u);
}
// Element e of a Q4_K/Q5_K super-block: low nibbles then high nibbles of 32-byte runs at qs;
// Q5_K adds bit 2c (+1 for the high half) of qh[l] as the fifth bit.
fn k45_quant(qs: u32, qh: u32, five: bool, e: u32) -> i32 {
    let c = e / 64u;
    let hi = (e % 64u) / 32u;
    let l = e % 32u;
    var q = (wb(qs + c * 32u + l) >> (4u * hi)) & 15u;
    if (five) { q |= ((wb(qh + l) >> (2u * c + hi)) & 1u) << 4u; }
    return i32(q);
}
fn k45_dot(w: u32, a: u32, qs: u32, five: bool) -> f32 {
    let yd = af32(a);
    var isum = 0;
    var summ = 0;
    for (var j = 0u; j < 8u; j++) {
        var dj = 0;
        for (var i = 0u; i < 32u; i++) {
            let e = j * 32u + i;
            dj += k45_quant(qs, w + 16u, five, e) * ai8(a + 4u + e);
        }
        isum += i32(k4_scale(w + 4u, j)) * dj;
        summ += i32(k4_min(w + 4u, j)) * (ai16(a + 260u + 4u * j) + ai16(a + 262u + 4u * j));
    }
    return (wf16(w) * yd) * f32(isum) - (wf16(w + 2u) * yd) * f32(summ);
}
