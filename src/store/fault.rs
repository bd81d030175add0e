//! [`FaultySource`]: a [`ByteSource`] wrapper for tests that injects faults by a scripted or
//! seeded plan: an I/O error on the n-th read or on reads touching a byte range, short reads,
//! flipped bits in returned data, and fail-N-times-then-succeed.
//!
//! Faults surface through the ordinary [`StoreError`] variants (`Io` with an "injected fault"
//! message, `ShortRead`), so code under test sees exactly what a failing disk would give it.
//! Bit flips return `Ok` with wrong data, as silent corruption does; only a checksum catches them.
//!
//! ```
//! use les::store::{ByteSource, MemSource, fault::{FaultySource, Rule}};
//! let s = FaultySource::new(MemSource::new(vec![0u8; 64]), 7)
//!     .with(Rule::error_on_read(1))          // the 2nd read fails
//!     .with(Rule::fail_range(32, 64, 1));    // the first read touching [32, 64) fails, later ones succeed
//! let mut b = [0u8; 8];
//! assert!(s.read_at(0, &mut b).is_ok());
//! assert!(s.read_at(0, &mut b).is_err());
//! assert!(s.read_at(40, &mut b).is_err());
//! assert!(s.read_at(40, &mut b).is_ok());
//! ```

use super::{ByteSource, StoreError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Which reads a rule applies to.
#[derive(Clone, Debug, PartialEq)]
pub enum Trigger {
    /// The n-th read (0-based; every `read_at` call on the source counts, failed ones included).
    Nth(u64),
    /// Every read whose range overlaps `[start, end)`.
    Range { start: u64, end: u64 },
    /// Every read.
    Any,
    /// Each read with probability `p`, drawn from the source's seeded generator (deterministic
    /// for a given seed and sequence of reads).
    Random { p: f64 },
}

/// What happens to a read a rule applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// [`StoreError::Io`] (kind `Other`, message "injected fault"); `buf` is left untouched.
    IoError,
    /// Only the first half of `buf` is filled; returns [`StoreError::ShortRead`]. A read of 0 or
    /// 1 bytes cannot be short and passes unharmed (the rule still counts as used).
    ShortRead,
    /// The read succeeds, but bit `bit` (0..8) of one returned byte is flipped: the first byte of
    /// the overlap for a `Range` trigger, a seeded random byte of the buffer otherwise.
    FlipBit { bit: u8 },
}

/// One line of a fault plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    pub trigger: Trigger,
    pub effect: Effect,
    /// How many more times the rule may fire; `None` = unlimited.
    pub times: Option<u64>,
}

impl Rule {
    pub fn new(trigger: Trigger, effect: Effect, times: Option<u64>) -> Self {
        Self { trigger, effect, times }
    }
    /// I/O error on the n-th read (0-based).
    pub fn error_on_read(n: u64) -> Self {
        Self::new(Trigger::Nth(n), Effect::IoError, Some(1))
    }
    /// I/O error on every read touching `[start, end)`.
    pub fn error_on_range(start: u64, end: u64) -> Self {
        Self::new(Trigger::Range { start, end }, Effect::IoError, None)
    }
    /// I/O error on the first `times` reads touching `[start, end)`, then success (a transient fault).
    pub fn fail_range(start: u64, end: u64, times: u64) -> Self {
        Self::new(Trigger::Range { start, end }, Effect::IoError, Some(times))
    }
    /// Short read on the n-th read (0-based).
    pub fn short_on_read(n: u64) -> Self {
        Self::new(Trigger::Nth(n), Effect::ShortRead, Some(1))
    }
    /// Short read on every read touching `[start, end)`.
    pub fn short_on_range(start: u64, end: u64) -> Self {
        Self::new(Trigger::Range { start, end }, Effect::ShortRead, None)
    }
    /// Flip bit `bit` of the byte at absolute offset `at` in every read that returns it.
    pub fn flip_bit(at: u64, bit: u8) -> Self {
        Self::new(Trigger::Range { start: at, end: at.saturating_add(1) }, Effect::FlipBit { bit: bit & 7 }, None)
    }
    /// Apply the rule at most `n` times.
    pub fn times(mut self, n: u64) -> Self {
        self.times = Some(n);
        self
    }
    /// Apply the rule without limit.
    pub fn always(mut self) -> Self {
        self.times = None;
        self
    }
}

/// A fault that was injected (for assertions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Injected {
    /// Index of the read (0-based).
    pub read: u64,
    pub offset: u64,
    pub len: usize,
    pub effect: Effect,
    /// For bit flips: absolute offset of the flipped byte.
    pub flipped_at: Option<u64>,
}

struct State {
    rules: Vec<Rule>,
    rng: u64,
    log: Vec<Injected>,
}

/// A byte source that injects faults into reads of `inner` according to a plan of [`Rule`]s.
/// For each read the first rule that matches and has uses left fires; other reads pass through.
pub struct FaultySource<S> {
    inner: S,
    reads: AtomicU64,
    state: Mutex<State>,
}

/// splitmix64: a tiny deterministic generator (no dependency, same sequence everywhere).
fn next_rand(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl<S: ByteSource> FaultySource<S> {
    /// No faults yet; `seed` drives `Trigger::Random` and the position of random bit flips.
    pub fn new(inner: S, seed: u64) -> Self {
        Self { inner, reads: AtomicU64::new(0), state: Mutex::new(State { rules: Vec::new(), rng: seed, log: Vec::new() }) }
    }
    /// Add a rule (builder form).
    pub fn with(self, rule: Rule) -> Self {
        self.add(rule);
        self
    }
    /// A seeded random plan: every read independently fails with probability `p_error`, is short
    /// with probability `p_short`, or has one bit flipped with probability `p_flip`.
    pub fn random(inner: S, seed: u64, p_error: f64, p_short: f64, p_flip: f64) -> Self {
        let s = Self::new(inner, seed);
        // Rules are tried in order, so convert to conditional probabilities.
        let mut left = 1.0f64;
        for (p, effect) in [(p_error, Effect::IoError), (p_short, Effect::ShortRead), (p_flip, Effect::FlipBit { bit: 0 })] {
            if p > 0.0 && left > 0.0 {
                let cond = (p / left).min(1.0);
                left -= p;
                let effect = if let Effect::FlipBit { .. } = effect { Effect::FlipBit { bit: (seed % 8) as u8 } } else { effect };
                s.add(Rule::new(Trigger::Random { p: cond }, effect, None));
            }
        }
        s
    }
    /// Add a rule to a source already in use (e.g. to corrupt reads from now on).
    pub fn add(&self, rule: Rule) {
        self.lock().rules.push(rule);
    }
    /// Remove every rule: later reads pass through.
    pub fn clear(&self) {
        self.lock().rules.clear();
    }
    /// Number of reads so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
    /// Faults injected so far, in order.
    pub fn injected(&self) -> Vec<Injected> {
        self.lock().log.clone()
    }
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic in a test thread must not hide later faults behind a poisoned lock.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decide the fault for read number `n` of `[offset, offset+len)`: the effect and, for bit
    /// flips, which byte (relative to `offset`).
    fn decide(&self, n: u64, offset: u64, len: usize) -> Option<(Effect, usize)> {
        let mut st = self.lock();
        let end = offset.saturating_add(len as u64);
        let State { rules, rng, log } = &mut *st;
        for rule in rules.iter_mut() {
            if rule.times == Some(0) {
                continue;
            }
            let (hit, first) = match rule.trigger {
                Trigger::Nth(k) => (k == n, None),
                Trigger::Any => (true, None),
                Trigger::Range { start, end: e } => {
                    let hit = len > 0 && offset < e && start < end;
                    (hit, Some(start.max(offset) - offset))
                }
                Trigger::Random { p } => {
                    let u = (next_rand(rng) >> 11) as f64 / (1u64 << 53) as f64;
                    (u < p, None)
                }
            };
            if !hit {
                continue;
            }
            if let Some(t) = rule.times.as_mut() {
                *t -= 1;
            }
            let at = match (rule.effect, first) {
                (Effect::FlipBit { .. }, Some(f)) => f as usize,
                (Effect::FlipBit { .. }, None) if len > 0 => (next_rand(rng) % len as u64) as usize,
                _ => 0,
            };
            let flipped_at = matches!(rule.effect, Effect::FlipBit { .. }).then_some(offset + at as u64);
            log.push(Injected { read: n, offset, len, effect: rule.effect, flipped_at });
            return Some((rule.effect, at));
        }
        None
    }
}

impl<S: ByteSource> ByteSource for FaultySource<S> {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn serves_in_order(&self) -> bool {
        self.inner.serves_in_order()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let n = self.reads.fetch_add(1, Ordering::Relaxed);
        match self.decide(n, offset, buf.len()) {
            None => self.inner.read_at(offset, buf),
            Some((Effect::IoError, _)) => Err(StoreError::Io {
                offset,
                len: buf.len(),
                source: std::io::Error::other(format!("injected fault (read #{n})")),
            }),
            Some((Effect::ShortRead, _)) => {
                let got = buf.len() / 2;
                if buf.len() < 2 {
                    return self.inner.read_at(offset, buf);
                }
                self.inner.read_at(offset, &mut buf[..got])?;
                Err(StoreError::ShortRead { offset, wanted: buf.len(), got })
            }
            Some((Effect::FlipBit { bit }, at)) => {
                self.inner.read_at(offset, buf)?;
                if let Some(b) = buf.get_mut(at) {
                    *b ^= 1 << (bit & 7);
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemSource;

    fn mem() -> MemSource {
        MemSource::new((0..=255u8).collect())
    }

    #[test]
    fn nth_read_fails_once() {
        let s = FaultySource::new(mem(), 1).with(Rule::error_on_read(2));
        let mut b = [0u8; 4];
        s.read_at(0, &mut b).unwrap();
        s.read_at(0, &mut b).unwrap();
        assert!(matches!(s.read_at(0, &mut b), Err(StoreError::Io { offset: 0, len: 4, .. })));
        s.read_at(0, &mut b).unwrap();
        assert_eq!(s.reads(), 4);
        assert_eq!(s.injected().len(), 1);
    }

    #[test]
    fn range_short_flip_and_transient() {
        let s = FaultySource::new(mem(), 1).with(Rule::short_on_range(100, 110));
        let mut b = [0u8; 8];
        s.read_at(90, &mut b).unwrap(); // [90, 98) does not touch the range
        assert!(matches!(s.read_at(96, &mut b), Err(StoreError::ShortRead { offset: 96, wanted: 8, got: 4 })));
        assert!(matches!(s.read_at(109, &mut b), Err(StoreError::ShortRead { .. })));
        s.read_at(110, &mut b).unwrap();

        let s = FaultySource::new(mem(), 1).with(Rule::flip_bit(20, 3));
        let mut b = [0u8; 8];
        s.read_at(16, &mut b).unwrap();
        assert_eq!(b, [16, 17, 18, 19, 20 ^ 8, 21, 22, 23]);
        s.read_at(21, &mut b).unwrap();
        assert_eq!(b[0], 21);

        let s = FaultySource::new(mem(), 1).with(Rule::fail_range(0, 256, 2));
        assert!(s.read_at(0, &mut b).is_err());
        assert!(s.read_at(8, &mut b).is_err());
        s.read_at(8, &mut b).unwrap();
        assert_eq!(b[0], 8);
    }

    #[test]
    fn random_plan_is_deterministic() {
        let run = |seed| {
            let s = FaultySource::random(mem(), seed, 0.2, 0.2, 0.2);
            let mut out = Vec::new();
            for i in 0..200u64 {
                let mut b = [0u8; 16];
                let r = s.read_at(i % 240, &mut b);
                out.push((r.is_ok(), b));
            }
            (out, s.injected().len())
        };
        let (a, na) = run(42);
        let (b, nb) = run(42);
        assert_eq!(a, b);
        assert_eq!(na, nb);
        assert!(na > 60 && na < 180, "{na} faults in 200 reads at p = 0.6");
        assert_ne!(run(43).0, a);
    }
}
