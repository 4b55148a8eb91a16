//! Rollouts against remote environments: episodes run on `cargo xtask serve` on loopback
//! through `fathom_env`'s client (with an access token, `llm()` answered by the local policy
//! over the WebSocket), and give exactly the tokens of the same episodes run in process.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fathom_env::client::{ClientConfig, RemoteEnv, ServerPool};
use fathom_env::env::{EnvConfig, Environment, ReplEnv, ResetRequest, Services};
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_model::{Cpu, Qwen2Config, Qwen2ForCausalLM, Sampling, Tokenizer};
use fathom_rewards::record::Split;
use fathom_trainer::rollout::{Bridge, Chat, EpisodeOutput, EpisodeSpec, RolloutSettings, rollout};

const XTASK: &str = env!("CARGO_BIN_EXE_xtask");
const TURNS: usize = 3;
const TOKEN: &str = "remote-rollout-test-token";

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn serve(port: u16, token_file: &std::path::Path) -> Server {
    let mut child = Command::new(XTASK)
        .args([
            "serve",
            "--port",
            &port.to_string(),
            "--max-turns",
            &TURNS.to_string(),
        ])
        .arg("--token-file")
        .arg(token_file)
        .env_remove("FATHOM_SERVE_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("xtask serve starts");
    // Wait until it accepts connections.
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || for _ in BufReader::new(stderr).lines() {});
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the server did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Server(child)
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen2.5-tokenizer"),
    )
    .unwrap()
}

fn run(envs: &mut [Box<dyn Environment>], bridge: &Bridge) -> Vec<EpisodeOutput> {
    let tok = tokenizer();
    let config = Qwen2Config::with_shape(tok.vocab_size(), 32, 64, 2, 4, 2);
    let model = Qwen2ForCausalLM::<Cpu>::random(config, 9, false, &Default::default());
    let chat = Chat::new(&tok, tok.token_id("<|im_end|>").unwrap());
    let specs: Vec<EpisodeSpec> = (0..envs.len())
        .map(|i| EpisodeSpec {
            reset: ResetRequest::Split {
                split: Split::Train,
                index: i / 2,
            },
            group: i / 2,
            stream: i as u64,
        })
        .collect();
    let settings = RolloutSettings {
        sampling: Sampling::Sample {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
        },
        max_turn_tokens: 10,
        max_episode_tokens: 8192,
        sub_call_tokens: 8,
        seed: 4,
    };
    rollout(
        &model,
        &chat,
        envs,
        &specs,
        &settings,
        bridge,
        &Default::default(),
    )
    .unwrap()
    .0
}

#[test]
fn remote_episodes_match_in_process_ones() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let port = free_port();
    let _server = serve(port, &token_file);
    let url = format!("ws://127.0.0.1:{port}");

    let bridge = Bridge::new();
    let config = ClientConfig {
        token: Some(TOKEN.into()),
        ..ClientConfig::default()
    };
    let pool = ServerPool::with_config(&[url.as_str()], config).unwrap();
    let mut remote: Vec<Box<dyn Environment>> = (0..4)
        .map(|_| {
            Box::new(RemoteEnv::with_sub_lm(pool.clone(), bridge.sub_lm())) as Box<dyn Environment>
        })
        .collect();
    let remote_out = run(&mut remote, &bridge);

    let mut sandbox = SandboxConfig::new(WorkerCommand::Path(PathBuf::from(XTASK)));
    sandbox.idle_workers = 2;
    let local_pool = SandboxPool::new(sandbox).unwrap();
    let local_bridge = Bridge::new();
    let mut local: Vec<Box<dyn Environment>> = (0..4)
        .map(|_| {
            let mut services = Services::new(local_pool.clone(), local_bridge.sub_lm());
            services.config = EnvConfig {
                max_turns: TURNS,
                ..EnvConfig::default()
            };
            Box::new(ReplEnv::new(services)) as Box<dyn Environment>
        })
        .collect();
    let local_out = run(&mut local, &local_bridge);

    for (i, (r, l)) in remote_out.iter().zip(&local_out).enumerate() {
        let t = r.trajectory.as_ref().expect("the remote episode finished");
        assert_eq!(t.steps.len(), TURNS, "episode {i} is multi-turn");
        assert_eq!(
            r.sample, l.sample,
            "episode {i}: remote and in-process tokens differ"
        );
    }

    // Without the token the server refuses the episode, and the rollout reports it.
    let bad = ServerPool::new(&[url.as_str()]).unwrap();
    let mut envs: Vec<Box<dyn Environment>> =
        vec![Box::new(RemoteEnv::new(bad)) as Box<dyn Environment>];
    let out = run(&mut envs, &Bridge::new());
    let err = out[0].trajectory.as_ref().unwrap_err();
    assert!(
        err.contains("reset") || err.contains("401") || err.contains("token"),
        "{err}"
    );
}
