//! Distillation: training a TokenFormer to behave like another model (the teacher)
//! on given inputs, as `tokenformer-convert import --recover-steps` does after mapping
//! and fitting a pre-trained Transformer. The loss of a batch is
//!
//! KL(teacher ‖ student) of the output distributions (temperature 1, mean over rows)
//! + w · mean over layers of ‖h_s − h_t‖² / ‖h_t‖²,
//!
//! h the residual stream after each block. The hidden-state term is each layer's mean
//! squared error divided by the teacher's mean square there (a relative MSE), so one
//! weight `w` means the same whether a model's residual stream has norm 1 or 100, and
//! late layers (whose streams grow) do not drown out early ones.
//!
//! The student is a trainable model ([`Distillable`]: the language model or the
//! classifier, with the fused CPU training ops); the teacher is whatever computes
//! [`Targets`] (the importer runs the source checkpoint). [`distill`] runs the shared
//! [`Trainer`] (AdamW, clipping, the schedule) over a [`Distill`] wrapper, reporting
//! each step to a callback: no printing here.

use std::cell::Cell;
use std::collections::BTreeMap;

use candle_core::{DType, Tensor, Var, D};

use super::lm::TrainableLm;
use super::trainer::{StepReport, TrainOptions, Trainable, Trainer};
use super::vit::TrainableVit;
use crate::error::{Error, Result};

/// What the teacher computed for one batch: logits [rows, classes] and each layer's
/// output [b, t, d] (as many as the student has layers; none to match logits only).
#[derive(Clone, Debug)]
pub struct Targets {
    pub logits: Tensor,
    pub hidden: Vec<Tensor>,
}

/// A trainable model that gives its logits and per-layer hidden states.
pub trait Distillable: Trainable {
    /// What the model reads: token ids [b, t], or pixels [b, C, H, W].
    type Input;
    /// Logits [rows, classes] and each layer's output [b, t, d] of `input`.
    fn forward_hidden(&self, input: &Self::Input) -> candle_core::Result<(Tensor, Vec<Tensor>)>;
}

impl Distillable for TrainableLm {
    type Input = Tensor;
    fn forward_hidden(&self, ids: &Tensor) -> candle_core::Result<(Tensor, Vec<Tensor>)> {
        TrainableLm::forward_hidden(self, ids)
    }
}

impl Distillable for TrainableVit {
    type Input = Tensor;
    fn forward_hidden(&self, pixels: &Tensor) -> candle_core::Result<(Tensor, Vec<Tensor>)> {
        TrainableVit::forward_hidden(self, pixels)
    }
}

/// One micro-batch of distillation: the input and the teacher's outputs on it.
pub struct DistillBatch<I> {
    pub input: I,
    pub targets: Targets,
}

/// The two terms of a distillation loss (before the weight of the hidden term).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossParts {
    /// Mean KL(teacher ‖ student) per row, in nats.
    pub kl: f64,
    /// Mean over layers of the relative hidden-state MSE.
    pub hidden: f64,
}

/// The distillation loss (scalar) of student logits [rows, classes] and hidden states
/// against `targets`, with the terms' values. Plain candle ops, so autograd
/// differentiates it: d/ds of the KL term is (softmax(s) − softmax(t)) / rows.
pub fn distill_loss(
    logits: &Tensor,
    hidden: &[Tensor],
    targets: &Targets,
    hidden_weight: f64,
) -> Result<(Tensor, LossParts)> {
    let (rows, classes) = logits.dims2()?;
    if targets.logits.dims() != [rows, classes] {
        return Err(Error::input(format!(
            "the teacher's logits have shape {:?}, the student's [{rows}, {classes}]",
            targets.logits.dims()
        )));
    }
    let n = targets.hidden.len();
    if n > 0 && n != hidden.len() {
        return Err(Error::input(format!(
            "the teacher gives {n} hidden states, the student has {} layers",
            hidden.len()
        )));
    }
    let dtype = logits.dtype();
    let log_softmax = |x: &Tensor| -> candle_core::Result<Tensor> {
        // The row maximum only keeps exp finite; it changes nothing, so no gradient.
        let shifted = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?;
        shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(D::Minus1)?.log()?)
    };
    let ls = log_softmax(logits)?;
    let lt = log_softmax(&targets.logits.to_dtype(dtype)?.detach())?;
    let kl = ((lt.exp()? * (lt - ls)?)?.sum_all()? / rows.max(1) as f64)?;
    let scalar = |t: &Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
    let mut parts = LossParts {
        kl: scalar(&kl)?,
        hidden: 0.0,
    };
    if n == 0 || hidden_weight == 0.0 {
        return Ok((kl, parts));
    }
    let mut sum: Option<Tensor> = None;
    for (i, (s, t)) in hidden.iter().zip(&targets.hidden).enumerate() {
        if s.dims() != t.dims() {
            return Err(Error::input(format!(
                "layer {i}: the teacher's hidden state has shape {:?}, the student's {:?}",
                t.dims(),
                s.dims()
            )));
        }
        let t = t.to_dtype(dtype)?.detach();
        // The teacher's mean square: a constant of the batch.
        let ms = scalar(&t.sqr()?.mean_all()?)?.max(f64::MIN_POSITIVE);
        let mse = ((s - &t)?.sqr()?.mean_all()? / ms)?;
        sum = Some(match sum {
            Some(acc) => (acc + mse)?,
            None => mse,
        });
    }
    let rel = (sum.expect("n > 0") / n as f64)?;
    parts.hidden = scalar(&rel)?;
    Ok(((kl + (rel * hidden_weight)?)?, parts))
}

/// A student being distilled: the [`Trainable`] whose loss is [`distill_loss`], so
/// the shared [`Trainer`] steps it.
pub struct Distill<M> {
    model: M,
    hidden_weight: f64,
    /// The terms of the latest micro-batch's loss (for progress and metrics).
    last: Cell<LossParts>,
}

impl<M: Distillable> Distill<M> {
    /// `hidden_weight` must be finite and non-negative.
    pub fn new(model: M, hidden_weight: f64) -> Result<Self> {
        if !(hidden_weight.is_finite() && hidden_weight >= 0.0) {
            return Err(Error::option(
                "hidden_weight",
                format!("must be a non-negative number, got {hidden_weight}"),
            ));
        }
        Ok(Self {
            model,
            hidden_weight,
            last: Cell::new(LossParts::default()),
        })
    }

    pub fn model(&self) -> &M {
        &self.model
    }

    pub fn into_model(self) -> M {
        self.model
    }

    /// The terms of the latest training micro-batch's loss.
    pub fn last_parts(&self) -> LossParts {
        self.last.get()
    }

    /// The loss and its terms on a batch, without a backward pass (held-out data).
    pub fn evaluate(&self, batch: &DistillBatch<M::Input>) -> Result<(f64, LossParts)> {
        let (logits, hidden) = self.model.forward_hidden(&batch.input)?;
        let (loss, parts) = distill_loss(&logits, &hidden, &batch.targets, self.hidden_weight)?;
        Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, parts))
    }
}

impl<M: Distillable> Trainable for Distill<M> {
    type Batch = DistillBatch<M::Input>;

    fn params(&self) -> &BTreeMap<String, Var> {
        self.model.params()
    }

    fn loss_of(&self, batch: &Self::Batch) -> candle_core::Result<Tensor> {
        let (logits, hidden) = self.model.forward_hidden(&batch.input)?;
        let (loss, parts) = distill_loss(&logits, &hidden, &batch.targets, self.hidden_weight)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        self.last.set(parts);
        Ok(loss)
    }

    fn config_json(&self) -> String {
        self.model.config_json()
    }
}

/// Distills `model` for `opts.steps` AdamW steps on the tensors `opts.train`
/// selects, each tensor's update multiplied by its `update_scales` entry if any
/// ([`crate::train::AdamW::scale_updates`]): each micro-batch's input from `next` (with
/// the items it counts), the teacher's [`Targets`] on it from `teacher`, and `on_step`
/// told of every step (with the student as it is after it, e.g. to validate). Returns
/// the student.
pub fn distill<M: Distillable>(
    model: M,
    opts: TrainOptions,
    hidden_weight: f64,
    update_scales: BTreeMap<String, Tensor>,
    mut next: impl FnMut() -> Result<(M::Input, u64)>,
    mut teacher: impl FnMut(&M::Input) -> Result<Targets>,
    mut on_step: impl FnMut(&Distill<M>, &StepReport) -> Result<()>,
) -> Result<M> {
    let mut trainer = Trainer::new(Distill::new(model, hidden_weight)?, opts, None)?;
    for (name, scale) in update_scales {
        trainer.scale_updates(&name, scale)?;
    }
    while !trainer.done() {
        let r = trainer.step(|| {
            let (input, n) = next()?;
            let targets = teacher(&input)?;
            Ok((DistillBatch { input, targets }, n))
        })?;
        on_step(trainer.model(), &r)?;
    }
    Ok(trainer.into_model().into_model())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(v: &[f64], shape: (usize, usize)) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
    }

    fn vals(x: &Tensor) -> Vec<f64> {
        x.flatten_all().unwrap().to_vec1::<f64>().unwrap()
    }

    /// A loss of the student logits and one hidden state (both [2, 3]) in f64.
    fn loss_at(s: &[f64], h: &[f64], targets: &Targets, w: f64) -> f64 {
        let (l, _) = distill_loss(&t(s, (2, 3)), &[t(h, (2, 3))], targets, w).unwrap();
        l.to_scalar::<f64>().unwrap()
    }

    #[test]
    fn the_loss_and_its_gradient_are_the_closed_forms_and_match_finite_differences() {
        let s = [0.3, -1.2, 2.0, 0.5, 0.1, -0.4];
        let tl = [1.0, 0.0, -1.0, -0.2, 0.9, 0.4];
        let h = [1.0, 2.0, -1.0, 0.0, 0.5, 0.25];
        let th = [0.5, 2.5, -1.0, 1.0, 0.0, 0.25];
        let targets = Targets {
            logits: t(&tl, (2, 3)),
            hidden: vec![t(&th, (2, 3))],
        };
        let w = 0.7;
        // Closed forms, written out here.
        let softmax = |r: &[f64]| -> Vec<f64> {
            let z: f64 = r.iter().map(|x| x.exp()).sum();
            r.iter().map(|x| x.exp() / z).collect()
        };
        let (mut kl, mut dkl) = (0.0, vec![]);
        for r in 0..2 {
            let (p, q) = (
                softmax(&tl[r * 3..r * 3 + 3]),
                softmax(&s[r * 3..r * 3 + 3]),
            );
            kl += p.iter().zip(&q).map(|(p, q)| p * (p / q).ln()).sum::<f64>() / 2.0;
            dkl.extend(p.iter().zip(&q).map(|(p, q)| (q - p) / 2.0));
        }
        let ms = th.iter().map(|x| x * x).sum::<f64>() / 6.0;
        let mse = h.iter().zip(&th).map(|(a, b)| (a - b).powi(2)).sum::<f64>() / 6.0 / ms;
        let dh: Vec<f64> = h
            .iter()
            .zip(&th)
            .map(|(a, b)| w * 2.0 * (a - b) / 6.0 / ms)
            .collect();

        let sv = Var::from_tensor(&t(&s, (2, 3))).unwrap();
        let hv = Var::from_tensor(&t(&h, (2, 3))).unwrap();
        let (loss, parts) =
            distill_loss(sv.as_tensor(), &[hv.as_tensor().clone()], &targets, w).unwrap();
        assert!((parts.kl - kl).abs() < 1e-12, "{parts:?} vs {kl}");
        assert!((parts.hidden - mse).abs() < 1e-12, "{parts:?} vs {mse}");
        let total = loss.to_scalar::<f64>().unwrap();
        assert!((total - (kl + w * mse)).abs() < 1e-12);
        let grads = loss.backward().unwrap();
        let (gs, gh) = (
            vals(grads.get(sv.as_tensor()).unwrap()),
            vals(grads.get(hv.as_tensor()).unwrap()),
        );
        for (g, want) in gs.iter().zip(&dkl).chain(gh.iter().zip(&dh)) {
            assert!((g - want).abs() < 1e-12, "{gs:?} {gh:?} vs {dkl:?} {dh:?}");
        }
        // Central differences of the loss itself agree with the backward pass.
        let eps = 1e-6;
        for i in 0..6 {
            let (mut up, mut down) = (s, s);
            up[i] += eps;
            down[i] -= eps;
            let fd =
                (loss_at(&up, &h, &targets, w) - loss_at(&down, &h, &targets, w)) / (2.0 * eps);
            assert!((fd - gs[i]).abs() < 1e-8, "logit {i}: {fd} vs {}", gs[i]);
            let (mut up, mut down) = (h, h);
            up[i] += eps;
            down[i] -= eps;
            let fd =
                (loss_at(&s, &up, &targets, w) - loss_at(&s, &down, &targets, w)) / (2.0 * eps);
            assert!((fd - gh[i]).abs() < 1e-8, "hidden {i}: {fd} vs {}", gh[i]);
        }
        // A student equal to its teacher has zero loss.
        assert!(loss_at(&tl, &th, &targets, w).abs() < 1e-12);
    }

    #[test]
    fn mismatched_targets_are_refused_by_shape() {
        let targets = Targets {
            logits: t(&[0.0; 4], (2, 2)),
            hidden: vec![],
        };
        let err = distill_loss(&t(&[0.0; 6], (2, 3)), &[], &targets, 1.0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("[2, 2]") && err.contains("[2, 3]"), "{err}");
        let targets = Targets {
            logits: t(&[0.0; 6], (2, 3)),
            hidden: vec![t(&[0.0; 6], (2, 3))],
        };
        let err = distill_loss(&t(&[0.0; 6], (2, 3)), &[], &targets, 1.0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("1 hidden states") && err.contains("0 layers"),
            "{err}"
        );
    }
}
