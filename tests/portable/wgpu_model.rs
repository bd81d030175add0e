//! The wgpu backend runs whole models as the CPU backend does. On the GPU's exact path (every
//! kernel reproduces the CPU's portable kernels' f32 results: shaders/exact.wgsl), for SmolLM2,
//! SmolMoE-32x2 and each random MoE, the GPU's greedy tokens equal the CPU's and every step's
//! logits are bit-identical (max |Δlogit| printed: 0). The default run takes a few of the
//! committed prompts and few free-running steps per architecture; `LES_FULL_TESTS=1`
//! (`tools/test_full.sh`) runs the long matrix: all 8 prompts × 32 steps (hybrids 4 × 16,
//! gpt-oss 4 × 20) and two prompts per streamed budget. The CPU runs its portable kernels
//! (`Simd::Scalar`, what wasm32 and aarch64 run; on x86 its AVX2 kernels follow llama.cpp's
//! summation orders instead). Streamed vs resident on the GPU: bit-identical logits at budgets of
//! 10% and 30% of expert bytes. Error paths: a lost device fails the session cleanly and a new
//! session works.
//!
//! Set `LES_NO_GPU=1` to skip on a machine without any adapter (never in CI).

use crate::common::*;
use les::backend::wgpu::exec::GpuOptions;
use les::backend::BackendKind;
use les::engine::sampling::SamplerConfig;
use les::engine::Session;
use les::model::{ExpertMode, Logits};
use les::store::FileSource;

fn gpu_available() -> bool {
    match les::backend::wgpu::GpuContext::new() {
        Ok(_) => true,
        Err(e) if std::env::var_os("LES_NO_GPU").is_some() => {
            eprintln!("skipping: {e}");
            false
        }
        Err(e) => panic!("{e} (set LES_NO_GPU=1 to skip on a machine without a GPU adapter)"),
    }
}

/// (prompts, greedy steps): `long` with `LES_FULL_TESTS=1`, else `short`.
fn sized(long: (usize, usize), short: (usize, usize)) -> (usize, usize) {
    if full_tests() { long } else { short }
}

fn prompts() -> Vec<String> {
    std::fs::read_to_string(root().join("tests/fixtures/prompts.txt")).unwrap().lines().filter(|l| !l.trim().is_empty()).map(String::from).collect()
}

/// Index of the largest logit (the first on a tie), as greedy sampling picks it.
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of `steps` tokens per prompt on the CPU (portable kernels) and on the GPU's
/// exact path, each fed its own tokens. Asserts equal tokens at every step; returns (steps,
/// steps whose logits are not bit-identical, max |Δlogit|).
fn compare(model: &str, n_prompts: usize, steps: usize) -> (usize, usize, f32) {
    les::quant::Simd::force(les::quant::Simd::Scalar);
    let path = model_path(model);
    let src = FileSource::open(&path).unwrap();
    let (mut cpu, mut gpu) = cpu_and_gpu(&src, 256);
    let (mut n, mut differ, mut worst) = (0, 0, 0f32);
    for p in prompts().iter().take(n_prompts) {
        let toks = cpu.tokenize(p);
        cpu.kv.clear();
        gpu.kv.clear();
        let mut lc = cpu.prefill(&toks).unwrap();
        let mut lg = gpu.prefill(&toks).unwrap();
        for i in 0..steps {
            let d = lc.iter().zip(&lg).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            worst = worst.max(d);
            n += 1;
            if lc.iter().zip(&lg).any(|(a, b)| a.to_bits() != b.to_bits()) {
                differ += 1;
                eprintln!("{model} '{p}' step {i}: logits differ, max |Δ| {d:e}");
            }
            let (tc, tg) = (argmax(&lc), argmax(&lg));
            assert_eq!(tg, tc, "{model} '{p}' step {i}: GPU greedy token differs from the CPU's (max |Δlogit| {d:e})");
            lc = cpu.forward(&[tc], Logits::Last).unwrap();
            lg = gpu.forward(&[tg], Logits::Last).unwrap();
        }
    }
    eprintln!("{model}: {n} greedy steps, tokens equal; {differ} steps with logits not bit-identical, max |Δlogit| {worst:e}");
    (n, differ, worst)
}

/// Two sessions of the model in `src` with `n_ctx` positions: one on the CPU, one on the GPU's
/// exact path.
fn cpu_and_gpu(src: &FileSource, n_ctx: usize) -> (Session, Session) {
    let cpu = Session::load(src, ExpertMode::Resident, n_ctx).unwrap();
    let mut gpu = Session::load(src, ExpertMode::Resident, n_ctx).unwrap();
    // Routing on the device (every expert resident in one slab): the token in one submit.
    gpu.set_backend(BackendKind::Wgpu, &GpuOptions { exact: Some(true), device_routing: Some(true), ..Default::default() }).unwrap();
    (cpu, gpu)
}

fn model_path(name: &str) -> std::path::PathBuf {
    model(name)
}

#[test]
fn gpu_greedy_equals_cpu_random_moes() {
    if !gpu_available() {
        return;
    }
    let (np, steps) = sized((8, 32), (2, 8));
    for m in ["rand-llama-moe.gguf", "rand-qwen2moe.gguf", "rand-qwen3moe.gguf", "rand-olmoe.gguf"] {
        let (n, differ, _) = compare(m, np, steps);
        assert_eq!(differ, 0, "{m}: {differ} of {n} steps' logits are not bit-identical");
    }
    // Gated DeltaNet hybrids (float weights: slower on lavapipe).
    let (np, steps) = sized((4, 16), (1, 8));
    for m in ["rand-qwen35moe.gguf", "rand-qwen3next.gguf", "rand-lfm2moe.gguf"] {
        let (n, differ, _) = compare(m, np, steps);
        assert_eq!(differ, 0, "{m}: {differ} of {n} steps' logits are not bit-identical");
    }
}

/// smallthinker (the router before attention, sigmoid gating — on the device too —, ReGLU
/// experts, NoPE layers): GPU = CPU bit for bit; then streamed (10% / 30% of expert slots) =
/// resident on the GPU, with the layer's experts named before its attention.
#[test]
fn gpu_equals_cpu_smallthinker() {
    if !gpu_available() {
        return;
    }
    let (np, steps) = sized((4, 16), (2, 8));
    let (n, differ, _) = compare("rand-smallthinker.gguf", np, steps);
    assert_eq!(differ, 0, "rand-smallthinker: {differ} of {n} steps' logits are not bit-identical");
    gpu_lossless("rand-smallthinker.gguf", 8);
}

/// gpt-oss (sinks, sliding window 16, YaRN, biased MXFP4 experts, swiglu_oai): prompts + steps
/// run past the window (the shortest prompt, 5 tokens, + 14 steps); then streamed (10% / 30% of
/// expert slots) = resident on the GPU.
#[test]
fn gpu_equals_cpu_gpt_oss() {
    if !gpu_available() {
        return;
    }
    let (np, steps) = sized((4, 20), (2, 14));
    let (n, differ, _) = compare("rand-gpt-oss.gguf", np, steps);
    assert_eq!(differ, 0, "rand-gpt-oss: {differ} of {n} steps' logits are not bit-identical");
    gpu_lossless("rand-gpt-oss.gguf", 8);
}

/// Sliding-window layers on the GPU keep a ring of cells (issue 37 item 3): rand-gpt-oss
/// (window 16 on layers 0 and 2) with 1024 positions holds 2 × 1024 cells and two rings of
/// 16 (window) + 32 (a forward's rows) + 64 (rollback) on the device; a 200-token prompt (the
/// rings wrap), greedy steps and a rollback of 30 give the CPU portable kernels' logits bit for
/// bit; a rollback past what the rings hold starts the cache over (the caller feeds everything).
#[test]
fn gpu_sliding_window_rings_equal_cpu() {
    if !gpu_available() {
        return;
    }
    les::quant::Simd::force(les::quant::Simd::Scalar);
    let n_ctx = 1024;
    let src = FileSource::open(model_path("rand-gpt-oss.gguf")).unwrap();
    let (mut cpu, mut gpu) = cpu_and_gpu(&src, n_ctx);
    // f16 keys and values, 2 KV heads of 64.
    let per_cell = 2 * 2 * 64 * 2;
    assert_eq!(gpu.gpu.as_ref().unwrap().kv_bytes() as usize, (2 * n_ctx + 2 * 112) * per_cell);
    let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let vocab = cpu.model.cfg.n_vocab as u32;
    let prompt = random_tokens(200, vocab, 11);
    let (a, b) = (cpu.prefill(&prompt).unwrap(), gpu.prefill(&prompt).unwrap());
    assert_eq!(bits(&b), bits(&a), "prompt logits");
    let mut next = argmax(&a);
    for step in 0..4 {
        let (a, b) = (cpu.forward(&[next], Logits::Last).unwrap(), gpu.forward(&[next], Logits::Last).unwrap());
        assert_eq!(bits(&b), bits(&a), "step {step}");
        next = argmax(&a);
    }
    // A rollback the rings still hold (speculative decoding, a regenerated reply).
    let back = cpu.kv.len - 30;
    assert_eq!(gpu.kv.truncate(back), back);
    assert_eq!(cpu.kv.truncate(back), back);
    let again = random_tokens(40, vocab, 13);
    let (a, b) = (cpu.forward(&again, Logits::All).unwrap(), gpu.forward(&again, Logits::All).unwrap());
    assert_eq!(bits(&b), bits(&a), "after a rollback of 30");
    // Further back than the rings hold (they hold positions 102..214): the cache starts over.
    assert_eq!(gpu.kv.truncate(50), 0);
    cpu.kv.clear();
    let (a, b) = (cpu.prefill(&prompt[..120]).unwrap(), gpu.prefill(&prompt[..120]).unwrap());
    assert_eq!(bits(&b), bits(&a), "after starting over");
}

/// MTP self-speculation with the target on the GPU (issue 37 item 2): the trunk runs on the
/// GPU's exact path and its output-normed rows are read back for the MTP block, which drafts on
/// the CPU; greedy output is the CPU's plain greedy, and drafts are made.
#[test]
fn gpu_mtp_speculative_equals_cpu_plain_greedy() {
    use les::engine::speculative::{self, SpecOptions};
    if !gpu_available() {
        return;
    }
    les::quant::Simd::force(les::quant::Simd::Scalar);
    let src = FileSource::open(model_path("rand-qwen35moe-mtp.gguf")).unwrap();
    let (mut cpu, mut gpu) = cpu_and_gpu(&src, 256);
    gpu.model.load_mtp(&src, &gpu.gguf).unwrap();
    let mut d = les::engine::mtp::MtpDraft::new(&gpu.model, 256).unwrap();
    let g = SamplerConfig::greedy();
    let toks = cpu.tokenize(&prompts()[1]);
    let want = cpu.generate(&toks, 8, &g, true, &mut |_, _| true).unwrap().0;
    let o = SpecOptions { draft_max: 3, io: None, verify_first: false };
    let (got, _, st) = speculative::generate(&mut gpu, Some(&mut d), &o, &toks, 8, &g, true, &mut |_, _| true).unwrap();
    assert_eq!(got, want, "MTP speculative greedy with the trunk on the GPU differs from the CPU's plain greedy");
    assert!(st.drafted > 0);
}

#[test]
fn gpu_greedy_equals_cpu_smolmoe_32x2() {
    if !gpu_available() {
        return;
    }
    let (np, steps) = sized((8, 32), (1, 6));
    let (n, differ, _) = compare("smolmoe-32x2.gguf", np, steps);
    assert_eq!(differ, 0, "SmolMoE-32x2: {differ} of {n} steps' logits are not bit-identical");
}

#[test]
fn gpu_greedy_equals_cpu_smollm2() {
    if !gpu_available() {
        return;
    }
    let (np, steps) = sized((8, 32), (2, 8));
    let (n, differ, _) = compare("SmolLM2-135M-Instruct.Q4_1.gguf", np, steps);
    assert_eq!(differ, 0, "SmolLM2: {differ} of {n} steps' logits are not bit-identical");
}

/// Logits after the prompt and after each continuation token (teacher forced).
fn logits_seq(s: &mut Session, prompt: &[u32], cont: &[u32]) -> Vec<Vec<f32>> {
    s.kv.clear();
    let mut out = vec![s.prefill(prompt).unwrap()];
    for &t in cont {
        out.push(s.forward(&[t], Logits::Last).unwrap());
    }
    out
}

/// On the GPU, streamed experts (budgets of 10% / 30% of experts, split into a small CPU staging
/// cache and a GPU slot pool; prefetch on) give logits bit-identical to every expert resident on
/// the GPU.
fn gpu_lossless(model_file: &str, n: usize) {
    use les::engine::stream::{open_streaming, StreamOptions};
    use les::expert::stream::{Policy, StreamConfig};
    let path = model(model_file);
    let src = FileSource::open(&path).unwrap();
    let mut res = Session::load(&src, ExpertMode::Resident, 256).unwrap();
    let c = res.model.cfg.clone();
    let total = c.n_layer * c.n_expert;
    res.set_backend(BackendKind::Wgpu, &GpuOptions { expert_slots: Some(total), ..Default::default() }).unwrap();
    let prompts = if full_tests() { &["The capital of France is", "def fibonacci(n):"][..] } else { &["def fibonacci(n):"][..] };
    let mut want = Vec::new();
    let mut seqs = Vec::new();
    for &p in prompts {
        let toks = res.tokenize(p);
        let (cont, _) = res.generate(&toks, n, &SamplerConfig::greedy(), true, &mut |_, _| true).unwrap();
        want.push(logits_seq(&mut res, &toks, &cont));
        seqs.push((toks, cont));
    }
    drop(res);
    for frac in [0.1, 0.3] {
        let slots = ((total as f64 * frac).round() as usize).max(c.n_expert_used + 1);
        let opts = StreamOptions {
            budget: 0,
            n_ctx: 256,
            direct: false,
            profile: None,
            cache: StreamConfig { policy: Policy::Lru, prefetch: true, depth: 2, io_threads: 3, ..Default::default() },
            slots: Some(slots),
            gpu_pool: true,
            dense: Default::default(),
        };
        let mut st = open_streaming(path.to_str().unwrap(), &opts).unwrap();
        // The budget's slots split as `les run --backend wgpu` splits them: a small CPU staging
        // cache in front of the GPU pool.
        let gpu_slots = st.plan.gpu_slots;
        let cpu_slots = st.experts.config().slots;
        assert!(gpu_slots > 0 && cpu_slots + gpu_slots <= slots.max(2 * (c.n_expert_used + 1)), "{slots} slots split as {gpu_slots} GPU + {cpu_slots} CPU");
        st.session.set_backend(BackendKind::Wgpu, &GpuOptions { expert_slots: Some(gpu_slots), ..Default::default() }).unwrap();
        for (i, (p, cont)) in seqs.iter().enumerate() {
            let got = logits_seq(&mut st.session, p, cont);
            for (r, (a, b)) in got.iter().zip(&want[i]).enumerate() {
                assert!(a == b, "{model_file}: GPU logits differ (prompt {i}, row {r}) at {:.0}% slots", frac * 100.0);
            }
        }
        let gs = st.session.gpu.as_ref().unwrap().stats();
        assert!(gs.experts.uploads > gs.experts.hits / 100, "the small GPU pool must have reloaded experts");
        assert!(st.experts.stats().bytes_read > 0, "nothing was streamed");
        eprintln!("{model_file}: {:.0}% slots ({gpu_slots} GPU + {} CPU staging): bit-identical on the GPU; {} uploads, {} GPU hits, {} readbacks ({:.2} ms each)", frac * 100.0, cpu_slots, gs.experts.uploads, gs.experts.hits, gs.counts.readbacks, gs.readback_ms / gs.counts.readbacks.max(1) as f64);
    }
}

#[test]
fn gpu_streamed_equals_gpu_resident() {
    if !gpu_available() {
        return;
    }
    for m in ["rand-llama-moe.gguf", "rand-qwen2moe.gguf", "rand-qwen3moe.gguf", "rand-olmoe.gguf", "rand-qwen35moe.gguf", "rand-lfm2moe.gguf"] {
        gpu_lossless(m, 8);
    }
}

#[test]
fn gpu_device_lost_fails_cleanly_and_a_new_session_works() {
    if !gpu_available() {
        return;
    }
    let path = model("rand-olmoe.gguf");
    let src = FileSource::open(&path).unwrap();
    let mut s = Session::load(&src, ExpertMode::Resident, 64).unwrap();
    s.set_backend(BackendKind::Wgpu, &GpuOptions::default()).unwrap();
    let toks = s.tokenize("Hello");
    let want = s.prefill(&toks).unwrap();
    s.gpu.as_ref().unwrap().ctx.destroy();
    s.kv.clear();
    let err = s.prefill(&toks).expect_err("a destroyed device must fail the forward pass");
    eprintln!("after device loss: {err}");
    let mut s2 = Session::load(&src, ExpertMode::Resident, 64).unwrap();
    s2.set_backend(BackendKind::Wgpu, &GpuOptions::default()).unwrap();
    assert_eq!(s2.prefill(&toks).unwrap(), want, "a new session after a device loss computes as before");
}

#[test]
fn gpu_slot_larger_than_the_binding_limit_is_a_clear_error() {
    if !gpu_available() {
        return;
    }
    let ctx = les::backend::wgpu::GpuContext::new().unwrap();
    let too_big = ctx.max_binding() as usize + 4;
    let err = les::backend::wgpu::experts::GpuExpertPool::new(&ctx, 2, too_big).err().expect("a slot over the limit must be refused");
    let msg = err.to_string();
    assert!(msg.contains("limit") && msg.contains(&too_big.to_string()), "{msg}");
}

/// A full GPU slot pool evicts the expert its source's policy ranks lowest (`retention`), not the
/// least recently used one; with no ranking it falls back to LRU.
#[test]
fn gpu_pool_evicts_what_the_scheduler_ranks_lowest() {
    if !gpu_available() {
        return;
    }
    use les::backend::wgpu::experts::GpuExpertPool;
    use les::backend::wgpu::Recorder;
    use les::expert::{ExpertBlock, ExpertLayout};
    use les::quant::GgmlType;
    let ctx = les::backend::wgpu::GpuContext::new().unwrap();
    let layout = ExpertLayout { n_embd: 4, n_ff: 1, gate_ty: GgmlType::F32, up_ty: GgmlType::F32, down_ty: GgmlType::F32, gate_bytes: 16, up_bytes: 16, down_bytes: 16 };
    let blk = ExpertBlock::new(vec![0u8; 48], layout);
    let arena = Recorder::arena_buffer(&ctx);
    for (ranked, evicted, kept) in [(true, (0, 1), (0, 0)), (false, (0, 0), (0, 1))] {
        let mut pool = GpuExpertPool::new(&ctx, 2, 48).unwrap();
        let mut rec = Recorder::new(&ctx, &arena);
        // (0, 0) is kept high and (0, 1) low by the ranking; (0, 0) is also the older one.
        let rank = |l: usize, e: usize| ranked.then_some(if (l, e) == (0, 0) { 10.0 } else { -10.0 });
        pool.ensure(&mut rec, 0, 0, &blk, &rank).unwrap();
        pool.ensure(&mut rec, 0, 1, &blk, &rank).unwrap();
        rec.submit();
        pool.ensure(&mut rec, 1, 0, &blk, &rank).unwrap();
        assert!(!pool.holds(evicted.0, evicted.1) && pool.holds(kept.0, kept.1) && pool.holds(1, 0), "ranked {ranked}: expected {evicted:?} evicted");
    }
}

/// Gated DeltaNet on the GPU: the recurrent state lives in GPU buffers and follows the host's
/// checkpoint / restore / clear (regenerate with prefix reuse; speculative decoding rejecting
/// drafts); greedy tokens stay the CPU's plain greedy tokens.
#[test]
fn gpu_recurrent_state_follows_checkpoints() {
    use les::engine::speculative::{self, PromptLookup, SpecOptions};
    if !gpu_available() {
        return;
    }
    les::quant::Simd::force(les::quant::Simd::Scalar);
    let src = FileSource::open(model_path("rand-qwen35moe.gguf")).unwrap();
    let (mut cpu, mut gpu) = cpu_and_gpu(&src, 256);
    // Keys and values on the GPU for the one attention layer of four only (GGUF
    // `full_attention_interval` 4; 2 KV heads of 64; f16; 256 positions), not for the
    // recurrent ones.
    assert_eq!(gpu.gpu.as_ref().unwrap().kv_bytes(), 2 * (2 * 64 * 256 * 2));
    gpu.reuse_prefix = true;
    let g = SamplerConfig::greedy();
    for p in prompts().iter().take(if full_tests() { 2 } else { 1 }) {
        let toks = cpu.tokenize(p);
        cpu.reset();
        let want = cpu.generate(&toks, 8, &g, true, &mut |_, _| true).unwrap().0;
        gpu.reset();
        let got = gpu.generate(&toks, 8, &g, true, &mut |_, _| true).unwrap().0;
        assert_eq!(got, want, "'{p}': GPU greedy differs from the CPU's");
        let (again, st) = gpu.generate(&toks, 8, &g, true, &mut |_, _| true).unwrap();
        assert_eq!(st.prompt_reused, toks.len() - 1, "'{p}': regenerate restores the checkpoint");
        assert_eq!(again, want, "'{p}': regenerated on the GPU from the restored state");
        let o = SpecOptions { draft_max: 3, io: None, verify_first: false };
        let (spec, _, sst) = speculative::generate(&mut gpu, Some(&mut PromptLookup::default()), &o, &toks, 8, &g, true, &mut |_, _| true).unwrap();
        assert_eq!(spec, want, "'{p}': speculative greedy on the GPU");
        eprintln!("'{p}': {} drafted, {} accepted", sst.drafted, sst.accepted);
    }
}

/// Images (issue 36): the `minicpmv4_6` tower's embeddings of every piece of a sliced image, and
/// the text tower's logits after them, on the GPU's exact path are the CPU portable kernels'
/// bits (each piece encoded on the GPU; the image chunks run through the GPU's text forward).
#[test]
fn gpu_image_embeddings_and_logits_equal_cpu() {
    if !gpu_available() {
        return;
    }
    les::quant::Simd::force(les::quant::Simd::Scalar);
    let mp = les::vision::Mmproj::load(&FileSource::open(model("rand-minicpmv-mmproj.gguf")).unwrap()).unwrap();
    let img = std::fs::read(root().join("tests/data/vision/grid_336x700.png")).unwrap();
    let prep = mp.prepare(&img).unwrap();
    let ctx = std::sync::Arc::new(les::backend::wgpu::GpuContext::new().unwrap());
    let opts = GpuOptions { exact: Some(true), ..Default::default() };
    for (i, p) in std::iter::once(&prep.overview).chain(&prep.slices).enumerate() {
        let c = mp.encode(p).unwrap();
        let g = les::backend::wgpu::block_on(mp.encode_gpu(&ctx, &opts, p)).unwrap();
        let d = c.iter().zip(&g).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(c.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits()), "piece {i}: GPU embeddings differ from the CPU's (max |Δ| {d:e})");
    }
    let src = FileSource::open(model("rand-qwen35-vl.gguf")).unwrap();
    let prompt = "<|im_start|>user\n<__media__>Describe<|im_end|>\n<|im_start|>assistant\n";
    let mut out = Vec::new();
    for gpu in [false, true] {
        let mut s = Session::load(&src, ExpertMode::Resident, 256).unwrap();
        if gpu {
            s.set_backend(BackendKind::Wgpu, &opts).unwrap();
        }
        let p = s.mm_prompt(&mp, prompt, std::slice::from_ref(&img)).unwrap();
        let toks = s.prefill_mm(&mp, &p).unwrap().tokens;
        let last = *toks.last().unwrap();
        let mut logits = s.forward(&[last], Logits::Last).unwrap();
        let mut seq = vec![logits.clone()];
        for _ in 0..4 {
            logits = s.forward(&[argmax(&logits)], Logits::Last).unwrap();
            seq.push(logits.clone());
        }
        out.push(seq);
    }
    for (i, (c, g)) in out[0].iter().zip(&out[1]).enumerate() {
        assert!(c.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits()), "step {i}: GPU logits after the image differ from the CPU's");
    }
}

/// The memory budget changed while a GPU session runs (issue 39 item 2): the budget's slots are
/// split into CPU staging and the GPU pool as at load, and both resize (down to the minimum, back
/// up) between tokens; the logits stay those of the unchanged GPU run, bit for bit.
#[test]
fn gpu_budget_changes_resize_the_pool_losslessly() {
    use les::engine::stream::{open_streaming, StreamOptions};
    use les::expert::stream::StreamConfig;
    if !gpu_available() {
        return;
    }
    let path = model("rand-qwen3moe.gguf");
    let c = {
        let src = FileSource::open(&path).unwrap();
        Session::load(&src, ExpertMode::Resident, 64).unwrap().model.cfg.clone()
    };
    let open = || {
        let opts = StreamOptions { budget: 0, n_ctx: 256, direct: false, profile: None, cache: StreamConfig { io_threads: 2, ..Default::default() }, slots: Some(c.n_layer * c.n_expert / 2), gpu_pool: true, dense: Default::default() };
        let mut st = open_streaming(path.to_str().unwrap(), &opts).unwrap();
        st.session.set_backend(BackendKind::Wgpu, &GpuOptions { expert_slots: Some(st.plan.gpu_slots), ..Default::default() }).unwrap();
        let pool = st.session.gpu.as_ref().unwrap().expert_pool();
        let budget = st.budget.clone().with_gpu_pool(pool);
        (st, budget)
    };
    let (mut st, _) = open();
    let toks = st.session.tokenize("The capital of France is");
    let (cont, _) = st.session.generate(&toks, 12, &SamplerConfig::greedy(), true, &mut |_, _| true).unwrap();
    let want = logits_seq(&mut st.session, &toks, &cont);
    drop(st);
    let (mut st, budget) = open();
    let (full, min) = (budget.budget(), budget.minimum());
    let gpu0 = st.session.gpu.as_ref().unwrap().expert_slots();
    st.session.kv.clear();
    let mut got = vec![st.session.prefill(&toks).unwrap()];
    for (i, &t) in cont.iter().enumerate() {
        match i {
            4 => {
                let p = budget.set(min).unwrap();
                let gpu = st.session.gpu.as_ref().unwrap().expert_slots();
                assert_eq!((p.gpu_slots, gpu), (gpu, c.n_expert_used + 1), "the GPU pool at the minimum");
                assert!(gpu < gpu0);
            }
            8 => {
                budget.set(full).unwrap();
                assert_eq!(st.session.gpu.as_ref().unwrap().expert_slots(), gpu0);
            }
            _ => {}
        }
        got.push(st.session.forward(&[t], Logits::Last).unwrap());
    }
    for (r, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(a == b, "GPU logits differ at row {r} with the budget changed");
    }
}
