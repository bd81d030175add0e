//! Every wgpu kernel against its CPU reference (ggml `test-backend-ops` style), on whatever adapter
//! wgpu finds (lavapipe in CI: `mesa-vulkan-drivers`). Inputs are the committed quantization
//! fixtures (block bytes written by gguf-py, tests/fixtures/quant/) and real SmolLM2 tensors; the
//! expected values come from the CPU backend, which `tests/suite/quant.rs` checks against gguf-py and
//! `tests/suite/reference.rs` against llama.cpp.
//!
//! Set `LES_NO_GPU=1` to skip on a machine without any adapter (never in CI).

use crate::common::WEIGHT_TYPES;
use les::backend::cpu::ops;
use les::backend::wgpu::kernels::{Kernels, List};
use les::backend::wgpu::{block_on, GpuContext, Recorder};
use les::quant::{self, GgmlType};
use std::path::PathBuf;
use std::sync::OnceLock;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Gpu {
    ctx: GpuContext,
    k: Kernels,
}

/// The kernels on the exact path (one thread per matvec row, blocks summed in the CPU's order),
/// in each f16 variant the adapter has: integer-emulated conversions always, native f16 where
/// the device has `shader-f16` (lavapipe does). Every test runs on each.
fn variants() -> &'static [Gpu] {
    static G: OnceLock<Vec<Gpu>> = OnceLock::new();
    G.get_or_init(|| {
        let mut out = Vec::new();
        for f16 in [false, true] {
            match GpuContext::new() {
                Ok(ctx) => {
                    if f16 && !ctx.device.features().contains(wgpu::Features::SHADER_F16) {
                        eprintln!("adapter without shader-f16: the f16 variant is not tested");
                        continue;
                    }
                    if !f16 {
                        eprintln!("{}", ctx.describe());
                    }
                    let mut k = Kernels::with_f16(&ctx, f16);
                    k.max_tpr = 1;
                    k.use_subgroups = false;
                    out.push(Gpu { ctx, k });
                }
                Err(e) => {
                    if std::env::var_os("LES_NO_GPU").is_some() {
                        eprintln!("skipping GPU kernel tests: {e}");
                        return Vec::new();
                    }
                    panic!("{e} (set LES_NO_GPU=1 to skip on a machine without a GPU adapter)");
                }
            }
        }
        out
    })
}

fn gpu() -> Option<&'static Gpu> {
    variants().first()
}

fn f32s(name: &str) -> Vec<f32> {
    let b = std::fs::read(root().join("tests/fixtures/quant").join(name)).unwrap();
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(root().join("tests/fixtures/quant").join(name)).unwrap()
}

fn up(g: &Gpu, b: &[u8]) -> wgpu::Buffer {
    g.ctx.upload("test", b).unwrap()
}

fn upf(g: &Gpu, v: &[f32]) -> wgpu::Buffer {
    up(g, bytemuck::cast_slice(v))
}

fn read(_g: &Gpu, rec: &mut Recorder<'_>, b: &wgpu::Buffer, n: usize) -> Vec<f32> {
    block_on(rec.readback(&[(b, 0, 4 * n as u64)])).unwrap().remove(0)
}

fn read_bytes(g: &Gpu, rec: &mut Recorder<'_>, b: &wgpu::Buffer, n: usize) -> Vec<u8> {
    let w = read(g, rec, b, n.div_ceil(4));
    let mut v: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    v.truncate(n);
    v
}

/// GPU matvec of `rows` x `cols` weights `w` (type `ty`) with `n_tok` f32 activation rows `x`,
/// against the CPU's `quant::vec_dot` on the same converted activations. Returns max |Δ| relative
/// to the row's sum of |w·x| terms.
fn check_matvec(g: &Gpu, arena: &wgpu::Buffer, what: &str, ty: GgmlType, w: &[u8], cols: usize, rows: usize, x: &[f32], n_tok: usize) -> f64 {
    let exact = g.k.max_tpr == 1;
    let vty = quant::vec_dot_type(ty);
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let ab = vty.row_bytes(cols as u64).unwrap() as usize;
    let mut acts = Vec::new();
    let mut tmp = Vec::new();
    for t in 0..n_tok {
        quant::quantize_activation(vty, &x[t * cols..(t + 1) * cols], &mut tmp).unwrap();
        acts.extend_from_slice(&tmp);
    }
    let (wb, abuf) = (up(g, &w[..rows * rb]), up(g, &acts));
    let y = g.ctx.scratch("y", 4 * rows * n_tok).unwrap();
    let mut rec = Recorder::new(&g.ctx, arena);
    g.k.matvec(&mut rec, ty, cols, rows, &wb, 0, &abuf, 0, &y, 0, rows, n_tok).unwrap();
    let got = read(g, &mut rec, &y, rows * n_tok);
    let mut wrow = vec![0f32; cols];
    let mut worst = 0f64;
    for t in 0..n_tok {
        for r in 0..rows {
            let want = quant::vec_dot_with(quant::Simd::Scalar, ty, cols, &w[r * rb..(r + 1) * rb], &acts[t * ab..(t + 1) * ab]);
            if exact {
                assert_eq!(got[t * rows + r].to_bits(), want.to_bits(), "{what} {ty:?} row {r} token {t}: gpu {} cpu {want}", got[t * rows + r]);
            }
            quant::dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut wrow).unwrap();
            let scale: f64 = wrow.iter().zip(&x[t * cols..]).map(|(a, b)| (a * b).abs() as f64).sum::<f64>().max(1e-6);
            let d = (got[t * rows + r] - want).abs() as f64 / scale;
            assert!(d < 1e-5, "{what} {ty:?} row {r} token {t}: gpu {} cpu {want} (rel {d:e})", got[t * rows + r]);
            worst = worst.max(d);
        }
    }
    worst
}

#[test]
fn matvec_every_type_matches_cpu() {
    for g in variants() {
        eprintln!("f16 variant: {}", g.k.uses_f16());
        // Each test records with its own parameter arena (tests run in parallel on one device).
        let arena = Recorder::arena_buffer(&g.ctx);
        let x = f32s("act_x.f32");
        let mut done = Vec::new();
        for ty in WEIGHT_TYPES {
            let w = fixture(&format!("weights_{}.bin", ty.name()));
            // 1024 elements: as 2 rows of 512 (two K-quant super-blocks or 16 small blocks per row),
            // times 4 activation rows.
            let worst = check_matvec(g, &arena, "synthetic", ty, &w, 512, 2, &x, 4);
            done.push(format!("{}: {worst:.1e}", ty.name()));
        }
        eprintln!("max relative |gpu - cpu| per type: {}", done.join(", "));
    }
}

/// The matvec reductions real GPUs use (several threads per row: shared-memory tree, and
/// subgroupAdd where the adapter has subgroups) against the CPU, forced on this adapter.
#[test]
fn matvec_reduction_variants_match_cpu() {
    let Some(g0) = gpu() else { return };
    let x = f32s("act_x.f32");
    for (tpr, subgroups) in [(8, false), (64, false), (64, true)] {
        if subgroups && !g0.ctx.device.features().contains(wgpu::Features::SUBGROUP) {
            eprintln!("adapter without subgroups: skipping that variant");
            continue;
        }
        let ctx = GpuContext::new().unwrap();
        let mut k = Kernels::new(&ctx);
        k.max_tpr = tpr;
        k.use_subgroups = subgroups;
        let g = Gpu { ctx, k };
        let arena = Recorder::arena_buffer(&g.ctx);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::F16, GgmlType::F32] {
            let w = fixture(&format!("weights_{}.bin", ty.name()));
            let worst = check_matvec(&g, &arena, "variant", ty, &w, 512, 2, &x, 4);
            eprintln!("tpr {tpr} subgroups {subgroups} {}: {worst:.1e}", ty.name());
        }
    }
}

#[test]
fn matvec_real_smollm2_tensors_match_cpu() {
    for g in variants() {
        eprintln!("f16 variant: {}", g.k.uses_f16());
        // Each test records with its own parameter arena (tests run in parallel on one device).
        let arena = Recorder::arena_buffer(&g.ctx);
        let path = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let src = les::store::FileSource::open(&path).unwrap_or_else(|e| panic!("{}: {e} (run tools/fetch_models.sh)", path.display()));
        let gg = les::gguf::GgufFile::read(&src).unwrap();
        let x = f32s("act_x.f32");
        for (name, rows) in [("blk.0.ffn_down.weight", 576), ("blk.0.attn_q.weight", 576), ("token_embd.weight", 256)] {
            let t = gg.tensor(name).unwrap();
            let cols = t.dims[0] as usize;
            let rb = t.ty.row_bytes(cols as u64).unwrap() as usize;
            let data = les::store::ByteSource::read_vec(&src, t.offset, rows * rb).unwrap();
            let xs: Vec<f32> = x.iter().cycle().take(cols * 2).copied().collect();
            let worst = check_matvec(g, &arena, name, t.ty, &data, cols, rows, &xs, 2);
            eprintln!("{name} ({:?}, {rows} x {cols}): max relative |gpu - cpu| {worst:.1e}", t.ty);
        }
    }
}

#[test]
fn activation_quantization_is_byte_exact() {
    for g in variants() {
        eprintln!("f16 variant: {}", g.k.uses_f16());
        // Each test records with its own parameter arena (tests run in parallel on one device).
        let arena = Recorder::arena_buffer(&g.ctx);
        let x = f32s("act_x.f32");
        let (cols, n_tok) = (512, 4);
        let xb = upf(g, &x[..cols * n_tok]);
        for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K, GgmlType::F16, GgmlType::BF16] {
            let row = ty.row_bytes(cols as u64).unwrap() as usize;
            let mut want = Vec::new();
            let mut tmp = Vec::new();
            for t in 0..n_tok {
                quant::quantize_activation(ty, &x[t * cols..(t + 1) * cols], &mut tmp).unwrap();
                want.extend_from_slice(&tmp);
            }
            let o = g.ctx.scratch("o", row * n_tok).unwrap();
            let mut rec = Recorder::new(&g.ctx, &arena);
            g.k.quant_act(&mut rec, ty, &xb, 0, cols, n_tok, &o, 0).unwrap();
            let got = read_bytes(g, &mut rec, &o, row * n_tok);
            let diff = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(diff, 0, "{ty:?}: {diff} of {} bytes differ from the CPU's quantize_activation", want.len());
        }
    }
}

#[test]
fn rms_norm_matches_cpu() {
    for g in variants() {
        eprintln!("f16 variant: {}", g.k.uses_f16());
        // Each test records with its own parameter arena (tests run in parallel on one device).
        let arena = Recorder::arena_buffer(&g.ctx);
        let x = f32s("act_x.f32");
        let (n, rows) = (576, 3);
        let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let (xb, wb) = (upf(g, &x[..n * rows]), upf(g, &w));
        let y = g.ctx.scratch("y", 4 * n * rows).unwrap();
        let mut rec = Recorder::new(&g.ctx, &arena);
        g.k.rms_norm(&mut rec, &xb, 0, &wb, n, rows, 1e-5, Some((&y, 0)));
        let got = read(g, &mut rec, &y, n * rows);
        // In place over groups (Q/K norm): 64-value groups.
        g.k.rms_norm(&mut rec, &xb, 0, &wb, 64, n * rows / 64, 1e-6, None);
        let got_in = read(g, &mut rec, &xb, n * rows);
        let mut want = vec![0f32; n];
        for r in 0..rows {
            ops::rms_norm(&x[r * n..(r + 1) * n], &w, 1e-5, &mut want);
            for i in 0..n {
                assert_eq!(got[r * n + i].to_bits(), want[i].to_bits(), "row {r} [{i}]: {} vs {}", got[r * n + i], want[i]);
            }
        }
        let mut grp = x[..n * rows].to_vec();
        ops::rms_norm_groups(&mut grp, &w[..64], 1e-6);
        for (i, (a, b)) in got_in.iter().zip(&grp).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "group norm [{i}]: {a} vs {b}");
        }
    }
}

#[test]
fn rope_matches_cpu_both_modes() {
    for g in variants() {
        eprintln!("f16 variant: {}", g.k.uses_f16());
        // Each test records with its own parameter arena (tests run in parallel on one device).
        let arena = Recorder::arena_buffer(&g.ctx);
        let x = f32s("act_x.f32");
        let (n_head, hd, n_rot, n_tok, pos0) = (4, 64, 64, 3, 1000);
        let n = n_head * hd;
        let mut cs = Vec::new();
        let mut one = Vec::new();
        for t in 0..n_tok {
            ops::rope_cache(pos0 + t, n_rot, 10000.0, &mut one);
            cs.extend_from_slice(&one);
        }
        let csb = upf(g, &cs);
        for kind in [les::backend::rope::RopeKind::Norm, les::backend::rope::RopeKind::Neox] {
            let xb = upf(g, &x[..n * n_tok]);
            let mut rec = Recorder::new(&g.ctx, &arena);
            g.k.rope(&mut rec, &xb, 0, &csb, n_head, hd, n_rot, kind == les::backend::rope::RopeKind::Neox, n_tok);
            let got = read(g, &mut rec, &xb, n * n_tok);
            for t in 0..n_tok {
                let mut want = x[t * n..(t + 1) * n].to_vec();
                ops::rope(&mut want, hd, n_rot, kind, &cs[t * n_rot..(t + 1) * n_rot]);
                for i in 0..n {
                    assert_eq!(got[t * n + i].to_bits(), want[i].to_bits(), "{kind:?} t{t} [{i}]: {} vs {}", got[t * n + i], want[i]);
                }
            }
        }
    }
}

#[test]
fn kv_store_and_attention_match_cpu() {
    for g in variants() {
        eprintln!("f16 variant: {}", g.k.uses_f16());
        // Each test records with its own parameter arena (tests run in parallel on one device).
        let arena = Recorder::arena_buffer(&g.ctx);
        // Head sizes: a multiple of 64 (f32 lanes), 32 (all in the CPU's f64 tail), 96 (both).
        for hd in [64, 32, 96] {
            attention_case(g, &arena, hd);
        }
    }
}

fn attention_case(g: &Gpu, arena: &wgpu::Buffer, hd: usize) {
    let x: Vec<f32> = f32s("act_x.f32").iter().cycle().take(8192).copied().collect();
    let (n_head, n_head_kv, n_ctx, n_layer) = (6, 2, 16, 2);
    let nkv = n_head_kv * hd;
    let layer = 1;
    // 12 positions of keys/values, written in two batches (8 then 4), then 4 queries at 8..12.
    let kvals: Vec<f32> = x.iter().take(12 * nkv).map(|v| v * 0.7).collect();
    let vvals: Vec<f32> = x.iter().rev().take(12 * nkv).copied().collect();
    // Two slots of n_ctx cells (the test writes the second), then a ring of 8 cells for a
    // sliding-window layer (position p in cell p mod 8: after 12 positions it holds 4..12).
    let ring = 8;
    let slot_words = n_head_kv * n_ctx * hd / 2;
    let ring_off = n_layer * slot_words;
    let words = ring_off + n_head_kv * ring * hd / 2;
    let kc = g.ctx.scratch("kc", 4 * words).unwrap();
    let vc = g.ctx.scratch("vc", 4 * words).unwrap();
    let mut rec = Recorder::new(&g.ctx, arena);
    for (p0, n) in [(0usize, 8usize), (8, 4)] {
        let kb = upf(g, &kvals[p0 * nkv..(p0 + n) * nkv]);
        let vb = upf(g, &vvals[p0 * nkv..(p0 + n) * nkv]);
        g.k.kv_store(&mut rec, &kb, &vb, &kc, &vc, n_head_kv, hd, n_ctx, layer * slot_words, p0, n);
        g.k.kv_store(&mut rec, &kb, &vb, &kc, &vc, n_head_kv, hd, ring, ring_off, p0, n);
        rec.submit();
    }
    // The cache holds the CPU's f16 rounding of every value.
    let mut cpu = les::model::KvCache::new(n_layer, n_ctx, n_head_kv, hd);
    for p in 0..12 {
        cpu.store(layer, p, &kvals[p * nkv..(p + 1) * nkv], &vvals[p * nkv..(p + 1) * nkv]);
    }
    let got_k = read_bytes(g, &mut rec, &kc, 4 * words);
    for h in 0..n_head_kv {
        let (kr, _) = cpu.head(layer, h, 12);
        for (i, v) in kr.iter().enumerate() {
            let at = (((layer * n_head_kv + h) * n_ctx) * hd + i) * 2;
            assert_eq!(u16::from_le_bytes([got_k[at], got_k[at + 1]]), v.to_bits(), "K head {h} [{i}]");
            // The ring: position i / hd (≥ 4) in cell (i / hd) mod 8.
            let (p, d) = (i / hd, i % hd);
            if p >= 12 - ring {
                let at = (ring_off * 2 + (h * ring + p % ring) * hd + d) * 2;
                assert_eq!(u16::from_le_bytes([got_k[at], got_k[at + 1]]), v.to_bits(), "ring K head {h} position {p} [{d}]");
            }
        }
    }
    let n_tok = 4;
    let pos0 = 8;
    let q: Vec<f32> = x.iter().skip(100).take(n_tok * n_head * hd).copied().collect();
    let qb = upf(g, &q);
    let o = g.ctx.scratch("o", 4 * n_tok * n_head * hd).unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    let sc = g.ctx.scratch("scores", 4 * n_tok * n_head * (pos0 + n_tok + 1)).unwrap();
    // Plain causal attention; then gpt-oss's: a sliding window of 5 and one sink logit per head
    // (above every score for some heads, below for others).
    let sinks = [3.0f32, -2.0, 0.5, 10.0, -10.0, 1.0];
    let sb = upf(g, &sinks);
    let mut worst = 0f32;
    // The window of 5 also on the ring (queries 8..12 see positions 4..12).
    for (window, sink, (cells, off)) in [(0usize, false, (n_ctx, layer * slot_words)), (5, true, (n_ctx, layer * slot_words)), (5, true, (ring, ring_off))] {
        g.k.attention(&mut rec, &qb, &kc, &vc, &o, &sc, n_head, n_head_kv, hd, cells, off, pos0, n_tok, scale, window, sink.then_some(&sb));
        let got = read(g, &mut rec, &o, n_tok * n_head * hd);
        for t in 0..n_tok {
            for h in 0..n_head {
                let n_kv = pos0 + t + 1;
                let (kr, vr) = cpu.head(layer, h / (n_head / n_head_kv), n_kv);
                let mut want = vec![0f32; hd];
                let qh = &q[(t * n_head + h) * hd..(t * n_head + h + 1) * hd];
                let lo = if window > 0 { n_kv.saturating_sub(window) } else { 0 };
                ops::attend_head_ext(qh, kr, vr, hd, lo..n_kv, sink.then_some(sinks[h]), scale, &mut want, &mut Vec::new(), &mut Vec::new());
                for i in 0..hd {
                    let d = (got[(t * n_head + h) * hd + i] - want[i]).abs();
                    worst = worst.max(d);
                    assert_eq!(got[(t * n_head + h) * hd + i].to_bits(), want[i].to_bits(), "head_dim {hd} window {window} cells {cells} t{t} h{h} [{i}]: {} vs {}", got[(t * n_head + h) * hd + i], want[i]);
                }
            }
        }
    }
    eprintln!("attention (head_dim {hd}) max |gpu - cpu| = {worst:e}");
}

#[test]
fn elementwise_kernels_match_cpu() {
    for g in variants() {
        eprintln!("f16 variant: {}", g.k.uses_f16());
        // Each test records with its own parameter arena (tests run in parallel on one device).
        let arena = Recorder::arena_buffer(&g.ctx);
        let x = f32s("act_x.f32");
        let n = 256;
        let (a, b) = (&x[..n], &x[n..2 * n]);
        let (ab, bb) = (upf(g, a), upf(g, b));
        let y = g.ctx.scratch("y", 4 * 4 * n).unwrap();
        let mut rec = Recorder::new(&g.ctx, &arena);
        // swiglu: ggml_expf is ported op for op; WGSL allows division 2.5 ulp from exact, so a few ulp.
        g.k.swiglu(&mut rec, &ab, &bb, &y, n);
        let got = read(g, &mut rec, &y, n);
        let mut want = vec![0f32; n];
        ops::swiglu(a, b, &mut want);
        let ulps = got.iter().zip(&want).map(|(p, q)| if p == q { 0 } else { (p.to_bits() as i64 - q.to_bits() as i64).abs() }).max().unwrap();
        assert_eq!(ulps, 0, "swiglu differs from the CPU by {ulps} ulp");
        // swiglu_oai (gpt-oss) on inputs scaled so that both clamps (±7) are reached.
        let (a8, b8): (Vec<f32>, Vec<f32>) = (a.iter().map(|v| v * 40.0).collect(), b.iter().map(|v| v * 40.0).collect());
        assert!(a8.iter().any(|&v| v > 7.0) && b8.iter().any(|&v| v < -7.0), "the inputs reach the clamps");
        let (a8b, b8b) = (upf(g, &a8), upf(g, &b8));
        g.k.glu(&mut rec, &a8b, &b8b, 0, &y, n, les::backend::ops::ExpertAct::SwigluOai { alpha: 1.702, limit: 7.0 });
        let got = read(g, &mut rec, &y, n);
        ops::swiglu_oai(&a8, &b8, &mut want, 1.702, 7.0);
        for i in 0..n {
            assert_eq!(got[i].to_bits(), want[i].to_bits(), "swiglu_oai [{i}]: {} vs {}", got[i], want[i]);
        }
        // reglu (smallthinker): gates of both signs and zeros.
        let mut az = a8.clone();
        az[..8].fill(0.0);
        let azb = upf(g, &az);
        g.k.glu(&mut rec, &azb, &b8b, 0, &y, n, les::backend::ops::ExpertAct::Relu);
        let got = read(g, &mut rec, &y, n);
        ops::reglu(&az, &b8, &mut want);
        for i in 0..n {
            assert_eq!(got[i].to_bits(), want[i].to_bits(), "reglu [{i}]: {} vs {}", got[i], want[i]);
        }
        // add (with a period: a bias over 4 rows).
        let yb = upf(g, &x[..4 * n]);
        g.k.add(&mut rec, &bb, 0, &yb, 0, 4 * n, n);
        let got = read(g, &mut rec, &yb, 4 * n);
        for i in 0..4 * n {
            assert_eq!(got[i], x[i] + b[i % n], "add [{i}]");
        }
        // gather rows 3, 0 of a 4-row matrix; scatter them back weighted into rows 1, 2.
        let m = upf(g, &x[..4 * n]);
        let gy = g.ctx.scratch("gy", 4 * 2 * n).unwrap();
        g.k.gather(&mut rec, &m, &gy, n, &[3, 0]).unwrap();
        let sy = g.ctx.scratch("sy", 4 * 4 * n).unwrap();
        g.k.scatter(&mut rec, &gy, &sy, n, &[1, 2], &[0.25, -2.0]).unwrap();
        let got = read(g, &mut rec, &sy, 4 * n);
        for i in 0..n {
            assert_eq!(got[i], 0.0);
            assert_eq!(got[n + i], x[3 * n + i] * 0.25);
            assert_eq!(got[2 * n + i], x[i] * -2.0);
        }
        // combine: 2 tokens x 3 ranks, summed in rank order.
        let per = upf(g, &x[..6 * n]);
        let cy = g.ctx.scratch("cy", 4 * 2 * n).unwrap();
        g.k.combine(&mut rec, &per, &cy, n, 2, 3);
        let got = read(g, &mut rec, &cy, 2 * n);
        for t in 0..2 {
            for i in 0..n {
                let want = (x[(3 * t) * n + i] + x[(3 * t + 1) * n + i]) + x[(3 * t + 2) * n + i];
                assert_eq!(got[t * n + i], want, "combine t{t} [{i}]");
            }
        }
        // gate_add: y += x * sigmoid(g) per token.
        let gb = upf(g, &[0.3, -1.7]);
        let yy = upf(g, &x[..2 * n]);
        g.k.gate_add(&mut rec, &per, &gb, &yy, n, 2, false);
        let got = read(g, &mut rec, &yy, 2 * n);
        for t in 0..2 {
            let s = ops::sigmoid([0.3f32, -1.7][t]);
            for i in 0..n {
                let want = x[t * n + i] + x[t * n + i] * s;
                assert_eq!(got[t * n + i].to_bits(), want.to_bits(), "gate_add t{t} [{i}]: {} vs {want}", got[t * n + i]);
            }
        }
    }
}

/// glibc's expf emulated in double-f32 (exact.wgsl; attention's softmax and the qwen2moe gate use
/// it) against the CPU's port of glibc (`cmath::expf`, itself checked against the C library):
/// 1M inputs spread over the whole range where e^x is neither 0 nor inf, plus the edges.
#[test]
fn expf_matches_glibc() {
    for g in variants() {
        eprintln!("f16 variant: {}", g.k.uses_f16());
        let arena = Recorder::arena_buffer(&g.ctx);
        let n = 1 << 20;
        let mut x: Vec<f32> = (0..n).map(|i| -104.0 + 193.0 * (i as f32 / n as f32)).collect();
        // Small and attention-like arguments (s - m <= 0), and the edges of the range.
        for (i, v) in x.iter_mut().enumerate().take(n / 4) {
            *v = -(i as f32) * 3.1e-5;
        }
        x.extend_from_slice(&[0.0, -0.0, 1e-30, -1e-30, 88.72283, 88.72284, -103.97207, -103.97208, -87.33654, -87.3366]);
        let xb = upf(g, &x);
        let y = g.ctx.scratch("y", 4 * x.len()).unwrap();
        let mut rec = Recorder::new(&g.ctx, &arena);
        g.k.expf(&mut rec, &xb, &y, x.len());
        let got = read(g, &mut rec, &y, x.len());
        let bad: Vec<(f32, f32, f32)> = x.iter().zip(&got).filter(|(v, e)| e.to_bits() != les::backend::cpu::cmath::expf(**v).to_bits()).map(|(v, e)| (*v, *e, les::backend::cpu::cmath::expf(*v))).collect();
        assert!(bad.is_empty(), "{} of {} differ, e.g. {:?}", bad.len(), x.len(), &bad[..bad.len().min(5)]);
    }
}

/// f32 -> f16 conversion in both variants (integer emulation; the hardware's f16 type) against the
/// CPU's `half::f16::from_f32`: every finite half, the ties between neighbours (to even), just
/// above and below each tie, and values past the largest half (to infinity), through the F16
/// activation conversion.
#[test]
fn f16_conversion_rounds_to_nearest_even() {
    for g in variants() {
        let arena = Recorder::arena_buffer(&g.ctx);
        let mut x = Vec::new();
        for h in 0u16..0x7c00 {
            for sign in [1.0f32, -1.0] {
                let a = half::f16::from_bits(h).to_f32();
                let b = half::f16::from_bits(h + 1).to_f32();
                let mid = (a + b) / 2.0; // exact in f32
                x.extend_from_slice(&[sign * a, sign * mid, sign * f32::from_bits(mid.to_bits() + 1), sign * f32::from_bits(mid.to_bits() - 1)]);
            }
        }
        x.extend_from_slice(&[65504.0, 65519.99, 65520.0, 1e6, -65520.0, -1e30, 0.0, -0.0]);
        let cols = 1024;
        x.resize(x.len().div_ceil(cols) * cols, 0.0);
        let n_tok = x.len() / cols;
        let xb = upf(g, &x);
        let o = g.ctx.scratch("o", 2 * x.len()).unwrap();
        let mut rec = Recorder::new(&g.ctx, &arena);
        g.k.quant_act(&mut rec, GgmlType::F16, &xb, 0, cols, n_tok, &o, 0).unwrap();
        let got = read_bytes(g, &mut rec, &o, 2 * x.len());
        let bad: Vec<(f32, u16, u16)> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| (v, u16::from_le_bytes([got[2 * i], got[2 * i + 1]]), half::f16::from_f32(v).to_bits()))
            .filter(|(_, a, b)| a != b)
            .collect();
        assert!(bad.is_empty(), "f16 variant {}: {} of {} conversions differ, e.g. {:?}", g.k.uses_f16(), bad.len(), x.len(), &bad[..bad.len().min(5)]);
    }
}

/// The decode token's expert kernels (issue 55): `matvec_id` (ggml `mul_mat_id`: experts' slots
/// at byte offsets of one slab, each into its own output row, from one shared activation row or
/// one row each) equals the CPU's `vec_dot` bit for bit on every weight type; `add_rows` (ggml
/// `add_id`) and `combine_w` (the weighted sum in rank order, each product rounded first) equal
/// the CPU's f32 arithmetic.
#[test]
fn matvec_id_add_rows_and_combine_w_match_cpu() {
    for g in variants() {
        let arena = Recorder::arena_buffer(&g.ctx);
        let x = f32s("act_x.f32");
        let (cols, rows) = (512, 2);
        for ty in WEIGHT_TYPES {
            let w = fixture(&format!("weights_{}.bin", ty.name()));
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            let vty = quant::vec_dot_type(ty);
            let ab = vty.row_bytes(cols as u64).unwrap() as usize;
            // A slab of two slots: slot 0 holds rows (0, 1), slot 1 rows (1, 0), each at a 4-byte
            // aligned offset after 8 bytes of padding.
            let slot = (2 * rb).div_ceil(4) * 4;
            let mut slab = vec![0u8; 8 + 2 * slot];
            slab[8..8 + 2 * rb].copy_from_slice(&w[..2 * rb]);
            slab[8 + slot..8 + slot + rb].copy_from_slice(&w[rb..2 * rb]);
            slab[8 + slot + rb..8 + slot + 2 * rb].copy_from_slice(&w[..rb]);
            let mut acts = Vec::new();
            let mut tmp = Vec::new();
            for t in 0..3 {
                quant::quantize_activation(vty, &x[t * cols..(t + 1) * cols], &mut tmp).unwrap();
                acts.extend_from_slice(&tmp);
            }
            let (sb, abuf) = (up(g, &slab), up(g, &acts));
            let y = g.ctx.scratch("y", 4 * rows * 3).unwrap();
            let mut rec = Recorder::new(&g.ctx, &arena);
            let cpu = |wrow: &[u8], t: usize| quant::vec_dot_with(quant::Simd::Scalar, ty, cols, wrow, &acts[t * ab..(t + 1) * ab]);
            // Shared activation row 0: slot 1 into output row 0, slot 0 into output row 2.
            g.k.matvec_id(&mut rec, ty, cols, rows, &sb, 8, &abuf, false, &y, 0, rows, List::Host(&[slot as u32, 0, 0, 2]), 2).unwrap();
            let got = read(g, &mut rec, &y, rows * 3);
            let want = [cpu(&w[rb..2 * rb], 0), cpu(&w[..rb], 0), got[2], got[3], cpu(&w[..rb], 0), cpu(&w[rb..2 * rb], 0)];
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty:?} shared row, output {i}: gpu {a} cpu {b}");
            }
            // One activation row each (a decode token's down projection: row = rank).
            g.k.matvec_id(&mut rec, ty, cols, rows, &sb, 8, &abuf, true, &y, 0, rows, List::Host(&[0, 1, slot as u32, 2]), 2).unwrap();
            let got = read(g, &mut rec, &y, rows * 3);
            let want = [cpu(&w[..rb], 1), cpu(&w[rb..2 * rb], 1), cpu(&w[rb..2 * rb], 2), cpu(&w[..rb], 2)];
            for (i, (a, b)) in got[2..].iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty:?} row per expert, output {}: gpu {a} cpu {b}", i + 2);
            }
        }
        let n = 64;
        let mut rec = Recorder::new(&g.ctx, &arena);
        // add_rows: bias rows 2 and 0 of a 3-row bias into rows 1 and 0.
        let (bias, yb) = (upf(g, &x[..3 * n]), upf(g, &x[3 * n..5 * n]));
        g.k.add_rows(&mut rec, &bias, &yb, 0, n, List::Host(&[1, 2, 0, 0]), 2).unwrap();
        let got = read(g, &mut rec, &yb, 2 * n);
        for i in 0..n {
            assert_eq!(got[i], x[3 * n + i] + x[i], "add_rows row 0 [{i}]");
            assert_eq!(got[n + i], x[4 * n + i] + x[2 * n + i], "add_rows row 1 [{i}]");
        }
        // combine_w over 3 ranks.
        let wts = [0.25f32, -2.0, 1.5];
        let (per, cy) = (upf(g, &x[..3 * n]), g.ctx.scratch("cy", 4 * n).unwrap());
        g.k.combine_w(&mut rec, &per, &cy, n, List::Host(&wts.map(f32::to_bits)), 3).unwrap();
        let got = read(g, &mut rec, &cy, n);
        for i in 0..n {
            let want = (x[i] * wts[0] + x[n + i] * wts[1]) + x[2 * n + i] * wts[2];
            assert_eq!(got[i].to_bits(), want.to_bits(), "combine_w [{i}]");
        }
    }
}

/// The router on the device (shaders/route.wgsl, issue 55 item 3) equals the host's
/// `model::route_with` bit for bit: softmax (f64 sums and reciprocal emulated in integers; blocks
/// of 16 plus a tail), top-k with ties to the lower index, norm_topk, gpt-oss's top-k then
/// softmax, the weight scale; and it lists each chosen expert's slot from the slot table.
#[test]
fn route_matches_cpu_router() {
    use les::backend::ops::RouteSpec;
    let x = f32s("act_x.f32");
    for g in variants() {
        let arena = Recorder::arena_buffer(&g.ctx);
        let mut cases = 0;
        for (n_expert, k) in [(8usize, 2usize), (32, 2), (60, 4), (64, 8), (128, 8), (256, 8), (40, 1)] {
            use les::backend::ops::Gating;
            for (gating, norm_topk, scale) in [(Gating::Softmax, true, 1.0f32), (Gating::Softmax, false, 0.0), (Gating::SoftmaxWeight, false, 1.0), (Gating::Softmax, true, 2.5), (Gating::Sigmoid, true, 1.0)] {
                for variant in 0..4 {
                    // Logits: activations at three scales, and rows with ties (equal maxima).
                    let mut row: Vec<f32> = (0..n_expert).map(|i| x[(i * 7 + variant * 131) % x.len()] * [1.0, 8.0, 40.0, 3.0][variant]).collect();
                    if variant == 3 {
                        for i in (0..n_expert).step_by(3) {
                            row[i] = 0.75;
                        }
                    }
                    let spec = RouteSpec { n_expert, k, gating, norm_topk, scale };
                    // A selection bias (lfm2moe's `exp_probs_b`) on the sigmoid router's odd variants.
                    let bias: Option<Vec<f32>> = (gating == Gating::Sigmoid && variant % 2 == 1).then(|| (0..n_expert).map(|i| x[(i * 11 + 5) % x.len()] * 0.05).collect());
                    let (sel, wts) = les::model::route_biased(&spec, &row, 1, bias.as_deref());
                    let slots: Vec<u32> = (0..n_expert as u32).map(|e| if e % 5 == 4 { u32::MAX } else { 4096 * e + 8 }).collect();
                    let (lb, sb) = (upf(g, &row), up(g, bytemuck::cast_slice(&slots)));
                    let out = g.ctx.scratch("route", 4 * 128).unwrap();
                    let mut rec = Recorder::new(&g.ctx, &arena);
                    let bb = bias.as_ref().map(|b| upf(g, b));
                    g.k.route(&mut rec, &lb, 0, &sb, 0, &out, 32, &spec, 100, bb.as_ref());
                    let got: Vec<u32> = read(g, &mut rec, &out, 128).iter().map(|v| v.to_bits()).collect();
                    let r = &got[32..];
                    let at = format!("n_expert {n_expert} k {k} gating {gating:?} bias {} norm {norm_topk} scale {scale} variant {variant}", bias.is_some());
                    let mut missing = 0;
                    for j in 0..k {
                        let ex = sel[j] as usize;
                        let slot = if slots[ex] == u32::MAX { missing = 1; 0 } else { slots[ex] };
                        assert_eq!(r[7 * k + j], sel[j], "{at}: expert of rank {j}");
                        assert_eq!(r[4 * k + j], wts[j].to_bits(), "{at}: weight of rank {j}: gpu {} cpu {}", f32::from_bits(r[4 * k + j]), wts[j]);
                        assert_eq!((r[2 * j], r[2 * j + 1]), (slot, j as u32), "{at}: list entry {j}");
                        assert_eq!((r[2 * k + 2 * j], r[2 * k + 2 * j + 1]), (slot + 100, (k + j) as u32), "{at}: up entry {j}");
                        assert_eq!((r[5 * k + 2 * j], r[5 * k + 2 * j + 1]), (j as u32, sel[j]), "{at}: bias pair {j}");
                    }
                    assert_eq!(r[8 * k], missing, "{at}: the no-slot flag");
                    cases += 1;
                }
            }
        }
        eprintln!("route: {cases} cases equal to the host's router");
    }
}
