//! Weight quantizers (`quant::quantize::quantize_weights`) write the bytes llama.cpp's
//! `llama-quantize --pure` writes (no importance matrix), for Q4_0, Q4_1, Q8_0, Q2_K, Q3_K, Q4_K.
//! Reference: tests/fixtures/quantize/ made by `tools/make_quant_refs.py` (F32 rows of
//! rand-llama-moe and llama-quantize's output for them; see index.json).

use les::quant::quantize::quantize_weights;
use les::quant::{dequantize_row, GgmlType};

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{}/tests/fixtures/quantize/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

#[test]
fn quantizers_match_llama_quantize() {
    let index: serde_json::Value = serde_json::from_slice(&fixture("index.json")).unwrap();
    let types = index["types"].as_object().unwrap();
    assert_eq!(types.len(), 6);
    for (name, t) in types {
        let ty = GgmlType::from_u32(t["ggml_type"].as_u64().unwrap() as u32).unwrap();
        let blob = fixture(&format!("{name}.bin"));
        for e in t["entries"].as_array().unwrap() {
            let (cols, rows) = (e["cols"].as_u64().unwrap() as usize, e["rows"].as_u64().unwrap() as usize);
            let fo = e["f32_offset"].as_u64().unwrap() as usize;
            let qo = e["q_offset"].as_u64().unwrap() as usize;
            let qn = e["q_bytes"].as_u64().unwrap() as usize;
            let x: Vec<f32> = blob[fo..fo + 4 * cols * rows].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            let want = &blob[qo..qo + qn];
            let mut got = Vec::new();
            quantize_weights(ty, &x, &mut got).unwrap();
            let rb = got.len() / rows;
            for r in 0..rows {
                assert_eq!(&got[r * rb..(r + 1) * rb], &want[r * rb..(r + 1) * rb], "{name} {} row {r}: bytes differ from llama-quantize", e["tensor"]);
            }
            // And the bytes decode to something close to the input (sanity of the layout).
            let mut y = vec![0f32; x.len()];
            dequantize_row(ty, &got, &mut y).unwrap();
            let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
            let err = (x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / x.len() as f32).sqrt();
            assert!(err < 0.5 * rms, "{name} {}: rms error {err} vs rms {rms}", e["tensor"]);
        }
    }
}

#[test]
fn quantizer_rejects_bad_input() {
    let mut out = Vec::new();
    // Not a multiple of the block size.
    assert!(quantize_weights(GgmlType::Q2K, &[0.0; 100], &mut out).is_err());
    // A type without a weight quantizer.
    assert!(quantize_weights(GgmlType::Q6K, &[0.0; 256], &mut out).is_err());
    // All zeros quantize to zeros that decode to zeros.
    for ty in les::quant::quantize::WEIGHT_TYPES {
        quantize_weights(ty, &[0.0; 256], &mut out).unwrap();
        let mut y = vec![1f32; 256];
        dequantize_row(ty, &out, &mut y).unwrap();
        assert!(y.iter().all(|&v| v == 0.0), "{ty}");
    }
}
