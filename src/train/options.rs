//! What decides a training run's numbers ([`TrainOptions`], recorded in every
//! checkpoint) and the checks that refuse bad values before anything runs.

use serde::{Deserialize, Serialize};

use super::optim::{AdamWConfig, LrSchedule};
use crate::error::{Error, Result};

/// Everything that decides a run's numbers; recorded in every checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainOptions {
    pub steps: u64,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub seq_len: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Global gradient-norm bound; 0 = no clipping.
    pub clip_grad: f64,
    pub seed: u64,
    /// Tensor-name globs of what trains (`*` = everything), or the single word `new`
    /// (the tokens appended by the last growth); the rest stays frozen.
    pub train: Vec<String>,
    /// In-run growth: after step `.0`, grow to the target `.1` (`ffn=1024,qkv=256`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grow_at: Vec<(u64, String)>,
    /// Classifiers' training augmentation (timm's `--scale` and `--hflip`).
    #[serde(default, skip_serializing_if = "Augment::is_default")]
    pub augment: Augment,
}

/// The random-resized crop's area range and the horizontal-flip probability.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Augment {
    pub scale: (f64, f64),
    pub hflip: f64,
}

impl Default for Augment {
    /// timm's defaults.
    fn default() -> Self {
        Self {
            scale: (0.08, 1.0),
            hflip: 0.5,
        }
    }
}

impl Augment {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

impl TrainOptions {
    pub fn schedule(&self) -> LrSchedule {
        LrSchedule {
            lr: self.lr,
            min_lr: self.min_lr,
            warmup: self.warmup_steps,
            total: self.steps,
        }
    }

    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }

    /// Checks what would otherwise fail late or silently.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::input(m));
        for (name, zero) in [
            ("steps", self.steps == 0),
            ("batch_size", self.batch_size == 0),
            ("grad_accum", self.grad_accum == 0),
            ("seq_len", self.seq_len == 0),
        ] {
            if zero {
                return Err(Error::option(name, "must be positive"));
            }
        }
        for (name, v) in [("lr", self.lr), ("min_lr", self.min_lr), ("eps", self.eps)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::option(
                    name,
                    format!("must be a non-negative number, got {v}"),
                ));
            }
        }
        let (s0, s1) = self.augment.scale;
        if !(0.0 < s0 && s0 <= s1 && s1 <= 1.0) {
            return bad(format!(
                "the crop scale range must satisfy 0 < min <= max <= 1, got {s0},{s1}"
            ));
        }
        if !(0.0..=1.0).contains(&self.augment.hflip) {
            return bad(format!(
                "the flip probability must be in [0, 1], got {}",
                self.augment.hflip
            ));
        }
        if self.min_lr > self.lr {
            return Err(Error::option(
                "min_lr",
                format!(
                    "{} is above the peak learning rate {}",
                    self.min_lr, self.lr
                ),
            ));
        }
        for (name, b) in [("first", self.beta1), ("second", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(format!("the {name} beta must be in [0, 1), got {b}"));
            }
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(Error::option(
                "weight_decay",
                format!("must be non-negative, got {}", self.weight_decay),
            ));
        }
        if !(self.clip_grad.is_finite() && self.clip_grad >= 0.0) {
            return Err(Error::option(
                "clip_grad",
                format!("must be non-negative, got {}", self.clip_grad),
            ));
        }
        if self.train.is_empty() {
            return Err(Error::option("train", "selects nothing"));
        }
        for (step, spec) in &self.grow_at {
            if *step == 0 || *step >= self.steps {
                return Err(Error::option(
                    "grow_at",
                    format!(
                        "{step}:{spec}: the step must be between 1 and {} (steps - 1)",
                        self.steps.saturating_sub(1)
                    ),
                ));
            }
        }
        Ok(())
    }
}
