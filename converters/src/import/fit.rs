//! `--fit values` (the default): "fit, don't only map". Every imported Pattention
//! keeps the key tokens [`Mapping`] gives it, and its value tokens are solved by
//! ridge least squares on calibration activations, layer by layer in order as GPTQ
//! calibrates (Frantar et al. 2022, <https://arxiv.org/abs/2210.17323>): layer i is
//! fitted on the inputs that the already-fitted imported layers 0..i produce, so
//! each fit also corrects what earlier layers got wrong.
//!
//! With A = Θ(x·Kᵀ) [rows, n], x what the import itself feeds the Pattention, and
//! Y [rows, out] the source's output of the same part for the same calibration
//! rows on the source's own forward (its trace), the values are
//! V = (AᵀA + Λ)⁻¹ (AᵀY + Λ·V₀): ridge regression towards the mapped values V₀,
//! not towards 0, so a direction the calibration data does not determine keeps
//! the mapping's value (a few calibration photos give fewer rows than an MLP has
//! tokens), and a part whose data V₀ already fits exactly stays as mapped.
//!
//! Λ = λ·diag(AᵀA): one ridge per token relative to its own activation energy,
//! because the mapping's tokens differ by ~10⁶ in scale by construction (anchors
//! score ~κ_A, bias tokens ~κ_b), so a single λ relative to trace(AᵀA)/n would
//! leave all but the anchors at V₀. A token no calibration row activates keeps V₀
//! (its ridge is floored at λ·[`FLOOR`]·trace/n). λ is not fixed: measured on the
//! random fixtures, the best λ ranged from 1e-6 (an exact part on exact data) to
//! 10 (8 calibration photos, where λ = 1e-6 over-fits and makes the held-out
//! photos worse than the mapping), so each fit picks it from [`RIDGES`] by 2-fold
//! cross-validation over calibration samples (images, or text windows; the two
//! halves of a single one), with V₀ itself (λ = ∞) as a candidate, so a fit is
//! only used where it beats the mapping on samples it was not solved on.
//! AᵀA and AᵀY are accumulated in f64 per fold and solved by the blocked Cholesky
//! factorisation of [`super::linalg`].
//!
//! Why the target is the source's trace and not the source layer applied to the
//! import's own input: the latter only reproduces the source layer locally and
//! carries the drift of earlier layers on; regressing onto what the source
//! computed at this point for the same sample asks each layer to produce what the
//! source produced there, which is what the next layers (and the head) expect.
//! Nor is the residual stream's own drift (x_src − x_imp) added to the target:
//! that asks one branch to cancel a difference that is not a function of its
//! normalised input, and the next layers' fits see that drift anyway.
//!
//! Cost: per part 2·|[`RIDGES`]| + 1 factorisations of an n×n matrix (n ≤ a few
//! thousand; 1.7 s for n = 4096 on 2 cores) and one forward of the layer per
//! part over the calibration data.

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};
use serde::Serialize;
use tokenformer::pattention::{theta, Activation};

use super::fidelity::{Agreement, FitReport, PairedAgreement};
use super::linalg::{cholesky, cholesky_solve, matmul};
use super::mapping::{ImportedLayer, Mapping};
use tokenformer::source::data::Unit;
use tokenformer::source::recover::{FitInputs, PattentionBlock, MAX_FIT_ROWS};
use tokenformer::source::{standardise, LayerTrace, SourceBody, Stack};

/// The smallest ridge of a token, relative to trace(AᵀA)/n.
pub const FLOOR: f64 = 1e-12;

/// The imported layer `l` as a [`tokenformer::source::Block`], its five Pattention layers in
/// [`tokenformer::models::tokenformer::PATTENTIONS`] order.
pub fn import_block(l: &ImportedLayer, map: &Mapping) -> Result<PattentionBlock> {
    let p = |j: usize| map.pattention(&l.parts[j]);
    Ok(PattentionBlock([p(0)?, p(1)?, p(2)?, p(3)?, p(4)?]))
}

/// The ridges tried, each λ of Λ = λ·diag(AᵀA); the mapping itself (λ = ∞) is
/// the last candidate.
pub const RIDGES: [f64; 7] = [1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0];

/// AᵀA and AᵀY of one Pattention's values (or of several sharing their keys: q, k
/// and v), accumulated in f64 over calibration batches, in two folds of
/// calibration samples so that λ can be chosen on held-out samples.
pub struct NormalEquations {
    folds: [Fold; 2],
}

#[derive(Clone)]
struct Fold {
    ata: Option<Tensor>,
    aty: Vec<Option<Tensor>>,
}

/// A fold's or their sum's normal equations as f64 vectors: AᵀA [n, n] and each AᵀY.
struct Dense64 {
    ata: Vec<f64>,
    aty: Vec<Vec<f64>>,
}

/// What [`NormalEquations::solve`] chose.
pub struct Solved {
    /// The values [n, out] of each target, f32.
    pub values: Vec<Tensor>,
    /// The chosen λ, or None where no λ beat the mapped values on held-out samples
    /// (they are kept).
    pub ridge: Option<f64>,
}

impl NormalEquations {
    /// For `targets` right-hand sides.
    pub fn new(targets: usize) -> Self {
        let f = Fold {
            ata: None,
            aty: vec![None; targets],
        };
        Self {
            folds: [f.clone(), f],
        }
    }

    /// Adds rows A [rows, n] and each target Y [rows, out] to fold 0 or 1.
    pub fn add(&mut self, fold: usize, a: &Tensor, ys: &[&Tensor]) -> Result<()> {
        let f = &mut self.folds[fold % 2];
        ensure!(ys.len() == f.aty.len(), "one target per right-hand side");
        let a = a.to_dtype(DType::F64)?;
        let at = a.t()?;
        let sum = |acc: &mut Option<Tensor>, t: Tensor| -> Result<()> {
            *acc = Some(match acc.take() {
                Some(s) => (s + t)?,
                None => t,
            });
            Ok(())
        };
        sum(&mut f.ata, at.matmul(&a)?)?;
        for (acc, y) in f.aty.iter_mut().zip(ys) {
            sum(acc, at.matmul(&y.to_dtype(DType::F64)?)?)?;
        }
        Ok(())
    }

    /// The values towards `priors` (V₀ [n, out] each): λ from [`RIDGES`] (or V₀
    /// itself) by 2-fold cross-validation, each fold's error on the other's
    /// solution, then the solution on both folds with that λ.
    pub fn solve(&self, priors: &[&Tensor]) -> Result<Solved> {
        let dev = priors[0].device().clone();
        let outs: Vec<usize> = priors
            .iter()
            .map(|p| p.dim(1))
            .collect::<candle_core::Result<_>>()?;
        let v0: Vec<Vec<f64>> = priors
            .iter()
            .map(|p| Ok(p.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?))
            .collect::<Result<_>>()?;
        let as_f32 = |v: &[Vec<f64>]| -> Result<Vec<Tensor>> {
            v.iter()
                .zip(&outs)
                .map(|(v, &out)| {
                    let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
                    let rows = f.len() / out;
                    Ok(Tensor::from_vec(f, (rows, out), &dev)?)
                })
                .collect()
        };
        let folds = match &self.folds {
            [Fold { ata: Some(_), .. }, Fold { ata: Some(_), .. }] => self
                .folds
                .iter()
                .map(|f| {
                    Ok(Dense64 {
                        ata: f.ata.as_ref().expect("matched").flatten_all()?.to_vec1()?,
                        aty: f
                            .aty
                            .iter()
                            .map(|t| {
                                Ok(t.as_ref().expect("set with ata").flatten_all()?.to_vec1()?)
                            })
                            .collect::<Result<_>>()?,
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            // Fewer than two calibration samples: nothing to validate on.
            _ => {
                return Ok(Solved {
                    values: as_f32(&v0)?,
                    ridge: None,
                })
            }
        };
        let n = priors[0].dim(0)?;
        ensure!(
            folds[0].ata.len() == n * n,
            "AᵀA and the prior disagree on n"
        );
        let heldout = |v: &[Vec<f64>], k: usize| {
            v.iter()
                .zip(&folds[k].aty)
                .zip(&outs)
                .map(|((v, r), &out)| quadratic_error(&folds[k].ata, r, v, n, out))
                .sum::<Result<f64>>()
        };
        for f in &folds {
            let finite = f
                .ata
                .iter()
                .chain(f.aty.iter().flatten())
                .all(|x| x.is_finite());
            ensure!(
                finite,
                "the calibration activations or the source's outputs are not finite: nothing to fit"
            );
        }
        // Each λ's held-out error; a λ whose system rounding makes indefinite (a
        // token almost never active, at the smallest λ) is left out.
        let mut candidates = vec![];
        'ridges: for &lambda in &RIDGES {
            let mut err = 0.0;
            for k in 0..2 {
                let Ok(v) = ridge_solve(&folds[1 - k], &v0, n, &outs, lambda) else {
                    continue 'ridges;
                };
                err += heldout(&v, k)?;
            }
            candidates.push((err, lambda));
        }
        let kept = heldout(&v0, 0)? + heldout(&v0, 1)?;
        candidates.retain(|(err, _)| *err < kept);
        candidates.sort_by(|a, b| a.0.total_cmp(&b.0));
        let sum =
            |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(x, y)| x + y).collect() };
        let all = Dense64 {
            ata: sum(&folds[0].ata, &folds[1].ata),
            aty: folds[0]
                .aty
                .iter()
                .zip(&folds[1].aty)
                .map(|(a, b)| sum(a, b))
                .collect(),
        };
        for (_, lambda) in candidates {
            if let Ok(v) = ridge_solve(&all, &v0, n, &outs, lambda) {
                return Ok(Solved {
                    values: as_f32(&v)?,
                    ridge: Some(lambda),
                });
            }
        }
        // No λ beat the mapped values on held-out samples.
        Ok(Solved {
            values: as_f32(&v0)?,
            ridge: None,
        })
    }
}

/// ‖A V − Y‖² − ‖Y‖² = tr(Vᵀ AᵀA V) − 2·tr(Vᵀ AᵀY), from the normal equations.
fn quadratic_error(ata: &[f64], aty: &[f64], v: &[f64], n: usize, out: usize) -> Result<f64> {
    let gv = matmul(ata, (n, n), v, out)?;
    Ok(v.iter()
        .zip(gv.iter().zip(aty))
        .map(|(v, (g, r))| v * (g - 2.0 * r))
        .sum())
}

/// V = (AᵀA + Λ)⁻¹(AᵀY + Λ·V₀) for each target, Λ = λ·diag(AᵀA) (floored).
fn ridge_solve(
    eq: &Dense64,
    v0: &[Vec<f64>],
    n: usize,
    outs: &[usize],
    lambda: f64,
) -> Result<Vec<Vec<f64>>> {
    let penalty = ridge_penalty(&eq.ata, n, lambda);
    let mut l = eq.ata.clone();
    for (i, p) in penalty.iter().enumerate() {
        l[i * n + i] += p;
    }
    cholesky(&mut l, n)?;
    eq.aty
        .iter()
        .zip(v0)
        .zip(outs)
        .map(|((aty, v0), &out)| {
            ensure!(
                v0.len() == n * out && aty.len() == n * out,
                "prior of the wrong shape"
            );
            let mut b = aty.clone();
            for (i, p) in penalty.iter().enumerate() {
                for (bj, vj) in b[i * out..(i + 1) * out]
                    .iter_mut()
                    .zip(&v0[i * out..(i + 1) * out])
                {
                    *bj += p * vj;
                }
            }
            cholesky_solve(&l, n, &mut b, out)?;
            Ok(b)
        })
        .collect()
}

/// Λ's diagonal: λ·(AᵀA)ᵢᵢ, at least [`FLOOR`]·trace/n (and positive).
fn ridge_penalty(gram: &[f64], n: usize, lambda: f64) -> Vec<f64> {
    let trace: f64 = (0..n).map(|i| gram[i * n + i]).sum();
    let floor = (FLOOR * trace / n as f64).max(f64::MIN_POSITIVE);
    (0..n)
        .map(|i| lambda * gram[i * n + i].max(floor))
        .collect()
}

/// Θ(x·Kᵀ) [rows, n] of a Pattention with `keys` [n, d] on x [rows, d].
fn activations(map: &Mapping, keys: &Tensor, x: &Tensor) -> Result<Tensor> {
    Ok(theta(
        &x.matmul(&keys.t()?)?,
        Activation::L2NormGelu,
        map.scale_tokens,
    )?)
}

/// Adds a batch's rows A [b·t, n] and targets [b·t, out] to `eq`: each sample
/// (image, or text window) to fold (its index) mod 2, `next` counting samples
/// across batches; with a single sample in all (`single`), its two halves.
fn add_samples(
    eq: &mut NormalEquations,
    a: &Tensor,
    ys: &[&Tensor],
    (b, t): (usize, usize),
    next: &mut usize,
    single: bool,
) -> Result<()> {
    let parts: Vec<(usize, usize, usize)> = if single {
        vec![(0, 0, t / 2), (1, t / 2, t - t / 2)]
    } else {
        (0..b).map(|j| ((*next + j) % 2, j * t, t)).collect()
    };
    *next += b;
    for (fold, start, len) in parts {
        if len == 0 {
            continue;
        }
        let ys: Vec<Tensor> = ys
            .iter()
            .map(|y| y.narrow(0, start, len))
            .collect::<candle_core::Result<_>>()?;
        let ys: Vec<&Tensor> = ys.iter().collect();
        eq.add(fold, &a.narrow(0, start, len)?, &ys)?;
    }
    Ok(())
}

/// The λ chosen for each layer's q/k/v, proj and MLP values (None: mapping kept).
pub type Ridges = [Option<f64>; 3];

/// What [`fit_values`] gives: the layers with fitted values, the λ of each fit,
/// and the calibration rows (tokens, or patches and class tokens) fitted on.
pub struct Fitted {
    pub layers: Vec<ImportedLayer>,
    pub ridges: Vec<Ridges>,
    pub rows: usize,
    /// Calibration rows beyond [`MAX_FIT_ROWS`], not fitted on.
    pub left_out: usize,
    /// The most parameter tokens of any fitted Pattention (the MLP's).
    pub max_tokens: usize,
}

/// Every layer of `mapped` with its value tokens fitted as the module says: layer
/// by layer, and within a layer q/k/v first (one AᵀA: they share their keys),
/// then the output projection on the attention output of the fitted q/k/v, then
/// the MLP on what the fitted attention leaves.
pub fn fit_values(
    stack: &Stack,
    body: &SourceBody,
    inputs: &FitInputs,
    mapped: &[ImportedLayer],
    map: &Mapping,
) -> Result<Fitted> {
    // The source's and the import's running activations of each batch.
    let mut src_x = inputs.batches.clone();
    let mut imp_x = inputs.batches.clone();
    let shapes: Vec<(usize, usize)> = inputs
        .batches
        .iter()
        .map(|x| Ok((x.dim(0)?, x.dim(1)?)))
        .collect::<Result<_>>()?;
    let single = shapes.iter().map(|s| s.0).sum::<usize>() == 1;
    let mut fitted = Vec::with_capacity(mapped.len());
    let mut ridges = Vec::with_capacity(mapped.len());
    for (l, m) in body.layers.iter().zip(mapped) {
        // The source's next activations and the five outputs the parts are fitted to
        // (the rest of its trace is dropped: calibration sets can be large).
        let src: Vec<(Tensor, [Tensor; 5])> = src_x
            .iter()
            .map(|x| {
                let (next, t) = stack.run_layer(l, x)?;
                Ok((next, [t.query, t.key, t.value, t.proj_out, t.mlp_out]))
            })
            .collect::<Result<_>>()?;
        let mut layer = m.clone();
        let mut chosen = [None; 3];
        let keys = layer.parts[0].0.clone();
        ensure!(
            (1..3).all(|j| layer.parts[j].0.dims() == keys.dims()),
            "q/k/v keys differ"
        );
        let mut qkv = NormalEquations::new(3);
        let mut next = 0;
        for ((x, (_, t)), &shape) in imp_x.iter().zip(&src).zip(&shapes) {
            let u = standardise(x, stack.eps)?;
            let d = u.dim(2)?;
            let a = activations(map, &keys, &u.reshape((u.elem_count() / d, d))?)?;
            add_samples(
                &mut qkv,
                &a,
                &[&t[0], &t[1], &t[2]],
                shape,
                &mut next,
                single,
            )?;
        }
        let solved = qkv.solve(&[&layer.parts[0].1, &layer.parts[1].1, &layer.parts[2].1])?;
        chosen[0] = solved.ridge;
        for (j, v) in solved.values.into_iter().enumerate() {
            layer.parts[j].1 = v;
        }
        // The output projection, then the MLP, each on the inputs the parts fitted
        // before it produce.
        for (k, j, input) in [(1, 3, proj_in as Pick), (2, 4, mlp_in)] {
            let block = import_block(&layer, map)?;
            let mut eq = NormalEquations::new(1);
            let mut next = 0;
            for ((x, (_, t)), &shape) in imp_x.iter().zip(&src).zip(&shapes) {
                let (_, it) = stack.run_layer(&block, x)?;
                let a = activations(map, &layer.parts[j].0, input(&it))?;
                add_samples(&mut eq, &a, &[&t[j]], shape, &mut next, single)?;
            }
            let solved = eq.solve(&[&layer.parts[j].1])?;
            chosen[k] = solved.ridge;
            layer.parts[j].1 = solved.values.into_iter().next().expect("one target");
        }
        let block = import_block(&layer, map)?;
        for x in imp_x.iter_mut() {
            *x = stack.run_layer(&block, x)?.0;
        }
        src_x = src.into_iter().map(|(next, _)| next).collect();
        fitted.push(layer);
        ridges.push(chosen);
    }
    let max_tokens = fitted
        .iter()
        .flat_map(|l| l.parts.iter().map(|(k, _)| k.dim(0)))
        .collect::<candle_core::Result<Vec<_>>>()?
        .into_iter()
        .max()
        .unwrap_or(0);
    Ok(Fitted {
        layers: fitted,
        ridges,
        rows: shapes.iter().map(|(b, t)| b * t).sum(),
        left_out: inputs.left_out,
        max_tokens,
    })
}

type Pick = fn(&LayerTrace) -> &Tensor;
fn proj_in(t: &LayerTrace) -> &Tensor {
    &t.proj_in
}
fn mlp_in(t: &LayerTrace) -> &Tensor {
    &t.mlp_in
}

/// A fitted import measured against the mapping it started from, on the eval
/// data: both run here layer by layer, so that each part's running error
/// ([`LayerFit`]) and the mapped import's end-to-end numbers can be reported.
pub struct FitCheck {
    mapped: Vec<PattentionBlock>,
    fitted: Vec<PattentionBlock>,
    ridges: Vec<Ridges>,
    rows: usize,
    left_out: usize,
    max_tokens: usize,
    running: RunningCheck,
    agreement: Agreement,
    paired: PairedAgreement,
}

impl FitCheck {
    pub fn new(mapped: &[ImportedLayer], fitted: &Fitted, map: &Mapping) -> Result<Self> {
        let blocks = |ls: &[ImportedLayer]| -> Result<Vec<PattentionBlock>> {
            ls.iter().map(|l| import_block(l, map)).collect()
        };
        Ok(Self {
            mapped: blocks(mapped)?,
            fitted: blocks(&fitted.layers)?,
            ridges: fitted.ridges.clone(),
            rows: fitted.rows,
            left_out: fitted.left_out,
            max_tokens: fitted.max_tokens,
            running: RunningCheck::new(mapped.len()),
            agreement: Agreement::default(),
            paired: PairedAgreement::default(),
        })
    }

    /// Adds one eval batch: the layer input x [b, t, d], the source's traces and
    /// logits, the written (fitted) import's logits, `head` (the copied final norm
    /// and head: last hidden state → logits) and, for text, the next tokens as
    /// [`Agreement::add`] takes them.
    #[allow(clippy::too_many_arguments)]
    pub fn add(
        &mut self,
        stack: &Stack,
        x: &Tensor,
        traces: &[LayerTrace],
        src_logits: &Tensor,
        imp_logits: &Tensor,
        head: impl Fn(&Tensor) -> Result<Tensor>,
        next: Option<&[u32]>,
    ) -> Result<()> {
        let (h, mapped) = stack.run(&self.mapped, x)?;
        let (_, fitted) = stack.run(&self.fitted, x)?;
        self.running.add(traces, &mapped, &fitted)?;
        let mapped_logits = head(&h)?;
        self.agreement.add(src_logits, &mapped_logits, next)?;
        self.paired.add(src_logits, &mapped_logits, imp_logits)
    }

    /// Each layer's [`LayerFit`] and the report's fit section.
    pub fn finish(self, unit: Unit) -> (Vec<LayerFit>, FitReport) {
        let mut report =
            FitReport::new(self.rows, self.agreement.finish(unit), self.paired.finish());
        report.calibration_rows_left_out = self.left_out;
        if self.left_out > 0 {
            report.calibration_note = Some(format!(
                "the value fits used the first {} calibration rows ({MAX_FIT_ROWS} at most) and left out {}; the scales used them all",
                self.rows, self.left_out
            ));
        }
        // Fewer rows than tokens: such a fit is under-determined, the ridge decides.
        if self.rows < self.max_tokens {
            let flag = match unit {
                Unit::Images => "--calibration-images",
                Unit::Tokens => "--calibration-text",
            };
            report.calibration_note = Some(format!(
                "only {} calibration rows for Pattentions of up to {} parameter tokens: the larger fits are under-determined and lean on the ridge towards the mapped values; pass {flag} with more",
                self.rows, self.max_tokens
            ));
        }
        (self.running.finish(&self.ridges), report)
    }
}

/// One part's relative error in the running model on the eval data, before
/// (mapped only) and after the fit.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct BeforeAfter {
    pub mapped: f64,
    pub fitted: f64,
}

/// Per layer, each part's [`BeforeAfter`]: ‖P(x) − f(x_src)‖/‖f(x_src)‖ with x what
/// the import itself feeds the part (mapped or fitted import) and f(x_src) the
/// source's output of it on its own forward, all over the eval data. Unlike the
/// per-layer errors on the source's activations, these include what earlier
/// layers got wrong, which is what the fit corrects.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct LayerFit {
    /// The λ chosen (relative, per token, see `import/fit.rs`) for the q/k/v, proj
    /// and MLP values; null where the mapped values were kept.
    pub ridge: Ridges,
    pub query: BeforeAfter,
    pub key: BeforeAfter,
    pub value: BeforeAfter,
    pub proj: BeforeAfter,
    pub mlp: BeforeAfter,
}

/// [`LayerFit`]s accumulated over eval batches.
struct RunningCheck {
    /// Per layer and part: (‖mapped − src‖², ‖fitted − src‖², ‖src‖²).
    sums: Vec<[[f64; 3]; 5]>,
}

fn outputs(t: &LayerTrace) -> [&Tensor; 5] {
    [&t.query, &t.key, &t.value, &t.proj_out, &t.mlp_out]
}

fn sq(a: &Tensor) -> Result<f64> {
    Ok(a.to_dtype(DType::F64)?
        .sqr()?
        .sum_all()?
        .to_scalar::<f64>()?)
}

impl RunningCheck {
    fn new(layers: usize) -> Self {
        Self {
            sums: vec![[[0.0; 3]; 5]; layers],
        }
    }

    /// Adds one batch's traces of the source, the mapped and the fitted import.
    fn add(
        &mut self,
        src: &[LayerTrace],
        mapped: &[LayerTrace],
        fitted: &[LayerTrace],
    ) -> Result<()> {
        for (i, ((s, m), f)) in src.iter().zip(mapped).zip(fitted).enumerate() {
            for (j, ((s, m), f)) in outputs(s)
                .into_iter()
                .zip(outputs(m))
                .zip(outputs(f))
                .enumerate()
            {
                self.sums[i][j][0] += sq(&(m - s)?)?;
                self.sums[i][j][1] += sq(&(f - s)?)?;
                self.sums[i][j][2] += sq(s)?;
            }
        }
        Ok(())
    }

    /// With the ridges [`fit_values`] chose.
    fn finish(&self, ridges: &[Ridges]) -> Vec<LayerFit> {
        let rel = |num: f64, den: f64| {
            if den > 0.0 {
                (num / den).sqrt()
            } else {
                num.sqrt()
            }
        };
        self.sums
            .iter()
            .zip(ridges)
            .map(|(l, &ridge)| {
                let p = |j: usize| BeforeAfter {
                    mapped: rel(l[j][0], l[j][2]),
                    fitted: rel(l[j][1], l[j][2]),
                };
                LayerFit {
                    ridge,
                    query: p(0),
                    key: p(1),
                    value: p(2),
                    proj: p(3),
                    mlp: p(4),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A small deterministic stream in [-1, 1).
    fn spread(n: usize, salt: f64) -> Vec<f64> {
        (0..n)
            .map(|i| ((i as f64 * 0.754_877_666 + salt).fract() - 0.5) * 2.0)
            .collect()
    }

    /// X of M X = B [n, cols] by Gaussian elimination with partial pivoting: an
    /// independent solver for the checks below.
    fn gauss(mut m: Vec<f64>, n: usize, mut b: Vec<f64>, cols: usize) -> Vec<f64> {
        for c in 0..n {
            let p = (c..n)
                .max_by(|&x, &y| m[x * n + c].abs().total_cmp(&m[y * n + c].abs()))
                .unwrap();
            for k in 0..n {
                m.swap(c * n + k, p * n + k);
            }
            for k in 0..cols {
                b.swap(c * cols + k, p * cols + k);
            }
            for r in c + 1..n {
                let f = m[r * n + c] / m[c * n + c];
                for k in c..n {
                    m[r * n + k] -= f * m[c * n + k];
                }
                for k in 0..cols {
                    b[r * cols + k] -= f * b[c * cols + k];
                }
            }
        }
        let mut x = vec![0.0; n * cols];
        for r in (0..n).rev() {
            for k in 0..cols {
                let s: f64 = (r + 1..n).map(|j| m[r * n + j] * x[j * cols + k]).sum();
                x[r * cols + k] = (b[r * cols + k] - s) / m[r * n + r];
            }
        }
        x
    }

    fn t(v: &[f64], r: usize, c: usize) -> Tensor {
        let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
        Tensor::from_vec(v, (r, c), &Device::Cpu).unwrap()
    }

    fn to_vec(t: &Tensor) -> Vec<f64> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// Y = A·V of a full-rank A [rows, n] rounded to f32, in f64.
    fn product(a: &[f64], v: &[f64], rows: usize, n: usize, out: usize) -> Vec<f64> {
        (0..rows)
            .flat_map(|r| {
                (0..out).map(move |c| (0..n).map(|k| a[r * n + k] * v[k * out + c]).sum())
            })
            .collect()
    }

    #[test]
    fn an_exact_system_is_solved_exactly() {
        // A [8, 3] of full column rank in both folds and Y = A·V: every fold's
        // solution is V, so the smallest λ wins and the solution is V (up to it),
        // whatever the prior.
        let a = [
            1.0, 0.0, 2.0, 0.0, 1.0, -1.0, 1.0, 1.0, 0.0, 0.5, 0.0, 1.0, //
            2.0, 1.0, 0.0, 0.0, -1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 0.5,
        ];
        let v = [1.0, -2.0, 0.5, 3.0, -1.0, 0.25];
        let y = product(&a, &v, 8, 3, 2);
        let mut eq = NormalEquations::new(1);
        for (fold, start) in [(0, 0), (1, 4)] {
            let yb = t(&y[start * 2..(start + 4) * 2], 4, 2);
            eq.add(fold, &t(&a[start * 3..(start + 4) * 3], 4, 3), &[&yb])
                .unwrap();
        }
        let solved = eq.solve(&[&t(&[9.0; 6], 3, 2)]).unwrap();
        assert_eq!(solved.ridge, Some(RIDGES[0]));
        let got = to_vec(&solved.values[0]);
        for (g, w) in got.iter().zip(v) {
            assert!((g - w).abs() < 1e-4, "{got:?} vs {v:?}");
        }
    }

    #[test]
    fn the_ridge_solve_equals_gaussian_elimination_of_the_same_normal_equations() {
        // 40 rows, 12 tokens (one never active, which keeps its prior), 3 outputs;
        // the tokens' scales differ by 1e4 as the mapping's do.
        let (rows, n, out) = (40, 12, 3);
        let mut a = spread(rows * n, 0.1);
        for r in 0..rows {
            a[r * n + 3] *= 1e-4;
            a[r * n + 7] = 0.0;
        }
        let f = |v: &[f64]| -> Vec<f64> { v.iter().map(|&x| x as f32 as f64).collect() };
        let (a, y, prior) = (f(&a), f(&spread(rows * out, 0.4)), f(&spread(n * out, 0.8)));
        // The normal equations, written out here.
        let mut ata = vec![0.0; n * n];
        let mut aty = vec![0.0; n * out];
        for r in 0..rows {
            for i in 0..n {
                for j in 0..n {
                    ata[i * n + j] += a[r * n + i] * a[r * n + j];
                }
                for k in 0..out {
                    aty[i * out + k] += a[r * n + i] * y[r * out + k];
                }
            }
        }
        let eq = Dense64 {
            ata: ata.clone(),
            aty: vec![aty.clone()],
        };
        let trace: f64 = (0..n).map(|i| ata[i * n + i]).sum();
        for lambda in [1e-6, 1e-2, 1.0] {
            let got = ridge_solve(&eq, std::slice::from_ref(&prior), n, &[out], lambda).unwrap();
            let (mut m, mut b) = (ata.clone(), aty.clone());
            for i in 0..n {
                let p = lambda * ata[i * n + i].max(FLOOR * trace / n as f64);
                m[i * n + i] += p;
                for k in 0..out {
                    b[i * out + k] += p * prior[i * out + k];
                }
            }
            let want = gauss(m, n, b, out);
            for (i, (x, w)) in got[0].iter().zip(&want).enumerate() {
                assert!(
                    (x - w).abs() <= 1e-8 * w.abs().max(1.0),
                    "λ {lambda}, {i}: {x} vs {w}"
                );
            }
            // The token no row activates keeps its prior.
            for k in 0..out {
                assert!((got[0][7 * out + k] - prior[7 * out + k]).abs() < 1e-12);
            }
        }
        // Accumulated in two folds by candle in f64, the same equations.
        let mut acc = NormalEquations::new(1);
        acc.add(0, &t(&a[..15 * n], 15, n), &[&t(&y[..15 * out], 15, out)])
            .unwrap();
        acc.add(1, &t(&a[15 * n..], 25, n), &[&t(&y[15 * out..], 25, out)])
            .unwrap();
        let sum = |k: usize| -> Vec<f64> {
            let f = &acc.folds[k];
            to_vec(f.ata.as_ref().unwrap())
        };
        let (g0, g1) = (sum(0), sum(1));
        for (i, w) in ata.iter().enumerate() {
            assert!((g0[i] + g1[i] - w).abs() <= 1e-9 * w.abs().max(1.0));
        }
    }

    #[test]
    fn noise_keeps_the_mapped_values() {
        // Targets unrelated to A and a prior of 0 (the best predictor of noise): no
        // λ beats the prior on the held-out fold, so it is kept.
        let (rows, n) = (40, 6);
        let a = spread(rows * n, 0.3);
        let y: Vec<f64> = (0..rows)
            .map(|r| if r % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        let mut eq = NormalEquations::new(1);
        for (fold, start, len) in [(0, 0, 20), (1, 20, 20)] {
            eq.add(
                fold,
                &t(&a[start * n..(start + len) * n], len, n),
                &[&t(&y[start..start + len], len, 1)],
            )
            .unwrap();
        }
        let solved = eq.solve(&[&t(&[0.0; 6], n, 1)]).unwrap();
        let v = to_vec(&solved.values[0]);
        assert!(
            solved.ridge.is_none() || v.iter().all(|x| x.abs() < 0.2),
            "{:?} {v:?}",
            solved.ridge
        );
    }
}
