//! ggml's tiled CPU flash attention (`ggml-cpu/ops.cpp` `ggml_compute_forward_flash_attn_ext_tiled`,
//! `simd-gemm.h`), which llama.cpp runs for batches of at least [`FA_TILE_Q`] query rows, bit for
//! bit. Its two products (scores `q·k`, accumulator `p·v`) have kernels per x86 level
//! ([`FaLevel`]): every lane is the same chain of FMAs in the same order on each, so the level
//! changes the speed, never a bit (tested below).

use super::ops::{ggml_expf_nb, reduce16};
use half::f16;

/// Query rows per tile of ggml's tiled flash attention (`GGML_FA_TILE_Q`, `ggml-cpu/common.h`):
/// llama.cpp's CPU backend takes the tiled path for a batch of at least this many query rows.
pub const FA_TILE_Q: usize = 64;
/// Key/value positions per tile (`GGML_FA_TILE_KV`).
pub const FA_TILE_KV: usize = 64;
const TK: usize = FA_TILE_KV;

/// The kernels that run [`attend_tiled`]'s products (all give the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaLevel {
    /// Plain loops (`f32::mul_add`).
    Portable,
    /// x86 AVX2 + FMA: one query row at a time, 8-lane registers.
    Avx2,
    /// x86 AVX-512F + VL: up to four query rows at a time on 16-lane registers (the key and
    /// value loads shared by the rows).
    Avx512,
}

impl FaLevel {
    /// The fastest level this CPU runs.
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if crate::quant::Simd::best() == crate::quant::Simd::Avx2 {
            return if crate::quant::has_avx512() { FaLevel::Avx512 } else { FaLevel::Avx2 };
        }
        FaLevel::Portable
    }

    /// Every level this CPU runs, slowest first.
    pub fn available() -> Vec<Self> {
        match Self::best() {
            FaLevel::Portable => vec![FaLevel::Portable],
            FaLevel::Avx2 => vec![FaLevel::Portable, FaLevel::Avx2],
            FaLevel::Avx512 => vec![FaLevel::Portable, FaLevel::Avx2, FaLevel::Avx512],
        }
    }
}

/// One head's keys and values for [`attend_tiled`]: position `t`'s row at `t · head_dim`.
#[derive(Clone, Copy)]
pub enum FaKv<'a> {
    /// f16 rows (a KV cache), widened to f32 tile by tile.
    F16 { k: &'a [f16], v: &'a [f16] },
    /// Widened once ([`FaKvF32::new`]), for attention whose every query tile reads every key
    /// (a vision encoder's): saves widening them again per query tile.
    F32(&'a FaKvF32),
}

/// f16 keys and values widened to f32 (exactly) in the layouts [`attend_tiled`]'s products read:
/// K transposed per tile of [`FA_TILE_KV`] positions (`kt[tile][d][t]`, zero past the last
/// position), V as rows.
pub struct FaKvF32 {
    kt: Vec<f32>,
    v: Vec<f32>,
}

impl FaKvF32 {
    /// `k`, `v`: the same number of rows of `head_dim` f16 values.
    pub fn new(k: &[f16], v: &[f16], head_dim: usize) -> Self {
        let hd = head_dim;
        let n = k.len() / hd.max(1);
        let mut kt = vec![0f32; n.div_ceil(TK) * hd * TK];
        for (t, row) in k.chunks_exact(hd).enumerate() {
            let base = t / TK * hd * TK + t % TK;
            for (d, &x) in row.iter().enumerate() {
                kt[base + d * TK] = x.to_f32();
            }
        }
        let v = v[..n * hd].iter().map(|x| x.to_f32()).collect();
        FaKvF32 { kt, v }
    }
}

/// Scratch of [`attend_tiled`] (one per thread).
pub struct FaScratch {
    level: FaLevel,
    /// K tile as f32, transposed: `kt[d · FA_TILE_KV + t]`.
    kt: Vec<f32>,
    /// V tile as f32: `v32[t · head_dim + d]`.
    v32: Vec<f32>,
    /// Per row of the query tile: running max, sum, f32 accumulator, the tile's scores (then
    /// probabilities).
    m: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    p: Vec<f32>,
    /// The rows with unmasked positions in the current tile: (row, first, end).
    live: Vec<(usize, usize, usize)>,
}

impl Default for FaScratch {
    fn default() -> Self {
        Self::with_level(FaLevel::best())
    }
}

impl FaScratch {
    /// Scratch whose products run on `level`'s kernels (which this CPU must run: one of
    /// [`FaLevel::available`]; others fall back to the portable loops).
    pub fn with_level(level: FaLevel) -> Self {
        let level = if FaLevel::available().contains(&level) { level } else { FaLevel::Portable };
        FaScratch { level, kt: Vec::new(), v32: Vec::new(), m: Vec::new(), s: Vec::new(), acc: Vec::new(), p: Vec::new(), live: Vec::new() }
    }
}

/// Query rows `q` (`rows` rows of `head_dim` at stride `q_stride`) of one head attending, row
/// `r` over positions `range(r)` (a causal range, shortened by a sliding window; or a window
/// block), as ggml's tiled CPU flash attention computes them. Per row and per tile of
/// [`FA_TILE_KV`] positions from the first: scores `q·k` summed in dimension order with one FMA
/// each from 0 (f32 `q`, `k` widened from f16), times `scale`; masked positions −∞; a tile with
/// nothing unmasked for the row is skipped; else the running max `M` rises to the tile's max
/// (`ms = expf(M_old − M)` with the C library's `expf` scales the accumulator and the sum), the
/// tile's exponentials come from the vectorised `ggml_expf` and their sum in ggml's AVX-512
/// `ggml_vec_soft_max_f32` order (16 at a time, `_mm512_reduce_add_ps`, into an f64 added to
/// the f32 sum), and the f32 accumulator takes `p · v` one position after another (one FMA
/// each). Then the sink (as `ops::attend_head_ext`), and the accumulator divided by the sum
/// into `out` (row `r`). Every step is per row and in a fixed order: the result does not
/// depend on which rows share a tile, on threads or on [`FaLevel`].
#[allow(clippy::too_many_arguments)]
pub fn attend_tiled(
    q: &[f32],
    q_stride: usize,
    rows: usize,
    range: &dyn Fn(usize) -> std::ops::Range<usize>,
    kv: FaKv<'_>,
    head_dim: usize,
    sink: Option<f32>,
    scale: f32,
    out: &mut dyn FnMut(usize, &[f32]),
    sc: &mut FaScratch,
) {
    let hd = head_dim;
    let FaScratch { level, kt: kt_buf, v32: v_buf, m, s, acc, p, live } = sc;
    let level = *level;
    m.clear();
    m.resize(rows, f32::NEG_INFINITY);
    s.clear();
    s.resize(rows, 0.0);
    acc.clear();
    acc.resize(rows * hd, 0.0);
    p.clear();
    p.resize(rows * TK, 0.0);
    let lo = (0..rows).map(|r| range(r).start).min().unwrap_or(0);
    let hi = (0..rows).map(|r| range(r).end).max().unwrap_or(0);
    let mut tile = lo / TK * TK;
    while tile < hi {
        let end = (tile + TK).min(hi);
        live.clear();
        for r in 0..rows {
            let k = range(r);
            let (a, b) = (k.start.max(tile), k.end.min(end));
            if a < b {
                live.push((r, a, b));
            }
        }
        if live.is_empty() {
            tile += TK;
            continue;
        }
        let (kt, v32): (&[f32], &[f32]) = match kv {
            FaKv::F16 { k, v } => {
                kt_buf.resize(hd * TK, 0.0);
                v_buf.resize(TK * hd, 0.0);
                for t in 0..end - tile {
                    let k = &k[(tile + t) * hd..(tile + t + 1) * hd];
                    for (d, &kd) in k.iter().enumerate() {
                        kt_buf[d * TK + t] = kd.to_f32();
                    }
                    let v = &v[(tile + t) * hd..(tile + t + 1) * hd];
                    for (o, &vd) in v_buf[t * hd..(t + 1) * hd].iter_mut().zip(v) {
                        *o = vd.to_f32();
                    }
                }
                (kt_buf, v_buf)
            }
            FaKv::F32(f) => (&f.kt[tile / TK * hd * TK..(tile / TK + 1) * hd * TK], &f.v[tile * hd..end * hd]),
        };
        scores(level, q, q_stride, hd, live, kt, p);
        for &(r, a, b) in live.iter() {
            let scores = &mut p[r * TK..(r + 1) * TK];
            let mut tmax = f32::NEG_INFINITY;
            for (t, x) in scores.iter_mut().enumerate() {
                let j = tile + t;
                *x = if j >= a && j < b { *x * scale } else { f32::NEG_INFINITY };
                tmax = if tmax > *x { tmax } else { *x }; // ggml_vec_max_f32: MAX(max, x)
            }
            let m_old = m[r];
            let mr = m_old.max(tmax);
            if mr > m_old {
                let ms = super::cmath::expf(m_old - mr);
                for x in acc[r * hd..(r + 1) * hd].iter_mut() {
                    *x *= ms;
                }
                s[r] *= ms;
            }
            m[r] = mr;
            for x in scores.iter_mut() {
                *x = ggml_expf_nb(*x - mr);
            }
            let mut sum = 0f64;
            for blk in scores.chunks_exact(16) {
                sum += reduce16(blk.try_into().unwrap()) as f64;
            }
            s[r] = (s[r] as f64 + sum) as f32;
        }
        accumulate(level, live, tile, p, v32, hd, acc);
        tile += TK;
    }
    for r in 0..rows {
        let acc = &mut acc[r * hd..(r + 1) * hd];
        let mut s_sum = s[r];
        if let Some(sk) = sink {
            let (mut ms, mut vs) = (1.0f32, 1.0f32);
            let mr = m[r];
            if sk > mr {
                ms = super::cmath::expf(mr - sk);
                for x in acc.iter_mut() {
                    *x *= ms;
                }
            } else {
                vs = super::cmath::expf(sk - mr);
            }
            s_sum = s_sum.mul_add(ms, vs);
        }
        let inv = if s_sum == 0.0 { 0.0 } else { 1.0 / s_sum };
        for x in acc.iter_mut() {
            *x *= inv;
        }
        out(r, acc);
    }
}

/// `p[r][t] = Σ_d q_r[d] · kt[d · 64 + t]` for each live row `r`, one FMA per `d` in order from
/// 0 (ggml's `simd_gemm`: the 64 positions are the vector lanes).
fn scores(level: FaLevel, q: &[f32], q_stride: usize, hd: usize, live: &[(usize, usize, usize)], kt: &[f32], p: &mut [f32]) {
    assert!(kt.len() >= hd * TK && live.iter().all(|&(r, ..)| q.len() >= r * q_stride + hd && p.len() >= (r + 1) * TK));
    let qrow = |r: usize| &q[r * q_stride..r * q_stride + hd];
    match level {
        #[cfg(target_arch = "x86_64")]
        FaLevel::Avx512 => {
            for g in live.chunks(4) {
                // SAFETY: AVX-512F/VL present (level from `FaLevel::available`); bounds asserted above.
                unsafe { x86::scores512(g.len(), row_ptrs(g, |r| q.as_ptr().add(r * q_stride)), hd, kt, row_ptrs(g, |r| p.as_mut_ptr().add(r * TK))) };
            }
        }
        #[cfg(target_arch = "x86_64")]
        FaLevel::Avx2 => {
            for &(r, ..) in live {
                // SAFETY: AVX2 and FMA present; bounds asserted above.
                unsafe { x86::scores(qrow(r), kt, (&mut p[r * TK..(r + 1) * TK]).try_into().unwrap()) };
            }
        }
        _ => {
            for &(r, ..) in live {
                let out = &mut p[r * TK..(r + 1) * TK];
                out.fill(0.0);
                for (d, &qd) in qrow(r).iter().enumerate() {
                    for (x, &k) in out.iter_mut().zip(&kt[d * TK..(d + 1) * TK]) {
                        *x = qd.mul_add(k, *x);
                    }
                }
            }
        }
    }
}

/// `acc_r[d] = fma(p_r[t], v32[t · hd + d], acc_r[d])` for each live row `r` and `t` in its
/// unmasked positions, in order (ggml's `simd_gemm` of the probabilities and the V tile: the
/// dimensions are the vector lanes).
fn accumulate(level: FaLevel, live: &[(usize, usize, usize)], tile: usize, p: &[f32], v32: &[f32], hd: usize, acc: &mut [f32]) {
    assert!(live.iter().all(|&(r, a, b)| b - tile <= TK && v32.len() >= (b - tile) * hd && a >= tile && acc.len() >= (r + 1) * hd && p.len() >= (r + 1) * TK));
    match level {
        #[cfg(target_arch = "x86_64")]
        FaLevel::Avx512 => {
            // Runs of up to four rows with the same unmasked positions share each V load.
            let mut i = 0;
            while i < live.len() {
                let (_, a, b) = live[i];
                let mut j = i + 1;
                while j < live.len() && j - i < 4 && live[j].1 == a && live[j].2 == b {
                    j += 1;
                }
                let g = &live[i..j];
                // SAFETY: AVX-512F/VL present; bounds asserted above, rows distinct.
                unsafe { x86::accumulate512(g.len(), row_ptrs(g, |r| p.as_ptr().add(r * TK)), a - tile..b - tile, v32, hd, row_ptrs(g, |r| acc.as_mut_ptr().add(r * hd))) };
                i = j;
            }
        }
        #[cfg(target_arch = "x86_64")]
        FaLevel::Avx2 if hd % 8 == 0 => {
            for &(r, a, b) in live {
                // SAFETY: AVX2 and FMA present; bounds asserted above.
                unsafe { x86::accumulate(&p[r * TK..(r + 1) * TK], a - tile..b - tile, v32, hd, &mut acc[r * hd..(r + 1) * hd]) };
            }
        }
        _ => {
            for &(r, a, b) in live {
                let acc = &mut acc[r * hd..(r + 1) * hd];
                for t in a - tile..b - tile {
                    let pt = p[r * TK + t];
                    for (x, &vd) in acc.iter_mut().zip(&v32[t * hd..(t + 1) * hd]) {
                        *x = pt.mul_add(vd, *x);
                    }
                }
            }
        }
    }
}

/// Up to four per-row pointers `f(row)` of a group of live rows (unused slots null).
#[cfg(target_arch = "x86_64")]
fn row_ptrs(g: &[(usize, usize, usize)], mut f: impl FnMut(usize) -> *const f32) -> [*const f32; 4] {
    let mut o = [std::ptr::null(); 4];
    for (o, &(r, ..)) in o.iter_mut().zip(g) {
        *o = f(r);
    }
    o
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::TK;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores(q: &[f32], kt: &[f32], out: &mut [f32; TK]) {
        let mut a = [_mm256_setzero_ps(); 8];
        for (d, &qd) in q.iter().enumerate() {
            let qv = _mm256_set1_ps(qd);
            let k = kt.as_ptr().add(d * TK);
            for (i, ai) in a.iter_mut().enumerate() {
                *ai = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k.add(8 * i)), *ai);
            }
        }
        for (i, ai) in a.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), *ai);
        }
    }

    /// One row's accumulator in chunks of up to eight 8-lane registers (`hd % 8 == 0`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn accumulate(p: &[f32], ts: std::ops::Range<usize>, v32: &[f32], hd: usize, acc: &mut [f32]) {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn chunk<const NV: usize>(p: &[f32], ts: std::ops::Range<usize>, v32: *const f32, hd: usize, acc: *mut f32) {
            let mut a = [_mm256_setzero_ps(); NV];
            for (i, ai) in a.iter_mut().enumerate() {
                *ai = _mm256_loadu_ps(acc.add(8 * i));
            }
            for t in ts {
                let pv = _mm256_set1_ps(p[t]);
                let v = v32.add(t * hd);
                for (i, ai) in a.iter_mut().enumerate() {
                    *ai = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.add(8 * i)), *ai);
                }
            }
            for (i, ai) in a.iter().enumerate() {
                _mm256_storeu_ps(acc.add(8 * i), *ai);
            }
        }
        let mut d0 = 0;
        while d0 + 64 <= hd {
            chunk::<8>(p, ts.clone(), v32.as_ptr().add(d0), hd, acc.as_mut_ptr().add(d0));
            d0 += 64;
        }
        while d0 < hd {
            chunk::<1>(p, ts.clone(), v32.as_ptr().add(d0), hd, acc.as_mut_ptr().add(d0));
            d0 += 8;
        }
    }

    /// Scores of `nr` ≤ 4 query rows (`q[i]`: `hd` values; `out[i]`: 64) on 16-lane registers:
    /// each key load serves every row.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(super) unsafe fn scores512(nr: usize, q: [*const f32; 4], hd: usize, kt: &[f32], out: [*const f32; 4]) {
        #[inline(never)]
        #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
        unsafe fn rows<const R: usize>(q: [*const f32; 4], hd: usize, kt: *const f32, out: [*const f32; 4]) {
            let mut a = [[_mm512_setzero_ps(); 4]; R];
            for d in 0..hd {
                let k: [__m512; 4] = std::array::from_fn(|i| _mm512_loadu_ps(kt.add(d * super::TK + 16 * i)));
                for r in 0..R {
                    let qv = _mm512_set1_ps(*q[r].add(d));
                    for i in 0..4 {
                        a[r][i] = _mm512_fmadd_ps(qv, k[i], a[r][i]);
                    }
                }
            }
            for r in 0..R {
                for i in 0..4 {
                    _mm512_storeu_ps((out[r] as *mut f32).add(16 * i), a[r][i]);
                }
            }
        }
        let kt = kt.as_ptr();
        match nr {
            4 => rows::<4>(q, hd, kt, out),
            3 => rows::<3>(q, hd, kt, out),
            2 => rows::<2>(q, hd, kt, out),
            _ => rows::<1>(q, hd, kt, out),
        }
    }

    /// The accumulators of `nr` ≤ 4 rows with the same positions `ts` (`p[i]`: 64
    /// probabilities; `acc[i]`: `hd` values) in chunks of up to four 16-lane registers (the last
    /// masked where `hd` is not a multiple of 16): each V load serves every row.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(super) unsafe fn accumulate512(nr: usize, p: [*const f32; 4], ts: std::ops::Range<usize>, v32: &[f32], hd: usize, acc: [*const f32; 4]) {
        #[inline(never)]
        #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
        unsafe fn chunk<const R: usize, const NV: usize>(p: [*const f32; 4], ts: std::ops::Range<usize>, v32: *const f32, hd: usize, acc: [*const f32; 4], d0: usize, last: __mmask16) {
            let mask = |i: usize| if i + 1 == NV { last } else { 0xffff };
            let mut a = [[_mm512_setzero_ps(); NV]; R];
            for r in 0..R {
                for i in 0..NV {
                    a[r][i] = _mm512_maskz_loadu_ps(mask(i), acc[r].add(d0 + 16 * i));
                }
            }
            for t in ts {
                let v: [__m512; NV] = std::array::from_fn(|i| _mm512_maskz_loadu_ps(mask(i), v32.add(t * hd + d0 + 16 * i)));
                for r in 0..R {
                    let pv = _mm512_set1_ps(*p[r].add(t));
                    for i in 0..NV {
                        a[r][i] = _mm512_fmadd_ps(pv, v[i], a[r][i]);
                    }
                }
            }
            for r in 0..R {
                for i in 0..NV {
                    _mm512_mask_storeu_ps((acc[r] as *mut f32).add(d0 + 16 * i), mask(i), a[r][i]);
                }
            }
        }
        macro_rules! go {
            ($nv:literal, $d0:expr, $last:expr) => {
                match nr {
                    4 => chunk::<4, $nv>(p, ts.clone(), v32.as_ptr(), hd, acc, $d0, $last),
                    3 => chunk::<3, $nv>(p, ts.clone(), v32.as_ptr(), hd, acc, $d0, $last),
                    2 => chunk::<2, $nv>(p, ts.clone(), v32.as_ptr(), hd, acc, $d0, $last),
                    _ => chunk::<1, $nv>(p, ts.clone(), v32.as_ptr(), hd, acc, $d0, $last),
                }
            };
        }
        let mut d0 = 0;
        while d0 + 64 <= hd {
            go!(4, d0, 0xffff);
            d0 += 64;
        }
        let rest = hd - d0;
        if rest > 0 {
            let last: __mmask16 = if rest % 16 == 0 { 0xffff } else { (1u16 << (rest % 16)) - 1 };
            match rest.div_ceil(16) {
                3 => go!(3, d0, last),
                2 => go!(2, d0, last),
                _ => go!(1, d0, last),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention of row `r` in f64 (softmax over `kv(r)` plus the sink), as a check of the tiled
    /// kernel's arithmetic (not its bits).
    fn attention_f64(q: &[f32], k: &[f16], v: &[f16], hd: usize, kv: std::ops::Range<usize>, sink: Option<f32>, scale: f32) -> Vec<f64> {
        let s: Vec<f64> = kv.clone().map(|j| (0..hd).map(|d| q[d] as f64 * k[j * hd + d].to_f64()).sum::<f64>() * scale as f64).collect();
        let m = s.iter().copied().chain(sink.map(|x| x as f64)).fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let total: f64 = e.iter().sum::<f64>() + sink.map(|x| (x as f64 - m).exp()).unwrap_or(0.0);
        (0..hd).map(|d| kv.clone().zip(&e).map(|(j, w)| w * v[j * hd + d].to_f64()).sum::<f64>() / total).collect()
    }

    /// Causal and windowed rows with sinks, non-causal window blocks, head sizes 64 (text) and
    /// 72 (SigLIP's), f16 and pre-widened keys: every level, every tiling and each row alone give
    /// the same bits, and those are attention (f64 within 1e-5).
    #[test]
    fn tiled_attention_is_attention_and_independent_of_tiling_and_level() {
        let n = 150;
        let mut rnd = crate::backend::cpu::ops::test_rng(0x9e37_79b9);
        let levels = FaLevel::available();
        for hd in [64, 72, 40] {
            let q: Vec<f32> = (0..n * hd).map(|_| rnd() * 3.0).collect();
            let k: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(rnd() * 3.0)).collect();
            let v: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(rnd())).collect();
            let wide = FaKvF32::new(&k, &v, hd);
            type Range = fn(usize, usize) -> std::ops::Range<usize>;
            let ranges: [(&str, usize, Range, Option<f32>); 4] = [
                ("causal", 0, |_, r| 0..r + 1, None),
                ("window 40 + sink", 40, |w, r| (r + 1).saturating_sub(w)..r + 1, Some(1.5)),
                ("causal + low sink", 0, |_, r| 0..r + 1, Some(-30.0)),
                ("blocks of 50", 50, |w, r| r / w * w..(r / w + 1) * w, None),
            ];
            for (name, w, range, sink) in ranges {
                let range = |r: usize| range(w, r);
                let mut first: Option<Vec<f32>> = None;
                for &level in &levels {
                    for kv in [FaKv::F16 { k: &k, v: &v }, FaKv::F32(&wide)] {
                        let mut sc = FaScratch::with_level(level);
                        let mut tiled = vec![0f32; n * hd];
                        for t0 in (0..n).step_by(FA_TILE_Q) {
                            let rows = (n - t0).min(FA_TILE_Q);
                            attend_tiled(&q[t0 * hd..], hd, rows, &|r| range(t0 + r), kv, hd, sink, 0.125, &mut |r, o| tiled[(t0 + r) * hd..(t0 + r + 1) * hd].copy_from_slice(o), &mut sc);
                        }
                        for r in [0, 1, 63, 64, 100, 149] {
                            let mut alone = vec![0f32; hd];
                            attend_tiled(&q[r * hd..], hd, 1, &|_| range(r), kv, hd, sink, 0.125, &mut |_, o| alone.copy_from_slice(o), &mut sc);
                            assert_eq!(alone, &tiled[r * hd..(r + 1) * hd], "{name} hd {hd} {level:?} row {r}: a row's bits depend on its tile");
                        }
                        match &first {
                            None => {
                                for r in [0, 1, 63, 64, 100, 149] {
                                    let want = attention_f64(&q[r * hd..(r + 1) * hd], &k, &v, hd, range(r), sink, 0.125);
                                    for (d, (&got, &w)) in tiled[r * hd..(r + 1) * hd].iter().zip(&want).enumerate() {
                                        assert!((got as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()), "{name} hd {hd} row {r} dim {d}: {got} vs f64 {w}");
                                    }
                                }
                                first = Some(tiled);
                            }
                            Some(f) => assert!(f.iter().zip(&tiled).all(|(a, b)| a.to_bits() == b.to_bits()), "{name} hd {hd}: {level:?} differs from {:?}", levels[0]),
                        }
                    }
                }
            }
        }
    }
}
