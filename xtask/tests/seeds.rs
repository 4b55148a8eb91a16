//! `cargo xtask train --seeds N` on `recipes/tiny.ron`: one run per seed offset, each with its
//! own seeds, and a summary over them; `--seed K` alone moves a single run's seeds.

mod cli;

use cli::{text, xtask};

#[test]
fn seeds_runs_each_seed_and_summarises_them() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("seeds");
    let out = xtask(&[
        "train",
        "--recipe",
        "recipes/tiny.ron",
        "--seeds",
        "2",
        "--out",
        root.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    for k in 0..2 {
        let run = root.join(format!("seed-{k}"));
        for file in [
            "metrics.jsonl",
            "report.md",
            "adapter/adapter_model.safetensors",
        ] {
            assert!(run.join(file).is_file(), "seed-{k}/{file} is missing");
        }
        // The recipe text saved with the run's checkpoints names the seeds it used.
        let saved = std::fs::read_dir(run.join("checkpoints"))
            .unwrap()
            .flatten()
            .filter(|e| e.path().join("recipe.ron").is_file())
            .map(|e| std::fs::read_to_string(e.path().join("recipe.ron")).unwrap())
            .next()
            .expect("a checkpoint");
        assert_eq!(saved.contains("Run with seed offset 1"), k == 1, "{saved}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("seeds.json")).unwrap()).unwrap();
    let runs = json["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    let tiny = fathom_trainer::recipe::Plan::load(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../recipes/tiny.ron"
    )))
    .unwrap();
    assert_eq!(runs[0]["seeds"]["model"], tiny.seeds.model);
    assert_eq!(runs[1]["seeds"]["model"], tiny.seeds.model + 1);
    assert_eq!(runs[1]["seeds"]["sampling"], tiny.seeds.sampling + 1);
    // The base is evaluated once; SFT and GRPO by every seed.
    let labels = |r: &serde_json::Value| -> Vec<String> {
        r["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s[0].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(labels(&runs[0]), ["base", "sft", "grpo"]);
    assert_eq!(labels(&runs[1]), ["sft", "grpo"]);
    let stages = json["stages"].as_array().unwrap();
    assert_eq!(stages[1]["label"], "sft");
    assert_eq!(stages[1]["accuracy"]["n"], 2);
    assert!(json["gain"]["accuracy"]["mean"].is_number());
    assert!(json["gain"]["llm_calls"]["mean"].is_number());
    assert!(json["gain"]["llm_calls_cut_beyond_spread"].is_boolean());
    let md = std::fs::read_to_string(root.join("seeds.md")).unwrap();
    assert!(md.contains("| sft | 2 |"), "{md}");
    assert!(md.contains("GRPO − SFT, seed for seed"), "{md}");
}

#[test]
fn seeds_refuses_what_it_cannot_combine() {
    for args in [
        &["train", "--recipe", "recipes/tiny.ron", "--seeds", "0"][..],
        &[
            "train",
            "--recipe",
            "recipes/tiny.ron",
            "--seeds",
            "2",
            "--no-eval",
        ][..],
        &[
            "train",
            "--recipe",
            "recipes/tiny.ron",
            "--seeds",
            "2",
            "--seed",
            "1",
        ][..],
    ] {
        let out = xtask(args);
        assert!(!out.status.success(), "{args:?} should be refused");
        assert!(text(&out).contains("--seeds"), "{}", text(&out));
    }
}
