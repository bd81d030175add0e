//! AArch64 NEON dot-product kernels (Apple phones, tablets and Macs; ARM Android and Linux).
//!
//! Same contract as the WebAssembly SIMD128 kernels (`wasm.rs`): the integer part of each block's
//! dot product is computed in vector lanes (exact: i8 × i8 products summed into i32 lanes) and the
//! f32 part (scales, the accumulation across blocks, the 8 float lanes of F32/F16/BF16) is the
//! portable code's, operation for operation, with no fused multiply-add. So an ARM CPU computes
//! bit for bit what the portable kernels compute (`LES_NO_SIMD=1`), what the browser computes and
//! what the wgpu backend's exact path reproduces. llama.cpp's ARM kernels (`ggml-cpu/arch/arm/
//! quants.c`) sum blocks in four f32 lanes with `vmlaq`/`vfmaq`: a different order, so LES on ARM
//! is not bit-identical to llama.cpp on ARM (as LES on x86 is to llama.cpp on x86).
//!
//! Two builds of every block kernel, picked at run time (`super::Simd`):
//! - `plain` (ARMv8.0 NEON, every aarch64 CPU): 8 × 8 → 16-bit products (`smull`, `smull2`, exact:
//!   |q4 or q8 × q8| ≤ 128²) pairwise added into i32 lanes (`sadalp`);
//! - `dotprod` (ARMv8.2 `FEAT_DotProd`: Apple A13 / M1 and later, Cortex-A55/A76 and later):
//!   `sdot`, four i8 products summed into each i32 lane in one instruction. Written as inline
//!   assembly: Rust's `vdotq_s32` intrinsic is still unstable (rust-lang/rust#117224).
//!
//! Batched products (prompts) also have tiles: four activation rows per weight block unpacked
//! once (`tile_kernel`, both builds), and with ARMv8.6 `FEAT_I8MM` two weight rows × four
//! activation rows through `smmla` (`tile2_kernel`: 2×8 by 8×2 i8 matrix products, exact i32),
//! turned off by `LES_NO_I8MM=1`. Every tile output is its single dot's bits: the integer block
//! sums are exact and each output's f32 sum runs in block order.
//!
//! Layouts and formulas: the portable modules (`legacy.rs`, `kquants.rs`, `iq.rs`) and ggml's
//! `ggml/src/ggml-cpu/quants.c`. Formats without a kernel here use the portable code.
//!
//! Every kernel is an `unsafe fn`: callers (see `super::vec_dot_with`) guarantee that the slices
//! hold `n` elements' worth of blocks and that the CPU has the kernel's features.

use super::iq::{e8m0_to_f32_half, KVALUES_IQ4NL, KVALUES_MXFP4};
use super::kquants::{scales_mins_k4, QK_K};
use super::{f16_to_f32, DotFn, GgmlType, Tile2Fn, TileFn};
use core::arch::aarch64::*;

/// The four-activation-row tile for `ty` (the 32-element block types), in the `sdot` build when
/// `dotprod`.
pub(super) fn tile_kernel(ty: GgmlType, dotprod: bool) -> Option<TileFn> {
    if dotprod {
        sdot_build::tile(ty)
    } else {
        plain_build::tile(ty)
    }
}

/// The `smmla` tile (two weight rows × four activation rows) for `ty`, where this CPU has
/// `FEAT_I8MM` (ARMv8.6: Apple A15 / M2 and later, Cortex-A510/A710/X2 and later) and `sdot`,
/// and `LES_NO_I8MM` is unset (decided once).
pub(super) fn tile2_kernel(ty: GgmlType) -> Option<Tile2Fn> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| {
        std::env::var_os("LES_NO_I8MM").is_none()
            && std::arch::is_aarch64_feature_detected!("i8mm")
            && std::arch::is_aarch64_feature_detected!("dotprod")
    });
    if on {
        sdot_build::tile2(ty)
    } else {
        None
    }
}

/// The NEON kernel for weight type `ty`, if there is one; `dotprod` selects the `sdot` build.
pub(super) fn kernel(ty: GgmlType, dotprod: bool) -> Option<DotFn> {
    use GgmlType::*;
    Some(match ty {
        F32 => dot_f32,
        F16 => dot_f16,
        BF16 => dot_bf16,
        _ if dotprod => return sdot_build::kernel(ty),
        _ => return plain_build::kernel(ty),
    })
}

#[inline(always)]
unsafe fn load(p: *const u8) -> int8x16_t {
    vld1q_s8(p as *const i8)
}

#[inline(always)]
unsafe fn f16s(p: *const u8) -> f32 {
    f16_to_f32(u16::from_le_bytes([*p, *p.add(1)]))
}

#[inline(always)]
unsafe fn f32s(p: *const u8) -> f32 {
    f32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)])
}

#[inline(always)]
unsafe fn i16s(p: *const u8) -> i32 {
    i16::from_le_bytes([*p, *p.add(1)]) as i32
}

/// Lanes summed ((0 + 1) + (2 + 3)), as the portable code's final reduction.
#[inline(always)]
unsafe fn hsum_f32(v: float32x4_t) -> f32 {
    (vgetq_lane_f32::<0>(v) + vgetq_lane_f32::<1>(v)) + (vgetq_lane_f32::<2>(v) + vgetq_lane_f32::<3>(v))
}

/// 16 packed nibbles -> (low nibbles, high nibbles): elements 0..16 and 16..32 of a block.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> (int8x16_t, int8x16_t) {
    let t = vld1q_u8(p);
    (vreinterpretq_s8_u8(vandq_u8(t, vdupq_n_u8(0x0f))), vreinterpretq_s8_u8(vshrq_n_u8::<4>(t)))
}

/// Q5_0 / Q5_1: the 32 high bits `qh` as 0x10 in byte i of (elements 0..16, elements 16..32).
#[inline(always)]
unsafe fn high_bits(qh: u32) -> (int8x16_t, int8x16_t) {
    let q = vreinterpretq_u8_u32(vdupq_n_u32(qh));
    const BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    const IDX0: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
    const IDX1: [u8; 16] = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3];
    let bits = vld1q_u8(BITS.as_ptr());
    let h = |idx: &[u8; 16]| {
        let set = vtstq_u8(vqtbl1q_u8(q, vld1q_u8(idx.as_ptr())), bits);
        vreinterpretq_s8_u8(vandq_u8(set, vdupq_n_u8(0x10)))
    };
    (h(&IDX0), h(&IDX1))
}

/// 16 packed nibbles looked up in a 16-entry code book (IQ4_NL, MXFP4).
#[inline(always)]
unsafe fn lut_nibbles(table: int8x16_t, p: *const u8) -> (int8x16_t, int8x16_t) {
    let (lo, hi) = nibbles(p);
    (vqtbl1q_s8(table, vreinterpretq_u8_s8(lo)), vqtbl1q_s8(table, vreinterpretq_u8_s8(hi)))
}

// ---------------------------------------------------------------------------------------------
// F32 / F16 / BF16 (no integer part: one build)

/// Four IEEE halves (the low 16 bits of each u32 lane) -> f32, exactly (see `super::f16_to_f32`;
/// the subnormal halves go through an f32 subnormal times 2^112, exact with flush-to-zero off,
/// the default of every aarch64 OS).
#[inline(always)]
unsafe fn f16x4_to_f32(h: uint32x4_t) -> float32x4_t {
    let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
    let em = vandq_u32(h, vdupq_n_u32(0x7fff));
    let normal = vreinterpretq_u32_f32(vmulq_f32(vreinterpretq_f32_u32(vshlq_n_u32::<13>(em)), vdupq_n_f32(f32::from_bits(0x7780_0000))));
    let quiet = vandq_u32(vcgtq_u32(em, vdupq_n_u32(0x7c00)), vdupq_n_u32(0x0040_0000));
    let special = vorrq_u32(vorrq_u32(vdupq_n_u32(0x7f80_0000), vshlq_n_u32::<13>(vandq_u32(em, vdupq_n_u32(0x3ff)))), quiet);
    vreinterpretq_f32_u32(vorrq_u32(sign, vbslq_u32(vcgeq_u32(em, vdupq_n_u32(0x7c00)), special, normal)))
}

/// Dot of two rows of `n` elements in the portable code's order (`float::dot_generic`): eight
/// lanes of separate multiply and add, reduced as ((0+4)+(1+5))+((2+6)+(3+7)), then the tail
/// one element at a time. `load8(p)` gives the 8 values at `p`; `get(p)` one value.
#[inline(always)]
unsafe fn float_dot(
    n: usize,
    w: &[u8],
    a: &[u8],
    esize: usize,
    load8: impl Fn(*const u8) -> (float32x4_t, float32x4_t),
    get: impl Fn(*const u8) -> f32,
) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    let mut i = 0;
    while i + 8 <= n {
        let (w0, w1) = load8(wp.add(i * esize));
        let (a0, a1) = load8(ap.add(i * esize));
        lo = vaddq_f32(lo, vmulq_f32(w0, a0));
        hi = vaddq_f32(hi, vmulq_f32(w1, a1));
        i += 8;
    }
    let mut sum = hsum_f32(vaddq_f32(lo, hi));
    while i < n {
        sum += get(wp.add(i * esize)) * get(ap.add(i * esize));
        i += 1;
    }
    sum
}

unsafe fn dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    float_dot(n, w, a, 4, |p| (vld1q_f32(p as *const f32), vld1q_f32(p.add(16) as *const f32)), |p| f32s(p))
}

unsafe fn dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    float_dot(n, w, a, 2, |p| {
        let h = vld1q_u16(p as *const u16);
        (f16x4_to_f32(vmovl_u16(vget_low_u16(h))), f16x4_to_f32(vmovl_high_u16(h)))
    }, |p| f16s(p))
}

unsafe fn dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    float_dot(n, w, a, 2, |p| {
        let h = vld1q_u16(p as *const u16);
        (
            vreinterpretq_f32_u32(vshlq_n_u32::<16>(vmovl_u16(vget_low_u16(h)))),
            vreinterpretq_f32_u32(vshlq_n_u32::<16>(vmovl_high_u16(h))),
        )
    }, |p| f32::from_bits((u16::from_le_bytes([*p, *p.add(1)]) as u32) << 16))
}

// ---------------------------------------------------------------------------------------------
// Integer products: `acc + the 16 products of x and y`, spread over four i32 lanes (exact).

/// ARMv8.0: `smull` + `smull2` (i16 products) and `sadalp` (pairwise into i32).
#[inline(always)]
unsafe fn dot16_plain(acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
    let lo = vmull_s8(vget_low_s8(x), vget_low_s8(y));
    vpadalq_s16(vpadalq_s16(acc, lo), vmull_high_s8(x, y))
}

/// `acc + op(x, y)` for a 4 × i32 accumulating instruction that Rust has no stable intrinsic for.
macro_rules! acc_asm {
    ($(#[$doc:meta])* $name:ident, $feat:literal, $insn:literal) => {
        $(#[$doc])*
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn $name(acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
            let mut r = acc;
            core::arch::asm!(
                concat!($insn, " {r:v}.4s, {x:v}.16b, {y:v}.16b"),
                r = inout(vreg) r,
                x = in(vreg) x,
                y = in(vreg) y,
                options(pure, nomem, nostack, preserves_flags)
            );
            r
        }
    };
}

acc_asm!(
    /// ARMv8.2 `sdot`: four i8 products summed into each i32 lane (rust-lang/rust#117224 keeps
    /// `vdotq_s32` unstable).
    dot16_sdot, "dotprod", "sdot"
);

acc_asm!(
    /// ARMv8.6 `smmla` (`FEAT_I8MM`): `acc + X·Yᵀ` for the 2×8 i8 matrices `x` (rows: bytes 0..8,
    /// 8..16) and `y`; lanes [x0·y0, x0·y1, x1·y0, x1·y1] (rust-lang/rust#117223 keeps
    /// `vmmlaq_s32` unstable).
    smmla, "i8mm", "smmla"
);

/// Elements 0..8 of `x` and of `y` as one 2×8 matrix (`zip1` on 64-bit lanes), and 8..16.
#[inline(always)]
unsafe fn pair_rows(x: int8x16_t, y: int8x16_t) -> (int8x16_t, int8x16_t) {
    let (x, y) = (vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y));
    (vreinterpretq_s8_s64(vzip1q_s64(x, y)), vreinterpretq_s8_s64(vzip2q_s64(x, y)))
}

/// [`blocks_32`]-style sums for two weight rows × four activation rows with `smmla`: each
/// (row, activation) pair's integer block sum is exact and its f32 sum runs in block order, so
/// every output has the bits of the single dot. Only the `i8mm` build uses it.
#[inline]
#[target_feature(enable = "neon,dotprod,i8mm")]
unsafe fn blocks_32_2x4(
    nb: usize,
    w: [*const u8; 2],
    wsize: usize,
    acts: [&[u8]; 4],
    asize: usize,
    q8_at: usize,
    qx: impl Fn(*const u8) -> (int8x16_t, int8x16_t),
    term: impl Fn(i32, *const u8, *const u8) -> f32,
) -> [[f32; 4]; 2] {
    let ap = acts.map(|a| a.as_ptr());
    let mut sumf = [[0f32; 4]; 2];
    for i in 0..nb {
        let (x0, x1) = (w[0].add(i * wsize), w[1].add(i * wsize));
        let ((p0, p1), (q0, q1)) = (qx(x0), qx(x1));
        let (a0, a1) = pair_rows(p0, q0);
        let (a2, a3) = pair_rows(p1, q1);
        for tp in 0..2 {
            let (y0, y1) = (ap[2 * tp].add(i * asize), ap[2 * tp + 1].add(i * asize));
            let (b0, b1) = pair_rows(load(y0.add(q8_at)), load(y1.add(q8_at)));
            let (b2, b3) = pair_rows(load(y0.add(q8_at + 16)), load(y1.add(q8_at + 16)));
            let s = smmla(smmla(smmla(smmla(vdupq_n_s32(0), a0, b0), a1, b1), a2, b2), a3, b3);
            sumf[0][2 * tp] += term(vgetq_lane_s32::<0>(s), x0, y0);
            sumf[0][2 * tp + 1] += term(vgetq_lane_s32::<1>(s), x0, y1);
            sumf[1][2 * tp] += term(vgetq_lane_s32::<2>(s), x1, y0);
            sumf[1][2 * tp + 1] += term(vgetq_lane_s32::<3>(s), x1, y1);
        }
    }
    sumf
}

/// A 32-element block type's single dot (`$dot`) and four-row tile (`$tile`): weight blocks of
/// `$wsize` bytes, activation blocks of `$asize` with quants at `$q8_at`, the quants `$qx` and
/// the per-block f32 term `$term` (see `blocks_32`). Expanded inside `block_kernels!`.
macro_rules! b32 {
    ($feat:literal, $dot:ident, $tile:ident, $tile2:ident, $wsize:literal, $asize:literal, $q8_at:literal, $qx:expr, $term:expr) => {
        #[target_feature(enable = $feat)]
        unsafe fn $dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
            blocks_32(n / 32, w.as_ptr(), $wsize, a.as_ptr(), $asize, $q8_at, $qx, $term)
        }

        #[target_feature(enable = $feat)]
        unsafe fn $tile(n: usize, w: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
            blocks_32_x4(n / 32, w.as_ptr(), $wsize, acts, $asize, $q8_at, $qx, $term)
        }

        #[allow(dead_code)] // the plain build's copy: only `sdot_build`'s is used
        #[target_feature(enable = "neon,dotprod,i8mm")]
        unsafe fn $tile2(n: usize, w: [&[u8]; 2], acts: [&[u8]; 4]) -> [[f32; 4]; 2] {
            blocks_32_2x4(n / 32, [w[0].as_ptr(), w[1].as_ptr()], $wsize, acts, $asize, $q8_at, $qx, $term)
        }
    };
}

/// The block kernels, built once per integer product (`$dot16`) with its target features.
macro_rules! block_kernels {
    ($name:ident, $feat:literal, $dot16:ident) => {
        mod $name {
            use super::*;

            pub(super) fn kernel(ty: GgmlType) -> Option<DotFn> {
                use GgmlType::*;
                Some(match ty {
                    Q4_0 => dot_q4_0_q8_0,
                    Q4_1 => dot_q4_1_q8_1,
                    Q5_0 => dot_q5_0_q8_0,
                    Q5_1 => dot_q5_1_q8_1,
                    Q8_0 => dot_q8_0_q8_0,
                    IQ4NL => dot_iq4_nl_q8_0,
                    MXFP4 => dot_mxfp4_q8_0,
                    Q4K => dot_q4_k_q8_k,
                    Q5K => dot_q5_k_q8_k,
                    Q6K => dot_q6_k_q8_k,
                    _ => return None,
                })
            }

            /// The four-activation-row tile for weight type `ty` (the 32-element block types).
            pub(super) fn tile(ty: GgmlType) -> Option<TileFn> {
                use GgmlType::*;
                Some(match ty {
                    Q4_0 => tile_q4_0,
                    Q4_1 => tile_q4_1,
                    Q5_0 => tile_q5_0,
                    Q5_1 => tile_q5_1,
                    Q8_0 => tile_q8_0,
                    IQ4NL => tile_iq4_nl,
                    MXFP4 => tile_mxfp4,
                    _ => return None,
                })
            }

            /// The two-weight-row × four-activation-row `smmla` tile for `ty` (call only where
            /// the CPU has `i8mm`).
            #[allow(dead_code)]
            pub(super) fn tile2(ty: GgmlType) -> Option<Tile2Fn> {
                use GgmlType::*;
                Some(match ty {
                    Q4_0 => tile2_q4_0,
                    Q4_1 => tile2_q4_1,
                    Q5_0 => tile2_q5_0,
                    Q5_1 => tile2_q5_1,
                    Q8_0 => tile2_q8_0,
                    IQ4NL => tile2_iq4_nl,
                    MXFP4 => tile2_mxfp4,
                    _ => return None,
                })
            }

            /// `sumf += term(sumi, weight block, activation block)` over 32-element blocks:
            /// `qx(block)` gives the 32 signed weight quants (elements 0..16, 16..32), `q8_at`
            /// where the activation's quants start, `term` the portable code's f32 expression.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn blocks_32(
                nb: usize,
                wp: *const u8,
                wsize: usize,
                ap: *const u8,
                asize: usize,
                q8_at: usize,
                qx: impl Fn(*const u8) -> (int8x16_t, int8x16_t),
                term: impl Fn(i32, *const u8, *const u8) -> f32,
            ) -> f32 {
                let mut sumf = 0f32;
                for i in 0..nb {
                    let (x, y) = (wp.add(i * wsize), ap.add(i * asize));
                    let (q0, q1) = qx(x);
                    let s = $dot16($dot16(vdupq_n_s32(0), q0, load(y.add(q8_at))), q1, load(y.add(q8_at + 16)));
                    sumf += term(vaddvq_s32(s), x, y);
                }
                sumf
            }

            /// [`blocks_32`] for four activation rows at once: each weight block unpacked once,
            /// each row's sum in its own block order (the same bits as four `blocks_32`).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn blocks_32_x4(
                nb: usize,
                wp: *const u8,
                wsize: usize,
                acts: [&[u8]; 4],
                asize: usize,
                q8_at: usize,
                qx: impl Fn(*const u8) -> (int8x16_t, int8x16_t),
                term: impl Fn(i32, *const u8, *const u8) -> f32,
            ) -> [f32; 4] {
                let ap = acts.map(|a| a.as_ptr());
                let mut sumf = [0f32; 4];
                for i in 0..nb {
                    let x = wp.add(i * wsize);
                    let (q0, q1) = qx(x);
                    for (sum, a) in sumf.iter_mut().zip(ap) {
                        let y = a.add(i * asize);
                        let s = $dot16($dot16(vdupq_n_s32(0), q0, load(y.add(q8_at))), q1, load(y.add(q8_at + 16)));
                        *sum += term(vaddvq_s32(s), x, y);
                    }
                }
                sumf
            }

            b32!($feat, dot_q4_0_q8_0, tile_q4_0, tile2_q4_0, 18, 34, 2, |x| {
                let (lo, hi) = nibbles(x.add(2));
                (vsubq_s8(lo, vdupq_n_s8(8)), vsubq_s8(hi, vdupq_n_s8(8)))
            }, |sumi, x, y| sumi as f32 * f16s(x) * f16s(y));

            // `ggml_vec_dot_q4_1_q8_1`: `sum_blocks(d_w * d_a * sumi + m_w * s_a)`.
            b32!($feat, dot_q4_1_q8_1, tile_q4_1, tile2_q4_1, 20, 36, 4, |x| nibbles(x.add(4)), |sumi, x, y| {
                (f16s(x) * f16s(y)) * sumi as f32 + f16s(x.add(2)) * f16s(y.add(2))
            });

            b32!($feat, dot_q5_0_q8_0, tile_q5_0, tile2_q5_0, 22, 34, 2, |x| {
                let (h0, h1) = high_bits(u32::from_le_bytes([*x.add(2), *x.add(3), *x.add(4), *x.add(5)]));
                let (lo, hi) = nibbles(x.add(6));
                (vsubq_s8(vorrq_s8(lo, h0), vdupq_n_s8(16)), vsubq_s8(vorrq_s8(hi, h1), vdupq_n_s8(16)))
            }, |sumi, x, y| (f16s(x) * f16s(y)) * sumi as f32);

            b32!($feat, dot_q5_1_q8_1, tile_q5_1, tile2_q5_1, 24, 36, 4, |x| {
                let (h0, h1) = high_bits(u32::from_le_bytes([*x.add(4), *x.add(5), *x.add(6), *x.add(7)]));
                let (lo, hi) = nibbles(x.add(8));
                (vorrq_s8(lo, h0), vorrq_s8(hi, h1))
            }, |sumi, x, y| (f16s(x) * f16s(y)) * sumi as f32 + f16s(x.add(2)) * f16s(y.add(2)));

            b32!($feat, dot_q8_0_q8_0, tile_q8_0, tile2_q8_0, 34, 34, 2, |x| (load(x.add(2)), load(x.add(18))), |sumi, x, y| {
                sumi as f32 * (f16s(x) * f16s(y))
            });

            b32!($feat, dot_iq4_nl_q8_0, tile_iq4_nl, tile2_iq4_nl, 18, 34, 2, |x| lut_nibbles(vld1q_s8(KVALUES_IQ4NL.as_ptr()), x.add(2)), |sumi, x, y| {
                (f16s(y) * f16s(x)) * sumi as f32
            });

            // `ggml_vec_dot_mxfp4_q8_0`: `sum_blocks(d_a * e8m0_half(e) * sumi)`.
            b32!($feat, dot_mxfp4_q8_0, tile_mxfp4, tile2_mxfp4, 17, 34, 2, |x| lut_nibbles(vld1q_s8(KVALUES_MXFP4.as_ptr()), x.add(1)), |sumi, x, y| {
                (f16s(y) * e8m0_to_f32_half(*x)) * sumi as f32
            });

            // K-quants × Q8_K (activation block: d f32 @0, qs @4, bsums @260)

            /// Q4_K (`five` false) and Q5_K: `d * sum(scale * dot) - dmin * sum(min * bsum)`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn dot_q45_k(n: usize, w: &[u8], a: &[u8], five: bool) -> f32 {
                let (bytes, qs_at) = if five { (176, 48) } else { (144, 16) };
                let (wp, ap) = (w.as_ptr(), a.as_ptr());
                let m1 = vdupq_n_u8(1);
                let mut sumf = 0f32;
                for i in 0..n / QK_K {
                    let (x, y) = (wp.add(i * bytes), ap.add(i * 292));
                    let yd = f32s(y);
                    let d = f16s(x) * yd;
                    let dmin = f16s(x.add(2)) * yd;
                    let (sc, mn) = scales_mins_k4(core::slice::from_raw_parts(x.add(4), 12));
                    let mut summ = 0i32;
                    for g in 0..8 {
                        summ += mn[g] as i32 * (i16s(y.add(260 + 4 * g)) + i16s(y.add(262 + 4 * g)));
                    }
                    let (qh0, qh1) = (vld1q_u8(x.add(16)), vld1q_u8(x.add(32)));
                    let mut isum = vdupq_n_s32(0);
                    for c in 0..4 {
                        let (mut lo0, mut hi0) = nibbles(x.add(qs_at + 32 * c));
                        let (mut lo1, mut hi1) = nibbles(x.add(qs_at + 16 + 32 * c));
                        if five {
                            // Bit 2c of qh[l] is element 64c + l's fifth bit, bit 2c + 1 element 64c + 32 + l's.
                            let bit = |qh: uint8x16_t, s: i32| {
                                let b = vandq_u8(vshlq_u8(qh, vdupq_n_s8(-(s as i8))), m1);
                                vreinterpretq_s8_u8(vshlq_n_u8::<4>(b))
                            };
                            lo0 = vorrq_s8(lo0, bit(qh0, 2 * c as i32));
                            lo1 = vorrq_s8(lo1, bit(qh1, 2 * c as i32));
                            hi0 = vorrq_s8(hi0, bit(qh0, 2 * c as i32 + 1));
                            hi1 = vorrq_s8(hi1, bit(qh1, 2 * c as i32 + 1));
                        }
                        let q8 = y.add(4 + 64 * c);
                        let s_lo = $dot16($dot16(vdupq_n_s32(0), lo0, load(q8)), lo1, load(q8.add(16)));
                        let s_hi = $dot16($dot16(vdupq_n_s32(0), hi0, load(q8.add(32))), hi1, load(q8.add(48)));
                        isum = vmlaq_n_s32(isum, s_lo, sc[2 * c] as i32);
                        isum = vmlaq_n_s32(isum, s_hi, sc[2 * c + 1] as i32);
                    }
                    sumf += d * vaddvq_s32(isum) as f32 - dmin * summ as f32;
                }
                sumf
            }

            #[target_feature(enable = $feat)]
            unsafe fn dot_q4_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
                dot_q45_k(n, w, a, false)
            }

            #[target_feature(enable = $feat)]
            unsafe fn dot_q5_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
                dot_q45_k(n, w, a, true)
            }

            /// `ggml_vec_dot_q6_K_q8_K`: `d_w * d_a * sum(scale * dot)`.
            #[target_feature(enable = $feat)]
            unsafe fn dot_q6_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
                let (wp, ap) = (w.as_ptr(), a.as_ptr());
                let (m4, m3) = (vdupq_n_u8(0x0f), vdupq_n_u8(3));
                let mut sumf = 0f32;
                for i in 0..n / QK_K {
                    let (x, y) = (wp.add(i * 210), ap.add(i * 292));
                    let mut isum = vdupq_n_s32(0);
                    for h in 0..2 {
                        for half in 0..2 {
                            let ql0 = vld1q_u8(x.add(64 * h + 16 * half));
                            let ql1 = vld1q_u8(x.add(64 * h + 32 + 16 * half));
                            let qh = vld1q_u8(x.add(128 + 32 * h + 16 * half));
                            let u = [
                                vorrq_u8(vandq_u8(ql0, m4), vshlq_n_u8::<4>(vandq_u8(qh, m3))),
                                vorrq_u8(vandq_u8(ql1, m4), vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<2>(qh), m3))),
                                vorrq_u8(vshrq_n_u8::<4>(ql0), vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<4>(qh), m3))),
                                vorrq_u8(vshrq_n_u8::<4>(ql1), vshlq_n_u8::<4>(vshrq_n_u8::<6>(qh))),
                            ];
                            for (k, &uk) in u.iter().enumerate() {
                                let q = vsubq_s8(vreinterpretq_s8_u8(uk), vdupq_n_s8(32));
                                let s = $dot16(vdupq_n_s32(0), q, load(y.add(4 + 128 * h + 32 * k + 16 * half)));
                                let scale = *x.add(192 + 8 * h + 2 * k + half) as i8 as i32;
                                isum = vmlaq_n_s32(isum, s, scale);
                            }
                        }
                    }
                    sumf += (f16s(x.add(208)) * f32s(y)) * vaddvq_s32(isum) as f32;
                }
                sumf
            }
        }
    };
}

block_kernels!(plain_build, "neon", dot16_plain);
block_kernels!(sdot_build, "neon,dotprod", dot16_sdot);
