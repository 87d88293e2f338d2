//! The transformer block every TokenFormer model shares: pre-norm, q/k/v/proj
//! and the feed-forward as Pattention layers, multi-head attention (causal with
//! GPT-NeoX rotary positions and a KV cache, or bidirectional), and the
//! non-parametric LayerNorm of the official `layernorm_nonparam`.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{LayerNorm, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::pattention::{Activation, Fused, Pattention};

/// The √n constants of the three Pattention kinds. Absent in a config means
/// "the layer's token count", which is what the official code does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScaleTokens {
    pub qkv: usize,
    pub proj: usize,
    pub ffn: usize,
}

impl ScaleTokens {
    /// `grown_from_tokens` of a config: each count between 1 and the layer's
    /// token count `now` (a model grows by appending tokens).
    pub(crate) fn check_grown_into(&self, now: [usize; 3]) -> std::result::Result<(), String> {
        for (key, old, now) in [
            ("qkv", self.qkv, now[0]),
            ("proj", self.proj, now[1]),
            ("ffn", self.ffn, now[2]),
        ] {
            super::lm::check_range(&format!("grown_from_tokens.{key}"), old, 1, now)?;
        }
        Ok(())
    }
}

/// What a block needs to know; shared by the language and vision models.
#[derive(Clone, Debug)]
pub struct BlockConfig {
    pub hidden_size: usize,
    pub num_heads: usize,
    pub qkv_tokens: usize,
    pub proj_tokens: usize,
    pub ffn_tokens: usize,
    pub norm_eps: f64,
    pub activation: Activation,
    pub scale_tokens: Option<ScaleTokens>,
    /// x + attn(LN x) + mlp(LN x) (GPT-NeoX `use_parallel_residual`).
    pub parallel_residual: bool,
}

/// A LayerNorm that computes in f32 whatever the activations' dtype: its
/// weight and bias are f32, half-precision input is widened first and the
/// result rounded back (candle would sum bf16 in bf16). f64 stays f64.
#[derive(Clone, Debug)]
pub struct Norm {
    inner: LayerNorm,
    eps: f64,
    /// Without weight and bias: on a GPU with the CUDA kernels on, one kernel
    /// pass in the activations' dtype (no widened copy).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    nonparam: bool,
}

impl Norm {
    /// Loads `weight` and `bias` [hidden] under `vb`, as f32.
    pub(crate) fn load(hidden: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            inner: candle_nn::layer_norm(hidden, eps, vb.set_dtype(DType::F32))?,
            eps,
            nonparam: false,
        })
    }

    /// Without weight and bias (the official `layernorm_nonparam`).
    pub fn nonparam(hidden: usize, eps: f64, device: &Device) -> Result<Self> {
        Ok(Self {
            inner: LayerNorm::new(
                Tensor::ones(hidden, DType::F32, device)?,
                Tensor::zeros(hidden, DType::F32, device)?,
                eps,
            ),
            eps,
            nonparam: true,
        })
    }

    pub fn weight(&self) -> &Tensor {
        self.inner.weight()
    }

    /// x + a and the norm of that sum: one kernel on a GPU with the CUDA
    /// kernels on (a residual and the next norm of a decoding step).
    pub(crate) fn add_forward(&self, x: &Tensor, a: &Tensor) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if self.nonparam
            && crate::kernels::nonparam_norm::serves(x)
            && (a.shape(), a.dtype()) == (x.shape(), x.dtype())
        {
            let out = crate::kernels::nonparam_norm::add_layer_norm(x, a, self.eps)?;
            return Ok((out.get(0)?, out.get(1)?));
        }
        let sum = (x + a)?;
        let y = self.forward(&sum)?;
        Ok((sum, y))
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.nonparam && crate::kernels::nonparam_norm::serves(x) {
            return crate::kernels::nonparam_norm::layer_norm(x, self.eps);
        }
        match x.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => {
                // On the CPU one fused pass with the variance about the mean; elsewhere
                // candle's kernel, half precision widened for it.
                let fused = crate::kernels::layer_norm_rows(
                    x,
                    self.inner.weight(),
                    self.inner.bias(),
                    self.eps,
                )?;
                match (fused, x.dtype()) {
                    (Some(y), _) => Ok(y),
                    (None, DType::F32) => self.inner.forward(x),
                    (None, dtype) => self
                        .inner
                        .forward(&x.to_dtype(DType::F32)?)?
                        .to_dtype(dtype),
                }
            }
            // candle's fused LayerNorm has no f64 on the CPU; the same formula in plain ops.
            dtype => {
                let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
                let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
                let y = centred
                    .broadcast_div(&(var + self.eps)?.sqrt()?)?
                    .broadcast_mul(&self.inner.weight().to_dtype(dtype)?)?;
                match self.inner.bias() {
                    Some(b) => y.broadcast_add(&b.to_dtype(dtype)?),
                    None => Ok(y),
                }
            }
        }
    }
}

/// GPT-NeoX rotary tables: cos/sin [max_positions, rotary_dims/2], computed
/// in f32 like the reference so that positions near 2048 round identically.
#[derive(Clone, Debug)]
pub struct Rotary {
    dims: usize,
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    pub fn new(dims: usize, base: f64, max_positions: usize, device: &Device) -> Result<Self> {
        let half = dims / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / (base as f32).powf((2 * i) as f32 / dims as f32))
            .collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for t in 0..max_positions {
            for f in &inv_freq {
                let a = t as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok(Self {
            dims,
            cos: Tensor::from_vec(cos, (max_positions, half), device)?,
            sin: Tensor::from_vec(sin, (max_positions, half), device)?,
        })
    }

    /// Rotated features per head, and the cos/sin tables [max_positions, dims/2]
    /// (the training path rotates with plain, differentiable tensor ops).
    pub(crate) fn tables(&self) -> (usize, &Tensor, &Tensor) {
        (self.dims, &self.cos, &self.sin)
    }

    /// Rotates the first `dims` features of x [b, h, t, head_dim] for positions
    /// offset..offset+t (rotate-half layout, not interleaved pairs).
    pub fn apply(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        if self.dims == 0 {
            return Ok(x.clone());
        }
        if crate::kernels::rotary_heads_serve(x) {
            let x = x.unsqueeze(0)?;
            return crate::kernels::rotary_heads(&x, &self.cos, &self.sin, self.dims, offset)?
                .squeeze(0);
        }
        let (_, _, t, hd) = x.dims4()?;
        let cos = self.cos.narrow(0, offset, t)?;
        let sin = self.sin.narrow(0, offset, t)?;
        // Half precision rotates in f32 (the tables are f32, and positions
        // near 2048 need their bits), then rounds back.
        let dtype = crate::kernels::reduction_dtype(x.dtype());
        let rot = x
            .narrow(D::Minus1, 0, self.dims)?
            .to_dtype(dtype)?
            .contiguous()?;
        let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        let rot = candle_nn::rotary_emb::rope(&rot, &cos, &sin)?.to_dtype(x.dtype())?;
        if self.dims == hd {
            return Ok(rot);
        }
        let pass = x.narrow(D::Minus1, self.dims, hd - self.dims)?;
        Tensor::cat(&[&rot, &pass], D::Minus1)
    }

    /// [`Self::apply`] to each of x [n, b, h, t, head_dim] (queries and keys
    /// stacked) in one op where [`crate::kernels::rotary_heads`] serves (one
    /// launch on a GPU).
    pub(crate) fn apply_stacked(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        if self.dims == 0 {
            return Ok(x.clone());
        }
        if crate::kernels::rotary_heads_serve(x) {
            return crate::kernels::rotary_heads(x, &self.cos, &self.sin, self.dims, offset);
        }
        let parts = (0..x.dim(0)?)
            .map(|i| self.apply(&x.get(i)?, offset))
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&parts, 0)
    }
}

/// Keys and values [b, h, t, head_dim] of one attention layer.
pub(crate) type KeyValues = (Tensor, Tensor);

/// How a block's token-token attention is masked and positioned.
pub enum AttentionMode<'a> {
    /// Language: causal, rotary positions from `offset`, optional KV cache.
    Causal {
        rotary: &'a Rotary,
        offset: usize,
        cache: Option<&'a mut LayerCache>,
    },
    /// Vision: every token sees every token, no positions here.
    Bidirectional,
    /// Language, one new token for each of several sequences (x [n, 1, d]):
    /// row r is at rotary position `positions[r]` and attends over its own
    /// cache (which may hold more than text, as a vision-language model's does).
    Rows {
        rotary: &'a Rotary,
        caches: Vec<&'a mut LayerCache>,
        positions: &'a [usize],
    },
}

/// Multi-head attention whose q/k/v/output projections are Pattention layers.
#[derive(Clone, Debug)]
pub struct Attention {
    pub query: Pattention,
    pub key: Pattention,
    pub value: Pattention,
    pub proj: Pattention,
    /// q, k and v as one fused Pattention (on a GPU with the CUDA kernels on).
    qkv: Option<Fused>,
    num_heads: usize,
    head_dim: usize,
}

impl Attention {
    pub fn new(cfg: &BlockConfig, vb: VarBuilder) -> Result<Self> {
        let d = cfg.hidden_size;
        let scale = cfg.scale_tokens;
        let p = |name: &str, tokens: usize, s: Option<usize>| {
            Pattention::new(d, d, tokens, s, cfg.activation, vb.pp(name))
        };
        let mut attention = Self {
            query: p("query", cfg.qkv_tokens, scale.map(|s| s.qkv))?,
            key: p("key", cfg.qkv_tokens, scale.map(|s| s.qkv))?,
            value: p("value", cfg.qkv_tokens, scale.map(|s| s.qkv))?,
            proj: p("proj", cfg.proj_tokens, scale.map(|s| s.proj))?,
            qkv: None,
            num_heads: cfg.num_heads,
            head_dim: d / cfg.num_heads,
        };
        // Where launches cost more than the products (a GPU decoding one token);
        // the CPU's fused kernels and q8 work per part.
        if vb.device().is_cuda() && crate::kernels::cuda_kernels_enabled() {
            attention.fuse_qkv()?;
        }
        Ok(attention)
    }

    /// Makes q, k and v one fused Pattention ([`Fused`]); false where they
    /// cannot be (different shapes or Θ, 8-bit weights).
    pub(crate) fn fuse_qkv(&mut self) -> Result<bool> {
        self.qkv = Fused::new(&mut [&mut self.query, &mut self.key, &mut self.value])?;
        Ok(self.qkv.is_some())
    }

    /// [b, t, d] → [b, h, t, head_dim], as a strided view (the attention
    /// kernel reads it in place).
    fn split_heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        x.reshape((b, t, self.num_heads, self.head_dim))?
            .transpose(1, 2)
    }

    /// q, k, v [b, h, t, head_dim] of a normalised x [b, t, d], q and k
    /// rotated where `rotary` gives positions from an offset.
    fn project_qkv(
        &self,
        x: &Tensor,
        rotary: Option<(&Rotary, usize)>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let parts = [&self.query, &self.key, &self.value];
        if let Some(fused) = self.qkv.as_ref().filter(|f| f.serves(&parts)) {
            let (b, t, _) = x.dims3()?;
            // [3, b·t, d] → [3, b, h, t, head_dim], views.
            let heads = fused
                .forward(x)?
                .reshape((3, b, t, self.num_heads, self.head_dim))?
                .transpose(2, 3)?;
            let v = heads.get(2)?;
            let qk = match rotary {
                Some((rotary, offset)) => rotary.apply_stacked(&heads.narrow(0, 0, 2)?, offset)?,
                None => heads,
            };
            return Ok((qk.get(0)?, qk.get(1)?, v));
        }
        let [q, k, v] = parts.map(|p| p.forward(x).and_then(|y| self.split_heads(&y)));
        let (q, k) = match rotary {
            Some((rotary, offset)) => (rotary.apply(&q?, offset)?, rotary.apply(&k?, offset)?),
            None => (q?, k?),
        };
        Ok((q, k, v?))
    }

    /// The output projection of multi-head attention over x's own keys and
    /// values after `prefix` ones (cached with x's own) that every query
    /// sees: the image tokens of a vision-language sequence. Also returns
    /// x's own keys (rotated) and values.
    pub(crate) fn forward_kv(
        &self,
        x: &Tensor,
        mode: AttentionMode,
        prefix: Option<&KeyValues>,
    ) -> Result<(Tensor, KeyValues)> {
        let causal = matches!(mode, AttentionMode::Causal { .. });
        let (rotary, cache) = match mode {
            AttentionMode::Bidirectional => (None, None),
            AttentionMode::Causal {
                rotary,
                offset,
                cache,
            } => (Some((rotary, offset)), cache),
            AttentionMode::Rows {
                rotary,
                caches,
                positions,
            } => {
                if prefix.is_some() {
                    candle_core::bail!("one-token rows take no prefix keys")
                }
                return self.forward_rows(x, rotary, caches, positions);
            }
        };
        let (q, k, v) = self.project_qkv(x, rotary)?;
        let (ks, vs) = match prefix {
            Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
            None => (k.clone(), v.clone()),
        };
        let (ks, vs) = match cache {
            Some(cache) => cache.append(&ks, &vs)?,
            None => (ks, vs),
        };
        // Causal counts from the end, so the prefix and the cache are "past".
        let out = crate::kernels::attention(&q, &ks, &vs, causal)?;
        Ok((self.proj.forward(&out)?, (k, v)))
    }

    /// [`AttentionMode::Rows`]: the projections of all rows at once (one
    /// pass over the weights), then each row rotated at its own position and
    /// attending over its own cache, as a one-token decode step of that
    /// sequence alone would.
    fn forward_rows(
        &self,
        x: &Tensor,
        rotary: &Rotary,
        caches: Vec<&mut LayerCache>,
        positions: &[usize],
    ) -> Result<(Tensor, KeyValues)> {
        let (n, t, _) = x.dims3()?;
        if t != 1 || n != caches.len() || n != positions.len() {
            candle_core::bail!(
                "rows take one token each, a cache and a position per row: x of {n}×{t} tokens, {} caches, {} positions",
                caches.len(),
                positions.len()
            )
        }
        let (q, k, v) = self.project_qkv(x, None)?;
        let (mut outs, mut keys) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (r, (cache, &offset)) in caches.into_iter().zip(positions).enumerate() {
            let q = rotary.apply(&q.narrow(0, r, 1)?, offset)?;
            let k = rotary.apply(&k.narrow(0, r, 1)?, offset)?;
            let (ks, vs) = cache.append(&k, &v.narrow(0, r, 1)?)?;
            outs.push(crate::kernels::attention(&q, &ks, &vs, true)?);
            keys.push(k);
        }
        let out = Tensor::cat(&outs, 0)?;
        Ok((self.proj.forward(&out)?, (Tensor::cat(&keys, 0)?, v)))
    }
}

/// A pre-norm TokenFormer block: x + P_proj(MHA(LN(x))), then x + P_ffn(LN(x));
/// or, with a parallel residual, x + P_proj(MHA(LN(x))) + P_ffn(LN(x)).
#[derive(Clone, Debug)]
pub struct Block {
    pub attention: Attention,
    pub mlp: Pattention,
    norm: Norm,
    parallel_residual: bool,
}

impl Block {
    pub fn new(cfg: &BlockConfig, vb: VarBuilder) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(Self {
            attention: Attention::new(cfg, vb.pp("attention"))?,
            mlp: Pattention::new(
                d,
                d,
                cfg.ffn_tokens,
                cfg.scale_tokens.map(|s| s.ffn),
                cfg.activation,
                vb.pp("mlp"),
            )?,
            norm: Norm::nonparam(d, cfg.norm_eps, vb.device())?,
            parallel_residual: cfg.parallel_residual,
        })
    }

    pub fn forward(&self, x: &Tensor, mode: AttentionMode) -> Result<Tensor> {
        Ok(self.forward_kv(x, mode, None)?.0)
    }

    /// [`Self::forward`] after `prefix` keys and values, returning x's own
    /// (see [`Attention::forward_kv`]).
    pub(crate) fn forward_kv(
        &self,
        x: &Tensor,
        mode: AttentionMode,
        prefix: Option<&KeyValues>,
    ) -> Result<(Tensor, KeyValues)> {
        let h = self.norm.forward(x)?;
        let (a, kv) = self.attention.forward_kv(&h, mode, prefix)?;
        if self.parallel_residual {
            // Both branches read the same LN(x): the norm has no parameters.
            return Ok((((x + a)? + self.mlp.forward(&h)?)?, kv));
        }
        let (x, h) = self.norm.add_forward(x, &a)?;
        Ok(((&x + self.mlp.forward(&h)?)?, kv))
    }
}

/// What a cache asked for `wanted` keeps keys and values computed in
/// `computed` in: `wanted`, except that an f32 cache keeps a half-precision
/// model's keys and values as they are. Widening them would be exact and add
/// nothing (attention widens them itself, to the same values), while costing
/// twice the memory and, on a GPU, a conversion of the whole cache per step.
fn kept_dtype(wanted: Option<DType>, computed: DType) -> DType {
    match wanted {
        Some(DType::F32) if matches!(computed, DType::BF16 | DType::F16) => computed,
        Some(wanted) => wanted,
        None => computed,
    }
}

/// One layer's keys and values [b, h, positions, head_dim], preallocated to
/// the model's context so appending a token is a copy, not a reallocation.
#[derive(Debug)]
pub struct LayerCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    capacity: usize,
    /// What keys and values are kept in; `None`: as computed.
    dtype: Option<DType>,
}

impl LayerCache {
    pub fn new(capacity: usize) -> Self {
        Self::with_dtype(capacity, None)
    }

    /// A cache that keeps keys and values in `dtype` (`None`: as computed);
    /// attention reads them as they are kept.
    pub fn with_dtype(capacity: usize, dtype: Option<DType>) -> Self {
        Self {
            k: None,
            v: None,
            len: 0,
            capacity,
            dtype,
        }
    }

    /// Appends k, v [b, h, t, hd] and returns all cached keys and values.
    pub(crate) fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let t = k.dim(2)?;
        if self.len + t > self.capacity {
            candle_core::bail!(
                "KV cache full: {} + {t} > {} positions",
                self.len,
                self.capacity
            )
        }
        let dtype = kept_dtype(self.dtype, k.dtype());
        let alloc = |x: &Tensor| -> Result<Tensor> {
            let (b, h, _, hd) = x.dims4()?;
            Tensor::zeros((b, h, self.capacity, hd), dtype, x.device())?.contiguous()
        };
        if self.k.is_none() {
            self.k = Some(alloc(k)?);
            self.v = Some(alloc(v)?);
        }
        let (kb, vb) = (
            self.k.as_ref().expect("allocated"),
            self.v.as_ref().expect("allocated"),
        );
        kb.slice_set(&k.to_dtype(dtype)?.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.to_dtype(dtype)?.contiguous()?, 2, self.len)?;
        self.len += t;
        Ok((kb.narrow(2, 0, self.len)?, vb.narrow(2, 0, self.len)?))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{bits, spread};

    /// Deterministic values in `dtype`, shifted by `phase` so keys and values differ.
    fn values(shape: (usize, usize, usize, usize), dtype: DType, phase: f64) -> Tensor {
        spread(shape)
            .affine(1.0, phase)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    /// An f32 cache keeps a half-precision model's keys and values as they are
    /// (and attention over them gives the bits it gives over their f32 copies);
    /// an f16 cache rounds whatever it is given; an unset one keeps the input's.
    #[test]
    fn an_f32_cache_keeps_half_precision_keys_as_they_are() {
        for (wanted, computed, kept) in [
            (Some(DType::F32), DType::BF16, DType::BF16),
            (Some(DType::F32), DType::F16, DType::F16),
            (Some(DType::F32), DType::F32, DType::F32),
            (Some(DType::F16), DType::BF16, DType::F16),
            (Some(DType::F16), DType::F32, DType::F16),
            (None, DType::BF16, DType::BF16),
        ] {
            let mut cache = LayerCache::with_dtype(16, wanted);
            let (k1, v1) = (
                values((1, 2, 5, 8), computed, 0.0),
                values((1, 2, 5, 8), computed, 1.0),
            );
            let (k2, v2) = (
                values((1, 2, 1, 8), computed, 2.0),
                values((1, 2, 1, 8), computed, 3.0),
            );
            cache.append(&k1, &v1).unwrap();
            let (ks, vs) = cache.append(&k2, &v2).unwrap();
            assert_eq!(
                (ks.dtype(), vs.dtype(), ks.dim(2).unwrap()),
                (kept, kept, 6),
                "{wanted:?} {computed:?}"
            );
            let all_k = Tensor::cat(&[&k1, &k2], 2).unwrap().to_dtype(kept).unwrap();
            assert_eq!(bits(&ks), bits(&all_k), "{wanted:?} {computed:?}");
            if wanted == Some(DType::F32) && kept != DType::F32 {
                let q = values((1, 2, 1, 8), computed, 4.0);
                let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let kept_out = crate::kernels::attention(&q, &ks, &vs, true).unwrap();
                let f32_out = crate::kernels::attention(&q, &wide(&ks), &wide(&vs), true).unwrap();
                assert_eq!(bits(&kept_out), bits(&f32_out), "{computed:?}");
            }
        }
    }

    /// q, k and v fused into one Pattention give the separate layers' output and
    /// keys (rotated, at a position offset) and values, leave each layer's own
    /// weights as they were, and stop serving a layer replaced since.
    #[test]
    fn fused_qkv_gives_the_separate_layers_output() {
        let (d, heads, tokens, b, t) = (16, 2, 12, 2, 5);
        let cfg = BlockConfig {
            hidden_size: d,
            num_heads: heads,
            qkv_tokens: tokens,
            proj_tokens: 7,
            ffn_tokens: 9,
            norm_eps: 1e-5,
            activation: Activation::L2NormGelu,
            scale_tokens: None,
            parallel_residual: false,
        };
        let dev = Device::Cpu;
        let mut map = std::collections::HashMap::new();
        for (i, (name, n)) in [
            ("query", tokens),
            ("key", tokens),
            ("value", tokens),
            ("proj", 7),
        ]
        .into_iter()
        .enumerate()
        {
            for (j, part) in ["key_param_tokens", "value_param_tokens"]
                .iter()
                .enumerate()
            {
                let w = values((1, 1, n, d), DType::F32, (2 * i + j) as f64)
                    .reshape((n, d))
                    .unwrap();
                map.insert(format!("{name}.{part}"), w);
            }
        }
        let vb = VarBuilder::from_tensors(map, DType::F32, &dev);
        let separate = Attention::new(&cfg, vb).unwrap();
        let mut fused = separate.clone();
        assert!(fused.fuse_qkv().unwrap());
        for (a, f) in [
            (&separate.query, &fused.query),
            (&separate.value, &fused.value),
        ] {
            assert_eq!(bits(&a.key()), bits(&f.key()));
            assert_eq!(bits(&a.value()), bits(&f.value()));
        }
        let rotary = Rotary::new(4, 10_000.0, 32, &dev).unwrap();
        let x = values((1, b, t, d), DType::F32, 0.5).squeeze(0).unwrap();
        let run = |a: &Attention| {
            let mode = AttentionMode::Causal {
                rotary: &rotary,
                offset: 3,
                cache: None,
            };
            let (out, (k, v)) = a.forward_kv(&x, mode, None).unwrap();
            [out, k, v]
        };
        let want = run(&separate);
        let got = run(&fused);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.dims(), w.dims());
            // A few units in the last place of the largest value (~50): the
            // portable kernels sum the fused and the separate products in
            // different orders.
            let diff = crate::kernels::test_util::max_abs_diff(g, w);
            let largest = crate::kernels::test_util::max_abs(w);
            assert!(
                diff <= 1e-6 * largest,
                "{diff} against values up to {largest}"
            );
        }
        let mut replaced = fused.clone();
        replaced.key = separate.key.clone();
        let parts = [&replaced.query, &replaced.key, &replaced.value];
        assert!(!replaced.qkv.as_ref().unwrap().serves(&parts));
        let parts = [&fused.query, &fused.key, &fused.value];
        assert!(fused.qkv.as_ref().unwrap().serves(&parts));
        let diff = crate::kernels::test_util::max_abs_diff(&run(&replaced)[0], &want[0]);
        assert!(diff < 1e-5, "{diff}");
    }
}
