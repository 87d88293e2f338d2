//! Flash-style attention on a CUDA GPU (`cuda/attention.cu`, PTX built by
//! build.rs): the launchers of [`super::flash`]'s op, whose forward runs an online
//! softmax over key tiles (no [heads, t, keys] score tensor is allocated) and whose
//! backward recomputes the probabilities tile by tile, every sum in f32 whatever the
//! inputs' dtype. Experimental: the models take it only when
//! `TOKENFORMER_CUDA_KERNELS=1` (see [`super::cuda_kernels_enabled`]) until a GPU
//! session has checked it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Tensor};

use super::flash::{fits, split_chunk, Part, HEAD_DIMS};
use super::rows_cuda::by_dtype;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));

const MODULE: &str = "tokenformer_attention";

/// Rows (queries, or the ∂k/∂v kernel's keys) per thread block (`ROWS` in the
/// kernels; `FAST_ROWS` queries or keys for the tensor-core and tiled ones) and its
/// threads.
const ROWS: usize = 32;
const FAST_ROWS: usize = 64;
const THREADS: u32 = 128;

/// The head sizes of the tensor-core forward's instances (96: the 1.5B's, which would
/// spend a quarter of a 128-wide instance's products on padding) and of its backward's.
const TC_HEAD_DIMS: [usize; 3] = [64, 96, 128];
const TC_GRAD_HEAD_DIMS: [usize; 1] = [64];
/// The largest head size of the register-tiled f32 forward (`flash_tile_f32_d64`).
const TILE_HEAD_DIM: usize = 64;

/// The faster version of `kernel` ("flash" for the forward, "flash_dq", "flash_dkv")
/// for `dtype`, head size `hd` and `t` queries, if it has one: on tensor cores for bf16
/// and f16 (head sizes up to 128 forward, 64 backward), register-tiled for the f32
/// forward (head sizes up to 64, more than one of the first kernel's blocks of
/// queries); unless `TOKENFORMER_FLASH_TC` is `0`, which keeps the first SIMT kernels,
/// for comparing the two on a GPU.
fn fast_instance(kernel: &str, dtype: DType, hd: usize, t: usize) -> Option<String> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("TOKENFORMER_FLASH_TC").is_ok_and(|v| v == "0"));
    if off {
        return None;
    }
    if dtype == DType::F32 {
        let serves = kernel == "flash" && hd <= TILE_HEAD_DIM && t > ROWS;
        return serves.then(|| "flash_tile_f32_d64".to_string());
    }
    let dims: &[usize] = if kernel == "flash" {
        &TC_HEAD_DIMS
    } else {
        &TC_GRAD_HEAD_DIMS
    };
    let maxd = dims.iter().find(|&&m| hd <= m)?;
    let name = match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => return None,
    };
    let kernel = kernel.strip_prefix("flash").unwrap_or(kernel);
    Some(format!("flash_tc{kernel}_{name}_d{maxd}"))
}

/// The name of `kernel`'s faster version ([`fast_instance`]) where it has one and the
/// PTX holds it (the tensor-core ones: built for compute capability 8.0 or later), with
/// its rows a block, else of the first SIMT one (`simt`: its stem, "flash_attention"
/// for the forward) with its; and whether it is the faster one (whose forward takes no
/// split-over-keys arguments).
fn pick(
    dev: &candle_core::CudaDevice,
    kernel: &str,
    simt: &str,
    dtype: DType,
    hd: usize,
    t: usize,
) -> Result<(String, usize, bool)> {
    let fast = fast_instance(kernel, dtype, hd, t)
        .filter(|name| dev.get_or_load_custom_func(name, MODULE, PTX).is_ok());
    Ok(match fast {
        Some(name) => (name, FAST_ROWS, true),
        None => (format!("{simt}_{}", instance(dtype, hd)?), ROWS, false),
    })
}

/// `storage` from its layout's offset, as T.
fn view<'a, T: CudaDType>((s, l): Arg<'a>) -> Result<CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

/// Whether attention takes the kernels: the CUDA kernels turned on, q on a GPU, and
/// [`fits`].
pub(crate) fn serves(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> bool {
    super::cuda_kernels_enabled() && q.device().is_cuda() && fits(q, k, v, causal).is_ok()
}

/// Attention of q [b, h, t, hd] over k, v [b, h, keys, hd] (each row's features
/// contiguous, other strides free: copied otherwise), scaled by 1/√hd, causal
/// counting from the end (keys − t earlier positions are the past), as [b, t, h·hd]
/// in q's dtype, by the kernels whatever `TOKENFORMER_CUDA_KERNELS` says;
/// differentiable. The same definition as `crate::kernels::attention`. On the CPU
/// (f32, f64) the same op runs its f64 loops, so the GPU tests' own logic can be
/// checked where there is no GPU.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    super::flash::attention(q, k, v, causal)
}

/// One of q, k, v and its layout.
type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// The instance suffix ("f32_d64", …) for `dtype` and head size `hd`.
fn instance(dtype: DType, hd: usize) -> Result<String> {
    let name = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        d => candle_core::bail!("attention kernel: no {d:?} version"),
    };
    let Some(maxd) = HEAD_DIMS.into_iter().find(|&m| hd <= m) else {
        candle_core::bail!("attention kernel: head size {hd} above {}", HEAD_DIMS[2])
    };
    Ok(format!("{name}_d{maxd}"))
}

/// The arguments every kernel takes after its pointers: heads, t, keys, hd, causal,
/// scale, then q's, k's and v's [b, h, row] strides.
struct Common {
    ints: [i32; 5],
    scale: f32,
    strides: [i64; 9],
}

impl Common {
    fn new(q: &Layout, k: &Layout, v: &Layout, causal: bool, scale: f32) -> Result<Self> {
        let (_, h, t, hd) = q.shape().dims4()?;
        let keys = k.dims()[2];
        let mut strides = [0i64; 9];
        for (i, l) in [q, k, v].iter().enumerate() {
            for (j, &s) in l.stride()[..3].iter().enumerate() {
                strides[3 * i + j] = s as i64;
            }
        }
        Ok(Self {
            ints: [
                h as i32,
                t as i32,
                keys as i32,
                hd as i32,
                i32::from(causal),
            ],
            scale,
            strides,
        })
    }

    fn push<'a>(&'a self, a: &mut LaunchArgs<'a>) {
        for i in &self.ints {
            a.arg(i);
        }
        a.arg(&self.scale);
        for s in &self.strides {
            a.arg(s);
        }
    }
}

/// `rows` rows in blocks of `per_block`, for each head and batch. A GPU takes at most
/// 65,535 blocks along a grid's y and z (heads and batch), and 2^31 − 1 along x.
fn config(rows: usize, per_block: usize, h: usize, b: usize) -> Result<LaunchConfig> {
    let tiles = rows.div_ceil(per_block);
    if h > 65_535 || b > 65_535 || tiles > i32::MAX as usize {
        candle_core::bail!(
            "attention kernel: {b} sequences of {h} heads of {rows} rows: a launch takes at \
             most 65,535 sequences and heads (split the batch)"
        )
    }
    Ok(LaunchConfig {
        grid_dim: (tiles as u32, h as u32, b as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The forward: the output [b, t, h·hd] in q's dtype and each query row's
/// log-sum-exp [b, t, h] in f32.
pub(super) fn forward(
    q: Arg,
    k: Arg,
    v: Arg,
    causal: bool,
    scale: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    fn run<T: DeviceRepr + CudaDType>(
        [q, k, v]: [Arg; 3],
        causal: bool,
        scale: f32,
        dtype: &str,
    ) -> Result<(CudaStorage, CudaStorage)> {
        let (b, h, t, hd) = q.1.shape().dims4()?;
        let dev = &q.0.device;
        // `TOKENFORMER_FLASH_SPLIT=0` keeps one block a head, for comparing on a GPU.
        static SPLIT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let split_on = *SPLIT
            .get_or_init(|| std::env::var("TOKENFORMER_FLASH_SPLIT").map_or(true, |v| v != "0"));
        if let Some(chunk) = split_chunk(b, h, t, k.1.dims()[2], hd, ROWS).filter(|_| split_on) {
            return split::<T>([q, k, v], causal, scale, chunk, dtype);
        }
        let (name, rows, fast) = pick(dev, "flash", "flash_attention", q.0.dtype(), hd, t)?;
        let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let (qs, ks, vs) = (view::<T>(q)?, view::<T>(k)?, view::<T>(v)?);
        // SAFETY: the kernel writes every element of both before they are read.
        let out = unsafe { dev.alloc::<T>(b * t * h * hd)? };
        let lse = unsafe { dev.alloc::<f32>(b * t * h)? };
        let common = Common::new(q.1, k.1, v.1, causal, scale)?;
        let mut a = func.builder();
        a.arg(&qs);
        a.arg(&ks);
        a.arg(&vs);
        a.arg(&out);
        a.arg(&lse);
        // The SIMT kernel's split over keys off: no partials (null), no chunk.
        let (null, no_chunk) = (0u64, 0i32);
        if !fast {
            a.arg(&null).arg(&null).arg(&no_chunk);
        }
        common.push(&mut a);
        // SAFETY: the arguments match the kernel's (q, k, v, out, lse, for the SIMT
        // kernel null partials and chunk, then `Common`); the views start at each
        // layout's offset and every index the kernel forms from the strides lies
        // inside its tensor.
        unsafe { a.launch(config(t, rows, h, b)?) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            CudaStorage::wrap_cuda_slice(lse, dev.clone()),
        ))
    }
    by_dtype!(q.0.dtype(), "attention kernel", |T, dtype| {
        run::<T>([q, k, v], causal, scale, dtype)
    })
}

/// The forward by decoding's split over keys: `flash_attention_*` over (chunks, h, b)
/// blocks into f32 partials, then `flash_combine_{dtype}` merges them into the output
/// [b, t, h·hd] and the log-sum-exp [b, t, h].
fn split<T: DeviceRepr + CudaDType>(
    [q, k, v]: [Arg; 3],
    causal: bool,
    scale: f32,
    chunk: usize,
    dtype: &str,
) -> Result<(CudaStorage, CudaStorage)> {
    let (b, h, t, hd) = q.1.shape().dims4()?;
    let keys = k.1.dims()[2];
    let chunks = keys.div_ceil(chunk);
    let rows = b * t * h;
    let dev = &q.0.device;
    let name = instance(q.0.dtype(), hd)?;
    let split = dev.get_or_load_custom_func(&format!("flash_attention_{name}"), MODULE, PTX)?;
    let combine = dev.get_or_load_custom_func(&format!("flash_combine_{dtype}"), MODULE, PTX)?;
    let (qs, ks, vs) = (view::<T>(q)?, view::<T>(k)?, view::<T>(v)?);
    // SAFETY: the split kernel writes every partial of a live row, the merge every
    // output and log-sum-exp, before anything reads them.
    let po = unsafe { dev.alloc::<f32>(chunks * rows * hd)? };
    let pml = unsafe { dev.alloc::<f32>(chunks * rows * 2)? };
    let out = unsafe { dev.alloc::<T>(rows * hd)? };
    let lse = unsafe { dev.alloc::<f32>(rows)? };
    let common = Common::new(q.1, k.1, v.1, causal, scale)?;
    // Unused in a split: the output and the log-sum-exp come from the merge.
    let (null, chunk_arg) = (0u64, chunk as i32);
    let mut a = split.builder();
    a.arg(&qs).arg(&ks).arg(&vs).arg(&null).arg(&null);
    a.arg(&po).arg(&pml).arg(&chunk_arg);
    common.push(&mut a);
    // SAFETY: the arguments match flash_attention's (q, k, v, out and lse null, po,
    // pml, chunk, then `Common`); the partials hold chunks · rows rows; t ≤ ROWS, so
    // one block of queries covers every row.
    unsafe { a.launch(config(chunks, 1, h, b)?) }.w()?;
    let (chunks_arg, rows_arg, hd_arg) = (chunks as i32, rows as i64, hd as i32);
    let mut a = combine.builder();
    a.arg(&po).arg(&pml).arg(&out).arg(&lse);
    a.arg(&chunks_arg).arg(&rows_arg).arg(&hd_arg);
    let merge = LaunchConfig {
        grid_dim: ((rows * hd).div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match flash_combine's (po, pml, out, lse, chunks, rows,
    // hd), each buffer of the size allocated above.
    unsafe { a.launch(merge) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev.clone()),
    ))
}

/// The backward's `part`: ∂q [b, h, t, hd], or ∂k and ∂v as [2, b, h, keys, hd], in
/// q's dtype, from `saved` = ∂o [b, t, h·hd] (q's dtype, contiguous), the
/// log-sum-exp and D [b, t, h] (f32, contiguous).
pub(super) fn grad(
    part: Part,
    qkv: [Arg; 3],
    saved: [Arg; 3],
    causal: bool,
    scale: f32,
) -> Result<CudaStorage> {
    fn run<T: DeviceRepr + CudaDType>(
        part: Part,
        [q, k, v]: [Arg; 3],
        [dout, lse, delta]: [Arg; 3],
        causal: bool,
        scale: f32,
    ) -> Result<CudaStorage> {
        let (b, h, t, hd) = q.1.shape().dims4()?;
        let keys = k.1.dims()[2];
        let dev = &q.0.device;
        let kernel = match part {
            Part::Q => "flash_dq",
            Part::KV => "flash_dkv",
        };
        let (name, per_block, _) = pick(dev, kernel, kernel, q.0.dtype(), hd, t)?;
        let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let (qs, ks, vs, ds) = (
            view::<T>(q)?,
            view::<T>(k)?,
            view::<T>(v)?,
            view::<T>(dout)?,
        );
        let (ls, es) = (view::<f32>(lse)?, view::<f32>(delta)?);
        for (what, l, n) in [
            ("∂o", dout.1, b * t * h * hd),
            ("log-sum-exp", lse.1, b * t * h),
            ("D", delta.1, b * t * h),
        ] {
            if !l.is_contiguous() || l.shape().elem_count() != n {
                candle_core::bail!(
                    "attention kernel: {what} of shape {:?}, not {n} contiguous elements",
                    l.dims()
                )
            }
        }
        let plane = (b * h * keys * hd) as i64;
        let (len, rows) = match part {
            Part::Q => (b * h * t * hd, t),
            Part::KV => (2 * plane as usize, keys),
        };
        // SAFETY: the kernel writes every element before it is read.
        let out = unsafe { dev.alloc::<T>(len)? };
        let common = Common::new(q.1, k.1, v.1, causal, scale)?;
        let mut a = func.builder();
        a.arg(&qs);
        a.arg(&ks);
        a.arg(&vs);
        a.arg(&ds);
        a.arg(&ls);
        a.arg(&es);
        a.arg(&out);
        if part == Part::KV {
            a.arg(&plane);
        }
        common.push(&mut a);
        // SAFETY: the arguments match the kernel's (q, k, v, dout, lse, delta, out,
        // for ∂k/∂v the plane, then `Common`); the views start at each layout's
        // offset, the saved tensors are contiguous with the sizes checked above.
        unsafe { a.launch(config(rows, per_block, h, b)?) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_dtype!(qkv[0].0.dtype(), "attention kernel", |T, _name| {
        run::<T>(part, qkv, saved, causal, scale)
    })
}

#[cfg(test)]
mod tests {
    /// The emulator takes any grid; a GPU refuses more than 65,535 blocks along y and z.
    #[test]
    fn a_grid_past_the_gpus_limits_is_an_error_naming_them() {
        let ok = super::config(2048, 64, 16, 65_535).unwrap();
        assert_eq!(ok.grid_dim, (32, 16, 65_535));
        for (h, b) in [(16, 65_536), (65_536, 1)] {
            let e = super::config(2048, 64, h, b).unwrap_err().to_string();
            assert!(e.contains("65,535"), "{e}");
        }
    }
}
