//! TokenFormer on candle: the Pattention layer, the TokenFormer language model
//! and image classifier, checkpoint IO, Hub download, the model zoo and
//! evaluation. Paper: <https://arxiv.org/abs/2410.23168>; official code:
//! <https://github.com/Haiyang-W/TokenFormer>.

pub mod alloc;
pub mod bench;
pub mod card;
pub mod checkpoint;
pub mod error;
pub mod eval;
pub mod fsutil;
pub mod generate;
pub mod grow;
pub mod hub;
pub mod kernels;
pub mod loader;
pub mod models;
pub mod pattention;
pub mod probe;
pub mod scoring;
pub mod train;
pub mod vision;
pub mod zoo;

pub use error::{Error, Result};
