//! One training forward and backward pass over packed sequences, with optional per-layer
//! activation checkpointing.
//!
//! Without checkpointing, burn's autodiff graph spans the whole model: every layer's
//! intermediates live until the backward pass (custom operations already keep them small: see
//! [`crate::backend::autodiff`]). With checkpointing, the forward pass runs on the inner
//! backend and keeps only each decoder layer's input; the backward pass then goes layer by
//! layer from the top, re-running one layer under autodiff from its saved input and
//! backpropagating the gradient that arrived from above. Only one layer's intermediates exist at
//! a time. Each layer is its own small graph, so nothing is re-entrant; the parameter gradients
//! of all layers are gathered into one [`GradientsParams`].
//!
//! LoRA dropout must be off with checkpointing: the recomputation would draw a different mask.
//!
//! Full fine-tuning ([`Qwen2ForCausalLM::into_full_tuning`]) marks every weight of a dense model
//! trainable; both paths then return gradients for all of them (with checkpointing, the
//! embedding's gradient comes from one more backward step below the first layer).

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Tensor};

use crate::backend::ModelBackend;
use crate::error::{ModelError, Result};
use crate::inputs::SharedPacking;
use crate::logprobs::{SequenceLogprobs, head_logprobs, targets_packed};
use crate::qwen2::Qwen2ForCausalLM;

/// Settings of a training pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainPass {
    /// Recompute each decoder layer in the backward pass instead of keeping its intermediates.
    pub checkpointing: bool,
    /// Positions of logits computed at a time.
    pub chunk: usize,
    /// Softmax temperature of the log-probabilities.
    pub temperature: f64,
    /// Pack consecutive sequences that begin with at least this many equal tokens (a GRPO
    /// group's prompt) with that beginning stored once ([`SharedPacking`]): its projections,
    /// MLP and output head then run once for the group. Values and gradients are those of
    /// packing every sequence whole, up to rounding. 0: every sequence is packed whole.
    pub share_prefix: usize,
}

impl Default for TrainPass {
    fn default() -> Self {
        Self {
            checkpointing: false,
            chunk: crate::qwen2::DEFAULT_LOGPROB_CHUNK,
            temperature: 1.0,
            share_prefix: 0,
        }
    }
}

/// What a training pass returns.
pub struct PassOutput<T> {
    /// The loss value.
    pub loss: f32,
    /// What the loss function returned beside the loss.
    pub aux: T,
    /// Gradients of the trainable parameters.
    pub grads: GradientsParams,
}

/// Runs the model over `seqs`, computes `loss` from their log-probabilities (a scalar tensor
/// and anything else the caller wants back), and backpropagates it.
pub fn forward_backward<B, T>(
    model: &Qwen2ForCausalLM<B>,
    seqs: &[&[u32]],
    pass: TrainPass,
    device: &B::Device,
    loss: impl FnOnce(&SequenceLogprobs<B>) -> (Tensor<B, 1>, T),
) -> Result<PassOutput<T>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
    run_pass(model, seqs, None, pass, device, loss)
}

/// [`forward_backward`] for a loss that reads only some tokens: `scored[i][t]` marks token `t`
/// of sequence `i` (one flag per token; token 0 is never predicted). Only the marked tokens'
/// log-probabilities and entropies are computed — the output head, the costliest matmul of a
/// small model, runs on their positions alone — and the other entries are 0 with no gradient.
/// Values and gradients of the marked entries equal [`forward_backward`]'s.
///
/// # Errors
/// As [`forward_backward`], and when `scored` does not match the sequences' lengths.
pub fn forward_backward_scored<B, T>(
    model: &Qwen2ForCausalLM<B>,
    seqs: &[&[u32]],
    scored: &[&[bool]],
    pass: TrainPass,
    device: &B::Device,
    loss: impl FnOnce(&SequenceLogprobs<B>) -> (Tensor<B, 1>, T),
) -> Result<PassOutput<T>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
    run_pass(model, seqs, Some(scored), pass, device, loss)
}

fn run_pass<B, T>(
    model: &Qwen2ForCausalLM<B>,
    seqs: &[&[u32]],
    scored: Option<&[&[bool]]>,
    pass: TrainPass,
    device: &B::Device,
    loss: impl FnOnce(&SequenceLogprobs<B>) -> (Tensor<B, 1>, T),
) -> Result<PassOutput<T>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
    let packing = SharedPacking::new(seqs, pass.share_prefix);
    let targets = targets_packed(seqs, &packing, scored)?;
    if !pass.checkpointing {
        let input = model.shared_input(seqs, &packing, device)?;
        let hidden = model.forward_hidden(&input, None);
        let out = head_logprobs(model, hidden, &targets, pass.temperature, pass.chunk);
        let (value, aux) = loss(&out);
        let scalar = scalar(&value)?;
        let grads = GradientsParams::from_grads(value.backward(), model);
        return Ok(PassOutput {
            loss: scalar,
            aux,
            grads,
        });
    }
    if has_dropout(model) {
        return Err(ModelError::Input(
            "activation checkpointing needs LoRA dropout 0 (a recomputed layer would draw a \
             different dropout mask)"
                .into(),
        ));
    }
    // Forward on the inner backend, keeping each layer's input.
    let inner = model.valid();
    let inner_input = inner.shared_input(seqs, &packing, device)?;
    let mut x = inner
        .model
        .embed_tokens
        .forward(inner_input.input_ids.clone());
    let mut saved = Vec::with_capacity(inner.model.layers.len());
    for (i, layer) in inner.model.layers.iter().enumerate() {
        saved.push(x.clone());
        x = layer.forward(x, &inner_input, i, None);
    }
    drop(inner);
    // The head stage under autodiff, from the last layer's output.
    let top = Tensor::<B, 2>::from_inner(x).require_grad();
    let hidden = model.model.norm.forward(top.clone());
    let out = head_logprobs(model, hidden, &targets, pass.temperature, pass.chunk);
    let (value, aux) = loss(&out);
    let scalar = scalar(&value)?;
    let mut grads_ad = value.backward();
    let mut upstream = top.grad_remove(&mut grads_ad);
    let mut grads = GradientsParams::from_grads(grads_ad, model);
    // Layer by layer from the top: re-run, backpropagate the gradient from above.
    let input = model.shared_input(seqs, &packing, device)?;
    for (i, layer) in model.model.layers.iter().enumerate().rev() {
        let Some(g) = upstream.take() else {
            break; // nothing above depends on this layer
        };
        let x =
            Tensor::<B, 2>::from_inner(saved.pop().expect("one input per layer")).require_grad();
        let y = layer.forward(x.clone(), &input, i, None);
        let surrogate = (y * Tensor::<B, 2>::from_inner(g)).sum();
        let mut layer_grads = surrogate.backward();
        upstream = x.grad_remove(&mut layer_grads);
        let from_layer = GradientsParams::from_grads(layer_grads, layer);
        layer.visit(&mut Gather {
            from: from_layer,
            into: &mut grads,
            _backend: std::marker::PhantomData::<B>,
        });
    }
    // A trainable embedding (full fine-tuning): its rows' gradient is what reached the bottom.
    let embedding = &model.model.embed_tokens;
    if let Some(g) = upstream
        && embedding.blocks.iter().any(|b| b.val().is_require_grad())
    {
        let rows = embedding.forward(input.input_ids.clone());
        let surrogate = (rows * Tensor::<B, 2>::from_inner(g)).sum();
        let from_embedding = GradientsParams::from_grads(surrogate.backward(), embedding);
        embedding.visit(&mut Gather {
            from: from_embedding,
            into: &mut grads,
            _backend: std::marker::PhantomData::<B>,
        });
    }
    Ok(PassOutput {
        loss: scalar,
        aux,
        grads,
    })
}

/// Adds the gradients `from` (of `model`'s parameters) into `into`, parameter by parameter: how
/// passes over parts of a batch add up to the gradient of the whole (a loss that is a sum over
/// sequences, run one part at a time to bound memory).
pub fn add_gradients<B: AutodiffBackend>(
    model: &Qwen2ForCausalLM<B>,
    from: GradientsParams,
    into: &mut GradientsParams,
) {
    model.visit(&mut Gather {
        from,
        into,
        _backend: std::marker::PhantomData::<B>,
    });
}

impl<B: AutodiffBackend + ModelBackend> Qwen2ForCausalLM<B> {
    /// The model with every weight trainable, for full fine-tuning: projections, biases,
    /// norms, the embedding and an untied head (a bf16 embedding is widened to f32 first).
    ///
    /// # Errors
    /// [`ModelError::Input`] when a projection is NF4 (packed 4-bit weights cannot be trained:
    /// load the base dense) or an adapter is attached (full fine-tuning replaces LoRA).
    pub fn into_full_tuning(mut self) -> Result<Self> {
        for (path, p) in self.projections() {
            if p.is_nf4() {
                return Err(ModelError::Input(format!(
                    "full fine-tuning needs a dense base, but `{path}` is NF4: 4-bit packed \
                     weights cannot be trained (load the base without quantization, or train a \
                     LoRA adapter)"
                )));
            }
            if p.lora.is_some() {
                return Err(ModelError::Input(format!(
                    "full fine-tuning trains the base itself, but `{path}` has a LoRA adapter \
                     attached"
                )));
            }
        }
        // Trained weights would leave their block copies behind.
        self.drop_block_copies();
        for block in &mut self.model.embed_tokens.blocks {
            if block.val().dtype() != DType::F32 {
                *block = crate::linear::frozen(block.val().cast(DType::F32));
            }
        }
        Ok(self.map(&mut Trainable))
    }

    /// Number of weights that receive gradients (the adapter's with LoRA, all of them under
    /// full fine-tuning).
    pub fn num_trainable(&self) -> usize {
        let mut count = CountTrainable(0);
        self.visit(&mut count);
        count.0
    }
}

/// Counts the elements of parameters that require gradients.
struct CountTrainable(usize);

impl<B: AutodiffBackend> ModuleVisitor<B> for CountTrainable {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        if value.is_require_grad() {
            self.0 += value.shape().num_elements();
        }
    }
}

/// Marks every parameter as requiring gradients.
struct Trainable;

impl<B: AutodiffBackend> ModuleMapper<B> for Trainable {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(id, tensor.detach().require_grad(), mapper)
    }
}

fn scalar<B: burn::tensor::backend::Backend>(value: &Tensor<B, 1>) -> Result<f32> {
    let v: f32 = value.clone().into_scalar().elem();
    if !v.is_finite() {
        return Err(ModelError::Input(format!("the loss is not finite ({v})")));
    }
    Ok(v)
}

/// Whether any adapter of the model has dropout.
fn has_dropout<B: ModelBackend>(model: &Qwen2ForCausalLM<B>) -> bool {
    model
        .projections()
        .iter()
        .any(|(_, p)| p.lora.as_ref().is_some_and(|l| l.dropout.prob > 0.0))
}

/// Moves a module's parameter gradients from one [`GradientsParams`] to another, adding them
/// to any gradient the parameter already has there.
struct Gather<'a, B> {
    from: GradientsParams,
    into: &'a mut GradientsParams,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        move_grad::<B, D>(&mut self.from, self.into, param.id);
    }
}

fn move_grad<B: AutodiffBackend, const D: usize>(
    from: &mut GradientsParams,
    into: &mut GradientsParams,
    id: ParamId,
) {
    if let Some(g) = from.remove::<B::InnerBackend, D>(id) {
        // A tied embedding has a gradient from the head already: the two add up.
        let g = match into.remove::<B::InnerBackend, D>(id) {
            Some(earlier) => earlier + g,
            None => g,
        };
        into.register::<B::InnerBackend, D>(id, g);
    }
}
