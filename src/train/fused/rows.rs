//! The row-wise training ops: the non-parametric LayerNorm and a scaled softmax.

use candle_core::{Layout, Result, Tensor};
use rayon::prelude::*;

use super::*;

/// (x − mean) / √(var + eps) over the last axis (biased variance, as torch), one node.
pub(crate) fn layer_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Rows(LayerNorm { eps }))
}

struct LayerNorm {
    eps: f64,
}

/// A row's mean and 1/√(var + eps), summed in f64.
fn moments<T: Elem>(row: &[T], eps: f64) -> (f64, f64) {
    let n = row.len().max(1) as f64;
    let mean = row.iter().map(|&x| x.into()).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&x| {
            let c = x.into() - mean;
            c * c
        })
        .sum::<f64>()
        / n;
    (mean, 1.0 / (var + eps).sqrt())
}

pub(super) fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1).max(1)
}

impl LayerNorm {
    fn fwd<T: Elem>(&self, x: &[T], n: usize) -> Vec<T> {
        let mut y = x.to_vec();
        y.par_chunks_mut(n).for_each(|row| {
            let (mean, inv) = moments(row, self.eps);
            for v in row.iter_mut() {
                *v = T::from_f64(((*v).into() - mean) * inv);
            }
        });
        y
    }

    /// ∂x = (g − mean(g) − x̂ · mean(g · x̂)) / σ, with x̂ the forward's output.
    fn bwd_t<T: Elem>(&self, x: &[T], y: &[T], g: &[T], n: usize) -> Vec<T> {
        let mut dx = g.to_vec();
        dx.par_chunks_mut(n)
            .zip(x.par_chunks(n).zip(y.par_chunks(n)))
            .for_each(|(dx, (x, y))| {
                let (_, inv) = moments(x, self.eps);
                let (mut sg, mut sgy) = (0f64, 0f64);
                for (&g, &y) in dx.iter().zip(y) {
                    sg += g.into();
                    sgy += g.into() * y.into();
                }
                let (mg, mgy) = (sg / n as f64, sgy / n as f64);
                for (g, &y) in dx.iter_mut().zip(y) {
                    *g = T::from_f64(((*g).into() - mg - y.into() * mgy) * inv);
                }
            });
        dx
    }
}

impl RowOp for LayerNorm {
    const NAME: &'static str = "layer-norm-train";

    fn fwd<T: Elem>(&self, x: &[T], n: usize) -> Vec<T> {
        LayerNorm::fwd(self, x, n)
    }

    fn bwd<T: Elem>(&self, x: &[T], y: &[T], g: &[T], n: usize) -> Vec<T> {
        self.bwd_t(x, y, g, n)
    }
}

/// softmax(scale · x) over the last axis, one node. Entries of −∞ (a mask) get weight
/// 0; a row of nothing but −∞ gets all zeros (no NaN).
pub(crate) fn softmax_scaled(x: &Tensor, scale: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Rows(Softmax { scale }))
}

struct Softmax {
    scale: f64,
}

/// dst = softmax(scale · src) for one row; a row of nothing but −∞ gets all zeros.
pub(super) fn softmax_row<T: Elem>(src: &[T], dst: &mut [T], scale: f64) {
    let max = src
        .iter()
        .map(|&x| x.into())
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        dst.iter_mut().for_each(|v| *v = T::zero());
        return;
    }
    let shift = T::from_f64(max * scale);
    let scale = T::from_f64(scale);
    // Arguments below ln(f32::MIN_POSITIVE) (masked ones among them) give an exact 0:
    // weights of ~1e-38 would make the backward's products subnormal, and subnormal
    // arithmetic is ~100 times slower.
    let floor = T::from_f64(-87.0);
    let mut sum = 0f64;
    for (d, &x) in dst.iter_mut().zip(src) {
        let a = x * scale - shift;
        let e = if a < floor { T::zero() } else { a.exp_fast() };
        sum += e.into();
        *d = e;
    }
    let inv = T::from_f64(1.0 / sum);
    dst.iter_mut().for_each(|v| *v *= inv);
}

/// dP becomes dS = scale · P · (dP − Σ dP·P) for one row.
pub(super) fn softmax_grad_row<T: Elem>(dp: &mut [T], p: &[T], scale: f64) {
    let dot: f64 = dp.iter().zip(p).map(|(&g, &y)| g.into() * y.into()).sum();
    let (dot, scale) = (T::from_f64(dot), T::from_f64(scale));
    for (g, &y) in dp.iter_mut().zip(p) {
        *g = scale * y * (*g - dot);
    }
}

impl Softmax {
    fn fwd<T: Elem>(&self, x: &[T], n: usize) -> Vec<T> {
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(n)
            .zip(x.par_chunks(n))
            .for_each(|(y, x)| softmax_row(x, y, self.scale));
        y
    }

    /// ∂x = scale · y · (g − Σ g·y).
    fn bwd_t<T: Elem>(&self, y: &[T], g: &[T], n: usize) -> Vec<T> {
        let mut dx = g.to_vec();
        dx.par_chunks_mut(n)
            .zip(y.par_chunks(n))
            .for_each(|(dx, y)| softmax_grad_row(dx, y, self.scale));
        dx
    }
}

impl RowOp for Softmax {
    const NAME: &'static str = "softmax-train";

    fn fwd<T: Elem>(&self, x: &[T], n: usize) -> Vec<T> {
        Softmax::fwd(self, x, n)
    }

    fn bwd<T: Elem>(&self, _: &[T], y: &[T], g: &[T], n: usize) -> Vec<T> {
        self.bwd_t(y, g, n)
    }
}
