//! One generation, step by step: prompt reuse, sampling, stop strings, a full context.
//!
//! The caller runs [`Generation::next_input`] through the model (the part of the prompt the
//! cache does not hold yet, then one token at a time; after a context shift, the kept tokens
//! again) and hands the logits to [`Generation::feed`]. The blocking [`Session::generate_with`],
//! `les serve` and the browser's async loop (one promise per token) share it.

use super::sampling::{Sampler, SamplerConfig};
use super::{now_ms, EngineError, GenStats, Session, Utf8Stream};

/// Why a generation ended, as OpenAI's `finish_reason` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// The token limit, or a full context with [`ContextMode::Stop`].
    Length,
    /// The caller stopped it (abort, a client that went away).
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// What happens when the context is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ContextMode {
    /// Stop with [`FinishReason::Length`] (llama-server's default).
    #[default]
    Stop,
    /// llama.cpp's context shift: keep the first `n_keep` tokens (and a leading BOS), drop the
    /// older half of the rest and continue. LES recomputes the kept tail at its new positions
    /// (llama.cpp instead re-rotates the cached keys), so the result is what a fresh run of the
    /// shortened sequence gives.
    Shift { n_keep: usize },
}

/// Options of one generation (llama.cpp / OpenAI names where they exist).
#[derive(Clone, Debug, Default)]
pub struct GenOptions {
    /// Tokens to generate at most (`max_tokens`, `-n`).
    pub n: usize,
    pub sampler: SamplerConfig,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Stop strings (`stop`): generation ends when the text contains one; it is not returned.
    pub stop: Vec<String>,
    pub context: ContextMode,
}

pub struct Generation {
    sampler: Sampler,
    utf8: Utf8Stream,
    /// Tokens generated so far.
    pub out: Vec<u32>,
    n: usize,
    ignore_eos: bool,
    stops: StopStrings,
    context: ContextMode,
    input: Vec<u32>,
    prefill: bool,
    done: bool,
    pub stats: GenStats,
    t_phase: f64,
}

impl Generation {
    /// Start generating up to `n` tokens after `prompt` (reusing the cache's common prefix when
    /// the session allows it).
    pub fn new(session: &mut Session, prompt: &[u32], n: usize, sampler: &SamplerConfig, ignore_eos: bool) -> Result<Self, EngineError> {
        Self::with_options(session, prompt, &GenOptions { n, sampler: sampler.clone(), ignore_eos, ..Default::default() })
    }

    pub fn with_options(session: &mut Session, prompt: &[u32], o: &GenOptions) -> Result<Self, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() >= session.kv.n_ctx {
            return Err(EngineError::PromptTooLong(prompt.len(), session.kv.n_ctx));
        }
        let reused = session.reuse(prompt);
        let mut s = Sampler::new(o.sampler.clone());
        for &t in prompt {
            s.accept(t);
        }
        let stats = GenStats { prompt_tokens: prompt.len(), prompt_reused: reused, ..Default::default() };
        Ok(Self {
            sampler: s,
            utf8: Utf8Stream::default(),
            out: Vec::new(),
            n: o.n,
            ignore_eos: o.ignore_eos,
            stops: StopStrings::new(&o.stop),
            context: o.context,
            input: prompt[reused..].to_vec(),
            prefill: true,
            done: o.n == 0,
            stats: GenStats { finish_reason: (o.n == 0).then_some(FinishReason::Length), ..stats },
            t_phase: now_ms(),
        })
    }

    /// The tokens to run next (the prompt's new part, then the last sampled token; more than
    /// one after a context shift); `None` when finished.
    pub fn next_input(&mut self) -> Option<Vec<u32>> {
        // Empty only when a caller steps again after a failed forward: nothing left to run.
        if self.done || self.input.is_empty() {
            return None;
        }
        Some(std::mem::take(&mut self.input))
    }

    /// True while the next input is the prompt.
    pub fn is_prefill(&self) -> bool {
        self.prefill
    }

    fn end(&mut self, why: FinishReason) {
        self.done = true;
        if self.stats.finish_reason.is_none() {
            self.stats.finish_reason = Some(why);
        }
    }

    /// Sample from the logits of the last input; returns the token and the text it completes
    /// (possibly empty: an incomplete UTF-8 sequence, or text that may start a stop string), or
    /// `None` when generation ended here.
    pub fn feed(&mut self, session: &mut Session, logits: &[f32]) -> Option<(u32, String)> {
        let now = now_ms();
        if self.prefill {
            self.stats.prompt_ms = now - self.t_phase;
            self.prefill = false;
            self.t_phase = now;
        }
        self.stats.gen_ms = now - self.t_phase;
        let tok = self.sampler.sample(logits);
        if !self.ignore_eos && session.tokenizer.is_eog(tok) {
            self.end(FinishReason::Stop);
            return None;
        }
        self.out.push(tok);
        self.stats.gen_tokens = self.out.len();
        self.sampler.accept(tok);
        let piece = self.utf8.push(&session.tokenizer.token_to_piece(tok, false));
        let text = self.hold_back(piece);
        if self.done {
            return Some((tok, text));
        }
        if self.out.len() >= self.n {
            self.end(FinishReason::Length);
        } else if session.kv.len + 1 >= session.kv.n_ctx {
            match self.context {
                ContextMode::Stop => self.end(FinishReason::Length),
                ContextMode::Shift { n_keep } => self.shift(session, n_keep, tok),
            }
        } else {
            self.input = vec![tok];
        }
        Some((tok, text))
    }

    /// llama.cpp's context shift (`common/` and `tools/main`: `n_discard = (n_past - n_keep) / 2`):
    /// keep the first `n_keep` tokens (plus a leading BOS), drop the next `n_discard`, and run the
    /// rest again at their new positions, then `tok`.
    fn shift(&mut self, session: &mut Session, n_keep: usize, tok: u32) {
        let toks = session.cached_tokens().to_vec();
        let bos = session.tokenizer.bos();
        let keep = (n_keep + usize::from(bos.is_some() && toks.first().copied() == bos)).min(toks.len());
        let discard = (toks.len() - keep) / 2;
        if discard == 0 {
            self.end(FinishReason::Length);
            return;
        }
        // A recurrent state goes back to its checkpoint (or the start): run again from there.
        let kept = session.kv.truncate(keep);
        let mut input = toks[kept..keep].to_vec();
        input.extend_from_slice(&toks[keep + discard..]);
        input.push(tok);
        self.input = input;
        self.stats.context_shifts += 1;
    }

    /// Text that is safe to return ([`StopStrings::push`]); a complete stop string ends
    /// generation.
    fn hold_back(&mut self, piece: String) -> String {
        let (out, hit) = self.stops.push(piece);
        if hit {
            self.end(FinishReason::Stop);
        }
        out
    }

    /// Stop after the current token (the caller's abort).
    pub fn stop(&mut self) {
        self.end(FinishReason::Abort);
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Text still held back (an incomplete UTF-8 sequence, a partial stop string that never
    /// completed); call once finished.
    pub fn finish(&mut self) -> String {
        self.stats.gen_ms = now_ms() - self.t_phase;
        let tail = self.utf8.finish();
        let (rest, hit) = self.stops.finish(tail);
        if hit {
            self.stats.finish_reason = Some(FinishReason::Stop);
        }
        if self.stats.finish_reason.is_none() {
            self.stats.finish_reason = Some(FinishReason::Length);
        }
        rest
    }
}

/// Stop strings over a stream of text pieces (llama-server's `stop`): a suffix that may begin one
/// is held back until it cannot; a complete one is cut off with everything after it.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stop: Vec<String>,
    /// Text not returned yet: it may be the start of a stop string.
    held: String,
    /// A stop string was found (everything after it is dropped).
    cut: bool,
}

impl StopStrings {
    /// Empty strings are ignored.
    pub fn new(stop: &[String]) -> Self {
        Self { stop: stop.iter().filter(|s| !s.is_empty()).cloned().collect(), ..Default::default() }
    }

    /// Whether a stop string was found.
    pub fn stopped(&self) -> bool {
        self.cut
    }

    /// The next piece: returns the text that is safe to pass on, and whether it completed a stop
    /// string (then nothing more is returned).
    pub fn push(&mut self, piece: String) -> (String, bool) {
        if self.cut {
            return (String::new(), true);
        }
        if self.stop.is_empty() {
            return (piece, false);
        }
        self.held.push_str(&piece);
        if let Some(at) = self.stop.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            self.cut = true;
            return (out, true);
        }
        // The longest suffix of `held` that is a proper prefix of a stop string stays.
        let keep = self
            .stop
            .iter()
            .map(|s| (1..s.len().min(self.held.len() + 1)).rev().find(|&k| s.is_char_boundary(k) && self.held.ends_with(&s[..k])).unwrap_or(0))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The end of the text (`tail`: bytes still undecoded): what was held back, unless a stop
    /// string completes with it; and whether one was found at all.
    pub fn finish(&mut self, tail: String) -> (String, bool) {
        if self.cut {
            return (String::new(), true);
        }
        let mut rest = std::mem::take(&mut self.held);
        rest.push_str(&tail);
        // A stop string that completes only with the last bytes.
        if let Some(at) = self.stop.iter().filter_map(|s| rest.find(s.as_str())).min() {
            rest.truncate(at);
            self.cut = true;
        }
        (rest, self.cut)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gen(stop: &[&str]) -> Generation {
        Generation {
            sampler: Sampler::new(SamplerConfig::greedy()),
            utf8: Utf8Stream::default(),
            out: Vec::new(),
            n: 100,
            ignore_eos: false,
            stops: StopStrings::new(&stop.iter().map(|s| s.to_string()).collect::<Vec<_>>()),
            context: ContextMode::Stop,
            input: Vec::new(),
            prefill: false,
            done: false,
            stats: GenStats::default(),
            t_phase: 0.0,
        }
    }

    /// Feed text pieces; returns what was let through and whether generation stopped.
    fn run(g: &mut Generation, pieces: &[&str]) -> (String, bool) {
        let mut out = String::new();
        for p in pieces {
            out.push_str(&g.hold_back(p.to_string()));
            if g.done {
                return (out, true);
            }
        }
        out.push_str(&g.finish());
        (out, g.done)
    }

    #[test]
    fn stop_string_across_pieces_is_cut_with_what_follows() {
        let mut g = gen(&["\nUser:"]);
        let (out, stopped) = run(&mut g, &["Hello", " there\n", "Us", "er: more"]);
        assert_eq!((out.as_str(), stopped), ("Hello there", true));
        assert_eq!(g.stats.finish_reason, Some(FinishReason::Stop));
    }

    #[test]
    fn partial_stop_prefix_is_released_when_it_does_not_complete() {
        let mut g = gen(&["###"]);
        let (out, stopped) = run(&mut g, &["a #", "# b", " c"]);
        assert_eq!((out.as_str(), stopped), ("a ## b c", false));
        assert_eq!(g.stats.finish_reason, Some(FinishReason::Length));
    }

    #[test]
    fn earliest_of_several_stop_strings_wins_and_multibyte_text_is_kept_whole() {
        let mut g = gen(&["é!", "xyz"]);
        let (out, _) = run(&mut g, &["café", " é", "! xyz"]);
        assert_eq!(out, "café ");
    }
}
