//! `qwen35moe` (Qwen3.5 / 3.6 MoE, llama.cpp `src/models/qwen35moe.cpp`), `qwen35` (Qwen3.5
//! dense, `src/models/qwen35.cpp`: the same layers with a dense SwiGLU FFN) and `qwen3next`
//! (Qwen3-Next, `src/models/qwen3next.cpp`): a hybrid of Gated DeltaNet (linear attention with a
//! recurrent state, `src/models/delta-net-base.cpp`) and gated full attention, every layer with a
//! MoE FFN plus a sigmoid-gated shared expert (`qwen35`: a dense FFN). Notes with file and line references:
//! `../shared/research/moe_archs.md` §1.
//!
//! Per layer: RMSNorm → (Gated DeltaNet | gated attention) → residual → RMSNorm
//! (`post_attention_norm`) → MoE + shared expert → residual. Then RMSNorm and the output.
//!
//! - Gated DeltaNet: `qkv = attn_qkv·h`, `z = attn_gate·h`, `beta = sigmoid(ssm_beta·h)`,
//!   `g = softplus(ssm_alpha·h + ssm_dt) · ssm_a`; causal conv1d (`ssm_conv1d`, with its state)
//!   then SiLU; q, k L2-normalised per head; the delta rule per value head (its S×S state);
//!   `rms_norm(o)·ssm_norm·silu(z)` per head; `ssm_out`.
//! - Gated attention: `attn_q` gives per head `[q (D) | gate (D)]` (read here as two matrices);
//!   per-head RMS QK-norm; NEOX RoPE on the first `n_rot` dims (qwen35moe's IMROPE is this for
//!   text positions, checked when the config is read); attention; `· sigmoid(gate)`; `attn_output`.
//! - qwen3next differs in a fused `ssm_ba` (`[beta (r) | alpha (r)]` per key head, r = H_v/H_k,
//!   split into the two projections here) and in the grouped value→key head mapping.

use super::blocks::{Ffn, Fwd};
use super::config::{HeadMap, Ssm};
use super::{Config, Loader, ModelError};
use crate::backend::ops::{DeltaNet, Mat, Ops, Vector};

/// A Gated DeltaNet layer's weights.
pub struct Linear {
    pub qkv: Mat,
    pub gate: Mat,
    pub beta: Mat,
    pub alpha: Mat,
    pub conv: Vector,
    pub net: DeltaNet,
    pub norm: Vector,
    pub out: Mat,
}

/// A gated full-attention layer's weights.
pub struct GatedAttn {
    pub wq: Mat,
    pub wgate: Mat,
    pub wk: Mat,
    pub wv: Mat,
    pub wo: Mat,
    pub q_norm: Vector,
    pub k_norm: Vector,
}

pub enum Mixer {
    Linear(Linear),
    Attn(GatedAttn),
}

pub struct Layer {
    pub attn_norm: Vector,
    pub mixer: Mixer,
    pub post_norm: Vector,
    /// Routed experts + shared expert (`qwen35moe`, `qwen3next`), or dense SwiGLU (`qwen35`).
    pub ffn: Ffn,
}

pub struct Hybrid {
    pub layers: Vec<Layer>,
    ssm: Ssm,
}

impl Hybrid {
    pub fn load(ld: &mut Loader<'_>, c: &Config) -> Result<Self, ModelError> {
        let ssm = c.ssm.ok_or_else(|| ModelError::Internal("a hybrid model without ssm hyper-parameters".into()))?;
        let mut layers = Vec::with_capacity(c.n_layer);
        for il in 0..c.n_layer {
            layers.push(Self::load_layer(ld, c, &ssm, il, c.is_recurrent(il))?);
        }
        Ok(Self { layers, ssm })
    }

    /// Block `il`'s weights (`recurrent`: a Gated DeltaNet layer, else gated attention).
    fn load_layer(ld: &mut Loader<'_>, c: &Config, ssm: &Ssm, il: usize, recurrent: bool) -> Result<Layer, ModelError> {
        let (e, s, hk, hv) = (c.n_embd, ssm.d_state, ssm.n_group, ssm.dt_rank);
        let n = |x: &str| format!("blk.{il}.{x}");
        let mixer = if recurrent {
            let (beta, alpha) = match ssm.head_map {
                HeadMap::Tiled => (ld.mat(&n("ssm_beta.weight"), [e, hv])?, ld.mat(&n("ssm_alpha.weight"), [e, hv])?),
                HeadMap::Grouped => {
                    if ld.has(&n("ssm_in.weight")) {
                        return Err(ModelError::Unsupported(format!("{}: the legacy fused ssm_in projection is not supported (convert the model again)", n("ssm_in.weight"))));
                    }
                    // `ssm_ba` rows: per key head g, [beta (r) | alpha (r)].
                    let r = hv / hk;
                    let beta_rows = (0..hk).map(|g| g * 2 * r..g * 2 * r + r).collect();
                    let alpha_rows = (0..hk).map(|g| g * 2 * r + r..(g + 1) * 2 * r).collect();
                    let m = ld.mat_parts(&n("ssm_ba.weight"), [e, 2 * hv], &[beta_rows, alpha_rows])?;
                    (m[0], m[1])
                }
            };
            Mixer::Linear(Linear {
                qkv: ld.mat(&n("attn_qkv.weight"), [e, ssm.conv_dim()])?,
                gate: ld.mat(&n("attn_gate.weight"), [e, ssm.d_inner])?,
                beta,
                alpha,
                conv: ld.vec_shaped(&n("ssm_conv1d.weight"), &[ssm.d_conv, ssm.conv_dim()])?,
                net: DeltaNet {
                    dt_bias: ld.vec(&n("ssm_dt.bias"), hv)?,
                    a: ld.vec(&n("ssm_a"), hv)?,
                    n_group: hk,
                    dt_rank: hv,
                    d_state: s,
                    tiled: ssm.head_map == HeadMap::Tiled,
                    eps: c.rms_eps,
                },
                norm: ld.vec(&n("ssm_norm.weight"), s)?,
                out: ld.mat(&n("ssm_out.weight"), [ssm.d_inner, e])?,
            })
        } else {
            let (d, hq) = (c.head_dim, c.n_head);
            // `attn_q` rows: per head, [q (D) | gate (D)].
            let q_rows = (0..hq).map(|h| 2 * h * d..2 * h * d + d).collect();
            let g_rows = (0..hq).map(|h| 2 * h * d + d..2 * (h + 1) * d).collect();
            let qg = ld.mat_parts(&n("attn_q.weight"), [e, 2 * hq * d], &[q_rows, g_rows])?;
            Mixer::Attn(GatedAttn {
                wq: qg[0],
                wgate: qg[1],
                wk: ld.mat(&n("attn_k.weight"), [e, c.n_embd_kv()])?,
                wv: ld.mat(&n("attn_v.weight"), [e, c.n_embd_kv()])?,
                wo: ld.mat(&n("attn_output.weight"), [c.n_embd_q(), e])?,
                q_norm: ld.vec(&n("attn_q_norm.weight"), d)?,
                k_norm: ld.vec(&n("attn_k_norm.weight"), d)?,
            })
        };
        Ok(Layer {
            attn_norm: ld.vec(&n("attn_norm.weight"), e)?,
            mixer,
            post_norm: ld.vec(&n("post_attention_norm.weight"), e)?,
            ffn: Ffn::load(ld, c, il)?,
        })
    }

    pub async fn forward<B: Ops>(&self, f: &mut Fwd<'_, B>) -> Result<Vec<f32>, ModelError> {
        let mut x = f.embed().await?;
        for (il, l) in self.layers.iter().enumerate() {
            x = self.block(f, il, x, l).await?;
        }
        f.output(x).await
    }

    /// One decoder block: norm → mixer → residual → norm → FFN → residual.
    async fn block<B: Ops>(&self, f: &mut Fwd<'_, B>, il: usize, mut x: B::T, l: &Layer) -> Result<B::T, ModelError> {
        let cur = f.norm(&x, l.attn_norm, "attn_norm", il).await?;
        let mixed = match &l.mixer {
            Mixer::Linear(w) => self.linear(f, il, &cur, w).await?,
            Mixer::Attn(w) => gated_attention(f, il, &cur, w).await?,
        };
        x = f.attn_residual(il, x, mixed).await?;
        let cur = f.norm(&x, l.post_norm, "attn_post_norm", il).await?;
        let out = match &l.ffn {
            Ffn::Moe(w) => f.moe(il, &cur, &x, w).await?,
            Ffn::Dense(w) => f.ffn(il, &cur, w).await?,
        };
        f.layer_out(il, &mut x, out).await?;
        Ok(x)
    }

    /// The MTP block's forward (`graph_mtp`): `x = eh_proj · [enorm(embed(token)) | hnorm(h)]`,
    /// one gated-attention block with its own cache (layer 0 of `f`'s backend) and experts
    /// (`f.experts`), then `shared_head_norm` and the head, on the last row. Returns that row's
    /// logits and normed hidden state.
    pub async fn forward_mtp<B: Ops>(&self, f: &mut Fwd<'_, B>, m: &Mtp, h: &[f32]) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let e = f.embed_from(m.embed).await?;
        let hx = f.b.input(h.to_vec(), f.m.cfg.n_embd)?;
        let hn = f.norm(&hx, m.hnorm, "mtp_hnorm", 0).await?;
        let en = f.norm(&e, m.enorm, "mtp_enorm", 0).await?;
        let cat = f.b.concat_cols(&[&en, &hn])?;
        let [x] = f.matmuls(&cat, [m.eh_proj])?;
        f.dump("mtp_eh_proj", 0, &x).await?;
        let x = self.block(f, 0, x, &m.layer).await?;
        let n = B::shape(&x).0;
        let x = if n > 1 { f.b.last_row(x)? } else { x };
        let hn = f.norm(&x, m.head_norm, "h_nextn", 0).await?;
        let [logits] = f.matmuls(&hn, [m.head])?;
        let mut back = f.b.read(&[(&logits, 0..1), (&hn, 0..1)]).await?;
        let h_out = back.pop().unwrap_or_default();
        Ok((back.pop().unwrap_or_default(), h_out))
    }

    /// A Gated DeltaNet layer (`build_layer_attn_linear`).
    async fn linear<B: Ops>(&self, f: &mut Fwd<'_, B>, il: usize, cur: &B::T, w: &Linear) -> Result<B::T, ModelError> {
        let c = &f.m.cfg;
        let [qkv, z, beta, alpha] = f.matmuls(cur, [w.qkv, w.gate, w.beta, w.alpha])?;
        f.dump("linear_attn_qkv_mixed", il, &qkv).await?;
        f.dump("z", il, &z).await?;
        let mut conv = f.b.ssm_conv(il, &qkv, w.conv, self.ssm.d_conv, true)?;
        f.dump("conv_output_silu", il, &conv).await?;
        let mut o = f.b.delta_net(il, &mut conv, &alpha, &beta, &w.net)?;
        f.dump("attn_output", il, &o).await?;
        f.b.norm_gated(&mut o, w.norm, &z, c.rms_eps)?;
        f.dump("final_output", il, &o).await?;
        let [out] = f.matmuls(&o, [w.out])?;
        f.dump("linear_attn_out", il, &out).await?;
        Ok(out)
    }
}

/// A multi-token-prediction (NextN) block (llama.cpp `load_block_mtp` and `graph_mtp`,
/// `src/models/qwen35moe.cpp`; one block, as llama.cpp supports): a full-attention decoder block
/// with the trunk's FFN kind, fed `eh_proj · [enorm(embed(x_p)) | hnorm(h_{p−1})]` where
/// `h_{p−1}` is the trunk's output-normed hidden state at the previous position; its head
/// predicts `x_{p+1}`.
pub struct Mtp {
    pub layer: Layer,
    pub eh_proj: Mat,
    pub enorm: Vector,
    pub hnorm: Vector,
    /// `nextn.embed_tokens`, else the trunk's `token_embd`.
    pub embed: Mat,
    /// `nextn.shared_head_norm`, else the trunk's `output_norm`.
    pub head_norm: Vector,
    /// `nextn.shared_head_head`, else the trunk's output matrix.
    pub head: Mat,
    /// The block's experts (layer 0 of this source), `None` for a dense FFN.
    pub experts: Option<std::sync::Arc<dyn crate::expert::ExpertSource>>,
    /// Bytes of the block's tensors (weights and experts) in the file.
    pub bytes: usize,
}

impl Mtp {
    /// Load the first NextN block (`blk.{n_layer}`); the experts are the caller's.
    pub fn load(ld: &mut Loader<'_>, c: &Config, tok_embd: Mat, output_norm: Vector, output: Mat) -> Result<Self, ModelError> {
        let ssm = c.ssm.ok_or_else(|| ModelError::Internal("a hybrid model without ssm hyper-parameters".into()))?;
        let (il, e, v) = (c.n_layer, c.n_embd, c.n_vocab);
        let layer = Hybrid::load_layer(ld, c, &ssm, il, false)?;
        let n = |x: &str| format!("blk.{il}.nextn.{x}.weight");
        let embed = if ld.has(&n("embed_tokens")) {
            let m = ld.mat(&n("embed_tokens"), [e, v])?;
            ld.w.set_host_only(m);
            m
        } else {
            tok_embd
        };
        let head = if ld.has(&n("shared_head_head")) { ld.mat(&n("shared_head_head"), [e, v])? } else { output };
        Ok(Self {
            layer,
            eh_proj: ld.mat(&n("eh_proj"), [2 * e, e])?,
            enorm: ld.vec(&n("enorm"), e)?,
            hnorm: ld.vec(&n("hnorm"), e)?,
            embed,
            head_norm: ld.opt_vec(&n("shared_head_norm"), e)?.unwrap_or(output_norm),
            head,
            experts: None,
            bytes: 0,
        })
    }
}

/// Gated full attention (`build_layer_attn`).
async fn gated_attention<B: Ops>(f: &mut Fwd<'_, B>, il: usize, cur: &B::T, a: &GatedAttn) -> Result<B::T, ModelError> {
    let c = &f.m.cfg;
    let [mut q, gate, mut k, v] = f.matmuls(cur, [a.wq, a.wgate, a.wk, a.wv])?;
    f.b.rms_norm_groups(&mut q, a.q_norm, c.rms_eps)?;
    f.b.rms_norm_groups(&mut k, a.k_norm, c.rms_eps)?;
    f.dump("Qcur_normed", il, &q).await?;
    f.dump("Kcur_normed", il, &k).await?;
    let mut o = f.rope_attend(il, q, k, &v, None).await?;
    f.b.mul_sigmoid(&mut o, &gate)?;
    f.dump("attn_gated", il, &o).await?;
    let [out] = f.matmuls(&o, [a.wo])?;
    f.dump("attn_output", il, &out).await?;
    Ok(out)
}
