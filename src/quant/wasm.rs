//! WebAssembly SIMD128 dot-product kernels.
//!
//! Compiled only when the crate is built with `-C target-feature=+simd128` (wasm has no run-time
//! feature detection; every current browser supports SIMD128). Same integer arithmetic as the
//! portable code: quants are widened to bytes, multiplied with `i16x8.extmul_{low,high}_i8x16`
//! (exact: |product| <= 128 * 127, two of them fit an i16), pairwise-summed into exact i32 lanes
//! and summed to the block's integer dot. The f32 part (scales, accumulation across blocks, the
//! 8 float lanes of F32/F16/BF16) is the portable code's, operation for operation, so a browser
//! computes bit-for-bit what the native build computes with its portable kernels (`LES_NO_SIMD=1`;
//! wasm has no deterministic fused multiply-add, so ggml's x86 FMA order is out of reach). The
//! layouts and formulas are those of the
//! portable modules (see `legacy.rs`, `kquants.rs`, and ggml's `ggml/src/ggml-cpu/quants.c`).
//! Formats without a kernel here use the portable code.
//!
//! Every kernel is an `unsafe fn`: callers (see `super::vec_dot_with`) guarantee that the slices
//! hold `n` elements' worth of blocks.

use super::kquants::{scales_mins_k4, QK_K};
use super::{f16_to_f32, DotFn, GgmlType};
use core::arch::wasm32::*;

/// The SIMD128 kernel for weight type `ty`, if there is one.
pub(super) fn kernel(ty: GgmlType) -> Option<DotFn> {
    use GgmlType::*;
    Some(match ty {
        F32 => dot_f32,
        F16 => dot_f16,
        BF16 => dot_bf16,
        Q4_0 => dot_q4_0_q8_0,
        Q4_1 => dot_q4_1_q8_1,
        Q5_0 => dot_q5_0_q8_0,
        Q8_0 => dot_q8_0_q8_0,
        Q4K => dot_q4_k_q8_k,
        Q6K => dot_q6_k_q8_k,
        _ => return None,
    })
}

#[inline]
#[target_feature(enable = "simd128")]
unsafe fn load(p: *const u8) -> v128 {
    v128_load(p as *const v128)
}

#[inline]
#[target_feature(enable = "simd128")]
unsafe fn f16s(p: *const u8) -> f32 {
    f16_to_f32(u16::from_le_bytes([*p, *p.add(1)]))
}

#[inline]
#[target_feature(enable = "simd128")]
unsafe fn f32s(p: *const u8) -> f32 {
    f32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)])
}

#[inline]
#[target_feature(enable = "simd128")]
unsafe fn hsum_f32(v: v128) -> f32 {
    (f32x4_extract_lane::<0>(v) + f32x4_extract_lane::<1>(v))
        + (f32x4_extract_lane::<2>(v) + f32x4_extract_lane::<3>(v))
}

/// Sum of the 16 signed byte products of `x` and `y` as 4 exact i32 lanes.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn dot16(x: v128, y: v128) -> v128 {
    i32x4_extadd_pairwise_i16x8(i16x8_add(i16x8_extmul_low_i8x16(x, y), i16x8_extmul_high_i8x16(x, y)))
}

/// 16 packed nibbles -> (low nibbles, high nibbles), elements 0..16 and 16..32 of a block.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn nibbles(p: *const u8) -> (v128, v128) {
    let t = load(p);
    (v128_and(t, u8x16_splat(0x0f)), u8x16_shr(t, 4))
}

// ---------------------------------------------------------------------------------------------
// F32 / F16 / BF16

/// Four IEEE halves (the low 16 bits of each u32 lane) -> f32, exactly (see `super::f16_to_f32`).
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn f16x4_to_f32(h: v128) -> v128 {
    let sign = i32x4_shl(v128_and(h, u32x4_splat(0x8000)), 16);
    let em = v128_and(h, u32x4_splat(0x7fff));
    let normal = f32x4_mul(i32x4_shl(em, 13), f32x4_splat(f32::from_bits(0x7780_0000)));
    let quiet = v128_and(u32x4_gt(em, u32x4_splat(0x7c00)), u32x4_splat(0x0040_0000));
    let special = v128_or(v128_or(u32x4_splat(0x7f80_0000), i32x4_shl(v128_and(em, u32x4_splat(0x3ff)), 13)), quiet);
    v128_or(sign, v128_bitselect(special, normal, u32x4_ge(em, u32x4_splat(0x7c00))))
}

/// Dot of two rows of `n` elements in the portable code's order (`float::dot_generic`): eight
/// lanes of separate multiply and add, reduced as ((0+4)+(1+5))+((2+6)+(3+7)), then the tail
/// one element at a time. `load8(p)` gives the 8 values at `p` as two f32x4; `get(p)` one value.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn float_dot(n: usize, w: &[u8], a: &[u8], esize: usize, load8: impl Fn(*const u8) -> (v128, v128), get: impl Fn(*const u8) -> f32) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (mut lo, mut hi) = (f32x4_splat(0.0), f32x4_splat(0.0));
    let mut i = 0;
    while i + 8 <= n {
        let (w0, w1) = load8(wp.add(i * esize));
        let (a0, a1) = load8(ap.add(i * esize));
        lo = f32x4_add(lo, f32x4_mul(w0, a0));
        hi = f32x4_add(hi, f32x4_mul(w1, a1));
        i += 8;
    }
    let mut sum = hsum_f32(f32x4_add(lo, hi));
    while i < n {
        sum += get(wp.add(i * esize)) * get(ap.add(i * esize));
        i += 1;
    }
    sum
}

#[target_feature(enable = "simd128")]
unsafe fn dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    float_dot(n, w, a, 4, |p| (load(p), load(p.add(16))), |p| f32s(p))
}

#[target_feature(enable = "simd128")]
unsafe fn dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    float_dot(n, w, a, 2, |p| {
        let h = load(p);
        (f16x4_to_f32(u32x4_extend_low_u16x8(h)), f16x4_to_f32(u32x4_extend_high_u16x8(h)))
    }, |p| f16s(p))
}

#[target_feature(enable = "simd128")]
unsafe fn dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    float_dot(n, w, a, 2, |p| {
        let h = load(p);
        (i32x4_shl(u32x4_extend_low_u16x8(h), 16), i32x4_shl(u32x4_extend_high_u16x8(h), 16))
    }, |p| f32::from_bits((u16::from_le_bytes([*p, *p.add(1)]) as u32) << 16))
}

// ---------------------------------------------------------------------------------------------
// 32-element blocks × Q8_0 / Q8_1

/// Sum of the four i32 lanes (exact, as the portable code's integer sums).
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn hsum_i32(v: v128) -> i32 {
    i32x4_extract_lane::<0>(v)
        .wrapping_add(i32x4_extract_lane::<1>(v))
        .wrapping_add(i32x4_extract_lane::<2>(v))
        .wrapping_add(i32x4_extract_lane::<3>(v))
}

/// `sumf += term(sumi, weight block, activation block)` over 32-element blocks: `qx(block)` gives
/// the 32 signed weight quants (elements 0..16, 16..32), `q8_at` where the activation's quants
/// start, and `term` the portable code's per-block f32 expression.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn blocks_32(
    nb: usize,
    wp: *const u8,
    wsize: usize,
    ap: *const u8,
    asize: usize,
    q8_at: usize,
    qx: impl Fn(*const u8) -> (v128, v128),
    term: impl Fn(i32, *const u8, *const u8) -> f32,
) -> f32 {
    let mut sumf = 0f32;
    for i in 0..nb {
        let (x, y) = (wp.add(i * wsize), ap.add(i * asize));
        let (q0, q1) = qx(x);
        let sumi = hsum_i32(i32x4_add(dot16(q0, load(y.add(q8_at))), dot16(q1, load(y.add(q8_at + 16)))));
        sumf += term(sumi, x, y);
    }
    sumf
}

#[target_feature(enable = "simd128")]
unsafe fn dot_q4_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    blocks_32(
        n / 32,
        w.as_ptr(),
        18,
        a.as_ptr(),
        34,
        2,
        |x| {
            let (lo, hi) = nibbles(x.add(2));
            (i8x16_sub(lo, i8x16_splat(8)), i8x16_sub(hi, i8x16_splat(8)))
        },
        |sumi, x, y| sumi as f32 * f16s(x) * f16s(y),
    )
}

#[target_feature(enable = "simd128")]
unsafe fn dot_q5_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    blocks_32(
        n / 32,
        w.as_ptr(),
        22,
        a.as_ptr(),
        34,
        2,
        |x| {
            // Byte i of each half gets bit i of `qh` (as 0x10) through a swizzle and a bit mask.
            let qh = u32x4_splat(u32::from_le_bytes([*x.add(2), *x.add(3), *x.add(4), *x.add(5)]));
            let bits = u8x16(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
            let h = |idx: v128| {
                let set = i8x16_ne(v128_and(i8x16_swizzle(qh, idx), bits), u8x16_splat(0));
                v128_and(set, u8x16_splat(0x10))
            };
            let h0 = h(u8x16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
            let h1 = h(u8x16(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
            let (lo, hi) = nibbles(x.add(6));
            (i8x16_sub(v128_or(lo, h0), i8x16_splat(16)), i8x16_sub(v128_or(hi, h1), i8x16_splat(16)))
        },
        |sumi, x, y| (f16s(x) * f16s(y)) * sumi as f32,
    )
}

#[target_feature(enable = "simd128")]
unsafe fn dot_q8_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    blocks_32(n / 32, w.as_ptr(), 34, a.as_ptr(), 34, 2, |x| (load(x.add(2)), load(x.add(18))), |sumi, x, y| sumi as f32 * (f16s(x) * f16s(y)))
}

/// `ggml_vec_dot_q4_1_q8_1`: `sum_blocks(d_w * d_a * sumi + m_w * s_a)`.
#[target_feature(enable = "simd128")]
unsafe fn dot_q4_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    blocks_32(n / 32, w.as_ptr(), 20, a.as_ptr(), 36, 4, |x| nibbles(x.add(4)), |sumi, x, y| (f16s(x) * f16s(y)) * sumi as f32 + f16s(x.add(2)) * f16s(y.add(2)))
}

// ---------------------------------------------------------------------------------------------
// K-quants × Q8_K (activation block: d f32 @0, qs @4, bsums @260)

#[target_feature(enable = "simd128")]
unsafe fn dot_q4_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut sumf = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(i * 144), ap.add(i * 292));
        let yd = f32s(y);
        let d = f16s(x) * yd;
        let dmin = f16s(x.add(2)) * yd;
        let (sc, mn) = scales_mins_k4(core::slice::from_raw_parts(x.add(4), 12));
        let bsum = |k: usize| i16::from_le_bytes([*y.add(260 + 2 * k), *y.add(261 + 2 * k)]) as i32;
        let summ: i32 = (0..8).map(|g| mn[g] as i32 * (bsum(2 * g) + bsum(2 * g + 1))).sum();
        let mut isum = i32x4_splat(0);
        for c in 0..4 {
            let (lo0, hi0) = nibbles(x.add(16 + 32 * c));
            let (lo1, hi1) = nibbles(x.add(32 + 32 * c));
            let q8 = y.add(4 + 64 * c);
            let s_lo = i32x4_add(dot16(lo0, load(q8)), dot16(lo1, load(q8.add(16))));
            let s_hi = i32x4_add(dot16(hi0, load(q8.add(32))), dot16(hi1, load(q8.add(48))));
            isum = i32x4_add(isum, i32x4_mul(s_lo, i32x4_splat(sc[2 * c] as i32)));
            isum = i32x4_add(isum, i32x4_mul(s_hi, i32x4_splat(sc[2 * c + 1] as i32)));
        }
        sumf += d * hsum_i32(isum) as f32 - dmin * summ as f32;
    }
    sumf
}

#[target_feature(enable = "simd128")]
unsafe fn dot_q6_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (m4, m3) = (u8x16_splat(0x0f), u8x16_splat(3));
    let mut sumf = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(i * 210), ap.add(i * 292));
        let mut isum = i32x4_splat(0);
        for h in 0..2 {
            for half in 0..2 {
                let ql0 = load(x.add(64 * h + 16 * half));
                let ql1 = load(x.add(64 * h + 32 + 16 * half));
                let qh = load(x.add(128 + 32 * h + 16 * half));
                let u = [
                    v128_or(v128_and(ql0, m4), i8x16_shl(v128_and(qh, m3), 4)),
                    v128_or(v128_and(ql1, m4), i8x16_shl(v128_and(u8x16_shr(qh, 2), m3), 4)),
                    v128_or(u8x16_shr(ql0, 4), i8x16_shl(v128_and(u8x16_shr(qh, 4), m3), 4)),
                    v128_or(u8x16_shr(ql1, 4), i8x16_shl(u8x16_shr(qh, 6), 4)),
                ];
                for (k, &uk) in u.iter().enumerate() {
                    let q = i8x16_sub(uk, i8x16_splat(32));
                    let s = dot16(q, load(y.add(4 + 128 * h + 32 * k + 16 * half)));
                    let scale = *x.add(192 + 8 * h + 2 * k + half) as i8 as i32;
                    isum = i32x4_add(isum, i32x4_mul(s, i32x4_splat(scale)));
                }
            }
        }
        sumf += (f16s(x.add(208)) * f32s(y)) * hsum_i32(isum) as f32;
    }
    sumf
}
