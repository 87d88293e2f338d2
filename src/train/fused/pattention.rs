//! A whole Pattention Θ(x·Kᵀ)·V as one node of the training graph.

use std::sync::Mutex;

use candle_core::{Layout, Result, Shape, Tensor};

use super::*;

/// Θ(x·Kᵀ)·V with Θ = l2_norm_gelu of constant √`scale_tokens`, for x [.., d] (any
/// leading axes: rows), K [n, d] and V [n, out], as one node whose backward gives ∂x,
/// ∂K and ∂V. Taking x as it is saves reshape nodes, each of which costs the backward
/// a zeroed gradient and an addition.
pub(crate) fn pattention(
    x: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale_tokens: usize,
) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        Three(Pattention {
            c: (scale_tokens as f64).sqrt(),
            saved: Mutex::new(None),
        }),
    )
}

pub(super) struct Pattention {
    pub(super) c: f64,
    /// The forward's scores and weights, for the backward (taken by it).
    pub(super) saved: Mutex<Option<(CpuStorage, CpuStorage)>>,
}

/// Rows, inner width, tokens and output width of a Pattention's operands.
fn pattention_dims(x: &Layout, k: &Layout, v: &Layout) -> Result<(usize, usize, usize, usize)> {
    let (d, r) = match x.dims() {
        [lead @ .., d] if !lead.is_empty() => (*d, lead.iter().product()),
        _ => candle_core::bail!("pattention: x of shape {:?} has no rows", x.dims()),
    };
    let (n, dk) = k.shape().dims2()?;
    let (nv, o) = v.shape().dims2()?;
    if d != dk || n != nv {
        candle_core::bail!(
            "pattention: x {:?}, keys {:?} and values {:?} do not fit",
            x.dims(),
            k.dims(),
            v.dims()
        )
    }
    Ok((r, d, n, o))
}

impl Pattention {
    /// Scores x·Kᵀ [r, n] and weights Θ(scores).
    fn scores<T: Elem>(
        &self,
        x: &[T],
        k: &[T],
        (r, d, n): (usize, usize, usize),
    ) -> (Vec<T>, Vec<T>) {
        let s = T::matmul(r, n, d, Operand::rows(x, d), Operand::transposed(k, d));
        let w = T::theta(&s, n, self.c);
        (s, w)
    }

    pub(super) fn fwd<T: Elem>(
        &self,
        x: &[T],
        k: &[T],
        v: &[T],
        dims: (usize, usize, usize, usize),
    ) -> Vec<T> {
        let (r, d, n, o) = dims;
        let (s, w) = self.scores(x, k, (r, d, n));
        let y = T::matmul(r, o, n, Operand::rows(&w, n), Operand::rows(v, o));
        *self.saved.lock().expect("not poisoned") =
            Some((T::to_cpu_storage_owned(s), T::to_cpu_storage_owned(w)));
        y
    }

    /// (∂x, ∂K, ∂V) from ∂y; `g` [r, o].
    pub(super) fn bwd_t<T: Elem>(
        &self,
        (x, k, v, g): (&[T], &[T], &[T], &[T]),
        (r, d, n, o): (usize, usize, usize, usize),
    ) -> Result<[Vec<T>; 3]> {
        let saved = self.saved.lock().expect("not poisoned").take();
        // A second backward over the same graph recomputes what the first one took.
        let (s, w) = match saved {
            Some((s, w)) => match (T::cpu_storage_data(s), T::cpu_storage_data(w)) {
                (Ok(s), Ok(w)) => (s, w),
                _ => candle_core::bail!("pattention: saved scores of another dtype"),
            },
            None => self.scores(x, k, (r, d, n)),
        };
        let dw = T::matmul(r, n, o, Operand::rows(g, o), Operand::transposed(v, o));
        let dv = T::matmul_long(n, o, r, Operand::transposed(&w, n), Operand::rows(g, o));
        drop(w);
        let ds = T::theta_grad(s, &dw, n, self.c);
        drop(dw);
        let dx = T::matmul(r, d, n, Operand::rows(&ds, n), Operand::rows(k, d));
        let dk = T::matmul_long(n, d, r, Operand::transposed(&ds, n), Operand::rows(x, d));
        Ok([dx, dk, dv])
    }
}

impl ThreeOp for Pattention {
    const NAME: &'static str = "pattention-train";
    type Dims = (usize, usize, usize, usize);

    fn dims(&self, x: &Layout, k: &Layout, v: &Layout) -> Result<Self::Dims> {
        pattention_dims(x, k, v)
    }

    fn out_shape(&self, x: &Layout, (.., o): Self::Dims) -> Shape {
        let mut shape = x.dims().to_vec();
        *shape.last_mut().expect("checked by pattention_dims") = o;
        Shape::from(shape)
    }

    fn fwd<T: Elem>(&self, x: &[T], k: &[T], v: &[T], dims: Self::Dims) -> Vec<T> {
        Pattention::fwd(self, x, k, v, dims)
    }

    fn bwd<T: Elem>(&self, ops: (&[T], &[T], &[T], &[T]), dims: Self::Dims) -> Result<[Vec<T>; 3]> {
        self.bwd_t(ops, dims)
    }
}
