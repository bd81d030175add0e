//! The per-sequence cache: f16 keys and values per attention layer, laid out
//! [kv_head][position][head_dim] so one head's keys are contiguous (llama.cpp's default cache type
//! is f16 too), and the f32 recurrent state of each Gated DeltaNet layer (llama.cpp's
//! `llama_memory_recurrent`: the conv state `r` and the delta-rule state `s`).
//!
//! A recurrent state cannot be cut back to an earlier position as a KV cache can: it holds every
//! position folded together. [`KvCache::checkpoint`] keeps a copy of it at the current position;
//! [`KvCache::truncate`] to a position before the newest state goes back to the newest checkpoint
//! at or before that position (or to the start), and returns where it went, so the caller feeds
//! the tokens in between again.

use half::f16;

/// One Gated DeltaNet layer's state: the last `d_conv − 1` conv inputs per channel
/// (`[channel][d_conv − 1]`, as ggml's `conv_states` view) and an S×S matrix per value head
/// (`M[j·S + i]` = S[i][j], stored transposed as ggml does).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecState {
    pub conv: Vec<f32>,
    pub ssm: Vec<f32>,
}

/// What happened to the recurrent state on the host, for a backend that holds its own copy (the
/// GPU replays these before its next forward, in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateEvent {
    /// A copy of the state was kept ([`KvCache::checkpoint`]).
    Checkpoint,
    /// The state went back to that copy.
    Restore,
    /// The state went back to zeros (the start of a sequence).
    Clear,
}

pub struct KvCache {
    pub n_ctx: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Positions filled so far.
    pub len: usize,
    pub k: Vec<Vec<f16>>,
    pub v: Vec<Vec<f16>>,
    /// Per layer: the recurrent state of a Gated DeltaNet layer (`None` for attention layers).
    pub rs: Vec<Option<RecState>>,
    /// A copy of every recurrent state at a position (see [`KvCache::checkpoint`]).
    saved: Option<(usize, Vec<Option<RecState>>)>,
    /// State events not yet taken by a device backend ([`KvCache::take_events`]).
    events: Vec<StateEvent>,
}

impl KvCache {
    pub fn new(n_layer: usize, n_ctx: usize, n_head_kv: usize, head_dim: usize) -> Self {
        Self::hybrid(&vec![None; n_layer], n_ctx, n_head_kv, head_dim)
    }

    /// A cache for layers that are attention (`None`) or recurrent (`Some((conv, ssm))`: the
    /// state sizes in f32 values); attention layers get `n_ctx` positions, recurrent ones none.
    pub fn hybrid(layers: &[Option<(usize, usize)>], n_ctx: usize, n_head_kv: usize, head_dim: usize) -> Self {
        let per = n_ctx * n_head_kv * head_dim;
        let kv = |l: &Option<(usize, usize)>| if l.is_none() { vec![f16::ZERO; per] } else { Vec::new() };
        Self {
            n_ctx,
            n_head_kv,
            head_dim,
            len: 0,
            k: layers.iter().map(kv).collect(),
            v: layers.iter().map(kv).collect(),
            rs: layers.iter().map(|l| l.map(|(c, s)| RecState { conv: vec![0.0; c], ssm: vec![0.0; s] })).collect(),
            saved: None,
            events: Vec::new(),
        }
    }

    /// The position count (and, for a model with recurrent layers, the checkpoint bookkeeping)
    /// of a sequence whose keys, values and states live on a device.
    pub fn positions_only(n_ctx: usize, recurrent: bool, n_head_kv: usize, head_dim: usize) -> Self {
        let layers: Vec<Option<(usize, usize)>> = if recurrent { vec![Some((0, 0))] } else { Vec::new() };
        Self::hybrid(&layers, n_ctx, n_head_kv, head_dim)
    }

    /// The state events since the last call (a device backend replays them).
    pub fn take_events(&mut self) -> Vec<StateEvent> {
        std::mem::take(&mut self.events)
    }

    /// Bytes held (for the memory budget).
    pub fn bytes(n_layer: usize, n_ctx: usize, n_head_kv: usize, head_dim: usize) -> usize {
        2 * n_layer * n_ctx * n_head_kv * head_dim * 2
    }

    fn recurrent(&self) -> bool {
        self.rs.iter().any(Option::is_some)
    }

    fn zero_states(&mut self) {
        for r in self.rs.iter_mut().flatten() {
            r.conv.fill(0.0);
            r.ssm.fill(0.0);
        }
    }

    pub fn clear(&mut self) {
        self.len = 0;
        self.zero_states();
        if self.recurrent() {
            self.events.push(StateEvent::Clear);
        }
    }

    /// Keep a copy of the recurrent states at the current position (replacing the previous
    /// copy), so that a later [`Self::truncate`] can come back here. Nothing for a model without
    /// recurrent layers.
    pub fn checkpoint(&mut self) {
        if self.recurrent() {
            self.saved = Some((self.len, self.rs.clone()));
            self.events.push(StateEvent::Checkpoint);
        }
    }

    /// Keep only the first `n` positions (speculative rollback, prompt reuse). Keys and values
    /// are cut at `n`; recurrent states go back to the checkpoint when it is at or before `n`,
    /// else to the start. Returns the positions kept (`≤ n`): the caller feeds the rest again.
    pub fn truncate(&mut self, n: usize) -> usize {
        if n >= self.len {
            return self.len;
        }
        self.restore(n)
    }

    /// [`Self::truncate`] even when nothing is cut: after a forward that failed half-way, the
    /// recurrent states may hold part of it, so they go back to the checkpoint at or before `n`.
    pub fn restore(&mut self, n: usize) -> usize {
        if !self.recurrent() {
            self.len = self.len.min(n);
            return self.len;
        }
        match &self.saved {
            Some((p, states)) if *p <= n => {
                self.len = *p;
                self.rs.clone_from(states);
                self.events.push(StateEvent::Restore);
            }
            _ => {
                self.saved = None;
                self.clear();
            }
        }
        self.len
    }

    fn at(&self, h: usize, pos: usize) -> usize {
        (h * self.n_ctx + pos) * self.head_dim
    }
    /// Store `k`/`v` (`n_head_kv * head_dim` values each) for position `pos` of layer `il`.
    pub fn store(&mut self, il: usize, pos: usize, k: &[f32], v: &[f32]) {
        for h in 0..self.n_head_kv {
            let o = self.at(h, pos);
            let src = h * self.head_dim..(h + 1) * self.head_dim;
            for (d, &x) in self.k[il][o..o + self.head_dim].iter_mut().zip(&k[src.clone()]) {
                *d = f16::from_f32(x);
            }
            for (d, &x) in self.v[il][o..o + self.head_dim].iter_mut().zip(&v[src]) {
                *d = f16::from_f32(x);
            }
        }
    }
    /// Keys and values of head `h` for positions `0..n` of layer `il`.
    pub fn head(&self, il: usize, h: usize, n: usize) -> (&[f16], &[f16]) {
        let o = self.at(h, 0);
        let e = o + n * self.head_dim;
        (&self.k[il][o..e], &self.v[il][o..e])
    }
}
