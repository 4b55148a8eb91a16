//! Keeping the GPU backends' compiled kernels and autotune results on disk between runs.
//!
//! CubeCL compiles every kernel at first use (NVRTC to PTX on CUDA, SPIR-V or WGSL on wgpu) and
//! autotunes every new matmul shape by compiling and timing candidates. Without a kernel cache a
//! fresh process pays that again: the first QLoRA training step of the 1.5B shape took 470 s on
//! an H200, almost all of it compiling, and 0.5 s in a process that found the kernels cached
//! (docs/benchmarks.md, "GPU"). CubeCL keeps no kernels by default and writes its autotune
//! results under the `target/` of whatever Cargo project the process runs in; this module points
//! both at one directory, for binaries to call at start-up.

use std::path::{Path, PathBuf};

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// The files through which a user configures CubeCL, looked for in the working directory and its
/// parents (CubeCL's own search).
const CONFIG_FILES: [&str; 4] = ["cubecl.toml", "CubeCL.toml", "burn.toml", "Burn.toml"];

/// What [`keep_kernel_caches`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelCaches {
    /// Kernels and autotune results are kept in this directory.
    Kept(PathBuf),
    /// A CubeCL configuration file was found (this one), so its settings stand unchanged.
    UserConfig(PathBuf),
    /// CubeCL's configuration was already read or set in this process, so nothing changed
    /// (it is fixed at its first use).
    AlreadyConfigured,
}

/// Points CubeCL's kernel cache and autotune cache at `dir` (created on first use), keeping its
/// other settings as its defaults and environment variables (`CUBECL_AUTOTUNE_LEVEL`, …) give
/// them. Call it at start-up, before any GPU tensor exists. Where the user configures CubeCL
/// with a file (`cubecl.toml` or `burn.toml` in the working directory or a parent), that file
/// wins and nothing changes.
///
/// The kernel cache is keyed by CubeCL's version and each kernel's definition, not by the GPU:
/// share one directory only between machines with the same GPU architecture.
pub fn keep_kernel_caches(dir: &Path) -> KernelCaches {
    if let Some(file) = user_config_file() {
        return KernelCaches::UserConfig(file);
    }
    let mut storage = CubeClRuntimeConfig::storage().lock();
    if storage.is_some() {
        return KernelCaches::AlreadyConfigured;
    }
    let mut config = CubeClRuntimeConfig::default().override_from_env();
    config.compilation.cache = Some(CacheConfig::File(dir.to_path_buf()));
    config.autotune.cache = CacheConfig::File(dir.to_path_buf());
    *storage = Some(std::sync::Arc::new(config));
    KernelCaches::Kept(dir.to_path_buf())
}

/// The first CubeCL configuration file in the working directory or a parent, as CubeCL looks.
fn user_config_file() -> Option<PathBuf> {
    let mut dir = std::env::current_dir().ok()?;
    loop {
        for name in CONFIG_FILES {
            let file = dir.join(name);
            if file.is_file() {
                return Some(file);
            }
        }
        if !dir.pop() {
            return None;
        }
    }
}
