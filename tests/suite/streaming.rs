//! Lossless streaming: logits are bit-identical (`==`) between the fully resident run and
//! streamed runs at budgets holding 10%, 30% and 60% of expert bytes, under every eviction
//! policy, with prefetch on and off, from the GGUF and from a packed bundle. Faults in expert
//! reads give a clear error or a successful retry, never a wrong token.

use crate::common::*;
use les::engine::stream::{open_streaming, StreamOptions};
use les::engine::Session;
use les::expert::store::GgufExpertStore;
use les::expert::stream::{Policy, StreamConfig, StreamingExperts};
use les::expert::GgufExpertTensors;
use les::gguf::GgufFile;
use les::model::{Config, ExpertMode, Logits};
use les::store::fault::{FaultySource, Rule};
use les::store::{ByteSource, FileSource};
use std::sync::Arc;

/// Logits after the prompt and after each continuation token (teacher forced).
fn logits_seq(s: &mut Session, prompt: &[u32], cont: &[u32]) -> Result<Vec<Vec<f32>>, String> {
    s.kv.clear();
    let mut out = vec![s.prefill(prompt).map_err(|e| e.to_string())?];
    for &t in cont {
        out.push(s.model.forward(&[t], &mut s.kv, Logits::Last).map_err(|e| e.to_string())?);
    }
    Ok(out)
}

fn reference(path: &std::path::Path, prompts: &[&str], n: usize) -> (Vec<(Vec<u32>, Vec<u32>)>, Vec<Vec<Vec<f32>>>) {
    let src = FileSource::open(path).unwrap();
    let mut s = Session::load(&src, ExpertMode::Resident, 256).unwrap();
    let mut seqs = Vec::new();
    let mut all = Vec::new();
    for p in prompts {
        let toks = s.tokenize(p);
        let (cont, _) = s.generate(&toks, n, &les::engine::sampling::SamplerConfig::greedy(), true, &mut |_, _| true).unwrap();
        all.push(logits_seq(&mut s, &toks, &cont).unwrap());
        seqs.push((toks, cont));
    }
    (seqs, all)
}

fn pack(model: &std::path::Path) -> std::path::PathBuf {
    pack_as(model, "")
}

/// [`pack`] to a file of its own (`tag`): tests run in parallel, and one test rewriting a bundle
/// another is reading gives the reader short reads.
fn pack_as(model: &std::path::Path, tag: &str) -> std::path::PathBuf {
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{}{tag}.les", model.file_stem().unwrap().to_string_lossy()));
    let src = FileSource::open(model).unwrap();
    let mut f = std::fs::File::create(&out).unwrap();
    les::expert::bundle::pack(&src, &mut f, &mut |_, _| {}).unwrap();
    out
}

fn lossless(model_file: &str, fractions: &[f64], policies: &[Policy], n: usize, with_bundle: bool) {
    let path = model(model_file);
    let prompts = ["The capital of France is", "def fibonacci(n):"];
    let (seqs, want) = reference(&path, &prompts, n);
    let g = GgufFile::read(&FileSource::open(&path).unwrap()).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    let total = c.n_layer * c.n_expert;
    let bundle = if with_bundle { Some(pack(&path)) } else { None };
    let mut runs = 0;
    for &frac in fractions {
        for &policy in policies {
            // Exact lookahead off and on where the model names its experts early (smallthinker).
            let exacts: &[bool] = if c.routes_early() { &[false, true] } else { &[true] };
            for (prefetch, &exact) in [false, true].into_iter().flat_map(|p| exacts.iter().map(move |e| (p, e))) {
                for store in [Some(path.clone()), bundle.clone()].into_iter().flatten() {
                    let slots = ((total as f64 * frac).round() as usize).max(c.n_expert_used + 1);
                    let opts = StreamOptions {
                        budget: 0,
                        n_ctx: 256,
                        direct: false,
                        profile: None,
                        cache: StreamConfig { policy, prefetch, depth: 2, io_threads: 3, exact, ..Default::default() },
                        slots: Some(slots),
                        gpu_pool: false,
                        dense: Default::default(),
                    };
                    let mut st = open_streaming(store.to_str().unwrap(), &opts).unwrap();
                    for (i, (p, cont)) in seqs.iter().enumerate() {
                        let got = logits_seq(&mut st.session, p, cont).unwrap();
                        for (r, (a, b)) in got.iter().zip(&want[i]).enumerate() {
                            assert!(a == b, "{model_file}: logits differ (prompt {i}, row {r}) at {:.0}% slots, {policy:?}, prefetch {prefetch}, exact {exact}, store {}", frac * 100.0, store.display());
                        }
                    }
                    let s = st.experts.stats();
                    if c.routes_early() && exact {
                        // Every routed expert was named before its layer ran.
                        assert!(s.exact_pred_routed > 0 && s.exact_pred_tp == s.exact_pred_routed, "{model_file}: exact lookahead named {} of {} routed experts", s.exact_pred_tp, s.exact_pred_routed);
                    } else {
                        assert_eq!(s.exact_pred_made, 0, "{model_file}: exact lookahead off, yet experts were named");
                    }
                    assert!(s.bytes_read > 0, "nothing was streamed");
                    if frac < 0.5 {
                        assert!(s.hit_rate() < 1.0, "a {:.0}% cache cannot hit every time", frac * 100.0);
                    }
                    runs += 1;
                }
            }
        }
    }
    eprintln!("{model_file}: {runs} streamed configurations bit-identical to resident");
}

const FRACTIONS: [f64; 3] = [0.1, 0.3, 0.6];
const POLICIES: [Policy; 3] = [Policy::Lru, Policy::Lfu, Policy::NextUse];

#[test]
fn lossless_rand_llama_moe() {
    lossless("rand-llama-moe.gguf", &FRACTIONS, &POLICIES, 8, true);
}

#[test]
fn lossless_rand_qwen2moe() {
    lossless("rand-qwen2moe.gguf", &FRACTIONS, &POLICIES, 8, true);
}

#[test]
fn lossless_rand_qwen3moe() {
    lossless("rand-qwen3moe.gguf", &FRACTIONS, &POLICIES, 8, true);
}

#[test]
fn lossless_rand_olmoe() {
    lossless("rand-olmoe.gguf", &FRACTIONS, &POLICIES, 8, true);
}

/// Gated DeltaNet hybrids: streamed experts leave the recurrent state's bits unchanged.
#[test]
fn lossless_rand_qwen35moe() {
    lossless("rand-qwen35moe.gguf", &FRACTIONS, &POLICIES, 8, true);
}

#[test]
fn lossless_rand_qwen3next() {
    lossless("rand-qwen3next.gguf", &FRACTIONS, &[Policy::NextUse], 8, true);
}

/// gpt-oss: biased MXFP4 experts (the biases stay with the dense weights, in the bundle too).
#[test]
fn lossless_rand_gpt_oss() {
    lossless("rand-gpt-oss.gguf", &FRACTIONS, &POLICIES, 8, true);
}

/// smallthinker: the router reads the layer's input before attention, so each layer's experts
/// are named before the layer runs and read while its attention computes (exact lookahead):
/// recall 100%, and the resident run's bits with it on and off.
#[test]
fn lossless_rand_smallthinker() {
    lossless("rand-smallthinker.gguf", &FRACTIONS, &POLICIES, 8, true);
}

/// lfm2moe: a dense first layer (the expert source numbers the five MoE layers only), a
/// router with a selection bias, and short-convolution states beside the streamed experts.
#[test]
fn lossless_rand_lfm2moe() {
    lossless("rand-lfm2moe.gguf", &FRACTIONS, &POLICIES, 8, true);
}

/// Prefetches (every lookahead stage: first, refinement, second) read in 4 KiB chunks from a slow modelled device: they pause for demand reads and
/// are cancelled mid-read when stale, and the logits still equal the resident run's.
#[test]
fn lossless_chunked_prefetch_on_a_slow_device() {
    let path = model("rand-qwen3moe.gguf");
    let prompts = ["The capital of France is", "def fibonacci(n):"];
    let (seqs, want) = reference(&path, &prompts, 6);
    let g = GgufFile::read(&FileSource::open(&path).unwrap()).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    let profile = les::store::throttle::DeviceProfile { name: "test-slow", bandwidth: 400e6, latency: 20e-6, queue_depth: 4 };
    for policy in [Policy::Lru, Policy::NextUse] {
        let opts = StreamOptions {
            budget: 0,
            n_ctx: 256,
            direct: false,
            profile: Some(profile),
            cache: StreamConfig { policy, prefetch: true, depth: 2, extra: 2, io_threads: 3, prefetch_chunk: 4096, residual_stage: true, refine: true, ..Default::default() },
            slots: Some(c.n_layer * c.n_expert * 3 / 10),
            gpu_pool: false,
            dense: Default::default(),
        };
        let mut st = open_streaming(path.to_str().unwrap(), &opts).unwrap();
        for (i, (p, cont)) in seqs.iter().enumerate() {
            let got = logits_seq(&mut st.session, p, cont).unwrap();
            for (r, (a, b)) in got.iter().zip(&want[i]).enumerate() {
                assert!(a == b, "logits differ (prompt {i}, row {r}) with chunked prefetch, {policy:?}");
            }
        }
        let s = st.experts.stats();
        assert!(s.prefetch_loads + s.prefetch_cancelled + s.prefetch_yields > 0, "no prefetch was issued");
        assert!(s.refine_pred_made > 0, "the refinement stage never fired");
        // Every expert is larger than one chunk: a prefetch takes several reads.
        let loads = s.demand_loads + s.prefetch_loads;
        assert!(s.reads > loads * 3, "prefetches were not chunked: {} reads for {loads} loads", s.reads);
        eprintln!("{policy:?}: {} prefetches, {} yields, {} cancelled, hit rate {:.1}%", s.prefetch_loads, s.prefetch_yields, s.prefetch_cancelled, 100.0 * s.hit_rate());
    }
}

/// The real-weights MoE (1.6 GB): by default at 10% and 30% of expert slots under the default
/// policy (next use), prefetch on and off, from the GGUF and the bundle (8 configurations);
/// `LES_FULL_TESTS=1` (`tools/test_full.sh`) runs every fraction × policy (36), as the random
/// fixtures above always do.
#[test]
fn lossless_smolmoe_32x2() {
    if full_tests() {
        lossless("smolmoe-32x2.gguf", &FRACTIONS, &POLICIES, 4, true);
    } else {
        lossless("smolmoe-32x2.gguf", &FRACTIONS[..2], &[Policy::NextUse], 4, true);
    }
}

/// A model whose experts come through a fault-injecting source.
fn faulty_session(path: &std::path::Path, rule: Rule, slots: usize) -> (Session, Arc<StreamingExperts>) {
    let file = FileSource::open(path).unwrap();
    let g = GgufFile::read(&file).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    let tensors: Vec<_> = (0..c.n_layer).map(|il| GgufExpertTensors::find(&g, il, c.n_embd, c.n_expert).unwrap()).collect();
    // Fault the first expert of layer 1's gate tensor.
    let faulty = FaultySource::new(FileSource::open(path).unwrap(), 1);
    faulty.add(rule);
    let src: Arc<dyn ByteSource> = Arc::new(faulty);
    let routers = (0..c.n_layer).map(|il| les::engine::stream::tensor_f32(&g, &file, &format!("blk.{il}.ffn_gate_inp.weight")).unwrap()).collect();
    let store = Arc::new(GgufExpertStore::new(src, tensors, c.n_expert));
    let ex = Arc::new(StreamingExperts::new(store, routers, c.n_expert, c.n_expert_used, StreamConfig { slots, ..Default::default() }));
    let s = Session::load(&file, ExpertMode::External(ex.clone()), 256).unwrap();
    (s, ex)
}

#[test]
fn faults_give_errors_or_retries_never_wrong_tokens() {
    let path = model("rand-llama-moe.gguf");
    let prompts = ["The capital of France is"];
    let (seqs, want) = reference(&path, &prompts, 6);
    let g = GgufFile::read(&FileSource::open(&path).unwrap()).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    let (p, cont) = &seqs[0];
    // Every expert of every layer: the first bytes of each expert's gate matrix.
    let t: Vec<_> = (0..c.n_layer).map(|il| GgufExpertTensors::find(&g, il, c.n_embd, c.n_expert).unwrap()).collect();
    let all_gate = (t[0].gate_off, t[c.n_layer - 1].down_off + (c.n_expert * t[c.n_layer - 1].layout.down_bytes) as u64);

    // A transient error (the first read of any expert fails, later ones succeed): retried, same
    // logits. One fault only: a load is retried once, so two faults can land on one expert (a
    // prefetch that failed and then its demand read) and make that load fail for good.
    let (mut s, ex) = faulty_session(&path, Rule::fail_range(all_gate.0, all_gate.1, 1), 6);
    let got = logits_seq(&mut s, p, cont).unwrap();
    assert!(got == want[0], "retried reads must give the resident logits");
    assert!(ex.stats().load_failures >= 1);

    // A permanent I/O error: a clear error, no panic, no logits.
    let (mut s, _) = faulty_session(&path, Rule::error_on_range(all_gate.0, all_gate.1), 6);
    let e = logits_seq(&mut s, p, cont).unwrap_err();
    assert!(e.contains("load failed"), "unexpected error text: {e}");

    // Short reads: same.
    let (mut s, _) = faulty_session(&path, Rule::short_on_range(all_gate.0, all_gate.1), 6);
    assert!(logits_seq(&mut s, p, cont).is_err());
}

#[test]
fn bundle_checksum_mismatch_is_an_error_not_a_wrong_token() {
    let path = model("rand-llama-moe.gguf");
    let b = pack_as(&path, "-checksum");
    let bad = b.with_extension("bad.les");
    let mut bytes = std::fs::read(&b).unwrap();
    // Corrupt one byte in the middle of the expert section of the first layer.
    let bundle = les::expert::bundle::Bundle::open(Arc::new(FileSource::open(&b).unwrap())).unwrap();
    let blk = bundle.block(0, 0).unwrap().clone();
    for e in 0..bundle.n_expert() {
        let blk = bundle.block(0, e).unwrap();
        bytes[(blk.offset + blk.size / 2) as usize] ^= 0x40;
    }
    let _ = blk;
    std::fs::write(&bad, &bytes).unwrap();
    let opts = StreamOptions { budget: 0, n_ctx: 256, direct: false, profile: None, cache: StreamConfig::default(), slots: Some(4), gpu_pool: false, dense: Default::default() };
    let mut st = open_streaming(bad.to_str().unwrap(), &opts).unwrap();
    let toks = st.session.tokenize("Hello");
    let r = logits_seq(&mut st.session, &toks, &[]);
    assert!(r.is_err(), "a corrupted expert must not produce logits");
    assert!(r.unwrap_err().contains("checksum"));
    // A truncated bundle is refused at open.
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    assert!(open_streaming(bad.to_str().unwrap(), &opts).is_err());
}

#[test]
fn budget_below_minimum_is_refused_with_the_minimum() {
    let path = model("rand-llama-moe.gguf");
    let opts = StreamOptions { budget: 1 << 20, n_ctx: 256, direct: false, profile: None, cache: StreamConfig::default(), slots: None, gpu_pool: false, dense: Default::default() };
    let e = open_streaming(path.to_str().unwrap(), &opts).err().expect("1 MiB cannot hold the dense weights");
    assert!(e.to_string().contains("minimum"), "{e}");
}

/// Streaming options at `budget` with dense matrices read in small pieces (8 KiB, a 32 KiB
/// read-ahead window) when the budget cannot hold them.
fn small_dense_pieces(budget: u64) -> StreamOptions {
    StreamOptions {
        budget,
        n_ctx: 256,
        direct: false,
        profile: None,
        cache: StreamConfig { prefetch: true, io_threads: 2, ..Default::default() },
        slots: None,
        gpu_pool: false,
        dense: les::engine::stream::DenseOptions { stream: true, piece: 8 << 10, window: 32 << 10 },
    }
}

/// Below the dense weights the plan reads matrices from storage at each use (an untied
/// `token_embd` row by row, then the largest: the output matrix, attention, dense FFNs) through
/// the read-ahead, in small pieces here; logits equal the resident run's bits, from the GGUF and
/// the bundle. At the minimum the refusal names, the model runs; the GPU backend refuses it.
#[test]
fn dense_weights_read_from_storage_are_lossless() {
    use les::engine::stream::{BudgetError, OpenError};
    for (file, bundle) in [("rand-gpt-oss.gguf", true), ("rand-qwen35moe.gguf", false), ("rand-qwen2moe.gguf", false)] {
        let path = model(file);
        let (seqs, want) = reference(&path, &["The capital of France is", "def fibonacci(n):"], 6);
        let opts = small_dense_pieces;
        let stores = [Some(path.clone()), bundle.then(|| pack_as(&path, "-dense"))];
        for store in stores.iter().flatten() {
            let resident_min = open_streaming(store.to_str().unwrap(), &opts(u64::MAX / 2)).unwrap().plan.minimum;
            let least = match open_streaming(store.to_str().unwrap(), &opts(1 << 20)) {
                Err(OpenError::Budget(BudgetError::TooSmall { minimum, .. })) => minimum,
                Err(e) => panic!("{file}: {e}"),
                Ok(_) => panic!("{file}: 1 MiB cannot hold the KV cache and scratch"),
            };
            assert!(least < resident_min, "{file}: streaming dense weights lowers the minimum ({least} vs {resident_min})");
            for budget in [resident_min - 1, least] {
                let mut st = open_streaming(store.to_str().unwrap(), &opts(budget)).unwrap();
                assert!(st.plan.dense_streamed > 0 && st.plan.dense + st.plan.kv + st.plan.scratch <= budget, "{file}: {:?}", st.plan);
                assert_eq!(st.session.model.weights.streamed_bytes(), st.plan.dense_streamed, "{file}: the loader streams what the plan counted");
                for (i, (p, cont)) in seqs.iter().enumerate() {
                    let got = logits_seq(&mut st.session, p, cont).unwrap();
                    for (r, (a, b)) in got.iter().zip(&want[i]).enumerate() {
                        assert!(a == b, "{file}: logits differ (prompt {i}, row {r}) with {} dense bytes read from {}", st.plan.dense_streamed, store.display());
                    }
                }
                let ra = st.session.model.weights.read_ahead().expect("a read-ahead");
                // Just below the resident minimum an untied token_embd goes first (rows only,
                // no cycle); at the least budget every candidate streams.
                assert!(ra.n_pieces() > 0 || budget != least, "{file}: at the minimum matrices are read whole");
                if ra.n_pieces() > 0 {
                    let s = ra.stats();
                    eprintln!("{file} at {budget}: {} B streamed, {s:?}", st.plan.dense_streamed);
                    assert!(s.gets > 0 && s.misses < s.gets, "{file}: the read-ahead read ahead: {s:?}");
                    assert!(s.peak_bytes <= (32 << 10) + (8 << 10) * 2, "{file}: window kept: {s:?}");
                }
                let line = st.session.set_backend(les::backend::BackendKind::Auto, &Default::default()).unwrap();
                assert!(line.contains("cpu"), "{line}");
                let e = st.session.set_backend(les::backend::BackendKind::Wgpu, &Default::default()).unwrap_err().to_string();
                assert!(e.contains("storage") || e.contains("no GPU adapter"), "{e}");
            }
        }
    }
}

/// `les bench ladder` (issue 37, item 4): every rung reports what a user waits — time to first
/// token and the inter-token latency's p50 ≤ p95 ≤ p99 ≤ longest, one gap per output token after
/// each prompt's first — and the stats JSON carries what reproduces the run: the model's SHA-256
/// (checked against coreutils' `sha256sum`), the commit, the command and the prompts.
#[test]
fn ladder_reports_waits_and_artifacts() {
    let m = model("rand-qwen35moe.gguf");
    let m = m.to_str().unwrap();
    let (rep, stdout) = ladder(m, &["-n", "6", "--n-prompts", "2"]);
    assert!(stdout.contains("TTFT p50"), "no waits table");
    let rungs = rep["rungs"].as_array().unwrap();
    assert!(rungs.len() >= 5, "{rep}");
    for r in rungs {
        let l = &r["latency"];
        let f = |k: &str| l[k].as_f64().unwrap_or_else(|| panic!("{}: no {k} in {l}", r["name"]));
        assert!(f("ttft_p50_ms") > 0.0, "{}", r["name"]);
        assert!(f("itl_p50_ms") <= f("itl_p95_ms") && f("itl_p95_ms") <= f("itl_p99_ms") && f("itl_p99_ms") <= f("longest_ms"), "{}: {l}", r["name"]);
        let tokens = r["tokens"].as_u64().unwrap();
        assert_eq!(l["gaps"].as_u64().unwrap(), tokens - 2, "{}: a gap per token after each prompt's first", r["name"]);
    }
    let a = &rep["artifacts"];
    let sum = std::process::Command::new("sha256sum").arg(m).output().unwrap();
    let want = String::from_utf8_lossy(&sum.stdout).split_whitespace().next().unwrap().to_string();
    assert_eq!(a["model_sha256"].as_str().unwrap(), want);
    assert!(!a["commit"].as_str().unwrap().is_empty() && a["command"].as_str().unwrap().contains("bench ladder"));
    let prompts: Vec<String> = std::fs::read_to_string(root().join("tests/fixtures/prompts.txt")).unwrap().lines().filter(|l| !l.trim().is_empty()).take(2).map(String::from).collect();
    assert_eq!(a["prompts"].as_str().unwrap(), prompts.join("\n"));
}

/// `les bench ladder` on `m` (packed into a bundle first) at 40 MiB with `args`: its stats JSON and
/// its standard output.
fn ladder(m: &str, args: &[&str]) -> (serde_json::Value, String) {
    let dir = std::env::temp_dir().join(format!("les-ladder-{}-{}", std::process::id(), args.join("")));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, bundle) = (dir.join("ladder.json"), dir.join("b.les"));
    let les = || std::process::Command::new(env!("CARGO_BIN_EXE_les"));
    assert!(les().args(["pack", m, bundle.to_str().unwrap()]).status().unwrap().success());
    let o = les()
        .current_dir(root())
        .args(["bench", "ladder", "-m", m, "--bundle", bundle.to_str().unwrap(), "--memory-budget", "40MiB", "--stats-json", json.to_str().unwrap()])
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rep = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(dir);
    (rep, String::from_utf8_lossy(&o.stdout).into_owned())
}

/// `les bench ladder --mtp` (issue 37 item 4): the + speculative rung drafts with the model's own
/// MTP block, read from the bundle (its weights and cache taken from the budget), and reports
/// its acceptance and the experts it loads per output token.
#[test]
fn ladder_mtp_rung_drafts_with_the_models_block() {
    let m = model("rand-qwen35moe-mtp.gguf");
    let (rep, _) = ladder(m.to_str().unwrap(), &["--mtp", "--no-resident", "-n", "4", "--n-prompts", "1"]);
    assert!(rep["spec_note"].as_str().unwrap().contains("MTP (γ 3), its weights + KV"), "{}", rep["spec_note"]);
    let spec = rep["rungs"].as_array().unwrap().iter().find(|r| r["name"] == "+ speculative").unwrap();
    assert!(spec["acceptance_rate"].is_number() && spec["experts_per_token"].as_f64().unwrap() > 0.0, "{spec}");
}

/// `les bench ladder --alone` (issue 37 item 4): each rung is on-demand plus one thing — only
/// `+ lookahead` prefetches, and `+ speculative` runs on the model's own file — and a device
/// profile serves every rung from in-memory copies of the model and the bundle. A second
/// layout (`--coactivation-bundle`, here the GGUF itself) runs as its own rung after the bundle,
/// with its reads per token.
#[test]
fn ladder_alone_adds_one_thing_to_on_demand() {
    let m = model("rand-qwen35moe-mtp.gguf");
    let m = m.to_str().unwrap();
    let (rep, stdout) = ladder(m, &["--alone", "--mtp", "--no-resident", "--store", "phone-4GBps", "--coactivation-bundle", m, "-n", "4", "--n-prompts", "1"]);
    assert_eq!(rep["stacking"], "alone");
    assert!(stdout.starts_with("ladder (alone)"), "{stdout}");
    let file = std::fs::metadata(m).unwrap().len();
    let copied = rep["memory_copy_bytes"].as_u64().unwrap();
    assert!(copied > file, "model and bundle copied: {copied} bytes for a {file}-byte model");
    let names: Vec<&str> = rep["rungs"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["on-demand", "+ lookahead", "+ next-use eviction", "+ bundle", "+ co-activation order", "+ speculative"]);
    for r in rep["rungs"].as_array().unwrap() {
        assert!(r["reads_per_token"].as_f64().unwrap() > 0.0 && r["merged_share"].is_number(), "{r}");
    }
    for r in rep["rungs"].as_array().unwrap() {
        assert_eq!(r["prefetch_on"].is_number(), r["name"] == "+ lookahead", "{}: {}", r["name"], r["prefetch_on"]);
    }
    assert!(rep["spec_note"].as_str().unwrap().ends_with(&format!("on {m}")) || rep["spec_note"].as_str().unwrap().contains(&format!("on {m};")), "{}", rep["spec_note"]);
}

/// A budget below the dense weights while the model runs (issue 39 item 2): the budget re-plans
/// which dense matrices are read from storage (as at load), the session frees them before its
/// next forward, a higher budget holds them again, and only a budget below the minimum with
/// every candidate streamed is refused. The logits stay the resident run's bits throughout, in
/// the same conversation (KV cache, recurrent state kept).
#[test]
fn dense_weights_replanned_while_running_are_lossless() {
    use les::engine::stream::BudgetError;
    for file in ["rand-qwen35moe.gguf", "rand-gpt-oss.gguf"] {
        let path = model(file);
        let (seqs, want) = reference(&path, &["The capital of France is"], 18);
        let (p, cont) = &seqs[0];
        let opts = small_dense_pieces;
        let resident_min = open_streaming(path.to_str().unwrap(), &opts(u64::MAX / 2)).unwrap().plan.minimum;
        let full = resident_min + resident_min / 4;
        let mut st = open_streaming(path.to_str().unwrap(), &opts(full)).unwrap();
        assert_eq!(st.plan.dense_streamed, 0, "{file}: {full} bytes hold the dense weights");
        let least = st.budget.minimum();
        assert!(least < resident_min, "{file}: streaming lowers the minimum ({least} vs {resident_min})");
        let held0 = st.session.model.dense_bytes as u64;
        let s = &mut st.session;
        s.kv.clear();
        let mut got = vec![s.prefill(p).unwrap()];
        let mut streamed_least = 0;
        for (i, &t) in cont.iter().enumerate() {
            let change = match i {
                4 => Some(least),
                8 => Some(resident_min - 1),
                12 => Some(full),
                _ => None,
            };
            if let Some(b) = change {
                let plan = st.budget.set(b).unwrap();
                assert!(plan.dense + plan.kv + plan.scratch + plan.slots as u64 * plan.expert_bytes_max <= b, "{file}: {plan:?}");
                match i {
                    4 => {
                        assert!(plan.dense_streamed > 0, "{file}: {plan:?}");
                        streamed_least = plan.dense_streamed;
                        match st.budget.set(least - 1) {
                            Err(BudgetError::TooSmall { minimum, .. }) => assert_eq!(minimum, least),
                            r => panic!("{file}: below the least minimum must be refused: {:?}", r.map(|p| p.slots)),
                        }
                    }
                    8 => assert!(plan.dense_streamed > 0 && plan.dense_streamed < streamed_least, "{file}: {plan:?} (at the least: {streamed_least})"),
                    _ => assert_eq!(plan.dense_streamed, 0, "{file}: {plan:?}"),
                }
                // The session applies the plan before its next forward.
                s.apply_budget().unwrap();
                assert_eq!(s.model.weights.streamed_bytes(), plan.dense_streamed, "{file}, token {i}");
                assert_eq!(s.model.dense_bytes as u64, held0 - plan.dense_streamed, "{file}, token {i}");
            }
            got.push(s.forward(&[t], Logits::Last).unwrap());
        }
        assert!(got == want[0], "{file}: logits changed with the dense weights re-planned");
        let ra = s.model.weights.read_ahead();
        assert!(ra.is_none(), "{file}: every matrix held again, no read-ahead left");
    }
}

/// The budget lowered and raised while the model runs (issue 39 item 2), between tokens and
/// from another thread in the middle of forwards: the logits stay the resident run's bits (the
/// hybrid's recurrent state and the KV cache are untouched), the cache's buffers follow the
/// budget, and a budget below the minimum is refused without changing anything.
#[test]
fn budget_changes_while_running_are_lossless() {
    let path = model("rand-qwen35moe.gguf");
    let (seqs, want) = reference(&path, &["The capital of France is"], 24);
    let (p, cont) = &seqs[0];
    let g = GgufFile::read(&FileSource::open(&path).unwrap()).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    let open = |prefetch: bool| {
        let cache = StreamConfig { prefetch, depth: 2, io_threads: 3, ..Default::default() };
        let opts = StreamOptions { budget: 0, n_ctx: 256, direct: false, profile: None, cache, slots: Some(c.n_layer * c.n_expert * 6 / 10), gpu_pool: false, dense: Default::default() };
        open_streaming(path.to_str().unwrap(), &opts).unwrap()
    };
    for prefetch in [false, true] {
        // Between tokens: 60% of the experts → the minimum → back → one slot above the minimum.
        let mut st = open(prefetch);
        let (full, min, slot) = (st.budget.budget(), st.budget.minimum(), st.plan.expert_bytes_max);
        let s = &mut st.session;
        s.kv.clear();
        let mut got = vec![s.prefill(p).unwrap()];
        for (i, &t) in cont.iter().enumerate() {
            let change = match i {
                6 => Some(min),
                12 => Some(full),
                18 => Some(min + slot),
                _ => None,
            };
            if let Some(b) = change {
                let plan = st.budget.set(b).unwrap();
                assert_eq!(plan.slots, st.experts.slots());
                assert_eq!(plan.slots as u64, (b - plan.dense - plan.kv - plan.scratch) / slot);
                if i == 6 {
                    assert_eq!(plan.slots, c.n_expert_used + 1, "the minimum holds one layer's top-k + 1");
                    // Below the minimum: refused, nothing changes.
                    match st.budget.set(min - 1) {
                        Err(les::engine::stream::BudgetError::TooSmall { minimum, .. }) => assert_eq!(minimum, min),
                        r => panic!("a budget below the minimum must be refused: {:?}", r.map(|p| p.slots)),
                    }
                    assert_eq!(st.experts.slots(), plan.slots);
                }
            }
            got.push(s.model.forward(&[t], &mut s.kv, Logits::Last).unwrap());
            // Freed buffers leave (slots read into when the budget fell retire when done).
            let bound = st.experts.slots() as u64 * slot;
            let t0 = std::time::Instant::now();
            while st.experts.held_bytes() > bound && t0.elapsed().as_secs() < 5 {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            assert!(st.experts.held_bytes() <= bound, "token {i}: {} bytes held by {} slots of {slot}", st.experts.held_bytes(), st.experts.slots());
        }
        assert!(got == want[0], "prefetch {prefetch}: logits changed with the budget");
        let stats = st.experts.stats();
        assert_eq!(stats.slot_changes, 3);
        assert!(stats.slot_bytes_freed >= (c.n_layer * c.n_expert * 6 / 10 - c.n_expert_used - 1) as u64 * slot / 2, "{stats:?}");

        // From another thread, during forwards: the budget swings between the minimum and 60%.
        let mut st = open(prefetch);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ctl = st.budget.clone();
        let swing = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    ctl.set(if n % 2 == 0 { min } else { full }).unwrap();
                    n += 1;
                    std::thread::sleep(std::time::Duration::from_micros(300));
                }
                n
            })
        };
        let got = logits_seq(&mut st.session, p, cont).unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let swings = swing.join().unwrap();
        assert!(swings >= 2, "the budget changed {swings} times");
        assert!(got == want[0], "prefetch {prefetch}: logits changed while the budget swung {swings} times");
    }
}

/// `--adapt-budget`'s watchdog: free memory falling below the low mark shrinks the budget
/// toward the minimum, free memory coming back grows it to the user's budget, never beyond.
#[test]
fn watchdog_follows_free_memory() {
    use les::engine::pressure::{AdaptRule, Watchdog};
    use std::sync::atomic::{AtomicU64, Ordering};
    let path = model("rand-llama-moe.gguf");
    let g = GgufFile::read(&FileSource::open(&path).unwrap()).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    let opts = StreamOptions { budget: 0, n_ctx: 256, direct: false, profile: None, cache: StreamConfig::default(), slots: Some(c.n_layer * c.n_expert / 2), gpu_pool: false, dense: Default::default() };
    let st = open_streaming(path.to_str().unwrap(), &opts).unwrap();
    let (full, min) = (st.budget.budget(), st.budget.minimum());
    let rule = AdaptRule { target: full, minimum: min, low: 1 << 20, high: 8 << 20 };
    let free = Arc::new(AtomicU64::new(4 << 20));
    let f = free.clone();
    let _w = Watchdog::spawn(st.budget.clone(), rule, std::time::Duration::from_millis(2), move || Some(f.load(Ordering::Relaxed)), |_, _, _| {}).unwrap();
    let wait_for = |want: u64| {
        let t0 = std::time::Instant::now();
        while st.budget.budget() != want && t0.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert_eq!(st.budget.budget(), want);
    };
    // Between the marks: unchanged.
    std::thread::sleep(std::time::Duration::from_millis(30));
    assert_eq!(st.budget.budget(), full);
    // Nothing free: down to the minimum (repeated steps of 2 MiB), slots top-k + 1.
    free.store(0, Ordering::Relaxed);
    wait_for(min);
    assert_eq!(st.experts.slots(), c.n_expert_used + 1);
    // Plenty free: back to the user's budget, no further.
    free.store(1 << 40, Ordering::Relaxed);
    wait_for(full);
    std::thread::sleep(std::time::Duration::from_millis(30));
    assert_eq!((st.budget.budget(), st.experts.slots()), (full, c.n_layer * c.n_expert / 2));
}

/// A bundle packed by co-activation (issue 39 item 3): each layer's blocks in the order
/// `coactivation_order` gives from a routing trace of other text; streamed from it, the logits
/// are the resident run's bits, and experts routed together come in merged reads.
#[test]
fn coactivation_packed_bundle_is_lossless_and_merges_reads() {
    use les::expert::coactivation::coactivation_order;
    let path = model("rand-qwen3moe.gguf");
    let (seqs, want) = reference(&path, &["The capital of France is", "def fibonacci(n):"], 12);
    let g = GgufFile::read(&FileSource::open(&path).unwrap()).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    // A routing trace of other text.
    let all = StreamOptions { budget: 0, n_ctx: 256, direct: false, profile: None, cache: StreamConfig::default(), slots: Some(usize::MAX), gpu_pool: false, dense: Default::default() };
    let mut st = open_streaming(path.to_str().unwrap(), &all).unwrap();
    let toks = st.session.tokenize("Once upon a time there was a lighthouse");
    st.session.generate(&toks, 24, &les::engine::sampling::SamplerConfig::greedy(), true, &mut |_, _| true).unwrap();
    let order = coactivation_order(&[st.experts.take_route_log()], c.n_layer, c.n_expert);
    assert!(order.iter().any(|o| o.iter().enumerate().any(|(i, &e)| i != e)), "the trace leaves every layer in index order");
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rand-qwen3moe-coact.les");
    let mut f = std::fs::File::create(&out).unwrap();
    les::expert::bundle::pack_ordered(&FileSource::open(&path).unwrap(), "", &[], &order, &mut f, &mut |_, _| {}).unwrap();
    drop(f);
    // The blocks lie in that order.
    let b = les::expert::bundle::Bundle::open(Arc::new(FileSource::open(&out).unwrap())).unwrap();
    for (il, o) in order.iter().enumerate() {
        assert!(o.windows(2).all(|w| b.block(il, w[0]).unwrap().offset < b.block(il, w[1]).unwrap().offset), "layer {il}");
    }
    let mut merged = 0;
    for prefetch in [false, true] {
        let cache = StreamConfig { prefetch, io_threads: 3, ..Default::default() };
        let opts = StreamOptions { slots: Some(c.n_expert_used * 3), cache, ..all.clone() };
        let mut st = open_streaming(out.to_str().unwrap(), &opts).unwrap();
        for (i, (p, cont)) in seqs.iter().enumerate() {
            let got = logits_seq(&mut st.session, p, cont).unwrap();
            assert!(got == want[i], "prefetch {prefetch}: logits differ (prompt {i})");
        }
        let s = st.experts.stats();
        merged += s.merged_loads;
        assert!(s.reads + s.merged_loads >= s.demand_loads + s.prefetch_loads, "{s:?}");
    }
    assert!(merged > 0, "no expert came in a merged read");
}

/// This test binary's allocator: allocations of exactly `FAIL_SIZE` bytes (an expert slot's
/// buffer) fail while `MAX_LIVE` of them are live — a heap that cannot grow (the browser's
/// wasm memory at its limit). Off (`FAIL_SIZE` 0) except in the child process of
/// `out_of_memory_shrinks_the_cache_instead_of_aborting` and `out_of_memory_at_load_is_an_error`.
mod limited_alloc {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    pub static FAIL_SIZE: AtomicUsize = AtomicUsize::new(0);
    pub static MAX_LIVE: AtomicUsize = AtomicUsize::new(usize::MAX);
    pub static LIVE: AtomicUsize = AtomicUsize::new(0);
    pub static REFUSED: AtomicUsize = AtomicUsize::new(0);
    /// A heap limit: bytes live at most (all sizes).
    pub static CAP_BYTES: AtomicUsize = AtomicUsize::new(usize::MAX);
    pub static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
    pub struct Limited;
    // SAFETY: forwards to the system allocator; only refuses some requests (returns null).
    unsafe impl GlobalAlloc for Limited {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            let live = LIVE_BYTES.fetch_add(l.size(), Relaxed);
            if live + l.size() > CAP_BYTES.load(Relaxed) {
                LIVE_BYTES.fetch_sub(l.size(), Relaxed);
                REFUSED.fetch_add(1, Relaxed);
                return std::ptr::null_mut();
            }
            if l.size() != 0 && l.size() == FAIL_SIZE.load(Relaxed) {
                if LIVE.fetch_add(1, Relaxed) >= MAX_LIVE.load(Relaxed) {
                    LIVE.fetch_sub(1, Relaxed);
                    LIVE_BYTES.fetch_sub(l.size(), Relaxed);
                    REFUSED.fetch_add(1, Relaxed);
                    return std::ptr::null_mut();
                }
            }
            unsafe { System.alloc(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            LIVE_BYTES.fetch_sub(l.size(), Relaxed);
            if l.size() != 0 && l.size() == FAIL_SIZE.load(Relaxed) {
                let _ = LIVE.fetch_update(Relaxed, Relaxed, |v| v.checked_sub(1));
            }
            unsafe { System.dealloc(p, l) }
        }
    }
    /// The limited allocator serves the whole test binary, so a test that limits it runs in a
    /// process of its own: false in the parent, which re-runs `test` in a child (and checks it
    /// passed); true in the child.
    pub fn in_own_process(test: &str) -> bool {
        if std::env::var_os("LES_TEST_OOM").is_some() {
            return true;
        }
        crate::common::rerun_with_env(module_path!().trim_end_matches("::limited_alloc"), test, &[("LES_TEST_OOM", "1")]);
        false
    }
    /// Wrapped as the wasm build and `les` wrap theirs: a refused allocation gives back the
    /// reserve and is tried again.
    #[global_allocator]
    static ALLOC: les::engine::reserve::Reserve<Limited> = les::engine::reserve::Reserve(Limited);
}

/// An allocation the heap refuses in the middle of a forward (issue 39 item 2: activations at a
/// heap's limit, which would abort): the allocator gives back its reserve and the forward goes
/// on; before the next forward the session lowers its budget by an eighth and takes a new
/// reserve. The logits stay the resident run's bits.
#[test]
fn a_refused_allocation_lowers_the_budget_instead_of_aborting() {
    use les::engine::reserve;
    use limited_alloc::*;
    use std::sync::atomic::Ordering::Relaxed;
    if !in_own_process("a_refused_allocation_lowers_the_budget_instead_of_aborting") {
        return;
    }
    let path = model("rand-qwen3moe.gguf");
    let (seqs, want) = reference(&path, &["The capital of France is"], 12);
    let (p, cont) = &seqs[0];
    let opts = |budget: u64| StreamOptions { budget, n_ctx: 256, direct: false, profile: None, cache: StreamConfig { prefetch: true, ..Default::default() }, slots: None, gpu_pool: false, dense: Default::default() };
    let probe = open_streaming(path.to_str().unwrap(), &opts(u64::MAX / 2)).unwrap();
    let budget = probe.budget.minimum() + 48 * probe.plan.expert_bytes_max;
    drop(probe);
    let mut st = open_streaming(path.to_str().unwrap(), &opts(budget)).unwrap();
    let held = reserve::reserve_bytes();
    assert!(held >= 1 << 20, "a session under a budget holds a reserve");
    let releases0 = reserve::releases();
    let s = &mut st.session;
    s.kv.clear();
    let mut got = vec![s.prefill(p).unwrap()];
    for (i, &t) in cont.iter().enumerate() {
        match i {
            // The heap's limit: what is live now plus 64 KiB.
            3 => CAP_BYTES.store(LIVE_BYTES.load(Relaxed) + (64 << 10), Relaxed),
            9 => CAP_BYTES.store(usize::MAX, Relaxed),
            _ => {}
        }
        got.push(s.forward(&[t], Logits::Last).unwrap());
    }
    let released = reserve::releases() - releases0;
    eprintln!("refused {} allocations, {released} reserve releases, budget {budget} -> {}", REFUSED.load(Relaxed), st.budget.budget());
    assert!(released > 0, "the reserve was given back");
    assert!(st.budget.budget() < budget, "the budget was lowered");
    assert!(got == want[0], "logits changed after a refused allocation");
    // A new reserve is taken once memory is back.
    s.forward(&[cont[0]], Logits::Last).unwrap();
    assert!(reserve::reserve_bytes() > 0);
}

/// Expert buffers that cannot be allocated (issue 39 item 2: failed allocations shrink, never
/// abort): the cache gives back slots and goes on, with the resident run's logits; when even the
/// fewest slots cannot be had, the forward fails with an error, not an abort.
#[test]
fn out_of_memory_shrinks_the_cache_instead_of_aborting() {
    use limited_alloc::*;
    use std::sync::atomic::Ordering::Relaxed;
    if !in_own_process("out_of_memory_shrinks_the_cache_instead_of_aborting") {
        return;
    }
    let path = model("rand-qwen3moe.gguf");
    let (seqs, want) = reference(&path, &["The capital of France is"], 12);
    let (p, cont) = &seqs[0];
    let open = || {
        let opts = StreamOptions { budget: 0, n_ctx: 256, direct: false, profile: None, cache: StreamConfig { prefetch: false, ..Default::default() }, slots: Some(40), gpu_pool: false, dense: Default::default() };
        open_streaming(path.to_str().unwrap(), &opts).unwrap()
    };
    // Room for 12 expert buffers: the 40-slot cache shrinks and the logits stay the same.
    let mut st = open();
    let slot = st.plan.expert_bytes_max as usize;
    LIVE.store(0, Relaxed);
    MAX_LIVE.store(12, Relaxed);
    FAIL_SIZE.store(slot, Relaxed);
    let got = logits_seq(&mut st.session, p, cont).unwrap();
    let s = st.experts.stats();
    eprintln!("refused {} allocations; {} shrinks, {} slots now", REFUSED.load(Relaxed), s.oom_shrinks, st.experts.slots());
    assert!(REFUSED.load(Relaxed) > 0 && s.oom_shrinks > 0, "{s:?}");
    assert!(st.experts.slots() < 40 && st.budget.plan().slots == st.experts.slots());
    assert!(got == want[0], "logits changed after an out-of-memory shrink");
    FAIL_SIZE.store(0, Relaxed);
    drop(st);
    // Room for fewer buffers than one layer's top-k: an error, no abort, no wrong logits.
    let mut st = open();
    LIVE.store(0, Relaxed);
    MAX_LIVE.store(2, Relaxed);
    FAIL_SIZE.store(slot, Relaxed);
    let e = logits_seq(&mut st.session, p, cont).unwrap_err();
    FAIL_SIZE.store(0, Relaxed);
    assert!(e.contains("out of memory"), "{e}");
}

/// A KV cache or a dense weight that cannot be allocated at load (issue 39 item 2: a heap at its
/// limit) is a load error that names what was short, not an abort; with the memory back, the
/// same load works.
#[test]
fn out_of_memory_at_load_is_an_error() {
    use limited_alloc::*;
    use std::sync::atomic::Ordering::Relaxed;
    if !in_own_process("out_of_memory_at_load_is_an_error") {
        return;
    }
    let src = FileSource::open(model("rand-qwen3moe.gguf")).unwrap();
    let g = GgufFile::read(&src).unwrap();
    let c = Config::from_gguf(&g).unwrap();
    // An odd context, so no other buffer has the KV layer's size.
    let n_ctx = 203.min(c.n_ctx_train);
    let load = || Session::load(&src, ExpertMode::Resident, n_ctx).map(|_| ()).map_err(|e| e.to_string());
    let embd = g.tensors.iter().find(|t| t.name == "token_embd.weight").unwrap().size as usize;
    for (what, size) in [("KV cache", n_ctx * c.n_head_kv * c.head_dim * 2), ("read", embd)] {
        (LIVE.store(0, Relaxed), MAX_LIVE.store(0, Relaxed), REFUSED.store(0, Relaxed));
        FAIL_SIZE.store(size, Relaxed);
        let e = load().unwrap_err();
        FAIL_SIZE.store(0, Relaxed);
        assert!(REFUSED.load(Relaxed) > 0);
        assert!(e.contains("out of memory") && e.contains(what) && e.contains(&size.to_string()), "{what}: {e}");
    }
    load().unwrap();
}
