//! Θ on a CUDA GPU as one kernel (`cuda/theta.cu`, PTX built by build.rs): a
//! pass over the scores instead of candle's half-dozen element-wise and
//! reduction launches, every sum in f32 whatever the scores' dtype; and, for
//! training, the backward of `l2_norm_gelu` (`crate::train::theta`'s op runs
//! both on a GPU).
//! Experimental: taken only when `TOKENFORMER_CUDA_KERNELS=1` (see
//! [`super::cuda_kernels_enabled`]) until a GPU session has checked it.

use candle_core::{CpuStorage, CudaStorage, DType, Layout, Result, Shape, Tensor};

use super::rows_cuda::{launch_rows, Module};
use super::theta::Activation;

const THETA: Module = Module {
    name: "tokenformer_theta",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/theta.ptx")),
};

/// Whether the model's Θ takes the kernel for `scores`: the CUDA kernels
/// turned on, and [`fits`].
pub(crate) fn serves(scores: &Tensor) -> bool {
    super::cuda_kernels_enabled() && fits(scores)
}

/// Whether the kernel can take `scores`: contiguous f32/bf16/f16 on a GPU.
fn fits(scores: &Tensor) -> bool {
    scores.device().is_cuda()
        && scores.elem_count() > 0
        && matches!(scores.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && scores.is_contiguous()
        && scores
            .dims()
            .last()
            .is_some_and(|&n| n > 0 && n <= i32::MAX as usize)
}

/// Θ of `scores` (contiguous f32, bf16 or f16 on a GPU) in a new tensor of
/// their dtype, by the kernel whatever `TOKENFORMER_CUDA_KERNELS` says.
pub fn theta(scores: &Tensor, activation: Activation, scale_tokens: usize) -> Result<Tensor> {
    if !fits(scores) {
        candle_core::bail!(
            "theta kernel: contiguous f32/bf16/f16 scores on a GPU only, not {:?} on {:?}",
            scores.dtype(),
            scores.device().location()
        )
    }
    scores.apply_op1_no_bwd(&ThetaCuda {
        activation,
        scale_tokens,
    })
}

struct ThetaCuda {
    activation: Activation,
    scale_tokens: usize,
}

/// Θ of the kind `activation` with the multiplier `scale` (√n or n, as theta.cu
/// says) over contiguous f32/bf16/f16 scores on a GPU.
pub(crate) fn theta_storage(
    storage: &CudaStorage,
    layout: &Layout,
    activation: Activation,
    scale: f32,
) -> Result<CudaStorage> {
    let act = match activation {
        Activation::L2NormGelu => 0i32,
        Activation::GeluL2Norm => 1,
        Activation::Softmax => 2,
    };
    launch_rows(THETA, "theta", &[(storage, layout)], scale, &[act])
}

/// ∂L/∂s of `l2_norm_gelu` with the multiplier `scale` (√n) from contiguous scores
/// and ∂L/∂Θ of one shape and dtype (f32/bf16/f16) on a GPU, for training.
pub(crate) fn l2_norm_gelu_grad_storage(
    scores: (&CudaStorage, &Layout),
    grad: (&CudaStorage, &Layout),
    scale: f32,
) -> Result<CudaStorage> {
    launch_rows(THETA, "theta_grad", &[scores, grad], scale, &[])
}

impl candle_core::CustomOp1 for ThetaCuda {
    fn name(&self) -> &'static str {
        "pattention-theta-cuda"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the CUDA theta kernel runs on a GPU only")
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let scale = match self.activation {
            Activation::L2NormGelu | Activation::GeluL2Norm => (self.scale_tokens as f32).sqrt(),
            Activation::Softmax => self.scale_tokens as f32,
        };
        let out = theta_storage(storage, layout, self.activation, scale)?;
        Ok((out, layout.shape().clone()))
    }
}
