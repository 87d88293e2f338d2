//! Ops over the rows of the last axis with their own backward, one op for every
//! device (the GPU training ops `masked_softmax` and `nonparam_norm`): on a GPU
//! a CUDA kernel each way (`rows_cuda`), on the CPU plain f64 loops over the
//! rows, so that each op's values and backward are tested where there is no GPU.
//! Also what `logprob`'s CPU side shares with them: reading f32 or f64 storages
//! as f64 and writing results back in the input's dtype.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType,
};

/// A row-wise op: its forward row by row and its backward from one saved
/// tensor (the op's input or its output) and ∂L/∂y.
pub(crate) trait RowOp: Clone + Send + Sync + 'static {
    const NAME: &'static str;
    const GRAD_NAME: &'static str;
    /// Whether the backward reads the op's output (else its input) beside ∂L/∂y.
    const GRAD_FROM_OUTPUT: bool;
    /// Row `index` of the forward, in f64 (`y` starts at 0).
    fn forward_row(&self, index: usize, x: &[f64], y: &mut [f64]);
    /// ∂L/∂x of one row from the saved row and ∂L/∂y, in f64.
    fn grad_row(&self, saved: &[f64], dy: &[f64], dx: &mut [f64]);
    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        x: (&candle_core::CudaStorage, &Layout),
    ) -> Result<candle_core::CudaStorage>;
    #[cfg(feature = "cuda")]
    fn cuda_grad(
        &self,
        saved: (&candle_core::CudaStorage, &Layout),
        dy: (&candle_core::CudaStorage, &Layout),
    ) -> Result<candle_core::CudaStorage>;
}

/// `op` over the rows of `x`, differentiable.
pub(crate) fn apply<R: RowOp>(x: &Tensor, op: R) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Forward(op))
}

struct Forward<R>(R);

/// The backward: ∂L/∂x from the saved tensor and ∂L/∂y.
struct Grad<R>(R);

fn row_len(layout: &Layout) -> usize {
    layout.dims().last().copied().unwrap_or(1).max(1)
}

impl<R: RowOp> CustomOp1 for Forward<R> {
    fn name(&self) -> &'static str {
        R::NAME
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f64s(storage, layout)?;
        let n = row_len(layout);
        let mut y = vec![0.0; x.len()];
        for (i, (x, y)) in x.chunks(n).zip(y.chunks_mut(n)).enumerate() {
            self.0.forward_row(i, x, y);
        }
        Ok((like(storage, y), layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            self.0.cuda_forward((storage, layout))?,
            layout.shape().clone(),
        ))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let saved = if R::GRAD_FROM_OUTPUT { res } else { arg };
        Ok(Some(grad(saved, grad_res, self.0.clone())?))
    }
}

/// ∂L/∂x of `op` outside the graph, from its saved tensor (its input, or its output
/// where `R::GRAD_FROM_OUTPUT`) and ∂L/∂y: for a backward written out by hand.
pub(crate) fn grad<R: RowOp>(saved: &Tensor, dy: &Tensor, op: R) -> Result<Tensor> {
    saved.apply_op2_no_bwd(&dy.contiguous()?, &Grad(op))
}

impl<R: RowOp> CustomOp2 for Grad<R> {
    fn name(&self) -> &'static str {
        R::GRAD_NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (saved, dy) = (f64s(s1, l1)?, f64s(s2, l2)?);
        let n = row_len(l1);
        let mut dx = vec![0.0; saved.len()];
        for ((s, g), d) in saved.chunks(n).zip(dy.chunks(n)).zip(dx.chunks_mut(n)) {
            self.0.grad_row(s, g, d);
        }
        Ok((like(s1, dx), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((self.0.cuda_grad((s1, l1), (s2, l2))?, l1.shape().clone()))
    }
}

/// The contiguous elements of `s` under `layout`, of type T.
pub(crate) fn contiguous<'a, T: WithDType>(s: &'a CpuStorage, layout: &Layout) -> Result<&'a [T]> {
    let Some((a, b)) = layout.contiguous_offsets() else {
        candle_core::bail!("contiguous inputs only")
    };
    Ok(&s.as_slice::<T>()?[a..b])
}

/// The contiguous f32 or f64 elements of `s` as f64.
pub(crate) fn f64s(s: &CpuStorage, layout: &Layout) -> Result<Vec<f64>> {
    Ok(match s.dtype() {
        DType::F32 => contiguous::<f32>(s, layout)?
            .iter()
            .map(|&x| f64::from(x))
            .collect(),
        DType::F64 => contiguous::<f64>(s, layout)?.to_vec(),
        d => candle_core::bail!("f32 or f64 on the CPU, not {d:?}"),
    })
}

/// `v` as a storage of `like`'s dtype (f32, else f64).
pub(crate) fn like(like: &CpuStorage, v: Vec<f64>) -> CpuStorage {
    match like.dtype() {
        DType::F32 => CpuStorage::F32(v.into_iter().map(|x| x as f32).collect()),
        _ => CpuStorage::F64(v),
    }
}
