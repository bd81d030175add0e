//! f32 work four lanes at a time on wasm SIMD128, with the bits of the scalar code it replaces.
//!
//! The portable kernels fuse multiply-adds (`f32::mul_add`: one rounding), as ggml's x86 builds
//! do. Wasm has no deterministic FMA instruction: `f32::mul_add` becomes a call to the software
//! `fmaf`, one element at a time. [`fma4`] gives the same single rounding to four lanes at once:
//! - where the browser's `f32x4.relaxed_madd` is fused (checked once: [`relaxed_madd_is_fused`];
//!   V8 fuses it on x86-64 with FMA3 and on ARM64, the relaxed-SIMD proposal lets an engine
//!   choose), that one instruction;
//! - otherwise in f64: `a · b` of two f32 is exact in f64 (24 + 24 significant bits), the sum
//!   with `c` rounds once to f64, and that f64 rounded to f32 is the FMA's single rounding except
//!   where the f64 sum sits exactly halfway between two f32 (low 29 bits `0x1000_0000`: musl's
//!   `fmaf` test) or is an f32 subnormal (a coarser grid); those four lanes are recomputed by
//!   `f32::mul_add`.

#![cfg(all(target_arch = "wasm32", target_feature = "simd128"))]

use core::arch::wasm32::*;

/// Whether `f32x4.relaxed_madd` rounds once here: 0 unknown, 1 fused, 2 not (or no relaxed SIMD).
static FUSED: core::sync::atomic::AtomicU8 = core::sync::atomic::AtomicU8::new(0);

/// Whether this engine's `f32x4.relaxed_madd` is a fused multiply-add (always false in the
/// SIMD128 builds). `(1 + 2⁻¹²)² − (1 + 2⁻¹¹)` is 2⁻²⁴ rounded once; rounding the product first
/// gives a tie (to even: 1 + 2⁻¹¹) and then 0.
pub fn relaxed_madd_is_fused() -> bool {
    use core::sync::atomic::Ordering::Relaxed;
    match FUSED.load(Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let fused = probe_fused();
            FUSED.store(if fused { 1 } else { 2 }, Relaxed);
            fused
        }
    }
}

#[cfg(target_feature = "relaxed-simd")]
fn probe_fused() -> bool {
    let a = core::hint::black_box(f32x4_splat(f32::from_bits(0x3f80_0800)));
    let c = core::hint::black_box(f32x4_splat(-f32::from_bits(0x3f80_1000)));
    let r = f32x4_relaxed_madd(a, a, c);
    u32x4_all_true(i32x4_eq(r, u32x4_splat(0x3380_0000))) // 2⁻²⁴ in every lane
}

#[cfg(not(target_feature = "relaxed-simd"))]
fn probe_fused() -> bool {
    false
}

/// `fma(a, b, c)` in each lane: one rounding, as `f32::mul_add`. `fused` is
/// [`relaxed_madd_is_fused`] (looked up once by the caller).
#[inline(always)]
pub fn fma4(a: v128, b: v128, c: v128, fused: bool) -> v128 {
    #[cfg(target_feature = "relaxed-simd")]
    if fused {
        return f32x4_relaxed_madd(a, b, c);
    }
    let _ = fused;
    let hi = |v: v128| f64x2_promote_low_f32x4(i32x4_shuffle::<2, 3, 2, 3>(v, v));
    let lo = f64x2_add(f64x2_mul(f64x2_promote_low_f32x4(a), f64x2_promote_low_f32x4(b)), f64x2_promote_low_f32x4(c));
    let hi = f64x2_add(f64x2_mul(hi(a), hi(b)), hi(c));
    let (mask, tie, tiny) = (i64x2_splat(0x1fff_ffff), i64x2_splat(0x1000_0000), f64x2_splat(f32::MIN_POSITIVE as f64));
    // Halfway cases, and f32 subnormals other than zero (`0 < |s| < 2⁻¹²⁶`).
    let odd = |s: v128| v128_or(i64x2_eq(v128_and(s, mask), tie), v128_and(f64x2_lt(f64x2_abs(s), tiny), f64x2_ne(s, f64x2_splat(0.0))));
    if v128_any_true(v128_or(odd(lo), odd(hi))) {
        let f = |v: v128| [f32x4_extract_lane::<0>(v), f32x4_extract_lane::<1>(v), f32x4_extract_lane::<2>(v), f32x4_extract_lane::<3>(v)];
        let (a, b, c) = (f(a), f(b), f(c));
        return f32x4(a[0].mul_add(b[0], c[0]), a[1].mul_add(b[1], c[1]), a[2].mul_add(b[2], c[2]), a[3].mul_add(b[3], c[3]));
    }
    i32x4_shuffle::<0, 1, 4, 5>(f32x4_demote_f64x2_zero(lo), f32x4_demote_f64x2_zero(hi))
}

/// `ops::ggml_expf_nb` in four lanes, the same bits.
#[inline(always)]
pub fn expf_nb4(x: v128, fused: bool) -> v128 {
    let k = |b: u32| f32x4_splat(f32::from_bits(b));
    let r = k(0x4b40_0000);
    let z = fma4(x, k(0x3fb8_aa3b), r, fused);
    let n = f32x4_sub(z, r);
    let nn = f32x4_neg(n);
    let b = fma4(nn, k(0x3f31_7200), x, fused);
    let b = fma4(nn, k(0x35bf_be8e), b, fused);
    let u = f32x4_mul(b, b);
    let p = fma4(k(0x3c07_2010), b, k(0x3d2b_9f17), fused);
    let q = fma4(k(0x3e2a_af33), b, k(0x3eff_fedb), fused);
    let lin = fma4(k(0x3f7f_fff6), b, f32x4_splat(1.0), fused);
    let j = fma4(fma4(p, u, q, fused), u, lin, fused);
    // `n.clamp(-256, 256) as i32`: NaN stays NaN through min/max and truncates to 0.
    let ni = i32x4_trunc_sat_f32x4(f32x4_min(f32x4_max(n, f32x4_splat(-256.0)), f32x4_splat(256.0)));
    // `ni / 2` rounds toward zero; `ni - ni / 2` is the rest.
    let a = i32x4_shr(i32x4_add(ni, u32x4_shr(ni, 31)), 1);
    let c = i32x4_sub(ni, a);
    let scale = |e: v128| i32x4_shl(i32x4_max(i32x4_min(i32x4_add(e, i32x4_splat(127)), i32x4_splat(254)), i32x4_splat(1)), 23);
    let y = f32x4_mul(f32x4_mul(j, scale(a)), scale(c));
    let big = v128_bitselect(f32x4_splat(0.0), f32x4_splat(f32::INFINITY), f32x4_le(n, f32x4_splat(0.0)));
    v128_bitselect(big, y, f32x4_gt(f32x4_abs(n), f32x4_splat(192.0)))
}

/// `ops::swiglu` four elements at a time (the same bits): `g / (1 + e^-g) · u`, over the
/// longest prefix of whole groups of four; returns how many elements it wrote (the caller does
/// the rest).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
    let n = out.len().min(gate.len()).min(up.len());
    let fused = relaxed_madd_is_fused();
    let one = f32x4_splat(1.0);
    let mut i = 0;
    while i + 4 <= n {
        // SAFETY: `i + 4 <= n` elements of all three slices.
        unsafe {
            let g = v128_load(gate.as_ptr().add(i) as *const v128);
            let u = v128_load(up.as_ptr().add(i) as *const v128);
            let e = expf_nb4(f32x4_neg(g), fused);
            v128_store(out.as_mut_ptr().add(i) as *mut v128, f32x4_mul(f32x4_div(g, f32x4_add(one, e)), u));
        }
        i += 4;
    }
    i
}

/// `x` rounded to the nearest half (ties to even) and widened back, in each lane:
/// `f16::from_f32(x).to_f32()`. Where every lane rounds to a normal half (2⁻¹⁴ <= |x| < 65520)
/// or is ±0 (attention's accumulator before its first position) the 13 low mantissa bits are
/// rounded off in place; otherwise lane by lane through `half`.
#[inline(always)]
pub fn round_half(x: v128) -> v128 {
    let a = v128_and(x, u32x4_splat(0x7fff_ffff));
    // `a - 113·2²³ < 0x477f_f000 - 113·2²³` (unsigned): 2⁻¹⁴ <= |x| < 65520 in one compare.
    let normal = u32x4_lt(i32x4_sub(a, u32x4_splat(113 << 23)), u32x4_splat(0x477f_f000 - (113 << 23)));
    let fast = v128_or(normal, i32x4_eq(a, u32x4_splat(0)));
    if !i32x4_all_true(fast) {
        let h = |v: f32| half::f16::from_f32(v).to_f32();
        return f32x4(h(f32x4_extract_lane::<0>(x)), h(f32x4_extract_lane::<1>(x)), h(f32x4_extract_lane::<2>(x)), h(f32x4_extract_lane::<3>(x)));
    }
    let odd = v128_and(u32x4_shr(x, 13), u32x4_splat(1));
    v128_and(i32x4_add(i32x4_add(x, u32x4_splat(0xfff)), odd), u32x4_splat(!0x1fff))
}

/// Four halves at `p` as f32 (exact).
#[inline(always)]
unsafe fn load_halves(p: *const half::f16) -> v128 {
    crate::quant::f16x8_to_f32(v128_load64_zero(p as *const u64)).0
}

/// ggml's `ggml_vec_mad_f16` on an accumulator of halves held as f32 (`acc[i]` always a half's
/// value): `acc[i] = half(fma(v[i], s, acc[i]))`, the bits of the f16 accumulator's
/// `f16::from_f32(v.to_f32().mul_add(s, acc.to_f32()))`.
pub fn mad_halves(acc: &mut [f32], v: &[half::f16], s: f32, fused: bool) {
    let n = acc.len().min(v.len());
    let sv = f32x4_splat(s);
    let mut i = 0;
    while i + 4 <= n {
        // SAFETY: `i + 4 <= n` elements of both slices.
        unsafe {
            let pa = acc.as_mut_ptr().add(i) as *mut v128;
            v128_store(pa, round_half(fma4(load_halves(v.as_ptr().add(i)), sv, v128_load(pa), fused)));
        }
        i += 4;
    }
    for j in i..n {
        acc[j] = half::f16::from_f32(v[j].to_f32().mul_add(s, acc[j])).to_f32();
    }
}

/// ggml's `ggml_vec_scale_f16` on an accumulator of halves held as f32: `acc[i] = half(acc[i] · s)`.
pub fn scale_halves(acc: &mut [f32], s: f32) {
    let sv = f32x4_splat(s);
    let mut chunks = acc.chunks_exact_mut(4);
    for c in &mut chunks {
        // SAFETY: four elements.
        unsafe {
            let p = c.as_mut_ptr() as *mut v128;
            v128_store(p, round_half(f32x4_mul(v128_load(p), sv)));
        }
    }
    for a in chunks.into_remainder() {
        *a = half::f16::from_f32(*a * s).to_f32();
    }
}
