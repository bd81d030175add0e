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
//!
//! A sliding-window layer (gpt-oss's even layers: a query at position p sees positions
//! `p − n_swa + 1 ..= p`) keeps a bounded run of cells, as llama.cpp's SWA cache does
//! (`llama-kv-cache-iswa.cpp`: `n_swa + n_ubatch` cells): [`swa_cells`] of them, cell `c` holding
//! position `base + c`. When a batch does not fit, the positions no query can see any more are
//! dropped from the front (all but [`SWA_KEEP`] of them, kept for short rollbacks) and `base`
//! moves on in steps of [`SWA_ALIGN`] positions, so the tiled attention's 64-position key tiles
//! start where they would in a full cache and the sums are the same bits. A rollback further back
//! than the cells reach clears the cache (the caller feeds everything again, as llama.cpp's
//! server does when its SWA cache lacks the data).

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

/// Positions of a batch for which a sliding-window layer keeps cells (llama.cpp's default
/// `n_ubatch`; prompts are fed in batches of at most this many tokens, [`crate::engine`]).
pub const UBATCH: usize = 512;
/// Positions before the window a sliding-window layer keeps, so that a rollback of up to this
/// many tokens (speculative decoding, a regenerated reply) finds its cells.
pub const SWA_KEEP: usize = 64;
/// The steps in which a sliding-window layer's first position moves (the tiled attention's key
/// tile).
pub const SWA_ALIGN: usize = super::flash::FA_TILE_KV;

/// Cells of a sliding-window layer of window `n_swa` in a cache of `n_ctx` positions: the window,
/// a batch, the rollback reserve and the alignment slack.
pub fn swa_cells(n_swa: usize, n_ctx: usize) -> usize {
    (n_swa + UBATCH + SWA_KEEP + SWA_ALIGN).min(n_ctx)
}

/// Cells of a sliding-window layer kept as a ring (a device's cache: position `p` in cell
/// `p mod cells`) for forwards of at most `rows` rows: the window, a forward's rows and the
/// rollback reserve. The ring's positions never move, so it needs no alignment slack.
pub fn swa_ring_cells(n_swa: usize, rows: usize, n_ctx: usize) -> usize {
    (n_swa + rows + SWA_KEEP).min(n_ctx)
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
    /// Per layer: cells of keys and values per KV head (`n_ctx`, fewer for a sliding window).
    cells: Vec<usize>,
    /// Per layer: the sliding window (0: every position is kept).
    window: Vec<usize>,
    /// Per layer: the position held by cell 0 (moves on for a sliding window only).
    base: Vec<usize>,
    /// A copy of every recurrent state at a position (see [`KvCache::checkpoint`]).
    saved: Option<(usize, Vec<Option<RecState>>)>,
    /// State events not yet taken by a device backend ([`KvCache::take_events`]).
    events: Vec<StateEvent>,
    /// A device's sliding-window layers, (window, cells): rings where position `p` lives in cell
    /// `p mod cells` ([`Self::positions_only`]); empty for a host cache.
    rings: Vec<(usize, usize)>,
    /// The most positions held since the cache was last cleared (a ring's cells hold positions
    /// `high − cells .. high`).
    high: usize,
}

impl KvCache {
    pub fn new(n_layer: usize, n_ctx: usize, n_head_kv: usize, head_dim: usize) -> Self {
        Self::hybrid(&vec![None; n_layer], n_ctx, n_head_kv, head_dim)
    }

    /// A cache for layers that are attention (`None`) or recurrent (`Some((conv, ssm))`: the
    /// state sizes in f32 values); attention layers get `n_ctx` positions, recurrent ones none.
    pub fn hybrid(layers: &[Option<(usize, usize)>], n_ctx: usize, n_head_kv: usize, head_dim: usize) -> Self {
        Self::with_windows(layers, &[], n_ctx, n_head_kv, head_dim)
    }

    /// [`Self::hybrid`] with a sliding window per layer (`windows[il]`, 0 or missing: none): those
    /// layers get [`swa_cells`] cells.
    pub fn with_windows(layers: &[Option<(usize, usize)>], windows: &[usize], n_ctx: usize, n_head_kv: usize, head_dim: usize) -> Self {
        Self::try_with_windows(layers, windows, n_ctx, n_head_kv, head_dim).unwrap_or_else(|e| panic!("KV cache: {e}"))
    }

    /// [`Self::with_windows`], with a failed allocation returned (the bytes asked for) instead of
    /// an abort.
    pub fn try_with_windows(layers: &[Option<(usize, usize)>], windows: &[usize], n_ctx: usize, n_head_kv: usize, head_dim: usize) -> Result<Self, usize> {
        let window: Vec<usize> = (0..layers.len()).map(|il| windows.get(il).copied().unwrap_or(0)).collect();
        let cells: Vec<usize> = layers
            .iter()
            .zip(&window)
            .map(|(l, &w)| match (l, w) {
                (Some(_), _) => 0,
                (None, 0) => n_ctx,
                (None, w) => swa_cells(w, n_ctx),
            })
            .collect();
        fn zeros<T: Clone>(n: usize, z: T) -> Result<Vec<T>, usize> {
            let mut v = Vec::new();
            v.try_reserve_exact(n).map_err(|_| n * std::mem::size_of::<T>())?;
            v.resize(n, z);
            Ok(v)
        }
        let kv = |&c: &usize| zeros(c * n_head_kv * head_dim, f16::ZERO);
        let rs = layers
            .iter()
            .map(|l| l.map(|(c, s)| Ok(RecState { conv: zeros(c, 0.0)?, ssm: zeros(s, 0.0)? })).transpose())
            .collect::<Result<_, usize>>()?;
        Ok(Self {
            n_ctx,
            n_head_kv,
            head_dim,
            len: 0,
            k: cells.iter().map(kv).collect::<Result<_, _>>()?,
            v: cells.iter().map(kv).collect::<Result<_, _>>()?,
            rs,
            base: vec![0; layers.len()],
            cells,
            window,
            saved: None,
            events: Vec::new(),
            rings: Vec::new(),
            high: 0,
        })
    }

    /// The position count (and, for a model with recurrent layers, the checkpoint bookkeeping)
    /// of a sequence whose keys, values and states live on a device. `rings`: the windows of the
    /// device's sliding-window layers as (window, cells), each a ring holding position `p` in cell
    /// `p mod cells`; a rollback further back than a ring still holds clears the cache, as
    /// [`Self::truncate`] does for the host's bounded cells.
    pub fn positions_only(n_ctx: usize, recurrent: bool, rings: &[(usize, usize)], n_head_kv: usize, head_dim: usize) -> Self {
        let layers: Vec<Option<(usize, usize)>> = if recurrent { vec![Some((0, 0))] } else { Vec::new() };
        let mut c = Self::hybrid(&layers, n_ctx, n_head_kv, head_dim);
        c.rings = rings.iter().copied().filter(|&(w, cells)| w > 0 && cells < n_ctx).collect();
        c
    }

    /// The state events since the last call (a device backend replays them).
    pub fn take_events(&mut self) -> Vec<StateEvent> {
        std::mem::take(&mut self.events)
    }

    /// Bytes of keys and values of `n_layer` layers of `cells` cells each (for the memory budget).
    pub fn bytes(n_layer: usize, cells: usize, n_head_kv: usize, head_dim: usize) -> usize {
        2 * n_layer * cells * n_head_kv * head_dim * 2
    }

    /// Bytes of keys and values held now.
    pub fn kv_bytes(&self) -> usize {
        (self.k.iter().chain(&self.v)).map(|x| x.len() * 2).sum()
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
        self.high = 0;
        self.base.fill(0);
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
        self.high = self.high.max(self.len);
        if !self.recurrent() {
            self.len = self.len.min(n);
        } else {
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
        }
        // The next query, at position len, sees len + 1 − window .. len: a sliding-window layer
        // must still hold them, or the cache starts over.
        let next = self.len + 1;
        // A device ring holds `high − cells .. high` (later positions overwrote the rest).
        let lost = |&(w, cells): &(usize, usize)| self.high.saturating_sub(cells) > next.saturating_sub(w);
        if self.window.iter().zip(&self.base).any(|(&w, &b)| w > 0 && b > next.saturating_sub(w)) || self.rings.iter().any(lost) {
            self.saved = None;
            self.clear();
        }
        self.len
    }

    fn at(&self, il: usize, h: usize, cell: usize) -> usize {
        (h * self.cells[il] + cell) * self.head_dim
    }

    /// The position held by layer `il`'s first cell ([`Self::head`]'s slices start there).
    pub fn base(&self, il: usize) -> usize {
        self.base[il]
    }

    /// Make room in layer `il` for positions `pos0 .. pos0 + n` (a batch about to be stored): a
    /// sliding-window layer drops the positions that neither this batch's queries nor a rollback
    /// of [`SWA_KEEP`] tokens can see, and grows only when a batch is larger than [`UBATCH`].
    pub fn make_room(&mut self, il: usize, pos0: usize, n: usize) {
        let (w, cap) = (self.window[il], self.cells[il]);
        if w == 0 || pos0 + n - self.base[il] <= cap {
            return;
        }
        let hd = self.head_dim;
        let keep = (pos0 + 1).saturating_sub(w).saturating_sub(SWA_KEEP) / SWA_ALIGN * SWA_ALIGN;
        let base = self.base[il];
        if keep > base {
            // Cells base..pos0 hold positions; keep..pos0 move to the front of each head's run.
            // (keep ≤ pos0: the window holds at least the query's own position.)
            let (from, used) = ((keep - base) * hd, (pos0 - base) * hd);
            for h in 0..self.n_head_kv {
                let o = h * cap * hd;
                self.k[il].copy_within(o + from..o + used, o);
                self.v[il].copy_within(o + from..o + used, o);
            }
            self.base[il] = keep;
        }
        let need = pos0 + n - self.base[il];
        if need > cap {
            let grown = need.div_ceil(SWA_ALIGN) * SWA_ALIGN;
            for x in [&mut self.k[il], &mut self.v[il]] {
                let mut y = vec![f16::ZERO; grown * self.n_head_kv * hd];
                for h in 0..self.n_head_kv {
                    y[h * grown * hd..(h * grown + cap) * hd].copy_from_slice(&x[h * cap * hd..(h + 1) * cap * hd]);
                }
                *x = y;
            }
            self.cells[il] = grown;
        }
    }

    /// Store `k`/`v` (`n_head_kv * head_dim` values each) for position `pos` of layer `il` (a
    /// sliding-window layer: after [`Self::make_room`] for it).
    pub fn store(&mut self, il: usize, pos: usize, k: &[f32], v: &[f32]) {
        let cell = pos - self.base[il];
        for h in 0..self.n_head_kv {
            let o = self.at(il, h, cell);
            let src = h * self.head_dim..(h + 1) * self.head_dim;
            for (d, &x) in self.k[il][o..o + self.head_dim].iter_mut().zip(&k[src.clone()]) {
                *d = f16::from_f32(x);
            }
            for (d, &x) in self.v[il][o..o + self.head_dim].iter_mut().zip(&v[src]) {
                *d = f16::from_f32(x);
            }
        }
    }
    /// Keys and values of head `h` for positions [`Self::base`]`..n` of layer `il`.
    pub fn head(&self, il: usize, h: usize, n: usize) -> (&[f16], &[f16]) {
        let o = self.at(il, h, 0);
        let e = o + (n - self.base[il]) * self.head_dim;
        (&self.k[il][o..e], &self.v[il][o..e])
    }
}
