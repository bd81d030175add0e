//! Micro-benchmark of the quantized mat-vec kernels on the real weights of the test models
//! (ignored by default; needs tools/fetch_models.sh):
//!
//!     cargo test --release --test suite -- quant_bench:: --ignored --nocapture
//!
//! For each model it runs, single-threaded, one decode step's worth of mat-vecs: every 2-D
//! weight once (the token embedding too, standing in for the tied output projection), each
//! with a freshly quantized activation, and prints the time per step by weight type and kernel
//! level. `LES_BENCH_ITERS` sets the number of timed steps (default 20).

use les::gguf::GgufFile;
use les::quant::{self, GgmlType, Simd};
use les::store::{ByteSource, FileSource};
use std::collections::BTreeMap;
use std::time::Instant;

struct Mat {
    ty: GgmlType,
    n: usize,
    rows: usize,
    data: Vec<u8>,
}

fn load(name: &str) -> Vec<Mat> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(name);
    assert!(path.exists(), "model {} is missing: run tools/fetch_models.sh", path.display());
    let src = FileSource::open(&path).unwrap();
    let g = GgufFile::read(&src).unwrap();
    g.tensors
        .iter()
        .filter(|t| t.dims.len() >= 2 && quant::supports_vec_dot(t.ty))
        .map(|t| Mat {
            ty: t.ty,
            n: t.ne0() as usize,
            rows: t.n_rows() as usize,
            data: src.read_vec(t.offset, t.size as usize).unwrap(),
        })
        .collect()
}

fn bench(model: &str) {
    let mats = load(model);
    let iters: usize = std::env::var("LES_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let max_n = mats.iter().map(|m| m.n).max().unwrap();
    let x: Vec<f32> = (0..max_n).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.7).collect();
    let max_rows = mats.iter().map(|m| m.rows).max().unwrap();
    let mut y = vec![0f32; max_rows];
    let bytes: usize = mats.iter().map(|m| m.data.len()).sum();
    println!("{model}: {} matrices, {:.1} MB of weights, {iters} steps", mats.len(), bytes as f64 / 1e6);
    // "matvec" is quant::matvec; "vec_dot" calls quant::vec_dot row by row (for comparison).
    for simd in Simd::available() {
        for how in ["matvec", "vec_dot"] {
            let mut by_type: BTreeMap<&str, f64> = BTreeMap::new();
            let mut act = Vec::new();
            for it in 0..iters + 1 {
                for m in &mats {
                    let t0 = Instant::now();
                    quant::quantize_activation(quant::vec_dot_type(m.ty), &x[..m.n], &mut act).unwrap();
                    if how == "matvec" {
                        quant::matvec_with(simd, m.ty, m.n, &m.data, &act, &mut y[..m.rows]);
                    } else {
                        let rb = m.data.len() / m.rows;
                        for (yr, w) in y[..m.rows].iter_mut().zip(m.data.chunks_exact(rb)) {
                            *yr = quant::vec_dot_with(simd, m.ty, m.n, w, &act);
                        }
                    }
                    if it > 0 {
                        *by_type.entry(m.ty.name()).or_default() += t0.elapsed().as_secs_f64();
                    }
                }
                std::hint::black_box(&y);
            }
            let total: f64 = by_type.values().sum::<f64>() / iters as f64;
            let parts: Vec<String> =
                by_type.iter().map(|(k, v)| format!("{k} {:.2} ms", v / iters as f64 * 1e3)).collect();
            println!(
                "  {simd:?} {how}: {:.2} ms per step ({:.1} GB/s): {}",
                total * 1e3,
                bytes as f64 / total / 1e9,
                parts.join(", ")
            );
        }
    }
}

#[test]
#[ignore]
fn bench_matvec_smollm2_q4_1() {
    bench("SmolLM2-135M-Instruct.Q4_1.gguf");
}

#[test]
#[ignore]
fn bench_matvec_gemma3_q4_k_m() {
    bench("gemma-3-270m-q4_k_m.gguf");
}
