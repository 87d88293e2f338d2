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
    /// Per-variable factors of the update, broadcast to its shape (a diagonal
    /// preconditioner, e.g. one per parameter token).
    update_scales: BTreeMap<String, Tensor>,
    step: u64,
}

impl AdamW {
    /// Optimises `vars` (name → variable), moments starting at zero.
    pub fn new(vars: BTreeMap<String, Var>, cfg: AdamWConfig) -> Result<Self> {
        let moments = vars
            .iter()
            .map(|(k, v)| {
                // Two allocations: the step updates each moment in place.
                let z = || v.as_tensor().zeros_like();
                Ok((k.clone(), Moments { m: z()?, v: z()? }))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            cfg,
            vars,
            moments,
            frozen_rows: BTreeMap::new(),
            update_scales: BTreeMap::new(),
            step: 0,
        })
    }

    /// Keeps the first `rows` rows of `name` bit for bit: only the rows after them are
    /// updated (and decayed), and only their moments change.
    pub fn freeze_rows(&mut self, name: &str, rows: usize) {
        self.frozen_rows.insert(name.to_string(), rows);
    }

    /// Multiplies `name`'s update (not its decay) by `scale`, broadcast to its shape
    /// (e.g. [rows, 1]: one factor per parameter token). Adam's update is about `lr` per
    /// element whatever the element's scale; where a tensor's rows differ by orders of
    /// magnitude in how much they move the output (an imported Pattention's anchor and
    /// bias tokens), a factor per row gives each the step its scale needs.
    pub fn scale_updates(&mut self, name: &str, scale: Tensor) -> Result<()> {
        let Some(var) = self.vars.get(name) else {
            candle_core::bail!("`{name}` is not optimised")
        };
        scale.broadcast_as(var.dims())?;
        self.update_scales.insert(name.to_string(), scale);
        Ok(())
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
            // Copies of their own on the tensor's device (a run saved on one
            // device resumes on another): the step updates moments in place.
            let own = |t: Tensor| -> Result<Tensor> {
                let t = t.to_dtype(var.dtype())?;
                if t.device().same_device(var.device()) {
                    t.copy()
                } else {
                    t.to_device(var.device())
                }
            };
            let m = own(grown(&saved.m)?)?;
            let v = own(grown(&saved.v)?)?;
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
        // The tensors stepped in place, all at once at the end (in parallel).
        let mut in_place = Vec::new();
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
            let decay = if full.rank() >= 2 { weight_decay } else { 0.0 };
            let update = Update {
                beta1,
                beta2,
                lr,
                decay,
                bc1,
                bc2,
                eps,
                from: r0 * full.elem_count() / n.max(1),
            };
            let scale = self.update_scales.get(name);
            if scale.is_none() && in_place::serves_all(full, &mom.m, &mom.v, g) {
                in_place.push(in_place::Job {
                    theta: full.clone(),
                    m: mom.m.clone(),
                    v: mom.v.clone(),
                    g: g.clone(),
                    update,
                });
                continue;
            }
            // Detached: a gradient can carry its graph, and moments that kept it would
            // chain every step's activations to the next (memory growing without bound).
            let (g, theta) = (rows(&g.detach())?, rows(&full.detach())?);
            let m = ((rows(&mom.m)? * beta1)? + (&g * (1.0 - beta1))?)?.detach();
            let v = ((rows(&mom.v)? * beta2)? + (g.sqr()? * (1.0 - beta2))?)?.detach();
            let decayed = (&theta * (1.0 - lr * decay))?;
            // torch: θ -= lr/bc1 · m / (√v / √bc2 + eps)
            let denom = ((v.sqrt()? / bc2.sqrt())? + eps)?;
            let mut update = ((&m / denom)? * (lr / bc1))?;
            if let Some(scale) = scale {
                let scale = scale.broadcast_as(full.dims())?.to_dtype(full.dtype())?;
                update = (update * rows(&scale)?)?;
            }
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
        in_place::step_all(&in_place)
    }
}

/// One variable's AdamW step: everything [`in_place::step`] needs besides the tensors.
struct Update {
    beta1: f64,
    beta2: f64,
    lr: f64,
    decay: f64,
    bc1: f64,
    bc2: f64,
    eps: f64,
    /// The first element updated (the frozen rows' elements before it stay).
    from: usize,
}

mod in_place;

/// Scales the gradients of `vars` so their global L2 norm is at most `max_norm`
/// (`max_norm` ≤ 0: no clipping), as `clip_grad_norm_` does (coefficient
/// max_norm / (norm + 1e-6), applied only when below 1). Returns the norm before.
pub fn clip_grad_norm<'a>(
    grads: &mut GradStore,
    vars: impl IntoIterator<Item = &'a Var> + Clone,
    max_norm: f64,
) -> Result<f64> {
    let (vars, owned): (Vec<&Var>, Vec<Tensor>) = vars
        .into_iter()
        .filter_map(|v| grads.get(v.as_tensor()).map(|g| (v, g.clone())))
        .unzip();
    let gs: Vec<&Tensor> = owned.iter().collect();
    let norm = match in_place::sum_sq_all(&gs)? {
        Some(sq) => sq.sqrt(),
        None => {
            // In f64 (an f32 sum over a large embedding gradient drifts by ~1e-5), the
            // per-tensor sums added where they are, in order: on a GPU one transfer and
            // one wait, not one per tensor.
            let mut sq: Option<Tensor> = None;
            for g in &gs {
                let s = g.to_dtype(candle_core::DType::F64)?.sqr()?.sum_all()?;
                sq = Some(match sq {
                    Some(acc) => (acc + s)?,
                    None => s,
                });
            }
            sq.map_or(Ok(0.0), |s| s.to_scalar::<f64>())?.sqrt()
        }
    };
    let coef = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coef < 1.0 {
        let scaled = match in_place::scaled_all(&gs, coef)? {
            Some(scaled) => scaled,
            None => gs.iter().map(|&g| g * coef).collect::<Result<Vec<_>>>()?,
        };
        for (v, g) in vars.iter().zip(scaled) {
            grads.insert(v.as_tensor(), g);
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The tests' hyper-parameters: torch's betas and eps, weight decay 0.1.
    fn decayed() -> AdamWConfig {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }

    /// Three in-place steps (one of them with the first row frozen) against torch's
    /// AdamW written out per element in f64, for a matrix (decayed) and a vector (not).
    #[test]
    fn in_place_steps_follow_torchs_adamw_per_element() {
        let (dev, cfg) = (Device::Cpu, decayed());
        let init =
            |n: usize, s: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 - 2.5) * s).collect() };
        let w = Var::from_tensor(&Tensor::from_vec(init(6, 0.3), (3, 2), &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::from_vec(init(2, 0.5), 2, &dev).unwrap()).unwrap();
        let vars: BTreeMap<String, Var> =
            [("w".to_string(), w.clone()), ("b".to_string(), b.clone())].into();
        let mut opt = AdamW::new(vars, cfg).unwrap();
        // (θ, m, v, decay) per tensor.
        type Expected = (Vec<f64>, Vec<f64>, Vec<f64>, f64);
        let mut want: Vec<Expected> = vec![
            (init(6, 0.3), vec![0.0; 6], vec![0.0; 6], cfg.weight_decay),
            (init(2, 0.5), vec![0.0; 2], vec![0.0; 2], 0.0),
        ];
        let now = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let mut kept = None;
        for step in 1..=3 {
            let lr = 0.01 * step as f64;
            let frozen = if step == 3 { 1 } else { 0 };
            if step == 3 {
                opt.freeze_rows("w", 1);
                kept = Some((now(w.as_tensor()), now(&opt.moments()["w"].m)));
            }
            let grads: Vec<Vec<f64>> = want
                .iter()
                .map(|(t, ..)| t.iter().map(|x| x * x - 0.2 * step as f64).collect())
                .collect();
            let loss = ((w.as_tensor()
                * Tensor::from_vec(grads[0].clone(), (3, 2), &dev).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
                + (b.as_tensor() * Tensor::from_vec(grads[1].clone(), 2, &dev).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap())
            .unwrap();
            opt.step(&loss.backward().unwrap(), lr).unwrap();
            let (bc1, bc2) = (1.0 - 0.9f64.powi(step), 1.0 - 0.95f64.powi(step));
            for (k, ((t, m, v, decay), g)) in want.iter_mut().zip(&grads).enumerate() {
                let first = if k == 0 { 2 * frozen } else { 0 };
                for i in first..t.len() {
                    m[i] = 0.9 * m[i] + 0.1 * g[i];
                    v[i] = 0.95 * v[i] + 0.05 * g[i] * g[i];
                    t[i] = t[i] * (1.0 - lr * *decay)
                        - lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + 1e-8);
                }
            }
            for (var, (t, ..)) in [&w, &b].into_iter().zip(&want) {
                let got: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                for (g, e) in got.iter().zip(t) {
                    assert!((g - e).abs() < 1e-14, "step {step}: {got:?} vs {t:?}");
                }
            }
        }
        // The frozen row kept its values and moments of step 2 bit for bit.
        let (theta, m) = kept.expect("set at step 3");
        assert_eq!(now(w.as_tensor())[..2], theta[..2]);
        assert_eq!(now(&opt.moments()["w"].m)[..2], m[..2]);
        assert_ne!(now(w.as_tensor())[2..], theta[2..]);
    }

    /// The f32 passes (the clipping norm and scaling, the moments, the update) over a
    /// tensor of several of their parallel chunks, rows frozen at its start: each
    /// element as the formulas give it in f32, to the bit.
    #[test]
    fn f32_passes_over_many_chunks_follow_the_formulas_per_element() {
        let (dev, cfg) = (Device::Cpu, decayed());
        let (rows, cols, frozen) = (10_007, 7, 3);
        let n = rows * cols;
        let wave = |i: usize, a: f32, b: f32| (i as f32 * a).sin() * b;
        let theta0: Vec<f32> = (0..n).map(|i| wave(i, 0.37, 0.5)).collect();
        let g: Vec<f32> = (0..n).map(|i| wave(i, 1.13, 0.02)).collect();
        let w = Var::from_tensor(&Tensor::from_vec(theta0.clone(), (rows, cols), &dev).unwrap())
            .unwrap();
        let mut opt = AdamW::new([("w".to_string(), w.clone())].into(), cfg).unwrap();
        opt.freeze_rows("w", frozen);
        let loss = (w.as_tensor() * Tensor::from_vec(g.clone(), (rows, cols), &dev).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let mut grads = loss.backward().unwrap();
        let norm = clip_grad_norm(&mut grads, [&w], 0.5).unwrap();
        let want_norm = g.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        assert!(
            (norm / want_norm - 1.0).abs() < 1e-12,
            "{norm} vs {want_norm}"
        );
        let lr = 1e-3;
        opt.step(&grads, lr).unwrap();

        let c = (0.5 / (norm + 1e-6)) as f32;
        let (b1, c1, b2, c2) = (
            0.9f32,
            (1.0 - 0.9f64) as f32,
            0.95f32,
            (1.0 - 0.95f64) as f32,
        );
        let keep = (1.0 - lr * cfg.weight_decay) as f32;
        let (sbc2, eps, step) = (
            (1.0 - 0.95f64).sqrt() as f32,
            1e-8f64 as f32,
            (lr / (1.0 - 0.9f64)) as f32,
        );
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (theta, m, v) = (
            flat(w.as_tensor()),
            flat(&opt.moments()["w"].m),
            flat(&opt.moments()["w"].v),
        );
        for i in 0..n {
            if i < frozen * cols {
                assert_eq!((theta[i], m[i], v[i]), (theta0[i], 0.0, 0.0), "{i}");
                continue;
            }
            let gc = g[i] * c;
            let mi = 0.0 * b1 + gc * c1;
            let vi = 0.0 * b2 + gc * gc * c2;
            let ti = theta0[i] * keep - mi / (vi.sqrt() / sbc2 + eps) * step;
            assert_eq!((theta[i], m[i], v[i]), (ti, mi, vi), "element {i}");
        }
    }
}
