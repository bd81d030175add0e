//! C ABI for native apps (Swift on iOS / macOS through an XCFramework, or any C caller): load a
//! model, generate with a callback per token, read statistics, free. The header `include/les.h` is
//! generated from this file by cbindgen (`tests/suite/c_abi.rs` checks it is current); `docs/apple.md`
//! shows a Swift example.
//!
//! Conventions: every function is safe to call with NULL where a pointer is optional; no Rust
//! panic crosses the boundary (each entry point catches unwinding and reports an error); strings
//! returned by LES are freed with [`les_string_free`]; the engine is freed with [`les_free`].

use crate::backend::wgpu::exec::GpuOptions;
use crate::backend::BackendKind;
use crate::engine::sampling::SamplerConfig;
use crate::engine::stream::{open_streaming, parse_bytes, StreamOptions};
use crate::engine::Session;
use crate::expert::stream::{StreamConfig, StreamingExperts};
use crate::model::ExpertMode;
use crate::store::FileSource;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// An engine: one model session (and its expert cache when a memory budget is set).
pub struct LesEngine {
    session: Session,
    experts: Option<Arc<StreamingExperts>>,
    last_error: CString,
    backend_line: String,
    /// Statistics of the last generation.
    last: Option<crate::engine::GenStats>,
}

/// Load options, given as a JSON object (all fields optional).
#[derive(serde::Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct LoadOptions {
    /// e.g. "400MiB": stream experts within this budget (absent: every expert resident).
    memory_budget: Option<String>,
    /// "cpu", "wgpu" or "auto" (default).
    backend: Option<String>,
    /// Context size in tokens (default 2048).
    n_ctx: Option<usize>,
    /// Device profile name for benchmarks (absent: the real file).
    store: Option<String>,
    /// Keep the cache between generations and run only what follows the longest prefix it shares
    /// with the next prompt (default true; see [`les_reset`]).
    reuse_prefix: Option<bool>,
}

/// Called with each chunk of generated text (UTF-8, NUL-terminated, valid only during the call).
/// Return `true` to continue, `false` to stop.
pub type LesTokenCallback = Option<extern "C" fn(text: *const c_char, user: *mut c_void) -> bool>;

fn write_err(buf: *mut c_char, len: usize, msg: &str) {
    if buf.is_null() || len == 0 {
        return;
    }
    let bytes = msg.as_bytes();
    let n = bytes.len().min(len - 1);
    // SAFETY: the caller promises `buf` holds `len` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
}

fn cstr<'a>(p: *const c_char) -> Result<&'a str, String> {
    if p.is_null() {
        return Err("NULL string".into());
    }
    // SAFETY: the caller passes a NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|e| format!("not UTF-8: {e}"))
}

fn load(path: &str, opts: &str) -> Result<LesEngine, String> {
    let o: LoadOptions = if opts.trim().is_empty() { LoadOptions::default() } else { serde_json::from_str(opts).map_err(|e| format!("options: {e}"))? };
    let n_ctx = o.n_ctx.unwrap_or(2048);
    let backend: BackendKind = o.backend.as_deref().unwrap_or("auto").parse()?;
    let (mut session, experts) = match &o.memory_budget {
        None => {
            let src = FileSource::open(path).map_err(|e| e.to_string())?;
            (Session::load(&src, ExpertMode::Resident, n_ctx).map_err(|e| e.to_string())?, None)
        }
        Some(b) => {
            let profile = match o.store.as_deref() {
                None | Some("disk") => None,
                Some(n) => Some(crate::store::throttle::DeviceProfile::by_name(n).ok_or_else(|| format!("unknown store profile '{n}'"))?),
            };
            let so = StreamOptions { budget: parse_bytes(b).map_err(|e| e.to_string())?, n_ctx, direct: false, profile, cache: StreamConfig::default(), slots: None, gpu_pool: false, dense: crate::engine::stream::DenseOptions::default() };
            let st = open_streaming(path, &so).map_err(|e| e.to_string())?;
            (st.session, Some(st.experts))
        }
    };
    let backend_line = session.set_backend(backend, &GpuOptions::default()).map_err(|e| e.to_string())?;
    session.reuse_prefix = o.reuse_prefix.unwrap_or(true);
    Ok(LesEngine { session, experts, last_error: CString::default(), backend_line, last: None })
}

/// Load a GGUF model (or a `.les` bundle). `options_json` may be NULL or a JSON object with
/// `memory_budget` ("400MiB"), `backend` ("cpu" | "wgpu" | "auto"), `n_ctx`, `store`,
/// `reuse_prefix` (default true: a chat that re-sends its conversation runs only the new part).
/// Returns NULL on failure with a message in `err` (`err_len` bytes, NUL-terminated).
#[no_mangle]
pub extern "C" fn les_load(model_path: *const c_char, options_json: *const c_char, err: *mut c_char, err_len: usize) -> *mut LesEngine {
    let r = catch_unwind(|| {
        let path = cstr(model_path)?;
        let opts = if options_json.is_null() { "" } else { cstr(options_json)? };
        load(path, opts)
    });
    match r {
        Ok(Ok(e)) => Box::into_raw(Box::new(e)),
        Ok(Err(m)) => {
            write_err(err, err_len, &m);
            std::ptr::null_mut()
        }
        Err(_) => {
            write_err(err, err_len, "internal error (panic) while loading");
            std::ptr::null_mut()
        }
    }
}

/// Generate up to `n_predict` tokens after `prompt` (tokenized as llama.cpp does), calling
/// `callback(text, user)` per decoded chunk. `temperature` 0 is greedy; `seed` seeds sampling.
/// Returns the number of tokens generated, or -1 on error (see [`les_last_error`]).
#[no_mangle]
pub extern "C" fn les_generate(engine: *mut LesEngine, prompt: *const c_char, n_predict: i32, temperature: f32, seed: u64, callback: LesTokenCallback, user: *mut c_void) -> i32 {
    if engine.is_null() {
        return -1;
    }
    // SAFETY: a pointer from les_load, not yet freed, used by one thread at a time.
    let e = unsafe { &mut *engine };
    let r = catch_unwind(AssertUnwindSafe(|| -> Result<i32, String> {
        let p = cstr(prompt)?;
        let toks = e.session.tokenize(p);
        let sampler = SamplerConfig { temperature: temperature.max(0.0), seed, ..Default::default() };
        let mut on = |_tok: u32, text: &str| -> bool {
            match (callback, CString::new(text.replace('\0', ""))) {
                (Some(cb), Ok(c)) => cb(c.as_ptr(), user),
                _ => true,
            }
        };
        let (out, st) = e.session.generate(&toks, n_predict.max(0) as usize, &sampler, false, &mut on).map_err(|x| x.to_string())?;
        e.last = Some(st);
        Ok(out.len() as i32)
    }));
    match r {
        Ok(Ok(n)) => n,
        Ok(Err(m)) => {
            e.last_error = CString::new(m.replace('\0', "")).unwrap_or_default();
            -1
        }
        Err(_) => {
            e.last_error = CString::new("internal error (panic) while generating").unwrap_or_default();
            -1
        }
    }
}

/// The last error message of `engine` (empty when none); valid until the next call on it.
#[no_mangle]
pub extern "C" fn les_last_error(engine: *const LesEngine) -> *const c_char {
    if engine.is_null() {
        return c"".as_ptr();
    }
    // SAFETY: a live engine pointer.
    unsafe { (*engine).last_error.as_ptr() }
}

/// Statistics as a JSON string (backend; `last`: the last generation's prompt tokens, reused
/// tokens, timings and finish reason; expert cache hit rate, bytes read per token, stall, GPU
/// readbacks); free it with [`les_string_free`]. NULL when `engine` is NULL.
#[no_mangle]
pub extern "C" fn les_stats_json(engine: *const LesEngine) -> *mut c_char {
    if engine.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a live engine pointer.
    let e = unsafe { &*engine };
    let r = catch_unwind(AssertUnwindSafe(|| {
        let mut v = serde_json::json!({ "backend": e.backend_line, "last": e.last });
        if let Some(x) = &e.experts {
            let s = x.stats();
            v["experts"] = serde_json::json!({
                "hit_rate": s.hit_rate(),
                "bytes_per_token": s.bytes_per_token(),
                "stall_ms_per_token": s.stall_ms_per_token(),
                "recall_at_1": s.recall(1),
                "tokens": s.tokens,
            });
        }
        if let Some(g) = &e.session.gpu {
            v["gpu"] = serde_json::to_value(g.stats()).unwrap_or_default();
        }
        CString::new(v.to_string()).unwrap_or_default().into_raw()
    }));
    r.unwrap_or(std::ptr::null_mut())
}

/// Forget the cached conversation: the next generation runs its prompt from the first token.
/// Returns 0, or -1 when `engine` is NULL.
#[no_mangle]
pub extern "C" fn les_reset(engine: *mut LesEngine) -> i32 {
    if engine.is_null() {
        return -1;
    }
    // SAFETY: a pointer from les_load, not yet freed, used by one thread at a time.
    let e = unsafe { &mut *engine };
    e.session.reset();
    0
}

/// Free a string returned by LES.
#[no_mangle]
pub extern "C" fn les_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: a string from CString::into_raw in this library.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// Free an engine (NULL is ignored).
#[no_mangle]
pub extern "C" fn les_free(engine: *mut LesEngine) {
    if !engine.is_null() {
        // SAFETY: a pointer from les_load, freed once.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(engine) })));
    }
}
