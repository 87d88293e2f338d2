//! How a source layer becomes Pattention layers: the token groups of [`Mapping`],
//! the LayerNorm affine folded into the linear after it, the input scale of the
//! output projection fitted on calibration data, and each new layer's error
//! against the source layer on the source's own activations of the eval data,
//! with which parts are exact and under what condition.

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, D};
use serde::Serialize;
use tokenformer::checkpoint::Tensors;
use tokenformer::models::tokenformer::PATTENTIONS;
use tokenformer::pattention::{Activation, Pattention};

use super::fit::LayerFit;
use tokenformer::source::{Dense, LayerTrace, Norm, SourceBody, SourceLayer};

/// How a linear layer or an MLP becomes a Pattention layer.
///
/// Θ(s) = GELU(s/‖s‖·√S) only sees the direction of the scores, so a
/// Pattention is invariant to the scale of its input; it can represent
/// functions of x̂ = x·√d/‖x‖. A LayerNorm output u = (x − μ)/√(var + eps) has
/// x̂ = u·√(1 + eps/var): the parts that read one are exact up to √(1 + eps/var) − 1,
/// which is small only when var ≫ eps (1.2e-2 at var 4e-4, eps 1e-5). Each
/// imported layer has these token groups (d = input width):
/// - anchors, 2·d tokens, keys ±e_i: they dominate ‖s‖ so that ‖s‖ = √2·‖x‖
///   is known, which makes Θ elementwise: anchor i scores GELU(±κ_A·x̂_i).
///   By GELU(a) − GELU(−a) = a, values ±(c/κ_A)·W_iᵀ give c·x̂·Wᵀ exactly.
/// - bias tokens, 2·d tokens, keys ±(κ_b/κ_A)·e_i with κ_b small: by
///   GELU(a) + GELU(−a) = a·erf(a/√2) ≈ √(2/π)·a², their sum over i is
///   √(2/π)·κ_b²·‖x̂‖² = √(2/π)·κ_b²·d, a constant, so equal values
///   b/(√(2/π)·κ_b²·d) reproduce a bias b (relative error ≈ κ_b²·x̂_i²/6).
/// - MLP only, the memories: keys (1/κ_A)·W_in (with the norm's weight
///   folded in), values W_outᵀ, scored GELU(x̂·W_inᵀ) up to the relative
///   error ‖x̂·W_inᵀ‖²/(4·d·κ_A²) their own share of ‖s‖ causes; anchor values are 0.
///
/// S, the √n constant, is 2·d·κ_A²·(1 + (κ_b/κ_A)²) rounded (config
/// `pattention_scale_tokens`). Not representable: the MLP's pre-activation
/// bias (it would need a constant score, but LayerNorm outputs have zero
/// mean), reported per layer; and the scale of un-normalised inputs (the
/// attention output feeding the output projection): c is fitted per layer by
/// least squares on the calibration data, which is not the eval data.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Mapping {
    pub width: usize,
    pub kappa_anchor: f64,
    pub kappa_bias: f64,
    pub bias_key_scale: f64,
    pub scale_tokens: usize,
}

/// κ_A: large so that the MLP memories barely perturb ‖s‖.
pub const KAPPA_ANCHOR: f64 = 1000.0;
/// κ_b: small so that GELU(a) + GELU(−a) is quadratic, not so small that f32 loses it.
pub const KAPPA_BIAS: f64 = 5e-3;

impl Mapping {
    pub fn new(width: usize) -> Self {
        let lambda = KAPPA_BIAS / KAPPA_ANCHOR;
        let s = (2.0 * width as f64 * KAPPA_ANCHOR * KAPPA_ANCHOR * (1.0 + lambda * lambda)).round()
            as usize;
        let kappa_anchor = (s as f64 / (2.0 * width as f64 * (1.0 + lambda * lambda))).sqrt();
        Self {
            width,
            kappa_anchor,
            kappa_bias: lambda * kappa_anchor,
            bias_key_scale: lambda,
            scale_tokens: s,
        }
    }

    /// Anchor and bias keys [4d, d]: [I; −I; λI; −λI].
    fn fixed_keys(&self, dev: &Device) -> Result<Tensor> {
        let eye = Tensor::eye(self.width, DType::F32, dev)?;
        let small = (&eye * self.bias_key_scale)?;
        Ok(Tensor::cat(&[&eye, &eye.neg()?, &small, &small.neg()?], 0)?)
    }

    /// Values of the 2d bias tokens reproducing bias b \[out\].
    fn bias_values(&self, bias: Option<&Tensor>, out: usize, dev: &Device) -> Result<Tensor> {
        let rows = 2 * self.width;
        match bias {
            None => Ok(Tensor::zeros((rows, out), DType::F32, dev)?),
            Some(b) => {
                let per = (2.0 / std::f64::consts::PI).sqrt()
                    * self.kappa_bias
                    * self.kappa_bias
                    * self.width as f64;
                Ok((b / per)?
                    .unsqueeze(0)?
                    .broadcast_as((rows, out))?
                    .contiguous()?)
            }
        }
    }

    /// y = c·x̂·Wᵀ + b as (keys [4d, d], values [4d, out]); w [out, d].
    pub fn linear(&self, w: &Tensor, bias: Option<&Tensor>, c: f64) -> Result<(Tensor, Tensor)> {
        let dev = w.device();
        let out = w.dim(0)?;
        let wt = (w.t()?.contiguous()? * (c / self.kappa_anchor))?;
        let values = Tensor::cat(&[&wt, &wt.neg()?, &self.bias_values(bias, out, dev)?], 0)?;
        Ok((self.fixed_keys(dev)?, values))
    }

    /// y = GELU(c·x̂·W_inᵀ)·W_outᵀ + b as (keys [m+4d, d], values [m+4d, out]).
    pub fn mlp(
        &self,
        w_in: &Tensor,
        w_out: &Tensor,
        bias: Option<&Tensor>,
        c: f64,
    ) -> Result<(Tensor, Tensor)> {
        let dev = w_in.device();
        let out = w_out.dim(0)?;
        let mem_keys = (w_in * (c / self.kappa_anchor))?;
        let keys = Tensor::cat(&[&mem_keys, &self.fixed_keys(dev)?], 0)?;
        let zeros = Tensor::zeros((2 * self.width, out), DType::F32, dev)?;
        let values = Tensor::cat(
            &[
                &w_out.t()?.contiguous()?,
                &zeros,
                &self.bias_values(bias, out, dev)?,
            ],
            0,
        )?;
        Ok((keys, values))
    }

    pub fn pattention(&self, kv: &(Tensor, Tensor)) -> candle_core::Result<Pattention> {
        Pattention::from_tensors(
            kv.0.clone(),
            kv.1.clone(),
            Activation::L2NormGelu,
            Some(self.scale_tokens),
        )
    }

    /// The model card's description of the mapping.
    pub fn describe(&self) -> String {
        format!(
            "Every linear layer y = x·Wᵀ + b (LayerNorm affine folded in) becomes 4·d parameter tokens: 2·d anchors with keys ±e_i and values ±(c/κ_A)·Wᵀ, exact by GELU(a) − GELU(−a) = a once the anchors fix ‖s‖; and 2·d bias tokens with keys ±(κ_b/κ_A)·e_i whose GELU(a)+GELU(−a) ≈ √(2/π)a² sums to a constant, values b/(√(2/π)·κ_b²·d). The MLP keeps its hidden units as key-value memories (keys W_in/κ_A, values W_outᵀ; Geva et al. 2021) plus the same 4·d anchor/bias tokens. κ_A = {:.3}, κ_b = {:.2e}, √n constant S = {} for d = {}.",
            self.kappa_anchor, self.kappa_bias, self.scale_tokens, self.width
        )
    }
}

/// W·diag(g) and W·b + bias: a LayerNorm's affine part folded into the linear after it.
fn fold_norm(l: &Dense, n: &Norm) -> Result<(Tensor, Tensor)> {
    let w = l.weight.broadcast_mul(&n.weight.unsqueeze(0)?)?;
    let mut b = l.weight.matmul(&n.bias.unsqueeze(1)?)?.squeeze(1)?;
    if let Some(lb) = &l.bias {
        b = (b + lb)?;
    }
    Ok((w, b))
}

/// The least-squares c for c·x̂·Wᵀ ≈ x·Wᵀ, accumulated over batches of rows.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScaleFit {
    num: f64,
    den: f64,
}

impl ScaleFit {
    /// Adds the rows of x [rows, d] (the inputs of the linear W [out, d]).
    pub fn add(&mut self, x: &Tensor, w: &Tensor) -> Result<()> {
        let d = x.dim(D::Minus1)? as f64;
        let norm = x
            .sqr()?
            .sum_keepdim(D::Minus1)?
            .sqrt()?
            .clamp(1e-30, f64::INFINITY)?;
        let xhat = (x.broadcast_div(&norm)? * d.sqrt())?;
        let y = x.matmul(&w.t()?)?.to_dtype(DType::F64)?;
        let yh = xhat.matmul(&w.t()?)?.to_dtype(DType::F64)?;
        self.num += (&y * &yh)?.sum_all()?.to_scalar::<f64>()?;
        self.den += yh.sqr()?.sum_all()?.to_scalar::<f64>()?;
        Ok(())
    }

    pub fn value(&self) -> f64 {
        if self.den > 0.0 {
            self.num / self.den
        } else {
            1.0
        }
    }
}

/// The scale c for c·x̂ ≈ u of LayerNorm outputs u = x̂·√(var/(var + eps)): its mean
/// over the calibration rows (‖x̂‖ is the same for every row), or exactly 1 where eps
/// is negligible, so that the exact constructions stay exact.
#[derive(Clone, Copy, Debug, Default)]
pub struct InputScale {
    sum: f64,
    rows: usize,
}

impl InputScale {
    /// Adds the per-row variances \[rows\] of a LayerNorm input with that `eps`.
    pub fn add(&mut self, var: &Tensor, eps: f64) -> Result<()> {
        let var = var.to_dtype(DType::F64)?;
        let f = var.broadcast_div(&(&var + eps)?)?.sqrt()?;
        self.sum += f.sum_all()?.to_scalar::<f64>()?;
        self.rows += var.elem_count();
        Ok(())
    }

    pub fn value(&self) -> f64 {
        let c = if self.rows > 0 {
            self.sum / self.rows as f64
        } else {
            1.0
        };
        if 1.0 - c > EXACT_TOLERANCE / 10.0 {
            c
        } else {
            1.0
        }
    }
}

/// Everything fitted on the calibration data, per layer: the output projection's
/// input scale, and the LayerNorm-eps scales of the q/k/v and MLP inputs.
pub struct Calibration {
    layers: Vec<(ScaleFit, InputScale, InputScale)>,
    eps: f64,
}

impl Calibration {
    pub fn new(body: &SourceBody) -> Self {
        Self {
            layers: vec![Default::default(); body.layers.len()],
            eps: body.eps,
        }
    }

    /// Adds one batch's traces of the source `body`.
    pub fn add(&mut self, body: &SourceBody, traces: &[LayerTrace]) -> Result<()> {
        for ((fit, t), l) in self.layers.iter_mut().zip(traces).zip(&body.layers) {
            fit.0.add(&t.proj_in, &l.dense.weight)?;
            fit.1.add(&t.attn_var, self.eps)?;
            fit.2.add(&t.mlp_var, self.eps)?;
        }
        Ok(())
    }

    /// Every layer of `body` mapped with the fitted constants.
    pub fn import(&self, body: &SourceBody, map: &Mapping) -> Result<Vec<ImportedLayer>> {
        body.layers
            .iter()
            .zip(&self.layers)
            .map(|(l, (proj, attn, mlp))| {
                import_layer(l, map, proj.value(), attn.value(), mlp.value())
            })
            .collect()
    }
}

/// (‖a − b‖², ‖b‖²) in f64.
fn squared_error(a: &Tensor, b: &Tensor) -> Result<(f64, f64)> {
    let a = a.flatten_all()?.to_dtype(DType::F64)?;
    let b = b.flatten_all()?.to_dtype(DType::F64)?;
    Ok((
        (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?,
        b.sqr()?.sum_all()?.to_scalar::<f64>()?,
    ))
}

/// A part "exact" reproduces its source part to this relative error on the eval data.
pub const EXACT_TOLERANCE: f64 = 1e-4;

/// How a new Pattention layer stands to its source part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exactness {
    /// An exact construction, measured within [`EXACT_TOLERANCE`].
    Exact,
    /// An exact construction on x̂ = x·√d/‖x‖, but LayerNorm's eps makes its input
    /// differ from x̂ by √(1 + eps/var) − 1 > [`EXACT_TOLERANCE`] on some rows; a
    /// fitted input scale takes out the mean of that, its spread over rows remains.
    EpsLimited,
    /// A fitted constant (proj) or a dropped term (the MLP's pre-activation bias).
    Approximate,
    /// Value tokens solved by least squares on the calibration data (`--fit
    /// values`): no longer exact by construction, since each fit also absorbs what
    /// earlier layers got wrong; "exact" only where measured within [`EXACT_TOLERANCE`].
    Fitted,
}

/// [`Exactness`] of each part of a layer.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct PartStatus {
    pub query: Exactness,
    pub key: Exactness,
    pub value: Exactness,
    pub proj: Exactness,
    pub mlp: Exactness,
}

/// Per-layer fidelity of the new Pattention layers on the source's activations
/// of the eval data.
#[derive(Clone, Debug, Serialize)]
pub struct LayerFidelity {
    pub layer: usize,
    /// Relative errors ‖P(x) − f(x)‖/‖f(x)‖ over all eval rows.
    pub query: f64,
    pub key: f64,
    pub value: f64,
    pub proj: f64,
    pub mlp: f64,
    /// The fitted c of the output projection (its input is not normalised).
    pub proj_input_scale: f64,
    /// The fitted c of q/k/v's and the MLP's inputs: the mean √(var/(var + eps)) of the
    /// calibration rows, or exactly 1 where eps is negligible there.
    pub qkv_input_scale: f64,
    pub mlp_input_scale: f64,
    /// ‖pre-activation bias‖₂ of the MLP (incl. the folded norm bias): not representable, dropped.
    pub dropped_mlp_bias_norm: f64,
    /// max over eval rows of eps/var of the LayerNorm input before q/k/v, and before the MLP.
    pub attn_eps_over_var: f64,
    pub mlp_eps_over_var: f64,
    /// √(1 + eps/var) − 1 at those maxima: how far LayerNorm's output is from x̂.
    pub attn_eps_error: f64,
    pub mlp_eps_error: f64,
    pub status: PartStatus,
    /// `--fit values`: each part's error in the running import before and after the fit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fit: Option<LayerFit>,
}

/// Source layer `i` as its five Pattention layers (q, k, v, proj, mlp).
#[derive(Clone)]
pub struct ImportedLayer {
    /// (keys, values) in [`PATTENTIONS`] order.
    pub parts: [(Tensor, Tensor); 5],
    pub proj_input_scale: f64,
    pub qkv_input_scale: f64,
    pub mlp_input_scale: f64,
    pub dropped_mlp_bias_norm: f64,
}

impl ImportedLayer {
    /// The layer's tensors under their canonical names `layers.{i}.…`.
    pub fn insert_into(&self, i: usize, tensors: &mut Tensors) {
        for (name, (keys, values)) in PATTENTIONS.into_iter().zip(&self.parts) {
            tensors.insert(format!("layers.{i}.{name}.key_param_tokens"), keys.clone());
            tensors.insert(
                format!("layers.{i}.{name}.value_param_tokens"),
                values.clone(),
            );
        }
    }
}

/// Source layer `l` mapped, with `c` the fitted output-projection input scale and
/// `c_qkv`, `c_mlp` those of the LayerNorm outputs.
pub fn import_layer(
    l: &SourceLayer,
    map: &Mapping,
    c: f64,
    c_qkv: f64,
    c_mlp: f64,
) -> Result<ImportedLayer> {
    let (wq, bq) = fold_norm(&l.query, &l.ln1)?;
    let (wk, bk) = fold_norm(&l.key, &l.ln1)?;
    let (wv, bv) = fold_norm(&l.value, &l.ln1)?;
    let (w1, b1) = fold_norm(&l.fc1, &l.ln2)?;
    Ok(ImportedLayer {
        parts: [
            map.linear(&wq, Some(&bq), c_qkv)?,
            map.linear(&wk, Some(&bk), c_qkv)?,
            map.linear(&wv, Some(&bv), c_qkv)?,
            map.linear(&l.dense.weight, l.dense.bias.as_ref(), c)?,
            map.mlp(&w1, &l.fc2.weight, l.fc2.bias.as_ref(), c_mlp)?,
        ],
        proj_input_scale: c,
        qkv_input_scale: c_qkv,
        mlp_input_scale: c_mlp,
        dropped_mlp_bias_norm: b1.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt() as f64,
    })
}

/// The per-layer check, accumulated over batches of the source's eval activations.
pub struct LayerCheck {
    layers: Vec<[Pattention; 5]>,
    /// Per layer and part: (‖P(x) − f(x)‖², ‖f(x)‖²).
    sums: Vec<[(f64, f64); 5]>,
    /// Per layer: the smallest variance before q/k/v and before the MLP.
    var_min: Vec<[f64; 2]>,
}

impl LayerCheck {
    pub fn new(layers: &[ImportedLayer], map: &Mapping) -> Result<Self> {
        let layers = layers
            .iter()
            .map(|l| -> Result<[Pattention; 5]> {
                let p = |j: usize| map.pattention(&l.parts[j]);
                Ok([p(0)?, p(1)?, p(2)?, p(3)?, p(4)?])
            })
            .collect::<Result<Vec<_>>>()?;
        let n = layers.len();
        Ok(Self {
            layers,
            sums: vec![[(0.0, 0.0); 5]; n],
            var_min: vec![[f64::INFINITY; 2]; n],
        })
    }

    /// Adds one batch: each layer's trace.
    pub fn add(&mut self, traces: &[LayerTrace]) -> Result<()> {
        for (i, t) in traces.iter().enumerate() {
            let io = [
                (&t.attn_in, &t.query),
                (&t.attn_in, &t.key),
                (&t.attn_in, &t.value),
                (&t.proj_in, &t.proj_out),
                (&t.mlp_in, &t.mlp_out),
            ];
            for (j, (x, y)) in io.into_iter().enumerate() {
                let (num, den) = squared_error(&self.layers[i][j].forward(x)?, y)?;
                self.sums[i][j].0 += num;
                self.sums[i][j].1 += den;
            }
            for (k, var) in [&t.attn_var, &t.mlp_var].into_iter().enumerate() {
                let m = var.min(0)?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                self.var_min[i][k] = self.var_min[i][k].min(m);
            }
        }
        Ok(())
    }

    /// The fidelity of each layer, with `eps` the source's LayerNorm eps and `fit`
    /// the before/after errors of a fitted import (None: mapped only).
    pub fn finish(
        &self,
        imported: &[ImportedLayer],
        eps: f64,
        fit: Option<&[LayerFit]>,
    ) -> Vec<LayerFidelity> {
        imported
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let err = |j: usize| {
                    let (num, den) = self.sums[i][j];
                    if den == 0.0 {
                        num.sqrt()
                    } else {
                        (num / den).sqrt()
                    }
                };
                let ratio = |k: usize| eps / self.var_min[i][k];
                let eps_error = |k: usize| (1.0 + ratio(k)).sqrt() - 1.0;
                // q/k/v always, the MLP when no bias was dropped, are exact constructions.
                let status = |j: usize, k: usize, exact_construction: bool| {
                    if fit.is_some() {
                        if err(j) <= EXACT_TOLERANCE {
                            Exactness::Exact
                        } else {
                            Exactness::Fitted
                        }
                    } else if !exact_construction {
                        Exactness::Approximate
                    } else if err(j) <= EXACT_TOLERANCE {
                        Exactness::Exact
                    } else if eps_error(k) > EXACT_TOLERANCE {
                        Exactness::EpsLimited
                    } else {
                        Exactness::Approximate
                    }
                };
                LayerFidelity {
                    layer: i,
                    query: err(0),
                    key: err(1),
                    value: err(2),
                    proj: err(3),
                    mlp: err(4),
                    proj_input_scale: l.proj_input_scale,
                    qkv_input_scale: l.qkv_input_scale,
                    mlp_input_scale: l.mlp_input_scale,
                    dropped_mlp_bias_norm: l.dropped_mlp_bias_norm,
                    attn_eps_over_var: ratio(0),
                    mlp_eps_over_var: ratio(1),
                    attn_eps_error: eps_error(0),
                    mlp_eps_error: eps_error(1),
                    status: PartStatus {
                        query: status(0, 0, true),
                        key: status(1, 0, true),
                        value: status(2, 0, true),
                        proj: status(3, 0, false),
                        mlp: status(4, 1, l.dropped_mlp_bias_norm == 0.0),
                    },
                    fit: fit.map(|f| f[i]),
                }
            })
            .collect()
    }
}
