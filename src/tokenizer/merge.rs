//! The two merge algorithms: byte-level BPE by merge rank, and SentencePiece by token score.
//!
//! Both follow llama.cpp's sessions in `src/llama-vocab.cpp` (`llm_tokenizer_bpe_session`,
//! `llm_tokenizer_spm_session`): the word starts as one symbol per UTF-8 character; a priority
//! queue holds every adjacent pair that could merge; the best pair is merged, stale queue entries
//! are skipped, and the pairs around the merged symbol are queued again. Ties go to the leftmost
//! pair, which makes the result deterministic.

use super::Vocab;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// A symbol: a byte range of the word, linked to its neighbours. `len == 0` once merged away.
#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    len: u32,
    prev: i32,
    next: i32,
}

fn symbols(word: &str) -> Vec<Sym> {
    let n = word.chars().count();
    let mut out = Vec::with_capacity(n);
    for (i, (start, c)) in word.char_indices().enumerate() {
        out.push(Sym {
            start: start as u32,
            len: c.len_utf8() as u32,
            prev: i as i32 - 1,
            next: if i + 1 == n { -1 } else { i as i32 + 1 },
        });
    }
    out
}

fn text<'a>(word: &'a str, s: &Sym) -> &'a str {
    &word[s.start as usize..(s.start + s.len) as usize]
}

/// Merge `right` into `left` and unlink it.
fn merge(syms: &mut [Sym], left: usize, right: usize) {
    syms[left].len += syms[right].len;
    syms[right].len = 0;
    let next = syms[right].next;
    syms[left].next = next;
    if next >= 0 {
        syms[next as usize].prev = left as i32;
    }
}

/// Merge ranks of a byte-level BPE vocabulary (`tokenizer.ggml.merges`).
pub(crate) struct BpeRanks {
    /// Key: "left right", exactly as the merge is written; value: its rank (index).
    ranks: HashMap<String, u32, super::FxBuild>,
}

impl BpeRanks {
    /// Build from the merge list. As in llama.cpp, a merge is split at its first space after the
    /// first character; the first occurrence of a pair keeps its rank; entries without such a
    /// space can never apply.
    pub(crate) fn new(merges: &[&str]) -> Self {
        let mut ranks = HashMap::with_capacity_and_hasher(merges.len(), super::FxBuild);
        for (i, m) in merges.iter().enumerate() {
            let Some(first_char) = m.chars().next() else { continue };
            if !m[first_char.len_utf8()..].contains(' ') {
                continue;
            }
            ranks.entry((*m).to_owned()).or_insert(i as u32);
        }
        Self { ranks }
    }

    fn rank(&self, key: &mut String, word: &str, l: &Sym, r: &Sym) -> Option<u32> {
        key.clear();
        key.push_str(text(word, l));
        key.push(' ');
        key.push_str(text(word, r));
        self.ranks.get(key.as_str()).copied()
    }
}

/// Tokenize one pre-tokenized, byte-encoded word with BPE merges.
pub(crate) fn bpe_word(vocab: &Vocab, ranks: &BpeRanks, word: &str, ignore_merges: bool, out: &mut Vec<u32>) {
    if word.is_empty() {
        return;
    }
    if ignore_merges {
        if let Some(id) = vocab.id(word) {
            out.push(id);
            return;
        }
    }
    let mut syms = symbols(word);
    // Min-heap on (rank, left); `size` detects stale entries.
    let mut queue: BinaryHeap<Reverse<(u32, u32, u32, u32)>> = BinaryHeap::new();
    let mut key = String::new();
    let push =
        |queue: &mut BinaryHeap<Reverse<(u32, u32, u32, u32)>>, key: &mut String, syms: &[Sym], l: i32, r: i32| {
            if l < 0 || r < 0 {
                return;
            }
            let (ls, rs) = (&syms[l as usize], &syms[r as usize]);
            if let Some(rank) = ranks.rank(key, word, ls, rs) {
                queue.push(Reverse((rank, l as u32, r as u32, ls.len + rs.len)));
            }
        };
    for i in 1..syms.len() {
        push(&mut queue, &mut key, &syms, i as i32 - 1, i as i32);
    }
    while let Some(Reverse((_, l, r, size))) = queue.pop() {
        let (l, r) = (l as usize, r as usize);
        let (ls, rs) = (syms[l], syms[r]);
        if ls.len == 0 || rs.len == 0 || ls.len + rs.len != size {
            continue;
        }
        merge(&mut syms, l, r);
        let (prev, next) = (syms[l].prev, syms[l].next);
        push(&mut queue, &mut key, &syms, prev, l as i32);
        push(&mut queue, &mut key, &syms, l as i32, next);
    }
    for s in syms.iter().filter(|s| s.len > 0) {
        let t = text(word, s);
        match vocab.id(t) {
            Some(id) => out.push(id),
            None => {
                // llama.cpp looks each byte of the symbol up as a one-byte token; only ASCII bytes
                // can be such tokens, the rest are dropped.
                for &b in t.as_bytes() {
                    if b < 0x80 {
                        let one = [b];
                        if let Some(id) = std::str::from_utf8(&one).ok().and_then(|s| vocab.id(s)) {
                            out.push(id);
                        }
                    }
                }
            }
        }
    }
}

/// Totally ordered key of a score: NaN sorts lowest, -0.0 equals 0.0.
fn score_key(s: f32) -> u32 {
    let s = if s.is_nan() { f32::NEG_INFINITY } else { s + 0.0 };
    let b = s.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Tokenize one SentencePiece fragment (spaces already escaped to U+2581) by score-based merges,
/// falling back to byte tokens for characters that are not in the vocabulary.
pub(crate) fn spm(vocab: &Vocab, word: &str, out: &mut Vec<u32>) {
    if word.is_empty() {
        return;
    }
    let mut syms = symbols(word);
    // Max-heap on (score, -left).
    type Entry = (u32, Reverse<u32>, u32, u32);
    let mut queue: BinaryHeap<Entry> = BinaryHeap::new();
    let push = |queue: &mut BinaryHeap<Entry>, syms: &[Sym], l: i32, r: i32| {
        if l < 0 || r < 0 {
            return;
        }
        let (ls, rs) = (&syms[l as usize], &syms[r as usize]);
        // Symbols are contiguous, so the pair's text is one slice of the word.
        let t = &word[ls.start as usize..(ls.start + ls.len + rs.len) as usize];
        if let Some(id) = vocab.id(t) {
            queue.push((score_key(vocab.score(id)), Reverse(l as u32), r as u32, ls.len + rs.len));
        }
    };
    for i in 1..syms.len() {
        push(&mut queue, &syms, i as i32 - 1, i as i32);
    }
    while let Some((_, Reverse(l), r, size)) = queue.pop() {
        let (l, r) = (l as usize, r as usize);
        let (ls, rs) = (syms[l], syms[r]);
        if ls.len == 0 || rs.len == 0 || ls.len + rs.len != size {
            continue;
        }
        merge(&mut syms, l, r);
        let (prev, next) = (syms[l].prev, syms[l].next);
        push(&mut queue, &syms, prev, l as i32);
        push(&mut queue, &syms, l as i32, next);
    }
    let mut i = 0i32;
    while i >= 0 {
        let s = syms[i as usize];
        let t = text(word, &s);
        match vocab.id(t) {
            Some(id) => out.push(id),
            None => {
                for &b in t.as_bytes() {
                    if let Some(id) = vocab.byte_token(b) {
                        out.push(id);
                    }
                }
            }
        }
        i = s.next;
    }
}

#[cfg(test)]
mod tests {
    use super::score_key;

    #[test]
    fn score_order() {
        let v = [f32::NEG_INFINITY, -3.5, -1.0, -0.0, 0.0, 1e-9, 2.0, f32::INFINITY];
        for w in v.windows(2) {
            assert!(score_key(w[0]) <= score_key(w[1]), "{w:?}");
        }
        assert_eq!(score_key(-0.0), score_key(0.0));
        assert_eq!(score_key(f32::NAN), score_key(f32::NEG_INFINITY));
    }
}
