//! `cargo xtask smoke` passes: one SFT step and one GRPO step end to end on the tiny recipe,
//! with every check of `SMOKE_RESULT.md` passing.

use std::process::Command;

#[test]
fn smoke_passes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smoke");
    let status = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .args(["smoke", "--out"])
        .arg(&out)
        .status()
        .expect("xtask runs");
    let report = std::fs::read_to_string(out.join("SMOKE_RESULT.md")).expect("a report");
    assert!(status.success(), "{report}");
    assert!(report.contains("Verdict: **PASS**"), "{report}");
    assert_eq!(report.matches("| pass |").count(), 4, "{report}");
}
