//! The packed bundle (`les pack IN.gguf OUT.les`): the dense weights as an embedded GGUF, and
//! every expert as one contiguous, 4 KiB-aligned, checksummed block, so that an expert costs one
//! range read (one `pread`, one HTTP range request) instead of three.
//!
//! # Format (version 1, all integers little-endian)
//!
//! ```text
//! [0, 128)                        header
//! [128, 128 + manifest_len)       manifest (one range read)
//! [dense_off, +dense_len)         dense GGUF v3 (dense_off 4096-aligned)
//! [experts_off, file_len)         expert blocks, layer-major, each 4096-aligned, zero padded
//! ```
//!
//! **Header** (128 bytes):
//!
//! | off | size | field |
//! |----:|----:|---|
//! | 0 | 8 | magic `"LESBUNDL"` |
//! | 8 | 4 | version (1) |
//! | 12 | 4 | header length (128) |
//! | 16 | 8 | file length (whole bundle; a truncated file is detected here) |
//! | 24 | 8 | manifest offset |
//! | 32 | 8 | manifest length |
//! | 40 | 4 | manifest crc32 |
//! | 44 | 4 | block alignment (4096) |
//! | 48 | 8 | dense GGUF offset |
//! | 56 | 8 | dense GGUF length |
//! | 64 | 4 | dense GGUF crc32 (checked by [`Bundle::verify`], not at open) |
//! | 68 | 4 | number of MoE layers |
//! | 72 | 8 | expert section offset |
//! | 80 | 8 | expert section length (to the end of the file) |
//! | 88 | 4 | experts per layer |
//! | 92 | 32 | reserved (zero) |
//! | 124 | 4 | header crc32 of bytes [0, 124) |
//!
//! **Manifest** (binary, fixed-size records; its length is exactly
//! `32 + pad8(name_len) + 64 * n_layers + 24 * n_layers * n_expert`):
//!
//! ```text
//! 0   8  magic "LESMANIF"
//! 8   4  n_layers            12  4  n_expert
//! 16  8  source GGUF size    24  4  source name length (bytes, <= 4096)    28  4  reserved
//! 32     source name (UTF-8), zero padded to a multiple of 8
//! then n_layers layer records, 64 bytes each:
//!     u32 blk (GGUF block index `N` of blk.N), u32 gate type, u32 up type, u32 down type (ggml ids),
//!     u64 n_embd, u64 n_ff, u64 gate bytes, u64 up bytes, u64 down bytes, u64 reserved
//! then n_layers * n_expert block records (layer-major), 24 bytes each:
//!     u64 offset (absolute), u64 size, u32 crc32 (of the block's `size` bytes), u32 reserved
//! ```
//!
//! A binary manifest rather than JSON: every record has a fixed size, so the manifest's length
//! follows from two counts and is checked exactly before anything is parsed; a block's record is
//! found by index with no parser (a browser reads it with a `DataView`); and it is small (24 bytes
//! per expert: 1,920 experts take 46 KiB).
//!
//! **Expert block** `(l, e)`: expert `e`'s gate bytes ‖ up bytes ‖ down bytes, exactly as
//! [`super::ExpertBlock::read_from_gguf`] concatenates the three ranges of the stacked GGUF tensors,
//! so a block read from the bundle is byte-identical to what [`super::store::GgufExpertStore`]
//! returns. Blocks start on 4096-byte boundaries and are zero padded to the next one (the file
//! length is a multiple of 4096 too), so O_DIRECT reads of whole pages stay inside the file.
//!
//! **Dense GGUF**: the source's metadata (in order) plus `les.bundle.version` (u32), and every
//! tensor of the source except the stacked expert tensors `blk.N.ffn_{gate,up,down}_exps.weight`,
//! in source order, with the source's alignment.
//!
//! [`Bundle::open`] checks the header checksum, the file length, that every section and block lies
//! inside the file in order without overlap, the manifest checksum, that every layout's byte sizes
//! follow from its shape and types, and parses the dense GGUF header. Every block is checksummed on
//! every read by [`BundleExpertStore`].

use super::store::ExpertStore;
use super::{ExpertError, ExpertLayout, GgufExpertTensors};
use crate::gguf::writer::{plan_gguf, write_gguf, write_zeros, TensorData, WriteError, WriteTensor};
use crate::gguf::{GgufError, GgufFile, Value};
use crate::quant::GgmlType;
use crate::store::sub::SubSource;
use crate::store::{ByteSource, StoreError};
use std::collections::BTreeMap;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::sync::Arc;

pub const BUNDLE_MAGIC: [u8; 8] = *b"LESBUNDL";
pub const MANIFEST_MAGIC: [u8; 8] = *b"LESMANIF";

/// Whether `src` starts with the bundle magic (a `.les` bundle rather than a GGUF).
pub fn is_bundle(src: &dyn ByteSource) -> bool {
    let mut m = [0u8; 8];
    src.len() >= 8 && src.read_at(0, &mut m).is_ok() && m == BUNDLE_MAGIC
}
pub const BUNDLE_VERSION: u32 = 1;
pub const HEADER_LEN: u64 = 128;
pub const BLOCK_ALIGN: u64 = 4096;
/// Metadata key added to the embedded dense GGUF.
pub const VERSION_KEY: &str = "les.bundle.version";
const LAYER_RECORD: u64 = 64;
const BLOCK_RECORD: u64 = 24;
const MAX_NAME: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("writing bundle: {0}")]
    Io(#[from] std::io::Error),
    #[error("source GGUF: {0}")]
    Source(GgufError),
    #[error("cannot pack: {0}")]
    Unsupported(String),
    #[error("writing the dense GGUF: {0}")]
    Write(#[from] WriteError),
    #[error("not a LES bundle (magic {0:02x?}, expected \"LESBUNDL\")")]
    BadMagic([u8; 8]),
    #[error("unsupported bundle version {0} (LES reads version {BUNDLE_VERSION})")]
    UnsupportedVersion(u32),
    #[error("truncated bundle: {what} needs {expected} bytes, the file has {actual}")]
    Truncated { what: &'static str, expected: u64, actual: u64 },
    #[error("bundle header checksum mismatch (stored {stored:08x}, computed {computed:08x})")]
    HeaderChecksum { stored: u32, computed: u32 },
    #[error("bundle manifest checksum mismatch (stored {stored:08x}, computed {computed:08x})")]
    ManifestChecksum { stored: u32, computed: u32 },
    #[error("bundle dense GGUF checksum mismatch (stored {stored:08x}, computed {computed:08x})")]
    DenseChecksum { stored: u32, computed: u32 },
    #[error("bundle block of expert {expert} of layer {layer}: checksum mismatch (stored {stored:08x}, computed {computed:08x})")]
    BlockChecksum { layer: usize, expert: usize, stored: u32, computed: u32 },
    #[error("corrupt bundle: {0}")]
    Corrupt(String),
    #[error("bundle's embedded dense GGUF: {0}")]
    Dense(GgufError),
}

fn corrupt(s: impl Into<String>) -> BundleError {
    BundleError::Corrupt(s.into())
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn rd_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn rd_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
fn wr_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn wr_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The fixed header (see the module docs for the byte layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleHeader {
    pub version: u32,
    pub file_len: u64,
    pub manifest_off: u64,
    pub manifest_len: u64,
    pub manifest_crc: u32,
    pub block_align: u32,
    pub dense_off: u64,
    pub dense_len: u64,
    pub dense_crc: u32,
    pub n_layers: u32,
    pub experts_off: u64,
    pub experts_len: u64,
    pub n_expert: u32,
}

impl BundleHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut b = [0u8; HEADER_LEN as usize];
        b[0..8].copy_from_slice(&BUNDLE_MAGIC);
        wr_u32(&mut b, 8, self.version);
        wr_u32(&mut b, 12, HEADER_LEN as u32);
        wr_u64(&mut b, 16, self.file_len);
        wr_u64(&mut b, 24, self.manifest_off);
        wr_u64(&mut b, 32, self.manifest_len);
        wr_u32(&mut b, 40, self.manifest_crc);
        wr_u32(&mut b, 44, self.block_align);
        wr_u64(&mut b, 48, self.dense_off);
        wr_u64(&mut b, 56, self.dense_len);
        wr_u32(&mut b, 64, self.dense_crc);
        wr_u32(&mut b, 68, self.n_layers);
        wr_u64(&mut b, 72, self.experts_off);
        wr_u64(&mut b, 80, self.experts_len);
        wr_u32(&mut b, 88, self.n_expert);
        let crc = crc32fast::hash(&b[..124]);
        wr_u32(&mut b, 124, crc);
        b
    }

    /// Parse and check the header (magic, version, checksum, and that the sections lie in order
    /// inside a file of `actual_len` bytes).
    pub fn decode(b: &[u8], actual_len: u64) -> Result<Self, BundleError> {
        if b.len() < HEADER_LEN as usize {
            return Err(BundleError::Truncated { what: "header", expected: HEADER_LEN, actual: b.len() as u64 });
        }
        let magic: [u8; 8] = b[0..8].try_into().unwrap();
        if magic != BUNDLE_MAGIC {
            return Err(BundleError::BadMagic(magic));
        }
        let version = rd_u32(b, 8);
        if version != BUNDLE_VERSION {
            return Err(BundleError::UnsupportedVersion(version));
        }
        let (stored, computed) = (rd_u32(b, 124), crc32fast::hash(&b[..124]));
        if stored != computed {
            return Err(BundleError::HeaderChecksum { stored, computed });
        }
        let h = Self {
            version,
            file_len: rd_u64(b, 16),
            manifest_off: rd_u64(b, 24),
            manifest_len: rd_u64(b, 32),
            manifest_crc: rd_u32(b, 40),
            block_align: rd_u32(b, 44),
            dense_off: rd_u64(b, 48),
            dense_len: rd_u64(b, 56),
            dense_crc: rd_u32(b, 64),
            n_layers: rd_u32(b, 68),
            experts_off: rd_u64(b, 72),
            experts_len: rd_u64(b, 80),
            n_expert: rd_u32(b, 88),
        };
        let header_len = rd_u32(b, 12);
        if header_len as u64 != HEADER_LEN {
            return Err(corrupt(format!("header length {header_len}, expected {HEADER_LEN}")));
        }
        if h.file_len > actual_len {
            return Err(BundleError::Truncated { what: "the bundle", expected: h.file_len, actual: actual_len });
        }
        if h.file_len < actual_len {
            return Err(corrupt(format!("{} bytes after the end of the bundle ({} bytes)", actual_len - h.file_len, h.file_len)));
        }
        if h.n_layers == 0 || h.n_expert == 0 {
            return Err(corrupt(format!("{} layers x {} experts", h.n_layers, h.n_expert)));
        }
        let (lo, hi) = (manifest_len(h.n_layers as u64, h.n_expert as u64, 0), manifest_len(h.n_layers as u64, h.n_expert as u64, MAX_NAME as u64));
        if lo.is_none_or(|lo| h.manifest_len < lo) || hi.is_none_or(|hi| h.manifest_len > hi) {
            return Err(corrupt(format!(
                "manifest length {} does not fit {} layers x {} experts",
                h.manifest_len, h.n_layers, h.n_expert
            )));
        }
        if h.block_align as u64 != BLOCK_ALIGN {
            return Err(corrupt(format!("block alignment {}, expected {BLOCK_ALIGN}", h.block_align)));
        }
        // Sections in order: header, manifest, dense GGUF, experts; none past the end of the file.
        let end = |what: &str, off: u64, len: u64| {
            off.checked_add(len).ok_or_else(|| corrupt(format!("{what} [{off}, +{len}) overflows")))
        };
        let m_end = end("manifest", h.manifest_off, h.manifest_len)?;
        let d_end = end("dense GGUF", h.dense_off, h.dense_len)?;
        let x_end = end("expert section", h.experts_off, h.experts_len)?;
        let order = [
            ("manifest start", HEADER_LEN, h.manifest_off),
            ("dense GGUF start", m_end, h.dense_off),
            ("expert section start", d_end, h.experts_off),
            ("expert section end", x_end, h.file_len),
        ];
        for (what, lo, at) in order {
            if at < lo {
                return Err(corrupt(format!("{what} at {at} overlaps the previous section (ends at {lo})")));
            }
        }
        if x_end != h.file_len {
            return Err(corrupt(format!("expert section ends at {x_end}, file at {}", h.file_len)));
        }
        if h.dense_off % BLOCK_ALIGN != 0 || h.experts_off % BLOCK_ALIGN != 0 {
            return Err(corrupt(format!("dense GGUF ({}) or expert section ({}) not {BLOCK_ALIGN}-aligned", h.dense_off, h.experts_off)));
        }
        Ok(h)
    }
}

/// One expert block's place in the bundle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEntry {
    /// Absolute offset in the bundle (a multiple of 4096).
    pub offset: u64,
    pub size: u64,
    pub crc32: u32,
}

/// The manifest: layouts of the MoE layers and where every expert block is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub n_expert: usize,
    /// Size of the GGUF the bundle was packed from (for reference).
    pub source_size: u64,
    /// Name of that GGUF as given to [`pack_named`] (for reference; may be empty).
    pub source_name: String,
    /// GGUF block index (`N` in `blk.N.`) of each MoE layer.
    pub layer_blk: Vec<u32>,
    pub layouts: Vec<ExpertLayout>,
    /// `n_layers * n_expert` entries, layer-major.
    pub blocks: Vec<BlockEntry>,
}

/// Encoded length of a manifest with these counts and source name length.
pub fn manifest_len(n_layers: u64, n_expert: u64, name_len: u64) -> Option<u64> {
    let blocks = n_layers.checked_mul(n_expert)?.checked_mul(BLOCK_RECORD)?;
    (32 + align_up(name_len, 8)).checked_add(n_layers.checked_mul(LAYER_RECORD)?)?.checked_add(blocks)
}

fn layout_bytes(ty: GgmlType, row: u64, rows: u64) -> Option<u64> {
    if row % ty.block_size() as u64 != 0 {
        return None;
    }
    ty.row_bytes(row)?.checked_mul(rows)
}

impl Manifest {
    pub fn block(&self, layer: usize, expert: usize) -> Option<&BlockEntry> {
        if layer >= self.layouts.len() || expert >= self.n_expert {
            return None;
        }
        self.blocks.get(layer * self.n_expert + expert)
    }

    pub fn encode(&self) -> Vec<u8> {
        let name = self.source_name.as_bytes();
        let name = &name[..name.len().min(MAX_NAME)];
        let n_layers = self.layouts.len() as u64;
        let len = manifest_len(n_layers, self.n_expert as u64, name.len() as u64).expect("manifest size overflows");
        let mut b = vec![0u8; len as usize];
        b[0..8].copy_from_slice(&MANIFEST_MAGIC);
        wr_u32(&mut b, 8, n_layers as u32);
        wr_u32(&mut b, 12, self.n_expert as u32);
        wr_u64(&mut b, 16, self.source_size);
        wr_u32(&mut b, 24, name.len() as u32);
        b[32..32 + name.len()].copy_from_slice(name);
        let mut at = 32 + align_up(name.len() as u64, 8) as usize;
        for (l, &blk) in self.layouts.iter().zip(&self.layer_blk) {
            wr_u32(&mut b, at, blk);
            wr_u32(&mut b, at + 4, l.gate_ty as u32);
            wr_u32(&mut b, at + 8, l.up_ty as u32);
            wr_u32(&mut b, at + 12, l.down_ty as u32);
            for (i, v) in [l.n_embd, l.n_ff, l.gate_bytes, l.up_bytes, l.down_bytes].into_iter().enumerate() {
                wr_u64(&mut b, at + 16 + 8 * i, v as u64);
            }
            at += LAYER_RECORD as usize;
        }
        for blk in &self.blocks {
            wr_u64(&mut b, at, blk.offset);
            wr_u64(&mut b, at + 8, blk.size);
            wr_u32(&mut b, at + 16, blk.crc32);
            at += BLOCK_RECORD as usize;
        }
        debug_assert_eq!(at, b.len());
        b
    }

    /// Parse the manifest and check it against the header: counts, exact length, layouts
    /// consistent with their shapes and types, blocks aligned, sized by their layout, in
    /// layer-major order without overlap, inside the expert section.
    pub fn decode(b: &[u8], h: &BundleHeader) -> Result<Self, BundleError> {
        if b.len() < 32 {
            return Err(corrupt(format!("manifest of {} bytes is shorter than its 32-byte header", b.len())));
        }
        if b[0..8] != MANIFEST_MAGIC {
            return Err(corrupt("manifest magic is not \"LESMANIF\""));
        }
        let (n_layers, n_expert) = (rd_u32(b, 8), rd_u32(b, 12));
        if n_layers != h.n_layers || n_expert != h.n_expert {
            return Err(corrupt(format!(
                "manifest has {n_layers} layers x {n_expert} experts, header {} x {}",
                h.n_layers, h.n_expert
            )));
        }
        if n_layers == 0 || n_expert == 0 {
            return Err(corrupt("no experts"));
        }
        let name_len = rd_u32(b, 24) as usize;
        if name_len > MAX_NAME {
            return Err(corrupt(format!("source name length {name_len} > {MAX_NAME}")));
        }
        let want = manifest_len(n_layers as u64, n_expert as u64, name_len as u64);
        if want != Some(b.len() as u64) {
            return Err(corrupt(format!("manifest is {} bytes, its counts need {want:?}", b.len())));
        }
        let source_name = String::from_utf8_lossy(&b[32..32 + name_len]).into_owned();
        let mut at = 32 + align_up(name_len as u64, 8) as usize;
        let (n_layers, n_expert) = (n_layers as usize, n_expert as usize);
        let mut layer_blk = Vec::with_capacity(n_layers);
        let mut layouts = Vec::with_capacity(n_layers);
        for il in 0..n_layers {
            let r = &b[at..at + LAYER_RECORD as usize];
            let ty = |i: usize| {
                let v = rd_u32(r, 4 + 4 * i);
                GgmlType::from_u32(v).ok_or_else(|| corrupt(format!("layer {il}: unknown ggml type {v}")))
            };
            let (gate_ty, up_ty, down_ty) = (ty(0)?, ty(1)?, ty(2)?);
            let v: Vec<u64> = (0..5).map(|i| rd_u64(r, 16 + 8 * i)).collect();
            let (n_embd, n_ff) = (v[0], v[1]);
            if n_embd == 0 || n_ff == 0 {
                return Err(corrupt(format!("layer {il}: zero dimension (n_embd {n_embd}, n_ff {n_ff})")));
            }
            let want = [layout_bytes(gate_ty, n_embd, n_ff), layout_bytes(up_ty, n_embd, n_ff), layout_bytes(down_ty, n_ff, n_embd)];
            for (i, (w, &got)) in want.iter().zip(&v[2..]).enumerate() {
                if *w != Some(got) {
                    return Err(corrupt(format!(
                        "layer {il}: {} matrix is {got} bytes, its shape and type need {w:?}",
                        ["gate", "up", "down"][i]
                    )));
                }
            }
            let us = |x: u64| usize::try_from(x).map_err(|_| corrupt(format!("layer {il}: size {x} too large for this machine")));
            let layout = ExpertLayout {
                n_embd: us(n_embd)?,
                n_ff: us(n_ff)?,
                gate_ty,
                up_ty,
                down_ty,
                gate_bytes: us(v[2])?,
                up_bytes: us(v[3])?,
                down_bytes: us(v[4])?,
            };
            // The sum must fit a usize as well (it is one buffer).
            us(v[2].checked_add(v[3]).and_then(|s| s.checked_add(v[4])).unwrap_or(u64::MAX))?;
            layer_blk.push(rd_u32(r, 0));
            layouts.push(layout);
            at += LAYER_RECORD as usize;
        }
        let x_end = h.experts_off.saturating_add(h.experts_len);
        let mut blocks = Vec::with_capacity(n_layers * n_expert);
        for (il, layout) in layouts.iter().enumerate() {
            let want = layout.bytes() as u64;
            for e in 0..n_expert {
                let blk = BlockEntry { offset: rd_u64(b, at), size: rd_u64(b, at + 8), crc32: rd_u32(b, at + 16) };
                at += BLOCK_RECORD as usize;
                let bad = |why: String| corrupt(format!("block of expert {e} of layer {il} at {}: {why}", blk.offset));
                if blk.offset % BLOCK_ALIGN != 0 {
                    return Err(bad(format!("not {BLOCK_ALIGN}-aligned")));
                }
                if blk.size != want {
                    return Err(bad(format!("size {} but the layer's layout needs {want}", blk.size)));
                }
                if blk.offset < h.experts_off {
                    return Err(bad(format!("starts before the expert section (at {})", h.experts_off)));
                }
                match blk.offset.checked_add(blk.size) {
                    Some(end) if end <= x_end => {}
                    _ => return Err(bad(format!("size {} runs past the expert section (ends at {x_end})", blk.size))),
                }
                blocks.push(blk);
            }
        }
        // Blocks may lie in any order (`pack_ordered`), but never overlap.
        let mut by_offset: Vec<(u64, u64, usize)> = blocks.iter().enumerate().map(|(i, b)| (b.offset, b.offset + b.size, i)).collect();
        by_offset.sort_unstable();
        for w in by_offset.windows(2) {
            if w[1].0 < w[0].1 {
                let (il, e) = (w[1].2 / n_expert.max(1), w[1].2 % n_expert.max(1));
                return Err(corrupt(format!("block of expert {e} of layer {il} at {}: overlaps another block (which ends at {})", w[1].0, w[0].1)));
            }
        }
        Ok(Self { n_expert, source_size: rd_u64(b, 16), source_name, layer_blk, layouts, blocks })
    }
}

/// What [`pack`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackSummary {
    pub file_len: u64,
    pub n_layers: usize,
    pub n_expert: usize,
    pub manifest_len: u64,
    pub dense_len: u64,
    pub n_dense_tensors: usize,
    /// Sum of all expert block sizes (without padding).
    pub expert_bytes: u64,
    /// Zero padding in the expert section.
    pub padding_bytes: u64,
}

/// The MoE layers of a GGUF: `(blk, tensors)` in block order, and the experts per layer.
fn expert_layers(g: &GgufFile) -> Result<(Vec<(u32, GgufExpertTensors)>, usize), BundleError> {
    let mut found: BTreeMap<u32, [bool; 3]> = BTreeMap::new();
    for t in &g.tensors {
        let Some(rest) = t.name.strip_prefix("blk.") else { continue };
        let Some((n, kind)) = rest.split_once('.') else { continue };
        let which = match kind {
            "ffn_gate_exps.weight" => 0,
            "ffn_up_exps.weight" => 1,
            "ffn_down_exps.weight" => 2,
            _ => continue,
        };
        let Ok(num) = n.parse::<u32>() else { continue };
        if num.to_string() != n {
            continue; // "blk.01." is not what the model loader looks up for block 1
        }
        let n = num;
        found.entry(n).or_default()[which] = true;
    }
    if found.is_empty() {
        return Err(BundleError::Unsupported("the GGUF has no expert tensors (blk.N.ffn_{gate,up,down}_exps.weight); only MoE models can be packed".into()));
    }
    let (&first, _) = found.iter().next().unwrap();
    let gate = g.req_tensor(&format!("blk.{first}.ffn_gate_exps.weight")).map_err(BundleError::Source)?;
    if gate.dims.len() != 3 {
        return Err(BundleError::Unsupported(format!("{}: shape {:?}, expected [n_embd, n_ff, n_expert]", gate.name, gate.dims)));
    }
    let (n_embd, n_expert) = (gate.dims[0] as usize, gate.dims[2] as usize);
    if let Some(arch) = g.get_str("general.architecture") {
        if let Some(want) = g.get_u64(&format!("{arch}.expert_count")) {
            if want as usize != n_expert {
                return Err(BundleError::Unsupported(format!("{arch}.expert_count is {want} but {} holds {n_expert} experts", gate.name)));
            }
        }
    }
    let mut layers = Vec::with_capacity(found.len());
    for (&n, have) in &found {
        if have != &[true; 3] {
            return Err(BundleError::Unsupported(format!("layer {n} lacks some of ffn_gate_exps / ffn_up_exps / ffn_down_exps")));
        }
        layers.push((n, GgufExpertTensors::find(g, n as usize, n_embd, n_expert).map_err(BundleError::Source)?));
    }
    Ok((layers, n_expert))
}

/// Counts bytes written and reports progress at most every MiB.
struct Counting<'a, W: Write> {
    inner: W,
    pos: u64,
    reported: u64,
    total: u64,
    progress: &'a mut dyn FnMut(u64, u64),
    crc: Option<crc32fast::Hasher>,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        if let Some(h) = self.crc.as_mut() {
            h.update(&buf[..n]);
        }
        self.pos += n as u64;
        if self.pos - self.reported >= 1 << 20 {
            self.reported = self.pos;
            (self.progress)(self.pos, self.total);
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// [`pack_named`] with no source name.
pub fn pack(src: &dyn ByteSource, out: &mut (impl Write + Seek), progress: &mut dyn FnMut(u64, u64)) -> Result<PackSummary, BundleError> {
    pack_named(src, "", out, progress)
}

/// Pack the MoE GGUF `src` into a bundle written to `out` from its current position (offsets in
/// the bundle are relative to it). Streams: the dense tensors go through a 1 MiB buffer and the
/// experts one at a time, so memory stays at about one expert plus the GGUF header whatever the
/// model size. `progress(done, total)` is called with bytes written, at most every MiB and once
/// at the end with `done == total`. `source_name` is recorded in the manifest for reference.
pub fn pack_named(
    src: &dyn ByteSource,
    source_name: &str,
    out: &mut (impl Write + Seek),
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PackSummary, BundleError> {
    pack_with(src, source_name, &[], out, progress)
}

/// Expert tensor types per MoE layer for [`pack_with`]: `[gate, up, down]`; `None` keeps the
/// source's types for that layer.
pub type ExpertTypes = Option<[GgmlType; 3]>;

/// [`pack_named`], re-quantizing layer `i`'s experts to `expert_types[i]` where given (layer-wise
/// mixed precision): each matrix is dequantized to f32 and quantized with llama-quantize's
/// reference quantizers ([`crate::quant::quantize`]). The manifest records each layer's types.
pub fn pack_with(
    src: &dyn ByteSource,
    source_name: &str,
    expert_types: &[ExpertTypes],
    out: &mut (impl Write + Seek),
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PackSummary, BundleError> {
    pack_ordered(src, source_name, expert_types, &[], out, progress)
}

/// [`pack_with`], placing layer `i`'s expert blocks on storage in the order `order[i]` (a
/// permutation of the experts, e.g. [`super::coactivation::coactivation_order`]; layers without
/// one keep the experts' own order). The manifest still maps (layer, expert) to its block, so
/// readers see the same experts whatever the order.
pub fn pack_ordered(
    src: &dyn ByteSource,
    source_name: &str,
    expert_types: &[ExpertTypes],
    order: &[Vec<usize>],
    out: &mut (impl Write + Seek),
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PackSummary, BundleError> {
    let g = GgufFile::read(src).map_err(BundleError::Source)?;
    let (layers, n_expert) = expert_layers(&g)?;
    if order.len() > layers.len() {
        return Err(BundleError::Unsupported(format!("an expert order for {} layers given, the model has {} MoE layers", order.len(), layers.len())));
    }
    let identity: Vec<usize> = (0..n_expert).collect();
    for (il, o) in order.iter().enumerate() {
        let mut seen = vec![false; n_expert];
        if o.len() != n_expert || o.iter().any(|&e| e >= n_expert || std::mem::replace(&mut seen[e], true)) {
            return Err(BundleError::Unsupported(format!("the expert order of layer {il} is not a permutation of its {n_expert} experts")));
        }
    }
    let order_of = |il: usize| order.get(il).unwrap_or(&identity);
    if expert_types.len() > layers.len() {
        return Err(BundleError::Unsupported(format!("{} layers of expert types given, the model has {} MoE layers", expert_types.len(), layers.len())));
    }
    // The layout each layer's blocks will have.
    let out_layouts: Vec<ExpertLayout> = layers
        .iter()
        .enumerate()
        .map(|(i, (_, t))| match expert_types.get(i).copied().flatten() {
            None => Ok(t.layout.clone()),
            Some(tys) => requant_layout(&t.layout, tys),
        })
        .collect::<Result<_, _>>()?;
    let mut name = source_name.to_string();
    while name.len() > MAX_NAME {
        name.pop();
    }

    // Dense GGUF: all metadata (plus our version key) and every non-expert tensor.
    let expert_names: std::collections::HashSet<String> = layers
        .iter()
        .flat_map(|(n, _)| ["gate", "up", "down"].map(|w| format!("blk.{n}.ffn_{w}_exps.weight")))
        .collect();
    let mut meta: Vec<(String, Value)> = g.metadata.iter().filter(|(k, _)| k != VERSION_KEY).cloned().collect();
    meta.push((VERSION_KEY.to_string(), Value::U32(BUNDLE_VERSION)));
    let dense: Vec<WriteTensor> = g
        .tensors
        .iter()
        .filter(|t| !expert_names.contains(&t.name))
        .map(|t| WriteTensor::new(t.name.clone(), &t.dims, t.ty, TensorData::Source { src, offset: t.offset }))
        .collect();
    let dense_plan = plan_gguf(&meta, &dense, g.alignment)?;

    // Layout of the bundle.
    let n_layers = layers.len();
    let m_len = manifest_len(n_layers as u64, n_expert as u64, name.len() as u64)
        .ok_or_else(|| BundleError::Unsupported("manifest size overflows".into()))?;
    let dense_off = align_up(HEADER_LEN + m_len, BLOCK_ALIGN);
    let dense_len = dense_plan.total_len;
    let experts_off = align_up(dense_off + dense_len, BLOCK_ALIGN);
    let mut blocks = Vec::with_capacity(n_layers * n_expert);
    let mut cursor = experts_off;
    for (il, lay) in out_layouts.iter().enumerate() {
        let size = lay.bytes() as u64;
        let first = blocks.len();
        blocks.extend((0..n_expert).map(|_| BlockEntry { offset: 0, size, crc32: 0 }));
        for &e in order_of(il) {
            blocks[first + e].offset = cursor;
            cursor += align_up(size, BLOCK_ALIGN);
        }
    }
    let file_len = cursor;

    // Write: placeholder header + manifest, dense GGUF, blocks; then the real header + manifest.
    let base = out.stream_position()?;
    let mut w = Counting {
        inner: BufWriter::with_capacity(1 << 20, out),
        pos: 0,
        reported: 0,
        total: file_len,
        progress: &mut *progress,
        crc: None,
    };
    write_zeros(&mut w, dense_off)?;
    w.crc = Some(crc32fast::Hasher::new());
    write_gguf(&mut w, &meta, &dense, g.alignment).map_err(|e| match e {
        WriteError::Store(e) => BundleError::Store(e),
        WriteError::Io(e) => BundleError::Io(e),
        e => BundleError::Write(e),
    })?;
    let dense_crc = w.crc.take().unwrap().finalize();
    if w.pos != dense_off + dense_len {
        return Err(BundleError::Unsupported(format!("dense GGUF wrote {} bytes, planned {dense_len}", w.pos - dense_off)));
    }
    let pad = experts_off - w.pos;
    write_zeros(&mut w, pad)?;
    let mut buf = Vec::new();
    let mut raw = Vec::new();
    let mut expert_bytes = 0u64;
    for (il, (_, t)) in layers.iter().enumerate() {
        let lay = &out_layouts[il];
        let requant = lay != &t.layout;
        for &e in order_of(il) {
            let b = &mut blocks[il * n_expert + e];
            debug_assert_eq!(w.pos, b.offset);
            raw.resize(t.layout.bytes(), 0);
            let mut at = 0;
            for (off, len) in t.ranges(e) {
                src.read_at(off, &mut raw[at..at + len])?;
                at += len;
            }
            if requant {
                requantize_expert(&t.layout, &raw, lay, &mut buf)?;
            } else {
                std::mem::swap(&mut buf, &mut raw);
            }
            b.crc32 = crc32fast::hash(&buf);
            w.write_all(&buf)?;
            write_zeros(&mut w, align_up(b.size, BLOCK_ALIGN) - b.size)?;
            expert_bytes += b.size;
        }
    }
    debug_assert_eq!(w.pos, file_len);
    w.flush()?;
    let Counting { inner, .. } = w;
    let out = inner.into_inner().map_err(|e| e.into_error())?;

    let manifest = Manifest {
        n_expert,
        source_size: src.len(),
        source_name: name,
        layer_blk: layers.iter().map(|(n, _)| *n).collect(),
        layouts: out_layouts,
        blocks,
    };
    let m = manifest.encode();
    debug_assert_eq!(m.len() as u64, m_len);
    let header = BundleHeader {
        version: BUNDLE_VERSION,
        file_len,
        manifest_off: HEADER_LEN,
        manifest_len: m_len,
        manifest_crc: crc32fast::hash(&m),
        block_align: BLOCK_ALIGN as u32,
        dense_off,
        dense_len,
        dense_crc,
        n_layers: n_layers as u32,
        experts_off,
        experts_len: file_len - experts_off,
        n_expert: n_expert as u32,
    };
    out.seek(SeekFrom::Start(base))?;
    out.write_all(&header.encode())?;
    out.write_all(&m)?;
    out.seek(SeekFrom::Start(base + file_len))?;
    out.flush()?;
    progress(file_len, file_len);
    Ok(PackSummary {
        file_len,
        n_layers,
        n_expert,
        manifest_len: m_len,
        dense_len,
        n_dense_tensors: dense.len(),
        expert_bytes,
        padding_bytes: file_len - experts_off - expert_bytes,
    })
}

/// `layout` with its matrices in `tys` ([gate, up, down]); an error when a row length is not a
/// multiple of a type's block size or there is no quantizer for it.
pub fn requant_layout(layout: &ExpertLayout, tys: [GgmlType; 3]) -> Result<ExpertLayout, BundleError> {
    use crate::quant::quantize::WEIGHT_TYPES;
    // A matrix that keeps its type is copied, not re-quantized: it needs no quantizer.
    let bytes = |ty: GgmlType, was: GgmlType, cols: usize, rows: usize, what: &str| -> Result<usize, BundleError> {
        if ty != was && !WEIGHT_TYPES.contains(&ty) && ty != GgmlType::F32 {
            return Err(BundleError::Unsupported(format!("no quantizer for {ty} (expert types: {})", WEIGHT_TYPES.map(|t| t.name()).join(", "))));
        }
        match ty.row_bytes(cols as u64) {
            Some(rb) => Ok(rb as usize * rows),
            None => Err(BundleError::Unsupported(format!("{what} rows of {cols} values cannot be {ty} ({}-value blocks)", ty.block_size()))),
        }
    };
    let (e, f) = (layout.n_embd, layout.n_ff);
    Ok(ExpertLayout {
        n_embd: e,
        n_ff: f,
        gate_ty: tys[0],
        up_ty: tys[1],
        down_ty: tys[2],
        gate_bytes: bytes(tys[0], layout.gate_ty, e, f, "ffn_gate_exps")?,
        up_bytes: bytes(tys[1], layout.up_ty, e, f, "ffn_up_exps")?,
        down_bytes: bytes(tys[2], layout.down_ty, f, e, "ffn_down_exps")?,
    })
}

/// One expert's block (gate ‖ up ‖ down in `from`) re-quantized to `to`'s types.
pub fn requantize_expert(from: &ExpertLayout, raw: &[u8], to: &ExpertLayout, out: &mut Vec<u8>) -> Result<(), BundleError> {
    let parts = [
        (from.gate_ty, from.gate_bytes, to.gate_ty, from.n_embd * from.n_ff),
        (from.up_ty, from.up_bytes, to.up_ty, from.n_embd * from.n_ff),
        (from.down_ty, from.down_bytes, to.down_ty, from.n_embd * from.n_ff),
    ];
    out.clear();
    let mut at = 0;
    let mut x = Vec::new();
    let mut q = Vec::new();
    for (fty, fbytes, tty, n) in parts {
        let part = &raw[at..at + fbytes];
        at += fbytes;
        if fty == tty {
            out.extend_from_slice(part);
            continue;
        }
        x.resize(n, 0f32);
        let bad = |e: crate::quant::QuantError| BundleError::Unsupported(format!("re-quantizing an expert: {e}"));
        crate::quant::dequantize_row(fty, part, &mut x).map_err(bad)?;
        if tty == GgmlType::F32 {
            out.extend(x.iter().flat_map(|v| v.to_le_bytes()));
        } else {
            crate::quant::quantize::quantize_weights(tty, &x, &mut q).map_err(bad)?;
            out.extend_from_slice(&q);
        }
    }
    debug_assert_eq!(out.len(), to.bytes());
    Ok(())
}

/// An opened bundle: header, manifest, and the parsed header of the embedded dense GGUF.
#[derive(Clone)]
pub struct Bundle {
    src: Arc<dyn ByteSource>,
    header: BundleHeader,
    manifest: Arc<Manifest>,
    dense: GgufFile,
}

impl std::fmt::Debug for Bundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bundle").field("header", &self.header).field("n_layers", &self.manifest.layouts.len()).finish()
    }
}

impl Bundle {
    /// Read the header and the manifest (two range reads) and the dense GGUF's header, and check
    /// them all (see the module docs). A corrupt or truncated bundle gives a typed error.
    pub fn open(src: Arc<dyn ByteSource>) -> Result<Self, BundleError> {
        let size = src.len();
        if size < HEADER_LEN {
            return Err(BundleError::Truncated { what: "header", expected: HEADER_LEN, actual: size });
        }
        let hb = src.read_vec(0, HEADER_LEN as usize)?;
        let header = BundleHeader::decode(&hb, size)?;
        let m_len = usize::try_from(header.manifest_len).map_err(|_| corrupt("manifest too large"))?;
        let mb = src.read_vec(header.manifest_off, m_len)?;
        let computed = crc32fast::hash(&mb);
        if computed != header.manifest_crc {
            return Err(BundleError::ManifestChecksum { stored: header.manifest_crc, computed });
        }
        let manifest = Manifest::decode(&mb, &header)?;
        let dense_src = SubSource::new(src.clone(), header.dense_off, header.dense_len)?;
        let dense = GgufFile::read(&dense_src).map_err(BundleError::Dense)?;
        match dense.get(VERSION_KEY).and_then(Value::as_u64) {
            Some(v) if v == header.version as u64 => {}
            v => return Err(corrupt(format!("dense GGUF's {VERSION_KEY} is {v:?}, header says {}", header.version))),
        }
        Ok(Self { src, header, manifest: Arc::new(manifest), dense })
    }

    /// The embedded dense GGUF as a byte source (offsets start at 0), for `GgufFile::read` and
    /// the model loader.
    pub fn dense_source(&self) -> SubSource<Arc<dyn ByteSource>> {
        SubSource::new(self.src.clone(), self.header.dense_off, self.header.dense_len).expect("checked at open")
    }
    /// The dense GGUF's parsed header (the same as `GgufFile::read(&bundle.dense_source())`).
    pub fn dense_gguf(&self) -> &GgufFile {
        &self.dense
    }
    pub fn header(&self) -> &BundleHeader {
        &self.header
    }
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// Layouts of the MoE layers, in order (index = the layer index of [`ExpertStore`]).
    pub fn layouts(&self) -> &[ExpertLayout] {
        &self.manifest.layouts
    }
    /// GGUF block index of each MoE layer.
    pub fn layer_blocks(&self) -> &[u32] {
        &self.manifest.layer_blk
    }
    pub fn n_layers(&self) -> usize {
        self.manifest.layouts.len()
    }
    pub fn n_expert(&self) -> usize {
        self.manifest.n_expert
    }
    pub fn block(&self, layer: usize, expert: usize) -> Option<&BlockEntry> {
        self.manifest.block(layer, expert)
    }
    pub fn source(&self) -> &Arc<dyn ByteSource> {
        &self.src
    }
    /// An expert store over this bundle.
    pub fn expert_store(&self) -> BundleExpertStore {
        BundleExpertStore { src: self.src.clone(), manifest: self.manifest.clone() }
    }

    /// Read the whole bundle and check the dense GGUF's checksum and every block's.
    /// `progress(done, total)` counts bytes checked.
    pub fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<(), BundleError> {
        let total = self.header.dense_len + self.manifest.blocks.iter().map(|b| b.size).sum::<u64>();
        let mut done = 0u64;
        let mut buf = Vec::new();
        let mut h = crc32fast::Hasher::new();
        let dense = self.dense_source();
        while done < self.header.dense_len {
            let n = (self.header.dense_len - done).min(1 << 20) as usize;
            buf.resize(n, 0);
            dense.read_at(done, &mut buf)?;
            h.update(&buf);
            done += n as u64;
            progress(done, total);
        }
        let computed = h.finalize();
        if computed != self.header.dense_crc {
            return Err(BundleError::DenseChecksum { stored: self.header.dense_crc, computed });
        }
        let n_expert = self.manifest.n_expert;
        for (i, b) in self.manifest.blocks.iter().enumerate() {
            buf.resize(b.size as usize, 0);
            self.src.read_at(b.offset, &mut buf)?;
            let computed = crc32fast::hash(&buf);
            if computed != b.crc32 {
                return Err(BundleError::BlockChecksum { layer: i / n_expert, expert: i % n_expert, stored: b.crc32, computed });
            }
            done += b.size;
            progress(done, total);
        }
        Ok(())
    }
}

/// Experts read from a bundle: one range read per expert, its crc32 checked on every read
/// (unless the source verified it when storing it, [`ByteSource::verified_at_rest`]).
#[derive(Clone)]
pub struct BundleExpertStore {
    src: Arc<dyn ByteSource>,
    manifest: Arc<Manifest>,
}

impl BundleExpertStore {
    pub fn new(bundle: &Bundle) -> Self {
        bundle.expert_store()
    }
    pub fn n_expert(&self) -> usize {
        self.manifest.n_expert
    }
}

impl ExpertStore for BundleExpertStore {
    fn n_layers(&self) -> usize {
        self.manifest.layouts.len()
    }
    fn layout(&self, layer: usize) -> &ExpertLayout {
        &self.manifest.layouts[layer]
    }
    fn ranges(&self, layer: usize, expert: usize) -> Result<Vec<(u64, usize)>, ExpertError> {
        let m = &self.manifest;
        match m.block(layer, expert) {
            // The size was checked against the layout (and to fit a usize) at open.
            Some(b) => Ok(vec![(b.offset, b.size as usize)]),
            None => Err(ExpertError::Invalid {
                layer,
                expert,
                why: format!("no such expert (the bundle has {} MoE layers x {} experts)", m.layouts.len(), m.n_expert),
            }),
        }
    }
    fn read_range(&self, layer: usize, expert: usize, off: u64, buf: &mut [u8]) -> Result<(), ExpertError> {
        self.src.read_at(off, buf).map_err(|source| ExpertError::Store { layer, expert, source })
    }
    fn verify(&self, layer: usize, expert: usize, buf: &[u8]) -> Result<(), ExpertError> {
        if self.src.verified_at_rest() {
            return Ok(());
        }
        let Some(b) = self.manifest.block(layer, expert) else {
            return Err(ExpertError::Invalid { layer, expert, why: "no such expert".into() });
        };
        let computed = crc32fast::hash(buf);
        if computed != b.crc32 {
            return Err(ExpertError::Invalid {
                layer,
                expert,
                why: format!("checksum mismatch in bundle block at offset {} (stored crc32 {:08x}, computed {computed:08x})", b.offset, b.crc32),
            });
        }
        Ok(())
    }
    fn reads_per_expert(&self) -> usize {
        1
    }
    fn hint(&self, layer: usize, expert: usize) {
        if let Some(b) = self.manifest.block(layer, expert) {
            self.src.hint(b.offset, b.size as usize);
        }
    }
    fn name(&self) -> &'static str {
        "bundle"
    }
    fn serves_in_order(&self) -> bool {
        self.src.serves_in_order()
    }
}
