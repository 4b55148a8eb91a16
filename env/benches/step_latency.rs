//! Step-latency benchmark: the pooled sandbox against a fresh `python3 -c` subprocess per
//! step, on trivial code and on a regex scan of a 1 MB `context`; plus worker start-up.
//!
//! Run with `cargo bench -p fathom-env --bench step_latency` (release build). Prints a
//! Markdown table of p50 / p99 latencies in milliseconds and the ratios.

use std::process::Command;
use std::time::{Duration, Instant};

use fathom_env::sandbox::{SandboxConfig, SandboxPool, WorkerCommand};

fn percentile(samples: &mut [f64], p: f64) -> f64 {
    samples.sort_by(f64::total_cmp);
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i]
}

struct Row {
    name: &'static str,
    p50: f64,
    p99: f64,
    n: usize,
}

fn row(name: &'static str, mut samples: Vec<f64>) -> Row {
    let n = samples.len();
    Row {
        name,
        p50: percentile(&mut samples, 0.5),
        p99: percentile(&mut samples, 0.99),
        n,
    }
}

fn time_ms(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

fn document(bytes: usize) -> String {
    let mut doc = String::with_capacity(bytes + 100);
    let mut i = 0u64;
    while doc.len() < bytes {
        i += 1;
        doc.push_str(&format!(
            "Line {i}: the vault code is {:04}-XY and nothing else happened. ",
            (i * 7919) % 10_000
        ));
    }
    doc
}

/// The real interpreter behind `python3` (not a shim such as pyenv's, which adds ~100 ms),
/// or `$FATHOM_BENCH_PYTHON`.
fn python3() -> String {
    if let Ok(p) = std::env::var("FATHOM_BENCH_PYTHON") {
        return p;
    }
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable, end='')"])
        .output()
        .expect("python3 on PATH");
    String::from_utf8(out.stdout).expect("utf-8 path")
}

fn subprocess_steps(code: &str, context_file: Option<&std::path::Path>, n: usize) -> Vec<f64> {
    let python = python3();
    let program = match context_file {
        Some(path) => format!(
            "context = open({:?}).read()\n{code}",
            path.display().to_string()
        ),
        None => format!("context = ''\n{code}"),
    };
    (0..n)
        .map(|_| {
            time_ms(|| {
                let out = Command::new(&python)
                    .args(["-c", &program])
                    .output()
                    .expect("python3 runs");
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            })
        })
        .collect()
}

fn main() {
    let worker =
        WorkerCommand::discover().expect("build fathom-sandbox first (cargo bench builds it)");
    let mut config = SandboxConfig::new(worker);
    config.step_timeout = Duration::from_secs(30);

    // Start-up: spawn + interpreter + prelude + loading a small document, no idle workers.
    let mut cold = config.clone();
    cold.idle_workers = 0;
    let pool = SandboxPool::new(cold).unwrap();
    let startup: Vec<f64> = (0..20)
        .map(|_| time_ms(|| drop(pool.session("doc").unwrap())))
        .collect();
    drop(pool);

    // Episode start with pre-started workers: acquire + load a 1 MB document + seal.
    let doc = document(1 << 20);
    let mut warm = config.clone();
    warm.idle_workers = 2;
    let pool = SandboxPool::new(warm).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let mut session_start = Vec::new();
    for _ in 0..20 {
        session_start.push(time_ms(|| drop(pool.session(doc.as_str()).unwrap())));
        std::thread::sleep(Duration::from_millis(150));
    }

    let mut session = pool.session(doc.as_str()).unwrap();
    let mut no_llm = |_: &str| String::new();
    let trivial_code = "x = 1";
    let regex_code = "import re\nn = len(re.findall(r'code (\\d{4})-XY', context))";
    let mut run = |code: &str, n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| {
                time_ms(|| {
                    assert!(
                        session
                            .exec(code, &mut no_llm)
                            .unwrap()
                            .output
                            .error
                            .is_none()
                    )
                })
            })
            .collect()
    };
    let _ = run(trivial_code, 50);
    let trivial = run(trivial_code, 2000);
    let regex = run(regex_code, 200);

    let dir = std::env::temp_dir().join(format!("fathom-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ctx_file = dir.join("context.txt");
    std::fs::write(&ctx_file, &doc).unwrap();
    let sub_trivial = subprocess_steps(trivial_code, None, 100);
    let sub_regex = subprocess_steps(regex_code, Some(&ctx_file), 100);
    let _ = std::fs::remove_dir_all(&dir);

    let config = fathom_env::tasks::TaskConfig::default();
    let mut largest = 0;
    let generation: Vec<f64> =
        (0..fathom_env::tasks::split_len(fathom_rewards::record::Split::Eval))
            .map(|i| {
                time_ms(|| {
                    let t = fathom_env::tasks::split_task(
                        fathom_rewards::record::Split::Eval,
                        i,
                        &config,
                    )
                    .unwrap();
                    largest = largest.max(t.doc_tokens);
                })
            })
            .collect();

    let rows = [
        row("sandbox step, trivial code (`x = 1`)", trivial),
        row("`python3 -c` per step, trivial code", sub_trivial),
        row("sandbox step, regex over 1 MB context", regex),
        row(
            "`python3 -c` per step, regex over 1 MB context (reads the file)",
            sub_regex,
        ),
        row(
            "worker start-up (spawn, interpreter, prelude, seal), no idle worker",
            startup,
        ),
        row(
            "episode start with idle workers (acquire, load 1 MB, seal)",
            session_start,
        ),
        row(
            "generating one eval task (500 to 204 800 tokens)",
            generation,
        ),
    ];
    println!("baseline interpreter: {}\n", python3());
    println!("| measurement | n | p50 (ms) | p99 (ms) |\n| --- | --- | --- | --- |");
    for r in &rows {
        println!("| {} | {} | {:.3} | {:.3} |", r.name, r.n, r.p50, r.p99);
    }
    println!("\nlargest eval document: {largest} tokens");
    println!(
        "\nratio (python3 -c / sandbox), p50: trivial {:.0}x, 1 MB regex {:.1}x; p99: trivial {:.0}x, 1 MB regex {:.1}x",
        rows[1].p50 / rows[0].p50,
        rows[3].p50 / rows[2].p50,
        rows[1].p99 / rows[0].p99,
        rows[3].p99 / rows[2].p99,
    );
}
