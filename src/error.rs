//! The library's error type. Every variant names the file, tensor or setting at
//! fault so a user can act on the message without a backtrace.

use std::path::PathBuf;

/// Errors of the `tokenformer` library; the CLI wraps them with `anyhow`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The I/O error is in the message and not also a `source()`, so reports that walk
    /// the chain (`{:#}`, the command line) do not show it twice.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A config file that does not parse or has a missing/invalid field.
    #[error("config {path}: {msg}")]
    Config { path: PathBuf, msg: String },
    /// A checkpoint that is unreadable, truncated, or disagrees with its config.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: PathBuf, msg: String },
    /// A tensor that is missing or has the wrong shape.
    #[error("tensor `{name}`: {msg}")]
    Tensor { name: String, msg: String },
    #[error("tokenizer {path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    /// Bad user input (empty prompt, too-long context, unknown model name, ...).
    #[error("{0}")]
    Input(String),
    /// A bad value of an option (a field of the options struct, e.g.
    /// `TrainOptions::min_lr`); a command line names its flag instead.
    #[error("`{option}` {msg}")]
    Option { option: &'static str, msg: String },
    /// A model name that is not an existing path, a zoo name or a Hub repo id.
    #[error("unknown model `{0}`: not an existing path, a zoo name or a Hub repo id owner/name")]
    UnknownModel(String),
    /// A zoo entry that is a configuration without released weights.
    #[error("zoo model `{0}` has no released weights (it is a configuration)")]
    NoReleasedWeights(String),
    /// An official `pytorch_model.bin` in `dir` without exactly one yml beside it.
    #[error("config {}: an official checkpoint needs its yml config: put exactly one .yml beside it", dir.display())]
    NoOfficialConfig { dir: PathBuf },
    /// A Hub repo with an official `pytorch_model.bin` and no config.
    #[error("{repo} holds an official pytorch_model.bin but no config")]
    NoHubConfig { repo: String },
    /// A model without `tokenizer.json`, and none given.
    #[error("{model} has no tokenizer.json (the released models use EleutherAI/gpt-neox-20b's)")]
    NoTokenizer { model: String },
    /// More tokens than the model has positions.
    #[error("the input has {tokens} tokens but the model's context is {max} positions")]
    TooLong { tokens: usize, max: usize },
    /// Boxed: Hub errors are large and would bloat every `Result`.
    #[error(transparent)]
    Hub(Box<crate::hub::HubError>),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A device that cannot be used (`--device`, `device=`).
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<crate::hub::HubError> for Error {
    fn from(e: crate::hub::HubError) -> Self {
        Error::Hub(Box::new(e))
    }
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
    }
    pub fn config(path: impl Into<PathBuf>, msg: impl std::fmt::Display) -> Self {
        Error::Config {
            path: path.into(),
            msg: msg.to_string(),
        }
    }
    pub fn checkpoint(path: impl Into<PathBuf>, msg: impl std::fmt::Display) -> Self {
        Error::Checkpoint {
            path: path.into(),
            msg: msg.to_string(),
        }
    }
    /// A bad value of the option `option` (see [`Error::Option`]).
    pub fn option(option: &'static str, msg: impl std::fmt::Display) -> Self {
        Error::Option {
            option,
            msg: msg.to_string(),
        }
    }
    pub fn input(msg: impl std::fmt::Display) -> Self {
        Error::Input(msg.to_string())
    }
}
