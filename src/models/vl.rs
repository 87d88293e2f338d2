//! The merged vision-language TokenFormer (`architecture: "tokenformer-vl"`),
//! after the paper's future-work proposal (<https://arxiv.org/abs/2410.23168>,
//! Section 6): each Pattention layer holds [vision | language | bridge] tokens.
//! An image token's Θ runs over the vision and bridge tokens, a text token's
//! over the language and bridge tokens, each with its source's √n. Bridge keys
//! start at zero (a zero score adds nothing to the L2 norm, GELU(0) = 0), so
//! at creation each modality computes exactly what its source computed. The
//! bridge acts in mixed [image; text] sequences only: a merged checkpoint loaded
//! as a language model or a classifier runs its source's own tokens, so text
//! alone and images alone stay exact after the bridge is trained.
//!
//! A route is an ordinary [`VisionTransformer`] / [`TokenFormerLm`] over its
//! group plus the bridge; the mixed sequence runs both routes' [`Block`]s, text
//! attending causally after the image (rotary positions count text only).

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::checkpoint::Tensors;
use crate::models::block::{AttentionMode, Block, LayerCache, ScaleTokens};
use crate::models::lm::{self, Cache, TokenFormerLm};
use crate::models::vit::{self, VisionTransformer};

pub const ARCHITECTURE: &str = "tokenformer-vl";

/// Token counts of one Pattention kind, in storage order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Groups {
    pub vision: usize,
    pub language: usize,
    pub bridge: usize,
}

impl Groups {
    pub(crate) fn total(&self) -> usize {
        self.vision + self.language + self.bridge
    }
}

/// Groups of the three Pattention kinds (q/k/v share one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PattentionGroups {
    pub qkv: Groups,
    pub proj: Groups,
    pub ffn: Groups,
}

/// `config.json` of a merged folder: both sources' configs as they were
/// (their token counts are their groups' sizes, their √n constants are the
/// routes'), the bridge size and the groups.
///
/// Written and read with `"architecture": "tokenformer-vl"` first, and each
/// source's config with its own architecture.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "architecture",
    rename = "tokenformer-vl",
    deny_unknown_fields,
    remote = "Self"
)]
pub struct Config {
    pub vision: vit::Config,
    pub language: lm::Config,
    pub bridge_tokens: usize,
    pub pattention_groups: PattentionGroups,
}

fn scale_or(s: Option<ScaleTokens>, qkv: usize, proj: usize, ffn: usize) -> ScaleTokens {
    s.unwrap_or(ScaleTokens { qkv, proj, ffn })
}

impl Config {
    /// The config of two sources merged with `bridge` new tokens per layer.
    pub fn merged(
        vision: &vit::Config,
        language: &lm::Config,
        bridge: usize,
    ) -> std::result::Result<Self, String> {
        let g = |v: usize, l: usize| Groups {
            vision: v,
            language: l,
            bridge,
        };
        let cfg = Self {
            vision: vision.clone(),
            language: language.clone(),
            bridge_tokens: bridge,
            pattention_groups: PattentionGroups {
                qkv: g(vision.qkv_tokens, language.qkv_tokens),
                proj: g(vision.proj_tokens, language.proj_tokens),
                ffn: g(vision.ffn_tokens, language.ffn_tokens),
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Same width, depth and heads; groups consistent with the sources.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let (v, l) = (&self.vision, &self.language);
        v.validate().map_err(|e| format!("vision: {e}"))?;
        l.validate().map_err(|e| format!("language: {e}"))?;
        // The routes hold their own tokens plus the bridge.
        let max = lm::limits::MAX_TOKENS;
        lm::check_range("bridge_tokens", self.bridge_tokens, 0, max)?;
        for (what, n) in [
            ("vision.qkv_tokens", v.qkv_tokens),
            ("vision.proj_tokens", v.proj_tokens),
            ("vision.ffn_tokens", v.ffn_tokens),
            ("language.qkv_tokens", l.qkv_tokens),
            ("language.proj_tokens", l.proj_tokens),
            ("language.ffn_tokens", l.ffn_tokens),
        ] {
            lm::check_range(
                &format!("{what} + bridge_tokens"),
                n.saturating_add(self.bridge_tokens),
                1,
                max,
            )?;
        }
        for (what, a, b) in [
            ("hidden_size", v.hidden_size, l.hidden_size),
            ("num_layers", v.num_layers, l.num_layers),
            ("num_heads", v.num_heads, l.num_heads),
        ] {
            if a != b {
                return Err(format!("the vision model has {what} {a} but the language model has {b}: they must match to share layers"));
            }
        }
        let g = &self.pattention_groups;
        for (what, grp, nv, nl) in [
            ("qkv", g.qkv, v.qkv_tokens, l.qkv_tokens),
            ("proj", g.proj, v.proj_tokens, l.proj_tokens),
            ("ffn", g.ffn, v.ffn_tokens, l.ffn_tokens),
        ] {
            if grp.vision != nv || grp.language != nl || grp.bridge != self.bridge_tokens {
                return Err(format!(
                    "pattention_groups.{what} {grp:?} disagrees with the sources' {nv}/{nl} tokens and bridge_tokens {}",
                    self.bridge_tokens
                ));
            }
        }
        Ok(())
    }

    /// The vision route as a classifier config: its tokens plus the bridge, its own √n.
    pub(crate) fn vision_route(&self) -> vit::Config {
        let v = &self.vision;
        let mut c = v.clone();
        c.pattention_scale_tokens = Some(scale_or(
            v.pattention_scale_tokens,
            v.qkv_tokens,
            v.proj_tokens,
            v.ffn_tokens,
        ));
        c.qkv_tokens += self.bridge_tokens;
        c.proj_tokens += self.bridge_tokens;
        c.ffn_tokens += self.bridge_tokens;
        c
    }

    /// The language route as a language-model config.
    pub(crate) fn language_route(&self) -> lm::Config {
        let l = &self.language;
        let mut c = l.clone();
        c.pattention_scale_tokens = Some(scale_or(
            l.pattention_scale_tokens,
            l.qkv_tokens,
            l.proj_tokens,
            l.ffn_tokens,
        ));
        c.qkv_tokens += self.bridge_tokens;
        c.proj_tokens += self.bridge_tokens;
        c.ffn_tokens += self.bridge_tokens;
        c
    }

    /// Whether the merged checkpoint has a tensor of this name.
    pub fn uses_tensor(&self, name: &str) -> bool {
        if let Some(n) = name.strip_prefix("vision.") {
            return !n.starts_with("layers.") && self.vision.uses_tensor(n);
        }
        if let Some(n) = name.strip_prefix("language.") {
            return n == "word_embeddings.weight"
                || n.starts_with("final_norm.")
                || (!self.language.tie_word_embeddings && n == "final_linear.weight");
        }
        name.strip_prefix("layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(i, _)| i.parse::<usize>().ok())
            .is_some_and(|i| i < self.vision.num_layers)
    }
}

/// The Pattention parameter names of one layer with their kind.
fn layer_params(i: usize) -> Vec<(String, &'static str)> {
    let mut out = vec![];
    for (p, kind) in [
        ("attention.query", "qkv"),
        ("attention.key", "qkv"),
        ("attention.value", "qkv"),
        ("attention.proj", "proj"),
        ("mlp", "ffn"),
    ] {
        for t in ["key_param_tokens", "value_param_tokens"] {
            out.push((format!("layers.{i}.{p}.{t}"), kind));
        }
    }
    out
}

impl PattentionGroups {
    fn of(&self, kind: &str) -> Groups {
        match kind {
            "qkv" => self.qkv,
            "proj" => self.proj,
            _ => self.ffn,
        }
    }
}

/// The merged checkpoint's tensors from the two sources' canonical tensors:
/// shared layers stacked [vision | language | bridge] (bridge keys zero,
/// values from `bridge_values(name, rows, width)`), everything else kept
/// under `vision.` / `language.`.
pub fn assemble(
    cfg: &Config,
    vision: &Tensors,
    language: &Tensors,
    mut bridge_values: impl FnMut(&str, usize, usize) -> Result<Tensor>,
) -> Result<Tensors> {
    let mut out = Tensors::new();
    for (n, t) in vision {
        if !n.starts_with("layers.") {
            out.insert(format!("vision.{n}"), t.clone());
        }
    }
    for (n, t) in language {
        if !n.starts_with("layers.") {
            out.insert(format!("language.{n}"), t.clone());
        }
    }
    let get = |m: &Tensors, n: &str, who: &str| -> Result<Tensor> {
        m.get(n)
            .cloned()
            .ok_or_else(|| candle_core::Error::Msg(format!("the {who} model has no tensor `{n}`")))
    };
    let d = cfg.vision.hidden_size;
    for i in 0..cfg.vision.num_layers {
        for (name, kind) in layer_params(i) {
            let g = cfg.pattention_groups.of(kind);
            let v = get(vision, &name, "vision")?;
            let l = get(language, &name, "language")?;
            let width = v.dim(1)?;
            let bridge = if name.ends_with("key_param_tokens") {
                Tensor::zeros((g.bridge, d), v.dtype(), v.device())?
            } else {
                bridge_values(&name, g.bridge, width)?.to_dtype(v.dtype())?
            };
            out.insert(name, Tensor::cat(&[&v, &l, &bridge], 0)?);
        }
    }
    Ok(out)
}

/// Rows of one route: its own group, and the bridge if `bridge`.
fn route_rows(t: &Tensor, g: Groups, vision: bool, bridge: bool) -> Result<Tensor> {
    let own = if vision {
        t.narrow(0, 0, g.vision)?
    } else {
        t.narrow(0, g.vision, g.language)?
    };
    if g.bridge == 0 || !bridge {
        return Ok(own);
    }
    Tensor::cat(&[&own, &t.narrow(0, g.vision + g.language, g.bridge)?], 0)
}

/// The shared layers' Pattention tokens of the vision and/or language route
/// (the rows of its own group, and the bridge if `bridge`), taken from `vb`.
fn split_layers(
    cfg: &Config,
    vb: &VarBuilder,
    vision: bool,
    language: bool,
    bridge: bool,
) -> Result<(Tensors, Tensors)> {
    if let Err(e) = cfg.validate() {
        candle_core::bail!("invalid config: {e}")
    }
    let (mut vis, mut lang) = (Tensors::new(), Tensors::new());
    for i in 0..cfg.vision.num_layers {
        for (name, kind) in layer_params(i) {
            let g = cfg.pattention_groups.of(kind);
            let t = vb.get_unchecked(&name)?;
            if t.dim(0)? != g.total() {
                candle_core::bail!(
                    "tensor `{name}` has {} tokens, the groups say {}",
                    t.dim(0)?,
                    g.total()
                )
            }
            if vision {
                vis.insert(name.clone(), route_rows(&t, g, true, bridge)?);
            }
            if language {
                lang.insert(name, route_rows(&t, g, false, bridge)?);
            }
        }
    }
    Ok((vis, lang))
}

/// The language model a merged checkpoint holds, for text alone: the source's
/// own tokens and config, without the bridge, which acts only in mixed
/// sequences; so text runs exactly what the source ran, however the bridge trained.
pub(crate) fn language_route(cfg: &Config, vb: VarBuilder) -> Result<TokenFormerLm> {
    let (_, lang) = split_layers(cfg, &vb, false, true, false)?;
    TokenFormerLm::new(&cfg.language, overlay(lang, vb.pp("language")))
}

/// The classifier a merged checkpoint holds, for images alone: the source's own
/// tokens and config, without the bridge (as [`language_route`]).
pub(crate) fn vision_route(cfg: &Config, vb: VarBuilder) -> Result<VisionTransformer> {
    let (vis, _) = split_layers(cfg, &vb, true, false, false)?;
    VisionTransformer::new(&cfg.vision, overlay(vis, vb.pp("vision")))
}

/// A VarBuilder that hands out `own` tensors by name and asks `rest` for the others.
fn overlay<'a>(own: Tensors, rest: VarBuilder<'a>) -> VarBuilder<'a> {
    let (dtype, device) = (rest.dtype(), rest.device().clone());
    let backend = Overlay {
        own: std::sync::Mutex::new(own),
        rest,
    };
    VarBuilder::from_backend(Box::new(backend), dtype, device)
}

struct Overlay<'a> {
    own: std::sync::Mutex<Tensors>,
    rest: VarBuilder<'a>,
}

impl Overlay<'_> {
    fn take(&self, name: &str) -> Option<Tensor> {
        self.own
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
    }
}

impl candle_nn::var_builder::SimpleBackend for Overlay<'_> {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        match self.take(name) {
            Some(t) if t.shape() != &s => Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt()),
            Some(t) => t.to_device(dev)?.to_dtype(dtype),
            None => self.rest.get_with_hints_dtype(s, name, init, dtype),
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        match self.take(name) {
            Some(t) => t.to_device(dev)?.to_dtype(dtype),
            None => self.rest.get_unchecked_dtype(name, dtype),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        let own = self.own.lock().unwrap_or_else(|e| e.into_inner());
        own.contains_key(name) || self.rest.contains_tensor(name)
    }
}

/// KV cache of a mixed (image + text) sequence: image keys first, then text.
pub struct VlCache {
    cache: Cache,
    image_tokens: usize,
}

impl VlCache {
    /// Positions already cached (image and text).
    pub fn len(&self) -> usize {
        self.cache.len()
    }
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
    /// Text tokens cached = the next text position.
    pub fn text_len(&self) -> usize {
        self.len().saturating_sub(self.image_tokens)
    }
}

/// The merged model: two routes over shared parameter tokens.
#[derive(Clone, Debug)]
pub struct VisionLanguageModel {
    vision: VisionTransformer,
    language: TokenFormerLm,
    cfg: Config,
}

impl VisionLanguageModel {
    /// Builds both routes from a merged checkpoint.
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (vis, lang) = split_layers(cfg, &vb, true, true, true)?;
        Ok(Self {
            vision: VisionTransformer::new(&cfg.vision_route(), overlay(vis, vb.pp("vision")))?,
            language: TokenFormerLm::new(&cfg.language_route(), overlay(lang, vb.pp("language")))?,
            cfg: cfg.clone(),
        })
    }

    /// Builds both routes from the merged checkpoint's tensors (f32).
    pub fn from_tensors(cfg: &Config, tensors: &Tensors, device: &Device) -> Result<Self> {
        let map = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        let vb = VarBuilder::from_tensors(map, DType::F32, device);
        Self::new(cfg, vb)
    }

    /// Both routes computing in `dtype` (f32, bf16, f16 or f64), as
    /// [`TokenFormerLm::with_compute_dtype`]: the image and text tokens, the
    /// image keys the text attends to and the cache in it, reductions in f32
    /// at least, logits out as f32. Load the weights in `dtype`
    /// ([`crate::loader::load_vl_in`]).
    pub fn with_compute_dtype(self, dtype: DType) -> crate::Result<Self> {
        Ok(Self {
            vision: self.vision.with_compute_dtype(dtype)?,
            language: self.language.with_compute_dtype(dtype)?,
            cfg: self.cfg,
        })
    }

    /// The dtype of activations and products (both routes share it).
    pub fn compute_dtype(&self) -> DType {
        self.language.compute_dtype()
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Text-only input runs this: the language model with the bridge tokens in its Pattentions.
    pub fn language(&self) -> &TokenFormerLm {
        &self.language
    }

    /// Image-only input runs this: the classifier with the bridge tokens in its Pattentions.
    pub fn vision(&self) -> &VisionTransformer {
        &self.vision
    }

    pub fn new_cache(&self) -> VlCache {
        self.cache_with(None)
    }

    /// [`Self::new_cache`] keeping keys and values in `kv`.
    pub fn new_cache_with_dtype(&self, kv: lm::KvDtype) -> VlCache {
        self.cache_with(Some(kv.dtype()))
    }

    /// A cache keeping keys and values in `kv` for an image and at most
    /// `text_positions` text tokens (a prompt and its budget, as batched
    /// generation sizes it; at most the model's context).
    pub fn new_cache_for(&self, kv: lm::KvDtype, text_positions: usize) -> VlCache {
        self.cache_for(Some(kv.dtype()), text_positions)
    }

    fn cache_with(&self, dtype: Option<DType>) -> VlCache {
        self.cache_for(dtype, self.cfg.language.max_position_embeddings)
    }

    fn cache_for(&self, dtype: Option<DType>, text_positions: usize) -> VlCache {
        let text = text_positions.min(self.cfg.language.max_position_embeddings);
        let cap = self.vision.config().num_patches() + 1 + text;
        VlCache {
            cache: Cache::with_capacity(self.cfg.language.num_layers, cap, dtype),
            image_tokens: 0,
        }
    }

    /// One new text token for each of several sequences, each with its own
    /// cache: ids [n, 1] → logits [n, 1, vocab] (f32), row r what
    /// [`Self::forward_mixed_with`] gives for `ids[r]` with `caches[r]` alone,
    /// up to float rounding. The image tokens are in the caches already, so a
    /// step is the language model's ([`TokenFormerLm::forward_rows`]), each
    /// row at its own text position.
    pub fn forward_rows(&self, ids: &Tensor, caches: &mut [&mut VlCache]) -> Result<Tensor> {
        let positions: Vec<usize> = caches.iter().map(|c| c.text_len()).collect();
        let mut inner: Vec<&mut Cache> = caches.iter_mut().map(|c| &mut c.cache).collect();
        self.language.forward_rows_at(ids, &mut inner, &positions)
    }

    /// One layer of the mixed sequence. Image rows attend only to image rows,
    /// exactly as in the classifier; text rows attend causally to text and to
    /// all image rows (from the cache when decoding): image keys come first,
    /// so the causal rule treats the image as the past.
    fn mixed_layer(
        &self,
        i: usize,
        img: Option<&Tensor>,
        txt: &Tensor,
        text_offset: usize,
        cache: Option<&mut LayerCache>,
    ) -> Result<(Option<Tensor>, Tensor)> {
        let (vb, lb): (&Block, &Block) = (&self.vision.layers()[i], &self.language.layers()[i]);
        let (img_out, image_kv) = match img {
            Some(x) => {
                let (x, kv) = vb.forward_kv(x, AttentionMode::Bidirectional, None)?;
                (Some(x), Some(kv))
            }
            None => (None, None),
        };
        let mode = AttentionMode::Causal {
            rotary: self.language.rotary(),
            offset: text_offset,
            cache,
        };
        // One image before several texts: its keys serve every text row.
        let b = txt.dim(0)?;
        let image_kv = match image_kv {
            Some((k, v)) if k.dim(0)? == 1 && b > 1 => {
                let (_, h, n, d) = k.dims4()?;
                Some((k.expand((b, h, n, d))?, v.expand((b, h, n, d))?))
            }
            kv => kv,
        };
        let (txt, _) = lb.forward_kv(txt, mode, image_kv.as_ref())?;
        Ok((img_out, txt))
    }

    /// The mixed sequence [image tokens; text tokens]: pixels [b, C, H, W]
    /// (or None to continue from the cache) and ids [b, t]. Returns the image
    /// logits (when pixels were given) and the text logits [b, t, vocab].
    /// Without a cache, pixels [1, C, H, W] put one image before each of the
    /// b texts (its tokens are computed once; the image logits are [1, ...]).
    pub fn forward_mixed(
        &self,
        pixels: Option<&Tensor>,
        ids: &Tensor,
        cache: Option<&mut VlCache>,
    ) -> Result<(Option<Tensor>, Tensor)> {
        self.forward_mixed_with(pixels, ids, cache, lm::Logits::All)
    }

    /// [`Self::forward_mixed`] with text logits for the positions `which`
    /// names only (a generation step reads the last).
    pub fn forward_mixed_with(
        &self,
        pixels: Option<&Tensor>,
        ids: &Tensor,
        cache: Option<&mut VlCache>,
        which: lm::Logits,
    ) -> Result<(Option<Tensor>, Tensor)> {
        crate::kernels::run_forward(ids.device(), self.rows(pixels, ids), || {
            let (img, txt) = self.hidden_mixed(pixels, ids, cache)?;
            let image_logits = img.map(|x| self.vision.head(&x)).transpose()?;
            Ok((image_logits, self.language.head(&which.rows(&txt)?)?))
        })
    }

    /// The text's last hidden states [b, t, d] (before the final norm) after
    /// the image `pixels` ([1 or b, C, H, W]): what scoring reads for the
    /// rows it scores, so that the output layer runs on those rows only.
    pub(crate) fn text_hidden(&self, pixels: &Tensor, ids: &Tensor) -> Result<Tensor> {
        crate::kernels::run_forward(ids.device(), self.rows(Some(pixels), ids), || {
            Ok(self.hidden_mixed(Some(pixels), ids, None)?.1)
        })
    }

    /// Input rows of a mixed forward (image tokens and text tokens), which
    /// decide where [`crate::kernels::run_forward`] runs it.
    fn rows(&self, pixels: Option<&Tensor>, ids: &Tensor) -> usize {
        let images = pixels.map_or(0, |p| p.dims().first().copied().unwrap_or(0));
        images * (self.vision.config().num_patches() + 1) + ids.elem_count()
    }

    /// The image's and the text's last hidden states of the mixed sequence.
    fn hidden_mixed(
        &self,
        pixels: Option<&Tensor>,
        ids: &Tensor,
        mut cache: Option<&mut VlCache>,
    ) -> Result<(Option<Tensor>, Tensor)> {
        let (b, t) = ids.dims2()?;
        if b == 0 || t == 0 {
            candle_core::bail!("no text tokens to run: ids of shape [{b}, {t}]")
        }
        if let Some(p) = pixels {
            let images = p.dims().first().copied().unwrap_or(0);
            if images != b && (images != 1 || cache.is_some()) {
                candle_core::bail!(
                    "{images} images for {b} texts: give one image per text, or one for all \
                     (without a cache)"
                )
            }
        }
        if let Some(c) = cache.as_deref_mut() {
            if pixels.is_some() {
                if !c.is_empty() {
                    candle_core::bail!(
                        "the image must come first: start a new cache for a new image"
                    )
                }
                c.image_tokens = self.vision.config().num_patches() + 1;
            }
        }
        // Text positions count from 0 after the image, whatever its length.
        let offset = match (&cache, pixels) {
            (Some(c), None) => c.text_len(),
            _ => 0,
        };
        let max = self.cfg.language.max_position_embeddings;
        if offset + t > max {
            candle_core::bail!(
                "{} text tokens exceed the model's {max} positions",
                offset + t
            )
        }
        let mut img = pixels.map(|p| self.vision.embed(p)).transpose()?;
        let mut txt = self.language.embed(ids)?;
        for i in 0..self.cfg.language.num_layers {
            let lc = cache.as_deref_mut().map(|c| c.cache.layer(i));
            let (ni, nt) = self.mixed_layer(i, img.as_ref(), &txt, offset, lc)?;
            img = ni;
            txt = nt;
        }
        Ok((img, txt))
    }
}
