//! The key/value cache, owned by the caller and passed to every forward call, so one model can
//! serve many sequences without hidden state. It is made for multi-turn rollouts:
//!
//! - every row (sequence) has its own length, so a step may append one token to some rows and
//!   a whole multi-token segment (an environment's observation) to others, without padding and
//!   without re-encoding what is cached;
//! - storage is preallocated in blocks of positions and written in place, instead of a
//!   concatenation (a copy of the whole cache) per token;
//! - a row can be forked (a group of samples shares its prompt's prefix: the fork shares the
//!   storage until one of them writes, then that one copies it once) and rows can be dropped
//!   (finished episodes leave the batch);
//! - it reports the memory it holds.
//!
//! Keys and values are stored after RoPE and before grouped-query expansion:
//! `[kv_heads, capacity, head_dim]` per layer and row.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::backend::ModelBackend;
use crate::error::{ModelError, Result};

/// Positions a row's storage grows by when it fills up.
pub const DEFAULT_BLOCK: usize = 256;

/// One layer's keys and values for a row: `[kv_heads, capacity, head_dim]` each.
type LayerKv<B> = (Tensor<B, 3>, Tensor<B, 3>);

#[derive(Clone, Debug)]
pub(crate) struct Row<B: Backend> {
    /// Positions cached.
    pub(crate) len: usize,
    /// Per layer, once written.
    layers: Vec<Option<LayerKv<B>>>,
}

/// Cached keys and values of every layer for a set of sequences (rows).
#[derive(Clone, Debug)]
pub struct KvCache<B: Backend> {
    num_layers: usize,
    block: usize,
    rows: Vec<Row<B>>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache (no rows) for a model with `num_layers` layers, growing rows by
    /// [`DEFAULT_BLOCK`] positions.
    pub fn new(num_layers: usize) -> Self {
        Self::with_block(num_layers, DEFAULT_BLOCK)
    }

    /// An empty cache growing rows by `block` positions (at least 1).
    pub fn with_block(num_layers: usize, block: usize) -> Self {
        Self {
            num_layers,
            block: block.max(1),
            rows: Vec::new(),
        }
    }

    /// Adds an empty row and returns its index.
    pub fn add_row(&mut self) -> usize {
        self.rows.push(Row {
            len: 0,
            layers: vec![None; self.num_layers],
        });
        self.rows.len() - 1
    }

    /// Adds `n` empty rows; returns the index of the first.
    pub fn add_rows(&mut self, n: usize) -> usize {
        let first = self.rows.len();
        for _ in 0..n {
            self.add_row();
        }
        first
    }

    /// Adds a copy of row `row` and returns its index. The copy shares storage with the
    /// original until either is written.
    pub fn fork_row(&mut self, row: usize) -> Result<usize> {
        let copy = self.row(row)?.clone();
        self.rows.push(copy);
        Ok(self.rows.len() - 1)
    }

    /// Empties row `row` (its storage is freed; the row stays, with length 0, so other rows
    /// keep their indices and the row can be reused).
    pub fn release_row(&mut self, row: usize) -> Result<()> {
        self.row(row)?;
        let layers = self.num_layers;
        self.rows[row] = Row {
            len: 0,
            layers: vec![None; layers],
        };
        Ok(())
    }

    /// Keeps only the given rows, in the given order (finished sequences leave; the remaining
    /// rows are renumbered `0..keep.len()`). A row may appear more than once (a fork).
    pub fn retain_rows(&mut self, keep: &[usize]) -> Result<()> {
        let mut rows = Vec::with_capacity(keep.len());
        for &r in keep {
            rows.push(self.row(r)?.clone());
        }
        self.rows = rows;
        Ok(())
    }

    /// Number of rows.
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }

    /// Positions cached in row `row`.
    pub fn row_len(&self, row: usize) -> Result<usize> {
        Ok(self.row(row)?.len)
    }

    /// Positions cached in every row.
    pub fn row_lens(&self) -> Vec<usize> {
        self.rows.iter().map(|r| r.len).collect()
    }

    /// Bytes of key/value storage the rows hold (allocated capacity, counting a buffer shared
    /// by forked rows once per row that refers to it).
    pub fn memory_bytes(&self) -> usize {
        self.rows
            .iter()
            .flat_map(|r| r.layers.iter().flatten())
            .map(|(k, v)| (k.shape().num_elements() + v.shape().num_elements()) * k.dtype().size())
            .sum()
    }

    pub(crate) fn row(&self, row: usize) -> Result<&Row<B>> {
        self.rows.get(row).ok_or_else(|| {
            ModelError::Input(format!(
                "cache row {row} does not exist ({} rows)",
                self.rows.len()
            ))
        })
    }
}

/// Writes `values` `[kv_heads, n, head_dim]` at position `start` of `buffer`
/// `[kv_heads, capacity, head_dim]`, in place where the backend can.
fn write<B: ModelBackend>(
    buffer: Tensor<B, 3>,
    start: usize,
    values: Tensor<B, 3>,
) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(B::kv_write(
        buffer.into_primitive().tensor(),
        start,
        values.into_primitive().tensor(),
    )))
}

impl<B: ModelBackend> KvCache<B> {
    /// Writes `k`, `v` (`[kv_heads, n, head_dim]`) after the positions row `row` holds in
    /// `layer`, and returns all its keys and values so far (`[kv_heads, len + n, head_dim]`).
    /// The row's length advances when the last layer is written.
    ///
    /// # Panics
    /// If `row` does not exist (the model checks rows when it builds a step).
    pub fn append(
        &mut self,
        layer: usize,
        row: usize,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let block = self.block;
        let last_layer = layer + 1 == self.num_layers;
        let slot = &mut self.rows[row];
        let [kvh, n, d] = k.dims();
        let len = slot.len;
        let end = len + n;
        let (kb, vb) = match slot.layers[layer].take() {
            Some((kb, vb)) if kb.dims()[1] >= end => (kb, vb),
            previous => {
                // Grow to the next whole block, keeping what is cached.
                let capacity = end.div_ceil(block) * block;
                let device = k.device();
                let mut kb = Tensor::zeros([kvh, capacity, d], &device);
                let mut vb = Tensor::zeros([kvh, capacity, d], &device);
                if let Some((pk, pv)) = previous
                    && len > 0
                {
                    kb = write(kb, 0, pk.narrow(1, 0, len));
                    vb = write(vb, 0, pv.narrow(1, 0, len));
                }
                (kb, vb)
            }
        };
        let kb = write(kb, len, k);
        let vb = write(vb, len, v);
        let out = (kb.clone().narrow(1, 0, end), vb.clone().narrow(1, 0, end));
        slot.layers[layer] = Some((kb, vb));
        if last_layer {
            slot.len = end;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Cpu;

    fn kv(values: &[f32], n: usize) -> Tensor<Cpu, 3> {
        Tensor::<Cpu, 1>::from_floats(values, &Default::default()).reshape([1, n, values.len() / n])
    }

    #[test]
    fn rows_grow_by_blocks_and_keep_their_contents() {
        let mut cache = KvCache::<Cpu>::with_block(1, 2);
        let r = cache.add_row();
        let (k, _) = cache.append(0, r, kv(&[1.0, 2.0], 1), kv(&[3.0, 4.0], 1));
        assert_eq!(k.dims(), [1, 1, 2]);
        let (k, v) = cache.append(0, r, kv(&[5.0, 6.0, 7.0, 8.0], 2), kv(&[0.0; 4], 2));
        assert_eq!(
            k.into_data().to_vec::<f32>().unwrap(),
            vec![1.0, 2.0, 5.0, 6.0, 7.0, 8.0]
        );
        assert_eq!(v.dims(), [1, 3, 2]);
        assert_eq!(cache.row_len(r).unwrap(), 3);
        // capacity 4 (two blocks of 2) for keys and values, 2 floats each position
        assert_eq!(cache.memory_bytes(), 2 * 4 * 2 * 4);
    }

    #[test]
    fn forks_are_independent_and_retain_reorders() {
        let mut cache = KvCache::<Cpu>::with_block(1, 4);
        let a = cache.add_row();
        cache.append(0, a, kv(&[1.0], 1), kv(&[1.0], 1));
        let b = cache.fork_row(a).unwrap();
        cache.append(0, a, kv(&[2.0], 1), kv(&[2.0], 1));
        let (kb, _) = cache.append(0, b, kv(&[9.0], 1), kv(&[9.0], 1));
        assert_eq!(kb.into_data().to_vec::<f32>().unwrap(), vec![1.0, 9.0]);
        cache.retain_rows(&[b]).unwrap();
        assert_eq!(cache.num_rows(), 1);
        let (k, _) = cache.append(0, 0, kv(&[3.0], 1), kv(&[3.0], 1));
        assert_eq!(k.into_data().to_vec::<f32>().unwrap(), vec![1.0, 9.0, 3.0]);
        cache.release_row(0).unwrap();
        assert_eq!(cache.row_len(0).unwrap(), 0);
        assert_eq!(cache.memory_bytes(), 0);
        cache.retain_rows(&[]).unwrap();
        assert_eq!(cache.num_rows(), 0);
        assert_eq!(cache.memory_bytes(), 0);
        assert!(cache.fork_row(0).is_err());
    }
}
