//! `loss.png`: the training loss (blue) and the validation loss (orange) against the
//! step, with a labelled grid (tick numbers on both axes, "step" and "loss"), drawn
//! with plotters' bitmap backend. The text uses a font compiled into the binary
//! (DejaVu Sans cut to ASCII, `assets/fonts`), so no system font is needed.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::error::{Error, Result};

const SIZE: (u32, u32) = (800, 480);
const FAMILY: &str = "sans-serif";
static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans-ASCII.ttf");
static REGISTER: Once = Once::new();

/// Decimals that tell ticks `span` apart (about two significant digits of the span).
fn decimals(span: f64) -> usize {
    (1.0 - span.log10().floor()).clamp(0.0, 6.0) as usize
}

/// Draws the curves into `path` (written to a temporary file, then renamed). Each
/// curve is (step, loss) points; non-finite losses are left out.
pub fn draw_loss_png(path: &Path, train: &[(f64, f64)], val: &[(f64, f64)]) -> Result<()> {
    REGISTER.call_once(|| {
        // The font is part of the binary and known to parse (tested).
        let _ = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT);
    });
    let finite = |v: &[(f64, f64)]| -> Vec<(f64, f64)> {
        v.iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect()
    };
    let (train, val) = (finite(train), finite(val));
    let all = || train.iter().chain(&val);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all() {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1.0 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let y_decimals = decimals(y1 - y0);
    let mut buf = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
    let draw = |buf: &mut [u8]| -> std::result::Result<(), String> {
        let root = BitMapBackend::with_buffer(buf, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root)
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| e.to_string())?;
        let text = (FAMILY, 15).into_font().color(&RGBColor(60, 60, 60));
        chart
            .configure_mesh()
            .x_labels(11)
            .y_labels(11)
            .bold_line_style(RGBColor(225, 225, 225))
            .light_line_style(RGBColor(245, 245, 245))
            .axis_style(RGBColor(150, 150, 150))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.y_decimals$}"))
            .label_style(text.clone())
            .axis_desc_style((FAMILY, 17).into_font().color(&RGBColor(60, 60, 60)))
            .x_desc("step")
            .y_desc("loss")
            .draw()
            .map_err(|e| e.to_string())?;
        let blue = RGBColor(31, 119, 180);
        let orange = RGBColor(255, 127, 14);
        chart
            .draw_series(LineSeries::new(train.iter().copied(), blue.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label("train")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], blue.stroke_width(2)));
        if !val.is_empty() {
            chart
                .draw_series(LineSeries::new(val.iter().copied(), orange.stroke_width(3)))
                .map_err(|e| e.to_string())?
                .label("validation")
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], orange.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .label_font(text)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())
    };
    draw(&mut buf).map_err(|e| Error::input(format!("drawing {}: {e}", path.display())))?;
    let img = image::RgbImage::from_raw(SIZE.0, SIZE.1, buf).expect("buffer of the image's size");
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = tempfile::Builder::new()
        .prefix(".loss.png.partial-")
        .suffix(".png")
        .tempfile_in(dir)
        .map_err(|e| Error::io(dir, e))?;
    img.save_with_format(tmp.path(), image::ImageFormat::Png)
        .map_err(|e| Error::input(format!("writing {}: {e}", path.display())))?;
    tmp.persist(path).map_err(|e| Error::io(path, e.error))?;
    Ok(())
}

/// The train and validation curves of a `metrics.jsonl` (its `loss` and `val_loss`
/// against `step`), for `loss.png`: what `train` and `import --recover-steps` draw.
#[derive(Clone, Debug, Default)]
pub struct Curve {
    train: Vec<(f64, f64)>,
    val: Vec<(f64, f64)>,
}

impl Curve {
    /// The points of an existing `metrics.jsonl` (a resumed run continues its curve);
    /// none when there is none.
    pub fn read(metrics: &Path) -> Self {
        let mut c = Self::default();
        if let Ok(text) = std::fs::read_to_string(metrics) {
            for line in text.lines() {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                    c.push(&v);
                }
            }
        }
        c
    }

    /// Adds one `metrics.jsonl` line.
    pub fn push(&mut self, line: &serde_json::Value) {
        let Some(step) = line["step"].as_f64() else {
            return;
        };
        // A resumed run rewrites the steps after its checkpoint: keep the newest.
        self.train.retain(|p| p.0 < step);
        self.val.retain(|p| p.0 < step);
        if let Some(l) = line["loss"].as_f64() {
            self.train.push((step, l));
        }
        if let Some(l) = line["val_loss"].as_f64() {
            self.val.push((step, l));
        }
    }

    /// Draws `loss.png` into the folder `out`.
    pub fn draw(&self, out: &Path) -> Result<()> {
        draw_loss_png(&out.join("loss.png"), &self.train, &self.val)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_font_parses_and_the_plot_has_text() {
        assert!(plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("loss.png");
        let train: Vec<(f64, f64)> = (1..=50).map(|s| (s as f64, 5.0 / s as f64)).collect();
        draw_loss_png(&p, &train, &[(25.0, 0.4), (50.0, 0.3)]).unwrap();
        let img = image::open(&p).unwrap().to_rgb8();
        // The text colour: tick numbers and axis names in the left and bottom margins.
        let dark = |x0: u32, x1: u32, y0: u32, y1: u32| {
            (x0..x1)
                .flat_map(|x| (y0..y1).map(move |y| (x, y)))
                .filter(|&(x, y)| img.get_pixel(x, y).0.iter().all(|&c| c < 120))
                .count()
        };
        assert!(dark(0, 70, 0, 420) > 200, "no y-axis text");
        assert!(dark(80, 800, 430, 480) > 200, "no x-axis text");
    }
}
