//! Scoring's log-softmax-gather on a CUDA GPU (`cuda/logprob.cu`, PTX built
//! by build.rs): for logits rows [n, vocab] and targets [n], log p(target),
//! the log-sum-exp and the first argmax of each row from one read of the
//! logits, in f32 whatever their dtype, instead of candle's max, subtract,
//! exp, sum, log, gather and argmax passes (and their [n, vocab] temporaries).
//! The CUDA side of [`super::logprob`]'s op, whose backward (a second kernel
//! writing the gradient in one pass) serves training's cross-entropy on a GPU.
//! Experimental: scoring and training take it only when
//! `TOKENFORMER_CUDA_KERNELS=1` (see [`super::cuda_kernels_enabled`]) until a GPU
//! session has checked it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};

use super::rows_cuda::by_dtype;
use super::TargetLogprobs;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/logprob.ptx"));

/// The argmax comes back as an f32: exact below 2^24.
const MAX_VOCAB: usize = 1 << 24;

/// Whether scoring takes the kernel for `logits`: the CUDA kernels turned on
/// and [`fits`].
pub(crate) fn serves(logits: &Tensor) -> bool {
    super::cuda_kernels_enabled() && fits(logits)
}

/// Whether the kernel can take `logits`: [n, vocab] f32/bf16/f16 on a GPU,
/// 0 < vocab < 2^24, n within one launch.
fn fits(logits: &Tensor) -> bool {
    logits.device().is_cuda()
        && matches!(logits.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && logits.dims2().is_ok_and(|(n, v)| shape_fits(n, v))
}

/// n rows within one launch's grid (2^31 - 1 blocks), 0 < vocab < 2^24.
fn shape_fits(n: usize, vocab: usize) -> bool {
    n > 0 && n <= i32::MAX as usize && vocab > 0 && vocab < MAX_VOCAB
}

/// log p(target), log-sum-exp and first argmax of each row of `logits`
/// [n, vocab] (f32, bf16 or f16 on a GPU) for `targets` (n ids), by the
/// kernel whatever `TOKENFORMER_CUDA_KERNELS` says. A target outside the
/// vocabulary is an error here (the kernel would give NaN).
pub fn target_logprobs(logits: &Tensor, targets: &[u32]) -> Result<TargetLogprobs> {
    if !fits(logits) {
        candle_core::bail!(
            "log-softmax-gather kernel: [n, vocab] f32/bf16/f16 logits on a GPU (vocab < 2^24), \
             not {:?} {:?} on {:?}",
            logits.dims(),
            logits.dtype(),
            logits.device().location()
        )
    }
    let (n, vocab) = logits.dims2()?;
    if targets.len() != n {
        candle_core::bail!(
            "log-softmax-gather kernel: {} targets for {n} rows",
            targets.len()
        )
    }
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        candle_core::bail!(
            "log-softmax-gather kernel: target {bad} outside the vocabulary ({vocab})"
        )
    }
    let index = Tensor::new(targets, logits.device())?;
    let out = logits
        .contiguous()?
        .apply_op2_no_bwd(&index, &super::logprob::LogprobGather)?
        .to_vec2::<f32>()?;
    let mut r = TargetLogprobs {
        logprob: Vec::with_capacity(n),
        logsumexp: Vec::with_capacity(n),
        argmax: Vec::with_capacity(n),
    };
    for row in out {
        r.logprob.push(row[0]);
        r.logsumexp.push(row[1]);
        r.argmax.push(row[2] as u32);
    }
    Ok(r)
}

/// The kernel's [n, 3] rows (log p(target), log-sum-exp, argmax) for contiguous
/// logits [n, vocab] (f32, bf16 or f16) and u32 targets [n].
pub(crate) fn gather(
    logits: &CudaStorage,
    ll: &Layout,
    targets: &CudaStorage,
    lt: &Layout,
) -> Result<(CudaStorage, Shape)> {
    if targets.dtype() != DType::U32 {
        candle_core::bail!(
            "log-softmax-gather kernel: u32 targets, not {:?}",
            targets.dtype()
        )
    }
    by_dtype!(logits.dtype(), "log-softmax-gather kernel", |T, name| {
        launch_gather::<T>(logits, ll, targets, lt, name)
    })
}

/// One block a row: 512 threads stream a 50k-token row; short rows fewer.
fn row_config(rows: usize, vocab: usize) -> Result<LaunchConfig> {
    if !shape_fits(rows, vocab) {
        candle_core::bail!(
            "log-softmax-gather kernel: {rows} rows of {vocab} logits \
             (1 to 2^31 - 1 rows of fewer than 2^24)"
        )
    }
    let threads = vocab.next_power_of_two().clamp(32, 512) as u32;
    Ok(LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn launch_gather<T: DeviceRepr + CudaDType>(
    logits: &CudaStorage,
    ll: &Layout,
    targets: &CudaStorage,
    lt: &Layout,
    name: &str,
) -> Result<(CudaStorage, Shape)> {
    let (n, vocab) = ll.shape().dims2()?;
    let cfg = row_config(n, vocab)?;
    let (Some((a, b)), Some((ta, tb))) = (ll.contiguous_offsets(), lt.contiguous_offsets()) else {
        candle_core::bail!("log-softmax-gather kernel: contiguous logits and targets only")
    };
    if tb - ta != n {
        candle_core::bail!(
            "log-softmax-gather kernel: {} targets for {n} rows",
            tb - ta
        )
    }
    let dev = &logits.device;
    let func =
        dev.get_or_load_custom_func(&format!("logprob_{name}"), "tokenformer_logprob", PTX)?;
    let x = logits.as_cuda_slice::<T>()?.slice(a..b);
    let tg = targets.as_cuda_slice::<u32>()?.slice(ta..tb);
    // SAFETY: the kernel writes all three values of every row.
    let out = unsafe { dev.alloc::<f32>(n * 3)? };
    let vocab32 = vocab as i32;
    let mut args = func.builder();
    args.arg(&x);
    args.arg(&tg);
    args.arg(&out);
    args.arg(&vocab32);
    // SAFETY: the arguments match the kernel's (logits, targets, out, vocab);
    // logits hold n · vocab elements, targets n, out 3n.
    unsafe { args.launch(cfg) }.w()?;
    let out = CudaStorage::wrap_cuda_slice(out, dev.clone());
    Ok((out, Shape::from((n, 3))))
}

/// The backward's ∂L/∂logits = a · exp(x − lse) − b · one-hot(target) for
/// contiguous logits [n, vocab], u32 targets [n] and f32 coefficients (a, b, lse)
/// [n, 3], in the logits' dtype.
pub(crate) fn grad(
    (logits, ll): (&CudaStorage, &Layout),
    (targets, lt): (&CudaStorage, &Layout),
    (coef, lc): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    if targets.dtype() != DType::U32 || coef.dtype() != DType::F32 {
        candle_core::bail!(
            "log-softmax-gather gradient: u32 targets and f32 coefficients, not {:?} and {:?}",
            targets.dtype(),
            coef.dtype()
        )
    }
    let (x, t, c) = ((logits, ll), (targets, lt), (coef, lc));
    by_dtype!(logits.dtype(), "log-softmax-gather gradient", |T, name| {
        launch_grad::<T>(x, t, c, name)
    })
}

fn launch_grad<T: DeviceRepr + CudaDType>(
    (logits, ll): (&CudaStorage, &Layout),
    (targets, lt): (&CudaStorage, &Layout),
    (coef, lc): (&CudaStorage, &Layout),
    name: &str,
) -> Result<(CudaStorage, Shape)> {
    let (n, vocab) = ll.shape().dims2()?;
    let cfg = row_config(n, vocab)?;
    let (Some((a, b)), Some((ta, tb)), Some((ca, cb))) = (
        ll.contiguous_offsets(),
        lt.contiguous_offsets(),
        lc.contiguous_offsets(),
    ) else {
        candle_core::bail!("log-softmax-gather gradient: contiguous inputs only")
    };
    if tb - ta != n || cb - ca != 3 * n {
        candle_core::bail!(
            "log-softmax-gather gradient: {} targets and {} coefficients for {n} rows",
            tb - ta,
            cb - ca
        )
    }
    let dev = &logits.device;
    let kernel = format!("logprob_grad_{name}");
    let func = dev.get_or_load_custom_func(&kernel, "tokenformer_logprob", PTX)?;
    let x = logits.as_cuda_slice::<T>()?.slice(a..b);
    let tg = targets.as_cuda_slice::<u32>()?.slice(ta..tb);
    let c = coef.as_cuda_slice::<f32>()?.slice(ca..cb);
    // SAFETY: the kernel writes every element of every row.
    let out = unsafe { dev.alloc::<T>(n * vocab)? };
    let vocab32 = vocab as i32;
    let mut args = func.builder();
    args.arg(&x);
    args.arg(&tg);
    args.arg(&c);
    args.arg(&out);
    args.arg(&vocab32);
    // SAFETY: the arguments match the kernel's (logits, targets, coef, out, vocab);
    // logits and out hold n · vocab elements, targets n, coef 3n.
    unsafe { args.launch(cfg) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        ll.shape().clone(),
    ))
}
