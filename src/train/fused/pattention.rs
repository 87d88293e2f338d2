//! A whole Pattention Θ(x·Kᵀ)·V as one node of the training graph.

use std::sync::Mutex;

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

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

/// The shape of a single Pattention's operands (one group).
fn pattention_dims(x: &Layout, k: &Layout, v: &Layout) -> Result<Dims> {
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
    Ok(Dims {
        r,
        d,
        n,
        o,
        groups: 1,
    })
}

/// Rows a block of the row-blocked passes takes. Smaller blocks keep more in cache
/// but pay gemm's operand packing once per block; 512 measured best of 64 to 2,080 on
/// the ViT's and LM's shapes (docs/PERFORMANCE.md).
pub(super) const BLOCK_ROWS: usize = 512;

/// The shape of one pass: rows, input width, tokens per group, output width, groups.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub r: usize,
    pub d: usize,
    pub n: usize,
    pub o: usize,
    pub groups: usize,
}

impl Pattention {
    /// `groups` Pattentions that read the same x [r, d], keys stacked in `keys`
    /// [groups·n, d] and values in `values` [groups·n, o] (q, k and v are three, every
    /// other projection one): y_g = Θ(x·K_gᵀ)·V_g [r, o] for each group. The scores of
    /// all groups are one product; each block of rows runs its scores, Θ and value
    /// products on one thread while they are in cache. The scores and weights [r,
    /// groups·n] are kept for the backward.
    pub(super) fn fwd<T: Elem>(
        &self,
        x: &[T],
        keys: &[T],
        values: &[T],
        dims: Dims,
    ) -> Vec<Vec<T>> {
        let (s, w, y) = forward_blocked(x, keys, values, dims, self.c);
        *self.saved.lock().expect("not poisoned") =
            Some((T::to_cpu_storage_owned(s), T::to_cpu_storage_owned(w)));
        y
    }

    /// The backward of [`Self::fwd`] from the outputs' gradients `grads` (one [r, o]
    /// per group): returns ∂x and writes ∂keys and ∂values (stacked as the keys and
    /// values) into `dkeys` and `dvalues`.
    pub(super) fn bwd<T: Elem>(
        &self,
        (x, keys, values): (&[T], &[T], &[T]),
        grads: &[&[T]],
        (dkeys, dvalues): (&mut [T], &mut [T]),
        dims: Dims,
    ) -> Result<Vec<T>> {
        let Dims { r, d, n, o, groups } = dims;
        let gn = groups * n;
        let saved = self.saved.lock().expect("not poisoned").take();
        // A second backward over the same graph recomputes what the first one took.
        let (mut s, w) = match saved {
            Some((s, w)) => match (T::cpu_storage_data(s), T::cpu_storage_data(w)) {
                (Ok(s), Ok(w)) => (s, w),
                _ => candle_core::bail!("pattention: saved scores of another dtype"),
            },
            None => {
                let (s, w, _) = forward_blocked(x, keys, values, dims, self.c);
                (s, w)
            }
        };
        for (g, grad) in grads.iter().enumerate() {
            let weights = Operand {
                data: &w[g * n..],
                rs: 1,
                cs: gn,
            };
            let dv = T::matmul_long(n, o, r, weights, Operand::rows(grad, o));
            dvalues[g * n * o..(g + 1) * n * o].copy_from_slice(&dv);
        }
        drop(w);
        let dx = backward_blocked(&mut s, grads, keys, values, dims, self.c);
        let dk = T::matmul_long(gn, d, r, Operand::transposed(&s, gn), Operand::rows(x, d));
        dkeys.copy_from_slice(&dk);
        Ok(dx)
    }
}

/// Scores s = x·Kᵀ [r, groups·n], weights w = Θ(s) over each group's n columns and the
/// outputs w_g·V_g, block by block of rows (see [`Pattention::fwd`]).
fn forward_blocked<T: Elem>(
    x: &[T],
    keys: &[T],
    values: &[T],
    Dims { r, d, n, o, groups }: Dims,
    c: f64,
) -> (Vec<T>, Vec<T>, Vec<Vec<T>>) {
    let gn = groups * n;
    if r * gn * d * o == 0 {
        // No rows, tokens or features: Θ of all-zero scores is zero, and so is every
        // output (the blocks below need non-empty rows).
        let zeros = |len| vec![T::zero(); len];
        return (
            zeros(r * gn),
            zeros(r * gn),
            (0..groups).map(|_| zeros(r * o)).collect(),
        );
    }
    let serial = gemm::Parallelism::None;
    let (mut s, mut w) = (Vec::with_capacity(r * gn), Vec::with_capacity(r * gn));
    let mut ys: Vec<Vec<T>> = (0..groups).map(|_| Vec::with_capacity(r * o)).collect();
    // Each block's rows of every output, gathered per block.
    let mut outs: Vec<Vec<&mut [T]>> = (0..r.div_ceil(BLOCK_ROWS)).map(|_| vec![]).collect();
    for y in ys.iter_mut() {
        let y = theta::uninit_as(&mut y.spare_capacity_mut()[..r * o]);
        for (block, rows) in outs.iter_mut().zip(y.chunks_mut(BLOCK_ROWS * o)) {
            block.push(rows);
        }
    }
    let s_rows = theta::uninit_as(&mut s.spare_capacity_mut()[..r * gn]);
    let w_rows = theta::uninit_as(&mut w.spare_capacity_mut()[..r * gn]);
    s_rows
        .par_chunks_mut(BLOCK_ROWS * gn)
        .zip(w_rows.par_chunks_mut(BLOCK_ROWS * gn))
        .zip(x.par_chunks(BLOCK_ROWS * d))
        .zip(outs.into_par_iter())
        .for_each(|(((s, w), x), mut ys)| {
            let rows = x.len() / d;
            let keys_t = Operand::transposed(keys, d);
            T::matmul_into(serial, s, gn, (rows, gn, d), Operand::rows(x, d), keys_t);
            T::theta_rows(s, w, n, c);
            for (g, y) in ys.iter_mut().enumerate() {
                let weights = Operand {
                    data: &w[g * n..],
                    rs: gn,
                    cs: 1,
                };
                let v = Operand::rows(&values[g * n * o..(g + 1) * n * o], o);
                T::matmul_into(serial, y, o, (rows, o, n), weights, v);
            }
        });
    // SAFETY: every block wrote all its rows of s, w and each output above.
    unsafe {
        s.set_len(r * gn);
        w.set_len(r * gn);
        ys.iter_mut().for_each(|y| y.set_len(r * o));
    }
    (s, w, ys)
}

/// The row-local part of the backward, block by block of rows: ∂w_g = ∂y_g·V_gᵀ,
/// the scores `s` turned into ∂s by Θ's backward, and ∂x = ∂s·K (returned).
fn backward_blocked<T: Elem>(
    s: &mut [T],
    grads: &[&[T]],
    keys: &[T],
    values: &[T],
    Dims { r, d, n, o, groups }: Dims,
    c: f64,
) -> Vec<T> {
    let gn = groups * n;
    if r * gn * d * o == 0 {
        // ∂x and ∂K, the only readers of ∂s, are empty, or ∂y is and ∂s is zero.
        s.fill(T::zero());
        return vec![T::zero(); r * d];
    }
    let serial = gemm::Parallelism::None;
    let mut dx = Vec::with_capacity(r * d);
    let dx_rows = theta::uninit_as(&mut dx.spare_capacity_mut()[..r * d]);
    s.par_chunks_mut(BLOCK_ROWS * gn)
        .zip(dx_rows.par_chunks_mut(BLOCK_ROWS * d))
        .enumerate()
        .for_each_init(
            || vec![T::zero(); BLOCK_ROWS * gn],
            |dw, (block, (s, dx))| {
                let rows = dx.len() / d;
                let dw = &mut dw[..rows * gn];
                for (g, grad) in grads.iter().enumerate() {
                    let grad = &grad[block * BLOCK_ROWS * o..][..rows * o];
                    let v = Operand::transposed(&values[g * n * o..(g + 1) * n * o], o);
                    T::matmul_into(
                        serial,
                        &mut dw[g * n..],
                        gn,
                        (rows, n, o),
                        Operand::rows(grad, o),
                        v,
                    );
                }
                T::theta_grad_rows(s, dw, n, c);
                T::matmul_into(
                    serial,
                    dx,
                    d,
                    (rows, d, gn),
                    Operand::rows(s, gn),
                    Operand::rows(keys, d),
                );
            },
        );
    // SAFETY: every block wrote all its rows of ∂x above.
    unsafe { dx.set_len(r * d) };
    dx
}

impl ThreeOp for Pattention {
    const NAME: &'static str = "pattention-train";
    type Dims = Dims;

    fn dims(&self, x: &Layout, k: &Layout, v: &Layout) -> Result<Self::Dims> {
        pattention_dims(x, k, v)
    }

    fn out_shape(&self, x: &Layout, dims: Dims) -> Shape {
        let mut shape = x.dims().to_vec();
        *shape.last_mut().expect("checked by pattention_dims") = dims.o;
        Shape::from(shape)
    }

    fn fwd<T: Elem>(&self, x: &[T], k: &[T], v: &[T], dims: Dims) -> Vec<T> {
        Pattention::fwd(self, x, k, v, dims)
            .pop()
            .expect("one group, one output")
    }

    fn bwd<T: Elem>(
        &self,
        (x, k, v, g): (&[T], &[T], &[T], &[T]),
        dims: Dims,
    ) -> Result<[Vec<T>; 3]> {
        let (mut dk, mut dv) = (vec![T::zero(); k.len()], vec![T::zero(); v.len()]);
        let dx = Pattention::bwd(self, (x, k, v), &[g], (&mut dk, &mut dv), dims)?;
        Ok([dx, dk, dv])
    }
}
