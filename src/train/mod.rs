//! Training on CPU: differentiable forwards of the language model, the classifier and
//! the merged model, one training loop for the three (AdamW with the official
//! parameter groups, the learning-rate schedule, gradient clipping, checkpoints).
//!
//! The inference path runs fused kernels that have no backward pass; the training
//! path computes the same function with candle tensor ops, which candle's autograd
//! differentiates: on the CPU its hot pieces (a whole Pattention, LayerNorm, softmax)
//! are single ops with their own backward (`fused`), elsewhere plain candle ops.
//! Both read the same canonical tensor names.

mod checkpoints;
pub mod data;
mod device_block;
pub mod distill;
mod fused;
pub(crate) use fused::layer_norm_row_f32;
pub mod lm;
pub mod loss;
pub mod optim;
pub mod options;
mod parts;
pub mod plot;
pub(crate) mod theta;
pub mod trainer;
pub mod vit;
pub mod vl;

pub use data::{Split, TokenWindows};
pub use lm::TrainableLm;
pub use optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
pub use trainer::{
    Augment, Fed, LmTrainer, Source, StepReport, TrainOptions, Trainable, Trainer, TrainerState,
};
