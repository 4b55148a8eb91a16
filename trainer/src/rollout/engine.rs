//! The generation loop: every live episode's next tokens and every queued `llm()` request's,
//! one packed forward pass per iteration over whatever rows have tokens to feed.

use std::collections::HashMap;
use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};
use crossbeam_channel::{Receiver, Sender, select, unbounded};
use fathom_env::env::{AgentAction, Environment, Observation};
use fathom_model::{ChatMessage, ChatRole, KvCache, ModelBackend, Qwen2ForCausalLM};
use fathom_rewards::record::Trajectory;
use rand::rngs::StdRng;

use super::bridge::{Bridge, Prompt, Request};
use super::chat::Chat;
use super::{
    EpisodeOutput, EpisodeSpec, RolloutError, RolloutEvent, RolloutObserver, RolloutSettings,
    RolloutStats,
};
use crate::grpo::Sample;

/// What the engine tells an episode's thread.
enum ToEnv {
    /// Take this assistant turn.
    Step(String),
    /// End the episode with this reason.
    Abort(String),
}

/// What an episode's thread reports.
enum FromEnv {
    /// The observation after a reset or a step (or why there is none).
    Observed {
        episode: usize,
        result: Result<Observation, String>,
    },
    /// The episode is over: its record (or why there is none).
    Finished {
        episode: usize,
        trajectory: Result<Trajectory, String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Reset sent, no observation yet.
    Starting,
    /// Prompt known, waiting for the group's prefill.
    Ready,
    /// Has tokens to feed or is sampling.
    Generating,
    /// A turn (or an abort) was sent to the environment.
    Waiting,
    /// The environment reported the end.
    Finished,
}

struct Live {
    phase: Phase,
    /// The episode's thread is working (resetting, stepping, aborting) rather than waiting for
    /// the engine's next action.
    busy: bool,
    row: Option<usize>,
    rng: StdRng,
    sample: Sample,
    turn: Vec<u32>,
    pending: Vec<u32>,
    turns: usize,
    generated: usize,
    truncated: bool,
    ended_with_eot: bool,
    to_env: Sender<ToEnv>,
    trajectory: Option<Result<Trajectory, String>>,
}

struct SubRow {
    row: usize,
    prompt: Prompt,
    rng: StdRng,
    pending: Vec<u32>,
    out: Vec<u32>,
    reply: Sender<Result<String, String>>,
}

/// Who a fed segment belongs to.
#[derive(Clone, Copy)]
enum Owner {
    Episode(usize),
    Sub(usize),
}

struct Engine<'a, B: ModelBackend> {
    observer: &'a mut dyn RolloutObserver,
    model: &'a Qwen2ForCausalLM<B>,
    chat: &'a Chat<'a>,
    settings: &'a RolloutSettings,
    device: &'a B::Device,
    cache: KvCache<B>,
    free_rows: Vec<usize>,
    episodes: Vec<Live>,
    subs: Vec<Option<SubRow>>,
    /// Requests received but not yet given a row.
    queued: Vec<Request>,
    stats: RolloutStats,
}

/// Runs `specs` to their ends; see [`super::rollout`].
#[allow(clippy::too_many_arguments)]
pub(super) fn run<B: ModelBackend>(
    model: &Qwen2ForCausalLM<B>,
    chat: &Chat<'_>,
    envs: &mut [Box<dyn Environment>],
    specs: &[EpisodeSpec],
    settings: &RolloutSettings,
    bridge: &Bridge,
    device: &B::Device,
    observer: &mut dyn RolloutObserver,
) -> Result<(Vec<EpisodeOutput>, RolloutStats), RolloutError> {
    if envs.len() < specs.len() {
        return Err(RolloutError::Setup(format!(
            "{} environments for {} episodes",
            envs.len(),
            specs.len()
        )));
    }
    settings.validate().map_err(RolloutError::Setup)?;
    let (events_tx, events) = unbounded::<FromEnv>();
    std::thread::scope(|scope| {
        let mut episodes = Vec::with_capacity(specs.len());
        for (i, (env, spec)) in envs.iter_mut().zip(specs).enumerate() {
            let (to_env, actions) = unbounded::<ToEnv>();
            let events_tx = events_tx.clone();
            let reset = spec.reset.clone();
            scope.spawn(move || drive(i, env.as_mut(), reset, actions, events_tx));
            episodes.push(Live {
                phase: Phase::Starting,
                busy: true,
                row: None,
                rng: fathom_model::sequence_rng(settings.seed, spec.stream),
                sample: Sample {
                    ids: Vec::new(),
                    sampled: Vec::new(),
                    logprobs: Vec::new(),
                },
                turn: Vec::new(),
                pending: Vec::new(),
                turns: 0,
                generated: 0,
                truncated: false,
                ended_with_eot: false,
                to_env,
                trajectory: None,
            });
        }
        drop(events_tx);
        let mut engine = Engine {
            observer,
            model,
            chat,
            settings,
            device,
            cache: model.new_cache(),
            free_rows: Vec::new(),
            episodes,
            subs: Vec::new(),
            queued: Vec::new(),
            stats: RolloutStats::default(),
        };
        let result = engine.run(specs, &events, bridge.requests());
        if result.is_err() {
            // Stop every episode so the threads end.
            for ep in &engine.episodes {
                let _ = ep.to_env.send(ToEnv::Abort("the rollout failed".into()));
            }
            while events.recv().is_ok() {}
        }
        result?;
        let outputs = engine
            .episodes
            .into_iter()
            .map(|ep| EpisodeOutput {
                trajectory: ep
                    .trajectory
                    .unwrap_or_else(|| Err("the episode never finished".into())),
                sample: ep.sample,
                turns: ep.turns,
                generated_tokens: ep.generated,
                truncated: ep.truncated,
            })
            .collect();
        Ok((outputs, engine.stats))
    })
}

/// An episode's thread: reset, then one step per turn the engine sends, then the record.
fn drive(
    episode: usize,
    env: &mut dyn Environment,
    reset: fathom_env::env::ResetRequest,
    actions: Receiver<ToEnv>,
    events: Sender<FromEnv>,
) {
    let report = |result: Result<Observation, String>| {
        let done = result.as_ref().map(|o| o.done).unwrap_or(true);
        let _ = events.send(FromEnv::Observed { episode, result });
        done
    };
    let mut failure = None;
    let first = env.reset(reset).map_err(|e| e.to_string());
    if let Err(e) = &first {
        failure = Some(format!("the environment failed to reset: {e}"));
    }
    let mut done = report(first);
    while !done {
        match actions.recv() {
            Ok(ToEnv::Step(text)) => {
                let result = env
                    .step(AgentAction::Message(text))
                    .map_err(|e| e.to_string());
                if let Err(e) = &result {
                    // End the episode with the error, so its record says why.
                    let _ = env.abort(&format!("the environment failed: {e}"));
                }
                done = report(result);
            }
            Ok(ToEnv::Abort(reason)) => {
                let _ = env.abort(&reason);
                break;
            }
            Err(_) => {
                let _ = env.abort("the rollout stopped");
                break;
            }
        }
    }
    let trajectory = match failure {
        Some(message) => Err(message),
        None => env.trajectory().map_err(|e| e.to_string()),
    };
    let _ = events.send(FromEnv::Finished {
        episode,
        trajectory,
    });
}

impl<B: ModelBackend> Engine<'_, B> {
    fn run(
        &mut self,
        specs: &[EpisodeSpec],
        events: &Receiver<FromEnv>,
        requests: &Receiver<Request>,
    ) -> Result<(), RolloutError> {
        // Every reset first, so each group's shared prompt is prefilled once.
        self.settle(events, requests)?;
        self.prefill_groups(specs)?;
        loop {
            self.settle(events, requests)?;
            if self.episodes.iter().all(|e| e.phase == Phase::Finished) {
                return Ok(());
            }
            if !self.step()? {
                return Err(RolloutError::Setup(
                    "the rollout stalled: no episode or request has tokens to generate".into(),
                ));
            }
        }
    }

    /// Waits until every episode thread is either waiting for the engine or blocked on a
    /// request the engine has received, then gives queued requests their rows in a fixed
    /// order. Environments run while the previous forward pass ran; what they report is taken
    /// in at this boundary and no other, so which tokens share a forward pass never depends on
    /// thread timing, and a rollout is reproducible bit for bit.
    fn settle(
        &mut self,
        events: &Receiver<FromEnv>,
        requests: &Receiver<Request>,
    ) -> Result<(), RolloutError> {
        let t = Instant::now();
        loop {
            while let Ok(event) = events.try_recv() {
                self.handle_event(event)?;
            }
            while let Ok(request) = requests.try_recv() {
                self.queued.push(request);
            }
            let busy = self.episodes.iter().filter(|e| e.busy).count();
            let blocked = self.subs.iter().flatten().count() + self.queued.len();
            if busy <= blocked {
                break;
            }
            select! {
                recv(events) -> event => {
                    let event = event.map_err(|_| {
                        RolloutError::Setup("episode threads ended early".into())
                    })?;
                    self.handle_event(event)?;
                }
                recv(requests) -> request => {
                    if let Ok(request) = request {
                        self.queued.push(request);
                    }
                }
            }
        }
        self.stats.environment_s += t.elapsed().as_secs_f64();
        let mut queued = std::mem::take(&mut self.queued);
        queued.sort_by_cached_key(|r| format!("{:?}", r.prompt));
        for request in queued {
            self.handle_request(request)?;
        }
        Ok(())
    }

    fn alloc_row(&mut self) -> usize {
        self.free_rows.pop().unwrap_or_else(|| self.cache.add_row())
    }

    fn free_row(&mut self, row: usize) -> Result<(), RolloutError> {
        self.cache.release_row(row)?;
        self.free_rows.push(row);
        Ok(())
    }

    /// Prefills each group's prompt once, forks it for the other samples of the group, and
    /// draws every episode's first token from it.
    fn prefill_groups(&mut self, specs: &[EpisodeSpec]) -> Result<(), RolloutError> {
        let mut leaders: HashMap<(usize, Vec<u32>), usize> = HashMap::new();
        let mut order: Vec<(usize, usize)> = Vec::new(); // (episode, segment)
        let mut segments: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            if self.episodes[i].phase != Phase::Ready {
                continue;
            }
            let key = (spec.group, self.episodes[i].sample.ids.clone());
            let segment = match leaders.get(&key) {
                Some(&s) => s,
                None => {
                    let row = self.alloc_row();
                    segments.push((row, key.1.clone()));
                    leaders.insert(key, segments.len() - 1);
                    segments.len() - 1
                }
            };
            order.push((i, segment));
        }
        if segments.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let refs: Vec<(usize, &[u32])> = segments
            .iter()
            .map(|(r, ids)| (*r, ids.as_slice()))
            .collect();
        let logits = fathom_model::prefill(self.model, &mut self.cache, &refs, self.device)?;
        self.stats.prefill_tokens += segments.iter().map(|(_, ids)| ids.len()).sum::<usize>();
        self.stats.forward_passes += 1;
        // Rows: the leader keeps the prefilled row, every other sample forks it.
        let mut used = vec![false; segments.len()];
        for &(i, s) in &order {
            let row = if used[s] {
                self.cache.fork_row(segments[s].0)?
            } else {
                used[s] = true;
                segments[s].0
            };
            self.episodes[i].row = Some(row);
        }
        let index: Vec<i64> = order.iter().map(|&(_, s)| s as i64).collect();
        let n = index.len();
        let picked = logits.select(
            0,
            Tensor::<B, 1, Int>::from_data(TensorData::new(index, [n]), self.device),
        );
        let mut rngs: Vec<StdRng> = order
            .iter()
            .map(|&(i, _)| self.episodes[i].rng.clone())
            .collect();
        let tokens = fathom_model::sample(picked, self.settings.sampling, &mut rngs)?;
        self.stats.generation_s += t.elapsed().as_secs_f64();
        for ((&(i, _), rng), (token, logprob)) in order.iter().zip(rngs).zip(tokens) {
            self.episodes[i].rng = rng;
            self.episodes[i].phase = Phase::Generating;
            self.accept(i, token, logprob)?;
        }
        Ok(())
    }

    /// One forward pass over every row with tokens to feed; false when there were none.
    fn step(&mut self) -> Result<bool, RolloutError> {
        let mut owners = Vec::new();
        let mut segments: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, ep) in self.episodes.iter_mut().enumerate() {
            if ep.phase == Phase::Generating && !ep.pending.is_empty() {
                segments.push((
                    ep.row.expect("a generating episode has a row"),
                    std::mem::take(&mut ep.pending),
                ));
                owners.push(Owner::Episode(i));
            }
        }
        for (j, sub) in self.subs.iter_mut().enumerate() {
            if let Some(sub) = sub
                && !sub.pending.is_empty()
            {
                segments.push((sub.row, std::mem::take(&mut sub.pending)));
                owners.push(Owner::Sub(j));
            }
        }
        if segments.is_empty() {
            return Ok(false);
        }
        let t = Instant::now();
        let refs: Vec<(usize, &[u32])> = segments
            .iter()
            .map(|(r, ids)| (*r, ids.as_slice()))
            .collect();
        let logits = fathom_model::prefill(self.model, &mut self.cache, &refs, self.device)?;
        self.stats.forward_passes += 1;
        self.stats.prefill_tokens += segments.iter().map(|(_, ids)| ids.len()).sum::<usize>();
        self.stats.peak_cache_bytes = self.stats.peak_cache_bytes.max(self.cache.memory_bytes());
        let mut rngs: Vec<StdRng> = owners
            .iter()
            .map(|o| match *o {
                Owner::Episode(i) => self.episodes[i].rng.clone(),
                Owner::Sub(j) => self.subs[j].as_ref().expect("live sub-call").rng.clone(),
            })
            .collect();
        let tokens = fathom_model::sample(logits, self.settings.sampling, &mut rngs)?;
        self.stats.generation_s += t.elapsed().as_secs_f64();
        for ((owner, rng), (token, logprob)) in owners.into_iter().zip(rngs).zip(tokens) {
            match owner {
                Owner::Episode(i) => {
                    self.episodes[i].rng = rng;
                    self.accept(i, token, logprob)?;
                }
                Owner::Sub(j) => {
                    self.subs[j].as_mut().expect("live sub-call").rng = rng;
                    self.accept_sub(j, token)?;
                }
            }
        }
        Ok(true)
    }

    /// Records a sampled token of an episode and decides whether its turn is over.
    fn accept(&mut self, i: usize, token: u32, logprob: f32) -> Result<(), RolloutError> {
        let eot = self.chat.end_of_turn();
        let (max_turn, max_episode) = (
            self.settings.max_turn_tokens,
            self.settings.max_episode_tokens,
        );
        let ep = &mut self.episodes[i];
        ep.sample.ids.push(token);
        ep.sample.sampled.push(true);
        ep.sample.logprobs.push(logprob);
        ep.turn.push(token);
        ep.generated += 1;
        self.stats.generated_tokens += 1;
        self.observer
            .event(RolloutEvent::Token { episode: i, token });
        let ep = &mut self.episodes[i];
        let ended = token == eot;
        if !ended && ep.sample.ids.len() >= max_episode {
            return self.abort(i, "the episode reached its token budget");
        }
        if ended || ep.turn.len() >= max_turn {
            let content = if ended {
                &ep.turn[..ep.turn.len() - 1]
            } else {
                &ep.turn[..]
            };
            let text = self.chat.tokenizer().decode(content, false)?;
            ep.ended_with_eot = ended;
            ep.turns += 1;
            ep.phase = Phase::Waiting;
            ep.busy = true;
            self.observer.event(RolloutEvent::Turn {
                episode: i,
                text: &text,
            });
            let _ = self.episodes[i].to_env.send(ToEnv::Step(text));
        } else {
            ep.pending = vec![token];
        }
        Ok(())
    }

    fn abort(&mut self, i: usize, reason: &str) -> Result<(), RolloutError> {
        let ep = &mut self.episodes[i];
        ep.truncated = true;
        ep.phase = Phase::Waiting;
        ep.busy = true;
        ep.pending.clear();
        let _ = ep.to_env.send(ToEnv::Abort(reason.into()));
        if let Some(row) = ep.row.take() {
            self.free_row(row)?;
        }
        Ok(())
    }

    fn accept_sub(&mut self, j: usize, token: u32) -> Result<(), RolloutError> {
        let eot = self.chat.end_of_turn();
        let max = self.settings.sub_call_tokens;
        let sub = self.subs[j].as_mut().expect("live sub-call");
        self.stats.generated_tokens += 1;
        if token != eot {
            sub.out.push(token);
        }
        if token == eot || sub.out.len() >= max {
            let sub = self.subs[j].take().expect("live sub-call");
            let answer = self
                .chat
                .tokenizer()
                .decode(&sub.out, true)
                .map_err(|e| e.to_string());
            if let Ok(text) = &answer {
                self.observer.event(RolloutEvent::SubCall {
                    prompt: &sub.prompt,
                    answer: text,
                });
            }
            let _ = sub.reply.send(answer);
            self.free_row(sub.row)?;
        } else {
            sub.pending = vec![token];
        }
        Ok(())
    }

    fn handle_event(&mut self, event: FromEnv) -> Result<(), RolloutError> {
        match event {
            FromEnv::Observed { episode, result } => {
                let phase = self.episodes[episode].phase;
                let obs = match result {
                    Ok(obs) => obs,
                    Err(_) => return Ok(()), // the thread reports the end next
                };
                if obs.done {
                    return Ok(()); // Finished follows
                }
                // The thread now waits for the engine's next action.
                self.episodes[episode].busy = false;
                if phase == Phase::Starting {
                    let ids = self.chat.prompt_ids(&obs.messages)?;
                    let ep = &mut self.episodes[episode];
                    ep.sample.sampled = vec![false; ids.len()];
                    ep.sample.logprobs = vec![0.0; ids.len()];
                    ep.sample.ids = ids;
                    ep.phase = Phase::Ready;
                    if ep.sample.ids.len() >= self.settings.max_episode_tokens {
                        ep.phase = Phase::Generating; // so the abort below takes effect
                        return self
                            .abort(episode, "the prompt exceeds the episode's token budget");
                    }
                    return Ok(());
                }
                if phase != Phase::Waiting {
                    return Ok(());
                }
                let ended_with_eot = self.episodes[episode].ended_with_eot;
                let segment = self.chat.observation_ids(&obs.messages, ended_with_eot)?;
                if let Some(last) = obs.messages.last() {
                    self.observer.event(RolloutEvent::Observation {
                        episode,
                        step: obs.step.as_ref(),
                        text: &last.content,
                    });
                }
                let ep = &mut self.episodes[episode];
                if ep.sample.ids.len() + segment.len() >= self.settings.max_episode_tokens {
                    return self.abort(episode, "the episode reached its token budget");
                }
                ep.sample.ids.extend(&segment);
                ep.sample
                    .sampled
                    .extend(std::iter::repeat_n(false, segment.len()));
                ep.sample
                    .logprobs
                    .extend(std::iter::repeat_n(0.0, segment.len()));
                ep.pending = segment;
                ep.turn.clear();
                ep.phase = Phase::Generating;
            }
            FromEnv::Finished {
                episode,
                trajectory,
            } => {
                self.observer.event(RolloutEvent::Finished {
                    episode,
                    trajectory: &trajectory,
                });
                let ep = &mut self.episodes[episode];
                ep.trajectory = Some(trajectory);
                ep.phase = Phase::Finished;
                ep.busy = false;
                ep.pending.clear();
                if let Some(row) = ep.row.take() {
                    self.free_row(row)?;
                }
            }
        }
        Ok(())
    }

    fn handle_request(&mut self, request: Request) -> Result<(), RolloutError> {
        let ids = match &request.prompt {
            Prompt::Text(text) => self
                .chat
                .render_ids(&[ChatMessage::new(ChatRole::User, text.clone())]),
            Prompt::Conversation(messages) => self.chat.prompt_ids(messages),
        };
        let ids = match ids {
            Ok(ids) if ids.len() < self.settings.max_episode_tokens => ids,
            Ok(_) => {
                let _ = request
                    .reply
                    .send(Err("the prompt exceeds the token budget".into()));
                return Ok(());
            }
            Err(e) => {
                let _ = request.reply.send(Err(e.to_string()));
                return Ok(());
            }
        };
        self.stats.sub_calls += 1;
        // A stream from the prompt itself, so answers do not depend on arrival order.
        let stream = ids.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
            (h ^ t as u64).wrapping_mul(0x100_0000_01b3)
        });
        let row = self.alloc_row();
        let sub = SubRow {
            row,
            prompt: request.prompt.clone(),
            rng: fathom_model::sequence_rng(self.settings.seed ^ 0x5b0c_a11, stream),
            pending: ids,
            out: Vec::new(),
            reply: request.reply,
        };
        match self.subs.iter().position(Option::is_none) {
            Some(j) => self.subs[j] = Some(sub),
            None => self.subs.push(Some(sub)),
        }
        Ok(())
    }
}
