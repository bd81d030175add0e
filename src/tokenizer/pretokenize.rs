//! Pre-tokenizers of byte-level BPE vocabularies: split text into words before BPE merges.
//!
//! Behaviour follows llama.cpp (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`, for the expressions
//! each `tokenizer.ggml.pre` uses; `src/unicode.cpp`, `unicode_regex_split`, for how they run):
//!
//! * A pre-tokenizer is a list of stages. The text starts as one chunk; every stage splits every
//!   chunk further. Text between matches of a stage becomes a chunk of its own.
//! * The three common expressions (GPT-2's, Llama 3's, Qwen 2's) are not run as regular expressions
//!   in llama.cpp but as hand-written scanners with a few deviations from the expressions (e.g. the
//!   GPT-2 scanner's `\s+(?!\S)` never gives back a single white-space character, and the
//!   contractions of the Llama 3 one compare with ASCII lower-casing). [`scan_gpt2`],
//!   [`scan_llama3`] reproduce those scanners.
//! * Any other expression runs as a regular expression over a "collapsed" copy of the text in which
//!   every non-ASCII code point is replaced by one stand-in character per class (number, letter,
//!   punctuation, mark, symbol, other, and U+000B for white space); `\p{..}` in the expression is
//!   rewritten to a class holding that stand-in and the ASCII members of the class.
//!   [`CollapsedRegex`] does the same with fancy-regex.

use super::unicode::{self, Flags};
use super::TokenizerError;
use fancy_regex::Regex;

/// GPT-2's expression, the one llama.cpp replaces with a scanner.
pub(crate) const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// One splitting stage.
pub(crate) enum Stage {
    Gpt2,
    /// Llama 3 (`\p{N}{1,3}`) when `digits == 3`, Qwen 2 (`\p{N}`) when `digits == 1`.
    Llama3 {
        digits: usize,
    },
    Regex(CollapsedRegex),
}

/// A general expression run on collapsed text.
pub(crate) struct CollapsedRegex {
    re: Regex,
    /// Whether the expression used `\p{..}` classes (then it runs on collapsed text; otherwise on
    /// the text with non-ASCII white space replaced by U+000B).
    collapsed: bool,
}

// Stand-ins for non-ASCII code points of each class (llama.cpp uses the bytes 0xD0..0xD5; here
// they are the characters U+00D0..U+00D5, which cannot otherwise occur in a collapsed text
// because every non-ASCII code point is replaced).
const STANDIN_OTHER: char = '\u{d0}';
const STANDIN_NUMBER: char = '\u{d1}';
const STANDIN_LETTER: char = '\u{d2}';
const STANDIN_PUNCT: char = '\u{d3}';
const STANDIN_MARK: char = '\u{d4}';
const STANDIN_SYMBOL: char = '\u{d5}';
const STANDIN_SPACE: char = '\u{0b}';

/// `\p{..}` names llama.cpp rewrites, with the class contents they become.
fn class_contents(name: &str) -> Option<&'static str> {
    Some(match name {
        "N" => r"\x{d1}0-9",
        "L" | "Lu" | "Ll" | "Lt" | "Lm" | "Lo" => r"\x{d2}A-Za-z",
        "P" => r"\x{d3}\x21-\x23\x25-\x2a\x2c-\x2f\x3a-\x3b\x3f-\x40\x5b-\x5d\x5f\x7b\x7d",
        "M" => r"\x{d4}",
        "S" => r"\x{d5}\x24\x2b\x3c-\x3e\x5e\x60\x7c\x7e",
        _ => return None,
    })
}

impl CollapsedRegex {
    /// Rewrite and compile an expression.
    pub(crate) fn new(expr: &str) -> Result<Self, TokenizerError> {
        let bad = |why: String| TokenizerError::BadRegex {
            expr: expr.to_owned(),
            why,
        };
        let mut out = String::with_capacity(expr.len() * 2);
        let mut collapsed = false;
        let mut inside = false;
        let b = expr.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let c = b[i];
            if c == b'\\' && i + 1 < b.len() {
                if b[i + 1] == b'p' && b.get(i + 2) == Some(&b'{') {
                    if let Some(close) = expr[i + 3..].find('}') {
                        let name = &expr[i + 3..i + 3 + close];
                        if let Some(contents) = class_contents(name) {
                            collapsed = true;
                            if !inside {
                                out.push('[');
                            }
                            out.push_str(contents);
                            if !inside {
                                out.push(']');
                            }
                            i += 3 + close + 1;
                            continue;
                        }
                        return Err(bad(format!("unsupported class \\p{{{name}}}")));
                    }
                }
                // Copy the escape and the escaped character unchanged.
                let ch_len = expr[i + 1..].chars().next().map_or(1, char::len_utf8);
                out.push_str(&expr[i..i + 1 + ch_len]);
                i += 1 + ch_len;
                continue;
            }
            if c == b'[' && !inside {
                inside = true;
            } else if c == b']' && inside {
                inside = false;
            }
            let ch_len = expr[i..].chars().next().map_or(1, char::len_utf8);
            out.push_str(&expr[i..i + ch_len]);
            i += ch_len;
        }
        if collapsed && !expr.is_ascii() {
            return Err(bad("classes mixed with non-ASCII characters".into()));
        }
        let re = Regex::new(&out).map_err(|e| bad(e.to_string()))?;
        Ok(Self { re, collapsed })
    }
}

/// Split `text` with the stages; returns the words as byte ranges of `text`.
pub(crate) fn split(stages: &[Stage], text: &str) -> Vec<std::ops::Range<usize>> {
    // Code points and the byte offset of each (plus the end).
    let cps: Vec<u32> = text.chars().map(|c| c as u32).collect();
    let mut byte_at: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    byte_at.push(text.len());

    let mut chunks: Vec<usize> = vec![cps.len()];
    let mut hay: Option<Haystack> = None;
    let mut hay_plain: Option<Haystack> = None;
    for stage in stages {
        let mut next = Vec::with_capacity(chunks.len() * 2);
        match stage {
            Stage::Gpt2 => scan_gpt2(&cps, &chunks, &mut next),
            Stage::Llama3 { digits } => scan_llama3(&cps, &chunks, *digits, &mut next),
            Stage::Regex(r) => {
                let h = if r.collapsed {
                    hay.get_or_insert_with(|| Haystack::new(&cps, true))
                } else {
                    hay_plain.get_or_insert_with(|| Haystack::new(&cps, false))
                };
                regex_split(r, h, &chunks, &mut next);
            }
        }
        chunks = next;
    }
    let mut out = Vec::with_capacity(chunks.len());
    let mut start = 0;
    for len in chunks {
        out.push(byte_at[start]..byte_at[start + len]);
        start += len;
    }
    out
}

/// Text prepared for a general expression, with the byte offset of each code point.
struct Haystack {
    s: String,
    at: Vec<usize>,
}

impl Haystack {
    fn new(cps: &[u32], collapse: bool) -> Self {
        let mut s = String::with_capacity(cps.len() * 2);
        let mut at = Vec::with_capacity(cps.len() + 1);
        for &cp in cps {
            at.push(s.len());
            let c = if cp < 128 {
                char::from_u32(cp).unwrap_or(STANDIN_OTHER)
            } else if unicode::is_whitespace(cp) {
                STANDIN_SPACE
            } else if !collapse {
                char::from_u32(cp).unwrap_or('\u{fffd}')
            } else {
                match unicode::category(cp) {
                    unicode::NUMBER => STANDIN_NUMBER,
                    unicode::LETTER => STANDIN_LETTER,
                    unicode::PUNCTUATION => STANDIN_PUNCT,
                    unicode::MARK => STANDIN_MARK,
                    unicode::SYMBOL => STANDIN_SYMBOL,
                    _ => STANDIN_OTHER,
                }
            };
            s.push(c);
        }
        at.push(s.len());
        Self { s, at }
    }
    /// Code-point index of a byte offset that starts a character.
    fn index_of(&self, byte: usize) -> usize {
        self.at.partition_point(|&b| b < byte)
    }
}

fn regex_split(r: &CollapsedRegex, h: &Haystack, chunks: &[usize], out: &mut Vec<usize>) {
    let mut start = 0;
    for &len in chunks {
        let (b0, b1) = (h.at[start], h.at[start + len]);
        let slice = &h.s[b0..b1];
        let mut done = 0; // code points of this chunk already emitted
        let mut pos = 0; // byte position in slice to search from
        while pos <= slice.len() {
            let m = match r.re.find_from_pos(slice, pos) {
                Ok(Some(m)) => m,
                // No match, or the backtracking limit was hit: leave the rest unsplit.
                _ => break,
            };
            let ms = h.index_of(b0 + m.start()) - start;
            let me = h.index_of(b0 + m.end()) - start;
            if ms > done {
                out.push(ms - done);
            }
            if me > ms {
                out.push(me - ms);
            }
            done = me.max(done);
            // Step past an empty match so the search advances.
            pos = if m.end() > m.start() {
                m.end()
            } else {
                match slice[m.end()..].chars().next() {
                    Some(c) => m.end() + c.len_utf8(),
                    None => break,
                }
            };
        }
        if done < len {
            out.push(len - done);
        }
        start += len;
    }
}

/// Positions of one chunk, with llama.cpp's convention that a position outside the chunk has no
/// code point and no flags.
struct Chunk<'a> {
    cps: &'a [u32],
    start: usize,
    end: usize,
}

const OUTSIDE: u32 = u32::MAX;

impl Chunk<'_> {
    #[inline]
    fn cp(&self, pos: usize) -> u32 {
        if pos >= self.start && pos < self.end {
            self.cps[pos]
        } else {
            OUTSIDE
        }
    }
    #[inline]
    fn flags(&self, pos: usize) -> Flags {
        if pos >= self.start && pos < self.end {
            unicode::flags(self.cps[pos])
        } else {
            Flags::NONE
        }
    }
    /// Whether `pos` starts one of the contractions 's 't 're 've 'm 'll 'd; returns its length.
    /// With `fold`, ASCII upper case letters count as lower case.
    fn contraction(&self, pos: usize, fold: bool) -> Option<usize> {
        if self.cp(pos) != '\'' as u32 || pos + 1 >= self.end {
            return None;
        }
        let low = |c: u32| {
            if fold && (b'A' as u32..=b'Z' as u32).contains(&c) {
                c + 32
            } else {
                c
            }
        };
        let a = low(self.cp(pos + 1));
        if [b's', b't', b'm', b'd'].iter().any(|&x| a == x as u32) {
            return Some(2);
        }
        if pos + 2 < self.end {
            let b = low(self.cp(pos + 2));
            let pair = |x: u8, y: u8| a == x as u32 && b == y as u32;
            if pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l') {
                return Some(3);
            }
        }
        None
    }
    /// Length of the white-space run at `pos`.
    fn whitespace_run(&self, pos: usize) -> usize {
        let mut n = 0;
        while self.flags(pos + n).is_whitespace() {
            n += 1;
        }
        n
    }
}

/// "Other": neither white space, letter nor number, but inside the chunk.
#[inline]
fn is_other(f: Flags) -> bool {
    !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.is_some()
}

/// Iterate over chunks, calling `scan` with each; `scan` returns the word lengths.
fn for_chunks(cps: &[u32], chunks: &[usize], out: &mut Vec<usize>, mut scan: impl FnMut(&Chunk, &mut Vec<usize>)) {
    let mut start = 0;
    for &len in chunks {
        let c = Chunk {
            cps,
            start,
            end: start + len,
        };
        scan(&c, out);
        start += len;
    }
}

/// GPT-2's expression `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`,
/// scanned as llama.cpp's `unicode_regex_split_custom_gpt2` does.
pub(crate) fn scan_gpt2(cps: &[u32], chunks: &[usize], out: &mut Vec<usize>) {
    for_chunks(cps, chunks, out, |c, out| {
        let mut pos = c.start;
        while pos < c.end {
            let begin = pos;
            let cp = c.cp(pos);
            if let Some(n) = c.contraction(pos, false) {
                pos += n;
            } else {
                let space = cp == ' ' as u32;
                let f = if space { c.flags(pos + 1) } else { c.flags(pos) };
                let skip = usize::from(space);
                if f.is_letter() {
                    pos += skip;
                    while c.flags(pos).is_letter() {
                        pos += 1;
                    }
                } else if f.is_number() {
                    pos += skip;
                    while c.flags(pos).is_number() {
                        pos += 1;
                    }
                } else if is_other(f) {
                    pos += skip;
                    while is_other(c.flags(pos)) {
                        pos += 1;
                    }
                } else {
                    let n = c.whitespace_run(pos);
                    if n > 1 && pos + n < c.end {
                        // Leave the last white space to prefix the next word.
                        pos += n - 1;
                    } else if n > 0 {
                        pos += n;
                    } else {
                        pos += 1;
                    }
                }
            }
            out.push(pos - begin);
        }
    });
}

/// Llama 3's expression
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
/// (`digits == 3`) and Qwen 2's, the same with `\p{N}` (`digits == 1`), scanned as llama.cpp's
/// `unicode_regex_split_custom_llama3` / `_qwen2` do.
pub(crate) fn scan_llama3(cps: &[u32], chunks: &[usize], digits: usize, out: &mut Vec<usize>) {
    let is_crlf = |cp: u32| cp == '\r' as u32 || cp == '\n' as u32;
    for_chunks(cps, chunks, out, |c, out| {
        let mut pos = c.start;
        while pos < c.end {
            let cp = c.cp(pos);
            let f = c.flags(pos);
            if let Some(n) = c.contraction(pos, true) {
                out.push(n);
                pos += n;
                continue;
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(is_crlf(cp) || f.is_number()) && (f.is_letter() || c.flags(pos + 1).is_letter()) {
                let begin = pos;
                pos += 1;
                while c.flags(pos).is_letter() {
                    pos += 1;
                }
                out.push(pos - begin);
                continue;
            }
            // \p{N}{1,digits}
            if f.is_number() {
                let mut begin = pos;
                while c.flags(pos).is_number() {
                    pos += 1;
                    if pos - begin >= digits {
                        out.push(pos - begin);
                        begin = pos;
                    }
                }
                if pos > begin {
                    out.push(pos - begin);
                }
                continue;
            }
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`. The scanner tests the flags of the character after an
            // optional space, but requires only that the current position is inside the chunk.
            let space = cp == ' ' as u32;
            let f2 = if space { c.flags(pos + 1) } else { f };
            if !(f2.is_whitespace() || f2.is_letter() || f2.is_number()) && f.is_some() {
                let begin = pos;
                pos += usize::from(space);
                while is_other(c.flags(pos)) {
                    pos += 1;
                }
                while is_crlf(c.cp(pos)) {
                    pos += 1;
                }
                out.push(pos - begin);
                continue;
            }
            // White space: \s*[\r\n]+ | \s+(?!\S) | \s+
            let n = c.whitespace_run(pos);
            let last_newline = (0..n).rev().find(|&k| is_crlf(c.cp(pos + k)));
            let len = if let Some(k) = last_newline {
                k + 1
            } else if n > 1 && pos + n < c.end {
                n - 1
            } else if n > 0 {
                n
            } else {
                1
            };
            out.push(len);
            pos += len;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words<'a>(stages: &[Stage], s: &'a str) -> Vec<&'a str> {
        split(stages, s).into_iter().map(|r| &s[r]).collect()
    }

    #[test]
    fn gpt2_words() {
        let st = [Stage::Gpt2];
        assert_eq!(words(&st, "Hello world's  end"), ["Hello", " world", "'s", " ", " end"]);
        assert_eq!(words(&st, "a   "), ["a", "   "]);
        assert_eq!(words(&st, "x\n\ny"), ["x", "\n", "\n", "y"]);
        assert!(words(&st, "").is_empty());
    }

    #[test]
    fn llama3_words() {
        let st = [Stage::Llama3 { digits: 3 }];
        assert_eq!(
            words(&st, "I'LL pay 1234567!!\n\n ok"),
            ["I", "'LL", " pay", " ", "123", "456", "7", "!!\n\n", " ok"]
        );
        let q = [Stage::Llama3 { digits: 1 }];
        assert_eq!(words(&q, "ab 12"), ["ab", " ", "1", "2"]);
    }

    #[test]
    fn collapsed_regex() {
        let st = [Stage::Regex(CollapsedRegex::new(r"\p{N}").unwrap()), Stage::Gpt2];
        assert_eq!(words(&st, "ab12 ٣x"), ["ab", "1", "2", " ", "٣", "x"]);
        let p = [Stage::Regex(CollapsedRegex::new(r"[\p{P}\$\+<=>\^~\|]+").unwrap())];
        assert_eq!(words(&p, "a+=b…c"), ["a", "+=", "b", "…", "c"]);
        assert!(CollapsedRegex::new(r"\p{Han}+").is_err());
    }
}
