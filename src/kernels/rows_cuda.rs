//! Launching the project's row kernels on a GPU (`cuda/theta.cu`,
//! `cuda/softmax.cu`, `cuda/norm.cu`): one thread block per row of the last axis, contiguous
//! inputs of one shape and dtype (f32, bf16 or f16), an output of that shape and
//! dtype (or several, one after the other), and the arguments `(inputs…, out, n,
//! scale, ints…)`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Tensor};

/// Runs `$body` with `$t` the Rust type and `$name` the kernels' suffix ("f32",
/// "bf16", "f16") of the CUDA dtype `$dtype`, or fails naming `$what`: the one
/// dispatch from a storage's dtype to a kernel instance.
macro_rules! by_dtype {
    ($dtype:expr, $what:expr, |$t:ident, $name:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                let $name = "f32";
                $body
            }
            candle_core::DType::BF16 => {
                type $t = ::half::bf16;
                let $name = "bf16";
                $body
            }
            candle_core::DType::F16 => {
                type $t = ::half::f16;
                let $name = "f16";
                $body
            }
            d => candle_core::bail!("{}: no {d:?} version", $what),
        }
    };
}
pub(crate) use by_dtype;

/// Whether a model or training path takes a row kernel for `t`: the CUDA kernels
/// turned on (`TOKENFORMER_CUDA_KERNELS`), and f32, bf16 or f16 on a GPU.
pub(crate) fn serves(t: &Tensor) -> bool {
    super::cuda_kernels_enabled()
        && t.device().is_cuda()
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// A PTX module built by build.rs and the name it is loaded under.
pub(crate) struct Module {
    pub(crate) name: &'static str,
    pub(crate) ptx: &'static str,
}

/// Runs `{kernel}_{f32|bf16|f16}` of `module` over the rows of `inputs` (the
/// first input's shape) and returns its output.
pub(crate) fn launch_rows(
    module: Module,
    kernel: &str,
    inputs: &[(&CudaStorage, &Layout)],
    scale: f32,
    ints: &[i32],
) -> Result<CudaStorage> {
    launch_rows_n(module, kernel, inputs, 1, scale, ints)
}

/// [`launch_rows`] for a kernel that writes `outputs` tensors of the inputs'
/// shape, one after the other in one allocation ([outputs, ...shape]).
pub(crate) fn launch_rows_n(
    module: Module,
    kernel: &str,
    inputs: &[(&CudaStorage, &Layout)],
    outputs: usize,
    scale: f32,
    ints: &[i32],
) -> Result<CudaStorage> {
    let Some(&(first, _)) = inputs.first() else {
        candle_core::bail!("{kernel} kernel: no input")
    };
    if let Some((s, _)) = inputs.iter().find(|(s, _)| s.dtype() != first.dtype()) {
        candle_core::bail!(
            "{kernel} kernel: {:?} and {:?} inputs",
            first.dtype(),
            s.dtype()
        )
    }
    by_dtype!(first.dtype(), format!("{kernel} kernel"), |T, name| {
        launch::<T>(
            module,
            &format!("{kernel}_{name}"),
            inputs,
            outputs,
            scale,
            ints,
        )
    })
}

fn launch<T: DeviceRepr + CudaDType>(
    module: Module,
    kernel: &str,
    inputs: &[(&CudaStorage, &Layout)],
    outputs: usize,
    scale: f32,
    ints: &[i32],
) -> Result<CudaStorage> {
    let (first, layout) = inputs[0];
    let n = layout.dims().last().copied().unwrap_or(1).max(1);
    let rows = layout.shape().elem_count() / n;
    // A grid's x dimension takes up to 2³¹ − 1 blocks.
    let (Ok(rows), Ok(n)) = (i32::try_from(rows), i32::try_from(n)) else {
        candle_core::bail!("{kernel}: {rows} rows of {n} are more than one launch takes")
    };
    let views = inputs
        .iter()
        .map(|&(s, l)| {
            if l.shape() != layout.shape() {
                candle_core::bail!("{kernel}: inputs {:?} and {:?}", layout.shape(), l.shape())
            }
            let Some((start, end)) = l.contiguous_offsets() else {
                candle_core::bail!("{kernel}: contiguous inputs only")
            };
            Ok(s.as_cuda_slice::<T>()?.slice(start..end))
        })
        .collect::<Result<Vec<CudaView<'_, T>>>>()?;
    let dev = &first.device;
    let elements = layout.shape().elem_count();
    // SAFETY: every element is written by the kernel before it is read.
    let out = unsafe { dev.alloc::<T>(elements * outputs)? };
    if elements == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
    }
    let func = dev.get_or_load_custom_func(kernel, module.name, module.ptx)?;
    // One block a row; fewer threads for short rows (a warp at least).
    let threads = (n as u32).next_power_of_two().clamp(32, 1024);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = func.builder();
    for v in &views {
        b.arg(v);
    }
    b.arg(&out);
    b.arg(&n);
    b.arg(&scale);
    for i in ints {
        b.arg(i);
    }
    // SAFETY: the arguments are the kernel's (inputs…, out, n, scale, ints…) as
    // the caller names them, and every input holds rows · n elements, the output
    // `outputs` times that.
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
