//! C ABI for native apps (Swift on iOS / macOS through an XCFramework, or any C caller): load a
//! model (and a vision tower for images), generate with a callback per token, read statistics,
//! free. The header `include/les.h` is
//! generated from this file by cbindgen (`tests/suite/c_abi.rs` checks it is current); `docs/apple.md`
//! shows a Swift example.
//!
//! Conventions: every function is safe to call with NULL where a pointer is optional; no Rust
//! panic crosses the boundary (each entry point catches unwinding and reports an error); strings
//! returned by LES are freed with [`les_string_free`]; the engine is freed with [`les_free`].

use crate::backend::wgpu::exec::GpuOptions;
use crate::backend::BackendKind;
use crate::engine::chat::Message;
use crate::engine::sampling::SamplerConfig;
use crate::engine::stream::{open_streaming, parse_bytes, BudgetControl, StreamOptions};
use crate::engine::draft::DraftSpec;
use crate::engine::speculative::{self, Draft, SpecOptions, SpecStats};
use crate::engine::{GenOptions, Session};
use crate::expert::stream::StreamConfig;
use crate::model::ExpertMode;
use crate::store::FileSource;
use crate::vision::{layout, Mmproj, VisionError};
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// An engine: one model session (and its expert cache when a memory budget is set).
pub struct LesEngine {
    session: Session,
    /// The budget and expert cache of a streamed engine (`memory_budget`).
    budget: Option<BudgetControl>,
    last_error: CString,
    backend_line: String,
    /// Statistics of the last generation.
    last: Option<crate::engine::GenStats>,
    /// The vision tower ([`les_load_mmproj`] or the `mmproj` load option): images are accepted.
    mmproj: Option<Mmproj>,
    /// What the last generation did with its images (none: it had none).
    last_images: Option<ImageStats>,
    /// Speculative decoding's draft and the most drafts per target forward (`speculative` /
    /// `draft_model` load options).
    draft: Option<(Box<dyn Draft + Send>, usize)>,
    /// Speculative decoding's counters of the last generation (it was drafted).
    last_spec: Option<SpecStats>,
}

/// The images of one generation, in [`les_stats_json`]'s `last.images`.
#[derive(serde::Serialize)]
struct ImageStats {
    /// Images in the prompt and the embedding rows they became.
    images: usize,
    rows: usize,
    /// Image pieces (overview, slices) encoded, and the time it took (ms): pieces the cache
    /// already held (the same image at the same place in a next turn) are not encoded again.
    encoded: usize,
    encode_ms: f64,
    /// The whole prompt's prefill (encoding included, ms).
    prefill_ms: f64,
}

/// One image given to [`les_generate_images`]: the bytes of a PNG or JPEG file (on iOS,
/// `UIImage.pngData()` or `jpegData(compressionQuality:)`), read only during the call.
#[repr(C)]
pub struct LesImage {
    pub data: *const u8,
    pub len: usize,
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
    /// A vision tower (mmproj GGUF) to load with the model, as [`les_load_mmproj`] does.
    mmproj: Option<String>,
    /// Speculative decoding: "mtp" (the model's own multi-token-prediction block) or "lookup"
    /// (prompt lookup); a draft model is given by `draft_model` instead.
    speculative: Option<String>,
    /// A draft model's GGUF (the target's vocabulary) for speculative decoding.
    draft_model: Option<String>,
    /// Most draft tokens verified per target forward (default per kind, as `les run`).
    draft_max: Option<usize>,
}

fn draft_spec(o: &LoadOptions) -> Result<Option<DraftSpec>, String> {
    match (o.speculative.as_deref(), &o.draft_model) {
        (Some(_), Some(_)) => Err("options: give speculative or draft_model, not both".into()),
        (None, Some(p)) => Ok(Some(DraftSpec::model_file(p).map_err(|e| format!("draft_model {p}: {e}"))?)),
        (Some("mtp"), None) => Ok(Some(DraftSpec::Mtp { lookahead: crate::engine::mtp::MTP_LOOKAHEAD_LAYERS })),
        (Some("lookup"), None) => Ok(Some(DraftSpec::Lookup)),
        (Some(k), None) => Err(format!("options: speculative must be \"mtp\" or \"lookup\", not {k:?}")),
        (None, None) => Ok(None),
    }
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
    let spec = draft_spec(&o)?;
    let target = || FileSource::open(path).map(|f| std::sync::Arc::new(f) as std::sync::Arc<dyn crate::store::ByteSource>).map_err(|e| e.to_string());
    let (mut session, budget, backend_line) = match &o.memory_budget {
        None => {
            let src = FileSource::open(path).map_err(|e| e.to_string())?;
            (Session::load(&src, ExpertMode::Resident, n_ctx).map_err(|e| e.to_string())?, None, None)
        }
        Some(b) => {
            let profile = match o.store.as_deref() {
                None | Some("disk") => None,
                Some(n) => Some(crate::store::throttle::DeviceProfile::by_name(n).ok_or_else(|| format!("unknown store profile '{n}'"))?),
            };
            // A vision tower's weights and encoder activations come out of the budget too, and
            // so does a draft (a draft model, an MTP block).
            let reserve = match &o.mmproj {
                Some(p) => Mmproj::footprint(&FileSource::open(p).map_err(|x| format!("mmproj {p}: {x}"))?, false).map_err(|x| format!("mmproj {p}: {x}"))?,
                None => 0,
            };
            let reserve = reserve + spec.as_ref().map(|d| d.reserve(target()?, n_ctx).map_err(|e| e.to_string())).transpose()?.unwrap_or(0);
            let budget = parse_bytes(b).map_err(|e| e.to_string())?;
            let budget = budget.checked_sub(reserve).ok_or_else(|| format!("memory_budget {b} is smaller than the {:.1} MiB set aside for the vision tower and the draft", reserve as f64 / 1048576.0))?;
            // On a GPU the budget's expert slots are split into a small CPU staging cache and
            // the GPU pool (as `les run`); `auto` falls back to the CPU when the budget cannot
            // hold the dense weights the GPU needs.
            let gpu_pool = backend.runs_on_gpu();
            let so = StreamOptions { budget, n_ctx, direct: false, profile, cache: StreamConfig::default(), slots: None, gpu_pool, dense: crate::engine::stream::DenseOptions::default() };
            let st = match open_streaming(path, &so) {
                Err(crate::engine::stream::OpenError::Budget(_)) if gpu_pool && backend == BackendKind::Auto => open_streaming(path, &StreamOptions { gpu_pool: false, ..so }),
                r => r,
            }
            .map_err(|e| e.to_string())?;
            let slots = if st.plan.gpu_slots > 0 { st.plan.gpu_slots } else { st.experts.config().slots };
            let mut session = st.session;
            let line = session.set_backend(backend, &GpuOptions { expert_slots: Some(slots), ..Default::default() }).map_err(|e| e.to_string())?;
            let pool = session.gpu.as_ref().and_then(|g| g.expert_pool());
            (session, Some(st.budget.with_reserve(reserve).with_gpu_pool(pool)), Some(line))
        }
    };
    let backend_line = match backend_line {
        Some(l) => l,
        None => session.set_backend(backend, &GpuOptions::default()).map_err(|e| e.to_string())?,
    };
    session.reuse_prefix = o.reuse_prefix.unwrap_or(true);
    let mmproj = o.mmproj.as_deref().map(|p| load_mmproj(&session, p)).transpose()?;
    let draft = match &spec {
        Some(d) => Some((d.open(target()?, &mut session).map_err(|e| e.to_string())?.draft, o.draft_max.unwrap_or(d.default_max()))),
        None => None,
    };
    Ok(LesEngine { session, budget, last_error: CString::default(), backend_line, last: None, mmproj, last_images: None, draft, last_spec: None })
}

/// A vision tower for `session`'s text model, checked against it when loaded (the embedding
/// width, the marker tokens mtmd puts around an image), as `les serve --mmproj` does.
fn load_mmproj(session: &Session, path: &str) -> Result<Mmproj, String> {
    let err = |x: &dyn std::fmt::Display| format!("mmproj {path}: {x}");
    let mp = Mmproj::load(&FileSource::open(path).map_err(|x| err(&x))?).map_err(|x| err(&x))?;
    if mp.n_embd_out != session.model.cfg.n_embd {
        return Err(err(&VisionError::Width { mmproj: mp.n_embd_out, text: session.model.cfg.n_embd }));
    }
    session.markers().map_err(|x| err(&x))?;
    Ok(mp)
}

/// Run `f` on a live engine (from [`les_load`], used by one thread at a time): an error, or a
/// panic caught here, becomes the engine's [`les_last_error`] and -1. A NULL engine gives -1.
fn with_engine(engine: *mut LesEngine, what: &str, f: impl FnOnce(&mut LesEngine) -> Result<i32, String>) -> i32 {
    if engine.is_null() {
        return -1;
    }
    // SAFETY: a pointer from les_load, not yet freed, used by one thread at a time.
    let e = unsafe { &mut *engine };
    let r = catch_unwind(AssertUnwindSafe(|| f(&mut *e)));
    let m = match r {
        Ok(Ok(n)) => return n,
        Ok(Err(m)) => m,
        Err(_) => format!("internal error (panic) while {what}"),
    };
    e.last_error = CString::new(m.replace('\0', "")).unwrap_or_default();
    -1
}

/// The generation callback as the engine's `on_token`: each chunk handed over NUL-terminated.
fn text_sink(callback: LesTokenCallback, user: *mut c_void) -> impl FnMut(u32, &str) -> bool {
    move |_tok, text| match (callback, CString::new(text.replace('\0', ""))) {
        (Some(cb), Ok(c)) => cb(c.as_ptr(), user),
        _ => true,
    }
}

/// The bytes of `n` images at `images` (copied: the caller's buffers are read only here).
fn image_bytes(images: *const LesImage, n: usize) -> Result<Vec<Vec<u8>>, String> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if images.is_null() {
        return Err(format!("images is NULL with n_images = {n}"));
    }
    // SAFETY: the caller passes `n` images.
    let list = unsafe { std::slice::from_raw_parts(images, n) };
    list.iter()
        .enumerate()
        .map(|(i, im)| match im.data.is_null() {
            true => Err(format!("image {i}: data is NULL")),
            // SAFETY: the caller promises `len` readable bytes at `data`.
            false => Ok(unsafe { std::slice::from_raw_parts(im.data, im.len) }.to_vec()),
        })
        .collect()
}

/// Load a GGUF model (or a `.les` bundle). `options_json` may be NULL or a JSON object with
/// `memory_budget` ("400MiB"), `backend` ("cpu" | "wgpu" | "auto"), `n_ctx`, `store`,
/// `reuse_prefix` (default true: a chat that re-sends its conversation runs only the new part),
/// `mmproj` (a vision tower's GGUF, as [`les_load_mmproj`]; its weights and encoder activations
/// come out of `memory_budget`, which a tower loaded later by [`les_load_mmproj`] adds to),
/// `speculative` ("mtp": the model's own multi-token-prediction block, llama.cpp's
/// `--spec-type draft-mtp`; "lookup": prompt lookup) or `draft_model` (a draft GGUF with the
/// model's vocabulary), `draft_max` (drafts verified per target forward; a draft's weights and
/// cache come out of `memory_budget` too).
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

/// Options of [`les_plan`] (JSON).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanJson {
    memory_budget: String,
    n_ctx: Option<usize>,
    store: Option<String>,
    /// A routing trace file (`les run --routes`).
    routes: Option<String>,
    policy: Option<String>,
    probe: Option<bool>,
    prompt_tokens: Option<usize>,
}

fn plan_json(path: &str, opts: &str) -> Result<String, String> {
    use crate::engine::plan::{plan, PlanOptions};
    let o: PlanJson = serde_json::from_str(opts).map_err(|e| format!("options: {e}"))?;
    let profile = match o.store.as_deref() {
        None | Some("disk") => None,
        Some(n) => Some(crate::store::throttle::DeviceProfile::by_name(n).ok_or_else(|| format!("unknown store profile '{n}'"))?),
    };
    let routes = match &o.routes {
        Some(p) => Some(serde_json::from_str::<Vec<(u32, u32)>>(&std::fs::read_to_string(p).map_err(|e| format!("routes {p}: {e}"))?).map_err(|e| format!("routes {p}: {e}"))?),
        None => None,
    };
    let policy = match o.policy.as_deref() {
        None => crate::expert::stream::Policy::NextUse,
        Some(p) => crate::expert::stream::Policy::parse(p).ok_or_else(|| format!("unknown policy '{p}'"))?,
    };
    let po = PlanOptions { budget: parse_bytes(&o.memory_budget)?, n_ctx: o.n_ctx.unwrap_or(2048), profile, routes, policy, probe: o.probe.unwrap_or(true), prompt_tokens: o.prompt_tokens.unwrap_or(512), gpu_devices: Vec::new() };
    let f = plan(path, &po).map_err(|e| e.to_string())?;
    serde_json::to_string(&f).map_err(|e| e.to_string())
}

/// Will it fit, and how fast? The forecast of `les plan --json` for a model file, before loading
/// it: `options_json` holds `memory_budget` ("400MiB", required), `n_ctx` (2048), `store`
/// ("disk" or a device profile), `routes` (a routing trace file of an earlier run), `policy`,
/// `probe` (default true: measure the forward's compute here, which loads the dense weights for a
/// moment; false: fit and reads only) and `prompt_tokens` (512). Returns a JSON string to free
/// with [`les_string_free`] (`fits`, `plan`, `minimum`, `largest_context`, `hit_rate`,
/// `bytes_per_token`, `decode_tokens_per_s`, `decode_bound`, `prompt_tokens_per_s`, …), or NULL
/// with a message in `err`.
#[no_mangle]
pub extern "C" fn les_plan(model_path: *const c_char, options_json: *const c_char, err: *mut c_char, err_len: usize) -> *mut c_char {
    let r = catch_unwind(|| plan_json(cstr(model_path)?, cstr(options_json)?));
    match r {
        Ok(Ok(j)) => CString::new(j).unwrap_or_default().into_raw(),
        Ok(Err(m)) => {
            write_err(err, err_len, &m);
            std::ptr::null_mut()
        }
        Err(_) => {
            write_err(err, err_len, "internal error (panic) while planning");
            std::ptr::null_mut()
        }
    }
}

/// Generate up to `n_predict` tokens after `prompt` (tokenized as llama.cpp does, as it is: no
/// chat template), calling `callback(text, user)` per decoded chunk. `temperature` 0 is greedy;
/// `seed` seeds sampling. With a draft (`speculative` / `draft_model` load options) the tokens
/// are drafted and verified (greedy output is plain greedy's; [`les_stats_json`]'s `last.draft`
/// counts the drafts). Returns the number of tokens generated, or -1 on error (see
/// [`les_last_error`]).
#[no_mangle]
pub extern "C" fn les_generate(engine: *mut LesEngine, prompt: *const c_char, n_predict: i32, temperature: f32, seed: u64, callback: LesTokenCallback, user: *mut c_void) -> i32 {
    with_engine(engine, "generating", |e| {
        let toks = e.session.tokenize(cstr(prompt)?);
        let sampler = SamplerConfig { temperature: temperature.max(0.0), seed, ..Default::default() };
        let n = n_predict.max(0) as usize;
        let (out, st, spec) = match e.draft.as_mut() {
            Some((d, gamma)) => {
                let o = SpecOptions { draft_max: *gamma, io: None, verify_first: false };
                let g = GenOptions { n, sampler, ..Default::default() };
                let (out, st, sp) = speculative::generate_with(&mut e.session, Some(&mut **d as &mut dyn Draft), &o, &toks, &g, &mut text_sink(callback, user)).map_err(|x| x.to_string())?;
                (out, st, Some(sp))
            }
            None => {
                let (out, st) = e.session.generate(&toks, n, &sampler, false, &mut text_sink(callback, user)).map_err(|x| x.to_string())?;
                (out, st, None)
            }
        };
        (e.last, e.last_images, e.last_spec) = (Some(st), None, spec);
        Ok(out.len() as i32)
    })
}

/// Load a vision tower (an mmproj GGUF, llama.cpp's `--mmproj`; projector `minicpmv4_6`) for
/// [`les_generate_images`], checked against the engine's text model (embedding width, image
/// marker tokens). A tower loaded before is replaced (and the cached conversation forgotten).
/// Its memory is not taken from `memory_budget` (the expert cache is sized already): give
/// `mmproj` in [`les_load`]'s options for that. Returns 0, or -1 with the error in
/// [`les_last_error`] (-1 alone when `engine` is NULL).
#[no_mangle]
pub extern "C" fn les_load_mmproj(engine: *mut LesEngine, mmproj_path: *const c_char) -> i32 {
    with_engine(engine, "loading the vision tower", |e| {
        let mp = load_mmproj(&e.session, cstr(mmproj_path)?)?;
        if e.mmproj.replace(mp).is_some() {
            e.session.reset();
        }
        Ok(0)
    })
}

/// Generate after a user message with images, as `llama-mtmd-cli -p PROMPT --image …` (and
/// `les run --image`) do: unlike [`les_generate`], `prompt` is the user's text and goes through
/// the model's chat template (one user turn, then the assistant's). Each image goes where
/// `prompt` holds the marker `<__media__>`; without markers they all go before the text.
/// `images` are `n_images` PNG / JPEG files' bytes (n_images 0: the chat turn alone, no vision
/// tower needed). Needs a vision tower ([`les_load_mmproj`]). Callback, sampling and return as
/// [`les_generate`] (decoded without drafts); -1 with [`les_last_error`] for an image that does not decode, no vision
/// tower, or NULL pointers. With `reuse_prefix`, a next call with the same image at the same
/// place neither encodes nor runs it again.
#[no_mangle]
pub extern "C" fn les_generate_images(
    engine: *mut LesEngine,
    prompt: *const c_char,
    images: *const LesImage,
    n_images: usize,
    n_predict: i32,
    temperature: f32,
    seed: u64,
    callback: LesTokenCallback,
    user: *mut c_void,
) -> i32 {
    with_engine(engine, "generating with images", |e| {
        let p = cstr(prompt)?;
        let imgs = image_bytes(images, n_images)?;
        if !imgs.is_empty() && e.mmproj.is_none() {
            return Err("no vision tower is loaded: images need les_load_mmproj (or \"mmproj\" in les_load's options) first".into());
        }
        let content = if p.contains(layout::MARKER) { p.to_string() } else { format!("{}{p}", layout::MARKER.repeat(imgs.len())) };
        let text = e.session.chat_prompt(&[Message { role: "user".into(), content }]).map_err(|x| x.to_string())?;
        let (toks, seen) = match &e.mmproj {
            Some(mp) if !imgs.is_empty() => {
                let mm = e.session.mm_prompt(mp, &text, &imgs).map_err(|x| x.to_string())?;
                if !e.session.reuse_prefix {
                    e.session.reset();
                }
                let run = e.session.prefill_mm(mp, &mm).map_err(|x| x.to_string())?;
                let seen = ImageStats { images: imgs.len(), rows: mm.image_rows, encoded: run.encoded, encode_ms: run.encode_ms, prefill_ms: run.ms };
                (run.tokens, Some((seen, run.reused)))
            }
            _ => (e.session.tokenize(&text), None),
        };
        let o = GenOptions { n: n_predict.max(0) as usize, sampler: SamplerConfig { temperature: temperature.max(0.0), seed, ..Default::default() }, ..Default::default() };
        // The prefill above left all but the last token in the cache: generation runs on from there.
        let was = e.session.reuse_prefix;
        e.session.reuse_prefix |= seen.is_some();
        let r = e.session.generate_with(&toks, &o, &mut text_sink(callback, user));
        e.session.reuse_prefix = was;
        let (out, mut st) = r.map_err(|x| x.to_string())?;
        if let Some((s, reused)) = &seen {
            (st.prompt_reused, st.prompt_ms) = (*reused, st.prompt_ms + s.prefill_ms);
        }
        (e.last, e.last_images, e.last_spec) = (Some(st), seen.map(|(s, _)| s), None);
        Ok(out.len() as i32)
    })
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
/// tokens, timings and finish reason, `images` after images: count, embedding rows, pieces
/// encoded, `encode_ms`, `prefill_ms`, and `draft` after speculative decoding: its source,
/// tokens drafted and accepted, target forwards; expert cache hit rate, bytes read per token, stall, GPU
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
        if let (Some(im), Some(last)) = (&e.last_images, v["last"].as_object_mut()) {
            last.insert("images".into(), serde_json::to_value(im).unwrap_or_default());
        }
        if let (Some(sp), Some(last)) = (&e.last_spec, v["last"].as_object_mut()) {
            last.insert("draft".into(), sp.summary_json());
        }
        if let Some(b) = &e.budget {
            v["budget"] = b.summary_json();
            let s = b.experts().stats();
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
    with_engine(engine, "resetting", |e| {
        e.session.reset();
        Ok(0)
    })
}

/// A handle on a streamed engine's memory budget ([`les_budget`]), for [`les_set_memory_budget`]
/// from any thread: on iOS the memory warning (`didReceiveMemoryWarning`,
/// `UIApplication.didReceiveMemoryWarningNotification`) arrives on the main thread while
/// [`les_generate`] runs on another. Valid until [`les_budget_free`], also after [`les_free`].
pub struct LesBudget {
    ctl: BudgetControl,
}

/// The budget handle of an engine loaded with a `memory_budget`; NULL for an engine holding every
/// weight (nothing to change) or a NULL engine. Call it while no other call uses the engine;
/// free the handle with [`les_budget_free`].
#[no_mangle]
pub extern "C" fn les_budget(engine: *const LesEngine) -> *mut LesBudget {
    if engine.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a live engine pointer, not used by another call now.
    let e = unsafe { &*engine };
    match &e.budget {
        Some(b) => Box::into_raw(Box::new(LesBudget { ctl: b.clone() })),
        None => std::ptr::null_mut(),
    }
}

/// Change the memory budget to `bytes` (the whole budget, as the `memory_budget` load option;
/// 0: the model's minimum), from any thread, also while a generation runs: a lower budget frees
/// expert cache memory at once (what a running layer uses, when it is done), a higher one lets
/// the cache grow again. The conversation and the output do not change. Returns 0, or -1 with
/// the reason in `err` (`err_len` bytes, NUL-terminated; may be NULL): a budget below the
/// model's minimum (the message names it; nothing changes), a NULL handle, or an engine whose
/// experts sit in a GPU pool.
#[no_mangle]
pub extern "C" fn les_set_memory_budget(budget: *const LesBudget, bytes: u64, err: *mut c_char, err_len: usize) -> i32 {
    if budget.is_null() {
        write_err(err, err_len, "budget handle is NULL");
        return -1;
    }
    // SAFETY: a handle from les_budget, not yet freed; BudgetControl is Sync.
    let b = unsafe { &*budget };
    let r = catch_unwind(AssertUnwindSafe(|| b.ctl.set(if bytes == 0 { b.ctl.minimum() } else { bytes }).map(|_| ()).map_err(|e| e.to_string())));
    match r {
        Ok(Ok(())) => 0,
        Ok(Err(m)) => {
            write_err(err, err_len, &m);
            -1
        }
        Err(_) => {
            write_err(err, err_len, "internal error (panic) while changing the memory budget");
            -1
        }
    }
}

/// The memory budget now (bytes; 0 for a NULL handle); writes the model's minimum to `minimum`
/// when it is not NULL.
#[no_mangle]
pub extern "C" fn les_memory_budget(budget: *const LesBudget, minimum: *mut u64) -> u64 {
    if budget.is_null() {
        return 0;
    }
    // SAFETY: a handle from les_budget, not yet freed.
    let b = unsafe { &*budget };
    if !minimum.is_null() {
        // SAFETY: the caller passes a writable u64.
        unsafe { *minimum = b.ctl.minimum() };
    }
    b.ctl.budget()
}

/// Free a handle from [`les_budget`] (NULL is ignored).
#[no_mangle]
pub extern "C" fn les_budget_free(budget: *mut LesBudget) {
    if !budget.is_null() {
        // SAFETY: a handle from les_budget, freed once.
        drop(unsafe { Box::from_raw(budget) });
    }
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
