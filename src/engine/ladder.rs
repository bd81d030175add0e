//! The ladder benchmark: the same prompts, in one process, through each rung of the stack —
//! resident → on-demand (no prefetch, LRU) → + lookahead → + packed bundle — with per-rung
//! tokens/s, ratio to on-demand, hit rate, recall, MB read per token and stall ms per token, plus
//! two bounds from the recorded routing trace: pure I/O time (the bytes a Belady-optimal cache of
//! the same size must still read, at the store's measured throughput) and the oracle
//! (Belady-optimal cache with perfect prediction: I/O fully overlapped with compute).

use super::sampling::SamplerConfig;
use super::stream::{open_streaming, StreamOptions};
use super::Session;
use crate::expert::stream::{belady_misses, Policy};
use crate::model::ExpertMode;
use crate::store::FileSource;
use std::time::Instant;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Rung {
    pub name: String,
    pub tokens_per_s: f64,
    pub ratio_to_on_demand: f64,
    pub hit_rate: f64,
    pub recall_d1: f64,
    pub precision_d1: f64,
    pub mb_read_per_token: f64,
    pub stall_ms_per_token: f64,
    pub io_busy: f64,
    pub tokens: usize,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LadderReport {
    pub model: String,
    pub store: String,
    pub budget: u64,
    pub slots: usize,
    pub slot_fraction: f64,
    pub rungs: Vec<Rung>,
    /// Decode tokens/s with I/O fully hidden behind compute and a Belady-optimal cache.
    pub oracle_tokens_per_s: f64,
    /// Time per token spent only reading what a Belady-optimal cache misses (ms).
    pub pure_io_ms_per_token: f64,
    pub belady_hit_rate: f64,
    pub store_mb_per_s: f64,
    pub per_layer: Vec<(usize, f64, f64, f64)>,
}

impl LadderReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "ladder: {} | store {} | budget {:.0} MiB | {} expert slots ({:.1}% of experts)\n{:<14} {:>9} {:>9} {:>8} {:>9} {:>10} {:>10} {:>8}\n",
            self.model,
            self.store,
            self.budget as f64 / 1048576.0,
            self.slots,
            100.0 * self.slot_fraction,
            "rung",
            "tok/s",
            "×on-dem",
            "hit %",
            "recall %",
            "MB/token",
            "stall ms",
            "I/O %"
        );
        for r in &self.rungs {
            s += &format!(
                "{:<14} {:>9.2} {:>9.2} {:>8.1} {:>9.1} {:>10.2} {:>10.2} {:>8.0}\n",
                r.name,
                r.tokens_per_s,
                r.ratio_to_on_demand,
                100.0 * r.hit_rate,
                100.0 * r.recall_d1,
                r.mb_read_per_token,
                r.stall_ms_per_token,
                100.0 * r.io_busy
            );
        }
        s += &format!(
            "bounds: oracle {:.2} tok/s (Belady hit rate {:.1}%, I/O hidden behind compute) | pure I/O {:.2} ms/token at {:.0} MB/s measured\n",
            self.oracle_tokens_per_s,
            100.0 * self.belady_hit_rate,
            self.pure_io_ms_per_token,
            self.store_mb_per_s
        );
        s
    }
}

fn decode_all(sess: &mut Session, prompts: &[String], n: usize) -> Result<(usize, f64), Box<dyn std::error::Error>> {
    let mut toks = 0;
    let mut ms = 0.0;
    for p in prompts {
        let t = sess.tokenize(p);
        let (_, st) = sess.generate(&t, n, &SamplerConfig::greedy(), true, &mut |_, _| true)?;
        toks += st.gen_tokens;
        ms += st.gen_ms;
    }
    Ok((toks, ms))
}

fn evict(path: &str) {
    if let Ok(f) = FileSource::open(path) {
        f.evict_page_cache();
    }
}

/// Run the ladder. Decode time only (prefill excluded); every streamed rung starts cold (the file
/// is evicted from the page cache first).
pub fn run(model: &str, bundle: &str, opts: &StreamOptions, prompts: &[String], n: usize, resident: bool) -> Result<LadderReport, Box<dyn std::error::Error>> {
    let mut rep = LadderReport { model: model.into(), store: opts.profile.map(|p| p.name.to_string()).unwrap_or_else(|| if opts.direct { "disk (O_DIRECT)".into() } else { "disk".into() }), budget: opts.budget, ..Default::default() };
    let mut compute_ms_per_tok = None;
    if resident {
        let src = FileSource::open(model)?;
        let mut s = Session::load(&src, ExpertMode::Resident, opts.n_ctx)?;
        let (t, ms) = decode_all(&mut s, prompts, n)?;
        compute_ms_per_tok = Some(ms / t.max(1) as f64);
        rep.rungs.push(Rung { name: "resident".into(), tokens_per_s: t as f64 / (ms / 1000.0), hit_rate: 1.0, tokens: t, ..Default::default() });
    }
    let mut route = Vec::new();
    let mut expert_bytes_max = 0u64;
    let rungs: [(&str, bool, &str); 3] = [("on-demand", false, model), ("+ lookahead", true, model), ("+ bundle", true, bundle)];
    for (name, prefetch, path) in rungs {
        let mut o = opts.clone();
        o.cache.prefetch = prefetch;
        if name == "on-demand" {
            o.cache.policy = Policy::Lru;
        }
        evict(path);
        let mut st = open_streaming(path, &o)?;
        rep.slots = st.experts.config().slots;
        expert_bytes_max = st.plan.expert_bytes_max;
        rep.slot_fraction = (rep.slots as u64 * st.plan.expert_bytes_max) as f64 / st.plan.total_expert_bytes.max(1) as f64;
        st.experts.reset_stats();
        let (t, ms) = decode_all(&mut st.session, prompts, n)?;
        let s = st.experts.stats();
        if name == "on-demand" {
            route = st.experts.take_route_log();
            rep.per_layer = s.layers.iter().enumerate().map(|(i, l)| {
                let tot = (l.hits + l.late + l.misses).max(1) as f64;
                (i, l.hits as f64 / tot, l.stall_ms, 0.0)
            }).collect();
        }
        if name == "+ lookahead" {
            for (i, l) in s.layers.iter().enumerate() {
                if let Some(pl) = rep.per_layer.get_mut(i) {
                    let r = l.pred_routed.first().copied().unwrap_or(0).max(1) as f64;
                    pl.3 = l.pred_tp.first().copied().unwrap_or(0) as f64 / r;
                }
            }
        }
        rep.rungs.push(Rung {
            name: name.into(),
            tokens_per_s: t as f64 / (ms / 1000.0),
            hit_rate: s.hit_rate(),
            recall_d1: s.recall(1),
            precision_d1: s.precision(1),
            mb_read_per_token: s.bytes_per_token() / 1e6,
            stall_ms_per_token: s.stall_ms_per_token(),
            io_busy: s.io_busy_fraction(o.cache.io_threads),
            tokens: t,
            ..Default::default()
        });
        drop(st);
    }
    let on_demand = rep.rungs.iter().find(|r| r.name == "on-demand").map(|r| r.tokens_per_s).unwrap_or(1.0);
    for r in &mut rep.rungs {
        r.ratio_to_on_demand = r.tokens_per_s / on_demand;
    }
    // Store throughput: read a spread of experts with the configured parallelism.
    let mbps = {
        let mut o = opts.clone();
        o.cache.prefetch = false;
        evict(model);
        let st = open_streaming(model, &o)?;
        let n_layer = st.session.model.cfg.n_layer;
        let n_exp = st.session.model.cfg.n_expert;
        let t0 = Instant::now();
        let mut bytes = 0u64;
        let mut ids: Vec<u32> = Vec::new();
        for l in 0..n_layer.min(8) {
            ids.clear();
            ids.extend((0..n_exp.min(st.experts.config().slots.saturating_sub(1)).min(16)).map(|e| ((e * 7 + l) % n_exp) as u32));
            ids.sort();
            ids.dedup();
            st.experts.with_experts_for_bench(l, &ids)?;
            bytes += ids.len() as u64 * st.plan.expert_bytes_max;
        }
        bytes as f64 / t0.elapsed().as_secs_f64() / 1e6
    };
    // A device profile's bandwidth is the store's throughput by definition; the probe measures the
    // real disk (it underestimates throttled stores on 2 busy cores).
    let mbps = match opts.profile {
        Some(p) => p.bandwidth / 1e6,
        None => mbps,
    };
    rep.store_mb_per_s = mbps;
    let tokens = rep.rungs.iter().find(|r| r.name == "on-demand").map(|r| r.tokens).unwrap_or(1).max(1);
    let misses = belady_misses(&route, rep.slots);
    rep.belady_hit_rate = 1.0 - misses as f64 / route.len().max(1) as f64;
    let per_expert = expert_bytes_max as f64;
    rep.pure_io_ms_per_token = misses as f64 * per_expert / (mbps * 1e6) * 1000.0 / tokens as f64;
    let compute = compute_ms_per_tok.unwrap_or(0.0);
    rep.oracle_tokens_per_s = 1000.0 / compute.max(rep.pure_io_ms_per_token).max(1e-9);
    Ok(rep)
}
