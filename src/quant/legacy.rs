//! The 32-element block formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q8_1 (portable code).
//!
//! Block layouts (`block_q4_0` … `block_q8_1` in `ggml/src/ggml-common.h`), all f16 little-endian:
//!
//! | type | bytes | layout                                   | value of element `i`                 |
//! |------|-------|------------------------------------------|--------------------------------------|
//! | Q4_0 | 18    | `d`, `qs[16]`                            | `(q - 8) * d`                        |
//! | Q4_1 | 20    | `d`, `m`, `qs[16]`                       | `q * d + m`                          |
//! | Q5_0 | 22    | `d`, `qh: u32`, `qs[16]`                 | `(q - 16) * d`, `q = nibble | hbit<<4`|
//! | Q5_1 | 24    | `d`, `m`, `qh: u32`, `qs[16]`            | `q * d + m`                          |
//! | Q8_0 | 34    | `d`, `qs: [i8; 32]`                      | `q * d`                              |
//! | Q8_1 | 36    | `d`, `s = d * sum(qs)`, `qs: [i8; 32]`   | `q * d`                              |
//!
//! Nibbles: byte `j` of `qs` holds element `j` in its low nibble and element `j + 16` in its high
//! nibble; bit `i` of `qh` is the fifth bit of element `i`. Dequantization follows
//! `dequantize_row_q4_0` … `dequantize_row_q8_0` (`ggml/src/ggml-quants.c`); activation
//! quantization `quantize_row_q8_0_ref` / `quantize_row_q8_1_ref` (same file); the dot products
//! `ggml_vec_dot_q4_0_q8_0_generic` … `ggml_vec_dot_q8_0_q8_0_generic`
//! (`ggml/src/ggml-cpu/quants.c`): an exact i32 sum per block, scaled in f32.

use super::{f16_at, f32_to_f16_bits};

const QK: usize = 32;

#[inline(always)]
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

pub(super) fn dequant_q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let qs = &b[2..18];
        for j in 0..16 {
            y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
            y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub(super) fn dequant_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(20).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qs = &b[4..20];
        for j in 0..16 {
            y[j] = (qs[j] & 0x0f) as f32 * d + m;
            y[j + 16] = (qs[j] >> 4) as f32 * d + m;
        }
    }
}

pub(super) fn dequant_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(22).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let qh = u32_at(b, 2);
        let qs = &b[6..22];
        for j in 0..16 {
            let lo = (qs[j] & 0x0f) as u32 | ((qh >> j) & 1) << 4;
            let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
            y[j] = (lo as i32 - 16) as f32 * d;
            y[j + 16] = (hi as i32 - 16) as f32 * d;
        }
    }
}

pub(super) fn dequant_q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(24).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qh = u32_at(b, 4);
        let qs = &b[8..24];
        for j in 0..16 {
            let lo = (qs[j] & 0x0f) as u32 | ((qh >> j) & 1) << 4;
            let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
            y[j] = lo as f32 * d + m;
            y[j + 16] = hi as f32 * d + m;
        }
    }
}

pub(super) fn dequant_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(34).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for (v, &q) in y.iter_mut().zip(&b[2..34]) {
            *v = q as i8 as f32 * d;
        }
    }
}

pub(super) fn dequant_q8_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(36).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for (v, &q) in y.iter_mut().zip(&b[4..36]) {
            *v = q as i8 as f32 * d;
        }
    }
}

/// Which of ggml's Q8_0 / Q8_1 activation quantizers to follow (they differ only on exact ties
/// and, rarely, in the last bit of the multiplier).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Q8Rounding {
    /// ggml's x86 (AVX/AVX2) `quantize_row_q8_0` / `quantize_row_q8_1`
    /// (`ggml/src/ggml-cpu/arch/x86/quants.c`): multiplier `127 / amax`, round half to even
    /// (`_mm256_round_ps(.., _MM_ROUND_NEAREST)`), saturating to int8. This is what llama.cpp
    /// runs on the x86-64 machines LES is compared against.
    X86,
    /// ggml's portable `quantize_row_q8_0_ref` / `quantize_row_q8_1_ref`
    /// (`ggml/src/ggml-quants.c`): multiplier `1 / d`, `roundf` (halves away from zero). gguf-py's
    /// `quantize(.., Q8_0)` reproduces it bit for bit.
    Reference,
}

/// Shared by Q8_0 and Q8_1: scale `d = amax / 127` and the 32 quants of one block, with their sum.
#[inline(always)]
fn q8_block(x: &[f32], qs: &mut [u8], mode: Q8Rounding) -> (f32, i32) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if let (Q8Rounding::X86, Ok(x), Ok(qs)) = (mode, <&[f32; 32]>::try_from(x), <&mut [u8; 32]>::try_from(&mut *qs)) {
        // SAFETY: SIMD128 is compiled in.
        return unsafe { super::wasm::q8_block_x86(x, qs) };
    }
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let mut sum = 0i32;
    match mode {
        Q8Rounding::X86 => {
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            for (q, &v) in qs.iter_mut().zip(x) {
                let r = (v * id).round_ties_even() as i8;
                sum += r as i32;
                *q = r as u8;
            }
        }
        Q8Rounding::Reference => {
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (q, &v) in qs.iter_mut().zip(x) {
                // `f32::round` rounds halves away from zero, like C's roundf.
                let r = (v * id).round() as i8;
                sum += r as i32;
                *q = r as u8;
            }
        }
    }
    (d, sum)
}

pub(super) fn quantize_q8_0(x: &[f32], out: &mut [u8], mode: Q8Rounding) {
    for (xb, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(34)) {
        let (d, _) = q8_block(xb, &mut b[2..34], mode);
        b[0..2].copy_from_slice(&f32_to_f16_bits(d).to_le_bytes());
    }
}

pub(super) fn quantize_q8_1(x: &[f32], out: &mut [u8], mode: Q8Rounding) {
    for (xb, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(36)) {
        let (d, sum) = q8_block(xb, &mut b[4..36], mode);
        b[0..2].copy_from_slice(&f32_to_f16_bits(d).to_le_bytes());
        b[2..4].copy_from_slice(&f32_to_f16_bits(sum as f32 * d).to_le_bytes());
    }
}

/// Block fields as fixed-size arrays (lets the compiler unroll and vectorize the inner loops).
#[inline(always)]
fn arr<const N: usize>(b: &[u8], at: usize) -> &[u8; N] {
    b[at..at + N].try_into().unwrap()
}

/// Integer dot of 16 packed nibbles (minus `offset`) with the 32 int8 quants `q8`.
#[inline(always)]
fn nibble_dot(qs: &[u8; 16], q8: &[u8; 32], offset: i32) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += ((qs[j] & 0x0f) as i32 - offset) * q8[j] as i8 as i32;
        s += ((qs[j] >> 4) as i32 - offset) * q8[j + 16] as i8 as i32;
    }
    s
}

/// Integer dot of 32 five-bit quants (nibbles + `qh` bits, minus `offset`) with `q8`.
#[inline(always)]
fn nibble5_dot(qs: &[u8; 16], qh: u32, q8: &[u8; 32], offset: i32) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        let lo = ((qs[j] & 0x0f) as u32 | ((qh >> j) & 1) << 4) as i32 - offset;
        let hi = ((qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4) as i32 - offset;
        s += lo * q8[j] as i8 as i32 + hi * q8[j + 16] as i8 as i32;
    }
    s
}

/// `ggml_vec_dot_q4_0_q8_0`: `sum_blocks(sumi * d_w * d_a)`.
pub(super) fn dot_q4_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(18).zip(a.chunks_exact(34)).take(n / QK) {
        let sumi = nibble_dot(arr(x, 2), arr(y, 2), 8);
        sumf += sumi as f32 * f16_at(x, 0) * f16_at(y, 0);
    }
    sumf
}

/// `ggml_vec_dot_q4_1_q8_1`: `sum_blocks(d_w * d_a * sumi + m_w * s_a)`.
pub(super) fn dot_q4_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(20).zip(a.chunks_exact(36)).take(n / QK) {
        let sumi = nibble_dot(arr(x, 4), arr(y, 4), 0);
        sumf += (f16_at(x, 0) * f16_at(y, 0)) * sumi as f32 + f16_at(x, 2) * f16_at(y, 2);
    }
    sumf
}

/// `ggml_vec_dot_q5_0_q8_0`: `sum_blocks(d_w * d_a * sumi)`.
pub(super) fn dot_q5_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(22).zip(a.chunks_exact(34)).take(n / QK) {
        let sumi = nibble5_dot(arr(x, 6), u32_at(x, 2), arr(y, 2), 16);
        sumf += (f16_at(x, 0) * f16_at(y, 0)) * sumi as f32;
    }
    sumf
}

/// `ggml_vec_dot_q5_1_q8_1`: `sum_blocks(d_w * d_a * sumi + m_w * s_a)`.
pub(super) fn dot_q5_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(24).zip(a.chunks_exact(36)).take(n / QK) {
        let sumi = nibble5_dot(arr(x, 8), u32_at(x, 4), arr(y, 4), 0);
        sumf += (f16_at(x, 0) * f16_at(y, 0)) * sumi as f32 + f16_at(x, 2) * f16_at(y, 2);
    }
    sumf
}

/// `ggml_vec_dot_q8_0_q8_0`: `sum_blocks(sumi * (d_w * d_a))`.
pub(super) fn dot_q8_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(34).zip(a.chunks_exact(34)).take(n / QK) {
        let (qx, qy) = (arr::<32>(x, 2), arr::<32>(y, 2));
        let mut sumi = 0i32;
        for j in 0..32 {
            sumi += qx[j] as i8 as i32 * qy[j] as i8 as i32;
        }
        sumf += sumi as f32 * (f16_at(x, 0) * f16_at(y, 0));
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_tie_rounding_per_mode() {
        // amax = 127 gives d = 1, so the scaled values are x itself: exact ties.
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 0.5;
        x[4] = -127.0;
        for (mode, want) in [(Q8Rounding::Reference, [127, 3, -3, 1, -127]), (Q8Rounding::X86, [127, 2, -2, 0, -127])] {
            let mut out = [0u8; 34];
            quantize_q8_0(&x, &mut out, mode);
            assert_eq!(f16_at(&out, 0), 1.0);
            assert_eq!(out[2..7].iter().map(|&b| b as i8).collect::<Vec<_>>(), want, "{mode:?}");
        }
    }

    #[test]
    fn q8_1_stores_scaled_sum() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
        let mut out = [0u8; 36];
        quantize_q8_1(&x, &mut out, Q8Rounding::X86);
        let d = f16_at(&out, 0);
        let sum: i32 = out[4..36].iter().map(|&b| b as i8 as i32).sum();
        assert_eq!(f16_at(&out, 2), half::f16::from_f32(sum as f32 * (21.0f32 / 127.0)).to_f32());
        assert!((d - 21.0 / 127.0).abs() < 1e-4);
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let x = [0f32; 32];
        let mut out = [0xffu8; 36];
        quantize_q8_1(&x, &mut out, Q8Rounding::Reference);
        assert!(out.iter().all(|&b| b == 0));
    }
}
