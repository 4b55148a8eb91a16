//! Load benchmark of the environment server: N concurrent WebSocket sessions (one
//! [`RemoteEnv`] per thread) run the scripted expert on the eval split against a server on
//! loopback, and the benchmark reports episodes per second, step and reset latency (p50 and
//! p99, as the client sees them, network and JSON included) and the error count, which must
//! be zero.
//!
//! ```text
//! cargo bench -p fathom-env --bench server_load -- [--sessions 8] [--episodes 200] [--max-seconds 300] [--in-process]
//! ```
//!
//! Bounded in count (`--episodes`) and time (`--max-seconds`: no episode starts after it);
//! the server runs in this process on 127.0.0.1 with one session slot per client and the
//! passage reader as its sub-LM. `--in-process` runs the same clients on `ReplEnv`s over the
//! same kind of sandbox pool instead, the baseline that shows what the server adds. Exits
//! non-zero if any episode failed.

mod common;

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fathom_env::client::{RemoteEnv, ServerPool};
use fathom_env::env::{Environment, ReplEnv, Services};
use fathom_env::expert::PassageReader;
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_env::server::{EnvServer, ServerConfig};
use fathom_env::tasks;
use fathom_rewards::Composite;

use common::{Tally, percentile};
use fathom_rewards::record::Split;

struct Args {
    sessions: usize,
    episodes: usize,
    max_seconds: u64,
    in_process: bool,
}

fn args() -> Args {
    let mut a = Args {
        sessions: 8,
        episodes: 200,
        max_seconds: 300,
        in_process: false,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let value = |i: usize| -> u64 {
            argv.get(i + 1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{} needs a number", argv[i]))
        };
        match argv[i].as_str() {
            "--sessions" => a.sessions = value(i) as usize,
            "--episodes" => a.episodes = value(i) as usize,
            "--max-seconds" => a.max_seconds = value(i),
            "--in-process" => {
                a.in_process = true;
                i += 1;
                continue;
            }
            // `cargo bench` passes --bench; other harness flags are ignored too.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    assert!(
        a.sessions > 0 && a.episodes > 0,
        "--sessions and --episodes must be positive"
    );
    a
}

fn main() {
    let args = args();
    let mut sandbox = SandboxConfig::new(WorkerCommand::Path(
        env!("CARGO_BIN_EXE_fathom-sandbox").into(),
    ));
    sandbox.idle_workers = args.sessions.min(16);
    let pool = SandboxPool::new(sandbox).expect("sandbox pool");
    let config = ServerConfig {
        max_sessions: args.sessions,
        ..ServerConfig::default()
    };
    let services = Services::new(pool, Arc::new(PassageReader));
    let server = EnvServer::new(services.clone(), Composite::default(), config).expect("server");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    listener.set_nonblocking(true).expect("nonblocking");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server_thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            server
                .serve(listener, async move {
                    let _ = stopped.await;
                })
                .await
        })
    });
    // Let the pool start its idle workers before the clock starts.
    std::thread::sleep(Duration::from_secs(2));

    let url = format!("ws://{addr}");
    let pool = ServerPool::new(&[url]).expect("pool");
    let next = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let budget = Duration::from_secs(args.max_seconds);
    let started = Instant::now();
    let threads: Vec<_> = (0..args.sessions)
        .map(|_| {
            let (pool, next, tally) = (pool.clone(), Arc::clone(&next), Arc::clone(&tally));
            let (episodes, services, in_process) =
                (args.episodes, services.clone(), args.in_process);
            std::thread::spawn(move || {
                let mut env: Box<dyn Environment> = if in_process {
                    Box::new(ReplEnv::new(services))
                } else {
                    Box::new(RemoteEnv::new(pool))
                };
                let split_len = tasks::split_len(Split::Eval);
                loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    if n >= episodes || started.elapsed() > budget {
                        return;
                    }
                    let index = n % split_len;
                    common::episode(env.as_mut(), index, &tally);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
    let wall = started.elapsed().as_secs_f64();
    let _ = stop.send(());
    server_thread
        .join()
        .expect("server thread")
        .expect("server stopped cleanly");

    let mut t = tally.lock().unwrap_or_else(|p| p.into_inner());
    t.steps_ms.sort_by(f64::total_cmp);
    t.resets_ms.sort_by(f64::total_cmp);
    let cut_short = t.episodes + t.errors.len() < args.episodes;
    if args.in_process {
        println!(
            "in-process baseline: {} threads with a ReplEnv each, expert on the eval split",
            args.sessions
        );
    } else {
        println!(
            "server load: {} concurrent WebSocket sessions, expert on the eval split, loopback",
            args.sessions
        );
    }
    println!(
        "| sessions | episodes | wall (s) | episodes/s | steps | step p50 (ms) | step p99 (ms) | reset p50 (ms) | reset p99 (ms) | correct | errors |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {} | {} | {:.1} | {:.2} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {}/{} | {} |",
        args.sessions,
        t.episodes,
        wall,
        t.episodes as f64 / wall,
        t.steps_ms.len(),
        percentile(&t.steps_ms, 50.0),
        percentile(&t.steps_ms, 99.0),
        percentile(&t.resets_ms, 50.0),
        percentile(&t.resets_ms, 99.0),
        t.correct,
        t.episodes,
        t.errors.len()
    );
    if cut_short {
        println!(
            "(stopped by --max-seconds {} before --episodes {})",
            args.max_seconds, args.episodes
        );
    }
    for e in t.errors.iter().take(10) {
        eprintln!("error: {e}");
    }
    if !t.errors.is_empty() {
        std::process::exit(1);
    }
}
