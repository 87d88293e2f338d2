//! The `tokenformer` command line: one module per command family. Library
//! errors become `anyhow` errors here, at the edge.
pub mod bench;
pub mod bench_train;
pub mod eval_lm;
pub mod inspect;
pub mod lm;
pub mod progress;
pub mod shell;
pub mod train;
pub mod vision;
pub mod zoo;

use clap::{Args, ValueEnum};
use tokenformer::{DeviceError, DeviceSpec, Error};

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
    /// present, else the CPU). CUDA needs a build with `--features cuda`, and no command runs on
    /// it yet: only cpu works for now.
    #[arg(
        long,
        env = "TOKENFORMER_DEVICE",
        default_value = "cpu",
        value_name = "DEVICE"
    )]
    pub device: DeviceSpec,
}

impl DeviceArgs {
    /// The device of `command`, which runs on the CPU only so far: any other
    /// device is an error (why it cannot be opened, or that the command has
    /// no GPU path yet), raised before a model is located or read.
    pub fn cpu_only(&self, command: &str) -> anyhow::Result<candle_core::Device> {
        self.device
            .require_cpu(&format!("`tokenformer {command}`"))
            .map_err(device_error)
    }
}

/// The library says what cannot run; the command line also names the flag that helps.
fn device_error(e: DeviceError) -> anyhow::Error {
    match e {
        DeviceError::CpuOnly { .. } => anyhow::anyhow!("{e}: use --device cpu"),
        e => e.into(),
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

/// The precision a language model's weight matrices are kept in.
#[derive(ValueEnum, Debug, Clone, Copy, Default)]
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

/// `--weight-dtype` of the language-model commands.
#[derive(Args, Debug, Clone)]
pub struct WeightArgs {
    /// Keep weight matrices in f16 (half the memory, faster decoding; results
    /// match f32 exactly for fp16 checkpoints, all released ones) or q8
    /// (8-bit blocks quantised at load, and the activations alike per
    /// product: under a third of the memory, faster still, a small accuracy
    /// cost).
    #[arg(long, value_enum, default_value_t)]
    pub weight_dtype: WeightDtype,
}

impl WeightArgs {
    pub fn load_lm(
        &self,
        files: &tokenformer::loader::ModelFiles,
    ) -> anyhow::Result<tokenformer::models::tokenformer::TokenFormerLm> {
        let dev = candle_core::Device::Cpu;
        let dtype = match self.weight_dtype {
            WeightDtype::F32 => candle_core::DType::F32,
            WeightDtype::F16 => candle_core::DType::F16,
            WeightDtype::Q8 => return Ok(tokenformer::loader::load_lm_q8(files, &dev)?),
        };
        Ok(tokenformer::loader::load_lm_as(files, &dev, dtype)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU-only refusal cannot be reached without a GPU; its wording is checked here.
    #[test]
    fn a_cpu_only_command_names_the_flag_that_helps() {
        let e = device_error(DeviceError::CpuOnly {
            what: "`tokenformer score`".to_string(),
            spec: DeviceSpec::Auto,
        });
        assert_eq!(
            describe(&e),
            "`tokenformer score` does not run on CUDA yet (device `auto`); only on the CPU for now: use --device cpu"
        );
        let e = device_error(DeviceError::NotCompiled(DeviceSpec::Cuda(None)));
        assert!(describe(&e).contains("--features cuda"));
    }
}
