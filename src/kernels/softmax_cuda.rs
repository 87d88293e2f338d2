//! Training attention's softmax on a GPU as one kernel each way
//! (`cuda/softmax.cu`): softmax(scale · s) over the last axis with the causal
//! mask applied inside the kernel (no [t, t] mask tensor, no widened copy), and
//! its backward from the probabilities alone. Sums and exponentials in f32 for
//! f32, bf16 and f16 scores. Experimental: taken only when
//! `TOKENFORMER_CUDA_KERNELS=1` (see [`super::cuda_kernels_enabled`]).

use candle_core::{CpuStorage, CudaStorage, DType, Layout, Result, Shape, Tensor};

use super::rows_cuda::{launch_rows, Module};

const SOFTMAX: Module = Module {
    name: "tokenformer_softmax",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/softmax.ptx")),
};

/// Whether training's softmax takes the kernel for `scores`: the CUDA kernels
/// turned on, f32/bf16/f16 on a GPU, rows short enough for one launch.
pub(crate) fn serves(scores: &Tensor) -> bool {
    super::cuda_kernels_enabled()
        && scores.device().is_cuda()
        && matches!(scores.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && scores.rank() >= 2
}

/// softmax(scale · scores) over the last axis, differentiable; with `causal`,
/// query q of the second-to-last axis (of t) sees keys 0 ..= q + keys − t, as
/// adding the causal mask first does. By the kernel whatever
/// `TOKENFORMER_CUDA_KERNELS` says (GPU scores only).
pub fn softmax_scaled(scores: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let dims = scores.dims();
    let (queries, keys) = match dims {
        [.., q, k] => (*q, *k),
        _ => candle_core::bail!("softmax kernel: scores of rank ≥ 2, not {dims:?}"),
    };
    if causal && queries > keys {
        candle_core::bail!("softmax kernel: {queries} causal queries over {keys} keys")
    }
    let Ok(queries) = i32::try_from(queries) else {
        candle_core::bail!("softmax kernel: {queries} queries")
    };
    scores.contiguous()?.apply_op1(Softmax {
        scale: scale as f32,
        queries,
        causal,
    })
}

struct Softmax {
    scale: f32,
    queries: i32,
    causal: bool,
}

impl candle_core::CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax-train-cuda"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the CUDA softmax kernel runs on a GPU only")
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let ints = [self.queries.max(1), i32::from(self.causal)];
        let out = launch_rows(SOFTMAX, "softmax", &[(storage, layout)], self.scale, &ints)?;
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        Ok(Some(res.apply_op2_no_bwd(&g, &Grad { scale: self.scale })?))
    }
}

/// ∂L/∂s = scale · y · (dy − Σ y·dy) from the probabilities y and dy.
struct Grad {
    scale: f32,
}

impl candle_core::CustomOp2 for Grad {
    fn name(&self) -> &'static str {
        "softmax-train-cuda-grad"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the CUDA softmax kernel runs on a GPU only")
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = launch_rows(
            SOFTMAX,
            "softmax_grad",
            &[(s1, l1), (s2, l2)],
            self.scale,
            &[],
        )?;
        Ok((out, l1.shape().clone()))
    }
}
