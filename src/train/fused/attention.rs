//! Attention over all heads of [b, t, d] q, k and v as one node of the training graph.

use std::sync::Mutex;

use candle_core::{Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::*;
use crate::train::theta::uninit_as;

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

    /// Every head's probabilities [b·heads, t, t] (a causal row's masked keys as
    /// zeros), each head's block handed to `then` on the task that wrote it.
    fn probs_then<T: Elem>(
        &self,
        q: &[T],
        k: &[T],
        (b, t, d): (usize, usize, usize),
        then: impl Fn(usize, &[T]) + Sync,
    ) -> Vec<T> {
        let mut p = Vec::with_capacity(b * self.heads * t * t);
        p.spare_capacity_mut()
            .par_chunks_mut((t * t).max(1))
            .enumerate()
            .for_each(|(bh, p)| {
                let p = uninit_as(p);
                let s = T::matmul_serial(
                    t,
                    t,
                    d / self.heads,
                    self.head(q, (t, d), bh, false),
                    self.head(k, (t, d), bh, true),
                );
                for (i, (p, s)) in p.chunks_mut(t).zip(s.chunks(t)).enumerate() {
                    let keys = if self.causal { i + 1 } else { t };
                    T::softmax_row(&s[..keys], &mut p[..keys], self.scale);
                    p[keys..].fill(T::zero());
                }
                then(bh, p);
            });
        // SAFETY: every head's block was written above.
        unsafe { p.set_len(b * self.heads * t * t) };
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
        if b * t * d == 0 {
            return vec![];
        }
        let out = HeadsOut::new(b * t * d);
        let p = self.probs_then(q, k, dims, |bh, p| {
            let v = self.head(v, (t, d), bh, false);
            // SAFETY: task bh alone writes head bh.
            unsafe { out.product(self, bh, (t, d), t, Operand::rows(p, t), v) };
        });
        *self.saved.lock().expect("not poisoned") = Some(T::to_cpu_storage_owned(p));
        // SAFETY: the heads' products wrote every element.
        unsafe { out.finish() }
    }

    pub(super) fn bwd_t<T: Elem>(
        &self,
        (q, k, v, g): (&[T], &[T], &[T], &[T]),
        dims: (usize, usize, usize),
    ) -> Result<[Vec<T>; 3]> {
        let (b, t, d) = dims;
        let hd = d / self.heads;
        let saved = self.saved.lock().expect("not poisoned").take();
        if b * t * d == 0 {
            return Ok([vec![], vec![], vec![]]);
        }
        let p = match saved.map(T::cpu_storage_data) {
            Some(Ok(p)) => p,
            Some(Err(_)) => candle_core::bail!("attention: saved probabilities of another dtype"),
            None => self.probs_then(q, k, dims, |_, _| {}),
        };
        let [dq, dk, dv] = [(); 3].map(|_| HeadsOut::new(b * t * d));
        (0..b * self.heads).into_par_iter().for_each(|bh| {
            let p = &p[bh * t * t..(bh + 1) * t * t];
            let head = |x, transposed| self.head(x, (t, d), bh, transposed);
            // SAFETY: task bh alone writes head bh of each output.
            let write =
                |out: &HeadsOut<T>, lhs, rhs| unsafe { out.product(self, bh, (t, d), t, lhs, rhs) };
            write(&dv, Operand::transposed(p, t), head(g, false));
            let mut ds = T::matmul_serial(t, t, hd, head(g, false), head(v, true));
            for (ds, p) in ds.chunks_mut(t).zip(p.chunks(t)) {
                T::softmax_grad_row(ds, p, self.scale);
            }
            write(&dq, Operand::rows(&ds, t), head(k, false));
            write(&dk, Operand::transposed(&ds, t), head(q, false));
        });
        // SAFETY: each head's three products wrote every element of its columns.
        Ok(unsafe { [dq.finish(), dk.finish(), dv.finish()] })
    }
}

/// A [b, t, d] buffer that parallel tasks write head by head, each task (batch, head)
/// the head's d/heads columns of the batch's t rows, so that no gather pass follows
/// (per-head results copied into place were a quarter of the attention's time).
struct HeadsOut<T> {
    buf: Vec<T>,
    ptr: *mut T,
    len: usize,
}

// SAFETY: threads write through `ptr` only by `product`, whose callers keep the heads
// apart; the Vec is touched again only by `finish`, which takes the buffer by value.
unsafe impl<T: Send> Send for HeadsOut<T> {}
unsafe impl<T: Send> Sync for HeadsOut<T> {}

impl<T: Elem> HeadsOut<T> {
    fn new(len: usize) -> Self {
        let mut buf = Vec::with_capacity(len);
        let ptr = buf.as_mut_ptr();
        Self { buf, ptr, len }
    }

    /// Head `bh`'s block [t, d/heads] = lhs [t, depth] · rhs [depth, d/heads], on the
    /// calling thread.
    ///
    /// # Safety
    /// No other thread writes head `bh`'s block at the same time.
    unsafe fn product(
        &self,
        a: &Attention,
        bh: usize,
        (t, d): (usize, usize),
        depth: usize,
        lhs: Operand<T>,
        rhs: Operand<T>,
    ) {
        let hd = d / a.heads;
        let first = (bh / a.heads) * t * d + (bh % a.heads) * hd;
        assert!(
            t > 0
                && hd > 0
                && depth > 0
                && lhs.covers(t, depth)
                && rhs.covers(depth, hd)
                && first + (t - 1) * d + hd <= self.len,
            "attention head product out of bounds"
        );
        // SAFETY: the operands and the block lie inside their buffers (checked above);
        // the block is this task's alone (the caller's contract).
        unsafe {
            T::matmul_raw(
                gemm::Parallelism::None,
                self.ptr.add(first),
                d,
                (t, hd, depth),
                lhs,
                rhs,
            )
        }
    }

    /// The buffer, once every head's block has been written.
    ///
    /// # Safety
    /// Every element was written by [`HeadsOut::product`] (or the buffer is empty).
    unsafe fn finish(mut self) -> Vec<T> {
        // SAFETY: the caller's contract (`new` reserved `len`).
        unsafe { self.buf.set_len(self.len) };
        self.buf
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
