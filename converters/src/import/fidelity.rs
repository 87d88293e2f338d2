//! How an import is measured end to end and reported: the probe and calibration
//! inputs (text, token ids or seeded images), perplexity, `import_report.json`
//! (rendered once for the terminal and for the model card), and the card and
//! folder both importers finish with.

use std::path::Path;

use anyhow::Result;
use candle_core::{Device, Tensor};
use serde::Serialize;
use serde_json::{json, Value};
use tokenformer::card::ModelCard;
use tokenformer::loader;

use super::mapping::{LayerFidelity, Mapping};
use crate::output::ModelFolder;

pub const DEFAULT_PROBE_TEXT: &str = "The museum opened its new wing on a rainy Tuesday morning. Visitors queued outside \
for an hour to see the collection of maps, letters and instruments that sailors had carried across the Atlantic \
two centuries ago, and the curator explained how each object had been found.";
pub const CALIBRATION_TEXT: &str = "In mathematics, a prime number is a natural number greater than one that is not \
a product of two smaller natural numbers. Farmers in the valley grow wheat, barley and grapes, and sell them at the \
market every Saturday.";

/// Token ids of `text` with the tokenizer.json at `path`, if it loads.
pub fn tokenize(path: &Path, text: &str) -> Option<Vec<u32>> {
    if !path.exists() {
        return None;
    }
    let files = loader::ModelFiles {
        source: path.display().to_string(),
        config: loader::ConfigSource::Json {
            path: None,
            value: Value::Null,
        },
        weights: loader::Weights::Safetensors(vec![]),
        tokenizer: Some(path.to_path_buf()),
    };
    let t = loader::load_tokenizer(&files).ok()?;
    let ids = t.encode(text, false).ok()?.get_ids().to_vec();
    (ids.len() >= 2).then_some(ids)
}

/// Marsaglia's xorshift64 (13, 7, 17), the stream of the seeded probe inputs. Its
/// values end up in `import_report.json` (the calibration ids, the measured errors),
/// so it is kept as it is rather than replaced by `tokenformer::init`.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// `n` token ids below `vocab` (the calibration input of a source without a tokenizer).
pub fn seeded_ids(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut x = XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..n).map(|_| (x.next() % vocab as u64) as u32).collect()
}

/// Seeded smooth images in normalised units: a few random plane waves per
/// channel plus noise, so that patches differ the way photographs' do.
pub fn synthetic_pixels(
    n: usize,
    c: usize,
    size: usize,
    seed: u64,
    dev: &Device,
) -> Result<Tensor> {
    let mut x = XorShift(seed | 1);
    let mut rnd = move || ((x.next() >> 11) as f64 / (1u64 << 53) as f64) as f32;
    let mut v = Vec::with_capacity(n * c * size * size);
    for _ in 0..n * c {
        let waves: Vec<[f32; 4]> = (0..3)
            .map(|_| [rnd() * 0.5, rnd() * 0.5, rnd() * 6.3, rnd() * 1.5])
            .collect();
        for i in 0..size {
            for j in 0..size {
                let mut p = 0.0;
                for w in &waves {
                    p += w[3] * (w[0] * i as f32 + w[1] * j as f32 + w[2]).sin();
                }
                v.push(p + 0.3 * (rnd() - 0.5));
            }
        }
    }
    Ok(Tensor::from_vec(v, (n, c, size, size), dev)?)
}

/// exp(mean negative log-likelihood) of `ids[1..]` under `logits` [t, vocab].
pub fn perplexity(logits: &Tensor, ids: &[u32]) -> Result<f64> {
    let n = ids.len() - 1;
    let logits = logits.narrow(0, 0, n)?;
    let lse = tokenformer::scoring::logsumexp(&logits)?;
    let targets = Tensor::new(&ids[1..], logits.device())?.unsqueeze(1)?;
    let picked = logits.gather(&targets, 1)?.squeeze(1)?;
    let nll: f64 = (lse - picked)?
        .to_vec1::<f32>()?
        .iter()
        .map(|&x| x as f64)
        .sum();
    Ok((nll / n as f64).exp())
}

/// End-to-end comparison on the probe.
#[derive(Clone, Debug, Serialize)]
pub struct EndToEnd {
    /// Perplexity (text) of the source on the probe.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_perplexity: Option<f64>,
    /// The source with its parallel residual run sequentially (what a TokenFormer block can express).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_sequential_perplexity: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub import_perplexity: Option<f64>,
    /// Share of probe images where the import's top-1 class is the source's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top1_agreement: Option<f64>,
    /// ‖logits_import − logits_source‖ / ‖logits_source‖ on the probe.
    pub logits_relative_error: f64,
}

/// `import_report.json`: everything the tool measured, for scripts and tests.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub source: String,
    pub from: String,
    pub mapping: Mapping,
    /// Token ids of the text probe (or the number of probe images).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_images: Option<usize>,
    pub parallel_residual_made_sequential: bool,
    pub layers: Vec<LayerFidelity>,
    pub end_to_end: EndToEnd,
    /// Source tensors copied unchanged: (source name, TokenFormer name).
    pub copied: Vec<(String, String)>,
    /// Source buffers that are not weights (ignored).
    pub ignored_buffers: Vec<String>,
    /// What has no home in a TokenFormer and how it was handled.
    pub not_representable: Vec<String>,
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
    fn row(self, cells: &[String]) -> String {
        match self {
            Style::Terminal => {
                let widths = [5, 10, 10, 10, 10, 10, 9, 14];
                let padded: Vec<String> = cells
                    .iter()
                    .zip(widths)
                    .map(|(c, w)| format!("{c:>w$}"))
                    .collect();
                padded.join(" ") + "\n"
            }
            Style::Markdown => format!("| {} |\n", cells.join(" | ")),
        }
    }
}

impl Report {
    /// What the import prints.
    pub fn print(&self) {
        print!("{}", self.render(Style::Terminal));
    }

    /// The model card's fidelity section.
    pub fn markdown(&self) -> String {
        self.render(Style::Markdown)
    }

    /// The per-layer table, then the end-to-end numbers (and, printed, the notes).
    fn render(&self, style: Style) -> String {
        let md = style == Style::Markdown;
        let mut s = String::from(if md {
            "Relative error ‖P(x) − f(x)‖/‖f(x)‖ of each new Pattention against the source layer, on the source's own activations of the probe:\n\n"
        } else {
            "per-layer relative error of each Pattention against the source layer (probe activations):\n"
        });
        let dropped = if md {
            "dropped ‖b_in‖"
        } else {
            "dropped |b_in|"
        };
        let header = [
            "layer", "query", "key", "value", "proj", "mlp", "proj c", dropped,
        ];
        s += &style.row(&header.map(String::from));
        if md {
            s += "|---|---|---|---|---|---|---|---|\n";
        }
        for l in &self.layers {
            let err = |x: f64| {
                if md {
                    format!("{x:.2e}")
                } else {
                    format!("{x:.3e}")
                }
            };
            let dropped = if md {
                format!("{:.3}", l.dropped_mlp_bias_norm)
            } else {
                format!("{:.4}", l.dropped_mlp_bias_norm)
            };
            s += &style.row(&[
                l.layer.to_string(),
                err(l.query),
                err(l.key),
                err(l.value),
                err(l.proj),
                err(l.mlp),
                format!("{:.4}", l.proj_input_scale),
                dropped,
            ]);
        }
        let e = &self.end_to_end;
        let images = self.probe_images.unwrap_or(0);
        if md {
            s.push('\n');
            if let Some(p) = e.source_perplexity {
                s += &format!("End to end on the probe: source perplexity {p:.4}");
                if let Some(q) = e.source_sequential_perplexity {
                    s += &format!(", source run sequentially {q:.4}");
                }
                if let Some(q) = e.import_perplexity {
                    s += &format!(", import {q:.4}");
                }
                s += ". ";
            }
            if let Some(t) = e.top1_agreement {
                s += &format!(
                    "End to end on {images} probe images: top-1 agreement {:.1}%. ",
                    100.0 * t
                );
            }
            s += &format!("Relative logit error {:.3e}.", e.logits_relative_error);
        } else {
            if let (Some(p), Some(i)) = (e.source_perplexity, e.import_perplexity) {
                s += &match e.source_sequential_perplexity {
                    Some(q) => format!(
                        "perplexity on the probe: source {p:.4} (run sequentially {q:.4}), import {i:.4}\n"
                    ),
                    None => format!("perplexity on the probe: source {p:.4}, import {i:.4}\n"),
                };
            }
            if let Some(t) = e.top1_agreement {
                s += &format!(
                    "top-1 agreement on {images} probe images: {:.1}%\n",
                    100.0 * t
                );
            }
            s += &format!("relative logit error: {:.3e}\n", e.logits_relative_error);
            for n in &self.not_representable {
                s += &format!("note: {n}\n");
            }
        }
        s
    }
}

/// An importer's own words in the model card.
pub struct CardText {
    pub title: String,
    pub pipeline: &'static str,
    /// The "Model" section.
    pub model: String,
    /// Appended to the fidelity table.
    pub fidelity_note: &'static str,
}

/// What both imports end with: the report printed and written, the card (model,
/// mapping, fidelity, what is not representable) written, and the folder moved into
/// place.
pub fn finish(input: &str, folder: ModelFolder, report: &Report, text: CardText) -> Result<()> {
    report.print();
    folder.write_json(REPORT_FILE, report)?;
    let mut card = ModelCard::new(text.title, text.pipeline);
    if !Path::new(input).exists() {
        card.set("base_model", json!(input));
    }
    card.section("Model", text.model);
    card.section("Mapping", report.mapping.describe());
    card.section("Fidelity", report.markdown() + text.fidelity_note);
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
    use super::*;

    fn report(text: bool) -> Report {
        Report {
            source: "src".into(),
            from: "gpt-neox".into(),
            mapping: Mapping::new(4),
            probe_ids: None,
            calibration_ids: None,
            probe_images: (!text).then_some(3),
            parallel_residual_made_sequential: false,
            layers: vec![LayerFidelity {
                layer: 0,
                query: 1.5e-6,
                key: 2.0e-6,
                value: 3.25e-6,
                proj: 0.125,
                mlp: 0.5,
                proj_input_scale: 1.25,
                dropped_mlp_bias_norm: 0.75,
            }],
            end_to_end: EndToEnd {
                source_perplexity: text.then_some(10.0),
                source_sequential_perplexity: text.then_some(11.0),
                import_perplexity: text.then_some(12.5),
                top1_agreement: (!text).then_some(2.0 / 3.0),
                logits_relative_error: 0.0625,
            },
            copied: vec![],
            ignored_buffers: vec![],
            not_representable: vec!["a note".into()],
        }
    }

    #[test]
    fn the_terminal_rendering() {
        assert_eq!(
            report(true).render(Style::Terminal),
            "per-layer relative error of each Pattention against the source layer (probe activations):\n\
             layer      query        key      value       proj        mlp    proj c dropped |b_in|\n    \
             0   1.500e-6   2.000e-6   3.250e-6   1.250e-1   5.000e-1    1.2500         0.7500\n\
             perplexity on the probe: source 10.0000 (run sequentially 11.0000), import 12.5000\n\
             relative logit error: 6.250e-2\nnote: a note\n"
        );
        let images = report(false).render(Style::Terminal);
        assert!(images.ends_with(
            "top-1 agreement on 3 probe images: 66.7%\nrelative logit error: 6.250e-2\nnote: a note\n"
        ));
    }

    #[test]
    fn the_markdown_rendering() {
        let table = "Relative error ‖P(x) − f(x)‖/‖f(x)‖ of each new Pattention against the source layer, on the source's own activations of the probe:\n\n\
                     | layer | query | key | value | proj | mlp | proj c | dropped ‖b_in‖ |\n\
                     |---|---|---|---|---|---|---|---|\n\
                     | 0 | 1.50e-6 | 2.00e-6 | 3.25e-6 | 1.25e-1 | 5.00e-1 | 1.2500 | 0.750 |\n\n";
        assert_eq!(
            report(true).markdown(),
            format!("{table}End to end on the probe: source perplexity 10.0000, source run sequentially 11.0000, import 12.5000. Relative logit error 6.250e-2.")
        );
        assert_eq!(
            report(false).markdown(),
            format!("{table}End to end on 3 probe images: top-1 agreement 66.7%. Relative logit error 6.250e-2.")
        );
    }
}
