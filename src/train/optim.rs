//! AdamW as PyTorch's `torch.optim.AdamW` computes it (decoupled weight decay, bias
//! correction), with the official parameter groups (weight decay on matrices only),
//! global-norm gradient clipping as `torch.nn.utils.clip_grad_norm_`, and linear
//! warm-up then cosine decay to a minimum learning rate.
//!
//! candle-nn's `AdamW` applies one weight decay to every variable and keeps its moments
//! private; training here needs per-tensor decay, and moments that survive a checkpoint
//! and a growth step (old tokens keep theirs, appended tokens start at zero).

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

/// Hyper-parameters of [`AdamW`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// The official TokenFormer configs: betas (0.9, 0.95), eps 1e-8, weight decay 0.1.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// First and second moments of one variable.
#[derive(Clone, Debug)]
pub struct Moments {
    pub m: Tensor,
    pub v: Tensor,
}

/// AdamW over named variables; only the names given are updated.
pub struct AdamW {
    cfg: AdamWConfig,
    vars: BTreeMap<String, Var>,
    moments: BTreeMap<String, Moments>,
    /// Leading rows that stay as they are (the old tokens of a grown tensor).
    frozen_rows: BTreeMap<String, usize>,
    step: u64,
}

impl AdamW {
    /// Optimises `vars` (name → variable), moments starting at zero.
    pub fn new(vars: BTreeMap<String, Var>, cfg: AdamWConfig) -> Result<Self> {
        let moments = vars
            .iter()
            .map(|(k, v)| {
                let z = v.as_tensor().zeros_like()?;
                Ok((k.clone(), Moments { m: z.clone(), v: z }))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            cfg,
            vars,
            moments,
            frozen_rows: BTreeMap::new(),
            step: 0,
        })
    }

    /// Keeps the first `rows` rows of `name` bit for bit: only the rows after them are
    /// updated (and decayed), and only their moments change.
    pub fn freeze_rows(&mut self, name: &str, rows: usize) {
        self.frozen_rows.insert(name.to_string(), rows);
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Steps taken (the bias-correction count).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The moments by variable name (for checkpoints).
    pub fn moments(&self) -> &BTreeMap<String, Moments> {
        &self.moments
    }

    /// Restores a checkpoint's moments and step count. Each given moment must match its
    /// variable's shape, except that a variable grown along its first axis (appended
    /// parameter tokens) keeps the old rows and starts the new ones at zero.
    pub fn restore(&mut self, step: u64, moments: BTreeMap<String, Moments>) -> Result<()> {
        for (name, saved) in moments {
            let Some(var) = self.vars.get(&name) else {
                continue; // frozen in this run
            };
            let shape = var.as_tensor().dims().to_vec();
            let grown = |t: &Tensor| -> Result<Tensor> {
                let old = t.dims();
                if old == shape.as_slice() {
                    return Ok(t.clone());
                }
                if old.len() == shape.len() && old[1..] == shape[1..] && old[0] < shape[0] {
                    let mut pad = shape.clone();
                    pad[0] -= old[0];
                    let zeros = Tensor::zeros(pad, t.dtype(), t.device())?;
                    return Tensor::cat(&[t, &zeros], 0);
                }
                candle_core::bail!(
                    "optimiser state of `{name}` has shape {old:?}, the tensor {shape:?}"
                )
            };
            let m = grown(&saved.m)?.to_dtype(var.dtype())?;
            let v = grown(&saved.v)?.to_dtype(var.dtype())?;
            self.moments.insert(name, Moments { m, v });
        }
        self.step = step;
        Ok(())
    }

    /// One AdamW step at learning rate `lr` with the gradients in `grads`. Weight decay
    /// applies to variables of two or more dimensions only.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.step += 1;
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.cfg;
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
        for (name, var) in &self.vars {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let mom = self.moments.get_mut(name).expect("one moment per variable");
            let full = var.as_tensor();
            let r0 = self.frozen_rows.get(name).copied().unwrap_or(0);
            let n = full.dim(0).unwrap_or(0);
            // The trainable rows only (all of them when nothing is frozen).
            let rows = |t: &Tensor| -> Result<Tensor> {
                if r0 == 0 {
                    Ok(t.clone())
                } else {
                    t.narrow(0, r0, n - r0)
                }
            };
            // Detached: a gradient can carry its graph, and moments that kept it would
            // chain every step's activations to the next (memory growing without bound).
            let (g, theta) = (rows(&g.detach())?, rows(&full.detach())?);
            let m = ((rows(&mom.m)? * beta1)? + (&g * (1.0 - beta1))?)?.detach();
            let v = ((rows(&mom.v)? * beta2)? + (g.sqr()? * (1.0 - beta2))?)?.detach();
            let decay = if full.rank() >= 2 { weight_decay } else { 0.0 };
            let decayed = (&theta * (1.0 - lr * decay))?;
            // torch: θ -= lr/bc1 · m / (√v / √bc2 + eps)
            let denom = ((v.sqrt()? / bc2.sqrt())? + eps)?;
            let update = ((&m / denom)? * (lr / bc1))?;
            let new = (decayed - update)?;
            if r0 == 0 {
                var.set(&new)?;
                *mom = Moments { m, v };
            } else {
                let keep =
                    |t: &Tensor, tail: &Tensor| Tensor::cat(&[&t.narrow(0, 0, r0)?, tail], 0);
                var.set(&keep(full, &new)?)?;
                *mom = Moments {
                    m: keep(&mom.m, &m)?,
                    v: keep(&mom.v, &v)?,
                };
            }
        }
        Ok(())
    }
}

/// Scales the gradients of `vars` so their global L2 norm is at most `max_norm`
/// (`max_norm` ≤ 0: no clipping), as `clip_grad_norm_` does (coefficient
/// max_norm / (norm + 1e-6), applied only when below 1). Returns the norm before.
pub fn clip_grad_norm<'a>(
    grads: &mut GradStore,
    vars: impl IntoIterator<Item = &'a Var> + Clone,
    max_norm: f64,
) -> Result<f64> {
    let mut sq = 0f64;
    for v in vars.clone() {
        if let Some(g) = grads.get(v.as_tensor()) {
            // In f64: an f32 sum over a large embedding gradient drifts by ~1e-5.
            sq += g
                .to_dtype(candle_core::DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
    }
    let norm = sq.sqrt();
    let coef = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coef < 1.0 {
        for v in vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                let scaled = (g * coef)?;
                grads.insert(v.as_tensor(), scaled);
            }
        }
    }
    Ok(norm)
}

/// Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to `min_lr`
/// at `total` steps (constant after), as GPT-NeoX's `cosine` schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    pub total: u64,
}

impl LrSchedule {
    /// The learning rate of step `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        if self.warmup > 0 && step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup.min(step)) as f64 / span).min(1.0);
        self.min_lr
            + (self.lr - self.min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}
