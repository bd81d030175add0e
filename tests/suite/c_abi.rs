//! The C ABI (src/ffi.rs): the committed header is what cbindgen makes from the source, and a
//! load → generate (callback per token) → stats → free round trip gives the same text as the Rust
//! API, with clear errors for bad input; with a vision tower, an image and "Describe" give
//! llama-mtmd-cli's greedy tokens (tests/data/vision/refs.json); with `"speculative": "mtp"`, the
//! same greedy text drafted by the model's MTP block.

use les::ffi::*;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn header_is_current() {
    let cfg = cbindgen::Config::from_file(root().join("cbindgen.toml")).unwrap();
    let mut out = Vec::new();
    cbindgen::Builder::new().with_config(cfg).with_src(root().join("src/ffi.rs")).generate().expect("cbindgen").write(&mut out);
    let path = root().join("include/les.h");
    if std::env::var_os("LES_BLESS").is_some() {
        std::fs::write(&path, &out).unwrap();
    }
    let have = std::fs::read(&path).unwrap_or_default();
    assert!(have == out, "include/les.h is stale: run LES_BLESS=1 cargo test --profile ci --test suite -- c_abi::");
    let h = String::from_utf8(out).unwrap();
    for f in ["les_load", "les_generate", "les_stats_json", "les_free", "les_string_free", "les_last_error", "les_reset", "les_load_mmproj", "les_generate_images", "LesImage", "les_budget", "les_set_memory_budget", "les_memory_budget", "les_budget_free", "LesBudget", "les_plan"] {
        assert!(h.contains(f), "header lacks {f}");
    }
}

/// The Rust API's greedy text for `prompt` with every weight resident (256 positions), and the
/// prompt's token count.
fn resident_greedy(model: &std::path::Path, prompt: &str, n: usize) -> (String, usize) {
    let src = les::store::FileSource::open(model).unwrap();
    let mut s = les::engine::Session::load(&src, les::model::ExpertMode::Resident, 256).unwrap();
    let toks = s.tokenize(prompt);
    let mut want = String::new();
    s.generate(&toks, n, &les::engine::sampling::SamplerConfig::greedy(), false, &mut |_, t| {
        want.push_str(t);
        true
    })
    .unwrap();
    (want, toks.len())
}

extern "C" fn collect(text: *const c_char, user: *mut c_void) -> bool {
    // SAFETY: `user` is the String passed below; `text` is valid during the call.
    let s = unsafe { &mut *(user as *mut String) };
    s.push_str(unsafe { CStr::from_ptr(text) }.to_str().unwrap());
    true
}

#[test]
fn load_generate_stats_free_round_trip() {
    let model = root().join("models/rand-olmoe.gguf");
    let path = CString::new(model.to_str().unwrap()).unwrap();
    let mut err = [0 as c_char; 256];
    // Streamed under a budget, on the CPU.
    let opts = CString::new(r#"{"memory_budget": "64MiB", "backend": "cpu", "n_ctx": 256}"#).unwrap();
    let e = les_load(path.as_ptr(), opts.as_ptr(), err.as_mut_ptr(), err.len());
    assert!(!e.is_null(), "{}", unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap());
    let prompt = CString::new("The capital of France is").unwrap();
    let mut text = String::new();
    let n = les_generate(e, prompt.as_ptr(), 12, 0.0, 1, Some(collect), &mut text as *mut String as *mut c_void);
    assert!(n > 0, "{}", unsafe { CStr::from_ptr(les_last_error(e)) }.to_str().unwrap());
    // The same text as the Rust API with every expert resident.
    let (want, n_prompt) = resident_greedy(&model, "The capital of France is", 12);
    assert_eq!(text, want);
    let st = les_stats_json(e);
    let js: serde_json::Value = serde_json::from_str(unsafe { CStr::from_ptr(st) }.to_str().unwrap()).unwrap();
    les_string_free(st);
    assert!(js["experts"]["bytes_per_token"].as_f64().unwrap() > 0.0, "{js}");
    assert!(js["backend"].as_str().unwrap().starts_with("backend: cpu"));
    assert_eq!(js["last"]["prompt_reused"], 0);
    // A follow-up that extends the conversation runs only its new part; after les_reset, all of it.
    let follow = CString::new("The capital of France is and then").unwrap();
    let mut more = String::new();
    assert!(les_generate(e, follow.as_ptr(), 4, 0.0, 1, Some(collect), &mut more as *mut String as *mut c_void) > 0);
    let reused = |e| {
        let st = les_stats_json(e);
        let js: serde_json::Value = serde_json::from_str(unsafe { CStr::from_ptr(st) }.to_str().unwrap()).unwrap();
        les_string_free(st);
        js["last"]["prompt_reused"].as_u64().unwrap()
    };
    let r = reused(e);
    assert!(r >= n_prompt as u64, "the first prompt's {n_prompt} tokens are reused, not {r}");
    assert_eq!(les_reset(e), 0);
    assert!(les_generate(e, follow.as_ptr(), 4, 0.0, 1, None, std::ptr::null_mut()) > 0);
    assert_eq!(reused(e), 0);
    assert_eq!(les_reset(std::ptr::null_mut()), -1);

    // The memory budget from another thread while a generation runs (an iOS memory warning):
    // down to the minimum (0), then a budget below it (refused, named), then back up; the
    // text stays the resident run's.
    let b = les_budget(e);
    assert!(!b.is_null());
    let mut min = 0u64;
    assert_eq!(les_memory_budget(b, &mut min), 64 << 20);
    assert!(min > 0 && min < 64 << 20);
    struct Handle(*const LesBudget);
    // SAFETY: the handle is documented as usable from any thread.
    unsafe impl Send for Handle {}
    let h = Handle(b);
    let warning = std::thread::spawn(move || {
        let h = h;
        let mut err = [0 as c_char; 256];
        std::thread::sleep(std::time::Duration::from_millis(2));
        let r = les_set_memory_budget(h.0, 0, err.as_mut_ptr(), err.len());
        assert_eq!(r, 0, "{}", unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap());
    });
    assert_eq!(les_reset(e), 0);
    let mut again = String::new();
    assert!(les_generate(e, prompt.as_ptr(), 12, 0.0, 1, Some(collect), &mut again as *mut String as *mut c_void) > 0);
    warning.join().unwrap();
    assert_eq!(again, want);
    assert_eq!(les_memory_budget(b, std::ptr::null_mut()), min);
    assert_eq!(stats(e)["budget"]["budget"].as_u64(), Some(min));
    let mut err = [0 as c_char; 256];
    assert_eq!(les_set_memory_budget(b, min - 1, err.as_mut_ptr(), err.len()), -1);
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap().to_string();
    assert!(msg.contains("minimum") && msg.contains(&min.to_string()), "{msg}");
    assert_eq!(les_memory_budget(b, std::ptr::null_mut()), min);
    assert_eq!(les_set_memory_budget(b, 64 << 20, err.as_mut_ptr(), err.len()), 0);
    assert_eq!(les_set_memory_budget(std::ptr::null(), 1, err.as_mut_ptr(), err.len()), -1);
    les_free(e);
    // The handle outlives the engine.
    assert_eq!(les_memory_budget(b, std::ptr::null_mut()), 64 << 20);
    les_budget_free(b);
    les_budget_free(std::ptr::null_mut());
    les_free(std::ptr::null_mut());
}

/// `les_plan`: the forecast as JSON, its plan the one `les_load` then runs with; bad options and a
/// missing file give messages.
#[test]
fn plan_forecasts_what_load_then_runs() {
    let model = root().join("models/rand-olmoe.gguf");
    let path = CString::new(model.to_str().unwrap()).unwrap();
    let mut err = [0 as c_char; 256];
    let opts = CString::new(r#"{"memory_budget": "64MiB", "n_ctx": 256, "store": "phone-4GBps", "prompt_tokens": 64}"#).unwrap();
    let j = les_plan(path.as_ptr(), opts.as_ptr(), err.as_mut_ptr(), err.len());
    assert!(!j.is_null(), "{}", unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap());
    let f: serde_json::Value = serde_json::from_str(unsafe { CStr::from_ptr(j) }.to_str().unwrap()).unwrap();
    les_string_free(j);
    assert_eq!(f["fits"], true);
    assert!(f["decode_tokens_per_s"].as_f64().unwrap() > 0.0 && f["prompt_tokens_per_s"].as_f64().unwrap() > 0.0, "{f}");
    let st = les::engine::stream::open_streaming(model.to_str().unwrap(), &les::engine::stream::StreamOptions { budget: 64 << 20, n_ctx: 256, direct: false, profile: None, cache: Default::default(), slots: None, gpu_pool: false, dense: Default::default() }).unwrap();
    assert_eq!(f["plan"]["slots"].as_u64(), Some(st.plan.slots as u64));
    assert_eq!(f["plan"]["minimum"].as_u64(), Some(st.plan.minimum));
    for (o, want) in [(r#"{"n_ctx": 256}"#, "memory_budget"), (r#"{"memory_budget": "64MiB", "store": "floppy"}"#, "floppy"), (r#"{"memory_budget": "64MiB", "routes": "/nonexistent.json"}"#, "nonexistent")] {
        let o = CString::new(o).unwrap();
        assert!(les_plan(path.as_ptr(), o.as_ptr(), err.as_mut_ptr(), err.len()).is_null());
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap().to_string();
        assert!(msg.contains(want), "{msg}");
    }
    let missing = CString::new("/nonexistent/model.gguf").unwrap();
    assert!(les_plan(missing.as_ptr(), opts.as_ptr(), err.as_mut_ptr(), err.len()).is_null());
    assert!(les_plan(std::ptr::null(), std::ptr::null(), std::ptr::null_mut(), 0).is_null());
}

#[test]
fn bad_input_gives_clear_errors() {
    let mut err = [0 as c_char; 256];
    let missing = CString::new("/nonexistent/model.gguf").unwrap();
    assert!(les_load(missing.as_ptr(), std::ptr::null(), err.as_mut_ptr(), err.len()).is_null());
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap().to_string();
    assert!(msg.contains("/nonexistent/model.gguf"), "{msg}");
    let model = CString::new(root().join("models/rand-olmoe.gguf").to_str().unwrap()).unwrap();
    let bad = CString::new(r#"{"memory_budget": "1KiB"}"#).unwrap();
    assert!(les_load(model.as_ptr(), bad.as_ptr(), err.as_mut_ptr(), err.len()).is_null());
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap().to_string();
    assert!(msg.contains("minimum"), "a budget below the minimum names it: {msg}");
    let typo = CString::new(r#"{"memory_budgit": "1GiB"}"#).unwrap();
    assert!(les_load(model.as_ptr(), typo.as_ptr(), err.as_mut_ptr(), err.len()).is_null());
    assert!(les_load(std::ptr::null(), std::ptr::null(), std::ptr::null_mut(), 0).is_null());
    assert_eq!(les_generate(std::ptr::null_mut(), std::ptr::null(), 1, 0.0, 0, None, std::ptr::null_mut()), -1);
    assert!(les_stats_json(std::ptr::null()).is_null());
}

/// Speculative decoding through the C ABI (issue 37 item 2): `"speculative": "mtp"` on
/// rand-qwen35moe-mtp with its experts streamed under a budget gives the resident engine's plain
/// greedy text, and `last.draft` counts the drafts; a kind LES does not know, and MTP on a model
/// without an MTP block, are load errors that say so.
#[test]
fn speculative_mtp_gives_plain_greedy() {
    let model = root().join("models/rand-qwen35moe-mtp.gguf");
    let path = CString::new(model.to_str().unwrap()).unwrap();
    let mut err = [0 as c_char; 256];
    let opts = CString::new(r#"{"memory_budget": "48MiB", "backend": "cpu", "n_ctx": 256, "speculative": "mtp"}"#).unwrap();
    let e = les_load(path.as_ptr(), opts.as_ptr(), err.as_mut_ptr(), err.len());
    assert!(!e.is_null(), "{}", unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap());
    let p = "Once upon a time";
    let prompt = CString::new(p).unwrap();
    let mut text = String::new();
    let n = les_generate(e, prompt.as_ptr(), 12, 0.0, 1, Some(collect), &mut text as *mut String as *mut c_void);
    assert!(n > 0, "{}", last_error(e));
    assert_eq!(text, resident_greedy(&model, p, 12).0);
    let js = stats(e);
    assert_eq!(js["last"]["draft"]["source"], "MTP", "{js}");
    assert!(js["last"]["draft"]["drafted"].as_u64().unwrap() > 0, "{js}");
    les_free(e);

    let bad = CString::new(r#"{"speculative": "eagle"}"#).unwrap();
    assert!(les_load(path.as_ptr(), bad.as_ptr(), err.as_mut_ptr(), err.len()).is_null());
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap().to_string();
    assert!(msg.contains("eagle"), "{msg}");
    let olmoe = CString::new(root().join("models/rand-olmoe.gguf").to_str().unwrap()).unwrap();
    let mtp = CString::new(r#"{"speculative": "mtp", "backend": "cpu", "n_ctx": 256}"#).unwrap();
    assert!(les_load(olmoe.as_ptr(), mtp.as_ptr(), err.as_mut_ptr(), err.len()).is_null());
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap().to_string();
    assert!(!msg.is_empty(), "MTP on a model without an MTP block is an error");
    eprintln!("MTP without a block: {msg}");
}

fn last_error(e: *const LesEngine) -> String {
    unsafe { CStr::from_ptr(les_last_error(e)) }.to_str().unwrap().to_string()
}

fn stats(e: *const LesEngine) -> serde_json::Value {
    let st = les_stats_json(e);
    let js = serde_json::from_str(unsafe { CStr::from_ptr(st) }.to_str().unwrap()).unwrap();
    les_string_free(st);
    js
}

fn image(bytes: &[u8]) -> LesImage {
    LesImage { data: bytes.as_ptr(), len: bytes.len() }
}

/// `les_generate_images` with a user text and images; (return value, text).
fn describe(e: *mut LesEngine, prompt: &str, images: &[LesImage], n: i32) -> (i32, String) {
    let p = CString::new(prompt).unwrap();
    let mut text = String::new();
    let r = les_generate_images(e, p.as_ptr(), images.as_ptr(), images.len(), n, 0.0, 1, Some(collect), &mut text as *mut String as *mut c_void);
    (r, text)
}

/// square_224.png + "Describe" through the C ABI: llama-mtmd-cli's greedy tokens (refs.json
/// `runs.qwen35`, its prompt the chat-templated `<__media__>Describe`), allowed to part only
/// where llama.cpp's top-2 margin is below 0.1; then the errors: no vision tower, an image that
/// does not decode, NULL pointers.
#[test]
fn images_give_llama_mtmd_clis_greedy_tokens() {
    let dir = root().join("tests/data/vision");
    let refs: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("refs.json")).unwrap()).unwrap();
    let run = refs["runs"]["qwen35"].as_array().unwrap().iter().find(|r| r["name"] == "square_224").unwrap();
    assert_eq!(run["prompt"], "<|im_start|>user\n<__media__>Describe<|im_end|>\n<|im_start|>assistant\n");
    let square = std::fs::read(dir.join("square_224.png")).unwrap();
    let model = root().join("models/rand-qwen35-vl.gguf");
    let mmproj = CString::new(root().join("models/rand-minicpmv-mmproj.gguf").to_str().unwrap()).unwrap();
    let path = CString::new(model.to_str().unwrap()).unwrap();
    let opts = CString::new(r#"{"backend": "cpu", "n_ctx": 256}"#).unwrap();
    let mut err = [0 as c_char; 256];
    let e = les_load(path.as_ptr(), opts.as_ptr(), err.as_mut_ptr(), err.len());
    assert!(!e.is_null(), "{}", unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap());

    // An image before any vision tower: -1, and the message says what to call.
    let (r, text) = describe(e, "Describe", &[image(&square)], 8);
    assert_eq!((r, text.as_str()), (-1, ""));
    assert!(last_error(e).contains("les_load_mmproj"), "{}", last_error(e));
    assert_eq!(les_load_mmproj(e, mmproj.as_ptr()), 0, "{}", last_error(e));

    // llama.cpp's 8 first tokens (the text of their pieces: the callback gets text).
    let (n, text) = describe(e, "Describe", &[image(&square)], 8);
    assert_eq!(n, 8, "{}", last_error(e));
    let src = les::store::FileSource::open(&model).unwrap();
    let s = les::engine::Session::load(&src, les::model::ExpertMode::Resident, 64).unwrap();
    let mut want = Vec::new();
    for (i, t) in run["generated"].as_array().unwrap()[..8].iter().enumerate() {
        let piece = s.tokenizer.token_to_piece(t.as_u64().unwrap() as u32, false);
        let margin = run["rows"][i]["margin"].as_f64().unwrap();
        if !text.as_bytes()[want.len()..].starts_with(&piece) {
            assert!(margin < 0.1, "token {i}: {text:?} parts from llama.cpp's {:?} where its margin is {margin}", String::from_utf8_lossy(&want));
            break;
        }
        want.extend(piece);
        if i == 7 {
            assert_eq!(text.as_bytes(), &want[..], "llama.cpp's 8 tokens, then nothing");
        }
    }
    let js = stats(e);
    assert_eq!(js["last"]["images"]["images"], 1, "{js}");
    assert_eq!(js["last"]["images"]["rows"], 16, "{js}");
    assert_eq!(js["last"]["images"]["encoded"], 1, "{js}");
    assert_eq!(js["last"]["gen_tokens"], 8, "{js}");
    // The same turn again: the image is in the cache, neither encoded nor run again.
    let (n, _) = describe(e, "<__media__>Describe", &[image(&square)], 2);
    assert_eq!(n, 2, "{}", last_error(e));
    let js = stats(e);
    assert_eq!(js["last"]["images"]["encoded"], 0, "{js}");
    assert!(js["last"]["prompt_reused"].as_u64().unwrap() >= 20, "the text and image before 'Describe' are reused: {js}");

    // A truncated PNG: -1 and the decoder's error.
    let truncated = std::fs::read(dir.join("bad_truncated.png")).unwrap();
    let (r, text) = describe(e, "Describe", &[image(&truncated)], 8);
    assert_eq!((r, text.as_str()), (-1, ""));
    assert!(last_error(e).contains("could not be decoded"), "{}", last_error(e));
    // Markers that do not match the images.
    assert_eq!(describe(e, "<__media__><__media__>Describe", &[image(&square)], 8).0, -1);
    assert!(last_error(e).contains("media markers"), "{}", last_error(e));
    // NULL pointers.
    let p = CString::new("Describe").unwrap();
    assert_eq!(les_generate_images(e, p.as_ptr(), std::ptr::null(), 1, 8, 0.0, 1, None, std::ptr::null_mut()), -1);
    assert!(last_error(e).contains("NULL"), "{}", last_error(e));
    assert_eq!(describe(e, "Describe", &[LesImage { data: std::ptr::null(), len: 10 }], 8).0, -1);
    assert!(last_error(e).contains("image 0"), "{}", last_error(e));
    let im = [image(&square)];
    assert_eq!(les_generate_images(e, std::ptr::null(), im.as_ptr(), 1, 8, 0.0, 1, None, std::ptr::null_mut()), -1);
    assert_eq!(les_generate_images(std::ptr::null_mut(), p.as_ptr(), im.as_ptr(), 1, 8, 0.0, 1, None, std::ptr::null_mut()), -1);
    assert_eq!(les_load_mmproj(std::ptr::null_mut(), mmproj.as_ptr()), -1);
    assert_eq!(les_load_mmproj(e, std::ptr::null()), -1);
    // Not an mmproj: refused, the tower loaded before stays.
    assert_eq!(les_load_mmproj(e, path.as_ptr()), -1);
    assert!(last_error(e).contains("not an mmproj"), "{}", last_error(e));
    assert_eq!(describe(e, "Describe", &[image(&square)], 1).0, 1, "{}", last_error(e));
    les_free(e);

    // The tower as a load option; a missing one fails the load with its path.
    let opts = CString::new(format!(r#"{{"backend": "cpu", "n_ctx": 256, "mmproj": {:?}}}"#, mmproj.to_str().unwrap())).unwrap();
    let e = les_load(path.as_ptr(), opts.as_ptr(), err.as_mut_ptr(), err.len());
    assert!(!e.is_null(), "{}", unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap());
    assert_eq!(describe(e, "Describe", &[image(&square)], 1).0, 1, "{}", last_error(e));
    les_free(e);
    let opts = CString::new(r#"{"backend": "cpu", "mmproj": "/nonexistent/mmproj.gguf"}"#).unwrap();
    assert!(les_load(path.as_ptr(), opts.as_ptr(), err.as_mut_ptr(), err.len()).is_null());
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap().to_string();
    assert!(msg.contains("/nonexistent/mmproj.gguf"), "{msg}");
    // Under a memory budget the tower's bytes are reserved from it.
    let opts = CString::new(format!(r#"{{"backend": "cpu", "memory_budget": "64KiB", "mmproj": {:?}}}"#, mmproj.to_str().unwrap())).unwrap();
    assert!(les_load(path.as_ptr(), opts.as_ptr(), err.as_mut_ptr(), err.len()).is_null());
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().unwrap().to_string();
    assert!(msg.contains("vision tower"), "{msg}");
}
