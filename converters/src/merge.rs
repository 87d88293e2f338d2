//! `tokenformer-convert merge`: a vision TokenFormer and a language
//! TokenFormer of the same width, depth and heads → one `tokenformer-vl`
//! model whose Pattention layers hold [vision | language | bridge] parameter
//! tokens (the paper's proposed unification, <https://arxiv.org/abs/2410.23168>;
//! layout and routing in `tokenformer::models::vl`). Bridge keys are zero and
//! bridge values seeded random, so the merged model must reproduce both
//! sources on their own modality; the tool checks that on a probe before
//! anything is written.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use tokenformer::card::ModelCard;
use tokenformer::checkpoint;
use tokenformer::loader;
use tokenformer::models::vl::{self, VisionLanguageModel};
use tokenformer::models::{lm, vit, ModelConfig};

use crate::args::FolderOut;
use crate::family::typed;
use crate::output::{check_not_input, ModelFolder};
use crate::probe;

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// The vision model (tokenformer-vit folder, zoo name or Hub repo).
    #[arg(long)]
    pub vision: String,
    /// The language model (tokenformer-lm folder, official .bin, zoo name or Hub repo).
    #[arg(long)]
    pub language: String,
    /// New bridge parameter tokens per Pattention layer.
    #[arg(long)]
    pub bridge_tokens: usize,
    #[command(flatten)]
    pub out: FolderOut,
    /// Seed of the bridge values.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Standard deviation of the bridge values.
    #[arg(long, default_value_t = 0.02)]
    pub bridge_std: f64,
}

/// The largest |Δ logit| accepted between the merged model and a source on its own
/// modality, per unit of the source's largest |logit| (at least 1).
pub const TOLERANCE: f32 = 1e-5;

pub fn run(a: MergeArgs) -> Result<()> {
    let dev = Device::Cpu;
    let vfiles = loader::locate(&a.vision, &with_bars())
        .with_context(|| format!("--vision {}", a.vision))?;
    let lfiles = loader::locate(&a.language, &with_bars())
        .with_context(|| format!("--language {}", a.language))?;
    for f in [&vfiles, &lfiles] {
        let p = std::path::Path::new(&f.source);
        if p.exists() {
            check_not_input(&a.out.out, p)?;
        }
    }
    let vw = loader::read_weights(&vfiles, Some(DType::F32), &dev)?;
    let lw = loader::read_weights(&lfiles, Some(DType::F32), &dev)?;
    // Both roles are checked by name before either config is validated.
    let vision = typed(&vw.config, &vw.path, &[vit::ARCHITECTURE]);
    let language = typed(&lw.config, &lw.path, &[lm::ARCHITECTURE]);
    if matches!(vision, Ok(None)) {
        bail!("--vision {}: architecture `{}` is not a TokenFormer image classifier (`tokenformer-vit`)", a.vision, loader::architecture(&vw.config));
    }
    if matches!(language, Ok(None)) {
        bail!("--language {}: architecture `{}` is not a TokenFormer language model (`tokenformer-lm`)", a.language, loader::architecture(&lw.config));
    }
    let (Some(ModelConfig::Vit(vcfg)), Some(ModelConfig::Lm(lcfg))) = (vision?, language?) else {
        unreachable!("typed() returns only the expected architecture")
    };
    let cfg = vl::Config::merged(&vcfg, &lcfg, a.bridge_tokens)
        .map_err(|e| anyhow::anyhow!("cannot merge {} and {}: {e}", a.vision, a.language))?;
    // Both sources load (all tensors present, right shapes) before anything is combined.
    let vision = loader::load_vit(&vfiles, &dev)?;
    let language = loader::load_lm(&lfiles, &dev)?;
    if vision.config() != &vcfg || language.config() != &lcfg {
        bail!("--vision/--language: a source is itself a merged model; merge plain classifiers and language models");
    }
    let tensors = vl::assemble(&cfg, &vw.tensors, &lw.tensors, |name, rows, cols| {
        tokenformer::init::normal_tensor((rows, cols), a.bridge_std, a.seed, name, &dev)
    })?;
    let merged = VisionLanguageModel::from_tensors(&cfg, &tensors, &dev)?;

    // Each modality must be what its source was.
    let ids = probe::probe_ids(lcfg.vocab_size, lcfg.max_position_embeddings);
    let input = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?;
    let lm_ref = language.forward(&input, None)?;
    let text_diff = probe::max_abs_diff(&merged.language().forward(&input, None)?, &lm_ref)?;
    let pixels = probe::probe_pixels(2, vcfg.num_channels, vcfg.image_size, &dev)?;
    let vit_ref = vision.forward(&pixels)?;
    let image_diff = probe::max_abs_diff(&merged.vision().forward(&pixels)?, &vit_ref)?;
    let (mixed_img, _) = merged.forward_mixed(Some(&pixels.narrow(0, 0, 1)?), &input, None)?;
    let mixed_diff =
        probe::max_abs_diff(&mixed_img.expect("pixels given"), &vit_ref.narrow(0, 0, 1)?)?;
    // f32 sums over more parameter tokens round differently: the bound scales
    // with the logits' size (a trained model's reach tens).
    let text_tol = TOLERANCE * largest(&lm_ref)?.max(1.0);
    let image_tol = TOLERANCE * largest(&vit_ref)?.max(1.0);
    let ok = probe::report(
        "the merged model on text and the language model",
        text_diff,
        text_tol,
    )? & probe::report(
        "the merged model on images and the classifier",
        image_diff,
        image_tol,
    )? & probe::report(
        "the image logits of a mixed [image; text] run and the classifier",
        mixed_diff,
        image_tol,
    )?;
    if !ok {
        bail!("the merged model does not reproduce its sources (text {text_diff:e}, images {image_diff:e}, mixed {mixed_diff:e}); nothing was written");
    }

    let folder = ModelFolder::new(&a.out.out, a.out.force)?;
    folder.write_config(&cfg)?;
    folder.write_weights(&tensors, checkpoint::DEFAULT_SHARD_BYTES)?;
    folder.copy_tokenizer(lfiles.tokenizer.as_deref())?;
    // The written folder must load through the library's own loader.
    let reloaded = loader::load_vl(&folder.files()?, &dev)?;
    let reload_diff = probe::max_abs_diff(&reloaded.language().forward(&input, None)?, &lm_ref)?;
    if reload_diff > text_tol {
        bail!("the written merged model does not reload to the same function (max |Δ logit| {reload_diff:e}); nothing was written");
    }

    let g = cfg.pattention_groups;
    let mut card = ModelCard::new(
        format!(
            "TokenFormer vision-language model (d {}, {} layers)",
            lcfg.hidden_size, lcfg.num_layers
        ),
        "image-text-to-text",
    );
    card.section(
        "Model",
        format!(
            "Merged by `tokenformer-convert merge` from the vision model `{}` and the language model `{}` (paper: https://arxiv.org/abs/2410.23168, future work). Each Pattention layer holds [vision | language | bridge] parameter tokens: qkv {}+{}+{}, proj {}+{}+{}, ffn {}+{}+{}. Image tokens score only vision and bridge tokens, text tokens only language and bridge tokens, each with its source's √n constant; bridge keys are zero and bridge values seeded random (seed {}, std {}), so at creation each modality computes exactly what its source did.",
            a.vision, a.language, g.qkv.vision, g.qkv.language, g.qkv.bridge, g.proj.vision, g.proj.language, g.proj.bridge, g.ffn.vision, g.ffn.language, g.ffn.bridge, a.seed, a.bridge_std
        ),
    );
    card.section(
        "Merge check",
        format!("Max |Δ logit| on a probe: text vs the language model {text_diff:.3e}; images vs the classifier {image_diff:.3e}; image logits of a mixed [image; text] sequence vs the classifier {mixed_diff:.3e} (tolerance {TOLERANCE:.0e} × the largest logit, at least 1)."),
    );
    card.section(
        "Usage",
        "```\ntokenformer score --model PATH --text \"...\"\ntokenformer classify --model PATH IMAGE\ntokenformer generate --model PATH --image IMAGE --prompt \"A photo of\"\n```",
    );
    folder.finish_and_say(&card)
}

/// Locate options that draw download bars.
fn with_bars() -> loader::LocateOptions {
    loader::LocateOptions {
        progress: Some(crate::progress::download_bars()),
        ..Default::default()
    }
}

/// The largest |logit| of `t`.
fn largest(t: &Tensor) -> Result<f32> {
    Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}
