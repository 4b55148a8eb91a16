//! Sandbox workers die with the process that started them, even when it is killed outright
//! (SIGKILL, so no destructor runs): nothing a crashed trainer or server leaves behind keeps
//! running untrusted code.
//!
//! The binary plays both parts: run plainly it is the test; run as `parent_death helper` it is
//! the parent, which starts a pool with a session open, prints its workers' pids, sets the
//! session's worker looping forever in Python and waits to be killed. The idle worker would
//! also die of its closed pipe; the looping one only dies of `PR_SET_PDEATHSIG`.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Child processes of `parent` that are still running (zombies count as gone).
fn live_children(parent: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Some((state, ppid)) = state_and_parent(pid)
            && ppid == parent
            && state != "Z"
        {
            found.push(pid);
        }
    }
    found
}

/// A process's state letter and parent, from `/proc/PID/stat`; `None` once it is gone.
fn state_and_parent(pid: u32) -> Option<(String, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid …": comm may hold spaces, so read after the last ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.to_string();
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

fn alive(pid: u32) -> bool {
    state_and_parent(pid).is_some_and(|(state, _)| state != "Z")
}

/// The parent: a pool (with its idle worker) and one open session, then wait.
fn helper() {
    let pool = common::pool();
    let mut session = pool.session("The vault code is 1234.").expect("session");
    let cell = session
        .exec("print(len(context))", &mut |_: &str| String::new())
        .expect("cell");
    assert_eq!(cell.output.stdout, "23\n");
    // Give the spawner time to refill its idle worker, so both kinds are covered.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut workers = live_children(std::process::id());
    while workers.len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        workers = live_children(std::process::id());
    }
    let line: Vec<String> = workers.iter().map(|p| p.to_string()).collect();
    println!("{}", line.join(" "));
    // A worker busy in untrusted code never reads its pipe, so only the kernel's parent-death
    // signal can stop it (its CPU limit is 20 s, the test waits 5).
    let _ = session.exec("while True:\n    pass", &mut |_: &str| String::new());
    std::thread::sleep(Duration::from_secs(600));
}

fn workers_die_when_their_parent_is_killed() {
    let mut parent = Command::new(std::env::current_exe().unwrap())
        .arg("helper")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the parent");
    let mut line = String::new();
    BufReader::new(parent.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("the parent's report");
    let workers: Vec<u32> = line
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    assert!(
        workers.len() >= 2,
        "the parent should hold a session's worker and an idle one, got {line:?}"
    );
    for &w in &workers {
        assert!(
            alive(w),
            "worker {w} should be running before its parent dies"
        );
    }
    // Let the session's worker enter its endless loop.
    std::thread::sleep(Duration::from_millis(700));
    parent.kill().expect("SIGKILL the parent");
    parent.wait().expect("reap the parent");
    let deadline = Instant::now() + Duration::from_secs(5);
    while workers.iter().any(|&w| alive(w)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<u32> = workers.iter().copied().filter(|&w| alive(w)).collect();
    assert!(
        left.is_empty(),
        "workers {left:?} outlived their killed parent"
    );
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("helper") {
        helper();
        return;
    }
    workers_die_when_their_parent_is_killed();
    println!("test workers_die_when_their_parent_is_killed ... ok");
}
