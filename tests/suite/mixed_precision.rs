//! Layer-wise mixed precision in bundles (`les pack --expert-types`): the per-layer expert types
//! round-trip through the manifest, each block holds exactly the source matrices re-quantized with
//! the weight quantizers (themselves byte-exact against llama-quantize, tests/suite/quantize.rs), and the
//! model streamed from such a bundle computes bit for bit the logits of a GGUF whose expert tensors
//! were re-quantized the same way (built here independently with the GGUF writer).


use les::engine::stream::{open_streaming, StreamOptions};
use les::engine::Session;
use les::expert::bundle::{pack_with, Bundle, ExpertTypes};
use les::expert::stream::StreamConfig;
use les::gguf::writer::{write_gguf, TensorData, WriteTensor};
use les::gguf::GgufFile;
use les::model::{ExpertMode, Logits};
use les::quant::quantize::quantize_weights;
use les::quant::{dequantize_row, GgmlType};
use les::store::{ByteSource, FileSource, MemSource};
use std::sync::Arc;

use GgmlType::*;

/// rand-llama-moe: gate/up rows of 256 (K-quants fit), down rows of 128 (32-blocks only).
fn types() -> Vec<ExpertTypes> {
    vec![Some([Q2K, Q3K, Q4_0]), None, Some([Q4K, Q4K, Q8_0]), Some([Q3K, Q2K, Q4_1])]
}

/// A stacked expert tensor [cols, rows, n_expert] of type `from` re-quantized to `to`.
fn requant_tensor(bytes: &[u8], from: GgmlType, to: GgmlType, cols: usize, rows_total: usize) -> Vec<u8> {
    let mut x = vec![0f32; cols * rows_total];
    dequantize_row(from, bytes, &mut x).unwrap();
    let mut q = Vec::new();
    quantize_weights(to, &x, &mut q).unwrap();
    q
}

#[test]
fn mixed_bundle_round_trips_and_matches_requantized_gguf() {
    let path = crate::common::model("rand-llama-moe.gguf");
    let src = FileSource::open(path.to_str().unwrap()).unwrap();
    let g = GgufFile::read(&src).unwrap();

    // The bundle.
    let dir = std::env::temp_dir().join(format!("les-mixed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bpath = dir.join("mixed.les");
    let mut f = std::fs::File::create(&bpath).unwrap();
    let sum = pack_with(&src, "rand-llama-moe.gguf", &types(), &mut f, &mut |_, _| {}).unwrap();
    drop(f);
    let b = Bundle::open(Arc::new(FileSource::open(bpath.to_str().unwrap()).unwrap())).unwrap();
    b.verify(&mut |_, _| {}).unwrap();
    for (il, want) in types().iter().enumerate() {
        let lay = &b.layouts()[il];
        let src_ty = |w: &str| g.req_tensor(&format!("blk.{il}.ffn_{w}_exps.weight")).unwrap().ty;
        let expect = want.unwrap_or([src_ty("gate"), src_ty("up"), src_ty("down")]);
        assert_eq!([lay.gate_ty, lay.up_ty, lay.down_ty], expect, "layer {il}: types in the manifest");
    }
    // A layer named with its own types keeps them, even types without a quantizer (Q6_K, F16).
    let l2 = les::expert::GgufExpertTensors::find(&g, 2, b.layouts()[2].n_embd, 8).unwrap().layout;
    assert_eq!([l2.gate_ty, l2.up_ty, l2.down_ty], [Q6K, Q6K, F16]);
    assert_eq!(les::expert::bundle::requant_layout(&l2, [Q6K, Q6K, F16]).unwrap(), l2);
    let plain: u64 = g.tensors.iter().filter(|t| t.name.contains("_exps.")).map(|t| t.size).sum();
    assert!(sum.expert_bytes < plain, "re-quantized experts are smaller: {} vs {plain}", sum.expert_bytes);

    // The reference: the same GGUF with its expert tensors re-quantized.
    let mut owned: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> = Vec::new();
    for t in &g.tensors {
        let data = src.read_vec(t.offset, t.size as usize).unwrap();
        let layer_types = t.name.strip_prefix("blk.").and_then(|r| r.split_once('.')).and_then(|(n, _)| n.parse::<usize>().ok()).and_then(|il| types().get(il).copied().flatten());
        let which = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"].iter().position(|w| t.name.ends_with(&format!("{w}.weight")));
        match (layer_types, which) {
            (Some(tys), Some(k)) => {
                let (cols, rows) = (t.dims[0] as usize, (t.dims[1] * t.dims[2]) as usize);
                owned.push((t.name.clone(), t.dims.clone(), tys[k], requant_tensor(&data, t.ty, tys[k], cols, rows)));
            }
            _ => owned.push((t.name.clone(), t.dims.clone(), t.ty, data)),
        }
    }
    let wts: Vec<WriteTensor> = owned.iter().map(|(n, d, ty, b)| WriteTensor::new(n.clone(), d, *ty, TensorData::Bytes(b))).collect();
    let mut gguf = Vec::new();
    write_gguf(&mut gguf, &g.metadata, &wts, g.alignment).unwrap();
    let mut reference = Session::load(&MemSource::new(gguf), ExpertMode::Resident, 256).unwrap();

    // The model streamed from the bundle (every expert slot available, and a small cache).
    for slots in [usize::MAX, 9] {
        let so = StreamOptions { budget: 0, n_ctx: 256, direct: false, profile: None, cache: StreamConfig::default(), slots: Some(slots), gpu_pool: false, dense: Default::default() };
        let mut streamed = open_streaming(bpath.to_str().unwrap(), &so).unwrap().session;
        let toks = reference.tokenize("The quick brown fox jumps over the lazy dog, then");
        reference.kv.clear();
        let want = reference.forward(&toks, Logits::All).unwrap();
        let got = streamed.forward(&toks, Logits::All).unwrap();
        assert_eq!(got.len(), want.len());
        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "slots {slots}: logits differ from the re-quantized GGUF's");
        // A few decode steps too.
        for t in [17u32, 4242, 99] {
            let a = reference.forward(&[t], Logits::Last).unwrap();
            let b = streamed.forward(&[t], Logits::Last).unwrap();
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "slots {slots}: decode logits differ");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
