//! Flash-style attention on a CUDA GPU (`cuda/attention.cu`, PTX built by
//! build.rs): softmax(q·kᵀ/√d)·v with an online softmax over key tiles, so no
//! [heads, t, keys] score tensor is allocated, every sum in f32 whatever the
//! inputs' dtype. For inference only (no backward). Experimental: the model
//! takes it only when `TOKENFORMER_CUDA_KERNELS=1` (see
//! [`super::cuda_kernels_enabled`]) until a GPU session has checked it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));

/// Queries per thread block (`ROWS` in the kernel) and its threads.
const ROWS: usize = 32;
const THREADS: u32 = 128;

/// The head sizes the kernel's instances take (the smallest that fits runs).
const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Whether the model's attention takes the kernel: the CUDA kernels turned
/// on and [`fits`].
pub(crate) fn serves(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> bool {
    super::cuda_kernels_enabled() && fits(q, k, v, causal).is_ok()
}

/// Why the kernel cannot take q [b, h, t, hd], k and v [b, h, keys, hd], if
/// it cannot: all on one GPU in one of f32/bf16/f16, hd ≤ 256, at least one
/// key (and, causal, at least as many keys as queries), shapes within one
/// launch.
fn fits(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> std::result::Result<(), String> {
    let dev = q.device();
    if !(dev.is_cuda() && dev.same_device(k.device()) && dev.same_device(v.device())) {
        return Err("q, k and v must be on one GPU".into());
    }
    let dtype = q.dtype();
    if k.dtype() != dtype
        || v.dtype() != dtype
        || !matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
    {
        return Err(format!(
            "q, k, v {:?}/{:?}/{:?}: one of f32, bf16, f16 for all three",
            dtype,
            k.dtype(),
            v.dtype()
        ));
    }
    let (Ok((b, h, t, hd)), Ok((kb, kh, keys, khd))) = (q.dims4(), k.dims4()) else {
        return Err(format!(
            "q {:?}, k {:?}: rank 4 expected",
            q.dims(),
            k.dims()
        ));
    };
    if (kb, kh, khd) != (b, h, hd) || v.dims() != k.dims() {
        return Err(format!(
            "q {:?}, k {:?}, v {:?} do not match",
            q.dims(),
            k.dims(),
            v.dims()
        ));
    }
    if hd == 0 || hd > HEAD_DIMS[2] || t == 0 || keys == 0 || (causal && keys < t) {
        return Err(format!(
            "head size {hd} (1 to 256), {t} queries, {keys} keys{}",
            if causal {
                " (causal: keys ≥ queries)"
            } else {
                ""
            }
        ));
    }
    if b > 65_535 || h > 65_535 || t.div_ceil(ROWS) > i32::MAX as usize || keys > i32::MAX as usize
    {
        return Err(format!("[{b}, {h}, {t}] is more than one launch takes"));
    }
    Ok(())
}

/// Attention of q [b, h, t, hd] over k, v [b, h, keys, hd] (each row's
/// features contiguous, other strides free: copied otherwise), scaled by
/// 1/√hd, causal counting from the end (keys − t earlier positions are the
/// past), as [b, t, h·hd] in q's dtype, by the kernel whatever
/// `TOKENFORMER_CUDA_KERNELS` says. The same definition as
/// `crate::kernels::attention`.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    if let Err(e) = fits(q, k, v, causal) {
        candle_core::bail!("attention kernel: {e}")
    }
    let unit = |x: &Tensor| -> Result<Tensor> {
        if x.stride()[3] == 1 {
            Ok(x.clone())
        } else {
            x.contiguous()
        }
    };
    let hd = q.dim(3)?;
    unit(q)?.apply_op3_no_bwd(
        &unit(k)?,
        &unit(v)?,
        &FlashAttention {
            causal,
            scale: 1.0 / (hd as f32).sqrt(),
        },
    )
}

struct FlashAttention {
    causal: bool,
    scale: f32,
}

impl FlashAttention {
    #[allow(clippy::too_many_arguments)]
    fn launch<T: DeviceRepr + CudaDType>(
        &self,
        sq: &CudaStorage,
        lq: &Layout,
        sk: &CudaStorage,
        lk: &Layout,
        sv: &CudaStorage,
        lv: &Layout,
        name: &str,
    ) -> Result<(CudaStorage, Shape)> {
        let (b, h, t, hd) = lq.shape().dims4()?;
        let keys = lk.dims()[2];
        let maxd = HEAD_DIMS
            .into_iter()
            .find(|&m| hd <= m)
            .expect("fits checked hd ≤ 256");
        let dev = &sq.device;
        let func = dev.get_or_load_custom_func(
            &format!("flash_attention_{name}_d{maxd}"),
            "tokenformer_attention",
            PTX,
        )?;
        let q = sq.as_cuda_slice::<T>()?.slice(lq.start_offset()..);
        let k = sk.as_cuda_slice::<T>()?.slice(lk.start_offset()..);
        let v = sv.as_cuda_slice::<T>()?.slice(lv.start_offset()..);
        // SAFETY: the kernel writes every element of [b, t, h, hd] before it is read.
        let out = unsafe { dev.alloc::<T>(b * t * h * hd)? };
        let strides = |l: &Layout| -> [i64; 3] {
            let s = l.stride();
            [s[0] as i64, s[1] as i64, s[2] as i64]
        };
        let (qs, ks, vs) = (strides(lq), strides(lk), strides(lv));
        let (heads, t32, keys32, hd32) = (h as i32, t as i32, keys as i32, hd as i32);
        let causal = i32::from(self.causal);
        let cfg = LaunchConfig {
            grid_dim: (t.div_ceil(ROWS) as u32, h as u32, b as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = func.builder();
        a.arg(&q);
        a.arg(&k);
        a.arg(&v);
        a.arg(&out);
        a.arg(&heads);
        a.arg(&t32);
        a.arg(&keys32);
        a.arg(&hd32);
        a.arg(&causal);
        a.arg(&self.scale);
        for s in qs.iter().chain(&ks).chain(&vs) {
            a.arg(s);
        }
        // SAFETY: the arguments match the kernel's (q, k, v, out, heads, t, keys,
        // hd, causal, scale, then q's, k's and v's [b, h, row] strides); the views
        // start at each layout's offset and every index the kernel forms from
        // them lies inside its tensor.
        unsafe { a.launch(cfg) }.w()?;
        let out = CudaStorage::wrap_cuda_slice(out, dev.clone());
        Ok((out, Shape::from((b, t, h * hd))))
    }
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the CUDA attention kernel runs on a GPU only")
    }

    fn cuda_fwd(
        &self,
        sq: &CudaStorage,
        lq: &Layout,
        sk: &CudaStorage,
        lk: &Layout,
        sv: &CudaStorage,
        lv: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        match sq.dtype() {
            DType::F32 => self.launch::<f32>(sq, lq, sk, lk, sv, lv, "f32"),
            DType::BF16 => self.launch::<::half::bf16>(sq, lq, sk, lk, sv, lv, "bf16"),
            DType::F16 => self.launch::<::half::f16>(sq, lq, sk, lk, sv, lv, "f16"),
            d => candle_core::bail!("attention kernel: no {d:?} version"),
        }
    }
}
