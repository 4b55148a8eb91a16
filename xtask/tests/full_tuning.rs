//! Full fine-tuning from the command line: `cargo xtask train` on `recipes/tiny.ron` with
//! `tuning: Full` writes the whole model as a Hugging Face directory, `cargo xtask eval
//! --adapter` evaluates that directory in the base's place, and an NF4 base with `tuning: Full`
//! is refused at its recipe line before anything loads.

mod cli;

use std::path::Path;
use std::process::Output;

use cli::text;

/// `recipes/tiny.ron` with every weight trained instead of a LoRA adapter.
fn full_recipe() -> String {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../recipes/tiny.ron"))
        .unwrap();
    let start = text.find("        tuning: Lora(").unwrap();
    let end = start + text[start..].find("        ),\n").unwrap() + "        ),\n".len();
    let mut text = text;
    text.replace_range(start..end, "        tuning: Full,\n");
    text
}

fn xtask(args: &[&str], recipe: &Path) -> Output {
    let mut all: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    all.extend([std::ffi::OsStr::new("--recipe"), recipe.as_os_str()]);
    cli::xtask(&all)
}

#[test]
fn a_fully_fine_tuned_model_is_written_and_evaluated() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("tiny-full.ron");
    std::fs::write(&recipe, full_recipe()).unwrap();
    let run = dir.path().join("run");
    let out = xtask(
        &["train", "--no-eval", "--out", run.to_str().unwrap()],
        &recipe,
    );
    assert!(out.status.success(), "{}", text(&out));
    let model = run.join("model");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(model.join(file).is_file(), "model/{file} is missing");
    }
    assert!(!run.join("adapter").exists());

    let out = xtask(
        &["eval", "--json", "--adapter", model.to_str().unwrap()],
        &recipe,
    );
    assert!(out.status.success(), "{}", text(&out));
    let reports: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
    assert_eq!(reports.len(), 2, "{reports:?}");
    for (label, report) in &reports {
        let accuracy = report["overall"]["accuracy"].as_f64();
        assert!(
            accuracy.is_some_and(|a| (0.0..=1.0).contains(&a)),
            "{label}: {report}"
        );
    }
    assert!(
        reports.keys().any(|k| k.contains("run/model")),
        "{reports:?}"
    );
}

#[test]
fn full_fine_tuning_of_an_nf4_base_is_refused_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("tiny-full-nf4.ron");
    let text_in = full_recipe().replacen(
        "quantization: Dense,",
        "quantization: Nf4(double_quant: false),",
        1,
    );
    let line = text_in
        .lines()
        .position(|l| l.contains("tuning: Full"))
        .unwrap()
        + 1;
    std::fs::write(&recipe, &text_in).unwrap();
    let out = xtask(&["train", "--dry-run"], &recipe);
    assert!(!out.status.success());
    let message = text(&out);
    assert!(
        message.contains(&format!("tiny-full-nf4.ron:{line}: model.tuning"))
            && message.contains("NF4"),
        "{message}"
    );
}
