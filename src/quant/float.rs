//! F32, F16 and BF16 rows: conversion to/from f32 and dot products (portable code).
//!
//! Formats: F32 is IEEE binary32, F16 IEEE binary16, BF16 the upper half of a binary32, all
//! little-endian (`ggml_fp16_t` / `ggml_bf16_t` in `ggml/src/ggml-impl.h`). The f32 -> bf16
//! rounding is ggml's `ggml_compute_fp32_to_bf16` (`ggml/src/ggml-impl.h`): NaN stays a quiet
//! NaN, everything else rounds to nearest even. The dot products are ggml's `ggml_vec_dot_f32`,
//! `ggml_vec_dot_f16`, `ggml_vec_dot_bf16` (`ggml/src/ggml-cpu/vec.cpp`): products of the f32
//! values summed in f32 lanes (ggml's SIMD builds) — the order of the additions, and so the last
//! bits, differ between builds.

use super::f16_at;

#[inline(always)]
fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

#[inline(always)]
fn bf16_at(b: &[u8], i: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[i], b[i + 1]]) as u32) << 16)
}

/// f32 -> bf16 bits (see the module comment).
#[inline]
pub(super) fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        // NaN: keep sign and top mantissa bits, force the quiet bit.
        return ((u >> 16) | 0x40) as u16;
    }
    let rounding = 0x7fff + ((u >> 16) & 1);
    (u.wrapping_add(rounding) >> 16) as u16
}

pub(super) fn dequant_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32_at(s, 0);
    }
}

pub(super) fn dequant_f16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16_at(s, 0);
    }
}

pub(super) fn dequant_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_at(s, 0);
    }
}

pub(super) fn quant_f32(x: &[f32], out: &mut [u8]) {
    for (o, v) in out.chunks_exact_mut(4).zip(x) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

pub(super) fn quant_f16(x: &[f32], out: &mut [u8]) {
    for (o, v) in out.chunks_exact_mut(2).zip(x) {
        o.copy_from_slice(&super::f32_to_f16_bits(*v).to_le_bytes());
    }
}

pub(super) fn quant_bf16(x: &[f32], out: &mut [u8]) {
    for (o, v) in out.chunks_exact_mut(2).zip(x) {
        o.copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
    }
}

/// Dot of two rows of `n` elements stored with `esize` bytes each, decoded by `get`; eight
/// independent f32 accumulators (so the compiler can keep them in vector lanes).
#[inline(always)]
fn dot_generic(n: usize, w: &[u8], a: &[u8], esize: usize, get: impl Fn(&[u8], usize) -> f32) -> f32 {
    let w = &w[..n * esize];
    let a = &a[..n * esize];
    let mut acc = [0f32; 8];
    let step = 8 * esize;
    let mut wc = w.chunks_exact(step);
    let mut ac = a.chunks_exact(step);
    for (wb, ab) in (&mut wc).zip(&mut ac) {
        for (k, s) in acc.iter_mut().enumerate() {
            *s += get(wb, k * esize) * get(ab, k * esize);
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    let (wr, ar) = (wc.remainder(), ac.remainder());
    for i in (0..wr.len()).step_by(esize) {
        sum += get(wr, i) * get(ar, i);
    }
    sum
}

pub(super) fn dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_generic(n, w, a, 4, f32_at)
}

pub(super) fn dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_generic(n, w, a, 2, f16_at)
}

pub(super) fn dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_generic(n, w, a, 2, bf16_at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding() {
        // Exact values pass through.
        assert_eq!(f32_to_bf16_bits(1.0), 0x3f80);
        assert_eq!(f32_to_bf16_bits(-2.0), 0xc000);
        // Ties go to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82);
        // Above the tie rounds up.
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f80_8001)), 0x3f81);
        // NaN stays NaN (quiet), infinity stays infinity.
        let nan = f32_to_bf16_bits(f32::from_bits(0x7f80_0001));
        assert!(f32::from_bits((nan as u32) << 16).is_nan());
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7f80);
    }
}
