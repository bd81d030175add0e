//! `les serve`: an OpenAI-compatible HTTP server (llama.cpp's `llama-server` flag names and
//! defaults), on axum + tokio.
//!
//! Endpoints: `POST /v1/chat/completions` and `POST /v1/completions` (streamed as server-sent
//! events with `"stream": true`, as OpenAI streams them), `GET /v1/models`, `GET /health`, and
//! LES's own `GET|POST /les/budget` (the memory budget of a `--memory-budget` session: read it,
//! or lower and raise it while the server runs, e.g. when the host is short of memory; the
//! expert cache follows at once, requests in progress go on with the same output).
//! One worker thread owns the session and serves requests one at a time from a bounded queue;
//! the session keeps its cache between requests, so a conversation's next turn runs only what
//! follows the longest prefix it shares with the previous one (`usage.prompt_tokens_details.
//! cached_tokens`). A request whose client goes away (a closed stream, a dropped connection)
//! stops after the current token. Bad requests get OpenAI-style JSON errors
//! (`{"error": {"message", "type", "param", "code"}}`) with 400, 404, 413 or 503.
//!
//! Images (`--mmproj`, llama-server's flag): chat messages may hold `image_url` content parts
//! with `data:image/png;base64,…` or `image/jpeg` URLs (the server fetches nothing: any other URL
//! is refused). Each becomes a media marker at its place in the message's text (text parts are
//! joined by newlines, none beside a marker, as llama-server joins them); the rendered
//! conversation is encoded with its images (`Session::mm_prompt`) and run by
//! `Session::prefill_mm`, whose token record keys each image on its content, so a next turn with
//! the same image reuses the cache past it.
//!
//! Speculative decoding (`--mtp`, `--lookup`, `--draft-model`, `--draft-max`, as `les run`;
//! llama-server's `--model-draft` / `--spec-type draft-mtp`): text requests are drafted and
//! verified (greedy output is plain greedy's; stop strings apply as without drafts); requests
//! with images decode without drafts; `--context-shift` is refused with a draft. `les.draft` in
//! a response's statistics counts the tokens drafted and accepted.

use super::{open_session_with_tower, GenArgs, ModelArgs, Res, SpecArgs, StreamArgs};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args;
use les::engine::chat::Message;
use les::engine::sampling::SamplerConfig;
use les::engine::speculative::{self, Draft, SpecOptions, SpecStats};
use les::engine::{FinishReason, GenOptions, Session};
use les::expert::stream::StreamingExperts;
use les::vision::layout::MARKER;
use les::vision::Mmproj;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// Largest request body accepted (413 above it): room for images sent as base64 data URLs (4/3
/// of their size), about 15 MiB of PNG / JPEG files per request (llama-server takes remote images
/// of up to 10 MB each).
const MAX_BODY: usize = 20 << 20;
/// Requests waiting for the worker at most (503 above it).
const QUEUE: usize = 64;
/// Most stop strings per request.
const MAX_STOP: usize = 16;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    m: ModelArgs,
    #[command(flatten)]
    s: StreamArgs,
    #[command(flatten)]
    g: GenArgs,
    #[command(flatten)]
    sp: SpecArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Model name in responses and `/v1/models` (default: the model file's name).
    #[arg(long)]
    alias: Option<String>,
    /// A vision tower (mmproj GGUF, llama-server's `--mmproj`: projector `minicpmv4_6`): chat
    /// messages may then carry images as `image_url` parts with base64 `data:` URLs.
    #[arg(long, value_name = "FILE")]
    mmproj: Option<String>,
}

/// An OpenAI-style error.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param, code: None }
    }
    fn server(message: String) -> Self {
        Self { status: StatusCode::INTERNAL_SERVER_ERROR, message, kind: "server_error", param: None, code: None }
    }
    fn json(&self) -> Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.json())).into_response()
    }
}

/// `stop`: a string or a list of strings.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOpts {
    #[serde(default)]
    include_usage: bool,
}

/// The fields both endpoints take (others are accepted and ignored, as OpenAI-compatible
/// servers do).
#[derive(Deserialize)]
struct Common {
    stream: Option<bool>,
    stream_options: Option<StreamOpts>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    /// llama-server's name for max_tokens.
    n_predict: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repeat_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    n: Option<u32>,
}

#[derive(Deserialize)]
struct ChatReq {
    messages: Vec<ChatMsg>,
    #[serde(flatten)]
    c: Common,
}

#[derive(Deserialize)]
struct ChatMsg {
    role: String,
    #[serde(default)]
    content: Value,
}

#[derive(Deserialize)]
struct CompletionReq {
    prompt: Value,
    #[serde(flatten)]
    c: Common,
}

enum Prompt {
    /// The messages (a media marker where each image goes) and the images' file bytes in order.
    Chat(Vec<Message>, Vec<Vec<u8>>),
    Text(String),
}

/// What the worker sends back for one request: `Started` once the prompt is accepted (or an
/// `Error` instead), then text, then `Done` (or an `Error`).
enum Msg {
    Started,
    Text(String),
    Done(Done),
    Error(ApiError),
}

struct Done {
    prompt_tokens: usize,
    completion_tokens: usize,
    reused: usize,
    finish: FinishReason,
    prompt_ms: f64,
    gen_ms: f64,
    hit_rate: Option<f64>,
    mb_per_token: Option<f64>,
    /// Speculative decoding's counters (a request decoded with drafts).
    spec: Option<SpecStats>,
}

struct Job {
    prompt: Prompt,
    opts: GenOptions,
    /// `max_tokens` was given (else: up to the end of the context).
    n_given: bool,
    tx: tokio::sync::mpsc::Sender<Msg>,
}

struct App {
    jobs: std::sync::mpsc::SyncSender<Job>,
    /// False once the worker thread has stopped (a panic it could not recover from).
    alive: Arc<std::sync::atomic::AtomicBool>,
    model: String,
    created: u64,
    next_id: std::sync::atomic::AtomicU64,
    defaults: GenArgs,
    /// A vision tower was loaded (`--mmproj`): images are accepted.
    vision: bool,
    /// The budget of a streamed session (`--memory-budget`).
    budget: Option<les::engine::stream::BudgetControl>,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub fn cmd_serve(a: ServeArgs) -> Res {
    // A vision tower's weights and activations come out of the budget too (its matrices read
    // from storage at each image when the budget cannot hold them beside the model).
    // So does a draft model or an MTP block.
    if a.sp.any() && a.g.context_shift {
        return Err("--context-shift is not supported with speculative decoding (--draft-model, --lookup, --mtp)".into());
    }
    let reserve = a.sp.reserve(&a.m, &a.s)?;
    let (mut sess, budget, mmproj) = open_session_with_tower(&a.m, &a.s, reserve, a.mmproj.as_deref())?;
    let experts = budget.as_ref().map(|b| b.experts().clone());
    sess.reuse_prefix = true;
    let (draft, gamma) = a.sp.open(&a.m, &a.s, &mut sess)?;
    let draft = draft.map(|d| (d, gamma));
    if let Some((d, g)) = &draft {
        eprintln!("les serve: speculative decoding ({}, up to {g} drafts per forward)", d.name());
    }
    if mmproj.is_some() {
        eprintln!("les serve: accepts images (image_url parts with data: URLs)");
    }
    let model = a.alias.clone().unwrap_or_else(|| std::path::Path::new(&a.m.model).file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_else(|| "les".into()));
    let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(QUEUE);
    let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = alive.clone();
    let vision = mmproj.is_some();
    std::thread::Builder::new().name("les-worker".into()).spawn(move || {
        worker(sess, experts, mmproj, draft, rx);
        flag.store(false, std::sync::atomic::Ordering::Relaxed);
    })?;
    let app = Arc::new(App { jobs: tx, alive, model, created: unix_now(), next_id: 0.into(), defaults: a.g.clone(), vision, budget });
    let router = Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/les/budget", get(get_budget).post(set_budget))
        .fallback(|| async { ApiError { status: StatusCode::NOT_FOUND, message: "no such endpoint".into(), kind: "invalid_request_error", param: None, code: None } })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(app);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port)).await?;
        eprintln!("les serve: listening on http://{}", listener.local_addr()?);
        axum::serve(listener, router).await
    })?;
    Ok(())
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.alive.load(std::sync::atomic::Ordering::Relaxed) {
        Json(json!({ "status": "ok" })).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "status": "error", "error": { "message": "the model worker stopped", "type": "server_error" } }))).into_response()
    }
}

/// The session's thread: one request at a time, in arrival order. A request that panics in the
/// engine is answered with a 500 and the session starts over from an empty cache.
fn worker(mut sess: Session, experts: Option<Arc<StreamingExperts>>, mmproj: Option<Mmproj>, mut draft: Option<(Box<dyn Draft + Send>, usize)>, rx: std::sync::mpsc::Receiver<Job>) {
    while let Ok(job) = rx.recv() {
        if job.tx.is_closed() {
            continue; // the client left while the request waited
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_job(&mut sess, experts.as_deref(), mmproj.as_ref(), draft.as_mut(), &job)));
        let msg = match r {
            Ok(Ok(d)) => Msg::Done(d),
            Ok(Err(e)) => Msg::Error(e),
            Err(_) => {
                sess.reset();
                Msg::Error(ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: "internal error while generating".into(), kind: "server_error", param: None, code: None })
            }
        };
        let _ = send(&job.tx, msg);
    }
}

/// How long a client may leave its stream unread before its request is stopped (the worker
/// serves everyone else meanwhile).
const STALL: std::time::Duration = std::time::Duration::from_secs(30);

/// Hand `m` to the request's handler; false when the client is gone or has not read for `STALL`.
fn send(tx: &tokio::sync::mpsc::Sender<Msg>, mut m: Msg) -> bool {
    let t0 = std::time::Instant::now();
    loop {
        match tx.try_send(m) {
            Ok(()) => return true,
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return false,
            Err(tokio::sync::mpsc::error::TrySendError::Full(back)) => {
                if t0.elapsed() > STALL {
                    return false;
                }
                m = back;
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }
}

fn run_job(sess: &mut Session, experts: Option<&StreamingExperts>, mmproj: Option<&Mmproj>, draft: Option<&mut (Box<dyn Draft + Send>, usize)>, job: &Job) -> Result<Done, ApiError> {
    let t0 = les::engine::now_ms();
    let (text, images) = match &job.prompt {
        Prompt::Chat(m, images) => (sess.chat_prompt(m).map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?, images.as_slice()),
        Prompt::Text(t) => (t.clone(), &[][..]),
    };
    // With images: encoded here (`image_error` tells the request's errors from the server's).
    let mm = match (images.is_empty(), mmproj) {
        (true, _) => None,
        (false, Some(mp)) => Some(sess.mm_prompt(mp, &text, images).map_err(image_error)?),
        (false, None) => return Err(no_vision()),
    };
    let toks = match &mm {
        Some(p) => p.tokens.clone(),
        None => sess.tokenize(&text),
    };
    let n_ctx = sess.kv.n_ctx;
    if toks.is_empty() {
        return Err(ApiError::bad("the prompt is empty after tokenization", Some("messages")));
    }
    if toks.len() >= n_ctx {
        return Err(ApiError { code: Some("context_length_exceeded"), ..ApiError::bad(format!("the prompt has {} tokens; the context holds {n_ctx} (start les serve with a larger --ctx-size)", toks.len()), Some("messages")) });
    }
    let mut opts = job.opts.clone();
    if !job.n_given {
        opts.n = n_ctx - toks.len();
    }
    if mm.is_some() {
        // A context shift recomputes the kept tokens from their ids, which an image's rows are not
        // (llama-server turns the shift off with --mmproj).
        opts.context = les::engine::ContextMode::Stop;
    }
    // With a context shift a generation could run on without end: at most 8 contexts' worth.
    opts.n = opts.n.min(8 * n_ctx);
    if let Some(e) = experts {
        e.reset_stats();
    }
    // All but the last token run here (the cached prefix kept); `generate_with` runs the last one
    // and generates.
    let mm_run = match (&mm, mmproj) {
        (Some(p), Some(mp)) => {
            let run = sess.prefill_mm(mp, p).map_err(image_error)?;
            Some((run.reused, les::engine::now_ms() - t0))
        }
        _ => None,
    };
    let tx = &job.tx;
    if !send(tx, Msg::Started) {
        return Err(ApiError::bad("the client went away", None));
    }
    let mut on_text = |_, t: &str| if t.is_empty() { !tx.is_closed() } else { send(tx, Msg::Text(t.to_string())) };
    // Text prompts are drafted and verified; with images (their rows are not tokens a draft
    // could read) plain decoding finishes what `prefill_mm` began.
    let (ids, st, spec) = match draft {
        Some((d, gamma)) if mm.is_none() => {
            let o = SpecOptions { draft_max: *gamma, io: None, verify_first: false };
            let (ids, st, sp) = speculative::generate_with(sess, Some(&mut **d as &mut dyn Draft), &o, &toks, &opts, &mut on_text).map_err(|e| ApiError::server(e.to_string()))?;
            (ids, st, Some(sp))
        }
        _ => {
            let (ids, st) = sess.generate_with(&toks, &opts, &mut on_text).map_err(|e| ApiError::server(e.to_string()))?;
            (ids, st, None)
        }
    };
    let es = experts.map(|e| e.stats());
    Ok(Done {
        prompt_tokens: st.prompt_tokens,
        completion_tokens: ids.len(),
        reused: mm_run.map_or(st.prompt_reused, |(kept, _)| kept),
        finish: st.finish_reason.unwrap_or(FinishReason::Length),
        // With images: encoding and the prefill above, too.
        prompt_ms: st.prompt_ms + mm_run.map_or(0.0, |(_, ms)| ms),
        gen_ms: st.gen_ms,
        hit_rate: es.as_ref().map(|s| s.hit_rate()),
        mb_per_token: es.as_ref().map(|s| s.bytes_per_token() / 1e6),
        spec,
    })
}

/// An image's error: the request's own (400: an image that does not decode, a format LES does
/// not read, too large, markers that do not match the images) or the server's (500).
fn image_error(e: les::engine::EngineError) -> ApiError {
    use les::vision::VisionError as V;
    match e {
        les::engine::EngineError::Vision(v @ (V::Decode(_) | V::Format(_) | V::Empty { .. } | V::TooLarge { .. } | V::Invalid { .. })) => ApiError::bad(v.to_string(), Some("messages")),
        e => ApiError::server(e.to_string()),
    }
}

/// `GET /les/budget`: the plan now (bytes): `BudgetControl::summary_json` (`budget`, `minimum`,
/// `expert_slots`, `expert_bytes_held`, `dense_streamed`, the allocator's reserve) and what the
/// budget holds (`dense`, `kv`, `scratch`, `expert_slot_bytes`).
async fn get_budget(State(app): State<Arc<App>>) -> Response {
    match &app.budget {
        Some(b) => Json(budget_json(b)).into_response(),
        None => no_budget().into_response(),
    }
}

fn no_budget() -> ApiError {
    ApiError { status: StatusCode::BAD_REQUEST, message: "this server holds every weight in memory (started without --memory-budget): there is no budget to change".into(), kind: "invalid_request_error", param: None, code: Some("no_memory_budget") }
}

fn budget_json(b: &les::engine::stream::BudgetControl) -> Value {
    let p = b.plan();
    let mut v = b.summary_json();
    for (k, x) in [("expert_slot_bytes", p.expert_bytes_max), ("dense", p.dense), ("kv", p.kv), ("scratch", p.scratch)] {
        v[k] = json!(x);
    }
    v
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BudgetReq {
    /// Bytes, or a size as `--memory-budget` takes it ("300MiB").
    memory_budget: Value,
}

/// `POST /les/budget {"memory_budget": "300MiB" | bytes}`: change the budget now (from the
/// HTTP thread: the worker may be generating). Below the model's minimum: 400 with code
/// `budget_too_small` and the minimum in the message; nothing changes.
async fn set_budget(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let Some(b) = &app.budget else { return no_budget().into_response() };
    let r: BudgetReq = match parse(body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let bytes = match &r.memory_budget {
        Value::Number(n) => n.as_u64().ok_or_else(|| "a whole number of bytes".to_string()),
        Value::String(s) => les::engine::stream::parse_bytes(s),
        _ => Err("a number of bytes or a size such as \"300MiB\"".into()),
    };
    let bytes = match bytes {
        Ok(v) => v,
        Err(e) => return ApiError::bad(format!("memory_budget: {e}"), Some("memory_budget")).into_response(),
    };
    match b.set(bytes) {
        Ok(_) => Json(budget_json(b)).into_response(),
        Err(e) => {
            let code = match e {
                les::engine::stream::BudgetError::TooSmall { .. } => "budget_too_small",
                les::engine::stream::BudgetError::GpuPool { .. } => "budget_fixed",
            };
            ApiError { status: StatusCode::BAD_REQUEST, message: e.to_string(), kind: "invalid_request_error", param: Some("memory_budget"), code: Some(code) }.into_response()
        }
    }
}

/// `/v1/models`: OpenAI's list, plus llama-server's `models` entry whose `capabilities` name
/// `multimodal` when a vision tower is loaded.
async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    let caps = if app.vision { json!(["completion", "multimodal"]) } else { json!(["completion"]) };
    Json(json!({
        "object": "list",
        "data": [{ "id": app.model, "object": "model", "created": app.created, "owned_by": "les" }],
        "models": [{ "name": app.model, "model": app.model, "type": "model", "capabilities": caps }],
    }))
}

fn parse<T: for<'de> Deserialize<'de>>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|r| ApiError { status: r.status(), message: r.body_text(), kind: "invalid_request_error", param: None, code: None })?;
    serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("invalid request body: {e}"), None))
}

/// Sampling and length options, checked.
fn options(app: &App, c: &Common) -> Result<(GenOptions, bool), ApiError> {
    if c.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("only n = 1 is supported", Some("n")));
    }
    let d = SamplerConfig::default();
    let temperature = c.temperature.unwrap_or(d.temperature);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad("temperature must be in 0..=2", Some("temperature")));
    }
    let top_p = c.top_p.unwrap_or(d.top_p);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(ApiError::bad("top_p must be in 0..=1", Some("top_p")));
    }
    let min_p = c.min_p.unwrap_or(d.min_p);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::bad("min_p must be in 0..=1", Some("min_p")));
    }
    let max = c.max_completion_tokens.or(c.max_tokens).or(c.n_predict.filter(|&n| n >= 0));
    if max.is_some_and(|m| m < 1) {
        return Err(ApiError::bad("max_tokens must be at least 1", Some("max_tokens")));
    }
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOP {
        return Err(ApiError::bad(format!("at most {MAX_STOP} stop strings"), Some("stop")));
    }
    let repeat_penalty = c.repeat_penalty.unwrap_or(d.repeat_penalty);
    if !(repeat_penalty > 0.0 && repeat_penalty.is_finite()) {
        return Err(ApiError::bad("repeat_penalty must be a positive number", Some("repeat_penalty")));
    }
    // A temperature too small to divide by is greedy.
    let temperature = if temperature < 1e-4 { 0.0 } else { temperature };
    let seed = c.seed.unwrap_or_else(|| {
        let n = app.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    });
    let sampler = SamplerConfig { temperature, top_p, min_p, top_k: c.top_k.unwrap_or(d.top_k), repeat_penalty, seed, ..d };
    let stop = if c.stop.is_none() { app.defaults.stop.clone() } else { stop };
    let n = max.map(|m| m.min(u32::MAX as i64) as usize).unwrap_or(0);
    Ok((GenOptions { n, sampler, ignore_eos: false, stop, context: app.defaults.context() }, max.is_some()))
}

fn no_vision() -> ApiError {
    ApiError::bad("this server has no vision tower: image input needs les serve started with --mmproj FILE", Some("messages"))
}

/// A message's text: a string, or content parts as llama-server joins them (text parts with
/// newlines between them, none beside an image's media marker). Images (`vision`: the server
/// has a tower) go to `images` in order.
fn content_text(v: &Value, vision: bool, images: &mut Vec<Vec<u8>>) -> Result<String, ApiError> {
    let bad = |m: &str| ApiError::bad(m, Some("messages"));
    let parts = match v {
        Value::Null => return Ok(String::new()),
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        _ => return Err(bad("message content must be a string or a list of content parts")),
    };
    let mut text = String::new();
    let mut after_marker = false;
    for p in parts {
        match p.get("type").and_then(|t| t.as_str()) {
            Some("text") => {
                let t = p.get("text").and_then(|t| t.as_str()).ok_or_else(|| bad("a text content part needs a string 'text'"))?;
                if !after_marker && !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(t);
                after_marker = false;
            }
            Some("image_url") => {
                if !vision {
                    return Err(no_vision());
                }
                // `{"url": …, "detail": …}` (`detail` ignored), or the URL alone.
                let url = match p.get("image_url") {
                    Some(Value::String(u)) => Some(u.as_str()),
                    Some(o) => o.get("url").and_then(|u| u.as_str()),
                    None => None,
                };
                images.push(data_url(url.ok_or_else(|| bad("an image_url content part needs 'image_url.url'"))?)?);
                text.push_str(MARKER);
                after_marker = true;
            }
            _ => return Err(bad(if vision { "only text and image_url content parts are supported" } else { "only text content parts are supported" })),
        }
    }
    Ok(text)
}

/// The file bytes of a `data:image/png;base64,…` (or `image/jpeg`) URL. Nothing is fetched: any
/// other URL is refused.
fn data_url(url: &str) -> Result<Vec<u8>, ApiError> {
    let bad = |m: String| ApiError::bad(m, Some("messages"));
    let rest = match url.get(..5) {
        Some(s) if s.eq_ignore_ascii_case("data:") => &url[5..],
        _ => return Err(bad("image URLs must be data: URLs (data:image/png;base64,… or data:image/jpeg;base64,…): les serve fetches nothing, so remote (http, https) URLs are refused".into())),
    };
    let (head, data) = rest.split_once(',').ok_or_else(|| bad("malformed data: URL (no ',' before the data)".into()))?;
    let mut params = head.split(';');
    let mime = params.next().unwrap_or("").trim().to_ascii_lowercase();
    if !matches!(mime.as_str(), "image/png" | "image/jpeg" | "image/jpg") {
        return Err(bad(format!("image type '{mime}' is not supported (image/png and image/jpeg are)")));
    }
    if !params.any(|p| p.trim().eq_ignore_ascii_case("base64")) {
        return Err(bad("image data: URLs must be base64-encoded (data:image/png;base64,…)".into()));
    }
    base64_decode(data).map_err(|e| bad(format!("the image's base64 data is invalid: {e}")))
}

/// Standard base64 (RFC 4648 §4); padding optional, ASCII whitespace skipped (as browsers' `atob`).
fn base64_decode(s: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(s.len() / 4 * 3 + 2);
    let (mut acc, mut bits, mut n, mut pad) = (0u32, 0u32, 0usize, 0usize);
    for (i, c) in s.bytes().enumerate() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => {
                pad += 1;
                continue;
            }
            b' ' | b'\t' | b'\n' | b'\r' | b'\x0c' => continue,
            _ => return Err(format!("character {i} is '{}'", c.escape_ascii())),
        };
        if pad > 0 {
            return Err("data after the '=' padding".into());
        }
        acc = (acc << 6 | v as u32) & 0xfff;
        bits += 6;
        n += 1;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if n % 4 == 1 || pad > 2 || (pad > 0 && (n + pad) % 4 != 0) {
        return Err(format!("{n} characters and {pad} '=' are not a whole number of base64 groups"));
    }
    Ok(out)
}

async fn chat(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r: Result<ChatReq, ApiError> = parse(body);
    let req = match r {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if req.messages.is_empty() {
        return ApiError::bad("messages must not be empty", Some("messages")).into_response();
    }
    let mut msgs = Vec::with_capacity(req.messages.len());
    let mut images = Vec::new();
    for m in &req.messages {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => return ApiError::bad(format!("unsupported role '{other}'"), Some("messages")).into_response(),
        };
        match content_text(&m.content, app.vision, &mut images) {
            Ok(c) => msgs.push(Message { role: role.into(), content: c }),
            Err(e) => return e.into_response(),
        }
    }
    submit(app, Prompt::Chat(msgs, images), &req.c, true).await
}

async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r: Result<CompletionReq, ApiError> = parse(body);
    let req = match r {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let prompt = match &req.prompt {
        Value::String(s) => s.clone(),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
        _ => return ApiError::bad("prompt must be a string", Some("prompt")).into_response(),
    };
    submit(app, Prompt::Text(prompt), &req.c, false).await
}

/// Queue the request and answer it, streamed or whole.
async fn submit(app: Arc<App>, prompt: Prompt, c: &Common, chat: bool) -> Response {
    let (opts, n_given) = match options(&app, c) {
        Ok(o) => o,
        Err(e) => return e.into_response(),
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Msg>(256);
    let busy = |m: &str| ApiError { status: StatusCode::SERVICE_UNAVAILABLE, message: m.into(), kind: "server_error", param: None, code: None }.into_response();
    match app.jobs.try_send(Job { prompt, opts, n_given, tx }) {
        Ok(()) => {}
        Err(std::sync::mpsc::TrySendError::Full(_)) => return busy("the request queue is full; retry later"),
        Err(std::sync::mpsc::TrySendError::Disconnected(_)) => return busy("the model worker stopped"),
    }
    // The worker accepts the prompt (or rejects it: the error goes out with its own status, also
    // for a streamed request) before the response starts.
    match rx.recv().await {
        Some(Msg::Started) => {}
        Some(Msg::Error(e)) => return e.into_response(),
        _ => return busy("the model worker stopped"),
    }
    let n = app.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let id = if chat { format!("chatcmpl-les-{n}") } else { format!("cmpl-les-{n}") };
    let created = unix_now();
    let model = app.model.clone();
    let object = if chat { "chat.completion" } else { "text_completion" };
    if !c.stream.unwrap_or(false) {
        let mut text = String::new();
        while let Some(m) = rx.recv().await {
            match m {
                Msg::Started => {}
                Msg::Text(t) => text.push_str(&t),
                Msg::Error(e) => return e.into_response(),
                Msg::Done(d) => {
                    let choice = if chat {
                        // gpt-oss (harmony): `content` is the final channel, `reasoning_content`
                        // the analysis channel (llama.cpp's field).
                        let msg = match les::engine::chat::split_harmony(&text) {
                            Some((reasoning, content)) => json!({ "role": "assistant", "content": content, "reasoning_content": reasoning }),
                            None => json!({ "role": "assistant", "content": text }),
                        };
                        json!({ "index": 0, "message": msg, "logprobs": null, "finish_reason": d.finish.as_str() })
                    } else {
                        json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": d.finish.as_str() })
                    };
                    return Json(json!({ "id": id, "object": object, "created": created, "model": model, "choices": [choice], "usage": usage(&d), "les": les_stats(&d) })).into_response();
                }
            }
        }
        return ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: "the worker stopped".into(), kind: "server_error", param: None, code: None }.into_response();
    }
    let include_usage = c.stream_options.as_ref().is_some_and(|s| s.include_usage);
    let chunk_object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let head = move |choice: Value| json!({ "id": id, "object": chunk_object, "created": created, "model": model, "choices": [choice] });
    // The events, in order: (chat) the role, text deltas, the finish reason, optionally usage, [DONE].
    let stream = async_stream(move |emit| async move {
        if chat {
            emit(Event::default().data(head(json!({ "index": 0, "delta": { "role": "assistant", "content": "" }, "logprobs": null, "finish_reason": null })).to_string())).await;
        }
        // gpt-oss (harmony): the analysis channel streams as `reasoning_content` deltas, the
        // final one as `content` (llama.cpp's server does the same).
        let mut harmony = les::engine::chat::HarmonyStream::default();
        let delta = |(r, c): (String, String)| {
            let mut out = Vec::new();
            if !r.is_empty() {
                out.push(json!({ "index": 0, "delta": { "reasoning_content": r }, "logprobs": null, "finish_reason": null }));
            }
            if !c.is_empty() {
                out.push(json!({ "index": 0, "delta": { "content": c }, "logprobs": null, "finish_reason": null }));
            }
            out
        };
        while let Some(m) = rx.recv().await {
            match m {
                Msg::Started => {}
                Msg::Text(t) if chat => {
                    for choice in delta(harmony.push(&t)) {
                        emit(Event::default().data(head(choice).to_string())).await;
                    }
                }
                Msg::Text(t) => {
                    let choice = json!({ "index": 0, "text": t, "logprobs": null, "finish_reason": null });
                    emit(Event::default().data(head(choice).to_string())).await;
                }
                Msg::Error(e) => {
                    emit(Event::default().data(e.json().to_string())).await;
                    break;
                }
                Msg::Done(d) => {
                    if chat {
                        for choice in delta(harmony.finish()) {
                            emit(Event::default().data(head(choice).to_string())).await;
                        }
                    }
                    let choice = if chat { json!({ "index": 0, "delta": {}, "logprobs": null, "finish_reason": d.finish.as_str() }) } else { json!({ "index": 0, "text": "", "logprobs": null, "finish_reason": d.finish.as_str() }) };
                    let mut last = head(choice);
                    last["les"] = les_stats(&d);
                    emit(Event::default().data(last.to_string())).await;
                    if include_usage {
                        let mut u = head(Value::Null);
                        u["choices"] = json!([]);
                        u["usage"] = usage(&d);
                        emit(Event::default().data(u.to_string())).await;
                    }
                    break;
                }
            }
        }
        emit(Event::default().data("[DONE]")).await;
    });
    Sse::new(stream).into_response()
}

/// A stream of SSE events from an async producer: `f(emit)` awaits `emit(event)` for each one.
/// When the client goes away the stream is dropped, and with it the producer and the request's
/// receiver, which tells the worker to stop.
fn async_stream<F, Fut>(f: F) -> impl futures::Stream<Item = Result<Event, std::convert::Infallible>>
where
    F: FnOnce(Box<dyn Fn(Event) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(16);
    let emit = Box::new(move |e: Event| {
        let tx = tx.clone();
        Box::pin(async move {
            let _ = tx.send(e).await;
        }) as std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
    });
    let producer = tokio::spawn(f(emit));
    let guard = AbortOnDrop(producer);
    futures::stream::unfold((rx, guard), |(mut rx, guard)| async move { rx.recv().await.map(|e| (Ok(e), (rx, guard))) })
}

/// Aborts the producer task when the response stream is dropped (client gone).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn usage(d: &Done) -> Value {
    json!({ "prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens, "total_tokens": d.prompt_tokens + d.completion_tokens, "prompt_tokens_details": { "cached_tokens": d.reused } })
}

/// LES's own statistics: cache reuse, timings, expert hit rate and MB read per token.
fn les_stats(d: &Done) -> Value {
    json!({
        "prompt_reused": d.reused,
        "prompt_ms": d.prompt_ms,
        "gen_ms": d.gen_ms,
        "tokens_per_s": if d.gen_ms > 0.0 { d.completion_tokens as f64 * 1000.0 / d.gen_ms } else { 0.0 },
        "hit_rate": d.hit_rate,
        "mb_read_per_token": d.mb_per_token,
        "draft": d.spec.as_ref().map(SpecStats::summary_json),
    })
}
