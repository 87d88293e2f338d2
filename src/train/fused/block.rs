//! A whole transformer block (LayerNorm, the q/k/v Pattentions, rotary, attention,
//! the output Pattention, the feed-forward Pattention and both residual additions) as
//! one node of the training graph.
//!
//! Why one node: candle's backward gives every argument of every node a zeroed
//! gradient and adds into it, and a block as separate nodes has fourteen
//! activation-sized arguments (the residual additions, the three projections of the
//! same LayerNorm output, q/k/v, the rotary's slices). Here the backward writes each
//! activation's gradient once, in order, and the residual additions cost one in-place
//! pass each (docs/PERFORMANCE.md). The parts are the fused ops' own forward and
//! backward, so the block computes what the separate nodes do.

use std::sync::Mutex;

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::attention::Attention;
use super::pattention::{Dims, Pattention};
use super::*;

/// What a block is besides its tensors.
#[derive(Clone, Debug)]
pub(crate) struct BlockSpec {
    pub heads: usize,
    /// Parameter tokens of the q/k/v, output and feed-forward Pattentions.
    pub tokens: [usize; 3],
    /// The token counts their Θ's √n constants use.
    pub scale_tokens: [usize; 3],
    pub causal: bool,
    /// x + attn(LN x) + ffn(LN x) (GPT-NeoX's parallel residual) instead of two
    /// LayerNorms in sequence.
    pub parallel_residual: bool,
    pub eps: f64,
}

/// GPT-NeoX rotary (rotate-half) on the first `dims` features of each head of q and
/// k: cos/sin [t, dims] for positions 0..t, both halves.
#[derive(Clone)]
pub(crate) struct RotaryTables {
    pub dims: usize,
    pub cos: Vec<f64>,
    pub sin: Vec<f64>,
}

/// The block on x [b, t, d] with the q, k, v, proj and mlp key tokens stacked in that
/// order in `keys` [N, d] and their value tokens in `values` [N, d]. `rotary` (if any)
/// rotates q and k after their projections. Output [b, t, d]; the backward gives ∂x,
/// ∂keys and ∂values.
pub(crate) fn block(
    x: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    spec: &BlockSpec,
    rotary: Option<RotaryTables>,
) -> Result<Tensor> {
    let [nq, no, nf] = spec.scale_tokens.map(|n| (n as f64).sqrt());
    let part = |c: f64| Pattention {
        c,
        saved: Mutex::new(None),
    };
    x.contiguous()?.apply_op3(
        &keys.contiguous()?,
        &values.contiguous()?,
        Three(Block {
            spec: spec.clone(),
            rotary,
            parts: [part(nq), part(no), part(nf)],
            attention: Attention {
                heads: spec.heads,
                scale: 1.0 / ((x.dim(2)? / spec.heads.max(1)) as f64).sqrt(),
                causal: spec.causal,
                saved: Mutex::new(None),
            },
            saved: Mutex::new(None),
        }),
    )
}

struct Block {
    spec: BlockSpec,
    rotary: Option<RotaryTables>,
    /// q/k/v (stacked), proj and mlp, each keeping its scores and weights for the
    /// backward.
    parts: [Pattention; 3],
    attention: Attention,
    /// The forward's activations for the backward (taken by it): h, q, k, v (q and k
    /// rotated), the attention's output a, and for sequential residuals x1 and h2.
    saved: Mutex<Option<Vec<CpuStorage>>>,
}

fn add_into<T: Elem>(dst: &mut [T], src: &[T]) {
    dst.par_chunks_mut(1 << 14)
        .zip(src.par_chunks(1 << 14))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d += s));
}

impl Block {
    /// Which elements of the stacked keys and values part `i` reads (q/k/v all three,
    /// proj, mlp, as in `Block::parts`; keys and values are both [N, d]), and its shape.
    fn part(&self, i: usize, (r, d): (usize, usize)) -> (std::ops::Range<usize>, Dims) {
        let [nq, no, nf] = self.spec.tokens;
        let (first, n, groups) = [(0, nq, 3), (3 * nq, no, 1), (3 * nq + no, nf, 1)][i];
        let dims = Dims {
            r,
            d,
            n,
            o: d,
            groups,
        };
        (first * d..(first + groups * n) * d, dims)
    }

    /// dy (the gradient of LN's output) becomes ∂x, added to `into`.
    fn layer_norm_grad_into<T: Elem>(
        &self,
        into: &mut [T],
        mut dy: Vec<T>,
        x: &[T],
        y: &[T],
        d: usize,
    ) {
        let eps = self.spec.eps;
        dy.par_chunks_mut(d)
            .zip(x.par_chunks(d).zip(y.par_chunks(d)))
            .zip(into.par_chunks_mut(d))
            .for_each(|((g, (x, y)), into)| {
                T::layer_norm_grad_row(g, x, y, eps);
                into.iter_mut().zip(g.iter()).for_each(|(o, &g)| *o += g);
            });
    }

    /// Rotates the first `dims` features of every head of x [b·t, d] (rows t
    /// positions long) by the positions' angles, or back by them (`inverse`: the
    /// transpose, for gradients).
    fn rotate<T: Elem>(&self, x: &mut [T], (t, d): (usize, usize), inverse: bool) {
        let Some(rot) = &self.rotary else { return };
        let (dims, hd) = (rot.dims, d / self.spec.heads);
        let half = dims / 2;
        let sign = if inverse { -1.0 } else { 1.0 };
        x.par_chunks_mut(d).enumerate().for_each(|(row, x)| {
            let p = row % t;
            let (cos, sin) = (&rot.cos[p * dims..], &rot.sin[p * dims..]);
            for head in x.chunks_mut(hd) {
                for i in 0..half {
                    let (x1, x2) = (head[i].into(), head[i + half].into());
                    let (s1, s2) = (sign * sin[i], sign * sin[i + half]);
                    head[i] = T::from_f64(x1 * cos[i] - x2 * s1);
                    head[i + half] = T::from_f64(x2 * cos[i + half] + x1 * s2);
                }
            }
        });
    }

    fn fwd<T: Elem>(
        &self,
        x: &[T],
        keys: &[T],
        values: &[T],
        (r, t, d): (usize, usize, usize),
    ) -> Vec<T> {
        let part = |i: usize, input: &[T]| -> Vec<Vec<T>> {
            let (span, dims) = self.part(i, (r, d));
            self.parts[i].fwd(input, &keys[span.clone()], &values[span], dims)
        };
        let h = super::rows::normalised(x, d, self.spec.eps);
        let Ok([mut q, mut k, v]) = <[Vec<T>; 3]>::try_from(part(0, &h)) else {
            unreachable!("three groups, three outputs")
        };
        self.rotate(&mut q, (t, d), false);
        self.rotate(&mut k, (t, d), false);
        let a = self.attention.fwd(&q, &k, &v, (r / t, t, d));
        let one = |i: usize, input: &[T]| part(i, input).pop().expect("one group");
        let mut out = one(1, &a);
        // x + attn first, as the separate nodes add.
        add_into(&mut out, x);
        let mut saved: Vec<CpuStorage> = vec![];
        if self.spec.parallel_residual {
            add_into(&mut out, &one(2, &h));
        } else {
            let h2 = super::rows::normalised(&out, d, self.spec.eps);
            let f = one(2, &h2);
            saved.push(T::to_cpu_storage(&out));
            saved.push(T::to_cpu_storage_owned(h2));
            add_into(&mut out, &f);
        }
        for s in [h, q, k, v, a] {
            saved.push(T::to_cpu_storage_owned(s));
        }
        *self.saved.lock().expect("not poisoned") = Some(saved);
        out
    }

    fn bwd_t<T: Elem>(
        &self,
        (x, keys, values, g): (&[T], &[T], &[T], &[T]),
        (r, t, d): (usize, usize, usize),
    ) -> Result<[Vec<T>; 3]> {
        let Some(mut saved) = self.saved.lock().expect("not poisoned").take() else {
            candle_core::bail!("transformer block: a second backward over one forward")
        };
        let mut take = || -> Result<Vec<T>> {
            match T::cpu_storage_data(saved.pop().expect("saved by the forward")) {
                Ok(v) => Ok(v),
                Err(_) => {
                    candle_core::bail!("transformer block: saved activations of another dtype")
                }
            }
        };
        let (a, v, k, q, h) = (take()?, take()?, take()?, take()?, take()?);
        let mut dkeys = vec![T::zero(); keys.len()];
        let mut dvalues = vec![T::zero(); values.len()];
        // A part's backward: ∂input, its key and value gradients written in place.
        let mut part_bwd = |i: usize, input: &[T], grads: &[&[T]]| -> Result<Vec<T>> {
            let (span, dims) = self.part(i, (r, d));
            self.parts[i].bwd(
                (input, &keys[span.clone()], &values[span.clone()]),
                grads,
                (&mut dkeys[span.clone()], &mut dvalues[span]),
                dims,
            )
        };
        // ∂x accumulates: the residual path's gradient first.
        let mut dx = g.to_vec();
        let mut dh_ffn = None;
        if self.spec.parallel_residual {
            dh_ffn = Some(part_bwd(2, &h, &[g])?);
        } else {
            let (h2, x1) = (take()?, take()?);
            let dh2 = part_bwd(2, &h2, &[g])?;
            self.layer_norm_grad_into(&mut dx, dh2, &x1, &h2, d);
        }
        // dx is now ∂x1 (sequential) or ∂x through the residual (parallel): the
        // output projection's upstream gradient either way.
        let da = part_bwd(1, &a, &[&dx])?;
        drop(a);
        let [mut dq, mut dk, dv] = self.attention.bwd_t((&q, &k, &v, &da), (r / t, t, d))?;
        drop((da, q, k, v));
        self.rotate(&mut dq, (t, d), true);
        self.rotate(&mut dk, (t, d), true);
        let mut dh = part_bwd(0, &h, &[&dq, &dk, &dv])?;
        drop((dq, dk, dv));
        if let Some(f) = dh_ffn {
            add_into(&mut dh, &f);
        }
        self.layer_norm_grad_into(&mut dx, dh, x, &h, d);
        Ok([dx, dkeys, dvalues])
    }
}

impl ThreeOp for Block {
    const NAME: &'static str = "transformer-block-train";
    /// (rows, tokens per sequence, width).
    type Dims = (usize, usize, usize);

    fn dims(&self, x: &Layout, keys: &Layout, values: &Layout) -> Result<Self::Dims> {
        let (b, t, d) = x.shape().dims3()?;
        let [nq, no, nf] = self.spec.tokens;
        let n = 3 * nq + no + nf;
        let rot_ok = self.rotary.as_ref().is_none_or(|r| {
            r.dims % 2 == 0
                && r.dims <= d / self.spec.heads.max(1)
                && r.cos.len() >= t * r.dims
                && r.sin.len() >= t * r.dims
        });
        if keys.shape().dims2()? != (n, d)
            || values.shape().dims2()? != (n, d)
            || self.spec.heads == 0
            || d % self.spec.heads != 0
            || !rot_ok
        {
            candle_core::bail!(
                "transformer block: x {:?}, keys {:?}, values {:?} do not fit {:?}",
                x.dims(),
                keys.dims(),
                values.dims(),
                self.spec
            )
        }
        Ok((b * t, t, d))
    }

    fn out_shape(&self, x: &Layout, _: Self::Dims) -> Shape {
        x.shape().clone()
    }

    fn fwd<T: Elem>(&self, x: &[T], k: &[T], v: &[T], dims: Self::Dims) -> Vec<T> {
        Block::fwd(self, x, k, v, dims)
    }

    fn bwd<T: Elem>(&self, ops: (&[T], &[T], &[T], &[T]), dims: Self::Dims) -> Result<[Vec<T>; 3]> {
        self.bwd_t(ops, dims)
    }
}
