use les::engine::Session;
use les::model::{ExpertMode, Logits};
use les::store::FileSource;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let stem = args.get(1).cloned().unwrap_or("SmolLM2-135M-Instruct.Q4_1".into());
    let pi: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(0);
    let refs: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(format!("{}/{stem}.json", std::env::var("REFS").unwrap_or("tests/fixtures/refs".into()))).unwrap()).unwrap();
    let src = FileSource::open(format!("models/{stem}.gguf")).unwrap();
    let mut s = Session::load(&src, ExpertMode::Resident, 512).unwrap();
    let p = &refs["prompts"][pi];
    let toks: Vec<u32> = p["prompt_tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let gen: Vec<u32> = p["generated"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    println!("prompt toks {:?}", toks);
    let mut logits = s.model.forward(&toks, &mut s.kv, Logits::Last).unwrap();
    for i in 0..33 {
        let row = &p["rows"][i];
        let mut md = 0f32;
        for t in row["top"].as_array().unwrap() {
            let id = t[0].as_u64().unwrap() as usize; let l = t[1].as_f64().unwrap() as f32;
            md = md.max((logits[id]-l).abs());
        }
        let t0 = &row["top"][0];
        println!("row {i}: max d {md:.4}  top {} ref {} ours {}", t0[0], t0[1], logits[t0[0].as_u64().unwrap() as usize]);
        if i < gen.len() { logits = s.model.forward(&[gen[i]], &mut s.kv, Logits::Last).unwrap(); }
    }
}
