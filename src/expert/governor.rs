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
//! verification forwards. Forwards alternate between prefetching on and off in an ABBA order
//! (on, off, off, on, on, off, …), so a slow spell of a shared machine or the context's growth
//! falls on both alike, and each side is summarised by its median (a token that waited for many
//! misses does not decide alone):
//! * **Warm-up**: [`GovernorConfig::warmup`] forwards of each; prefetching stays on only if it
//!   was faster by [`GovernorConfig::margin`].
//! * **Then** the chosen setting runs `gap` forwards, then an exploration block of
//!   [`GovernorConfig::explore`] forwards of each, alternating again. The estimate (relative
//!   difference of the medians) is averaged with the block's; prefetching is turned on when it
//!   is faster by the margin and off when it is not faster at all (hysteresis: no flapping at
//!   the threshold). `gap` starts at [`GovernorConfig::first_gap`] and doubles up to
//!   [`GovernorConfig::max_gap`] while the choice stands, so a settled choice spends
//!   `explore / (max_gap + 2·explore)` of its forwards (3% by default) on the other setting.
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
    /// Forwards of each setting in the warm-up.
    pub warmup: u32,
    /// Forwards of each setting in an exploration block.
    pub explore: u32,
    /// Forwards the chosen setting runs before the first exploration after a choice.
    pub first_gap: u32,
    /// Most forwards between explorations.
    pub max_gap: u32,
    /// Relative speed-up prefetching must show to be turned on (0.03: 3% less time per token).
    pub margin: f64,
}

impl Default for GovernorConfig {
    fn default() -> Self {
        Self { warmup: 16, explore: 8, first_gap: 32, max_gap: 256, margin: 0.03 }
    }
}

/// What the governor did (for statistics).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GovernorStats {
    /// Tokens measured with prefetching on / off.
    pub tokens_on: u64,
    pub tokens_off: u64,
    /// Median ms per token with prefetching on / off in the last block that measured both.
    pub last_on_ms: Option<f64>,
    pub last_off_ms: Option<f64>,
    /// The running estimate: (on − off) / off of the medians (negative: prefetching is faster).
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

/// The ABBA order of an alternating block: on, off, off, on, on, off, …
fn abba(i: u32) -> Arm {
    if matches!(i % 4, 0 | 3) { Arm::On } else { Arm::Off }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

impl Governor {
    pub fn new(cfg: GovernorConfig) -> Self {
        let cfg = GovernorConfig { warmup: cfg.warmup.max(1), explore: cfg.explore.max(1), first_gap: cfg.first_gap.max(1), max_gap: cfg.max_gap.max(cfg.first_gap.max(1)), margin: cfg.margin.max(0.0) };
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
                match self.arm {
                    Arm::On => self.on.push(per_token),
                    Arm::Off => self.off.push(per_token),
                }
                let len = 2 * if self.chosen.is_none() { self.cfg.warmup } else { self.cfg.explore };
                if i + 1 < len {
                    self.block = Some(i + 1);
                    self.arm = abba(i + 1);
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
        let (on, off) = (median(&mut self.on), median(&mut self.off));
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
            // The first choice: on only if faster by the margin.
            None => {
                if est < -self.cfg.margin { Arm::On } else { Arm::Off }
            }
            Some(Arm::Off) if est < -self.cfg.margin => Arm::On,
            Some(Arm::On) if est >= 0.0 => Arm::Off,
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
        let cfg = GovernorConfig { warmup: 2, ..Default::default() };
        let mut g = Governor::new(cfg);
        let arms = drive(&mut g, 6, |a, _| if a == Arm::On { 10.0 } else { 20.0 });
        use Arm::*;
        assert_eq!(arms, vec![On, Off, Off, On, On, On]);
        let mut g = Governor::new(cfg);
        let arms = drive(&mut g, 6, |a, _| if a == Arm::On { 20.0 } else { 10.0 });
        assert_eq!(arms, vec![On, Off, Off, On, Off, Off]);
    }

    #[test]
    fn prefetching_must_beat_the_margin_to_be_turned_on() {
        // On is 2% faster: within the 3% margin, so prefetching goes off (fewer bytes read).
        let mut g = Governor::new(GovernorConfig::default());
        drive(&mut g, 32, |a, _| if a == Arm::On { 9.8 } else { 10.0 });
        assert_eq!(g.arm(), Arm::Off);
        // 5% faster: it stays on.
        let mut g = Governor::new(GovernorConfig::default());
        drive(&mut g, 32, |a, _| if a == Arm::On { 9.5 } else { 10.0 });
        assert_eq!(g.arm(), Arm::On);
        assert!((g.stats().estimate.unwrap() + 0.05).abs() < 1e-9);
    }

    #[test]
    fn a_settled_choice_explores_less_and_less() {
        // Prefetching costs 10%: after the warm-up, the other setting gets explore forwards in
        // every gap + 2·explore, the gap doubling up to max_gap.
        let cfg = GovernorConfig::default();
        let mut g = Governor::new(cfg);
        let arms = drive(&mut g, 4000, |a, _| if a == Arm::On { 11.0 } else { 10.0 });
        let warm = 2 * cfg.warmup as usize;
        let period = (cfg.max_gap + 2 * cfg.explore) as usize;
        let late = &arms[arms.len() - 3 * period..];
        assert!(share_on(&arms[warm..]) < 0.06, "{}", share_on(&arms[warm..]));
        let want = cfg.explore as f64 / period as f64;
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
        // Prefetching is 10% faster; one of its warm-up tokens waited 50× longer.
        let mut g = Governor::new(GovernorConfig::default());
        drive(&mut g, 32, |a, i| if a == Arm::On { if i == 3 { 450.0 } else { 9.0 } } else { 10.0 });
        assert_eq!(g.arm(), Arm::On);
    }

    #[test]
    fn multi_token_forwards_and_bad_samples() {
        let mut g = Governor::new(GovernorConfig { warmup: 2, ..Default::default() });
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
