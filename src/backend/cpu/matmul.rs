//! Quantized matrix × activation products on the CPU.
//!
//! As in ggml's CPU backend, the activation rows are first converted to the weight type's
//! `vec_dot_type` (Q8_0, Q8_1, Q8_K, F16, …) and then dotted with each weight row; see
//! [`crate::quant::vec_dot_type`].

use super::par;
use crate::quant::{self, GgmlType};

/// A 2-D weight matrix in a GGML block format: `rows` rows of `cols` elements.
#[derive(Clone, Debug)]
pub struct Weight {
    pub ty: GgmlType,
    pub cols: usize,
    pub rows: usize,
    pub data: Vec<u8>,
    /// The rows are in [`quant::repack`]'s layout (groups of four interleaved, the last
    /// `rows % 4` plain), not the file's.
    pub repacked: bool,
}

/// A borrowed 2-D weight matrix (e.g. one expert's slice of a stacked tensor).
#[derive(Clone, Copy, Debug)]
pub struct WeightRef<'a> {
    pub ty: GgmlType,
    pub cols: usize,
    pub rows: usize,
    pub data: &'a [u8],
    /// As [`Weight::repacked`].
    pub repacked: bool,
}

impl Weight {
    /// A matrix in the file's layout.
    pub fn new(ty: GgmlType, cols: usize, rows: usize, data: Vec<u8>) -> Self {
        Self { ty, cols, rows, data, repacked: false }
    }
    pub fn as_ref(&self) -> WeightRef<'_> {
        WeightRef { ty: self.ty, cols: self.cols, rows: self.rows, data: &self.data, repacked: self.repacked }
    }
    /// Dequantize row `r` into `out` (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) -> Result<(), quant::QuantError> {
        let rb = self.ty.row_bytes(self.cols as u64).unwrap_or(0) as usize;
        if self.repacked {
            let mut plain = vec![0u8; rb];
            quant::repack::row(self.ty, self.cols, self.rows, &self.data, r, &mut plain);
            return quant::dequantize_row(self.ty, &plain, out);
        }
        quant::dequantize_row(self.ty, &self.data[r * rb..(r + 1) * rb], out)
    }
    /// Put the rows in [`quant::repack`]'s layout where the type has one and it
    /// [pays](quant::repack::pays) on this build (or `always`: tests); returns whether they are.
    pub fn repack(&mut self, always: bool) -> bool {
        if !self.repacked && (always || quant::repack::pays()) {
            self.repacked = quant::repack::pack(self.ty, self.cols, self.rows, &mut self.data);
        }
        self.repacked
    }
    /// The file's layout again (a backend that reads the bytes as they are, e.g. a GPU upload).
    pub fn unpack(&mut self) {
        if self.repacked {
            quant::repack::unpack(self.ty, self.cols, self.rows, &mut self.data);
            self.repacked = false;
        }
    }
    /// All values as f32 (small vectors: norms, biases).
    pub fn to_f32(&self) -> Result<Vec<f32>, quant::QuantError> {
        let mut v = vec![0f32; self.cols * self.rows];
        quant::dequantize_row(self.ty, &self.data, &mut v)?;
        Ok(v)
    }
}

/// Which kernels a product over several activation rows uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowMode {
    /// ggml's batched `mul_mat` kernels (tinyBLAS, repacked GEMM, tiled K-quants), so a batch gives
    /// llama.cpp's bits for a batch.
    Batch,
    /// One expert's rows of a `mul_mat_id` (ggml has fewer batch kernels there).
    Experts,
    /// Every row exactly as a single-row product (speculative verification: a batch of tokens gives
    /// the bits of feeding them one at a time).
    PerRow,
}

/// Activations (`n_tok` rows of `cols` f32 values) with their conversions to vec-dot formats,
/// made once per format and shared by every matmul that reads the same input (e.g. Q, K, V).
pub struct Acts<'a> {
    pub x: &'a [f32],
    pub cols: usize,
    pub n_tok: usize,
    mode: RowMode,
    conv: Vec<(GgmlType, Vec<u8>, usize)>,
    /// The activations rounded to f16 and widened back to f32 (F16 weights' batched tiles).
    wide16: Option<Vec<f32>>,
}

impl<'a> Acts<'a> {
    pub fn new(x: &'a [f32], cols: usize) -> Self {
        Self { x, cols, n_tok: x.len() / cols, mode: RowMode::Batch, conv: Vec::new(), wide16: None }
    }

    /// Activations whose products use the kernels of `mode`.
    pub fn with_mode(x: &'a [f32], cols: usize, mode: RowMode) -> Self {
        Self { mode, ..Self::new(x, cols) }
    }

    /// The f32 rows [`quant::FloatGemm`] reads for weights of type `wty` (F32: the activations
    /// themselves; F16: each value rounded to f16, as the F16 vec-dot type holds it, in f32),
    /// made once (on every thread) for all the matrices that share these activations.
    fn widened(&mut self, wty: GgmlType) -> &[f32] {
        if wty != GgmlType::F16 {
            return self.x;
        }
        if self.wide16.is_none() {
            let mut v = vec![0f32; self.x.len()];
            const CHUNK: usize = 1 << 14;
            let x = self.x;
            par::for_each_chunk(&mut v, CHUNK, |ci, out| {
                for (o, &a) in out.iter_mut().zip(&x[ci * CHUNK..]) {
                    *o = half::f16::from_f32(a).to_f32();
                }
            });
            self.wide16 = Some(v);
        }
        self.wide16.as_deref().unwrap_or(self.x)
    }

    fn converted(&mut self, wty: GgmlType) -> (&[u8], usize) {
        let vty = quant::vec_dot_type(wty);
        if let Some(i) = self.conv.iter().position(|c| c.0 == vty) {
            let c = &self.conv[i];
            return (&c.1, c.2);
        }
        let row_b = vty.row_bytes(self.cols as u64).expect("activation row not a multiple of the block size") as usize;
        let (x, cols) = (self.x, self.cols);
        let mut buf = vec![0u8; row_b * self.n_tok];
        // Rows are converted independently: a prompt's rows on every thread, 16 per task.
        par::for_each_chunk(&mut buf, row_b * 16, |ci, out| {
            let mut tmp = Vec::with_capacity(row_b);
            for (j, o) in out.chunks_mut(row_b).enumerate() {
                let t = ci * 16 + j;
                tmp.clear();
                quant::quantize_activation(vty, &x[t * cols..(t + 1) * cols], &mut tmp).expect("activation quantization");
                o.copy_from_slice(&tmp);
            }
        });
        self.conv.push((vty, buf, row_b));
        let c = self.conv.last().unwrap();
        (&c.1, c.2)
    }
}

/// Rows per parallel task: small enough to balance, large enough to amortise dispatch (~64K
/// multiply-adds at least). On wasm one task per thread, in whole groups of four rows (the
/// four-row kernels): each task's kernel call has a fixed cost there (the activation prepared
/// for its rows, the f16 scales in software), and one range per thread decoded SmolLM2 1.14×
/// faster at two threads than four ranges per thread (BENCHMARKS.md, 2026-12-07).
fn rows_per_task(rows: usize, cols: usize) -> usize {
    let threads = par::n_threads().max(1);
    let min_rows = (65536 / cols.max(1)).max(1);
    if cfg!(target_arch = "wasm32") {
        return rows.div_ceil(threads).max(min_rows).next_multiple_of(4);
    }
    rows.div_ceil(threads * 4).max(min_rows)
}

/// Numerics checks across platforms (`examples/quant_probe matmul`, the wasm build's
/// `debugMatmul`): the batched product of weight rows `w` of ggml type `ty` (id) with the tokens
/// `x` (rows of `cols`), `y` token-major; empty for an unknown type or a bad size. `repack`: the
/// rows in [`quant::repack`]'s layout first, where the type has it.
#[doc(hidden)]
pub fn matmul_probe(ty: u32, w: &[u8], x: &[f32], cols: usize, repack: bool) -> Vec<f32> {
    let Some(ty) = GgmlType::from_u32(ty) else { return Vec::new() };
    let rb = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
    if rb == 0 || cols == 0 || w.len() % rb != 0 || x.len() % cols != 0 {
        return Vec::new();
    }
    let rows = w.len() / rb;
    let mut y = vec![0f32; rows * (x.len() / cols)];
    let mut wt = Weight::new(ty, cols, rows, w.to_vec());
    if repack {
        wt.repack(true);
    }
    matmul(wt.as_ref(), &mut Acts::new(x, cols), &mut y);
    y
}

/// `y[t][r] = W[r] · x[t]` for every token `t`. `y` is `n_tok × w.rows`, token-major.
pub fn matmul(w: WeightRef<'_>, acts: &mut Acts<'_>, y: &mut [f32]) {
    matmul_part(w, acts, y, w.rows)
}

/// [`matmul`] of a piece of a matrix of `whole_rows` rows (read from storage piece by piece):
/// the kernels are chosen for the whole matrix, so each output has the bits it has there
/// (pieces start at multiples of 8 rows).
pub fn matmul_part(w: WeightRef<'_>, acts: &mut Acts<'_>, y: &mut [f32], whole_rows: usize) {
    assert_eq!(w.cols, acts.cols, "matmul: weight has {} columns, activation {}", w.cols, acts.cols);
    if w.repacked {
        return matmul_rows4(w, acts, y);
    }
    let n_tok = acts.n_tok;
    let mode = acts.mode;
    let w_row = w.ty.row_bytes(w.cols as u64).unwrap() as usize;
    if n_tok == 1 {
        let (a, _) = acts.converted(w.ty);
        let chunk = rows_per_task(w.rows, w.cols);
        par::for_each_chunk(&mut y[..w.rows], chunk, |ci, out| {
            let r0 = ci * chunk;
            quant::matvec(w.ty, w.cols, &w.data[r0 * w_row..(r0 + out.len()) * w_row], a, out);
        });
        return;
    }
    // Batched: chunks of weight rows; within a chunk, blocks of `TOKENS` tokens whose converted
    // activations stay in L1 while the chunk's rows are dotted with them (ggml's 16 × 16 blocks
    // in `ggml_compute_forward_mul_mat_one_chunk`). Every output is one `vec_dot` as before, so
    // the loop order does not change a bit.
    let rows_chunk = rows_per_task(w.rows, w.cols * n_tok);
    let yp = par::SharedMut::new(&mut y[..n_tok * w.rows]);
    let wrow = |r: usize| &w.data[r * w_row..(r + 1) * w_row];
    // F32 / F16 weights in ggml's tinyBLAS order: the activations widened to f32 once.
    if let Some(fg) = quant::FloatGemm::new(w.ty, w.cols, whole_rows, n_tok, mode == RowMode::Experts, mode == RowMode::PerRow) {
        let wide = acts.widened(w.ty);
        // Tasks of 16 weight rows × 72 tokens, rows fastest (ggml's tinyBLAS jobs): a task's
        // four-row groups stay in L1 while its tokens' activations, in L2, pass by.
        let (rb, tb) = (16, 72);
        let rows = w.rows;
        let n_rb = rows.div_ceil(rb);
        par::for_each(n_rb * n_tok.div_ceil(tb), |job| {
            let (r0, t0) = ((job % n_rb) * rb, (job / n_rb) * tb);
            let (r1, t1) = ((r0 + rb).min(rows), (t0 + tb).min(n_tok));
            fg.block(&w.data[r0 * w_row..r1 * w_row], r1 - r0, &wide[t0 * w.cols..t1 * w.cols], t1 - t0, &mut |r, t, v| {
                // SAFETY: job `job` alone writes rows r0..r1 of tokens t0..t1, within y.
                unsafe { yp.write((t0 + t) * rows + r0 + r, v) }
            });
        });
        return;
    }
    let (a, a_row) = acts.converted(w.ty);
    let dot = quant::BatchDot::new(w.ty, w.cols, whole_rows, n_tok, mode == RowMode::Experts, mode == RowMode::PerRow);
    let act = |t: usize| &a[t * a_row..(t + 1) * a_row];
    let tile_rows = dot.tile_rows();
    let tile_acts = |t: usize| dot.tile_acts([act(t), act(t + 1), act(t + 2), act(t + 3)], t);
    let tile = |r: usize, a: &quant::TileActs<'_>| dot.dot_tile([0, 1, 2, 3].map(|i| wrow(r + i.min(tile_rows - 1))), a);
    let tile = (tile_rows > 0).then_some(Tile { rows: tile_rows, acts: &tile_acts, dot: &tile });
    blocks(w.rows, n_tok, rows_chunk, 16, &yp, tile, &|r, t| dot.dot4(wrow(r), [act(t), act(t + 1), act(t + 2), act(t + 3)], t), &|r, t| dot.dot(wrow(r), act(t), t));
}

/// [`matmul`] of a repacked matrix ([`quant::repack`]): tasks of whole groups of four rows;
/// a matrix-vector product group by group, a batch in blocks of 16 tokens, each group × up to
/// four tokens per call, the tokens prepared once per task and block. Every output has its
/// single dot's bits, whatever the [`RowMode`].
fn matmul_rows4(w: WeightRef<'_>, acts: &mut Acts<'_>, y: &mut [f32]) {
    let (n_tok, rows) = (acts.n_tok, w.rows);
    let w_row = w.ty.row_bytes(w.cols as u64).unwrap() as usize;
    let (a, a_row) = acts.converted(w.ty);
    if n_tok == 1 {
        let chunk = rows_per_task(rows, w.cols).next_multiple_of(4);
        par::for_each_chunk(&mut y[..rows], chunk, |ci, out| {
            let r0 = ci * chunk;
            quant::repack::matvec(w.ty, w.cols, &w.data[r0 * w_row..(r0 + out.len()) * w_row], a, out);
        });
        return;
    }
    let Some(dot) = quant::repack::Rows4Dot::new(w.ty, w.cols) else {
        y.fill(f32::NAN);
        return;
    };
    let rows_chunk = rows_per_task(rows, w.cols * n_tok).next_multiple_of(4);
    let yp = par::SharedMut::new(&mut y[..n_tok * rows]);
    let act = |t: usize| &a[t * a_row..(t + 1) * a_row];
    let grouped = rows / 4 * 4;
    par::for_each(rows.div_ceil(rows_chunk), |ci| {
        let (r0, r1) = (ci * rows_chunk, ((ci + 1) * rows_chunk).min(rows));
        for t0 in (0..n_tok).step_by(16) {
            let t1 = (t0 + 16).min(n_tok);
            let tiles: Vec<_> = (t0..t1).step_by(4).map(|t| (t, dot.prepare(&(t..t1.min(t + 4)).map(act).collect::<Vec<_>>()))).collect();
            for r in (r0..r1.min(grouped)).step_by(4) {
                let g = &w.data[r * w_row..(r + 4) * w_row];
                for (t, p) in &tiles {
                    let v = dot.dot(g, p);
                    for (i, row) in v.iter().enumerate() {
                        for (k, &v) in row.iter().enumerate().take(t1 - t) {
                            // SAFETY: chunk `ci` alone writes rows r0..r1 of every token, within y.
                            unsafe { yp.write((t + k) * rows + r + i, v) };
                        }
                    }
                }
            }
            for r in grouped.max(r0)..r1 {
                for t in t0..t1 {
                    // SAFETY: as above.
                    unsafe { yp.write(t * rows + r, quant::vec_dot(w.ty, w.cols, &w.data[r * w_row..(r + 1) * w_row], act(t))) };
                }
            }
        }
    });
}

/// Tiles of `rows` weight rows × four tokens: `acts(t)` makes tokens `t .. t + 4` ready once for
/// every row tile, `dot(r, acts)` gives rows `r ..` × those tokens, `out[row][k]` (rows beyond
/// `rows` unused).
struct Tile<'a, 'b> {
    rows: usize,
    acts: &'a (dyn Fn(usize) -> quant::TileActs<'b> + Sync),
    dot: &'a (dyn Fn(usize, &quant::TileActs<'b>) -> Option<[[f32; 4]; 4]> + Sync),
}

/// The batched loop: chunks of weight rows in parallel; within a chunk, blocks of `tokens` tokens;
/// `tile`'s rows × four tokens, one row × four tokens (`d4`) where a tile computes them, else
/// one output at a time (`d1`). `y` is `n_tok × rows`, token-major.
fn blocks(rows: usize, n_tok: usize, rows_chunk: usize, tokens: usize, yp: &par::SharedMut<f32>, tile: Option<Tile<'_, '_>>, d4: &(dyn Fn(usize, usize) -> Option<[f32; 4]> + Sync), d1: &(dyn Fn(usize, usize) -> f32 + Sync)) {
    par::for_each(rows.div_ceil(rows_chunk), |ci| {
        let (r0, r1) = (ci * rows_chunk, ((ci + 1) * rows_chunk).min(rows));
        for t0 in (0..n_tok).step_by(tokens) {
            let t1 = (t0 + tokens).min(n_tok);
            let mut r = r0;
            // Several weight rows × four tokens at once where the CPU has a tile for it (AArch64
            // `smmla`: two rows; wasm SIMD128: four); every output keeps its single dot's bits.
            // The rest row by row below.
            let tile = tile.as_ref().filter(|tl| r0 + tl.rows <= r1);
            let acts: Vec<_> = tile.map(|tl| (t0..t1.saturating_sub(3)).step_by(4).map(|t| (tl.acts)(t)).collect()).unwrap_or_default();
            while let Some(tl) = tile.filter(|tl| r + tl.rows <= r1) {
                let n_rows = tl.rows;
                let mut t = t0;
                while t + 4 <= t1 {
                    let Some(v) = (tl.dot)(r, &acts[(t - t0) / 4]) else { break };
                    for (i, row) in v.into_iter().take(n_rows).enumerate() {
                        for (k, v) in row.into_iter().enumerate() {
                            // SAFETY: chunk `ci` alone writes rows r0..r1 of every token, within y.
                            unsafe { yp.write((t + k) * rows + r + i, v) };
                        }
                    }
                    t += 4;
                }
                for t in t..t1 {
                    for i in 0..n_rows {
                        // SAFETY: as above.
                        unsafe { yp.write(t * rows + r + i, d1(r + i, t)) };
                    }
                }
                r += n_rows;
            }
            for r in r..r1 {
                let mut t = t0;
                while t + 4 <= t1 {
                    let Some(v) = d4(r, t) else { break };
                    for (k, v) in v.into_iter().enumerate() {
                        // SAFETY: chunk `ci` alone writes rows r0..r1 of every token, within y.
                        unsafe { yp.write((t + k) * rows + r, v) };
                    }
                    t += 4;
                }
                for t in t..t1 {
                    // SAFETY: as above.
                    unsafe { yp.write(t * rows + r, d1(r, t)) };
                }
            }
        }
    });
}

/// How fast matrix-vector products run on each thread count from 1 to [`par::pool_threads`]:
/// ms per product of a 1536 × 576 Q4_0 matrix (SmolLM2-135M's FFN shape, 0.5 MB: a decode
/// step's typical section), each count's `reps` products timed together, counts interleaved
/// over `rounds` rounds after a warm-up on all threads (workers woken, caches warm); the best
/// round per count (the least disturbed by other work). Leaves the pool on all its threads. The
/// browser picks its default thread count from this at load ([`pick_threads`]).
pub fn time_threads(rounds: usize, reps: usize, now_ms: impl Fn() -> f64) -> Vec<f64> {
    const ROWS: usize = 1536;
    const COLS: usize = 576;
    let ty = GgmlType::Q4_0;
    let row_b = ty.row_bytes(COLS as u64).unwrap_or(0) as usize;
    let block = ty.type_size();
    // Quants from a fixed pattern; every block's scale a normal half (1/64).
    let mut data: Vec<u8> = (0..ROWS * row_b).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    for b in data.chunks_mut(block) {
        b[..2].copy_from_slice(&half::f16::from_f32(1.0 / 64.0).to_le_bytes());
    }
    let x: Vec<f32> = (0..COLS).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    let w = WeightRef { ty, cols: COLS, rows: ROWS, data: &data, repacked: false };
    let mut y = vec![0f32; ROWS];
    let n = par::pool_threads();
    let mut times = vec![f64::INFINITY; n];
    for _ in 0..reps.max(1) {
        matmul(w, &mut Acts::new(&x, COLS), &mut y);
    }
    for round in 0..rounds.max(1) {
        for i in 0..n {
            // Rotate the order each round, so no count always runs first (warm-up) or last.
            let k = (i + round) % n;
            par::use_threads(k + 1);
            let t0 = now_ms();
            for _ in 0..reps.max(1) {
                matmul(w, &mut Acts::new(&x, COLS), &mut y);
            }
            times[k] = times[k].min((now_ms() - t0) / reps.max(1) as f64);
        }
    }
    par::use_threads(n);
    times
}

/// The thread count to use from [`time_threads`]' times (index `k` = `k + 1` threads): the
/// fewest threads within 5% of the fastest (another thread that buys less costs the device's
/// power and the page's other work a core).
pub fn pick_threads(times: &[f64]) -> usize {
    let best = times.iter().copied().fold(f64::INFINITY, f64::min);
    times.iter().position(|&t| t <= best * 1.05).map_or(1, |k| k + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_fewest_threads_within_five_percent_of_the_fastest() {
        assert_eq!(pick_threads(&[10.0, 6.0, 5.8, 7.0]), 2); // 6.0 <= 5.8 × 1.05
        assert_eq!(pick_threads(&[10.0, 6.2, 5.8]), 3);
        assert_eq!(pick_threads(&[4.0, 6.0]), 1);
        assert_eq!(pick_threads(&[]), 1);
    }

    /// Every thread count of the pool is timed, and the pool is left on all its threads.
    #[test]
    fn times_every_thread_count_and_leaves_the_pool_whole() {
        let t = time_threads(1, 1, crate::clock::now_ms);
        assert_eq!(t.len(), par::pool_threads());
        assert!(t.iter().all(|&ms| ms > 0.0 && ms.is_finite()), "{t:?}");
        assert_eq!(par::n_threads(), par::pool_threads());
    }
}
