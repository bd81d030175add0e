//! `les`: command-line interface.
//!
//!   les run --model PATH (--prompt TEXT | --chat) [-n N] [--temp T] [--seed S] …
//!   les inspect PATH
//!   les bench decode --model PATH [-n N]

use clap::{Args, Parser, Subcommand};
use les::engine::chat::Message;
use les::engine::sampling::SamplerConfig;
use les::engine::{memory_usage, Session};
use les::gguf::GgufFile;
use les::model::ExpertMode;
use les::store::FileSource;
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
    /// Print a GGUF file's metadata and tensor table.
    Inspect {
        /// GGUF file.
        path: String,
        /// Print every metadata value in full (default: arrays abbreviated).
        #[arg(long)]
        full: bool,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
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
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    m: ModelArgs,
    /// Prompt text (tokenized as llama.cpp does: special tokens parsed, BOS as the model says).
    #[arg(short, long, conflicts_with = "chat")]
    prompt: Option<String>,
    /// Chat: read one user message per line from stdin, render with the model's chat template.
    #[arg(long)]
    chat: bool,
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
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Decode speed: a short prompt, then N greedy tokens; prints tokens/s.
    Decode {
        #[command(flatten)]
        m: ModelArgs,
        #[arg(short = 'n', long, default_value_t = 128)]
        n_predict: usize,
        /// Repetitions (the best is reported, plus the mean).
        #[arg(short = 'r', long, default_value_t = 3)]
        reps: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
    Ok(Session::load(&src, ExpertMode::Resident, m.ctx_size)?)
}

fn run(cli: Cli) -> Res {
    match cli.cmd {
        Cmd::Run(a) => cmd_run(a),
        Cmd::Inspect { path, full } => cmd_inspect(&path, full),
        Cmd::Bench(BenchCmd::Decode { m, n_predict, reps }) => cmd_bench_decode(&m, n_predict, reps),
    }
}

fn cmd_run(a: RunArgs) -> Res {
    let mut sess = open(&a.m)?;
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
        let mut history = Vec::new();
        for line in std::io::stdin().lock().lines() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            history.push(Message { role: "user".into(), content: line });
            let p = sess.chat_prompt(&history)?;
            let reply = generate_one(&mut sess, &p, &a, &sampler)?;
            history.push(Message { role: "assistant".into(), content: reply });
            println!();
        }
        return Ok(());
    }
    match &a.prompt {
        Some(p) => prompts.push(p.clone()),
        None => return Err("give --prompt TEXT or --chat".into()),
    }
    for p in prompts {
        generate_one(&mut sess, &p, &a, &sampler)?;
    }
    Ok(())
}

fn generate_one(sess: &mut Session, prompt: &str, a: &RunArgs, sampler: &SamplerConfig) -> Result<String, Box<dyn std::error::Error>> {
    let toks = sess.tokenize(prompt);
    let mut out = std::io::stdout().lock();
    let mut text = String::new();
    let (_, st) = sess.generate(&toks, a.n_predict, sampler, a.ignore_eos, &mut |_, s| {
        text.push_str(s);
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
        true
    })?;
    let mem = memory_usage().map(|(_, peak)| format!(", peak memory {:.1} MiB", peak as f64 / 1048576.0)).unwrap_or_default();
    eprintln!(
        "\nles: prompt {} tokens, {:.1} tokens/s | decode {} tokens, {:.1} tokens/s{}",
        st.prompt_tokens,
        st.prompt_tps(),
        st.gen_tokens,
        st.gen_tps(),
        mem
    );
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
    let g = GgufFile::read(&src)?;
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
    if let Ok(cfg) = les::model::Config::from_gguf(&g) {
        writeln!(o, "\n== model\narch {} | n_embd {} | n_layer {} | n_head {} | n_head_kv {} | head_dim {} | n_ff {} | n_vocab {} | rope {:?} base {}", cfg.arch.name(), cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.n_vocab, cfg.rope, cfg.rope_base)?;
        if cfg.is_moe() {
            let mut per_expert = 0u64;
            let mut expert_total = 0u64;
            for il in 0..cfg.n_layer {
                if let Ok(t) = les::expert::GgufExpertTensors::find(&g, il, cfg.n_embd, cfg.n_expert) {
                    per_expert = t.layout.bytes() as u64;
                    expert_total += per_expert * cfg.n_expert as u64;
                }
            }
            let total: u64 = g.tensors.iter().map(|t| t.size).sum();
            writeln!(o, "\n== experts\nexperts per layer (n_expert): {}\nused per token (n_expert_used): {}\nexpert n_ff: {}\nbytes per expert (gate+up+down): {} ({})\ntotal expert bytes: {} ({})\ndense bytes: {} ({})\nexpert bytes per token at 0% hit rate: {} ({})",
                cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, per_expert, human(per_expert), expert_total, human(expert_total), total - expert_total, human(total - expert_total),
                per_expert * cfg.n_expert_used as u64 * cfg.n_layer as u64, human(per_expert * cfg.n_expert_used as u64 * cfg.n_layer as u64))?;
        }
    }
    Ok(())
}

fn cmd_bench_decode(m: &ModelArgs, n: usize, reps: usize) -> Res {
    let mut sess = open(m)?;
    let prompt = sess.tokenize("The quick brown fox jumps over the lazy dog. Once upon a time");
    let mut best: f64 = 0.0;
    let mut all = Vec::new();
    for _ in 0..reps.max(1) {
        let (_, st) = sess.generate(&prompt, n, &SamplerConfig::greedy(), true, &mut |_, _| true)?;
        best = best.max(st.gen_tps());
        all.push(st.gen_tps());
    }
    let mean = all.iter().sum::<f64>() / all.len() as f64;
    println!(
        "les bench decode: model {} | threads {} | {} tokens x {} reps | decode best {:.2} tokens/s, mean {:.2} tokens/s",
        m.model,
        les::backend::cpu::par::n_threads(),
        n,
        all.len(),
        best,
        mean
    );
    Ok(())
}
