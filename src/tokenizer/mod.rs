//! Tokenizers built from GGUF metadata, producing the same token ids as llama.cpp.
//!
//! Two vocabulary types are supported:
//!
//! * byte-level BPE (`tokenizer.ggml.model = "gpt2"`): a pre-tokenizer chosen by
//!   `tokenizer.ggml.pre` splits the text into words, each word's bytes are mapped to GPT-2's
//!   printable byte alphabet, and merges from `tokenizer.ggml.merges` are applied by rank;
//! * SentencePiece (`tokenizer.ggml.model = "llama"`): spaces become U+2581, characters are merged
//!   by token score (`tokenizer.ggml.scores`), and characters without a token fall back to
//!   `<0xXX>` byte tokens.
//!
//! Before either runs, control, user-defined and unknown tokens (`tokenizer.ggml.token_type`
//! 3, 4, 2) are cut out of the text ([`Tokenizer::encode`]'s `parse_special`).
//!
//! The reference is llama.cpp's `src/llama-vocab.cpp` (loading: `llama_vocab::impl::load`;
//! encoding: `impl::tokenize`, `tokenizer_st_partition`; pieces: `impl::token_to_piece`) and
//! `src/unicode.cpp` (pre-tokenizer splitting). Where llama.cpp's result depends on hash-map
//! iteration order or an unstable sort, this implementation picks the lowest token id.

mod merge;
mod pretokenize;
mod unicode;
mod unicode_data;

use crate::gguf::{GgufFile, Value};
use pretokenize::{CollapsedRegex, Stage};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("missing metadata key '{0}'")]
    MissingKey(String),
    #[error("metadata key '{key}': {why}")]
    BadMetadata { key: String, why: String },
    #[error(
        "unsupported tokenizer model '{0}' (LES reads 'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies)"
    )]
    UnsupportedModel(String),
    #[error("unsupported BPE pre-tokenizer '{0}'")]
    UnsupportedPre(String),
    #[error("pre-tokenizer expression {expr:?}: {why}")]
    BadRegex { expr: String, why: String },
}

// Token attributes (llama.h `llama_token_attr`).
const ATTR_UNKNOWN: u16 = 1 << 0;
const ATTR_UNUSED: u16 = 1 << 1;
const ATTR_NORMAL: u16 = 1 << 2;
const ATTR_CONTROL: u16 = 1 << 3;
const ATTR_USER_DEFINED: u16 = 1 << 4;
const ATTR_BYTE: u16 = 1 << 5;
const ATTR_LSTRIP: u16 = 1 << 7;
const ATTR_RSTRIP: u16 = 1 << 8;

/// FxHash-style hasher: token maps are built from trusted model files and must load fast.
#[derive(Clone, Copy, Default)]
pub(crate) struct FxBuild;

pub(crate) struct FxHasher(u64);

impl BuildHasher for FxBuild {
    type Hasher = FxHasher;
    fn build_hasher(&self) -> FxHasher {
        FxHasher(0)
    }
}

impl FxHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut v = [0u8; 8];
            v[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(v) ^ ((rest.len() as u64) << 56));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Token texts, scores and attributes, with the text → id map.
pub(crate) struct Vocab {
    texts: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<u16>,
    index: HashMap<String, u32, FxBuild>,
}

impl Vocab {
    #[inline]
    pub(crate) fn id(&self, text: &str) -> Option<u32> {
        self.index.get(text).copied()
    }
    #[inline]
    pub(crate) fn score(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }
    /// SentencePiece byte token: `<0xXX>`, else the byte itself as a token.
    pub(crate) fn byte_token(&self, b: u8) -> Option<u32> {
        const HEX: &[u8; 16] = b"0123456789ABCDEF";
        let name = [b'<', b'0', b'x', HEX[(b >> 4) as usize], HEX[(b & 15) as usize], b'>'];
        if let Some(id) = std::str::from_utf8(&name).ok().and_then(|s| self.id(s)) {
            return Some(id);
        }
        let one = [b];
        std::str::from_utf8(&one).ok().and_then(|s| self.id(s))
    }
}

enum Kind {
    Bpe {
        stages: Vec<Stage>,
        ranks: merge::BpeRanks,
        ignore_merges: bool,
    },
    Spm,
}

/// A tokenizer loaded from GGUF metadata.
pub struct Tokenizer {
    kind: Kind,
    vocab: Vocab,
    /// Control / user-defined / unknown tokens, longest text first (llama.cpp's
    /// `cache_special_tokens`).
    special: Vec<u32>,
    /// Positions in `special`, ordered by token text (bytes), to find which special tokens occur
    /// in a text; `first[b]` is the range of those starting with byte b.
    special_sorted: Vec<u32>,
    special_first: Vec<(u32, u32)>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    pre: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.model())
            .field("pre", &self.pre)
            .field("n_vocab", &self.n_vocab())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish_non_exhaustive()
    }
}

/// Keys of the special token ids (`tokenizer.ggml.*_token_id`).
#[derive(Clone, Copy)]
enum Sp {
    Bos,
    Eos,
    Eot,
    Eom,
    Unk,
    Sep,
    Pad,
    Mask,
    FimPre,
    FimSuf,
    FimMid,
    FimPad,
    FimRep,
    FimSep,
}
const N_SP: usize = 14;

/// Key → id slot, in llama.cpp's order (the deprecated prefix/suffix/middle keys last).
const SPECIAL_KEYS: [(&str, Sp); 17] = [
    ("tokenizer.ggml.bos_token_id", Sp::Bos),
    ("tokenizer.ggml.eos_token_id", Sp::Eos),
    ("tokenizer.ggml.eot_token_id", Sp::Eot),
    ("tokenizer.ggml.eom_token_id", Sp::Eom),
    ("tokenizer.ggml.unknown_token_id", Sp::Unk),
    ("tokenizer.ggml.seperator_token_id", Sp::Sep),
    ("tokenizer.ggml.padding_token_id", Sp::Pad),
    ("tokenizer.ggml.mask_token_id", Sp::Mask),
    ("tokenizer.ggml.fim_pre_token_id", Sp::FimPre),
    ("tokenizer.ggml.fim_suf_token_id", Sp::FimSuf),
    ("tokenizer.ggml.fim_mid_token_id", Sp::FimMid),
    ("tokenizer.ggml.fim_pad_token_id", Sp::FimPad),
    ("tokenizer.ggml.fim_rep_token_id", Sp::FimRep),
    ("tokenizer.ggml.fim_sep_token_id", Sp::FimSep),
    ("tokenizer.ggml.prefix_token_id", Sp::FimPre),
    ("tokenizer.ggml.suffix_token_id", Sp::FimSuf),
    ("tokenizer.ggml.middle_token_id", Sp::FimMid),
];

/// Texts by which llama.cpp recognises special tokens whose id the metadata does not give.
const AUTO_DETECT: [(Sp, &[&str]); 8] = [
    (
        Sp::Eot,
        &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ],
    ),
    (Sp::Eom, &["<|eom_id|>"]),
    (
        Sp::FimPre,
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        Sp::FimSuf,
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        Sp::FimMid,
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    (Sp::FimPad, &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"]),
    (
        Sp::FimRep,
        &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
    ),
    (Sp::FimSep, &["<|file_sep|>"]),
];

/// Texts of tokens that end generation (llama.cpp's `special_eog_ids` heuristics).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Pre-tokenizer settings of one `tokenizer.ggml.pre` value.
struct PreSpec {
    exprs: &'static [&'static str],
    ignore_merges: bool,
    /// `Some(v)`: this pre-tokenizer sets llama.cpp's default of add_bos to v.
    add_bos: Option<bool>,
    /// The pre-tokenizer clears the default BOS id.
    no_bos: bool,
}

const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizers LES supports, by `tokenizer.ggml.pre` (llama.cpp `llama_vocab::impl::load`
/// for the names, `llm_tokenizer_bpe` for the expressions).
fn pre_spec(pre: &str) -> Option<PreSpec> {
    use pretokenize::RE_GPT2;
    let spec = |exprs, ignore_merges, add_bos, no_bos| {
        Some(PreSpec {
            exprs,
            ignore_merges,
            add_bos,
            no_bos,
        })
    };
    const GPT2: &[&str] = &[RE_GPT2];
    const SMOLLM: &[&str] = &[r"\p{N}", RE_GPT2];
    const LLAMA3: &[&str] = &[RE_LLAMA3];
    const QWEN2: &[&str] = &[RE_QWEN2];
    const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", RE_GPT2, r"\p{N}+", "[0-9][0-9][0-9]"];
    match pre {
        "" | "default" => spec(DEFAULT, false, None, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" => spec(LLAMA3, true, Some(true), false),
        "dbrx" | "smaug-bpe" => spec(LLAMA3, false, None, false),
        "chatglm-bpe" => spec(LLAMA3, false, None, true),
        "glm4" | "glm5" => spec(LLAMA3, true, None, true),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "stablelm2" | "hunyuan" | "solar-open" | "megrez"
        | "grok-2" => spec(QWEN2, false, None, false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum"
        | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "mpt" | "olmo" | "jais" | "trillion"
        | "granite-docling" | "exaone4" => spec(GPT2, false, None, false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            spec(SMOLLM, false, None, false)
        }
        _ => None,
    }
}

fn stage_for(expr: &str) -> Result<Stage, TokenizerError> {
    Ok(match expr {
        e if e == pretokenize::RE_GPT2 => Stage::Gpt2,
        e if e == RE_LLAMA3 => Stage::Llama3 { digits: 3 },
        e if e == RE_QWEN2 => Stage::Llama3 { digits: 1 },
        e => Stage::Regex(CollapsedRegex::new(e)?),
    })
}

// ---- metadata access with typed errors ----

fn bad(key: &str, why: impl Into<String>) -> TokenizerError {
    TokenizerError::BadMetadata {
        key: key.to_owned(),
        why: why.into(),
    }
}

fn opt_str<'a>(g: &'a GgufFile, key: &str) -> Result<Option<&'a str>, TokenizerError> {
    match g.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(bad(key, format!("expected a string, found {}", v.type_name()))),
    }
}

fn opt_bool(g: &GgufFile, key: &str) -> Result<Option<bool>, TokenizerError> {
    match g.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(bad(key, format!("expected a bool, found {}", v.type_name()))),
    }
}

fn opt_id(g: &GgufFile, key: &str) -> Result<Option<u64>, TokenizerError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|_| !matches!(v, Value::Bool(_)))
            .map(Some)
            .ok_or_else(|| bad(key, format!("expected a token id, found {}", v.display_short()))),
    }
}

fn opt_array<'a>(g: &'a GgufFile, key: &str) -> Result<Option<&'a [Value]>, TokenizerError> {
    match g.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(v) => Err(bad(key, format!("expected an array, found {}", v.type_name()))),
    }
}

fn str_array<'a>(key: &str, a: &'a [Value]) -> Result<Vec<&'a str>, TokenizerError> {
    a.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str()
                .ok_or_else(|| bad(key, format!("element {i} is a {}, expected a string", v.type_name())))
        })
        .collect()
}

impl Tokenizer {
    /// Build the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, TokenizerError> {
        const K_MODEL: &str = "tokenizer.ggml.model";
        const K_PRE: &str = "tokenizer.ggml.pre";
        const K_TOKENS: &str = "tokenizer.ggml.tokens";
        const K_SCORES: &str = "tokenizer.ggml.scores";
        const K_TYPES: &str = "tokenizer.ggml.token_type";
        const K_MERGES: &str = "tokenizer.ggml.merges";

        let model = opt_str(g, K_MODEL)?.ok_or_else(|| TokenizerError::MissingKey(K_MODEL.into()))?;
        let pre_name = opt_str(g, K_PRE)?.unwrap_or("").to_owned();

        // Vocabulary type, its default special ids and flags.
        let mut ids: [Option<u64>; N_SP] = [None; N_SP];
        let (mut add_bos, mut add_eos, mut add_space_prefix);
        let kind = match model {
            "llama" => {
                ids[Sp::Bos as usize] = Some(1);
                ids[Sp::Eos as usize] = Some(2);
                ids[Sp::Unk as usize] = Some(0);
                (add_bos, add_eos, add_space_prefix) = (true, false, true);
                Kind::Spm
            }
            "gpt2" => {
                let merges_v = opt_array(g, K_MERGES)?.ok_or_else(|| TokenizerError::MissingKey(K_MERGES.into()))?;
                let merges = str_array(K_MERGES, merges_v)?;
                let spec = pre_spec(&pre_name).ok_or_else(|| TokenizerError::UnsupportedPre(pre_name.clone()))?;
                ids[Sp::Bos as usize] = Some(11);
                ids[Sp::Eos as usize] = Some(11);
                (add_bos, add_eos, add_space_prefix) = (spec.add_bos.unwrap_or(false), false, false);
                if spec.no_bos {
                    ids[Sp::Bos as usize] = None;
                }
                let stages = spec.exprs.iter().map(|e| stage_for(e)).collect::<Result<Vec<_>, _>>()?;
                Kind::Bpe {
                    stages,
                    ranks: merge::BpeRanks::new(&merges),
                    ignore_merges: spec.ignore_merges,
                }
            }
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };
        if let Some(v) = opt_bool(g, "tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }

        // Token texts, scores, types.
        let tokens_v = opt_array(g, K_TOKENS)?.ok_or_else(|| TokenizerError::MissingKey(K_TOKENS.into()))?;
        let n = tokens_v.len();
        if n == 0 {
            return Err(bad(K_TOKENS, "empty vocabulary"));
        }
        if n > i32::MAX as usize {
            return Err(bad(K_TOKENS, format!("{n} tokens is too many")));
        }
        let mut texts = Vec::with_capacity(n);
        for (i, v) in tokens_v.iter().enumerate() {
            let s = v.as_str().ok_or_else(|| {
                bad(
                    K_TOKENS,
                    format!("element {i} is a {}, expected a string", v.type_name()),
                )
            })?;
            // llama.cpp renames empty tokens so that every text is distinct and non-empty.
            texts.push(if s.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                s.to_owned()
            });
        }
        let scores = match opt_array(g, K_SCORES)? {
            None => vec![0.0; n],
            Some(a) => {
                if a.len() < n {
                    return Err(bad(K_SCORES, format!("{} scores for {n} tokens", a.len())));
                }
                a[..n]
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_f64()
                            .map(|x| x as f32)
                            .ok_or_else(|| bad(K_SCORES, format!("element {i} is a {}", v.type_name())))
                    })
                    .collect::<Result<Vec<f32>, _>>()?
            }
        };
        let mut attrs = match opt_array(g, K_TYPES)? {
            None => vec![ATTR_NORMAL; n],
            Some(a) => {
                if a.len() < n {
                    return Err(bad(K_TYPES, format!("{} token types for {n} tokens", a.len())));
                }
                a[..n]
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        let t = v
                            .as_i64()
                            .ok_or_else(|| bad(K_TYPES, format!("element {i} is a {}", v.type_name())))?;
                        Ok(match t {
                            1 => ATTR_NORMAL,
                            2 => ATTR_UNKNOWN,
                            3 => ATTR_CONTROL,
                            4 => ATTR_USER_DEFINED,
                            5 => ATTR_UNUSED,
                            6 => ATTR_BYTE,
                            _ => 0, // undefined
                        })
                    })
                    .collect::<Result<Vec<u16>, TokenizerError>>()?
            }
        };
        let mut index: HashMap<String, u32, FxBuild> = HashMap::with_capacity_and_hasher(n, FxBuild);
        for (i, t) in texts.iter().enumerate() {
            index.insert(t.clone(), i as u32);
        }

        // Special ids: defaults outside the vocabulary are dropped; valid keys override.
        for slot in ids.iter_mut() {
            if slot.is_some_and(|id| id >= n as u64) {
                *slot = None;
            }
        }
        for (key, sp) in SPECIAL_KEYS {
            if let Some(id) = opt_id(g, key)? {
                if id < n as u64 {
                    ids[sp as usize] = Some(id);
                }
            }
        }
        if let Some(v) = opt_bool(g, "tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        if let Some(v) = opt_bool(g, "tokenizer.ggml.add_eos_token")? {
            add_eos = v;
        }

        // Auto-detected special tokens; they become control tokens.
        for (sp, names) in AUTO_DETECT {
            if ids[sp as usize].is_some() {
                continue;
            }
            if let Some(id) = names.iter().filter_map(|t| index.get(*t).copied()).min() {
                ids[sp as usize] = Some(id as u64);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        // Control tokens named "unused…" are unused.
        for (i, t) in texts.iter().enumerate() {
            if attrs[i] & ATTR_CONTROL != 0 && t.contains("unused") {
                attrs[i] |= ATTR_UNUSED;
            }
        }
        let id32 = |sp: Sp| ids[sp as usize].map(|v| v as u32);
        let mut eog: Vec<u32> = [Sp::FimPad, Sp::FimRep, Sp::FimSep]
            .iter()
            .filter_map(|&s| id32(s))
            .collect();
        for &t in EOG_TEXTS {
            if let Some(&id) = index.get(t) {
                eog.push(id);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = index.get(t) {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        eog.extend([Sp::Eos, Sp::Eot, Sp::Eom].iter().filter_map(|&s| id32(s)));
        eog.sort_unstable();
        eog.dedup();
        let in_eog = |eog: &[u32], t: &str| eog.iter().copied().find(|&id| texts[id as usize] == t);
        // Harmony / solar-open: "<|end|>" ends a message, not the generation.
        if let Some(end) = in_eog(&eog, "<|end|>") {
            let ret = in_eog(&eog, "<|return|>").is_some();
            let call = in_eog(&eog, "<|call|>").is_some() || in_eog(&eog, "<|calls|>").is_some();
            let flush = in_eog(&eog, "<|flush|>").is_some();
            if call && (ret || flush) {
                eog.retain(|&id| id != end);
                attrs[end as usize] = ATTR_USER_DEFINED;
            }
        }
        // Gemma 4 / PLaMo: "</s>" is an ordinary token.
        if let Some(s) = in_eog(&eog, "</s>") {
            if in_eog(&eog, "<|tool_response>").is_some() || in_eog(&eog, "<|plamo:eos|>").is_some() {
                eog.retain(|&id| id != s);
                attrs[s as usize] = ATTR_NORMAL;
            }
        }

        // Tokens cut out of the text before tokenizing, longest first.
        let mut special: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        special.sort_by(|&a, &b| texts[b as usize].len().cmp(&texts[a as usize].len()));

        // Per-model strip attributes (llama.cpp sets these by model / tokenizer name).
        let name = opt_str(g, "general.name")?.unwrap_or("").to_lowercase();
        let arch = opt_str(g, "general.architecture")?.unwrap_or("");
        let set = |attrs: &mut Vec<u16>, t: &str, bit: u16, on: bool| {
            if let Some(&id) = index.get(t) {
                if on {
                    attrs[id as usize] |= bit;
                } else {
                    attrs[id as usize] &= !bit;
                }
            }
        };
        if ["jina-v2-de", "jina-v2-es", "jina-v2-code"]
            .iter()
            .any(|s| pre_name.contains(s))
            || ["nomic-bert-moe", "jina-bert-v3"].iter().any(|s| arch.contains(s))
        {
            set(&mut attrs, "<mask>", ATTR_LSTRIP, true);
        } else if name.contains("phi-3") || name.contains("phi3") {
            for &id in &special {
                attrs[id as usize] |= ATTR_RSTRIP;
            }
            set(&mut attrs, "</s>", ATTR_RSTRIP, true);
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                set(&mut attrs, t, ATTR_RSTRIP, false);
            }
        } else if name.contains("modern-bert") {
            set(&mut attrs, "[MASK]", ATTR_LSTRIP, true);
        }

        let mut special_sorted: Vec<u32> = (0..special.len() as u32).collect();
        special_sorted.sort_by(|&a, &b| texts[special[a as usize] as usize].cmp(&texts[special[b as usize] as usize]));
        let mut special_first = vec![(0u32, 0u32); 256];
        for (b, range) in special_first.iter_mut().enumerate() {
            let first = |k: &u32| texts[special[*k as usize] as usize].as_bytes()[0];
            let lo = special_sorted.partition_point(|k| first(k) < b as u8);
            let hi = special_sorted.partition_point(|k| first(k) <= b as u8);
            *range = (lo as u32, hi as u32);
        }
        Ok(Self {
            kind,
            vocab: Vocab {
                texts,
                scores,
                attrs,
                index,
            },
            special,
            special_sorted,
            special_first,
            bos: id32(Sp::Bos),
            eos: id32(Sp::Eos),
            eot: id32(Sp::Eot),
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
            pre: pre_name,
        })
    }

    /// Tokenize like llama.cpp's `llama_tokenize(vocab, text, add_special, parse_special)`:
    /// with `add_special`, BOS / EOS are added where the model asks for them; with
    /// `parse_special`, control and unknown token texts in `text` become those tokens
    /// (user-defined tokens are always matched).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let frags = self.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        match &self.kind {
            Kind::Spm => {
                let mut prev_special = true;
                let mut buf = String::new();
                for f in frags {
                    match f {
                        Frag::Text(a, b) => {
                            buf.clear();
                            if self.add_space_prefix && prev_special {
                                buf.push('\u{2581}');
                            }
                            for c in text[a..b].chars() {
                                buf.push(if c == ' ' { '\u{2581}' } else { c });
                            }
                            merge::spm(&self.vocab, &buf, &mut out);
                            prev_special = false;
                        }
                        Frag::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Kind::Bpe {
                stages,
                ranks,
                ignore_merges,
            } => {
                let mut word = String::new();
                for f in frags {
                    match f {
                        Frag::Text(a, b) => {
                            let piece = &text[a..b];
                            for r in pretokenize::split(stages, piece) {
                                word.clear();
                                word.extend(piece[r].bytes().map(unicode::byte_to_char));
                                merge::bpe_word(&self.vocab, ranks, &word, *ignore_merges, &mut out);
                            }
                        }
                        Frag::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Split `text` around special tokens (llama.cpp `tokenizer_st_partition`): each special
    /// token, longest first, is cut out of every text fragment at all its non-overlapping
    /// leftmost occurrences.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Frag> {
        if text.is_empty() {
            return Vec::new();
        }
        let present = self.specials_in(text.as_bytes());
        let mut frags = vec![Frag::Text(0, text.len())];
        let mut next = Vec::new();
        for (pos, &id) in self.special.iter().enumerate() {
            if !present[pos] {
                continue;
            }
            let attr = self.vocab.attrs[id as usize];
            if !parse_special && attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let tok = self.vocab.texts[id as usize].as_str();
            let mut found = false;
            next.clear();
            for f in &frags {
                let (mut s, e) = match *f {
                    Frag::Text(s, e) => (s, e),
                    Frag::Token(_) => {
                        next.push(*f);
                        continue;
                    }
                };
                loop {
                    let Some(k) = text[s..e].find(tok) else {
                        if s < e {
                            next.push(Frag::Text(s, e));
                        }
                        break;
                    };
                    found = true;
                    let m = s + k;
                    let mut left_end = m;
                    if attr & ATTR_LSTRIP != 0 {
                        while left_end > s && is_c_space(text.as_bytes()[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > s {
                        next.push(Frag::Text(s, left_end));
                    }
                    next.push(Frag::Token(id));
                    s = m + tok.len();
                    if s >= e {
                        break;
                    }
                    if attr & ATTR_RSTRIP != 0 {
                        while s < e && is_c_space(text.as_bytes()[s]) {
                            s += 1;
                        }
                    }
                }
            }
            if found {
                std::mem::swap(&mut frags, &mut next);
            }
        }
        frags
    }

    /// Which special tokens (positions in `self.special`) occur anywhere in `text`. Only those
    /// can split a fragment, so the partition skips the others; the result is unchanged.
    fn specials_in(&self, text: &[u8]) -> Vec<bool> {
        let mut present = vec![false; self.special.len()];
        let texts = &self.vocab.texts;
        let byte_at = |k: u32, d: usize| texts[self.special[k as usize] as usize].as_bytes().get(d).copied();
        for i in 0..text.len() {
            let (lo, hi) = self.special_first[text[i] as usize];
            let (mut lo, mut hi) = (lo as usize, hi as usize);
            let mut d = 1;
            loop {
                // [lo, hi): tokens starting with text[i..i + d]; the ones of length d sort first.
                let mut k = lo;
                while k < hi && byte_at(self.special_sorted[k], d).is_none() {
                    present[self.special_sorted[k] as usize] = true;
                    k += 1;
                }
                lo = k;
                if lo >= hi || i + d >= text.len() {
                    break;
                }
                let b = Some(text[i + d]);
                let range = &self.special_sorted[lo..hi];
                let a = range.partition_point(|&k| byte_at(k, d) < b);
                let z = range.partition_point(|&k| byte_at(k, d) <= b);
                (lo, hi) = (lo + a, lo + z);
                d += 1;
            }
        }
        present
    }

    /// The bytes of one token as llama.cpp's `llama_token_to_piece(vocab, id, buf, len, 0,
    /// special)`: control and unknown tokens are empty unless `special`; byte-level BPE pieces
    /// are mapped back to bytes, SentencePiece's U+2581 to a space, `<0xXX>` tokens to the byte.
    pub fn token_to_piece(&self, id: u32, special: bool) -> Vec<u8> {
        let Some(text) = self.vocab.texts.get(id as usize) else {
            return Vec::new();
        };
        let attr = self.vocab.attrs[id as usize];
        if !special && attr & (ATTR_UNKNOWN | ATTR_CONTROL) != 0 {
            return Vec::new();
        }
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if attr & ATTR_NORMAL != 0 {
            return match self.kind {
                Kind::Spm => text.replace('\u{2581}', " ").into_bytes(),
                Kind::Bpe { .. } => decode_byte_level(text),
            };
        }
        if attr & ATTR_BYTE != 0 {
            return vec![hex_byte(text)];
        }
        Vec::new()
    }

    /// Concatenated pieces ([`Tokenizer::token_to_piece`]) as UTF-8, invalid sequences replaced.
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend(self.token_to_piece(id, special));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn n_vocab(&self) -> usize {
        self.vocab.texts.len()
    }
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    /// End-of-turn token, given or recognised by its text.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }
    /// Whether the token ends generation: EOS, EOT, EOM and the other tokens llama.cpp marks as
    /// end-of-generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }
    /// All end-of-generation tokens, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }
    /// The token's text as stored in the vocabulary ("" for an id out of range).
    pub fn token_text(&self, id: u32) -> &str {
        self.vocab.texts.get(id as usize).map_or("", String::as_str)
    }
    /// The id of a token text, if the vocabulary has it.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }
    /// Whether `encode(.., add_special = true, ..)` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }
    /// Whether `encode(.., add_special = true, ..)` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos && self.eos.is_some()
    }
    /// `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub fn model(&self) -> &'static str {
        match self.kind {
            Kind::Bpe { .. } => "gpt2",
            Kind::Spm => "llama",
        }
    }
    /// `tokenizer.ggml.pre` ("" when absent).
    pub fn pre(&self) -> &str {
        &self.pre
    }
}

#[derive(Clone, Copy, Debug)]
enum Frag {
    /// Byte range of the input text.
    Text(usize, usize),
    Token(u32),
}

/// C `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// Byte-level BPE token text back to bytes (llama.cpp `llama_decode_text`): characters outside
/// GPT-2's byte alphabet are written as `[UNK_BYTE_0x..<token>]`.
fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match unicode::char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// The byte of a `<0xXX>` token: like `strtol(text.substr(3, 2), 16)`.
fn hex_byte(text: &str) -> u8 {
    let digits = text.as_bytes().get(3..).unwrap_or(&[]);
    let mut v = 0u8;
    for &d in digits.iter().take(2) {
        match (d as char).to_digit(16) {
            Some(x) => v = v.wrapping_mul(16).wrapping_add(x as u8),
            None => break,
        }
    }
    v
}
