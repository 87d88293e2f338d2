//! Training attention's softmax on a GPU (`cuda/softmax.cu`), the CUDA side of
//! [`super::masked_softmax`]: softmax(scale · s) over the last axis with the
//! causal mask applied inside the kernel (no [t, t] mask tensor, no widened
//! copy), and its backward from the probabilities alone, sums and exponentials
//! in f32 for f32, bf16 and f16 scores. Experimental: training takes it only
//! when `TOKENFORMER_CUDA_KERNELS=1` (see [`super::cuda_kernels_enabled`]).

use candle_core::{CudaStorage, DType, Layout, Result, Tensor};

use super::rows_cuda::{launch_rows, Module};

const SOFTMAX: Module = Module {
    name: "tokenformer_softmax",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/softmax.ptx")),
};

/// Whether training's softmax takes the kernel for `scores`: the CUDA kernels
/// turned on, f32/bf16/f16 scores of rank ≥ 2 on a GPU.
pub(crate) fn serves(scores: &Tensor) -> bool {
    super::cuda_kernels_enabled()
        && scores.device().is_cuda()
        && matches!(scores.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && scores.rank() >= 2
}

/// The softmax of contiguous scores whose second-to-last axis holds `queries`
/// (see softmax.cu for `causal`).
pub(crate) fn forward(
    scores: (&CudaStorage, &Layout),
    scale: f32,
    queries: i32,
    causal: bool,
) -> Result<CudaStorage> {
    let ints = [queries.max(1), i32::from(causal)];
    launch_rows(SOFTMAX, "softmax", &[scores], scale, &ints)
}

/// ∂L/∂s = scale · y · (dy − Σ y·dy) from the probabilities y and dy.
pub(crate) fn grad(
    y: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    scale: f32,
) -> Result<CudaStorage> {
    launch_rows(SOFTMAX, "softmax_grad", &[y, dy], scale, &[])
}
