//! Attention over all heads of [b, t, d] q, k and v as one node of the training graph.

use std::sync::Mutex;

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::*;

/// softmax(scale · q_h·k_hᵀ)·v_h for every head h, causal (query i sees keys 0..=i) or
/// not, for q, k, v [b, t, d] with `heads` heads of d/heads side by side along d (the
/// Pattention outputs as they are, no transposition), one node whose backward gives
/// ∂q, ∂k and ∂v. Heads run in parallel, each product on one thread.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    scale: f64,
    causal: bool,
) -> Result<Tensor> {
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        Three(Attention {
            heads,
            scale,
            causal,
            saved: Mutex::new(None),
        }),
    )
}

pub(super) struct Attention {
    pub(super) heads: usize,
    pub(super) scale: f64,
    pub(super) causal: bool,
    /// The forward's probabilities [b·heads, t, t], for the backward (taken by it).
    pub(super) saved: Mutex<Option<CpuStorage>>,
}

/// (batch, tokens, width) of q, k and v.
fn attention_dims(
    q: &Layout,
    k: &Layout,
    v: &Layout,
    heads: usize,
) -> Result<(usize, usize, usize)> {
    let dims = q.shape().dims3()?;
    if k.shape().dims3()? != dims || v.shape().dims3()? != dims || heads == 0 || dims.2 % heads != 0
    {
        candle_core::bail!(
            "attention: q {:?}, k {:?}, v {:?} with {heads} heads do not fit",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    Ok(dims)
}

impl Attention {
    /// Head `bh` (batch·heads + head) of x [b, t, d] as a [t, d/heads] operand, or as
    /// its transpose.
    fn head<'a, T>(
        &self,
        x: &'a [T],
        (t, d): (usize, usize),
        bh: usize,
        transposed: bool,
    ) -> Operand<'a, T> {
        let hd = d / self.heads;
        let data = &x[(bh / self.heads) * t * d + (bh % self.heads) * hd..];
        if transposed {
            Operand { data, rs: 1, cs: d }
        } else {
            Operand { data, rs: d, cs: 1 }
        }
    }

    /// Per-head [t, d/heads] blocks back into one [b, t, d] buffer.
    fn gather<T: Elem>(&self, blocks: &[Vec<T>], (b, t, d): (usize, usize, usize)) -> Vec<T> {
        let hd = d / self.heads;
        let mut out = vec![T::zero(); b * t * d];
        out.par_chunks_mut(t * d).enumerate().for_each(|(bi, out)| {
            for h in 0..self.heads {
                let block = &blocks[bi * self.heads + h];
                for (row, src) in out.chunks_mut(d).zip(block.chunks(hd)) {
                    row[h * hd..(h + 1) * hd].copy_from_slice(src);
                }
            }
        });
        out
    }

    fn probs<T: Elem>(&self, q: &[T], k: &[T], (b, t, d): (usize, usize, usize)) -> Vec<T> {
        let hd = d / self.heads;
        let mut p = vec![T::zero(); b * self.heads * t * t];
        p.par_chunks_mut(t * t).enumerate().for_each(|(bh, p)| {
            let s = T::matmul_serial(
                t,
                t,
                hd,
                self.head(q, (t, d), bh, false),
                self.head(k, (t, d), bh, true),
            );
            for (i, (p, s)) in p.chunks_mut(t).zip(s.chunks(t)).enumerate() {
                let keys = if self.causal { i + 1 } else { t };
                T::softmax_row(&s[..keys], &mut p[..keys], self.scale);
            }
        });
        p
    }

    pub(super) fn fwd<T: Elem>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        dims: (usize, usize, usize),
    ) -> Vec<T> {
        let (b, t, d) = dims;
        let hd = d / self.heads;
        let p = self.probs(q, k, dims);
        let blocks: Vec<Vec<T>> = (0..b * self.heads)
            .into_par_iter()
            .map(|bh| {
                T::matmul_serial(
                    t,
                    hd,
                    t,
                    Operand::rows(&p[bh * t * t..], t),
                    self.head(v, (t, d), bh, false),
                )
            })
            .collect();
        *self.saved.lock().expect("not poisoned") = Some(T::to_cpu_storage_owned(p));
        self.gather(&blocks, dims)
    }

    pub(super) fn bwd_t<T: Elem>(
        &self,
        (q, k, v, g): (&[T], &[T], &[T], &[T]),
        dims: (usize, usize, usize),
    ) -> Result<[Vec<T>; 3]> {
        let (b, t, d) = dims;
        let hd = d / self.heads;
        let saved = self.saved.lock().expect("not poisoned").take();
        let p = match saved.map(T::cpu_storage_data) {
            Some(Ok(p)) => p,
            Some(Err(_)) => candle_core::bail!("attention: saved probabilities of another dtype"),
            None => self.probs(q, k, dims),
        };
        let grads: Vec<[Vec<T>; 3]> = (0..b * self.heads)
            .into_par_iter()
            .map(|bh| {
                let p = &p[bh * t * t..(bh + 1) * t * t];
                let head = |x, transposed| self.head(x, (t, d), bh, transposed);
                let dv = T::matmul_serial(t, hd, t, Operand::transposed(p, t), head(g, false));
                let mut ds = T::matmul_serial(t, t, hd, head(g, false), head(v, true));
                for (ds, p) in ds.chunks_mut(t).zip(p.chunks(t)) {
                    T::softmax_grad_row(ds, p, self.scale);
                }
                let dq = T::matmul_serial(t, hd, t, Operand::rows(&ds, t), head(k, false));
                let dk = T::matmul_serial(t, hd, t, Operand::transposed(&ds, t), head(q, false));
                [dq, dk, dv]
            })
            .collect();
        let [mut dq, mut dk, mut dv] = [vec![], vec![], vec![]];
        for [q, k, v] in grads {
            dq.push(q);
            dk.push(k);
            dv.push(v);
        }
        Ok([
            self.gather(&dq, dims),
            self.gather(&dk, dims),
            self.gather(&dv, dims),
        ])
    }
}

impl ThreeOp for Attention {
    const NAME: &'static str = "attention-train";
    type Dims = (usize, usize, usize);

    fn dims(&self, q: &Layout, k: &Layout, v: &Layout) -> Result<Self::Dims> {
        attention_dims(q, k, v, self.heads)
    }

    fn out_shape(&self, _: &Layout, dims: Self::Dims) -> Shape {
        Shape::from(dims)
    }

    fn fwd<T: Elem>(&self, q: &[T], k: &[T], v: &[T], dims: Self::Dims) -> Vec<T> {
        Attention::fwd(self, q, k, v, dims)
    }

    fn bwd<T: Elem>(&self, ops: (&[T], &[T], &[T], &[T]), dims: Self::Dims) -> Result<[Vec<T>; 3]> {
        self.bwd_t(ops, dims)
    }
}
