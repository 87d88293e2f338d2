//! The `tokenformer` command line: one module per command family. Library
//! errors become `anyhow` errors here, at the edge.
pub mod bench;
pub mod bench_gpu;
pub mod bench_train;
pub mod eval_lm;
pub mod inspect;
pub mod lm;
pub mod progress;
pub mod serve;
pub mod shell;
pub mod stdout;
pub mod train;
pub mod vision;
pub mod zoo;

use clap::{Args, ValueEnum};
use tokenformer::{DeviceSpec, Error};

/// The message `main` prints for an error (as `{:#}` does: each cause after
/// a colon), with the flag or command that helps added where the library
/// only says what is missing.
pub fn describe(e: &anyhow::Error) -> String {
    e.chain()
        .map(|cause| match cause.downcast_ref::<Error>() {
            Some(lib) => hint(lib).unwrap_or_else(|| lib.to_string()),
            None => cause.to_string(),
        })
        .collect::<Vec<_>>()
        .join(": ")
}

/// A count flag (`--batch-size`, `--limit`, `--save-every`, …) for which 0 is no setting
/// at all: refused while the command line is read, not taken as 1.
pub(crate) fn positive<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr<Err: std::fmt::Display> + PartialEq + From<u8>,
{
    match s.parse::<T>() {
        Ok(n) if n == T::from(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn hint(e: &Error) -> Option<String> {
    Some(match e {
        Error::UnknownModel(spec) => format!(
            "unknown model `{spec}`: not an existing path, a zoo name (see `tokenformer zoo list`) or a Hub repo id owner/name"
        ),
        Error::NoReleasedWeights(name) => format!(
            "zoo model `{name}` has no released weights (it is a configuration; see `tokenformer zoo show {name}`)"
        ),
        Error::NoOfficialConfig { .. } => format!("{e} or pass --config"),
        Error::NoHubConfig { repo } => {
            format!("{repo} holds an official pytorch_model.bin but no config: pass --config X.yml")
        }
        Error::NoTokenizer { model } => format!(
            "{model} has no tokenizer.json: pass --tokenizer PATH (the released models use EleutherAI/gpt-neox-20b's)"
        ),
        Error::Option { option, msg } => format!("--{} {msg}", option.replace('_', "-")),
        Error::TooLong { .. } => format!("{e}; use `tokenformer eval pile` for long documents"),
        _ => return None,
    })
}

/// `--device` of the commands that run a model.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Where to run: cpu, cuda (the first GPU), cuda:N or auto (CUDA when built in and a GPU is
    /// present, else the CPU). CUDA needs a build with `--features cuda`.
    #[arg(
        long,
        env = "TOKENFORMER_DEVICE",
        default_value = "cpu",
        value_name = "DEVICE"
    )]
    pub device: DeviceSpec,
}

impl DeviceArgs {
    /// The device asked for, opened (an error says why it cannot be).
    pub fn open(&self) -> anyhow::Result<candle_core::Device> {
        Ok(self.device.resolve()?)
    }
}

/// How every command names and finds a model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A zoo name (`tokenformer zoo list`), a Hub repo `owner/name[@revision]`, or a local path
    /// (model folder, .safetensors, or official pytorch_model.bin).
    #[arg(long, short)]
    pub model: String,
    /// Config to use instead of the found one: an official eval .yml or a config.json.
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// tokenizer.json to use instead of the model's.
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
}

impl ModelArgs {
    pub fn locate(&self) -> anyhow::Result<tokenformer::loader::ModelFiles> {
        let opts = tokenformer::loader::LocateOptions {
            config: self.config.clone(),
            tokenizer: self.tokenizer.clone(),
            progress: Some(progress::download_bars()),
        };
        Ok(tokenformer::loader::locate(&self.model, &opts)?)
    }
}

/// Says what ran out of GPU memory, and how much was free, when `e` is a
/// GPU out-of-memory error; any other error is returned as it is.
pub fn gpu_memory_error(
    e: anyhow::Error,
    device: &candle_core::Device,
    what: &str,
) -> anyhow::Error {
    let oom = e.chain().any(tokenformer::device::is_out_of_memory);
    if device.is_cpu() || !oom {
        return e;
    }
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let free = match tokenformer::device::gpu_memory(device) {
        Some((free, total)) => format!("{:.1} GiB of {:.1} GiB free now", gib(free), gib(total)),
        None => "free memory unknown".to_string(),
    };
    e.context(format!(
        "out of GPU memory running {what} ({free}): lower --batch-size or --max-batch-tokens, or \
         use --dtype bf16"
    ))
}

/// The dtype a model computes in.
#[derive(ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DtypeArg {
    #[default]
    F32,
    Bf16,
    F16,
}

impl From<DtypeArg> for tokenformer::ComputeDtype {
    fn from(d: DtypeArg) -> Self {
        match d {
            DtypeArg::F32 => tokenformer::ComputeDtype::F32,
            DtypeArg::Bf16 => tokenformer::ComputeDtype::Bf16,
            DtypeArg::F16 => tokenformer::ComputeDtype::F16,
        }
    }
}

/// The precision a language model's weight matrices are kept in.
#[derive(ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WeightDtype {
    #[default]
    F32,
    F16,
    /// 8-bit: int8 blocks of 32 with an f32 scale, quantised at load.
    Q8,
}

/// The precision a KV cache keeps keys and values in (`--kv-dtype`).
#[derive(ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvDtypeArg {
    #[default]
    F32,
    F16,
}

impl From<KvDtypeArg> for tokenformer::KvDtype {
    fn from(a: KvDtypeArg) -> Self {
        match a {
            KvDtypeArg::F32 => tokenformer::KvDtype::F32,
            KvDtypeArg::F16 => tokenformer::KvDtype::F16,
        }
    }
}

/// `--dtype` and `--weight-dtype` of the language-model commands.
#[derive(Args, Debug, Clone)]
pub struct WeightArgs {
    /// Compute in f32 (exact; the default), bf16 or f16 (GPUs: several times faster; the
    /// weights are kept in it too). Norms, softmaxes and Θ's normalisation sum in f32 in
    /// every dtype.
    #[arg(long, value_enum, default_value_t)]
    pub dtype: DtypeArg,
    /// With f32 computation, keep weight matrices in f16 (half the memory, faster decoding;
    /// results match f32 for fp16 checkpoints, all released ones, up to summation order) or q8 (CPU only:
    /// 8-bit blocks quantised at load, and the activations alike per product: under a third
    /// of the memory, faster still, a small accuracy cost).
    #[arg(long, value_enum, default_value_t)]
    pub weight_dtype: WeightDtype,
}

/// What `--dtype` and `--weight-dtype` ask a model to be loaded in.
enum Precision {
    /// f32 computation with the weight matrices kept in this dtype.
    Weights(candle_core::DType),
    /// Computation, and the weights, in this dtype.
    Compute(candle_core::DType),
    /// f32 computation with 8-bit weight matrices (CPU only).
    Q8,
}

impl WeightArgs {
    fn precision(&self, dev: &candle_core::Device) -> anyhow::Result<Precision> {
        use candle_core::DType;
        Ok(match (self.dtype, self.weight_dtype) {
            (DtypeArg::F32, WeightDtype::F32) => Precision::Weights(DType::F32),
            (DtypeArg::F32, WeightDtype::F16) => Precision::Weights(DType::F16),
            (DtypeArg::F32, WeightDtype::Q8) if dev.is_cpu() => Precision::Q8,
            (DtypeArg::F32, WeightDtype::Q8) => anyhow::bail!(
                "--weight-dtype q8 runs on the CPU only (its kernels are CPU kernels); on a GPU \
                 use --dtype bf16 for less memory"
            ),
            (d, WeightDtype::F32) => Precision::Compute(tokenformer::ComputeDtype::from(d).dtype()),
            (d, w) => {
                anyhow::bail!(
                "--weight-dtype {} applies to f32 computation; with --dtype {} the weights are \
                 kept in {} (drop --weight-dtype)",
                w.to_possible_value().expect("no skipped variants").get_name(),
                tokenformer::ComputeDtype::from(d),
                tokenformer::ComputeDtype::from(d)
            )
            }
        })
    }

    /// The language model of `files` on `dev`, in the precision asked for.
    pub fn load_lm(
        &self,
        files: &tokenformer::loader::ModelFiles,
        dev: &candle_core::Device,
    ) -> anyhow::Result<tokenformer::models::tokenformer::TokenFormerLm> {
        use tokenformer::loader;
        Ok(match self.precision(dev)? {
            Precision::Weights(w) => loader::load_lm_as(files, dev, w)?,
            Precision::Compute(d) => loader::load_lm_in(files, dev, d)?,
            Precision::Q8 => loader::load_lm_q8(files, dev)?,
        })
    }

    /// Whether a merged vision-language model runs whole in this precision:
    /// 8-bit weights are a language model's kernels.
    pub fn merged_ok(&self) -> bool {
        self.weight_dtype != WeightDtype::Q8
    }

    /// The merged vision-language model of `files` on `dev`, in the precision
    /// asked for (see [`Self::merged_ok`]).
    pub fn load_vl(
        &self,
        files: &tokenformer::loader::ModelFiles,
        dev: &candle_core::Device,
    ) -> anyhow::Result<tokenformer::models::vl::VisionLanguageModel> {
        use tokenformer::loader;
        Ok(match self.precision(dev)? {
            Precision::Weights(w) => loader::load_vl_as(files, dev, w)?,
            Precision::Compute(d) => loader::load_vl_in(files, dev, d)?,
            Precision::Q8 => anyhow::bail!("8-bit weights quantise language models only"),
        })
    }

    /// The name reports give the precision: `f32`, `f16`, `q8` (f32
    /// computation) or `bf16` (weights and computation).
    pub fn name(&self) -> String {
        match self.dtype {
            DtypeArg::F32 => self
                .weight_dtype
                .to_possible_value()
                .expect("no skipped variants")
                .get_name()
                .to_string(),
            d => tokenformer::ComputeDtype::from(d).to_string(),
        }
    }
}
