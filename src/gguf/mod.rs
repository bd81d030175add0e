//! GGUF reader (versions 2 and 3).
//!
//! Format: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md> (and `gguf-py/gguf/gguf_reader.py`).
//! The reader pulls the header through a [`ByteSource`] in small windows, so a model never has to
//! be in memory as a whole. Every count, length and offset is checked against what the file can
//! hold before anything is allocated: a hostile header yields a [`GgufError`], never a panic or a
//! huge allocation.

use crate::quant::GgmlType;
use crate::store::{ByteSource, StoreError};
use std::collections::HashMap;

pub const GGUF_MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions (`GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Nesting limit for arrays of arrays (GGUF allows them; real files use depth 1).
const MAX_ARRAY_DEPTH: u32 = 4;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("not a GGUF file (magic {0:#010x}, expected 0x46554747 \"GGUF\")")]
    BadMagic(u32),
    #[error("unsupported GGUF version {0} (LES reads versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("truncated GGUF: {what} at offset {offset} runs past the end of the file ({size} bytes)")]
    Truncated { what: &'static str, offset: u64, size: u64 },
    #[error("GGUF {what} count {count} cannot fit in a file of {size} bytes")]
    CountTooLarge { what: &'static str, count: u64, size: u64 },
    #[error("unknown GGUF metadata value type {0}")]
    UnknownValueType(u32),
    #[error("GGUF arrays nested deeper than {MAX_ARRAY_DEPTH}")]
    ArrayTooDeep,
    #[error("tensor '{name}': unknown ggml type {ty}")]
    UnknownTensorType { name: String, ty: u32 },
    #[error("tensor '{name}': {n_dims} dimensions (at most {MAX_DIMS} allowed)")]
    TooManyDims { name: String, n_dims: u32 },
    #[error("tensor '{name}': invalid shape {dims:?} ({why})")]
    BadShape { name: String, dims: Vec<u64>, why: &'static str },
    #[error("tensor '{name}': data [{start}, {end}) lies outside the file ({size} bytes)")]
    TensorOutOfBounds { name: String, start: u64, end: u64, size: u64 },
    #[error("tensor '{name}': offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { name: String, offset: u64, alignment: u64 },
    #[error("duplicate tensor name '{0}'")]
    DuplicateTensor(String),
    #[error("invalid general.alignment {0} (must be a non-zero power of two)")]
    BadAlignment(u64),
    #[error("metadata key '{key}': {why}")]
    BadMetadata { key: String, why: String },
    #[error("missing metadata key '{0}'")]
    MissingKey(String),
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
}

/// A metadata value. Arrays keep their element type.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }
    /// Integer value as u64 (any integer type, negative values rejected).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            Value::Bool(b) => Some(b as u64),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
    /// Short human-readable rendering (arrays abbreviated).
    pub fn display_short(&self) -> String {
        match self {
            Value::String(s) => {
                let mut t: String = s.chars().take(80).collect();
                if s.chars().count() > 80 {
                    t.push('…');
                }
                format!("{t:?}")
            }
            Value::Array(a) => {
                let head: Vec<String> = a.iter().take(4).map(|v| v.display_short()).collect();
                let more = if a.len() > 4 { ", …" } else { "" };
                format!("[{}{}] ({} items)", head.join(", "), more, a.len())
            }
            Value::F32(v) => format!("{v}"),
            Value::F64(v) => format!("{v}"),
            Value::Bool(v) => format!("{v}"),
            other => other.as_i64().map(|v| v.to_string()).unwrap_or_default(),
        }
    }
}

/// One tensor's description and byte range.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (row length).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Row length (`ne[0]`).
    pub fn ne0(&self) -> u64 {
        self.dims[0]
    }
    /// Number of rows (product of all dimensions but the first).
    pub fn n_rows(&self) -> u64 {
        self.dims[1..].iter().product()
    }
    pub fn row_bytes(&self) -> u64 {
        self.ty.row_bytes(self.dims[0]).unwrap_or(0)
    }
}

/// A parsed GGUF header: metadata and tensor index. Tensor data stays in the source.
#[derive(Clone, Debug)]
pub struct GgufFile {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset where tensor data begins.
    pub data_offset: u64,
    pub file_size: u64,
    meta_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

/// Buffered forward reader over a ByteSource.
struct Reader<'a> {
    src: &'a dyn ByteSource,
    size: u64,
    pos: u64,
    buf: Vec<u8>,
    buf_start: u64,
}

const WINDOW: usize = 1 << 20;

impl<'a> Reader<'a> {
    fn new(src: &'a dyn ByteSource) -> Self {
        Self { src, size: src.len(), pos: 0, buf: Vec::new(), buf_start: 0 }
    }
    fn remaining(&self) -> u64 {
        self.size.saturating_sub(self.pos)
    }
    fn bytes(&mut self, n: usize, what: &'static str) -> Result<&[u8], GgufError> {
        if (n as u64) > self.remaining() {
            return Err(GgufError::Truncated { what, offset: self.pos, size: self.size });
        }
        let buf_end = self.buf_start + self.buf.len() as u64;
        if self.pos < self.buf_start || self.pos + n as u64 > buf_end {
            let len = (n.max(WINDOW) as u64).min(self.remaining()) as usize;
            self.buf.resize(len, 0);
            self.src.read_at(self.pos, &mut self.buf)?;
            self.buf_start = self.pos;
        }
        let s = (self.pos - self.buf_start) as usize;
        self.pos += n as u64;
        Ok(&self.buf[s..s + n])
    }
    fn u8(&mut self) -> Result<u8, GgufError> {
        Ok(self.bytes(1, "value")?[0])
    }
    fn u16(&mut self) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.bytes(2, "value")?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes(4, "value")?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes(8, "value")?.try_into().unwrap()))
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let at = self.pos;
        let len = self.u64()?;
        if len > self.remaining() {
            return Err(GgufError::Truncated { what: "string", offset: at, size: self.size });
        }
        let b = self.bytes(len as usize, "string")?;
        Ok(match std::str::from_utf8(b) {
            Ok(s) => s.to_owned(),
            Err(_) => String::from_utf8_lossy(b).into_owned(),
        })
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.u8()?),
            1 => Value::I8(self.u8()? as i8),
            2 => Value::U16(self.u16()?),
            3 => Value::I16(self.u16()? as i16),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(self.u32()? as i32),
            6 => Value::F32(f32::from_bits(self.u32()?)),
            7 => Value::Bool(self.u8()? != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::ArrayTooDeep);
                }
                let ety = self.u32()?;
                let count = self.u64()?;
                let min = min_value_size(ety).ok_or(GgufError::UnknownValueType(ety))?;
                if count.checked_mul(min).is_none_or(|b| b > self.remaining()) {
                    return Err(GgufError::CountTooLarge { what: "array element", count, size: self.size });
                }
                let mut v = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    v.push(self.value(ety, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            t => return Err(GgufError::UnknownValueType(t)),
        })
    }
}

/// Smallest number of bytes a value of this type occupies (used to bound counts).
fn min_value_size(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4 | 5 | 6 => 4,
        10..=12 => 8,
        8 => 8,  // length prefix
        9 => 12, // element type + count
        _ => return None,
    })
}

impl GgufFile {
    /// Parse the header of a GGUF file from a byte source.
    pub fn read(src: &dyn ByteSource) -> Result<Self, GgufError> {
        let mut r = Reader::new(src);
        let size = r.size;
        if size < 4 {
            return Err(GgufError::Truncated { what: "magic", offset: 0, size });
        }
        let magic = r.u32()?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = r.u32()?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        // A tensor info takes at least 8 (name len) + 4 + 8 + 4 + 8 bytes; a kv at least 8 + 4 + 1.
        if n_tensors.checked_mul(32).is_none_or(|b| b > r.remaining()) {
            return Err(GgufError::CountTooLarge { what: "tensor", count: n_tensors, size });
        }
        if n_kv.checked_mul(13).is_none_or(|b| b > r.remaining()) {
            return Err(GgufError::CountTooLarge { what: "metadata", count: n_kv, size });
        }
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty, 0)?;
            meta_index.insert(key.clone(), metadata.len());
            metadata.push((key, v));
        }
        let alignment = match meta_index.get("general.alignment") {
            Some(&i) => {
                let a = metadata[i].1.as_u64().unwrap_or(0);
                if a == 0 || !a.is_power_of_two() {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
            None => DEFAULT_ALIGNMENT,
        };
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > MAX_DIMS {
                return Err(GgufError::TooManyDims { name, n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64()?);
            }
            let ty = r.u32()?;
            let off = r.u64()?;
            raw.push((name, dims, ty, off));
        }
        let data_offset = r.pos.div_ceil(alignment).checked_mul(alignment).unwrap_or(u64::MAX);
        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = HashMap::with_capacity(raw.len());
        for (name, mut dims, ty, off) in raw {
            let ty = GgmlType::from_u32(ty).ok_or_else(|| GgufError::UnknownTensorType { name: name.clone(), ty })?;
            if dims.is_empty() {
                dims.push(1);
            }
            if dims.contains(&0) {
                return Err(GgufError::BadShape { name, dims, why: "zero dimension" });
            }
            let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let Some(n) = n else {
                return Err(GgufError::BadShape { name, dims, why: "element count overflows" });
            };
            if dims[0] % ty.block_size() as u64 != 0 {
                return Err(GgufError::BadShape { name, dims, why: "row length is not a multiple of the block size" });
            }
            let Some(bytes) = (n / ty.block_size() as u64).checked_mul(ty.type_size() as u64) else {
                return Err(GgufError::BadShape { name, dims, why: "byte size overflows" });
            };
            if off % alignment != 0 {
                return Err(GgufError::Misaligned { name, offset: off, alignment });
            }
            let start = data_offset.checked_add(off);
            let end = start.and_then(|s| s.checked_add(bytes));
            match (start, end) {
                (Some(s), Some(e)) if e <= size => {
                    if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                        return Err(GgufError::DuplicateTensor(name));
                    }
                    tensors.push(TensorInfo { name, dims, ty, offset: s, size: bytes });
                }
                _ => {
                    return Err(GgufError::TensorOutOfBounds {
                        name,
                        start: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        size,
                    })
                }
            }
        }
        Ok(Self { version, metadata, tensors, alignment, data_offset, file_size: size, meta_index, tensor_index })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key).and_then(Value::as_f64).map(|v| v as f32)
    }
    /// Required integer key, with a typed error naming the key.
    pub fn req_u64(&self, key: &str) -> Result<u64, GgufError> {
        match self.get(key) {
            None => Err(GgufError::MissingKey(key.into())),
            Some(v) => v.as_u64().ok_or_else(|| GgufError::BadMetadata {
                key: key.into(),
                why: format!("expected an unsigned integer, found {}", v.type_name()),
            }),
        }
    }
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture").ok_or_else(|| GgufError::MissingKey("general.architecture".into()))
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    pub fn req_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor(name.into()))
    }
    /// String array (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get(key)?.as_array()?.iter().map(Value::as_str).collect()
    }
}
pub mod writer;
