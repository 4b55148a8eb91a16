//! The REPL inside a worker: state across cells, tracebacks as Python shows them, the echo
//! of a final expression, `llm()` round trips, and the instrumented `context` recording how
//! each cell touched the document.

mod common;

use fathom_env::sandbox::{Cell, Session};
use fathom_rewards::record::{Access, AccessKind, Span};

const DOC: &str = "alpha beta gamma delta. The code is 4411. More text about gamma here.";

fn run(s: &mut Session, code: &str) -> Cell {
    s.exec(code, &mut |p| format!("echo:{p}")).unwrap()
}

fn span(start: usize, end: usize) -> Span {
    Span { start, end }
}

#[test]
fn state_persists_and_last_expression_is_echoed() {
    let pool = common::pool();
    let mut s = pool.session(DOC).unwrap();
    assert_eq!(run(&mut s, "x = 40").output.stdout, "");
    assert_eq!(run(&mut s, "x + 2").output.stdout, "42\n");
    assert_eq!(run(&mut s, "print('a'); None").output.stdout, "a\n");
    assert_eq!(
        run(&mut s, "isinstance(context, str), len(context)")
            .output
            .stdout,
        format!("(True, {})\n", DOC.len())
    );
}

#[test]
fn errors_read_like_python_tracebacks() {
    let pool = common::pool();
    let mut s = pool.session(DOC).unwrap();
    let cell = run(
        &mut s,
        "def f(x):\n    return x / 0\n\nprint('before')\nf(1)",
    );
    assert_eq!(cell.output.stdout, "before\n");
    let err = cell.output.error.unwrap();
    assert!(err.starts_with("Traceback (most recent call last):\n  File \"<cell 1>\", line 5, in <module>\n    f(1)\n"), "{err}");
    assert!(err.contains("line 2, in f\n    return x / 0"), "{err}");
    assert!(
        err.ends_with("ZeroDivisionError: division by zero\n"),
        "{err}"
    );
    assert!(
        !err.contains("fathom-prelude"),
        "internal frames are hidden: {err}"
    );
    let err = run(&mut s, "context.index('zzz')").output.error.unwrap();
    assert!(
        err.ends_with("ValueError: substring not found\n") && !err.contains("prelude"),
        "{err}"
    );
    let err = run(&mut s, "if True print(1)").output.error.unwrap();
    assert!(
        err.contains("File \"<cell 3>\", line 1") && err.contains("SyntaxError"),
        "{err}"
    );
}

#[test]
fn llm_round_trips_through_the_parent() {
    let pool = common::pool();
    let mut s = pool.session(DOC).unwrap();
    let mut prompts = Vec::new();
    let cell = s
        .exec(
            "a = llm('one')\nb = llm(context[6:10])\nprint(a, b)",
            &mut |p| {
                prompts.push(p.to_string());
                p.to_uppercase()
            },
        )
        .unwrap();
    assert_eq!(cell.output.stdout, "ONE BETA\n");
    assert_eq!(prompts, ["one", "beta"]);
}

#[test]
fn slices_remember_their_offsets() {
    let pool = common::pool();
    let mut s = pool.session(DOC).unwrap();
    let cell = run(
        &mut s,
        "part = context[24:]\nsub = part[4:8]\nprint(sub)\nprint(part.find('4411'))",
    );
    assert_eq!(cell.output.stdout, "code\n12\n");
    assert_eq!(
        cell.accesses,
        vec![
            Access {
                kind: AccessKind::Slice,
                span: span(24, DOC.len())
            },
            Access {
                kind: AccessKind::Slice,
                span: span(28, 32)
            },
            Access {
                kind: AccessKind::Find {
                    needle: "4411".into()
                },
                span: span(24, DOC.len())
            },
        ]
    );
}

#[test]
fn regex_searches_are_recorded_with_pattern_and_span() {
    let pool = common::pool();
    let mut s = pool.session(DOC).unwrap();
    let cell = run(
        &mut s,
        "import re\nre.findall(r'\\d+', context)\np = re.compile('gamma')\np.search(context, 30)\nre.sub('a', 'b', context[0:5])\n'gamma' in context.lower()\nre.findall('x', 'not the document')",
    );
    let n = DOC.len();
    assert_eq!(
        cell.accesses,
        vec![
            Access {
                kind: AccessKind::Search {
                    pattern: r"\d+".into()
                },
                span: span(0, n)
            },
            Access {
                kind: AccessKind::Search {
                    pattern: "gamma".into()
                },
                span: span(30, n)
            },
            Access {
                kind: AccessKind::Slice,
                span: span(0, 5)
            },
            Access {
                kind: AccessKind::Search {
                    pattern: "a".into()
                },
                span: span(0, 5)
            },
            Access {
                kind: AccessKind::Find {
                    needle: "gamma".into()
                },
                span: span(0, n)
            },
        ],
        "{cell:?}"
    );
    // A later cell starts a fresh record.
    assert!(run(&mut s, "1 + 1").accesses.is_empty());
}

#[test]
fn access_records_are_capped_per_cell() {
    let pool = common::pool();
    let mut s = pool.session(DOC).unwrap();
    let cell = run(&mut s, "for i in range(1000):\n    context[i % 10:20]");
    assert_eq!(cell.accesses.len(), pool.config().limits.max_accesses);
    assert_eq!(
        cell.accesses_dropped,
        1000 - pool.config().limits.max_accesses
    );
}
