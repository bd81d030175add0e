//! KV cache: f16 keys and values per layer, laid out [kv_head][position][head_dim] so one head's
//! keys are contiguous (llama.cpp's default cache type is f16 too).

use half::f16;

pub struct KvCache {
    pub n_ctx: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Positions filled so far.
    pub len: usize,
    pub k: Vec<Vec<f16>>,
    pub v: Vec<Vec<f16>>,
}

impl KvCache {
    pub fn new(n_layer: usize, n_ctx: usize, n_head_kv: usize, head_dim: usize) -> Self {
        let per = n_ctx * n_head_kv * head_dim;
        Self {
            n_ctx,
            n_head_kv,
            head_dim,
            len: 0,
            k: (0..n_layer).map(|_| vec![f16::ZERO; per]).collect(),
            v: (0..n_layer).map(|_| vec![f16::ZERO; per]).collect(),
        }
    }
    /// Bytes held (for the memory budget).
    pub fn bytes(n_layer: usize, n_ctx: usize, n_head_kv: usize, head_dim: usize) -> usize {
        2 * n_layer * n_ctx * n_head_kv * head_dim * 2
    }
    pub fn clear(&mut self) {
        self.len = 0;
    }
    /// Keep only the first `n` positions (speculative rollback, prompt reuse).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
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
