//! The optimiser side of a training step: AdamW over the trainable parameters, gradient
//! clipping by the global norm across all of them, and the learning-rate schedule.
//!
//! - **Trainable parameters only.** burn optimisers step the `Param`s that have a gradient. In
//!   `fathom-model` the base weights, biases, norms and embeddings are frozen `Param`s (no
//!   gradient; `model/src/linear.rs`), so with LoRA attached the optimiser — and its state, and
//!   the global norm below — sees exactly the adapters' `lora_a` / `lora_b`; under full
//!   fine-tuning (`Qwen2ForCausalLM::into_full_tuning`) it sees every weight.
//!   [`trainable_params`] lists the parameters that require gradients.
//! - **Global-norm clipping.** burn's `GradientClipping::Norm` clips each tensor on its own.
//!   [`clip_global_norm`] instead computes `‖g‖ = sqrt(Σ_p ‖g_p‖²)` over every parameter the
//!   module visits and, when it exceeds the limit, multiplies every gradient by the same
//!   `max_norm / ‖g‖` (as PyTorch's `clip_grad_norm_`, without its 1e-6 in the denominator).
//! - **Schedule.** [`Schedule::lr`] is a linear warm-up from `lr / warmup_steps` to `lr`, then
//!   constant, linear or cosine decay to `final_fraction · lr` at the last step.

use std::collections::BTreeMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use serde::{Deserialize, Serialize};

/// AdamW hyper-parameters (a recipe's `optimizer` section).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamWSettings {
    /// Peak learning rate (> 0).
    pub lr: f64,
    /// Decoupled weight decay (≥ 0).
    pub weight_decay: f64,
    /// `(β₁, β₂)`, each in `[0, 1)`.
    pub betas: (f64, f64),
    /// The denominator's ε (> 0).
    pub eps: f64,
    /// Clip gradients to this global norm (> 0); `None` for no clipping.
    pub grad_clip: Option<f64>,
}

impl AdamWSettings {
    /// Checks the values; the error names the offending field (relative to this section).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(("lr", format!("must be a positive number, got {}", self.lr)));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err((
                "weight_decay",
                format!("must be ≥ 0, got {}", self.weight_decay),
            ));
        }
        let (b1, b2) = self.betas;
        for b in [b1, b2] {
            if !(0.0..1.0).contains(&b) {
                return Err(("betas", format!("each must be in [0, 1), got ({b1}, {b2})")));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(("eps", format!("must be positive, got {}", self.eps)));
        }
        if let Some(c) = self.grad_clip
            && !(c.is_finite() && c > 0.0)
        {
            return Err(("grad_clip", format!("must be positive, got {c}")));
        }
        Ok(())
    }

    /// A burn AdamW optimiser with these settings and no per-tensor clipping (clip with
    /// [`clip_global_norm`] before stepping). The learning rate is passed at each step.
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(&self) -> OptimizerAdaptor<AdamW, M, B> {
        AdamWConfig::new()
            .with_beta_1(self.betas.0 as f32)
            .with_beta_2(self.betas.1 as f32)
            .with_epsilon(self.eps as f32)
            .with_weight_decay(self.weight_decay as f32)
            .init()
    }
}

/// How the learning rate decays after the warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Decay {
    /// Stays at the peak.
    Constant,
    /// Linearly from the peak to `final_fraction · lr` at the last step.
    Linear {
        /// The last step's learning rate as a fraction of the peak, in `[0, 1]`.
        final_fraction: f64,
    },
    /// Half a cosine from the peak to `final_fraction · lr` at the last step.
    Cosine {
        /// The last step's learning rate as a fraction of the peak, in `[0, 1]`.
        final_fraction: f64,
    },
}

/// A learning-rate schedule (a recipe's `schedule` section).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Steps of linear warm-up (0 for none).
    pub warmup_steps: usize,
    /// What follows the warm-up.
    pub decay: Decay,
}

impl Schedule {
    /// Checks the values against the run's length; the error names the field.
    pub fn validate(&self, total_steps: usize) -> Result<(), (&'static str, String)> {
        if self.warmup_steps > total_steps {
            return Err((
                "warmup_steps",
                format!(
                    "must not exceed the number of steps ({total_steps}), got {}",
                    self.warmup_steps
                ),
            ));
        }
        match self.decay {
            Decay::Constant => Ok(()),
            Decay::Linear { final_fraction } | Decay::Cosine { final_fraction } => {
                if (0.0..=1.0).contains(&final_fraction) {
                    Ok(())
                } else {
                    Err((
                        "decay",
                        format!("final_fraction must be in [0, 1], got {final_fraction}"),
                    ))
                }
            }
        }
    }

    /// The learning rate of `step` (0-based) in a run of `total_steps`, peaking at `peak`.
    ///
    /// Warm-up: step `s < w` gets `peak · (s + 1) / w`, so the first step already moves and
    /// step `w − 1` reaches the peak. Decay runs over steps `w ..= total − 1`: the fraction
    /// `p = (s − w) / (total − 1 − w)` goes from 0 to 1, and the rate is
    /// `peak · (f + (1 − f) · shape(p))` with `shape = 1 − p` (linear) or
    /// `(1 + cos(π p)) / 2` (cosine). Steps past the end keep the last rate.
    ///
    /// ```
    /// use fathom_trainer::optim::{Decay, Schedule};
    /// let s = Schedule { warmup_steps: 2, decay: Decay::Linear { final_fraction: 0.0 } };
    /// let lrs: Vec<f64> = (0..6).map(|i| s.lr(1.0, i, 6)).collect();
    /// let want = [0.5, 1.0, 1.0, 2.0 / 3.0, 1.0 / 3.0, 0.0];
    /// assert!(lrs.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12), "{lrs:?}");
    /// ```
    pub fn lr(&self, peak: f64, step: usize, total_steps: usize) -> f64 {
        let w = self.warmup_steps;
        if step < w {
            return peak * (step + 1) as f64 / w as f64;
        }
        let final_fraction = match self.decay {
            Decay::Constant => return peak,
            Decay::Linear { final_fraction } | Decay::Cosine { final_fraction } => final_fraction,
        };
        let span = total_steps.saturating_sub(1).saturating_sub(w);
        let p = if span == 0 {
            1.0
        } else {
            ((step - w) as f64 / span as f64).min(1.0)
        };
        let shape = match self.decay {
            Decay::Linear { .. } => 1.0 - p,
            _ => (1.0 + (std::f64::consts::PI * p).cos()) / 2.0,
        };
        peak * (final_fraction + (1.0 - final_fraction) * shape)
    }
}

/// What [`clip_global_norm`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Clipping {
    /// The global gradient norm before clipping.
    pub norm: f64,
    /// The factor every gradient was multiplied by (1 when not clipped).
    pub scale: f64,
}

/// Collects the id and module path of every float parameter a module visits, in order.
struct ParamWalker {
    path: Vec<String>,
    params: Vec<(ParamId, String, Vec<usize>)>,
}

impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for ParamWalker {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        if value.is_require_grad() {
            self.params
                .push((param.id, self.path.join("."), value.dims().to_vec()));
        }
    }
}

/// One trainable parameter: its id in this process, its module path and its shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// burn's id (fresh for every process and every load; never persist it alone).
    pub id: ParamId,
    /// The module path, e.g. `model.layers.0.self_attn.q_proj.lora.lora_a`.
    pub path: String,
    /// The tensor's shape.
    pub shape: Vec<usize>,
}

/// Every float parameter of `module` that requires gradients (what an optimiser steps), with
/// its path, in visiting order. Frozen parameters, and every parameter of a module on a
/// backend without autodiff, are left out.
pub fn trainable_params<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(
    module: &M,
) -> Vec<ParamInfo> {
    let mut walker = ParamWalker {
        path: Vec::new(),
        params: Vec::new(),
    };
    module.visit(&mut walker);
    walker
        .params
        .into_iter()
        .map(|(id, path, shape)| ParamInfo { id, path, shape })
        .collect()
}

/// The paths of the trainable parameters, keyed by id (for re-keying optimiser state).
pub fn param_paths<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(
    module: &M,
) -> BTreeMap<String, ParamInfo> {
    trainable_params(module)
        .into_iter()
        .map(|p| (p.path.clone(), p))
        .collect()
}

/// Sums the squared gradients of every visited parameter (on the device, one scalar read).
struct SquaredNorm<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    total: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let sq = g.square().sum();
            self.total = Some(match self.total.take() {
                Some(t) => t + sq,
                None => sq,
            });
        }
    }
}

/// Multiplies every visited parameter's gradient by the same factor.
struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, g.mul_scalar(self.factor));
        }
    }
}

/// The global L2 norm of the gradients of every parameter of `module`:
/// `sqrt(Σ_p Σ_i g_{p,i}²)`. Parameters without a gradient count as zero.
pub fn global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
) -> f64 {
    let mut visitor = SquaredNorm::<B> { grads, total: None };
    module.visit(&mut visitor);
    visitor
        .total
        .map(|t| t.into_scalar().elem::<f64>().sqrt())
        .unwrap_or(0.0)
}

/// Clips the gradients to a global norm of at most `max_norm` (no-op with `None`), scaling
/// every parameter's gradient by the same factor. Returns the norm before clipping and the
/// factor used.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: Option<f64>,
) -> Clipping {
    let norm = global_norm::<B, M>(module, grads);
    let scale = match max_norm {
        Some(max) if norm > max => max / norm,
        _ => 1.0,
    };
    if scale != 1.0 {
        module.visit(&mut Scale {
            grads,
            factor: scale,
        });
    }
    Clipping { norm, scale }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Autodiff;
    use burn::module::Module;
    use burn::tensor::TensorData;
    use fathom_model::Cpu;

    type Ad = Autodiff<Cpu>;

    #[derive(Module, Debug)]
    struct Two<B: burn::tensor::backend::Backend> {
        a: Param<Tensor<B, 2>>,
        b: Param<Tensor<B, 1>>,
        frozen: Tensor<B, 1>,
    }

    fn model() -> Two<Ad> {
        let device = Default::default();
        Two {
            a: Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![1.0f32, -2.0, 0.5, 3.0], [2, 2]),
                &device,
            )),
            b: Param::from_tensor(Tensor::from_floats([4.0, -1.0, 2.0], &device)),
            frozen: Tensor::from_floats([10.0, 10.0, 10.0], &device),
        }
    }

    /// loss = Σ a² / 2 + Σ 3b + Σ frozen·b: grad a = a, grad b = 3 + frozen = 13 each.
    fn grads(m: &Two<Ad>) -> GradientsParams {
        let loss = m.a.val().square().sum().div_scalar(2.0)
            + m.b.val().mul_scalar(3.0).sum()
            + (m.frozen.clone() * m.b.val()).sum();
        GradientsParams::from_grads(loss.backward(), m)
    }

    fn values<const D: usize>(g: &GradientsParams, id: ParamId) -> Vec<f32> {
        g.get::<Cpu, D>(id).unwrap().into_data().to_vec().unwrap()
    }

    #[test]
    fn global_norm_matches_a_hand_computation() {
        let m = model();
        let g = grads(&m);
        // ‖(1, −2, 0.5, 3)‖² + 3 · 13² = 14.25 + 507.
        let want = (1.0f64 + 4.0 + 0.25 + 9.0 + 3.0 * 169.0).sqrt();
        let got = global_norm::<Ad, _>(&m, &g);
        assert!((got - want).abs() < 1e-5 * want, "{got} vs {want}");
    }

    #[test]
    fn only_params_are_trainable_and_paths_are_named() {
        let m = model();
        let params = trainable_params(&m);
        let paths: Vec<_> = params.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["a", "b"]);
        assert_eq!(params[0].shape, vec![2, 2]);
    }

    #[test]
    fn clipping_scales_every_gradient_by_the_same_factor() {
        let m = model();
        let mut g = grads(&m);
        let before_a = values::<2>(&g, m.a.id);
        let before_b = values::<1>(&g, m.b.id);
        let norm = global_norm::<Ad, _>(&m, &g);
        let c = clip_global_norm::<Ad, _>(&m, &mut g, Some(2.0));
        assert!((c.norm - norm).abs() < 1e-9);
        assert!((c.scale - 2.0 / norm).abs() < 1e-12);
        let after_a = values::<2>(&g, m.a.id);
        let after_b = values::<1>(&g, m.b.id);
        for (x, y) in before_a
            .iter()
            .chain(&before_b)
            .zip(after_a.iter().chain(&after_b))
        {
            assert!((*y as f64 - *x as f64 * c.scale).abs() < 1e-6, "{x} → {y}");
        }
        let clipped = global_norm::<Ad, _>(&m, &g);
        assert!((clipped - 2.0).abs() < 1e-5, "{clipped}");
        // Under the limit nothing changes.
        let c = clip_global_norm::<Ad, _>(&m, &mut g, Some(100.0));
        assert_eq!(c.scale, 1.0);
        assert_eq!(values::<2>(&g, m.a.id), after_a);
        // No limit: the norm is reported, nothing is scaled.
        let c = clip_global_norm::<Ad, _>(&m, &mut g, None);
        assert_eq!(c.scale, 1.0);
    }

    #[test]
    fn adamw_steps_only_params() {
        use burn::optim::Optimizer;
        let m = model();
        let g = grads(&m);
        let settings = AdamWSettings {
            lr: 0.1,
            weight_decay: 0.0,
            betas: (0.9, 0.999),
            eps: 1e-8,
            grad_clip: None,
        };
        let mut optim = settings.init::<Ad, Two<Ad>>();
        let frozen_before: Vec<f32> = m.frozen.clone().into_data().to_vec().unwrap();
        let stepped = optim.step(0.1, m, g);
        // Adam's first step moves each weight by lr · sign(grad).
        let a: Vec<f32> = stepped.a.val().into_data().to_vec().unwrap();
        let want = [0.9f32, -1.9, 0.4, 2.9];
        for (x, w) in a.iter().zip(want) {
            assert!((x - w).abs() < 1e-5, "{a:?}");
        }
        let frozen: Vec<f32> = stepped.frozen.into_data().to_vec().unwrap();
        assert_eq!(frozen, frozen_before);
    }

    #[test]
    fn schedule_values() {
        let total = 11;
        let warm = |decay| Schedule {
            warmup_steps: 4,
            decay,
        };
        let constant = warm(Decay::Constant);
        assert_eq!(constant.lr(2.0, 0, total), 0.5);
        assert_eq!(constant.lr(2.0, 3, total), 2.0);
        assert_eq!(constant.lr(2.0, 10, total), 2.0);
        // Linear to 0.25 of the peak over steps 4..=10 (span 6).
        let linear = warm(Decay::Linear {
            final_fraction: 0.25,
        });
        assert_eq!(linear.lr(2.0, 4, total), 2.0);
        assert!((linear.lr(2.0, 7, total) - 2.0 * (0.25 + 0.75 * 0.5)).abs() < 1e-12);
        assert!((linear.lr(2.0, 10, total) - 0.5).abs() < 1e-12);
        assert!((linear.lr(2.0, 50, total) - 0.5).abs() < 1e-12);
        // Cosine: half-way is the mean of peak and floor; the end is the floor.
        let cosine = warm(Decay::Cosine {
            final_fraction: 0.0,
        });
        assert!((cosine.lr(2.0, 7, total) - 1.0).abs() < 1e-12);
        assert!(cosine.lr(2.0, 10, total).abs() < 1e-12);
        let at5 = 2.0 * (1.0 + (std::f64::consts::PI / 6.0).cos()) / 2.0;
        assert!((cosine.lr(2.0, 5, total) - at5).abs() < 1e-12);
        // No warm-up: the first step is at the peak.
        let none = Schedule {
            warmup_steps: 0,
            decay: Decay::Constant,
        };
        assert_eq!(none.lr(3.0, 0, 5), 3.0);
        assert!(warm(Decay::Constant).validate(3).is_err());
        assert!(
            Schedule {
                warmup_steps: 0,
                decay: Decay::Cosine {
                    final_fraction: 1.5
                }
            }
            .validate(3)
            .is_err()
        );
    }
}
