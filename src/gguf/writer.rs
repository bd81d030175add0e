//! A minimal GGUF v3 writer (the inverse of [`super::GgufFile::read`]).
//!
//! Layout, as gguf-py's `GGUFWriter` writes it: magic, version 3, tensor count, metadata count,
//! the metadata key/values, the tensor infos (name, dims, ggml type, data offset relative to the
//! data section), zero padding to the alignment, then every tensor's data, each padded with zeros
//! to the alignment. A `general.alignment` key is added when the alignment is not the default 32
//! and the metadata does not already carry it.
//!
//! Tensor data comes from a byte slice, a [`ByteSource`] range, or a reader callback, and is
//! streamed through a 1 MiB buffer, so a multi-gigabyte GGUF can be written without holding it.
//!
//! Checked with gguf-py (0.17+): a file written here reads back in `gguf.GGUFReader` with the same
//! keys, values, tensor names, shapes, types and bytes (see `tests/suite/bundle.rs`, test
//! `writer_output_reads_in_gguf_py`, which runs the check when python3 with `gguf` is present).
//! Limitation: [`Value`] does not keep the element type of an empty array, so an empty array is
//! written as an empty array of u8 (whatever its type was in the file it was read from).

use super::{Value, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use crate::quant::GgmlType;
use crate::store::{ByteSource, StoreError};
use std::io::Write;

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("writing GGUF: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("GGUF tensor '{name}': {why}")]
    Tensor { name: String, why: String },
    #[error("GGUF metadata key '{key}': {why}")]
    Metadata { key: String, why: String },
    #[error("invalid GGUF alignment {0} (must be a non-zero power of two)")]
    BadAlignment(u64),
}

/// A tensor reader callback: `f(offset_in_tensor, buf)` fills `buf`.
pub type ReadFn<'a> = dyn Fn(u64, &mut [u8]) -> Result<(), StoreError> + 'a;

/// Where a tensor's bytes come from.
pub enum TensorData<'a> {
    Bytes(&'a [u8]),
    /// `size` bytes at `offset` of a byte source.
    Source { src: &'a dyn ByteSource, offset: u64 },
    /// A reader callback: `f(offset_in_tensor, buf)` fills `buf` with the tensor's bytes at that
    /// offset. It is called with consecutive chunks of at most 1 MiB.
    Reader(&'a ReadFn<'a>),
}

/// One tensor to write. `dims` are in ggml order (`dims[0]` is the row length).
pub struct WriteTensor<'a> {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub data: TensorData<'a>,
}

impl<'a> WriteTensor<'a> {
    pub fn new(name: impl Into<String>, dims: &[u64], ty: GgmlType, data: TensorData<'a>) -> Self {
        Self { name: name.into(), dims: dims.to_vec(), ty, data }
    }
    /// Byte size implied by the shape and type.
    pub fn byte_size(&self) -> Result<u64, WriteError> {
        tensor_bytes(&self.name, &self.dims, self.ty)
    }
}

/// Sizes of a GGUF the writer will produce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufPlan {
    /// Offset of the data section (header + tensor infos + padding).
    pub data_offset: u64,
    /// Each tensor's data offset relative to the data section, and its byte size.
    pub tensors: Vec<(u64, u64)>,
    /// Total file length.
    pub total_len: u64,
}

fn tensor_bytes(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64, WriteError> {
    let bad = |why: String| WriteError::Tensor { name: name.into(), why };
    if dims.is_empty() || dims.len() > MAX_DIMS as usize {
        return Err(bad(format!("{} dimensions (1..={MAX_DIMS} allowed)", dims.len())));
    }
    if dims.contains(&0) {
        return Err(bad(format!("zero dimension in {dims:?}")));
    }
    let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or_else(|| bad("element count overflows".into()))?;
    let bs = ty.block_size() as u64;
    if dims[0] % bs != 0 {
        return Err(bad(format!("row length {} is not a multiple of {}'s block size {bs}", dims[0], ty.name())));
    }
    (n / bs).checked_mul(ty.type_size() as u64).ok_or_else(|| bad("byte size overflows".into()))
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

struct Enc(Vec<u8>);

impl Enc {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn value(&mut self, key: &str, v: &Value) -> Result<(), WriteError> {
        match *v {
            Value::U8(x) => self.0.push(x),
            Value::I8(x) => self.0.push(x as u8),
            Value::U16(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => self.u32(x),
            Value::I32(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => self.0.push(x as u8),
            Value::String(ref s) => self.str(s),
            Value::U64(x) => self.u64(x),
            Value::I64(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => self.0.extend_from_slice(&x.to_le_bytes()),
            Value::Array(ref a) => {
                let ety = a.first().map(value_type).unwrap_or(0);
                if let Some(o) = a.iter().find(|x| value_type(x) != ety) {
                    return Err(WriteError::Metadata {
                        key: key.into(),
                        why: format!("array mixes element types {} and {}", a[0].type_name(), o.type_name()),
                    });
                }
                self.u32(ety);
                self.u64(a.len() as u64);
                for x in a {
                    self.value(key, x)?;
                }
            }
        }
        Ok(())
    }
}

/// GGUF value type code of a value.
pub fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// Encode the header (everything before the data section, padding included) and plan the data.
fn encode_header(metadata: &[(String, Value)], tensors: &[WriteTensor], alignment: u64) -> Result<(Vec<u8>, GgufPlan), WriteError> {
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(WriteError::BadAlignment(alignment));
    }
    let mut seen = std::collections::HashSet::new();
    for (k, v) in metadata {
        if !seen.insert(k.as_str()) {
            return Err(WriteError::Metadata { key: k.clone(), why: "duplicate key".into() });
        }
        if k == "general.alignment" && v.as_u64() != Some(alignment) {
            return Err(WriteError::Metadata {
                key: k.clone(),
                why: format!("value {} disagrees with the alignment {alignment} being written", v.display_short()),
            });
        }
    }
    let add_alignment = alignment != DEFAULT_ALIGNMENT && !seen.contains("general.alignment");
    let mut names = std::collections::HashSet::new();
    let mut e = Enc(Vec::new());
    e.u32(GGUF_MAGIC);
    e.u32(3);
    e.u64(tensors.len() as u64);
    e.u64(metadata.len() as u64 + add_alignment as u64);
    for (k, v) in metadata {
        e.str(k);
        e.u32(value_type(v));
        e.value(k, v)?;
    }
    if add_alignment {
        e.str("general.alignment");
        e.u32(4);
        e.u32(u32::try_from(alignment).map_err(|_| WriteError::BadAlignment(alignment))?);
    }
    let mut planned = Vec::with_capacity(tensors.len());
    let mut off = 0u64;
    for t in tensors {
        if !names.insert(t.name.as_str()) {
            return Err(WriteError::Tensor { name: t.name.clone(), why: "duplicate tensor name".into() });
        }
        let size = t.byte_size()?;
        if let TensorData::Bytes(b) = t.data {
            if b.len() as u64 != size {
                return Err(WriteError::Tensor { name: t.name.clone(), why: format!("{} bytes given, shape and type need {size}", b.len()) });
            }
        }
        e.str(&t.name);
        e.u32(t.dims.len() as u32);
        for &d in &t.dims {
            e.u64(d);
        }
        e.u32(t.ty as u32);
        e.u64(off);
        planned.push((off, size));
        off = align_up(off + size, alignment);
    }
    let data_offset = align_up(e.0.len() as u64, alignment);
    e.0.resize(data_offset as usize, 0);
    Ok((e.0, GgufPlan { data_offset, tensors: planned, total_len: data_offset + off }))
}

/// Sizes of the GGUF `write_gguf` would write (validates everything but the tensor bytes).
pub fn plan_gguf(metadata: &[(String, Value)], tensors: &[WriteTensor], alignment: u64) -> Result<GgufPlan, WriteError> {
    Ok(encode_header(metadata, tensors, alignment)?.1)
}

const CHUNK: usize = 1 << 20;
static ZEROS: [u8; 4096] = [0; 4096];

pub(crate) fn write_zeros(out: &mut (impl Write + ?Sized), mut n: u64) -> std::io::Result<()> {
    while n > 0 {
        let k = n.min(ZEROS.len() as u64) as usize;
        out.write_all(&ZEROS[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Write a GGUF v3 file to `out` (from its current position; offsets in the file are relative to
/// where writing starts). Returns the plan (sizes) of what was written.
pub fn write_gguf(out: &mut impl Write, metadata: &[(String, Value)], tensors: &[WriteTensor], alignment: u64) -> Result<GgufPlan, WriteError> {
    let (header, plan) = encode_header(metadata, tensors, alignment)?;
    out.write_all(&header)?;
    let mut pos = plan.data_offset;
    let mut buf = Vec::new();
    for (t, &(off, size)) in tensors.iter().zip(&plan.tensors) {
        write_zeros(out, plan.data_offset + off - pos)?;
        match t.data {
            TensorData::Bytes(b) => out.write_all(b)?,
            TensorData::Source { src, offset } => {
                let mut done = 0u64;
                while done < size {
                    let n = (size - done).min(CHUNK as u64) as usize;
                    buf.resize(n, 0);
                    src.read_at(offset + done, &mut buf)?;
                    out.write_all(&buf)?;
                    done += n as u64;
                }
            }
            TensorData::Reader(f) => {
                let mut done = 0u64;
                while done < size {
                    let n = (size - done).min(CHUNK as u64) as usize;
                    buf.resize(n, 0);
                    f(done, &mut buf)?;
                    out.write_all(&buf)?;
                    done += n as u64;
                }
            }
        }
        pos = plan.data_offset + off + size;
    }
    write_zeros(out, plan.total_len - pos)?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::store::MemSource;

    #[test]
    fn round_trip_through_reader() {
        let meta = vec![
            ("general.architecture".to_string(), Value::String("llama".into())),
            ("a.u8".into(), Value::U8(7)),
            ("a.i8".into(), Value::I8(-7)),
            ("a.u16".into(), Value::U16(65000)),
            ("a.i16".into(), Value::I16(-30000)),
            ("a.u32".into(), Value::U32(4_000_000_000)),
            ("a.i32".into(), Value::I32(-2_000_000_000)),
            ("a.f32".into(), Value::F32(1.25)),
            ("a.bool".into(), Value::Bool(true)),
            ("a.u64".into(), Value::U64(u64::MAX)),
            ("a.i64".into(), Value::I64(i64::MIN)),
            ("a.f64".into(), Value::F64(-0.5)),
            ("a.arr".into(), Value::Array(vec![Value::String("x".into()), Value::String("".into())])),
            ("a.nested".into(), Value::Array(vec![Value::Array(vec![Value::I32(1)]), Value::Array(vec![Value::I32(2), Value::I32(3)])])),
        ];
        let f32s: Vec<u8> = (0..12).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let q8: Vec<u8> = (0..68u8).collect();
        let src = MemSource::new((0..=255u8).cycle().take(1000).collect());
        let reader = |off: u64, buf: &mut [u8]| {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (off as usize + i) as u8 ^ 0x5a;
            }
            Ok(())
        };
        for align in [32u64, 64, 4096] {
            let tensors = vec![
                WriteTensor::new("t.f32", &[4, 3], GgmlType::F32, TensorData::Bytes(&f32s)),
                WriteTensor::new("t.q8", &[32, 2], GgmlType::Q8_0, TensorData::Bytes(&q8)),
                WriteTensor::new("t.src", &[100], GgmlType::I8, TensorData::Source { src: &src, offset: 7 }),
                WriteTensor::new("t.cb", &[16, 1, 1, 2], GgmlType::I16, TensorData::Reader(&reader)),
            ];
            let mut out = Vec::new();
            let plan = write_gguf(&mut out, &meta, &tensors, align).unwrap();
            assert_eq!(out.len() as u64, plan.total_len);
            assert_eq!(plan_gguf(&meta, &tensors, align).unwrap(), plan);
            let g = GgufFile::read(&MemSource::new(out.clone())).unwrap();
            assert_eq!(g.version, 3);
            assert_eq!(g.alignment, align);
            let want_meta = if align == 32 { meta.len() } else { meta.len() + 1 };
            assert_eq!(g.metadata.len(), want_meta);
            assert_eq!(&g.metadata[..meta.len()], &meta[..]);
            assert_eq!(g.data_offset, plan.data_offset);
            let bytes = |n: &str| {
                let t = g.tensor(n).unwrap();
                out[t.offset as usize..(t.offset + t.size) as usize].to_vec()
            };
            assert_eq!(bytes("t.f32"), f32s);
            assert_eq!(bytes("t.q8"), q8);
            assert_eq!(bytes("t.src"), src.bytes()[7..107].to_vec());
            let want_cb: Vec<u8> = (0..64usize).map(|i| i as u8 ^ 0x5a).collect();
            assert_eq!(bytes("t.cb"), want_cb);
            assert_eq!(g.tensor("t.cb").unwrap().dims, vec![16, 1, 1, 2]);
            for t in &g.tensors {
                assert_eq!(t.offset % align, 0);
            }
        }
    }

    #[test]
    fn rejects_bad_input() {
        let q8 = [0u8; 34];
        let meta = vec![("general.alignment".to_string(), Value::U32(64))];
        let t = |dims: &[u64], ty| vec![WriteTensor::new("x", dims, ty, TensorData::Bytes(&q8))];
        let mut out = Vec::new();
        assert!(matches!(write_gguf(&mut out, &[], &t(&[32], GgmlType::Q8_0), 48), Err(WriteError::BadAlignment(48))));
        assert!(matches!(write_gguf(&mut out, &meta, &t(&[32], GgmlType::Q8_0), 32), Err(WriteError::Metadata { .. })));
        assert!(matches!(write_gguf(&mut out, &[], &t(&[16], GgmlType::Q8_0), 32), Err(WriteError::Tensor { .. })));
        assert!(matches!(write_gguf(&mut out, &[], &t(&[64], GgmlType::Q8_0), 32), Err(WriteError::Tensor { .. })));
        assert!(matches!(write_gguf(&mut out, &[], &t(&[32, 0], GgmlType::Q8_0), 32), Err(WriteError::Tensor { .. })));
        assert!(matches!(write_gguf(&mut out, &[], &t(&[32, 1, 1, 1, 1], GgmlType::Q8_0), 32), Err(WriteError::Tensor { .. })));
        let mixed = vec![("m".to_string(), Value::Array(vec![Value::U8(1), Value::I8(1)]))];
        assert!(matches!(write_gguf(&mut out, &mixed, &[], 32), Err(WriteError::Metadata { .. })));
        let dup = vec![("m".to_string(), Value::U8(1)), ("m".to_string(), Value::U8(2))];
        assert!(matches!(write_gguf(&mut out, &dup, &[], 32), Err(WriteError::Metadata { .. })));
        write_gguf(&mut out, &meta, &t(&[32], GgmlType::Q8_0), 64).unwrap();
    }
}
