//! The `tokenformer` command line: one module per command family. Library
//! errors become `anyhow` errors here, at the edge.
pub mod bench;
pub mod eval_lm;
pub mod inspect;
pub mod lm;
pub mod vision;
pub mod zoo;

use clap::Args;

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
            progress: true,
        };
        Ok(tokenformer::loader::locate(&self.model, &opts)?)
    }
}
