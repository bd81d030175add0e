// A decode token's router on the device (issue 55 item 3), equal bit for bit to the host's
// `model::route` (src/model/mod.rs; llama.cpp `build_moe_ffn`, src/llama-graph.cpp):
//   Softmax (gating 0): probabilities = softmax(logits) as `cpu::ops::softmax` computes it
//     (ggml `ggml_vec_soft_max_f32`): e = ggml_expf(x - max) over blocks of 16, each block summed
//     in f32 in `reduce16`'s order and added to an f64 sum; the tail past a multiple of 16 with
//     glibc's expf, each added to the f64 sum; inv = f32(1 / sum) (the division in f64); p = e * inv.
//     Then top-k of p (ties: the lower index first), weights p[top], normalised (norm_topk) by
//     their f64 sum rounded to f32 (at least 2^-14), as ggml_sum_rows + ggml_div.
//   Sigmoid (gating 2, smallthinker): p = 1 / (1 + expf(-x)) (glibc's expf, the division
//     rounded to nearest), then top-k and the weights as for Softmax.
//   SoftmaxWeight (gating 1, gpt-oss): top-k of the raw logits, then the softmax of those k
//     values (all "tail": glibc's expf).
//   With a selection bias (B, lfm2moe's `exp_probs_b`): top-k of p + B, the weights still p.
//   Then the weights times `scale` (when it is not 0 or 1).
// WGSL has no f64: the sums and the reciprocal are integer arithmetic on the f64 encoding
// (positive values only), rounded to nearest even as IEEE-754 does.
// One invocation does it all (n_expert ≤ 256). Output, at word `out_off` of R (one 256-byte
// region per MoE layer, read by the expert kernels through a dynamic offset):
//   [0, 2k): (slot byte offset, rank r) for r < k: the down projection's list;
//   [2k, 4k): (slot byte offset + up_delta, k + r): with the first 2k words, gate+up's list;
//   [4k, 5k): the k weights' bits (combine_w); [5k, 7k): (rank, expert) (add_rows: gpt-oss's
//   biases); [7k, 8k): the expert ids (for the host); word 8k: 1 if an expert had no slot.

struct Params {
    n_expert: u32,
    k: u32,
    gating: u32,
    norm_topk: u32,
    scale: u32,
    table_off: u32,
    out_off: u32,
    up_delta: u32,
    logits_off: u32,
    zero: u32,
    has_bias: u32, // 1: add B (the selection bias, `exp_probs_b`) to the probabilities for top-k only
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> L: array<f32>;
@group(0) @binding(1) var<storage, read> SLOT: array<u32>;
@group(0) @binding(2) var<storage, read_write> R: array<u32>;
@group(0) @binding(3) var<storage, read> B: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

// A positive f64 as (exponent field, significand with the implicit bit: hi 21 bits, lo 32).
struct F64 {
    e: i32,
    hi: u32,
    lo: u32,
}

// An f32 (≥ 0) widened to f64 (exact).
fn f64_from_f32(x: f32) -> F64 {
    let b = bitcast<u32>(x);
    var e = i32((b >> 23u) & 0xffu);
    var m = b & 0x7fffffu;
    if (e == 0) {
        if (m == 0u) { return F64(0, 0u, 0u); }
        // Subnormal: normalise.
        e = 1;
        while ((m & 0x800000u) == 0u) { m = m << 1u; e -= 1; }
        m = m & 0x7fffffu;
    }
    // 52-bit fraction = m << 29: hi gets m's top 20 bits, lo its low 3 bits at the top.
    return F64(e - 127 + 1023, (m >> 3u) | 0x100000u, (m & 7u) << 29u);
}

// (hi, lo) >> s with the bits shifted out OR-ed into bit 0 (sticky); s < 64.
fn shr_sticky(hi: u32, lo: u32, s: u32) -> vec2<u32> {
    if (s == 0u) { return vec2<u32>(hi, lo); }
    if (s >= 32u) {
        let t = s - 32u;
        var out_lo = hi;
        var lost = lo;
        if (t > 0u) {
            out_lo = hi >> t;
            lost = lost | (hi << (32u - t));
        }
        return vec2<u32>(0u, out_lo | select(0u, 1u, lost != 0u));
    }
    let lost = lo << (32u - s);
    return vec2<u32>(hi >> s, ((lo >> s) | (hi << (32u - s))) | select(0u, 1u, lost != 0u));
}

// a + b for positive f64 (or zero), rounded to nearest even.
fn f64_add(a: F64, b: F64) -> F64 {
    if (a.hi == 0u && a.lo == 0u) { return b; }
    if (b.hi == 0u && b.lo == 0u) { return a; }
    var x = a;
    var y = b;
    if (y.e > x.e) { x = b; y = a; }
    // Three guard bits: significands << 3 (56 bits in hi:lo).
    let xs = vec2<u32>((x.hi << 3u) | (x.lo >> 29u), x.lo << 3u);
    var ys = vec2<u32>((y.hi << 3u) | (y.lo >> 29u), y.lo << 3u);
    let d = u32(x.e - y.e);
    if (d >= 60u) {
        ys = vec2<u32>(0u, 1u);
    } else {
        ys = shr_sticky(ys.x, ys.y, d);
    }
    var lo = xs.y + ys.y;
    var hi = xs.x + ys.x + select(0u, 1u, lo < xs.y);
    var e = x.e;
    // A carry past bit 55 (the implicit bit at 55 after << 3): one more exponent.
    if ((hi >> 24u) != 0u) {
        let s = shr_sticky(hi, lo, 1u);
        hi = s.x;
        lo = s.y;
        e += 1;
    }
    return round53(hi, lo, e, false);
}

// A 56-bit significand (hi:lo, leading bit 55) with exponent field `e`, its three low bits
// rounded off (nearest, ties to even; `sticky`: something nonzero below them).
fn round53(hi: u32, lo: u32, e: i32, sticky: bool) -> F64 {
    let g = lo & 7u;
    var mlo = (lo >> 3u) | (hi << 29u);
    var mhi = hi >> 3u;
    var ex = e;
    if (g > 4u || (g == 4u && (sticky || (mlo & 1u) == 1u))) {
        mlo += 1u;
        if (mlo == 0u) { mhi += 1u; }
        if ((mhi >> 21u) != 0u) {
            mlo = (mlo >> 1u) | (mhi << 31u);
            mhi = mhi >> 1u;
            ex += 1;
        }
    }
    return F64(ex, mhi, mlo);
}

// Round a 53-bit significand (hi 21 bits with the implicit one, lo 32) at exponent field `e`
// to an f32 (a normal one: the values here are within f32's range), nearest even.
fn f32_from_f64(v: F64) -> f32 {
    if (v.hi == 0u && v.lo == 0u) { return 0.0; }
    // Keep 24 bits: hi's 21 and lo's top 3; the 29 below decide the rounding.
    var m = (v.hi << 3u) | (v.lo >> 29u);
    let rest = v.lo & 0x1fffffffu;
    let half = 0x10000000u;
    var e = v.e - 1023 + 127;
    if (rest > half || (rest == half && (m & 1u) == 1u)) {
        m += 1u;
        if ((m >> 24u) != 0u) { m = m >> 1u; e += 1; }
    }
    return bitcast<f32>((u32(e) << 23u) | (m & 0x7fffffu));
}

// f32(1 / s) for a positive f64 s ≥ 2^-126: the quotient rounded to f64 (nearest even), then
// to f32 (nearest even), as `(1.0 / sum) as f32` does.
fn recip_f32(s: F64) -> f32 {
    // s = M · 2^(e - 1075), M in [2^52, 2^53). 1 / s = 2^(1075 - e) / M: long division of
    // 2^k by M, 56 quotient bits (the first is 1 after the leading step), remainder sticky.
    var rhi = 0u;
    var rlo = 1u;
    var qhi = 0u;
    var qlo = 0u;
    var started = false;
    var bits = 0u;
    var shifts = 0i;
    loop {
        // rem >= M ?
        let ge = rhi > s.hi || (rhi == s.hi && rlo >= s.lo);
        if (ge) {
            let nlo = rlo - s.lo;
            rhi = rhi - s.hi - select(0u, 1u, rlo < s.lo);
            rlo = nlo;
            started = true;
        }
        if (started) {
            qhi = (qhi << 1u) | (qlo >> 31u);
            qlo = (qlo << 1u) | select(0u, 1u, ge);
            bits += 1u;
            if (bits == 56u) { break; }
        }
        // rem *= 2
        rhi = (rhi << 1u) | (rlo >> 31u);
        rlo = rlo << 1u;
        shifts += 1;
    }
    // q = floor(2^shifts / M), 56 bits (the leading one at bit 55), the remainder sticky; the
    // value 1 / s = 2^(1075 - e) / M ≈ q · 2^(1075 - e - shifts), so its leading bit has the
    // exponent 1075 - e - shifts + 55. Rounded to 53 bits, then to f32.
    let sticky = (rhi | rlo) != 0u;
    return f32_from_f64(round53(qhi, qlo, 1075 - s.e - shifts + 55 + 1023, sticky));
}

// Sum of 16 values in `cpu::ops::reduce16`'s order.
fn reduce16(v: array<f32, 16>) -> f32 {
    var t: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) { t[i] = keep(v[i + 8u] + v[i]); }
    let u0 = keep(t[4] + t[0]);
    let u1 = keep(t[5] + t[1]);
    let u2 = keep(t[6] + t[2]);
    let u3 = keep(t[7] + t[3]);
    return keep(keep(u0 + u2) + keep(u1 + u3));
}

var<private> probs: array<f32, 256>;
// What top-k ranks: the probabilities, plus the selection bias where there is one.
var<private> sel: array<f32, 256>;
var<private> chosen: array<u32, 8>;
var<private> wts: array<f32, 8>;

// Top-k of probs[0..n] into `chosen`: the largest first, ties to the lower index.
fn top_k(n: u32, k: u32) {
    for (var i = 0u; i < n; i++) {
        sel[i] = probs[i];
        if (P.has_bias != 0u) { sel[i] = keep(probs[i] + B[i]); }
    }
    for (var r = 0u; r < k; r++) {
        var best = 0xffffffffu;
        for (var i = 0u; i < n; i++) {
            var taken = false;
            for (var j = 0u; j < r; j++) { if (chosen[j] == i) { taken = true; } }
            if (taken) { continue; }
            if (best == 0xffffffffu || sel[i] > sel[best]) { best = i; }
        }
        chosen[r] = best;
    }
}

@compute @workgroup_size(1)
fn main() {
    let n = P.n_expert;
    let k = P.k;
    if (P.gating != 1u) {
      if (P.gating == 2u) {
        for (var i = 0u; i < n; i++) { probs[i] = div_rn(1.0, keep(1.0 + expf_glibc(-L[P.logits_off + i]))); }
      } else {
        var mx = -3.4028234663852886e38;
        for (var i = 0u; i < n; i++) { mx = max(mx, L[P.logits_off + i]); }
        var sum = F64(0, 0u, 0u);
        let n16 = n & ~15u;
        for (var b = 0u; b < n16; b += 16u) {
            var blk: array<f32, 16>;
            for (var j = 0u; j < 16u; j++) {
                let e = ggml_expf(keep(L[P.logits_off + b + j] - mx));
                probs[b + j] = e;
                blk[j] = e;
            }
            sum = f64_add(sum, f64_from_f32(reduce16(blk)));
        }
        for (var i = n16; i < n; i++) {
            let e = expf_glibc(keep(L[P.logits_off + i] - mx));
            probs[i] = e;
            sum = f64_add(sum, f64_from_f32(e));
        }
        let inv = recip_f32(sum);
        for (var i = 0u; i < n; i++) { probs[i] = keep(probs[i] * inv); }
      }
        top_k(n, k);
        var s = F64(0, 0u, 0u);
        for (var r = 0u; r < k; r++) {
            wts[r] = probs[chosen[r]];
            s = f64_add(s, f64_from_f32(wts[r]));
        }
        if (P.norm_topk != 0u) {
            let d = max(f32_from_f64(s), 6.103515625e-5);
            for (var r = 0u; r < k; r++) { wts[r] = div_rn(wts[r], d); }
        }
    } else {
        for (var i = 0u; i < n; i++) { probs[i] = L[P.logits_off + i]; }
        top_k(n, k);
        var mx = -3.4028234663852886e38;
        for (var r = 0u; r < k; r++) { mx = max(mx, probs[chosen[r]]); }
        var sum = F64(0, 0u, 0u);
        for (var r = 0u; r < k; r++) {
            let e = expf_glibc(keep(probs[chosen[r]] - mx));
            wts[r] = e;
            sum = f64_add(sum, f64_from_f32(e));
        }
        let inv = recip_f32(sum);
        for (var r = 0u; r < k; r++) { wts[r] = keep(wts[r] * inv); }
    }
    let scale = bitcast<f32>(P.scale);
    if (scale != 0.0 && scale != 1.0) {
        for (var r = 0u; r < k; r++) { wts[r] = keep(wts[r] * scale); }
    }
    var missing = 0u;
    let o = P.out_off;
    for (var r = 0u; r < k; r++) {
        let ex = chosen[r];
        var slot = SLOT[P.table_off + ex];
        if (slot == 0xffffffffu) { missing = 1u; slot = 0u; }
        R[o + 2u * r] = slot;
        R[o + 2u * r + 1u] = r;
        R[o + 2u * k + 2u * r] = slot + P.up_delta;
        R[o + 2u * k + 2u * r + 1u] = k + r;
        R[o + 4u * k + r] = bitcast<u32>(wts[r]);
        R[o + 5u * k + 2u * r] = r;
        R[o + 5u * k + 2u * r + 1u] = ex;
        R[o + 7u * k + r] = ex;
    }
    R[o + 8u * k] = missing;
}
