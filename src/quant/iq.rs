//! Non-linear 4-bit formats: IQ4_NL, IQ4_XS and MXFP4 (portable code).
//!
//! Block layouts (`block_iq4_nl`, `block_iq4_xs`, `block_mxfp4` in `ggml/src/ggml-common.h`):
//!
//! | type   | bytes | layout                                                            |
//! |--------|-------|-------------------------------------------------------------------|
//! | IQ4_NL | 18    | `d: f16`, `qs[16]` (32 elements)                                  |
//! | IQ4_XS | 136   | `d: f16`, `scales_h: u16`, `scales_l[4]`, `qs[128]` (256 elements)|
//! | MXFP4  | 17    | `e: u8` (E8M0 exponent), `qs[16]` (32 elements)                   |
//!
//! Each nibble indexes a 16-entry table (`kvalues_iq4nl`, `kvalues_mxfp4` in ggml-common.h);
//! byte `j` of a 16-byte run holds element `j` (low nibble) and `j + 16` (high nibble). IQ4_XS
//! has a 6-bit scale per 32 elements (low 4 bits in `scales_l`, top 2 in `scales_h`), minus 32.
//! MXFP4's table holds twice the E2M1 values, so the scale is half the E8M0 power of two
//! (`ggml_e8m0_to_fp32_half`, `ggml/src/ggml-impl.h`). Dequantization follows
//! `dequantize_row_iq4_nl` / `_iq4_xs` / `_mxfp4` (`ggml/src/ggml-quants.c`), the dot products
//! `ggml_vec_dot_iq4_nl_q8_0_generic`, `ggml_vec_dot_iq4_xs_q8_K_generic`,
//! `ggml_vec_dot_mxfp4_q8_0_generic` (`ggml/src/ggml-cpu/quants.c`).

use super::f16_at;

/// IQ4_NL / IQ4_XS code book.
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];
/// MXFP4 code book: E2M1 values times two.
pub(crate) const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of the E8M0 value `2^(e - 127)`, i.e. `2^(e - 128)` (e = 0 and 1 give subnormals).
#[inline(always)]
pub(crate) fn e8m0_to_f32_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000u32 << e)
    } else {
        f32::from_bits((e as u32 - 1) << 23)
    }
}

/// The 6-bit scale of 32-element sub-block `ib` of an IQ4_XS block, minus 32.
#[inline(always)]
pub(crate) fn iq4_xs_scale(b: &[u8], ib: usize) -> i32 {
    let scales_h = u16::from_le_bytes([b[2], b[3]]) as u32;
    let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) as u32 & 0x0f;
    let hi = (scales_h >> (2 * ib)) & 3;
    (lo | hi << 4) as i32 - 32
}

#[inline(always)]
fn lut_block(qs: &[u8], table: &[i8; 16], scale: f32, y: &mut [f32]) {
    for j in 0..16 {
        y[j] = scale * table[(qs[j] & 0x0f) as usize] as f32;
        y[j + 16] = scale * table[(qs[j] >> 4) as usize] as f32;
    }
}

pub(super) fn dequant_iq4_nl(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
        lut_block(&b[2..18], &KVALUES_IQ4NL, f16_at(b, 0), y);
    }
}

pub(super) fn dequant_iq4_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(136).zip(dst.chunks_exact_mut(256)) {
        let d = f16_at(b, 0);
        for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
            let dl = d * iq4_xs_scale(b, ib) as f32;
            lut_block(&b[8 + 16 * ib..24 + 16 * ib], &KVALUES_IQ4NL, dl, ys);
        }
    }
}

pub(super) fn dequant_mxfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(17).zip(dst.chunks_exact_mut(32)) {
        let d = e8m0_to_f32_half(b[0]);
        for j in 0..16 {
            y[j] = KVALUES_MXFP4[(b[1 + j] & 0x0f) as usize] as f32 * d;
            y[j + 16] = KVALUES_MXFP4[(b[1 + j] >> 4) as usize] as f32 * d;
        }
    }
}

/// Integer dot of 16 packed nibbles (32 elements through `table`) with 32 int8 quants.
#[inline(always)]
fn lut_dot(qs: &[u8], table: &[i8; 16], q8: &[u8]) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += table[(qs[j] & 0x0f) as usize] as i32 * q8[j] as i8 as i32;
        s += table[(qs[j] >> 4) as usize] as i32 * q8[j + 16] as i8 as i32;
    }
    s
}

/// `ggml_vec_dot_iq4_nl_q8_0`: `sum_blocks(d_a * d_w * sumi)`.
pub(super) fn dot_iq4_nl_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(18).zip(a.chunks_exact(34)).take(n / 32) {
        let d = f16_at(y, 0) * f16_at(x, 0);
        sumf += d * lut_dot(&x[2..18], &KVALUES_IQ4NL, &y[2..34]) as f32;
    }
    sumf
}

/// `ggml_vec_dot_mxfp4_q8_0`: `sum_blocks(d_a * e8m0_half(e) * sumi)`.
pub(super) fn dot_mxfp4_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(17).zip(a.chunks_exact(34)).take(n / 32) {
        let d = f16_at(y, 0) * e8m0_to_f32_half(x[0]);
        sumf += d * lut_dot(&x[1..17], &KVALUES_MXFP4, &y[2..34]) as f32;
    }
    sumf
}

/// `ggml_vec_dot_iq4_xs_q8_K`: `d_w * d_a * sum(scale * sumi)` (exact i32 per super-block).
pub(super) fn dot_iq4_xs_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(136).zip(a.chunks_exact(292)).take(n / 256) {
        let d = f16_at(x, 0) * f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let mut isum = 0i32;
        for ib in 0..8 {
            let s = lut_dot(&x[8 + 16 * ib..24 + 16 * ib], &KVALUES_IQ4NL, &y[4 + 32 * ib..36 + 32 * ib]);
            isum += iq4_xs_scale(x, ib) * s;
        }
        sumf += d * isum as f32;
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_half_values() {
        assert_eq!(e8m0_to_f32_half(127), 0.5);
        assert_eq!(e8m0_to_f32_half(128), 1.0);
        assert_eq!(e8m0_to_f32_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32_half(0), 2f32.powi(-128));
    }
}
