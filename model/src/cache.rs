//! The key/value cache, owned by the caller and passed to every forward call, so one model can
//! serve many sequences (batched rollouts, training) without hidden state.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// Cached keys and values of every layer for a batch of sequences.
///
/// Keys and values are stored before grouped-query expansion and after RoPE:
/// `[batch, num_kv_heads, cached_len, head_dim]` per layer.
#[derive(Clone, Debug)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
    len: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            len: 0,
        }
    }

    /// Number of positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends this step's keys and values for `layer` and returns everything cached for it.
    /// The cache length advances when the last layer is appended.
    pub fn append(
        &mut self,
        layer: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let step = k.dims()[2];
        let (k, v) = match self.layers[layer].take() {
            None => (k, v),
            Some((pk, pv)) => (Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2)),
        };
        self.layers[layer] = Some((k.clone(), v.clone()));
        if layer + 1 == self.layers.len() {
            self.len += step;
        }
        (k, v)
    }

    /// Keeps only the given batch rows, in the given order (to drop finished sequences).
    pub fn select_rows(&mut self, rows: &[usize]) {
        if rows.is_empty() {
            self.layers.iter_mut().for_each(|l| *l = None);
            return;
        }
        for slot in self.layers.iter_mut() {
            if let Some((k, v)) = slot.take() {
                let device = k.device();
                let idx: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
                let idx =
                    Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [rows.len()]), &device);
                *slot = Some((k.select(0, idx.clone()), v.select(0, idx)));
            }
        }
    }
}
