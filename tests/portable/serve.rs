//! `les serve` end to end over TCP: the OpenAI-style endpoints answer what the engine computes
//! (greedy text equal to `Session::generate` on the same prompt), streamed and whole; a second
//! chat turn reuses the first's cache; bad requests (invalid JSON, an oversized body, a bad
//! parameter, a prompt longer than the context, an unknown path) get OpenAI-style JSON errors
//! with the right status; a client that disconnects mid-stream does not take the server down.
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
    // Portable kernels on both sides (see `engine_greedy`).
    les::quant::Simd::force(les::quant::Simd::Scalar);
    let mut child = Command::new(env!("CARGO_BIN_EXE_les"))
        .env("LES_NO_SIMD", "1")
        .args(["serve", "--model", model(MODEL).to_str().unwrap(), "--port", "0", "-c", &CTX.to_string(), "-t", "2"])
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

/// A 5 MiB body, written by another thread while the response is read (the server answers 413
/// without reading it all).
fn oversized(addr: &str) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let n = 5 << 20;
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
    let src = FileSource::open(model(MODEL)).unwrap();
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
    let ev = r.events();
    let streamed: String = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string()).collect();
    assert_eq!(streamed, want);

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
}
