//! The TokenFormer image classifier (ViT layout): a linear patch embedding,
//! a class token and learned position embeddings, then the language model's
//! own [`Block`] with bidirectional attention and no rotary embedding, and a
//! mean-pool (`fc_norm`) or class-token (`final_norm`) head.
//!
//! No official vision code is released; the layout follows the paper's
//! Section 4.2 / Table 3 (<https://arxiv.org/abs/2410.23168>) and the MAE
//! fine-tuning ViT it was trained with (`models_vit.py` of
//! facebookresearch/mae: `global_pool` → mean of patch tokens, then `fc_norm`).

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::models::block::{AttentionMode, Block, BlockConfig, Norm, ScaleTokens};
use crate::pattention::Activation;

pub const ARCHITECTURE: &str = "tokenformer-vit";

/// Largest `image_size`: one preprocessed image is image_size² × 3 floats.
pub(crate) const MAX_IMAGE_SIZE: usize = 4096;
pub(crate) const MAX_CLASSES: usize = 1 << 20;
/// Smallest `crop_pct`: images are resized to image_size / crop_pct first.
pub(crate) const MIN_CROP_PCT: f64 = 0.125;

/// How the token sequence becomes one feature vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    /// Mean of the patch tokens (not the class token), then `fc_norm` (MAE fine-tuning).
    Mean,
    /// `final_norm` on the tokens, then the class token (original ViT).
    Cls,
}

/// Resampling filter of the eval resize (Pillow's filters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Interpolation {
    #[default]
    Bicubic,
    Bilinear,
}

/// How the eval preprocessing brings an image to `image_size`² before the
/// centre crop (timm's `crop_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ResizeMode {
    /// The shorter side to floor(image_size / crop_pct), aspect ratio kept (timm's `center`).
    #[default]
    ShorterSide,
    /// Both sides to floor(image_size / crop_pct), aspect ratio not kept (timm's
    /// `squash`; with crop_pct 1 transformers' `ViTImageProcessor`: no crop).
    Squash,
}

impl ResizeMode {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

fn default_norm_eps() -> f64 {
    1e-6
}
fn default_channels() -> usize {
    3
}
fn default_crop_pct() -> f64 {
    0.875
}
fn default_mean() -> [f32; 3] {
    [0.485, 0.456, 0.406]
}
fn default_std() -> [f32; 3] {
    [0.229, 0.224, 0.225]
}

/// `config.json` of a TokenFormer-ViT folder (key names shared with the LM where
/// they mean the same thing), with `"architecture": "tokenformer-vit"` first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "architecture",
    rename = "tokenformer-vit",
    deny_unknown_fields,
    remote = "Self"
)]
pub struct Config {
    pub image_size: usize,
    pub patch_size: usize,
    #[serde(default = "default_channels")]
    pub num_channels: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub qkv_tokens: usize,
    pub proj_tokens: usize,
    pub ffn_tokens: usize,
    pub num_classes: usize,
    pub pool: Pool,
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    #[serde(default)]
    pub pattention_activation: Activation,
    /// √n constants when they differ from the token counts (grown models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattention_scale_tokens: Option<ScaleTokens>,
    /// Eval preprocessing: the shorter side is resized to floor(image_size / crop_pct).
    #[serde(default = "default_crop_pct")]
    pub crop_pct: f64,
    #[serde(default)]
    pub interpolation: Interpolation,
    /// Eval resize before the centre crop: the shorter side (absent) or `squash`.
    #[serde(default, skip_serializing_if = "ResizeMode::is_default")]
    pub resize_mode: ResizeMode,
    #[serde(default = "default_mean")]
    pub mean: [f32; 3],
    #[serde(default = "default_std")]
    pub std: [f32; 3],
    /// The dataset label of each class index (ImageNet: the sorted WordNet ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_wnids: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_names: Option<Vec<String>>,
    /// Token counts before the last `grow` (what `train --train new` leaves frozen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grown_from_tokens: Option<ScaleTokens>,
}

impl Config {
    /// The paper's ImageNet-1k classifier shape at 224² with patch 16.
    pub fn imagenet(
        num_layers: usize,
        hidden_size: usize,
        num_heads: usize,
        qkv: usize,
        ffn: usize,
    ) -> Self {
        Self {
            image_size: 224,
            patch_size: 16,
            num_channels: 3,
            hidden_size,
            num_layers,
            num_heads,
            qkv_tokens: qkv,
            proj_tokens: qkv,
            ffn_tokens: ffn,
            num_classes: 1000,
            pool: Pool::Mean,
            norm_eps: 1e-6,
            pattention_activation: Activation::L2NormGelu,
            pattention_scale_tokens: None,
            crop_pct: 0.875,
            interpolation: Interpolation::Bicubic,
            resize_mode: ResizeMode::ShorterSide,
            mean: default_mean(),
            std: default_std(),
            class_wnids: None,
            class_names: None,
            grown_from_tokens: None,
        }
    }

    /// Patches per side.
    pub(crate) fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// N, the number of patch tokens.
    pub fn num_patches(&self) -> usize {
        self.grid() * self.grid()
    }

    /// The batch size of normalised pixels [b, C, H, W], checked against this
    /// shape: at least one image, of the configured channels and size.
    pub(crate) fn image_batch(&self, pixels: &Tensor) -> Result<usize> {
        let (b, c, h, w) = pixels.dims4()?;
        if b == 0 {
            candle_core::bail!("no images: pixels of shape {:?}", pixels.dims())
        }
        if c != self.num_channels || h != self.image_size || w != self.image_size {
            candle_core::bail!(
                "pixels of shape {:?}, expected [batch, {}, {}, {}]",
                pixels.dims(),
                self.num_channels,
                self.image_size,
                self.image_size
            )
        }
        Ok(b)
    }

    /// Checks what serde cannot: every number within its range, divisibility,
    /// list lengths and unique class ids. Every loader calls this before
    /// anything is allocated from the config.
    pub fn validate(&self) -> std::result::Result<(), String> {
        use crate::models::tokenformer::{check_block, check_divides, check_float, check_range};
        check_range("image_size", self.image_size, 1, MAX_IMAGE_SIZE)?;
        check_range("patch_size", self.patch_size, 1, self.image_size)?;
        check_divides("image_size", self.image_size, "patch_size", self.patch_size)?;
        if self.num_channels != 3 {
            return Err(format!(
                "`num_channels` is {}, allowed 3 (images are RGB)",
                self.num_channels
            ));
        }
        check_block(
            self.hidden_size,
            self.num_layers,
            self.num_heads,
            [self.qkv_tokens, self.proj_tokens, self.ffn_tokens],
            self.pattention_scale_tokens,
        )?;
        check_range("num_classes", self.num_classes, 1, MAX_CLASSES)?;
        if let Some(g) = self.grown_from_tokens {
            g.check_grown_into([self.qkv_tokens, self.proj_tokens, self.ffn_tokens])?;
        }
        check_float("norm_eps", self.norm_eps, 0.0, false, 1.0)?;
        check_float("crop_pct", self.crop_pct, MIN_CROP_PCT, true, 1.0)?;
        for c in 0..3 {
            check_float(&format!("mean[{c}]"), self.mean[c].into(), -1e3, true, 1e3)?;
            check_float(&format!("std[{c}]"), self.std[c].into(), 0.0, false, 1e3)?;
        }
        for (name, list) in [
            ("class_wnids", &self.class_wnids),
            ("class_names", &self.class_names),
        ] {
            if let Some(l) = list {
                if l.len() != self.num_classes {
                    return Err(format!(
                        "`{name}` has {} entries, num_classes is {}",
                        l.len(),
                        self.num_classes
                    ));
                }
            }
        }
        if let Some(ids) = &self.class_wnids {
            let mut seen = std::collections::HashMap::new();
            for (i, id) in ids.iter().enumerate() {
                if let Some(j) = seen.insert(id.as_str(), i) {
                    return Err(format!(
                        "`class_wnids` lists {id:?} twice (classes {j} and {i}): class ids must be unique"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The shared block's settings.
    pub(crate) fn block(&self) -> BlockConfig {
        BlockConfig {
            hidden_size: self.hidden_size,
            num_heads: self.num_heads,
            qkv_tokens: self.qkv_tokens,
            proj_tokens: self.proj_tokens,
            ffn_tokens: self.ffn_tokens,
            norm_eps: self.norm_eps,
            activation: self.pattention_activation,
            scale_tokens: self.pattention_scale_tokens,
            parallel_residual: false,
        }
    }

    /// Whether `name` is a tensor this config reads (for the loader's unused-tensor check).
    pub fn uses_tensor(&self, name: &str) -> bool {
        let norm = match self.pool {
            Pool::Mean => "fc_norm.",
            Pool::Cls => "final_norm.",
        };
        matches!(
            name,
            "patch_embed.weight"
                | "patch_embed.bias"
                | "cls_token"
                | "pos_embed"
                | "head.weight"
                | "head.bias"
        ) || name.starts_with(norm)
            || name
                .strip_prefix("layers.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(i, _)| i.parse::<usize>().ok())
                .is_some_and(|i| i < self.num_layers)
    }
}

/// The TokenFormer-ViT classifier.
#[derive(Clone, Debug)]
pub struct VisionTransformer {
    /// `patch_embed.weight` flattened to [C·p·p, d] (the convolution as one matmul).
    patch_weight_t: Tensor,
    patch_bias: Tensor,
    cls_token: Tensor,
    pos_embed: Tensor,
    layers: Vec<Block>,
    norm: Norm,
    head: Linear,
    compute: DType,
    cfg: Config,
}

impl VisionTransformer {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        if let Err(e) = cfg.validate() {
            candle_core::bail!("invalid config: {e}")
        }
        let (d, c, p) = (cfg.hidden_size, cfg.num_channels, cfg.patch_size);
        let patch_weight = vb.get((d, c, p, p), "patch_embed.weight")?;
        let patch_weight_t = patch_weight.reshape((d, c * p * p))?.t()?.contiguous()?;
        let patch_bias = vb.get(d, "patch_embed.bias")?;
        let cls_token = vb.get((1, 1, d), "cls_token")?;
        let pos_embed = vb.get((1, cfg.num_patches() + 1, d), "pos_embed")?;
        let block = cfg.block();
        let layers = (0..cfg.num_layers)
            .map(|i| Block::new(&block, vb.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let norm_name = match cfg.pool {
            Pool::Mean => "fc_norm",
            Pool::Cls => "final_norm",
        };
        let norm = Norm::load(d, cfg.norm_eps, vb.pp(norm_name))?;
        let head = Linear::new(
            vb.get((cfg.num_classes, d), "head.weight")?,
            Some(vb.get(cfg.num_classes, "head.bias")?),
        );
        Ok(Self {
            patch_weight_t,
            patch_bias,
            cls_token,
            pos_embed,
            layers,
            norm,
            head,
            compute: DType::F32,
            cfg: cfg.clone(),
        })
    }

    /// The model computing in `dtype` (f32, bf16, f16 or f64), as
    /// [`crate::models::lm::TokenFormerLm::with_compute_dtype`]: pixels are
    /// converted at the input, logits come out as f32.
    pub fn with_compute_dtype(mut self, dtype: DType) -> crate::Result<Self> {
        crate::kernels::check_compute_dtype(dtype)?;
        self.compute = dtype;
        Ok(self)
    }

    /// The dtype of activations and products.
    pub fn compute_dtype(&self) -> DType {
        self.compute
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.cls_token.device()
    }

    pub fn layers(&self) -> &[Block] {
        &self.layers
    }

    /// The stride-p convolution as unfold + one matmul (see
    /// docs/PERFORMANCE.md): pixels [b, C, H, W] → patch tokens [b, N, d],
    /// patches in row-major order.
    pub fn embed_patches(&self, pixels: &Tensor) -> Result<Tensor> {
        let b = self.cfg.image_batch(pixels)?;
        let (c, s, p) = (
            self.cfg.num_channels,
            self.cfg.image_size,
            self.cfg.patch_size,
        );
        let (gh, gw) = (s / p, s / p);
        let patches = pixels
            .to_dtype(self.compute)?
            .reshape((b, c, gh, p, gw, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .contiguous()?
            .reshape((b * gh * gw, c * p * p))?;
        crate::kernels::matmul_nn(&patches, &self.patch_weight_t)?
            .broadcast_add(&self.patch_bias.to_dtype(self.compute)?)?
            .reshape((b, gh * gw, self.cfg.hidden_size))
    }

    /// The input token sequence [b, N+1, d]: class token, then patches, plus
    /// position embeddings (also the image part of a vision-language sequence).
    pub(crate) fn embed(&self, pixels: &Tensor) -> Result<Tensor> {
        let patches = self.embed_patches(pixels)?;
        let b = patches.dim(0)?;
        let cls =
            self.cls_token
                .to_dtype(self.compute)?
                .broadcast_as((b, 1, self.cfg.hidden_size))?;
        Tensor::cat(&[&cls, &patches], 1)?.broadcast_add(&self.pos_embed.to_dtype(self.compute)?)
    }

    /// The final token states [b, N+1, d] (class token first), before pooling,
    /// in the compute dtype: timm's `forward_features`.
    pub fn forward_features(&self, pixels: &Tensor) -> Result<Tensor> {
        let mut x = self.embed(pixels)?;
        for layer in &self.layers {
            x = layer.forward(&x, AttentionMode::Bidirectional)?;
        }
        Ok(x)
    }

    /// Logits [b, num_classes] (f32) of final token states [b, N+1, d].
    pub(crate) fn head(&self, x: &Tensor) -> Result<Tensor> {
        let pooled = self.pool(x)?;
        let w = self.head.weight().to_dtype(pooled.dtype())?;
        let bias = self.head.bias().map(|b| b.to_dtype(pooled.dtype()));
        let logits = pooled.matmul(&w.t()?)?;
        match bias {
            Some(b) => logits.broadcast_add(&b?)?,
            None => logits,
        }
        .to_dtype(DType::F32)
    }

    /// The pooled, normalised feature [b, d] that the head reads, in f32
    /// (or f64): the mean, the norm and the small head product are cheap, and
    /// a bf16 mean over 196 tokens would round at every step.
    pub(crate) fn pool(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(1)? - 1;
        let x = crate::kernels::widened(x)?;
        match self.cfg.pool {
            Pool::Mean => self.norm.forward(&x.narrow(1, 1, n)?.mean(1)?),
            // LayerNorm acts per token, so normalising only the class token is
            // the same as normalising all tokens and then taking it.
            Pool::Cls => self.norm.forward(&x.narrow(1, 0, 1)?.squeeze(1)?),
        }
    }

    /// Logits [b, num_classes] for normalised pixels [b, C, H, W].
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        self.head(&self.forward_features(pixels)?)
    }

    /// The image embedding [b, d] (f32) of normalised pixels [b, C, H, W]: the
    /// pooled, normalised feature the head reads, timm's
    /// `forward_head(x, pre_logits=True)` (what a linear probe or a retrieval
    /// index takes).
    pub fn pre_logits(&self, pixels: &Tensor) -> Result<Tensor> {
        self.pool(&self.forward_features(pixels)?)?
            .to_dtype(DType::F32)
    }
}

/// Class probabilities [b, classes] from logits.
pub(crate) fn probabilities(logits: &Tensor) -> Result<Tensor> {
    candle_nn::ops::softmax(logits, D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pixels are checked against the configured shape (the ViT's and the training
    /// embedding's one check), and a batch of no images is refused by name.
    #[test]
    fn pixels_must_match_the_config_and_hold_an_image() {
        let mut cfg = Config::imagenet(1, 8, 2, 8, 16);
        cfg.image_size = 8;
        cfg.patch_size = 4;
        let px = |dims: (usize, usize, usize, usize)| Tensor::zeros(dims, DType::F32, &Device::Cpu);
        assert_eq!(cfg.image_batch(&px((2, 3, 8, 8)).unwrap()).unwrap(), 2);
        let e = cfg.image_batch(&px((0, 3, 8, 8)).unwrap()).unwrap_err();
        assert!(
            e.to_string()
                .contains("no images: pixels of shape [0, 3, 8, 8]"),
            "{e}"
        );
        let e = cfg.image_batch(&px((1, 3, 8, 9)).unwrap()).unwrap_err();
        let want = "pixels of shape [1, 3, 8, 9], expected [batch, 3, 8, 8]";
        assert!(e.to_string().contains(want), "{e}");
    }
}
