//! Θ on a CUDA GPU as one kernel (`cuda/theta.cu`, PTX built by build.rs): a
//! pass over the scores instead of candle's half-dozen element-wise and
//! reduction launches, every sum in f32 whatever the scores' dtype. For
//! inference only (no backward): training differentiates the definition.
//! Experimental: taken only when `TOKENFORMER_CUDA_KERNELS=1` (see
//! [`super::cuda_kernels_enabled`]) until a GPU session has checked it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Result, Shape, Tensor};

use super::theta::Activation;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/theta.ptx"));

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

impl ThetaCuda {
    fn launch<T: DeviceRepr + CudaDType>(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
        kernel: &str,
    ) -> Result<CudaStorage> {
        let n = *layout.dims().last().expect("rank ≥ 1");
        let rows = layout.shape().elem_count() / n;
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("theta kernel: contiguous scores only")
        };
        let dev = &storage.device;
        let func = dev.get_or_load_custom_func(kernel, "tokenformer_theta", PTX)?;
        let src: &CudaSlice<T> = storage.as_cuda_slice()?;
        let src = src.slice(start..end);
        // SAFETY: every element is written by the kernel before it is read.
        let out = unsafe { dev.alloc::<T>(end - start)? };
        let (scale, act) = match self.activation {
            Activation::L2NormGelu => ((self.scale_tokens as f32).sqrt(), 0i32),
            Activation::GeluL2Norm => ((self.scale_tokens as f32).sqrt(), 1),
            Activation::Softmax => (self.scale_tokens as f32, 2),
        };
        let n32 = n as i32;
        // One block a row; fewer threads for short rows (a warp at least).
        let threads = n.next_power_of_two().clamp(32, 1024) as u32;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&out);
        b.arg(&n32);
        b.arg(&scale);
        b.arg(&act);
        // SAFETY: the arguments match the kernel's (in, out, n, scale, act), and
        // `in` and `out` hold rows · n elements.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

impl candle_core::CustomOp1 for ThetaCuda {
    fn name(&self) -> &'static str {
        "pattention-theta-cuda"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the CUDA theta kernel runs on a GPU only")
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let rows = layout.shape().elem_count() / layout.dims().last().copied().unwrap_or(1).max(1);
        if rows > u32::MAX as usize {
            candle_core::bail!("theta kernel: {rows} rows are more than one launch takes")
        }
        let out = match storage.dtype() {
            DType::F32 => self.launch::<f32>(storage, layout, "theta_f32")?,
            DType::BF16 => self.launch::<::half::bf16>(storage, layout, "theta_bf16")?,
            DType::F16 => self.launch::<::half::f16>(storage, layout, "theta_f16")?,
            d => candle_core::bail!("theta kernel: no {d:?} version"),
        };
        Ok((out, layout.shape().clone()))
    }
}
