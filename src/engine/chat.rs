//! Chat templates: `tokenizer.chat_template` (Jinja) rendered with minijinja, as llama.cpp's
//! `--jinja` mode and Hugging Face's `apply_chat_template` do (transformers
//! `utils/chat_template_utils.py`: `trim_blocks`, `lstrip_blocks`, `raise_exception`,
//! `strftime_now`; checked against jinja2 by `tests/chat_templates.rs`).

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

    #[test]
    fn raise_exception_is_an_error() {
        let t = "{{ raise_exception('no system role') }}";
        assert!(matches!(render(t, &[], "", ""), Err(ChatError::Template(_))));
    }
}
