//! Chat templates: `tokenizer.chat_template` (Jinja) rendered with minijinja, as llama.cpp's
//! `--jinja` mode and Hugging Face's `apply_chat_template` do.

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
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
    env.add_template("chat", template).map_err(|e| ChatError::Template(e.to_string()))?;
    let t = env.get_template("chat").map_err(|e| ChatError::Template(e.to_string()))?;
    t.render(context! { messages => messages, add_generation_prompt => true, bos_token => bos, eos_token => eos })
        .map_err(|e| ChatError::Template(e.to_string()))
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
    fn raise_exception_is_an_error() {
        let t = "{{ raise_exception('no system role') }}";
        assert!(matches!(render(t, &[], "", ""), Err(ChatError::Template(_))));
    }
}
