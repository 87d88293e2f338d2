//! `loss.png`: the training loss (blue) and the validation loss (orange) against the
//! step, on a light grid, drawn with plotters' bitmap backend and no text, so no font
//! is needed. The grid has ten columns across the steps; the vertical axis runs from
//! the lowest to the highest loss drawn.

use std::path::Path;

use plotters::prelude::*;

use crate::error::{Error, Result};

const SIZE: (u32, u32) = (800, 480);

/// Draws the curves into `path` (written to a temporary file, then renamed). Each
/// curve is (step, loss) points; non-finite losses are left out.
pub fn draw_loss_png(path: &Path, train: &[(f64, f64)], val: &[(f64, f64)]) -> Result<()> {
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
    let mut buf = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
    let draw = |buf: &mut [u8]| -> std::result::Result<(), String> {
        let root = BitMapBackend::with_buffer(buf, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root)
            .margin(16)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| e.to_string())?;
        let grey = RGBColor(225, 225, 225);
        for i in 0..=10 {
            let x = x0 + (x1 - x0) * i as f64 / 10.0;
            let y = y0 + (y1 - y0) * i as f64 / 10.0;
            chart
                .draw_series(LineSeries::new([(x, y0), (x, y1)], grey))
                .map_err(|e| e.to_string())?;
            chart
                .draw_series(LineSeries::new([(x0, y), (x1, y)], grey))
                .map_err(|e| e.to_string())?;
        }
        let blue = RGBColor(31, 119, 180).stroke_width(2);
        let orange = RGBColor(255, 127, 14).stroke_width(3);
        chart
            .draw_series(LineSeries::new(train.iter().copied(), blue))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(LineSeries::new(val.iter().copied(), orange))
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
