//! K-quants: the 256-element super-block formats Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and the
//! activation format Q8_K (portable code).
//!
//! Block layouts (`block_q2_K` … `block_q8_K` in `ggml/src/ggml-common.h`; f16/f32/i16 little-endian):
//!
//! | type | bytes | layout (byte offsets)                                                         |
//! |------|-------|-------------------------------------------------------------------------------|
//! | Q2_K | 84    | `scales[16]`@0 (low nibble scale, high nibble min), `qs[64]`@16, `d`@80, `dmin`@82 |
//! | Q3_K | 110   | `hmask[32]`@0, `qs[64]`@32, `scales[12]`@96 (16 × 6 bit), `d`@108               |
//! | Q4_K | 144   | `d`@0, `dmin`@2, `scales[12]`@4 (8 scales + 8 mins, 6 bit), `qs[128]`@16        |
//! | Q5_K | 176   | `d`@0, `dmin`@2, `scales[12]`@4, `qh[32]`@16, `qs[128]`@48                      |
//! | Q6_K | 210   | `ql[128]`@0, `qh[64]`@128, `scales: [i8; 16]`@192, `d`@208                      |
//! | Q8_K | 292   | `d: f32`@0, `qs: [i8; 256]`@4, `bsums: [i16; 16]`@260 (sums of 16 quants)       |
//!
//! Element order and bit packing follow `dequantize_row_q2_K` … `dequantize_row_q6_K`
//! (`ggml/src/ggml-quants.c`): in each 128-element half, Q2_K/Q3_K take 2-bit fields at shifts
//! 0, 2, 4, 6 of 32 `qs` bytes (Q3_K's third bit, inverted, from bit `4*half + shift/2` of
//! `hmask`), Q4_K/Q5_K take the low then high nibbles of 32-byte runs (Q5_K's fifth bit from
//! `qh`), Q6_K combines nibbles of `ql` with 2-bit fields of `qh`. Scales cover 16 elements
//! (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K). Activation quantization is `quantize_row_q8_K_ref`
//! (same file) and the dot products are `ggml_vec_dot_q2_K_q8_K_generic` …
//! `ggml_vec_dot_q6_K_q8_K_generic` (`ggml/src/ggml-cpu/quants.c`): exact i32 sums per
//! super-block (the min terms through Q8_K's `bsums`), scaled in f32 by `d_w * d_a`.

use super::f16_at;

pub(crate) const QK_K: usize = 256;

#[inline(always)]
fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

#[inline(always)]
fn i16_at(b: &[u8], i: usize) -> i32 {
    i16::from_le_bytes([b[i], b[i + 1]]) as i32
}

/// Q4_K/Q5_K: the 8 six-bit scales and 8 six-bit mins packed in 12 bytes
/// (`get_scale_min_k4` in `ggml/src/ggml-quants.c`).
#[inline(always)]
pub(crate) fn scales_mins_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// Q3_K: the 16 six-bit scales packed in 12 bytes, minus 32 (`dequantize_row_q3_K`): low
/// nibbles from bytes 0..8 (then their high nibbles), top two bits from bytes 8..12.
#[inline(always)]
pub(crate) fn scales_q3_k(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let lo = if i < 8 { s[i] & 0x0f } else { s[i - 8] >> 4 };
        let hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = ((lo | hi << 4) as i32 - 32) as i8;
    }
    out
}

/// Q2_K quants of one super-block, in element order (0..=3).
#[inline(always)]
fn quants_q2_k(b: &[u8], q: &mut [i8; QK_K]) {
    let qs = &b[16..80];
    for n in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                q[n * 128 + j * 32 + l] = ((qs[n * 32 + l] >> (2 * j)) & 3) as i8;
            }
        }
    }
}

/// Q3_K quants of one super-block, in element order (-4..=3).
#[inline(always)]
fn quants_q3_k(b: &[u8], q: &mut [i8; QK_K]) {
    let hm = &b[0..32];
    let qs = &b[32..96];
    for n in 0..2 {
        for j in 0..4 {
            let bit = 1u8 << (4 * n + j);
            for l in 0..32 {
                let low = ((qs[n * 32 + l] >> (2 * j)) & 3) as i8;
                q[n * 128 + j * 32 + l] = low - if hm[l] & bit != 0 { 0 } else { 4 };
            }
        }
    }
}

/// Q4_K (`qh = None`) or Q5_K quants of one super-block, in element order.
#[inline(always)]
fn quants_q45_k(qs: &[u8], qh: Option<&[u8]>, q: &mut [i8; QK_K]) {
    for c in 0..4 {
        for l in 0..32 {
            let (mut lo, mut hi) = (qs[c * 32 + l] & 0x0f, qs[c * 32 + l] >> 4);
            if let Some(qh) = qh {
                lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            q[c * 64 + l] = lo as i8;
            q[c * 64 + 32 + l] = hi as i8;
        }
    }
}

/// Q6_K quants of one super-block, in element order (-32..=31).
#[inline(always)]
fn quants_q6_k(b: &[u8], q: &mut [i8; QK_K]) {
    for n in 0..2 {
        let ql = &b[n * 64..n * 64 + 64];
        let qh = &b[128 + n * 32..128 + n * 32 + 32];
        for l in 0..32 {
            let h = qh[l];
            q[n * 128 + l] = ((ql[l] & 0x0f) | (h & 3) << 4) as i8 - 32;
            q[n * 128 + 32 + l] = ((ql[l + 32] & 0x0f) | ((h >> 2) & 3) << 4) as i8 - 32;
            q[n * 128 + 64 + l] = ((ql[l] >> 4) | ((h >> 4) & 3) << 4) as i8 - 32;
            q[n * 128 + 96 + l] = ((ql[l + 32] >> 4) | ((h >> 6) & 3) << 4) as i8 - 32;
        }
    }
}

pub(super) fn dequant_q2_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    for (b, y) in src.chunks_exact(84).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 80);
        let dmin = f16_at(b, 82);
        quants_q2_k(b, &mut q);
        for (g, (yg, qg)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let sc = b[g];
            let dl = d * (sc & 0x0f) as f32;
            let ml = dmin * (sc >> 4) as f32;
            for (v, &qv) in yg.iter_mut().zip(qg) {
                *v = dl * qv as f32 - ml;
            }
        }
    }
}

pub(super) fn dequant_q3_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    for (b, y) in src.chunks_exact(110).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 108);
        let sc = scales_q3_k(&b[96..108]);
        quants_q3_k(b, &mut q);
        for (g, (yg, qg)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let dl = d * sc[g] as f32;
            for (v, &qv) in yg.iter_mut().zip(qg) {
                *v = dl * qv as f32;
            }
        }
    }
}

fn dequant_q45_k(src: &[u8], dst: &mut [f32], five: bool) {
    let (bytes, qs_at) = if five { (176, 48) } else { (144, 16) };
    let mut q = [0i8; QK_K];
    for (b, y) in src.chunks_exact(bytes).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let (sc, mn) = scales_mins_k4(&b[4..16]);
        quants_q45_k(&b[qs_at..qs_at + 128], five.then(|| &b[16..48]), &mut q);
        for (g, (yg, qg)) in y.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
            let dl = d * sc[g] as f32;
            let ml = dmin * mn[g] as f32;
            for (v, &qv) in yg.iter_mut().zip(qg) {
                *v = dl * qv as f32 - ml;
            }
        }
    }
}

pub(super) fn dequant_q4_k(src: &[u8], dst: &mut [f32]) {
    dequant_q45_k(src, dst, false)
}

pub(super) fn dequant_q5_k(src: &[u8], dst: &mut [f32]) {
    dequant_q45_k(src, dst, true)
}

pub(super) fn dequant_q6_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    for (b, y) in src.chunks_exact(210).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 208);
        quants_q6_k(b, &mut q);
        for (g, (yg, qg)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let dl = d * b[192 + g] as i8 as f32;
            for (v, &qv) in yg.iter_mut().zip(qg) {
                *v = dl * qv as f32;
            }
        }
    }
}

pub(super) fn dequant_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(292).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32_at(b, 0);
        for (v, &q) in y.iter_mut().zip(&b[4..260]) {
            *v = d * q as i8 as f32;
        }
    }
}

/// `quantize_row_q8_K_ref`: `d = max / -127` where `max` is the first element of largest
/// magnitude, `q = min(127, round_half_even(x * -127 / max))`, `bsums` = sums of 16 quants.
/// An all-zero block is all-zero bytes.
pub(super) fn quantize_q8_k(x: &[f32], out: &mut [u8]) {
    for (xb, b) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(292)) {
        let mut amax = 0f32;
        let mut max = 0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            b.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b[4..260].iter_mut().zip(xb) {
            // ggml's nearest_int (adding 1.5 * 2^23) rounds half to even.
            let r = ((iscale * v).round_ties_even() as i32).min(127);
            *q = r as i8 as u8;
        }
        for g in 0..16 {
            let s: i32 = b[4 + 16 * g..4 + 16 * g + 16].iter().map(|&q| q as i8 as i32).sum();
            b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

/// Integer dots of 16 groups of 16 quants with the Q8_K quants `q8`.
#[inline(always)]
fn group16_dots(q: &[i8; QK_K], q8: &[u8]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (o, (qg, yg)) in out.iter_mut().zip(q.chunks_exact(16).zip(q8.chunks_exact(16))) {
        *o = qg.iter().zip(yg).map(|(&a, &b)| a as i32 * b as i8 as i32).sum();
    }
    out
}

/// `ggml_vec_dot_q2_K_q8_K`: `d_a * (d * sum(scale * dot) - dmin * sum(min * bsum))`.
pub(super) fn dot_q2_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(84).zip(a.chunks_exact(292)).take(n / QK_K) {
        let yd = f32_at(y, 0);
        let dall = yd * f16_at(x, 80);
        let dmin = yd * f16_at(x, 82);
        quants_q2_k(x, &mut q);
        let dots = group16_dots(&q, &y[4..260]);
        let (mut isum, mut summs) = (0i32, 0i32);
        for g in 0..16 {
            isum += (x[g] & 0x0f) as i32 * dots[g];
            summs += (x[g] >> 4) as i32 * i16_at(y, 260 + 2 * g);
        }
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

/// `ggml_vec_dot_q3_K_q8_K`: `d_w * d_a * sum((scale - 32) * dot)`.
pub(super) fn dot_q3_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(110).zip(a.chunks_exact(292)).take(n / QK_K) {
        let d = f16_at(x, 108) * f32_at(y, 0);
        let sc = scales_q3_k(&x[96..108]);
        quants_q3_k(x, &mut q);
        let dots = group16_dots(&q, &y[4..260]);
        let isum: i32 = sc.iter().zip(&dots).map(|(&s, &t)| s as i32 * t).sum();
        sumf += d * isum as f32;
    }
    sumf
}

fn dot_q45_k(n: usize, w: &[u8], a: &[u8], five: bool) -> f32 {
    let (bytes, qs_at) = if five { (176, 48) } else { (144, 16) };
    let mut q = [0i8; QK_K];
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(bytes).zip(a.chunks_exact(292)).take(n / QK_K) {
        let yd = f32_at(y, 0);
        let d = f16_at(x, 0) * yd;
        let dmin = f16_at(x, 2) * yd;
        let (sc, mn) = scales_mins_k4(&x[4..16]);
        quants_q45_k(&x[qs_at..qs_at + 128], five.then(|| &x[16..48]), &mut q);
        let dots = group16_dots(&q, &y[4..260]);
        let (mut isum, mut summ) = (0i32, 0i32);
        for g in 0..8 {
            isum += sc[g] as i32 * (dots[2 * g] + dots[2 * g + 1]);
            summ += mn[g] as i32 * (i16_at(y, 260 + 4 * g) + i16_at(y, 262 + 4 * g));
        }
        sumf += d * isum as f32 - dmin * summ as f32;
    }
    sumf
}

/// `ggml_vec_dot_q4_K_q8_K`: `d * sum(scale * dot) - dmin * sum(min * bsum)`.
pub(super) fn dot_q4_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_q45_k(n, w, a, false)
}

/// `ggml_vec_dot_q5_K_q8_K`: as Q4_K with 5-bit quants.
pub(super) fn dot_q5_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_q45_k(n, w, a, true)
}

/// `ggml_vec_dot_q6_K_q8_K`: `d_w * d_a * sum(scale * dot)`.
pub(super) fn dot_q6_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(210).zip(a.chunks_exact(292)).take(n / QK_K) {
        let d = f16_at(x, 208) * f32_at(y, 0);
        quants_q6_k(x, &mut q);
        let dots = group16_dots(&q, &y[4..260]);
        let isum: i32 = (0..16).map(|g| x[192 + g] as i8 as i32 * dots[g]).sum();
        sumf += d * isum as f32;
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_k_scale_sign_and_sums() {
        // The element of largest magnitude maps to -127 and d = max / -127.
        let mut x = vec![0f32; QK_K];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 - 100.0) / 50.0;
        }
        x[7] = -10.0;
        let mut out = vec![0u8; 292];
        quantize_q8_k(&x, &mut out);
        let d = f32_at(&out, 0);
        assert_eq!(d, 1.0 / (-127.0f32 / -10.0));
        assert_eq!(out[4 + 7] as i8, -127);
        for g in 0..16 {
            let s: i32 = out[4 + 16 * g..20 + 16 * g].iter().map(|&q| q as i8 as i32).sum();
            assert_eq!(i16_at(&out, 260 + 2 * g), s);
        }
    }

    #[test]
    fn q3_k_scale_unpacking() {
        // Scale i = 37 (unsigned 6 bit 5 | 2 << 4 = 37) for all 16 -> 37 - 32 = 5.
        let mut s = [0u8; 12];
        for b in s.iter_mut().take(8) {
            *b = 0x55;
        }
        for b in s.iter_mut().skip(8) {
            *b = 0b1010_1010;
        }
        assert_eq!(scales_q3_k(&s), [5i8; 16]);
    }
}
