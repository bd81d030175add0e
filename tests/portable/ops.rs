//! The op contract (`les::backend::ops::Ops`) on every backend, against the CPU backend — ggml's
//! `test-backend-ops` for LES. Each case is written once, generic over the backend, and run on
//! the CPU (the reference: its kernels are checked against gguf-py in `tests/suite/quant.rs` and
//! against llama.cpp in `tests/suite/reference.rs`) and on the wgpu backend's exact path (tolerance 0:
//! bit-identical) and fast path (several threads per matvec row: relative tolerance 1e-5).
//! The CPU runs its portable kernels (`Simd::Scalar`, the orders the exact path reproduces).
//!
//! Inputs: weight blocks written by gguf-py (`tests/fixtures/quant/weights_<TYPE>.bin`, 2 rows ×
//! 512) and activation rows (`act_x.f32`); small expert blocks are quantized here.
//!
//! `docs/ops.md` is the op × backend table these cases produce; `ops_table_is_current` fails
//! when it drifts (`LES_WRITE_OPS_DOC=1 cargo test --profile ci --test portable -- ops::` rewrites it).
//! Set `LES_NO_GPU=1` to skip the GPU columns on a machine without any adapter (never in CI).

use crate::common::WEIGHT_TYPES as TYPES;
use les::backend::cpu::exec::CpuExec;
use les::backend::cpu::kv::KvCache;
use les::backend::cpu::matmul::Weight;
use les::backend::ops::{ready, Attn, ExpertAct, ExpertFfn, Gelu, Mat, OpError, Ops, Rope, RopeKind, Route, SelfAttn, Vector, Weights, Yarn};
use les::backend::wgpu::exec::{GpuBackend, GpuOptions, GpuShapes};
use les::backend::wgpu::{block_on, GpuContext};
use les::expert::{ExpertBlock, ExpertError, ExpertLayout, ExpertSource};
use les::quant::{self, GgmlType};
use std::sync::{Arc, Mutex, OnceLock};

use crate::common::root;

fn f32s(name: &str) -> Vec<f32> {
    let b = std::fs::read(root().join("tests/fixtures/quant").join(name)).unwrap();
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}


const E: usize = 512;
const FF: usize = 64;
const N_EXPERT: usize = 4;
/// The Gated DeltaNet cases: E = (2·HK + HV)·S conv channels, layer 1 of the cache.
const D_CONV: usize = 4;
const HK: usize = 2;
const HV: usize = 4;
const S: usize = 64;

/// Every tensor the cases use, in one table (a backend uploads the table once).
struct Fx {
    w: Weights,
    mats: Vec<(GgmlType, Mat)>,
    norm: Vector,
    head_norm: Vector,
    bias: Vector,
    gate_row: Mat,
    /// Gated DeltaNet: conv weights (E channels × D_CONV), dt_bias and ssm_a (HV values).
    conv_w: Vector,
    dt_bias: Vector,
    ssm_a: Vector,
    /// gpt-oss: attention sinks (8 heads) and expert biases (gate, up, down rows per expert).
    sinks: Vector,
    ex_bias: [Vector; 3],
    x: Vec<f32>,
    experts: Arc<dyn ExpertSource>,
}

/// A deterministic value stream (xorshift) for inputs no fixture has.
fn stream(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
        })
        .collect()
}

struct TestExperts {
    layout: ExpertLayout,
    blocks: Vec<ExpertBlock>,
}

impl ExpertSource for TestExperts {
    fn layout(&self, _layer: usize) -> &ExpertLayout {
        &self.layout
    }
    fn with_experts(&self, layer: usize, ids: &[u32], f: &mut dyn FnMut(usize, &ExpertBlock)) -> Result<(), ExpertError> {
        // Handed over last to first: the combine must not depend on the order.
        for (i, &e) in ids.iter().enumerate().rev() {
            let b = self.blocks.get(e as usize).ok_or(ExpertError::Invalid { layer, expert: e as usize, why: "no such expert".into() })?;
            f(i, b);
        }
        Ok(())
    }
}

fn fx() -> &'static Fx {
    static FX: OnceLock<Fx> = OnceLock::new();
    FX.get_or_init(|| {
        let mut w = Weights::default();
        let mats = TYPES
            .iter()
            .map(|&ty| {
                let data = std::fs::read(root().join("tests/fixtures/quant").join(format!("weights_{}.bin", ty.name()))).unwrap();
                (ty, w.add_mat(Weight::new(ty, E, 2, data)))
            })
            .collect();
        let norm = w.add_vec(stream(1, E, 1.0));
        let head_norm = w.add_vec(stream(2, 64, 1.0));
        let bias = w.add_vec(stream(3, E, 0.5));
        let conv_w = w.add_vec(stream(5, E * D_CONV, 0.5));
        let dt_bias = w.add_vec(stream(6, HV, 1.0));
        let ssm_a = w.add_vec(stream(7, HV, 1.0).iter().map(|v| -4.0 - 8.0 * v.abs()).collect());
        let sinks = w.add_vec(vec![3.0, -2.0, 0.5, 10.0, -10.0, 1.0, 0.0, 6.0]);
        let ex_bias = [w.add_vec(stream(8, N_EXPERT * FF, 0.5)), w.add_vec(stream(9, N_EXPERT * FF, 0.5)), w.add_vec(stream(10, N_EXPERT * E, 0.5))];
        let gate_row = w.add_mat(Weight::new(GgmlType::F32, E, 1, bytemuck::cast_slice(&stream(4, E, 0.05)).to_vec()));
        let q = |ty: GgmlType, v: &[f32]| {
            let mut out = Vec::new();
            quant::quantize::quantize_weights(ty, v, &mut out).unwrap();
            out
        };
        let (gt, dt) = (GgmlType::Q4K, GgmlType::Q8_0);
        let layout = ExpertLayout {
            n_embd: E,
            n_ff: FF,
            gate_ty: gt,
            up_ty: gt,
            down_ty: dt,
            gate_bytes: gt.row_bytes(E as u64).unwrap() as usize * FF,
            up_bytes: gt.row_bytes(E as u64).unwrap() as usize * FF,
            down_bytes: dt.row_bytes(FF as u64).unwrap() as usize * E,
        };
        let blocks = (0..N_EXPERT as u64)
            .map(|e| {
                let mut data = q(gt, &stream(10 + e, E * FF, 0.1));
                data.extend(q(gt, &stream(20 + e, E * FF, 0.1)));
                data.extend(q(dt, &stream(30 + e, FF * E, 0.1)));
                ExpertBlock::new(data, layout.clone())
            })
            .collect();
        Fx { w, mats, norm, head_norm, bias, gate_row, conv_w, dt_bias, ssm_a, sinks, ex_bias, x: f32s("act_x.f32"), experts: Arc::new(TestExperts { layout, blocks }) }
    })
}

/// `rows` rows of `cols` input values (from act_x.f32, repeated as needed).
fn rows_of(rows: usize, cols: usize, shift: usize) -> Vec<f32> {
    let x = &fx().x;
    (0..rows * cols).map(|i| x[(i + shift) % x.len()]).collect()
}

type Out = Result<Vec<Vec<f32>>, OpError>;

async fn read_all<B: Ops>(b: &mut B, ts: &[&B::T]) -> Out {
    let parts: Vec<_> = ts.iter().map(|t| (*t, 0..B::shape(t).0)).collect();
    b.read(&parts).await
}

async fn case_rms_norm<B: Ops>(b: &mut B) -> Out {
    let x = b.input(rows_of(4, E, 0), E)?;
    let y = b.rms_norm(&x, fx().norm, 1e-5)?;
    read_all(b, &[&y]).await
}

async fn case_rms_norm_groups<B: Ops>(b: &mut B) -> Out {
    let mut x = b.input(rows_of(3, E, 7), E)?;
    b.rms_norm_groups(&mut x, fx().head_norm, 1e-6)?;
    let mut y = b.input(rows_of(2, E, 9), E)?;
    b.rms_norm_groups(&mut y, fx().norm, 1e-6)?;
    read_all(b, &[&x, &y]).await
}

async fn case_matmul<B: Ops>(b: &mut B, ty: GgmlType, n_tok: usize) -> Out {
    let m = fx().mats.iter().find(|(t, _)| *t == ty).unwrap().1;
    let x = b.input(rows_of(n_tok, E, 0), E)?;
    // Twice on one input: the activation conversion is shared.
    let ys = b.matmul(&x, &[m, m])?;
    read_all(b, &[&ys[0], &ys[1]]).await
}

async fn case_add_row<B: Ops>(b: &mut B) -> Out {
    let mut x = b.input(rows_of(3, E, 1), E)?;
    b.add_row(&mut x, fx().bias)?;
    read_all(b, &[&x]).await
}

async fn case_add<B: Ops>(b: &mut B) -> Out {
    let mut x = b.input(rows_of(3, E, 1), E)?;
    let y = b.input(rows_of(3, E, 100), E)?;
    b.add(&mut x, &y)?;
    read_all(b, &[&x]).await
}

async fn case_swiglu<B: Ops>(b: &mut B) -> Out {
    let g = b.input(rows_of(3, E, 5), E)?;
    let u = b.input(rows_of(3, E, 50), E)?;
    let h = b.swiglu(&g, &u)?;
    read_all(b, &[&h]).await
}

async fn case_gate_add<B: Ops>(b: &mut B) -> Out {
    let mut x = b.input(rows_of(3, E, 2), E)?;
    let y = b.input(rows_of(3, E, 60), E)?;
    let g = b.matmul(&x, &[fx().gate_row])?.remove(0);
    b.gate_add(&mut x, &y, &g, les::backend::ops::Sigmoid::SiluDiv)?;
    read_all(b, &[&x, &g]).await
}

async fn case_gate_add_exp<B: Ops>(b: &mut B) -> Out {
    let mut x = b.input(rows_of(3, E, 2), E)?;
    let y = b.input(rows_of(3, E, 60), E)?;
    let g = b.matmul(&x, &[fx().gate_row])?.remove(0);
    b.gate_add(&mut x, &y, &g, les::backend::ops::Sigmoid::Exp)?;
    read_all(b, &[&x, &g]).await
}

async fn case_mul_sigmoid<B: Ops>(b: &mut B) -> Out {
    let mut x = b.input(rows_of(3, E, 2), E)?;
    let g = b.input(rows_of(3, E, 70), E)?;
    b.mul_sigmoid(&mut x, &g)?;
    read_all(b, &[&x]).await
}

async fn case_norm_gated<B: Ops>(b: &mut B) -> Out {
    let mut x = b.input(rows_of(3, E, 3), E)?;
    let z = b.input(rows_of(3, E, 80), E)?;
    b.norm_gated(&mut x, fx().head_norm, &z, 1e-6)?;
    read_all(b, &[&x]).await
}

async fn case_conv_silu<B: Ops>(b: &mut B) -> Out {
    // A prompt of 3 rows, then 1 more: the state carries over.
    let x = b.input(rows_of(3, E, 5), E)?;
    let y1 = b.ssm_conv(1, &x, fx().conv_w, D_CONV, true)?;
    let x = b.input(rows_of(1, E, 90), E)?;
    let y2 = b.ssm_conv(1, &x, fx().conv_w, D_CONV, true)?;
    read_all(b, &[&y1, &y2]).await
}

/// lfm2's short convolution: the same conv without an activation, between two gates.
async fn case_short_conv<B: Ops>(b: &mut B) -> Out {
    let mut gx = b.input(rows_of(3, E, 7), E)?;
    let g = b.input(rows_of(3, E, 71), E)?;
    b.mul(&mut gx, &g)?;
    let y1 = b.ssm_conv(1, &gx, fx().conv_w, D_CONV, false)?;
    let x = b.input(rows_of(1, E, 91), E)?;
    let y2 = b.ssm_conv(1, &x, fx().conv_w, D_CONV, false)?;
    read_all(b, &[&gx, &y1, &y2]).await
}

async fn case_delta_net<B: Ops>(b: &mut B) -> Out {
    use les::backend::ops::DeltaNet;
    let p = DeltaNet { dt_bias: fx().dt_bias, a: fx().ssm_a, n_group: HK, dt_rank: HV, d_state: S, tiled: true, eps: 1e-6 };
    // 3 rows with tiled heads (qwen35moe), then 2 with grouped heads (qwen3next), one state.
    let mut x1 = b.input(rows_of(3, E, 6), E)?;
    let (al, be) = (b.input(rows_of(3, HV, 15), HV)?, b.input(rows_of(3, HV, 25), HV)?);
    let o1 = b.delta_net(1, &mut x1, &al, &be, &p)?;
    let mut x2 = b.input(rows_of(2, E, 95), E)?;
    let (al, be) = (b.input(rows_of(2, HV, 35), HV)?, b.input(rows_of(2, HV, 45), HV)?);
    let o2 = b.delta_net(1, &mut x2, &al, &be, &DeltaNet { tiled: false, ..p })?;
    // The inputs too: their q and k heads normalised in place.
    read_all(b, &[&o1, &o2, &x1, &x2]).await
}

async fn case_last_row<B: Ops>(b: &mut B) -> Out {
    let x = b.input(rows_of(5, E, 3), E)?;
    let y = b.last_row(x)?;
    read_all(b, &[&y]).await
}

// ---- Vision encoder ops (src/vision: the minicpmv4_6 tower) ----

async fn case_layer_norm<B: Ops>(b: &mut B) -> Out {
    let x = b.input(rows_of(4, E, 13), E)?;
    let y = b.layer_norm(&x, fx().norm, Some(fx().bias), 1e-6)?;
    let z = b.layer_norm(&x, fx().norm, None, 1e-5)?;
    read_all(b, &[&y, &z]).await
}

/// Values over every branch of both GELUs: |x| < 2^-28, the polynomial ranges of erf, the tail,
/// the table's range and beyond ±10.
fn gelu_inputs() -> Vec<f32> {
    let mut v: Vec<f32> = stream(40, 3 * E, 1.0).iter().enumerate().map(|(i, x)| x * [0.5, 2.0, 4.0, 9.0, 14.0][i % 5]).collect();
    v[..8].copy_from_slice(&[0.0, 1e-9, -3e-9, 10.0, -10.0, 9.999, -9.999, f32::from_bits(0x3f58_0000)]);
    v
}

async fn case_gelu<B: Ops>(b: &mut B, kind: Gelu) -> Out {
    let mut x = b.input(gelu_inputs(), E)?;
    b.gelu(&mut x, kind)?;
    read_all(b, &[&x]).await
}

/// Non-causal attention among 8 rows: 4 heads of 64 and 3 heads of 32 (the fixture tower's),
/// over all rows and in blocks of 4 (the ViT merger's windows).
async fn case_self_attention<B: Ops>(b: &mut B, block: usize) -> Out {
    let mut outs = Vec::new();
    for (nh, hd) in [(4, 64), (3, 32)] {
        let c = nh * hd;
        let q = b.input(rows_of(8, c, 0), c)?;
        let k = b.input(rows_of(8, c, 333), c)?;
        let v = b.input(rows_of(8, c, 777), c)?;
        let p = SelfAttn { n_head: nh, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), block };
        let o = b.self_attention(&q, &k, &v, &p)?;
        outs.extend(read_all(b, &[&o]).await?);
    }
    Ok(outs)
}

/// Rows gathered (repeats, any order), concatenated side by side, scaled.
async fn case_gather_concat_scale<B: Ops>(b: &mut B) -> Out {
    let x = b.input(rows_of(4, E, 21), E)?;
    let y = b.input(rows_of(3, 96, 5), 96)?;
    let g = b.gather_rows(&x, &[3, 0, 2])?;
    let mut c = b.concat_cols(&[&g, &y, &g])?;
    b.scale(&mut c, 0.25)?;
    read_all(b, &[&g, &c]).await
}

async fn case_rope<B: Ops>(b: &mut B, kind: RopeKind) -> Out {
    let p = Rope { head_dim: 64, n_rot: 64, base: 10000.0, kind, yarn: None };
    let mut x = b.input(rows_of(3, E, 4), E)?;
    b.rope(&mut x, 5, &p)?;
    // Partial rotation (n_rot < head_dim) at other positions.
    let mut y = b.input(rows_of(2, E, 8), E)?;
    b.rope(&mut y, 1000, &Rope { n_rot: 32, base: 500000.0, ..p })?;
    read_all(b, &[&x, &y]).await
}

async fn case_attention<B: Ops>(b: &mut B) -> Out {
    attend(b, &Attn { n_head: 8, n_head_kv: 2, head_dim: 64, scale: 0.125, window: 0, sinks: None }).await
}

/// GQA: 8 query heads over 2 KV heads of 64; a prompt of 3 rows, then one more row.
async fn attend<B: Ops>(b: &mut B, p: &Attn) -> Out {
    let (nq, nkv) = (8 * 64, 2 * 64);
    let q = b.input(rows_of(3, nq, 11), nq)?;
    let k = b.input(rows_of(3, nkv, 22), nkv)?;
    let v = b.input(rows_of(3, nkv, 33), nkv)?;
    let o1 = b.attention(0, &q, &k, &v, 0, p)?;
    let q = b.input(rows_of(1, nq, 44), nq)?;
    let k = b.input(rows_of(1, nkv, 55), nkv)?;
    let v = b.input(rows_of(1, nkv, 66), nkv)?;
    let o2 = b.attention(0, &q, &k, &v, 3, p)?;
    read_all(b, &[&o1, &o2]).await
}

async fn case_experts<B: Ops>(b: &mut B) -> Out {
    // 3 tokens, top-2 of 4 experts (expert 1 serves two tokens; expert 3 none).
    let sel = [1u32, 0, 2, 1, 0, 1];
    let wts = [0.7f32, 0.3, 0.55, 0.45, 0.9, 0.1];
    let x = b.input(rows_of(3, E, 13), E)?;
    let y = b.experts(0, &*fx().experts, &x, Route { sel: &sel, wts: &wts, k: 2 }, &ExpertFfn::SWIGLU, None)?;
    // One token (the decode shape).
    let x1 = b.input(rows_of(1, E, 17), E)?;
    let y1 = b.experts(0, &*fx().experts, &x1, Route { sel: &sel[2..4], wts: &wts[2..4], k: 2 }, &ExpertFfn::SWIGLU, None)?;
    read_all(b, &[&y, &y1]).await
}

/// gpt-oss's experts: per-expert biases after each product and `swiglu_oai`.
async fn case_experts_oai<B: Ops>(b: &mut B) -> Out {
    let sel = [1u32, 0, 2, 1, 3, 1];
    let wts = [0.7f32, 0.3, 0.55, 0.45, 0.9, 0.1];
    let f = ExpertFfn { act: ExpertAct::SwigluOai { alpha: 1.702, limit: 7.0 }, bias: Some(fx().ex_bias) };
    let x = b.input(rows_of(3, E, 13), E)?;
    let y = b.experts(0, &*fx().experts, &x, Route { sel: &sel, wts: &wts, k: 2 }, &f, None)?;
    let x1 = b.input(rows_of(1, E, 17), E)?;
    let y1 = b.experts(0, &*fx().experts, &x1, Route { sel: &sel[4..6], wts: &wts[4..6], k: 2 }, &f, None)?;
    read_all(b, &[&y, &y1]).await
}

/// smallthinker's experts: `reglu` (ggml `ggml_vec_reglu_f32`), no biases.
async fn case_experts_reglu<B: Ops>(b: &mut B) -> Out {
    let sel = [2u32, 0, 1, 3, 3, 2];
    let wts = [0.6f32, 0.4, 0.25, 0.75, 0.5, 0.5];
    let f = ExpertFfn { act: ExpertAct::Relu, bias: None };
    let x = b.input(rows_of(3, E, 11), E)?;
    let y = b.experts(0, &*fx().experts, &x, Route { sel: &sel, wts: &wts, k: 2 }, &f, None)?;
    let x1 = b.input(rows_of(1, E, 19), E)?;
    let y1 = b.experts(0, &*fx().experts, &x1, Route { sel: &sel[4..6], wts: &wts[4..6], k: 2 }, &f, None)?;
    read_all(b, &[&y, &y1]).await
}

/// gpt-oss's RoPE: NEOX with YaRN (factor 32 over 4096 positions, as gpt-oss-20b), at positions
/// on both sides of the original context.
async fn case_rope_yarn<B: Ops>(b: &mut B) -> Out {
    let yarn = Yarn { freq_scale: 1.0 / 32.0, ext_factor: 1.0, attn_factor: 1.0, beta_fast: 32.0, beta_slow: 1.0, n_ctx_orig: 4096 };
    let p = Rope { head_dim: 64, n_rot: 64, base: 150000.0, kind: RopeKind::Neox, yarn: Some(yarn) };
    let mut x = b.input(rows_of(3, E, 4), E)?;
    b.rope(&mut x, 5, &p)?;
    let mut y = b.input(rows_of(2, E, 8), E)?;
    b.rope(&mut y, 9000, &p)?;
    read_all(b, &[&x, &y]).await
}

/// gpt-oss's attention: a sliding window of 2 (the prompt's rows see 1-2 positions) and one sink
/// logit per head (above every score for some heads, below for others).
async fn case_attention_oai<B: Ops>(b: &mut B) -> Out {
    attend(b, &Attn { n_head: 8, n_head_kv: 2, head_dim: 64, scale: 0.125, window: 2, sinks: Some(fx().sinks) }).await
}

/// The GPU backends: exact path and fast path, each holding the fixture table.
fn gpus() -> &'static [(&'static str, Mutex<GpuBackend>)] {
    static G: OnceLock<Vec<(&'static str, Mutex<GpuBackend>)>> = OnceLock::new();
    G.get_or_init(|| {
        let mut out = Vec::new();
        for (name, exact) in [("wgpu-exact", true), ("wgpu-fast", false)] {
            match GpuContext::new() {
                Ok(ctx) => {
                    let shapes = GpuShapes { n_moe_layer: 2, kv_layers: 2, swa_layers: 0, swa_cells: 0, n_head_kv: 2, head_dim: 64, n_ctx: 64, n_expert: N_EXPERT, n_expert_used: 2 };
                    let opts = GpuOptions { exact: Some(exact), expert_slots: Some(2), ..Default::default() };
                    let g = GpuBackend::new(Arc::new(ctx), &fx().w, shapes, Some(&fx().experts), &opts).unwrap();
                    out.push((name, Mutex::new(g)));
                }
                Err(e) if std::env::var_os("LES_NO_GPU").is_some() => {
                    eprintln!("skipping GPU columns: {e}");
                    return Vec::new();
                }
                Err(e) => panic!("{e} (set LES_NO_GPU=1 to skip on a machine without a GPU adapter)"),
            }
        }
        out
    })
}

/// How a backend's result compares with the CPU's: bit-identical, within `tol` (relative to the
/// largest |value| of the row), or not.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Verdict {
    Exact,
    Close,
    Differs,
    Unsupported,
}

fn compare(want: &[Vec<f32>], got: &[Vec<f32>]) -> (Verdict, f32) {
    let mut worst = 0f32;
    let mut exact = true;
    for (a, b) in want.iter().zip(got) {
        if a.len() != b.len() {
            return (Verdict::Differs, f32::INFINITY);
        }
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        for (x, y) in a.iter().zip(b) {
            exact &= x.to_bits() == y.to_bits();
            worst = worst.max((x - y).abs() / scale);
        }
    }
    if exact {
        (Verdict::Exact, 0.0)
    } else if worst < 1e-5 {
        (Verdict::Close, worst)
    } else {
        (Verdict::Differs, worst)
    }
}

/// Run one case on the CPU and on each GPU backend; returns the verdict per GPU backend.
macro_rules! conform {
    ($case:expr) => {{
        les::quant::Simd::force(les::quant::Simd::Scalar);
        // Layer 0: attention; layer 1: a Gated DeltaNet layer's recurrent state.
        let mut kv = KvCache::hybrid(&[None, Some((E * (D_CONV - 1), HV * S * S))], 64, 2, 64);
        let mut cpu = CpuExec::new(&fx().w, &mut kv, false);
        let want = ready($case(&mut cpu)).unwrap().unwrap();
        let mut verdicts = Vec::new();
        for (name, g) in gpus() {
            let g = g.lock().unwrap();
            let got = block_on(async {
                let mut b = g.exec()?;
                b.apply_state_events(&[les::backend::cpu::kv::StateEvent::Clear])?;
                let r = $case(&mut b).await;
                b.finish()?;
                r
            });
            let v = match got {
                Ok(got) => compare(&want, &got),
                Err(OpError::Gpu(les::backend::wgpu::GpuError::Unsupported(t))) => {
                    eprintln!("{name}: unsupported ({t})");
                    (Verdict::Unsupported, 0.0)
                }
                Err(e) => panic!("{name}: {e}"),
            };
            eprintln!("{name}: {:?} (max relative |Δ| {:e})", v.0, v.1);
            verdicts.push((*name, v.0));
        }
        verdicts
    }};
}

/// The exact path must be bit-identical and the fast path within tolerance.
fn assert_conforms(what: &str, v: &[(&str, Verdict)]) {
    for (name, v) in v {
        match (*name, v) {
            ("wgpu-exact", Verdict::Exact) | ("wgpu-fast", Verdict::Exact | Verdict::Close) => {}
            _ => panic!("{what} on {name}: {v:?}"),
        }
    }
}

#[test]
fn rms_norm() {
    assert_conforms("rms_norm", &conform!(case_rms_norm));
}
#[test]
fn rms_norm_groups() {
    assert_conforms("rms_norm_groups", &conform!(case_rms_norm_groups));
}
#[test]
fn matmul_every_type() {
    for ty in TYPES {
        for n_tok in [1, 4] {
            assert_conforms(&format!("matmul {} × {n_tok}", ty.name()), &conform!(|b| case_matmul(b, ty, n_tok)));
        }
    }
}
#[test]
fn add_row() {
    assert_conforms("add_row", &conform!(case_add_row));
}
#[test]
fn add() {
    assert_conforms("add", &conform!(case_add));
}
#[test]
fn swiglu() {
    assert_conforms("swiglu", &conform!(case_swiglu));
}
#[test]
fn gate_add() {
    assert_conforms("gate_add", &conform!(case_gate_add));
}
#[test]
fn gate_add_exp() {
    assert_conforms("gate_add (sigmoid)", &conform!(case_gate_add_exp));
}
#[test]
fn mul_sigmoid() {
    assert_conforms("mul_sigmoid", &conform!(case_mul_sigmoid));
}
#[test]
fn norm_gated() {
    assert_conforms("norm_gated", &conform!(case_norm_gated));
}
#[test]
fn conv_silu() {
    assert_conforms("conv_silu", &conform!(case_conv_silu));
    assert_conforms("mul, ssm_conv (no activation)", &conform!(case_short_conv));
}
#[test]
fn delta_net() {
    assert_conforms("delta_net", &conform!(case_delta_net));
}
#[test]
fn last_row() {
    assert_conforms("last_row", &conform!(case_last_row));
}
#[test]
fn rope() {
    assert_conforms("rope norm", &conform!(|b| case_rope(b, RopeKind::Norm)));
    assert_conforms("rope neox", &conform!(|b| case_rope(b, RopeKind::Neox)));
}
#[test]
fn attention() {
    assert_conforms("attention", &conform!(case_attention));
}
#[test]
fn experts() {
    assert_conforms("experts", &conform!(case_experts));
    assert_conforms("experts (biases, swiglu_oai)", &conform!(case_experts_oai));
    assert_conforms("experts (reglu)", &conform!(case_experts_reglu));
}
#[test]
fn gpt_oss_rope_and_attention() {
    assert_conforms("rope (neox, YaRN)", &conform!(case_rope_yarn));
    assert_conforms("attention (window, sinks)", &conform!(case_attention_oai));
}

#[test]
fn vision_ops() {
    assert_conforms("layer_norm", &conform!(case_layer_norm));
    assert_conforms("gelu (tanh)", &conform!(|b| case_gelu(b, Gelu::Tanh)));
    assert_conforms("gelu (erf)", &conform!(|b| case_gelu(b, Gelu::Erf)));
    assert_conforms("self_attention", &conform!(|b| case_self_attention(b, 0)));
    assert_conforms("self_attention (blocks of 4)", &conform!(|b| case_self_attention(b, 4)));
    assert_conforms("gather_rows, concat_cols, scale", &conform!(case_gather_concat_scale));
}

fn cell(v: Option<Verdict>) -> &'static str {
    match v {
        Some(Verdict::Exact) => "✅ bit-exact",
        Some(Verdict::Close) => "🟡 ≤ 1e-5",
        Some(Verdict::Differs) => "❌ differs",
        Some(Verdict::Unsupported) => "❌ no kernel",
        None => "—",
    }
}

/// docs/ops.md, from running every case.
#[test]
fn ops_table_is_current() {
    let mut rows: Vec<(String, Vec<(&str, Verdict)>)> = vec![
        ("rms_norm".into(), conform!(case_rms_norm)),
        ("rms_norm_groups".into(), conform!(case_rms_norm_groups)),
    ];
    for ty in TYPES {
        rows.push((format!("matmul {}", ty.name()), conform!(|b| case_matmul(b, ty, 4))));
    }
    rows.push(("add_row".into(), conform!(case_add_row)));
    rows.push(("add".into(), conform!(case_add)));
    rows.push(("rope (norm)".into(), conform!(|b| case_rope(b, RopeKind::Norm))));
    rows.push(("rope (neox)".into(), conform!(|b| case_rope(b, RopeKind::Neox))));
    rows.push(("rope (neox, YaRN)".into(), conform!(case_rope_yarn)));
    rows.push(("attention".into(), conform!(case_attention)));
    rows.push(("attention (window, sinks)".into(), conform!(case_attention_oai)));
    rows.push(("swiglu".into(), conform!(case_swiglu)));
    rows.push(("gate_add".into(), conform!(case_gate_add)));
    rows.push(("gate_add (sigmoid)".into(), conform!(case_gate_add_exp)));
    rows.push(("mul_sigmoid".into(), conform!(case_mul_sigmoid)));
    rows.push(("norm_gated".into(), conform!(case_norm_gated)));
    rows.push(("conv_silu".into(), conform!(case_conv_silu)));
    rows.push(("mul, ssm_conv (no activation)".into(), conform!(case_short_conv)));
    rows.push(("delta_net".into(), conform!(case_delta_net)));
    rows.push(("last_row".into(), conform!(case_last_row)));
    rows.push(("experts".into(), conform!(case_experts)));
    rows.push(("experts (biases, swiglu_oai)".into(), conform!(case_experts_oai)));
    rows.push(("experts (reglu)".into(), conform!(case_experts_reglu)));
    rows.push(("layer_norm".into(), conform!(case_layer_norm)));
    rows.push(("gelu (tanh)".into(), conform!(|b| case_gelu(b, Gelu::Tanh))));
    rows.push(("gelu (erf)".into(), conform!(|b| case_gelu(b, Gelu::Erf))));
    rows.push(("self_attention".into(), conform!(|b| case_self_attention(b, 0))));
    rows.push(("self_attention (blocks of 4)".into(), conform!(|b| case_self_attention(b, 4))));
    rows.push(("gather_rows, concat_cols, scale".into(), conform!(case_gather_concat_scale)));
    if gpus().is_empty() {
        eprintln!("no GPU adapter: docs/ops.md not checked");
        return;
    }
    let mut md = String::from(
        "# Ops × backends\n\n\
         Generated by `tests/portable/ops.rs` (`LES_WRITE_OPS_DOC=1 cargo test --profile ci --test portable -- ops::ops_table`); the test\n\
         fails when this file differs from what the backends do. Each op is the `Ops` contract of\n\
         `src/backend/ops.rs`; the CPU backend is the reference (its kernels follow ggml's: bit-identical\n\
         logits with llama.cpp on x86-64 with AVX2, `tests/suite/reference.rs`). The wgpu columns compare with the\n\
         CPU's portable kernels (`Simd::Scalar`, what wasm32 and aarch64 run) on the adapter the test finds\n\
         (lavapipe, as in CI): *wgpu-exact* is the exact path (`--gpu-exact`, default on CPU-type adapters),\n\
         *wgpu-fast* the parallel matvec reduction hardware GPUs use by default (tolerance: relative 1e-5).\n\
         `read` and `input` (host transfers) are exercised by every case.\n\n\
         | op | cpu | wgpu-exact | wgpu-fast |\n|---|---|---|---|\n",
    );
    for (op, v) in &rows {
        let get = |n: &str| v.iter().find(|(name, _)| *name == n).map(|x| x.1);
        md.push_str(&format!("| {op} | ✅ reference | {} | {} |\n", cell(get("wgpu-exact")), cell(get("wgpu-fast"))));
    }
    let path = root().join("docs/ops.md");
    // The table records the adapter CI has (lavapipe, a CPU-type adapter); elsewhere, print it.
    let info = gpus()[0].1.lock().unwrap().ctx.info.clone();
    if info.device_type != wgpu::DeviceType::Cpu {
        eprintln!("adapter {} is not the CPU-type adapter docs/ops.md records:\n{md}", info.name);
        return;
    }
    if std::env::var_os("LES_WRITE_OPS_DOC").is_some() {
        std::fs::write(&path, &md).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(have, md, "docs/ops.md is out of date: run LES_WRITE_OPS_DOC=1 cargo test --profile ci --test portable -- ops::ops_table");
}
