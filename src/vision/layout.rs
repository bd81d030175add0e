//! Where an image goes in the prompt, as llama.cpp's mtmd lays it out (`mtmd.cpp`,
//! `mtmd_tokenize`, `MTMD_SLICE_TMPL_MINICPMV_2_6`; `mtmd-cli.cpp` `eval_message`):
//!
//! `<image>` overview `</image>` then, when sliced, per grid row `<slice>` slice `</slice>` for
//! each column, rows separated by `"\n"` (none after the last). Each piece is one chunk of
//! embeddings, decoded as its own batch at the next positions: mtmd's llava-uhd chunks keep the
//! default `MTMD_POS_TYPE_NORMAL` (`split_batch_to_chunk` sets no M-RoPE layout), so even with
//! an IMROPE text model (`qwen35`, `qwen35moe`) row i of a chunk at p0 is at `p0 + i` in every
//! section: the text model's plain RoPE (checked against llama.cpp's decoder positions).

use super::image::RgbF32;
use super::VisionError;

/// The default media marker in prompts (`mtmd_default_marker()`).
pub const MARKER: &str = "<__media__>";

/// One chunk of a prompt: text tokens, or one image piece (its prepared pixels, encoded into
/// `rows` embeddings when the chunk has to run: a cached image is not encoded again).
#[derive(Clone, Debug, PartialEq)]
pub enum Chunk {
    Text(Vec<u32>),
    /// `id` names the image (its content hash) and piece.
    Image { rows: usize, piece: RgbF32, id: String },
}

impl Chunk {
    pub fn n_tokens(&self) -> usize {
        match self {
            Chunk::Text(t) => t.len(),
            Chunk::Image { rows, .. } => *rows,
        }
    }
}

/// The marker tokens of MiniCPM-V 2.6 and later, looked up in the text model's vocabulary.
#[derive(Clone, Copy, Debug)]
pub struct Markers {
    pub image_start: u32,
    pub image_end: u32,
    pub slice_start: u32,
    pub slice_end: u32,
    pub row_end: u32,
}

impl Markers {
    /// `lookup(text)`: the token whose piece is exactly `text` (mtmd's `lookup_token`).
    pub fn find(lookup: impl Fn(&str) -> Option<u32>) -> Result<Self, VisionError> {
        let f = |s: &str| lookup(s).ok_or_else(|| VisionError::NoMarker(s.to_string()));
        Ok(Self { image_start: f("<image>")?, image_end: f("</image>")?, slice_start: f("<slice>")?, slice_end: f("</slice>")?, row_end: f("\n")? })
    }
}

/// The chunks of one image: its pieces (overview first, then the slices row by row; each with
/// its embedding rows) between the marker tokens, appended to `out` (text tokens merge into a
/// preceding text chunk).
pub fn push_image(out: &mut Vec<Chunk>, m: &Markers, pieces: Vec<(usize, RgbF32)>, grid: (usize, usize), id: &str) {
    let text = |out: &mut Vec<Chunk>, t: u32| match out.last_mut() {
        Some(Chunk::Text(v)) => v.push(t),
        _ => out.push(Chunk::Text(vec![t])),
    };
    let mut it = pieces.into_iter().enumerate();
    if let Some((i, (rows, piece))) = it.next() {
        text(out, m.image_start);
        out.push(Chunk::Image { rows, piece, id: format!("{id}/{i}") });
        text(out, m.image_end);
    }
    let (cols, nrows) = grid;
    for y in 0..nrows {
        for _ in 0..cols {
            if let Some((i, (rows, piece))) = it.next() {
                text(out, m.slice_start);
                out.push(Chunk::Image { rows, piece, id: format!("{id}/{i}") });
                text(out, m.slice_end);
            }
        }
        if y + 1 != nrows {
            text(out, m.row_end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_and_rows_follow_mtmd() {
        let m = Markers { image_start: 1, image_end: 2, slice_start: 3, slice_end: 4, row_end: 5 };
        let mut out = vec![Chunk::Text(vec![9])];
        let piece = |n: usize| (n, RgbF32 { w: 1, h: 1, px: vec![0.0; 3] });
        push_image(&mut out, &m, vec![piece(4), piece(2), piece(2), piece(2), piece(2)], (2, 2), "x");
        let shape: Vec<String> = out.iter().map(|c| match c { Chunk::Text(t) => format!("{t:?}"), Chunk::Image { rows, .. } => format!("E{rows}") }).collect();
        assert_eq!(shape, ["[9, 1]", "E4", "[2, 3]", "E2", "[4, 3]", "E2", "[4, 5, 3]", "E2", "[4, 3]", "E2", "[4]"]);
    }
}
