//! Prefetch that never costs: while decoding, the scheduler measures whether lookahead
//! prefetching makes tokens faster, and turns it off when it does not.
//!
//! A prefetch hides a read behind compute, but it is not free: a wrong guess takes store
//! bandwidth and a slot, a demand read may wait behind a prefetch's chunk, and when the store's
//! bytes are copied by the CPU (the page cache, a throttled device profile, the browser's OPFS
//! reads) every prefetch takes CPU time from the compute threads. Which side wins depends on the
//! machine, the thread count and the store (BENCHMARKS.md), so it is measured, not assumed.
//!
//! The measure is the time of a forward's MoE layers per token (from the first MoE layer's
//! router to the return of the last layer's experts: compute, stalls and the compute lost to
//! I/O copies, without sampling or the idle time between requests), for decode and speculative
//! verification forwards. Runs of [`GovernorConfig::run`] forwards alternate between
//! prefetching on and off in an ABBA order (on, off, off, on, on, off, …), so a slow spell of a
//! shared machine or the context's growth falls on both alike; the first forward of each run is
//! not counted (what a setting leaves in the cache spills into the next forward: prefetched
//! experts the next token also routes to), and each side is summarised by its mean without its slowest forward
//! (throughput is a mean — prefetching pays most on the tokens with many misses, which a median
//! would not see — but one forward descheduled for a second must not decide alone):
//! * **Warm-up**: [`GovernorConfig::warmup`] runs of each; prefetching goes off if it was slower
//!   by more than [`GovernorConfig::margin`]. The bias is to keep it: where it pays it pays a
//!   lot (I/O-bound stores), where it costs it costs little, and a 96-token run measures a
//!   difference of a few percent only roughly.
//! * **Then** the chosen setting runs `gap` forwards, then an exploration block of
//!   [`GovernorConfig::explore`] runs of each, alternating again. The estimate (relative
//!   difference of the means) is averaged with the block's; prefetching is turned off when it
//!   is slower by more than the margin and on again when it is faster at all (hysteresis: no
//!   flapping at the threshold). `gap` starts at [`GovernorConfig::first_gap`] and doubles up to
//!   [`GovernorConfig::max_gap`] while the choice stands, so a settled choice spends
//!   `explore·run / (max_gap + 2·explore·run)` of its forwards (3% by default) on the other.
//!
//! The router decides every expert either way, so the logits do not depend on the choice.

/// Prefetching on or off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Arm {
    On,
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GovernorConfig {
    /// Forwards in a run of one setting (the first is not counted).
    pub run: u32,
    /// Runs of each setting in the warm-up.
    pub warmup: u32,
    /// Runs of each setting in an exploration block.
    pub explore: u32,
    /// Forwards the chosen setting runs before the first exploration after a choice.
    pub first_gap: u32,
    /// Most forwards between explorations.
    pub max_gap: u32,
    /// Relative slow-down that turns prefetching off (0.05: 5% more time per token).
    pub margin: f64,
}

impl Default for GovernorConfig {
    fn default() -> Self {
        Self { run: 4, warmup: 4, explore: 2, first_gap: 32, max_gap: 256, margin: 0.05 }
    }
}

/// What the governor did (for statistics).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GovernorStats {
    /// Tokens measured with prefetching on / off.
    pub tokens_on: u64,
    pub tokens_off: u64,
    /// Mean ms per token (slowest forward left out) with prefetching on / off in the last block.
    pub last_on_ms: Option<f64>,
    pub last_off_ms: Option<f64>,
    /// The running estimate: (on − off) / off of the means (negative: prefetching is faster).
    pub estimate: Option<f64>,
    /// Times the chosen setting changed after the warm-up.
    pub switches: u64,
}

/// The on/off controller (pure logic: [`super::stream::StreamingExperts`] measures and asks
/// [`Governor::arm`] before each prefetch).
pub struct Governor {
    cfg: GovernorConfig,
    /// The chosen setting (before the first choice: none, the warm-up runs).
    chosen: Option<Arm>,
    /// Position in the current alternating block (`None`: exploiting), and its samples.
    block: Option<u32>,
    on: Vec<f64>,
    off: Vec<f64>,
    /// Forwards left before the next exploration block.
    left: u32,
    gap: u32,
    arm: Arm,
    stats: GovernorStats,
}

/// The ABBA order of an alternating block's runs: on, off, off, on, on, off, …
fn abba(i: u32) -> Arm {
    if matches!(i % 4, 0 | 3) { Arm::On } else { Arm::Off }
}

/// The mean without the largest value (the mean itself for fewer than three values).
fn trimmed_mean(v: &[f64]) -> f64 {
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    let sum: f64 = v.iter().sum();
    if n < 3 {
        return sum / n as f64;
    }
    let max = v.iter().copied().fold(f64::MIN, f64::max);
    (sum - max) / (n - 1) as f64
}

impl Governor {
    pub fn new(cfg: GovernorConfig) -> Self {
        let cfg = GovernorConfig { run: cfg.run.max(1), warmup: cfg.warmup.max(1), explore: cfg.explore.max(1), first_gap: cfg.first_gap.max(1), max_gap: cfg.max_gap.max(cfg.first_gap.max(1)), margin: cfg.margin.max(0.0) };
        Self { cfg, chosen: None, block: Some(0), on: Vec::new(), off: Vec::new(), left: 0, gap: cfg.first_gap, arm: abba(0), stats: GovernorStats::default() }
    }

    /// Whether prefetching runs now.
    pub fn arm(&self) -> Arm {
        self.arm
    }

    pub fn stats(&self) -> GovernorStats {
        self.stats.clone()
    }

    /// One measured forward: `ms` for `tokens` tokens. Returns the setting for the next one.
    pub fn record(&mut self, ms: f64, tokens: u32) -> Arm {
        if tokens == 0 || !ms.is_finite() || ms < 0.0 {
            return self.arm;
        }
        match self.arm {
            Arm::On => self.stats.tokens_on += tokens as u64,
            Arm::Off => self.stats.tokens_off += tokens as u64,
        }
        let per_token = ms / tokens as f64;
        match self.block {
            Some(i) => {
                let run = self.cfg.run;
                if run == 1 || i % run != 0 {
                    match self.arm {
                        Arm::On => self.on.push(per_token),
                        Arm::Off => self.off.push(per_token),
                    }
                }
                let len = 2 * run * if self.chosen.is_none() { self.cfg.warmup } else { self.cfg.explore };
                if i + 1 < len {
                    self.block = Some(i + 1);
                    self.arm = abba((i + 1) / run);
                } else {
                    self.end_block();
                }
            }
            None => {
                self.left = self.left.saturating_sub(1);
                if self.left == 0 {
                    self.block = Some(0);
                    self.arm = abba(0);
                }
            }
        }
        self.arm
    }

    fn end_block(&mut self) {
        let (on, off) = (trimmed_mean(&self.on), trimmed_mean(&self.off));
        self.on.clear();
        self.off.clear();
        self.stats.last_on_ms = Some(on);
        self.stats.last_off_ms = Some(off);
        let rel = (on - off) / off.max(1e-9);
        let est = match (self.chosen, self.stats.estimate) {
            (Some(_), Some(e)) => 0.5 * (e + rel),
            _ => rel,
        };
        self.stats.estimate = Some(est);
        let next = match self.chosen {
            // The first choice: off only if slower by the margin.
            None => {
                if est > self.cfg.margin { Arm::Off } else { Arm::On }
            }
            Some(Arm::On) if est > self.cfg.margin => Arm::Off,
            Some(Arm::Off) if est < 0.0 => Arm::On,
            Some(c) => c,
        };
        match self.chosen {
            Some(c) if c == next => self.gap = (self.gap * 2).min(self.cfg.max_gap),
            Some(_) => {
                self.stats.switches += 1;
                self.gap = self.cfg.first_gap;
            }
            None => self.gap = self.cfg.first_gap,
        }
        self.chosen = Some(next);
        self.block = None;
        self.left = self.gap;
        self.arm = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `n` one-token forwards through `g`, each taking `ms(arm, i)`; returns every arm.
    fn drive(g: &mut Governor, n: usize, ms: impl Fn(Arm, usize) -> f64) -> Vec<Arm> {
        (0..n)
            .map(|i| {
                let a = g.arm();
                g.record(ms(a, i), 1);
                a
            })
            .collect()
    }

    fn share_on(arms: &[Arm]) -> f64 {
        arms.iter().filter(|&&a| a == Arm::On).count() as f64 / arms.len() as f64
    }

    #[test]
    fn warmup_alternates_abba_then_keeps_the_faster_setting() {
        let cfg = GovernorConfig { run: 2, warmup: 2, ..Default::default() };
        let mut g = Governor::new(cfg);
        let arms = drive(&mut g, 10, |a, _| if a == Arm::On { 10.0 } else { 20.0 });
        use Arm::*;
        assert_eq!(arms, vec![On, On, Off, Off, Off, Off, On, On, On, On]);
        let mut g = Governor::new(cfg);
        let arms = drive(&mut g, 10, |a, _| if a == Arm::On { 20.0 } else { 10.0 });
        assert_eq!(arms, vec![On, On, Off, Off, Off, Off, On, On, Off, Off]);
        // The first forward of each run is left out: a slow first forward after every change
        // does not count.
        let mut g = Governor::new(cfg);
        drive(&mut g, 8, |a, i| if i % 2 == 0 { 1000.0 } else if a == Arm::On { 10.0 } else { 20.0 });
        assert_eq!(g.arm(), Arm::On);
        assert_eq!(g.stats().last_on_ms, Some(10.0));
    }

    #[test]
    fn prefetching_goes_off_when_it_costs_more_than_the_margin() {
        // On is 3% slower: within the 5% margin, so prefetching stays on.
        let mut g = Governor::new(GovernorConfig::default());
        drive(&mut g, 32, |a, _| if a == Arm::On { 10.3 } else { 10.0 });
        assert_eq!(g.arm(), Arm::On);
        assert!((g.stats().estimate.unwrap() - 0.03).abs() < 1e-9);
        // 8% slower: it goes off.
        let mut g = Governor::new(GovernorConfig::default());
        drive(&mut g, 32, |a, _| if a == Arm::On { 10.8 } else { 10.0 });
        assert_eq!(g.arm(), Arm::Off);
        // Off, then prefetching turns out faster at all: it goes on again.
        drive(&mut g, 2000, |a, _| if a == Arm::On { 9.9 } else { 10.0 });
        assert_eq!(g.arm(), Arm::On);
        assert_eq!(g.stats().switches, 1);
    }

    #[test]
    fn a_settled_choice_explores_less_and_less() {
        // Prefetching costs 10%: after the warm-up, the other setting gets explore forwards in
        // every gap + 2·explore·run, the gap doubling up to max_gap.
        let cfg = GovernorConfig::default();
        let mut g = Governor::new(cfg);
        let arms = drive(&mut g, 4000, |a, _| if a == Arm::On { 11.0 } else { 10.0 });
        let warm = (2 * cfg.warmup * cfg.run) as usize;
        let period = (cfg.max_gap + 2 * cfg.explore * cfg.run) as usize;
        let late = &arms[arms.len() - 3 * period..];
        assert!(share_on(&arms[warm..]) < 0.06, "{}", share_on(&arms[warm..]));
        let want = (cfg.explore * cfg.run) as f64 / period as f64;
        assert!((share_on(late) - want).abs() < 1e-9, "{} vs {want}", share_on(late));
        assert_eq!(g.stats().switches, 0);
        assert_eq!(g.stats().tokens_on + g.stats().tokens_off, 4000);
    }

    #[test]
    fn the_choice_follows_a_change_in_the_machine() {
        // Prefetching pays for the first 1000 tokens (another core was free), then costs.
        let mut g = Governor::new(GovernorConfig::default());
        let arms = drive(&mut g, 3000, |a, i| match (a, i < 1000) {
            (Arm::On, true) => 8.0,
            (Arm::Off, true) => 10.0,
            (Arm::On, false) => 12.0,
            (Arm::Off, false) => 10.0,
        });
        assert!(share_on(&arms[..1000]) > 0.9, "{}", share_on(&arms[..1000]));
        assert!(share_on(&arms[2000..]) < 0.1, "{}", share_on(&arms[2000..]));
        assert_eq!(g.stats().switches, 1);
    }

    #[test]
    fn slow_spells_fall_on_both_settings() {
        // Prefetching is 5% faster, but every other run of 8 forwards the machine is 40% slower
        // (another tenant) and the context grows (1% per 8 forwards): the ABBA blocks still
        // see prefetching ahead, and it stays on.
        let mut g = Governor::new(GovernorConfig::default());
        let arms = drive(&mut g, 2000, |a, i| {
            let t = 10.0 * (1.0 + 0.01 * (i / 8) as f64) * if (i / 8) % 2 == 1 { 1.4 } else { 1.0 };
            if a == Arm::On { 0.95 * t } else { t }
        });
        assert!(share_on(&arms[32..]) > 0.9, "{}", share_on(&arms[32..]));
        assert_eq!(g.stats().switches, 0);
    }

    #[test]
    fn one_slow_token_does_not_decide() {
        // Prefetching is 10% faster; one of its warm-up tokens waited 50× longer (left out).
        let mut g = Governor::new(GovernorConfig::default());
        drive(&mut g, 32, |a, i| if a == Arm::On { if i == 3 { 450.0 } else { 9.0 } } else { 10.0 });
        assert_eq!(g.arm(), Arm::On);
    }

    #[test]
    fn the_slow_tokens_count() {
        // Prefetching saves nothing on most tokens but a quarter of a long stall on one in four
        // (the tokens with many misses): the mean sees it, a median would not.
        let mut g = Governor::new(GovernorConfig::default());
        drive(&mut g, 32, |a, i| match (a, i % 8 < 2) {
            (Arm::On, true) => 30.0,
            (Arm::Off, true) => 40.0,
            _ => 10.0,
        });
        assert_eq!(g.arm(), Arm::On, "{:?}", g.stats());
    }

    #[test]
    fn multi_token_forwards_and_bad_samples() {
        let mut g = Governor::new(GovernorConfig { run: 1, warmup: 2, ..Default::default() });
        // A verification forward of 5 tokens is one sample of 10 ms per token.
        assert_eq!(g.record(50.0, 5), Arm::Off);
        // Ignored: no tokens, NaN, negative.
        assert_eq!(g.record(1.0, 0), Arm::Off);
        assert_eq!(g.record(f64::NAN, 1), Arm::Off);
        assert_eq!(g.record(-1.0, 1), Arm::Off);
        assert_eq!((g.stats().tokens_on, g.stats().tokens_off), (5, 0));
        g.record(20.0, 1);
        g.record(20.0, 1);
        g.record(10.0, 1);
        assert_eq!((g.stats().last_on_ms, g.stats().last_off_ms), (Some(10.0), Some(20.0)));
        assert_eq!(g.arm(), Arm::On);
    }
}
