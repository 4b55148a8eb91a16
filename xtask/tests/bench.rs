//! `cargo xtask bench` on small inputs: each command prints the JSON its documentation promises
//! (the keys docs/benchmarks.md reads), with figures that are consistent with each other, and
//! refuses impossible settings with an error that names them.

mod cli;

use cli::{text, xtask};
use serde_json::Value;

/// The one JSON line a bench command prints.
fn json_line(args: &[&str]) -> Value {
    let out = xtask(args);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line in:\n{}", text(&out)));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

fn number(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` is not a number in {v}"))
}

#[test]
fn train_step_reports_its_steps_with_and_without_checkpointing() {
    for checkpointing in [false, true] {
        let mut args = vec![
            "bench",
            "train-step",
            "--shape",
            "small",
            "--nf4",
            "--tokens",
            "48",
            "--steps",
            "2",
        ];
        if checkpointing {
            args.push("--checkpointing");
        }
        let v = json_line(&args);
        assert_eq!(v["checkpointing"], checkpointing, "{v}");
        assert_eq!(v["nf4"], true, "{v}");
        assert_eq!(v["tokens"], 48, "{v}");
        assert_eq!(v["backend"], "cpu", "{v}");
        let steps = v["steps_s"].as_array().expect("steps_s");
        assert_eq!(steps.len(), 2, "{v}");
        let step = number(&v, "step_s");
        assert!(
            steps.iter().any(|s| s.as_f64() == Some(step)),
            "the median of two steps is one of them: {v}"
        );
        for key in ["warmup_s", "build_s"] {
            assert!(number(&v, key) > 0.0, "{key}: {v}");
        }
        assert!(
            number(&v, "peak_rss_mb") >= number(&v, "rss_after_build_mb"),
            "{v}"
        );
        // LoRA r = 16 on all seven projections of the 4-layer small shape: a small share of it.
        let (params, lora) = (number(&v, "params"), number(&v, "lora_params"));
        assert!(lora > 0.0 && lora < params / 4.0, "{v}");
    }
}

#[test]
fn train_step_refuses_a_step_without_a_target() {
    let out = xtask(&["bench", "train-step", "--shape", "small", "--tokens", "1"]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("two tokens"), "{}", text(&out));
}

#[test]
fn model_bench_reports_prefill_and_decoding_of_a_checkpoint() {
    let v = json_line(&[
        "bench",
        "model",
        "--model",
        "fixtures/tiny-qwen2",
        "--prefill-len",
        "16",
        "--prefill-iters",
        "2",
        "--prompt-len",
        "4",
        "--new-tokens",
        "3",
        "--decode-iters",
        "1",
        "--batches",
        "1,2",
    ]);
    for key in [
        "prefill_tok_s",
        "decode_b1_tok_s",
        "decode_b2_tok_s",
        "peak_rss_mb",
    ] {
        assert!(number(&v, key) > 0.0, "{key}: {v}");
    }
    assert_eq!(v["prefill_len"], 16, "{v}");
    assert_eq!(v["prefill_s"].as_array().map(Vec::len), Some(2), "{v}");
}

/// `--backend cuda` on a machine without a CUDA driver or device (CI's) is an error that says
/// so, not the runtime's panic (exit code 101); where CUDA starts, the step runs.
#[cfg(feature = "cuda")]
#[test]
fn cuda_without_a_device_is_a_clear_error() {
    let out = xtask(&[
        "bench",
        "train-step",
        "--shape",
        "small",
        "--tokens",
        "16",
        "--steps",
        "1",
        "--backend",
        "cuda",
    ]);
    if out.status.success() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("\"backend\":\"cuda\""), "{}", text(&out));
    } else {
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(
            text(&out).contains("the CUDA runtime could not start"),
            "{}",
            text(&out)
        );
    }
}
