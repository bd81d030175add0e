//! Images in (issue 36): the `minicpmv4_6` vision tower and the `qwen35` / `qwen35moe` text
//! towers against llama.cpp's mtmd. References: `tests/data/vision/refs.json` + `refs.bin`
//! (`tools/make_vision_refs.sh`: `tools/mtmd_ref.cpp` against libmtmd, and `llama-mtmd-cli`;
//! the commands and llama.cpp's version are recorded there), fixtures from `tools/make_vlm.py`
//! (`./build.sh models`).

use crate::common::*;
use les::engine::sampling::SamplerConfig;
use les::engine::stream::{open_streaming, StreamOptions};
use les::engine::{GenOptions, Session};
use les::expert::stream::StreamConfig;
use les::model::ExpertMode;
use les::store::FileSource;
use les::vision::{Mmproj, VisionError};
use serde_json::Value;

/// Bound on |Δ| between LES's image embeddings and llama.cpp's (values of magnitude ~2.5; F32
/// tower weights, llama.cpp's flash attention with K/V in f16 on both sides; the sum orders of
/// the f32 products differ). Measured 2026-12-04: 8.6e-4 to 1.2e-3 on the PNG pieces.
const EMBD_DELTA: f32 = 2e-3;
/// JPEG: stb_image and the `image` crate's decoder (zune-jpeg) differ by up to 3 levels in
/// some pixels of the JPEG (refs.json `stb_vs_pillow`), so its embeddings differ more: measured
/// 4.8e-3 to 7.1e-3.
const EMBD_DELTA_JPEG: f32 = 2e-2;
/// Greedy text may part from llama.cpp's only where llama.cpp's top-2 logit margin is below this.
const MARGIN: f32 = 0.1;

struct Refs {
    json: Value,
    bin: Vec<f32>,
}

fn refs() -> Refs {
    let dir = root().join("tests/data/vision");
    let json: Value = serde_json::from_slice(&std::fs::read(dir.join("refs.json")).unwrap()).unwrap();
    let bin = std::fs::read(dir.join("refs.bin")).unwrap().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    Refs { json, bin }
}

fn image_bytes(run: &Value) -> Vec<Vec<u8>> {
    run["images"].as_array().unwrap().iter().map(|i| std::fs::read(root().join("tests/data/vision").join(i["file"].as_str().unwrap())).unwrap()).collect()
}

/// Runs whose images llama.cpp loaded (and the text-only run).
fn loaded(run: &Value) -> bool {
    run["images"].as_array().unwrap().iter().all(|i| i["loaded"].as_bool() == Some(true))
}

fn mmproj() -> Mmproj {
    Mmproj::load(&FileSource::open(model("rand-minicpmv-mmproj.gguf")).unwrap()).unwrap()
}

/// Every piece of every image (overview, slices) in llama.cpp's order: the prepared pixels'
/// per-channel sums and the embeddings, against `mtmd_encode_chunk`'s.
#[test]
fn image_embeddings_match_llama_cpp() {
    let r = refs();
    let mp = mmproj();
    for run in r.json["runs"]["qwen35"].as_array().unwrap().iter().filter(|r| loaded(r) && !r["images"].as_array().unwrap().is_empty()) {
        let name = run["name"].as_str().unwrap();
        let chunks: Vec<&Value> = run["chunks"].as_array().unwrap().iter().filter(|c| c["type"] == "image").collect();
        let mut pieces = Vec::new();
        for (bytes, im) in image_bytes(run).iter().zip(run["images"].as_array().unwrap()) {
            let p = mp.prepare(bytes).unwrap();
            let jpeg = im["file"].as_str().unwrap().ends_with(".jpg");
            pieces.push((p.overview, jpeg));
            pieces.extend(p.slices.into_iter().map(|s| (s, jpeg)));
        }
        assert_eq!(pieces.len(), chunks.len(), "{name}: pieces (overview + slices)");
        // Resizing and slicing give llama.cpp's pixels exactly (`preproc/*.png`: each clip input
        // as 8-bit pixels; the JPEG's differ where the decoders do).
        let pre: Vec<&Value> = run["images"].as_array().unwrap().iter().flat_map(|im| {
            let file = im["file"].as_str().unwrap();
            let per = r.json["images"].as_array().unwrap().iter().find(|x| x["file"] == file).unwrap();
            per["preprocessed"].as_array().unwrap().iter().collect::<Vec<_>>()
        }).collect();
        assert_eq!(pre.len(), pieces.len(), "{name}: preprocessed pieces recorded");
        for (i, ((img, jpeg), p)) in pieces.iter().zip(&pre).enumerate() {
            let png = std::fs::read(root().join("tests/data/vision").join(p["png"].as_str().unwrap())).unwrap();
            let want = les::vision::image::decode(&png).unwrap();
            let ours: Vec<u8> = img.px.iter().map(|&v| ((v * 0.5 + 0.5) * 255.0).round() as u8).collect();
            let diff = ours.iter().zip(&want.px).filter(|(a, b)| a != b).count();
            assert_eq!((img.w, img.h), (want.w, want.h), "{name} piece {i}: size");
            assert!(diff == 0 || *jpeg, "{name} piece {i}: {diff} pixel values differ from llama.cpp's");
        }
        for (i, ((img, jpeg), c)) in pieces.iter().zip(&chunks).enumerate() {
            let ne = &c["inp_raw"]["ne"];
            assert_eq!((img.w as u64, img.h as u64), (ne[0].as_u64().unwrap(), ne[1].as_u64().unwrap()), "{name} piece {i}: size");
            // Per-channel sums of the normalised pixels (f64, llama.cpp's graph input).
            for ch in 0..3 {
                let ours: f64 = img.px.iter().skip(ch).step_by(3).map(|&v| v as f64).sum();
                let want = c["inp_raw"]["channel_sums"][ch].as_f64().unwrap();
                let tol = if *jpeg { 2e-3 * img.px.len() as f64 } else { 1e-6 * img.px.len() as f64 };
                assert!((ours - want).abs() <= tol, "{name} piece {i} channel {ch}: pixel sum {ours} vs llama.cpp {want}");
            }
            let e = mp.encode(img).unwrap();
            let (off, n) = (c["embd"]["bin_offset"].as_u64().unwrap() as usize, c["embd"]["count"].as_u64().unwrap() as usize);
            assert_eq!(e.len(), n, "{name} piece {i}: embedding values");
            assert_eq!(e.len() / mp.n_embd_out, c["n_tokens"].as_u64().unwrap() as usize);
            let d = e.iter().zip(&r.bin[off..off + n]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            eprintln!("{name} piece {i} ({}×{}): max |Δ| {d:e}", img.w, img.h);
            assert!(d <= if *jpeg { EMBD_DELTA_JPEG } else { EMBD_DELTA }, "{name} piece {i}: max |Δ| {d} vs llama.cpp");
        }
    }
}

/// Greedy tokens equal llama.cpp's (`mtmd_ref`, the same as `llama-mtmd-cli`'s text) up to the
/// first place llama.cpp's own top-2 margin is below [`MARGIN`].
fn check_greedy(name: &str, got: &[u32], run: &Value) {
    let want: Vec<u32> = run["generated"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    for (i, w) in want.iter().enumerate() {
        let margin = run["rows"][i]["margin"].as_f64().unwrap() as f32;
        if got.get(i) != Some(w) {
            assert!(margin < MARGIN, "{name}: token {i} is {:?}, llama.cpp's {w} (margin {margin}); ours {got:?} vs {want:?}", got.get(i));
            eprintln!("{name}: parts from llama.cpp at token {i} (margin {margin})");
            return;
        }
    }
}

fn generate(s: &mut Session, mp: &Mmproj, run: &Value) -> Vec<u32> {
    let p = s.mm_prompt(mp, run["prompt"].as_str().unwrap(), &image_bytes(run)).unwrap();
    let want: Vec<u32> = run["chunks"].as_array().unwrap().iter().flat_map(|c| c["tokens"].as_array().map(|t| t.iter().map(|v| v.as_u64().unwrap() as u32).collect::<Vec<_>>()).unwrap_or_default()).collect();
    let got: Vec<u32> = p.chunks.iter().flat_map(|c| match c {
        les::vision::layout::Chunk::Text(t) => t.clone(),
        _ => vec![],
    }).collect();
    assert_eq!(got, want, "{}: text tokens around the images", run["name"]);
    let toks = s.prefill_mm(mp, &p).unwrap().tokens;
    s.reuse_prefix = true;
    let o = GenOptions { n: 16, sampler: SamplerConfig { temperature: 0.0, ..Default::default() }, ..Default::default() };
    let (ids, _) = s.generate_with(&toks, &o, &mut |_, _| true).unwrap();
    ids
}

#[test]
fn greedy_text_after_an_image_matches_llama_mtmd_cli() {
    let r = refs();
    let mp = mmproj();
    for (tower, file) in [("qwen35", "rand-qwen35-vl.gguf"), ("qwen35moe", "rand-qwen35moe-vl.gguf")] {
        let src = FileSource::open(model(file)).unwrap();
        for run in r.json["runs"][tower].as_array().unwrap().iter().filter(|r| loaded(r)) {
            let mut s = Session::load(&src, ExpertMode::Resident, 512).unwrap();
            let ids = generate(&mut s, &mp, run);
            check_greedy(&format!("{tower}/{}", run["name"]), &ids, run);
        }
    }
}

/// The MoE text tower with its experts streamed at the smallest budget the plan accepts gives
/// the resident run's tokens.
#[test]
fn greedy_text_after_an_image_streamed_at_the_minimum_budget() {
    let r = refs();
    let mp = mmproj();
    let path = model("rand-qwen35moe-vl.gguf");
    let opts = |budget: u64| StreamOptions { budget, n_ctx: 512, direct: false, profile: None, cache: StreamConfig::default(), slots: None, gpu_pool: false, dense: Default::default() };
    let minimum = match open_streaming(path.to_str().unwrap(), &opts(1 << 20)) {
        Err(les::engine::stream::OpenError::Budget(les::engine::stream::BudgetError::TooSmall { minimum, .. })) => minimum,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("1 MiB cannot hold the dense weights"),
    };
    let src = FileSource::open(&path).unwrap();
    for run in r.json["runs"]["qwen35moe"].as_array().unwrap().iter().filter(|r| loaded(r)).take(2) {
        let mut st = open_streaming(path.to_str().unwrap(), &opts(minimum)).unwrap();
        let streamed = generate(&mut st.session, &mp, run);
        let mut s = Session::load(&src, ExpertMode::Resident, 512).unwrap();
        let resident = generate(&mut s, &mp, run);
        assert_eq!(streamed, resident, "{}: streamed at {minimum} B vs resident", run["name"]);
    }
}

/// A second turn with the same image reuses the cached prefix up to the new text (the image is
/// neither run again nor mistaken for another: a different image ends the shared prefix).
#[test]
fn prefix_reuse_is_keyed_on_the_image() {
    let r = refs();
    let mp = mmproj();
    let src = FileSource::open(model("rand-qwen35-vl.gguf")).unwrap();
    let runs = r.json["runs"]["qwen35"].as_array().unwrap();
    let run = runs.iter().find(|r| r["name"] == "square_224").unwrap();
    let other = runs.iter().find(|r| r["name"] == "wide_200x150_rgba").unwrap();
    let mut s = Session::load(&src, ExpertMode::Resident, 512).unwrap();
    let cold = generate(&mut s, &mp, run);
    let again = generate(&mut s, &mp, run);
    assert_eq!(cold, again, "the same prompt again gives the same tokens");
    // The image is neither encoded nor run again.
    let p = s.mm_prompt(&mp, run["prompt"].as_str().unwrap(), &image_bytes(run)).unwrap();
    let pre = s.prefill_mm(&mp, &p).unwrap();
    assert_eq!(pre.encoded, 0, "a cached image is not encoded again");
    assert_eq!(pre.reused, p.tokens.len() - 1);
    let p = s.mm_prompt(&mp, other["prompt"].as_str().unwrap(), &image_bytes(other)).unwrap();
    let kept = les::engine::common_prefix(s.cached_tokens(), &p.tokens);
    assert!(kept <= 5, "another image shares only the text before it ({kept} positions)");
}

fn prepare_err(bytes: &[u8]) -> VisionError {
    mmproj().prepare(bytes).err().expect("an error")
}

/// A PNG whose header claims `w × h`, with a few bytes of pixel data (a decompression bomb's
/// shape: the header promises far more than the file holds).
fn png_header(w: u32, h: u32) -> Vec<u8> {
    fn crc(b: &[u8]) -> u32 {
        let mut c = 0xffff_ffffu32;
        for &x in b {
            c ^= x as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0xedb8_8320 ^ (c >> 1) } else { c >> 1 };
            }
        }
        !c
    }
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    for c in [ihdr, b"IDAT\x78\x9c\x63\x00\x00\x00\x01\x00\x01".to_vec(), b"IEND".to_vec()] {
        v.extend((c.len() as u32 - 4).to_be_bytes());
        v.extend(&c);
        v.extend(crc(&c).to_be_bytes());
    }
    v
}

#[test]
fn bad_images_are_typed_errors() {
    let dir = root().join("tests/data/vision");
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    assert!(matches!(prepare_err(&read("bad_truncated.png")), VisionError::Decode(_)), "truncated PNG");
    assert!(matches!(prepare_err(&read("bad_empty.png")), VisionError::Format(_) | VisionError::Decode(_)), "empty file");
    assert!(matches!(prepare_err(&read("bad_zero_dims.png")), VisionError::Empty { .. } | VisionError::Decode(_)), "0×0 PNG");
    assert!(matches!(prepare_err(&read("bad_garbage.jpg")), VisionError::Decode(_) | VisionError::Format(_)), "garbage after a JPEG marker");
    // A decompression bomb: refused from its header, before any pixel is allocated.
    let t0 = std::time::Instant::now();
    let e = prepare_err(&png_header(30000, 30000));
    assert!(matches!(e, VisionError::TooLarge { w: 30000, h: 30000, .. }), "{e}");
    assert!(t0.elapsed().as_millis() < 1000);
    assert!(matches!(prepare_err(&png_header(0, 7)), VisionError::Empty { .. } | VisionError::Decode(_)));
    // Not an image format LES reads.
    assert!(matches!(prepare_err(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"), VisionError::Format(_)));
}

#[test]
fn an_mmproj_of_another_width_or_a_text_model_without_markers_is_refused() {
    let mp = mmproj();
    let img = std::fs::read(root().join("tests/data/vision/square_224.png")).unwrap();
    // SmolLM2: width 576 against the tower's 128.
    let s = Session::load(&FileSource::open(model("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap(), ExpertMode::Resident, 256).unwrap();
    let e = s.mm_prompt(&mp, "x", &[img]).err().expect("a width mismatch");
    assert!(e.to_string().contains("576") && e.to_string().contains("128"), "{e}");
    // Not an mmproj at all.
    let e = Mmproj::load(&FileSource::open(model("rand-qwen35-vl.gguf")).unwrap()).err().expect("a text model is not an mmproj");
    assert!(matches!(e, VisionError::NotClip(_)), "{e}");
}

/// `les run`: an image without `--mmproj` is refused with what to add; a bad image names the
/// decoding failure; a good one prints llama-mtmd-cli's greedy text for the same command line
/// (`llama-mtmd-cli -m M --mmproj P --image I -p Describe -n 16 --temp 0`, refs.json).
#[test]
fn les_run_with_images() {
    let les = |args: &[&str]| std::process::Command::new(env!("CARGO_BIN_EXE_les")).args(args).output().unwrap();
    let (m, p) = (model("rand-qwen35-vl.gguf"), model("rand-minicpmv-mmproj.gguf"));
    let (m, p) = (m.to_str().unwrap(), p.to_str().unwrap());
    let dir = root().join("tests/data/vision");
    let img = |f: &str| dir.join(f).to_str().unwrap().to_string();
    let o = les(&["run", "-m", m, "--image", &img("square_224.png"), "-p", "Describe", "-n", "2", "--temp", "0"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--mmproj"), "{o:?}");
    let o = les(&["run", "-m", m, "--mmproj", p, "--image", &img("bad_truncated.png"), "-p", "Describe", "-n", "2", "--temp", "0"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("could not be decoded"), "{o:?}");
    let o = les(&["run", "-m", m, "--mmproj", p, "--image", &img("square_224.png"), "-p", "Describe", "-n", "16", "--temp", "0"]);
    assert!(o.status.success(), "{o:?}");
    let r = refs();
    let run = r.json["runs"]["qwen35"].as_array().unwrap().iter().find(|r| r["name"] == "square_224").unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout), run["llama_mtmd_cli"]["text"].as_str().unwrap(), "les run vs llama-mtmd-cli");
}

/// A tower whose matrices are read from storage at each use (a budget that cannot hold them)
/// gives the resident tower's embeddings bit for bit, holding a fraction of its bytes.
#[test]
fn a_tower_read_from_storage_gives_the_same_embeddings() {
    let path = model("rand-minicpmv-mmproj.gguf");
    let src = FileSource::open(&path).unwrap();
    let resident = Mmproj::load(&src).unwrap();
    let streamed = Mmproj::load_with(&src, Some(std::sync::Arc::new(FileSource::open(&path).unwrap()))).unwrap();
    assert!(streamed.bytes * 3 < resident.bytes, "{} of {} bytes held", streamed.bytes, resident.bytes);
    assert!(Mmproj::footprint(&src, true).unwrap() < Mmproj::footprint(&src, false).unwrap());
    let prep = resident.prepare(&std::fs::read(root().join("tests/data/vision/grid_336x700.png")).unwrap()).unwrap();
    for (i, p) in std::iter::once(&prep.overview).chain(&prep.slices).enumerate() {
        let (a, b) = (resident.encode(p).unwrap(), streamed.encode(p).unwrap());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "piece {i}");
    }
}

/// Projectors LES does not run are refused by name (here the fixture with its projector type
/// renamed: `resampler` is MiniCPM-V 2.5-4.5's); a truncated mmproj is a typed GGUF error.
#[test]
fn other_projectors_and_truncated_files_are_refused() {
    let bytes = std::fs::read(model("rand-minicpmv-mmproj.gguf")).unwrap();
    let mut other = bytes.clone();
    while let Some(at) = other.windows(11).position(|w| w == b"minicpmv4_6") {
        other[at..at + 11].copy_from_slice(b"resampler__");
    }
    let e = Mmproj::load(&les::store::MemSource::new(other)).err().expect("refused");
    assert!(matches!(&e, VisionError::Projector(p) if p == "resampler__"), "{e}");
    assert!(e.to_string().contains("minicpmv4_6"), "the error names what LES runs: {e}");
    for cut in [16, bytes.len() / 3, bytes.len() - 1] {
        let e = Mmproj::load(&les::store::MemSource::new(bytes[..cut].to_vec())).err().expect("a truncated file");
        assert!(matches!(e, VisionError::Gguf(_) | VisionError::Store(_) | VisionError::Model(_)), "cut at {cut}: {e}");
    }
}
