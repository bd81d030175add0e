//! Elementwise and normalisation ops, each following the ggml CPU kernel it mirrors.

use crate::backend::rope::{RopeKind, Yarn};
use half::f16;

/// RMSNorm (ggml `rms_norm`): the sum of squares is accumulated in f64 as ggml does, then
/// `y = x / sqrt(mean + eps)`, then multiplied by `w` (a separate `ggml_mul` in llama.cpp).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let mut sum = 0f64;
    for &v in x {
        sum += (v * v) as f64;
    }
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for ((o, &v), &g) in y.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * g;
    }
}

/// In-place RMSNorm over consecutive groups of `w.len()` elements (per-head QK-norm).
pub fn rms_norm_groups(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    let mut tmp = vec![0f32; n];
    for g in x.chunks_mut(n) {
        rms_norm(g, w, eps, &mut tmp);
        g.copy_from_slice(&tmp);
    }
}

/// cos/sin table for one position, as ggml's `ggml_rope_cache_init` builds it: theta starts at
/// the position and is multiplied by `base^(-2/n_rot)` per pair, in f32 (iterated, not powf per
/// pair), with no YaRN extrapolation (ext_factor 0, freq_scale 1, attn_factor 1). sin and cos
/// follow glibc's `sincosf` bit for bit ([`super::cmath`]), as ggml calls the C library.
/// Other transcendentals here (and in softmax, sigmoid, attention) come from the `libm` crate, not the
/// platform's C library, so that native and wasm32 builds compute bit-identical logits.
pub fn rope_cache(pos: usize, n_rot: usize, base: f32, cache: &mut Vec<f32>) {
    rope_cache_ext(pos, n_rot, base, None, cache)
}

/// [`rope_cache`] with YaRN (ggml-cpu `ggml_rope_cache_init` → `rope_yarn`): per pair i,
/// `θ_interp = freq_scale · θ`, `θ = θ_interp · (1 − r) + θ · r` with `r = ramp(i) · ext_factor`
/// (`rope_yarn_ramp` over [`yarn_corr_dims`]), and cos / sin times
/// `attn_factor · (1 + 0.1 · ln(1 / freq_scale))`. The sums of products are fused as GCC fuses
/// them in ggml (`-ffp-contract=fast`: the first product of each sum becomes the FMA).
pub fn rope_cache_ext(pos: usize, n_rot: usize, base: f32, yarn: Option<&Yarn>, cache: &mut Vec<f32>) {
    cache.clear();
    let theta_scale = rope_theta_scale(base, n_rot);
    let mut theta = pos as f32;
    let Some(y) = yarn else {
        for _ in 0..n_rot / 2 {
            let (s, c) = super::cmath::sincosf(theta);
            cache.push(c);
            cache.push(s);
            theta *= theta_scale;
        }
        return;
    };
    let corr = yarn_corr_dims(n_rot, y.n_ctx_orig, base, y.beta_fast, y.beta_slow);
    for i in 0..n_rot / 2 {
        let theta_extrap = theta;
        let theta_interp = y.freq_scale * theta_extrap;
        let (mut th, mut mscale) = (theta_interp, y.attn_factor);
        if y.ext_factor != 0.0 {
            let r = (i as f32 - corr[0]) / (corr[1] - corr[0]).max(0.001);
            let ramp_mix = (1.0 - r.clamp(0.0, 1.0)) * y.ext_factor;
            th = theta_interp.mul_add(1.0 - ramp_mix, theta_extrap * ramp_mix);
            mscale *= 0.1f32.mul_add(libm::logf(1.0 / y.freq_scale), 1.0);
        }
        let (s, c) = super::cmath::sincosf(th);
        cache.push(c * mscale);
        cache.push(s * mscale);
        theta *= theta_scale;
    }
}

/// YaRN's correction dims (ggml `ggml_rope_yarn_corr_dims`, floored / ceiled, clamped to
/// `[0, n_dims − 1]`): the pairs below `[0]` are extrapolated, above `[1]` interpolated.
pub fn yarn_corr_dims(n_dims: usize, n_ctx_orig: usize, base: f32, beta_fast: f32, beta_slow: f32) -> [f32; 2] {
    let dim = |n_rot: f32| n_dims as f32 * libm::logf(n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)) / (2.0 * libm::logf(base));
    [dim(beta_fast).floor().max(0.0), dim(beta_slow).ceil().min(n_dims as f32 - 1.0)]
}

/// `powf(base, -2 / n_rot)` (ggml's `theta_scale`), computed in f64 and rounded once: the
/// correctly rounded value, which is what glibc's `powf` returns for these arguments (checked
/// against the C library in `cmath`'s tests).
pub fn rope_theta_scale(base: f32, n_rot: usize) -> f32 {
    libm::pow(base as f64, (-2.0f32 / n_rot as f32) as f64) as f32
}

/// One rotated pair, `(x0·c − x1·s, x0·s + x1·c)`, with the products fused as GCC fuses ggml's
/// `rotate_pairs` (`-O3 -march=native`, contraction on): `fma(x0, c, −(x1·s))`,
/// `fma(x0, s, x1·c)`. Checked element by element against llama.cpp's RoPE output.
#[inline]
fn rotate(x0: f32, x1: f32, c: f32, s: f32) -> (f32, f32) {
    (x0.mul_add(c, -(x1 * s)), x0.mul_add(s, x1 * c))
}

/// Apply RoPE in place to `n_heads` consecutive heads of `head_dim` values each (only the first
/// `n_rot` dims of each head rotate).
pub fn rope(x: &mut [f32], head_dim: usize, n_rot: usize, kind: RopeKind, cache: &[f32]) {
    for h in x.chunks_mut(head_dim) {
        match kind {
            RopeKind::Norm => {
                for i in 0..n_rot / 2 {
                    let (c, s) = (cache[2 * i], cache[2 * i + 1]);
                    let (x0, x1) = (h[2 * i], h[2 * i + 1]);
                    (h[2 * i], h[2 * i + 1]) = rotate(x0, x1, c, s);
                }
            }
            RopeKind::Neox => {
                let half = n_rot / 2;
                for i in 0..half {
                    let (c, s) = (cache[2 * i], cache[2 * i + 1]);
                    let (x0, x1) = (h[i], h[i + half]);
                    (h[i], h[i + half]) = rotate(x0, x1, c, s);
                }
            }
        }
    }
}

/// e^x as ggml's vectorised `ggml_v_expf` computes it on x86 and ARM (the "ARM optimized
/// routines" expf: round x·log2(e) to an integer n, a degree-5 polynomial in the remainder, then
/// scale by 2^n; max error about 1.5 ulp). Matching it keeps SwiGLU outputs bit-equal to
/// llama.cpp's, which matters because they are then quantized to 8 bits.
#[inline]
pub fn ggml_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // log2(e) = 0x1.715476p+0
    let n = z - r;
    let b = (-n).mul_add(f32::from_bits(0x3f31_7200), x); // ln2 hi = 0x1.62e4p-1
    let b = (-n).mul_add(f32::from_bits(0x35bf_be8e), b); // ln2 lo = 0x1.7f7d1cp-20
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let p = f32::from_bits(0x3c07_2010).mul_add(b, f32::from_bits(0x3d2b_9f17)); // 0x1.0e4020p-7, 0x1.573e2ep-5
    let q = f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)); // 0x1.555e66p-3, 0x1.fffdb6p-2
    let lin = f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0); // 0x1.ffffecp-1
    let j = p.mul_add(u, q).mul_add(u, lin);
    // j · 2^n (n is an integer in [-192, 192]); split the scale so no step overflows early.
    let ni = n as i32;
    let (a, c) = (ni / 2, ni - ni / 2);
    j * f32::from_bits(((a + 127).clamp(1, 254) as u32) << 23) * f32::from_bits(((c + 127).clamp(1, 254) as u32) << 23)
}

/// SiLU as ggml's vectorised kernels compute it: x / (1 + e^-x) with [`ggml_expf`].
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + ggml_expf(-x))
}

/// SwiGLU (ggml `swiglu_split`): out = silu(gate) * up ([`silu`]'s bits; its exponential
/// without a branch, so the loop vectorises).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    let done = super::lanes::swiglu(gate, up, out);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    let done = 0;
    let (gate, up, out) = (&gate[done..], &up[done..], &mut out[done..]);
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + ggml_expf_nb(-g)) * u;
    }
}

/// Softmax (ggml `soft_max`, `ggml_vec_soft_max_f32` as ggml's AVX-512 build runs it):
/// exponentials of `x - max` in blocks of 16 with the vectorised [`ggml_expf`], each block's sum
/// added to an f64 total in `_mm512_reduce_add_ps` order, the remaining elements with the C
/// library's `expf` ([`super::cmath::expf`]) added one by one; then every value times
/// `f32(1 / total)`.
pub fn softmax(x: &[f32], y: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    let n16 = x.len() & !15;
    for (yb, xb) in y[..n16].chunks_exact_mut(16).zip(x[..n16].chunks_exact(16)) {
        for (o, &v) in yb.iter_mut().zip(xb) {
            *o = ggml_expf(v - max);
        }
        sum += reduce16(&*<&mut [f32; 16]>::try_from(yb).unwrap()) as f64;
    }
    for (o, &v) in y[n16..].iter_mut().zip(&x[n16..]) {
        let e = super::cmath::expf(v - max);
        *o = e;
        sum += e as f64;
    }
    let inv = (1.0 / sum) as f32;
    for o in y.iter_mut() {
        *o *= inv;
    }
}

/// Sum of 16 values in the order of GCC's `_mm512_reduce_add_ps`: halves 8 apart, then 4 apart,
/// then (0 + 2) + (1 + 3).
#[inline]
pub fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t = [0f32; 8];
    for i in 0..8 {
        t[i] = v[i + 8] + v[i];
    }
    let u = [t[4] + t[0], t[5] + t[1], t[6] + t[2], t[7] + t[3]];
    (u[0] + u[2]) + (u[1] + u[3])
}

/// Sigmoid as llama.cpp's qwen2moe graph computes the shared-expert gate: `silu(x) / x`
/// (`ggml_div(ggml_silu(x), x)`), where a single-element SiLU is ggml's scalar
/// `x / (1 + expf(-x))` with the C library's `expf` ([`super::cmath::expf`]). NaN at `x = 0`,
/// as there.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    (x / (1.0 + super::cmath::expf(-x))) / x
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Dot product of two f16 vectors accumulated in f32, in the order ggml's AVX-512
/// `ggml_vec_dot_f16` sums (`ggml-cpu/vec.cpp`, `simd-mappings.h`): four 16-lane accumulators over
/// 64-element steps, reduced pairwise (0+2, 1+3, then 0+1), then a lane tree (i+8, i+4, i^2, i+1);
/// a tail beyond a multiple of 64 is added one product at a time. Products of two f16 values are
/// exact in f32, so only this order decides the rounding.
#[inline]
pub fn dot_f16(a: &[f16], b: &[f16]) -> f32 {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if crate::quant::Simd::best() == crate::quant::Simd::Avx2 {
        let n = a.len().min(b.len());
        // The AVX2 F16 kernel sums in this same order (and its tail in f64): same bits, faster.
        // SAFETY: `f16` is a transparent u16; the byte views cover exactly the `n` halves.
        let (ab, bb) = unsafe {
            (core::slice::from_raw_parts(a.as_ptr() as *const u8, 2 * n), core::slice::from_raw_parts(b.as_ptr() as *const u8, 2 * n))
        };
        return crate::quant::vec_dot(crate::quant::GgmlType::F16, n, ab, bb);
    }
    dot_f16_portable(a, b, None)
}

/// [`dot_f16`]'s portable order; `bf`: `b`'s values widened to f32 beforehand (exact, so the
/// same bits), which the wasm lanes then load instead of converting (a query row dotted with
/// every cached key).
#[inline]
fn dot_f16_portable(a: &[f16], b: &[f16], bf: Option<&[f32]>) -> f32 {
    let n = a.len().min(b.len());
    let np = n & !63;
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    // SAFETY: SIMD128 is compiled in; `np <= n` values are read from each row (and from `bf`,
    // checked to hold them).
    let s = unsafe { dot_f16_lanes_wasm(a, b, bf.filter(|f| f.len() >= np), np) };
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    let s = {
        let _ = bf;
        let mut acc = [[0f32; 16]; 4];
        for i in (0..np).step_by(64) {
            for (j, accj) in acc.iter_mut().enumerate() {
                for (l, al) in accj.iter_mut().enumerate() {
                    let k = i + j * 16 + l;
                    *al = (a[k].to_f32()).mul_add(b[k].to_f32(), *al);
                }
            }
        }
        let mut v = [0f32; 16];
        for l in 0..16 {
            v[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
        }
        let mut t3 = [0f32; 8];
        for i in 0..8 {
            t3[i] = v[i + 8] + v[i];
        }
        let mut t6 = [0f32; 4];
        for i in 0..4 {
            t6[i] = t3[i + 4] + t3[i];
        }
        (t6[0] + t6[2]) + (t6[1] + t6[3])
    };
    let mut s = s as f64;
    for k in np..n {
        s += (a[k].to_f32() * b[k].to_f32()) as f64;
    }
    s as f32
}

/// `acc[i] = f16(f32(acc[i]) · s)` (ggml `ggml_vec_scale_f16`), element by element; 8 lanes at a
/// time with F16C at the AVX2 kernel level (the same bits).
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn scale_f16(acc: &mut [f16], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::Simd::best() == crate::quant::Simd::Avx2 {
        // SAFETY: the Avx2 level implies AVX2, FMA and F16C.
        return unsafe { f16_lanes_x86::<false>(acc, &[], s) };
    }
    for a in acc.iter_mut() {
        *a = f16::from_f32(a.to_f32() * s);
    }
}

/// `acc[i] = f16(fma(f32(v[i]), s, f32(acc[i])))` (ggml `ggml_vec_mad_f16` on x86: an f32 FMA
/// rounded back to f16), element by element; 8 lanes at a time at the AVX2 kernel level.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn mad_f16(acc: &mut [f16], v: &[f16], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::Simd::best() == crate::quant::Simd::Avx2 {
        // SAFETY: the Avx2 level implies AVX2, FMA and F16C.
        return unsafe { f16_lanes_x86::<true>(acc, v, s) };
    }
    for (a, &vv) in acc.iter_mut().zip(v) {
        *a = f16::from_f32(vv.to_f32().mul_add(s, a.to_f32()));
    }
}

/// [`scale_f16`] on wasm, whose accumulator holds its halves as f32 ([`attend_head_ext`]):
/// [`super::lanes::scale_halves`].
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn scale_f16(acc: &mut [f32], s: f32) {
    super::lanes::scale_halves(acc, s)
}

/// [`mad_f16`] on wasm, whose accumulator holds its halves as f32: [`super::lanes::mad_halves`].
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn mad_f16(acc: &mut [f32], v: &[f16], s: f32) {
    super::lanes::mad_halves(acc, v, s, super::lanes::relaxed_madd_is_fused())
}

/// [`scale_f16`] (`MAD = false`) and [`mad_f16`] (`MAD = true`) in 8-lane F16C steps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma,f16c")]
unsafe fn f16_lanes_x86<const MAD: bool>(acc: &mut [f16], v: &[f16], s: f32) {
    use core::arch::x86_64::*;
    let n = if MAD { acc.len().min(v.len()) } else { acc.len() };
    let sv = _mm256_set1_ps(s);
    let mut i = 0;
    while i + 8 <= n {
        let pa = acc.as_mut_ptr().add(i) as *mut __m128i;
        let a = _mm256_cvtph_ps(_mm_loadu_si128(pa));
        let r = if MAD {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i));
            _mm256_fmadd_ps(x, sv, a)
        } else {
            _mm256_mul_ps(a, sv)
        };
        _mm_storeu_si128(pa, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
        i += 8;
    }
    for j in i..n {
        let a = acc[j].to_f32();
        acc[j] = f16::from_f32(if MAD { v[j].to_f32().mul_add(s, a) } else { a * s });
    }
}

/// [`dot_f16`]'s four 16-lane accumulators over the first `np` (a multiple of 64) halves, four
/// lanes at a time on wasm SIMD128, reduced in the portable order (lanes `l`, `l + 4`, `l + 8`,
/// `l + 12` of an accumulator are lane `l` of its four vectors). The FMA of the portable order is a multiply then an add
/// here, with the same bits: the product of two halves (11 significant bits each, exponents
/// within 2^±48) is exact in f32, so `fma(a, b, c)` rounds once, as `a · b + c` does.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[target_feature(enable = "simd128")]
unsafe fn dot_f16_lanes_wasm(a: &[f16], b: &[f16], bf: Option<&[f32]>, np: usize) -> f32 {
    use core::arch::wasm32::*;
    let halves = |p: *const f16| crate::quant::f16x8_to_f32(v128_load(p as *const v128));
    let mut acc = [f32x4_splat(0.0); 16]; // accumulator j's lanes 4q..4q+4 at 4j + q
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut i = 0;
    while i < np {
        for j in 0..4 {
            for h in 0..2 {
                let k = i + 16 * j + 8 * h;
                let (a0, a1) = halves(pa.add(k));
                let (b0, b1) = match bf {
                    Some(f) => (v128_load(f.as_ptr().add(k) as *const v128), v128_load(f.as_ptr().add(k + 4) as *const v128)),
                    None => halves(pb.add(k)),
                };
                let q = 4 * j + 2 * h;
                acc[q] = f32x4_add(f32x4_mul(a0, b0), acc[q]);
                acc[q + 1] = f32x4_add(f32x4_mul(a1, b1), acc[q + 1]);
            }
        }
        i += 64;
    }
    sum_lanes16_wasm(&acc)
}

/// [`dot_f16`]'s reduction of its four 16-lane accumulators held as 16 vectors of four (lanes
/// `4q..4q + 4` of accumulator `j` at `acc[4j + q]`), in the portable order:
/// v[l] = (acc0[l] + acc2[l]) + (acc1[l] + acc3[l]); t3[i] = v[i + 8] + v[i];
/// t6[i] = t3[i + 4] + t3[i]; then (t6[0] + t6[2]) + (t6[1] + t6[3]).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn sum_lanes16_wasm(acc: &[core::arch::wasm32::v128; 16]) -> f32 {
    use core::arch::wasm32::*;
    let v = |q: usize| f32x4_add(f32x4_add(acc[q], acc[8 + q]), f32x4_add(acc[4 + q], acc[12 + q]));
    let t6 = f32x4_add(f32x4_add(v(3), v(1)), f32x4_add(v(2), v(0)));
    let h = f32x4_add(t6, i32x4_shuffle::<2, 3, 2, 3>(t6, t6));
    f32x4_extract_lane::<0>(h) + f32x4_extract_lane::<1>(h)
}

/// [`dot_f16`] for many rows of one length, its kernel looked up once.
struct DotF16(Option<crate::quant::BatchDot>);

impl DotF16 {
    fn new(n: usize) -> Self {
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        if crate::quant::Simd::best() == crate::quant::Simd::Avx2 {
            return DotF16(Some(crate::quant::BatchDot::new(crate::quant::GgmlType::F16, n, 1, 1, false, true)));
        }
        let _ = n;
        DotF16(None)
    }

    #[inline]
    fn dot(&self, a: &[f16], b: &[f16]) -> f32 {
        match &self.0 {
            // As `dot_f16`'s x86 path (the AVX2 F16 kernel), without the lookup.
            Some(d) => {
                let n = a.len().min(b.len());
                // SAFETY: `f16` is a transparent u16; the byte views cover exactly `n` halves.
                let (ab, bb) = unsafe {
                    (core::slice::from_raw_parts(a.as_ptr() as *const u8, 2 * n), core::slice::from_raw_parts(b.as_ptr() as *const u8, 2 * n))
                };
                d.dot(ab, bb, 0)
            }
            None => dot_f16(a, b),
        }
    }

    /// [`DotF16::dot`] with `b`'s values also given widened to f32 (`bf`, exact): the portable
    /// order's wasm lanes take them instead of converting `b` again.
    #[inline]
    fn dot_widened(&self, a: &[f16], b: &[f16], bf: &[f32]) -> f32 {
        match &self.0 {
            Some(_) => self.dot(a, b),
            None => dot_f16_portable(a, b, Some(bf)),
        }
    }
}

/// One query head attending over `n_kv` cached positions, as ggml's CPU flash-attention kernel
/// (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`) does with an f16 KV cache: Q is rounded
/// to f16, scores are f16 dots scaled by `scale`, the softmax is online, and the V accumulator is
/// kept in f16.
pub fn attend_head(q: &[f32], k_rows: &[f16], v_rows: &[f16], head_dim: usize, n_kv: usize, scale: f32, out: &mut [f32], qh: &mut Vec<f16>, acc: &mut Vec<f16>) {
    attend_head_ext(q, k_rows, v_rows, head_dim, 0..n_kv, None, scale, out, qh, acc)
}

/// [`attend_head`] over positions `kv` only (a sliding window: ggml skips masked positions,
/// `-INFINITY` in the mask), then an attention sink: `sink` joins the softmax's sum (a new
/// maximum rescales the f32 accumulator), as ggml's flash-attention kernel applies `sinks`.
#[allow(clippy::too_many_arguments)]
pub fn attend_head_ext(q: &[f32], k_rows: &[f16], v_rows: &[f16], head_dim: usize, kv: std::ops::Range<usize>, sink: Option<f32>, scale: f32, out: &mut [f32], qh: &mut Vec<f16>, acc: &mut Vec<f16>) {
    qh.clear();
    qh.extend(q.iter().map(|&v| f16::from_f32(v)));
    // The accumulator's halves: as halves natively, as f32 values on wasm (each step rounds them
    // to halves: the same values, without converting them in and out at every position).
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    let mut halves = vec![0f32; head_dim];
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    let acc = {
        let _ = acc;
        &mut halves
    };
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        acc.clear();
        acc.resize(head_dim, f16::ZERO);
    }
    let mut s_sum = 0f32;
    let mut m = f32::NEG_INFINITY;
    let dot = DotF16::new(head_dim);
    let qf: Vec<f32> = if cfg!(target_arch = "wasm32") { qh.iter().map(|h| h.to_f32()).collect() } else { Vec::new() };
    for j in kv {
        let k = &k_rows[j * head_dim..(j + 1) * head_dim];
        let s = if qf.is_empty() { dot.dot(k, qh) } else { dot.dot_widened(k, qh, &qf) } * scale;
        let mut ms = 1.0f32;
        let mut vs = 1.0f32;
        if s > m {
            let m_old = m;
            m = s;
            ms = super::cmath::expf(m_old - m);
            scale_f16(acc, ms);
        } else {
            vs = super::cmath::expf(s - m);
        }
        let v = &v_rows[j * head_dim..(j + 1) * head_dim];
        mad_f16(acc, v, vs);
        s_sum = s_sum.mul_add(ms, vs);
    }
    finish_head(acc.iter().map(|&a| f32::from(a)), sink, m, s_sum, f32::mul_add, out);
}

/// The end of one head's online softmax (ggml's flash-attention kernel): the sink, if any, joins
/// the sum `s_sum` (a new maximum over `m` rescales the accumulator), then `out = acc / sum`.
/// `fma(a, b, c)`: `a · b + c` rounded once.
fn finish_head(acc: impl Iterator<Item = f32>, sink: Option<f32>, m: f32, mut s_sum: f32, fma: impl Fn(f32, f32, f32) -> f32, out: &mut [f32]) {
    let mut acc_scale = None;
    if let Some(s) = sink {
        let (mut ms, mut vs) = (1.0f32, 1.0f32);
        if s > m {
            ms = super::cmath::expf(m - s);
            acc_scale = Some(ms);
        } else {
            vs = super::cmath::expf(s - m);
        }
        s_sum = fma(s_sum, ms, vs);
    }
    let inv = if s_sum == 0.0 { 0.0 } else { 1.0 / s_sum };
    for (o, a) in out.iter_mut().zip(acc) {
        *o = match acc_scale {
            Some(ms) => (a * ms) * inv,
            None => a * inv,
        };
    }
}

/// Whether [`attend_heads`] takes the query heads of one KV head together here: on wasm SIMD128
/// (keys and values widened from f16 once per position for all of them) when the head size is a
/// multiple of 64 (the f16 dot's blocks, no tail); elsewhere each head is its own task.
pub fn attend_heads_grouped(head_dim: usize) -> bool {
    cfg!(all(target_arch = "wasm32", target_feature = "simd128")) && head_dim % 64 == 0 && head_dim > 0
}

/// [`attend_head_ext`] for `g` query heads that share one KV head (grouped-query attention):
/// `q` and `out` hold the heads one after another (`g · head_dim`), `sinks` the heads' sinks in
/// the same order (`None`, or fewer values: no sink). Each head gets [`attend_head_ext`]'s bits.
#[allow(clippy::too_many_arguments)]
pub fn attend_heads(q: &[f32], g: usize, k_rows: &[f16], v_rows: &[f16], head_dim: usize, kv: std::ops::Range<usize>, sinks: Option<&[f32]>, scale: f32, out: &mut [f32]) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if attend_heads_grouped(head_dim) {
        // SAFETY: SIMD128 is compiled in; the head size is a positive multiple of 64.
        return unsafe { attend_heads_wasm(q, g, k_rows, v_rows, head_dim, kv, sinks, scale, out) };
    }
    let (mut qb, mut acc) = (Vec::new(), Vec::new());
    for i in 0..g {
        let sink = sinks.and_then(|s| s.get(i).copied());
        let (qi, oi) = (&q[i * head_dim..(i + 1) * head_dim], &mut out[i * head_dim..(i + 1) * head_dim]);
        attend_head_ext(qi, k_rows, v_rows, head_dim, kv.clone(), sink, scale, oi, &mut qb, &mut acc);
    }
}

/// [`attend_heads`] on wasm SIMD128, `head_dim` a multiple of 64: each position's key and value
/// rows are widened to f32 once (exact) and serve all `g` heads; per head the steps of
/// [`attend_head_ext`]'s wasm path in its order: the f16 dot's sixteen lane accumulators
/// (`dot_f16_lanes_wasm`), the online softmax with glibc's `expf`, the accumulator's halves held as
/// f32 and rounded to halves at each step ([`super::lanes::mad_halves`]), the running sum's FMA
/// four lanes wide ([`super::lanes::fma4`]) instead of the software `fmaf`.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[target_feature(enable = "simd128")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_heads_wasm(q: &[f32], g: usize, k_rows: &[f16], v_rows: &[f16], hd: usize, kv: std::ops::Range<usize>, sinks: Option<&[f32]>, scale: f32, out: &mut [f32]) {
    use super::lanes;
    use core::arch::wasm32::*;
    let fused = lanes::relaxed_madd_is_fused();
    let fma1 = |a: f32, b: f32, c: f32| f32x4_extract_lane::<0>(lanes::fma4(f32x4_splat(a), f32x4_splat(b), f32x4_splat(c), fused));
    let qf: Vec<f32> = q[..g * hd].iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    let mut acc = vec![0f32; g * hd];
    let (mut m, mut s_sum) = (vec![f32::NEG_INFINITY; g], vec![0f32; g]);
    let (mut kf, mut vf) = (vec![0f32; hd], vec![0f32; hd]);
    let widen = |src: &[f16], dst: &mut [f32]| {
        for (s, d) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)) {
            let (a, b) = crate::quant::f16x8_to_f32(v128_load(s.as_ptr() as *const v128));
            v128_store(d.as_mut_ptr() as *mut v128, a);
            v128_store(d.as_mut_ptr().add(4) as *mut v128, b);
        }
    };
    let ld = |p: &[f32], i: usize| v128_load(p.as_ptr().add(i) as *const v128);
    for j in kv {
        widen(&k_rows[j * hd..(j + 1) * hd], &mut kf);
        widen(&v_rows[j * hd..(j + 1) * hd], &mut vf);
        for i in 0..g {
            let qi = &qf[i * hd..(i + 1) * hd];
            // `dot_f16_lanes_wasm`: lanes 4r..4r + 4 of each 64-block in accumulator r.
            let mut d = [f32x4_splat(0.0); 16];
            for b in (0..hd).step_by(64) {
                for (r, dr) in d.iter_mut().enumerate() {
                    *dr = f32x4_add(f32x4_mul(ld(&kf, b + 4 * r), ld(qi, b + 4 * r)), *dr);
                }
            }
            let s = sum_lanes16_wasm(&d) * scale;
            let a = &mut acc[i * hd..(i + 1) * hd];
            let (mut ms, mut vs) = (1.0f32, 1.0f32);
            if s > m[i] {
                ms = super::cmath::expf(m[i] - s);
                m[i] = s;
                lanes::scale_halves(a, ms);
            } else {
                vs = super::cmath::expf(s - m[i]);
            }
            let sv = f32x4_splat(vs);
            for r in (0..hd).step_by(4) {
                let pa = a.as_mut_ptr().add(r) as *mut v128;
                v128_store(pa, lanes::round_half(lanes::fma4(ld(&vf, r), sv, v128_load(pa), fused)));
            }
            s_sum[i] = fma1(s_sum[i], ms, vs);
        }
    }
    for i in 0..g {
        let sink = sinks.and_then(|s| s.get(i).copied());
        finish_head(acc[i * hd..(i + 1) * hd].iter().copied(), sink, m[i], s_sum[i], fma1, &mut out[i * hd..(i + 1) * hd]);
    }
}

/// [`ggml_expf`] without a branch, so a loop over it vectorises (same bits for every input:
/// tested against it).
#[inline(always)]
pub fn ggml_expf_nb(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000);
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(f32::from_bits(0x3f31_7200), x);
    let b = (-n).mul_add(f32::from_bits(0x35bf_be8e), b);
    let u = b * b;
    let p = f32::from_bits(0x3c07_2010).mul_add(b, f32::from_bits(0x3d2b_9f17));
    let q = f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb));
    let lin = f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0);
    let j = p.mul_add(u, q).mul_add(u, lin);
    let ni = n.clamp(-256.0, 256.0) as i32; // NaN (x = ±inf) → 0; decided by the select below
    let (a, c) = (ni / 2, ni - ni / 2);
    let y = j * f32::from_bits(((a + 127).clamp(1, 254) as u32) << 23) * f32::from_bits(((c + 127).clamp(1, 254) as u32) << 23);
    let big = if n <= 0.0 { 0.0 } else { f32::INFINITY };
    // `!(n.abs() <= 192)` is also true for NaN n (x = ±inf gives n = ±inf, never NaN).
    if n.abs() > 192.0 { big } else { y }
}

/// gpt-oss's gated activation (ggml `swiglu_oai`, `ggml-cpu/ops.cpp`): `x = min(g, limit)`,
/// `y = clamp(u, −limit, limit)`, `h = x / (1 + expf(alpha · −x)) · (y + 1)`, with the C
/// library's `expf` ([`super::cmath::expf`]).
pub fn swiglu_oai(g: &[f32], u: &[f32], h: &mut [f32], alpha: f32, limit: f32) {
    for ((o, &gv), &uv) in h.iter_mut().zip(g).zip(u) {
        let x = if limit < gv { limit } else { gv };
        let y = uv.clamp(-limit, limit);
        let glu = x / (1.0 + super::cmath::expf(alpha * -x));
        *o = glu * (y + 1.0);
    }
}

/// ReGLU as ggml's `reglu` (`ggml_vec_reglu_f32`): `g > 0 ? g · u : 0`.
pub fn reglu(g: &[f32], u: &[f32], h: &mut [f32]) {
    for ((o, &gv), &uv) in h.iter_mut().zip(g).zip(u) {
        *o = if gv > 0.0 { gv * uv } else { 0.0 };
    }
}

/// Uniform values in [−1, 1) from a 32-bit xorshift (Marsaglia) seeded with `seed` ≠ 0: test
/// inputs that need no crate.
#[cfg(test)]
pub(crate) fn test_rng(seed: u32) -> impl FnMut() -> f32 {
    let mut z = seed;
    move || {
        z ^= z << 13;
        z ^= z >> 17;
        z ^= z << 5;
        z as f32 / u32::MAX as f32 * 2.0 - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branchless_expf_has_ggml_expf_bits() {
        let mut xs = vec![f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, -87.3, 88.7, -103.0, -150.0, 200.0, -200.0, 1e-30, -1e-30, 133.0, -133.0, 126.9, -126.9];
        let mut rnd = test_rng(0x1234_5678);
        for _ in 0..200_000 {
            xs.push(rnd() * 150.0);
        }
        for x in xs {
            assert_eq!(ggml_expf_nb(x).to_bits(), ggml_expf(x).to_bits(), "x = {x:e}");
        }
    }

    /// A prompt's causal conv in channel blocks gives the per-token steps' outputs and final
    /// state, bit for bit.
    #[test]
    fn conv_over_channels_equals_token_steps() {
        let (cols, d_conv, n) = (10, 4, 7);
        let v = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 300.0 - 1.6;
        let x: Vec<f32> = (0..n * cols).map(|i| v(i + 7)).collect();
        let w: Vec<f32> = (0..cols * d_conv).map(|i| v(i + 1000)).collect();
        let st0: Vec<f32> = (0..cols * (d_conv - 1)).map(|i| v(i + 2000)).collect();
        for silu in [true, false] {
            let mut st_ref = st0.clone();
            let mut y_ref = vec![0f32; n * cols];
            for t in 0..n {
                conv_silu_step(&mut st_ref, &w, d_conv, &x[t * cols..(t + 1) * cols], &mut y_ref[t * cols..(t + 1) * cols], silu);
            }
            for block in [1, 3, cols] {
                let mut st = st0.clone();
                let mut y = vec![f32::NAN; n * cols];
                for (bi, sb) in st.chunks_mut(block * (d_conv - 1)).enumerate() {
                    let c0 = bi * block;
                    let nb = sb.len() / (d_conv - 1);
                    conv_silu_channels(sb, &w[c0 * d_conv..(c0 + nb) * d_conv], d_conv, &x, cols, c0, n, silu, &mut |t, vals| y[t * cols + c0..t * cols + c0 + nb].copy_from_slice(vals));
                }
                assert!(y.iter().zip(&y_ref).all(|(a, b)| a.to_bits() == b.to_bits()), "block {block}, silu {silu}: outputs differ");
                assert!(st.iter().zip(&st_ref).all(|(a, b)| a.to_bits() == b.to_bits()), "block {block}, silu {silu}: state differs");
            }
        }
    }

    #[test]
    fn rope_norm_rotates_pairs_by_position_angle() {
        // n_rot = 2: a single pair rotated by theta = pos (base^0 = 1).
        let mut cache = Vec::new();
        rope_cache(3, 2, 10000.0, &mut cache);
        let mut x = [1.0f32, 0.0];
        rope(&mut x, 2, 2, RopeKind::Norm, &cache);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[1] - 3f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn top_k_orders_by_value() {
        assert_eq!(top_k(&[0.1, 0.7, 0.3, 0.7], 3), vec![1, 3, 2]);
    }

    #[test]
    fn attention_single_position_returns_v() {
        let k = vec![f16::from_f32(1.0); 4];
        let v: Vec<f16> = [1.0f32, -2.0, 0.5, 4.0].iter().map(|&x| f16::from_f32(x)).collect();
        let mut out = vec![0f32; 4];
        attend_head(&[0.3, 0.1, 0.2, 0.4], &k, &v, 4, 1, 0.5, &mut out, &mut Vec::new(), &mut Vec::new());
        assert_eq!(out, vec![1.0, -2.0, 0.5, 4.0]);
    }
}


// ---- Gated DeltaNet (qwen35moe / qwen3next), llama.cpp `src/models/delta-net-base.cpp`, ----
// ---- `qwen35moe.cpp` and the CPU kernels of `ggml-cpu/ops.cpp`                        ----

/// Logistic sigmoid as ggml's `sigmoid` op computes it: `1 / (1 + expf(-x))` with the C
/// library's `expf` ([`super::cmath::expf`]). (qwen2moe's gate is [`sigmoid`], `silu(x) / x`.)
#[inline]
pub fn sigmoid_exp(x: f32) -> f32 {
    1.0 / (1.0 + super::cmath::expf(-x))
}

/// Softplus as ggml's `softplus` op: `x > 20 ? x : logf(1 + expf(x))`, `expf` as glibc's
/// ([`super::cmath::expf`]) and `logf` the `libm` crate's (FreeBSD `e_logf.c`: f32 arithmetic
/// only, so the GPU's exact path repeats it; glibc's `logf` may differ in the last bit).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        libm::logf(1.0 + super::cmath::expf(x))
    }
}

/// `ggml_vec_dot_f32` in ggml's AVX-512 order on x86 (AVX2 builds), LES's portable order elsewhere.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    crate::quant::vec_dot(crate::quant::GgmlType::F32, n, bytemuck::cast_slice(&a[..n]), bytemuck::cast_slice(&b[..n]))
}

/// One token of ggml's `ssm_conv` (depthwise causal conv1d) for every channel, then SiLU:
/// `y[c] = silu(Σ_k w[c·K + k] · in[c][k])` over `in[c] = [state[c] (K − 1 values), x[c]]`,
/// summed in k order, each term a fused multiply-add (`sum = fma(in, w, sum)`: ggml's loop as
/// GCC contracts it with `-march=native` on FMA machines; bit-identical to llama.cpp 0c1e570's
/// AVX-512 build on lfm2's short convolution, 2026-12-07); then the state shifts by one (it
/// keeps the last K − 1 inputs of each channel). `silu_out` false: no activation (lfm2).
pub fn conv_silu_step(state: &mut [f32], w: &[f32], d_conv: usize, x: &[f32], y: &mut [f32], silu_out: bool) {
    let kc = d_conv - 1;
    for (c, (&xc, yc)) in x.iter().zip(y.iter_mut()).enumerate() {
        let st = &mut state[c * kc..(c + 1) * kc];
        let wc = &w[c * d_conv..(c + 1) * d_conv];
        let mut sum = 0f32;
        for k in 0..kc {
            sum = st[k].mul_add(wc[k], sum);
        }
        sum = xc.mul_add(wc[kc], sum);
        *yc = if silu_out { silu(sum) } else { sum };
        st.copy_within(1.., 0);
        st[kc - 1] = xc;
    }
}

/// [`conv_silu_step`] over many tokens for a block of channels: channel `c`'s inputs
/// `[state (K − 1), x[0][c], x[1][c], …]` as one window, each output summed in the same order
/// (`y[t] = silu(Σ_k w[k] · win[t + k])`, fused multiply-adds in k order; SiLU's exponential
/// branch-free, [`ggml_expf_nb`], same bits) and the state left holding the last K − 1 inputs:
/// the bits of the per-token steps. `x`: `n_tok` rows of `cols`; this call takes channels
/// `c0 .. c0 + state.len() / (K − 1)` (`state`, `w`: those channels' rows) and hands each
/// token's outputs for them to `out(token, values)`.
#[allow(clippy::too_many_arguments)]
pub fn conv_silu_channels(state: &mut [f32], w: &[f32], d_conv: usize, x: &[f32], cols: usize, c0: usize, n_tok: usize, silu_out: bool, out: &mut impl FnMut(usize, &[f32])) {
    let kc = d_conv - 1;
    let nc = state.len() / kc.max(1);
    let span = kc + n_tok;
    let mut win = vec![0f32; nc * span];
    for (i, st) in state.chunks_exact(kc).enumerate() {
        win[i * span..i * span + kc].copy_from_slice(st);
    }
    for t in 0..n_tok {
        for (i, &xv) in x[t * cols + c0..t * cols + c0 + nc].iter().enumerate() {
            win[i * span + kc + t] = xv;
        }
    }
    let mut row = vec![0f32; nc];
    for t in 0..n_tok {
        for (i, (o, wc)) in row.iter_mut().zip(w.chunks_exact(d_conv)).enumerate() {
            let wi = &win[i * span + t..i * span + t + d_conv];
            let mut sum = 0f32;
            for (&a, &wk) in wi.iter().zip(wc) {
                sum = a.mul_add(wk, sum);
            }
            *o = sum;
        }
        if silu_out {
            for v in row.iter_mut() {
                *v = *v / (1.0 + ggml_expf_nb(-*v));
            }
        }
        out(t, &row);
    }
    for (i, st) in state.chunks_exact_mut(kc).enumerate() {
        st.copy_from_slice(&win[i * span + n_tok..(i + 1) * span]);
    }
}

/// L2-normalisation of one head as llama.cpp's `build_gdn_l2_norm`: `rms_norm(x, eps / n)`
/// then `scale(1 / sqrt(n))`, i.e. `x / sqrt(Σx² + eps)` with ggml's roundings.
pub fn l2_norm(x: &mut [f32], eps: f32) {
    let n = x.len() as f32;
    let mut sum = 0f64;
    for &v in x.iter() {
        sum += (v * v) as f64;
    }
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps / n).sqrt();
    let s2 = 1.0f32 / n.sqrt();
    for v in x.iter_mut() {
        *v = (*v * scale) * s2;
    }
}

/// One token of one value head of ggml's `gated_delta_net` (`ops.cpp`,
/// `ggml_compute_forward_gated_delta_net_one_chunk`, scalar decay): with the S×S state `m`
/// stored transposed (`m[j·S + i]` = S[i][j]),
/// `m *= expf(g)`; `d[j] = (v[j] − m_j·k) · beta`; `m_j += d[j] · k`; `o[j] = (m_j·q) / sqrt(S)`,
/// the dot products and multiply-adds in ggml's orders ([`dot_f32`], FMA).
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step(m: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, d: &mut [f32], o: &mut [f32]) {
    let s = v.len();
    let decay = super::cmath::expf(g);
    for x in m.iter_mut() {
        *x *= decay;
    }
    for j in 0..s {
        let sum = dot_f32(&m[j * s..(j + 1) * s], k);
        d[j] = (v[j] - sum) * beta;
    }
    for j in 0..s {
        let dj = d[j];
        for (mi, &ki) in m[j * s..(j + 1) * s].iter_mut().zip(k) {
            *mi = ki.mul_add(dj, *mi);
        }
    }
    let scale = 1.0f32 / (s as f32).sqrt();
    for j in 0..s {
        o[j] = dot_f32(&m[j * s..(j + 1) * s], q) * scale;
    }
}

// ---- Vision encoder ops (clip's graphs, llama.cpp `tools/mtmd`), ggml-cpu's scalar orders ----

/// ggml `norm` of one row (`ggml_compute_forward_norm_f32`: the sum in f64, `mean = sum / n` in
/// f32, the centred squares summed in f64, `1 / sqrtf(var + eps)`), then `· w (+ b)`.
pub fn layer_norm_row(x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32, y: &mut [f32]) {
    let n = x.len();
    let sum: f64 = x.iter().map(|&v| v as f64).sum();
    let mean = sum as f32 / n as f32;
    let mut sq = 0f64;
    for (o, &v) in y.iter_mut().zip(x) {
        let d = v - mean;
        *o = d;
        sq += (d * d) as f64;
    }
    let var = (sq / n as f64) as f32;
    let scale = 1.0 / (var + eps).sqrt();
    for (i, o) in y.iter_mut().enumerate() {
        *o = *o * scale * w[i];
        if let Some(b) = b {
            *o += b[i];
        }
    }
}

const GELU_COEF_A: f32 = 0.044715;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const SQRT_2_INV: f32 = std::f32::consts::FRAC_1_SQRT_2;

/// ggml's `ggml_gelu_f32` (tanh form) at one value.
fn gelu_tanh_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::tanhf(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)))
}

/// GELU (tanh form) as ggml-cpu computes it (`GGML_GELU_FP16`): the f16 table of
/// `ggml_gelu_f32` at x rounded to f16; x itself from 10 up, 0 from −10 down.
pub fn gelu_tanh(x: &mut [f32]) {
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(gelu_tanh_table);
    for v in x {
        *v = if *v <= -10.0 {
            0.0
        } else if *v >= 10.0 {
            *v
        } else {
            f16::from_bits(t[f16::from_f32(*v).to_bits() as usize]).to_f32()
        };
    }
}

/// `ggml_table_gelu_f16`: the f16 bits of GELU (tanh form) at every f16 value (what
/// [`gelu_tanh`] and the wgpu backend look up).
pub fn gelu_tanh_table() -> Vec<u16> {
    (0..=u16::MAX).map(|h| f16::from_f32(gelu_tanh_f32(f16::from_bits(h).to_f32())).to_bits()).collect()
}

/// GELU (erf form, ggml `gelu_erf`): `0.5·x·(1 + erff(x/√2))` ([`super::cmath::erff`]: glibc's).
pub fn gelu_erf(x: &mut [f32]) {
    for v in x {
        *v = 0.5 * *v * (1.0 + super::cmath::erff(*v * SQRT_2_INV));
    }
}

/// Numerics checks across builds (`tests/e2e/numerics.test.mjs`: the wasm builds' `debugF32Ops`
/// against `examples/quant_probe f32ops` natively with the portable kernels): the f32 loops
/// whose wasm versions run four lanes at a time. `x` is cut in thirds `a`, `b`, `c`; returns
/// `fma(a, b, c)` (four lanes at a time on wasm: [`super::lanes::fma4`]), [`swiglu`]`(a, b)`,
/// [`super::cmath::expf`] of every `x`, one attention head ([`attend_head`], head size 64:
/// the query is `x`'s first 64 values, keys and values its following rows rounded to f16) and
/// three heads sharing one KV head ([`attend_heads`]: a window, sinks, moderate scores).
#[doc(hidden)]
pub fn numerics_probe(x: &[f32]) -> Vec<f32> {
    let n = x.len() / 3;
    let (a, b, c) = (&x[..n], &x[n..2 * n], &x[2 * n..3 * n]);
    let mut out = Vec::with_capacity(3 * n + x.len() + 64);
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        use core::arch::wasm32::*;
        let fused = super::lanes::relaxed_madd_is_fused();
        let v = |s: &[f32], i: usize| f32x4(s[i], s[i + 1], s[i + 2], s[i + 3]);
        for i in (0..n & !3).step_by(4) {
            let r = super::lanes::fma4(v(a, i), v(b, i), v(c, i), fused);
            out.extend([f32x4_extract_lane::<0>(r), f32x4_extract_lane::<1>(r), f32x4_extract_lane::<2>(r), f32x4_extract_lane::<3>(r)]);
        }
    }
    for i in out.len()..n {
        out.push(a[i].mul_add(b[i], c[i]));
    }
    let mut h = vec![0f32; n];
    swiglu(a, b, &mut h);
    out.extend(h);
    out.extend(x.iter().map(|&v| super::cmath::expf(v)));
    const HD: usize = 64;
    if x.len() >= 3 * HD {
        let rows: Vec<f16> = x[HD..].iter().map(|&v| f16::from_f32(v)).collect();
        let n_kv = rows.len() / (2 * HD);
        let (k, v) = rows[..2 * n_kv * HD].split_at(n_kv * HD);
        let mut o = vec![0f32; HD];
        attend_head(&x[..HD], k, v, HD, n_kv, 0.125, &mut o, &mut Vec::new(), &mut Vec::new());
        out.extend(o);
        // Three query heads sharing one KV head (wasm: together), positions 1.. only, sinks on
        // the first two (one above the scores, one among them). Queries and keys squashed into
        // (−4, 4) and (−1, 1): scores of a few units, so every position weighs in the softmax
        // (with the raw values one position takes it all, and a wrong score would not show).
        let soft = |v: f32| v / (1.0 + v.abs());
        let q: Vec<f32> = x[..3 * HD].iter().map(|&v| 4.0 * soft(v)).collect();
        let ks: Vec<f16> = k.iter().map(|&h| f16::from_f32(soft(h.to_f32()))).collect();
        let mut o = vec![0f32; 3 * HD];
        attend_heads(&q, 3, &ks, v, HD, 1..n_kv, Some(&[4.0, -1.0]), 0.125, &mut o);
        out.extend(o);
    }
    out
}
