//! How an import is measured end to end and reported: tokenizing the text,
//! the seeded ids of a source without a tokenizer, the agreement of source and
//! import (top-1, KL divergence, logit error, perplexity), `import_report.json`
//! (rendered once for the terminal and for the model card), and the card and
//! folder both importers finish with.

use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Tensor, D};
use serde::Serialize;
use serde_json::json;
use tokenformer::card::ModelCard;

use super::data::agreement_interval;
use super::fit::{import_block, FitCheck, Fitted};
use super::mapping::{
    Exactness, ImportedLayer, LayerCheck, LayerFidelity, Mapping, EXACT_TOLERANCE,
};
use super::recover::RecoveryReport;
use crate::output::ModelFolder;
use crate::stdout::out;
use tokenformer::source::data::{DataInfo, Unit};
use tokenformer::source::recover::PattentionBlock;
use tokenformer::source::{Block, Stack};

/// Marsaglia's xorshift64 (13, 7, 17), the stream of the seeded ids.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// `n` token ids below `vocab`: what a source without a tokenizer is run on.
pub fn seeded_ids(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut x = XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..n).map(|_| (x.next() % vocab as u64) as u32).collect()
}

/// Source and import compared on the eval data, accumulated batch by batch.
#[derive(Default)]
pub struct Agreement {
    rows: usize,
    agree: usize,
    kl: f64,
    diff_sq: f64,
    src_sq: f64,
    src_nll: f64,
    imp_nll: f64,
    predicted: usize,
    source_top1: Vec<u32>,
    import_top1: Vec<u32>,
}

/// Per row: −log softmax(logits)\[target\] for rows 0..targets.len().
fn nll(log_probs: &Tensor, targets: &[u32]) -> Result<f64> {
    let n = targets.len();
    let t = Tensor::new(targets, log_probs.device())?.unsqueeze(1)?;
    let picked = log_probs.narrow(0, 0, n)?.gather(&t, 1)?;
    Ok(-picked.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?)
}

impl Agreement {
    /// Adds rows of logits [n, classes] of the source and the import; for text,
    /// `next` holds the token each row but the last predicts (one window).
    pub fn add(&mut self, src: &Tensor, imp: &Tensor, next: Option<&[u32]>) -> Result<()> {
        let (src, imp) = (src.to_dtype(DType::F32)?, imp.to_dtype(DType::F32)?);
        let ls = candle_nn::ops::log_softmax(&src, D::Minus1)?;
        let li = candle_nn::ops::log_softmax(&imp, D::Minus1)?;
        let kl = (ls.exp()? * (&ls - &li)?)?.sum(D::Minus1)?;
        self.kl += kl.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        let s = src.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let i = imp.argmax(D::Minus1)?.to_vec1::<u32>()?;
        self.agree += s.iter().zip(&i).filter(|(a, b)| a == b).count();
        self.rows += s.len();
        let f64s = |t: &Tensor| t.to_dtype(DType::F64);
        let (s64, i64) = (f64s(&src)?, f64s(&imp)?);
        self.diff_sq += (&i64 - &s64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        self.src_sq += s64.sqr()?.sum_all()?.to_scalar::<f64>()?;
        match next {
            Some(next) => {
                self.src_nll += nll(&ls, next)?;
                self.imp_nll += nll(&li, next)?;
                self.predicted += next.len();
            }
            None => {
                self.source_top1.extend(s);
                self.import_top1.extend(i);
            }
        }
        Ok(())
    }

    /// The end-to-end numbers over `unit`s.
    pub fn finish(self, unit: Unit) -> EndToEnd {
        let n = self.rows.max(1) as f64;
        let text = unit == Unit::Tokens;
        let (lo, hi) = agreement_interval(self.agree, self.rows);
        // Few items, or an interval too wide to tell a good import from a bad one.
        let small = self.rows < if text { 1000 } else { 50 } || hi - lo > 0.2;
        let sample_note = small.then(|| {
            format!(
                "only {} eval {unit}: top-1 agreement is known to within {:.0}–{:.0}% (95% interval), too small a sample to mean much; pass {} with more",
                self.rows,
                100.0 * lo,
                100.0 * hi,
                if text { "--eval-text" } else { "--eval-images" }
            )
        });
        let ppl = |s: f64| (self.predicted > 0).then(|| (s / self.predicted as f64).exp());
        EndToEnd {
            items: self.rows,
            unit,
            top1_agreement: self.agree as f64 / n,
            top1_agreement_95: [lo, hi],
            mean_kl: self.kl / n,
            logits_relative_error: if self.src_sq > 0.0 {
                (self.diff_sq / self.src_sq).sqrt()
            } else {
                self.diff_sq.sqrt()
            },
            source_perplexity: ppl(self.src_nll),
            import_perplexity: ppl(self.imp_nll),
            predicted_tokens: text.then_some(self.predicted),
            source_top1: (!text).then_some(self.source_top1),
            import_top1: (!text).then_some(self.import_top1),
            sample_note,
        }
    }
}

/// Per eval item, whether the mapped and the fitted import pick the source's top-1
/// class (token): the paired outcomes behind [`AgreementChange`].
#[derive(Default)]
pub struct PairedAgreement {
    both: usize,
    fitted_only: usize,
    mapped_only: usize,
    items: usize,
}

impl PairedAgreement {
    /// Adds rows of logits [n, classes] of the source, the mapped and the fitted import.
    pub fn add(&mut self, src: &Tensor, mapped: &Tensor, fitted: &Tensor) -> Result<()> {
        let top1 = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.to_dtype(DType::F32)?
                .argmax(D::Minus1)?
                .to_vec1::<u32>()?)
        };
        let (s, m, f) = (top1(src)?, top1(mapped)?, top1(fitted)?);
        for ((s, m), f) in s.iter().zip(&m).zip(&f) {
            match (m == s, f == s) {
                (true, true) => self.both += 1,
                (false, true) => self.fitted_only += 1,
                (true, false) => self.mapped_only += 1,
                (false, false) => {}
            }
        }
        self.items += s.len();
        Ok(())
    }

    pub fn finish(&self) -> AgreementChange {
        let n = self.items.max(1) as f64;
        let (lo, hi) =
            super::data::change_interval(self.both, self.fitted_only, self.mapped_only, self.items);
        AgreementChange {
            change: (self.fitted_only as f64 - self.mapped_only as f64) / n,
            change_95: [lo, hi],
            fitted_only: self.fitted_only,
            mapped_only: self.mapped_only,
        }
    }
}

/// How fitting changed top-1 (next-token) agreement with the source on the same
/// eval items.
#[derive(Clone, Debug, Serialize)]
pub struct AgreementChange {
    /// Fitted agreement − mapped agreement.
    pub change: f64,
    /// Its 95 % interval (Newcombe's score interval for paired proportions; the
    /// items are taken as independent, which tokens of one text only roughly are).
    pub change_95: [f64; 2],
    /// Items where only the fitted import agrees with the source, and only the mapped one.
    pub fitted_only: usize,
    pub mapped_only: usize,
}

/// End-to-end comparison on the eval data.
#[derive(Clone, Debug, Serialize)]
pub struct EndToEnd {
    /// Images, or token positions of the text.
    pub items: usize,
    pub unit: Unit,
    /// Share of items where the import's top-1 class (next token) is the source's.
    pub top1_agreement: f64,
    /// Its 95 % Wilson interval.
    pub top1_agreement_95: [f64; 2],
    /// Mean KL(source ‖ import) of the softmax over classes (tokens), in nats.
    pub mean_kl: f64,
    /// ‖logits_import − logits_source‖ / ‖logits_source‖ over all items.
    pub logits_relative_error: f64,
    /// Perplexity (text) of each on the eval text (windows of the context length).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_perplexity: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub import_perplexity: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_tokens: Option<usize>,
    /// Each eval image's top-1 class under the source and the import.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_top1: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub import_top1: Option<Vec<u32>>,
    /// Set when the sample is too small to mean much.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample_note: Option<String>,
}

/// `import_report.json`: everything the tool measured, for scripts and tests.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub source: String,
    pub from: String,
    pub mapping: Mapping,
    /// What the fitted constants (`proj_input_scale`) were fitted on.
    pub calibration: DataInfo,
    /// What every number below was measured on.
    pub evaluation: DataInfo,
    /// The eval images, in the order of `source_top1` / `import_top1`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_images: Option<Vec<String>>,
    /// GPT-NeoX's parallel residual, kept (the TokenFormer config's `parallel_residual`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel_residual: Option<bool>,
    pub layers: Vec<LayerFidelity>,
    pub end_to_end: EndToEnd,
    /// Source tensors copied unchanged: (source name, TokenFormer name).
    pub copied: Vec<(String, String)>,
    /// Source buffers that are not weights (ignored).
    pub ignored_buffers: Vec<String>,
    /// What has no home in a TokenFormer and how it was handled.
    pub not_representable: Vec<String>,
    /// `--fit values`: how the value tokens were fitted, and the mapped-only import
    /// on the same eval data (`end_to_end` is the fitted, written model's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fit: Option<FitReport>,
    /// `--recover-steps`: the distillation and the import before it on the same eval
    /// data (`end_to_end` is the recovered, written model's; the per-layer numbers
    /// above are the import's before recovery).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery: Option<RecoveryReport>,
}

/// What `--fit values` did (see `import/fit.rs`).
#[derive(Clone, Debug, Serialize)]
pub struct FitReport {
    pub method: String,
    /// The λ tried for each fit (per-token ridge λ·diag(AᵀA) towards the mapped
    /// values), chosen by 2-fold cross-validation over calibration samples.
    pub ridges_tried: Vec<f64>,
    /// Calibration rows (tokens, or patches and class tokens) each part was fitted on.
    pub calibration_rows: usize,
    /// The import before fitting (the mapping alone), end to end on the eval data.
    pub mapped_end_to_end: EndToEnd,
    /// Fitted minus mapped top-1 agreement on the same items, with its 95 % interval.
    pub top1_change: AgreementChange,
    /// Calibration rows beyond the fit's bound (`MAX_FIT_ROWS` in `import/fit.rs`),
    /// not fitted on.
    pub calibration_rows_left_out: usize,
    /// Set when the calibration data has fewer rows than a Pattention has tokens,
    /// or more than the fit keeps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration_note: Option<String>,
}

impl FitReport {
    pub fn new(
        calibration_rows: usize,
        mapped_end_to_end: EndToEnd,
        top1_change: AgreementChange,
    ) -> Self {
        Self {
            method: "value tokens of every Pattention solved by ridge least squares towards the mapped values, keys as mapped, layer by layer on the import's own activations of the calibration data, targets the source's outputs on its own forward".into(),
            ridges_tried: super::fit::RIDGES.to_vec(),
            calibration_rows,
            mapped_end_to_end,
            top1_change,
            calibration_rows_left_out: 0,
            calibration_note: None,
        }
    }
}

pub const REPORT_FILE: &str = "import_report.json";

/// Where a report is shown: printed after the import, or in the model card.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Style {
    Terminal,
    Markdown,
}

impl Style {
    /// One table row: right-aligned columns, or a Markdown row.
    /// One table row; on a terminal each cell right-aligned to its width.
    fn row(self, cells: &[String], widths: &[usize]) -> String {
        match self {
            Style::Terminal => {
                let padded: Vec<String> = cells
                    .iter()
                    .zip(widths)
                    .map(|(c, &w)| format!("{c:>w$}"))
                    .collect();
                padded.join(" ") + "\n"
            }
            Style::Markdown => format!("| {} |\n", cells.join(" | ")),
        }
    }
}

/// Column widths of the per-layer table on a terminal.
const LAYER_WIDTHS: [usize; 10] = [5, 10, 10, 10, 10, 10, 9, 14, 12, 10];

/// The parts of a layer with status `want`, by name.
fn parts_with(l: &LayerFidelity, want: Exactness) -> Vec<&'static str> {
    let s = &l.status;
    [
        ("query", s.query),
        ("key", s.key),
        ("value", s.value),
        ("proj", s.proj),
        ("mlp", s.mlp),
    ]
    .into_iter()
    .filter(|(_, x)| *x == want)
    .map(|(n, _)| n)
    .collect()
}

impl Report {
    /// The before/after table of a fitted import.
    fn render_fit(&self, style: Style) -> String {
        let md = style == Style::Markdown;
        let mut s = if md {
            "\nRelative error of each part in the running import, ‖P(x) − f(x_src)‖/‖f(x_src)‖ with x what the import itself feeds it and f(x_src) the source's output on its own forward (so it includes what earlier layers got wrong), mapped only → fitted, and the ridge λ each fit chose (kept: no λ beat the mapped values on held-out calibration samples):\n\n".to_string()
        } else {
            "per-layer relative error in the running import (its own activations against the source's outputs, eval data), mapped only -> fitted, and the ridge chosen (kept: the mapped values):\n".to_string()
        };
        let row = |cells: &[String]| style.row(cells, &[5, 20, 20, 20, 20, 20, 18]);
        let ridge = if md {
            "λ qkv, proj, mlp"
        } else {
            "lambda qkv/proj/mlp"
        };
        s += &row(&["layer", "query", "key", "value", "proj", "mlp", ridge].map(String::from));
        if md {
            s += "|---|---|---|---|---|---|---|\n";
        }
        let arrow = if md { "→" } else { "->" };
        for l in &self.layers {
            let Some(f) = &l.fit else { continue };
            let c =
                |b: &super::fit::BeforeAfter| format!("{:.3e} {arrow} {:.3e}", b.mapped, b.fitted);
            // "kept": no λ beat the mapped values on held-out calibration samples.
            let lambdas: Vec<String> = f
                .ridge
                .iter()
                .map(|r| r.map_or("kept".into(), |r| format!("{r:.0e}")))
                .collect();
            s += &row(&[
                l.layer.to_string(),
                c(&f.query),
                c(&f.key),
                c(&f.value),
                c(&f.proj),
                c(&f.mlp),
                lambdas.join(if md { ", " } else { "/" }),
            ]);
        }
        s
    }

    /// What the import prints.
    pub fn print(&self) -> std::io::Result<()> {
        out!("{}", self.render(Style::Terminal))
    }

    /// The model card's fidelity section.
    pub fn markdown(&self) -> String {
        self.render(Style::Markdown)
    }

    /// The per-layer table, what is exact and why, then the end-to-end numbers
    /// (and, printed, the notes).
    fn render(&self, style: Style) -> String {
        let md = style == Style::Markdown;
        let data = |d: &DataInfo| {
            let mut s = format!("{} {}, {}", d.items, d.unit, d.source);
            if let Some(n) = &d.note {
                s += &format!(" ({n})");
            }
            s
        };
        let mut s = if md {
            format!(
                "Calibration data (the fitted constants): {}. Eval data (every number here): {}.\n\nRelative error ‖P(x) − f(x)‖/‖f(x)‖ of each new Pattention against the source layer, on the source's own activations of the eval data:\n\n",
                data(&self.calibration),
                data(&self.evaluation)
            )
        } else {
            format!(
                "calibration: {}\nevaluation: {}\nper-layer relative error of each Pattention against the source layer (eval activations):\n",
                data(&self.calibration),
                data(&self.evaluation)
            )
        };
        let dropped = if md {
            "dropped ‖b_in‖"
        } else {
            "dropped |b_in|"
        };
        let header = [
            "layer",
            "query",
            "key",
            "value",
            "proj",
            "mlp",
            "proj c",
            dropped,
            "max eps/var",
            "exact",
        ];
        s += &style.row(&header.map(String::from), &LAYER_WIDTHS);
        if md {
            s += "|---|---|---|---|---|---|---|---|---|---|\n";
        }
        let err = |x: f64| {
            if md {
                format!("{x:.2e}")
            } else {
                format!("{x:.3e}")
            }
        };
        for l in &self.layers {
            let dropped = if md {
                format!("{:.3}", l.dropped_mlp_bias_norm)
            } else {
                format!("{:.4}", l.dropped_mlp_bias_norm)
            };
            let exact = parts_with(l, Exactness::Exact);
            let exact = if exact.is_empty() {
                "none".to_string()
            } else {
                exact.join(" ")
            };
            s += &style.row(
                &[
                    l.layer.to_string(),
                    err(l.query),
                    err(l.key),
                    err(l.value),
                    err(l.proj),
                    err(l.mlp),
                    format!("{:.4}", l.proj_input_scale),
                    dropped,
                    err(l.attn_eps_over_var.max(l.mlp_eps_over_var)),
                    exact,
                ],
                &LAYER_WIDTHS,
            );
        }
        if md {
            s.push('\n');
        }
        if self.fit.is_some() {
            s += &format!(
                "exact: reproduces its source part within {EXACT_TOLERANCE:.0e} on the eval data. Every part's value tokens were fitted by least squares on the calibration data (--fit values), so no part is exact by construction: each fit also corrects what earlier layers got wrong, on the import's own activations.\n"
            );
        } else {
            s += &format!(
                "exact: reproduces its source part within {EXACT_TOLERANCE:.0e} on the eval data. q/k/v, and the MLP when no pre-activation bias was dropped, are exact constructions on x̂ = x·√d/‖x‖; a LayerNorm output differs from x̂ by √(1 + eps/var) − 1, so they are exact only where var ≫ eps. proj is approximate (a fitted input scale).\n"
            );
        }
        for l in &self.layers {
            let eps = parts_with(l, Exactness::EpsLimited);
            if !eps.is_empty() {
                let (r, e, c) = if eps.iter().all(|p| *p == "mlp") {
                    (l.mlp_eps_over_var, l.mlp_eps_error, l.mlp_input_scale)
                } else {
                    (l.attn_eps_over_var, l.attn_eps_error, l.qkv_input_scale)
                };
                let fitted = if c != 1.0 {
                    format!(" (a fitted input scale {c:.4} takes out the mean of that)")
                } else {
                    String::new()
                };
                s += &format!(
                    "{}layer {}: {} exact by construction, but eps/var reaches {} here: LayerNorm outputs differ from x̂ by up to {}{fitted}.\n",
                    if md { "- " } else { "" },
                    l.layer,
                    eps.join(", "),
                    err(r),
                    err(e)
                );
            }
        }
        if self.fit.is_some() {
            s += &self.render_fit(style);
        }
        let e = &self.end_to_end;
        if md {
            s.push('\n');
        }
        let what = if e.unit == Unit::Tokens {
            "next-token"
        } else {
            "top-1"
        };
        if let Some(f) = &self.fit {
            s += &end_to_end_line("Mapped only (before fitting)", &f.mapped_end_to_end);
            match &self.recovery {
                Some(r) => s += &end_to_end_line("Fitted (before recovery)", &r.before_end_to_end),
                None => s += &end_to_end_line("Fitted (the written model)", e),
            }
            let c = &f.top1_change;
            s += &format!(
                "Fitting changed {} agreement by {:+.1} points (95% interval {:+.1} to {:+.1}): {} {} where only the fitted import agrees with the source, {} where only the mapped one does.\n",
                what,
                100.0 * c.change,
                100.0 * c.change_95[0],
                100.0 * c.change_95[1],
                c.fitted_only,
                e.unit,
                c.mapped_only
            );
        } else if let Some(r) = &self.recovery {
            s += &end_to_end_line("Mapped only (before recovery)", &r.before_end_to_end);
        } else {
            s += &end_to_end_line("End to end", e);
        }
        if let Some(r) = &self.recovery {
            s += &end_to_end_line("Recovered (the written model)", e);
            let c = &r.top1_change;
            s += &format!(
                "Recovery ({} steps, distillation loss {:.4} -> {:.4}, {:.4} on the eval data) changed {what} agreement by {:+.1} points (95% interval {:+.1} to {:+.1}): {} {} where only the recovered import agrees with the source, {} where only the one before does. The per-layer numbers above are the import's before recovery.\n",
                r.steps,
                r.first_loss,
                r.final_loss,
                r.final_eval_loss,
                100.0 * c.change,
                100.0 * c.change_95[0],
                100.0 * c.change_95[1],
                c.recovered_only,
                e.unit,
                c.before_only
            );
        }
        if let Some(n) = self.fit.as_ref().and_then(|f| f.calibration_note.as_ref()) {
            s += &format!("{}{n}.\n", if md { "Note: " } else { "note: " });
        }
        if let Some(n) = &e.sample_note {
            s += &format!("{}{n}.\n", if md { "Note: " } else { "note: " });
        }
        if !md {
            for n in &self.not_representable {
                s += &format!("note: {n}\n");
            }
        }
        s
    }
}

/// One model's end-to-end numbers: agreement, KL, logit error, perplexity.
fn end_to_end_line(label: &str, e: &EndToEnd) -> String {
    let what = if e.unit == Unit::Tokens {
        "next-token top-1"
    } else {
        "top-1"
    };
    let mut s = format!(
        "{label} on {} eval {}: {what} agreement {:.1}% (95% interval {:.1}–{:.1}%), mean KL(source ‖ import) {:.3e} nats, relative logit error {:.3e}.\n",
        e.items,
        e.unit,
        100.0 * e.top1_agreement,
        100.0 * e.top1_agreement_95[0],
        100.0 * e.top1_agreement_95[1],
        e.mean_kl,
        e.logits_relative_error
    );
    if let (Some(p), Some(i), Some(n)) =
        (e.source_perplexity, e.import_perplexity, e.predicted_tokens)
    {
        s += &format!(
            "Perplexity on the eval text ({n} predicted tokens): source {p:.4}, import {i:.4} ({:+.2}%).\n",
            100.0 * (i / p - 1.0)
        );
    }
    s
}

/// The model card's words for a recovered import, after the importer's own.
const RECOVERED_CARD_NOTE: &str = " It was then trained to match the source on the calibration data by distillation (`--recover-steps`: KL of the outputs plus per-layer hidden-state error); `metrics.jsonl` and `loss.png` in this folder record the run, the fidelity section gives agreement before and after.";

/// The model card's words for a fitted import, after the importer's own.
const FITTED_CARD_NOTE: &str = " The value tokens of every Pattention were then fitted by ridge least squares on the calibration data, layer by layer on the import's own activations (`--fit values`); the fidelity section gives each part's error before and after.";

/// The written import measured against the source on the eval data, batch by
/// batch: each part's error on the source's activations ([`LayerCheck`]), the
/// end-to-end agreement, a fitted import against the mapping it started from
/// ([`FitCheck`]) and a recovered one against the import before recovery (run
/// here, as it was before it was trained).
pub struct Comparison {
    check: LayerCheck,
    agreement: Agreement,
    fit: Option<FitCheck>,
    before: Option<Before>,
}

/// The import before recovery and how it compares.
struct Before {
    blocks: Vec<PattentionBlock>,
    agreement: Agreement,
    paired: PairedAgreement,
}

/// What [`Comparison::finish`] gives the report.
pub struct Compared {
    pub layers: Vec<LayerFidelity>,
    pub end_to_end: EndToEnd,
    pub fit: Option<FitReport>,
    /// With recovery: the import before it, end to end, and how recovery changed
    /// top-1 agreement on the same items.
    pub before_recovery: Option<(EndToEnd, AgreementChange)>,
}

impl Comparison {
    /// For the import of `mapped` layers, `fitted` when their values were fitted, and
    /// `recovered` when distillation then trained it further (the import before
    /// recovery is `fitted`'s layers, or `mapped` when nothing was fitted).
    pub fn new(
        mapped: &[ImportedLayer],
        fitted: Option<&Fitted>,
        recovered: bool,
        map: &Mapping,
    ) -> Result<Self> {
        let imported = fitted.map_or(mapped, |f| &f.layers);
        let before = if recovered {
            Some(Before {
                blocks: imported
                    .iter()
                    .map(|l| import_block(l, map))
                    .collect::<Result<_>>()?,
                agreement: Agreement::default(),
                paired: PairedAgreement::default(),
            })
        } else {
            None
        };
        Ok(Self {
            check: LayerCheck::new(imported, map)?,
            agreement: Agreement::default(),
            fit: fitted.map(|f| FitCheck::new(mapped, f, map)).transpose()?,
            before,
        })
    }

    /// Adds one eval batch: x [b, t, d] the source's input to its first layer,
    /// `imp_logits` the written import's logits, `head` the copied final norm and
    /// head (last hidden state → logits) and, for text, the next tokens as
    /// [`Agreement::add`] takes them.
    pub fn add<B: Block>(
        &mut self,
        stack: &Stack,
        source: &[B],
        x: &Tensor,
        imp_logits: &Tensor,
        head: impl Fn(&Tensor) -> Result<Tensor>,
        next: Option<&[u32]>,
    ) -> Result<()> {
        let (h, traces) = stack.run(source, x)?;
        self.check.add(&traces)?;
        let src_logits = head(&h)?;
        self.agreement.add(&src_logits, imp_logits, next)?;
        let before = match &mut self.before {
            Some(b) => {
                let logits = head(&stack.run(&b.blocks, x)?.0)?;
                b.agreement.add(&src_logits, &logits, next)?;
                b.paired.add(&src_logits, &logits, imp_logits)?;
                Some(logits)
            }
            None => None,
        };
        if let Some(fc) = &mut self.fit {
            // The fitted import is the written one unless recovery trained it further.
            let fitted_logits = before.as_ref().unwrap_or(imp_logits);
            fc.add(stack, x, &traces, &src_logits, fitted_logits, &head, next)?;
        }
        Ok(())
    }

    /// The report's numbers, with `imported` the import before recovery (as
    /// [`Comparison::new`] says) and `eps` the source's LayerNorm eps.
    pub fn finish(self, imported: &[ImportedLayer], eps: f64, unit: Unit) -> Compared {
        let (layer_fit, fit) = self.fit.map(|fc| fc.finish(unit)).unzip();
        Compared {
            layers: self.check.finish(imported, eps, layer_fit.as_deref()),
            end_to_end: self.agreement.finish(unit),
            fit,
            before_recovery: self
                .before
                .map(|b| (b.agreement.finish(unit), b.paired.finish())),
        }
    }
}

/// An importer's own words in the model card.
pub struct CardText {
    pub title: String,
    pub pipeline: &'static str,
    /// The "Model" section.
    pub model: String,
}

/// What both imports end with: the report printed and written, the card (model,
/// mapping, fidelity, what is not representable) written, and the folder moved into
/// place.
pub fn finish(input: &str, folder: ModelFolder, report: &Report, text: CardText) -> Result<()> {
    report.print()?;
    folder.write_json(REPORT_FILE, report)?;
    let mut card = ModelCard::new(text.title, text.pipeline);
    if !Path::new(input).exists() {
        card.set("base_model", json!(input));
    }
    let mut model = text.model;
    if report.fit.is_some() {
        model += FITTED_CARD_NOTE;
    }
    if report.recovery.is_some() {
        model += RECOVERED_CARD_NOTE;
    }
    card.section("Model", model);
    card.section("Mapping", report.mapping.describe());
    card.section("Fidelity", report.markdown());
    let items: Vec<String> = report
        .not_representable
        .iter()
        .map(|s| format!("- {s}"))
        .collect();
    card.section("Not representable", items.join("\n"));
    folder.finish_and_say(&card)
}

#[cfg(test)]
mod tests {
    use super::super::mapping::PartStatus;
    use super::*;

    fn layer(i: usize, qkv: Exactness, mlp: Exactness, ratio: f64) -> LayerFidelity {
        LayerFidelity {
            layer: i,
            query: 1.5e-6,
            key: 2.0e-6,
            value: 0.0125,
            proj: 0.125,
            mlp: 0.5,
            proj_input_scale: 1.25,
            qkv_input_scale: if ratio > 1e-3 { 0.9876 } else { 1.0 },
            mlp_input_scale: 1.0,
            dropped_mlp_bias_norm: 0.75,
            attn_eps_over_var: ratio,
            mlp_eps_over_var: 1e-6,
            attn_eps_error: (1.0 + ratio).sqrt() - 1.0,
            mlp_eps_error: 5e-7,
            status: PartStatus {
                query: qkv,
                key: qkv,
                value: qkv,
                proj: Exactness::Approximate,
                mlp,
            },
            fit: None,
        }
    }

    fn report(text: bool) -> Report {
        let info = |items, unit| DataInfo {
            source: "shipped samples (x)".into(),
            shipped: true,
            items,
            unit,
            note: None,
        };
        let mut agreement = Agreement::default();
        let src = Tensor::new(
            &[[1f32, 0.0, 0.0], [0.0, 2.0, 0.0]],
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let imp = Tensor::new(
            &[[1f32, 0.0, 0.0], [0.0, 0.0, 2.0]],
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let next = [1u32];
        agreement
            .add(&src, &imp, text.then_some(&next[..]))
            .unwrap();
        let unit = if text { Unit::Tokens } else { Unit::Images };
        Report {
            source: "src".into(),
            from: "gpt-neox".into(),
            mapping: Mapping::new(4),
            calibration: info(10, unit),
            evaluation: info(2, unit),
            eval_images: None,
            parallel_residual: text.then_some(true),
            layers: vec![
                layer(0, Exactness::EpsLimited, Exactness::Approximate, 0.025),
                layer(1, Exactness::Exact, Exactness::Exact, 1e-6),
            ],
            end_to_end: agreement.finish(unit),
            copied: vec![],
            ignored_buffers: vec![],
            not_representable: vec!["a note".into()],
            fit: None,
            recovery: None,
        }
    }

    #[test]
    fn the_agreement_numbers() {
        let e = report(true).end_to_end;
        // Rows: argmax 0 = 0 (agree), 1 ≠ 2; KL of row 0 is 0.
        assert_eq!((e.items, e.top1_agreement), (2, 0.5));
        let ls = [2.0 - (2f64.exp() + 2.0).ln(), -(2f64.exp() + 2.0).ln()];
        let kl = ls[0].exp() * (ls[0] - ls[1]) + 2.0 * ls[1].exp() * (ls[1] - ls[1]) + 0.0;
        // Row 1: source p = (1, e², 1)/Z, import q = (1, 1, e²)/Z.
        let kl_row1 = ls[0].exp() * (ls[0] - ls[1]) + ls[1].exp() * (ls[1] - ls[0]);
        assert!(
            (e.mean_kl - kl_row1 / 2.0).abs() < 1e-6,
            "{} {kl}",
            e.mean_kl
        );
        assert!((e.logits_relative_error - (8f64 / 5.0).sqrt()).abs() < 1e-9);
        // One predicted token (row 0 predicts id 1): source log p = −ln(e + 2)... both 1/(e+2).
        let p = (1f64.exp() + 2.0).ln().exp();
        assert!((e.source_perplexity.unwrap() - p).abs() < 1e-5);
        assert!((e.import_perplexity.unwrap() - p).abs() < 1e-5);
        assert!(e.sample_note.unwrap().starts_with("only 2 eval tokens"));
    }

    #[test]
    fn the_terminal_rendering_says_what_is_exact_and_why() {
        let s = report(true).render(Style::Terminal);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "calibration: 10 tokens, shipped samples (x)");
        assert_eq!(lines[1], "evaluation: 2 tokens, shipped samples (x)");
        assert_eq!(
            lines[3],
            "layer      query        key      value       proj        mlp    proj c dropped |b_in|  max eps/var      exact"
        );
        assert_eq!(
            lines[4],
            "    0   1.500e-6   2.000e-6   1.250e-2   1.250e-1   5.000e-1    1.2500         0.7500     2.500e-2       none"
        );
        assert!(
            lines[5].ends_with("1.000e-6 query key value mlp"),
            "{}",
            lines[5]
        );
        assert!(s.contains(
            "layer 0: query, key, value exact by construction, but eps/var reaches 2.500e-2 here: LayerNorm outputs differ from x̂ by up to 1.242e-2 (a fitted input scale 0.9876 takes out the mean of that).\n"
        ), "{s}");
        assert!(s.contains("End to end on 2 eval tokens: next-token top-1 agreement 50.0%"));
        assert!(s.contains("Perplexity on the eval text (1 predicted tokens)"));
        assert!(s.ends_with("note: a note\n"));
        let img = report(false).render(Style::Terminal);
        assert!(img.contains("End to end on 2 eval images: top-1 agreement 50.0%"));
        assert!(!img.contains("Perplexity"));
    }

    #[test]
    fn a_fitted_import_shows_before_and_after() {
        use super::super::fit::{BeforeAfter, LayerFit};
        let mut r = report(false);
        let ba = |mapped, fitted| BeforeAfter { mapped, fitted };
        r.layers[0].fit = Some(LayerFit {
            ridge: [Some(1e-2), None, Some(10.0)],
            query: ba(1e-6, 5e-7),
            key: ba(1e-6, 5e-7),
            value: ba(1e-6, 5e-7),
            proj: ba(0.25, 0.125),
            mlp: ba(0.5, 0.25),
        });
        r.layers.truncate(1);
        let mut paired = PairedAgreement::default();
        let dev = candle_core::Device::Cpu;
        let src = Tensor::new(&[[1f32, 0.0], [0.0, 1.0], [1.0, 0.0]], &dev).unwrap();
        let mapped = Tensor::new(&[[1f32, 0.0], [1.0, 0.0], [0.0, 1.0]], &dev).unwrap();
        let fitted = Tensor::new(&[[1f32, 0.0], [0.0, 1.0], [1.0, 0.0]], &dev).unwrap();
        paired.add(&src, &mapped, &fitted).unwrap();
        let change = paired.finish();
        assert_eq!((change.fitted_only, change.mapped_only), (2, 0));
        assert!((change.change - 2.0 / 3.0).abs() < 1e-12);
        r.fit = Some(FitReport::new(136, r.end_to_end.clone(), change));
        let s = r.render(Style::Terminal);
        assert!(s.contains("no part is exact by construction"), "{s}");
        assert!(
            s.contains("    0 1.000e-6 -> 5.000e-7 1.000e-6 -> 5.000e-7 1.000e-6 -> 5.000e-7 2.500e-1 -> 1.250e-1 5.000e-1 -> 2.500e-1      1e-2/kept/1e1\n"),
            "{s}"
        );
        assert!(s.contains("Mapped only (before fitting) on 2 eval images: top-1 agreement 50.0%"));
        assert!(s.contains("Fitted (the written model) on 2 eval images: top-1 agreement 50.0%"));
        assert!(
            s.contains("Fitting changed top-1 agreement by +66.7 points (95% interval "),
            "{s}"
        );
        assert!(s.contains("2 images where only the fitted import agrees with the source, 0 where only the mapped one does.\n"));
        let md = r.markdown();
        assert!(md.contains("| 0 | 1.000e-6 → 5.000e-7 | 1.000e-6 → 5.000e-7 | 1.000e-6 → 5.000e-7 | 2.500e-1 → 1.250e-1 | 5.000e-1 → 2.500e-1 | 1e-2, kept, 1e1 |\n\nMapped only"), "{md}");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["layers"][0]["fit"]["ridge"], json!([0.01, null, 10.0]));
        assert_eq!(json["fit"]["calibration_rows"], 136);
    }

    #[test]
    fn the_markdown_rendering() {
        let s = report(false).markdown();
        assert!(s.starts_with("Calibration data (the fitted constants): 10 images, shipped samples (x). Eval data (every number here): 2 images, shipped samples (x).\n\n"));
        assert!(s.contains("| layer | query | key | value | proj | mlp | proj c | dropped ‖b_in‖ | max eps/var | exact |\n|---|---|---|---|---|---|---|---|---|---|\n| 0 | 1.50e-6 | 2.00e-6 | 1.25e-2 | 1.25e-1 | 5.00e-1 | 1.2500 | 0.750 | 2.50e-2 | none |\n"), "{s}");
        assert!(s.contains("- layer 0: query, key, value exact by construction"));
        assert!(s.contains("Note: only 2 eval images"));
        assert!(!s.contains("a note"));
    }
}
