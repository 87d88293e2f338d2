//! The TokenFormer language model (decoder-only, GPT-NeoX layout): its
//! config, KV cache and forward over the shared [`Block`], then a final
//! LayerNorm and logits against the tied word embeddings, as the official
//! `megatron/model/tokenformer.py` (<https://arxiv.org/abs/2410.23168>).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

pub use crate::models::block::ScaleTokens;
use crate::models::block::{AttentionMode, Block, BlockConfig, LayerCache, Norm, Rotary};
use crate::pattention::Activation;

fn default_rotary_pct() -> f64 {
    0.25
}
fn default_rotary_base() -> f64 {
    10_000.0
}
fn default_norm_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}

/// The Pattention modules of every layer (`layers.{i}.{name}`), in
/// checkpoint order.
pub const PATTENTIONS: [&str; 5] = [
    "attention.query",
    "attention.key",
    "attention.value",
    "attention.proj",
    "mlp",
];

/// `config.json` of a canonical language-model folder. It is written and read
/// with `"architecture": "tokenformer-lm"` first (see [`crate::models::ModelConfig`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "architecture",
    rename = "tokenformer-lm",
    deny_unknown_fields,
    remote = "Self"
)]
pub struct Config {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub qkv_tokens: usize,
    pub proj_tokens: usize,
    pub ffn_tokens: usize,
    /// Rows of the word embedding (the tokenizer's vocabulary padded to 128).
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "default_rotary_pct")]
    pub rotary_pct: f64,
    #[serde(default = "default_rotary_base")]
    pub rotary_base: f64,
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    #[serde(default)]
    pub pattention_activation: Activation,
    #[serde(default)]
    pub eos_token_id: u32,
    /// Logits against the word embeddings (true, every released model) or a
    /// separate `final_linear.weight` (models imported from untied sources).
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// √n constants when they differ from the token counts (grown models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattention_scale_tokens: Option<ScaleTokens>,
    /// Token counts before the last `grow`: the rows after these are the appended
    /// tokens (what `train --train new` trains).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grown_from_tokens: Option<ScaleTokens>,
    /// GPT-NeoX's parallel residual, x + attn(LN x) + mlp(LN x), instead of the
    /// sequential block (Pythia-style imports keep their structure).
    #[serde(default, skip_serializing_if = "is_false")]
    pub parallel_residual: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

pub const ARCHITECTURE: &str = "tokenformer-lm";

impl Config {
    /// The released TokenFormer LM shape with the GPT-NeoX vocabulary.
    pub fn released(num_layers: usize, hidden_size: usize, num_heads: usize) -> Self {
        Self {
            hidden_size,
            num_layers,
            num_heads,
            qkv_tokens: hidden_size,
            proj_tokens: hidden_size,
            ffn_tokens: 4 * hidden_size,
            vocab_size: 50_304,
            max_position_embeddings: 2048,
            rotary_pct: 0.25,
            rotary_base: 10_000.0,
            norm_eps: 1e-5,
            pattention_activation: Activation::L2NormGelu,
            eos_token_id: 0,
            tie_word_embeddings: true,
            pattention_scale_tokens: None,
            grown_from_tokens: None,
            parallel_residual: false,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// [`PATTENTIONS`] with their parameter-token counts.
    pub fn pattentions(&self) -> [(&'static str, usize); 5] {
        let [q, k, v, o, f] = PATTENTIONS;
        [
            (q, self.qkv_tokens),
            (k, self.qkv_tokens),
            (v, self.qkv_tokens),
            (o, self.proj_tokens),
            (f, self.ffn_tokens),
        ]
    }

    /// Checks what serde cannot: every number within its range (see
    /// `limits`), divisibility, and the sizes derived from them. Every
    /// loader calls this before anything is allocated from the config.
    pub fn validate(&self) -> std::result::Result<(), String> {
        use limits::*;
        check_block(
            self.hidden_size,
            self.num_layers,
            self.num_heads,
            [self.qkv_tokens, self.proj_tokens, self.ffn_tokens],
            self.pattention_scale_tokens,
        )?;
        check_range("vocab_size", self.vocab_size, 1, MAX_VOCAB)?;
        check_range(
            "max_position_embeddings",
            self.max_position_embeddings,
            1,
            MAX_POSITIONS,
        )?;
        check_range(
            "max_position_embeddings × hidden_size (one layer's KV cache)",
            self.max_position_embeddings
                .saturating_mul(self.hidden_size),
            1,
            MAX_CACHE_VALUES,
        )?;
        if let Some(g) = self.grown_from_tokens {
            g.check_grown_into([self.qkv_tokens, self.proj_tokens, self.ffn_tokens])?;
        }
        check_float("rotary_pct", self.rotary_pct, 0.0, false, 1.0)?;
        check_float("rotary_base", self.rotary_base, 1.0, true, MAX_ROTARY_BASE)?;
        check_float("norm_eps", self.norm_eps, 0.0, false, 1.0)?;
        if !self.rotary_dims().is_multiple_of(2) {
            return Err(format!(
                "rotary dims int({} * {}) must be even",
                self.rotary_pct,
                self.head_dim()
            ));
        }
        if u64::from(self.eos_token_id) >= self.vocab_size as u64 {
            return Err(format!(
                "`eos_token_id` is {}, allowed 0..={} (below vocab_size {})",
                self.eos_token_id,
                self.vocab_size - 1,
                self.vocab_size
            ));
        }
        Ok(())
    }

    /// int(rotary_pct · head_dim), as GPT-NeoX.
    pub fn rotary_dims(&self) -> usize {
        (self.head_dim() as f64 * self.rotary_pct) as usize
    }

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
            parallel_residual: self.parallel_residual,
        }
    }
}

/// Upper bounds of config values: far above any released or imported model,
/// low enough that nothing computed from them (rotary tables, KV caches,
/// token and shape products) overflows or allocates without bound before
/// the checkpoint's own tensor sizes are checked against the config.
pub(crate) mod limits {
    pub(crate) const MAX_HIDDEN_SIZE: usize = 1 << 16;
    pub(crate) const MAX_LAYERS: usize = 1 << 10;
    /// Parameter tokens of one Pattention layer.
    pub(crate) const MAX_TOKENS: usize = 1 << 24;
    /// A √n constant (`pattention_scale_tokens`): only a number, but one that
    /// converts to f64 exactly (imported models use 2·d·10⁶).
    pub(crate) const MAX_SCALE_TOKENS: usize = 1 << 53;
    pub(crate) const MAX_VOCAB: usize = 1 << 24;
    pub(crate) const MAX_POSITIONS: usize = 1 << 20;
    /// Positions × hidden size: one layer's preallocated KV cache (batch 1).
    pub(crate) const MAX_CACHE_VALUES: usize = 1 << 30;
    pub(crate) const MAX_ROTARY_BASE: f64 = 1e12;
}

/// `key` must lie in lo..=hi.
pub(crate) fn check_range(
    key: &str,
    v: usize,
    lo: usize,
    hi: usize,
) -> std::result::Result<(), String> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(format!("`{key}` is {v}, allowed {lo}..={hi}"))
    }
}

/// `key` must be finite and in (lo, hi], or [lo, hi] with `lo_inclusive`.
pub(crate) fn check_float(
    key: &str,
    v: f64,
    lo: f64,
    lo_inclusive: bool,
    hi: f64,
) -> std::result::Result<(), String> {
    let above = if lo_inclusive { v >= lo } else { v > lo };
    if v.is_finite() && above && v <= hi {
        Ok(())
    } else {
        let open = if lo_inclusive { '[' } else { '(' };
        Err(format!(
            "`{key}` is {v}, allowed a finite number in {open}{lo}, {hi}]"
        ))
    }
}

/// `a` must be a multiple of `b` (b ≥ 1).
pub(crate) fn check_divides(
    a_key: &str,
    a: usize,
    b_key: &str,
    b: usize,
) -> std::result::Result<(), String> {
    if b == 0 || !a.is_multiple_of(b) {
        return Err(format!("`{a_key}` {a} is not divisible by `{b_key}` {b}"));
    }
    Ok(())
}

/// The block shape every architecture shares: width, depth, heads, the Pattention
/// token counts (q/k/v, proj, ffn) and their √n constants.
pub(crate) fn check_block(
    hidden_size: usize,
    num_layers: usize,
    num_heads: usize,
    [qkv, proj, ffn]: [usize; 3],
    scale: Option<ScaleTokens>,
) -> std::result::Result<(), String> {
    use limits::{MAX_HIDDEN_SIZE, MAX_LAYERS, MAX_SCALE_TOKENS, MAX_TOKENS};
    check_range("hidden_size", hidden_size, 1, MAX_HIDDEN_SIZE)?;
    check_range("num_layers", num_layers, 1, MAX_LAYERS)?;
    check_range("num_heads", num_heads, 1, hidden_size)?;
    check_divides("hidden_size", hidden_size, "num_heads", num_heads)?;
    check_range("qkv_tokens", qkv, 1, MAX_TOKENS)?;
    check_range("proj_tokens", proj, 1, MAX_TOKENS)?;
    check_range("ffn_tokens", ffn, 1, MAX_TOKENS)?;
    if let Some(s) = scale {
        check_range("pattention_scale_tokens.qkv", s.qkv, 1, MAX_SCALE_TOKENS)?;
        check_range("pattention_scale_tokens.proj", s.proj, 1, MAX_SCALE_TOKENS)?;
        check_range("pattention_scale_tokens.ffn", s.ffn, 1, MAX_SCALE_TOKENS)?;
    }
    Ok(())
}

/// The precision a KV cache keeps keys and values in; attention computes in
/// f32 either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtype {
    /// Never rounded: f32 for a model computing in f32; a model computing in
    /// bf16 or f16 keeps its own keys and values as they are (in f32 they
    /// would be the same values at twice the memory).
    #[default]
    F32,
    /// Half the cache's memory and the bytes a decode step reads from it;
    /// keys and values rounded to f16 (accuracy in docs/PERFORMANCE.md).
    F16,
}

impl KvDtype {
    pub fn dtype(self) -> DType {
        match self {
            KvDtype::F32 => DType::F32,
            KvDtype::F16 => DType::F16,
        }
    }
}

/// Which positions a forward computes logits for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Logits {
    /// Every position, [b, t, vocab]: scoring and evaluation.
    #[default]
    All,
    /// The last position only, [b, 1, vocab]: all that generation reads
    /// (transformers' `logits_to_keep=1`). The output layer is about a
    /// quarter of a 150M prefill's products, and its [t, vocab] logits the
    /// largest activation.
    Last,
}

impl Logits {
    /// The rows of hidden states [b, t, d] the output layer needs.
    pub(crate) fn rows(self, h: &Tensor) -> Result<Tensor> {
        match self {
            Logits::All => Ok(h.clone()),
            Logits::Last => {
                let t = h.dim(1)?;
                if t == 0 {
                    candle_core::bail!("no position to take the last logits of")
                }
                h.narrow(1, t - 1, 1)?.contiguous()
            }
        }
    }
}

/// Per-layer KV cache for incremental decoding.
pub struct Cache {
    layers: Vec<LayerCache>,
}

impl Cache {
    /// Keys and values kept as the model computes them (f32 on the CPU).
    pub fn new(cfg: &Config) -> Self {
        Self::with_capacity(cfg.num_layers, cfg.max_position_embeddings, None)
    }
    /// Keys and values kept in `kv`.
    pub fn with_dtype(cfg: &Config, kv: KvDtype) -> Self {
        Self::with_capacity(
            cfg.num_layers,
            cfg.max_position_embeddings,
            Some(kv.dtype()),
        )
    }
    /// Room for `positions` tokens only (a sequence whose length is known,
    /// such as a prompt and its token budget), keys and values kept in `kv`.
    pub fn for_positions(cfg: &Config, kv: KvDtype, positions: usize) -> Self {
        let positions = positions.min(cfg.max_position_embeddings);
        Self::with_capacity(cfg.num_layers, positions, Some(kv.dtype()))
    }
    pub(crate) fn with_capacity(layers: usize, positions: usize, dtype: Option<DType>) -> Self {
        Self {
            layers: (0..layers)
                .map(|_| LayerCache::with_dtype(positions, dtype))
                .collect(),
        }
    }
    pub(crate) fn layer(&mut self, i: usize) -> &mut LayerCache {
        &mut self.layers[i]
    }
    /// Tokens already in the cache (= the next position).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A weight matrix of the language model outside the Pattention layers.
#[derive(Clone, Debug)]
enum Matrix {
    /// f32 or f16.
    Dense(Tensor),
    Q8(crate::kernels::Q8Matrix),
}

impl Matrix {
    fn bytes(&self) -> usize {
        match self {
            Matrix::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Matrix::Q8(q) => q.bytes(),
        }
    }
}

/// The TokenFormer causal language model. The VarBuilder's dtype is the
/// precision its weight matrices are kept in (f32, or f16 to halve memory and
/// decode traffic; [`TokenFormerLm::quantize_q8`] makes them 8-bit);
/// activations and products are f32 unless [`TokenFormerLm::with_compute_dtype`]
/// says otherwise (bf16 on a GPU). Norms, Θ's normalisation and softmaxes
/// always reduce in f32, and logits come out as f32 (in the compute dtype
/// from [`TokenFormerLm::forward_in_compute_dtype`]).
#[derive(Clone, Debug)]
pub struct TokenFormerLm {
    word_embeddings: Matrix,
    layers: Vec<Block>,
    final_norm: Norm,
    final_linear: Option<Matrix>,
    rotary: Rotary,
    compute: DType,
    cfg: Config,
}

impl TokenFormerLm {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        if let Err(e) = cfg.validate() {
            candle_core::bail!("invalid config: {e}")
        }
        let d = cfg.hidden_size;
        let word_embeddings = vb.get((cfg.vocab_size, d), "word_embeddings.weight")?;
        let block = cfg.block();
        let layers = (0..cfg.num_layers)
            .map(|i| Block::new(&block, vb.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = Norm::load(d, cfg.norm_eps, vb.pp("final_norm"))?;
        let final_linear = if cfg.tie_word_embeddings {
            None
        } else {
            Some(vb.get((cfg.vocab_size, d), "final_linear.weight")?)
        };
        let rotary = Rotary::new(
            cfg.rotary_dims(),
            cfg.rotary_base,
            cfg.max_position_embeddings,
            vb.device(),
        )?;
        Ok(Self {
            word_embeddings: Matrix::Dense(word_embeddings),
            layers,
            final_norm,
            final_linear: final_linear.map(Matrix::Dense),
            rotary,
            compute: DType::F32,
            cfg: cfg.clone(),
        })
    }

    /// The model computing in `dtype` (f32, bf16, f16 or f64): activations
    /// and products in it, reductions in f32 at least. Weights in another
    /// dtype are converted at each product, so load them in `dtype`
    /// ([`crate::loader::load_lm_in`]). The CPU's fused kernels serve f32
    /// only; other dtypes take plain candle ops there.
    pub fn with_compute_dtype(mut self, dtype: DType) -> crate::Result<Self> {
        crate::kernels::check_compute_dtype(dtype)?;
        if dtype != DType::F32 && matches!(self.word_embeddings, Matrix::Q8(_)) {
            return Err(crate::Error::input(
                "8-bit weights compute in f32 only".to_string(),
            ));
        }
        self.compute = dtype;
        Ok(self)
    }

    /// The dtype of activations and products.
    pub fn compute_dtype(&self) -> DType {
        self.compute
    }

    /// The model with every weight matrix in 8 bits ([`crate::kernels::q8`]:
    /// the products quantise their activations alike). Each matrix is
    /// replaced as soon as it is quantised, so memory peaks at the old
    /// weights plus one 8-bit matrix.
    pub fn quantize_q8(mut self) -> crate::Result<Self> {
        let q8 = |m: &Matrix, name: &str| -> crate::Result<Matrix> {
            Ok(match m {
                Matrix::Dense(t) => Matrix::Q8(crate::kernels::Q8Matrix::quantize(t, name)?),
                q @ Matrix::Q8(_) => q.clone(),
            })
        };
        self.word_embeddings = q8(&self.word_embeddings, "word_embeddings.weight")?;
        if let Some(m) = &self.final_linear {
            self.final_linear = Some(q8(m, "final_linear.weight")?);
        }
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let at = |m: &str| format!("layers.{i}.{m}");
            let a = &mut layer.attention;
            a.query = a.query.quantize_q8(&at("attention.query"))?;
            a.key = a.key.quantize_q8(&at("attention.key"))?;
            a.value = a.value.quantize_q8(&at("attention.value"))?;
            a.proj = a.proj.quantize_q8(&at("attention.proj"))?;
            layer.mlp = layer.mlp.quantize_q8(&at("mlp"))?;
        }
        Ok(self)
    }

    /// Bytes the weight matrices hold in their stored precision.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let a = &l.attention;
                [&a.query, &a.key, &a.value, &a.proj, &l.mlp]
                    .iter()
                    .map(|p| p.weight_bytes())
                    .sum::<usize>()
            })
            .sum();
        layers + self.word_embeddings.bytes() + self.final_linear.as_ref().map_or(0, Matrix::bytes)
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.final_norm.weight().device()
    }

    pub fn layers(&self) -> &[Block] {
        &self.layers
    }

    /// The rotary tables (text positions of the vision-language model).
    pub(crate) fn rotary(&self) -> &Rotary {
        &self.rotary
    }

    /// Rejects ids outside the embedding table (a tokenizer/model mismatch).
    pub(crate) fn check_ids(&self, ids: &[u32]) -> crate::Result<()> {
        match ids.iter().find(|&&i| i as usize >= self.cfg.vocab_size) {
            Some(bad) => Err(crate::Error::input(format!(
                "token id {bad} is outside the model's vocabulary of {} (does the tokenizer belong to this model?)",
                self.cfg.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// Token embeddings [b, t, d] of ids [b, t].
    pub(crate) fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let rows = match &self.word_embeddings {
            Matrix::Dense(w) => w.index_select(&ids.flatten_all()?, 0)?,
            Matrix::Q8(w) => w
                .select_rows(&ids.flatten_all()?.to_vec1::<u32>()?)?
                .to_device(self.device())?,
        };
        rows.to_dtype(self.compute)?
            .reshape((b, t, self.cfg.hidden_size))
    }

    /// Final norm and output projection: hidden [b, t, d] → logits [b, t, vocab], f32.
    pub(crate) fn head(&self, h: &Tensor) -> Result<Tensor> {
        self.head_in_own_dtype(h)?.to_dtype(DType::F32)
    }

    /// [`Self::head`] with the logits in the compute dtype (f32 for 8-bit weights).
    fn head_in_own_dtype(&self, h: &Tensor) -> Result<Tensor> {
        match self.final_linear.as_ref().unwrap_or(&self.word_embeddings) {
            Matrix::Dense(out) => self.head_in_compute_dtype(h, out),
            Matrix::Q8(out) => {
                let (b, t, d) = h.dims3()?;
                let h = self.final_norm.forward(h)?.reshape((b * t, d))?;
                crate::kernels::matmul_nt_q8(&h, out)?.reshape((b, t, self.cfg.vocab_size))
            }
        }
    }

    /// The output projection [vocab, d] in its stored precision (f32 for
    /// 8-bit weights, dequantised).
    pub(crate) fn output_matrix(&self) -> Tensor {
        match self.final_linear.as_ref().unwrap_or(&self.word_embeddings) {
            Matrix::Dense(t) => t.clone(),
            Matrix::Q8(q) => q.dequantize().expect("a CPU tensor of its own size"),
        }
    }

    /// The final norm and output projection against `out`, the output matrix
    /// or a copy of it in another precision (a caller running the head on
    /// many row chunks widens f16 weights once instead of once per chunk),
    /// with the logits in the product's dtype (bf16 logits of a bf16 model):
    /// for a reader that widens them itself, such as the GPU's
    /// log-softmax-gather, so that they are not written twice.
    pub(crate) fn head_in_compute_dtype(&self, h: &Tensor, out: &Tensor) -> Result<Tensor> {
        let (b, t, d) = h.dims3()?;
        let h = self.final_norm.forward(h)?.reshape((b * t, d))?;
        crate::kernels::matmul_nt(&h, out)?.reshape((b, t, self.cfg.vocab_size))
    }

    /// Logits [b, t, vocab] for ids [b, t]. With a cache, positions continue
    /// from the cached length and the new keys/values are appended to it.
    pub fn forward(&self, ids: &Tensor, cache: Option<&mut Cache>) -> Result<Tensor> {
        self.forward_with(ids, cache, Logits::All)
    }

    /// [`Self::forward`] with logits for the positions `which` names only
    /// ([b, 1, vocab] for [`Logits::Last`], what a generation step reads).
    pub fn forward_with(
        &self,
        ids: &Tensor,
        cache: Option<&mut Cache>,
        which: Logits,
    ) -> Result<Tensor> {
        self.forward_in_compute_dtype(ids, cache, which)?
            .to_dtype(DType::F32)
    }

    /// [`Self::forward_with`] with the logits left in the compute dtype: bf16
    /// logits of a bf16 model, as PyTorch and transformers return them, for a
    /// caller that reads them as they are. Widening a 16×2048 prefill's bf16
    /// logits to f32 would write 6.6 GB more.
    pub fn forward_in_compute_dtype(
        &self,
        ids: &Tensor,
        cache: Option<&mut Cache>,
        which: Logits,
    ) -> Result<Tensor> {
        crate::kernels::run_forward(ids.device(), ids.elem_count(), || {
            self.forward_here(ids, cache, which)
        })
    }

    /// One new token for each of several sequences, each at its own
    /// position with its own cache: ids [n, 1] → logits [n, 1, vocab] (f32),
    /// row r what [`Self::forward_with`] gives for `ids[r]` with `caches[r]`
    /// alone, up to float rounding. The rows share the Pattention products, so
    /// a decode step reads the weights once for all of them (batched
    /// generation); attention is per row, over that row's cache.
    pub fn forward_rows(&self, ids: &Tensor, caches: &mut [&mut Cache]) -> Result<Tensor> {
        let positions: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        self.forward_rows_at(ids, caches, &positions)
    }

    /// [`Self::forward_rows`] with row r at rotary position `positions[r]`,
    /// for caches that hold more than the text (a vision-language model's
    /// image tokens come first and take no text position).
    pub(crate) fn forward_rows_at(
        &self,
        ids: &Tensor,
        caches: &mut [&mut Cache],
        positions: &[usize],
    ) -> Result<Tensor> {
        let (n, t) = ids.dims2()?;
        if n == 0 || t != 1 || n != caches.len() || n != positions.len() {
            candle_core::bail!(
                "forward_rows takes one token, a cache and a position per row: ids [{n}, {t}], {} caches, {} positions",
                caches.len(),
                positions.len()
            )
        }
        let max = self.cfg.max_position_embeddings;
        for (c, &p) in caches.iter().zip(positions) {
            if c.layers.len() != self.layers.len() {
                candle_core::bail!(
                    "a cache of {} layers for a model of {}",
                    c.layers.len(),
                    self.layers.len()
                )
            }
            if p + 1 > max {
                candle_core::bail!(
                    "sequence of {} tokens exceeds the model's maximum of {max} positions",
                    p + 1
                )
            }
        }
        let logits = crate::kernels::run_forward(ids.device(), n, || {
            let mut x = self.embed(ids)?;
            for (i, layer) in self.layers.iter().enumerate() {
                let mode = AttentionMode::Rows {
                    rotary: &self.rotary,
                    caches: caches.iter_mut().map(|c| &mut c.layers[i]).collect(),
                    positions,
                };
                x = layer.forward(&x, mode)?;
            }
            self.head_in_own_dtype(&x)
        })?;
        logits.to_dtype(DType::F32)
    }

    fn forward_here(
        &self,
        ids: &Tensor,
        mut cache: Option<&mut Cache>,
        which: Logits,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if b == 0 || t == 0 {
            candle_core::bail!("no tokens to run: ids of shape [{b}, {t}]")
        }
        let offset = cache.as_ref().map_or(0, |c| c.len());
        let max = self.cfg.max_position_embeddings;
        if offset + t > max {
            candle_core::bail!(
                "sequence of {} tokens exceeds the model's maximum of {max} positions",
                offset + t
            )
        }
        let mut x = self.embed(ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mode = AttentionMode::Causal {
                rotary: &self.rotary,
                offset,
                cache: cache.as_mut().map(|c| &mut c.layers[i]),
            };
            x = layer.forward(&x, mode)?;
        }
        self.head_in_own_dtype(&which.rows(&x)?)
    }
}
