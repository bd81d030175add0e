//! Chat templates rendered by LES (minijinja) against jinja2's rendering, set up as Hugging
//! Face's `apply_chat_template` sets it up (`tools/render_chat_refs.py` writes the expected
//! texts), and the end-of-generation tokens a template's format relies on.

use crate::common::*;
use les::engine::chat::{render, Message};
use les::store::FileSource;

fn msgs(v: &[(&str, &str)]) -> Vec<Message> {
    v.iter().map(|(r, c)| Message { role: r.to_string(), content: c.to_string() }).collect()
}

/// gpt-oss's harmony template (llama.cpp `models/templates/openai-gpt-oss-120b.jinja`, as the
/// GGUF carries it): system prompt with the date and reasoning effort, the system message as a
/// developer message, past assistant turns on the final channel, `<|start|>assistant` opened.
#[test]
fn gpt_oss_harmony_template_renders_as_jinja2() {
    let dir = root().join("tests/fixtures/templates");
    let t = std::fs::read_to_string(dir.join("openai-gpt-oss-120b.jinja")).unwrap();
    let want = std::fs::read_to_string(dir.join("openai-gpt-oss-120b.expected.txt")).unwrap();
    let m = msgs(&[
        ("system", "You are a terse assistant."),
        ("user", "What is the capital of France?"),
        ("assistant", "Paris."),
        ("user", "And of Italy?"),
    ]);
    let got = render(&t, &m, "", "").unwrap();
    // strftime_now: today's date here, the reference's fixed date there.
    let at = got.find("Current date: ").expect("the template prints the date") + "Current date: ".len();
    let date = &got[at..at + 10];
    assert!(date.len() == 10 && date.as_bytes()[4] == b'-' && date.as_bytes()[7] == b'-', "date {date}");
    let got = got.replacen(date, "2026-12-02", 1);
    assert_eq!(got, want);
    // A message whose content carries harmony tags is refused by the template itself.
    let bad = msgs(&[("user", "hi"), ("assistant", "<|channel|>final<|message|>x")]);
    assert!(render(&t, &bad, "", "").is_err());
}

/// gpt-oss's end-of-generation tokens (llama.cpp `llama-vocab.cpp`): `<|return|>` and `<|call|>`
/// end a turn; `<|end|>`, which closes the analysis message mid-turn, does not.
#[test]
fn gpt_oss_stops_on_return_and_call_not_end() {
    let src = FileSource::open(model("rand-gpt-oss.gguf")).unwrap();
    let s = les::engine::Session::load(&src, les::model::ExpertMode::Resident, 64).unwrap();
    let tk = &s.tokenizer;
    let id = |t: &str| {
        let v = tk.encode(t, false, true);
        assert_eq!(v.len(), 1, "{t} is one special token");
        v[0]
    };
    let (ret, call, end) = (id("<|return|>"), id("<|call|>"), id("<|end|>"));
    assert!(tk.is_eog(ret) && tk.is_eog(call));
    assert!(!tk.is_eog(end));
}

/// `les run --chat` on gpt-oss: the harmony prompt (template given as llama.cpp's
/// `--chat-template-file`) becomes single special tokens, the assistant's turn is opened, and a
/// second turn keeps the first reply's final answer only.
#[test]
fn gpt_oss_chat_prompt_tokenizes_into_harmony_tokens() {
    let src = FileSource::open(model("rand-gpt-oss.gguf")).unwrap();
    let mut s = les::engine::Session::load(&src, les::model::ExpertMode::Resident, 64).unwrap();
    assert!(s.chat_prompt(&msgs(&[("user", "hi")])).is_err(), "the fixture carries no template");
    s.chat_template = Some(std::fs::read_to_string(root().join("tests/fixtures/templates/openai-gpt-oss-120b.jinja")).unwrap());
    let reply = "<|channel|>analysis<|message|>Short answer.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>";
    // The reply goes back as generated (the JS chat API and OpenAI clients do): its final answer stays.
    let p = s.chat_prompt(&msgs(&[("user", "Capital of France?"), ("assistant", reply), ("user", "And Italy?")])).unwrap();
    assert!(p.ends_with("<|end|><|start|>user<|message|>And Italy?<|end|><|start|>assistant"), "{p}");
    assert!(p.contains("<|start|>assistant<|channel|>final<|message|>Paris.<|end|>"), "{p}");
    let toks = s.tokenize(&p);
    let id = |t: &str| s.tokenizer.encode(t, false, true)[0];
    let count = |t: &str| toks.iter().filter(|&&x| x == id(t)).count();
    // <|start|>: system, developer? (no system message: none), user, assistant, user, assistant.
    assert_eq!(count("<|start|>"), 5, "{p}");
    assert_eq!(count("<|message|>"), 4);
    assert_eq!(count("<|end|>"), 4);
    assert_eq!(count("<|channel|>"), 1);
}
