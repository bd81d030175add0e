//! `les`: command-line interface.
//!
//!   les run --model PATH (--prompt TEXT | --chat) [-n N] [--temp T] [--seed S] …
//!   les serve --model PATH [--host 127.0.0.1] [--port 8080] [--memory-budget B] …
//!           [--draft-model PATH | --lookup] [--draft-max N]
//!   les inspect PATH
//!   les bench decode --model PATH [-n N]

#[path = "les/serve.rs"]
mod serve;

use clap::{Args, Parser, Subcommand};
use les::engine::chat::Message;
use les::engine::sampling::SamplerConfig;
use les::engine::draft::DraftSpec;
use les::engine::speculative::{self, Draft, SpecOptions};

/// An allocation the heap refuses gives back an emergency reserve and lowers the budget instead
/// of aborting ([`les::engine::reserve`]).
#[global_allocator]
static ALLOC: les::engine::reserve::Reserve<std::alloc::System> = les::engine::reserve::Reserve(std::alloc::System);
use les::engine::stream::BudgetControl;
use les::engine::{memory_usage, Session};
use les::gguf::GgufFile;
use les::model::ExpertMode;
use les::store::{ByteSource, FileSource};
use std::io::{BufRead, Write};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "les", version, about = "LES: run Mixture-of-Experts GGUF models with less memory than the model")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text: streams only the generated text to stdout, one stats line to stderr.
    Run(RunArgs),
    /// An OpenAI-compatible HTTP server (`/v1/chat/completions`, `/v1/completions`,
    /// `/v1/models`, `/health`) with llama-server's flag names and defaults.
    Serve(serve::ServeArgs),
    /// Will it fit, and how fast? The budget plan of a model (without loading it), the minimum
    /// budget and longest context, the expert hit rate and bytes read per token, and the decode
    /// and prompt speed with what bounds them, from this machine's measured compute and the
    /// store's reads.
    Plan(PlanArgs),
    /// Print a GGUF file's metadata and tensor table.
    Inspect {
        /// GGUF file.
        #[arg(required_unless_present = "device")]
        path: Option<String>,
        /// Print the GPU adapter wgpu finds: backend, limits and features.
        #[arg(long)]
        device: bool,
        /// Print every metadata value in full (default: arrays abbreviated).
        #[arg(long)]
        full: bool,
    },
    /// Pack a MoE GGUF into a bundle: one contiguous, 4 KiB-aligned, checksummed block per
    /// (layer, expert), a manifest, and the dense weights as an embedded GGUF.
    Pack {
        /// Input GGUF.
        input: String,
        /// Output bundle (.les).
        output: String,
        /// Re-quantize experts, per MoE layer: `GATE,UP,DOWN` for every layer (e.g.
        /// `q4_0,q4_0,q2_k`), or `;`-separated `LAYERS:GATE,UP,DOWN` with LAYERS `N` or `A-B`
        /// (e.g. `0-9:q4_1,q4_1,q3_k;10-29:q4_0,q4_0,q2_k`; other layers keep their types).
        /// Types: q4_0 q4_1 q8_0 q2_k q3_k q4_k f32.
        #[arg(long, value_name = "SPEC", conflicts_with = "mixed_precision")]
        expert_types: Option<String>,
        /// Choose per-layer expert types under --target-bytes by measured sensitivity (KL on
        /// --calibration when one layer's experts are re-quantized), then pack with them.
        #[arg(long, requires = "target_bytes")]
        mixed_precision: bool,
        /// Expert bytes to fit (B, KiB, MiB, GiB, KB, MB, GB).
        #[arg(long)]
        target_bytes: Option<String>,
        /// Calibration text for --mixed-precision.
        #[arg(long, default_value = "tests/fixtures/eval/calibration.txt")]
        calibration: String,
        /// Calibration tokens (one chunk).
        #[arg(long, default_value_t = 256)]
        calib_tokens: usize,
        /// Order of each layer's expert blocks on storage: `index` (the experts' own order) or
        /// `coactivation` (experts routed in the same forward next to each other, from
        /// --routes; the streaming reader reads adjacent wanted experts in one read).
        #[arg(long, default_value = "index", value_parser = ["index", "coactivation"])]
        order: String,
        /// Routing traces of this model (`les run --routes FILE`) for `--order coactivation`.
        #[arg(long, value_name = "FILE", num_args = 1..)]
        routes: Vec<String>,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Quality evaluation.
    #[command(subcommand)]
    Eval(EvalCmd),
}

#[derive(Args)]
struct PlanArgs {
    /// GGUF model or `.les` bundle.
    #[arg(short, long)]
    model: String,
    /// Memory budget (as `les run --memory-budget`).
    #[arg(long)]
    memory_budget: String,
    /// Context size in tokens (the KV cache the budget holds).
    #[arg(short = 'c', long, default_value_t = 2048)]
    ctx_size: usize,
    /// Worker threads of the compute probe (default: all cores), as `les run -t`.
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Where experts are read from: `disk` (this machine's file, probed) or a device profile
    /// (phone-1.5GBps, phone-4GBps, laptop-nvme).
    #[arg(long, default_value = "disk")]
    store: String,
    /// A routing trace of this model (`les run --routes FILE`): the hit rate comes from
    /// replaying it through the cache; without one, uniform routing is assumed.
    #[arg(long, value_name = "FILE")]
    routes: Option<String>,
    /// Eviction policy (as `les run --policy`).
    #[arg(long, default_value = "next-use")]
    policy: String,
    /// Skip the compute probe (no dense weights loaded): fit and reads only.
    #[arg(long)]
    no_probe: bool,
    /// Prompt length whose speed is forecast (a first prompt: the cache starts empty).
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Print the forecast as JSON.
    #[arg(long)]
    json: bool,
    /// `wgpu`: also forecast a decode token on GPU devices (`--device`): the backend's calls
    /// per token are counted on this machine's adapter (lavapipe will do) and priced with each
    /// device's per-call costs (src/engine/gpu_cost.rs).
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// GPU device profiles, comma-separated: iphone-metal, chrome-apple-silicon,
    /// chrome-discrete, firefox-apple-silicon, this-adapter (measured now by the GPU probe);
    /// default: all but this-adapter.
    #[arg(long, value_delimiter = ',')]
    device: Vec<String>,
}

fn cmd_plan(a: PlanArgs) -> Res {
    use les::engine::plan::{plan, PlanOptions};
    if let Some(t) = a.threads {
        les::backend::cpu::par::init_threads(t);
    }
    let profile = match a.store.as_str() {
        "disk" => None,
        n => Some(les::store::throttle::DeviceProfile::by_name(n).ok_or_else(|| format!("unknown --store '{n}' (disk, {})", les::store::throttle::PROFILES.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")))?),
    };
    let routes = match &a.routes {
        Some(p) => Some(serde_json::from_str::<Vec<(u32, u32)>>(&std::fs::read_to_string(p).map_err(|e| format!("--routes {p}: {e}"))?).map_err(|e| format!("--routes {p}: not a routing trace (a JSON array of [layer, expert]): {e}"))?),
        None => None,
    };
    let policy = les::expert::stream::Policy::parse(&a.policy).ok_or_else(|| format!("unknown --policy '{}' (lru, lfu, next-use)", a.policy))?;
    let budget = les::engine::stream::parse_bytes(&a.memory_budget)?;
    let gpu_devices = match a.backend.as_str() {
        "cpu" if a.device.is_empty() => Vec::new(),
        "cpu" => return Err("--device needs --backend wgpu".into()),
        "wgpu" if a.no_probe => return Err("--backend wgpu counts the GPU's calls on a probe run: drop --no-probe".into()),
        "wgpu" => {
            use les::engine::gpu_cost::{profiles, GpuDevice};
            let names: Vec<String> = if a.device.is_empty() { profiles().into_iter().map(|p| p.name).collect() } else { a.device.clone() };
            let mut v = Vec::new();
            for n in &names {
                v.push(match n.as_str() {
                    "this-adapter" => {
                        let ctx = les::backend::wgpu::GpuContext::new()?;
                        let (main, cols) = plan_main_type(&a.model)?;
                        GpuDevice::measured(&les::backend::wgpu::probe::probe(&ctx, main, cols)?, profile.map(|p| p.name).unwrap_or("laptop-nvme"))
                    }
                    n => GpuDevice::by_name(n).ok_or_else(|| format!("unknown --device '{n}' ({}, this-adapter)", profiles().iter().map(|p| p.name.clone()).collect::<Vec<_>>().join(", ")))?,
                });
            }
            v
        }
        b => return Err(format!("unknown --backend '{b}' (cpu, wgpu)").into()),
    };
    let f = plan(&a.model, &PlanOptions { budget, n_ctx: a.ctx_size, profile, routes, policy, probe: !a.no_probe, prompt_tokens: a.prompt_tokens, gpu_devices })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
        return Ok(());
    }
    let mib = |b: u64| b as f64 / 1048576.0;
    println!("les plan: {} ({}, {} layers × {} experts, top-{}; {})", a.model, f.arch, f.n_layer, f.n_expert, f.n_expert_used, f.store);
    match &f.plan {
        Some(p) => println!(
            "fits: yes. budget {:.1} MiB = dense {:.1}{} + KV {:.1} ({} tokens) + scratch {:.1} + {} expert slots of {:.2} MiB ({:.1} MiB, {:.1}% of {:.1} MiB of experts)",
            mib(p.budget),
            mib(p.dense),
            if p.dense_streamed > 0 { format!(" (+ {:.1} MiB read from storage at each use)", mib(p.dense_streamed)) } else { String::new() },
            mib(p.kv),
            a.ctx_size,
            mib(p.scratch),
            p.slots.min(f.n_layer * f.n_expert),
            mib(p.expert_bytes_max),
            mib(p.slots.min(f.n_layer * f.n_expert) as u64 * p.expert_bytes_max),
            100.0 * (p.slots.min(f.n_layer * f.n_expert) as u64 * p.expert_bytes_max) as f64 / p.total_expert_bytes.max(1) as f64,
            mib(p.total_expert_bytes)
        ),
        None => println!("fits: no. {}", f.why.as_deref().unwrap_or("")),
    }
    println!("minimum budget: {:.1} MiB at {} tokens of context; longest context in {:.1} MiB: {} tokens", mib(f.minimum), a.ctx_size, mib(budget), f.largest_context);
    println!("hit rate: {:.1}%, decode {:.1}% ({})", 100.0 * f.hit_rate, 100.0 * f.decode_hit_rate, f.hit_rate_source);
    println!(
        "reads per token: {:.1} experts, {:.1} MB, {:.1} ms ({}: {:.0} µs latency, {:.0} MB/s)",
        f.reads_per_token,
        f.bytes_per_token / 1e6,
        f.read_ms_per_token,
        f.read.source,
        f.read.latency_s * 1e6,
        f.read.bandwidth / 1e6
    );
    if let Some(c) = &f.compute {
        println!("compute (measured here, {} threads): decode {:.1} ms/token, prompt {:.2} ms/token in batches of {}", c.threads, c.decode_ms_per_token, c.prompt_ms_per_token, c.prompt_batch);
        println!(
            "forecast: decode {:.1} tokens/s (bound: {}; up to {:.1} with every read hidden by lookahead), a first prompt of {} tokens {:.1} tokens/s (bound: {})",
            f.decode_tokens_per_s.unwrap_or(0.0),
            f.decode_bound.unwrap_or("-"),
            f.decode_tokens_per_s_overlapped.unwrap_or(0.0),
            f.prompt_tokens,
            f.prompt_tokens_per_s.unwrap_or(0.0),
            f.prompt_bound.unwrap_or("-")
        );
    }
    if let Some(g) = &f.gpu {
        println!("GPU decode token, counted on {} ({:.1} ms/token measured there): {}", g.adapter, g.measured_ms_per_token, g.per_token);
        println!("  weights per token: {:.1} MB (most of them {})", g.weight_bytes / 1e6, g.main_type);
        println!("  | device | syncs ms | submits ms | dispatches ms | bind groups ms | bandwidth ms | reads ms | total ms | tokens/s | bandwidth floor tokens/s |");
        for b in &g.forecasts {
            println!(
                "  | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} |",
                b.device, b.sync_ms, b.submit_ms, b.dispatch_ms, b.bind_group_ms, b.bandwidth_ms, b.read_ms, b.total_ms, b.tokens_per_s, b.floor_tokens_per_s
            );
        }
    }
    Ok(())
}

/// The weight type and width `les plan --device this-adapter` times: the type of the most bytes
/// among the first layer's experts (the bulk of a MoE token's reads), and n_embd.
fn plan_main_type(model: &str) -> Result<(les::quant::GgmlType, usize), Box<dyn std::error::Error>> {
    let src: std::sync::Arc<dyn les::store::ByteSource> = std::sync::Arc::new(les::store::FileSource::open(model)?);
    let parts = les::engine::stream::open_parts(src.clone(), src.clone(), src, model)?;
    let l = parts.store.layout(0);
    let t = [(l.gate_ty, l.gate_bytes), (l.up_ty, l.up_bytes), (l.down_ty, l.down_bytes)].into_iter().max_by_key(|x| x.1).map(|x| x.0);
    Ok((t.unwrap_or(les::quant::GgmlType::Q8_0), l.n_embd))
}

#[derive(Subcommand)]
enum EvalCmd {
    /// Perplexity of a text (llama-perplexity's method: chunks of --chunk tokens, second half of
    /// each scored), and with --base the mean KL divergence from a base model and top-1 agreement.
    Ppl {
        #[command(flatten)]
        m: ModelArgs,
        /// Text file to score.
        #[arg(long)]
        text: String,
        /// Tokens per chunk.
        #[arg(long, default_value_t = 256)]
        chunk: usize,
        /// Base model (same tokenizer) for KL(base ‖ model).
        #[arg(long)]
        base: Option<String>,
        /// Write the report as JSON.
        #[arg(long)]
        json: Option<String>,
    },
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// GGUF model file.
    #[arg(short, long)]
    model: String,
    /// Context size in tokens.
    #[arg(short = 'c', long, default_value_t = 2048)]
    ctx_size: usize,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Compute backend: cpu, wgpu (WebGPU / Metal / Vulkan / DX12), or auto (a hardware GPU when
    /// there is one, else the CPU). Default cpu: loading a GPU driver costs ~50 MiB of resident
    /// memory (measured with lavapipe), which a tight --memory-budget may not have.
    #[arg(long, default_value = "cpu")]
    backend: les::backend::BackendKind,
    /// wgpu: expert slots on the GPU (default: as many as the memory budget's expert cache, else
    /// every expert up to 1 GiB).
    #[arg(long)]
    gpu_expert_slots: Option<usize>,
    /// wgpu: the exact path (on) or the parallel matvec reduction (off). Exact: every kernel
    /// gives the CPU's portable-kernel results bit for bit (`LES_NO_SIMD=1` on x86; the CPU
    /// backend on wasm32 and aarch64). Default: exact on software adapters (lavapipe), parallel
    /// on hardware GPUs.
    #[arg(long)]
    gpu_exact: Option<bool>,
}

impl ModelArgs {
    /// Move the session to the chosen backend; prints the choice to stderr. `budget_slots`: the
    /// expert slots a memory budget allows, the GPU pool's default size under a budget.
    fn apply_backend(&self, s: &mut Session) -> Res {
        self.apply_backend_with(s, None)
    }

    /// Whether the backend will run on a GPU (wgpu, or auto finding a hardware adapter): a memory
    /// budget then puts the expert cache in GPU slots behind a small CPU staging cache.
    fn gpu_pool(&self) -> bool {
        self.backend.runs_on_gpu()
    }

    /// Stream options for a budget, with the GPU split when the backend is a GPU.
    fn stream_options(&self, s: &StreamArgs, budget: u64) -> Result<les::engine::stream::StreamOptions, Box<dyn std::error::Error>> {
        let mut o = s.options(budget, self.ctx_size)?;
        o.gpu_pool = self.gpu_pool();
        Ok(o)
    }

    fn apply_backend_with(&self, s: &mut Session, budget_slots: Option<usize>) -> Res {
        let line = s.set_backend(self.backend, &les::backend::wgpu::exec::GpuOptions { expert_slots: self.gpu_expert_slots.or(budget_slots), exact: self.gpu_exact, device_routing: None })?;
        eprintln!("les: {line}");
        Ok(())
    }
}

#[derive(Args, Clone, Default)]
struct StreamArgs {
    /// Memory budget (e.g. 400MiB, 1.5GiB): dense weights + expert cache + KV cache + scratch.
    /// Experts beyond the cache are streamed from storage. Without it, every weight is loaded.
    #[arg(long)]
    memory_budget: Option<String>,
    /// Where expert reads come from: `disk` (the file) or a device profile modelling flash
    /// (phone-1.5GBps, phone-4GBps, laptop-nvme).
    #[arg(long, default_value = "disk")]
    store: String,
    /// Read experts with O_DIRECT (bypass the page cache; Linux).
    #[arg(long)]
    direct: bool,
    /// Disable lookahead prefetching (on-demand loading only).
    #[arg(long)]
    no_prefetch: bool,
    /// Eviction policy: lru, lfu (frequency-aware) or next-use (Belady-like: evicts the expert
    /// whose next use is estimated farthest away from its layer distance and use frequency).
    #[arg(long, default_value = "next-use")]
    policy: String,
    /// Lookahead depth (layers ahead the routers are applied).
    #[arg(long, default_value_t = 1)]
    lookahead: usize,
    /// Disable the temporal predictor (previous token's experts).
    #[arg(long)]
    no_temporal: bool,
    /// I/O threads (reads in flight).
    #[arg(long, default_value_t = 4)]
    io_threads: usize,
    /// Follow the memory available to the process (Linux: its memory cgroup's limit less its
    /// working set, and MemAvailable): below max(64 MiB, 5% of the budget) free the expert
    /// cache shrinks, above four times that it grows back, never past --memory-budget nor below
    /// the model's minimum. The output does not change.
    #[arg(long, requires = "memory_budget")]
    adapt_budget: bool,
    /// Two-stage lookahead: after each layer's FFN, its output re-predicts layer l+1 and predicts
    /// l+2 (recall 80% vs 56%, but slower in the measured ladders: see BENCHMARKS.md).
    #[arg(long)]
    two_stage: bool,
    /// Turn off the refinement stage (on by default: as soon as layer l's first expert is
    /// computed, its partial output re-predicts layer l+1; recall 69% vs 56% on SmolMoE-32x2).
    #[arg(long)]
    no_refine: bool,
    /// Prefetch on every token. By default the scheduler measures, while decoding, whether
    /// prefetching makes tokens faster (tokens alternating with it on and off) and turns it off
    /// while it does not (`src/expert/governor.rs`).
    #[arg(long)]
    prefetch_always: bool,
    /// Do not read a layer's experts when the model names them before the layer runs
    /// (smallthinker's router reads the layer's input: by default the misses are read while the
    /// layer's attention computes).
    #[arg(long)]
    no_exact_lookahead: bool,
    /// Prefetch reads in flight at once (prefetches run only while no demand read is waiting).
    #[arg(long, default_value_t = 1)]
    prefetch_inflight: usize,
    /// Prefetches are read in chunks of this size (e.g. 256KiB, 1MiB; 0: one read per range),
    /// so a demand read waits for at most one chunk and a stale prefetch stops mid-read.
    #[arg(long, default_value = "1MiB")]
    prefetch_chunk: String,
    /// Write run and per-layer statistics as JSON.
    #[arg(long)]
    stats_json: Option<String>,
    /// Write a Chrome trace-event timeline (open in Perfetto / chrome://tracing).
    #[arg(long)]
    trace: Option<String>,
    /// Write the routing trace: every routed expert in order as a JSON array of [layer, expert]
    /// (decode steps visit layers 0..n_layer; prefill batches list each layer's union).
    #[arg(long, value_name = "FILE")]
    routes: Option<String>,
}

impl StreamArgs {
    fn options(&self, budget: u64, n_ctx: usize) -> Result<les::engine::stream::StreamOptions, Box<dyn std::error::Error>> {
        use les::expert::stream::{Policy, StreamConfig};
        let profile = match self.store.as_str() {
            "disk" => None,
            name => Some(les::store::throttle::DeviceProfile::by_name(name).ok_or_else(|| {
                format!("unknown --store '{name}' (disk, {})", les::store::throttle::PROFILES.iter().map(|p| p.name).collect::<Vec<_>>().join(", "))
            })?),
        };
        let policy = Policy::parse(&self.policy).ok_or_else(|| format!("unknown --policy '{}' (lru, lfu, next-use)", self.policy))?;
        Ok(les::engine::stream::StreamOptions {
            budget,
            n_ctx,
            direct: self.direct,
            profile,
            cache: StreamConfig {
                policy,
                prefetch: !self.no_prefetch,
                depth: self.lookahead.max(1),
                temporal: !self.no_temporal,
                io_threads: self.io_threads.max(1),
                max_prefetch_inflight: self.prefetch_inflight.max(1),
                residual_stage: self.two_stage,
                refine: !self.no_refine,
                adaptive: !self.prefetch_always,
                exact: !self.no_exact_lookahead,
                prefetch_chunk: les::engine::stream::parse_bytes(&self.prefetch_chunk).map_err(|e| format!("--prefetch-chunk: {e}"))? as usize,
                trace: self.trace.is_some(),
                ..Default::default()
            },
            slots: None,
            gpu_pool: false,
            dense: les::engine::stream::DenseOptions::default(),
        })
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    m: ModelArgs,
    #[command(flatten)]
    s: StreamArgs,
    /// Prompt text (tokenized as llama.cpp does: special tokens parsed, BOS as the model says).
    #[arg(short, long, conflicts_with = "chat")]
    prompt: Option<String>,
    /// Read the prompt text from FILE (llama.cpp's `-f`; for prompts longer than a command line).
    #[arg(short = 'f', long = "file", value_name = "FILE", conflicts_with_all = ["chat", "prompt"])]
    prompt_file: Option<std::path::PathBuf>,
    /// Chat: read one user message per line from stdin, render with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A Jinja chat template file used instead of the model's `tokenizer.chat_template`.
    #[arg(long, requires = "chat")]
    chat_template_file: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128)]
    n_predict: usize,
    /// Temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8)]
    temp: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    #[command(flatten)]
    g: GenArgs,
    #[command(flatten)]
    sp: SpecArgs,
    /// Write the generated token ids as a JSON array to FILE (one array per prompt, one per line).
    #[arg(long, value_name = "FILE")]
    tokens_out: Option<String>,
    /// A vision tower (mmproj GGUF, llama.cpp's `--mmproj`: projector `minicpmv4_6`) for --image.
    #[arg(long, value_name = "FILE", requires = "prompt")]
    mmproj: Option<String>,
    /// An image (PNG or JPEG) for the prompt (repeatable); the prompt goes through the chat
    /// template as `llama-mtmd-cli -p` lays it out (`<__media__>` marks where each image goes,
    /// else the images come first). Needs --mmproj.
    #[arg(long, value_name = "FILE")]
    image: Vec<String>,
}

/// Speculative decoding (`les run`, `les serve`; llama.cpp's names where it has them).
#[derive(Args, Clone, Default)]
struct SpecArgs {
    /// Speculative decoding with this draft model (same vocabulary as --model; loaded resident).
    #[arg(long, conflicts_with_all = ["lookup", "mtp"])]
    draft_model: Option<String>,
    /// Speculative decoding with prompt lookup (n-gram drafts from the prompt and the output).
    #[arg(long, conflicts_with = "mtp")]
    lookup: bool,
    /// Speculative decoding with the model's own multi-token-prediction block (qwen35moe, qwen35,
    /// qwen3next files with `nextn_predict_layers`; llama.cpp's `--spec-type draft-mtp`). Its
    /// weights and experts are held in memory, out of --memory-budget.
    #[arg(long)]
    mtp: bool,
    /// With --mtp on a streamed model: how many of the first layers get experts prefetched from
    /// the embeddings of the tokens the block drafts, before the verification forward reaches
    /// them (0: off, the default: measured no faster, see BENCHMARKS.md).
    #[arg(long, value_name = "N", default_value_t = les::engine::mtp::MTP_LOOKAHEAD_LAYERS, requires = "mtp")]
    mtp_lookahead: usize,
    /// Most draft tokens verified per target forward (default 4 with --draft-model, 16 with
    /// --lookup, 3 with --mtp).
    #[arg(long)]
    draft_max: Option<usize>,
}

impl SpecArgs {
    fn any(&self) -> bool {
        self.draft_model.is_some() || self.lookup || self.mtp
    }

    fn spec(&self) -> Result<Option<DraftSpec>, Box<dyn std::error::Error>> {
        Ok(match (&self.draft_model, self.lookup, self.mtp) {
            (Some(p), _, _) => Some(DraftSpec::model_file(p).map_err(|e| format!("--draft-model {p}: {e}"))?),
            (None, true, _) => Some(DraftSpec::Lookup),
            (None, false, true) => Some(DraftSpec::Mtp { lookahead: self.mtp_lookahead }),
            (None, false, false) => None,
        })
    }

    /// Bytes the draft takes out of `--memory-budget` ([`DraftSpec::reserve`]; 0 without a
    /// budget).
    fn reserve(&self, m: &ModelArgs, s: &StreamArgs) -> Result<u64, Box<dyn std::error::Error>> {
        match (self.spec()?, &s.memory_budget) {
            (Some(d), Some(_)) => Ok(d.reserve(std::sync::Arc::new(FileSource::open(&m.model)?), m.ctx_size)?),
            _ => Ok(0),
        }
    }

    /// The draft asked for, loaded beside `sess` (an MTP block into its model), and γ.
    fn open(&self, m: &ModelArgs, s: &StreamArgs, sess: &mut Session) -> Result<(Option<Box<dyn Draft + Send>>, usize), Box<dyn std::error::Error>> {
        let Some(spec) = self.spec()? else {
            return Ok((None, 0));
        };
        let d = spec.open(std::sync::Arc::new(FileSource::open(&m.model)?), sess)?;
        let within = if s.memory_budget.is_some() { "taken from --memory-budget" } else { "resident" };
        let mib = |b: u64| b as f64 / 1048576.0;
        match &spec {
            DraftSpec::Model(_) => eprintln!("les: draft model {}: {:.1} MiB of weights ({within})", self.draft_model.as_deref().unwrap_or(""), mib(d.weight_bytes)),
            DraftSpec::Mtp { .. } => eprintln!("les: MTP block: {:.1} MiB of weights + {:.1} MiB of cache ({within}; run on the CPU)", mib(d.weight_bytes), mib(d.cache_bytes)),
            DraftSpec::Lookup => {}
        }
        Ok((Some(d.draft), self.draft_max.unwrap_or(spec.default_max())))
    }
}

/// Stop strings and a full context (llama.cpp's names).
#[derive(Args, Clone, Default)]
struct GenArgs {
    /// Stop when the output contains STR (repeatable); the stop string is not printed.
    #[arg(long, value_name = "STR")]
    stop: Vec<String>,
    /// When the context is full, keep the first N tokens (and a leading BOS), drop the older half
    /// of the rest and continue (llama.cpp's context shift). Without it generation stops there.
    #[arg(long)]
    context_shift: bool,
    /// Tokens kept from the start by --context-shift.
    #[arg(long, default_value_t = 0)]
    keep: usize,
}

impl GenArgs {
    fn context(&self) -> les::engine::ContextMode {
        if self.context_shift {
            les::engine::ContextMode::Shift { n_keep: self.keep }
        } else {
            les::engine::ContextMode::Stop
        }
    }
}

#[derive(Subcommand)]
enum BenchCmd {
    /// The GPU cost model's constants measured on this machine's adapter (src/backend/wgpu/
    /// probe.rs): idle sync, one dispatch, a one-token matvec's bandwidth.
    GpuProbe {
        /// Weight type of the matvec timed (e.g. Q4_1, Q4_K, MXFP4).
        #[arg(long, default_value = "Q4_1")]
        r#type: String,
        /// Columns of the matrix timed (a model's n_embd).
        #[arg(long, default_value_t = 4096)]
        cols: usize,
        #[arg(long)]
        json: bool,
    },
    /// The ladder: resident → on-demand (no prefetch, LRU) → + lookahead → + packed bundle →
    /// + speculative, same prompts in one process, plus oracle and pure-I/O bounds from the
    /// recorded routing trace.
    Ladder {
        #[command(flatten)]
        m: ModelArgs,
        #[command(flatten)]
        s: StreamArgs,
        /// Bundle for the packed rung (made with `les pack` when missing).
        #[arg(long)]
        bundle: Option<String>,
        /// Tokens generated per prompt.
        #[arg(short = 'n', long, default_value_t = 32)]
        n_predict: usize,
        /// Number of prompts from tests/fixtures/prompts.txt (or --prompts FILE).
        #[arg(long, default_value_t = 4)]
        n_prompts: usize,
        #[arg(long, default_value = "tests/fixtures/prompts.txt")]
        prompts: String,
        /// Skip the resident rung (models larger than RAM).
        #[arg(long)]
        no_resident: bool,
        /// The + speculative rung's draft, as `les run` takes it (default: prompt lookup); its
        /// weights and cache come out of the budget.
        #[command(flatten)]
        spec: SpecArgs,
        /// A bundle with per-layer expert types (`les pack --mixed-precision` or
        /// `--expert-types`): adds the + mixed precision rung, and the + speculative rung then
        /// runs on it. Not lossless: check its quality with `les eval ppl`.
        #[arg(long)]
        mixed_bundle: Option<String>,
        /// The model packed with `les pack --order coactivation`: adds the + co-activation order
        /// rung after + bundle (the same bundle with its experts in another order on storage).
        #[arg(long)]
        coactivation_bundle: Option<String>,
        /// Each rung alone against on-demand (on-demand plus that one thing) instead of stacked.
        #[arg(long)]
        alone: bool,
    },
    /// Soak: many generations in one process under a budget; prints RSS and hit rate per run.
    Soak {
        #[command(flatten)]
        m: ModelArgs,
        #[command(flatten)]
        s: StreamArgs,
        /// Generations.
        #[arg(long, default_value_t = 100)]
        runs: usize,
        /// Tokens per generation.
        #[arg(short = 'n', long, default_value_t = 256)]
        n_predict: usize,
    },
    /// A three-turn chat (tests/fixtures/chat.txt: one user message per line), with and without
    /// reusing the previous turn's cache, interleaved: time to first token and MB of experts read
    /// during each turn's prefill.
    Chat {
        #[command(flatten)]
        m: ModelArgs,
        #[command(flatten)]
        s: StreamArgs,
        /// Tokens generated per reply.
        #[arg(short = 'n', long, default_value_t = 32)]
        n_predict: usize,
        /// Repetitions of the whole conversation, each mode in turn.
        #[arg(short = 'r', long, default_value_t = 2)]
        reps: usize,
        #[arg(long, default_value = "tests/fixtures/chat.txt")]
        messages: String,
    },
    /// What llama-bench measures, in its table format: prompt processing (`ppN`: N random tokens in
    /// one forward from an empty cache) and token generation (`tgN`: N single-token forwards
    /// from an empty cache), each repeated after a warm-up, t/s as mean ± sd.
    PpTg {
        #[command(flatten)]
        m: ModelArgs,
        #[command(flatten)]
        s: StreamArgs,
        /// Prompt lengths (llama-bench `-p`; 0 to skip).
        #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
        n_prompt: Vec<usize>,
        /// Generated tokens (llama-bench `-n`; 0 to skip).
        #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
        n_gen: Vec<usize>,
        /// Repetitions (llama-bench `-r`).
        #[arg(short = 'r', long, default_value_t = 5)]
        reps: usize,
        /// After each test, print the CPU forward's time per op (ms per token over the timed
        /// repetitions; `forward` is the whole pass, the ops' sum leaves host work between them).
        #[arg(long)]
        profile: bool,
    },
    /// Decode speed: a short prompt, then N greedy tokens; prints tokens/s.
    Decode {
        #[command(flatten)]
        m: ModelArgs,
        #[arg(short = 'n', long, default_value_t = 128)]
        n_predict: usize,
        /// Repetitions (the best is reported, plus the mean).
        #[arg(short = 'r', long, default_value_t = 3)]
        reps: usize,
        /// Print one JSON object (speeds, and on the GPU the calls per decode token after the
        /// first repetition's warm-up) instead of the text lines.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Output piped into `head` and the like: end quietly when the reader goes away, as C tools
    // do, instead of panicking in println! (Rust ignores SIGPIPE by default). Not for the server,
    // whose sockets must never end the process.
    #[cfg(unix)]
    if !matches!(cli.cmd, Cmd::Serve(_)) {
        // SAFETY: restoring a signal's default disposition before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("les: error: {e}");
            ExitCode::FAILURE
        }
    }
}

type Res = Result<(), Box<dyn std::error::Error>>;

fn open(m: &ModelArgs) -> Result<Session, Box<dyn std::error::Error>> {
    if let Some(t) = m.threads {
        les::backend::cpu::par::init_threads(t);
    }
    let src = FileSource::open(&m.model)?;
    let mut s = if les::expert::bundle::is_bundle(&src) {
        // A bundle's experts are not GGUF tensors: read them all through the expert cache.
        les::engine::stream::open_streaming(&m.model, &les::engine::stream::StreamOptions::every_expert(m.ctx_size))?.session
    } else {
        Session::load(&src, ExpertMode::Resident, m.ctx_size)?
    };
    m.apply_backend(&mut s)?;
    Ok(s)
}

fn run(cli: Cli) -> Res {
    match cli.cmd {
        Cmd::Run(a) => cmd_run(a),
        Cmd::Serve(a) => serve::cmd_serve(a),
        Cmd::Plan(a) => cmd_plan(a),
        Cmd::Inspect { path, full, device } => {
            if device {
                match les::backend::wgpu::GpuContext::new() {
                    Ok(c) => println!("{}", c.describe()),
                    Err(e) => println!("no GPU: {e}"),
                }
            }
            match path {
                Some(p) => cmd_inspect(&p, full),
                None => Ok(()),
            }
        }
        Cmd::Bench(BenchCmd::Decode { m, n_predict, reps, json }) => cmd_bench_decode(&m, n_predict, reps, json),
        Cmd::Bench(BenchCmd::GpuProbe { r#type, cols, json }) => (|| -> Res {
            let ty = les::quant::GgmlType::from_name(&r#type).ok_or_else(|| format!("unknown --type '{type}'", type = r#type))?;
            let ctx = les::backend::wgpu::GpuContext::new()?;
            let p = les::backend::wgpu::probe::probe(&ctx, ty, cols)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&p)?);
            } else {
                println!("les bench gpu-probe: {} | idle sync {:.3} ms | one dispatch {:.2} µs | {} matvec {:.2} GB/s", p.adapter, p.sync_ms, p.dispatch_us, p.matvec_type, p.bandwidth / 1e9);
            }
            Ok(())
        })(),
        Cmd::Bench(BenchCmd::PpTg { m, s, n_prompt, n_gen, reps, profile }) => cmd_bench_pp_tg(&m, &s, &n_prompt, &n_gen, reps, profile),
        Cmd::Bench(BenchCmd::Chat { m, s, n_predict, reps, messages }) => cmd_bench_chat(&m, &s, n_predict, reps, &messages),
        Cmd::Pack { input, output, expert_types, mixed_precision, target_bytes, calibration, calib_tokens, order, routes } => {
            let order = pack_order(&input, &order, &routes)?;
            if mixed_precision {
                let target = les::engine::stream::parse_bytes(target_bytes.as_deref().unwrap_or_default())?;
                let spec = choose_mixed(&input, target, &calibration, calib_tokens)?;
                cmd_pack(&input, &output, Some(&spec), &order)
            } else {
                cmd_pack(&input, &output, expert_types.as_deref(), &order)
            }
        }
        Cmd::Eval(EvalCmd::Ppl { m, text, chunk, base, json }) => {
            let body = std::fs::read_to_string(&text).map_err(|e| format!("{text}: {e}"))?;
            let mut sess = open(&ModelArgs { ctx_size: m.ctx_size.max(chunk), ..m.clone() })?;
            let mut b = match &base {
                Some(p) => Some(open(&ModelArgs { model: p.clone(), ctx_size: m.ctx_size.max(chunk), ..m.clone() })?),
                None => None,
            };
            let r = les::engine::eval::perplexity(&mut sess, b.as_mut(), &body, chunk)?;
            println!("les eval ppl: model {} | text {text} | {} chunks of {} tokens, {} scored | PPL {:.4} (NLL {:.5} nats/token)", m.model, r.chunks, r.n_ctx, r.scored, r.ppl, r.nll);
            if let (Some(kl), Some(same), Some(bp)) = (r.kl, r.same_top, r.base_ppl) {
                println!("  vs base {}: base PPL {:.4} | PPL ratio {:.4} | mean KL {:.6} nats/token | same top-1 {:.2}%", base.as_deref().unwrap_or(""), bp, r.ppl / bp, kl, 100.0 * same);
            }
            if let Some(p) = json {
                std::fs::write(p, serde_json::to_string_pretty(&r)?)?;
            }
            Ok(())
        }
        Cmd::Bench(BenchCmd::Soak { m, s, runs, n_predict }) => cmd_soak(&m, &s, runs, n_predict),
        Cmd::Bench(BenchCmd::Ladder { m, s, bundle, n_predict, n_prompts, prompts, no_resident, spec, mixed_bundle, coactivation_bundle, alone }) => {
            if let Some(t) = m.threads {
                les::backend::cpu::par::init_threads(t);
            }
            let budget = les::engine::stream::parse_bytes(s.memory_budget.as_deref().ok_or("bench ladder needs --memory-budget")?)?;
            let opts = m.stream_options(&s, budget)?;
            let text = std::fs::read_to_string(&prompts).map_err(|e| format!("{prompts}: {e}"))?;
            let ps: Vec<String> = text.lines().filter(|l| !l.trim().is_empty()).take(n_prompts).map(String::from).collect();
            let bundle = match bundle {
                Some(b) => b,
                None => {
                    let b = format!("{}.les", m.model.trim_end_matches(".gguf"));
                    if !std::path::Path::new(&b).exists() {
                        cmd_pack(&m.model, &b, None, &[])?;
                    }
                    b
                }
            };
            let spec = les::engine::ladder::Rungs { draft: spec.spec()?, draft_max: spec.draft_max, mixed_bundle, coactivation_bundle, alone };
            let backend = |sess: &mut Session, gpu_slots: Option<usize>| m.apply_backend_with(sess, gpu_slots.filter(|&n| n > 0));
            let mut rep = les::engine::ladder::run(&m.model, &bundle, &opts, &ps, n_predict, !no_resident, &spec, &backend)?;
            println!("{}", rep.table());
            // What makes the run reproducible, after the measurements (hashing reads the file).
            let a = &mut rep.artifacts;
            a.insert("command".into(), std::env::args().collect::<Vec<_>>().join(" "));
            a.insert("les_version".into(), env!("CARGO_PKG_VERSION").into());
            a.insert("commit".into(), git_commit().unwrap_or_else(|| "unknown".into()));
            a.insert("model_sha256".into(), sha256_file(&m.model).map_err(|e| format!("{}: {e}", m.model))?);
            a.insert("bundle".into(), bundle.clone());
            a.insert("prompts".into(), ps.join("\n"));
            a.insert("n_predict".into(), n_predict.to_string());
            if let Some(p) = &s.stats_json {
                std::fs::write(p, serde_json::to_string_pretty(&rep)?)?;
            }
            Ok(())
        }
    }
}

/// The commit of the working tree `les` runs in (`git rev-parse HEAD`, `+dirty` with local
/// changes); `None` outside a git checkout.
fn git_commit() -> Option<String> {
    let out = std::process::Command::new("git").args(["rev-parse", "HEAD"]).output().ok().filter(|o| o.status.success())?;
    let dirty = std::process::Command::new("git").args(["status", "--porcelain", "--untracked-files=no"]).output().ok().is_some_and(|o| !o.stdout.is_empty());
    Some(format!("{}{}", String::from_utf8_lossy(&out.stdout).trim(), if dirty { "+dirty" } else { "" }))
}

/// SHA-256 of a file (hex), read in 8 MiB pieces.
fn sha256_file(path: &str) -> std::io::Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// A session for `m`: every weight resident, or under `--memory-budget` with experts streamed
/// (less `reserve` bytes the caller needs for itself, e.g. a draft model). Returns the session
/// and, when streamed, its expert cache (for statistics).
/// [`open_session`] with a vision tower (`--mmproj`): under `--memory-budget` its weights and
/// encoder activations come out of the budget; when the budget cannot hold them beside the
/// model, the tower's matrices are read from storage at each use instead (the same bits).
fn open_session_with_tower(m: &ModelArgs, s: &StreamArgs, reserve: u64, mmproj: Option<&str>) -> Result<(Session, Option<BudgetControl>, Option<les::vision::Mmproj>), Box<dyn std::error::Error>> {
    let Some(p) = mmproj else {
        let (sess, ex) = open_session(m, s, reserve)?;
        return Ok((sess, ex, None));
    };
    let err = |e: &dyn std::fmt::Display| format!("--mmproj {p}: {e}");
    let file = std::sync::Arc::new(FileSource::open(p).map_err(|e| err(&e))?);
    let t0 = les::engine::now_ms();
    let (sess, ex, streamed) = match s.memory_budget {
        None => {
            let (sess, ex) = open_session(m, s, reserve)?;
            (sess, ex, false)
        }
        Some(_) => {
            let whole = les::vision::Mmproj::footprint(&*file, false).map_err(|e| err(&e))?;
            match open_session(m, s, reserve + whole) {
                Ok((sess, ex)) => (sess, ex, false),
                Err(e) if e.to_string().contains("minimum") || e.to_string().contains("reserved beside") => {
                    let least = les::vision::Mmproj::footprint(&*file, true).map_err(|e| err(&e))?;
                    let (sess, ex) = open_session(m, s, reserve + least)?;
                    eprintln!("les: the budget cannot hold the vision tower's {:.1} MiB beside the model: its matrices are read from storage at each image ({:.1} MiB reserved)", whole as f64 / 1048576.0, least as f64 / 1048576.0);
                    (sess, ex, true)
                }
                Err(e) => return Err(e),
            }
        }
    };
    let stream = streamed.then(|| file.clone() as std::sync::Arc<dyn les::store::ByteSource>);
    let mp = les::vision::Mmproj::load_with(&*file, stream).map_err(|e| err(&e))?;
    if mp.n_embd_out != sess.model.cfg.n_embd {
        return Err(err(&les::vision::VisionError::Width { mmproj: mp.n_embd_out, text: sess.model.cfg.n_embd }).into());
    }
    sess.markers().map_err(|e| err(&e))?;
    eprintln!("les: vision tower {p}: {}, {:.1} MiB of weights in memory, loaded in {:.0} ms", mp.cfg.projector, mp.bytes as f64 / 1048576.0, les::engine::now_ms() - t0);
    Ok((sess, ex, Some(mp)))
}

/// Open the model: resident, or streamed under `--memory-budget` (less `reserve`, held beside the
/// model), with the `--adapt-budget` watchdog when asked; the budget's control for streamed
/// sessions.
fn open_session(m: &ModelArgs, s: &StreamArgs, reserve: u64) -> Result<(Session, Option<BudgetControl>), Box<dyn std::error::Error>> {
    let Some(b) = &s.memory_budget else { return Ok((open(m)?, None)) };
    if let Some(t) = m.threads {
        les::backend::cpu::par::init_threads(t);
    }
    let budget = les::engine::stream::parse_bytes(b)?;
    let budget = budget.checked_sub(reserve).ok_or_else(|| format!("--memory-budget {b} is smaller than the {:.1} MiB reserved beside the model", reserve as f64 / 1048576.0))?;
    let opts = m.stream_options(s, budget)?;
    let st = match les::engine::stream::open_streaming(&m.model, &opts) {
        // `auto` found a GPU, but the budget cannot hold the dense weights the GPU needs: the CPU
        // backend can read some of them from storage.
        Err(les::engine::stream::OpenError::Budget(_)) if opts.gpu_pool && m.backend == les::backend::BackendKind::Auto => {
            les::engine::stream::open_streaming(&m.model, &les::engine::stream::StreamOptions { gpu_pool: false, ..opts })?
        }
        r => r?,
    };
    let (cpu_slots, gpu_slots) = (st.experts.config().slots, st.plan.gpu_slots);
    let all = cpu_slots + gpu_slots;
    eprintln!(
        "les: budget {:.0} MiB = dense {:.1} MiB{} + KV {:.1} MiB + scratch {:.1} MiB + {} expert slots{} ({:.1} MiB, {:.1}% of {:.1} MiB of experts); store {} {}",
        st.plan.budget as f64 / 1048576.0,
        st.plan.dense as f64 / 1048576.0,
        if st.plan.dense_streamed > 0 {
            format!(" (of which {:.1} MiB read-ahead; {:.1} MiB more read from storage at each use)", st.plan.dense_window as f64 / 1048576.0, st.plan.dense_streamed as f64 / 1048576.0)
        } else {
            String::new()
        },
        st.plan.kv as f64 / 1048576.0,
        st.plan.scratch as f64 / 1048576.0,
        all,
        if gpu_slots > 0 { format!(" = {gpu_slots} on the GPU + {cpu_slots} CPU staging") } else { String::new() },
        (all as u64 * st.plan.expert_bytes_max) as f64 / 1048576.0,
        100.0 * (all as u64 * st.plan.expert_bytes_max) as f64 / st.plan.total_expert_bytes.max(1) as f64,
        st.plan.total_expert_bytes as f64 / 1048576.0,
        st.store_kind,
        s.store
    );
    let les::engine::stream::Streaming { mut session, budget, .. } = st;
    m.apply_backend_with(&mut session, Some(if gpu_slots > 0 { gpu_slots } else { cpu_slots }))?;
    let budget = budget.with_reserve(reserve).with_gpu_pool(session.gpu.as_ref().and_then(|g| g.expert_pool()));
    if s.adapt_budget {
        adapt_budget(&budget)?;
    }
    Ok((session, Some(budget)))
}

/// `--adapt-budget`: a watchdog that follows the memory available to the process for the rest
/// of the run (`les::engine::pressure`).
fn adapt_budget(budget: &BudgetControl) -> Res {
    use les::engine::pressure::{available_memory, AdaptRule, Watchdog};
    if available_memory().is_none() {
        return Err("--adapt-budget: this system does not say how much memory is available (Linux: /proc/meminfo, memory cgroups)".into());
    }
    let rule = AdaptRule::for_budget(budget.budget(), budget.minimum());
    let mib = |b: u64| b as f64 / 1048576.0;
    eprintln!("les: --adapt-budget: below {:.0} MiB free the budget shrinks (to {:.0} MiB at least), above {:.0} MiB it grows back (to {:.0} MiB at most)", mib(rule.low), mib(rule.minimum), mib(rule.high), mib(rule.target));
    let ctl = budget.clone();
    let log = move |old: u64, new: u64, free: u64| eprintln!("les: memory budget {:.0} → {:.0} MiB ({:.0} MiB free; {} expert slots)", mib(old), mib(new), mib(free), ctl.plan().slots);
    // Lives as long as the process.
    std::mem::forget(Watchdog::spawn(budget.clone(), rule, std::time::Duration::from_millis(250), available_memory, log)?);
    Ok(())
}

fn cmd_run(a: RunArgs) -> Res {
    // A draft model or an MTP block comes out of the same budget; so does a vision tower (its
    // weights and the encoder's activations).
    let reserve = a.sp.reserve(&a.m, &a.s)?;
    if a.mmproj.is_none() && !a.image.is_empty() {
        return Err("--image needs --mmproj FILE (the model's vision tower)".into());
    }
    if a.sp.any() && a.g.context_shift {
        return Err("--context-shift is not supported with speculative decoding (--draft-model, --lookup, --mtp)".into());
    }
    let (mut sess, budget, tower) = open_session_with_tower(&a.m, &a.s, reserve, a.mmproj.as_deref())?;
    let streaming = budget.as_ref().map(|b| b.experts().clone());
    let (mut draft, gamma) = a.sp.open(&a.m, &a.s, &mut sess)?;
    let probe_ex = streaming.clone();
    let probe = move || {
        probe_ex.as_ref().map(|e| {
            let s = e.stats();
            (s.demand_loads + s.prefetch_loads, s.bytes_read)
        }).unwrap_or((0, 0))
    };
    let spec = Spec { draft: draft.as_deref_mut().map(|d| d as &mut dyn Draft), gamma, io: if streaming.is_some() { Some(&probe) } else { None } };
    let r = cmd_run_inner(&a, &mut sess, spec, tower.as_ref());
    if let Some(g) = &sess.gpu {
        let st = g.stats();
        eprintln!("les: wgpu per decode token ({} tokens): {}", st.decode_forwards, st.per_token());
    }
    if let Some(ex) = &streaming {
        let st = ex.stats();
        eprintln!(
            "les: experts: hit rate {:.1}% | {:.2} MB read/token | stall {:.2} ms/token | recall@1 {:.1}% | I/O busy {:.0}%",
            100.0 * st.hit_rate(),
            st.bytes_per_token() / 1e6,
            st.stall_ms_per_token(),
            100.0 * st.recall(1),
            100.0 * st.io_busy_fraction(ex.config().io_threads)
        );
        if let Some(ra) = sess.model.weights.read_ahead() {
            let d = ra.stats();
            eprintln!(
                "les: dense weights read from storage: {:.2} MB read/token | pieces read ahead {:.1}% (waited for {:.1}%)",
                d.bytes_read as f64 / st.tokens.max(1) as f64 / 1e6,
                100.0 * (d.gets - d.misses) as f64 / d.gets.max(1) as f64,
                100.0 * d.waits as f64 / d.gets.max(1) as f64
            );
        }
        if let (Some(share), Some(g)) = (st.prefetch_on_share(), &st.governor) {
            let ms = |v: Option<f64>| v.map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into());
            eprintln!(
                "les: prefetch governor: on for {:.0}% of measured tokens, now {} | last block: {} ms/token on, {} off | estimate {} | {} switches",
                100.0 * share,
                if ex.prefetching() { "on" } else { "off" },
                ms(g.last_on_ms),
                ms(g.last_off_ms),
                g.estimate.map(|e| format!("{:+.1}%", 100.0 * e)).unwrap_or_else(|| "-".into()),
                g.switches
            );
        }
        if let Some(r) = st.exact_recall() {
            eprintln!("les: exact lookahead (experts named before their layer ran): recall {:.1}%, {} named", 100.0 * r, st.exact_pred_made);
        }
        if let (Some(r), Some(p)) = (st.refine_recall(), st.refine_precision()) {
            eprintln!("les: refined l+1 predictions (from layer l's partial output): recall {:.1}%, precision {:.1}%", 100.0 * r, 100.0 * p);
        }
        if let (Some(r), Some(p)) = (st.draft_recall(), st.draft_precision()) {
            eprintln!("les: experts predicted from the draft's hidden states: recall {:.1}%, precision {:.1}%", 100.0 * r, 100.0 * p);
        }
        if let Some(p) = &a.s.stats_json {
            std::fs::write(p, serde_json::to_string_pretty(&st)?)?;
        }
        if let Some(p) = &a.s.trace {
            let ev = ex.take_trace();
            std::fs::write(p, serde_json::to_string(&serde_json::json!({ "traceEvents": ev, "displayTimeUnit": "ms" }))?)?;
        }
        if let Some(p) = &a.s.routes {
            std::fs::write(p, serde_json::to_string(&ex.take_route_log())?)?;
        }
    }
    r
}

/// Speculative decoding settings of `les run`.
struct Spec<'a> {
    draft: Option<&'a mut (dyn Draft + 'static)>,
    gamma: usize,
    io: Option<speculative::IoProbe<'a>>,
}

fn cmd_run_inner(a: &RunArgs, sess: &mut Session, mut spec: Spec<'_>, tower: Option<&les::vision::Mmproj>) -> Res {
    let sess = sess;
    let sampler = SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        seed: a.seed,
        ..Default::default()
    };
    let mut prompts: Vec<String> = Vec::new();
    if a.chat {
        // Each turn re-renders the conversation; only what the cache lacks is run.
        sess.reuse_prefix = true;
        if let Some(f) = &a.chat_template_file {
            sess.chat_template = Some(std::fs::read_to_string(f).map_err(|e| format!("--chat-template-file {f}: {e}"))?);
        }
        let mut history = Vec::new();
        for line in std::io::stdin().lock().lines() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            history.push(Message { role: "user".into(), content: line });
            let p = sess.chat_prompt(&history)?;
            let toks = sess.tokenize(&p);
            let reply = generate_one(sess, toks, a, &sampler, &mut spec)?;
            // gpt-oss: the conversation keeps the final answer, not the harmony headers or the
            // reasoning (its template refuses `<|channel|>` in a message).
            let reply = les::engine::chat::split_harmony(&reply).map(|(_, content)| content).unwrap_or(reply);
            history.push(Message { role: "assistant".into(), content: reply });
            println!();
        }
        return Ok(());
    }
    let from_file = match &a.prompt_file {
        Some(f) => Some(std::fs::read_to_string(f).map_err(|e| format!("--file {}: {e}", f.display()))?),
        None => None,
    };
    match (a.prompt.as_ref().or(from_file.as_ref()), tower) {
        (Some(p), Some(mp)) => return run_images(sess, p, mp, a, &sampler, &mut spec),
        (Some(p), None) => prompts.push(p.clone()),
        (None, _) => return Err("give --prompt TEXT, --file FILE or --chat".into()),
    }
    for p in prompts {
        let toks = sess.tokenize(&p);
        generate_one(sess, toks, a, &sampler, &mut spec)?;
    }
    Ok(())
}

/// `les run --mmproj F --image F -p TEXT`: the prompt as `llama-mtmd-cli -p` builds it (one
/// user message through the chat template, the images' markers first unless the text places
/// them), the images encoded, every chunk run, then generation.
fn run_images(sess: &mut Session, prompt: &str, mp: &les::vision::Mmproj, a: &RunArgs, sampler: &SamplerConfig, spec: &mut Spec<'_>) -> Res {
    if spec.draft.is_some() {
        return Err("--image is not supported with speculative decoding (--draft-model, --lookup, --mtp) yet".into());
    }
    let mut images = Vec::new();
    for f in &a.image {
        images.push(std::fs::read(f).map_err(|e| format!("--image {f}: {e}"))?);
    }
    let marker = les::vision::layout::MARKER;
    let content = if prompt.contains(marker) { prompt.to_string() } else { format!("{}{prompt}", marker.repeat(images.len())) };
    let text = sess.chat_prompt(&[Message { role: "user".into(), content }])?;
    let p = sess.mm_prompt(mp, &text, &images)?;
    let run = sess.prefill_mm(mp, &p)?;
    eprintln!(
        "les: {} image(s): {} embedding rows; {} pieces encoded in {:.0} ms; prompt of {} positions run in {:.0} ms",
        images.len(),
        p.image_rows,
        run.encoded,
        run.encode_ms,
        run.tokens.len() - 1 - run.reused,
        run.ms
    );
    let toks = run.tokens;
    let was = sess.reuse_prefix;
    sess.reuse_prefix = true;
    let r = generate_one_with(sess, toks, a, sampler, spec, Some((run.reused, run.ms)));
    sess.reuse_prefix = was;
    r.map(|_| ())
}

fn generate_one(sess: &mut Session, toks: Vec<u32>, a: &RunArgs, sampler: &SamplerConfig, spec: &mut Spec<'_>) -> Result<String, Box<dyn std::error::Error>> {
    generate_one_with(sess, toks, a, sampler, spec, None)
}

/// [`generate_one`] after a prefill of all but the last token (`pre`: positions reused from the
/// cache before it, its time in ms), which the prompt line then counts.
fn generate_one_with(sess: &mut Session, toks: Vec<u32>, a: &RunArgs, sampler: &SamplerConfig, spec: &mut Spec<'_>, pre: Option<(usize, f64)>) -> Result<String, Box<dyn std::error::Error>> {
    let mut out = std::io::stdout().lock();
    let mut text = String::new();
    let mut on_text = |_, s: &str| {
        text.push_str(s);
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
        true
    };
    let (ids, st, spec_st) = match spec.draft.as_deref_mut() {
        None => {
            let o = les::engine::GenOptions { n: a.n_predict, sampler: sampler.clone(), ignore_eos: a.ignore_eos, stop: a.g.stop.clone(), context: a.g.context() };
            let (ids, st) = sess.generate_with(&toks, &o, &mut on_text)?;
            (ids, st, None)
        }
        Some(d) => {
            let o = SpecOptions { draft_max: spec.gamma, io: spec.io, verify_first: false };
            let g = les::engine::GenOptions { n: a.n_predict, sampler: sampler.clone(), ignore_eos: a.ignore_eos, stop: a.g.stop.clone(), context: a.g.context() };
            let (ids, st, sp) = speculative::generate_with(sess, Some(d), &o, &toks, &g, &mut on_text)?;
            (ids, st, Some(sp))
        }
    };
    if let Some(p) = &a.tokens_out {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(p)?;
        writeln!(f, "{}", serde_json::to_string(&ids)?)?;
    }
    let mem = memory_usage().map(|(_, peak)| format!(", peak memory {:.1} MiB", peak as f64 / 1048576.0)).unwrap_or_default();
    let (reused, prompt_tps) = match pre {
        Some((reused, ms)) => (reused, (st.prompt_tokens - reused) as f64 / ((ms + st.prompt_ms) / 1000.0).max(1e-9)),
        None => (st.prompt_reused, st.prompt_tps()),
    };
    eprintln!(
        "\nles: prompt {} tokens{}, {:.1} tokens/s | decode {} tokens, {:.1} tokens/s{}",
        st.prompt_tokens,
        if reused > 0 { format!(" ({reused} reused from the cache)") } else { String::new() },
        prompt_tps,
        st.gen_tokens,
        st.gen_tps(),
        mem
    );
    if let Some(sp) = spec_st {
        eprintln!("les: {}", sp.line());
    }
    Ok(text)
}

fn human(b: u64) -> String {
    let f = b as f64;
    if f >= 1073741824.0 {
        format!("{:.2} GiB", f / 1073741824.0)
    } else if f >= 1048576.0 {
        format!("{:.2} MiB", f / 1048576.0)
    } else if f >= 1024.0 {
        format!("{:.1} KiB", f / 1024.0)
    } else {
        format!("{b} B")
    }
}

fn cmd_inspect(path: &str, full: bool) -> Res {
    let src = FileSource::open(path)?;
    if les::expert::bundle::is_bundle(&src) {
        return cmd_inspect_bundle(path, full);
    }
    let g = GgufFile::read(&src)?;
    inspect_gguf(path, &g, full)
}

/// A bundle: its expert section per MoE layer (types, bytes per expert), then the dense GGUF.
fn cmd_inspect_bundle(path: &str, full: bool) -> Res {
    let b = les::expert::bundle::Bundle::open(std::sync::Arc::new(FileSource::open(path)?))?;
    let m = b.manifest();
    let mut o = std::io::stdout().lock();
    let total: u64 = m.blocks.iter().map(|x| x.size).sum();
    writeln!(o, "bundle: {path}
source: {} ({} bytes)
MoE layers: {} | experts per layer: {} | expert bytes: {} ({})", m.source_name, m.source_size, m.layouts.len(), m.n_expert, total, human(total))?;
    writeln!(o, "\n== expert types per layer (layer-wise mixed precision)\n{:<6} {:<6} {:<6} {:<6} {:>14} {:>12}", "layer", "gate", "up", "down", "bytes/expert", "layer bytes")?;
    for (i, l) in m.layouts.iter().enumerate() {
        writeln!(o, "{:<6} {:<6} {:<6} {:<6} {:>14} {:>12}", m.layer_blk[i], l.gate_ty.name(), l.up_ty.name(), l.down_ty.name(), l.bytes(), human(l.bytes() as u64 * m.n_expert as u64))?;
    }
    writeln!(o, "\n== dense part (embedded GGUF)")?;
    drop(o);
    let dense = b.dense_source();
    let g = GgufFile::read(&dense)?;
    inspect_gguf(&format!("{path} (dense part)"), &g, full)
}

fn inspect_gguf(path: &str, g: &GgufFile, full: bool) -> Res {
    let mut o = std::io::stdout().lock();
    writeln!(o, "file: {path}\nsize: {} ({} bytes)\nGGUF version: {}\ntensors: {}\nmetadata: {} keys\nalignment: {}\ndata offset: {}", human(g.file_size), g.file_size, g.version, g.tensors.len(), g.metadata.len(), g.alignment, g.data_offset)?;
    writeln!(o, "\n== metadata")?;
    for (k, v) in &g.metadata {
        let s = if full { format!("{v:?}") } else { v.display_short() };
        writeln!(o, "{k:<45} {:<7} {s}", v.type_name())?;
    }
    writeln!(o, "\n== tensors\n{:<40} {:<7} {:<24} {:>12}", "name", "type", "shape", "bytes")?;
    for t in &g.tensors {
        writeln!(o, "{:<40} {:<7} {:<24} {:>12}", t.name, t.ty.name(), format!("{:?}", t.dims), t.size)?;
    }
    let cfg = les::model::Config::from_gguf(g);
    if let Err(e) = &cfg {
        writeln!(o, "\n== model\nnot runnable by LES: {e}")?;
    }
    if let Ok(cfg) = cfg {
        writeln!(o, "\n== model\narch {} | n_embd {} | n_layer {} | n_head {} | n_head_kv {} | head_dim {} | n_rot {} | n_ff {} | n_vocab {} | rope {:?} base {}", cfg.arch.name(), cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rot, cfg.n_ff, cfg.n_vocab, cfg.rope, cfg.rope_base)?;
        if cfg.n_swa > 0 {
            let swa: Vec<String> = (0..cfg.n_layer).filter(|&il| cfg.is_swa(il)).map(|il| il.to_string()).collect();
            writeln!(o, "sliding window {} on layers {} (RoPE base {} there); the others see every position", cfg.n_swa, swa.join(","), cfg.rope_base_swa)?;
        }
        let nope: Vec<String> = (0..cfg.n_layer).filter(|&il| cfg.is_nope(il)).map(|il| il.to_string()).collect();
        if !nope.is_empty() {
            writeln!(o, "no RoPE (NoPE) on layers {}", nope.join(","))?;
        }
        if cfg.routes_early() {
            writeln!(o, "router before attention: each layer's experts are known when the layer starts (exact lookahead)")?;
        }
        if let Some(y) = cfg.yarn {
            writeln!(o, "RoPE scaling: freq_scale {} (factor {}) | ext_factor {} | attn_factor {} | original context {} | beta {} / {}", y.freq_scale, 1.0 / y.freq_scale, y.ext_factor, y.attn_factor, y.n_ctx_orig, y.beta_fast, y.beta_slow)?;
        }
        if cfg.gating != les::model::config::Gating::Softmax || cfg.expert_act != les::backend::ops::ExpertAct::Silu {
            writeln!(o, "router gating {:?} | expert activation {:?}", cfg.gating, cfg.expert_act)?;
        }
        // What a context costs (the CPU cache): f16 keys and values of the full-attention layers
        // grow with it; the recurrent state of a hybrid and the cells of a sliding window do not
        // (once the context is longer than the window's cells).
        let far = 1usize << 24;
        let per_1k = cfg.cache_bytes(far + 1024) - cfg.cache_bytes(far);
        let fixed = cfg.cache_bytes(far) - far / 1024 * per_1k;
        let n_swa = (0..cfg.n_layer).filter(|&il| !cfg.is_recurrent(il) && cfg.window(il) > 0).count();
        let what = match (cfg.ssm.is_some(), n_swa) {
            (true, _) => " (recurrent state and its checkpoint)".to_string(),
            (false, 0) => String::new(),
            (false, n) => {
                use les::backend::cpu::kv::{swa_cells, SWA_ALIGN, SWA_KEEP, UBATCH};
                format!(" ({n} sliding-window layers of {} cells: window {} + batch {UBATCH} + rollback {SWA_KEEP} + alignment {SWA_ALIGN})", swa_cells(cfg.n_swa, far), cfg.n_swa)
            }
        };
        let fixed_s = if fixed > 0 { format!(" + {} ({fixed} bytes) fixed{what}", human(fixed as u64)) } else { String::new() };
        writeln!(o, "context memory: {} ({per_1k} bytes) per 1k tokens (f16 keys and values of {} full-attention layers){fixed_s}", human(per_1k as u64), cfg.n_attn_layers() - n_swa)?;
        if let Some(s) = cfg.ssm {
            let pattern: String = (0..cfg.n_layer).map(|il| if cfg.is_recurrent(il) { 'L' } else { 'A' }).collect();
            let list = |rec: bool| (0..cfg.n_layer).filter(|&il| cfg.is_recurrent(il) == rec).map(|il| il.to_string()).collect::<Vec<_>>().join(",");
            let n_rec = cfg.n_layer - cfg.n_attn_layers();
            let per_layer = (s.conv_state_len() + s.ssm_state_len()) * 4;
            let kv_tok = 2 * cfg.n_attn_layers() * cfg.n_head_kv * cfg.head_dim * 2;
            writeln!(o, "\n== layers (L: Gated DeltaNet, A: full attention)\npattern: {pattern}\nlinear layers ({n_rec}): {}\nattention layers ({}): {}\nGated DeltaNet: d_conv {} | state size S {} | key heads {} | value heads {} | inner {} | v->k heads {:?}\nrecurrent state per sequence: {} ({} per linear layer: conv {} + delta-rule {} f32 values)\nKV cache per token (f16, attention layers only): {}",
                list(true), cfg.n_attn_layers(), list(false), s.d_conv, s.d_state, s.n_group, s.dt_rank, s.d_inner, s.head_map,
                human((per_layer * n_rec) as u64), human(per_layer as u64), s.conv_state_len(), s.ssm_state_len(), human(kv_tok as u64))?;
        }
        if let (Some(l), true) = (cfg.shortconv, cfg.has_recurrent()) {
            let pattern: String = (0..cfg.n_layer).map(|il| if cfg.is_recurrent(il) { 'C' } else { 'A' }).collect();
            let n_rec = cfg.n_layer - cfg.n_attn_layers();
            let per_layer = (l - 1) * cfg.n_embd * 4;
            writeln!(o, "\n== layers (C: short convolution, A: attention; the first {} with a dense FFN)\npattern: {pattern}\nshort convolution: L {l}\nrecurrent state per sequence: {} ({} per conv layer: {} f32 values)",
                cfg.n_dense_lead, human((per_layer * n_rec) as u64), human(per_layer as u64), (l - 1) * cfg.n_embd)?;
        }
        if cfg.is_moe() && g.tensors.iter().any(|t| t.name.contains("_exps.")) {
            let mut per_expert = 0u64;
            let mut expert_total = 0u64;
            for il in 0..cfg.n_layer {
                if let Ok(t) = les::expert::GgufExpertTensors::find(g, il, cfg.n_embd, cfg.n_expert) {
                    per_expert = t.layout.bytes() as u64;
                    expert_total += per_expert * cfg.n_expert as u64;
                }
            }
            let total: u64 = g.tensors.iter().map(|t| t.size).sum();
            let n_moe = cfg.n_moe_layers() as u64;
            writeln!(o, "\n== experts\nexperts per layer (n_expert): {}\nused per token (n_expert_used): {}\nexpert n_ff: {}\nbytes per expert (gate+up+down): {} ({})\ntotal expert bytes: {} ({})\ndense bytes: {} ({})\nexpert bytes per token at 0% hit rate: {} ({})",
                cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, per_expert, human(per_expert), expert_total, human(expert_total), total - expert_total, human(total - expert_total),
                per_expert * cfg.n_expert_used as u64 * n_moe, human(per_expert * cfg.n_expert_used as u64 * n_moe))?;
        }
    }
    Ok(())
}

fn cmd_soak(m: &ModelArgs, s: &StreamArgs, runs: usize, n: usize) -> Res {
    if let Some(t) = m.threads {
        les::backend::cpu::par::init_threads(t);
    }
    let budget = les::engine::stream::parse_bytes(s.memory_budget.as_deref().ok_or("bench soak needs --memory-budget")?)?;
    let mut st = les::engine::stream::open_streaming(&m.model, &m.stream_options(s, budget)?)?;
    let gpu_slots = st.plan.gpu_slots;
    m.apply_backend_with(&mut st.session, (gpu_slots > 0).then_some(gpu_slots))?;
    let prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):", "The three primary colors are"];
    let mut first_rss = 0u64;
    let mut max_dev = 0f64;
    let mut peak = 0u64;
    for r in 0..runs {
        st.experts.reset_stats();
        let toks = st.session.tokenize(prompts[r % prompts.len()]);
        let (_, g) = st.session.generate(&toks, n, &SamplerConfig::greedy(), true, &mut |_, _| true)?;
        let (rss, hwm) = memory_usage().unwrap_or((0, 0));
        peak = peak.max(hwm);
        if r == 0 {
            first_rss = rss;
        } else {
            max_dev = max_dev.max((rss as f64 - first_rss as f64).abs() / first_rss.max(1) as f64);
        }
        let x = st.experts.stats();
        println!("run {:>3}: {:>4} tokens {:>7.2} tok/s | RSS {:>7.1} MiB | hit rate {:>5.1}%", r + 1, g.gen_tokens, g.gen_tps(), rss as f64 / 1048576.0, 100.0 * x.hit_rate());
    }
    println!(
        "soak: {runs} runs x {n} tokens | budget {:.0} MiB | peak RSS {:.1} MiB | RSS after run 1 {:.1} MiB, max deviation after it {:.2}%",
        budget as f64 / 1048576.0,
        peak as f64 / 1048576.0,
        first_rss as f64 / 1048576.0,
        100.0 * max_dev
    );
    Ok(())
}

/// `les pack --mixed-precision`: measure, choose, print the choice; returns an --expert-types SPEC.
fn choose_mixed(input: &str, target: u64, calibration: &str, n_tok: usize) -> Result<String, Box<dyn std::error::Error>> {
    use les::engine::mixed;
    let text = std::fs::read_to_string(calibration).map_err(|e| format!("{calibration}: {e}"))?;
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(indicatif::ProgressStyle::with_template("sensitivity {bar:40} {pos}/{len} layer x type, eta {eta}").unwrap());
    let s = mixed::measure(input, &text, n_tok, &mut |d, t| {
        bar.set_length(t as u64);
        bar.set_position(d as u64);
    })?;
    bar.finish_and_clear();
    let pick = mixed::choose(&s, target)?;
    let orig: u64 = s.layers.iter().map(|o| o[0].bytes_per_expert as u64 * s.n_expert as u64).sum();
    let got: u64 = s.layers.iter().zip(&pick).map(|(o, &p)| o[p].bytes_per_expert as u64 * s.n_expert as u64).sum();
    let kl: f64 = s.layers.iter().zip(&pick).map(|(o, &p)| o[p].kl).sum();
    eprintln!("les pack: mixed precision on {} calibration tokens: expert bytes {} -> {} ({:.1}% smaller; target {}), summed per-layer KL {:.4} nats/token", s.calibration_tokens, human(orig), human(got), 100.0 * (1.0 - got as f64 / orig as f64), human(target), kl);
    eprintln!("{:<6} {:<18} {:>12} {:>10}", "layer", "gate,up,down", "bytes/exp", "KL");
    for (l, (o, &p)) in s.layers.iter().zip(&pick).enumerate() {
        let c = &o[p];
        eprintln!("{l:<6} {:<18} {:>12} {:>10.5}", c.types.map(|t| t.name()).join(","), c.bytes_per_expert, c.kl);
    }
    Ok(s.layers.iter().zip(&pick).enumerate().map(|(l, (o, &p))| format!("{l}:{}", o[p].types.map(|t| t.name()).join(","))).collect::<Vec<_>>().join(";"))
}

/// `--expert-types SPEC` of `les pack` for a model of `n_layers` MoE layers.
fn parse_expert_types(spec: &str, n_layers: usize) -> Result<Vec<les::expert::bundle::ExpertTypes>, String> {
    use les::quant::GgmlType;
    let tys = |s: &str| -> Result<[GgmlType; 3], String> {
        let v: Vec<GgmlType> = s.split(',').map(|t| GgmlType::from_name(t.trim()).ok_or_else(|| format!("unknown ggml type '{}' in --expert-types", t.trim()))).collect::<Result<_, _>>()?;
        <[GgmlType; 3]>::try_from(v).map_err(|_| format!("'{s}': give three types, GATE,UP,DOWN"))
    };
    let mut out = vec![None; n_layers];
    if !spec.contains(':') {
        out.fill(Some(tys(spec)?));
        return Ok(out);
    }
    for part in spec.split(';').filter(|p| !p.trim().is_empty()) {
        let (layers, t) = part.split_once(':').ok_or_else(|| format!("'{part}': expected LAYERS:GATE,UP,DOWN"))?;
        let t = tys(t)?;
        let num = |x: &str| x.trim().parse::<usize>().map_err(|_| format!("'{x}' is not a layer number"));
        let (a, b) = match layers.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(layers)?, num(layers)?),
        };
        if a > b || b >= n_layers {
            return Err(format!("layers {a}-{b}: the model has MoE layers 0-{}", n_layers.saturating_sub(1)));
        }
        out[a..=b].fill(Some(t));
    }
    Ok(out)
}

/// `les pack --order`: per MoE layer, the experts in storage order (empty: their own order).
fn pack_order(input: &str, order: &str, routes: &[String]) -> Result<Vec<Vec<usize>>, Box<dyn std::error::Error>> {
    if order == "index" {
        if !routes.is_empty() {
            return Err("--routes is for --order coactivation".into());
        }
        return Ok(Vec::new());
    }
    if routes.is_empty() {
        return Err("--order coactivation needs --routes FILE... (routing traces from les run --routes)".into());
    }
    let g = les::gguf::GgufFile::read(&FileSource::open(input)?)?;
    let c = les::model::Config::from_gguf(&g)?;
    let traces = routes
        .iter()
        .map(|p| -> Result<Vec<(u32, u32)>, Box<dyn std::error::Error>> {
            let t: Vec<(u32, u32)> = serde_json::from_str(&std::fs::read_to_string(p).map_err(|e| format!("--routes {p}: {e}"))?).map_err(|e| format!("--routes {p}: not a routing trace: {e}"))?;
            match t.iter().find(|&&(l, e)| l as usize >= c.n_layer || e as usize >= c.n_expert) {
                Some((l, e)) => Err(format!("--routes {p}: [{l}, {e}] is outside this model's {} layers × {} experts", c.n_layer, c.n_expert).into()),
                None => Ok(t),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(les::expert::coactivation::coactivation_order(&traces, c.n_layer, c.n_expert))
}

fn cmd_pack(input: &str, output: &str, expert_types: Option<&str>, order: &[Vec<usize>]) -> Res {
    let src = FileSource::open(input)?;
    let types = match expert_types {
        Some(spec) => {
            let g = les::gguf::GgufFile::read(&src)?;
            let c = les::model::Config::from_gguf(&g)?;
            parse_expert_types(spec, c.n_layer)?
        }
        None => Vec::new(),
    };
    let tmp = format!("{output}.part");
    let mut f = std::fs::File::create(&tmp).map_err(|e| format!("cannot create {tmp}: {e}"))?;
    let bar = indicatif::ProgressBar::new(src.len());
    bar.set_style(indicatif::ProgressStyle::with_template("packing {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}").unwrap());
    let name = std::path::Path::new(input).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let r = les::expert::bundle::pack_ordered(&src, &name, &types, order, &mut f, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    match r {
        Ok(sum) => {
            f.sync_all()?;
            std::fs::rename(&tmp, output)?;
            eprintln!("les pack: {input} -> {output}: {sum:?}");
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e.into())
        }
    }
}

fn cmd_bench_chat(m: &ModelArgs, s: &StreamArgs, n: usize, reps: usize, messages: &str) -> Res {
    let users: Vec<String> = std::fs::read_to_string(messages)?.lines().filter(|l| !l.trim().is_empty()).map(String::from).collect();
    let (mut sess, budget) = open_session(m, s, 0)?;
    let experts = budget.as_ref().map(|b| b.experts().clone());
    println!("les bench chat: model {} | {} turns, {n} tokens per reply, greedy | budget {}", m.model, users.len(), s.memory_budget.as_deref().unwrap_or("none (resident)"));
    println!("{:<4} {:<9} {:>5} {:>14} {:>8} {:>10} {:>12}", "rep", "reuse", "turn", "prompt tokens", "reused", "TTFT ms", "prefill MB");
    for rep in 0..reps.max(1) {
        for reuse in [false, true] {
            sess.reset();
            sess.reuse_prefix = reuse;
            let mut history: Vec<Message> = Vec::new();
            for (turn, u) in users.iter().enumerate() {
                history.push(Message { role: "user".into(), content: u.clone() });
                let toks = sess.tokenize(&sess.chat_prompt(&history)?);
                if let Some(e) = &experts {
                    e.reset_stats();
                }
                let mut prefill_bytes = None;
                let mut reply = String::new();
                let ex = experts.clone();
                let o = les::engine::GenOptions { n, sampler: SamplerConfig::greedy(), ..Default::default() };
                let (_, st) = sess.generate_with(&toks, &o, &mut |_, t| {
                    // The first token comes from the prefill's logits: what was read so far is the prefill's.
                    if prefill_bytes.is_none() {
                        prefill_bytes = Some(ex.as_ref().map(|e| e.stats().bytes_read).unwrap_or(0));
                    }
                    reply.push_str(t);
                    true
                })?;
                history.push(Message { role: "assistant".into(), content: reply });
                println!(
                    "{:<4} {:<9} {:>5} {:>14} {:>8} {:>10.1} {:>12}",
                    rep + 1,
                    if reuse { "on" } else { "off" },
                    turn + 1,
                    st.prompt_tokens,
                    st.prompt_reused,
                    st.prompt_ms,
                    experts.as_ref().map(|_| format!("{:.1}", prefill_bytes.unwrap_or(0) as f64 / 1e6)).unwrap_or_else(|| "-".into())
                );
            }
        }
    }
    Ok(())
}

fn cmd_bench_pp_tg(m: &ModelArgs, s: &StreamArgs, n_prompt: &[usize], n_gen: &[usize], reps: usize, profile: bool) -> Res {
    use les::model::Logits;
    let (mut sess, _budget) = open_session(m, s, 0)?;
    if m.ctx_size < n_prompt.iter().chain(n_gen).copied().max().unwrap_or(0) {
        return Err(format!("-c {} is smaller than the longest test", m.ctx_size).into());
    }
    let g = GgufFile::read(&FileSource::open(&m.model)?).ok();
    // Size and parameters of the GGUF (a bundle: its file size; parameters of the dense part).
    let (size, params) = g.as_ref().map(|g| (g.tensors.iter().map(|t| t.size).sum::<u64>(), g.tensors.iter().map(|t| t.dims.iter().product::<u64>()).sum::<u64>())).unwrap_or((std::fs::metadata(&m.model)?.len(), 0));
    // The type holding most bytes names the file, as llama-bench's model column does.
    let mut by_type: std::collections::HashMap<&'static str, u64> = Default::default();
    for t in g.iter().flat_map(|g| &g.tensors) {
        *by_type.entry(t.ty.name()).or_default() += t.size;
    }
    let main_type = by_type.into_iter().max_by_key(|x| x.1).map(|x| x.0).unwrap_or("?");
    let c = &sess.model.cfg;
    let n_vocab = c.n_vocab.max(1) as u64;
    let desc = if g.is_some() { format!("{} {:.0}M {main_type}", c.arch.name(), params as f64 / 1e6) } else { format!("{} (bundle)", c.arch.name()) };
    let params = if g.is_some() { format!("{:.2} M", params as f64 / 1e6) } else { "-".into() };
    let backend = match (&sess.gpu, &s.memory_budget) {
        (Some(_), None) => "wgpu".to_string(),
        (Some(_), Some(b)) => format!("wgpu, budget {b}"),
        (None, None) => "CPU".to_string(),
        (None, Some(b)) => format!("CPU, budget {b}"),
    };
    // Random token ids, as llama-bench uses (a fixed xorshift sequence here).
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n_vocab) as u32
    };
    println!("| model | size | params | backend | threads | test | t/s |");
    println!("| --- | ---: | ---: | --- | ---: | ---: | ---: |");
    let tests: Vec<(bool, usize)> = n_prompt.iter().filter(|&&n| n > 0).map(|&n| (true, n)).chain(n_gen.iter().filter(|&&n| n > 0).map(|&n| (false, n))).collect();
    if profile && sess.gpu.is_some() {
        return Err("--profile times the CPU forward's ops: use --backend cpu".into());
    }
    let mut profiles = Vec::new();
    for (pp, n) in tests {
        let mut tps = Vec::new();
        for rep in 0..=reps.max(1) {
            if profile && rep == 1 {
                les::backend::profile::enable(true); // the timed repetitions, not the warm-up
            }
            sess.reset();
            let t0 = std::time::Instant::now();
            if pp {
                let toks: Vec<u32> = (0..n).map(|_| rnd()).collect();
                sess.forward(&toks, Logits::Last)?;
            } else {
                for _ in 0..n {
                    sess.forward(&[rnd()], Logits::Last)?;
                }
            }
            let dt = t0.elapsed().as_secs_f64();
            if rep > 0 {
                tps.push(n as f64 / dt.max(1e-9)); // rep 0 warms up, as llama-bench's warm-up run
            }
        }
        if profile {
            les::backend::profile::enable(false);
            profiles.push((format!("{}{n}", if pp { "pp" } else { "tg" }), (n * reps.max(1)) as f64, les::backend::profile::table()));
        }
        let mean = tps.iter().sum::<f64>() / tps.len() as f64;
        let sd = (tps.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (tps.len().max(2) - 1) as f64).sqrt();
        println!(
            "| {desc} | {:.2} MiB | {params} | {backend} | {} | {}{n} | {mean:.2} ± {sd:.2} |",
            size as f64 / 1048576.0,
            les::backend::cpu::par::n_threads(),
            if pp { "pp" } else { "tg" }
        );
    }
    for (test, tokens, rows) in profiles {
        let total = rows.iter().find(|r| r.op == "forward").map(|r| r.ms).unwrap_or(0.0);
        println!("\n{test}: time per op, {} threads (ms per token; share of `forward`)\n", les::backend::cpu::par::n_threads());
        println!("| op | calls/token | ms/token | share |");
        println!("| --- | ---: | ---: | ---: |");
        for r in &rows {
            println!("| {} | {:.2} | {:.4} | {:.1}% |", r.op, r.calls as f64 / tokens, r.ms / tokens, 100.0 * r.ms / total.max(1e-9));
        }
        let ops: f64 = rows.iter().filter(|r| r.op != "forward").map(|r| r.ms).sum();
        println!("| (between ops) | | {:.4} | {:.1}% |", (total - ops) / tokens, 100.0 * (total - ops) / total.max(1e-9));
    }
    Ok(())
}

fn cmd_bench_decode(m: &ModelArgs, n: usize, reps: usize, json: bool) -> Res {
    let mut sess = open(m)?;
    let prompt = sess.tokenize("The quick brown fox jumps over the lazy dog. Once upon a time");
    let mut best: f64 = 0.0;
    let mut all = Vec::new();
    for rep in 0..reps.max(1) {
        let (_, st) = sess.generate(&prompt, n, &SamplerConfig::greedy(), true, &mut |_, _| true)?;
        best = best.max(st.gen_tps());
        all.push(st.gen_tps());
        // The GPU's counters from the second repetition on: pipelines, bind groups and buffers
        // made once are warm-up, not per-token cost.
        if rep == 0 && reps > 1 {
            if let Some(g) = &sess.gpu {
                g.reset_stats();
            }
        }
    }
    let mean = all.iter().sum::<f64>() / all.len() as f64;
    let backend = if sess.gpu.is_some() { "wgpu" } else { "cpu" };
    let gpu = match &sess.gpu {
        Some(g) => Some((g.stats(), g.probe_sync_ms(20)?, g.expert_slots(), g.adapter_name())),
        None => None,
    };
    if json {
        let v = serde_json::json!({
            "model": m.model,
            "backend": backend,
            "threads": les::backend::cpu::par::n_threads(),
            "n_predict": n,
            "reps": all.len(),
            "decode_tokens_per_s": all,
            "best": best,
            "mean": mean,
            "gpu": gpu.as_ref().map(|(st, sync, slots, name)| serde_json::json!({
                "adapter": name,
                "per_token": st.per_token(),
                "stats": st,
                "idle_sync_ms": sync,
                "expert_slots": slots,
            })),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "les bench decode: model {} | backend {} | threads {} | {} tokens x {} reps | decode best {:.2} tokens/s, mean {:.2} tokens/s",
        m.model,
        backend,
        les::backend::cpu::par::n_threads(),
        n,
        all.len(),
        best,
        mean
    );
    if let Some((st, sync, slots, _)) = gpu {
        println!(
            "  wgpu: {} forwards, readbacks wait {:.3} ms for the GPU on average (an idle sync costs {:.3} ms), expert slots {} ({} uploads, {} hits)\n  per decode token: {}",
            st.forwards,
            st.readback_ms / st.counts.readbacks.max(1) as f64,
            sync,
            slots,
            st.experts.uploads,
            st.experts.hits,
            st.per_token()
        );
    }
    Ok(())
}
