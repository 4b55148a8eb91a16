//! One test per attack on the sandbox. Each asserts that the attack failed, that the parent
//! (this test process) is unharmed, and that a following benign episode works.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fathom_env::env::{AgentAction, Environment, ResetRequest};
use fathom_env::sandbox::{Cell, SandboxPool, Session};
use fathom_env::sublm::{SubLm, SubLmError};

const DOC: &str = "The vault code is 1234-AB. Nothing else of note.";

fn pool() -> SandboxPool {
    let mut config = common::sandbox_config();
    config.step_timeout = Duration::from_secs(2);
    config.limits.memory_bytes = 384 << 20;
    SandboxPool::new(config).expect("pool")
}

fn no_llm(_: &str) -> String {
    panic!("this test's code must not reach llm()")
}

fn run(session: &mut Session, code: &str) -> Cell {
    session
        .exec(code, &mut no_llm)
        .expect("the sandbox itself must keep working")
}

fn error_of(cell: &Cell) -> &str {
    cell.output.error.as_deref().unwrap_or("")
}

/// The session still answers (in a restarted worker if the attack cost it its worker), and a
/// new episode on the same pool works and sees none of the attack's state.
fn assert_recovers(pool: &SandboxPool, session: &mut Session) {
    let cell = run(session, "print(len(context))");
    assert_eq!(cell.output.stdout, format!("{}\n", DOC.len()), "{cell:?}");
    let mut fresh = pool
        .session(DOC)
        .expect("a benign episode after the attack");
    let cell = run(&mut fresh, "print(context[:9], 'pwned' in globals())");
    assert_eq!(cell.output.stdout, "The vault False\n", "{cell:?}");
}

fn attack(code: &str) -> (SandboxPool, Session, Cell) {
    let pool = pool();
    let mut session = pool.session(DOC).expect("session");
    let started = Instant::now();
    let cell = run(&mut session, code);
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "attack took {:?}",
        started.elapsed()
    );
    (pool, session, cell)
}

#[test]
fn fork_bomb_fails() {
    let (pool, mut s, cell) =
        attack("import os\npwned = 0\nwhile True:\n    os.fork()\n    pwned += 1");
    assert!(error_of(&cell).contains("PermissionError"), "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn thread_bomb_fails() {
    let (pool, mut s, cell) = attack(
        "import _thread\nfor _ in range(1000):\n    _thread.start_new_thread(lambda: None, ())",
    );
    assert!(
        error_of(&cell).contains("can't start new thread"),
        "{cell:?}"
    );
    let cell = run(
        &mut s,
        "import threading\nthreading.Thread(target=print).start()",
    );
    assert!(cell.output.error.is_some(), "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn memory_bomb_fails() {
    let (pool, mut s, cell) = attack("pwned = bytearray(8 * 1024 ** 3)");
    assert!(error_of(&cell).contains("MemoryError"), "{cell:?}");
    let cell = run(
        &mut s,
        "pwned = []\nwhile True:\n    pwned.append(' ' * 10 ** 7)",
    );
    assert!(
        error_of(&cell).contains("MemoryError") || cell.fault.is_some(),
        "{cell:?}"
    );
    assert_recovers(&pool, &mut s);
}

#[test]
fn infinite_python_loop_is_stopped() {
    let (pool, mut s, cell) = attack("while True:\n    pass");
    assert!(
        cell.fault.is_some() && error_of(&cell).contains("TimeoutError"),
        "{cell:?}"
    );
    assert_recovers(&pool, &mut s);
}

#[test]
fn infinite_c_loop_is_stopped() {
    // Catastrophic backtracking runs inside the C regex engine and ignores Python signals.
    let (pool, mut s, cell) = attack("import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')");
    assert!(
        cell.fault.is_some() && error_of(&cell).contains("TimeoutError"),
        "{cell:?}"
    );
    let cell = run(&mut s, "sum(range(10 ** 15))");
    assert!(error_of(&cell).contains("TimeoutError"), "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn output_flood_is_truncated_and_bounded() {
    let (pool, mut s, cell) =
        attack("print('x' * 10 ** 7)\nimport sys\nsys.stderr.write('y' * 10 ** 7)");
    let limit = pool.config().limits.max_output_chars;
    assert!(cell.output.truncated, "{cell:?}");
    assert!(cell.output.stdout.len() < limit + 200 && cell.output.stderr.len() < limit + 200);
    assert!(cell.output.stdout.contains("output truncated"));
    let cell = run(&mut s, "while True:\n    print('z' * 1000)");
    assert!(
        error_of(&cell).contains("TimeoutError"),
        "{}",
        error_of(&cell)
    );
    // Raw writes to the inherited stdout go to /dev/null, not into the protocol.
    let cell = run(
        &mut s,
        "import os\nos.write(1, b'x' * 100000)\nos.write(2, b'y' * 1000)\nprint('still here')",
    );
    assert_eq!(cell.output.stdout, "still here\n", "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn reading_etc_passwd_fails() {
    let (pool, mut s, cell) = attack("pwned = open('/etc/passwd').read()\nprint(pwned)");
    assert!(error_of(&cell).contains("PermissionError"), "{cell:?}");
    assert!(!cell.output.stdout.contains("root:"));
    assert_recovers(&pool, &mut s);
}

#[test]
fn reading_proc_self_environ_fails_and_environment_is_empty() {
    let (pool, mut s, cell) = attack("print(open('/proc/self/environ', 'rb').read())");
    assert!(error_of(&cell).contains("PermissionError"), "{cell:?}");
    let cell = run(&mut s, "import os\nprint(dict(os.environ))");
    assert_eq!(cell.output.stdout, "{}\n", "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn reading_the_parents_files_fails() {
    let parent = std::process::id();
    let me = std::env::current_exe().unwrap();
    let code = format!(
        "import os\nfor path in ['/proc/{parent}/cmdline', '/proc/{parent}/environ', {me:?}, '/root', '.']:\n    try:\n        print(open(path, 'rb').read()[:20])\n    except OSError as e:\n        print('denied', type(e).__name__)\nos.listdir('/')"
    );
    let (pool, mut s, cell) = attack(&code);
    assert_eq!(
        cell.output.stdout.matches("denied PermissionError").count(),
        5,
        "{cell:?}"
    );
    assert!(error_of(&cell).contains("PermissionError"), "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn writing_files_fails() {
    let target = std::env::temp_dir().join(format!("fathom-pwned-{}", std::process::id()));
    let code = format!(
        "open({:?}, 'w').write('pwned')",
        target.display().to_string()
    );
    let (pool, mut s, cell) = attack(&code);
    assert!(error_of(&cell).contains("PermissionError"), "{cell:?}");
    assert!(!target.exists());
    let cell = run(
        &mut s,
        &format!(
            "import os\nos.mkdir({:?})",
            format!("{}-dir", target.display())
        ),
    );
    assert!(error_of(&cell).contains("PermissionError"), "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn sockets_fail() {
    let (pool, mut s, cell) =
        attack("import socket\ns = socket.create_connection(('127.0.0.1', 22))");
    assert!(error_of(&cell).contains("Error"), "{cell:?}");
    assert!(
        !cell
            .output
            .error
            .as_deref()
            .unwrap_or("")
            .contains("ConnectionRefused")
    );
    assert_recovers(&pool, &mut s);
}

#[test]
fn subprocess_system_and_exec_fail() {
    let target = std::env::temp_dir().join(format!("fathom-system-{}", std::process::id()));
    let code = format!("import os\nprint(os.system('touch {}'))", target.display());
    let (pool, mut s, cell) = attack(&code);
    assert!(
        cell.output.stdout.trim() != "0" || cell.output.error.is_some(),
        "{cell:?}"
    );
    assert!(!target.exists());
    let cell = run(&mut s, "import subprocess\nsubprocess.run(['id'])");
    assert!(error_of(&cell).contains("Error"), "{cell:?}");
    let cell = run(&mut s, "import os\nos.execv('/bin/sh', ['sh', '-c', 'id'])");
    assert!(error_of(&cell).contains("PermissionError"), "{cell:?}");
    let cell = run(&mut s, "import os\nos.posix_spawn('/bin/sh', ['sh'], {})");
    assert!(error_of(&cell).contains("PermissionError"), "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn ctypes_calls_into_libc_fail() {
    let (pool, mut s, cell) = attack("import ctypes\nctypes.CDLL(None).system(b'id')");
    assert!(error_of(&cell).contains("Error"), "{cell:?}");
    assert!(!cell.output.stdout.contains("uid="));
    assert_recovers(&pool, &mut s);
}

#[test]
fn signalling_the_parent_fails() {
    let parent = std::process::id();
    let code = format!(
        "import os\nfor target in [{parent}, -1, 0]:\n    try:\n        os.kill(target, 9)\n    except OSError as e:\n        print('denied', type(e).__name__)"
    );
    let (pool, mut s, cell) = attack(&code);
    assert_eq!(
        cell.output.stdout.matches("denied PermissionError").count(),
        3,
        "{cell:?}"
    );
    // The parent's pid is not even visible: getppid(2) is denied (glibc returns -1).
    let cell = run(&mut s, "import os\nos.getppid()");
    assert_eq!(cell.output.stdout, "-1\n", "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn stack_overflow_recursion_fails() {
    let (pool, mut s, cell) = attack("def f(n):\n    return f(n + 1)\nf(0)");
    assert!(error_of(&cell).contains("RecursionError"), "{cell:?}");
    // With the recursion limit lifted, the C stack overflows and the worker dies.
    let cell = run(
        &mut s,
        "import sys\nsys.setrecursionlimit(10 ** 7)\ndef g(n):\n    return g(n + 1)\ng(0)",
    );
    assert!(cell.output.error.is_some(), "{cell:?}");
    assert_recovers(&pool, &mut s);
}

#[test]
fn sys_exit_and_os_exit_do_not_escape() {
    let (pool, mut s, cell) = attack("import sys\nsys.exit(3)");
    assert!(error_of(&cell).contains("SystemExit: 3"), "{cell:?}");
    assert!(cell.fault.is_none());
    let cell = run(&mut s, "print('alive')");
    assert_eq!(cell.output.stdout, "alive\n");
    let cell = run(&mut s, "import os\nos._exit(0)");
    assert!(
        cell.fault.is_some() && error_of(&cell).contains("restarted"),
        "{cell:?}"
    );
    assert_recovers(&pool, &mut s);
}

#[test]
fn forged_protocol_frames_cost_only_the_worker() {
    let (pool, mut s, cell) =
        attack("import os\nos.write(4, b'\\xff\\xff\\xff\\x7f')\nwhile True:\n    pass");
    assert!(
        cell.fault.as_deref().unwrap_or("").contains("protocol"),
        "{cell:?}"
    );
    let cell = run(
        &mut s,
        "import os\nos.write(4, b'\\x05\\x00\\x00\\x00{nope')\nprint(1)",
    );
    assert!(cell.fault.is_some(), "{cell:?}");
    assert_recovers(&pool, &mut s);
}

/// Counts the calls that reach it.
struct CountingSubLm(AtomicUsize);

impl SubLm for CountingSubLm {
    fn complete(&self, prompt: &str) -> Result<String, SubLmError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(format!("read {} chars", prompt.len()))
    }
}

fn llm_episode(code: &str) -> (fathom_rewards::record::Step, usize, SandboxPool) {
    let pool = pool();
    let sub = Arc::new(CountingSubLm(AtomicUsize::new(0)));
    let mut env = common::env(&pool, sub.clone());
    env.reset(ResetRequest::Custom {
        document: DOC.into(),
        question: "Q?".into(),
        answer: None,
    })
    .unwrap();
    let obs = env.step(AgentAction::Code(code.into())).unwrap();
    (obs.step.unwrap(), sub.0.load(Ordering::SeqCst), pool)
}

#[test]
fn llm_spam_is_capped() {
    let (step, reached, pool) = llm_episode("for i in range(5000):\n    r = llm('hi')\nprint(r)");
    assert_eq!(reached, 16, "only max_calls calls reach the sub-LM");
    assert!(
        step.output.as_ref().unwrap().stdout.contains("refused"),
        "{step:?}"
    );
    assert_eq!(
        step.llm_calls.len(),
        16 + 32,
        "answered plus a bounded number of refused records"
    );
    assert!(step.llm_calls[16].refused.is_some());
    let mut s = pool.session(DOC).unwrap();
    assert_recovers(&pool, &mut s);
}

#[test]
fn oversized_llm_prompt_is_refused() {
    let (step, reached, pool) = llm_episode("r = llm('x' * 10 ** 6)\nprint(r)\nllm(12)");
    assert_eq!(reached, 0);
    let call = &step.llm_calls[0];
    assert!(
        call.refused.as_deref().unwrap().contains("limit is 8192"),
        "{call:?}"
    );
    assert!(call.prompt.len() <= 2000, "refused prompts are stored cut");
    assert!(call.prompt_tokens >= 250_000);
    let out = step.output.unwrap();
    assert!(out.stdout.contains("[llm() refused"), "{out:?}");
    assert!(
        out.error
            .unwrap()
            .contains("TypeError: llm() expects a str prompt")
    );
    let mut s = pool.session(DOC).unwrap();
    assert_recovers(&pool, &mut s);
}

#[test]
fn state_does_not_leak_between_episodes() {
    let (pool, mut first, cell) = attack(
        "import builtins, sys, re, os\npwned = 1\nbuiltins.pwned = 1\nsys.modules['json'] = None\nre.search = None\ncontext.__class__.find = None\nprint(os.getpid())",
    );
    assert!(cell.output.error.is_none(), "{cell:?}");
    let first_pid = cell.output.stdout.trim().to_string();
    let mut second = pool.session(DOC).unwrap();
    let cell = run(
        &mut second,
        "import builtins, json, re, os\nprint('pwned' in globals(), hasattr(builtins, 'pwned'), re.search('vault', context) is not None, context.find('code'), os.getpid())",
    );
    let out = cell.output.stdout.trim().to_string();
    let (flags, pid) = out.rsplit_once(' ').expect("five values");
    assert_eq!(flags, "False False True 10", "{cell:?}");
    assert_ne!(pid, first_pid, "each episode gets its own worker process");
    assert_recovers(&pool, &mut first);
}
