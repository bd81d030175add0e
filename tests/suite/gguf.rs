//! GGUF reader: a fixture written by the `gguf` Python package (tools/make_gguf_fixture.py) is read
//! back with the values gguf-py's GGUFReader reports; hostile and truncated inputs give typed errors.

use les::gguf::{GgufError, GgufFile, Value};
use les::quant::GgmlType;
use les::store::MemSource;
use proptest::prelude::*;

fn fixture() -> Vec<u8> {
    std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gguf/tiny.gguf")).unwrap()
}

fn parse(b: &[u8]) -> Result<GgufFile, GgufError> {
    GgufFile::read(&MemSource::new(b.to_vec()))
}

#[test]
fn reads_every_value_type() {
    let g = parse(&fixture()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get("t.u8"), Some(&Value::U8(200)));
    assert_eq!(g.get("t.i8"), Some(&Value::I8(-100)));
    assert_eq!(g.get("t.u16"), Some(&Value::U16(60000)));
    assert_eq!(g.get("t.i16"), Some(&Value::I16(-30000)));
    assert_eq!(g.get("t.u32"), Some(&Value::U32(4000000000)));
    assert_eq!(g.get("t.i32"), Some(&Value::I32(-2000000000)));
    assert_eq!(g.get("t.f32"), Some(&Value::F32(1.5)));
    assert_eq!(g.get("t.bool"), Some(&Value::Bool(true)));
    assert_eq!(g.get_str("t.str"), Some("héllo ✓"));
    assert_eq!(g.get("t.arr_i32"), Some(&Value::Array(vec![Value::I32(1), Value::I32(-2), Value::I32(3)])));
    assert_eq!(g.get_str_array("t.arr_str"), Some(vec!["a", "bc", ""]));
    assert_eq!(g.get("t.u64"), Some(&Value::U64((1u64 << 63) + 5)));
    assert_eq!(g.get("t.i64"), Some(&Value::I64(-(1i64 << 62))));
    assert_eq!(g.get("t.f64"), Some(&Value::F64(-0.25)));
    assert_eq!(g.architecture().unwrap(), "llama");
}

#[test]
fn tensor_table_matches_gguf_py() {
    // Values printed by gguf-py 0.19's GGUFReader for this file: name, type, shape, data offset, bytes.
    let g = parse(&fixture()).unwrap();
    assert_eq!(g.data_offset, 576);
    let want = [
        ("a.f32", GgmlType::F32, vec![4u64, 3], 576u64, 48u64),
        ("b.f16", GgmlType::F16, vec![32, 2], 640, 128),
        ("c.q8_0", GgmlType::Q8_0, vec![32, 2], 768, 68),
    ];
    assert_eq!(g.tensors.len(), want.len());
    for (name, ty, dims, off, n) in want {
        let t = g.tensor(name).unwrap();
        assert_eq!((t.ty, &t.dims, t.offset, t.size), (ty, &dims, off, n), "{name}");
    }
}

#[test]
fn every_truncation_is_a_typed_error() {
    let b = fixture();
    // Any prefix that cuts the header or a tensor's data must fail cleanly (the file ends with
    // alignment padding after the last tensor, at 768 + 68 = 836 bytes per gguf-py).
    for n in 0..836 {
        let r = parse(&b[..n]);
        assert!(r.is_err(), "prefix of {n} bytes parsed");
    }
    assert!(parse(&b[..836]).is_ok(), "the data ends at 836; the padding after it is optional");
}

#[test]
fn hostile_headers() {
    let b = fixture();
    let mut bad = b.clone();
    bad[0] = b'X';
    assert!(matches!(parse(&bad), Err(GgufError::BadMagic(_))));
    let mut v1 = b.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(parse(&v1), Err(GgufError::UnsupportedVersion(1))));
    let mut many = b.clone();
    many[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(parse(&many), Err(GgufError::CountTooLarge { .. })));
    let mut kvs = b.clone();
    kvs[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(parse(&kvs), Err(GgufError::CountTooLarge { .. })));
    // First key's string length (at offset 24) made huge.
    let mut s = b.clone();
    s[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    assert!(matches!(parse(&s), Err(GgufError::Truncated { .. })));
}

/// Byte offset of tensor `i`'s info record (name length field) in the fixture.
fn tensor_info_offset(b: &[u8], i: usize) -> usize {
    // Walk the header with gguf's layout: skip kvs, then tensor infos.
    let rd = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let rd32 = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let n_kv = rd(16) as usize;
    let mut o = 24;
    fn skip_val(b: &[u8], o: usize, ty: u32) -> usize {
        let rd = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        match ty {
            0 | 1 | 7 => o + 1,
            2 | 3 => o + 2,
            4..=6 => o + 4,
            10..=12 => o + 8,
            8 => o + 8 + rd(o) as usize,
            9 => {
                let ety = u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
                let n = rd(o + 4) as usize;
                let mut p = o + 12;
                for _ in 0..n {
                    p = skip_val(b, p, ety);
                }
                p
            }
            _ => panic!(),
        }
    }
    for _ in 0..n_kv {
        o += 8 + rd(o) as usize;
        let ty = rd32(o);
        o = skip_val(b, o + 4, ty);
    }
    for _ in 0..i {
        o += 8 + rd(o) as usize;
        let nd = rd32(o) as usize;
        o += 4 + 8 * nd + 4 + 8;
    }
    o
}

#[test]
fn hostile_tensor_infos() {
    let b = fixture();
    let t0 = tensor_info_offset(&b, 0);
    let name_len = u64::from_le_bytes(b[t0..t0 + 8].try_into().unwrap()) as usize;
    let nd_at = t0 + 8 + name_len;
    assert_eq!(&b[t0 + 8..nd_at], b"a.f32");
    // Too many dims.
    let mut x = b.clone();
    x[nd_at..nd_at + 4].copy_from_slice(&5u32.to_le_bytes());
    assert!(matches!(parse(&x), Err(GgufError::TooManyDims { .. })));
    // Overflowing dimensions.
    let mut x = b.clone();
    x[nd_at + 4..nd_at + 12].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(parse(&x).is_err());
    // Unknown ggml type.
    let ty_at = nd_at + 4 + 16;
    let mut x = b.clone();
    x[ty_at..ty_at + 4].copy_from_slice(&999u32.to_le_bytes());
    assert!(matches!(parse(&x), Err(GgufError::UnknownTensorType { ty: 999, .. })));
    // Data offset past the end of the file.
    let off_at = ty_at + 4;
    let mut x = b.clone();
    x[off_at..off_at + 8].copy_from_slice(&(1u64 << 20).to_le_bytes());
    assert!(matches!(parse(&x), Err(GgufError::TensorOutOfBounds { .. })));
    // Misaligned offset.
    let mut x = b.clone();
    x[off_at..off_at + 8].copy_from_slice(&3u64.to_le_bytes());
    assert!(matches!(parse(&x), Err(GgufError::Misaligned { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    /// Random byte edits never panic (errors are fine).
    #[test]
    fn random_mutations_never_panic(edits in proptest::collection::vec((0usize..864, any::<u8>()), 1..8)) {
        let mut b = fixture();
        for (i, v) in edits {
            let n = b.len();
            b[i % n] = v;
        }
        let _ = parse(&b);
    }
}
