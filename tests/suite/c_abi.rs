//! The C ABI (src/ffi.rs): the committed header is what cbindgen makes from the source, and a
//! load → generate (callback per token) → stats → free round trip gives the same text as the Rust
//! API, with clear errors for bad input.

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
    for f in ["les_load", "les_generate", "les_stats_json", "les_free", "les_string_free", "les_last_error", "les_reset"] {
        assert!(h.contains(f), "header lacks {f}");
    }
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
    let src = les::store::FileSource::open(&model).unwrap();
    let mut s = les::engine::Session::load(&src, les::model::ExpertMode::Resident, 256).unwrap();
    let toks = s.tokenize("The capital of France is");
    let mut want = String::new();
    s.generate(&toks, 12, &les::engine::sampling::SamplerConfig::greedy(), false, &mut |_, t| {
        want.push_str(t);
        true
    })
    .unwrap();
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
    assert!(r >= toks.len() as u64, "the first prompt's {} tokens are reused, not {r}", toks.len());
    assert_eq!(les_reset(e), 0);
    assert!(les_generate(e, follow.as_ptr(), 4, 0.0, 1, None, std::ptr::null_mut()) > 0);
    assert_eq!(reused(e), 0);
    assert_eq!(les_reset(std::ptr::null_mut()), -1);
    les_free(e);
    les_free(std::ptr::null_mut());
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
