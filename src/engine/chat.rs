//! Chat templates: `tokenizer.chat_template` (Jinja) rendered with minijinja, as llama.cpp's
//! `--jinja` mode and Hugging Face's `apply_chat_template` do (transformers
//! `utils/chat_template_utils.py`: `trim_blocks`, `lstrip_blocks`, `raise_exception`,
//! `strftime_now`; checked against jinja2 by `tests/suite/chat_templates.rs`).

use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("the model has no tokenizer.chat_template")]
    NoTemplate,
    #[error("chat template error: {0}")]
    Template(String),
}

/// Render `messages` with the model's template, ending with the assistant's turn opened.
pub fn render(template: &str, messages: &[Message], bos: &str, eos: &str) -> Result<String, ChatError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
    // Hugging Face: `datetime.now().strftime(format)`; here in UTC (native and in the browser).
    env.add_function("strftime_now", |fmt: String| -> Result<String, Error> {
        let secs = web_time::SystemTime::now().duration_since(web_time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let t = chrono::DateTime::from_timestamp(secs, 0).ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "clock out of range"))?;
        let items: Vec<_> = chrono::format::StrftimeItems::new(&fmt).collect();
        if items.iter().any(|i| matches!(i, chrono::format::Item::Error)) {
            return Err(Error::new(ErrorKind::InvalidOperation, format!("strftime_now: bad format '{fmt}'")));
        }
        Ok(t.format_with_items(items.into_iter()).to_string())
    });
    env.add_template("chat", template).map_err(|e| ChatError::Template(e.to_string()))?;
    let t = env.get_template("chat").map_err(|e| ChatError::Template(e.to_string()))?;
    t.render(context! { messages => messages, add_generation_prompt => true, bos_token => bos, eos_token => eos })
        .map_err(|e| ChatError::Template(e.to_string()))
}

/// A reply in OpenAI's harmony format (gpt-oss) split into its reasoning (`analysis` channel)
/// and its content (`final`, and `commentary` without a recipient), as llama.cpp's
/// `common/chat.cpp` GPT-OSS parser does. `None` when `text` has no `<|channel|>` header.
///
/// A reply is a sequence of messages `[<|start|>assistant]<|channel|>NAME[ to=…]<|message|>BODY`
/// each ended by `<|end|>`, `<|return|>`, `<|call|>` or the end of the text.
pub fn split_harmony(text: &str) -> Option<(String, String)> {
    if !text.contains("<|channel|>") {
        return None;
    }
    let (mut reasoning, mut content) = (String::new(), String::new());
    for part in text.split("<|channel|>").skip(1) {
        let Some((header, rest)) = part.split_once("<|message|>") else { continue };
        let end = ["<|end|>", "<|return|>", "<|call|>", "<|start|>"].iter().filter_map(|t| rest.find(t)).min().unwrap_or(rest.len());
        let body = &rest[..end];
        if header.contains("to=") {
            continue; // a tool call (a recipient): neither reasoning nor content
        }
        match header.split_whitespace().next().unwrap_or("") {
            "analysis" => reasoning.push_str(body),
            "final" | "commentary" => content.push_str(body),
            _ => {}
        }
    }
    Some((reasoning, content))
}

/// The harmony tokens that end a message body ([`split_harmony`]'s, plus the next header).
const HARMONY_ENDS: [&str; 5] = ["<|end|>", "<|return|>", "<|call|>", "<|start|>", "<|channel|>"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HarmonyState {
    /// Nothing decided yet: the reply may start with `<|channel|>`.
    Start,
    /// Not a harmony reply: everything is content.
    Plain,
    /// Between messages: waiting for `<|channel|>`.
    Between,
    /// In a header, waiting for `<|message|>`.
    Header,
    /// In a message body: reasoning (`true`) or content (`false`); `None`: a tool call, dropped.
    Body(Option<bool>),
}

/// [`split_harmony`] on text that arrives in pieces (streamed responses): [`Self::push`] returns
/// the reasoning and content that became certain, holding back a possible token's first bytes.
/// A reply that does not start with `<|channel|>` is passed through as content. The pieces of a
/// reply that starts with a header add up to `split_harmony` of the whole.
#[derive(Clone, Debug)]
pub struct HarmonyStream {
    state: HarmonyState,
    buf: String,
    header: String,
}

impl Default for HarmonyStream {
    fn default() -> Self {
        Self { state: HarmonyState::Start, buf: String::new(), header: String::new() }
    }
}

impl HarmonyStream {
    /// Take `text`; returns (reasoning, content) now certain.
    pub fn push(&mut self, text: &str) -> (String, String) {
        self.buf.push_str(text);
        let (mut r, mut c) = (String::new(), String::new());
        loop {
            match self.state {
                HarmonyState::Start => {
                    if let Some(rest) = self.buf.strip_prefix("<|channel|>") {
                        self.buf = rest.to_string();
                        self.state = HarmonyState::Header;
                    } else if "<|channel|>".starts_with(self.buf.as_str()) {
                        return (r, c);
                    } else {
                        self.state = HarmonyState::Plain;
                    }
                }
                HarmonyState::Plain => {
                    c.push_str(&std::mem::take(&mut self.buf));
                    return (r, c);
                }
                HarmonyState::Between => match self.buf.find("<|channel|>") {
                    Some(i) => {
                        self.buf.drain(..i + "<|channel|>".len());
                        self.state = HarmonyState::Header;
                    }
                    None => {
                        let keep = partial_suffix(&self.buf, &["<|channel|>"]);
                        self.buf.drain(..self.buf.len() - keep);
                        return (r, c);
                    }
                },
                HarmonyState::Header => match self.buf.find("<|message|>") {
                    Some(i) => {
                        self.header = self.buf[..i].to_string();
                        self.buf.drain(..i + "<|message|>".len());
                        let kind = if self.header.contains("to=") {
                            None
                        } else {
                            match self.header.split_whitespace().next().unwrap_or("") {
                                "analysis" => Some(true),
                                "final" | "commentary" => Some(false),
                                _ => None,
                            }
                        };
                        self.state = HarmonyState::Body(kind);
                    }
                    None => return (r, c),
                },
                HarmonyState::Body(kind) => {
                    let end = HARMONY_ENDS.iter().filter_map(|t| self.buf.find(t).map(|i| (i, *t))).min();
                    let (take, next) = match end {
                        Some((i, t)) => (i, Some((i + t.len(), t))),
                        None => (self.buf.len() - partial_suffix(&self.buf, &HARMONY_ENDS), None),
                    };
                    match kind {
                        Some(true) => r.push_str(&self.buf[..take]),
                        Some(false) => c.push_str(&self.buf[..take]),
                        None => {}
                    }
                    match next {
                        Some((n, t)) => {
                            self.buf.drain(..n);
                            self.state = if t == "<|channel|>" { HarmonyState::Header } else { HarmonyState::Between };
                        }
                        None => {
                            self.buf.drain(..take);
                            return (r, c);
                        }
                    }
                }
            }
        }
    }

    /// The end of the reply: what was held back (a body runs to the end of the text).
    pub fn finish(&mut self) -> (String, String) {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            HarmonyState::Start if !rest.is_empty() => (String::new(), rest),
            HarmonyState::Plain | HarmonyState::Body(Some(false)) => (String::new(), rest),
            HarmonyState::Body(Some(true)) => (rest, String::new()),
            _ => (String::new(), String::new()),
        }
    }
}

/// Bytes at the end of `s` that could begin one of `tokens` (held back until the next piece).
fn partial_suffix(s: &str, tokens: &[&str]) -> usize {
    let Some(i) = s.rfind('<') else { return 0 };
    let tail = &s[i..];
    if tokens.iter().any(|t| t.len() > tail.len() && t.starts_with(tail)) {
        s.len() - i
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_template_renders() {
        // The ChatML template SmolLM2-Instruct ships (Hugging Face tokenizer_config.json), shortened.
        let t = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let s = render(t, &[Message { role: "user".into(), content: "Hi".into() }], "", "").unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn harmony_replies_split_into_reasoning_and_content() {
        // llama.cpp tests/test-chat.cpp's GPT-OSS cases.
        let (r, c) = split_harmony("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?<|return|>").unwrap();
        assert_eq!((r.as_str(), c.as_str()), ("I'm\nthinking", "Hello, world!\nWhat's up?"));
        let (r, c) = split_harmony("<|channel|>commentary<|message|>Hello, world!\nWhat's up?").unwrap();
        assert_eq!((r.as_str(), c.as_str()), ("", "Hello, world!\nWhat's up?"));
        // A tool call (a recipient) is neither.
        let (r, c) = split_harmony("<|channel|>analysis to=functions.f<|message|>{\"arg1\": 1}<|call|>").unwrap();
        assert_eq!((r.as_str(), c.as_str()), ("", ""));
        assert!(split_harmony("plain text").is_none());
    }

    /// Streamed in pieces cut at every place (two and three pieces), the reply adds up to
    /// `split_harmony` of the whole (itself checked on llama.cpp's cases above).
    #[test]
    fn harmony_streamed_in_pieces_adds_up_to_the_whole() {
        let replies = [
            "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?<|return|>",
            "<|channel|>commentary<|message|>Hello, world!\nWhat's up?",
            "<|channel|>analysis to=functions.f<|message|>{\"arg1\": 1}<|call|>",
            "<|channel|>analysis<|message|>a < b, <| not a token<|end|><|start|>assistant<|channel|>final<|message|>x <|",
            "<|channel|>analysis<|message|>cut off mid-thought",
        ];
        let run = |cuts: &[usize], text: &str| {
            let mut h = HarmonyStream::default();
            let (mut r, mut c) = (String::new(), String::new());
            let mut at = 0;
            for &k in cuts.iter().chain([&text.len()]) {
                let (a, b) = h.push(&text[at..k]);
                r += &a;
                c += &b;
                at = k;
            }
            let (a, b) = h.finish();
            (r + &a, c + &b)
        };
        for text in replies {
            let want = split_harmony(text).unwrap();
            let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            for &i in &cuts {
                assert_eq!(run(&[i], text), want, "{text:?} cut at {i}");
                for &j in cuts.iter().filter(|&&j| j >= i).step_by(3) {
                    assert_eq!(run(&[i, j], text), want, "{text:?} cut at {i}, {j}");
                }
            }
        }
        // Not harmony: passed through as it comes.
        let mut h = HarmonyStream::default();
        assert_eq!(h.push("<|ch"), (String::new(), String::new()));
        assert_eq!(h.push("at"), (String::new(), "<|chat".to_string()));
        assert_eq!(h.push(" <|end|>"), (String::new(), " <|end|>".to_string()));
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = "{{ raise_exception('no system role') }}";
        assert!(matches!(render(t, &[], "", ""), Err(ChatError::Template(_))));
    }
}
