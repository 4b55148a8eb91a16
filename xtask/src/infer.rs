//! `cargo xtask infer`: one full RLM episode over a document from the command line, with the
//! real sandbox and `llm()` sub-calls answered by the same model. Each turn is printed as it
//! ends (the model's message, the REPL's output, the `llm()` answers), a spinner shows the turn
//! being written, and a summary closes the run: answer, turns, `llm()` calls, tokens, time and
//! tokens/s. `--json` prints exactly one JSON object instead (the summary with the trajectory).
//!
//! ```text
//! cargo xtask infer [--model DIR] [--adapter DIR] [--backend cpu|wgpu|cuda] [--quantize nf4]
//!                   --document FILE --question TEXT [--max-turns N] [--recursion-depth D] [--json]
//! ```

pub mod device;
pub mod session;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::backend::{BackendKind, QuantizeOnLoad};
use session::{EpisodeRequest, InferEvent, Session, SessionOptions, Summary, read_document};

/// Options that choose and load the model (shared with `demo`).
#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// Hugging Face model directory (Qwen2 or Llama; config.json, safetensors, tokenizer).
    /// Default: the recipe's base (SmolLM2-135M-Instruct, fetched and cached on first use).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// PEFT LoRA adapter directory (e.g. `<run>/adapter` from `cargo xtask train`).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
    /// Quantize the base's projections to NF4 while loading (the CubeCL kernel on wgpu/CUDA).
    #[arg(long, value_enum)]
    pub quantize: Option<QuantizeOnLoad>,
    /// Recipe whose environment, sandbox limits, token budgets and rewards apply (default: the
    /// embedded laptop recipe, as `cargo xtask train` uses).
    #[arg(long, value_name = "FILE")]
    pub recipe: Option<PathBuf>,
    /// Assistant turns per episode (default: the recipe's).
    #[arg(long, value_name = "N")]
    pub max_turns: Option<usize>,
    /// `llm()` recursion depth: 1 answers calls directly, D > 1 runs a sub-episode (its own
    /// REPL over the prompt) for calls made above depth D (default: the recipe's).
    #[arg(long, value_name = "D")]
    pub recursion_depth: Option<u32>,
    /// New tokens per turn and per `llm()` answer (default: the recipe's `max_new_tokens`).
    #[arg(long, value_name = "N")]
    pub max_turn_tokens: Option<usize>,
    /// Tokens an episode may hold in all (default: the recipe's `max_episode_tokens`).
    #[arg(long, value_name = "N")]
    pub max_episode_tokens: Option<usize>,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Seed of sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl LoadArgs {
    /// The session options, after checking that the backend can start.
    pub fn options(&self) -> Result<SessionOptions> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            anyhow::bail!("--temperature must be a finite number ≥ 0");
        }
        let device_name = device::check(self.backend)?;
        Ok(SessionOptions {
            model: self.model.clone(),
            adapter: self.adapter.clone(),
            nf4: self.quantize == Some(QuantizeOnLoad::Nf4),
            recipe: self.recipe.clone(),
            max_turns: self.max_turns,
            recursion_depth: self.recursion_depth,
            max_turn_tokens: self.max_turn_tokens,
            max_episode_tokens: self.max_episode_tokens,
            temperature: self.temperature,
            seed: self.seed,
            backend: format!("{:?}", self.backend).to_lowercase(),
            device_name,
        })
    }
}

/// Arguments of `infer`.
#[derive(Args, Debug)]
pub struct InferArgs {
    #[command(flatten)]
    load: LoadArgs,
    /// The document (UTF-8 text), loaded into the REPL as `context`.
    #[arg(long, value_name = "FILE")]
    document: PathBuf,
    /// The question.
    #[arg(long, value_name = "TEXT")]
    question: String,
    /// Print exactly one JSON object (summary and trajectory) instead of the transcript.
    #[arg(long)]
    json: bool,
}

/// Runs `infer`.
pub fn run(args: InferArgs) -> Result<()> {
    let document = read_document(&args.document)?;
    if args.question.trim().is_empty() {
        anyhow::bail!("--question is empty");
    }
    let options = args.load.options()?;
    let request = EpisodeRequest {
        document,
        question: args.question.clone(),
        task: None,
    };
    let summary = crate::with_backend!(args.load.backend, |B, device| {
        let spinner = spinner();
        spinner.set_message("loading the model");
        let session = Session::<B>::load(&options, device)?;
        let mut printer = Printer::new(&spinner, !args.json);
        let summary = session.run(request, &mut |e| printer.event(e));
        spinner.finish_and_clear();
        summary?
    });
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print_summary(&summary);
    }
    Ok(())
}

fn spinner() -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}").expect("a valid template"),
    );
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// Prints the transcript as events arrive (when `transcript`), and keeps the spinner's message
/// current.
struct Printer<'a> {
    spinner: &'a ProgressBar,
    transcript: bool,
    turn: usize,
    tokens: usize,
    tail: String,
}

impl<'a> Printer<'a> {
    fn new(spinner: &'a ProgressBar, transcript: bool) -> Self {
        Self {
            spinner,
            transcript,
            turn: 1,
            tokens: 0,
            tail: String::new(),
        }
    }

    fn say(&self, text: &str) {
        if self.transcript {
            self.spinner.suspend(|| {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{text}");
                let _ = out.flush();
            });
        }
    }

    fn event(&mut self, event: InferEvent) {
        match event {
            InferEvent::Started {
                model,
                backend,
                document_chars,
                question,
                ..
            } => {
                self.say(&format!(
                    "model    {model}\nbackend  {backend}\ndocument {document_chars} characters\nquestion {question}\n"
                ));
                self.spinner
                    .set_message(format!("turn {}: writing", self.turn));
            }
            InferEvent::Token { text } => {
                self.tokens += 1;
                self.tail.push_str(&text);
                let flat: String = self.tail.replace('\n', "⏎");
                let chars: Vec<char> = flat.chars().collect();
                let shown: String = chars[chars.len().saturating_sub(48)..].iter().collect();
                self.spinner.set_message(format!(
                    "turn {}: writing, {} tokens … {shown}",
                    self.turn, self.tokens
                ));
            }
            InferEvent::Turn { turn, text, .. } => {
                self.say(&format!("── turn {turn} ──\n{}", text.trim_end()));
                self.tokens = 0;
                self.tail.clear();
                self.turn = turn + 1;
                self.spinner
                    .set_message(format!("turn {turn}: running in the REPL"));
            }
            InferEvent::SubCall { prompt, answer } => {
                self.say(&format!(
                    "   ↳ llm({}) → {}",
                    quote(&prompt, 60),
                    quote(&answer, 100)
                ));
            }
            InferEvent::Observation {
                turn,
                text,
                llm_calls,
                cell_ms,
                ..
            } => {
                let calls = match llm_calls {
                    0 => String::new(),
                    1 => ", 1 llm() call".into(),
                    n => format!(", {n} llm() calls"),
                };
                self.say(&format!(
                    "── output of turn {turn} ({cell_ms:.0} ms{calls}) ──\n{}\n",
                    text.trim_end()
                ));
                self.spinner
                    .set_message(format!("turn {}: writing", self.turn));
            }
            InferEvent::Finished(_) => {}
        }
    }
}

/// `text` on one line, cut to `max` characters, in quotes.
fn quote(text: &str, max: usize) -> String {
    let flat = text.replace('\n', "⏎");
    let cut: String = flat.chars().take(max).collect();
    let more = if flat.chars().count() > max {
        "…"
    } else {
        ""
    };
    format!("\"{cut}{more}\"")
}

fn print_summary(s: &Summary) {
    println!("── {} ──", s.end);
    match &s.answer {
        Some(a) => println!("answer   {a}"),
        None => println!("answer   (none)"),
    }
    println!(
        "turns    {}\nllm()    {} calls\ntokens   {} generated, {} fed in {} forward passes\ntime     {:.1} s ({:.1} s in the model)\nspeed    {:.1} generated tokens/s",
        s.turns,
        s.llm_calls,
        s.generated_tokens,
        s.prefill_tokens,
        s.forward_passes,
        s.seconds,
        s.model_seconds,
        s.tokens_per_s
    );
}
