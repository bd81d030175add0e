//! `les serve` end to end over TCP: the OpenAI-style endpoints answer what the engine computes
//! (greedy text equal to `Session::generate` on the same prompt), streamed and whole; a second
//! chat turn reuses the first's cache; bad requests (invalid JSON, an oversized body, a bad
//! parameter, a prompt longer than the context, an unknown path) get OpenAI-style JSON errors
//! with the right status; a client that disconnects mid-stream does not take the server down.
//! With `--mmproj`: an image sent as a data URL gives llama.cpp's greedy text, a second turn with
//! the same image reuses the cache past it, and remote URLs, bad data URLs and bad images are
//! refused (as is any image on a server without a vision tower).
//! Speculative decoding (`--lookup`, `--mtp`) gives the same greedy text.
//! The `openai` Python client and curl run against it in `tests/e2e/serve_clients.sh`.

use crate::common::*;
use les::engine::chat::Message;
use les::engine::sampling::SamplerConfig;
use les::engine::Session;
use les::model::ExpertMode;
use les::store::FileSource;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const CTX: usize = 192;

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Server {
    start_with(MODEL, &[])
}

fn start_with(file: &str, extra: &[&str]) -> Server {
    // Portable kernels on both sides (see `engine_greedy`).
    les::quant::Simd::force(les::quant::Simd::Scalar);
    let mut child = Command::new(env!("CARGO_BIN_EXE_les"))
        .env("LES_NO_SIMD", "1")
        .args(["serve", "--model", model(file).to_str().unwrap(), "--port", "0", "-c", &CTX.to_string(), "-t", "2"])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let l = lines.next().expect("les serve exited before listening").unwrap();
        if let Some(a) = l.strip_prefix("les serve: listening on http://") {
            break a.to_string();
        }
    };
    // Keep draining stderr so the server never blocks on it.
    std::thread::spawn(move || for _ in lines {});
    Server { child, addr }
}

struct Resp {
    status: u16,
    body: Vec<u8>,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    /// The text of a streamed `/v1/completions` reply: every chunk's `choices[0].text` before
    /// `[DONE]`.
    fn streamed_completion(&self) -> String {
        let ev = self.events();
        ev[..ev.len() - 1].iter().map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string()).collect()
    }
    /// The `data:` payloads of a server-sent-event stream.
    fn events(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.body).lines().filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")).map(|s| s.to_string())).collect()
    }
}

/// One HTTP/1.1 request (`Connection: close`), the response de-chunked.
fn http(addr: &str, method: &str, path: &str, body: Option<&[u8]>) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let b = body.unwrap_or(&[]);
    let head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", b.len());
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(b); // the server may answer (413) and close before reading it all
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("no header end");
    let headers = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    let status: u16 = headers.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut rest = &raw[split + 4..];
    let body = if headers.contains("transfer-encoding: chunked") {
        let mut out = Vec::new();
        loop {
            let nl = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let n = usize::from_str_radix(std::str::from_utf8(&rest[..nl]).unwrap().trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[nl + 2..nl + 2 + n]);
            rest = &rest[nl + 2 + n + 2..];
        }
        out
    } else {
        rest.to_vec()
    };
    Resp { status, body }
}

/// A 21 MiB body (the limit is 20 MiB), written by another thread while the response is read
/// (the server answers 413 without reading it all).
fn oversized(addr: &str) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let n = 21 << 20;
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n").unwrap();
    let mut w = s.try_clone().unwrap();
    std::thread::spawn(move || {
        let _ = w.write_all(&vec![b' '; n]);
    });
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(k) = s.read(&mut buf) {
        if k == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..k]);
    }
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("no response to an oversized body");
    let headers = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = headers.split_whitespace().nth(1).unwrap().parse().unwrap();
    Resp { status, body: raw[split + 4..].to_vec() }
}

fn post(addr: &str, path: &str, v: &Value) -> Resp {
    http(addr, "POST", path, Some(v.to_string().as_bytes()))
}

/// The engine's own greedy text for `prompt` (the reference the server must reproduce), cold.
/// The server reuses cached prefixes; on the portable kernels (forced on both sides) that gives
/// a cold run's bits (`tests/portable/conversation.rs`).
fn engine_greedy(prompt: &str, n: usize) -> String {
    engine_greedy_on(MODEL, prompt, n)
}

fn engine_greedy_on(file: &str, prompt: &str, n: usize) -> String {
    let src = FileSource::open(model(file)).unwrap();
    let mut s = Session::load(&src, ExpertMode::Resident, CTX).unwrap();
    let toks = s.tokenize(prompt);
    let mut text = String::new();
    s.generate(&toks, n, &SamplerConfig::greedy(), false, &mut |_, t| {
        text.push_str(t);
        true
    })
    .unwrap();
    text
}

fn chat_text(messages: &[(&str, &str)]) -> String {
    let src = FileSource::open(model(MODEL)).unwrap();
    let s = Session::load(&src, ExpertMode::Resident, CTX).unwrap();
    let m: Vec<Message> = messages.iter().map(|(r, c)| Message { role: r.to_string(), content: c.to_string() }).collect();
    s.chat_prompt(&m).unwrap()
}

fn assert_error(r: &Resp, status: u16, what: &str) -> Value {
    assert_eq!(r.status, status, "{what}: {}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
    assert!(v["error"]["type"].is_string(), "{what}: {v}");
    v
}

#[test]
fn serve_end_to_end() {
    let srv = start();
    let a = srv.addr.as_str();

    let h = http(a, "GET", "/health", None);
    assert_eq!((h.status, h.json()["status"].as_str()), (200, Some("ok")));
    let m = http(a, "GET", "/v1/models", None).json();
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["models"][0]["capabilities"], json!(["completion"]));

    // Chat, whole: the engine's greedy text on the rendered conversation.
    let q = "What is the capital of France?";
    let req = json!({ "model": MODEL, "messages": [{ "role": "user", "content": q }], "max_tokens": 12, "temperature": 0 });
    let r = post(a, "/v1/chat/completions", &req);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(content, engine_greedy(&chat_text(&[("user", q)]), 12));
    assert_eq!(v["object"], "chat.completion");
    assert!(matches!(v["choices"][0]["finish_reason"].as_str(), Some("stop" | "length")));
    let u = &v["usage"];
    assert_eq!(u["total_tokens"].as_u64(), Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()));
    assert!(v["les"]["tokens_per_s"].is_number());

    // Streamed: the same text in deltas, a finish reason, usage on request, then [DONE].
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({ "include_usage": true });
    let r = post(a, "/v1/chat/completions", &sreq);
    assert_eq!(r.status, 200);
    let ev = r.events();
    assert_eq!(ev.last().map(|s| s.as_str()), Some("[DONE]"));
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, content);
    assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"].is_string()));
    assert!(chunks.last().unwrap()["usage"]["completion_tokens"].is_number());

    // A second turn reuses the first's cache.
    let req2 = json!({ "messages": [{ "role": "user", "content": q }, { "role": "assistant", "content": content }, { "role": "user", "content": "And of Italy?" }], "max_tokens": 8, "temperature": 0 });
    let v2 = post(a, "/v1/chat/completions", &req2).json();
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 10, "second turn reused {cached} tokens: {v2}");
    assert_eq!(v2["les"]["prompt_reused"].as_u64(), Some(cached));

    // Completions, whole and streamed, with a stop string.
    let p = "The capital of France is";
    let want = engine_greedy(p, 10);
    let v = post(a, "/v1/completions", &json!({ "prompt": p, "max_tokens": 10, "temperature": 0 })).json();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()));
    let stop: String = want.chars().skip(want.chars().count() / 2).take(3).collect();
    let v = post(a, "/v1/completions", &json!({ "prompt": p, "max_tokens": 10, "temperature": 0, "stop": [stop] })).json();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(&want[..want.find(&stop).unwrap()]), "stop {stop:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let r = post(a, "/v1/completions", &json!({ "prompt": p, "max_tokens": 10, "temperature": 0, "stream": true }));
    assert_eq!(r.streamed_completion(), want);

    // Unknown fields are ignored.
    let r = post(a, "/v1/chat/completions", &json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 2, "frobnicate": { "x": 1 }, "logit_bias": {} }));
    assert_eq!(r.status, 200);

    // Bad requests.
    assert_error(&http(a, "POST", "/v1/chat/completions", Some(b"{\"messages\": [")), 400, "invalid JSON");
    assert_error(&oversized(a), 413, "oversized body");
    let e = assert_error(&post(a, "/v1/chat/completions", &json!({ "messages": [{ "role": "user", "content": "Hi" }], "temperature": 7 })), 400, "temperature");
    assert_eq!(e["error"]["param"], "temperature");
    assert_error(&post(a, "/v1/chat/completions", &json!({ "messages": [] })), 400, "no messages");
    assert_error(&post(a, "/v1/chat/completions", &json!({ "messages": "hello" })), 400, "messages not a list");
    assert_error(&post(a, "/v1/completions", &json!({ "prompt": 42 })), 400, "prompt not a string");
    let e = assert_error(&post(a, "/v1/chat/completions", &image_request(&[], "data:image/png;base64,iVBORw0KGgo=", "Describe", 2)), 400, "an image without --mmproj");
    assert!(e["error"]["message"].as_str().unwrap().contains("--mmproj"), "{e}");
    let long = "word ".repeat(4 * CTX);
    let e = assert_error(&post(a, "/v1/completions", &json!({ "prompt": long, "max_tokens": 4 })), 400, "prompt longer than the context");
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    assert_error(&http(a, "GET", "/v1/nope", None), 404, "unknown path");
    // Streamed requests are checked before the stream starts: the error keeps its status.
    let e = assert_error(&post(a, "/v1/completions", &json!({ "prompt": long, "max_tokens": 4, "stream": true })), 400, "streamed prompt longer than the context");
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    assert_error(&post(a, "/v1/completions", &json!({ "prompt": p, "repeat_penalty": 0 })), 400, "repeat_penalty 0");
    assert_eq!(post(a, "/v1/completions", &json!({ "prompt": p, "max_tokens": 2, "stream": null })).status, 200);

    // A client that goes away mid-stream: the server stops that request and serves the next.
    {
        let mut s = TcpStream::connect(a).unwrap();
        let b = json!({ "prompt": "Once upon a time", "max_tokens": 150, "stream": true, "temperature": 0 }).to_string();
        write!(s, "POST /v1/completions HTTP/1.1\r\nHost: {a}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len()).unwrap();
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    }
    let t0 = std::time::Instant::now();
    let v = post(a, "/v1/completions", &json!({ "prompt": p, "max_tokens": 10, "temperature": 0 })).json();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()));
    eprintln!("request after a disconnect answered in {:.2} s", t0.elapsed().as_secs_f64());

    // Requests at once are queued and each answered.
    let hs: Vec<_> = (0..3)
        .map(|i| {
            let a = a.to_string();
            std::thread::spawn(move || post(&a, "/v1/completions", &json!({ "prompt": format!("Count to {i}:"), "max_tokens": 4 })).status)
        })
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap(), 200);
    }
    assert_eq!(http(a, "GET", "/health", None).status, 200);

    // Every weight resident: no budget to change.
    let v = assert_error(&post(a, "/les/budget", &json!({ "memory_budget": "64MiB" })), 400, "budget without --memory-budget");
    assert_eq!(v["error"]["code"], "no_memory_budget");
}

/// Speculative decoding in `les serve` (issue 37 item 2): with prompt lookup (`--lookup`,
/// SmolLM2, a prompt that repeats itself: drafts are accepted) and with the model's own MTP block
/// (`--mtp`, rand-qwen35moe-mtp with its experts streamed under a budget), greedy replies are the
/// engine's plain greedy text, whole and streamed; a stop string cuts them where it cuts plain
/// decoding; a next turn reuses the cache; `les.draft` counts the drafts.
/// `--context-shift` with a draft is refused at start.
#[test]
fn serve_speculative() {
    let srv = start_with(MODEL, &["--lookup"]);
    let a = srv.addr.as_str();
    let p = "one two three four five six seven eight nine ten, one two three four five six seven eight nine ten, one two three";
    let want = engine_greedy(p, 16);
    let v = post(a, "/v1/completions", &json!({ "prompt": p, "max_tokens": 16, "temperature": 0 })).json();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "{v}");
    let d = &v["les"]["draft"];
    assert_eq!(d["source"], "prompt lookup");
    assert!(d["accepted"].as_u64().unwrap() > 0, "no draft accepted: {v}");
    let stop: String = want.chars().skip(want.chars().count() / 2).take(3).collect();
    let v = post(a, "/v1/completions", &json!({ "prompt": p, "max_tokens": 16, "temperature": 0, "stop": [stop] })).json();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(&want[..want.find(&stop).unwrap()]), "stop {stop:?}: {v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let r = post(a, "/v1/completions", &json!({ "prompt": p, "max_tokens": 16, "temperature": 0, "stream": true }));
    assert_eq!(r.streamed_completion(), want);
    // The next turn (the reply and more) reuses the cache.
    let p2 = format!("{p}{want} eleven");
    let v = post(a, "/v1/completions", &json!({ "prompt": p2, "max_tokens": 8, "temperature": 0 })).json();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(engine_greedy(&p2, 8).as_str()), "{v}");
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 10, "the next turn reused too little: {v}");
    drop(srv);

    // 40 MiB: 11 of the experts' slots, the MTP block held beside them.
    const MTP: &str = "rand-qwen35moe-mtp.gguf";
    let srv = start_with(MTP, &["--mtp", "--memory-budget", "40MiB"]);
    let a = srv.addr.as_str();
    for p in ["Once upon a time", "The capital of France is"] {
        let want = engine_greedy_on(MTP, p, 12);
        let v = post(a, "/v1/completions", &json!({ "prompt": p, "max_tokens": 12, "temperature": 0 })).json();
        assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "'{p}': {v}");
        assert_eq!(v["les"]["draft"]["source"], "MTP");
        assert!(v["les"]["draft"]["drafted"].as_u64().unwrap() > 0, "{v}");
        assert!(v["les"]["mb_read_per_token"].as_f64().unwrap() > 0.0, "nothing was streamed: {v}");
    }
    drop(srv);

    let out = Command::new(env!("CARGO_BIN_EXE_les")).args(["serve", "--model", model(MODEL).to_str().unwrap(), "--port", "0", "--lookup", "--context-shift"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--context-shift"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `/les/budget` (issue 39 item 2): a streamed server's budget lowered to the model's minimum
/// and raised again between requests, and once while a request is generating: every reply is the
/// resident engine's greedy text, the expert slots follow, and bad values are refused with
/// nothing changed.
#[test]
fn serve_memory_budget() {
    const MOE: &str = "rand-qwen3moe.gguf";
    let greedy = |prompt: &str, n: usize| engine_greedy_on(MOE, prompt, n);
    // 40 MiB: room for 21 of the 64 experts' slots beside the rest.
    let srv = start_with(MOE, &["--memory-budget", "40MiB"]);
    let a = srv.addr.as_str();
    let b0 = http(a, "GET", "/les/budget", None).json();
    assert_eq!(b0["budget"].as_u64(), Some(40 << 20), "{b0}");
    let (min, slot) = (b0["minimum"].as_u64().unwrap(), b0["expert_slot_bytes"].as_u64().unwrap());
    let fixed = b0["dense"].as_u64().unwrap() + b0["kv"].as_u64().unwrap() + b0["scratch"].as_u64().unwrap();
    assert_eq!(b0["expert_slots"].as_u64(), Some((40 << 20) - fixed).map(|b| b / slot), "{b0}");
    assert!(b0["expert_slots"].as_u64().unwrap() < 64, "{b0}");
    let complete = |prompt: &str| post(a, "/v1/completions", &json!({ "prompt": prompt, "max_tokens": 12, "temperature": 0 })).json()["choices"][0]["text"].as_str().unwrap().to_string();

    let prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"];
    assert_eq!(complete(prompts[0]), greedy(prompts[0], 12));
    // Down to the minimum: one layer's top-k + 1 slots, their buffers only, and the dense
    // matrices that can be read from storage at each use, streamed.
    let v = post(a, "/les/budget", &json!({ "memory_budget": min })).json();
    assert_eq!((v["budget"].as_u64(), v["minimum"].as_u64()), (Some(min), Some(min)), "{v}");
    let held = v["dense"].as_u64().unwrap() + v["kv"].as_u64().unwrap() + v["scratch"].as_u64().unwrap();
    assert!(min < fixed && v["dense_streamed"].as_u64().unwrap() > 0, "{v}");
    let n_min = (min - held) / slot;
    assert_eq!(v["expert_slots"].as_u64(), Some(n_min), "{v}");
    assert!(v["expert_bytes_held"].as_u64().unwrap() <= n_min * slot, "{v}");
    assert_eq!(complete(prompts[1]), greedy(prompts[1], 12));
    // Refused, nothing changed.
    let e = assert_error(&post(a, "/les/budget", &json!({ "memory_budget": min - 1 })), 400, "below the minimum");
    assert_eq!(e["error"]["code"], "budget_too_small");
    assert!(e["error"]["message"].as_str().unwrap().contains(&min.to_string()), "{e}");
    assert_error(&post(a, "/les/budget", &json!({ "memory_budget": "12 parsecs" })), 400, "a bad size");
    assert_error(&post(a, "/les/budget", &json!({ "budget": 1 })), 400, "an unknown field");
    assert_error(&post(a, "/les/budget", &json!({ "memory_budget": -5 })), 400, "a negative size");
    assert_eq!(http(a, "GET", "/les/budget", None).json()["budget"].as_u64(), Some(min));
    // Back up (a size string), then down again as a request starts generating.
    let v = post(a, "/les/budget", &json!({ "memory_budget": "40MiB" })).json();
    assert_eq!(v["expert_slots"], b0["expert_slots"], "{v}");
    let busy = {
        let a = a.to_string();
        std::thread::spawn(move || post(&a, "/v1/completions", &json!({ "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0 })).json()["choices"][0]["text"].as_str().unwrap().to_string())
    };
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(post(a, "/les/budget", &json!({ "memory_budget": min })).status, 200);
    assert_eq!(busy.join().unwrap(), greedy(prompts[2], 40));
}

const VL_MODEL: &str = "rand-qwen35-vl.gguf";
const MMPROJ: &str = "rand-minicpmv-mmproj.gguf";

fn vision_file(name: &str) -> Vec<u8> {
    std::fs::read(root().join("tests/data/vision").join(name)).unwrap()
}

fn base64(b: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in b.chunks(3) {
        let n = c.iter().enumerate().fold(0u32, |n, (i, &x)| n | (x as u32) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= c.len() { A[(n >> (18 - 6 * i) & 63) as usize] as char } else { '=' });
        }
    }
    out
}

/// A PNG whose header claims 30000×30000 pixels (a decompression bomb's shape).
fn png_bomb() -> Vec<u8> {
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend(30000u32.to_be_bytes());
    ihdr.extend(30000u32.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    for c in [ihdr, b"IDAT\x78\x9c\x63\x00\x00\x00\x01\x00\x01".to_vec(), b"IEND".to_vec()] {
        v.extend((c.len() as u32 - 4).to_be_bytes());
        v.extend(&c);
        v.extend(crc32fast::hash(&c).to_be_bytes());
    }
    v
}

fn data_url(mime: &str, b: &[u8]) -> String {
    format!("data:{mime};base64,{}", base64(b))
}

/// A user message of an image part then a text part (as `les run --image F -p TEXT` lays it
/// out), after the earlier `history` messages.
fn image_request(history: &[Value], url: &str, text: &str, n: usize) -> Value {
    let mut messages = history.to_vec();
    messages.push(json!({ "role": "user", "content": [{ "type": "image_url", "image_url": { "url": url, "detail": "low" } }, { "type": "text", "text": text }] }));
    json!({ "messages": messages, "max_tokens": n, "temperature": 0 })
}

/// `les serve --mmproj`: the first 8 greedy tokens' text after `square_224.png` + "Describe" is
/// llama.cpp's (`tests/data/vision/refs.json`, the same run as `les run --mmproj … --image …
/// -p Describe -n 8 --temp 0`; its top-2 margins there are all above 0.2, so the portable
/// kernels agree); the next turn reuses the cache past the image; bad images are refused.
#[test]
fn serve_images() {
    let refs: Value = serde_json::from_slice(&vision_file("refs.json")).unwrap();
    let run = refs["runs"]["qwen35"].as_array().unwrap().iter().find(|r| r["name"] == "square_224").unwrap();
    let ids: Vec<u32> = run["generated"].as_array().unwrap()[..8].iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert!(run["rows"].as_array().unwrap()[..8].iter().all(|r| r["margin"].as_f64().unwrap() > 0.1));
    let s = Session::load(&FileSource::open(model(VL_MODEL)).unwrap(), ExpertMode::Resident, CTX).unwrap();
    let want = s.tokenizer.decode(&ids, false);
    // The image's last position (its `</image>` marker follows).
    let image_end = run["chunks"].as_array().unwrap().iter().filter(|c| c["type"] == "image").map(|c| c["pos_0"].as_u64().unwrap() + c["n_tokens"].as_u64().unwrap()).max().unwrap();

    let srv = start_with(VL_MODEL, &["--mmproj", model(MMPROJ).to_str().unwrap()]);
    let a = srv.addr.as_str();
    let m = http(a, "GET", "/v1/models", None).json();
    assert_eq!(m["models"][0]["capabilities"], json!(["completion", "multimodal"]));

    let png = data_url("image/png", &vision_file("square_224.png"));
    let r = post(a, "/v1/chat/completions", &image_request(&[], &png, "Describe", 8));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(content, want);
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), run["n_tokens_total"].as_u64(), "{v}");
    // Streamed: the same text (the same prompt again, from the cache).
    let mut sreq = image_request(&[], &png, "Describe", 8);
    sreq["stream"] = json!(true);
    let ev = post(a, "/v1/chat/completions", &sreq).events();
    let streamed: String = ev[..ev.len() - 1].iter().filter_map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"].as_str().map(String::from)).collect();
    assert_eq!(streamed, want);

    // The next turn: the same image again, so the cache is reused past it.
    let turn1 = image_request(&[], &png, "Describe", 8)["messages"][0].clone();
    let req2 = json!({ "messages": [turn1, { "role": "assistant", "content": content }, { "role": "user", "content": "More?" }], "max_tokens": 4, "temperature": 0 });
    let v2 = post(a, "/v1/chat/completions", &req2).json();
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > image_end && cached < v2["usage"]["prompt_tokens"].as_u64().unwrap(), "second turn reused {cached} tokens (the image ends at {image_end}): {v2}");
    assert_eq!(v2["les"]["prompt_reused"].as_u64(), Some(cached));
    // Another image in its place: only the text before it is shared.
    let jpg = data_url("image/jpeg", &vision_file("slice_400x240.jpg"));
    let v3 = post(a, "/v1/chat/completions", &image_request(&[], &jpg, "Describe", 2)).json();
    let cached = v3["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached < 5, "another image reused {cached} tokens: {v3}");
    // Text alone still works.
    assert_eq!(post(a, "/v1/chat/completions", &json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": 2 })).status, 200);

    // Refused: each a 400 on `messages` naming the problem.
    for (url, what, says) in [
        ("https://example.com/cat.png".to_string(), "a remote URL", "fetches nothing"),
        ("cat.png".to_string(), "a bare path", "data: URLs"),
        ("data:image/png;base64,iVBOR@@".to_string(), "bad base64", "base64"),
        ("data:image/png,iVBORw0KGgo=".to_string(), "not base64-encoded", "base64"),
        (data_url("image/gif", b"GIF89a"), "a GIF", "image/gif"),
        (data_url("image/png", &vision_file("bad_truncated.png")), "a truncated PNG", "decoded"),
        (data_url("image/jpeg", &vision_file("bad_garbage.jpg")), "a garbage JPEG", "image"),
        (data_url("image/png", &png_bomb()), "a 30000×30000 PNG", "at most"),
        (data_url("image/png", b""), "an empty image", "image"),
    ] {
        let e = assert_error(&post(a, "/v1/chat/completions", &image_request(&[], &url, "Describe", 2)), 400, what);
        assert_eq!((e["error"]["type"].as_str(), e["error"]["param"].as_str()), (Some("invalid_request_error"), Some("messages")), "{what}: {e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(says), "{what}: {e}");
    }
    let e = assert_error(&post(a, "/v1/chat/completions", &json!({ "messages": [{ "role": "user", "content": [{ "type": "image_url" }] }] })), 400, "no url");
    assert_eq!(e["error"]["param"], "messages");
    // The server still answers as before.
    let v = post(a, "/v1/chat/completions", &image_request(&[], &png, "Describe", 8)).json();
    assert_eq!(v["choices"][0]["message"]["content"].as_str(), Some(want.as_str()));
}
