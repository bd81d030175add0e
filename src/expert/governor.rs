//! Prefetch that never costs: while decoding, the scheduler measures whether lookahead
//! prefetching makes tokens faster, and turns it off when it does not.
//!
//! A prefetch hides a read behind compute, but it is not free: a wrong guess takes store
//! bandwidth and a slot, and when the store's bytes are copied by the CPU (the page cache, a
//! throttled device profile, the browser's OPFS reads) every prefetch takes CPU time from the
//! compute threads. Which side wins depends on the machine, the thread count and the store
//! (BENCHMARKS.md, 2 vCPUs: with one compute thread prefetching ran 1.06-1.23× on-demand, with
//! two compute threads, which leave no core for the copies, 0.85-1.04×), so it is measured, not
//! assumed.
//!
//! The measure is the time of the forward's MoE layers per token (from the first MoE layer's
//! router to the return of the last layer's experts: compute, stalls and the compute lost to
//! I/O copies, without sampling or idle time between requests), for decode and speculative
//! verification forwards. Time is cut into epochs of [`GovernorConfig::epoch`] tokens, each run
//! with prefetching on or off:
//! * **Warm-up**: on, off, off, on (an ABBA order, so a steady drift — the context growing —
//!   favours neither); prefetching stays on only if its epochs were faster by
//!   [`GovernorConfig::margin`].
//! * **Then** the chosen arm runs `gap` epochs, one epoch of the other arm, one of the chosen
//!   again; the other arm takes over if its epoch beat the mean of the two around it (by the
//!   margin when that means turning prefetching on, the bytes saved being the tie-break). `gap`
//!   starts at [`GovernorConfig::first_gap`] and doubles up to [`GovernorConfig::max_gap`]
//!   while the choice stands, so a settled choice costs at most one epoch in `max_gap + 1`.
//!
//! The router decides every expert either way, so the logits do not depend on the choice.

use std::collections::VecDeque;

/// Prefetching on or off for an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Arm {
    On,
    Off,
}

impl Arm {
    fn other(self) -> Arm {
        match self {
            Arm::On => Arm::Off,
            Arm::Off => Arm::On,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GovernorConfig {
    /// Tokens per epoch.
    pub epoch: u32,
    /// Epochs the chosen arm runs before the first exploration after a choice.
    pub first_gap: u32,
    /// Most epochs between explorations.
    pub max_gap: u32,
    /// Relative speed-up prefetching must show to be turned on (0.03: 3% less time per token).
    pub margin: f64,
}

impl Default for GovernorConfig {
    fn default() -> Self {
        Self { epoch: 8, first_gap: 4, max_gap: 32, margin: 0.03 }
    }
}

/// What the governor did (for statistics).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GovernorStats {
    /// Tokens measured with prefetching on / off.
    pub tokens_on: u64,
    pub tokens_off: u64,
    /// Mean ms per token of the last completed epoch of each arm.
    pub last_on_ms: Option<f64>,
    pub last_off_ms: Option<f64>,
    /// Times the chosen arm changed after the warm-up.
    pub switches: u64,
}

enum Phase {
    /// Epochs still to run before the first choice, and the means so far as (arm, ms).
    Warmup(VecDeque<Arm>, Vec<(Arm, f64)>),
    /// The chosen arm runs `left` more epochs, then the other is explored.
    Exploit { left: u32 },
    /// The other arm's epoch is running; `before`: the chosen arm's epoch just before it.
    Explore { before: f64 },
    /// The chosen arm's epoch after an exploration; `before`, `other`: the two epochs before it.
    Confirm { before: f64, other: f64 },
}

/// The on/off controller (pure logic: the caller measures, [`StreamingExperts`] asks
/// [`Governor::arm`] before each prefetch).
///
/// [`StreamingExperts`]: super::stream::StreamingExperts
pub struct Governor {
    cfg: GovernorConfig,
    phase: Phase,
    /// The arm running now.
    arm: Arm,
    /// The chosen arm (after the warm-up).
    chosen: Arm,
    gap: u32,
    sum_ms: f64,
    n: u32,
    stats: GovernorStats,
}

impl Governor {
    pub fn new(cfg: GovernorConfig) -> Self {
        let cfg = GovernorConfig { epoch: cfg.epoch.max(1), first_gap: cfg.first_gap.max(1), max_gap: cfg.max_gap.max(cfg.first_gap.max(1)), margin: cfg.margin.max(0.0) };
        let order = VecDeque::from([Arm::On, Arm::Off, Arm::Off, Arm::On]);
        Self { cfg, phase: Phase::Warmup(order, Vec::new()), arm: Arm::On, chosen: Arm::On, gap: cfg.first_gap, sum_ms: 0.0, n: 0, stats: GovernorStats::default() }
    }

    /// Whether prefetching runs now.
    pub fn arm(&self) -> Arm {
        self.arm
    }

    pub fn stats(&self) -> GovernorStats {
        self.stats.clone()
    }

    /// One measured forward: `ms` for `tokens` tokens. Returns the arm to run from now on.
    pub fn record(&mut self, ms: f64, tokens: u32) -> Arm {
        if tokens == 0 || !ms.is_finite() || ms < 0.0 {
            return self.arm;
        }
        match self.arm {
            Arm::On => self.stats.tokens_on += tokens as u64,
            Arm::Off => self.stats.tokens_off += tokens as u64,
        }
        self.sum_ms += ms;
        self.n += tokens;
        if self.n >= self.cfg.epoch {
            let mean = self.sum_ms / self.n as f64;
            self.sum_ms = 0.0;
            self.n = 0;
            match self.arm {
                Arm::On => self.stats.last_on_ms = Some(mean),
                Arm::Off => self.stats.last_off_ms = Some(mean),
            }
            self.end_epoch(mean);
        }
        self.arm
    }

    /// `a` (ms per token) is faster than `b` enough to run `arm_a` instead.
    fn better(&self, arm_a: Arm, a: f64, b: f64) -> bool {
        match arm_a {
            Arm::On => a < b * (1.0 - self.cfg.margin),
            Arm::Off => a < b,
        }
    }

    fn end_epoch(&mut self, mean: f64) {
        let cur = self.arm;
        self.phase = match std::mem::replace(&mut self.phase, Phase::Exploit { left: 0 }) {
            Phase::Warmup(mut order, mut seen) => {
                seen.push((cur, mean));
                order.pop_front();
                match order.front() {
                    Some(&next) => {
                        self.arm = next;
                        Phase::Warmup(order, seen)
                    }
                    None => {
                        let avg = |a: Arm| {
                            let v: Vec<f64> = seen.iter().filter(|s| s.0 == a).map(|s| s.1).collect();
                            v.iter().sum::<f64>() / v.len().max(1) as f64
                        };
                        self.chosen = if self.better(Arm::On, avg(Arm::On), avg(Arm::Off)) { Arm::On } else { Arm::Off };
                        self.arm = self.chosen;
                        self.gap = self.cfg.first_gap;
                        Phase::Exploit { left: self.gap }
                    }
                }
            }
            Phase::Exploit { left } => {
                if left > 1 {
                    Phase::Exploit { left: left - 1 }
                } else {
                    self.arm = self.chosen.other();
                    Phase::Explore { before: mean }
                }
            }
            Phase::Explore { before } => {
                self.arm = self.chosen;
                Phase::Confirm { before, other: mean }
            }
            Phase::Confirm { before, other } => {
                let around = 0.5 * (before + mean);
                let other_arm = self.chosen.other();
                if self.better(other_arm, other, around) {
                    self.chosen = other_arm;
                    self.stats.switches += 1;
                    self.gap = self.cfg.first_gap;
                } else {
                    self.gap = (self.gap * 2).min(self.cfg.max_gap);
                }
                self.arm = self.chosen;
                // This epoch (the chosen arm's, if it stayed) counts as the first of the gap.
                Phase::Exploit { left: if self.chosen == cur { self.gap.saturating_sub(1).max(1) } else { self.gap } }
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `tokens` tokens of one-token forwards through `g`, each taking `ms(arm, i)`; returns
    /// the arm of every token.
    fn drive(g: &mut Governor, tokens: usize, ms: impl Fn(Arm, usize) -> f64) -> Vec<Arm> {
        (0..tokens)
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
    fn warmup_runs_abba_then_keeps_the_faster_arm() {
        let cfg = GovernorConfig { epoch: 2, ..Default::default() };
        let mut g = Governor::new(cfg);
        let arms = drive(&mut g, 8, |a, _| if a == Arm::On { 10.0 } else { 20.0 });
        use Arm::*;
        assert_eq!(arms, vec![On, On, Off, Off, Off, Off, On, On]);
        assert_eq!(g.arm(), On);
        let mut g = Governor::new(cfg);
        drive(&mut g, 8, |a, _| if a == Arm::On { 20.0 } else { 10.0 });
        assert_eq!(g.arm(), Off);
    }

    #[test]
    fn prefetching_must_beat_the_margin_to_stay_on() {
        // On is 2% faster: within the 3% margin, so prefetching goes off (fewer bytes read).
        let mut g = Governor::new(GovernorConfig::default());
        drive(&mut g, 32, |a, _| if a == Arm::On { 9.8 } else { 10.0 });
        assert_eq!(g.arm(), Arm::Off);
        // 5% faster: it stays on.
        let mut g = Governor::new(GovernorConfig::default());
        drive(&mut g, 32, |a, _| if a == Arm::On { 9.5 } else { 10.0 });
        assert_eq!(g.arm(), Arm::On);
    }

    #[test]
    fn a_settled_choice_explores_less_and_less() {
        // Prefetching costs 10%: after the warm-up it runs one epoch in first_gap + 1, then one in
        // 2·first_gap + 1, ... up to one in max_gap + 1.
        let cfg = GovernorConfig::default();
        let mut g = Governor::new(cfg);
        let arms = drive(&mut g, 8 * 400, |a, _| if a == Arm::On { 11.0 } else { 10.0 });
        let warm = 4 * cfg.epoch as usize;
        let late = &arms[arms.len() - 8 * 99..];
        assert!(share_on(&arms[warm..]) < 0.06, "{}", share_on(&arms[warm..]));
        assert!(share_on(late) <= 1.0 / (cfg.max_gap as f64 + 1.0), "{}", share_on(late));
        assert!(share_on(late) > 0.0, "the other arm is still explored");
        assert_eq!(g.stats().switches, 0);
        assert_eq!(g.stats().tokens_on + g.stats().tokens_off, 8 * 400);
    }

    #[test]
    fn the_choice_follows_a_change_in_the_machine() {
        // Prefetching pays for the first 800 tokens (another core was free), then costs.
        let mut g = Governor::new(GovernorConfig::default());
        let arms = drive(&mut g, 2400, |a, i| match (a, i < 800) {
            (Arm::On, true) => 8.0,
            (Arm::Off, true) => 10.0,
            (Arm::On, false) => 12.0,
            (Arm::Off, false) => 10.0,
        });
        assert!(share_on(&arms[..800]) > 0.9, "{}", share_on(&arms[..800]));
        assert!(share_on(&arms[1600..]) < 0.1, "{}", share_on(&arms[1600..]));
        assert!(g.stats().switches >= 1);
    }

    #[test]
    fn a_steady_drift_does_not_flip_the_choice() {
        // Both arms slow down as the context grows (1% per epoch); prefetching is 5% faster.
        let mut g = Governor::new(GovernorConfig::default());
        let arms = drive(&mut g, 8 * 200, |a, i| {
            let t = 10.0 * (1.0 + 0.01 * (i / 8) as f64);
            if a == Arm::On { 0.95 * t } else { t }
        });
        assert!(share_on(&arms[32..]) > 0.9, "{}", share_on(&arms[32..]));
        assert_eq!(g.stats().switches, 0);
    }

    #[test]
    fn multi_token_forwards_and_bad_samples() {
        let mut g = Governor::new(GovernorConfig { epoch: 4, ..Default::default() });
        // A verification forward of 5 tokens ends the first epoch at once.
        assert_eq!(g.record(50.0, 5), Arm::Off);
        // Ignored: no tokens, NaN, negative.
        assert_eq!(g.record(1.0, 0), Arm::Off);
        assert_eq!(g.record(f64::NAN, 1), Arm::Off);
        assert_eq!(g.record(-1.0, 1), Arm::Off);
        assert_eq!(g.stats().tokens_on, 5);
        assert_eq!(g.stats().tokens_off, 0);
        assert_eq!(g.stats().last_on_ms, Some(10.0));
    }
}
