//! GGML quantized formats against the reference (gguf-py).
//!
//! Every expected value here comes from `tools/gen_quant_fixtures.py`, which runs gguf-py's
//! `gguf.quants` (the Python port of ggml's reference code) and writes tests/fixtures/quant/
//! (see the manifest for the gguf-py version). The real-tensor tests read the two models that
//! `tools/fetch_models.sh` downloads and fail (not skip) when they are missing.

use les::gguf::GgufFile;
use les::quant::{self, GgmlType, QuantError, Simd};
use les::store::FileSource;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture_dir() -> PathBuf {
    root().join("tests/fixtures/quant")
}

fn manifest() -> Value {
    let p = fixture_dir().join("manifest.json");
    let s = std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e} (run tools/gen_quant_fixtures.py)", p.display()));
    serde_json::from_str(&s).expect("manifest.json")
}

fn bytes(name: &str) -> Vec<u8> {
    let p = fixture_dir().join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn f32s(name: &str) -> Vec<f32> {
    bytes(name).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn ty(name: &str) -> GgmlType {
    use GgmlType::*;
    [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K, IQ4NL, IQ4XS, MXFP4]
        .into_iter()
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("unknown type {name}"))
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or_else(|| panic!("manifest: {k} missing in {v}"))
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("manifest: {k} missing in {v}"))
}

/// Bitwise comparison (so -0.0 != 0.0 and NaN patterns count), with the first mismatch reported.
fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        let n = (0..got.len()).filter(|&i| got[i].to_bits() != want[i].to_bits()).count();
        panic!("{what}: {n} of {} values differ; first at {i}: got {:e}, want {:e}", got.len(), got[i], want[i]);
    }
}

/// The activation vector and its reference conversions.
struct Act {
    x: Vec<f32>,
    formats: Value,
}

impl Act {
    fn load(m: &Value) -> Act {
        let a = &m["activation"];
        Act { x: f32s(s(a, "x")), formats: a["formats"].clone() }
    }
    /// Reference bytes of the first `n` elements in format `fmt`.
    fn bytes(&self, fmt: GgmlType, n: usize) -> Vec<u8> {
        let all = bytes(s(&self.formats[fmt.name()], "bytes"));
        all[..fmt.row_bytes(n as u64).unwrap() as usize].to_vec()
    }
}

/// Tolerance for an f32 dot product against the f64 reference: a rounding-error bound of
/// (number of f32 accumulation steps + slack) units of f32 epsilon times the sum of |terms|.
fn dot_tol(t: GgmlType, n: usize, abs_sum: f64) -> f64 {
    let steps = (n / t.block_size()) as f64 + 16.0;
    steps * f32::EPSILON as f64 * abs_sum + 1e-30
}

fn quantized(fmt: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    quant::quantize_activation(fmt, x, &mut out).unwrap();
    out
}

// ------------------------------------------------------------------------------------------
// 1. Dequantization of synthetic rows

#[test]
fn dequantize_matches_gguf_py() {
    let m = manifest();
    assert!(m["gguf_version"].as_str().is_some());
    let synth = m["synthetic"].as_array().unwrap();
    assert!(synth.len() >= 16, "expected every supported type in the fixtures");
    for e in synth {
        let t = ty(s(e, "type"));
        let src = bytes(s(e, "bytes"));
        let want = f32s(s(e, "dequantized"));
        let mut got = vec![f32::NAN; want.len()];
        quant::dequantize_row(t, &src, &mut got).unwrap();
        // ggml and gguf-py perform the same f32 operations in the same order (no FMA), so the
        // results are bit-identical.
        assert_bits_eq(&format!("dequantize {t}"), &got, &want);
    }
}

#[test]
fn dequantize_row_rejects_bad_sizes_and_types() {
    let mut dst = vec![0f32; 32];
    let err = quant::dequantize_row(GgmlType::Q4_0, &[0u8; 17], &mut dst).unwrap_err();
    assert_eq!(err, QuantError::SizeMismatch { ty: GgmlType::Q4_0, n: 32, expected: 18, got: 17 });
    let err = quant::dequantize_row(GgmlType::Q4_0, &[0u8; 19], &mut dst).unwrap_err();
    assert!(matches!(err, QuantError::SizeMismatch { .. }), "{err}");
    let mut dst = vec![0f32; 31];
    let err = quant::dequantize_row(GgmlType::Q4_0, &[0u8; 18], &mut dst).unwrap_err();
    assert_eq!(err, QuantError::NotBlockMultiple { ty: GgmlType::Q4_0, n: 31, block: 32 });
    let err = quant::dequantize_row(GgmlType::I32, &[0u8; 4], &mut [0f32; 1]).unwrap_err();
    assert!(matches!(err, QuantError::Unsupported { ty: GgmlType::I32, .. }), "{err}");
    assert!(!err.to_string().is_empty());
    // Empty rows are fine.
    quant::dequantize_row(GgmlType::Q4K, &[], &mut []).unwrap();
}

// ------------------------------------------------------------------------------------------
// 2. Activation quantization

fn assert_bytes_eq(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{what}: byte {i} differs: got {:#04x}, want {:#04x}", got[i], want[i]);
    }
}

#[test]
fn activation_quantization_matches_reference() {
    let m = manifest();
    let act = Act::load(&m);
    let n = act.x.len();
    for fmt in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K] {
        let f = &act.formats[fmt.name()];
        // quantize_activation: ggml's x86 quantizers.
        let got = quantized(fmt, &act.x);
        assert_bytes_eq(&format!("quantize_activation {fmt} ({})", s(f, "source")), &got, &act.bytes(fmt, n));
        // And the activation formats dequantize to the reference values.
        let mut deq = vec![0f32; n];
        quant::dequantize_row(fmt, &got, &mut deq).unwrap();
        assert_bits_eq(&format!("dequantize activation {fmt}"), &deq, &f32s(s(f, "dequantized")));
        // quantize_activation_reference: ggml's portable reference quantizers (gguf-py's bytes);
        // the same as quantize_activation except for Q8_0 / Q8_1.
        let mut got_ref = Vec::new();
        quant::quantize_activation_reference(fmt, &act.x, &mut got_ref).unwrap();
        let want_ref = match f.get("reference_bytes") {
            Some(file) => bytes(file.as_str().unwrap()),
            None => act.bytes(fmt, n),
        };
        let src = f.get("reference_source").and_then(Value::as_str).unwrap_or(s(f, "source"));
        assert_bytes_eq(&format!("quantize_activation_reference {fmt} ({src})"), &got_ref, &want_ref);
    }
}

#[test]
fn q8_rounding_of_ties() {
    // The fixture's first block has amax 127 with a negative extreme (Q8_0 d = 1, Q8_K iscale = 1)
    // and exact halves: ggml's reference Q8_0 rounds them away from zero (gguf-py agrees), its
    // x86 Q8_0 and its Q8_K to even.
    let m = manifest();
    let act = Act::load(&m);
    let q8_0 = quantized(GgmlType::Q8_0, &act.x[..32]);
    let q: Vec<i8> = q8_0[2..14].iter().map(|&b| b as i8).collect();
    assert_eq!(q, [-127, 2, -2, 0, 0, 2, -2, 4, 4, -4, 126, -126]);
    let mut q8_0_ref = Vec::new();
    quant::quantize_activation_reference(GgmlType::Q8_0, &act.x[..32], &mut q8_0_ref).unwrap();
    let q: Vec<i8> = q8_0_ref[2..14].iter().map(|&b| b as i8).collect();
    assert_eq!(q, [-127, 3, -3, 1, -1, 2, -2, 4, 5, -5, 127, -127]);
    let q8_k = quantized(GgmlType::Q8K, &act.x[..256]);
    let q: Vec<i8> = q8_k[4..16].iter().map(|&b| b as i8).collect();
    assert_eq!(q, [-127, 2, -2, 0, 0, 2, -2, 4, 4, -4, 126, -126]);
}

#[test]
fn quantize_activation_errors() {
    let mut out = vec![1u8; 3];
    let e = quant::quantize_activation(GgmlType::Q4_0, &[0.0; 32], &mut out).unwrap_err();
    assert!(matches!(e, QuantError::Unsupported { .. }));
    let e = quant::quantize_activation(GgmlType::Q8_0, &[0.0; 31], &mut out).unwrap_err();
    assert!(matches!(e, QuantError::NotBlockMultiple { .. }));
    // Output is overwritten, not appended to.
    quant::quantize_activation(GgmlType::Q8_0, &[1.0; 64], &mut out).unwrap();
    assert_eq!(out.len(), 68);
}

#[test]
fn vec_dot_types_follow_ggml_cpu() {
    use GgmlType::*;
    let want = [
        (F32, F32),
        (F16, F16),
        (BF16, BF16),
        (Q4_0, Q8_0),
        (Q4_1, Q8_1),
        (Q5_0, Q8_0),
        (Q5_1, Q8_1),
        (Q8_0, Q8_0),
        (Q2K, Q8K),
        (Q3K, Q8K),
        (Q4K, Q8K),
        (Q5K, Q8K),
        (Q6K, Q8K),
        (IQ4NL, Q8_0),
        (IQ4XS, Q8K),
        (MXFP4, Q8_0),
    ];
    for (w, a) in want {
        assert_eq!(quant::vec_dot_type(w), a, "{w}");
        assert!(quant::supports_vec_dot(w));
    }
}

// ------------------------------------------------------------------------------------------
// 3. Dot products

#[test]
fn vec_dot_matches_f64_reference() {
    let m = manifest();
    let act = Act::load(&m);
    for e in m["synthetic"].as_array().unwrap() {
        let t = ty(s(e, "type"));
        let n = num(e, "n") as usize;
        let w = bytes(s(e, "bytes"));
        let vdt = quant::vec_dot_type(t);
        assert_eq!(vdt.name(), s(e, "vec_dot_type"));
        let a = quantized(vdt, &act.x[..n]);
        assert_eq!(a, act.bytes(vdt, n), "{t}: activation bytes");
        let (want, abs) = (num(e, "dot_ref"), num(e, "dot_abs"));
        for simd in Simd::available() {
            let got = quant::vec_dot_with(simd, t, n, &w, &a) as f64;
            let tol = dot_tol(t, n, abs);
            assert!(
                (got - want).abs() <= tol,
                "{t} {simd:?}: got {got}, want {want} (|err| {:e} > tol {tol:e})",
                (got - want).abs()
            );
        }
    }
}

/// Deterministic pseudo-random bytes (xorshift), with sane f16 scales patched in.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.unit()).sum::<f32>() - 2.0
    }
}

fn random_row(rng: &mut Rng, t: GgmlType, n: usize) -> Vec<u8> {
    use GgmlType::*;
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    match t {
        F32 => return (0..n).flat_map(|_| rng.normal().to_le_bytes()).collect(),
        F16 => return (0..n).flat_map(|_| f16(rng.normal())).collect(),
        BF16 => return (0..n).flat_map(|_| ((rng.normal().to_bits() >> 16) as u16).to_le_bytes()).collect(),
        _ => {}
    }
    let scale_offsets: &[usize] = match t {
        Q4_0 | Q5_0 | Q8_0 | IQ4NL | IQ4XS => &[0],
        Q4_1 | Q5_1 | Q4K | Q5K => &[0, 2],
        Q2K => &[80, 82],
        Q3K => &[108],
        Q6K => &[208],
        MXFP4 => &[],
        _ => unreachable!(),
    };
    let (bs, ts) = (t.block_size(), t.type_size());
    let mut v: Vec<u8> = (0..n / bs * ts).map(|_| rng.next() as u8).collect();
    for b in v.chunks_exact_mut(ts) {
        for &o in scale_offsets {
            let sign = if rng.next() & 1 == 0 { 1.0 } else { -1.0 };
            b[o..o + 2].copy_from_slice(&f16(sign * (0.001 + 0.1 * rng.unit())));
        }
        if t == MXFP4 {
            b[0] = 115 + (rng.next() % 20) as u8;
        }
    }
    v
}

#[test]
fn simd_agrees_with_scalar() {
    let levels = Simd::available();
    if levels.len() == 1 {
        eprintln!("only the scalar kernels run on this CPU; nothing to compare");
        return;
    }
    use GgmlType::*;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let types = [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, IQ4NL, IQ4XS, MXFP4];
    let mut checked = 0;
    for t in types {
        let bs = t.block_size();
        // Odd and even block counts (the 32-element kernels unroll by two), float tails.
        let sizes: Vec<usize> = if bs == 1 {
            vec![1, 7, 8, 9, 31, 33, 576, 1000]
        } else {
            [1usize, 2, 3, 5, 8, 18].iter().map(|k| k * bs.max(32)).filter(|n| n % bs == 0).collect()
        };
        for n in sizes {
            for _ in 0..4 {
                let w = random_row(&mut rng, t, n);
                let x: Vec<f32> = (0..n).map(|_| rng.normal() * 3.0).collect();
                let a = quantized(quant::vec_dot_type(t), &x);
                let scalar = quant::vec_dot_with(Simd::Scalar, t, n, &w, &a);
                // Scale of the terms, for a relative tolerance.
                let mut wd = vec![0f32; n];
                quant::dequantize_row(t, &w, &mut wd).unwrap();
                let abs: f64 = wd.iter().zip(&x).map(|(p, q)| (p * q).abs() as f64).sum::<f64>() + 1e-20;
                for &simd in &levels[1..] {
                    let v = quant::vec_dot_with(simd, t, n, &w, &a);
                    if matches!(simd, Simd::Neon | Simd::NeonDotprod) {
                        // The ARM kernels keep the portable code's f32 order (src/quant/neon.rs).
                        assert_eq!(v.to_bits(), scalar.to_bits(), "{t} n={n} {simd:?}: {v} vs scalar {scalar}");
                    }
                    let err = (v as f64 - scalar as f64).abs();
                    assert!(
                        err <= 1e-5 * abs,
                        "{t} n={n} {simd:?}: {v} vs scalar {scalar} (err {err:e}, scale {abs:e})"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 100);
}

/// Batched products' tiles give the single dots' bits: four activation rows (x86 AVX2, Q4_K
/// included; AArch64 NEON; `BatchDot::dot4`) and two weight rows × four activation rows (AArch64 `smmla`,
/// `BatchDot::dot2x4`) only share each block's unpacking and integer products between outputs.
#[test]
fn batch_tiles_equal_single_dots() {
    use GgmlType::*;
    let mut rng = Rng(7);
    let (mut tiled, mut tiled2) = (0, 0);
    for t in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4NL, MXFP4, F32, F16] {
        for n in [32, 96, 512] {
            let w = random_row(&mut rng, t, n);
            let acts: Vec<Vec<u8>> = (0..4)
                .map(|_| quantized(quant::vec_dot_type(t), &(0..n).map(|_| rng.normal() * 3.0).collect::<Vec<_>>()))
                .collect();
            let dot = quant::BatchDot::new(t, n, 2, 4, false, false);
            let w2 = random_row(&mut rng, t, n);
            let acts4 = [&acts[0][..], &acts[1], &acts[2], &acts[3]];
            if let Some(eight) = dot.dot2x4([&w, &w2], acts4, 0) {
                for (i, wr) in [&w, &w2].into_iter().enumerate() {
                    for (k, a) in acts.iter().enumerate() {
                        let one = dot.dot(wr, a, k);
                        assert_eq!(eight[i][k].to_bits(), one.to_bits(), "{t} n={n} 2x4 tile [{i}][{k}]: {} vs single {one}", eight[i][k]);
                    }
                }
                tiled2 += 1;
            }
            let Some(four) = dot.dot4(&w, acts4, 0) else { continue };
            for (k, a) in acts.iter().enumerate() {
                let one = dot.dot(&w, a, k);
                assert_eq!(four[k].to_bits(), one.to_bits(), "{t} n={n} row {k}: tile {} vs single {one}", four[k]);
            }
            tiled += 1;
        }
    }
    // Q4_K: its tile in both batched orders (rows a multiple of 8: ggml's repacked GEMM; other
    // row counts and `mul_mat_id`'s experts: the GEMV), where the CPU has it (x86 AVX2).
    for (rows, experts) in [(8, false), (2, false), (8, true)] {
        for n in [256, 1024] {
            let w = random_row(&mut rng, Q4K, n);
            let acts: Vec<Vec<u8>> = (0..4).map(|_| quantized(quant::vec_dot_type(Q4K), &(0..n).map(|_| rng.normal() * 3.0).collect::<Vec<_>>())).collect();
            let dot = quant::BatchDot::new(Q4K, n, rows, 4, experts, false);
            let Some(four) = dot.dot4(&w, [&acts[0][..], &acts[1], &acts[2], &acts[3]], 0) else { continue };
            for (k, a) in acts.iter().enumerate() {
                let one = dot.dot(&w, a, k);
                assert_eq!(four[k].to_bits(), one.to_bits(), "Q4_K n={n} rows {rows} experts {experts} row {k}: tile {} vs single {one}", four[k]);
            }
            tiled += 1;
        }
    }
    eprintln!("{tiled} four-row tiles and {tiled2} 2x4 tiles compared ({:?})", Simd::best());
}

/// F32 / F16 weights in a prompt-sized product: every output of `FloatGemm::block` (AVX-512
/// tiles of 4 rows × 6 activations where the CPU has them, and the AVX2 path) has the bits of
/// the single tinyBLAS dot `BatchDot::dot`, for row and token counts that leave every partial
/// tile shape.
#[test]
fn float_gemm_blocks_equal_single_dots() {
    use GgmlType::*;
    let mut rng = Rng(11);
    let mut compared = 0;
    for t in [F32, F16] {
        for n in [16, 80, 1152] {
            let (rows, toks) = (9, 13);
            let w: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut rng, t, n)).collect();
            let acts: Vec<Vec<f32>> = (0..toks).map(|_| (0..n).map(|_| rng.normal() * 3.0).collect()).collect();
            // The activations as the weights' dot type holds them (F16: rounded), and widened.
            let bytes: Vec<Vec<u8>> = acts.iter().map(|a| quantized(quant::vec_dot_type(t), a)).collect();
            let wide: Vec<f32> = acts.iter().flat_map(|a| a.iter().map(move |&v| if t == F16 { half::f16::from_f32(v).to_f32() } else { v })).collect();
            let dot = quant::BatchDot::new(t, n, 4 * rows, toks, false, false); // as FloatGemm: a multiple of 4 rows
            let w_row = w.len() / rows;
            let Some(fg) = quant::FloatGemm::new(t, n, 4 * rows, toks, false, false) else { continue };
            for fg in [quant::FloatGemm::new(t, n, 4 * rows, toks, false, false).unwrap(), fg.avx2_only()] {
                for (r_n, t_n) in [(rows, toks), (1, 1), (4, 6), (3, 5), (8, 12), (5, 7)] {
                    let mut got = vec![f32::NAN; r_n * t_n];
                    fg.block(&w[..r_n * w_row], r_n, &wide[..t_n * n], t_n, &mut |r, k, v| got[r * t_n + k] = v);
                    for r in 0..r_n {
                        for k in 0..t_n {
                            let one = dot.dot(&w[r * w_row..(r + 1) * w_row], &bytes[k], k);
                            assert_eq!(got[r * t_n + k].to_bits(), one.to_bits(), "{t} n={n} {r_n}x{t_n} [{r}][{k}]: block {} vs single {one}", got[r * t_n + k]);
                        }
                    }
                    compared += 1;
                }
            }
        }
    }
    eprintln!("{compared} blocks compared ({:?})", Simd::best());
}

/// Every finite and infinite half through each level's F16 dot: eight copies of `h` against
/// eight ones sum to exactly `8 h` (powers of two, no rounding), so any half converted wrongly
/// (subnormals, signed zeros, infinities) shows.
#[test]
fn f16_dot_converts_every_half_exactly() {
    let ones: Vec<u8> = (0..8).flat_map(|_| half::f16::ONE.to_bits().to_le_bytes()).collect();
    for simd in Simd::available() {
        for h in 0..=u16::MAX {
            let v = half::f16::from_bits(h);
            if v.is_nan() {
                continue;
            }
            let w: Vec<u8> = (0..8).flat_map(|_| h.to_le_bytes()).collect();
            let got = quant::vec_dot_with(simd, GgmlType::F16, 8, &w, &ones);
            let want = 8.0 * v.to_f32() + 0.0; // sums start from +0: -0 gives +0
            assert_eq!(got.to_bits(), want.to_bits(), "{simd:?} half {h:#06x}: {got} vs {want}");
        }
    }
}

#[test]
fn matvec_equals_vec_dot_per_row() {
    let mut rng = Rng(42);
    for t in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::F32] {
        let (n, rows) = (512, 7);
        let w = random_row(&mut rng, t, n * rows);
        let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let a = quantized(quant::vec_dot_type(t), &x);
        let rb = t.row_bytes(n as u64).unwrap() as usize;
        for simd in Simd::available() {
            let mut y = vec![f32::NAN; rows];
            quant::matvec_with(simd, t, n, &w, &a, &mut y);
            for (r, yr) in y.iter().enumerate() {
                let d = quant::vec_dot_with(simd, t, n, &w[r * rb..(r + 1) * rb], &a);
                assert_eq!(yr.to_bits(), d.to_bits(), "{t} {simd:?} row {r}");
            }
        }
        let mut y = vec![0f32; rows];
        quant::matvec(t, n, &w, &a, &mut y);
        assert!(y.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn bad_sizes_are_caught() {
    let w = vec![0u8; 20];
    let a = vec![0u8; 35]; // one byte short of a Q8_1 block
    let r = std::panic::catch_unwind(|| quant::vec_dot(GgmlType::Q4_1, 32, &w, &a));
    if cfg!(debug_assertions) {
        assert!(r.is_err(), "debug builds assert on short activations");
    } else {
        assert!(r.unwrap().is_nan(), "release builds return NaN");
    }
    let a = vec![0u8; 36];
    let r = std::panic::catch_unwind(|| {
        let mut y = [0f32; 2];
        quant::matvec(GgmlType::Q4_1, 32, &w, &a, &mut y); // 2 rows but 1 row of weights
        y
    });
    if cfg!(debug_assertions) {
        assert!(r.is_err());
    } else {
        assert!(r.unwrap().iter().all(|v| v.is_nan()));
    }
    // Valid sizes, including zero rows and extra trailing bytes, are fine.
    assert_eq!(quant::vec_dot(GgmlType::Q4_1, 32, &w, &a), 0.0);
    quant::matvec(GgmlType::Q4_1, 32, &w, &a, &mut []);
}

// ------------------------------------------------------------------------------------------
// 4. Real tensors from the test models

fn open_model(name: &str) -> (FileSource, GgufFile) {
    let path: PathBuf = root().join("models").join(name);
    if !Path::new(&path).exists() {
        panic!("model {} is missing: run tools/fetch_models.sh to download the test models", path.display());
    }
    let src = FileSource::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let gguf = GgufFile::read(&src).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (src, gguf)
}

#[test]
fn real_tensor_rows_match_gguf_py() {
    use les::store::ByteSource;
    let m = manifest();
    let act = Act::load(&m);
    let real = m["real"].as_array().unwrap();
    let mut seen = std::collections::HashSet::new();
    for e in real {
        let model = s(e, "model");
        let (src, gguf) = open_model(model);
        let tname = s(e, "tensor");
        let info = gguf.req_tensor(tname).unwrap();
        let t = ty(s(e, "type"));
        assert_eq!(info.ty, t, "{model}:{tname} type");
        seen.insert(t);
        let ne0 = num(e, "ne0") as usize;
        assert_eq!(info.ne0() as usize, ne0);
        let rb = info.row_bytes() as usize;
        let want_all = f32s(s(e, "dequantized"));
        let rows = e["rows"].as_array().unwrap();
        assert_eq!(want_all.len(), rows.len() * ne0);
        let vdt = quant::vec_dot_type(t);
        let a = quantized(vdt, &act.x[..ne0]);
        assert_eq!(a, act.bytes(vdt, ne0), "activation bytes for n = {ne0}");
        let mut block = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            let row = num(r, "row") as u64;
            let w = src.read_vec(info.offset + row * rb as u64, rb).unwrap();
            let mut got = vec![0f32; ne0];
            quant::dequantize_row(t, &w, &mut got).unwrap();
            assert_bits_eq(&format!("{model}:{tname} row {row}"), &got, &want_all[i * ne0..(i + 1) * ne0]);
            let (want, abs) = (num(r, "dot_ref"), num(r, "dot_abs"));
            for simd in Simd::available() {
                let d = quant::vec_dot_with(simd, t, ne0, &w, &a) as f64;
                let tol = dot_tol(t, ne0, abs);
                assert!((d - want).abs() <= tol, "{tname} row {row} {simd:?}: dot {d} vs {want} (tol {tol:e})");
            }
            block.extend_from_slice(&w);
        }
        // The same rows through matvec.
        let mut y = vec![0f32; rows.len()];
        quant::matvec(t, ne0, &block, &a, &mut y);
        for (r, yr) in rows.iter().zip(&y) {
            let want = num(r, "dot_ref");
            assert!((*yr as f64 - want).abs() <= dot_tol(t, ne0, num(r, "dot_abs")), "{tname} matvec");
        }
    }
    for t in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::F32] {
        assert!(seen.contains(&t), "no real tensor of type {t} in the fixtures");
    }
}
