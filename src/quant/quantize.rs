//! Weight quantizers: f32 rows to ggml block formats, as llama.cpp's `llama-quantize` writes them
//! without an importance matrix (`quantize_row_<type>_ref` in `ggml/src/ggml-quants.c`; ggml-base
//! is built without FMA, so plain multiply-then-add here gives the same bytes). Used to re-quantize
//! experts to fewer bits (layer-wise mixed precision); tested against `llama-quantize` output
//! (`tests/suite/quantize.rs`).

use super::{f16_to_f32, f32_to_f16_bits, GgmlType, QuantError};
use super::kquants::QK_K;

/// Types [`quantize_weights`] writes.
pub const WEIGHT_TYPES: [GgmlType; 6] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q3K, GgmlType::Q4K];

/// Quantize the f32 row(s) `x` to `ty` (llama-quantize's bytes). `x.len()` must be a multiple of
/// the type's block size; `out` is cleared and then holds `ty.row_bytes(x.len())` bytes.
pub fn quantize_weights(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Result<(), QuantError> {
    if !WEIGHT_TYPES.contains(&ty) {
        return Err(QuantError::Unsupported { ty, op: "weight quantization" });
    }
    let bytes = super::row_size(ty, x.len())?;
    out.clear();
    out.resize(bytes, 0);
    if ty == GgmlType::Q8_0 {
        // `quantize_row_q8_0_ref`, as the activation quantizer's reference mode computes it.
        super::legacy::quantize_q8_0(x, out, super::legacy::Q8Rounding::Reference);
        return Ok(());
    }
    let (bs, ts) = (ty.block_size(), ty.type_size());
    for (xb, b) in x.chunks_exact(bs).zip(out.chunks_exact_mut(ts)) {
        match ty {
            GgmlType::Q4_0 => q4_0(xb, b),
            GgmlType::Q4_1 => q4_1(xb, b),
            GgmlType::Q2K => q2_k(xb, b),
            GgmlType::Q3K => q3_k(xb, b),
            GgmlType::Q4K => q4_k(xb, b),
            _ => unreachable!("checked above"),
        }
    }
    Ok(())
}

/// ggml's `nearest_int`: round to nearest, ties to even, through the 1.5·2^23 magic number
/// (valid for |x| <= 4194303).
#[inline]
fn nearest_int(x: f32) -> i32 {
    let v = x + 12582912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f32_to_f16_bits(v).to_le_bytes());
}

fn f16_round(v: f32) -> f32 {
    f16_to_f32(f32_to_f16_bits(v))
}

/// `quantize_row_q4_0_ref`: d = max / -8 (max: the value of largest magnitude), q = x/d + 8.5
/// truncated, at most 15.
fn q4_0(x: &[f32], b: &mut [u8]) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(b, 0, d);
    for j in 0..16 {
        let x0 = x[j] * id;
        let x1 = x[16 + j] * id;
        let q0 = ((x0 + 8.5) as i8).min(15) as u8;
        let q1 = ((x1 + 8.5) as i8).min(15) as u8;
        b[2 + j] = q0 | (q1 << 4);
    }
}

/// `quantize_row_q4_1_ref`: d = (max - min) / 15, m = min, q = (x - min)/d + 0.5 truncated.
fn q4_1(x: &[f32], b: &mut [u8]) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(b, 0, d);
    put_f16(b, 2, min);
    for j in 0..16 {
        let x0 = (x[j] - min) * id;
        let x1 = (x[16 + j] - min) * id;
        let q0 = ((x0 + 0.5) as i8).min(15) as u8;
        let q1 = ((x1 + 0.5) as i8).min(15) as u8;
        b[4 + j] = q0 | (q1 << 4);
    }
}

/// `make_qkx2_quants`: scale and min of a group of `n` values for levels 0..=nmax, refined over
/// `nstep + 1` candidate scales, minimizing the weighted error (absolute with `use_mad`).
/// Returns (scale, -min); `l` gets the levels.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(nmax: i32, x: &[f32], w: &[f32], l: &mut [u8], rmin: f32, rdelta: f32, nstep: i32, use_mad: bool) -> (f32, f32) {
    let n = x.len();
    let mut laux = [0u8; 32];
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let err = |d: f32| if use_mad { d.abs() } else { d * d };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        best += w[i] * err(scale * l[i] as f32 + min - x[i]);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let lf = q as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let dd = sum_w * sum_l2 - sum_l * sum_l;
        if dd > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / dd;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / dd;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur = 0f32;
            for i in 0..n {
                cur += w[i] * err(this_scale * laux[i] as f32 + this_min - x[i]);
            }
            if cur < best {
                l[..n].copy_from_slice(&laux[..n]);
                best = cur;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// `make_q3_quants` with `do_rmse`: signed levels -nmax..nmax-1 (stored + nmax), scale refined by
/// coordinate descent weighted by x². Returns the scale.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let n = x.len();
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-15 {
        l[..n].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = q as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let li = l[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] as i32 {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for v in l[..n].iter_mut() {
        *v += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Per group of `N` values of a 256-superblock: `make_qkx2_quants` with the weights and settings
/// `setup(group, weights) -> (nmax, rmin, nstep, use_mad)` gives (rdelta 0.1); returns the groups'
/// scales and mins and their maxima (as the K-quant reference quantizers track them).
fn group_scales_mins<const G: usize, const N: usize>(x: &[f32], l: &mut [u8; QK_K], setup: impl Fn(&[f32], &mut [f32; N]) -> (i32, f32, i32, bool)) -> ([f32; G], [f32; G], f32, f32) {
    let (mut scales, mut mins) = ([0f32; G], [0f32; G]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..G {
        let xs = &x[N * j..N * j + N];
        let mut w = [0f32; N];
        let (nmax, rmin, nstep, mad) = setup(xs, &mut w);
        let (s, m) = make_qkx2_quants(nmax, xs, &w, &mut l[N * j..N * j + N], rmin, 0.1, nstep, mad);
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    (scales, mins, max_scale, max_min)
}

/// `quantize_row_q2_K_ref`: 16 groups of 16, 2-bit levels with a 4-bit scale and min per group
/// (`make_qkx2_quants(16, 3, .., |x|, -0.5, 0.1, 15, mad)`). Layout: scales[16] (scale | min << 4),
/// qs[64], d (f16), dmin (f16).
fn q2_k(x: &[f32], b: &mut [u8]) {
    let mut l = [0u8; QK_K];
    let (scales, mins, max_scale, max_min) = group_scales_mins::<16, 16>(x, &mut l, |xs, w| {
        for (wi, &v) in w.iter_mut().zip(xs) {
            *wi = v.abs();
        }
        (3, -0.5, 15, true)
    });
    let (sc, qs) = b.split_at_mut(16);
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for j in 0..16 {
            sc[j] = nearest_int(iscale * scales[j]) as u8;
        }
        put_f16(qs, 64, max_scale / 15.0);
    } else {
        sc.fill(0);
        put_f16(qs, 64, 0.0);
    }
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for j in 0..16 {
            sc[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        put_f16(qs, 66, max_min / 15.0);
    } else {
        put_f16(qs, 66, 0.0);
    }
    let d_all = f16_to_f32(u16::from_le_bytes([qs[64], qs[65]]));
    let m_all = f16_to_f32(u16::from_le_bytes([qs[66], qs[67]]));
    for j in 0..16 {
        let d = d_all * (sc[j] & 0xf) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = m_all * (sc[j] >> 4) as f32;
        for ii in 0..16 {
            l[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3) as u8;
        }
    }
    for j in (0..QK_K).step_by(128) {
        for k in 0..32 {
            qs[j / 4 + k] = l[j + k] | (l[j + k + 32] << 2) | (l[j + k + 64] << 4) | (l[j + k + 96] << 6);
        }
    }
}

/// `quantize_row_q3_K_ref`: 16 groups of 16, 3-bit levels (2 low bits in qs, the high bit in
/// hmask) with 6-bit signed scales. Layout: hmask[32], qs[64], scales[12], d (f16).
fn q3_k(x: &[f32], b: &mut [u8]) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut amax) = (0f32, 0f32);
    for j in 0..16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
        let s = scales[j].abs();
        if s > amax {
            amax = s;
            max_scale = scales[j];
        }
    }
    let (hmask, rest) = b.split_at_mut(32);
    let (qs, rest) = rest.split_at_mut(64);
    let (sc, dpart) = rest.split_at_mut(12);
    sc.fill(0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for j in 0..16 {
            let mut v = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) + 32;
            if j < 8 {
                sc[j] = (v & 0xf) as u8;
            } else {
                sc[j - 8] |= ((v & 0xf) << 4) as u8;
            }
            v >>= 4;
            sc[j % 4 + 8] |= (v << (2 * (j / 4))) as u8;
        }
        put_f16(dpart, 0, 1.0 / iscale);
    } else {
        put_f16(dpart, 0, 0.0);
    }
    let d_all = f16_to_f32(u16::from_le_bytes([dpart[0], dpart[1]]));
    for j in 0..16 {
        let lo = if j < 8 { sc[j] & 0xf } else { sc[j - 8] >> 4 };
        let s = ((lo | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i8) - 32;
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    hmask.fill(0);
    let (mut m, mut hm) = (0usize, 1u8);
    for v in l.iter_mut() {
        if *v > 3 {
            hmask[m] |= hm;
            *v -= 4;
        }
        m += 1;
        if m == QK_K / 8 {
            m = 0;
            hm <<= 1;
        }
    }
    for j in (0..QK_K).step_by(128) {
        for k in 0..32 {
            qs[j / 4 + k] = (l[j + k] | (l[j + k + 32] << 2) | (l[j + k + 64] << 4) | (l[j + k + 96] << 6)) as u8;
        }
    }
}

/// `quantize_row_q4_K_ref`: 8 groups of 32, 4-bit levels with 6-bit scale and min per group
/// (`make_qkx2_quants(32, 15, .., rms + |x|, -1, 0.1, 20, squared)`). Layout: d, dmin (f16),
/// scales[12] (packed as `get_scale_min_k4` reads them), qs[128].
fn q4_k(x: &[f32], b: &mut [u8]) {
    let mut l = [0u8; QK_K];
    let (scales, mins, max_scale, max_min) = group_scales_mins::<8, 32>(x, &mut l, |xs, w| {
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (wi, &v) in w.iter_mut().zip(xs) {
            *wi = av_x + v.abs();
        }
        (15, -1.0, 20, false)
    });
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut b[4..16];
    sc.fill(0);
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    put_f16(b, 0, max_scale / 63.0);
    put_f16(b, 2, max_min / 63.0);
    let d_all = f16_round(max_scale / 63.0);
    let m_all = f16_round(max_min / 63.0);
    let (scv, mnv) = super::kquants::scales_mins_k4(&b[4..16]);
    for j in 0..8 {
        let d = d_all * scv[j] as f32;
        if d == 0.0 {
            continue;
        }
        let dm = m_all * mnv[j] as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, 15) as u8;
        }
    }
    let qs = &mut b[16..144];
    for (c, j) in (0..QK_K).step_by(64).enumerate() {
        for k in 0..32 {
            qs[32 * c + k] = l[j + k] | (l[j + k + 32] << 4);
        }
    }
}
