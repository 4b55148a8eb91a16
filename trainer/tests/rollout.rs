//! The rollout engine against the real environment and sandbox, on a small random Qwen2 with
//! the Qwen2.5 tokenizer: exact token bookkeeping against the chat template, multi-turn
//! episodes with masked observations, batched rollouts identical to one episode at a time
//! (greedy), a shared prompt prefilled once per group, and `llm()` calls answered by the
//! policy through the queue without deadlock.
//!
//! This test binary serves as its own sandbox worker (`harness = false`).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use fathom_env::env::{
    AgentAction, EnvConfig, EnvError, Environment, Observation, ReplEnv, ResetRequest, Services,
};
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_model::{ChatRole, Cpu, Qwen2Config, Qwen2ForCausalLM, Sampling, Tokenizer};
use fathom_rewards::record::{Role, Split, Trajectory};
use fathom_trainer::rollout::{Bridge, Chat, EpisodeOutput, EpisodeSpec, RolloutSettings, rollout};
use fathom_trainer::sft::chat_messages;

fn tokenizer() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen2.5-tokenizer");
    Tokenizer::from_dir(&dir).unwrap()
}

fn model(tokenizer: &Tokenizer) -> Qwen2ForCausalLM<Cpu> {
    let config = Qwen2Config::with_shape(tokenizer.vocab_size(), 32, 64, 2, 4, 2);
    Qwen2ForCausalLM::random(config, 5, false, &Default::default())
}

fn pool() -> SandboxPool {
    let mut config = SandboxConfig::new(WorkerCommand::CurrentExe);
    config.idle_workers = 2;
    config.step_timeout = Duration::from_secs(20);
    config.limits.memory_bytes = 512 << 20;
    config.limits.cpu_seconds = 60;
    SandboxPool::new(config).expect("sandbox pool")
}

fn envs(n: usize, bridge: &Bridge, max_turns: usize) -> Vec<Box<dyn Environment>> {
    let pool = pool();
    (0..n)
        .map(|_| {
            let mut services = Services::new(pool.clone(), bridge.sub_lm());
            services.config = EnvConfig {
                max_turns,
                ..EnvConfig::default()
            };
            Box::new(ReplEnv::new(services)) as Box<dyn Environment>
        })
        .collect()
}

fn settings(sampling: Sampling) -> RolloutSettings {
    RolloutSettings {
        sampling,
        max_turn_tokens: 12,
        max_episode_tokens: 8192,
        sub_call_tokens: 8,
        seed: 3,
    }
}

fn specs(groups: usize, per_group: usize) -> Vec<EpisodeSpec> {
    (0..groups * per_group)
        .map(|i| EpisodeSpec {
            reset: ResetRequest::Split {
                split: Split::Train,
                index: i / per_group,
            },
            group: i / per_group,
            stream: i as u64,
        })
        .collect()
}

fn run(
    specs: &[EpisodeSpec],
    sampling: Sampling,
    max_turns: usize,
) -> (Vec<EpisodeOutput>, fathom_trainer::rollout::RolloutStats) {
    let tok = tokenizer();
    let m = model(&tok);
    let chat = Chat::new(&tok, tok.token_id("<|im_end|>").unwrap());
    let bridge = Bridge::new();
    let mut envs = envs(specs.len(), &bridge, max_turns);
    rollout(
        &m,
        &chat,
        &mut envs,
        specs,
        &settings(sampling),
        &bridge,
        &Default::default(),
    )
    .unwrap()
}

/// The text the template renders for a finished episode, through its last assistant turn.
fn rendered_through_last_turn(tok: &Tokenizer, t: &Trajectory) -> String {
    let last = t
        .messages
        .iter()
        .rposition(|m| m.role == Role::Assistant)
        .expect("an assistant turn");
    tok.apply_chat_template(&chat_messages(&t.messages[..=last]), false)
        .unwrap()
}

fn bookkeeping_is_exact_and_episodes_are_multi_turn() {
    let sampling = Sampling::Sample {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
    };
    let (outputs, stats) = run(&specs(2, 2), sampling, 3);
    let tok = tokenizer();
    let eot = tok.token_id("<|im_end|>").unwrap();
    for (i, out) in outputs.iter().enumerate() {
        let t = out.trajectory.as_ref().expect("a trajectory");
        assert_eq!(out.turns, 3, "episode {i}: three turns (the cap)");
        assert_eq!(t.steps.len(), 3);
        let s = &out.sample;
        assert_eq!(s.ids.len(), s.sampled.len());
        assert_eq!(s.ids.len(), s.logprobs.len());
        assert_eq!(
            s.sampled.iter().filter(|x| **x).count(),
            out.generated_tokens
        );
        // Sampled log-probabilities are real; everything else is 0 and masked.
        for ((&m, &lp), &id) in s.sampled.iter().zip(&s.logprobs).zip(&s.ids) {
            if m {
                assert!(lp.is_finite() && lp <= 0.0);
            } else {
                assert_eq!(lp, 0.0);
                let _ = id;
            }
        }
        // The ids decode to exactly the template's rendering of the conversation.
        let decoded = tok.decode(&s.ids, false).unwrap();
        let expected = rendered_through_last_turn(&tok, t);
        let rest = expected.strip_prefix(&decoded).unwrap_or_else(|| {
            panic!("episode {i}: ids decode to\n{decoded}\n---\nnot a prefix of\n{expected}")
        });
        assert!(
            rest == "\n" || rest == "<|im_end|>\n",
            "episode {i}: left {rest:?}"
        );
        // Every masked run after the prompt is an observation exactly as the template
        // tokenizes it: its text re-encodes to the same ids.
        let mut t0 = 0;
        while t0 < s.ids.len() {
            let mut t1 = t0;
            while t1 < s.ids.len() && s.sampled[t1] == s.sampled[t0] {
                t1 += 1;
            }
            if !s.sampled[t0] {
                let text = tok.decode(&s.ids[t0..t1], false).unwrap();
                let ids = tok.encode(&text, false).unwrap();
                assert_eq!(
                    ids,
                    s.ids[t0..t1].to_vec(),
                    "episode {i}: masked run at {t0}"
                );
                if t0 > 0 {
                    let starts = [eot]; // after a cut turn the template's end-of-turn
                    assert!(
                        text.starts_with("\n<|im_start|>user") || s.ids[t0] == starts[0],
                        "episode {i}: {text:?}"
                    );
                }
            }
            t0 = t1;
        }
        // Observations are in the conversation and masked: every user turn after the first.
        let observations = t.messages.iter().filter(|m| m.role == Role::User).count() - 1;
        assert!(observations >= 2, "episode {i}: multi-turn");
    }
    // The two samples of each group shared one prefill of their prompt.
    let prompt = |i: usize| {
        let out = &outputs[i];
        out.sample.sampled.iter().position(|s| *s).unwrap()
    };
    let fed_once = prompt(0) + prompt(2);
    let observed: usize = outputs
        .iter()
        .map(|o| o.sample.ids.len() - prompt(0).min(o.sample.ids.len()))
        .sum();
    assert!(
        stats.prefill_tokens <= fed_once + observed,
        "{} fed; prompts once would be {fed_once} + {observed}",
        stats.prefill_tokens
    );
    eprintln!(
        "4 episodes: {} forward passes, {} tokens fed, {} sampled",
        stats.forward_passes, stats.prefill_tokens, stats.generated_tokens
    );
}

/// Same tokens and masks; log-probabilities equal up to f32 summation order (a row's logits
/// are computed in a different batch, so the matmul may block its sums differently).
fn assert_same(a: &EpisodeOutput, b: &EpisodeOutput, what: &str) {
    assert_eq!(a.sample.ids, b.sample.ids, "{what}: tokens");
    assert_eq!(a.sample.sampled, b.sample.sampled, "{what}: mask");
    for (x, y) in a.sample.logprobs.iter().zip(&b.sample.logprobs) {
        assert!((x - y).abs() < 1e-4, "{what}: log-probability {x} vs {y}");
    }
}

fn batched_rollouts_equal_one_episode_at_a_time() {
    let all = specs(2, 2);
    let (batched, _) = run(&all, Sampling::Greedy, 2);
    for (i, spec) in all.iter().enumerate() {
        let (alone, _) = run(std::slice::from_ref(spec), Sampling::Greedy, 2);
        assert_same(&alone[0], &batched[i], &format!("greedy episode {i}"));
    }
    // Sampled rollouts too: a sequence's draws come from its own stream.
    let sampling = Sampling::Sample {
        temperature: 1.2,
        top_p: 0.95,
        top_k: 0,
    };
    let (batched, _) = run(&all, sampling, 2);
    let (alone, _) = run(&all[3..], sampling, 2);
    assert_same(&alone[0], &batched[3], "sampled episode 3");
}

/// An environment whose first turn runs fixed code calling `llm()` (whatever the model wrote),
/// while the conversation keeps the model's own text.
struct LlmFirst(ReplEnv);

impl Environment for LlmFirst {
    fn reset(&mut self, request: ResetRequest) -> Result<Observation, EnvError> {
        self.0.reset(request)
    }

    fn step(&mut self, action: AgentAction) -> Result<Observation, EnvError> {
        let AgentAction::Message(text) = action else {
            return self.0.step(action);
        };
        let code = "a = llm('Say hi. ' + context[:40])\nb = llm('And again: ' + context[40:80])\nprint(type(a).__name__, type(b).__name__)";
        let mut obs = self.0.step(AgentAction::Code(code.into()))?;
        let n = obs.messages.len();
        obs.messages[n - 2].content = text; // the template check sees the model's turn
        Ok(obs)
    }

    fn abort(&mut self, reason: &str) -> Result<(), EnvError> {
        self.0.abort(reason)
    }

    fn trajectory(&self) -> Result<Trajectory, EnvError> {
        self.0.trajectory()
    }
}

fn llm_calls_are_answered_by_the_policy() {
    let tok = tokenizer();
    let m = model(&tok);
    let chat = Chat::new(&tok, tok.token_id("<|im_end|>").unwrap());
    let bridge = Bridge::new();
    let pool = pool();
    let mut envs: Vec<Box<dyn Environment>> = (0..3)
        .map(|_| {
            let mut services = Services::new(pool.clone(), bridge.sub_lm());
            services.config.max_turns = 1;
            Box::new(LlmFirst(ReplEnv::new(services))) as Box<dyn Environment>
        })
        .collect();
    let specs = specs(3, 1);
    let (outputs, stats) = rollout(
        &m,
        &chat,
        &mut envs,
        &specs,
        &settings(Sampling::Greedy),
        &bridge,
        &Default::default(),
    )
    .unwrap();
    assert_eq!(stats.sub_calls, 6, "two calls per episode");
    for out in &outputs {
        let t = out.trajectory.as_ref().unwrap();
        let calls = &t.steps[0].llm_calls;
        assert_eq!(calls.len(), 2);
        let output = t.steps[0].output.as_ref().expect("the cell ran");
        assert!(output.stdout.contains("str str"), "{:?}", output);
    }
    let _ = ChatRole::User;
}

fn main() {
    fathom_env::sandbox::run_worker_if_requested();
    let tests: [(&str, fn()); 3] = [
        (
            "bookkeeping_is_exact_and_episodes_are_multi_turn",
            bookkeeping_is_exact_and_episodes_are_multi_turn,
        ),
        (
            "batched_rollouts_equal_one_episode_at_a_time",
            batched_rollouts_equal_one_episode_at_a_time,
        ),
        (
            "llm_calls_are_answered_by_the_policy",
            llm_calls_are_answered_by_the_policy,
        ),
    ];
    common::run_tests(&tests);
}
