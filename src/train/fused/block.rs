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
use super::pattention::Pattention;
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

/// Which parts read which stacked rows: (first token, tokens) of q/k/v (all three),
/// proj and mlp, as in `Block::parts`.
fn offsets([nq, no, nf]: [usize; 3]) -> [(usize, usize); 3] {
    [(0, 3 * nq), (3 * nq, no), (3 * nq + no, nf)]
}

fn add_into<T: Elem>(dst: &mut [T], src: &[T]) {
    dst.par_chunks_mut(1 << 14)
        .zip(src.par_chunks(1 << 14))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d += s));
}

impl Block {
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

    /// q, k and v of h [r, d]: the three Pattentions' scores as one product with
    /// their stacked keys ([r, 3n], Θ over each n), then one product per value set
    /// reading its columns of the weights. The scores and weights are kept in
    /// `self.parts[0]` for the backward.
    fn qkv_fwd<T: Elem>(
        &self,
        h: &[T],
        keys: &[T],
        values: &[T],
        (r, d): (usize, usize),
    ) -> [Vec<T>; 3] {
        let n = self.spec.tokens[0];
        let s = T::matmul(
            r,
            3 * n,
            d,
            Operand::rows(h, d),
            Operand::transposed(&keys[..3 * n * d], d),
        );
        let w = T::theta(&s, n, self.parts[0].c);
        let out = std::array::from_fn(|g| {
            let weights = Operand {
                data: &w[g * n..],
                rs: 3 * n,
                cs: 1,
            };
            T::matmul(
                r,
                d,
                n,
                weights,
                Operand::rows(&values[g * n * d..(g + 1) * n * d], d),
            )
        });
        *self.parts[0].saved.lock().expect("not poisoned") =
            Some((T::to_cpu_storage_owned(s), T::to_cpu_storage_owned(w)));
        out
    }

    /// ∂h from ∂q, ∂k, ∂v, writing the three key and value gradients into the
    /// stacked ones: ∂h and ∂keys as one product each over all 3n tokens.
    fn qkv_bwd<T: Elem>(
        &self,
        (h, keys, values): (&[T], &[T], &[T]),
        grads: [&[T]; 3],
        (dkeys, dvalues): (&mut [T], &mut [T]),
        (r, d): (usize, usize),
    ) -> Result<Vec<T>> {
        let n = self.spec.tokens[0];
        let saved = self.parts[0].saved.lock().expect("not poisoned").take();
        let Some((s, w)) = saved else {
            candle_core::bail!("transformer block: a second backward over one forward")
        };
        let (Ok(s), Ok(w)) = (T::cpu_storage_data(s), T::cpu_storage_data(w)) else {
            candle_core::bail!("transformer block: saved scores of another dtype")
        };
        // ∂weights [r, 3n]: each value set's product writes its n columns.
        let mut dw = vec![T::zero(); r * 3 * n];
        for (g, grad) in grads.into_iter().enumerate() {
            let v = &values[g * n * d..(g + 1) * n * d];
            T::matmul_into(
                &mut dw[g * n..],
                3 * n,
                (r, n, d),
                Operand::rows(grad, d),
                Operand::transposed(v, d),
            );
            let weights = Operand {
                data: &w[g * n..],
                rs: 1,
                cs: 3 * n,
            };
            let dv = T::matmul_long(n, d, r, weights, Operand::rows(grad, d));
            dvalues[g * n * d..(g + 1) * n * d].copy_from_slice(&dv);
        }
        drop(w);
        let ds = T::theta_grad(s, &dw, n, self.parts[0].c);
        drop(dw);
        let k = &keys[..3 * n * d];
        let dh = T::matmul(r, d, 3 * n, Operand::rows(&ds, 3 * n), Operand::rows(k, d));
        let dk = T::matmul_long(
            3 * n,
            d,
            r,
            Operand::transposed(&ds, 3 * n),
            Operand::rows(h, d),
        );
        dkeys[..3 * n * d].copy_from_slice(&dk);
        Ok(dh)
    }

    fn fwd<T: Elem>(
        &self,
        x: &[T],
        keys: &[T],
        values: &[T],
        (r, t, d): (usize, usize, usize),
    ) -> Vec<T> {
        let at = offsets(self.spec.tokens);
        let part = |i: usize, input: &[T]| -> Vec<T> {
            let (first, n) = at[i];
            self.parts[i].fwd(
                input,
                &keys[first * d..(first + n) * d],
                &values[first * d..(first + n) * d],
                (r, d, n, d),
            )
        };
        let h = super::rows::normalised(x, d, self.spec.eps);
        let [mut q, mut k, v] = self.qkv_fwd(&h, keys, values, (r, d));
        self.rotate(&mut q, (t, d), false);
        self.rotate(&mut k, (t, d), false);
        let a = self.attention.fwd(&q, &k, &v, (r / t, t, d));
        let mut out = part(1, &a);
        // x + attn first, as the separate nodes add.
        add_into(&mut out, x);
        let mut saved: Vec<CpuStorage> = vec![];
        if self.spec.parallel_residual {
            add_into(&mut out, &part(2, &h));
        } else {
            let h2 = super::rows::normalised(&out, d, self.spec.eps);
            let f = part(2, &h2);
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
        let at = offsets(self.spec.tokens);
        let mut dkeys = vec![T::zero(); keys.len()];
        let mut dvalues = vec![T::zero(); values.len()];
        // A part's backward: ∂input, its key and value gradients written in place.
        let mut part_bwd = |i: usize, input: &[T], grad: &[T]| -> Result<Vec<T>> {
            let (first, n) = at[i];
            let span = first * d..(first + n) * d;
            let [dx, dk, dv] = self.parts[i].bwd_t(
                (input, &keys[span.clone()], &values[span.clone()], grad),
                (r, d, n, d),
            )?;
            dkeys[span.clone()].copy_from_slice(&dk);
            dvalues[span].copy_from_slice(&dv);
            Ok(dx)
        };
        // ∂x accumulates: the residual path's gradient first.
        let mut dx = g.to_vec();
        let mut dh_ffn = None;
        if self.spec.parallel_residual {
            dh_ffn = Some(part_bwd(2, &h, g)?);
        } else {
            let (h2, x1) = (take()?, take()?);
            let dh2 = part_bwd(2, &h2, g)?;
            self.layer_norm_grad_into(&mut dx, dh2, &x1, &h2, d);
        }
        // dx is now ∂x1 (sequential) or ∂x through the residual (parallel): the
        // output projection's upstream gradient either way.
        let da = part_bwd(1, &a, &dx)?;
        drop(a);
        let [mut dq, mut dk, dv] = self.attention.bwd_t((&q, &k, &v, &da), (r / t, t, d))?;
        drop((da, q, k, v));
        self.rotate(&mut dq, (t, d), true);
        self.rotate(&mut dk, (t, d), true);
        let mut dh = self.qkv_bwd(
            (&h, keys, values),
            [&dq, &dk, &dv],
            (&mut dkeys, &mut dvalues),
            (r, d),
        )?;
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
