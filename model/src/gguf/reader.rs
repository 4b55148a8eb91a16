//! The GGUF container, versions 2 and 3, little-endian: a header (magic `GGUF`, version, tensor
//! count, metadata count), metadata key/value pairs of thirteen value types (arrays nest), the
//! tensor infos (name, dimensions innermost first, ggml type, offset), then the tensor data,
//! starting at the next multiple of `general.alignment` (32 when absent).
//!
//! The file is memory-mapped; every count and length read from it is checked against the bytes
//! that remain before anything is allocated, so a corrupt or hostile file gives a
//! [`GgufError::Format`] naming the offset, never a panic or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::GgufError;
use super::dequant::{GgmlType, type_name};

const MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of the tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest array nesting accepted (llama.cpp writes at most one level).
const MAX_DEPTH: usize = 8;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `uint8`
    U8(u8),
    /// `int8`
    I8(i8),
    /// `uint16`
    U16(u16),
    /// `int16`
    I16(i16),
    /// `uint32`
    U32(u32),
    /// `int32`
    I32(i32),
    /// `uint64`
    U64(u64),
    /// `int64`
    I64(i64),
    /// `float32`
    F32(f32),
    /// `float64`
    F64(f64),
    /// `bool`
    Bool(bool),
    /// `string` (UTF-8)
    String(String),
    /// `array` of one element type
    Array(Vec<Value>),
}

impl Value {
    /// The value as a non-negative integer, whatever its integer type.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float (floats, and integers converted).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The GGUF name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in ggml order: the innermost (contiguous) first. A `[rows, cols]` PyTorch
    /// weight is `[cols, rows]` here.
    pub dims: Vec<u64>,
    /// ggml's numeric type id (see [`GgmlType`]).
    pub type_id: u32,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn len(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape in PyTorch order (outermost first).
    pub fn torch_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and of each tensor's offset.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, message: impl std::fmt::Display) -> GgufError {
        GgufError::Format {
            path: self.path.to_path_buf(),
            message: format!("{message} (at byte {})", self.pos),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| self.err(format!("file ends inside {what}")))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        Ok(self.take(N, what)?.try_into().expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_size` bytes long, checked against what remains.
    fn count(&mut self, what: &str, min_size: usize) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n.saturating_mul(min_size.max(1) as u64) > left {
            return Err(self.err(format!("{what} {n} is larger than the rest of the file")));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.count(what, 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, type_id: u32, key: &str, depth: usize) -> Result<Value, GgufError> {
        Ok(match type_id {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(key)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("`{key}`: bool byte {b} is neither 0 nor 1"))),
            },
            8 => Value::String(self.string(&format!("string of `{key}`"))?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.err(format!("`{key}`: arrays nested deeper than {MAX_DEPTH}")));
                }
                let elem = self.u32(key)?;
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                };
                let n = self.count(&format!("length of array `{key}`"), min)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(key)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            t => return Err(self.err(format!("`{key}`: unknown metadata value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file (the tensor data stays mapped, unread).
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = File::open(path).map_err(|e| GgufError::io(path, e))?;
        // SAFETY: the map is read-only; a file truncated underneath us would fault, as any
        // memory-mapped reader would (the safetensors checkpoints are read the same way).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| GgufError::io(path, e))?;
        Self::parse(path, map)
    }

    fn parse(path: &Path, map: Mmap) -> Result<Self, GgufError> {
        let mut c = Cursor {
            bytes: &map,
            pos: 0,
            path,
        };
        let magic = c.take(4, "the magic number")?;
        if magic != MAGIC {
            return Err(GgufError::Format {
                path: path.to_path_buf(),
                message: format!("magic is {magic:?}, expected \"GGUF\""),
            });
        }
        let version = c.u32("the version")?;
        if version != 2 && version != 3 {
            return Err(c.err(format!(
                "version {version} is not supported (only 2 and 3; a big-endian file reads as \
                 a huge version)"
            )));
        }
        // Each tensor info is at least 24 bytes, each key/value pair at least 13.
        let n_tensors = c.count("tensor count", 24)?;
        let n_kv = c.count("metadata count", 13)?;
        let mut metadata = Vec::with_capacity(n_kv);
        let mut index = HashMap::with_capacity(n_kv);
        for _ in 0..n_kv {
            let key = c.string("a metadata key")?;
            let type_id = c.u32(&key)?;
            let value = c.value(type_id, &key, 0)?;
            if index.insert(key.clone(), metadata.len()).is_some() {
                return Err(c.err(format!("metadata key `{key}` appears twice")));
            }
            metadata.push((key, value));
        }
        let alignment = match index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if *a > 0 && a.is_power_of_two() => u64::from(*a),
            Some(other) => {
                return Err(GgufError::Metadata {
                    path: path.to_path_buf(),
                    key: "general.alignment".into(),
                    message: format!("{other:?} is not a power-of-two uint32"),
                });
            }
        };
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut names = HashMap::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            let n_dims = c.u32(&name)? as usize;
            if n_dims > 4 {
                return Err(c.err(format!(
                    "tensor `{name}` has {n_dims} dimensions (at most 4)"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&name)?);
            }
            let type_id = c.u32(&name)?;
            let offset = c.u64(&name)?;
            if !offset.is_multiple_of(alignment) {
                return Err(c.err(format!(
                    "tensor `{name}` offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            if names.insert(name.clone(), tensors.len()).is_some() {
                return Err(c.err(format!("tensor `{name}` appears twice")));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                type_id,
                offset,
            });
        }
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let file = Self {
            path: path.to_path_buf(),
            map,
            version,
            metadata,
            index,
            tensors,
            alignment,
            data_offset,
        };
        // Tensors of known types must lie inside the file; unknown types are checked only if
        // they are read (their size is not known).
        for t in &file.tensors {
            if GgmlType::from_id(t.type_id).is_some() {
                file.tensor_bytes(t)?;
            }
        }
        Ok(file)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn meta_err(&self, key: &str, message: impl Into<String>) -> GgufError {
        GgufError::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            message: message.into(),
        }
    }

    fn required(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key)
            .ok_or_else(|| self.meta_err(key, "missing from the file"))
    }

    /// A required non-negative integer.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.required(key)?;
        v.as_u64()
            .ok_or_else(|| self.meta_err(key, format!("{v:?} is not a non-negative integer")))
    }

    /// A required number.
    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.required(key)?;
        v.as_f64()
            .ok_or_else(|| self.meta_err(key, format!("{v:?} is not a number")))
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.required(key)?;
        v.as_str()
            .ok_or_else(|| self.meta_err(key, format!("{v:?} is not a string")))
    }

    /// An optional boolean (`None` when absent; an error when present with another type).
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.meta_err(key, format!("{v:?} is not a bool"))),
        }
    }

    /// An optional non-negative integer.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.u64(key).map(Some),
        }
    }

    /// A required array of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let v = self.required(key)?;
        let items = v
            .as_array()
            .ok_or_else(|| self.meta_err(key, "is not an array"))?;
        items
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str()
                    .ok_or_else(|| self.meta_err(key, format!("element {i} is not a string")))
            })
            .collect()
    }

    /// An optional array of integers.
    pub fn opt_ints(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let items = v
            .as_array()
            .ok_or_else(|| self.meta_err(key, "is not an array"))?;
        items
            .iter()
            .enumerate()
            .map(|(i, x)| match *x {
                Value::I8(v) => Ok(v.into()),
                Value::I16(v) => Ok(v.into()),
                Value::I32(v) => Ok(v.into()),
                Value::I64(v) => Ok(v),
                _ => x
                    .as_u64()
                    .and_then(|u| i64::try_from(u).ok())
                    .ok_or_else(|| self.meta_err(key, format!("element {i} is not an integer"))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// A tensor's info by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor of a supported type.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> Result<&[u8], GgufError> {
        let ty = GgmlType::from_id(t.type_id).ok_or_else(|| self.unsupported(t))?;
        let err = |message: String| GgufError::Tensor {
            path: self.path.clone(),
            name: t.name.clone(),
            message,
        };
        let n = t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let n = n.ok_or_else(|| err(format!("dimensions {:?} overflow", t.dims)))?;
        let inner = t.dims.first().copied().unwrap_or(1);
        let block = ty.block_len() as u64;
        if !inner.is_multiple_of(block) {
            return Err(err(format!(
                "rows of {inner} elements are not whole {} blocks of {block}",
                ty.name()
            )));
        }
        let size = n / block * ty.block_bytes() as u64;
        let start = self.data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(size));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.map.len() as u64 => {
                Ok(&self.map[s as usize..e as usize])
            }
            _ => Err(err(format!(
                "data ({size} bytes at offset {}) runs past the end of the file ({} bytes)",
                t.offset,
                self.map.len()
            ))),
        }
    }

    /// The error for a tensor whose type is not supported.
    pub fn unsupported(&self, t: &TensorInfo) -> GgufError {
        GgufError::UnsupportedType {
            path: self.path.clone(),
            name: t.name.clone(),
            type_name: type_name(t.type_id).to_string(),
            type_id: t.type_id,
            supported: GgmlType::ALL
                .iter()
                .map(|t| t.name())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// A tensor dequantized to f32, in row-major (PyTorch) order.
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let ty = GgmlType::from_id(t.type_id).ok_or_else(|| self.unsupported(t))?;
        let bytes = self.tensor_bytes(t)?;
        Ok(ty.dequantize(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(out: &mut Vec<u8>, key: &str, type_id: u32, value: &[u8]) {
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(type_id.to_le_bytes());
        out.extend(value);
    }

    fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(n_tensors.to_le_bytes());
        out.extend(n_kv.to_le_bytes());
        out
    }

    fn parse(bytes: &[u8]) -> Result<GgufFile, GgufError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        std::fs::write(&path, bytes).unwrap();
        GgufFile::open(&path)
    }

    #[test]
    fn bad_magic_and_version_are_named() {
        let err = parse(b"GGML\x03\0\0\0").unwrap_err().to_string();
        assert!(err.contains("magic"), "{err}");
        let mut b = b"GGUF".to_vec();
        b.extend(1u32.to_le_bytes());
        let err = parse(&b).unwrap_err().to_string();
        assert!(err.contains("version 1"), "{err}");
    }

    #[test]
    fn truncation_and_huge_counts_are_errors_not_panics() {
        let full = {
            let mut b = header(0, 1);
            kv(
                &mut b,
                "general.name",
                8,
                &[5, 0, 0, 0, 0, 0, 0, 0, b'h', b'e', b'l', b'l', b'o'],
            );
            b
        };
        assert_eq!(parse(&full).unwrap().str("general.name").unwrap(), "hello");
        for cut in 0..full.len() {
            assert!(parse(&full[..cut]).is_err(), "cut at {cut}");
        }
        let mut huge = header(0, 1);
        kv(&mut huge, "a", 9, &[]);
        huge.extend(4u32.to_le_bytes());
        huge.extend(u64::MAX.to_le_bytes());
        let err = parse(&huge).unwrap_err().to_string();
        assert!(err.contains("larger than the rest"), "{err}");
        let err = parse(&header(u64::MAX, 0)).unwrap_err().to_string();
        assert!(err.contains("tensor count"), "{err}");
    }

    #[test]
    fn tensor_outside_the_file_or_misaligned_is_named() {
        let mut b = header(1, 0);
        b.extend(3u64.to_le_bytes());
        b.extend(b"w.x");
        b.extend(1u32.to_le_bytes());
        b.extend(64u64.to_le_bytes());
        b.extend(0u32.to_le_bytes()); // f32
        b.extend(0u64.to_le_bytes());
        let err = parse(&b).unwrap_err().to_string();
        assert!(
            err.contains("`w.x`") && err.contains("past the end"),
            "{err}"
        );
        let n = b.len();
        b[n - 8..].copy_from_slice(&4u64.to_le_bytes());
        let err = parse(&b).unwrap_err().to_string();
        assert!(err.contains("alignment"), "{err}");
    }

    #[test]
    fn unknown_tensor_type_parses_and_is_named_when_read() {
        let mut b = header(1, 0);
        b.extend(1u64.to_le_bytes());
        b.extend(b"w");
        b.extend(1u32.to_le_bytes());
        b.extend(256u64.to_le_bytes());
        b.extend(16u32.to_le_bytes()); // IQ2_XXS
        b.extend(0u64.to_le_bytes());
        let f = parse(&b).unwrap();
        let err = f.dequantize(&f.tensors[0]).unwrap_err().to_string();
        assert!(err.contains("IQ2_XXS") && err.contains("`w`"), "{err}");
    }
}
