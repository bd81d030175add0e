//! Hash of the logits a model computes on the reference prompts (teacher forced), to compare
//! platforms bit for bit: `tools/test_arm.sh` runs it natively with the portable kernels
//! (`LES_NO_SIMD=1`) and on an emulated AArch64 CPU with the NEON kernels; the hashes must match.
//!
//!   cargo run --release --example logits_hash -- MODEL.gguf REFS.json [ROWS]
//!
//! For the first two prompts of REFS.json (a `tests/fixtures/refs` file): the prompt in one batch,
//! then ROWS - 1 (default 6) of llama.cpp's generated tokens one at a time; prints the FNV-1a hash
//! of every logit's bits over those ROWS rows, per prompt.
use les::engine::Session;
use les::model::{ExpertMode, Logits};
use les::store::FileSource;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(model), Some(refs)) = (args.get(1), args.get(2)) else {
        return Err("usage: logits_hash MODEL.gguf REFS.json [ROWS]".into());
    };
    let rows: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(6);
    let refs: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(refs)?)?;
    let src = FileSource::open(model)?;
    let mut s = Session::load(&src, ExpertMode::Resident, 512)?;
    let ids = |v: &serde_json::Value| -> Vec<u32> { v.as_array().into_iter().flatten().filter_map(|x| x.as_u64()).map(|x| x as u32).collect() };
    for (pi, p) in refs["prompts"].as_array().ok_or("no prompts")?.iter().take(2).enumerate() {
        let (prompt, generated) = (ids(&p["prompt_tokens"]), ids(&p["generated"]));
        s.kv.clear();
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut logits = s.model.forward(&prompt, &mut s.kv, Logits::Last)?;
        for i in 0..rows {
            for b in logits.iter().flat_map(|v| v.to_bits().to_le_bytes()) {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
            match generated.get(i) {
                Some(&t) if i + 1 < rows => logits = s.model.forward(&[t], &mut s.kv, Logits::Last)?,
                _ => break,
            }
        }
        println!("prompt {pi}: {} tokens, {rows} rows, logits hash {h:016x} ({:?} kernels)", prompt.len(), les::quant::Simd::best());
    }
    Ok(())
}
