//! The training loop every architecture shares ([`Trainer`] over a [`Trainable`]
//! model, fed by a [`Source`] of micro-batches in [`Fed`]): gradient accumulation,
//! clipping, AdamW on the selected tensors, the schedule, in-run growth, and
//! checkpoints that a later run resumes exactly (written and read back
//! by `checkpoints.rs`); and the language model's trainer.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::data::TokenWindows;
use super::lm::TrainableLm;
use super::optim::{clip_grad_norm, AdamW, AdamWConfig, Moments};
use crate::checkpoint::Tensors;
use crate::error::{Error, Result};
use crate::grow::{self, GrowInit, Kind};
use crate::models::tokenformer::ScaleTokens;

use super::checkpoints::write_checkpoint;
pub use super::checkpoints::{
    checkpoint_path, checkpoints, prune, read_resume_state, resume_dir, write_model,
    OPTIMIZER_FILE, STATE_FILE,
};
pub use super::options::{Augment, TrainOptions};

/// What `trainer_state.json` holds besides the options.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: u64,
    pub tokens: u64,
    /// Training windows consumed from the data stream.
    pub data_position: u64,
    pub options: TrainOptions,
    /// Training FLOPs so far, each step counted at the size it trained
    /// (0 for models without a FLOPs count and for runs saved before it was kept).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub flops: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// One optimiser step's numbers.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepReport {
    pub step: u64,
    pub lr: f64,
    pub loss: f64,
    pub grad_norm: f64,
    pub tokens: u64,
    /// Training FLOPs so far (0 where the model has no FLOPs count).
    pub flops: f64,
}

/// A model the generic [`Trainer`] trains: its variables, the loss of a batch, and
/// what a checkpoint of it holds.
pub trait Trainable: Sized {
    /// One micro-batch.
    type Batch;
    /// Whether `--grow-at` can grow this model inside a run.
    const GROWS: bool = false;

    fn params(&self) -> &BTreeMap<String, Var>;
    /// The mean loss of one micro-batch (a scalar).
    fn loss_of(&self, batch: &Self::Batch) -> candle_core::Result<Tensor>;
    /// `config.json` of a checkpoint.
    fn config_json(&self) -> String;
    /// Training FLOPs per token (or image) of a step at `seq_len`; 0 if not counted.
    fn flops_per_token(&self, seq_len: usize) -> f64 {
        let _ = seq_len;
        0.0
    }
    /// Token counts before the last growth (what `--train new` leaves frozen).
    fn grown_from(&self) -> Option<ScaleTokens> {
        None
    }
    /// Rows before the bridge (what `--train bridge` leaves frozen).
    fn bridge_from(&self) -> Option<ScaleTokens> {
        None
    }
    /// The model grown to the target `spec` (`ffn=1024,qkv=256`) by the
    /// function-preserving rule.
    fn grown(&self, spec: &str, init: &GrowInit) -> Result<Self> {
        let _ = init;
        Err(Error::option(
            "grow_at",
            format!("{spec}: this architecture cannot grow inside a run"),
        ))
    }

    /// The current values, by canonical name (for saving).
    fn tensors(&self) -> Tensors {
        self.params()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect()
    }
}

/// The training loop every architecture shares: AdamW on the tensors `--train`
/// selects, gradient accumulation, clipping, the schedule, in-run growth and
/// checkpoints. The data comes from the caller, one micro-batch at a time.
pub struct Trainer<M: Trainable> {
    model: M,
    opt: AdamW,
    opts: TrainOptions,
    /// Trained tensors with their leading frozen rows (0: the whole tensor trains).
    trained: BTreeMap<String, usize>,
    step: u64,
    /// Tokens (or images) seen so far.
    seen: u64,
    flops: f64,
}

impl<M: Trainable> Trainer<M> {
    /// Starts (or, with `resume`, continues at its step with its optimiser moments)
    /// training `model`.
    pub fn new(
        model: M,
        opts: TrainOptions,
        resume: Option<(TrainerState, BTreeMap<String, Moments>)>,
    ) -> Result<Self> {
        opts.validate()?;
        if !M::GROWS && !opts.grow_at.is_empty() {
            return Err(Error::option(
                "grow_at",
                "grows language models and classifiers only",
            ));
        }
        let trained = select(
            model.params(),
            model.grown_from(),
            model.bridge_from(),
            &opts.train,
        )?;
        let mut opt = optimizer(model.params(), &trained, opts.adamw())?;
        let (mut step, mut seen, mut flops) = (0, 0, 0.0);
        if let Some((state, moments)) = resume {
            opt.restore(state.step, moments)?;
            step = state.step;
            seen = state.tokens;
            // A checkpoint from before the count was kept: every token at this size.
            flops = if state.flops == 0.0 {
                model.flops_per_token(opts.seq_len) * seen as f64
            } else {
                state.flops
            };
        }
        Ok(Self {
            model,
            opt,
            opts,
            trained,
            step,
            seen,
            flops,
        })
    }

    pub fn model(&self) -> &M {
        &self.model
    }

    /// Multiplies the AdamW update of the trained tensor `name` by `scale` (see
    /// [`AdamW::scale_updates`]).
    pub fn scale_updates(&mut self, name: &str, scale: Tensor) -> Result<()> {
        if !self.trained.contains_key(name) {
            return Err(Error::input(format!(
                "`{name}` does not train, so its updates cannot be scaled"
            )));
        }
        Ok(self.opt.scale_updates(name, scale)?)
    }

    /// The model as trained so far.
    pub fn into_model(self) -> M {
        self.model
    }

    /// The tensors that train, each with its leading rows that stay frozen.
    pub fn trained(&self) -> &BTreeMap<String, usize> {
        &self.trained
    }

    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }

    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Tokens (or images) trained on so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Whether every step has been taken.
    pub fn done(&self) -> bool {
        self.step >= self.opts.steps
    }

    /// Continues with `grown` (the model after a growth): the old tokens keep their
    /// AdamW moments, the new ones start at zero, and the step count (bias correction,
    /// schedule) goes on.
    pub fn replace_model(&mut self, grown: M) -> Result<()> {
        let trained = select(
            grown.params(),
            grown.grown_from(),
            grown.bridge_from(),
            &self.opts.train,
        )?;
        let mut opt = optimizer(grown.params(), &trained, self.opts.adamw())?;
        opt.restore(self.opt.step_count(), self.opt.moments().clone())?;
        self.model = grown;
        self.trained = trained;
        self.opt = opt;
        Ok(())
    }

    /// One optimiser step over `grad_accum` micro-batches from `next` (each with the
    /// tokens or images it counts), then the growth `--grow-at` asks for after it.
    pub fn step(
        &mut self,
        mut next: impl FnMut() -> Result<(M::Batch, u64)>,
    ) -> Result<StepReport> {
        let accum = self.opts.grad_accum;
        let mut acc = Accumulation::new(accum);
        let mut seen = 0;
        for _ in 0..accum {
            let (batch, n) = next()?;
            let loss = self.model.loss_of(&batch)?;
            acc.add(loss, self.model.params(), &self.trained)?;
            seen += n;
        }
        let (loss, lr, grad_norm) = acc.update(
            self.model.params(),
            &self.trained,
            &mut self.opt,
            &self.opts,
            self.step,
        )?;
        self.step += 1;
        self.seen += seen;
        self.flops += self.model.flops_per_token(self.opts.seq_len) * seen as f64;
        let growth: Vec<String> = self
            .opts
            .grow_at
            .iter()
            .filter(|(s, _)| *s == self.step)
            .map(|(_, spec)| spec.clone())
            .collect();
        for spec in growth {
            let init = GrowInit {
                seed: self.opts.seed ^ self.step,
                ..GrowInit::default()
            };
            let grown = self.model.grown(&spec, &init)?;
            self.replace_model(grown)?;
        }
        Ok(StepReport {
            step: self.step,
            lr,
            loss,
            grad_norm,
            tokens: self.seen,
            flops: self.flops,
        })
    }

    /// The state a checkpoint records now, at `data_position` in the data.
    pub fn state(&self, data_position: u64) -> TrainerState {
        TrainerState {
            step: self.step,
            tokens: self.seen,
            data_position,
            options: self.opts.clone(),
            flops: self.flops,
        }
    }

    /// Writes `checkpoint-{step}` into `out` atomically: the model folder (config,
    /// weights, the `extra` files such as the tokenizer and a model card) plus optimiser
    /// and trainer state. Returns its path.
    pub fn save(
        &self,
        out: &Path,
        data_position: u64,
        extra: &[(&str, Vec<u8>)],
    ) -> Result<PathBuf> {
        write_checkpoint(
            out,
            &self.model.config_json(),
            &self.model.tensors(),
            &self.opt,
            &self.state(data_position),
            extra,
        )
    }
}

impl Trainable for TrainableLm {
    /// Windows of `seq_len + 1` token ids [b, t+1].
    type Batch = Tensor;
    const GROWS: bool = true;

    fn params(&self) -> &BTreeMap<String, Var> {
        TrainableLm::params(self)
    }

    fn loss_of(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.loss(ids)
    }

    fn config_json(&self) -> String {
        serde_json::to_string_pretty(self.config()).expect("serialisable")
    }

    fn flops_per_token(&self, seq_len: usize) -> f64 {
        super::lm::flops_per_token(self.config(), seq_len)
    }

    fn grown_from(&self) -> Option<ScaleTokens> {
        self.config().grown_from_tokens
    }

    fn grown(&self, spec: &str, init: &GrowInit) -> Result<Self> {
        let cfg = self.config();
        let current = ScaleTokens {
            qkv: cfg.qkv_tokens,
            proj: cfg.proj_tokens,
            ffn: cfg.ffn_tokens,
        };
        self.grown_to(&grow::parse_target(spec, &current)?, init)
    }
}

impl TrainableLm {
    /// This model with every Pattention layer grown to `target` tokens (zero keys,
    /// normal values, √n constants kept).
    pub fn grown_to(&self, target: &ScaleTokens, init: &GrowInit) -> Result<Self> {
        let cfg = self.config();
        let old = ScaleTokens {
            qkv: cfg.qkv_tokens,
            proj: cfg.proj_tokens,
            ffn: cfg.ffn_tokens,
        };
        let new_cfg = grow::grown_lm_config(cfg, target)?;
        let (tensors, _) = grow::grow_tensors(Trainable::tensors(self), &old, target, init)?;
        let device = super::parts::device_of(self.params());
        Ok(TrainableLm::new(&new_cfg, &tensors, self.dtype(), &device)?
            .with_compute_dtype(self.compute_dtype()))
    }
}

/// Where a [`Fed`] trainer's micro-batches come from.
pub trait Source<M: Trainable> {
    /// The next micro-batch of `batch_size` examples, with the tokens (or images) it
    /// counts.
    fn next_batch(&mut self, batch_size: usize) -> Result<(M::Batch, u64)>;
    /// Examples consumed so far (what a checkpoint records to resume at).
    fn position(&self) -> u64;
}

/// A [`Trainer`] fed from a data source: the language model's token windows, the
/// classifier's images, the merged model's pairs.
pub struct Fed<M: Trainable, S> {
    core: Trainer<M>,
    data: S,
}

impl<M: Trainable, S> std::ops::Deref for Fed<M, S> {
    type Target = Trainer<M>;
    fn deref(&self) -> &Self::Target {
        &self.core
    }
}

impl<M: Trainable, S: Source<M>> Fed<M, S> {
    /// `data` already at the resumed position, when resuming.
    pub(crate) fn with(
        model: M,
        data: S,
        opts: TrainOptions,
        resume: Option<(TrainerState, BTreeMap<String, Moments>)>,
    ) -> Result<Self> {
        Ok(Self {
            core: Trainer::new(model, opts, resume)?,
            data,
        })
    }

    pub(crate) fn source(&self) -> &S {
        &self.data
    }

    /// One optimiser step over `grad_accum` micro-batches.
    pub fn step(&mut self) -> Result<StepReport> {
        let b = self.core.options().batch_size;
        let data = &mut self.data;
        self.core.step(|| data.next_batch(b))
    }

    /// The state a checkpoint records now.
    pub fn state(&self) -> TrainerState {
        self.core.state(self.data.position())
    }

    /// Writes `checkpoint-{step}` into `out` atomically: the model folder (config,
    /// weights, the `extra` files such as the tokenizer and a model card) plus optimiser
    /// and trainer state. Returns its path.
    pub fn save(&self, out: &Path, extra: &[(&str, Vec<u8>)]) -> Result<PathBuf> {
        self.core.save(out, self.data.position(), extra)
    }
}

/// Packed windows of `seq_len + 1` token ids.
pub struct LmSource {
    windows: TokenWindows,
    seq_len: usize,
    vocab: usize,
    device: Device,
}

/// Refuses token ids the model has no embedding for (a tokenizer of another model).
pub(crate) fn check_ids(ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().max() {
        Some(&id) if id as usize >= vocab => Err(Error::input(format!(
            "the tokenizer gives token id {id}, but the model's vocabulary has {vocab} entries: \
             is --tokenizer the model's?"
        ))),
        _ => Ok(()),
    }
}

impl Source<TrainableLm> for LmSource {
    fn next_batch(&mut self, b: usize) -> Result<(Tensor, u64)> {
        let t = self.seq_len;
        let mut ids = Vec::with_capacity(b * (t + 1));
        for _ in 0..b {
            ids.extend(self.windows.next_window()?);
        }
        check_ids(&ids, self.vocab)?;
        Ok((
            Tensor::from_vec(ids, (b, t + 1), &self.device)?,
            (b * t) as u64,
        ))
    }

    fn position(&self) -> u64 {
        self.windows.position()
    }
}

/// A language model being trained on a stream of token windows.
pub type LmTrainer = Fed<TrainableLm, LmSource>;

impl LmTrainer {
    /// Starts (or, with `state`, resumes) training `model` on `data`. `moments` are a
    /// checkpoint's optimiser moments.
    pub fn new(
        model: TrainableLm,
        mut data: TokenWindows,
        opts: TrainOptions,
        resume: Option<(TrainerState, BTreeMap<String, Moments>)>,
    ) -> Result<Self> {
        if let Some((state, _)) = &resume {
            data.skip(state.data_position)?;
        }
        let source = LmSource {
            windows: data,
            seq_len: opts.seq_len,
            vocab: model.config().vocab_size,
            device: super::parts::device_of(model.params()),
        };
        Self::with(model, source, opts, resume)
    }

    /// Grows every Pattention layer to `target` tokens in the middle of the run, with
    /// the function-preserving rule (zero keys, normal values, √n constants kept): the
    /// old tokens keep their AdamW moments, the new ones start at zero, and the step
    /// count (bias correction, schedule) goes on.
    pub fn grow(&mut self, target: &ScaleTokens, init: &GrowInit) -> Result<()> {
        let grown = self.core.model().grown_to(target, init)?;
        self.core.replace_model(grown)
    }

    /// Mean next-token loss over `windows` (each `seq_len + 1` tokens), `batch` at a time.
    pub fn evaluate(&self, windows: &[Vec<u32>], batch: usize) -> Result<f64> {
        let mut sum = 0.0;
        for chunk in windows.chunks(batch.max(1)) {
            let t = chunk[0].len();
            let flat: Vec<u32> = chunk.iter().flatten().copied().collect();
            let ids = Tensor::from_vec(flat, (chunk.len(), t), &self.data.device)?;
            let loss = self
                .model()
                .loss(&ids)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            sum += loss * chunk.len() as f64;
        }
        Ok(sum / windows.len().max(1) as f64)
    }
}

/// What `--train` selects: each trained tensor with its leading frozen rows.
pub(crate) fn select(
    params: &BTreeMap<String, Var>,
    grown_from: Option<ScaleTokens>,
    bridge_from: Option<ScaleTokens>,
    train: &[String],
) -> Result<BTreeMap<String, usize>> {
    let mut out = BTreeMap::new();
    if let [word] = train {
        if word == "bridge" || word == "new" {
            let rows_from = if word == "bridge" {
                bridge_from.ok_or_else(|| {
                    Error::option(
                    "train",
                    "bridge trains a merged vision-language model's bridge tokens; this is not one",
                )
                })?
            } else {
                grown_from.ok_or_else(|| Error::option(
                    "train",
                    "new: the model records no growth (config.json has no `grown_from_tokens`); grow it first (grow_at, or `tokenformer-convert grow`)",
                ))?
            };
            let old = rows_from;
            for (name, var) in params {
                if let Some(kind) = grow::pattention_kind(name)? {
                    let old_rows = Kind::of(&old, kind);
                    let rows = var.dim(0)?;
                    if rows > old_rows {
                        out.insert(name.clone(), old_rows);
                    }
                }
            }
            if out.is_empty() {
                return Err(Error::option(
                    "train",
                    format!("{word}: the model has no such tokens (none appended)"),
                ));
            }
            return Ok(out);
        }
    }
    let globs = train
        .iter()
        .map(|p| {
            globset::Glob::new(p)
                .map(|g| g.compile_matcher())
                .map_err(|e| Error::option("train", format!("{p:?}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    for name in params.keys() {
        if globs.iter().any(|g| g.is_match(name.as_str())) {
            out.insert(name.clone(), 0);
        }
    }
    if out.is_empty() {
        return Err(Error::option(
            "train",
            format!("{} matches no tensor of the model", train.join(",")),
        ));
    }
    Ok(out)
}

/// Gradients summed over the micro-batches of one optimiser step, then the step itself:
/// the loop every trainer (language model, classifier, merged model) runs.
pub(crate) struct Accumulation {
    accum: usize,
    sums: HashMap<String, Tensor>,
    store: Option<GradStore>,
    loss_sum: f64,
}

impl Accumulation {
    pub(crate) fn new(accum: usize) -> Self {
        Self {
            accum,
            sums: HashMap::new(),
            store: None,
            loss_sum: 0.0,
        }
    }

    /// Back-propagates one micro-batch's mean loss (scaled by 1/accum) and keeps its gradients.
    pub(crate) fn add(
        &mut self,
        loss: Tensor,
        params: &BTreeMap<String, Var>,
        trained: &BTreeMap<String, usize>,
    ) -> Result<()> {
        self.loss_sum += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let grads = (loss / self.accum as f64)?.backward()?;
        if self.accum > 1 {
            for name in trained.keys() {
                if let Some(g) = grads.get(params[name].as_tensor()) {
                    let sum = match self.sums.remove(name) {
                        Some(prev) => (prev + g)?,
                        None => g.clone(),
                    };
                    self.sums.insert(name.clone(), sum);
                }
            }
        }
        self.store = Some(grads);
        Ok(())
    }

    /// The optimiser step at `step` (0-based) with the summed gradients; returns the mean
    /// loss, the learning rate and the gradient norm before clipping.
    pub(crate) fn update(
        self,
        params: &BTreeMap<String, Var>,
        trained: &BTreeMap<String, usize>,
        opt: &mut AdamW,
        opts: &TrainOptions,
        step: u64,
    ) -> Result<(f64, f64, f64)> {
        let mut store = self.store.expect("at least one micro-batch");
        for (name, g) in self.sums {
            store.insert(params[&name].as_tensor(), g);
        }
        let loss = self.loss_sum / self.accum as f64;
        if !loss.is_finite() {
            return Err(Error::input(format!(
                "the training loss is {loss} at step {}: lower the learning rate or check the data",
                step + 1
            )));
        }
        let lr = opts.schedule().at(step);
        let grad_norm = update(params, trained, opt, store, opts.clip_grad, lr)?;
        Ok((loss, lr, grad_norm))
    }
}

/// Masks the frozen rows' gradients, clips the global norm and takes the AdamW step at
/// `lr`. Returns the gradient norm before clipping.
pub(crate) fn update(
    params: &BTreeMap<String, Var>,
    trained: &BTreeMap<String, usize>,
    opt: &mut AdamW,
    mut store: GradStore,
    clip: f64,
    lr: f64,
) -> Result<f64> {
    // Frozen rows get no gradient, so they count neither in the norm nor in clipping.
    for (name, &r0) in trained {
        let var = params[name].as_tensor();
        if let (true, Some(g)) = (r0 > 0, store.get(var)) {
            let n = g.dim(0)?;
            let mut zshape = g.dims().to_vec();
            zshape[0] = r0;
            let z = Tensor::zeros(zshape, g.dtype(), g.device())?;
            let masked = Tensor::cat(&[&z, &g.narrow(0, r0, n - r0)?], 0)?;
            store.insert(var, masked);
        }
    }
    let vars: Vec<&Var> = trained.keys().map(|n| &params[n]).collect();
    let grad_norm = clip_grad_norm(&mut store, vars.iter().copied(), clip)?;
    opt.step(&store, lr)?;
    Ok(grad_norm)
}

/// AdamW over the selected tensors, their frozen rows excluded from updates.
pub(crate) fn optimizer(
    params: &BTreeMap<String, Var>,
    trained: &BTreeMap<String, usize>,
    cfg: AdamWConfig,
) -> Result<AdamW> {
    let vars = trained
        .keys()
        .map(|k| (k.clone(), params[k].clone()))
        .collect();
    let mut opt = AdamW::new(vars, cfg)?;
    for (name, &rows) in trained {
        if rows > 0 {
            opt.freeze_rows(name, rows);
        }
    }
    Ok(opt)
}
