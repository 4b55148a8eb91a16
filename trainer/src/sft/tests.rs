//! The assistant mask against the Qwen2.5 chat template, and the SFT loss by hand.

use super::*;
use burn::backend::Autodiff;
use fathom_model::{Cpu, Qwen2Config};
use std::path::PathBuf;

fn tokenizer() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen2.5-tokenizer");
    Tokenizer::from_dir(&dir).unwrap()
}

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new(ChatRole::System, "You answer questions about `context`."),
        ChatMessage::new(
            ChatRole::User,
            "Question: What is the access code for vault K-12?\n\nThe document is in `context`.",
        ),
        ChatMessage::new(
            ChatRole::Assistant,
            "Let me search.\n```repl\nimport re\nfor m in re.finditer(\"K-12\", context):\n    print(context[m.start():m.end() + 40])\n```",
        ),
        ChatMessage::new(
            ChatRole::User,
            "Output:\nK-12 holds access code 7731-QX. The courier\n",
        ),
        ChatMessage::new(ChatRole::Assistant, "Found it.\n\n<answer>7731-QX</answer>"),
    ]
}

/// Maximal runs of target tokens, decoded.
fn target_runs(t: &Tokenizer, ex: &SftExample) -> Vec<String> {
    let mut runs = Vec::new();
    let mut current: Vec<u32> = Vec::new();
    for (id, target) in ex.ids.iter().zip(&ex.targets) {
        if *target {
            current.push(*id);
        } else if !current.is_empty() {
            runs.push(t.decode(&current, false).unwrap());
            current.clear();
        }
    }
    if !current.is_empty() {
        runs.push(t.decode(&current, false).unwrap());
    }
    runs
}

#[test]
fn the_mask_covers_exactly_the_assistant_tokens() {
    let t = tokenizer();
    let messages = conversation();
    let ex = render(&t, &messages).unwrap();
    // The ids are the template's tokenization of the whole conversation.
    let text = t.apply_chat_template(&messages, false).unwrap();
    assert_eq!(ex.ids, t.encode(&text, false).unwrap());
    // Each run of targets is one assistant message and its end-of-turn token, nothing else.
    let runs = target_runs(&t, &ex);
    let want: Vec<String> = messages
        .iter()
        .filter(|m| m.role == ChatRole::Assistant)
        .map(|m| format!("{}<|im_end|>", m.content))
        .collect();
    assert_eq!(runs, want);
    // And every non-target token decodes to the rest of the text.
    let others: Vec<u32> = ex
        .ids
        .iter()
        .zip(&ex.targets)
        .filter(|(_, t)| !**t)
        .map(|(i, _)| *i)
        .collect();
    let rest = t.decode(&others, false).unwrap();
    assert!(rest.contains("Output:\nK-12 holds access code"));
    assert!(!rest.contains("<answer>"));
    assert!(rest.ends_with("<|im_start|>assistant\n\n"), "{rest:?}");
}

#[test]
fn traces_render_from_environment_messages() {
    let messages = vec![
        Message {
            role: Role::System,
            content: "sys".into(),
        },
        Message {
            role: Role::User,
            content: "Question: q?".into(),
        },
        Message {
            role: Role::Assistant,
            content: "<answer>a</answer>".into(),
        },
    ];
    let chat = chat_messages(&messages);
    assert_eq!(chat[2].role, ChatRole::Assistant);
    let ex = render(&tokenizer(), &chat).unwrap();
    assert_eq!(
        target_runs(&tokenizer(), &ex),
        vec!["<answer>a</answer><|im_end|>"]
    );
}

type Ad = Autodiff<Cpu>;

#[test]
fn the_loss_is_the_mean_nll_of_assistant_tokens_only() {
    let device = Default::default();
    let model = Qwen2ForCausalLM::<Ad>::random(
        Qwen2Config::with_shape(48, 16, 32, 2, 4, 2),
        9,
        false,
        &device,
    );
    let a = SftExample {
        ids: vec![1, 7, 8, 9, 2, 30, 31, 3],
        targets: vec![false, false, true, true, false, false, true, true],
    };
    let b = SftExample {
        ids: vec![4, 5, 40, 41, 42],
        targets: vec![false, false, false, true, true],
    };
    let batch = sft_batch(&[&a, &b], 0).unwrap();
    assert_eq!(batch.targets, 6);
    let loss = sft_loss(&model, &batch, &device).unwrap().into_scalar() as f64;
    // By hand: each sequence alone, its log-probabilities at its target positions.
    let mut nll = 0.0;
    for ex in [&a, &b] {
        let mask = vec![vec![1u8; ex.ids.len()]];
        let lp = fathom_model::sequence_logprobs(
            &model,
            std::slice::from_ref(&ex.ids),
            &mask,
            1.0,
            &device,
        )
        .unwrap()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
        for t in 1..ex.ids.len() {
            if ex.targets[t] {
                nll -= lp[t - 1] as f64;
            }
        }
    }
    let want = nll / 6.0;
    assert!((loss - want).abs() < 1e-5, "loss {loss}, by hand {want}");
    // Changing a non-target token after the last target leaves the loss unchanged; changing
    // a target changes it.
    let mut c = b.clone();
    c.ids.push(47);
    c.targets.push(false);
    let batch2 = sft_batch(&[&a, &c], 0).unwrap();
    let loss2 = sft_loss(&model, &batch2, &device).unwrap().into_scalar() as f64;
    assert!((loss2 - loss).abs() < 1e-6);
    assert!(
        sft_batch(
            &[&SftExample {
                ids: vec![1, 2],
                targets: vec![false, false]
            }],
            0
        )
        .is_err()
    );
}
