//! GGML block formats: sizes, dequantization, activation quantization and dot products.
//!
//! Layouts follow ggml (`ggml/src/ggml-common.h`, `ggml/src/ggml-quants.c` in llama.cpp); the dot
//! products follow ggml's CPU backend (`ggml/src/ggml-cpu/quants.c` for the portable versions,
//! `ggml/src/ggml-cpu/arch/x86/quants.c` for AVX2, `ggml/src/ggml-cpu/vec.cpp` for F32/F16/BF16).
//!
//! A matrix-vector product works as in ggml: the f32 activation row is first converted to the
//! weight type's [`vec_dot_type`] with [`quantize_activation`] (Q8_0, Q8_1, Q8_K, F16, …), then
//! every weight row is dotted with it by [`vec_dot`] / [`matvec`], in integer arithmetic inside a
//! block and f32 across blocks, exactly as ggml does.
//!
//! Code layout: `float` (F32/F16/BF16), `legacy` (Q4_0 … Q8_1), `kquants` (Q2_K … Q8_K),
//! `iq` (IQ4_NL, IQ4_XS, MXFP4) hold the portable (scalar) code, which is also what runs on
//! wasm32; `x86` holds the AVX2+FMA+F16C kernels, chosen at run time, and `wasm` the
//! WebAssembly SIMD128 kernels, compiled in when the build enables `simd128` (see [`Simd`]).

mod float;
mod iq;
mod kquants;
mod legacy;
pub mod quantize;
pub mod repack;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod wasm;
/// Four-lane f16 <-> f32 conversions (exact / round to nearest even) for the CPU backend's f16
/// vector loops on wasm.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub(crate) use wasm::f16x8_to_f32;
#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
mod x86;
#[cfg(target_arch = "aarch64")]
mod neon;

use std::sync::atomic::{AtomicU8, Ordering};

/// GGML tensor types, with the numeric ids GGUF stores (`enum ggml_type` in `ggml.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    IQ4NL = 20,
    IQ4XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    BF16 = 30,
    MXFP4 = 39,
}

impl GgmlType {
    pub fn from_u32(v: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match v {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            20 => IQ4NL,
            23 => IQ4XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            39 => MXFP4,
            _ => return None,
        })
    }

    /// Name as ggml prints it (`ggml_type_name`).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            IQ4NL => "IQ4_NL",
            IQ4XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            BF16 => "BF16",
            MXFP4 => "MXFP4",
        }
    }

    /// The type named `s` as ggml writes it (`q4_0`, `Q2_K`, `f16`; case-insensitive).
    pub fn from_name(s: &str) -> Option<Self> {
        (0..64).filter_map(Self::from_u32).find(|t| t.name().eq_ignore_ascii_case(s))
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4NL | MXFP4 => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | IQ4XS => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            IQ4NL => 18,
            MXFP4 => 17,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
            IQ4XS => 136,
        }
    }

    /// Bytes of a row of `n` elements, or `None` if `n` is not a multiple of the block size
    /// or the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if n % bs != 0 {
            return None;
        }
        (n / bs).checked_mul(self.type_size() as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors from the (de)quantization entry points.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{op} is not supported for ggml type {ty}")]
    Unsupported { ty: GgmlType, op: &'static str },
    #[error("{ty}: {n} elements is not a multiple of the block size {block}")]
    NotBlockMultiple { ty: GgmlType, n: usize, block: usize },
    #[error("{ty}: {n} elements take {expected} bytes, but {got} bytes were given")]
    SizeMismatch { ty: GgmlType, n: usize, expected: usize, got: usize },
}

/// Byte size of a row of `n` elements, with the error [`dequantize_row`] and
/// [`quantize_activation`] report.
fn row_size(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let bs = ty.block_size();
    if n % bs != 0 {
        return Err(QuantError::NotBlockMultiple { ty, n, block: bs });
    }
    Ok(n / bs * ty.type_size())
}

/// IEEE half bits -> f32, exact, branch-light and inlinable on every target (the scalar kernels
/// convert a few scales per block; `half`'s conversion is an out-of-line call with a CPU check).
/// The 15 exponent+mantissa bits are placed in an f32 (biased as if f32) and rescaled by 2^112,
/// which is exact for normal and subnormal halves; infinities and NaNs (quieted, as F16C does)
/// take the other branch.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let em = (h as u32) & 0x7fff;
    let mag = if em < 0x7c00 {
        (f32::from_bits(em << 13) * f32::from_bits(0x7780_0000)).to_bits() // 0x7780_0000 = 2^112
    } else {
        0x7f80_0000 | (em & 0x3ff) << 13 | if em > 0x7c00 { 0x0040_0000 } else { 0 }
    };
    f32::from_bits(sign | mag)
}

/// Reads the little-endian IEEE half at `b[i..i + 2]` as f32 (exact).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// f32 -> IEEE half bits, round to nearest even (ggml's `GGML_FP32_TO_FP16`).
#[inline(always)]
pub(crate) fn f32_to_f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// Whether [`dequantize_row`] handles `ty`.
pub fn supports_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_1
            | Q2K
            | Q3K
            | Q4K
            | Q5K
            | Q6K
            | Q8K
            | IQ4NL
            | IQ4XS
            | MXFP4
    )
}

/// Whether `ty` can be a weight row for [`vec_dot`] / [`matvec`].
pub fn supports_vec_dot(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K | IQ4NL | IQ4XS | MXFP4
    )
}

/// Dequantize `n = dst.len()` elements from `src`, which must hold exactly `row_bytes(n)` bytes.
///
/// Each type follows ggml's `dequantize_row_<type>` (`ggml/src/ggml-quants.c`), operation for
/// operation, so results are bit-identical to ggml's (and to gguf-py's `gguf.quants.dequantize`).
/// Q8_1 and Q8_K (activation formats) dequantize to `d * q`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    use GgmlType::*;
    if !supports_dequantize(ty) {
        return Err(QuantError::Unsupported { ty, op: "dequantization" });
    }
    let n = dst.len();
    let expected = row_size(ty, n)?;
    if src.len() != expected {
        return Err(QuantError::SizeMismatch { ty, n, expected, got: src.len() });
    }
    match ty {
        F32 => float::dequant_f32(src, dst),
        F16 => float::dequant_f16(src, dst),
        BF16 => float::dequant_bf16(src, dst),
        Q4_0 => legacy::dequant_q4_0(src, dst),
        Q4_1 => legacy::dequant_q4_1(src, dst),
        Q5_0 => legacy::dequant_q5_0(src, dst),
        Q5_1 => legacy::dequant_q5_1(src, dst),
        Q8_0 => legacy::dequant_q8_0(src, dst),
        Q8_1 => legacy::dequant_q8_1(src, dst),
        Q2K => kquants::dequant_q2_k(src, dst),
        Q3K => kquants::dequant_q3_k(src, dst),
        Q4K => kquants::dequant_q4_k(src, dst),
        Q5K => kquants::dequant_q5_k(src, dst),
        Q6K => kquants::dequant_q6_k(src, dst),
        Q8K => kquants::dequant_q8_k(src, dst),
        IQ4NL => iq::dequant_iq4_nl(src, dst),
        IQ4XS => iq::dequant_iq4_xs(src, dst),
        MXFP4 => iq::dequant_mxfp4(src, dst),
        I8 | I16 | I32 | I64 | F64 => unreachable!("filtered by supports_dequantize"),
    }
    Ok(())
}

/// The format ggml's CPU backend converts the activation row to before dotting it with a weight
/// row of type `ty` (`type_traits_cpu[ty].vec_dot_type` in `ggml/src/ggml-cpu/ggml-cpu.c`):
/// Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4 -> Q8_0, Q4_1/Q5_1 -> Q8_1, K-quants and IQ4_XS -> Q8_K, and
/// F32/F16/BF16 to themselves. As in that table, Q8_1 maps to itself and the types without an
/// entry (integers, F64, Q8_K) to F32, the value of its zero-initialised fields; none of these
/// has a [`vec_dot`] (see [`supports_vec_dot`]).
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    use GgmlType::*;
    match ty {
        F16 => F16,
        BF16 => BF16,
        Q4_0 | Q5_0 | Q8_0 | IQ4NL | MXFP4 => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q2K | Q3K | Q4K | Q5K | Q6K | IQ4XS => Q8K,
        Q8_1 => Q8_1,
        F32 | Q8K | I8 | I16 | I32 | I64 | F64 => F32,
    }
}

/// Quantize the f32 activation row `x` into `act_ty` (one of F32, F16, BF16, Q8_0, Q8_1, Q8_K),
/// as ggml's CPU backend does on x86-64 (the platform LES's reference logits come from).
/// `out` is cleared and then holds exactly `act_ty.row_bytes(x.len())` bytes.
///
/// Q8_0/Q8_1 follow ggml's x86 `quantize_row_q8_0` / `quantize_row_q8_1`
/// (`ggml/src/ggml-cpu/arch/x86/quants.c`): `d = amax / 127` (stored as f16),
/// `q = round_half_even(x * (127 / amax))`, and for Q8_1 `s = f16(d * sum(q))`. Q8_K follows
/// `quantize_row_q8_K_ref` (`ggml/src/ggml-quants.c`, also what x86 runs): `iscale = -127 / max`
/// (`max`: the first element of largest magnitude), `q = min(127, round_half_even(x * iscale))`,
/// `d = 1 / iscale` as f32 and int16 sums of each 16 quants. F16 rounds to nearest even; BF16
/// rounds to nearest even with NaNs kept quiet (ggml's `GGML_FP32_TO_BF16`). The result is the
/// same on every platform LES runs on (wasm included).
///
/// [`quantize_activation_reference`] gives ggml's portable reference quantizers instead; the two
/// differ only on exact ties and, rarely, by one quantum where `127 / amax` and `1 / d` round
/// differently.
pub fn quantize_activation(act_ty: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Result<(), QuantError> {
    quantize_activation_with(act_ty, x, out, legacy::Q8Rounding::X86)
}

/// As [`quantize_activation`], but Q8_0/Q8_1 follow ggml's portable reference quantizers
/// `quantize_row_q8_0_ref` / `quantize_row_q8_1_ref` (`ggml/src/ggml-quants.c`): multiplier
/// `1 / d` and `roundf` (halves away from zero). These are the bytes gguf-py's
/// `gguf.quants.quantize(.., Q8_0)` produces and what ggml's non-SIMD builds compute.
pub fn quantize_activation_reference(act_ty: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Result<(), QuantError> {
    quantize_activation_with(act_ty, x, out, legacy::Q8Rounding::Reference)
}

fn quantize_activation_with(
    act_ty: GgmlType,
    x: &[f32],
    out: &mut Vec<u8>,
    mode: legacy::Q8Rounding,
) -> Result<(), QuantError> {
    use GgmlType::*;
    if !matches!(act_ty, F32 | F16 | BF16 | Q8_0 | Q8_1 | Q8K) {
        return Err(QuantError::Unsupported { ty: act_ty, op: "activation quantization" });
    }
    let bytes = row_size(act_ty, x.len())?;
    out.clear();
    out.resize(bytes, 0);
    match act_ty {
        F32 => float::quant_f32(x, out),
        F16 => float::quant_f16(x, out),
        BF16 => float::quant_bf16(x, out),
        Q8_0 => legacy::quantize_q8_0(x, out, mode),
        Q8_1 => legacy::quantize_q8_1(x, out, mode),
        Q8K => kquants::quantize_q8_k(x, out),
        _ => unreachable!("filtered above"),
    }
    Ok(())
}

/// Instruction-set level of the dot-product kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Simd {
    /// Portable Rust (also the wasm32 path).
    Scalar,
    /// x86 AVX2 + FMA + F16C.
    Avx2,
    /// WebAssembly SIMD128 (only in builds with `-C target-feature=+simd128`).
    Simd128,
    /// AArch64 NEON (ARMv8.0: every aarch64 CPU). Same bits as [`Simd::Scalar`].
    Neon,
    /// AArch64 NEON with the ARMv8.2 dot-product instructions (`sdot`). Same bits as
    /// [`Simd::Scalar`].
    NeonDotprod,
}

/// 0 = not yet detected, else [`Simd::code`].
static SIMD_LEVEL: AtomicU8 = AtomicU8::new(0);

/// Every level, the best first (the order [`Simd::best`] tries them in).
const LEVELS: [Simd; 5] = [Simd::Avx2, Simd::NeonDotprod, Simd::Neon, Simd::Simd128, Simd::Scalar];

impl Simd {
    /// The best level this CPU supports. Setting the environment variable `LES_NO_SIMD` (to any
    /// value) forces [`Simd::Scalar`]. Detected once, then cached.
    pub fn best() -> Simd {
        match SIMD_LEVEL.load(Ordering::Relaxed) {
            1 => Simd::Scalar,
            2 => Simd::Avx2,
            3 => Simd::Simd128,
            4 => Simd::Neon,
            5 => Simd::NeonDotprod,
            _ => {
                let forced_scalar = std::env::var_os("LES_NO_SIMD").is_some();
                let s = LEVELS.into_iter().find(|s| !forced_scalar && s.is_available()).unwrap_or(Simd::Scalar);
                SIMD_LEVEL.store(s.code(), Ordering::Relaxed);
                s
            }
        }
    }

    /// Use `level` for every kernel call from now on in this process (when this CPU has it; the
    /// same as `LES_NO_SIMD=1` for [`Simd::Scalar`]). The portable level is the arithmetic the
    /// CPU backend computes on every platform without AVX2 (wasm32, aarch64) and what the wgpu
    /// backend's exact path reproduces bit for bit; AVX2 follows llama.cpp's x86 kernels.
    pub fn force(level: Simd) {
        if level.is_available() {
            SIMD_LEVEL.store(level.code(), Ordering::Relaxed);
        }
    }

    /// The level's value in `SIMD_LEVEL`.
    fn code(self) -> u8 {
        match self {
            Simd::Scalar => 1,
            Simd::Avx2 => 2,
            Simd::Simd128 => 3,
            Simd::Neon => 4,
            Simd::NeonDotprod => 5,
        }
    }

    /// Whether this CPU can run the level.
    pub fn is_available(self) -> bool {
        match self {
            Simd::Scalar => true,
            Simd::Avx2 => {
                // Cached: `vec_dot` checks this on every call.
                static AVX2: AtomicU8 = AtomicU8::new(0); // 0 = unknown, 1 = no, 2 = yes
                match AVX2.load(Ordering::Relaxed) {
                    1 => false,
                    2 => true,
                    _ => {
                        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
                        let ok = std::arch::is_x86_feature_detected!("avx2")
                            && std::arch::is_x86_feature_detected!("fma")
                            && std::arch::is_x86_feature_detected!("f16c");
                        #[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
                        let ok = false;
                        AVX2.store(if ok { 2 } else { 1 }, Ordering::Relaxed);
                        ok
                    }
                }
            }
            Simd::Simd128 => cfg!(all(target_arch = "wasm32", target_feature = "simd128")),
            Simd::Neon => cfg!(target_arch = "aarch64"),
            Simd::NeonDotprod => {
                #[cfg(target_arch = "aarch64")]
                let ok = std::arch::is_aarch64_feature_detected!("dotprod");
                #[cfg(not(target_arch = "aarch64"))]
                let ok = false;
                ok
            }
        }
    }

    /// Every level this CPU can run, [`Simd::Scalar`] first.
    pub fn available() -> Vec<Simd> {
        LEVELS.into_iter().rev().filter(|s| s.is_available()).collect()
    }
}

/// A dot-product kernel: `(n, weight row, quantized activation) -> dot`.
///
/// Safety contract for callers: `n` is a multiple of the weight block size, the weight row holds
/// at least `row_bytes(n)` bytes, the activation at least `vec_dot_type.row_bytes(n)` bytes,
/// and the kernel's instruction set is available.
type DotFn = unsafe fn(usize, &[u8], &[u8]) -> f32;

/// A four-activation-row tile: `(n, weight row, four activation rows) -> four dots`, each the
/// bits of the same level's [`DotFn`] on that row (same safety contract).
#[cfg(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64"))]
type TileFn = unsafe fn(usize, &[u8], [&[u8]; 4]) -> [f32; 4];

/// A two-weight-row × four-activation-row tile (`out[row][activation]`), each output the bits
/// of the same level's [`DotFn`] (AArch64 `smmla`).
#[cfg(target_arch = "aarch64")]
type Tile2Fn = unsafe fn(usize, [&[u8]; 2], [&[u8]; 4]) -> [[f32; 4]; 2];

fn scalar_kernel(ty: GgmlType) -> Option<DotFn> {
    use GgmlType::*;
    Some(match ty {
        F32 => float::dot_f32,
        F16 => float::dot_f16,
        BF16 => float::dot_bf16,
        Q4_0 => legacy::dot_q4_0_q8_0,
        Q4_1 => legacy::dot_q4_1_q8_1,
        Q5_0 => legacy::dot_q5_0_q8_0,
        Q5_1 => legacy::dot_q5_1_q8_1,
        Q8_0 => legacy::dot_q8_0_q8_0,
        Q2K => kquants::dot_q2_k_q8_k,
        Q3K => kquants::dot_q3_k_q8_k,
        Q4K => kquants::dot_q4_k_q8_k,
        Q5K => kquants::dot_q5_k_q8_k,
        Q6K => kquants::dot_q6_k_q8_k,
        IQ4NL => iq::dot_iq4_nl_q8_0,
        IQ4XS => iq::dot_iq4_xs_q8_k,
        MXFP4 => iq::dot_mxfp4_q8_0,
        _ => return None,
    })
}

/// The kernel for `ty` at `simd` (falling back to scalar where a type has no SIMD kernel or the
/// level is unavailable on this CPU).
fn kernel(simd: Simd, ty: GgmlType) -> Option<DotFn> {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if simd == Simd::Avx2 && simd.is_available() {
        if let Some(k) = x86::kernel(ty) {
            return Some(k);
        }
    }
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if simd == Simd::Simd128 {
        if let Some(k) = wasm::kernel(ty) {
            return Some(k);
        }
    }
    #[cfg(target_arch = "aarch64")]
    if matches!(simd, Simd::Neon | Simd::NeonDotprod) && simd.is_available() {
        if let Some(k) = neon::kernel(ty, simd == Simd::NeonDotprod) {
            return Some(k);
        }
    }
    let _ = simd;
    scalar_kernel(ty)
}

/// Checks the sizes of a dot / matvec call; `false` (after a debug assertion) if they are wrong.
#[inline]
fn dot_sizes_ok(ty: GgmlType, n: usize, w_len: usize, act_len: usize, rows: usize) -> bool {
    let bs = ty.block_size();
    let at = vec_dot_type(ty);
    let ok_n = n % bs == 0 && n % at.block_size() == 0;
    let w_need = (n / bs).checked_mul(ty.type_size()).and_then(|r| r.checked_mul(rows));
    let a_need = (n / at.block_size()).checked_mul(at.type_size());
    let ok = ok_n && w_need.is_some_and(|w| w_len >= w) && a_need.is_some_and(|a| act_len >= a);
    debug_assert!(
        ok,
        "quant::vec_dot/matvec({ty}, n = {n}, rows = {rows}): weight has {w_len} bytes (needs {w_need:?}), \
         activation has {act_len} bytes (needs {a_need:?} of {at})"
    );
    ok
}

/// Dot product of one weight row (type `ty`, `n` elements) with an activation row already
/// converted by `quantize_activation(vec_dot_type(ty), ..)`. Same arithmetic as ggml's
/// `ggml_vec_dot_<ty>_<vec_dot_type>`.
///
/// Wrong sizes or an unsupported type are a caller bug: debug builds panic with a message,
/// release builds return NaN (never reading out of bounds).
pub fn vec_dot(ty: GgmlType, n: usize, w_row: &[u8], act: &[u8]) -> f32 {
    vec_dot_with(Simd::best(), ty, n, w_row, act)
}

/// [`vec_dot`] of two f32 rows with the kernel looked up once (hot loops over short rows: the
/// Gated DeltaNet state's). Same bits as `vec_dot(F32, ..)`; NaN where no kernel exists.
#[derive(Clone, Copy)]
pub struct F32Dot(Option<DotFn>);

impl F32Dot {
    pub fn new() -> Self {
        F32Dot(kernel(Simd::best(), GgmlType::F32))
    }

    /// `Σ a[i] · b[i]` over the shorter length, in `ggml_vec_dot_f32`'s order.
    #[inline]
    pub fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        match self.0 {
            // SAFETY: both rows hold `n` f32 values; `kernel` only returns kernels the CPU supports.
            Some(k) => unsafe { k(n, bytemuck::cast_slice(&a[..n]), bytemuck::cast_slice(&b[..n])) },
            None => f32::NAN,
        }
    }
}

impl Default for F32Dot {
    fn default() -> Self {
        Self::new()
    }
}

/// [`vec_dot`] with an explicit kernel level (tests, benchmarks). An unavailable level falls back
/// to scalar.
pub fn vec_dot_with(simd: Simd, ty: GgmlType, n: usize, w_row: &[u8], act: &[u8]) -> f32 {
    let Some(k) = kernel(simd, ty) else {
        debug_assert!(false, "quant::vec_dot: no dot product for ggml type {ty}");
        return f32::NAN;
    };
    if !dot_sizes_ok(ty, n, w_row.len(), act.len(), 1) {
        return f32::NAN;
    }
    // SAFETY: sizes checked above; `kernel` only returns SIMD kernels the CPU supports.
    unsafe { k(n, w_row, act) }
}

/// Four activation rows of a batched product, ready for [`BatchDot::dot_tile`] with any number
/// of weight rows ([`BatchDot::tile_acts`]).
pub struct TileActs<'a> {
    acts: [&'a [u8]; 4],
    t: usize,
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    prep: Option<Vec<wasm::ActBlock>>,
}

/// The dot products of one batched product (`n_tok` activation rows × a weight of `rows` rows),
/// looked up and size-checked once instead of per output. On x86-64 with AVX2 it follows ggml's
/// batched paths where they sum in a different order from [`vec_dot`] (tinyBLAS for F32 and F16
/// weights, the repacked GEMM for Q4_K, the tiled K-quant matmul for Q6_K; `experts`: one
/// expert's rows of a `mul_mat_id`); elsewhere, and for every row when `per_row`, it is
/// [`vec_dot`]'s kernel.
#[cfg_attr(not(any(target_arch = "x86", target_arch = "x86_64")), allow(dead_code))]
pub struct BatchDot {
    ty: GgmlType,
    n: usize,
    rows: usize,
    n_tok: usize,
    experts: bool,
    gemm: bool,
    plain: Option<DotFn>,
    #[cfg(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64"))]
    tile: Option<TileFn>,
    #[cfg(target_arch = "aarch64")]
    tile2: Option<Tile2Fn>,
    /// wasm SIMD128: four dots per call (one weight row × four activation rows here).
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    x4: Option<wasm::X4Fn>,
    /// wasm SIMD128: four weight rows × four activation rows per call, the activation rows
    /// prepared once per tile ([`BatchDot::tile_acts`]).
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    x4x4: Option<(wasm::Prep4Fn, wasm::X4x4Fn)>,
    w_need: usize,
    a_need: usize,
}

/// Whether the x86 kernels run (`Simd::Avx2`, the orders of ggml's x86 builds) on a CPU with
/// AVX-512F and VL: some of them then use 16-lane registers (same bits); `LES_NO_AVX512=1` turns
/// that off. False elsewhere.
pub fn has_avx512() -> bool {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    return Simd::best() == Simd::Avx2 && x86::has_avx512();
    #[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
    false
}

/// F32 and F16 weights in a batched product on x86 AVX2, where [`BatchDot`] takes ggml's tinyBLAS
/// order for every row (`n` a multiple of 16, a multiple of 4 rows, not per row, not experts):
/// the same bits from activations widened to f32 once (F16: the f16 activation values, exact),
/// four activation rows per weight row load.
pub struct FloatGemm {
    ty: GgmlType,
    n: usize,
    /// [`Self::block`] on AVX-512 registers (the CPU has AVX-512F and VL, `LES_NO_AVX512` unset).
    #[cfg_attr(not(any(target_arch = "x86", target_arch = "x86_64")), allow(dead_code))]
    avx512: bool,
}

impl FloatGemm {
    pub fn new(ty: GgmlType, n: usize, rows: usize, n_tok: usize, experts: bool, per_row: bool) -> Option<Self> {
        let ok = matches!(ty, GgmlType::F32 | GgmlType::F16) && n % 16 == 0 && rows % 4 == 0 && n_tok >= 2 && !experts && !per_row;
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        let avx512 = x86::has_avx512();
        #[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
        let avx512 = false;
        (ok && cfg!(any(target_arch = "x86", target_arch = "x86_64")) && Simd::best() == Simd::Avx2).then_some(Self { ty, n, avx512 })
    }

    /// The same product with [`Self::block`] on AVX2 registers only (as on CPUs without
    /// AVX-512; for tests and comparisons).
    pub fn avx2_only(self) -> Self {
        Self { avx512: false, ..self }
    }

    /// Every product of `rows` weight rows (`w`: the rows, contiguous) with `toks` activation
    /// rows (`a`: contiguous rows of `n` f32): `out(row, token, value)`, each value the bits of
    /// [`Self::dot`]. With AVX-512F, tiles of 4 rows × 6 activations on 16-lane registers;
    /// otherwise one row × four activations on AVX2. Short slices give NaN outputs.
    pub fn block(&self, w: &[u8], rows: usize, a: &[f32], toks: usize, out: &mut impl FnMut(usize, usize, f32)) {
        let w_row = self.n * if self.ty == GgmlType::F16 { 2 } else { 4 };
        if w.len() < rows * w_row || a.len() < toks * self.n {
            for r in 0..rows {
                for t in 0..toks {
                    out(r, t, f32::NAN);
                }
            }
            return;
        }
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        if self.avx512 {
            // SAFETY: sizes checked above; AVX-512F and VL are available (`has_avx512`), `n % 16 == 0` (`new`).
            unsafe { x86::float_block_avx512(self.ty == GgmlType::F16, self.n, w, rows, a, toks, out) };
            return;
        }
        let wrow = |r: usize| &w[r * w_row..(r + 1) * w_row];
        let act = |t: usize| &a[t * self.n..(t + 1) * self.n];
        for t0 in (0..toks).step_by(4) {
            for r in 0..rows {
                if t0 + 4 <= toks {
                    let v = self.dot4(wrow(r), [act(t0), act(t0 + 1), act(t0 + 2), act(t0 + 3)]);
                    for (k, v) in v.into_iter().enumerate() {
                        out(r, t0 + k, v);
                    }
                } else {
                    for t in t0..toks {
                        out(r, t, self.dot(wrow(r), act(t)));
                    }
                }
            }
        }
    }

    /// `w_row · a` (`a`: `n` f32 values; NaN when a slice is short).
    #[inline]
    pub fn dot(&self, w_row: &[u8], a: &[f32]) -> f32 {
        let esize = if self.ty == GgmlType::F16 { 2 } else { 4 };
        if w_row.len() < self.n * esize || a.len() < self.n {
            return f32::NAN;
        }
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        // SAFETY: sizes checked above; AVX2/FMA/F16C are available (`new` checked Simd::best).
        unsafe {
            if self.ty == GgmlType::F16 {
                x86::gemm_x1_f16(self.n, w_row, a)
            } else {
                x86::gemm_x4_f32(self.n, w_row, [a, a, a, a])[0]
            }
        }
        #[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
        f32::NAN
    }

    /// [`Self::dot`] for four activation rows.
    #[inline]
    pub fn dot4(&self, w_row: &[u8], a: [&[f32]; 4]) -> [f32; 4] {
        let esize = if self.ty == GgmlType::F16 { 2 } else { 4 };
        if w_row.len() < self.n * esize || a.iter().any(|a| a.len() < self.n) {
            return [f32::NAN; 4];
        }
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        // SAFETY: as in `dot`.
        unsafe {
            if self.ty == GgmlType::F16 {
                x86::gemm_x4_f16(self.n, w_row, a)
            } else {
                x86::gemm_x4_f32(self.n, w_row, a)
            }
        }
        #[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
        [f32::NAN; 4]
    }
}

impl BatchDot {
    pub fn new(ty: GgmlType, n: usize, rows: usize, n_tok: usize, experts: bool, per_row: bool) -> Self {
        let simd = Simd::best();
        let (bs, at) = (ty.block_size(), vec_dot_type(ty));
        let ok_n = bs > 0 && at.block_size() > 0 && n % bs == 0 && n % at.block_size() == 0;
        let need = |bs: usize, size: usize| if ok_n { (n / bs).checked_mul(size) } else { None };
        let (w_need, a_need) = match (need(bs, ty.type_size()), need(at.block_size(), at.type_size())) {
            (Some(w), Some(a)) => (w, a),
            _ => (usize::MAX, usize::MAX),
        };
        let gemm = !per_row && cfg!(any(target_arch = "x86", target_arch = "x86_64")) && simd == Simd::Avx2;
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        // (F32/F16 tiles follow `vec_dot`'s order: not where tinyBLAS takes the rows.)
        let tile = match (simd, ty) {
            // Q4_K: the tile in the order the batched product takes for whole groups of four.
            (Simd::Avx2, GgmlType::Q4K) => Some(x86::tile_q4_k(gemm, rows, experts)),
            (Simd::Avx2, _) => x86::tile_kernel(ty).filter(|_| !(gemm && x86::gemm_kernel(ty, n, rows, 0, n_tok, experts).is_some() && matches!(ty, GgmlType::F32 | GgmlType::F16))),
            _ => None,
        };
        #[cfg(target_arch = "aarch64")]
        let tile = match simd {
            Simd::Neon | Simd::NeonDotprod => neon::tile_kernel(ty, simd == Simd::NeonDotprod),
            _ => None,
        };
        // `smmla` tiles where the CPU has them (same bits).
        #[cfg(target_arch = "aarch64")]
        let tile2 = if simd == Simd::NeonDotprod && !per_row { neon::tile2_kernel(ty) } else { None };
        BatchDot {
            ty,
            n,
            rows,
            n_tok,
            experts,
            gemm,
            plain: kernel(simd, ty),
            #[cfg(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64"))]
            tile,
            #[cfg(target_arch = "aarch64")]
            tile2,
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            x4: if simd == Simd::Simd128 { wasm::kernel_x4(ty).1 } else { None },
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            x4x4: if simd == Simd::Simd128 { wasm::kernel_4x4(ty) } else { None },
            w_need,
            a_need,
        }
    }

    /// [`BatchDot::dot`] for four activation rows `t .. t + 4` at once, where a tile kernel
    /// exists (the 32-element block types on x86 AVX2 (and Q4_K there), AArch64 NEON and wasm SIMD128: same bits
    /// as four single dots); `None` otherwise.
    #[inline]
    pub fn dot4(&self, w_row: &[u8], acts: [&[u8]; 4], t: usize) -> Option<[f32; 4]> {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        if let Some(k) = self.x4 {
            if w_row.len() < self.w_need || acts.iter().any(|a| a.len() < self.a_need) {
                return Some([f32::NAN; 4]);
            }
            // SAFETY: sizes checked above; SIMD128 is compiled in.
            return Some(unsafe { k(self.n, [w_row; 4], acts) });
        }
        #[cfg(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64"))]
        if let Some(k) = self.tile {
            if w_row.len() < self.w_need || acts.iter().any(|a| a.len() < self.a_need) {
                return Some([f32::NAN; 4]);
            }
            // The block types have no batched kernel of their own: every row takes `kernel`'s
            // (Q4_K's tile is in the batched order, which is the same for a whole group of four).
            #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
            debug_assert!(self.ty == GgmlType::Q4K || (t..t + 4).all(|t| !self.gemm || x86::gemm_kernel(self.ty, self.n, self.rows, t, self.n_tok, self.experts).is_none()));
            // SAFETY: sizes checked above; the tile's instructions are available (Simd::best).
            return Some(unsafe { k(self.n, w_row, acts) });
        }
        let _ = (w_row, acts, t);
        None
    }

    /// Weight rows per tile of [`BatchDot::dot_tile`]: 2 on AArch64 with `FEAT_I8MM`
    /// ([`BatchDot::dot2x4`]), 4 on wasm SIMD128, for the 32-element block types; 0 otherwise.
    #[inline]
    pub fn tile_rows(&self) -> usize {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        if self.x4x4.is_some() {
            return 4;
        }
        if self.has_2x4() {
            2
        } else {
            0
        }
    }

    /// Activation rows `t .. t + 4` (`acts`) made ready for [`BatchDot::dot_tile`] with every
    /// weight row of a tile (wasm: their blocks prepared once).
    pub fn tile_acts<'a>(&self, acts: [&'a [u8]; 4], t: usize) -> TileActs<'a> {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        let prep = match self.x4x4 {
            Some((prep4, _)) if acts.iter().all(|a| a.len() >= self.a_need) => {
                let mut v = Vec::new();
                // SAFETY: sizes checked; SIMD128 is compiled in.
                unsafe { prep4(self.n, acts, &mut v) };
                Some(v)
            }
            _ => None,
        };
        TileActs {
            acts,
            t,
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            prep,
        }
    }

    /// [`BatchDot::tile_rows`] weight rows (`w_rows`, the rest ignored) × the tile's four
    /// activation rows: `out[row][k]`, each output the bits of [`BatchDot::dot`]; `None` where
    /// there is no tile.
    #[inline]
    pub fn dot_tile(&self, w_rows: [&[u8]; 4], acts: &TileActs<'_>) -> Option<[[f32; 4]; 4]> {
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        if let Some((_, k)) = self.x4x4 {
            let Some(prep) = acts.prep.as_deref().filter(|_| w_rows.iter().all(|w| w.len() >= self.w_need)) else {
                return Some([[f32::NAN; 4]; 4]);
            };
            // SAFETY: sizes checked above (the activation rows by `tile_acts`); SIMD128 is
            // compiled in.
            return Some(unsafe { k(self.n, w_rows, prep) });
        }
        let [a, b] = self.dot2x4([w_rows[0], w_rows[1]], acts.acts, acts.t)?;
        Some([a, b, [f32::NAN; 4], [f32::NAN; 4]])
    }

    /// Whether [`BatchDot::dot2x4`] computes (AArch64 with `FEAT_I8MM`, the 32-element block
    /// types).
    #[inline]
    pub fn has_2x4(&self) -> bool {
        #[cfg(target_arch = "aarch64")]
        return self.tile2.is_some();
        #[cfg(not(target_arch = "aarch64"))]
        false
    }

    /// Two weight rows × activation rows `t .. t + 4` (`out[row][k]`), where
    /// [`BatchDot::has_2x4`]: each output the bits of [`BatchDot::dot`]; `None` otherwise.
    #[inline]
    pub fn dot2x4(&self, w_rows: [&[u8]; 2], acts: [&[u8]; 4], t: usize) -> Option<[[f32; 4]; 2]> {
        #[cfg(target_arch = "aarch64")]
        if let Some(k) = self.tile2 {
            if w_rows.iter().any(|w| w.len() < self.w_need) || acts.iter().any(|a| a.len() < self.a_need) {
                return Some([[f32::NAN; 4]; 2]);
            }
            // SAFETY: sizes checked above; `tile2_kernel` checked i8mm and dotprod.
            return Some(unsafe { k(self.n, w_rows, acts) });
        }
        let _ = (w_rows, acts, t);
        None
    }

    /// Weight row `w_row` · activation row `t` (`act`, converted to the vec-dot type); NaN when
    /// the sizes are wrong, as [`vec_dot`].
    #[inline]
    pub fn dot(&self, w_row: &[u8], act: &[u8], t: usize) -> f32 {
        if w_row.len() < self.w_need || act.len() < self.a_need {
            debug_assert!(false, "quant::BatchDot({}, n = {}): weight row {} bytes, activation {} bytes", self.ty, self.n, w_row.len(), act.len());
            return f32::NAN;
        }
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        if self.gemm {
            if let Some(k) = x86::gemm_kernel(self.ty, self.n, self.rows, t, self.n_tok, self.experts) {
                // SAFETY: sizes checked above; AVX2/FMA/F16C are available (Simd::best).
                return unsafe { k(self.n, w_row, act) };
            }
        }
        let _ = t;
        match self.plain {
            // SAFETY: sizes checked above; `kernel` only returns SIMD kernels the CPU supports.
            Some(k) => unsafe { k(self.n, w_row, act) },
            None => f32::NAN,
        }
    }
}

/// `y[r] = dot(row r of w, x)` for `r in 0..y.len()`: `w` holds `y.len()` consecutive rows of
/// `n` elements of type `ty`, `act` is `x` converted by `quantize_activation(vec_dot_type(ty), ..)`.
/// Single-threaded; callers split rows across threads. Size errors as in [`vec_dot`] (release
/// builds fill `y` with NaN).
pub fn matvec(ty: GgmlType, n: usize, w: &[u8], act: &[u8], y: &mut [f32]) {
    matvec_with(Simd::best(), ty, n, w, act, y)
}

/// [`matvec`] with an explicit kernel level.
pub fn matvec_with(simd: Simd, ty: GgmlType, n: usize, w: &[u8], act: &[u8], y: &mut [f32]) {
    let Some(k) = kernel(simd, ty) else {
        debug_assert!(false, "quant::matvec: no dot product for ggml type {ty}");
        y.fill(f32::NAN);
        return;
    };
    if !dot_sizes_ok(ty, n, w.len(), act.len(), y.len()) {
        y.fill(f32::NAN);
        return;
    }
    let rb = n / ty.block_size() * ty.type_size();
    if rb == 0 {
        y.fill(0.0);
        return;
    }
    #[allow(unused_mut)]
    let (mut y, mut w) = (y, w);
    // wasm SIMD128: four rows at a time (each output its single dot's bits), the rest below.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if let Some(kv) = wasm::matvec_kernel(ty).filter(|_| simd == Simd::Simd128) {
        let quads = y.len() / 4;
        let (y4, y_rest) = core::mem::take(&mut y).split_at_mut(quads * 4);
        // SAFETY: sizes checked above (every row and the activation); SIMD128 is compiled in.
        unsafe { kv(n, &w[..quads * 4 * rb], rb, act, y4) };
        (y, w) = (y_rest, &w[quads * 4 * rb..]);
    } else if let Some(k4) = kernel_x4(simd, ty) {
        let quads = y.len() / 4;
        let (y4, y_rest) = core::mem::take(&mut y).split_at_mut(quads * 4);
        for (yq, wq) in y4.chunks_exact_mut(4).zip(w.chunks_exact(4 * rb)) {
            let (w0, w1, w2, w3) = (&wq[..rb], &wq[rb..2 * rb], &wq[2 * rb..3 * rb], &wq[3 * rb..]);
            // SAFETY: sizes checked above (every row and the activation); SIMD128 is compiled in.
            yq.copy_from_slice(&unsafe { k4(n, [w0, w1, w2, w3], [act; 4]) });
        }
        (y, w) = (y_rest, &w[quads * 4 * rb..]);
    }
    for (yr, wr) in y.iter_mut().zip(w.chunks_exact(rb)) {
        // SAFETY: sizes checked above; `kernel` only returns SIMD kernels the CPU supports.
        *yr = unsafe { k(n, wr, act) };
    }
}

/// The four-weight-row kernel of `ty` at `simd` (wasm SIMD128 only).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn kernel_x4(simd: Simd, ty: GgmlType) -> Option<wasm::X4Fn> {
    if simd == Simd::Simd128 { wasm::kernel_x4(ty).0 } else { None }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact_for_every_half() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_to_f32(h);
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
                assert_eq!(got.is_sign_negative(), want.is_sign_negative(), "{h:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn simd_levels() {
        assert!(Simd::Scalar.is_available());
        assert!(Simd::available().contains(&Simd::best()));
        assert_eq!(Simd::available()[0], Simd::Scalar);
    }
}
