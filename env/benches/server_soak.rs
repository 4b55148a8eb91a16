//! Soak benchmark of the environment server: many episodes through one server process, to
//! catch what leaks (memory, descriptors, worker processes) rather than to measure peak speed.
//!
//! ```text
//! cargo bench -p fathom-env --bench server_soak -- [--episodes 2000] [--clients 8] [--warmup 400]
//!     [--rounds 4] [--max-seconds 900] [--rss-margin-mib 8] [--fd-margin 2]
//! ```
//!
//! The server runs in a child process (this binary, re-run with `--serve-child`) on
//! 127.0.0.1, with 32 session slots and the passage reader as its sub-LM, so its resident
//! memory (RSS), open descriptors and worker processes can be read from `/proc` apart from
//! the clients'. `--clients` threads each hold one WebSocket session ([`RemoteEnv`]) and run
//! the scripted expert on the eval split. First `--warmup` episodes run (long enough for the
//! allocator's high-water mark to settle: in a run started after 80 episodes, RSS rose for
//! about 1000 more and then levelled off) and every session is closed; the server's RSS, descriptors and children are then read once they have settled
//! (the **start**); then `--episodes` episodes run in `--rounds` equal rounds, after each of
//! which every session is closed and the same figures are read again (the last is the
//! **end**; the rounds show whether growth levels off or keeps on). Printed: episodes/s, step
//! and reset latency (p50, p99, as the client sees them), and the figures after each round.
//!
//! The run fails (exit status 1) if any episode fails, if `--max-seconds` (a bound on the
//! measured episodes) runs out first, if RSS grows by more than `--rss-margin-mib` MiB, or if
//! descriptors grow by more than `--fd-margin`, or if the server keeps more worker processes
//! at the end than at the start.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fathom_env::client::{RemoteEnv, ServerPool};
use fathom_env::env::Services;
use fathom_env::expert::PassageReader;
use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};
use fathom_env::server::{EnvServer, ServerConfig};
use fathom_env::tasks;
use fathom_rewards::Composite;
use fathom_rewards::record::Split;

use common::{Tally, episode, percentile};

struct Args {
    episodes: usize,
    clients: usize,
    warmup: usize,
    rounds: usize,
    max_seconds: u64,
    rss_margin_mib: f64,
    fd_margin: usize,
}

fn args() -> Args {
    let mut a = Args {
        episodes: 2000,
        clients: 8,
        warmup: 400,
        rounds: 4,
        max_seconds: 900,
        rss_margin_mib: 8.0,
        fd_margin: 2,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let value = |i: usize| -> f64 {
            argv.get(i + 1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{} needs a number", argv[i]))
        };
        match argv[i].as_str() {
            "--episodes" => a.episodes = value(i) as usize,
            "--clients" => a.clients = value(i) as usize,
            "--warmup" => a.warmup = value(i) as usize,
            "--rounds" => a.rounds = value(i) as usize,
            "--max-seconds" => a.max_seconds = value(i) as u64,
            "--rss-margin-mib" => a.rss_margin_mib = value(i),
            "--fd-margin" => a.fd_margin = value(i) as usize,
            // `cargo bench` passes --bench; other harness flags are ignored too.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    assert!(
        a.clients > 0 && a.episodes > 0 && a.rounds > 0,
        "--clients, --episodes and --rounds must be positive"
    );
    a
}

/// The child: serves on 127.0.0.1 until its standard input closes.
fn serve_child(clients: usize) {
    let mut sandbox = SandboxConfig::new(WorkerCommand::Path(
        env!("CARGO_BIN_EXE_fathom-sandbox").into(),
    ));
    sandbox.idle_workers = clients.min(16);
    let pool = SandboxPool::new(sandbox).expect("sandbox pool");
    let services = Services::new(pool, Arc::new(PassageReader));
    let server =
        EnvServer::new(services, Composite::default(), ServerConfig::default()).expect("server");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime
        .block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            println!("listening {}", listener.local_addr().expect("addr"));
            let stdin_closed = async {
                let _ = tokio::task::spawn_blocking(|| {
                    let mut sink = Vec::new();
                    let _ = std::io::stdin().read_to_end(&mut sink);
                })
                .await;
            };
            server.serve(listener, stdin_closed).await
        })
        .expect("serve");
}

/// What `/proc` says about the server process.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Footprint {
    rss_mib: f64,
    fds: usize,
    children: usize,
}

fn footprint(pid: u32) -> Footprint {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("/proc fd")
        .count();
    let children = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            // /proc/P/stat: "pid (comm) state ppid …"; comm may hold spaces and parens.
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                })
                == Some(pid)
        })
        .count();
    Footprint {
        rss_mib: rss_kib / 1024.0,
        fds,
        children,
    }
}

/// The footprint once descriptors and children have stopped changing for a second (the pool
/// refilling its idle workers, sessions' workers being killed), bounded by 60 s.
fn settled(pid: u32) -> Footprint {
    let started = Instant::now();
    let mut last = footprint(pid);
    let mut stable_since = Instant::now();
    while stable_since.elapsed() < Duration::from_secs(1)
        && started.elapsed() < Duration::from_secs(60)
    {
        std::thread::sleep(Duration::from_millis(100));
        let now = footprint(pid);
        if (now.fds, now.children) != (last.fds, last.children) {
            stable_since = Instant::now();
        }
        last = now;
    }
    last
}

/// Runs `episodes` episodes on `clients` threads (each its own session, closed at the end),
/// none started after `deadline`, adding to `tally`.
fn run(
    pool: &ServerPool,
    clients: usize,
    episodes: usize,
    deadline: Instant,
    tally: &Arc<Mutex<Tally>>,
) {
    let next = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (pool, next, tally) = (pool.clone(), Arc::clone(&next), Arc::clone(tally));
            std::thread::spawn(move || {
                let mut env = RemoteEnv::new(pool);
                let split_len = tasks::split_len(Split::Eval);
                loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    if n >= episodes || Instant::now() > deadline {
                        break;
                    }
                    episode(&mut env, n % split_len, &tally);
                }
                env.close();
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
}

/// Sessions the server has open (`GET /sessions`, over a raw HTTP/1.1 request).
fn open_sessions(addr: &str) -> Option<u64> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET /sessions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let body = raw.split("\r\n\r\n").nth(1)?;
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v["active_sessions"].as_u64()
}

fn wait_no_sessions(addr: &str) {
    let started = Instant::now();
    while open_sessions(addr) != Some(0) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "sessions still open a minute after every client closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn start_child(clients: usize) -> (Child, String) {
    let mut child = Command::new(std::env::current_exe().expect("current exe"))
        .args(["--serve-child", &clients.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the server process");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the server's address");
    let addr = line
        .trim()
        .strip_prefix("listening ")
        .unwrap_or_else(|| panic!("unexpected first line from the server: {line:?}"))
        .to_string();
    (child, addr)
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if let Some(i) = argv.iter().position(|a| a == "--serve-child") {
        let clients = argv.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or(8);
        serve_child(clients);
        return;
    }
    let args = args();
    let (mut child, addr) = start_child(args.clients);
    let pid = child.id();
    let pool = ServerPool::new(&[format!("ws://{addr}")]).expect("pool");
    let launched = settled(pid);

    let warm = Arc::new(Mutex::new(Tally::default()));
    let far = Instant::now() + Duration::from_secs(args.max_seconds);
    run(&pool, args.clients, args.warmup, far, &warm);
    wait_no_sessions(&addr);
    let start = settled(pid);
    let warm = std::mem::take(&mut *warm.lock().unwrap_or_else(|p| p.into_inner()));

    // The measured episodes, in rounds; --max-seconds bounds them all.
    let tally = Arc::new(Mutex::new(Tally::default()));
    let deadline = Instant::now() + Duration::from_secs(args.max_seconds);
    let mut rounds = Vec::new();
    let mut wall = 0.0;
    for round in 0..args.rounds {
        let n = args.episodes * (round + 1) / args.rounds - args.episodes * round / args.rounds;
        let t0 = Instant::now();
        run(&pool, args.clients, n, deadline, &tally);
        wall += t0.elapsed().as_secs_f64();
        wait_no_sessions(&addr);
        let done = tally.lock().unwrap_or_else(|p| p.into_inner()).episodes;
        rounds.push((done, settled(pid)));
    }
    let end = rounds.last().map_or(start, |r| r.1);
    let t = std::mem::take(&mut *tally.lock().unwrap_or_else(|p| p.into_inner()));

    drop(child.stdin.take());
    let stopped = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the server") {
            break Some(status);
        }
        if stopped.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };

    let mut t = t;
    t.steps_ms.sort_by(f64::total_cmp);
    t.resets_ms.sort_by(f64::total_cmp);
    println!(
        "server soak: {} concurrent WebSocket clients, expert on the eval split, server in its own process on loopback",
        args.clients
    );
    println!(
        "| episodes | wall (s) | episodes/s | steps | step p50 (ms) | step p99 (ms) | reset p50 (ms) | reset p99 (ms) | correct | errors |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {} | {:.1} | {:.2} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {}/{} | {} |",
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
    println!();
    println!("| server | RSS (MiB) | open fds | worker processes |");
    println!("| --- | --- | --- | --- |");
    let mut rows = vec![
        ("launched".to_string(), launched),
        (
            format!("start (after {} warm-up episodes)", warm.episodes),
            start,
        ),
    ];
    for (i, (done, f)) in rounds.iter().enumerate() {
        let when = if i + 1 == rounds.len() {
            "end"
        } else {
            "round"
        };
        rows.push((format!("{when} (after {done} episodes)"), *f));
    }
    for (when, f) in rows {
        println!("| {when} | {:.1} | {} | {} |", f.rss_mib, f.fds, f.children);
    }

    let mut failures = Vec::new();
    if !warm.errors.is_empty() || !t.errors.is_empty() {
        for e in warm.errors.iter().chain(&t.errors).take(10) {
            eprintln!("error: {e}");
        }
        failures.push(format!(
            "{} episodes failed",
            warm.errors.len() + t.errors.len()
        ));
    }
    if t.episodes + t.errors.len() < args.episodes {
        failures.push(format!(
            "--max-seconds {} ran out after {} of {} episodes",
            args.max_seconds,
            t.episodes + t.errors.len(),
            args.episodes
        ));
    }
    let rss_growth = end.rss_mib - start.rss_mib;
    if rss_growth > args.rss_margin_mib {
        failures.push(format!(
            "RSS grew by {rss_growth:.1} MiB (margin {} MiB)",
            args.rss_margin_mib
        ));
    }
    if end.fds > start.fds + args.fd_margin {
        failures.push(format!(
            "open descriptors grew from {} to {} (margin {})",
            start.fds, end.fds, args.fd_margin
        ));
    }
    if end.children > start.children {
        failures.push(format!(
            "worker processes grew from {} to {}",
            start.children, end.children
        ));
    }
    match status {
        Some(s) if s.success() => {}
        Some(s) => failures.push(format!("the server exited with {s}")),
        None => failures.push("the server did not stop within 60 s of its stdin closing".into()),
    }
    println!();
    println!(
        "margins: RSS +{} MiB, descriptors +{}, worker processes +0 (start to end)",
        args.rss_margin_mib, args.fd_margin
    );
    if failures.is_empty() {
        println!(
            "PASSED: RSS {rss_growth:+.1} MiB, descriptors {:+}, worker processes {:+}",
            end.fds as i64 - start.fds as i64,
            end.children as i64 - start.children as i64
        );
    } else {
        println!("FAILED: {}", failures.join("; "));
        std::process::exit(1);
    }
}
