//! AVX2 + FMA + F16C dot-product kernels (x86 / x86_64), selected at run time.
//!
//! Same integer arithmetic as the portable code (and as ggml's AVX2 kernels in
//! `ggml/src/ggml-cpu/arch/x86/quants.c`): quants are widened to bytes, multiplied pairwise with
//! `vpmaddubsw` (unsigned × signed bytes -> i16; a signed weight is split into its magnitude and
//! a sign applied to the activation with `vpsignb`), summed with the block / sub-block scale by
//! `vpmaddwd` into exact i32 lanes, and only then converted to f32 and scaled by `d_w * d_a`
//! (one FMA per block). No i16 intermediate can saturate: the largest pair sum is
//! `2 * 128 * 127 = 32512` (Q8_0 weights; activations never hold -128).
//!
//! Every kernel is an `unsafe fn` whose callers (see `super::vec_dot_with`) guarantee that the
//! CPU has AVX2, FMA and F16C and that the slices hold `n` elements' worth of blocks.

#[cfg(target_arch = "x86")]
use core::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use core::arch::x86_64::*;

use super::iq::{e8m0_to_f32_half, iq4_xs_scale, KVALUES_IQ4NL, KVALUES_MXFP4};
use super::kquants::{scales_mins_k4, scales_q3_k, QK_K};
use super::{DotFn, GgmlType, TileFn};
use core::ptr::read_unaligned;

/// Which build of the 32-element block kernels runs (see `vnni_builds!`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vnni {
    /// `vpmaddubsw` + `vpmaddwd` (any AVX2 CPU).
    Avx2,
    /// AVX-VNNI `vpdpbusd` (Alder Lake and later, Zen 5).
    AvxVnni,
    /// AVX512-VNNI `vpdpbusd` on 256-bit lanes (Ice Lake, Zen 4).
    Avx512Vnni,
}

impl Vnni {
    /// The fastest the CPU has; `LES_NO_VNNI=1` keeps the AVX2 build (same bits either way).
    pub fn best() -> Vnni {
        use std::sync::atomic::{AtomicU8, Ordering};
        static LEVEL: AtomicU8 = AtomicU8::new(0);
        match LEVEL.load(Ordering::Relaxed) {
            1 => Vnni::Avx2,
            2 => Vnni::AvxVnni,
            3 => Vnni::Avx512Vnni,
            _ => {
                let v = if std::env::var_os("LES_NO_VNNI").is_some() {
                    Vnni::Avx2
                } else if std::is_x86_feature_detected!("avxvnni") {
                    Vnni::AvxVnni
                } else if std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl") {
                    Vnni::Avx512Vnni
                } else {
                    Vnni::Avx2
                };
                LEVEL.store(v as u8 + 1, Ordering::Relaxed);
                v
            }
        }
    }

    #[cfg(test)]
    pub fn is_available(self) -> bool {
        match self {
            Vnni::Avx2 => true,
            Vnni::AvxVnni => std::is_x86_feature_detected!("avxvnni"),
            Vnni::Avx512Vnni => std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl"),
        }
    }
}

/// The AVX2 kernel for weight type `ty`, if there is one (block kernels in the CPU's best
/// [`Vnni`] build).
pub(super) fn kernel(ty: GgmlType) -> Option<DotFn> {
    kernel_with(ty, Vnni::best())
}

/// [`kernel`] with the block kernels of build `v` (the caller checks `v.is_available()`).
pub(super) fn kernel_with(ty: GgmlType, v: Vnni) -> Option<DotFn> {
    use GgmlType::*;
    macro_rules! pick {
        ($a:ident, $b:ident, $c:ident) => {
            match v {
                Vnni::Avx2 => $a as DotFn,
                Vnni::AvxVnni => $b,
                Vnni::Avx512Vnni => $c,
            }
        };
    }
    Some(match ty {
        F32 => dot_f32,
        F16 => dot_f16,
        BF16 => dot_bf16,
        Q4_0 => pick!(dot_q4_0_q8_0, dot_q4_0_q8_0_vnni, dot_q4_0_q8_0_vnni512),
        Q4_1 => pick!(dot_q4_1_q8_1, dot_q4_1_q8_1_vnni, dot_q4_1_q8_1_vnni512),
        Q5_0 => pick!(dot_q5_0_q8_0, dot_q5_0_q8_0_vnni, dot_q5_0_q8_0_vnni512),
        Q5_1 => pick!(dot_q5_1_q8_1, dot_q5_1_q8_1_vnni, dot_q5_1_q8_1_vnni512),
        Q8_0 => pick!(dot_q8_0_q8_0, dot_q8_0_q8_0_vnni, dot_q8_0_q8_0_vnni512),
        Q2K => dot_q2_k_q8_k,
        Q3K => dot_q3_k_q8_k,
        Q4K => dot_q4_k_q8_k,
        Q5K => dot_q5_k_q8_k,
        Q6K => dot_q6_k_q8_k,
        IQ4NL => pick!(dot_iq4_nl_q8_0, dot_iq4_nl_q8_0_vnni, dot_iq4_nl_q8_0_vnni512),
        IQ4XS => dot_iq4_xs_q8_k,
        MXFP4 => pick!(dot_mxfp4_q8_0, dot_mxfp4_q8_0_vnni, dot_mxfp4_q8_0_vnni512),
        _ => return None,
    })
}

/// The four-row tile for weight type `ty` (the 32-element block types), in the CPU's best
/// [`Vnni`] build.
pub(super) fn tile_kernel(ty: GgmlType) -> Option<TileFn> {
    match ty {
        GgmlType::F32 if has_avx512() => Some(x4_f32_512),
        GgmlType::F16 if has_avx512() => Some(x4_f16_512),
        _ => tile_kernel_with(ty, Vnni::best()),
    }
}

/// [`tile_kernel`] in build `v` (the caller checks `v.is_available()`).
pub(super) fn tile_kernel_with(ty: GgmlType, v: Vnni) -> Option<TileFn> {
    use GgmlType::*;
    macro_rules! pick {
        ($a:ident, $b:ident, $c:ident) => {
            match v {
                Vnni::Avx2 => $a as TileFn,
                Vnni::AvxVnni => $b,
                Vnni::Avx512Vnni => $c,
            }
        };
    }
    Some(match ty {
        Q4_0 => pick!(tile_q4_0, tile_q4_0_vnni, tile_q4_0_vnni512),
        Q4_1 => pick!(tile_q4_1, tile_q4_1_vnni, tile_q4_1_vnni512),
        Q5_0 => pick!(tile_q5_0, tile_q5_0_vnni, tile_q5_0_vnni512),
        Q5_1 => pick!(tile_q5_1, tile_q5_1_vnni, tile_q5_1_vnni512),
        Q8_0 => pick!(tile_q8_0, tile_q8_0_vnni, tile_q8_0_vnni512),
        IQ4NL => pick!(tile_iq4_nl, tile_iq4_nl_vnni, tile_iq4_nl_vnni512),
        MXFP4 => pick!(tile_mxfp4, tile_mxfp4_vnni, tile_mxfp4_vnni512),
        _ => return None,
    })
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// The two IEEE halves at `p..p + 4` (unaligned) as lanes 0 and 1 (lanes 2, 3 are zero).
/// A 32-bit `vmovd` load, so the conversion carries no false dependency on an old register.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x2(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(read_unaligned(p as *const i32)))
}

/// IEEE half at `p` (unaligned; `p..p + 4` must be readable) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(f16x2(p))
}

/// IEEE half at `p + 2` (unaligned; reads `p..p + 4`) as f32: for a half at the end of a block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_hi(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_movehdup_ps(f16x2(p)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_at(p: *const u8) -> f32 {
    read_unaligned(p as *const f32)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load256(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load128(p: *const u8) -> __m128i {
    _mm_loadu_si128(p as *const __m128i)
}

/// Sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Sum of the 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
    _mm_cvtsi128_si32(s)
}

/// 16 bytes of packed nibbles -> 32 bytes: low nibbles first (elements 0..16), then high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let t = load128(p);
    let v = _mm256_set_m128i(_mm_srli_epi16::<4>(t), t);
    _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
}

/// 32 bits -> 32 bytes, byte `i` = 0xff if bit `i` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits32_to_bytes(bits: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0),
    );
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select)
}

/// Pairwise i16 sums of `u * s` (unsigned bytes × signed bytes), then pairs of those times the
/// i16 lanes of `scale`: 8 exact i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_us(u: __m256i, s: __m256i, scale: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale)
}

/// As [`dot_us`] for signed × signed bytes (`y` must not hold -128).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_ss(x: __m256i, y: __m256i, scale: __m256i) -> __m256i {
    dot_us(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x), scale)
}

/// Per pair `p` of 16-element groups: byte indices `2p` ×8 then `2p + 1` ×8, to spread scale
/// bytes over the 16 i16 lanes of a 32-element product.
static PAIR_SHUFFLE: [[u8; 16]; 8] = {
    let mut t = [[0u8; 16]; 8];
    let mut p = 0;
    while p < 8 {
        let mut i = 0;
        while i < 16 {
            t[p][i] = (2 * p + i / 8) as u8;
            i += 1;
        }
        p += 1;
    }
    t
};

/// Scales of groups `2p` and `2p + 1` (signed bytes of `sc`) as 16 i16 lanes (8 + 8).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair_scales(sc: __m128i, p: usize) -> __m256i {
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, load128(PAIR_SHUFFLE[p].as_ptr())))
}

// ---------------------------------------------------------------------------------------------
// F32 / F16 / BF16

macro_rules! float_dot {
    ($name:ident, $esize:expr, $load:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name(n: usize, w: &[u8], a: &[u8]) -> f32 {
            let (wp, ap) = (w.as_ptr(), a.as_ptr());
            let load = $load;
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 32 <= n {
                for (k, s) in acc.iter_mut().enumerate() {
                    let o = (i + 8 * k) * $esize;
                    *s = _mm256_fmadd_ps(load(wp.add(o)), load(ap.add(o)), *s);
                }
                i += 32;
            }
            while i + 8 <= n {
                let o = i * $esize;
                acc[0] = _mm256_fmadd_ps(load(wp.add(o)), load(ap.add(o)), acc[0]);
                i += 8;
            }
            let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut sum = hsum_ps(v);
            if i < n {
                let tail = (n - i) * $esize;
                let mut wb = [0u8; 8 * $esize];
                let mut ab = [0u8; 8 * $esize];
                wb[..tail].copy_from_slice(&w[i * $esize..n * $esize]);
                ab[..tail].copy_from_slice(&a[i * $esize..n * $esize]);
                sum += hsum_ps(_mm256_mul_ps(load(wb.as_ptr()), load(ab.as_ptr())));
            }
            sum
        }
    };
}

float_dot!(dot_bf16, 2, |p: *const u8| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(load128(p)))));

/// Sum of a 16-lane vector held as `(lanes 0..8, lanes 8..16)` in the order GCC's
/// `_mm512_reduce_add_ps` adds (upper 256 + lower 256, upper 128 + lower 128, lanes (0+2, 1+3),
/// then 0 + 1): ggml's AVX-512 reductions, emulated exactly on AVX2 (lanes are independent).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce16(lo: __m256, hi: __m256) -> f32 {
    hsum_ps(_mm256_add_ps(hi, lo))
}

/// `ggml_vec_dot_f32` / `ggml_vec_dot_f16` as ggml's AVX-512 build computes them (`vec.cpp`,
/// `simd-mappings.h`: `GGML_F32_STEP` 64, `GGML_F32_EPR` 16): four 16-lane FMA accumulators over
/// 64-element steps, reduced `(0 + 2) + (1 + 3)` and then across lanes; the tail beyond a multiple
/// of 64 is added one product at a time (f32 FMA for f32 rows, f64 for f16 rows, as ggml's
/// `sumf` types are). Each 16-lane register is two AVX2 registers here.
macro_rules! ggml_float_dot {
    ($name:ident, $esize:expr, $load:expr, $tail:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name(n: usize, w: &[u8], a: &[u8]) -> f32 {
            let (wp, ap) = (w.as_ptr(), a.as_ptr());
            let load = $load;
            let mut acc = [_mm256_setzero_ps(); 8]; // accumulator j = (acc[2j], acc[2j + 1])
            let np = n & !63;
            let mut i = 0;
            while i < np {
                for (k, s) in acc.iter_mut().enumerate() {
                    let o = (i + 8 * k) * $esize;
                    *s = _mm256_fmadd_ps(load(wp.add(o)), load(ap.add(o)), *s);
                }
                i += 64;
            }
            let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
            let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
            let tail = $tail;
            tail(reduce16(lo, hi), np, n, w, a)
        }
    };
}

/// `ggml_vec_dot_f32`'s tail: the products beyond a multiple of 64, one FMA each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tail_f32(s: f32, np: usize, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut s = s;
    for i in np..n {
        s = f32_at(w.as_ptr().add(4 * i)).mul_add(f32_at(a.as_ptr().add(4 * i)), s);
    }
    s
}

/// `ggml_vec_dot_f16`'s tail: each product of two halves added to an f64 sum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tail_f16(s: f32, np: usize, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut s = s as f64;
    for i in np..n {
        s += (f16_at(w.as_ptr().add(2 * i)) * f16_at(a.as_ptr().add(2 * i))) as f64;
    }
    s as f32
}

ggml_float_dot!(dot_f32, 4, |p: *const u8| _mm256_loadu_ps(p as *const f32), |s, np, n, w, a| tail_f32(s, np, n, w, a));
ggml_float_dot!(dot_f16, 2, |p: *const u8| _mm256_cvtph_ps(load128(p)), |s, np, n, w, a| tail_f16(s, np, n, w, a));

/// [`reduce16`] of one 16-lane register.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn reduce512(v: __m512) -> f32 {
    reduce16(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))))
}

/// Four activation rows through [`dot_f32`] / [`dot_f16`]'s order (ggml's AVX-512
/// `ggml_vec_dot_f32` / `_f16`: four 16-lane accumulators over 64-element steps) on real
/// 16-lane registers: each weight step loaded (and widened) once for the four rows, the
/// accumulators (16 of them) in registers. The same bits as four single dots. For experts
/// (ggml's `mul_mat_id` never takes tinyBLAS) and rows tinyBLAS does not take.
macro_rules! ggml_float_x4_512 {
    ($name:ident, $esize:expr, $load:expr, $tail:ident) => {
        #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
        unsafe fn $name(n: usize, w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
            let load = $load;
            let wp = w.as_ptr();
            let ap = a.map(|a| a.as_ptr());
            let mut acc = [[_mm512_setzero_ps(); 4]; 4]; // [activation][accumulator]
            let np = n & !63;
            let mut i = 0;
            while i < np {
                let wv: [__m512; 4] = std::array::from_fn(|j| load(wp.add((i + 16 * j) * $esize)));
                for (k, acc) in acc.iter_mut().enumerate() {
                    for (j, s) in acc.iter_mut().enumerate() {
                        *s = _mm512_fmadd_ps(wv[j], load(ap[k].add((i + 16 * j) * $esize)), *s);
                    }
                }
                i += 64;
            }
            let mut out = [0f32; 4];
            for (k, o) in out.iter_mut().enumerate() {
                let s = _mm512_add_ps(_mm512_add_ps(acc[k][0], acc[k][2]), _mm512_add_ps(acc[k][1], acc[k][3]));
                *o = $tail(reduce512(s), np, n, w, a[k]);
            }
            out
        }
    };
}

ggml_float_x4_512!(x4_f32_512, 4, |p: *const u8| _mm512_loadu_ps(p as *const f32), tail_f32);
ggml_float_x4_512!(x4_f16_512, 2, |p: *const u8| _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)), tail_f16);

/// The batched (prompt) form of the F32 / F16 dots: llamafile's `tinyBLAS<16, __m512, ..>`
/// (`ggml-cpu/llamafile/sgemm.cpp`), which ggml's AVX-512 build uses for F32 and F16 weights when
/// a matmul has two or more activation rows and `n` is a multiple of 16: one 16-lane FMA
/// accumulator over the whole row, then `_mm512_reduce_add_ps`.
macro_rules! tinyblas_dot {
    ($name:ident, $esize:expr, $load:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn $name(n: usize, w: &[u8], a: &[u8]) -> f32 {
            debug_assert!(n % 16 == 0);
            let (wp, ap) = (w.as_ptr(), a.as_ptr());
            let load = $load;
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 16 <= n {
                lo = _mm256_fmadd_ps(load(wp.add(i * $esize)), load(ap.add(i * $esize)), lo);
                hi = _mm256_fmadd_ps(load(wp.add((i + 8) * $esize)), load(ap.add((i + 8) * $esize)), hi);
                i += 16;
            }
            reduce16(lo, hi)
        }
    };
}

tinyblas_dot!(gemm_dot_f32, 4, |p: *const u8| _mm256_loadu_ps(p as *const f32));
tinyblas_dot!(gemm_dot_f16, 2, |p: *const u8| _mm256_cvtph_ps(load128(p)));

/// Four activation rows at once through [`gemm_dot_f32`] / [`gemm_dot_f16`]'s order: one weight
/// row loaded (and widened) once for the four; each output keeps its single dot's two 8-lane
/// accumulators and reduction, so the same bits. The activations come as f32: for F16 weights
/// the f16 activation values widened (exactly) once per matmul instead of once per weight row.
macro_rules! tinyblas_x4 {
    ($name:ident, $esize:expr, $load:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn $name(n: usize, w: &[u8], a: [&[f32]; 4]) -> [f32; 4] {
            debug_assert!(n % 16 == 0 && w.len() >= n * $esize && a.iter().all(|a| a.len() >= n));
            let wp = w.as_ptr();
            let load = $load;
            let ap = a.map(|a| a.as_ptr());
            let mut lo = [_mm256_setzero_ps(); 4];
            let mut hi = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 16 <= n {
                let (wl, wh) = (load(wp.add(i * $esize)), load(wp.add((i + 8) * $esize)));
                for k in 0..4 {
                    lo[k] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(ap[k].add(i)), lo[k]);
                    hi[k] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(ap[k].add(i + 8)), hi[k]);
                }
                i += 16;
            }
            [reduce16(lo[0], hi[0]), reduce16(lo[1], hi[1]), reduce16(lo[2], hi[2]), reduce16(lo[3], hi[3])]
        }
    };
}

tinyblas_x4!(gemm_x4_f32, 4, |p: *const u8| _mm256_loadu_ps(p as *const f32));
tinyblas_x4!(gemm_x4_f16, 2, |p: *const u8| _mm256_cvtph_ps(load128(p)));

/// Whether the CPU has AVX-512F and VL (zmm registers: [`float_block_avx512`]); `LES_NO_AVX512=1`
/// turns it off (the AVX2 tiles then run, with the same bits).
pub(super) fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512vl") && std::env::var_os("LES_NO_AVX512").is_none_or(|v| v.is_empty() || v == "0"))
}

/// `RM` weight rows × `RN` activation rows of the tinyBLAS product on 16-lane registers: each
/// output is one zmm FMA accumulator over the whole row, then `_mm512_reduce_add_ps`'s order
/// ([`reduce16`] on its two halves): [`gemm_dot_f16`] / [`gemm_dot_f32`]'s bits, which are ggml's
/// AVX-512 `tinyBLAS<16, __m512, ..>`. The weight rows are loaded (and widened) once per 16
/// columns for all `RN` activations, each activation vector once for all `RM` rows.
/// `F16`: the weights are f16 (else f32); `a` rows are f32 (for F16 weights the activations
/// rounded to f16 and widened, exactly). AVX-512VL is enabled with F so that the 256- and
/// 128-bit steps of the reduction can use zmm16-31 too: without it they are VEX-encoded, which
/// confines the accumulators to 16 registers and LLVM spills most of the 24 in the loop.
/// One function per tile shape (not inlined): each loop gets its registers alone.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn tile512<const RM: usize, const RN: usize, const F16: bool>(n: usize, w: *const u8, w_stride: usize, a: *const f32, a_stride: usize, out: &mut [[f32; RN]; RM]) {
    debug_assert!(RM <= 4 && RN <= 6);
    let mut acc = [[_mm512_setzero_ps(); RN]; RM];
    let mut i = 0;
    while i < n {
        let wv: [__m512; RM] = std::array::from_fn(|r| {
            if F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(w.add(r * w_stride + i * 2) as *const __m256i))
            } else {
                _mm512_loadu_ps(w.add(r * w_stride + i * 4) as *const f32)
            }
        });
        for t in 0..RN {
            let av = _mm512_loadu_ps(a.add(t * a_stride + i));
            for r in 0..RM {
                acc[r][t] = _mm512_fmadd_ps(wv[r], av, acc[r][t]);
            }
        }
        i += 16;
    }
    for r in 0..RM {
        for t in 0..RN {
            out[r][t] = reduce512(acc[r][t]);
        }
    }
}

/// The tile shape of [`float_block_avx512`]: 4 weight rows × 6 activation rows (24 accumulators,
/// 4 weight registers and one activation register of the 32).
const TILE_RM: usize = 4;
const TILE_RN: usize = 6;

/// Calls `tile512::<RM, RN, F16>` for run-time `rm` ≤ 4, `rn` ≤ 6 and hands each output to `out`.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn tile512_any<const F16: bool>(rm: usize, rn: usize, n: usize, w: *const u8, w_stride: usize, a: *const f32, r0: usize, t0: usize, out: &mut impl FnMut(usize, usize, f32)) {
    macro_rules! go {
        ($rm:literal, $rn:literal) => {{
            let mut o = [[0f32; $rn]; $rm];
            tile512::<$rm, $rn, F16>(n, w, w_stride, a, n, &mut o);
            for (r, row) in o.iter().enumerate() {
                for (t, &v) in row.iter().enumerate() {
                    out(r0 + r, t0 + t, v);
                }
            }
        }};
    }
    macro_rules! rows {
        ($rm:literal) => {
            match rn {
                6 => go!($rm, 6),
                5 => go!($rm, 5),
                4 => go!($rm, 4),
                3 => go!($rm, 3),
                2 => go!($rm, 2),
                _ => go!($rm, 1),
            }
        };
    }
    match rm {
        4 => rows!(4),
        3 => rows!(3),
        2 => rows!(2),
        _ => rows!(1),
    }
}

/// Every product of `rows` weight rows (`w`, contiguous, `n` values each) with `toks` activation
/// rows (`a`, contiguous f32 rows of `n`) in [`tile512`]'s tiles: `out(row, token, value)`.
/// Activation rows go outermost in groups of 6 (their 16-column slices in L1 while the weight
/// rows, sized by the caller to stay in L2, pass by). `n` is a multiple of 16 and the slices hold
/// the rows (the caller checked).
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn float_block_avx512(f16: bool, n: usize, w: &[u8], rows: usize, a: &[f32], toks: usize, out: &mut impl FnMut(usize, usize, f32)) {
    let esize = if f16 { 2 } else { 4 };
    let w_stride = n * esize;
    debug_assert!(n % 16 == 0 && w.len() >= rows * w_stride && a.len() >= toks * n);
    let mut r0 = 0;
    while r0 < rows {
        let rm = (rows - r0).min(TILE_RM);
        let mut t0 = 0;
        while t0 < toks {
            let rn = (toks - t0).min(TILE_RN);
            let (wp, ap) = (w.as_ptr().add(r0 * w_stride), a.as_ptr().add(t0 * n));
            if f16 {
                tile512_any::<true>(rm, rn, n, wp, w_stride, ap, r0, t0, out);
            } else {
                tile512_any::<false>(rm, rn, n, wp, w_stride, ap, r0, t0, out);
            }
            t0 += rn;
        }
        r0 += rm;
    }
}

/// One output of [`gemm_x4_f16`] (the tile's leftover rows): [`gemm_dot_f16`]'s bits from the
/// widened activation.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemm_x1_f16(n: usize, w: &[u8], a: &[f32]) -> f32 {
    debug_assert!(n % 16 == 0 && w.len() >= n * 2 && a.len() >= n);
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        lo = _mm256_fmadd_ps(_mm256_cvtph_ps(load128(wp.add(i * 2))), _mm256_loadu_ps(ap.add(i)), lo);
        hi = _mm256_fmadd_ps(_mm256_cvtph_ps(load128(wp.add((i + 8) * 2))), _mm256_loadu_ps(ap.add(i + 8)), hi);
        i += 16;
    }
    reduce16(lo, hi)
}

/// The kernel ggml's batched `mul_mat` uses for activation row `t` of `n_tok` (≥ 2) where it sums
/// in a different order from its `vec_dot`: F32 and F16 through tinyBLAS (every row, when `n` is
/// a multiple of 16 and the weight's row count `rows` of 4), Q4_K through the repacked GEMM
/// (weights with a multiple of 8 rows, which ggml repacks) for the rows that fill groups of four
/// (the remaining rows take the GEMV, i.e. [`kernel`]'s order), Q6_K through the tiled K-quant matmul
/// from 8 rows on. `experts`: the product is a `mul_mat_id` (one expert's rows), where only the
/// tiled path applies. `None`: use [`kernel`].
pub(super) fn gemm_kernel(ty: GgmlType, n: usize, rows: usize, t: usize, n_tok: usize, experts: bool) -> Option<DotFn> {
    match ty {
        GgmlType::Q6K if n_tok >= 8 => Some(tiled_dot_q6_k_q8_k),
        _ if experts => None,
        GgmlType::F32 if n % 16 == 0 && rows % 4 == 0 => Some(gemm_dot_f32),
        GgmlType::F16 if n % 16 == 0 && rows % 4 == 0 => Some(gemm_dot_f16),
        GgmlType::Q4K if rows % 8 == 0 && t < n_tok - n_tok % 4 => Some(gemm_dot_q4_k_q8_k),
        _ => None,
    }
}

/// Q4_K as ggml's repacked GEMM (`ggml_gemm_q4_K_8x8_q8_K`, x86) sums one output: as the GEMV
/// order ([`dot_q4_k_q8_k`]) but with one FMA per pair of 32-element sub-blocks instead of per
/// super-block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_dot_q4_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q4_k_repacked::<true>(n, w, a)
}

// ---------------------------------------------------------------------------------------------
// 32-element blocks × Q8_0 / Q8_1

/// The kernels over 32-element blocks, each in three builds that differ only in how a block's
/// unsigned × signed bytes are summed into 8 exact i32 lanes (`dus`): `vpmaddubsw` + `vpmaddwd`
/// (AVX2), or one `vpdpbusd` (AVX-VNNI, or AVX512-VNNI on 256-bit lanes), as ggml's
/// `mul_sum_us8_pairs_float` picks by build flags. The integers are the same either way (no i16
/// pair sum saturates, see the module doc), so the three give the same bits; [`kernel`] picks
/// the fastest the CPU has. Each kernel also comes as a tile (`x4`): one weight row against four
/// activation rows, each output summed in exactly the single kernel's order (so the same bits),
/// with the weight block unpacked once for the four.
macro_rules! vnni_builds {
    ($($(#[$m:meta])* fn $name:ident / $vnni:ident / $v512:ident, $x4:ident / $x4vnni:ident / $x4v512:ident ($n:ident, $w:ident, $aps:ident, $dus:ident) $body:block)*) => {$(
        $(#[$m])*
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name($n: usize, $w: &[u8], a: &[u8]) -> f32 {
            let ones = _mm256_set1_epi16(1);
            let $dus = |u, s| dot_us(u, s, ones);
            let $aps = [a.as_ptr()];
            let [r]: [f32; 1] = $body;
            r
        }
        #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
        unsafe fn $vnni($n: usize, $w: &[u8], a: &[u8]) -> f32 {
            let $dus = |u, s| _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
            let $aps = [a.as_ptr()];
            let [r]: [f32; 1] = $body;
            r
        }
        #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
        unsafe fn $v512($n: usize, $w: &[u8], a: &[u8]) -> f32 {
            let $dus = |u, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
            let $aps = [a.as_ptr()];
            let [r]: [f32; 1] = $body;
            r
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $x4($n: usize, $w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
            let ones = _mm256_set1_epi16(1);
            let $dus = |u, s| dot_us(u, s, ones);
            let $aps = a.map(|a| a.as_ptr());
            $body
        }
        #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
        unsafe fn $x4vnni($n: usize, $w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
            let $dus = |u, s| _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
            let $aps = a.map(|a| a.as_ptr());
            $body
        }
        #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
        unsafe fn $x4v512($n: usize, $w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
            let $dus = |u, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
            let $aps = a.map(|a| a.as_ptr());
            $body
        }
    )*};
}

/// `sum_blocks(d_w * d_a * sumi)` over Q8_0 activations (`T` rows at `aps`), with `qx(block)`
/// giving the 32 signed weight quants and `dw(block)` the weight scale in lane 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks_q8_0<const T: usize>(
    nb: usize,
    wp: *const u8,
    wsize: usize,
    aps: [*const u8; T],
    dw: impl Fn(*const u8) -> __m128,
    qx: impl Fn(*const u8) -> __m256i,
    dus: impl Fn(__m256i, __m256i) -> __m256i,
) -> [f32; T] {
    // ggml's order (`ggml_vec_dot_q8_0_q8_0` and kin, x86 quants.c): one 8-lane accumulator,
    // `acc = fma(d_w * d_a, lanes, acc)` block by block, then `hsum(acc)`. Signed × signed as
    // |x| × sign(y, x) (`mul_sum_i8_pairs_float`).
    let mut acc = [_mm256_setzero_ps(); T];
    for i in 0..nb {
        let x = wp.add(i * wsize);
        let (q, d) = (qx(x), dw(x));
        let qa = _mm256_sign_epi8(q, q);
        for t in 0..T {
            let y = aps[t].add(i * 34);
            let p = _mm256_cvtepi32_ps(dus(qa, _mm256_sign_epi8(load256(y.add(2)), q)));
            acc[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_mul_ss(d, f16x2(y))), p, acc[t]);
        }
    }
    acc.map(|a| hsum_ps(a))
}

/// `sum_blocks(d_w * d_a * sumi + m_w * s_a)` over Q8_1 activations (`T` rows at `aps`), with
/// `qx(block)` giving the 32 unsigned weight quants. Both blocks start with a pair of halves,
/// `(d, m)` and `(d, s)`: one multiply gives `d_w * d_a` in lane 0 and `m_w * s_a` in lane 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks_q8_1<const T: usize>(
    nb: usize,
    wp: *const u8,
    wsize: usize,
    aps: [*const u8; T],
    qx: impl Fn(*const u8) -> __m256i,
    dus: impl Fn(__m256i, __m256i) -> __m256i,
) -> [f32; T] {
    // ggml's order (`ggml_vec_dot_q4_1_q8_1`, x86 quants.c, as GCC compiles it): one 8-lane
    // accumulator `acc = fma(d_w * d_a, lanes, acc)` and a scalar `summs = fma(m_w, s_a, summs)`
    // block by block, then `hsum(acc) + summs`.
    let mut acc = [_mm256_setzero_ps(); T];
    let mut summs = [_mm_setzero_ps(); T];
    for i in 0..nb {
        let x = wp.add(i * wsize);
        let (q, hx) = (qx(x), f16x2(x));
        for t in 0..T {
            let y = aps[t].add(i * 36);
            let p = _mm256_cvtepi32_ps(dus(q, load256(y.add(4))));
            let hy = f16x2(y);
            let d = _mm_mul_ss(hx, hy);
            summs[t] = _mm_fmadd_ss(_mm_movehdup_ps(hx), _mm_movehdup_ps(hy), summs[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(d), p, acc[t]);
        }
    }
    let mut out = [0f32; T];
    for t in 0..T {
        out[t] = hsum_ps(acc[t]) + _mm_cvtss_f32(summs[t]);
    }
    out
}

vnni_builds! {
    fn dot_q4_0_q8_0 / dot_q4_0_q8_0_vnni / dot_q4_0_q8_0_vnni512, tile_q4_0 / tile_q4_0_vnni / tile_q4_0_vnni512 (n, w, aps, dus) {
        let eight = _mm256_set1_epi8(8);
        blocks_q8_0(n / 32, w.as_ptr(), 18, aps, |x| f16x2(x), |x| _mm256_sub_epi8(nibbles32(x.add(2)), eight), dus)
    }

    fn dot_q5_0_q8_0 / dot_q5_0_q8_0_vnni / dot_q5_0_q8_0_vnni512, tile_q5_0 / tile_q5_0_vnni / tile_q5_0_vnni512 (n, w, aps, dus) {
        let (bit4, sixteen) = (_mm256_set1_epi8(0x10), _mm256_set1_epi8(16));
        blocks_q8_0(
            n / 32,
            w.as_ptr(),
            22,
            aps,
            |x| f16x2(x),
            |x| {
                let hi = _mm256_and_si256(bits32_to_bytes(read_unaligned(x.add(2) as *const u32)), bit4);
                _mm256_sub_epi8(_mm256_or_si256(nibbles32(x.add(6)), hi), sixteen)
            },
            dus,
        )
    }

    fn dot_q8_0_q8_0 / dot_q8_0_q8_0_vnni / dot_q8_0_q8_0_vnni512, tile_q8_0 / tile_q8_0_vnni / tile_q8_0_vnni512 (n, w, aps, dus) {
        blocks_q8_0(n / 32, w.as_ptr(), 34, aps, |x| f16x2(x), |x| load256(x.add(2)), dus)
    }

    fn dot_iq4_nl_q8_0 / dot_iq4_nl_q8_0_vnni / dot_iq4_nl_q8_0_vnni512, tile_iq4_nl / tile_iq4_nl_vnni / tile_iq4_nl_vnni512 (n, w, aps, dus) {
        let table = _mm256_broadcastsi128_si256(load128(KVALUES_IQ4NL.as_ptr() as *const u8));
        blocks_q8_0(n / 32, w.as_ptr(), 18, aps, |x| f16x2(x), |x| _mm256_shuffle_epi8(table, nibbles32(x.add(2))), dus)
    }

    fn dot_mxfp4_q8_0 / dot_mxfp4_q8_0_vnni / dot_mxfp4_q8_0_vnni512, tile_mxfp4 / tile_mxfp4_vnni / tile_mxfp4_vnni512 (n, w, aps, dus) {
        let table = _mm256_broadcastsi128_si256(load128(KVALUES_MXFP4.as_ptr() as *const u8));
        blocks_q8_0(
            n / 32,
            w.as_ptr(),
            17,
            aps,
            |x| _mm_set_ss(e8m0_to_f32_half(*x)),
            |x| _mm256_shuffle_epi8(table, nibbles32(x.add(1))),
            dus,
        )
    }

    fn dot_q4_1_q8_1 / dot_q4_1_q8_1_vnni / dot_q4_1_q8_1_vnni512, tile_q4_1 / tile_q4_1_vnni / tile_q4_1_vnni512 (n, w, aps, dus) {
        blocks_q8_1(n / 32, w.as_ptr(), 20, aps, |x| nibbles32(x.add(4)), dus)
    }

    fn dot_q5_1_q8_1 / dot_q5_1_q8_1_vnni / dot_q5_1_q8_1_vnni512, tile_q5_1 / tile_q5_1_vnni / tile_q5_1_vnni512 (n, w, aps, dus) {
        let bit4 = _mm256_set1_epi8(0x10);
        blocks_q8_1(
            n / 32,
            w.as_ptr(),
            24,
            aps,
            |x| {
                let hi = _mm256_and_si256(bits32_to_bytes(read_unaligned(x.add(4) as *const u32)), bit4);
                _mm256_or_si256(nibbles32(x.add(8)), hi)
            },
            dus,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants × Q8_K (activation block: d f32 @0, qs @4, bsums @260)

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q2_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (m3, m4) = (_mm256_set1_epi8(3), _mm_set1_epi8(0x0f));
    let mut acc = _mm256_setzero_ps();
    let mut mins_total = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(i * 84), ap.add(i * 292));
        let yd = f32_at(y);
        let raw = load128(x);
        let scales = _mm_and_si128(raw, m4);
        let mins = _mm_and_si128(_mm_srli_epi16::<4>(raw), m4);
        let summs = hsum_epi32(_mm256_madd_epi16(load256(y.add(260)), _mm256_cvtepu8_epi16(mins)));
        let dm = _mm_mul_ps(f16x2(x.add(80)), _mm_set1_ps(yd)); // (d, dmin) * d_a
        mins_total += _mm_cvtss_f32(_mm_movehdup_ps(dm)) * summs as f32;
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            let mut q2 = load256(x.add(16 + 32 * h));
            for j in 0..4 {
                let u = _mm256_and_si256(q2, m3);
                q2 = _mm256_srli_epi16::<2>(q2);
                let q8 = load256(y.add(4 + 128 * h + 32 * j));
                sumi = _mm256_add_epi32(sumi, dot_us(u, q8, pair_scales(scales, 4 * h + j)));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc) - mins_total
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q3_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (m3, m1) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let mut acc = _mm256_setzero_ps();
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(i * 110), ap.add(i * 292));
        let sc_arr = scales_q3_k(core::slice::from_raw_parts(x.add(96), 12));
        let scales = load128(sc_arr.as_ptr() as *const u8);
        // Quants are stored as u = q + 4 in 0..8; subtract 4 * sum(scale * bsum) at the end.
        let offset = _mm256_slli_epi32::<2>(_mm256_madd_epi16(load256(y.add(260)), _mm256_cvtepi8_epi16(scales)));
        let mut hm = load256(x);
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            let mut q2 = load256(x.add(32 + 32 * h));
            for j in 0..4 {
                let hi = _mm256_slli_epi16::<2>(_mm256_and_si256(hm, m1));
                let u = _mm256_or_si256(_mm256_and_si256(q2, m3), hi);
                q2 = _mm256_srli_epi16::<2>(q2);
                hm = _mm256_srli_epi16::<1>(hm);
                let q8 = load256(y.add(4 + 128 * h + 32 * j));
                sumi = _mm256_add_epi32(sumi, dot_us(u, q8, pair_scales(scales, 4 * h + j)));
            }
        }
        sumi = _mm256_sub_epi32(sumi, offset);
        let d = f16_hi(x.add(106)) * f32_at(y);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}

/// The 32 lane sums of sub-block pair `c` of a K-quant super-block: the weight quants `lo`
/// (elements `64c..64c+32`) and `hi` (the next 32) times the Q8_K activation `y`, each scaled by
/// its sub-block scale `sc[2c]` / `sc[2c + 1]` (exact i32 lanes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled_pair(lo: __m256i, hi: __m256i, y: *const u8, sc: &[u8; 8], c: usize) -> __m256i {
    let p_lo = dot_us(lo, load256(y.add(4 + 64 * c)), _mm256_set1_epi16(sc[2 * c] as i16));
    let p_hi = dot_us(hi, load256(y.add(36 + 64 * c)), _mm256_set1_epi16(sc[2 * c + 1] as i16));
    _mm256_add_epi32(p_lo, p_hi)
}

/// `Σ min · bsum` of sub-block pair `c` (Q8_K bsums are per 16 elements, at byte 260 of `y`).
#[inline]
unsafe fn pair_min(y: *const u8, mn: &[u8; 8], c: usize) -> i32 {
    let bs = |j: usize| read_unaligned(y.add(260 + 2 * j) as *const i16) as i32;
    mn[2 * c] as i32 * (bs(4 * c) + bs(4 * c + 1)) + mn[2 * c + 1] as i32 * (bs(4 * c + 2) + bs(4 * c + 3))
}

/// Q4_K in the order of ggml's repacked x86 kernels (`ggml_gemv_q4_K_8x8_q8_K` /
/// `ggml_gemm_q4_K_8x8_q8_K`, `ggml-cpu/arch/x86/repack.cpp`), which llama.cpp runs for every
/// Q4_K matrix whose row count is a multiple of 8 on AVX2 CPUs: the exact integer sums
/// `Σ scale·q·a` and `Σ min·bsum` each take one scalar FMA, `acc += isum · (d_w·d_a)`,
/// `acc_min += imin · (dmin_w·d_a)`, per super-block (GEMV) or per sub-block pair (GEMM,
/// `PER_PAIR`); the result is `acc − acc_min`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_repacked<const PER_PAIR: bool>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let m4 = _mm256_set1_epi8(0x0f);
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(i * 144), ap.add(i * 292));
        let yd = f32_at(y);
        let (dd, dm) = (f16_at(x) * yd, f16_hi(x) * yd);
        let (sc, mn) = scales_mins_k4(core::slice::from_raw_parts(x.add(4), 12));
        let (mut sumi, mut imin) = (_mm256_setzero_si256(), 0i32);
        for c in 0..4 {
            let q4 = load256(x.add(16 + 32 * c));
            let lanes = scaled_pair(_mm256_and_si256(q4, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4), y, &sc, c);
            if PER_PAIR {
                acc = (hsum_epi32(lanes) as f32).mul_add(dd, acc);
                acc_min = (pair_min(y, &mn, c) as f32).mul_add(dm, acc_min);
            } else {
                sumi = _mm256_add_epi32(sumi, lanes);
                imin += pair_min(y, &mn, c);
            }
        }
        if !PER_PAIR {
            acc = (hsum_epi32(sumi) as f32).mul_add(dd, acc);
            acc_min = (imin as f32).mul_add(dm, acc_min);
        }
    }
    acc - acc_min
}

/// [`q4_k_repacked`] for one weight row and four activation rows at once, each output summed in
/// exactly its order (the same bits): the weight's scales, mins and nibbles unpacked once for
/// the four (the batched products of Q4_K matrices: `BatchDot::dot4`). The single-row kernel
/// stays a function of its own: written as this one with one row, decode ran 0.88× as fast
/// (SmallThinker-4B shape, 2 threads, 2026-12-07).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_repacked_x4<const PER_PAIR: bool>(n: usize, w: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
    let wp = w.as_ptr();
    let aps = acts.map(|a| a.as_ptr());
    let m4 = _mm256_set1_epi8(0x0f);
    let (mut acc, mut acc_min) = ([0f32; 4], [0f32; 4]);
    for i in 0..n / QK_K {
        let x = wp.add(i * 144);
        let (dw, dmw) = (f16_at(x), f16_hi(x));
        let (sc, mn) = scales_mins_k4(core::slice::from_raw_parts(x.add(4), 12));
        let mut q = [(_mm256_setzero_si256(), _mm256_setzero_si256()); 4];
        for (c, qc) in q.iter_mut().enumerate() {
            let q4 = load256(x.add(16 + 32 * c));
            *qc = (_mm256_and_si256(q4, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4));
        }
        for j in 0..4 {
            let y = aps[j].add(i * 292);
            let yd = f32_at(y);
            let (dd, dm) = (dw * yd, dmw * yd);
            let (mut sumi, mut imin) = (_mm256_setzero_si256(), 0i32);
            for (c, &(lo, hi)) in q.iter().enumerate() {
                let lanes = scaled_pair(lo, hi, y, &sc, c);
                if PER_PAIR {
                    acc[j] = (hsum_epi32(lanes) as f32).mul_add(dd, acc[j]);
                    acc_min[j] = (pair_min(y, &mn, c) as f32).mul_add(dm, acc_min[j]);
                } else {
                    sumi = _mm256_add_epi32(sumi, lanes);
                    imin += pair_min(y, &mn, c);
                }
            }
            if !PER_PAIR {
                acc[j] = (hsum_epi32(sumi) as f32).mul_add(dd, acc[j]);
                acc_min[j] = (imin as f32).mul_add(dm, acc_min[j]);
            }
        }
    }
    [acc[0] - acc_min[0], acc[1] - acc_min[1], acc[2] - acc_min[2], acc[3] - acc_min[3]]
}

/// Q4_K tiles in the GEMV order ([`dot_q4_k_q8_k`]: per-row products, `mul_mat_id`'s experts,
/// matrices whose rows are not a multiple of 8) and in the GEMM order
/// ([`gemm_dot_q4_k_q8_k`]: batched products where ggml repacks the matrix).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q4_k_gemv(n: usize, w: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
    q4_k_repacked_x4::<false>(n, w, acts)
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q4_k_gemm(n: usize, w: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
    q4_k_repacked_x4::<true>(n, w, acts)
}

/// The Q4_K tile for a batched product of a matrix of `rows` rows ([`gemm_kernel`]'s choice of
/// order for whole groups of four activation rows).
pub(super) fn tile_q4_k(gemm: bool, rows: usize, experts: bool) -> TileFn {
    if gemm && !experts && rows % 8 == 0 { tile_q4_k_gemm } else { tile_q4_k_gemv }
}

/// Q4_K, single row: the repacked GEMV order ([`q4_k_repacked`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q4_k_repacked::<false>(n, w, a)
}

/// Q5_K, written after ggml's AVX2 `ggml_vec_dot_q5_K_q8_K` (one 8-lane FMA per super-block, the
/// mins apart; not compared with it element-wise: no reference model uses Q5_K).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let (m4, m1) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
    let mut acc = _mm256_setzero_ps();
    let mut mins_total = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(i * 176), ap.add(i * 292));
        let yd = f32_at(y);
        let (sc, mn) = scales_mins_k4(core::slice::from_raw_parts(x.add(4), 12));
        // sum over 32-element groups g of min[g] * (bsum[2g] + bsum[2g + 1]).
        let mn16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
            _mm_loadl_epi64(mn.as_ptr() as *const __m128i),
            _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
        ));
        let summ = hsum_epi32(_mm256_madd_epi16(load256(y.add(260)), mn16));
        let dm = _mm_mul_ps(f16x2(x), _mm_set1_ps(yd)); // (d, dmin) * d_a
        mins_total += _mm_cvtss_f32(_mm_movehdup_ps(dm)) * summ as f32;
        let mut qh = load256(x.add(16));
        let mut sumi = _mm256_setzero_si256();
        for c in 0..4 {
            let q4 = load256(x.add(48 + 32 * c));
            let lo = _mm256_or_si256(_mm256_and_si256(q4, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m1)));
            let hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4),
                _mm256_slli_epi16::<3>(_mm256_and_si256(qh, _mm256_set1_epi8(2))),
            );
            qh = _mm256_srli_epi16::<2>(qh);
            sumi = _mm256_add_epi32(sumi, scaled_pair(lo, hi, y, &sc, c));
        }
        acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc) - mins_total
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q6_k::<false>(n, w, a)
}

/// Q6_K as ggml's tiled K-quant matmul sums one output (`ggml-cpu/tiled`, which llama.cpp uses
/// for a batch of 8 or more activation rows, expert products included): per super-block,
/// `out = fma(isum · d_w, d_a, out)` with the exact integer sum (the kernel's `add(out,
/// mul(r, d_a))` intrinsics, fused by GCC).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiled_dot_q6_k_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q6_k::<true>(n, w, a)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const TILED: bool>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let m4 = _mm256_set1_epi8(0x0f);
    let mut acc = _mm256_setzero_ps();
    let mut tiled = 0f32;
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(i * 210), ap.add(i * 292));
        let scales = load128(x.add(192));
        // Quants are stored as u = q + 32 in 0..64; subtract 32 * sum(scale * bsum) at the end.
        let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(load256(y.add(260)), _mm256_cvtepi8_epi16(scales)));
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            let ql0 = load256(x.add(64 * h));
            let ql1 = load256(x.add(64 * h + 32));
            let qh = load256(x.add(128 + 32 * h));
            let u = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, m4),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(qh, _mm256_set1_epi8(0x03))),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, m4),
                    _mm256_slli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(0x0c))),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                    _mm256_and_si256(qh, _mm256_set1_epi8(0x30)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                    _mm256_srli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(0xc0u8 as i8))),
                ),
            ];
            for (k, &uk) in u.iter().enumerate() {
                let q8 = load256(y.add(4 + 128 * h + 32 * k));
                sumi = _mm256_add_epi32(sumi, dot_us(uk, q8, pair_scales(scales, 4 * h + k)));
            }
        }
        sumi = _mm256_sub_epi32(sumi, offset);
        if TILED {
            tiled = (hsum_epi32(sumi) as f32 * f16_hi(x.add(206))).mul_add(f32_at(y), tiled);
            continue;
        }
        let d = f16_hi(x.add(206)) * f32_at(y);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    if TILED {
        return tiled;
    }
    hsum_ps(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq4_xs_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let table = _mm256_broadcastsi128_si256(load128(KVALUES_IQ4NL.as_ptr() as *const u8));
    let mut acc = _mm256_setzero_ps();
    for i in 0..n / QK_K {
        let (x, y) = (wp.add(i * 136), ap.add(i * 292));
        let xs = core::slice::from_raw_parts(x, 136);
        let mut sumi = _mm256_setzero_si256();
        for ib in 0..8 {
            let qx = _mm256_shuffle_epi8(table, nibbles32(x.add(8 + 16 * ib)));
            let q8 = load256(y.add(4 + 32 * ib));
            let scale = _mm256_set1_epi16(iq4_xs_scale(xs, ib) as i16);
            sumi = _mm256_add_epi32(sumi, dot_ss(qx, q8, scale));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(x) * f32_at(y)), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every VNNI build of the block kernels gives the AVX2 build's bits, on random blocks and on
    /// the extremes (Q8_0 weights of -128 against activations of ±127, the largest pair sums).
    #[test]
    fn vnni_builds_and_tiles_give_the_avx2_bits() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c")) {
            return;
        }
        let builds: Vec<Vnni> = [Vnni::AvxVnni, Vnni::Avx512Vnni].into_iter().filter(|v| v.is_available()).collect();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let n = 256;
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::IQ4NL, GgmlType::MXFP4] {
            let (bs, ts) = (ty.block_size(), ty.type_size());
            for case in 0..20 {
                let mut w: Vec<u8> = (0..n / bs * ts).map(|_| rnd() as u8).collect();
                // Finite scales: (d, m) halves in [0.5, 1) for the blocks that start with them.
                for b in 0..n / bs {
                    let blk = &mut w[b * ts..(b + 1) * ts];
                    match ty {
                        GgmlType::MXFP4 => blk[0] = 120 + (rnd() % 8) as u8,
                        _ => {
                            blk[..2].copy_from_slice(&(0x3800u16 | (rnd() as u16 & 0x3ff)).to_le_bytes());
                            if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                                blk[2..4].copy_from_slice(&(0xb800u16 | (rnd() as u16 & 0x3ff)).to_le_bytes());
                            }
                            if ty == GgmlType::Q8_0 && case == 0 {
                                blk[2..].fill(0x80); // -128 everywhere
                            }
                        }
                    }
                }
                let x: Vec<f32> = (0..n)
                    .map(|i| if case == 0 { if i % 2 == 0 { 1.0 } else { -1.0 } } else { (rnd() % 2001) as f32 / 1000.0 - 1.0 })
                    .collect();
                let mut a = Vec::new();
                crate::quant::quantize_activation(crate::quant::vec_dot_type(ty), &x, &mut a).unwrap();
                let base = kernel_with(ty, Vnni::Avx2).unwrap();
                // SAFETY: AVX2/FMA/F16C checked above; `w` and `a` hold `n` elements' blocks.
                let want = unsafe { base(n, &w, &a) };
                for &v in &builds {
                    let got = unsafe { kernel_with(ty, v).unwrap()(n, &w, &a) };
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty} case {case} {v:?}: {got} vs {want}");
                }
                // Tiles: four activation rows (this one and three shifted copies), each output
                // the single kernel's bits.
                let rows: Vec<Vec<u8>> = (0..4)
                    .map(|r| {
                        let xr: Vec<f32> = x.iter().enumerate().map(|(i, v)| if r == 0 { *v } else { x[(i + 7 * r) % n] * (r as f32 + 0.5) }).collect();
                        let mut ar = Vec::new();
                        crate::quant::quantize_activation(crate::quant::vec_dot_type(ty), &xr, &mut ar).unwrap();
                        ar
                    })
                    .collect();
                let acts = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
                for v in std::iter::once(Vnni::Avx2).chain(builds.iter().copied()) {
                    let got = unsafe { tile_kernel_with(ty, v).unwrap()(n, &w, acts) };
                    for r in 0..4 {
                        let want = unsafe { base(n, &w, acts[r]) };
                        assert_eq!(got[r].to_bits(), want.to_bits(), "{ty} case {case} tile {v:?} row {r}");
                    }
                }
            }
        }
    }
}
