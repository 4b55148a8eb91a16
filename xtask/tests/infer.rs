//! `cargo xtask infer` end to end, through the binary: a scripted model plays a full episode
//! (code, an `llm()` call answered by the model, the REPL's output, the answer) and the
//! transcript and summary say so; the same greedy episode gives the same tokens on the CPU and
//! on wgpu (Mesa's lavapipe where there is no GPU), for the scripted model and a random one;
//! and each bad input gets its own clear error: an adapter made for a different base shape, an
//! unreadable, non-UTF-8 or empty document, no wgpu adapter.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{SCRIPTED_ANSWER, SCRIPTED_CODE, random_model, scripted_model};
use serde_json::Value;

const XTASK: &str = env!("CARGO_BIN_EXE_xtask");
const DOCUMENT: &str = "The vault ledger, page one. Entries follow in order of arrival. \
    Vault K-12 holds access code 7731-QX. Vault K-13 holds access code 9902-LM.";
const QUESTION: &str = "What is the access code for vault K-12?";

/// `xtask infer` with `args` (and a runtime directory for wgpu, which Vulkan's loader wants).
fn infer(args: &[&str], env: &[(&str, &str)]) -> Output {
    let runtime = std::env::temp_dir().join("fathom-xdg-runtime");
    std::fs::create_dir_all(&runtime).unwrap();
    let mut cmd = Command::new(XTASK);
    cmd.arg("infer").args(args);
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        cmd.env("XDG_RUNTIME_DIR", &runtime);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("xtask runs")
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

fn document(dir: &Path) -> PathBuf {
    let path = dir.join("ledger.txt");
    std::fs::write(&path, DOCUMENT).unwrap();
    path
}

fn json_run(model: &Path, doc: &Path, backend: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "--model",
        model.to_str().unwrap(),
        "--document",
        doc.to_str().unwrap(),
        "--question",
        QUESTION,
        "--backend",
        backend,
        "--json",
    ];
    args.extend(extra);
    let out = infer(&args, &[]);
    assert!(
        out.status.success(),
        "infer --backend {backend} failed:\n{}",
        text(&out.stderr)
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        stdout.trim().lines().count(),
        1,
        "exactly one JSON line:\n{stdout}"
    );
    serde_json::from_str(stdout.trim()).unwrap()
}

#[test]
fn scripted_episode_prints_code_llm_output_answer_and_summary() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("scripted");
    scripted_model(&model);
    let doc = document(dir.path());
    let out = infer(
        &[
            "--model",
            model.to_str().unwrap(),
            "--document",
            doc.to_str().unwrap(),
            "--question",
            QUESTION,
        ],
        &[],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", text(&out.stderr));
    let expect = [
        "question What is the access code for vault K-12?",
        "── turn 1 ──",
        SCRIPTED_CODE,
        "↳ llm(\"The vault ledger, page one.",
        "── output of turn 1 (",
        "1 llm() call) ──",
        "── turn 2 ──",
        "<answer>",
        "── answered ──",
        "answer   42",
        "turns    2",
        "llm()    1 calls",
        "generated tokens/s",
    ];
    let mut at = 0;
    for e in expect {
        let found = stdout[at..]
            .find(e)
            .unwrap_or_else(|| panic!("`{e}` missing (in order) from the transcript:\n{stdout}"));
        at += found + e.len();
    }
    // The REPL really ran the code: its output is the llm() answer, which (for this model)
    // repeats the code.
    let output = stdout.split("── output of turn 1").nth(1).unwrap();
    assert!(output.contains("Output:\n```repl"), "{output}");
}

#[test]
fn json_summary_holds_the_answer_counts_and_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("scripted");
    scripted_model(&model);
    let v = json_run(&model, &document(dir.path()), "cpu", &[]);
    assert_eq!(v["answer"], SCRIPTED_ANSWER);
    assert_eq!(v["end"], "answered");
    assert_eq!(v["turns"], 2);
    assert_eq!(v["llm_calls"], 1);
    assert!(v["reward"].is_null(), "a custom question is not scored");
    let steps = v["trajectory"]["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0]["action"]["code"], format!("\n{SCRIPTED_CODE}\n"));
    assert_eq!(steps[0]["llm_calls"].as_array().unwrap().len(), 1);
    let sampled = v["sampled_ids"].as_array().unwrap().len();
    let generated = v["generated_tokens"].as_u64().unwrap() as usize;
    // The episode's own tokens, plus the llm() answer's.
    assert!(
        sampled > 10 && generated > sampled,
        "{sampled} of {generated}"
    );
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
}

/// The same greedy episode on the CPU and on wgpu: the same tokens and answer. (The f32 logits
/// of the two backends differ in the last bits — model/tests/wgpu.rs bounds them — which
/// greedy decoding does not see here.)
#[cfg(feature = "wgpu")]
#[test]
fn cpu_and_wgpu_give_the_same_episode() {
    let dir = tempfile::tempdir().unwrap();
    let doc = document(dir.path());
    let scripted = dir.path().join("scripted");
    scripted_model(&scripted);
    let random = dir.path().join("random");
    random_model(&random, 7);
    let short = ["--max-turns", "2", "--max-turn-tokens", "12"];
    for (model, extra) in [(&scripted, &[][..]), (&random, &short[..])] {
        let cpu = json_run(model, &doc, "cpu", extra);
        let gpu = json_run(model, &doc, "wgpu", extra);
        assert_eq!(
            cpu["sampled_ids"],
            gpu["sampled_ids"],
            "{}",
            model.display()
        );
        assert_eq!(cpu["answer"], gpu["answer"]);
        assert_eq!(cpu["turns"], gpu["turns"]);
        assert_eq!(
            without_timings(&cpu["trajectory"]["steps"]),
            without_timings(&gpu["trajectory"]["steps"])
        );
    }
}

/// `v` without its wall-clock fields (`elapsed_ms`), which no two runs share.
#[cfg(feature = "wgpu")]
fn without_timings(v: &Value) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| k.as_str() != "elapsed_ms")
                .map(|(k, v)| (k.clone(), without_timings(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_timings).collect()),
        other => other.clone(),
    }
}

#[test]
fn an_adapter_for_another_base_shape_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("random");
    random_model(&model, 1);
    let adapter = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-qwen2-lora");
    let out = infer(
        &[
            "--model",
            model.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--document",
            document(dir.path()).to_str().unwrap(),
            "--question",
            QUESTION,
        ],
        &[],
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("loading the adapter"), "{stderr}");
    assert!(
        stderr.contains("made for a different base shape"),
        "{stderr}"
    );
    assert!(
        stderr.contains("the adapter names its base `tiny-qwen2`"),
        "{stderr}"
    );
}

#[test]
fn unreadable_non_text_and_empty_documents_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.txt");
    let binary = dir.path().join("binary.bin");
    std::fs::write(&binary, [b'a', 0xff, 0xfe, b'b']).unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, " \n\t\n").unwrap();
    for (path, says) in [
        (&missing, "cannot read the document"),
        (&binary, "is not UTF-8 text (invalid byte at offset 1)"),
        (&empty, "is empty"),
    ] {
        // No model is loaded before the document is checked (the directory does not exist).
        let out = infer(
            &[
                "--model",
                "/nonexistent",
                "--document",
                path.to_str().unwrap(),
                "--question",
                "q",
            ],
            &[],
        );
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{}", path.display());
        assert!(stderr.contains(says), "{}: {stderr}", path.display());
        assert!(
            stderr.contains(path.to_str().unwrap()),
            "names the file: {stderr}"
        );
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn no_wgpu_adapter_is_an_error_that_suggests_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let doc = document(dir.path());
    // Point Vulkan's loader at a driver list that does not exist: no adapter at all.
    let none = dir.path().join("no-such-icd.json");
    let none = none.to_str().unwrap();
    let out = infer(
        &[
            "--model",
            "/nonexistent",
            "--backend",
            "wgpu",
            "--document",
            doc.to_str().unwrap(),
            "--question",
            "q",
        ],
        &[("VK_ICD_FILENAMES", none), ("VK_DRIVER_FILES", none)],
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no wgpu adapter found"), "{stderr}");
    assert!(stderr.contains("--backend cpu"), "{stderr}");
    assert!(
        !stderr.contains("panicked"),
        "an error, not a panic: {stderr}"
    );
}
