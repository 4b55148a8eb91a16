//! Reading and writing safetensors files: single-file and sharded checkpoints, memory-mapped,
//! with dtype conversion to f32 and atomic writes.
//!
//! burn 0.21's `burn-store` can load safetensors into a module by key, but Fathom's projections
//! are not burn `Linear`s (a dense or NF4 base plus an optional LoRA, see [`crate::linear`]),
//! NF4 weights arrive as several packed tensors per projection, and every failure must name the
//! tensor; so the loader reads tensors one by one through the `safetensors` crate instead.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, Metadata, TensorView};

use crate::error::{ModelError, Result};

/// One memory-mapped safetensors file with its parsed header.
struct Shard {
    path: PathBuf,
    map: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// A checkpoint's tensors, from `model.safetensors` or the shards listed in
/// `model.safetensors.index.json` (or any single safetensors file).
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
}

/// The raw bytes of one tensor, borrowed from the memory map.
pub struct RawTensor<'a> {
    /// Element type as stored.
    pub dtype: Dtype,
    /// Shape as stored.
    pub shape: Vec<usize>,
    /// Little-endian row-major bytes.
    pub data: &'a [u8],
}

impl Checkpoint {
    /// Opens the checkpoint in `dir` (single file or sharded).
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: HashMap<String, String>,
            }
            let parsed: Index = serde_json::from_str(&text).map_err(|e| ModelError::Json {
                path: index.clone(),
                message: e.to_string(),
            })?;
            let mut files: Vec<String> = parsed.weight_map.values().cloned().collect();
            files.sort();
            files.dedup();
            let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
            let checkpoint = Self::open_files(dir, &paths)?;
            for (name, file) in &parsed.weight_map {
                let listed = checkpoint
                    .index
                    .get(name)
                    .map(|&i| &checkpoint.shards[i].path);
                if listed != Some(&dir.join(file)) {
                    return Err(ModelError::Safetensors {
                        path: dir.join(file),
                        message: format!(
                            "the index lists tensor `{name}` in this shard, but it is not there"
                        ),
                    });
                }
            }
            Ok(checkpoint)
        } else if single.exists() {
            Self::open_files(dir, &[single])
        } else {
            Err(ModelError::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors or model.safetensors.index.json in the model directory",
                ),
            ))
        }
    }

    /// Opens one or more safetensors files as a single checkpoint.
    pub fn open_files(dir: &Path, paths: &[PathBuf]) -> Result<Self> {
        let mut shards = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for path in paths {
            let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
            // SAFETY: the map is read-only; a checkpoint rewritten underneath a running process
            // is outside what any loader can defend against (safetensors and candle map too).
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
            let (header_len, metadata) =
                SafeTensors::read_metadata(&map).map_err(|e| ModelError::Safetensors {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            for name in metadata.tensors().keys() {
                if index.insert(name.clone(), shards.len()).is_some() {
                    return Err(ModelError::Safetensors {
                        path: path.clone(),
                        message: format!("tensor `{name}` appears in more than one shard"),
                    });
                }
            }
            shards.push(Shard {
                path: path.clone(),
                map,
                header_len,
                metadata,
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            index,
        })
    }

    /// The directory the checkpoint was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a tensor with this key exists.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// All tensor keys, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.index.keys().cloned().collect();
        names.sort();
        names
    }

    /// The raw bytes of a tensor.
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>> {
        let &shard = self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
            })?;
        let shard = &self.shards[shard];
        let info = shard
            .metadata
            .info(name)
            .expect("indexed tensor has metadata");
        let (start, end) = info.data_offsets;
        let base = 8 + shard.header_len;
        let data =
            shard
                .map
                .get(base + start..base + end)
                .ok_or_else(|| ModelError::Safetensors {
                    path: shard.path.clone(),
                    message: format!("tensor `{name}` points past the end of the file"),
                })?;
        let elements: usize = info.shape.iter().product();
        if elements * info.dtype.bitsize() != data.len() * 8 {
            return Err(ModelError::Safetensors {
                path: shard.path.clone(),
                message: format!(
                    "tensor `{name}` has {} bytes for shape {:?}",
                    data.len(),
                    info.shape
                ),
            });
        }
        Ok(RawTensor {
            dtype: info.dtype,
            shape: info.shape.clone(),
            data,
        })
    }

    /// The shape of a tensor.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.raw(name)?.shape)
    }

    /// A floating-point tensor converted to f32, checked against the expected shape.
    pub fn f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        let raw = self.raw(name)?;
        if raw.shape != expected {
            return Err(ModelError::Shape {
                name: name.into(),
                found: raw.shape,
                expected: expected.to_vec(),
            });
        }
        to_f32(name, raw.dtype, raw.data)
    }

    /// A `u8` tensor's bytes.
    pub fn u8(&self, name: &str) -> Result<(Vec<usize>, &[u8])> {
        let raw = self.raw(name)?;
        if raw.dtype != Dtype::U8 {
            return Err(ModelError::Dtype {
                name: name.into(),
                dtype: format!("{:?} (expected U8)", raw.dtype),
            });
        }
        Ok((raw.shape, raw.data))
    }
}

/// Converts little-endian f32, f16 or bf16 bytes to f32.
pub fn to_f32(name: &str, dtype: Dtype, data: &[u8]) -> Result<Vec<f32>> {
    let out = match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(ModelError::Dtype {
                name: name.into(),
                dtype: format!("{other:?} (expected F32, F16 or BF16)"),
            });
        }
    };
    Ok(out)
}

/// A tensor to be written: key, dtype, shape and little-endian bytes.
pub struct OutTensor {
    /// The key.
    pub name: String,
    /// The element type.
    pub dtype: Dtype,
    /// The shape.
    pub shape: Vec<usize>,
    /// Row-major little-endian bytes.
    pub data: Vec<u8>,
}

impl OutTensor {
    /// An f32 tensor.
    pub fn f32(name: impl Into<String>, shape: Vec<usize>, values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self {
            name: name.into(),
            dtype: Dtype::F32,
            shape,
            data,
        }
    }

    /// A u8 tensor.
    pub fn u8(name: impl Into<String>, shape: Vec<usize>, values: Vec<u8>) -> Self {
        Self {
            name: name.into(),
            dtype: Dtype::U8,
            shape,
            data: values,
        }
    }

    /// An i64 tensor.
    pub fn i64(name: impl Into<String>, shape: Vec<usize>, values: &[i64]) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self {
            name: name.into(),
            dtype: Dtype::I64,
            shape,
            data,
        }
    }
}

/// Writes tensors to a safetensors file atomically (a temporary file renamed into place), with
/// optional string metadata (`{"format": "pt"}` is what PyTorch tools expect).
pub fn write_safetensors(
    path: &Path,
    tensors: &[OutTensor],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| ModelError::Safetensors {
                    path: path.into(),
                    message: format!("`{}`: {e}", t.name),
                })
        })
        .collect::<Result<_>>()?;
    let bytes = safetensors::serialize(views, metadata).map_err(|e| ModelError::Safetensors {
        path: path.into(),
        message: e.to_string(),
    })?;
    write_atomic(path, &bytes)
}

/// Writes a file atomically: the bytes go to a sibling temporary file which is synced and then
/// renamed over `path`, so a reader never sees a half-written file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(ModelError::io(path, e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_conversion() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let bf16: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        write_safetensors(
            &path,
            &[
                OutTensor::f32("a", vec![2, 2], &[1.0, 2.0, 3.0, 4.0]),
                OutTensor {
                    name: "b".into(),
                    dtype: Dtype::BF16,
                    shape: vec![2],
                    data: bf16,
                },
            ],
            None,
        )
        .unwrap();
        let ck = Checkpoint::open_dir(dir.path()).unwrap();
        assert_eq!(ck.f32("a", &[2, 2]).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(ck.f32("b", &[2]).unwrap(), vec![1.5, -2.0]);
        let err = ck.f32("a", &[4]).unwrap_err().to_string();
        assert!(err.contains("`a`") && err.contains("[2, 2]"), "{err}");
        let err = ck.f32("missing", &[1]).unwrap_err().to_string();
        assert!(err.contains("`missing`"), "{err}");
    }

    #[test]
    fn sharded_index() {
        let dir = tempfile::tempdir().unwrap();
        write_safetensors(
            &dir.path().join("s1.safetensors"),
            &[OutTensor::f32("x", vec![1], &[1.0])],
            None,
        )
        .unwrap();
        write_safetensors(
            &dir.path().join("s2.safetensors"),
            &[OutTensor::f32("y", vec![1], &[2.0])],
            None,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            r#"{"metadata": {}, "weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}}"#,
        )
        .unwrap();
        let ck = Checkpoint::open_dir(dir.path()).unwrap();
        assert_eq!(ck.f32("y", &[1]).unwrap(), vec![2.0]);
        assert_eq!(ck.names(), vec!["x".to_string(), "y".to_string()]);
    }

    #[test]
    fn garbage_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("model.safetensors"),
            b"not a safetensors file at all",
        )
        .unwrap();
        let err = Checkpoint::open_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("model.safetensors"), "{err}");
    }
}
