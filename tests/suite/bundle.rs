//! Packed bundles (`les pack`): a small Mixtral-style MoE GGUF is written in the test with the GGUF
//! writer, packed, and read back. Every expert block must be byte-identical to what the GGUF expert
//! store returns; the embedded dense GGUF must hold the source's metadata and non-expert tensors;
//! truncated or corrupt bundles must be refused with typed errors, corrupt blocks caught by their
//! checksum on read, and injected I/O faults must surface as `ExpertError`s, never as wrong bytes.
//!
//! gguf-py cross-check (run by `writer_output_reads_in_gguf_py` when `python3 -c "import gguf"`
//! works; otherwise it prints a note and passes): the files the writer produced are read with
//! `gguf.GGUFReader` and every key (type and value) and tensor (type, shape, offset, bytes) must
//! match what LES's reader reports.

use les::expert::bundle::{pack, pack_named, Bundle, BundleError, BundleHeader, BUNDLE_VERSION, HEADER_LEN, VERSION_KEY};
use les::expert::store::{ExpertStore, GgufExpertStore};
use les::expert::{ExpertError, GgufExpertTensors};
use les::gguf::writer::{value_type, write_gguf, TensorData, WriteTensor};
use les::gguf::{GgufFile, Value};
use les::quant::GgmlType;
use les::store::fault::{Effect, FaultySource, Rule, Trigger};
use les::store::sub::SubSource;
use les::store::{ByteSource, MemSource, StoreError};
use std::io::Cursor;
use std::sync::Arc;

const N_EMBD: u64 = 64;
const N_FF: u64 = 96;
const N_VOCAB: u64 = 40;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Random but well-formed tensor bytes (small f16/f32 values, valid Q8_0 scales).
fn tensor_bytes(rng: &mut Rng, ty: GgmlType, dims: &[u64]) -> Vec<u8> {
    let n: u64 = dims.iter().product();
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| ((rng.next() % 2001) as f32 / 1000.0 - 1.0).to_le_bytes()).collect(),
        GgmlType::F16 => (0..n).flat_map(|_| half::f16::from_f32((rng.next() % 2001) as f32 / 1000.0 - 1.0).to_le_bytes()).collect(),
        GgmlType::Q8_0 => {
            let mut v = Vec::new();
            for _ in 0..n / 32 {
                v.extend_from_slice(&half::f16::from_f32(0.001 + (rng.next() % 100) as f32 / 10000.0).to_le_bytes());
                v.extend(rng.bytes(32));
            }
            v
        }
        _ => unreachable!(),
    }
}

/// Expert tensor types per layer: (gate, up, down). Layer 1 mixes types, so layouts differ per layer.
fn expert_types(il: usize) -> [GgmlType; 3] {
    match il % 3 {
        1 => [GgmlType::F32, GgmlType::Q8_0, GgmlType::F16],
        _ => [GgmlType::Q8_0; 3],
    }
}

/// A small `llama` MoE GGUF (Mixtral tensor names and shapes). `interleave` puts the expert
/// tensors between dense ones (as converters do); `alignment` is the GGUF alignment.
fn build_moe(n_layer: usize, n_expert: u64, alignment: u64, seed: u64) -> (Vec<u8>, Vec<(String, Value)>) {
    let mut rng = Rng(seed);
    let u32v = |v: u64| Value::U32(v as u32);
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("general.name".into(), Value::String("test-moe ✓".into())),
        ("llama.block_count".into(), u32v(n_layer as u64)),
        ("llama.context_length".into(), u32v(256)),
        ("llama.embedding_length".into(), u32v(N_EMBD)),
        ("llama.feed_forward_length".into(), u32v(N_FF)),
        ("llama.attention.head_count".into(), u32v(4)),
        ("llama.attention.head_count_kv".into(), u32v(2)),
        ("llama.attention.layer_norm_rms_epsilon".into(), Value::F32(1e-5)),
        ("llama.rope.freq_base".into(), Value::F32(10000.0)),
        ("llama.expert_count".into(), u32v(n_expert)),
        ("llama.expert_used_count".into(), u32v(2)),
        ("t.i64".into(), Value::I64(-(1 << 40))),
        ("t.f64".into(), Value::F64(0.125)),
        ("t.bool".into(), Value::Bool(false)),
        ("t.i16s".into(), Value::Array(vec![Value::I16(-3), Value::I16(7)])),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array((0..N_VOCAB).map(|i| Value::String(format!("t{i}"))).collect())),
    ];
    if alignment != 32 {
        meta.push(("general.alignment".into(), Value::U32(alignment as u32)));
    }
    let mut specs: Vec<(String, Vec<u64>, GgmlType)> = vec![
        ("token_embd.weight".into(), vec![N_EMBD, N_VOCAB], GgmlType::Q8_0),
        ("output_norm.weight".into(), vec![N_EMBD], GgmlType::F32),
    ];
    for il in 0..n_layer {
        let n = |s: &str| format!("blk.{il}.{s}");
        let [gt, ut, dt] = expert_types(il);
        specs.push((n("attn_norm.weight"), vec![N_EMBD], GgmlType::F32));
        specs.push((n("ffn_gate_exps.weight"), vec![N_EMBD, N_FF, n_expert], gt));
        specs.push((n("attn_q.weight"), vec![N_EMBD, N_EMBD], GgmlType::Q8_0));
        specs.push((n("attn_k.weight"), vec![N_EMBD, 32], GgmlType::Q8_0));
        specs.push((n("attn_v.weight"), vec![N_EMBD, 32], GgmlType::Q8_0));
        specs.push((n("ffn_down_exps.weight"), vec![N_FF, N_EMBD, n_expert], dt));
        specs.push((n("attn_output.weight"), vec![N_EMBD, N_EMBD], GgmlType::Q8_0));
        specs.push((n("ffn_norm.weight"), vec![N_EMBD], GgmlType::F32));
        specs.push((n("ffn_gate_inp.weight"), vec![N_EMBD, n_expert], GgmlType::F32));
        specs.push((n("ffn_up_exps.weight"), vec![N_EMBD, N_FF, n_expert], ut));
    }
    specs.push(("output.weight".into(), vec![N_EMBD, N_VOCAB], GgmlType::Q8_0));
    let data: Vec<Vec<u8>> = specs.iter().map(|(_, d, t)| tensor_bytes(&mut rng, *t, d)).collect();
    let tensors: Vec<WriteTensor> =
        specs.iter().zip(&data).map(|((name, dims, ty), b)| WriteTensor::new(name.clone(), dims, *ty, TensorData::Bytes(b))).collect();
    let mut out = Vec::new();
    write_gguf(&mut out, &meta, &tensors, alignment).unwrap();
    if alignment == 32 {
        // The reader reports the key only when it was written.
        assert!(!meta.iter().any(|(k, _)| k == "general.alignment"));
    }
    (out, meta)
}

fn is_expert_tensor(name: &str) -> bool {
    name.ends_with("_exps.weight")
}

fn pack_bytes(src: &[u8]) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    pack(&MemSource::new(src.to_vec()), &mut out, &mut |_, _| {}).unwrap();
    out.into_inner()
}

fn gguf_store(src: Arc<dyn ByteSource>) -> GgufExpertStore {
    let g = GgufFile::read(&*src).unwrap();
    let n_layer = g.get_u64("llama.block_count").unwrap() as usize;
    let n_expert = g.get_u64("llama.expert_count").unwrap() as usize;
    let t = (0..n_layer).map(|il| GgufExpertTensors::find(&g, il, N_EMBD as usize, n_expert).unwrap()).collect();
    GgufExpertStore::new(src, t, n_expert)
}

fn open(b: &[u8]) -> Result<Bundle, BundleError> {
    Bundle::open(Arc::new(MemSource::new(b.to_vec())))
}

#[test]
fn pack_round_trip() {
    let (n_layer, n_expert) = (3usize, 4u64);
    let (src, meta) = build_moe(n_layer, n_expert, 32, 1);
    let src_source: Arc<dyn ByteSource> = Arc::new(MemSource::new(src.clone()));
    let g = GgufFile::read(&*src_source).unwrap();

    let mut out = Cursor::new(Vec::new());
    let mut calls = Vec::new();
    let summary = pack_named(&*src_source, "test-moe.gguf", &mut out, &mut |d, t| calls.push((d, t))).unwrap();
    let bytes = out.into_inner();
    assert_eq!(summary.file_len, bytes.len() as u64);
    assert_eq!(bytes.len() % 4096, 0);
    assert_eq!((summary.n_layers, summary.n_expert), (n_layer, n_expert as usize));
    assert_eq!(summary.n_dense_tensors, g.tensors.iter().filter(|t| !is_expert_tensor(&t.name)).count());
    assert_eq!(calls.last(), Some(&(summary.file_len, summary.file_len)));
    assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 == w[1].1));

    let bundle = Bundle::open(Arc::new(MemSource::new(bytes.clone()))).unwrap();
    assert_eq!(bundle.n_expert(), n_expert as usize);
    assert_eq!(bundle.n_layers(), n_layer);
    assert_eq!(bundle.layer_blocks(), &[0, 1, 2]);
    assert_eq!(bundle.manifest().source_name, "test-moe.gguf");
    assert_eq!(bundle.manifest().source_size, src.len() as u64);
    assert_eq!(bundle.header().version, BUNDLE_VERSION);
    bundle.verify(&mut |_, _| {}).unwrap();

    // Expert blocks: byte-identical to the GGUF store's, 4096-aligned, one read each.
    let gs = gguf_store(src_source.clone());
    let counting = Arc::new(FaultySource::new(MemSource::new(bytes.clone()), 0));
    let counted = Bundle::open(counting.clone()).unwrap();
    let bs = counted.expert_store();
    assert_eq!((bs.name(), bs.reads_per_expert(), bs.n_layers()), ("bundle", 1, n_layer));
    assert_eq!((gs.name(), gs.reads_per_expert()), ("gguf", 3));
    let mut total = 0usize;
    for il in 0..n_layer {
        assert_eq!(bs.layout(il), gs.layout(il));
        assert_eq!(&bundle.layouts()[il], gs.layout(il));
        let [gt, ut, dt] = expert_types(il);
        let l = bs.layout(il);
        assert_eq!((l.n_embd, l.n_ff, l.gate_ty, l.up_ty, l.down_ty), (N_EMBD as usize, N_FF as usize, gt, ut, dt));
        for e in 0..n_expert as usize {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            gs.read_expert(il, e, &mut a).unwrap();
            let before = counting.reads();
            bs.read_expert(il, e, &mut b).unwrap();
            assert_eq!(counting.reads() - before, 1, "one range read per expert");
            assert_eq!(a.len(), l.bytes());
            assert!(a == b, "layer {il} expert {e}: bundle block differs from the GGUF ranges");
            let blk = bundle.block(il, e).unwrap();
            assert_eq!(blk.offset % 4096, 0);
            assert_eq!(blk.size as usize, l.bytes());
            assert_eq!(&bytes[blk.offset as usize..][..l.bytes()], &a[..]);
            total += l.bytes();
        }
    }
    assert_eq!(summary.expert_bytes as usize, total);
    assert!(matches!(bs.read_expert(0, n_expert as usize, &mut Vec::new()), Err(ExpertError::Invalid { .. })));
    assert!(matches!(bs.read_expert(n_layer, 0, &mut Vec::new()), Err(ExpertError::Invalid { .. })));

    // Dense GGUF: the source's metadata plus les.bundle.version; every non-expert tensor's bytes.
    let dense = bundle.dense_source();
    let dg = GgufFile::read(&dense).unwrap();
    assert_eq!(dg.metadata.len(), g.metadata.len() + 1);
    assert_eq!(&dg.metadata[..g.metadata.len()], &g.metadata[..]);
    assert_eq!(&dg.metadata[..meta.len()], &meta[..]);
    assert_eq!(dg.get(VERSION_KEY), Some(&Value::U32(BUNDLE_VERSION)));
    assert_eq!(dg.alignment, g.alignment);
    assert_eq!(bundle.dense_gguf().tensors.len(), dg.tensors.len());
    let want: Vec<_> = g.tensors.iter().filter(|t| !is_expert_tensor(&t.name)).collect();
    assert_eq!(dg.tensors.len(), want.len());
    for (t, w) in dg.tensors.iter().zip(want) {
        assert_eq!((&t.name, &t.dims, t.ty, t.size), (&w.name, &w.dims, w.ty, w.size));
        assert_eq!(dense.read_vec(t.offset, t.size as usize).unwrap(), src_source.read_vec(w.offset, w.size as usize).unwrap(), "{}", t.name);
    }
    // The dense GGUF is a valid model header (hyper-parameters parse unchanged).
    let cfg = les::model::config::Config::from_gguf(&dg).unwrap();
    assert_eq!((cfg.n_embd, cfg.n_layer, cfg.n_expert), (N_EMBD as usize, n_layer, n_expert as usize));

    // Packing is deterministic.
    assert!(pack_named(&*src_source, "test-moe.gguf", &mut Cursor::new(Vec::new()), &mut |_, _| {}).is_ok());
    let mut again = Cursor::new(Vec::new());
    pack_named(&*src_source, "test-moe.gguf", &mut again, &mut |_, _| {}).unwrap();
    assert!(again.into_inner() == bytes);
}

#[test]
fn pack_at_offset_alignment_64_and_file_output() {
    let (src, _) = build_moe(2, 8, 64, 2);
    // Written after 100 bytes of something else: offsets are relative to the bundle's start.
    let mut out = Cursor::new(vec![0xEEu8; 100]);
    out.set_position(100);
    let s = pack(&MemSource::new(src.clone()), &mut out, &mut |_, _| {}).unwrap();
    let all = out.into_inner();
    assert_eq!(all.len() as u64, 100 + s.file_len);
    assert!(all[..100].iter().all(|&b| b == 0xEE));
    let inner: Arc<dyn ByteSource> = Arc::new(SubSource::new(MemSource::new(all.clone()), 100, s.file_len).unwrap());
    let b = Bundle::open(inner).unwrap();
    assert_eq!(b.dense_gguf().alignment, 64);
    let gs = gguf_store(Arc::new(MemSource::new(src.clone())));
    let bs = b.expert_store();
    for il in 0..2 {
        for e in 0..8 {
            let (mut x, mut y) = (Vec::new(), Vec::new());
            gs.read_expert(il, e, &mut x).unwrap();
            bs.read_expert(il, e, &mut y).unwrap();
            assert!(x == y);
        }
    }
    assert!(all[100..] == pack_bytes(&src)[..]);

    // A real file through FileSource.
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("bundle-test-{}.les", std::process::id()));
    {
        let mut f = std::fs::File::create(&path).unwrap();
        pack(&MemSource::new(src.clone()), &mut f, &mut |_, _| {}).unwrap();
    }
    let fb = Bundle::open(Arc::new(les::store::FileSource::open(&path).unwrap())).unwrap();
    fb.verify(&mut |_, _| {}).unwrap();
    let mut y = Vec::new();
    fb.expert_store().read_expert(1, 7, &mut y).unwrap();
    let mut x = Vec::new();
    gs.read_expert(1, 7, &mut x).unwrap();
    assert!(x == y);
    std::fs::remove_file(&path).ok();
}

#[test]
fn truncated_bundles_are_refused() {
    let (src, _) = build_moe(2, 4, 32, 3);
    let b = pack_bytes(&src);
    let len = b.len();
    let mut cuts: Vec<usize> = (0..600).collect();
    cuts.extend((600..len).step_by(97));
    cuts.extend([len - 4096, len - 4095, len - 1]);
    for n in cuts {
        match open(&b[..n]) {
            Err(BundleError::Truncated { expected, actual, .. }) => {
                assert_eq!(actual, n as u64);
                assert!(expected > actual);
            }
            other => panic!("prefix of {n} bytes: {other:?}"),
        }
    }
    // Trailing garbage is refused too.
    let mut longer = b.clone();
    longer.extend_from_slice(&[0; 10]);
    assert!(matches!(open(&longer), Err(BundleError::Corrupt(_))));
}

#[test]
fn header_and_manifest_corruption_is_refused() {
    let (src, _) = build_moe(2, 4, 32, 4);
    let b = pack_bytes(&src);
    let h = BundleHeader::decode(&b[..HEADER_LEN as usize], b.len() as u64).unwrap();
    // Every single-byte change in the header or the manifest.
    let m_end = (h.manifest_off + h.manifest_len) as usize;
    for at in 0..m_end {
        for x in [0x01u8, 0x80, 0xFF] {
            let mut c = b.clone();
            c[at] ^= x;
            match (at, open(&c)) {
                (0..=7, Err(BundleError::BadMagic(_))) => {}
                (8..=11, Err(BundleError::UnsupportedVersion(_))) => {}
                (12..=127, Err(BundleError::HeaderChecksum { .. })) => {}
                (128.., Err(BundleError::ManifestChecksum { .. })) => {}
                (_, r) => panic!("byte {at} ^ {x:#x}: {r:?}"),
            }
        }
    }
    // Bytes between the manifest and the dense GGUF are padding: changes there are harmless.
    let mut c = b.clone();
    c[m_end] ^= 0xFF;
    open(&c).unwrap();
    // A corrupt dense GGUF header: typed error.
    let mut c = b.clone();
    c[h.dense_off as usize] ^= 0xFF;
    assert!(matches!(open(&c), Err(BundleError::Dense(_))));
    let mut c = b.clone();
    c[h.dense_off as usize + 9] ^= 0x40; // tensor count
    assert!(matches!(open(&c), Err(BundleError::Dense(_))));
}

fn put64(c: &mut [u8], at: usize, v: u64) {
    c[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn put32(c: &mut [u8], at: usize, v: u32) {
    c[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn get64(c: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(c[at..at + 8].try_into().unwrap())
}

/// Re-sign a header after editing it.
fn resign_header(b: &mut [u8]) {
    let crc = crc32fast::hash(&b[..124]);
    b[124..128].copy_from_slice(&crc.to_le_bytes());
}

/// Re-sign the manifest (and then the header) after editing it.
fn resign(b: &mut [u8]) {
    let h = BundleHeader::decode(&b[..128], b.len() as u64).unwrap_or_else(|_| panic!("header must stay valid"));
    let m = &b[h.manifest_off as usize..(h.manifest_off + h.manifest_len) as usize];
    let crc = crc32fast::hash(m);
    b[40..44].copy_from_slice(&crc.to_le_bytes());
    resign_header(b);
}

#[test]
fn consistent_but_wrong_offsets_are_refused() {
    let (src, _) = build_moe(2, 4, 32, 5);
    let b = pack_bytes(&src);
    let h = BundleHeader::decode(&b[..128], b.len() as u64).unwrap();
    let m0 = h.manifest_off as usize;
    let name_pad = 0; // pack() records no name
    let layers = m0 + 32 + name_pad;
    let blocks = layers + 64 * 2;

    // Manifest edits (re-signed, so only the semantic checks can catch them).
    type Edit = Box<dyn Fn(&mut Vec<u8>)>;
    let edits: Vec<(&str, Edit)> = vec![
        ("unaligned block", Box::new(move |c| { let o = get64(c, blocks + 24); put64(c, blocks + 24, o + 8) })),
        ("block past end", Box::new(move |c| { let n = c.len() as u64; put64(c, blocks + 24 * 7, n) })),
        ("huge block offset", Box::new(move |c| put64(c, blocks + 24 * 7, u64::MAX - 4095))),
        ("wrong block size", Box::new(move |c| { let s = get64(c, blocks + 8); put64(c, blocks + 8, s + 1) })),
        ("huge block size", Box::new(move |c| put64(c, blocks + 8, u64::MAX))),
        ("overlapping blocks", Box::new(move |c| { let o = get64(c, blocks); put64(c, blocks + 24, o) })),
        ("block inside dense part", Box::new(move |c| put64(c, blocks, h.dense_off))),
        ("unknown type", Box::new(move |c| put32(c, layers + 4, 1234))),
        ("wrong gate bytes", Box::new(move |c| { let s = get64(c, layers + 32); put64(c, layers + 32, s - 34) })),
        ("zero n_embd", Box::new(move |c| put64(c, layers + 16, 0))),
        ("huge n_ff", Box::new(move |c| put64(c, layers + 24, u64::MAX / 2))),
        ("layer count", Box::new(move |c| put32(c, m0 + 8, 3))),
        ("expert count", Box::new(move |c| put32(c, m0 + 12, 1 << 30))),
        ("name length", Box::new(move |c| put32(c, m0 + 24, 1 << 31))),
        ("manifest magic", Box::new(move |c| c[m0] = b'X')),
    ];
    for (what, f) in edits {
        let mut c = b.clone();
        f(&mut c);
        resign(&mut c);
        match open(&c) {
            Err(BundleError::Corrupt(msg)) => eprintln!("{what}: {msg}"),
            r => panic!("{what}: {r:?}"),
        }
    }

    // Header edits (re-signed).
    let hedits: Vec<(&str, Edit)> = vec![
        ("manifest inside header", Box::new(|c| put64(c, 24, 64))),
        ("manifest length huge", Box::new(|c| put64(c, 32, u64::MAX - 100))),
        ("manifest past dense", Box::new(move |c| put64(c, 32, h.dense_off))),
        ("dense unaligned", Box::new(move |c| put64(c, 48, h.dense_off + 1))),
        ("dense length huge", Box::new(|c| put64(c, 56, u64::MAX))),
        ("experts before dense end", Box::new(move |c| put64(c, 72, h.dense_off))),
        ("experts length", Box::new(move |c| put64(c, 80, h.experts_len - 4096))),
        ("block alignment", Box::new(|c| put32(c, 44, 512))),
        ("header length", Box::new(|c| put32(c, 12, 64))),
        ("layer count", Box::new(|c| put32(c, 68, 7))),
    ];
    for (what, f) in hedits {
        let mut c = b.clone();
        f(&mut c);
        resign_header(&mut c);
        match open(&c) {
            Err(BundleError::Corrupt(msg)) => eprintln!("{what}: {msg}"),
            Err(BundleError::ManifestChecksum { .. }) if what == "manifest inside header" => {}
            r => panic!("{what}: {r:?}"),
        }
    }
    // File length in the header larger than the file: truncated.
    let mut c = b.clone();
    put64(&mut c, 16, b.len() as u64 + 4096);
    resign_header(&mut c);
    assert!(matches!(open(&c), Err(BundleError::Truncated { .. })));

    // Random multi-byte edits of the header and manifest, re-signed: never a panic; when the
    // result opens, reading every expert gives bytes or a typed error.
    let mut rng = Rng(99);
    let m_end = (h.manifest_off + h.manifest_len) as usize;
    for _ in 0..3000 {
        let mut c = b.clone();
        for _ in 0..1 + rng.next() % 4 {
            let at = (rng.next() as usize) % m_end;
            if (120..128).contains(&at) || (40..44).contains(&at) {
                continue;
            }
            c[at] = rng.next() as u8;
        }
        if BundleHeader::decode(&c[..128], c.len() as u64).is_ok() {
            resign(&mut c);
        } else {
            resign_header(&mut c);
        }
        if let Ok(bd) = open(&c) {
            let s = bd.expert_store();
            for il in 0..bd.n_layers() {
                for e in 0..bd.n_expert() {
                    let _ = s.read_expert(il, e, &mut Vec::new());
                }
            }
        }
    }
}

#[test]
fn corrupt_block_is_caught_on_read() {
    let (src, _) = build_moe(3, 4, 32, 6);
    let b = pack_bytes(&src);
    let good = open(&b).unwrap();
    let blk = *good.block(1, 2).unwrap();
    for at in [blk.offset, blk.offset + blk.size / 2, blk.offset + blk.size - 1] {
        let mut c = b.clone();
        c[at as usize] ^= 0x10;
        let bundle = open(&c).expect("block corruption is found on read, not at open");
        let s = bundle.expert_store();
        let mut buf = Vec::new();
        match s.read_expert(1, 2, &mut buf) {
            Err(ExpertError::Invalid { layer: 1, expert: 2, why }) => assert!(why.contains("checksum mismatch"), "{why}"),
            r => panic!("corrupt block read: {r:?}"),
        }
        let msg = s.read_expert(1, 2, &mut buf).unwrap_err().to_string();
        assert!(msg.contains("expert 2 of layer 1") && msg.contains("checksum mismatch"), "{msg}");
        // Other experts are unaffected.
        for (il, e) in [(1, 1), (1, 3), (0, 2), (2, 2)] {
            s.read_expert(il, e, &mut buf).unwrap();
        }
        assert!(matches!(bundle.verify(&mut |_, _| {}), Err(BundleError::BlockChecksum { layer: 1, expert: 2, .. })));
    }
    // Padding after a block is not part of it.
    let mut c = b.clone();
    c[(blk.offset + blk.size) as usize] ^= 0x10;
    open(&c).unwrap().expert_store().read_expert(1, 2, &mut Vec::new()).unwrap();
    // Dense tensor bytes: caught by verify().
    let h = good.header().clone();
    let mut c = b.clone();
    c[(h.dense_off + h.dense_len - 10) as usize] ^= 1;
    assert!(matches!(open(&c).unwrap().verify(&mut |_, _| {}), Err(BundleError::DenseChecksum { .. })));
}

#[test]
fn injected_faults_surface_as_expert_errors() {
    let (src, _) = build_moe(2, 4, 32, 7);
    let b = pack_bytes(&src);
    let plain = open(&b).unwrap();
    let want = |il: usize, e: usize| {
        let mut v = Vec::new();
        plain.expert_store().read_expert(il, e, &mut v).unwrap();
        v
    };
    let blk = *plain.block(1, 3).unwrap();
    let (start, end) = (blk.offset, blk.offset + blk.size);
    let faulty = |rule: Rule| {
        let fs = Arc::new(FaultySource::new(MemSource::new(b.clone()), 11).with(rule));
        let bundle = Bundle::open(fs.clone()).unwrap();
        (fs, bundle.expert_store())
    };
    let mut buf = Vec::new();

    // I/O error on reads touching the block.
    let (_, s) = faulty(Rule::error_on_range(start + 100, start + 101));
    match s.read_expert(1, 3, &mut buf) {
        Err(ExpertError::Store { layer: 1, expert: 3, source: StoreError::Io { .. } }) => {}
        r => panic!("{r:?}"),
    }
    s.read_expert(1, 2, &mut buf).unwrap();
    assert_eq!(buf, want(1, 2));

    // Short read.
    let (_, s) = faulty(Rule::short_on_range(start, end));
    match s.read_expert(1, 3, &mut buf) {
        Err(ExpertError::Store { layer: 1, expert: 3, source: StoreError::ShortRead { .. } }) => {}
        r => panic!("{r:?}"),
    }

    // The n-th read fails (reads 0.. are the header, manifest and dense GGUF header at open).
    let fs = Arc::new(FaultySource::new(MemSource::new(b.clone()), 11));
    let s = Bundle::open(fs.clone()).unwrap().expert_store();
    fs.add(Rule::error_on_read(fs.reads() + 1));
    s.read_expert(0, 0, &mut buf).unwrap();
    assert!(matches!(s.read_expert(0, 1, &mut buf), Err(ExpertError::Store { layer: 0, expert: 1, .. })));
    s.read_expert(0, 1, &mut buf).unwrap();
    assert_eq!(buf, want(0, 1));

    // A flipped bit in returned data: checksum mismatch, never wrong bytes.
    let (_, s) = faulty(Rule::flip_bit(start + 7, 5));
    match s.read_expert(1, 3, &mut buf) {
        Err(ExpertError::Invalid { layer: 1, expert: 3, why }) => assert!(why.contains("checksum mismatch")),
        r => panic!("{r:?}"),
    }

    // Fail once, then succeed: a retry gets the right bytes.
    let (fs, s) = faulty(Rule::fail_range(start, end, 1));
    assert!(s.read_expert(1, 3, &mut buf).is_err());
    s.read_expert(1, 3, &mut buf).unwrap();
    assert_eq!(buf, want(1, 3));
    assert_eq!(fs.injected().len(), 1);

    // A seeded random plan over many reads: every read gives the right bytes or an error.
    let wants: Vec<Vec<Vec<u8>>> = (0..2).map(|il| (0..4).map(|e| want(il, e)).collect()).collect();
    for seed in 0..4u64 {
        let fs = Arc::new(FaultySource::new(MemSource::new(b.clone()), seed));
        let s = Bundle::open(fs.clone()).unwrap().expert_store();
        for (p, effect) in [(0.1, Effect::IoError), (0.1, Effect::ShortRead), (0.2, Effect::FlipBit { bit: (seed % 8) as u8 })] {
            fs.add(Rule::new(Trigger::Random { p }, effect, None));
        }
        let (mut ok, mut err) = (0, 0);
        for i in 0..400usize {
            let (il, e) = (i % 2, (i / 2) % 4);
            match s.read_expert(il, e, &mut buf) {
                Ok(()) => {
                    assert!(buf == wants[il][e], "seed {seed} read {i}: wrong bytes returned as Ok");
                    ok += 1;
                }
                Err(ExpertError::Store { .. } | ExpertError::Invalid { .. }) => err += 1,
            }
        }
        assert!(ok > 100 && err > 50, "seed {seed}: {ok} ok, {err} errors");
        assert_eq!(fs.injected().len(), err, "seed {seed}: every injected fault is reported, none passes");
    }

    // The GGUF store surfaces faults the same way.
    let fsg = Arc::new(FaultySource::new(MemSource::new(src.clone()), 1));
    let gs = gguf_store(fsg.clone());
    fsg.add(Rule::short_on_read(fsg.reads() + 2));
    assert!(matches!(gs.read_expert(0, 0, &mut buf), Err(ExpertError::Store { layer: 0, expert: 0, source: StoreError::ShortRead { .. } })));

    // Packing from a failing source: a typed error.
    let (bad_at, _) = {
        let g = GgufFile::read(&MemSource::new(src.clone())).unwrap();
        let t = g.tensor("blk.1.ffn_down_exps.weight").unwrap();
        (t.offset + 5, ())
    };
    let fsrc = FaultySource::new(MemSource::new(src.clone()), 1).with(Rule::error_on_range(bad_at, bad_at + 1));
    // (the GGUF header is read in one 1 MiB window, which covers this tiny file: the fault hits it)
    assert!(matches!(
        pack(&fsrc, &mut Cursor::new(Vec::new()), &mut |_, _| {}),
        Err(BundleError::Source(les::gguf::GgufError::Store(StoreError::Io { .. })))
    ));
    // A later read (a tensor's data) fails.
    let fsrc = FaultySource::new(MemSource::new(src.clone()), 1).with(Rule::error_on_read(5));
    assert!(matches!(pack(&fsrc, &mut Cursor::new(Vec::new()), &mut |_, _| {}), Err(BundleError::Store(StoreError::Io { .. }))));
    let fsrc = FaultySource::new(MemSource::new(src.clone()), 1).with(Rule::short_on_read(40));
    assert!(matches!(pack(&fsrc, &mut Cursor::new(Vec::new()), &mut |_, _| {}), Err(BundleError::Store(StoreError::ShortRead { .. }))));
}

#[test]
fn non_moe_and_incomplete_sources_are_refused() {
    let t = [0u8; 68];
    let meta = vec![("general.architecture".to_string(), Value::String("llama".into()))];
    let dense = vec![WriteTensor::new("blk.0.ffn_gate.weight", &[32, 2], GgmlType::Q8_0, TensorData::Bytes(&t))];
    let mut g = Vec::new();
    write_gguf(&mut g, &meta, &dense, 32).unwrap();
    assert!(matches!(pack(&MemSource::new(g), &mut Cursor::new(Vec::new()), &mut |_, _| {}), Err(BundleError::Unsupported(_))));

    let half = vec![WriteTensor::new("blk.0.ffn_gate_exps.weight", &[32, 1, 2], GgmlType::Q8_0, TensorData::Bytes(&t))];
    let mut g = Vec::new();
    write_gguf(&mut g, &meta, &half, 32).unwrap();
    assert!(matches!(pack(&MemSource::new(g), &mut Cursor::new(Vec::new()), &mut |_, _| {}), Err(BundleError::Unsupported(_))));

    assert!(matches!(pack(&MemSource::new(b"GGUF".to_vec()), &mut Cursor::new(Vec::new()), &mut |_, _| {}), Err(BundleError::Source(_))));
    assert!(matches!(open(b"definitely not a bundle, but long enough to hold a header......................................................................."), Err(BundleError::BadMagic(_))));
}

fn value_json(v: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        Value::F32(x) => J::from(*x as f64),
        Value::F64(x) => J::from(*x),
        Value::Bool(b) => J::from(*b),
        Value::String(s) => J::from(s.clone()),
        Value::Array(a) => J::Array(a.iter().map(value_json).collect()),
        Value::I8(_) | Value::I16(_) | Value::I32(_) | Value::I64(_) => J::from(v.as_i64().unwrap()),
        _ => J::from(v.as_u64().unwrap()),
    }
}

const GGUF_PY_DUMP: &str = r#"
import sys, json, zlib
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
kv = {}
for name, f in r.fields.items():
    if name.startswith("GGUF."):
        continue
    kv[name] = {"types": [int(t) for t in f.types], "value": f.contents()}
ts = [{"name": t.name, "type": int(t.tensor_type), "ne": [int(x) for x in t.shape], "n_bytes": int(t.n_bytes),
       "crc": zlib.crc32(t.data.tobytes()), "offset": int(t.data_offset)} for t in r.tensors]
print(json.dumps({"kv": kv, "tensors": ts}))
"#;

#[test]
fn writer_output_reads_in_gguf_py() {
    let have = std::process::Command::new("python3").args(["-c", "import gguf"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !have {
        eprintln!("note: python3 with the `gguf` package not found; gguf-py cross-check skipped");
        return;
    }
    let (src, _) = build_moe(2, 4, 64, 8);
    let b = pack_bytes(&src);
    let bundle = open(&b).unwrap();
    let h = bundle.header();
    let dense = b[h.dense_off as usize..(h.dense_off + h.dense_len) as usize].to_vec();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    for (tag, bytes) in [("source", src), ("dense", dense)] {
        let path = dir.join(format!("bundle-py-{tag}-{}.gguf", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let o = std::process::Command::new("python3").args(["-c", GGUF_PY_DUMP]).arg(&path).output().unwrap();
        std::fs::remove_file(&path).ok();
        assert!(o.status.success(), "gguf-py failed on the {tag} GGUF: {}", String::from_utf8_lossy(&o.stderr));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let g = GgufFile::read(&MemSource::new(bytes.clone())).unwrap();
        let kv = j["kv"].as_object().unwrap();
        assert_eq!(kv.len(), g.metadata.len(), "{tag}: key count");
        for (k, v) in &g.metadata {
            let p = &kv[k.as_str()];
            let mut types = vec![value_type(v) as u64];
            if let Value::Array(a) = v {
                types.push(a.first().map(value_type).unwrap_or(0) as u64);
            }
            let py_types: Vec<u64> = p["types"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
            assert_eq!(py_types, types, "{tag}: {k} type");
            assert_eq!(p["value"], value_json(v), "{tag}: {k}");
        }
        let ts = j["tensors"].as_array().unwrap();
        assert_eq!(ts.len(), g.tensors.len());
        for (p, t) in ts.iter().zip(&g.tensors) {
            assert_eq!(p["name"].as_str().unwrap(), t.name);
            assert_eq!(p["type"].as_u64().unwrap(), t.ty as u64, "{}", t.name);
            let ne: Vec<u64> = p["ne"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            assert_eq!(ne, t.dims, "{}", t.name);
            assert_eq!(p["n_bytes"].as_u64().unwrap(), t.size, "{}", t.name);
            assert_eq!(p["offset"].as_u64().unwrap(), t.offset, "{}", t.name);
            let crc = crc32fast::hash(&bytes[t.offset as usize..(t.offset + t.size) as usize]);
            assert_eq!(p["crc"].as_u64().unwrap(), crc as u64, "{}", t.name);
        }
        eprintln!("gguf-py agrees on the {tag} GGUF ({} keys, {} tensors)", g.metadata.len(), g.tensors.len());
    }
}

/// Pack `path`, then check every expert against the GGUF store and the dense part against the
/// source. Returns (bundle bytes, seconds to pack).
fn check_model_file(path: &std::path::Path) -> (u64, f64) {
    use les::store::FileSource;
    let src: Arc<dyn ByteSource> = Arc::new(FileSource::open(path).unwrap());
    let g = GgufFile::read(&*src).unwrap();
    let out_path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{}-{}.les", path.file_stem().unwrap().to_string_lossy(), std::process::id()));
    let t0 = std::time::Instant::now();
    let mut last = (0, 0);
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&out_path).unwrap());
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        pack_named(&*src, &name, &mut f, &mut |d, t| last = (d, t)).unwrap();
        use std::io::Write;
        f.flush().unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    let bundle = Bundle::open(Arc::new(FileSource::open(&out_path).unwrap())).unwrap();
    assert_eq!(last, (bundle.header().file_len, bundle.header().file_len));
    let arch = g.architecture().unwrap().to_string();
    let n_expert = g.get_u64(&format!("{arch}.expert_count")).unwrap() as usize;
    let n_embd = g.get_u64(&format!("{arch}.embedding_length")).unwrap() as usize;
    let n_layer = g.get_u64(&format!("{arch}.block_count")).unwrap() as usize;
    assert_eq!((bundle.n_layers(), bundle.n_expert()), (n_layer, n_expert));
    let t = (0..n_layer).map(|il| GgufExpertTensors::find(&g, il, n_embd, n_expert).unwrap()).collect();
    let gs = GgufExpertStore::new(src.clone(), t, n_expert);
    let bs = bundle.expert_store();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for il in 0..n_layer {
        assert_eq!(bs.layout(il), gs.layout(il));
        for e in 0..n_expert {
            gs.read_expert(il, e, &mut a).unwrap();
            bs.read_expert(il, e, &mut b).unwrap();
            assert!(a == b, "{}: layer {il} expert {e} differs", path.display());
            assert_eq!(bundle.block(il, e).unwrap().offset % 4096, 0);
        }
    }
    let dense = bundle.dense_source();
    let dg = GgufFile::read(&dense).unwrap();
    assert_eq!(&dg.metadata[..g.metadata.len()], &g.metadata[..]);
    let want: Vec<_> = g.tensors.iter().filter(|t| !is_expert_tensor(&t.name)).collect();
    assert_eq!(dg.tensors.len(), want.len());
    for (t, w) in dg.tensors.iter().zip(want) {
        assert_eq!((&t.name, &t.dims, t.ty), (&w.name, &w.dims, w.ty));
        assert!(dense.read_vec(t.offset, t.size as usize).unwrap() == src.read_vec(w.offset, w.size as usize).unwrap(), "{}", t.name);
    }
    les::model::config::Config::from_gguf(&dg).unwrap();
    let len = bundle.header().file_len;
    drop(bundle);
    std::fs::remove_file(&out_path).ok();
    (len, secs)
}

/// The random MoE models of tools/build_models.sh (every supported architecture), when present.
#[test]
fn random_moe_models_if_present() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models");
    let mut n = 0;
    for arch in ["llama-moe", "qwen2moe", "qwen3moe", "olmoe"] {
        let p = dir.join(format!("rand-{arch}.gguf"));
        if p.exists() {
            let (len, secs) = check_model_file(&p);
            eprintln!("{}: bundle of {len} bytes packed in {secs:.2}s, identical experts and dense part", p.display());
            n += 1;
        }
    }
    if n == 0 {
        eprintln!("note: no models/rand-*.gguf (tools/build_models.sh); covered by the synthetic tests only");
    }
}

/// A large model: `LES_PACK_GGUF=models/smolmoe-32x2.gguf cargo test --release --test suite -- bundle:: --ignored --nocapture`.
#[test]
#[ignore]
fn pack_large_model_from_env() {
    let Ok(p) = std::env::var("LES_PACK_GGUF") else {
        eprintln!("set LES_PACK_GGUF to a MoE GGUF");
        return;
    };
    let p = std::path::PathBuf::from(p);
    let size = std::fs::metadata(&p).unwrap().len();
    let (len, secs) = check_model_file(&p);
    eprintln!("{}: {size} bytes -> bundle of {len} bytes in {secs:.1}s ({:.0} MB/s)", p.display(), size as f64 / secs / 1e6);
}
