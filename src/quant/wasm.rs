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
//! **Relaxed SIMD** (`-C target-feature=+relaxed-simd`, the `pkg*-relaxed` builds that browsers
//! with the proposal get): the byte products go through `i32x4.relaxed_dot_i8x16_i7x16_add_s`
//! (one instruction for 16 products instead of four). Its result is implementation-defined only
//! when a lane of the second operand has its top bit set, so the kernels always pass the
//! *unsigned* quants there (Q4 nibbles 0..=15, Q5 0..=31, Q6 0..=63) and the activation's signed
//! bytes as the first; the offset (8, 16, 32 per quant) comes back as `offset * sum(activation)`
//! (a dot with ones, or Q8_K's `bsums`). Products of |128 · 63| pair up within an i16 even where
//! the pairs saturate (x86 `pmaddubsw`), so the integer sums are exact and the relaxed build
//! computes the same bits as the SIMD128 one. Q8_0 × Q8_0 (both operands signed) keeps SIMD128.
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

/// Four dots at once, `out[i] = w[i] · a[i]` (`(n, weight rows, activation rows)`): the same
/// integer sums and, lane by lane, the same f32 operations in the same order as [`kernel`]'s, so
/// every output has its single dot's bits. The lanes share the per-block work that is scalar in
/// a single dot (f16 scales, the horizontal sums, the block's f32 term) and the row that is the
/// same in every lane (see [`kernel_x4`]). Same safety contract as [`DotFn`] for each pair.
pub(super) type X4Fn = unsafe fn(usize, [&[u8]; 4], [&[u8]; 4]) -> [f32; 4];

/// The four-lane kernels for weight type `ty`: (four weight rows × one activation row, one
/// weight row × four activation rows), where there are (the 32-element block types' matrix-vector
/// products are [`matvec_kernel`]). Other pairs are not supported.
pub(super) fn kernel_x4(ty: GgmlType) -> (Option<X4Fn>, Option<X4Fn>) {
    use GgmlType::*;
    match ty {
        Q4_0 => (None, Some(q4_0_toks4)),
        Q4_1 => (None, Some(q4_1_toks4)),
        Q5_0 => (None, Some(q5_0_toks4)),
        Q8_0 => (None, Some(q8_0_toks4)),
        Q4K => (Some(q4_k_rows4), None),
        Q6K => (Some(q6_k_rows4), None),
        _ => (None, None),
    }
}

/// Four weight rows × four activation rows, `out[row][token]` (`(n, weight rows, activation
/// rows)`), each output its single dot's bits. Same safety contract as [`DotFn`] for each pair.
/// The four activation rows come prepared by the type's [`Prep4Fn`].
pub(super) type X4x4Fn = unsafe fn(usize, [&[u8]; 4], &[ActBlock]) -> [[f32; 4]; 4];

/// Four activation rows `(n, rows, out)` prepared for a type's [`X4x4Fn`], once for all the
/// weight rows of a prompt tile: block `i` of row `k` at `out[4i + k]`.
pub(super) type Prep4Fn = unsafe fn(usize, [&[u8]; 4], &mut Vec<ActBlock>);

/// The four-by-four prompt tile of the 32-element block types ([`rows4_toks4`]) and how it
/// prepares its activation rows.
pub(super) fn kernel_4x4(ty: GgmlType) -> Option<(Prep4Fn, X4x4Fn)> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 => (q4_0_prep4, q4_0_4x4),
        Q4_1 => (q4_1_prep4, q4_1_4x4),
        Q5_0 => (q5_0_prep4, q5_0_4x4),
        Q8_0 => (q8_0_prep4, q8_0_4x4),
        _ => return None,
    })
}

/// A matrix-vector product over whole groups of four rows: `(n, weight rows, bytes per row,
/// activation, outputs)`, `outputs.len()` a multiple of 4 and the rows holding that many; each
/// output its single dot's bits. Same safety contract as [`DotFn`] for every row.
pub(super) type MatvecFn = unsafe fn(usize, &[u8], usize, &[u8], &mut [f32]);

/// The matrix-vector kernel of the 32-element block types, whose activation is prepared once for
/// all rows ([`rows_prepared`]).
pub(super) fn matvec_kernel(ty: GgmlType) -> Option<MatvecFn> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 => q4_0_matvec,
        Q4_1 => q4_1_matvec,
        Q5_0 => q5_0_matvec,
        Q8_0 => q8_0_matvec,
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

/// `acc` plus the products of the signed bytes `x` and the bytes `u` (each in 0..=127), as four
/// exact i32 lanes (lane i: products 4i..4i+4).
#[cfg(target_feature = "relaxed-simd")]
#[inline]
#[target_feature(enable = "simd128,relaxed-simd")]
unsafe fn dot16u(x: v128, u: v128, acc: v128) -> v128 {
    i32x4_relaxed_dot_i8x16_i7x16_add(x, u, acc)
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

/// How `qx` gives a block's 32 weight quants: the signed values themselves, or each value plus
/// an offset (`Unsigned(8)`: Q4_0's nibbles), every byte then in 0..=127.
#[derive(Clone, Copy)]
enum Quants {
    Signed,
    Unsigned(i8),
}

/// Where a 32-element block type keeps its parts: weight block bytes (`wsize`), activation
/// block bytes (`asize`; its quants at `q8_at`, its scale at 0 and, with `two_scales`, a second
/// one at 2, as the weight block's), and how its quants read (`quants`).
#[derive(Clone, Copy)]
struct Layout {
    wsize: usize,
    asize: usize,
    q8_at: usize,
    quants: Quants,
    two_scales: bool,
}

impl Layout {
    const fn new(wsize: usize, asize: usize, q8_at: usize, quants: Quants, two_scales: bool) -> Self {
        Layout { wsize, asize, q8_at, quants, two_scales }
    }
}

/// The integer dot of a 32-element block, four i32 lanes: weight quants `q0`, `q1` (as `quants`
/// says) with the activation's signed quants `a0`, `a1`.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn block_dot(q0: v128, q1: v128, a0: v128, a1: v128, quants: Quants) -> v128 {
    match quants {
        Quants::Signed => i32x4_add(dot16(q0, a0), dot16(q1, a1)),
        #[cfg(target_feature = "relaxed-simd")]
        Quants::Unsigned(off) => {
            let d = dot16u(a1, q1, dot16u(a0, q0, i32x4_splat(0)));
            if off == 0 {
                return d;
            }
            let k = i8x16_splat(off);
            i32x4_sub(d, dot16u(a1, k, dot16u(a0, k, i32x4_splat(0))))
        }
        #[cfg(not(target_feature = "relaxed-simd"))]
        Quants::Unsigned(off) => {
            let k = i8x16_splat(off);
            i32x4_add(dot16(i8x16_sub(q0, k), a0), dot16(i8x16_sub(q1, k), a1))
        }
    }
}

/// `sumf += term(sumi, weight block, activation block)` over 32-element blocks: `qx(block)` gives
/// the 32 weight quants (elements 0..16, 16..32) as `quants` says, `q8_at` where the activation's
/// quants start, and `term` the portable code's per-block f32 expression.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn blocks_32(
    nb: usize,
    wp: *const u8,
    wsize: usize,
    ap: *const u8,
    asize: usize,
    q8_at: usize,
    quants: Quants,
    qx: impl Fn(*const u8) -> (v128, v128),
    term: impl Fn(i32, *const u8, *const u8) -> f32,
) -> f32 {
    let mut sumf = 0f32;
    for i in 0..nb {
        let (x, y) = (wp.add(i * wsize), ap.add(i * asize));
        let (q0, q1) = qx(x);
        let sumi = hsum_i32(block_dot(q0, q1, load(y.add(q8_at)), load(y.add(q8_at + 16)), quants));
        sumf += term(sumi, x, y);
    }
    sumf
}

/// The four lanes' integer block sums `[Σv0, Σv1, Σv2, Σv3]` (exact).
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn hsum_i32_x4(v0: v128, v1: v128, v2: v128, v3: v128) -> v128 {
    let t01 = i32x4_add(i32x4_shuffle::<0, 4, 1, 5>(v0, v1), i32x4_shuffle::<2, 6, 3, 7>(v0, v1));
    let t23 = i32x4_add(i32x4_shuffle::<0, 4, 1, 5>(v2, v3), i32x4_shuffle::<2, 6, 3, 7>(v2, v3));
    i32x4_add(i32x4_shuffle::<0, 1, 4, 5>(t01, t23), i32x4_shuffle::<2, 3, 6, 7>(t01, t23))
}

/// The halves at `p[i] + at` as f32x4 (exact, as [`f16s`]).
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn f16s_x4(p: [*const u8; 4], at: usize) -> v128 {
    // One 16-bit lane load per block (into the top half of each lane: `f16_top_to_f32`).
    let z = i32x4_splat(0);
    let v = v128_load16_lane::<1>(z, p[0].add(at) as *const u16);
    let v = v128_load16_lane::<3>(v, p[1].add(at) as *const u16);
    let v = v128_load16_lane::<5>(v, p[2].add(at) as *const u16);
    let v = v128_load16_lane::<7>(v, p[3].add(at) as *const u16);
    f16_top_to_f32(v, || u32x4_shr(v, 16))
}

/// The two halves at `p[i] + at` and `p[i] + at + 2` (a block's `d` and `m`) as two f32x4,
/// from one 32-bit load per block.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn f16_pairs_x4(p: [*const u8; 4], at: usize) -> (v128, v128) {
    let v = v128_load32_zero(p[0].add(at) as *const u32);
    let v = v128_load32_lane::<1>(v, p[1].add(at) as *const u32);
    let v = v128_load32_lane::<2>(v, p[2].add(at) as *const u32);
    let v = v128_load32_lane::<3>(v, p[3].add(at) as *const u32);
    (f16x4_to_f32_finite(v), f16_top_to_f32(v, || u32x4_shr(v, 16)))
}

/// [`f16x4_to_f32`] (the same bits), shorter where no lane is an infinity or NaN (scales are
/// finite): the half moved to the top of the lane and shifted back 3 places arithmetically puts
/// its sign at bit 31 and its exponent and mantissa at bits 27..13 (the mask clears the sign's
/// copies), an f32 2^112 below the half's value (exact for normal and subnormal halves), so one
/// multiply rescales it. An infinity or NaN comes out at 65536 or more: then `f16x4_to_f32`.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn f16x4_to_f32_finite(h: v128) -> v128 {
    f16_top_to_f32(i32x4_shl(h, 16), || h)
}

/// Eight halves (a v128 of them) as two f32x4, the first four and the last four (the bits of
/// [`f16x4_to_f32`]): interleaving them with zeros puts each at the top of its lane.
#[inline]
#[target_feature(enable = "simd128")]
pub(crate) unsafe fn f16x8_to_f32(h: v128) -> (v128, v128) {
    let z = i16x8_splat(0);
    (
        f16_top_to_f32(i16x8_shuffle::<0, 8, 1, 9, 2, 10, 3, 11>(z, h), || u32x4_extend_low_u16x8(h)),
        f16_top_to_f32(i16x8_shuffle::<4, 12, 5, 13, 6, 14, 7, 15>(z, h), || u32x4_extend_high_u16x8(h)),
    )
}

/// [`f16x4_to_f32_finite`] of halves held in the top 16 bits of each lane (`top`; the low bits
/// are ignored); `h()`: the same halves in the low 16 bits, for the slow path only.
#[inline(always)]
unsafe fn f16_top_to_f32(top: v128, h: impl Fn() -> v128) -> v128 {
    let f = f16_top_finite(top);
    if v128_any_true(f32x4_ge(f32x4_abs(f), f32x4_splat(65536.0))) {
        return f16x4_to_f32(h());
    }
    f
}

/// The fast path of [`f16_top_to_f32`] alone: the bits of `f16_to_f32` for finite halves.
#[inline(always)]
fn f16_top_finite(top: v128) -> v128 {
    f16_top_finite_by(top, u32x4_splat(0x8fff_e000), f32x4_splat(f32::from_bits(0x7780_0000)))
}

/// [`f16_top_finite`] with its two constants given (`mask` = 0x8fffe000, `two112` = 2^112 in
/// every lane): a loop can load them once.
#[inline(always)]
fn f16_top_finite_by(top: v128, mask: v128, two112: v128) -> v128 {
    f32x4_mul(v128_and(i32x4_shr(top, 3), mask), two112)
}

/// One activation block of a matrix-vector product, prepared once for all the matrix's rows:
/// what the integer sums need of it (`v`), the constant they add (`corr`, in every lane) and its
/// scales as f32 (`ys`: `d` and, for Q8_1, `s`).
/// - Relaxed SIMD, unsigned quants: `v = [a0, a1, _, _]` for one `relaxed_dot` per 16 products;
///   `corr = −off · Σa` (the quants' offset).
/// - Relaxed SIMD, signed quants (Q8_0): the activation's magnitudes |a| (<= 127: LES's Q8
///   quantizer rounds within ±127, see `legacy::q8_block`) go in the 7-bit operand and each
///   weight byte, complemented where a < 0, in the other: for a < 0,
///   (!w)·|a| = (−w − 1)·|a| = w·a − |a|, so Σ w·a = Σ (w ^ sign(a))·|a| + Σ_{a<0} |a|:
///   `v = [|a0|, |a1|, sign(a0), sign(a1)]`, `corr = Σ_{a<0} |a|`. Exact for every weight byte
///   (!w never overflows), two instructions per 16 products.
/// - SIMD128: `v` = the activation widened to i16 (four vectors), each weight block then taking
///   `i32x4.dot_i16x8_s` (x86 `pmaddwd`); `corr = 0`.
#[derive(Clone, Copy)]
pub(super) struct ActBlock {
    v: [v128; 4],
    corr: v128,
    ys: [v128; 2],
}

/// The activation's `nb` blocks (`asize` bytes each, quants at `q8_at`, scales at 0 and, with
/// `two_scales`, 2) prepared for [`rows_prepared`].
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn prepare_act(nb: usize, ap: *const u8, l: Layout, out: &mut Vec<ActBlock>) {
    out.clear();
    out.extend((0..nb).map(|i| prepare_block(ap.add(i * l.asize), l)));
}

/// One activation block at `y` prepared for [`prepared_dot`] (see [`ActBlock`]).
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn prepare_block(y: *const u8, l: Layout) -> ActBlock {
    let Layout { q8_at, quants, two_scales, .. } = l;
    let zero = i32x4_splat(0);
    let (a0, a1) = (load(y.add(q8_at)), load(y.add(q8_at + 16)));
    let ys = [f32x4_splat(f16s(y)), if two_scales { f32x4_splat(f16s(y.add(2))) } else { f32x4_splat(0.0) }];
    #[cfg(target_feature = "relaxed-simd")]
    let (v, corr) = match quants {
        Quants::Unsigned(off) => {
            let kk = i8x16_splat(off);
            let corr = if off == 0 { 0 } else { -hsum_i32(dot16u(a1, kk, dot16u(a0, kk, zero))) };
            ([a0, a1, zero, zero], i32x4_splat(corr))
        }
        Quants::Signed => {
            let z8 = i8x16_splat(0);
            let (m0, m1) = (i8x16_lt(a0, z8), i8x16_lt(a1, z8));
            let (b0, b1) = (i8x16_abs(a0), i8x16_abs(a1));
            let one = i8x16_splat(1);
            let neg = hsum_i32(dot16u(v128_and(m1, one), b1, dot16u(v128_and(m0, one), b0, zero)));
            ([b0, b1, m0, m1], i32x4_splat(neg))
        }
    };
    #[cfg(not(target_feature = "relaxed-simd"))]
    let (v, corr) = {
        let _ = quants;
        ([i16x8_extend_low_i8x16(a0), i16x8_extend_high_i8x16(a0), i16x8_extend_low_i8x16(a1), i16x8_extend_high_i8x16(a1)], zero)
    };
    ActBlock { v, corr, ys }
}

/// The integer sums of four weight blocks (`qx(k)`, as `quants` says) with one prepared
/// activation block, one lane per weight block, exact.
#[inline(always)]
unsafe fn prepared_dot(b: &ActBlock, quants: Quants, qx: impl Fn(usize) -> (v128, v128)) -> v128 {
    let zero = i32x4_splat(0);
    #[cfg(target_feature = "relaxed-simd")]
    let lane = |k: usize| {
        let (q0, q1) = qx(k);
        match quants {
            Quants::Unsigned(_) => dot16u(b.v[1], q1, dot16u(b.v[0], q0, zero)),
            Quants::Signed => dot16u(v128_xor(q1, b.v[3]), b.v[1], dot16u(v128_xor(q0, b.v[2]), b.v[0], zero)),
        }
    };
    #[cfg(not(target_feature = "relaxed-simd"))]
    let lane = |k: usize| {
        let _ = zero;
        let (mut q0, mut q1) = qx(k);
        if let Quants::Unsigned(off) = quants {
            (q0, q1) = (i8x16_sub(q0, i8x16_splat(off)), i8x16_sub(q1, i8x16_splat(off)));
        }
        let d0 = i32x4_add(i32x4_dot_i16x8(i16x8_extend_low_i8x16(q0), b.v[0]), i32x4_dot_i16x8(i16x8_extend_high_i8x16(q0), b.v[1]));
        let d1 = i32x4_add(i32x4_dot_i16x8(i16x8_extend_low_i8x16(q1), b.v[2]), i32x4_dot_i16x8(i16x8_extend_high_i8x16(q1), b.v[3]));
        i32x4_add(d0, d1)
    };
    i32x4_add(hsum_i32_x4(lane(0), lane(1), lane(2), lane(3)), b.corr)
}

/// A matrix-vector product over whole groups of four weight rows (`rb` bytes each; `y` holds one
/// output per row, its length a multiple of four): the activation is prepared once
/// ([`prepare_act`]), then each group's four rows run in the four lanes, each lane the single
/// dot's integer sums and f32 operations in its order (its bits). `term` as [`blocks_32_x4`]'s.
#[inline]
#[target_feature(enable = "simd128")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_prepared(
    n: usize,
    w: &[u8],
    rb: usize,
    act: &[u8],
    l: Layout,
    y: &mut [f32],
    qx: impl Fn(*const u8) -> (v128, v128),
    term: impl Fn(v128, [v128; 2], [v128; 2]) -> v128,
) {
    with_prep(|prep| {
        prepare_act(n / 32, act.as_ptr(), l, prep);
        for (q, yq) in y.chunks_exact_mut(4).enumerate() {
            let base = w.as_ptr().add(q * 4 * rb);
            let wp = [base, base.add(rb), base.add(2 * rb), base.add(3 * rb)];
            let mut sumf = f32x4_splat(0.0);
            for (i, b) in prep.iter().enumerate() {
                let x = wp.map(|p| p.add(i * l.wsize));
                let sumi = prepared_dot(b, l.quants, |k| qx(x[k]));
                sumf = f32x4_add(sumf, term(f32x4_convert_i32x4(sumi), scales_x4::<false>(x, l.two_scales), b.ys));
            }
            v128_store(yq.as_mut_ptr() as *mut v128, sumf);
        }
    });
}

/// `f` with this thread's buffer of prepared activation blocks: a matrix-vector product runs as
/// many parallel chunks, and an allocation per chunk takes the threaded build's allocator lock.
fn with_prep<R>(f: impl FnOnce(&mut Vec<ActBlock>) -> R) -> R {
    thread_local!(static PREP: core::cell::RefCell<Vec<ActBlock>> = const { core::cell::RefCell::new(Vec::new()) });
    PREP.with(|p| f(&mut p.borrow_mut()))
}

/// Four activation rows' blocks prepared for [`rows4_toks4`] (block `i` of row `k` at
/// `out[4i + k]`).
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn prepare_act4(n: usize, a: [&[u8]; 4], l: Layout, out: &mut Vec<ActBlock>) {
    out.clear();
    out.extend((0..n / 32).flat_map(|i| a.map(|r| prepare_block(r.as_ptr().add(i * l.asize), l))));
}

/// Four weight rows × four activation rows (`out[row][token]`), the activation rows prepared
/// ([`prepare_act4`], once for all the weight rows of a prompt tile): per token the operations
/// of [`rows_prepared`] on those rows (so each output has its single dot's bits), the weight
/// blocks unpacked and their scales converted once for the four tokens.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn rows4_toks4(n: usize, w: [&[u8]; 4], prep: &[ActBlock], l: Layout, qx: impl Fn(*const u8) -> (v128, v128), term: impl Fn(v128, [v128; 2], [v128; 2]) -> v128) -> [[f32; 4]; 4] {
    let wp = w.map(|r| r.as_ptr());
    let mut sumf = [f32x4_splat(0.0); 4]; // per token, one lane per row
    for (i, bs) in prep.chunks_exact(4).take(n / 32).enumerate() {
        let x = wp.map(|p| p.add(i * l.wsize));
        let q = x.map(|p| qx(p));
        let ws = scales_x4::<false>(x, l.two_scales);
        for (s, b) in sumf.iter_mut().zip(bs) {
            let sumi = prepared_dot(b, l.quants, |r| q[r]);
            *s = f32x4_add(*s, term(f32x4_convert_i32x4(sumi), ws, b.ys));
        }
    }
    let t = sumf.map(lanes);
    core::array::from_fn(|r| core::array::from_fn(|k| t[k][r]))
}

/// The blocks' scales, one per lane: the half at byte 0 of `p[i]` and (`two`) the one at byte
/// 2; where the four pointers are one block (`SAME`) its halves once, in every lane.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn scales_x4<const SAME: bool>(p: [*const u8; 4], two: bool) -> [v128; 2] {
    match (SAME, two) {
        (true, false) => [f32x4_splat(f16s(p[0])), f32x4_splat(0.0)],
        (true, true) => [f32x4_splat(f16s(p[0])), f32x4_splat(f16s(p[0].add(2)))],
        (false, false) => [f16s_x4(p, 0), f32x4_splat(0.0)],
        (false, true) => {
            let (d, m) = f16_pairs_x4(p, 0);
            [d, m]
        }
    }
}

/// [`blocks_32`] for one weight row and four activation rows (a prompt tile of four tokens), one
/// per lane; the weight row is loaded and converted once. `term` gets the lanes' `sumi as f32`, the weight blocks' scales (f16 at byte 0,
/// and at byte 2 where `two_scales`) and the activation blocks' scales, and gives the four f32
/// terms, each lane the scalar term's operations.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn blocks_32_toks4(n: usize, w: [&[u8]; 4], a: [&[u8]; 4], l: Layout, qx: impl Fn(*const u8) -> (v128, v128), term: impl Fn(v128, [v128; 2], [v128; 2]) -> v128) -> [f32; 4] {
    let (wp, ap) = (w.map(|r| r.as_ptr()), a.map(|r| r.as_ptr()));
    let zero = f32x4_splat(0.0);
    let mut sumf = zero;
    for i in 0..n / 32 {
        let (x, y) = (wp.map(|p| p.add(i * l.wsize)), ap.map(|p| p.add(i * l.asize)));
        let (q0, q1) = qx(x[0]);
        let lane = |k: usize| block_dot(q0, q1, load(y[k].add(l.q8_at)), load(y[k].add(l.q8_at + 16)), l.quants);
        let sumi = hsum_i32_x4(lane(0), lane(1), lane(2), lane(3));
        let ws = scales_x4::<true>(x, l.two_scales);
        let ys = scales_x4::<false>(y, l.two_scales);
        sumf = f32x4_add(sumf, term(f32x4_convert_i32x4(sumi), ws, ys));
    }
    lanes(sumf)
}

/// The four f32 lanes of `v`.
#[inline(always)]
fn lanes(v: v128) -> [f32; 4] {
    [f32x4_extract_lane::<0>(v), f32x4_extract_lane::<1>(v), f32x4_extract_lane::<2>(v), f32x4_extract_lane::<3>(v)]
}

/// The four-lane kernels of a 32-element block type: `$rows` (four weight rows, one activation
/// row) and `$toks` (one weight row, four activation rows), from `blocks_32_x4`'s arguments
/// but the rows.
macro_rules! x4_kernels {
    ($rows:ident, $toks:ident, $prep:ident, $tile:ident, $layout:expr, $qx:expr, $term:expr $(,)?) => {
        #[target_feature(enable = "simd128")]
        unsafe fn $prep(n: usize, a: [&[u8]; 4], out: &mut Vec<ActBlock>) {
            prepare_act4(n, a, $layout, out)
        }
        #[target_feature(enable = "simd128")]
        unsafe fn $tile(n: usize, w: [&[u8]; 4], prep: &[ActBlock]) -> [[f32; 4]; 4] {
            rows4_toks4(n, w, prep, $layout, $qx, $term)
        }
        #[target_feature(enable = "simd128")]
        unsafe fn $rows(n: usize, w: &[u8], rb: usize, a: &[u8], y: &mut [f32]) {
            rows_prepared(n, w, rb, a, $layout, y, $qx, $term)
        }
        #[target_feature(enable = "simd128")]
        unsafe fn $toks(n: usize, w: [&[u8]; 4], a: [&[u8]; 4]) -> [f32; 4] {
            blocks_32_toks4(n, [w[0]; 4], a, $layout, $qx, $term)
        }
    };
}

/// The per-block f32 terms of the portable kernels (`legacy.rs`), four lanes at a time: `s` the
/// integer sums as f32, `[xd, xm]` the weight blocks' scales, `[yd, ys]` the activation's.
#[inline(always)]
fn term_q4_0(s: v128, [xd, _]: [v128; 2], [yd, _]: [v128; 2]) -> v128 {
    f32x4_mul(f32x4_mul(s, xd), yd)
}
#[inline(always)]
fn term_q5_0(s: v128, [xd, _]: [v128; 2], [yd, _]: [v128; 2]) -> v128 {
    f32x4_mul(f32x4_mul(xd, yd), s)
}
#[inline(always)]
fn term_q8_0(s: v128, [xd, _]: [v128; 2], [yd, _]: [v128; 2]) -> v128 {
    f32x4_mul(s, f32x4_mul(xd, yd))
}
#[inline(always)]
fn term_q4_1(s: v128, [xd, xm]: [v128; 2], [yd, ys]: [v128; 2]) -> v128 {
    f32x4_add(f32x4_mul(f32x4_mul(xd, yd), s), f32x4_mul(xm, ys))
}

const Q4_0: Layout = Layout::new(18, 34, 2, Quants::Unsigned(8), false);
const Q4_1: Layout = Layout::new(20, 36, 4, Quants::Unsigned(0), true);
const Q5_0: Layout = Layout::new(22, 34, 2, Quants::Unsigned(16), false);
const Q8_0: Layout = Layout::new(34, 34, 2, Quants::Signed, false);

x4_kernels!(q4_0_matvec, q4_0_toks4, q4_0_prep4, q4_0_4x4, Q4_0, |x| nibbles(x.add(2)), term_q4_0);
x4_kernels!(q5_0_matvec, q5_0_toks4, q5_0_prep4, q5_0_4x4, Q5_0, |x| q5_0_quants(x), term_q5_0);
x4_kernels!(q8_0_matvec, q8_0_toks4, q8_0_prep4, q8_0_4x4, Q8_0, |x| (load(x.add(2)), load(x.add(18))), term_q8_0);
x4_kernels!(q4_1_matvec, q4_1_toks4, q4_1_prep4, q4_1_4x4, Q4_1, |x| nibbles(x.add(4)), term_q4_1);

// ---------------------------------------------------------------------------------------------
// Repacked rows (`super::repack`): four rows' blocks side by side, relaxed SIMD

/// A repacked kernel: `(n, group bytes, prepared activation blocks, tokens)` → per token, the
/// four rows' results in the lanes.
#[cfg(target_feature = "relaxed-simd")]
type Rows4Fn<const T: usize> = unsafe fn(usize, *const u8, &[ActBlock]) -> [v128; T];

/// The four rows × `T` tokens of one repacked group `g` (`super::repack`'s layout), the tokens'
/// blocks prepared by [`prepare_block`] (block `i` of token `k` at `prep[T·i + k]`). Per token
/// and block, lane `j` gets row `j`'s exact integer block sum, then the portable order's f32
/// `term`, as [`rows_prepared`] does for plain rows (the same bits), with neither horizontal
/// sums nor per-row scale loads:
/// - Q4_0 / Q4_1: vector `c` holds bytes `4c .. 4c + 4` of each row, whose low nibbles are
///   elements `4c ..` and high nibbles `16 + 4c ..`; the activation's four matching bytes,
///   splatted, go through `i16x8.relaxed_dot_i8x16_i7x16_s` (pairs of products, |a · q| <=
///   128 · 15) and eight of them add up in i16 lanes (<= 8 · 2 · 1920 = 30720: exact), widened
///   once per block; the offset is the prepared `corr`.
/// - Q8_0: vector `c` holds elements `4c .. 4c + 4` of each row; each weight byte, its sign
///   flipped where the activation's is negative, times |a| as in [`ActBlock`] (a pair <=
///   2 · 128 · 127: exact in i16), widened per vector.
/// Scales: the four rows' halves in one load, converted without the infinity/NaN path (repacked
/// matrices have finite scales only).
#[cfg(target_feature = "relaxed-simd")]
#[inline(always)]
unsafe fn rows4_group<const T: usize>(n: usize, g: *const u8, prep: &[ActBlock], l: Layout, term: impl Fn(v128, [v128; 2], [v128; 2]) -> v128) -> [v128; T] {
    let sc = if l.two_scales { 16 } else { 8 };
    // The constants as loads before the loop: V8 builds every `v128.const` anew where it is
    // used (three instructions or more), and LLVM puts them in the loop.
    let konst = |v: v128| core::ptr::read_volatile(&v);
    let (m4, ones, z) = (konst(u8x16_splat(0x0f)), konst(i16x8_splat(1)), konst(i16x8_splat(0)));
    let (mask, two112) = (konst(u32x4_splat(0x8fff_e000)), konst(f32x4_splat(f32::from_bits(0x7780_0000))));
    let half = |h: v128| f16_top_finite_by(i32x4_shl(h, 16), mask, two112);
    let mut sumf = [f32x4_splat(0.0); T];
    for (i, bs) in prep.chunks_exact(T).take(n / 32).enumerate() {
        let x = g.add(i * 4 * l.wsize);
        let h = if l.two_scales { load(x) } else { v128_load64_zero(x as *const u64) };
        // Each half moved to the top of its lane.
        let ws = [half(u32x4_extend_low_u16x8(h)), half(u32x4_extend_high_u16x8(h))];
        let q = x.add(sc);
        // Each weight vector once, the tokens innermost (few registers live: 16 on x86-64).
        let a: [*const u8; T] = core::array::from_fn(|k| bs[k].v.as_ptr() as *const u8);
        let sumi: [v128; T] = match l.quants {
            Quants::Unsigned(_) => {
                let mut acc = [z; T];
                for c in 0..4 {
                    let v = load(q.add(16 * c));
                    let (lo, hi) = (v128_and(v, m4), v128_and(u16x8_shr(v, 4), m4));
                    for (acc, a) in acc.iter_mut().zip(a) {
                        *acc = i16x8_add(*acc, i16x8_relaxed_dot_i8x16_i7x16(splat4(a.add(4 * c)), lo));
                        *acc = i16x8_add(*acc, i16x8_relaxed_dot_i8x16_i7x16(splat4(a.add(16 + 4 * c)), hi));
                    }
                }
                core::array::from_fn(|k| i32x4_add(i32x4_dot_i16x8(acc[k], ones), bs[k].corr))
            }
            Quants::Signed => {
                let mut acc: [v128; T] = core::array::from_fn(|k| bs[k].corr);
                for c in 0..8 {
                    let v = load(q.add(16 * c));
                    for (acc, a) in acc.iter_mut().zip(a) {
                        let p = i16x8_relaxed_dot_i8x16_i7x16(v128_xor(v, splat4(a.add(32 + 4 * c))), splat4(a.add(4 * c)));
                        *acc = i32x4_add(*acc, i32x4_dot_i16x8(p, ones));
                    }
                }
                acc
            }
        };
        for ((s, b), si) in sumf.iter_mut().zip(bs).zip(sumi) {
            *s = f32x4_add(*s, term(f32x4_convert_i32x4(si), ws, b.ys));
        }
    }
    sumf
}

/// The four bytes at `p` in every lane.
#[cfg(target_feature = "relaxed-simd")]
#[inline(always)]
unsafe fn splat4(p: *const u8) -> v128 {
    v128_load32_splat(p as *const u32)
}

/// The repacked kernels of a 32-element block type: `$one` (one token) and `$four` (four).
#[cfg(target_feature = "relaxed-simd")]
macro_rules! rows4_kernels {
    ($one:ident, $four:ident, $layout:expr, $term:expr $(,)?) => {
        #[target_feature(enable = "simd128")]
        unsafe fn $one(n: usize, g: *const u8, prep: &[ActBlock]) -> [v128; 1] {
            rows4_group::<1>(n, g, prep, $layout, $term)
        }
        #[target_feature(enable = "simd128")]
        unsafe fn $four(n: usize, g: *const u8, prep: &[ActBlock]) -> [v128; 4] {
            rows4_group::<4>(n, g, prep, $layout, $term)
        }
    };
}

#[cfg(target_feature = "relaxed-simd")]
rows4_kernels!(q4_0_r4x1, q4_0_r4x4, Q4_0, term_q4_0);
#[cfg(target_feature = "relaxed-simd")]
rows4_kernels!(q4_1_r4x1, q4_1_r4x4, Q4_1, term_q4_1);
#[cfg(target_feature = "relaxed-simd")]
rows4_kernels!(q8_0_r4x1, q8_0_r4x4, Q8_0, term_q8_0);

/// The layout and the one- and four-token kernels of a repackable type.
#[cfg(target_feature = "relaxed-simd")]
fn rows4_table(ty: GgmlType) -> Option<(Layout, Rows4Fn<1>, Rows4Fn<4>)> {
    Some(match ty {
        GgmlType::Q4_0 => (Q4_0, q4_0_r4x1, q4_0_r4x4),
        GgmlType::Q4_1 => (Q4_1, q4_1_r4x1, q4_1_r4x4),
        GgmlType::Q8_0 => (Q8_0, q8_0_r4x1, q8_0_r4x4),
        _ => return None,
    })
}

/// The matrix-vector product of a repacked matrix of `ty` (`super::repack::matvec`): `w` holds
/// `y.len() / 4` groups, four outputs each. False (nothing written) for a type without
/// kernels. Same safety contract as [`DotFn`] for every row.
#[cfg(target_feature = "relaxed-simd")]
#[target_feature(enable = "simd128")]
pub(super) unsafe fn rows4_matvec(ty: GgmlType, n: usize, w: &[u8], act: &[u8], y: &mut [f32]) -> bool {
    let Some((l, one, _)) = rows4_table(ty) else { return false };
    with_prep(|prep| {
        prepare_act(n / 32, act.as_ptr(), l, prep);
        for (q, yq) in y.chunks_exact_mut(4).enumerate() {
            let [v] = one(n, w.as_ptr().add(q * 4 * (n / 32) * l.wsize), prep);
            v128_store(yq.as_mut_ptr() as *mut v128, v);
        }
    });
    true
}

/// Activation rows `acts` (1 to 4) prepared for [`rows4_dot`]: one row's blocks in order, or
/// (2 to 4 rows) four rows interleaved, the last repeated.
#[cfg(target_feature = "relaxed-simd")]
#[target_feature(enable = "simd128")]
pub(super) unsafe fn rows4_prepare(ty: GgmlType, n: usize, acts: &[&[u8]], out: &mut Vec<ActBlock>) {
    let Some((l, _, _)) = rows4_table(ty) else { return };
    match acts {
        [] => out.clear(),
        [a] => prepare_act(n / 32, a.as_ptr(), l, out),
        _ => prepare_act4(n, core::array::from_fn(|k| acts[k.min(acts.len() - 1)]), l, out),
    }
}

/// A repacked group `g` × `k` prepared activation rows ([`rows4_prepare`]): `out[row][token]`.
/// `None` for a type without kernels.
#[cfg(target_feature = "relaxed-simd")]
#[target_feature(enable = "simd128")]
pub(super) unsafe fn rows4_dot(ty: GgmlType, n: usize, g: &[u8], prep: &[ActBlock], k: usize) -> Option<[[f32; 4]; 4]> {
    let (_, one, four) = rows4_table(ty)?;
    let t: [[f32; 4]; 4] = if k == 1 {
        let [v] = one(n, g.as_ptr(), prep);
        [lanes(v), [0.0; 4], [0.0; 4], [0.0; 4]]
    } else {
        four(n, g.as_ptr(), prep).map(lanes)
    };
    // t[token][row] -> out[row][token], tokens past `k` zero.
    Some(core::array::from_fn(|r| core::array::from_fn(|j| if j < k { t[j][r] } else { 0.0 })))
}

#[target_feature(enable = "simd128")]
unsafe fn dot_q4_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    blocks_32(n / 32, w.as_ptr(), 18, a.as_ptr(), 34, 2, Quants::Unsigned(8), |x| nibbles(x.add(2)), |sumi, x, y| sumi as f32 * f16s(x) * f16s(y))
}

/// Q5_0's 32 quants + 16 (0..=31): the low nibbles with bit i of `qh` as 0x10 in byte i.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn q5_0_quants(x: *const u8) -> (v128, v128) {
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
    (v128_or(lo, h0), v128_or(hi, h1))
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
        Quants::Unsigned(16),
        |x| q5_0_quants(x),
        |sumi, x, y| (f16s(x) * f16s(y)) * sumi as f32,
    )
}

#[target_feature(enable = "simd128")]
unsafe fn dot_q8_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    blocks_32(n / 32, w.as_ptr(), 34, a.as_ptr(), 34, 2, Quants::Signed, |x| (load(x.add(2)), load(x.add(18))), |sumi, x, y| sumi as f32 * (f16s(x) * f16s(y)))
}

/// `ggml_vec_dot_q4_1_q8_1`: `sum_blocks(d_w * d_a * sumi + m_w * s_a)`.
#[target_feature(enable = "simd128")]
unsafe fn dot_q4_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    blocks_32(n / 32, w.as_ptr(), 20, a.as_ptr(), 36, 4, Quants::Unsigned(0), |x| nibbles(x.add(4)), |sumi, x, y| (f16s(x) * f16s(y)) * sumi as f32 + f16s(x.add(2)) * f16s(y.add(2)))
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
            let s_lo = block_dot(lo0, lo1, load(q8), load(q8.add(16)), Quants::Unsigned(0));
            let s_hi = block_dot(hi0, hi1, load(q8.add(32)), load(q8.add(48)), Quants::Unsigned(0));
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
        // Relaxed SIMD: the quants' offset of 32 as `32 * sum(scale * bsum)` over the 16 groups of
        // 16 (Q8_K's `bsums`), taken off at the end (exact integers).
        #[cfg(target_feature = "relaxed-simd")]
        let mut offset = 0i32;
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
                    let g = 8 * h + 2 * k + half;
                    let a16 = load(y.add(4 + 16 * g));
                    let scale = *x.add(192 + g) as i8 as i32;
                    #[cfg(target_feature = "relaxed-simd")]
                    let s = {
                        let bsum = i16::from_le_bytes([*y.add(260 + 2 * g), *y.add(261 + 2 * g)]) as i32;
                        offset += scale * bsum;
                        dot16u(a16, uk, i32x4_splat(0))
                    };
                    #[cfg(not(target_feature = "relaxed-simd"))]
                    let s = dot16(i8x16_sub(uk, i8x16_splat(32)), a16);
                    isum = i32x4_add(isum, i32x4_mul(s, i32x4_splat(scale)));
                }
            }
        }
        #[cfg(target_feature = "relaxed-simd")]
        let sumi = hsum_i32(isum).wrapping_sub(32 * offset);
        #[cfg(not(target_feature = "relaxed-simd"))]
        let sumi = hsum_i32(isum);
        sumf += (f16s(x.add(208)) * f32s(y)) * sumi as f32;
    }
    sumf
}

// ---------------------------------------------------------------------------------------------
// K-quants, four weight rows × one activation row (matrix-vector products)

/// 16 weight quants `q` (each in 0..=63) · the activation's 16 bytes `a` as four exact i32 lanes
/// (relaxed SIMD), or `q - off` · the activation widened to i16 once (`wide`, `[low, high]`).
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn dot16_shared(q: v128, off: i8, a: v128, wide: [v128; 2]) -> v128 {
    #[cfg(target_feature = "relaxed-simd")]
    {
        let _ = (off, wide);
        dot16u(a, q, i32x4_splat(0))
    }
    #[cfg(not(target_feature = "relaxed-simd"))]
    {
        let _ = a;
        let q = if off == 0 { q } else { i8x16_sub(q, i8x16_splat(off)) };
        i32x4_add(i32x4_dot_i16x8(i16x8_extend_low_i8x16(q), wide[0]), i32x4_dot_i16x8(i16x8_extend_high_i8x16(q), wide[1]))
    }
}

/// A Q8_K block's 256 quants as 16 vectors of 16, and (without relaxed SIMD) widened to i16.
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn q8_k_shared(y: *const u8) -> ([v128; 16], [[v128; 2]; 16]) {
    let a: [v128; 16] = core::array::from_fn(|g| load(y.add(4 + 16 * g)));
    #[cfg(target_feature = "relaxed-simd")]
    let wide = [[i32x4_splat(0); 2]; 16];
    #[cfg(not(target_feature = "relaxed-simd"))]
    let wide = a.map(|v| [i16x8_extend_low_i8x16(v), i16x8_extend_high_i8x16(v)]);
    (a, wide)
}

/// Q8_K's `bsums[k]` (the sum of quants 16k..16k+16).
#[inline]
#[target_feature(enable = "simd128")]
unsafe fn bsum(y: *const u8, k: usize) -> i32 {
    i16::from_le_bytes([*y.add(260 + 2 * k), *y.add(261 + 2 * k)]) as i32
}

/// `dot_q4_k_q8_k` for four weight rows and one activation row, lane by lane the same.
#[target_feature(enable = "simd128")]
unsafe fn q4_k_rows4(n: usize, w: [&[u8]; 4], a: [&[u8]; 4]) -> [f32; 4] {
    let (wp, ap) = (w.map(|r| r.as_ptr()), a[0].as_ptr());
    let mut sumf = f32x4_splat(0.0);
    for i in 0..n / QK_K {
        let (x, y) = (wp.map(|p| p.add(i * 144)), ap.add(i * 292));
        let yd = f32x4_splat(f32s(y));
        let (xd, xm) = f16_pairs_x4(x, 0);
        let (d, dmin) = (f32x4_mul(xd, yd), f32x4_mul(xm, yd));
        let (av, wide) = q8_k_shared(y);
        let pair: [i32; 8] = core::array::from_fn(|g| bsum(y, 2 * g) + bsum(y, 2 * g + 1));
        let mut summ = [0i32; 4];
        let lane = |k: usize, summ: &mut i32| {
            let x = x[k];
            let (sc, mn) = scales_mins_k4(core::slice::from_raw_parts(x.add(4), 12));
            *summ = (0..8).map(|g| mn[g] as i32 * pair[g]).sum();
            let mut isum = i32x4_splat(0);
            for c in 0..4 {
                let (lo0, hi0) = nibbles(x.add(16 + 32 * c));
                let (lo1, hi1) = nibbles(x.add(32 + 32 * c));
                let s_lo = i32x4_add(dot16_shared(lo0, 0, av[4 * c], wide[4 * c]), dot16_shared(lo1, 0, av[4 * c + 1], wide[4 * c + 1]));
                let s_hi = i32x4_add(dot16_shared(hi0, 0, av[4 * c + 2], wide[4 * c + 2]), dot16_shared(hi1, 0, av[4 * c + 3], wide[4 * c + 3]));
                isum = i32x4_add(isum, i32x4_mul(s_lo, i32x4_splat(sc[2 * c] as i32)));
                isum = i32x4_add(isum, i32x4_mul(s_hi, i32x4_splat(sc[2 * c + 1] as i32)));
            }
            isum
        };
        let [s0, s1, s2, s3] = &mut summ;
        let sumi = hsum_i32_x4(lane(0, s0), lane(1, s1), lane(2, s2), lane(3, s3));
        let mins = f32x4(summ[0] as f32, summ[1] as f32, summ[2] as f32, summ[3] as f32);
        sumf = f32x4_add(sumf, f32x4_sub(f32x4_mul(d, f32x4_convert_i32x4(sumi)), f32x4_mul(dmin, mins)));
    }
    lanes(sumf)
}

/// `dot_q6_k_q8_k` for four weight rows and one activation row, lane by lane the same.
#[target_feature(enable = "simd128")]
unsafe fn q6_k_rows4(n: usize, w: [&[u8]; 4], a: [&[u8]; 4]) -> [f32; 4] {
    let (wp, ap) = (w.map(|r| r.as_ptr()), a[0].as_ptr());
    let (m4, m3) = (u8x16_splat(0x0f), u8x16_splat(3));
    let mut sumf = f32x4_splat(0.0);
    for i in 0..n / QK_K {
        let (x, y) = (wp.map(|p| p.add(i * 210)), ap.add(i * 292));
        let (av, wide) = q8_k_shared(y);
        #[cfg(target_feature = "relaxed-simd")]
        let bsums: [i32; 16] = core::array::from_fn(|g| bsum(y, g));
        let lane = |k: usize| {
            let x = x[k];
            let mut isum = i32x4_splat(0);
            // Relaxed SIMD: the quants' offset of 32 as `32 · Σ scale · bsum` (see `dot_q6_k_q8_k`).
            #[cfg(target_feature = "relaxed-simd")]
            let mut offset = 0i32;
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
                    for (kk, &uk) in u.iter().enumerate() {
                        let g = 8 * h + 2 * kk + half;
                        let scale = *x.add(192 + g) as i8 as i32;
                        #[cfg(target_feature = "relaxed-simd")]
                        {
                            offset += scale * bsums[g];
                        }
                        let s = dot16_shared(uk, 32, av[g], wide[g]);
                        isum = i32x4_add(isum, i32x4_mul(s, i32x4_splat(scale)));
                    }
                }
            }
            #[cfg(target_feature = "relaxed-simd")]
            let isum = i32x4_sub(isum, i32x4(32 * offset, 0, 0, 0));
            isum
        };
        let sumi = hsum_i32_x4(lane(0), lane(1), lane(2), lane(3));
        let d = f32x4_mul(f16s_x4(x, 208), f32x4_splat(f32s(y)));
        sumf = f32x4_add(sumf, f32x4_mul(d, f32x4_convert_i32x4(sumi)));
    }
    lanes(sumf)
}

// ---------------------------------------------------------------------------------------------
// Activation quantization

/// `legacy::q8_block` with the x86 rounding (multiplier `127 / amax`, round half to even) on one
/// block of 32, four lanes at a time: the same scale, quants and sum. `amax` is the pairwise
/// maximum of |x| (a NaN never wins, as `f32::max` lets it lose), whose order does not matter;
/// every `x · id` lies within ±127.5, so the saturating narrowings equal `as i8`, and a NaN
/// product truncates to 0 as `as i8` does.
#[target_feature(enable = "simd128")]
pub(super) unsafe fn q8_block_x86(x: &[f32; 32], qs: &mut [u8; 32]) -> (f32, i32) {
    let v: [v128; 8] = core::array::from_fn(|i| v128_load(x.as_ptr().add(4 * i) as *const v128));
    let mut m = f32x4_splat(0.0);
    for &vi in &v {
        m = f32x4_pmax(m, f32x4_abs(vi));
    }
    let amax = f32x4_extract_lane::<0>(m).max(f32x4_extract_lane::<1>(m)).max(f32x4_extract_lane::<2>(m).max(f32x4_extract_lane::<3>(m)));
    let d = amax / 127.0;
    let id = f32x4_splat(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let q = v.map(|vi| i32x4_trunc_sat_f32x4(f32x4_nearest(f32x4_mul(vi, id))));
    let sum = i32x4_add(i32x4_add(i32x4_add(q[0], q[1]), i32x4_add(q[2], q[3])), i32x4_add(i32x4_add(q[4], q[5]), i32x4_add(q[6], q[7])));
    let h = |a: v128, b: v128, c: v128, d: v128| i8x16_narrow_i16x8(i16x8_narrow_i32x4(a, b), i16x8_narrow_i32x4(c, d));
    v128_store(qs.as_mut_ptr() as *mut v128, h(q[0], q[1], q[2], q[3]));
    v128_store(qs.as_mut_ptr().add(16) as *mut v128, h(q[4], q[5], q[6], q[7]));
    (d, hsum_i32(sum))
}
