//! Blocks shared by the architecture files, as llama.cpp's `src/llama-graph.cpp` shares
//! `build_norm`, `build_attn`, `build_ffn` and `build_moe_ffn`. Each block is written once
//! against [`Ops`] and names its intermediates once (`dump`, llama.cpp's names: `attn_norm`,
//! `Qcur`, `kqv_out`, `ffn_moe_logits`, `l_out`, …).
//!
//! The expert scheduler is told things at fixed points: [`crate::expert::ExpertSource::on_hidden`] with the
//! FFN input (read with the router logits, one synchronisation per MoE layer),
//! `on_partial` inside [`Ops::experts`], and `on_residual` after
//! each layer when the source asks for it.

use super::{dump, dump_wanted, route, Loader, Logits, Model, ModelError};
use crate::backend::ops::{Attn, ExpertFfn, Mat, Ops, Rope, Route, Sigmoid, Vector};
use super::Config;

/// Which QK-norm an architecture applies after the Q/K projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm of each head (`attn_q_norm` has `head_dim` values: qwen3moe).
    PerHead,
    /// RMSNorm of the whole Q / K row (`n_embd_q` / `n_embd_kv` values: olmoe).
    Whole,
}

/// One layer's attention weights (`build_qkv` + `build_attn`): optional biases and QK-norms.
pub struct Attention {
    pub wq: Mat,
    pub wk: Mat,
    pub wv: Mat,
    pub wo: Mat,
    pub bq: Option<Vector>,
    pub bk: Option<Vector>,
    pub bv: Option<Vector>,
    /// `attn_output.bias` (gpt-oss).
    pub bo: Option<Vector>,
    pub q_norm: Option<Vector>,
    pub k_norm: Option<Vector>,
    /// `attn_sinks.weight`: one logit per head (gpt-oss).
    pub sinks: Option<Vector>,
}

impl Attention {
    pub fn load(ld: &mut Loader<'_>, c: &Config, il: usize, qk: QkNorm) -> Result<Self, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}");
        let (e, nq, nkv) = (c.n_embd, c.n_embd_q(), c.n_embd_kv());
        let (q_norm, k_norm) = match qk {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (Some(ld.vec(&n("attn_q_norm.weight"), c.head_dim)?), Some(ld.vec(&n("attn_k_norm.weight"), c.head_dim)?)),
            QkNorm::Whole => (Some(ld.vec(&n("attn_q_norm.weight"), nq)?), Some(ld.vec(&n("attn_k_norm.weight"), nkv)?)),
        };
        Ok(Self {
            wq: ld.mat(&n("attn_q.weight"), [e, nq])?,
            wk: ld.mat(&n("attn_k.weight"), [e, nkv])?,
            wv: ld.mat(&n("attn_v.weight"), [e, nkv])?,
            wo: ld.mat(&n("attn_output.weight"), [nq, e])?,
            bq: ld.opt_vec(&n("attn_q.bias"), nq)?,
            bk: ld.opt_vec(&n("attn_k.bias"), nkv)?,
            bv: ld.opt_vec(&n("attn_v.bias"), nkv)?,
            bo: ld.opt_vec(&n("attn_output.bias"), e)?,
            q_norm,
            k_norm,
            sinks: ld.opt_vec(&n("attn_sinks.weight"), c.n_head)?,
        })
    }
}

/// A SwiGLU FFN: `down(silu(gate x) * up x)`.
pub struct Swiglu {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
}

impl Swiglu {
    /// `blk.N.ffn_{gate,up,down}{suffix}.weight` of width `n_ff`.
    pub fn load(ld: &mut Loader<'_>, e: usize, il: usize, suffix: &str, n_ff: usize) -> Result<Self, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}{suffix}.weight");
        Ok(Self { gate: ld.mat(&n("ffn_gate"), [e, n_ff])?, up: ld.mat(&n("ffn_up"), [e, n_ff])?, down: ld.mat(&n("ffn_down"), [n_ff, e])? })
    }
}

/// A shared expert (qwen2moe): a SwiGLU FFN on every token, optionally scaled by the sigmoid of a
/// one-row gate (`ffn_gate_inp_shexp`).
pub struct SharedExpert {
    pub ffn: Swiglu,
    pub gate_inp: Option<Mat>,
    /// The gate's sigmoid as the architecture's graph writes it.
    pub gate_fn: Sigmoid,
}

/// A MoE FFN: the router (`ffn_gate_inp`, optionally biased), experts reached through the
/// model's expert source (their activation and optional per-expert biases in `ffn`), and an
/// optional shared expert.
pub struct Moe {
    pub router: Mat,
    pub router_b: Option<Vector>,
    /// A selection bias added to the router's probabilities for the top-k choice only
    /// (`exp_probs_b.bias`: lfm2moe; DeepSeek-V3's `e_score_correction_bias`).
    pub probs_b: Option<Vector>,
    pub ffn: ExpertFfn,
    pub shared: Option<SharedExpert>,
}

impl Moe {
    pub fn load(ld: &mut Loader<'_>, c: &Config, il: usize) -> Result<Self, ModelError> {
        let e = c.n_embd;
        let router = ld.mat(&format!("blk.{il}.ffn_gate_inp.weight"), [e, c.n_expert])?;
        let router_b = ld.opt_vec(&format!("blk.{il}.ffn_gate_inp.bias"), c.n_expert)?;
        let probs_b = ld.opt_vec(&format!("blk.{il}.exp_probs_b.bias"), c.n_expert)?;
        // gpt-oss: `ffn_{gate,up,down}_exps.bias` ([n_ff_exp | n_embd, n_expert]), all or none.
        let bn = |w: &str| format!("blk.{il}.ffn_{w}_exps.bias");
        let bias = if ld.has(&bn("gate")) || ld.has(&bn("up")) || ld.has(&bn("down")) {
            let (f, x) = (c.n_ff_exp, c.n_expert);
            Some([ld.vec_shaped(&bn("gate"), &[f, x])?, ld.vec_shaped(&bn("up"), &[f, x])?, ld.vec_shaped(&bn("down"), &[e, x])?])
        } else {
            None
        };
        let ffn = ExpertFfn { act: c.expert_act, bias };
        let gate_shexp = format!("blk.{il}.ffn_gate_shexp.weight");
        let shared = if ld.has(&gate_shexp) {
            let sh = ld.g.req_tensor(&gate_shexp)?.dims.get(1).copied().unwrap_or(0) as usize;
            let gi = format!("blk.{il}.ffn_gate_inp_shexp.weight");
            // qwen2moe's graph: `silu(x) / x`; qwen35moe / qwen3next: ggml's `sigmoid`.
            let gate_fn = if c.ssm.is_some() { Sigmoid::Exp } else { Sigmoid::SiluDiv };
            Some(SharedExpert { ffn: Swiglu::load(ld, e, il, "_shexp", sh)?, gate_inp: if ld.has(&gi) { Some(ld.row(&gi, e)?) } else { None }, gate_fn })
        } else {
            None
        };
        Ok(Self { router, router_b, probs_b, ffn, shared })
    }
}

/// A MoE layer's routing once its router has run ([`Fwd::route`]).
pub enum Routing<T> {
    /// Decided on the host: top-k expert ids and weights, `k` per row.
    Host { sel: Vec<u32>, wts: Vec<f32> },
    /// Left on the device: the router logits, routed by [`Ops::experts_routed`].
    Device(T),
}

/// A layer's FFN: dense, or routed experts.
pub enum Ffn {
    Dense(Swiglu),
    Moe(Moe),
}

impl Ffn {
    pub fn load(ld: &mut Loader<'_>, c: &Config, il: usize) -> Result<Self, ModelError> {
        Ok(if c.is_moe_layer(il) { Ffn::Moe(Moe::load(ld, c, il)?) } else { Ffn::Dense(Swiglu::load(ld, c.n_embd, il, "", c.n_ff)?) })
    }
}

/// One forward pass in progress: the model, the backend, the positions, what is wanted.
pub struct Fwd<'a, B: Ops> {
    pub m: &'a Model,
    pub b: &'a mut B,
    pub pos0: usize,
    pub t_n: usize,
    pub want: Option<Logits>,
    /// What the rows are: token ids, or embeddings (an image's).
    pub input: Input<'a>,
    /// The experts of the MoE layers run here: the model's, or a multi-token-prediction block's.
    pub experts: Option<std::sync::Arc<dyn crate::expert::ExpertSource>>,
    /// Whether this forward feeds the model's hidden-state records (the lookahead capture and the
    /// output-normed rows an MTP draft reads): the trunk's forwards do, an MTP block's do not.
    pub record: bool,
}

/// A forward's rows: token ids looked up in `token_embd`, or embeddings given directly (an
/// image's rows, `n × n_embd`).
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    Tokens(&'a [u32]),
    Embd(&'a [f32]),
}

impl<'a> Input<'a> {
    /// Rows (`n_embd`: the width of an embedding row).
    pub fn rows(&self, n_embd: usize) -> usize {
        match self {
            Input::Tokens(t) => t.len(),
            Input::Embd(e) => e.len() / n_embd.max(1),
        }
    }
    /// Rows `r0..r1`.
    pub fn slice(&self, r0: usize, r1: usize, n_embd: usize) -> Input<'a> {
        match *self {
            Input::Tokens(t) => Input::Tokens(&t[r0..r1]),
            Input::Embd(e) => Input::Embd(&e[r0 * n_embd..r1 * n_embd]),
        }
    }
}

impl<'a, B: Ops> Fwd<'a, B> {
    pub fn new(m: &'a Model, b: &'a mut B, pos0: usize, input: Input<'a>, want: Option<Logits>) -> Self {
        Self { m, b, pos0, t_n: input.rows(m.cfg.n_embd), want, input, experts: m.experts().cloned(), record: true }
    }

    /// Rows of `t`.
    pub fn rows(t: &B::T) -> usize {
        B::shape(t).0
    }

    /// `W_i · x` for each matrix of `ws`, as an array (one activation conversion for all).
    pub fn matmuls<const N: usize>(&mut self, x: &B::T, ws: [Mat; N]) -> Result<[B::T; N], ModelError> {
        self.b.matmul(x, &ws)?.try_into().map_err(|_| ModelError::Internal("matmul returned the wrong number of tensors".into()))
    }

    /// Name an intermediate (read back only when dumping is on).
    pub async fn dump(&mut self, name: &str, il: usize, t: &B::T) -> Result<(), ModelError> {
        if dump_wanted() {
            let v = self.b.read(&[(t, 0..Self::rows(t))]).await?;
            dump(name, il, &v[0]);
        }
        Ok(())
    }

    /// The input rows: token embeddings (`get_rows` of `token_embd`, on the host), or the
    /// embeddings given.
    pub async fn embed(&mut self) -> Result<B::T, ModelError> {
        self.embed_from(self.m.tok_embd).await
    }

    /// [`Self::embed`] looking token ids up in `table` (an MTP block's own `embed_tokens`).
    pub async fn embed_from(&mut self, table: Mat) -> Result<B::T, ModelError> {
        let tokens = match self.input {
            Input::Tokens(t) => t,
            Input::Embd(e) => {
                let x = self.b.input(e.to_vec(), self.m.cfg.n_embd)?;
                self.dump("embd", 0, &x).await?;
                return Ok(x);
            }
        };
        let w = self.m.weights.mat(table);
        let (e, n_vocab) = (w.cols, w.rows);
        let mut x = vec![0f32; tokens.len() * e];
        for (t, &tok) in tokens.iter().enumerate() {
            if tok as usize >= n_vocab {
                return Err(ModelError::BadToken(tok));
            }
            self.m.weights.row_f32(table, tok as usize, &mut x[t * e..(t + 1) * e])?;
        }
        let x = self.b.input(x, e)?;
        self.dump("embd", 0, &x).await?;
        Ok(x)
    }

    /// RMSNorm with weight `w` (`build_norm`).
    pub async fn norm(&mut self, x: &B::T, w: Vector, name: &str, il: usize) -> Result<B::T, ModelError> {
        let y = self.b.rms_norm(x, w, self.m.cfg.rms_eps)?;
        self.dump(name, il, &y).await?;
        Ok(y)
    }

    /// Self-attention of `cur` (`build_qkv` + RoPE + `build_attn` + output projection).
    pub async fn attention(&mut self, il: usize, cur: &B::T, a: &Attention) -> Result<B::T, ModelError> {
        let c = &self.m.cfg;
        let [mut q, mut k, mut v] = self.matmuls(cur, [a.wq, a.wk, a.wv])?;
        self.dump("Qcur", il, &q).await?;
        self.dump("Kcur", il, &k).await?;
        self.dump("Vcur", il, &v).await?;
        for (t, b) in [(&mut q, a.bq), (&mut k, a.bk), (&mut v, a.bv)] {
            if let Some(b) = b {
                self.b.add_row(t, b)?;
            }
        }
        if let (Some(qn), Some(kn)) = (a.q_norm, a.k_norm) {
            self.b.rms_norm_groups(&mut q, qn, c.rms_eps)?;
            self.b.rms_norm_groups(&mut k, kn, c.rms_eps)?;
        }
        let o = self.rope_attend(il, q, k, &v, a.sinks).await?;
        let [mut out] = self.matmuls(&o, [a.wo])?;
        if let Some(bo) = a.bo {
            self.b.add_row(&mut out, bo)?;
        }
        self.dump("attn_out", il, &out).await?;
        Ok(out)
    }

    /// RoPE on `q` and `k` (the first `n_rot` dims of each head; the layer's base, YaRN), then
    /// causal attention over the layer's cache with `k`, `v` appended (`build_attn`, scale
    /// `1/sqrt(head_dim)`, the layer's sliding window, optional sinks).
    pub async fn rope_attend(&mut self, il: usize, mut q: B::T, mut k: B::T, v: &B::T, sinks: Option<Vector>) -> Result<B::T, ModelError> {
        let c = &self.m.cfg;
        let swa = c.is_swa(il);
        let base = if swa { c.rope_base_swa } else { c.rope_base };
        let rope = Rope { head_dim: c.head_dim, n_rot: c.n_rot, base, kind: c.rope, yarn: c.yarn };
        if !c.is_nope(il) {
            self.b.rope(&mut q, self.pos0, &rope)?;
            self.b.rope(&mut k, self.pos0, &rope)?;
        }
        self.dump("Qrope", il, &q).await?;
        self.dump("Krope", il, &k).await?;
        let p = Attn { n_head: c.n_head, n_head_kv: c.n_head_kv, head_dim: c.head_dim, scale: 1.0 / (c.head_dim as f32).sqrt(), window: c.window(il), sinks };
        let o = self.b.attention(il, &q, &k, v, self.pos0, &p)?;
        self.dump("kqv_out", il, &o).await?;
        Ok(o)
    }

    /// `x + attn`, the FFN's input (`ffn_inp`). In the last layer, when only the last logits are
    /// wanted, only the last row goes on (llama.cpp's `inp_out_ids`), so the last FFN's kernels
    /// see one row, as llama.cpp's do.
    /// (The hybrid graphs and gpt-oss keep every row to the output norm.)
    pub async fn attn_residual(&mut self, il: usize, mut x: B::T, mut attn: B::T) -> Result<B::T, ModelError> {
        if self.trims(il, Self::rows(&x)) {
            x = self.b.last_row(x)?;
            attn = self.b.last_row(attn)?;
        }
        self.b.add(&mut x, &attn)?;
        self.dump("ffn_inp", il, &x).await?;
        if let Some(cap) = self.m.capture.as_ref().filter(|_| self.record) {
            let n = Self::rows(&x);
            let row = self.b.read(&[(&x, n - 1..n)]).await?.remove(0);
            if let Some(rows) = cap.lock().unwrap().get_mut(self.m.cfg.expert_layer(il)).filter(|_| self.m.cfg.is_moe_layer(il)) {
                rows.extend_from_slice(&row);
            }
        }
        Ok(x)
    }

    /// Whether layer `il` keeps only the last of its `rows` rows from its FFN on (llama.cpp's
    /// `inp_out_ids` in the last layer of the llama family, when only the last logits are wanted).
    pub fn trims(&self, il: usize, rows: usize) -> bool {
        il + 1 == self.m.cfg.n_layer && self.want == Some(Logits::Last) && rows > 1 && self.m.cfg.trims_last_layer()
    }

    /// A SwiGLU FFN of `cur` (`build_ffn` with `LLM_FFN_SILU`, `LLM_FFN_PAR`).
    pub async fn ffn(&mut self, il: usize, cur: &B::T, w: &Swiglu) -> Result<B::T, ModelError> {
        let [g, u] = self.matmuls(cur, [w.gate, w.up])?;
        self.dump("ffn_gate", il, &g).await?;
        self.dump("ffn_up", il, &u).await?;
        let h = self.b.swiglu(&g, &u)?;
        self.dump("ffn_swiglu", il, &h).await?;
        let [y] = self.matmuls(&h, [w.down])?;
        Ok(y)
    }

    /// A MoE FFN of `cur` (`build_moe_ffn`): router logits → softmax → top-k → weights (on the
    /// host, [`route`], or for a decode row on a device that holds every expert of the layer,
    /// there: [`Ops::experts_routed`], the same bits) → the routed experts combined in rank order
    /// → plus the shared expert. `x`: the residual entering this FFN (for the scheduler's
    /// refinement).
    pub async fn moe(&mut self, il: usize, cur: &B::T, x: &B::T, w: &Moe) -> Result<B::T, ModelError> {
        let logits = self.router_logits(cur, w)?;
        let routing = self.route(il, logits, cur, w).await?;
        self.moe_routed(il, cur, x, w, routing).await
    }

    /// The router's logits of `h` (`ffn_gate_inp`, plus its bias where there is one).
    pub fn router_logits(&mut self, h: &B::T, w: &Moe) -> Result<B::T, ModelError> {
        let [mut logits] = self.matmuls(h, [w.router])?;
        if let Some(b) = w.router_b {
            self.b.add_row(&mut logits, b)?;
        }
        Ok(logits)
    }

    /// Layer `il`'s routing from its router `logits`: left on the device (a decode row whose
    /// experts the device holds: [`Ops::routes_on_device`]), or read back with one
    /// synchronisation — with `hidden`'s row when decoding, the lookahead predictor's input
    /// ([`crate::expert::ExpertSource::on_hidden`]) — and decided on the host ([`route`]).
    pub async fn route(&mut self, il: usize, logits: B::T, hidden: &B::T, w: &Moe) -> Result<Routing<B::T>, ModelError> {
        let c = &self.m.cfg;
        let src = self.experts.clone().ok_or(ModelError::NoExperts)?;
        let t_n = Self::rows(&logits);
        let xl = c.expert_layer(il);
        if t_n == 1 && c.n_expert_used <= 8 && self.b.routes_on_device(xl, &*src, c.n_expert) {
            return Ok(Routing::Device(logits));
        }
        let mut parts = vec![(&logits, 0..t_n)];
        if t_n == 1 {
            let n = Self::rows(hidden);
            parts.push((hidden, n - 1..n));
        }
        let back = self.b.read(&parts).await?;
        src.on_hidden(xl, back.get(1).map(|v| v.as_slice()).unwrap_or(&[]), t_n);
        dump("ffn_moe_logits", il, &back[0]);
        let (sel, wts) = route(c, &back[0], t_n, w.probs_b.map(|b| self.m.weights.vec(b)));
        dump("ffn_moe_weights", il, &wts);
        dump("ffn_moe_topk", il, &sel.iter().map(|&v| v as f32).collect::<Vec<_>>());
        Ok(Routing::Host { sel, wts })
    }

    /// The routed experts of `cur` as `routing` chose them, combined in rank order, plus the
    /// shared expert.
    pub async fn moe_routed(&mut self, il: usize, cur: &B::T, x: &B::T, w: &Moe, routing: Routing<B::T>) -> Result<B::T, ModelError> {
        let c = &self.m.cfg;
        let src = self.experts.clone().ok_or(ModelError::NoExperts)?;
        let t_n = Self::rows(cur);
        let out = match routing {
            Routing::Device(logits) => self.b.experts_routed(c.expert_layer(il), &*src, cur, &logits, &c.route_spec(), w.probs_b, &w.ffn)?,
            Routing::Host { sel, wts } => {
                let r = Route { sel: &sel, wts: &wts, k: c.n_expert_used };
                self.b.experts(c.expert_layer(il), &*src, cur, r, &w.ffn, (t_n == 1).then_some(x))?
            }
        };
        self.shared_expert(il, cur, out, w).await
    }

    /// `out` (the routed experts' sum) plus the layer's shared expert of `cur`, if it has one
    /// (gated by `ffn_gate_inp_shexp` where present).
    async fn shared_expert(&mut self, il: usize, cur: &B::T, mut out: B::T, w: &Moe) -> Result<B::T, ModelError> {
        if let Some(sh) = &w.shared {
            self.dump("ffn_moe_out", il, &out).await?;
            let y = self.ffn(il, cur, &sh.ffn).await?;
            self.dump("ffn_shexp", il, &y).await?;
            match sh.gate_inp {
                Some(gi) => {
                    let [g] = self.matmuls(cur, [gi])?;
                    self.dump("ffn_shexp_gate_inp", il, &g).await?;
                    self.b.gate_add(&mut out, &y, &g, sh.gate_fn)?;
                }
                None => self.b.add(&mut out, &y)?,
            }
        }
        Ok(out)
    }

    /// `x += ffn_out` (`l_out`); then, when the expert source asks for it, the layer's output
    /// (last row) goes to the expert source's `on_residual`.
    pub async fn layer_out(&mut self, il: usize, x: &mut B::T, out: B::T) -> Result<(), ModelError> {
        self.dump("ffn_out", il, &out).await?;
        self.b.add(x, &out)?;
        self.dump("l_out", il, x).await?;
        if let Some(src) = &self.experts {
            let n = Self::rows(x);
            if n == 1 && src.wants_residual() && self.m.cfg.is_moe_layer(il) {
                let row = self.b.read(&[(&*x, 0..1)]).await?.remove(0);
                src.on_residual(self.m.cfg.expert_layer(il), &row, n);
            }
        }
        Ok(())
    }

    /// Final norm and output projection (`result_norm`, `result_output`), read to the host.
    /// When an MTP draft reads the trunk's hidden states ([`Model::set_record_hidden`]), every
    /// row's output-normed hidden state (llama.cpp's `h_nextn`) is recorded first, by a norm of
    /// its own: the logits' path is unchanged.
    pub async fn output(&mut self, x: B::T) -> Result<Vec<f32>, ModelError> {
        if self.record && self.m.records_hidden() {
            let n = Self::rows(&x);
            let h = self.b.rms_norm(&x, self.m.output_norm, self.m.cfg.rms_eps)?;
            let rows = self.b.read(&[(&h, 0..n)]).await?.remove(0);
            self.m.push_hidden(&rows);
        }
        let Some(want) = self.want else { return Ok(Vec::new()) };
        let n = Self::rows(&x);
        let x = if want == Logits::Last && n > 1 { self.b.last_row(x)? } else { x };
        let h = self.norm(&x, self.m.output_norm, "result_norm", 0).await?;
        let output = self.m.output;
        let [logits] = self.matmuls(&h, [output])?;
        let rows = Self::rows(&logits);
        let out = self.b.read(&[(&logits, 0..rows)]).await?.remove(0);
        dump("result_output", 0, &out);
        Ok(out)
    }
}
