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
// Sub-block j (32 elements) of a Q4_K/Q5_K super-block: the low (j even) or high (j odd) nibbles
// of qs[32 * (j / 2) ..]; Q5_K adds bit j of qh[l] as the fifth bit.
fn k45_dot(w: u32, a: u32, qs: u32, five: bool) -> f32 {
    let yd = af32(a);
    var isum = 0;
    var summ = 0;
    for (var j = 0u; j < 8u; j++) {
        var dj = 0;
        for (var l = 0u; l < 32u; l += 4u) {
            var q = (ww(qs + (j / 2u) * 32u + l) >> (4u * (j % 2u))) & 0x0f0f0f0fu;
            if (five) { q |= ((ww(w + 16u + l) >> j) & 0x01010101u) << 4u; }
            dj += dot4I8Packed(q, aw(a + 4u + j * 32u + l));
        }
        isum += i32(k4_scale(w + 4u, j)) * dj;
        summ += i32(k4_min(w + 4u, j)) * (ai16(a + 260u + 4u * j) + ai16(a + 262u + 4u * j));
    }
    return keep((wf16(w) * yd) * f32(isum)) - keep((wf16(w + 2u) * yd) * f32(summ));
}
