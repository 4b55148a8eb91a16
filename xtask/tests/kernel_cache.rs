//! `cargo xtask` keeps CubeCL's autotune results (and, on CUDA, its compiled kernels) in the
//! directory `FATHOM_CUBECL_CACHE` names (by default `<cache root>/cubecl`), so that a GPU run
//! after the first skips that work.

#![cfg(feature = "wgpu")]

mod cli;

use std::process::Command;

use cli::text;

#[test]
fn a_wgpu_run_keeps_its_autotune_results_in_the_named_directory() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("kernels");
    // A Cargo project around the working directory: CubeCL's default would write its autotune
    // results to `target/` there.
    std::fs::write(dir.path().join("Cargo.toml"), "").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(dir.path())
        .env("FATHOM_CUBECL_CACHE", &cache)
        .args([
            "bench",
            "forward",
            "--shape",
            "small",
            "--seq",
            "4",
            "--backend",
            "wgpu",
        ])
        .output()
        .expect("xtask runs");
    let text = text(&out);
    assert!(out.status.success(), "{text}");
    // CubeCL writes one file of results per tuned operation (matmul, reductions) under
    // `autotune/<version>/<device>/`.
    let tuned: Vec<_> = walk(&cache.join("autotune"))
        .into_iter()
        .filter(|p| p.to_string_lossy().contains("matmul"))
        .collect();
    assert!(
        !tuned.is_empty(),
        "no matmul autotune results under {cache:?}\n{text}"
    );
    // Nothing went to CubeCL's default place.
    assert!(!dir.path().join("target").exists(), "{text}");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}
