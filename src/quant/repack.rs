//! Weight rows repacked four at a time, for the wasm relaxed-SIMD kernels.
//!
//! A 128-bit lane set holds one i32 per row, so four rows' integer block sums come out of
//! `relaxed_dot` instructions side by side when each 16-byte vector holds four bytes of each of
//! four rows: no horizontal sums, and one load of the four rows' scales. This is ggml's
//! `block_q4_0x4` idea (`ggml/src/ggml-cpu/repack.cpp`, `blck_size_interleave = 4`) for the
//! 32-element block types, without ggml's change of the quants' values: the bytes are only moved.
//!
//! Layout of a matrix of `rows` rows: rows `4g .. 4g + 4` (every whole group of four) hold
//! `4 × row_bytes` bytes, block after block; block `i` of a group is
//! - each scale of the block type in its order (`d`; Q4_1: `d`, then `m`) for the four rows,
//!   four f16 each (8 or 16 bytes),
//! - the blocks' quant bytes in chunks of four: chunk `c` of rows 0, 1, 2, 3, then chunk `c + 1`…
//!   (Q4_0 / Q4_1: 16 bytes a row, byte `k` holding elements `k` and `k + 16`; Q8_0: 32).
//!
//! The last `rows % 4` rows stay as they were. Repacking moves bytes within each group only
//! (no size change, in place), so a matrix's byte offsets of row groups are unchanged, and
//! [`unpack`] restores the file's bytes exactly. Every block's scales must be finite (the wasm
//! kernels convert them without the infinity/NaN path): [`pack`] leaves a matrix with any other
//! scale as it was.
//!
//! Products ([`matvec`], [`Rows4Dot`]) give every output the bits of [`super::vec_dot`] on the
//! plain row with the portable kernels' order: the wasm kernels per lane compute the same exact
//! integer block sum and the same f32 operations; elsewhere (tests) the rows are unpacked and
//! dotted.

use super::{vec_dot, vec_dot_type, GgmlType};

/// The block types with a repacked layout: `(block bytes, scale bytes at the front)`.
fn parts(ty: GgmlType) -> Option<(usize, usize)> {
    match ty {
        GgmlType::Q4_0 => Some((18, 2)),
        GgmlType::Q4_1 => Some((20, 4)),
        GgmlType::Q8_0 => Some((34, 2)),
        _ => None,
    }
}

/// Whether matrices of `ty` with rows of `cols` elements can be repacked.
pub fn supported(ty: GgmlType, cols: usize) -> bool {
    parts(ty).is_some() && cols > 0 && cols % 32 == 0
}

static OFF: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether loading repacks: on builds whose kernels read the layout (wasm relaxed SIMD; other
/// builds would only unpack it again, they run it in tests), unless [`set_enabled`] said no.
pub fn pays() -> bool {
    cfg!(all(target_arch = "wasm32", target_feature = "simd128", target_feature = "relaxed-simd")) && !OFF.load(std::sync::atomic::Ordering::Relaxed)
}

/// Repack what loads from now on (the default) or keep the file's layout (comparisons; the same
/// bits either way).
pub fn set_enabled(on: bool) {
    OFF.store(!on, std::sync::atomic::Ordering::Relaxed);
}

/// Where row `j`'s byte `k` of a block goes in the repacked block of its group (`4 × block
/// bytes`; `sc` scale bytes at the front of a block).
#[inline]
fn packed_at(sc: usize, j: usize, k: usize) -> usize {
    if k < sc {
        // Scale `k / 2` (a half), row `j`.
        (k / 2) * 8 + 2 * j + k % 2
    } else {
        let q = k - sc;
        4 * sc + (q / 4) * 16 + 4 * j + q % 4
    }
}

/// Repack the whole groups of four rows of a `cols` × `rows` matrix of `ty` (`data`: its
/// `rows` plain rows) in place. Returns false, leaving `data` unchanged, where the type is not
/// [`supported`], the size is not `rows` rows, or a block's scale is infinite or NaN.
pub fn pack(ty: GgmlType, cols: usize, rows: usize, data: &mut [u8]) -> bool {
    let Some((bs, sc)) = parts(ty).filter(|_| supported(ty, cols)) else { return false };
    let rb = cols / 32 * bs;
    if data.len() != rb * rows {
        return false;
    }
    let groups = rows / 4;
    let finite = |b: &[u8]| (0..sc / 2).all(|s| u16::from_le_bytes([b[2 * s], b[2 * s + 1]]) & 0x7c00 != 0x7c00);
    if !data[..groups * 4 * rb].chunks_exact(bs).all(finite) {
        return false;
    }
    let mut tmp = vec![0u8; 4 * rb];
    for g in data[..groups * 4 * rb].chunks_exact_mut(4 * rb) {
        tmp.copy_from_slice(g);
        for i in 0..cols / 32 {
            for j in 0..4 {
                let src = &tmp[j * rb + i * bs..j * rb + (i + 1) * bs];
                for (k, &b) in src.iter().enumerate() {
                    g[4 * bs * i + packed_at(sc, j, k)] = b;
                }
            }
        }
    }
    true
}

/// Undo [`pack`]: the plain rows again, byte for byte.
pub fn unpack(ty: GgmlType, cols: usize, rows: usize, data: &mut [u8]) {
    let Some((bs, _)) = parts(ty).filter(|_| supported(ty, cols)) else { return };
    let rb = cols / 32 * bs;
    if data.len() != rb * rows {
        return;
    }
    let mut tmp = vec![0u8; 4 * rb];
    for g in data[..rows / 4 * 4 * rb].chunks_exact_mut(4 * rb) {
        tmp.copy_from_slice(g);
        for j in 0..4 {
            group_row(ty, cols, &tmp, j, &mut g[j * rb..(j + 1) * rb]);
        }
    }
}

/// Row `j` (0..4) of a repacked group `g` (`4 × row_bytes` bytes) as its plain bytes in `out`
/// (`row_bytes` long).
pub fn group_row(ty: GgmlType, cols: usize, g: &[u8], j: usize, out: &mut [u8]) {
    let Some((bs, sc)) = parts(ty) else { return };
    for (i, blk) in out.chunks_exact_mut(bs).take(cols / 32).enumerate() {
        for (k, b) in blk.iter_mut().enumerate() {
            *b = g[4 * bs * i + packed_at(sc, j, k)];
        }
    }
}

/// Row `r`'s plain bytes (`out`, `row_bytes` long) of a repacked matrix of `rows` rows (`data`).
pub fn row(ty: GgmlType, cols: usize, rows: usize, data: &[u8], r: usize, out: &mut [u8]) {
    let rb = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
    if r >= rows / 4 * 4 {
        out.copy_from_slice(&data[r * rb..(r + 1) * rb]);
    } else {
        let g = r / 4;
        group_row(ty, cols, &data[g * 4 * rb..(g + 1) * 4 * rb], r % 4, out);
    }
}

/// `y[r] = dot(row r, act)` for the rows of `w`: `y.len() / 4` repacked groups, then
/// `y.len() % 4` plain rows (a piece of a repacked matrix that starts at a group; `act` as for
/// [`super::matvec`]). Each output has the bits of [`vec_dot`] of its plain row with the
/// portable order (the wasm relaxed-SIMD kernels), or of `vec_dot` itself elsewhere.
pub fn matvec(ty: GgmlType, n: usize, w: &[u8], act: &[u8], y: &mut [f32]) {
    let rb = ty.row_bytes(n as u64).unwrap_or(0) as usize;
    if !supported(ty, n) || w.len() < rb * y.len() {
        y.fill(f32::NAN);
        return;
    }
    let quads = y.len() / 4;
    let (y4, y_rest) = y.split_at_mut(quads * 4);
    // SAFETY: sizes checked above (the groups) and here (the activation); relaxed SIMD is compiled in.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128", target_feature = "relaxed-simd"))]
    let done = act.len() >= n / 32 * vec_dot_type(ty).type_size() && unsafe { super::wasm::rows4_matvec(ty, n, &w[..quads * 4 * rb], act, y4) };
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128", target_feature = "relaxed-simd")))]
    let done = false;
    if !done {
        for (q, yq) in y4.chunks_exact_mut(4).enumerate() {
            unpacked_dots(ty, n, &w[q * 4 * rb..(q + 1) * 4 * rb], &[act], |j, _, v| yq[j] = v);
        }
    }
    for (yr, wr) in y_rest.iter_mut().zip(w[quads * 4 * rb..].chunks_exact(rb)) {
        *yr = vec_dot(ty, n, wr, act);
    }
}

/// Where no kernel reads the layout: each row of group `g` unpacked and dotted with each of
/// `acts` by [`vec_dot`], `out(row, k, value)`.
fn unpacked_dots(ty: GgmlType, n: usize, g: &[u8], acts: &[&[u8]], mut out: impl FnMut(usize, usize, f32)) {
    let mut plain = vec![0u8; ty.row_bytes(n as u64).unwrap_or(0) as usize];
    for j in 0..4 {
        group_row(ty, n, g, j, &mut plain);
        for (k, act) in acts.iter().enumerate() {
            out(j, k, vec_dot(ty, n, &plain, act));
        }
    }
}

/// Batched products with a repacked matrix: a group of four rows × up to four activation rows
/// per call, the activation rows prepared once ([`Rows4Dot::prepare`]) for every group.
pub struct Rows4Dot {
    ty: GgmlType,
    n: usize,
    a_need: usize,
}

/// Up to four activation rows made ready for [`Rows4Dot::dot`].
pub struct Rows4Acts<'a> {
    acts: Vec<&'a [u8]>,
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128", target_feature = "relaxed-simd"))]
    prep: Vec<super::wasm::ActBlock>,
}

impl Rows4Dot {
    /// For repacked matrices of `ty` with rows of `n` elements; `None` where not [`supported`].
    pub fn new(ty: GgmlType, n: usize) -> Option<Self> {
        supported(ty, n).then(|| Self { ty, n, a_need: n / 32 * vec_dot_type(ty).type_size() })
    }

    /// Activation rows `acts` (1 to 4, each converted to the vec-dot type) made ready for
    /// [`Self::dot`] with every group.
    pub fn prepare<'a>(&self, acts: &[&'a [u8]]) -> Rows4Acts<'a> {
        let acts: Vec<&'a [u8]> = acts.iter().take(4).copied().collect();
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128", target_feature = "relaxed-simd"))]
        let prep = {
            let mut v = Vec::new();
            if acts.iter().all(|a| a.len() >= self.a_need) {
                // SAFETY: sizes checked; relaxed SIMD is compiled in.
                unsafe { super::wasm::rows4_prepare(self.ty, self.n, &acts, &mut v) };
            }
            v
        };
        Rows4Acts {
            acts,
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128", target_feature = "relaxed-simd"))]
            prep,
        }
    }

    /// Group `g` (`4 × row_bytes` repacked bytes) × the prepared activation rows: `out[row][k]`
    /// for `k < acts` (the rest 0), each the bits of the plain row's single dot. NaN where a
    /// size is short.
    pub fn dot(&self, g: &[u8], a: &Rows4Acts<'_>) -> [[f32; 4]; 4] {
        let rb = self.ty.row_bytes(self.n as u64).unwrap_or(0) as usize;
        if g.len() < 4 * rb || a.acts.iter().any(|x| x.len() < self.a_need) {
            return [[f32::NAN; 4]; 4];
        }
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128", target_feature = "relaxed-simd"))]
        if !a.prep.is_empty() {
            // SAFETY: sizes checked above and by `prepare`; relaxed SIMD is compiled in.
            if let Some(v) = unsafe { super::wasm::rows4_dot(self.ty, self.n, g, &a.prep, a.acts.len()) } {
                return v;
            }
        }
        let mut out = [[0f32; 4]; 4];
        unpacked_dots(self.ty, self.n, g, &a.acts, |j, k, v| out[j][k] = v);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(ty: GgmlType, cols: usize, rows: usize, seed: u32) -> Vec<u8> {
        let rb = ty.row_bytes(cols as u64).unwrap() as usize;
        let (bs, sc) = parts(ty).unwrap();
        let mut v: Vec<u8> = (0..rb * rows).map(|i| ((i as u32 ^ seed).wrapping_mul(2654435761) >> 23) as u8).collect();
        for b in v.chunks_exact_mut(bs) {
            for s in 0..sc / 2 {
                let h = half::f16::from_f32(0.01 + (b[2 * s + 4] as f32) / 4096.0 * if s == 0 { 1.0 } else { -1.0 });
                b[2 * s..2 * s + 2].copy_from_slice(&h.to_le_bytes());
            }
        }
        v
    }

    /// Packing moves every byte of a whole group and none of the tail; unpacking and single
    /// rows give the file's bytes back; every kind of product keeps the plain rows' bits.
    #[test]
    fn packs_in_place_and_keeps_every_product() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (cols, rows) = (96, 10);
            let rb = ty.row_bytes(cols as u64).unwrap() as usize;
            let plain = matrix(ty, cols, rows, ty as u32);
            let mut w = plain.clone();
            assert!(pack(ty, cols, rows, &mut w));
            assert_ne!(w[..8 * rb], plain[..8 * rb], "{ty}");
            assert_eq!(w[8 * rb..], plain[8 * rb..], "{ty}: the tail rows stay");
            let mut sorted = (w[..4 * rb].to_vec(), plain[..4 * rb].to_vec());
            sorted.0.sort_unstable();
            sorted.1.sort_unstable();
            assert_eq!(sorted.0, sorted.1, "{ty}: bytes moved within the group");
            // Block 0 of group 0: row 1's first scale is bytes 2..4, row 2's quant chunk 0 at 4 × sc + 8.
            let sc = parts(ty).unwrap().1;
            assert_eq!(w[2..4], plain[rb..rb + 2], "{ty}");
            assert_eq!(w[4 * sc + 8..4 * sc + 12], plain[2 * rb + sc..2 * rb + sc + 4], "{ty}");
            let mut out = vec![0u8; rb];
            for r in 0..rows {
                row(ty, cols, rows, &w, r, &mut out);
                assert_eq!(out, plain[r * rb..(r + 1) * rb], "{ty} row {r}");
            }
            let x: Vec<Vec<f32>> = (0..4).map(|t| (0..cols).map(|i| ((i * 7 + t * 13) % 23) as f32 / 11.0 - 1.0).collect()).collect();
            let acts: Vec<Vec<u8>> = x
                .iter()
                .map(|x| {
                    let mut a = Vec::new();
                    super::super::quantize_activation(vec_dot_type(ty), x, &mut a).unwrap();
                    a
                })
                .collect();
            let want = |r: usize, t: usize| vec_dot(ty, cols, &plain[r * rb..(r + 1) * rb], &acts[t]);
            let mut y = vec![0f32; rows];
            matvec(ty, cols, &w, &acts[0], &mut y);
            for (r, v) in y.iter().enumerate() {
                assert_eq!(v.to_bits(), want(r, 0).to_bits(), "{ty} matvec row {r}");
            }
            let d = Rows4Dot::new(ty, cols).unwrap();
            for k in 1..=4 {
                let refs: Vec<&[u8]> = acts[..k].iter().map(|a| a.as_slice()).collect();
                let p = d.prepare(&refs);
                for g in 0..rows / 4 {
                    let v = d.dot(&w[g * 4 * rb..(g + 1) * 4 * rb], &p);
                    for j in 0..4 {
                        for t in 0..k {
                            assert_eq!(v[j][t].to_bits(), want(4 * g + j, t).to_bits(), "{ty} group {g} row {j} token {t}");
                        }
                    }
                }
            }
            unpack(ty, cols, rows, &mut w);
            assert_eq!(w, plain, "{ty}: unpacked");
        }
    }

    /// What cannot be repacked is left alone: other types, a size that is not `rows` rows, a
    /// block with an infinite or NaN scale.
    #[test]
    fn leaves_what_it_cannot_pack() {
        let (cols, rows) = (64, 8);
        let mut w = matrix(GgmlType::Q4_1, cols, rows, 1);
        let plain = w.clone();
        assert!(!pack(GgmlType::Q4_1, cols, rows + 1, &mut w));
        assert!(!pack(GgmlType::Q5_0, cols, rows, &mut w));
        let m_at = GgmlType::Q4_1.row_bytes(cols as u64).unwrap() as usize * 5 + 20 + 2;
        w[m_at..m_at + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
        let held = w.clone();
        assert!(!pack(GgmlType::Q4_1, cols, rows, &mut w));
        assert_eq!(w, held);
        w = plain;
        w[m_at..m_at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
        assert!(!pack(GgmlType::Q4_1, cols, rows, &mut w));
        assert!(!supported(GgmlType::Q8_0, 48));
    }
}
