//! AdamW's and gradient clipping's passes on a GPU: `cuda/adamw.cu`'s kernels, one
//! launch each, in place from element `from` on (the frozen rows' elements before it
//! stay); and their multi-tensor forms, one launch for all of a step's tensors.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

use super::{ApplyConsts, Job, MomentConsts};
use crate::kernels::rows_cuda::Module;

/// Elements a block of the multi-tensor kernels takes.
const PIECE: usize = 1 << 16;

/// The device, and the device address and length of `t`'s elements from `from`
/// on: a contiguous f32 tensor on a GPU. The caller keeps `t` alive until the
/// kernels that use the address are enqueued: candle's one stream orders them
/// before any later use or release of the memory.
fn address(t: &Tensor, from: usize) -> Result<(CudaDevice, u64, usize)> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        candle_core::bail!("multi-tensor kernels: a tensor not on a GPU")
    };
    let (a, b) = match layout.contiguous_offsets() {
        Some((a, b)) if t.dtype() == DType::F32 && a + from <= b => (a, b),
        _ => candle_core::bail!("multi-tensor kernels: contiguous f32 of {from}+ elements"),
    };
    let stream = s.device.cuda_stream();
    let view = s.as_cuda_slice::<f32>()?.slice(a + from..b);
    let (ptr, _read) = view.device_ptr(&stream);
    Ok((s.device.clone(), ptr, b - a - from))
}

/// A multi-tensor kernel's table: pieces of at most [`PIECE`] elements, each as
/// its device addresses (4-byte elements), its length and any extra words; and
/// the one GPU all its tensors are on.
#[derive(Default)]
struct Table {
    words: Vec<u64>,
    dev: Option<CudaDevice>,
}

impl Table {
    /// `n` elements from the addresses `at`, on `dev`.
    fn add(&mut self, dev: CudaDevice, at: &[u64], n: usize, extra: &[u64]) -> Result<()> {
        match &self.dev {
            Some(d) if d.id() != dev.id() => {
                candle_core::bail!("multi-tensor kernels: tensors on two GPUs")
            }
            Some(_) => {}
            None => self.dev = Some(dev),
        }
        for start in (0..n).step_by(PIECE) {
            self.words.extend(at.iter().map(|&a| a + 4 * start as u64));
            self.words.push(PIECE.min(n - start) as u64);
            self.words.extend_from_slice(extra);
        }
        Ok(())
    }

    /// The device, the table on it and one block of 256 threads a piece of
    /// `width` words; `None` when there is no piece.
    #[allow(clippy::type_complexity)]
    fn upload(self, width: usize) -> Result<Option<(CudaDevice, CudaSlice<u64>, LaunchConfig)>> {
        let blocks = self.words.len() / width;
        let Some(dev) = self.dev.filter(|_| blocks > 0) else {
            return Ok(None);
        };
        if blocks > i32::MAX as usize {
            candle_core::bail!("multi-tensor kernels: {blocks} pieces")
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let table = dev.clone_htod(&self.words)?;
        Ok(Some((dev, table, cfg)))
    }
}

/// Every job's step in one launch (`adamw_step_multi`), as [`super::step_all`]
/// takes them one by one. `false` (nothing done) unless the jobs share their
/// constants but for weight decay, as one optimizer's step does.
pub(super) fn step_all(jobs: &[Job]) -> Result<bool> {
    let Some(first) = jobs.first() else {
        return Ok(true);
    };
    let u = &first.update;
    let shared = |v: &super::Update| {
        (v.beta1, v.beta2, v.lr, v.bc1, v.bc2, v.eps)
            == (u.beta1, u.beta2, u.lr, u.bc1, u.bc2, u.eps)
    };
    if !jobs.iter().all(|j| shared(&j.update)) {
        return Ok(false);
    }
    let mut table = Table::default();
    for j in jobs {
        let from = j.update.from;
        let (dev, theta, n) = address(&j.theta, from)?;
        let mut at = [theta; 4];
        for (k, t) in [&j.m, &j.v, &j.g].into_iter().enumerate() {
            let (d, a, len) = address(t, from)?;
            if d.id() != dev.id() || len != n {
                candle_core::bail!("adamw kernel: a variable, its moments and gradient differ")
            }
            at[k + 1] = a;
        }
        let keep = ApplyConsts::<f32>::of(&j.update).keep;
        table.add(dev, &at, n, &[u64::from(keep.to_bits())])?;
    }
    let Some((dev, table, cfg)) = table.upload(6)? else {
        return Ok(true);
    };
    let func = dev.get_or_load_custom_func("adamw_step_multi", ADAMW.name, ADAMW.ptx)?;
    let (m, v, k) = (
        MomentConsts::<f32>::of(u.beta1, false),
        MomentConsts::<f32>::of(u.beta2, true),
        ApplyConsts::<f32>::of(u),
    );
    let consts = [m.b, m.c, v.b, v.c, k.sbc2, k.eps, k.step];
    let mut a = func.builder();
    a.arg(&table);
    for k in &consts {
        a.arg(k);
    }
    // SAFETY: the arguments are the kernel's (table, b1, c1, b2, c2, sbc2, eps,
    // step); each piece's four addresses hold its length of f32s (`address`
    // checked every tensor's extent), and the jobs' tensors outlive the enqueue.
    unsafe { a.launch(cfg) }.w()?;
    Ok(true)
}

/// Σ x² over all of `ts` (contiguous f32 on one GPU), in f64: one launch
/// (`sum_sq_multi`) and one copy of the pieces' sums, added here in order.
pub(super) fn sum_sq_all(ts: &[&Tensor]) -> Result<f64> {
    let mut table = Table::default();
    for t in ts {
        let (dev, x, n) = address(t, 0)?;
        table.add(dev, &[x], n, &[])?;
    }
    let Some((dev, table, cfg)) = table.upload(2)? else {
        return Ok(0.0);
    };
    let blocks = cfg.grid_dim.0 as usize;
    // SAFETY: the kernel writes every block's sum.
    let partial = unsafe { dev.alloc::<f64>(blocks)? };
    let func = dev.get_or_load_custom_func("sum_sq_multi", ADAMW.name, ADAMW.ptx)?;
    let mut a = func.builder();
    a.arg(&table);
    a.arg(&partial);
    // SAFETY: the arguments are the kernel's (table, partial); each piece's
    // address holds its length of f32s, `partial` one f64 a piece.
    unsafe { a.launch(cfg) }.w()?;
    Ok(dev.clone_dtoh(&partial)?.iter().sum())
}

/// Each of `ts` (contiguous f32 on one GPU) · `c`, as views of one new tensor:
/// one launch (`scale_multi`).
pub(super) fn scaled_all(ts: &[&Tensor], c: f32) -> Result<Vec<Tensor>> {
    let total: usize = ts.iter().map(|t| t.elem_count()).sum();
    let Some(first) = ts.first() else {
        return Ok(Vec::new());
    };
    let out = Tensor::zeros(total, DType::F32, first.device())?;
    let mut table = Table::default();
    let mut views = Vec::with_capacity(ts.len());
    let mut at = 0;
    for t in ts {
        let n = t.elem_count();
        let view = out.narrow(0, at, n)?.reshape(t.shape())?;
        let (dev, src, _) = address(t, 0)?;
        let (_, dst, _) = address(&view, 0)?;
        table.add(dev, &[src, dst], n, &[])?;
        views.push(view);
        at += n;
    }
    let Some((dev, table, cfg)) = table.upload(3)? else {
        return Ok(views);
    };
    let func = dev.get_or_load_custom_func("scale_multi", ADAMW.name, ADAMW.ptx)?;
    let mut a = func.builder();
    a.arg(&table);
    a.arg(&c);
    // SAFETY: the arguments are the kernel's (table, k); each piece's source and
    // destination hold its length of f32s, and `out` is this function's own.
    unsafe { a.launch(cfg) }.w()?;
    Ok(views)
}

const ADAMW: Module = Module {
    name: "tokenformer_adamw",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx")),
};

/// The storage range a pass covers: the layout's elements from `from` on.
fn range(l: &Layout, from: usize) -> Result<std::ops::Range<usize>> {
    match l.contiguous_offsets() {
        Some((a, b)) if a + from <= b => Ok(a + from..b),
        _ => candle_core::bail!("adamw kernel: contiguous tensors of {from}+ elements"),
    }
}

/// Blocks of 256 threads, a grid-stride loop past 4,096 blocks.
fn config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// m ← b·m + c·g (g² when `square`), `[b, c]` = consts.
pub(super) fn moment(
    (dst, dl): (&mut CudaStorage, &Layout),
    (g, gl): (&CudaStorage, &Layout),
    from: usize,
    [b, c]: [f32; 2],
    square: bool,
) -> Result<()> {
    let (r, gr) = (range(dl, from)?, range(gl, from)?);
    if r.len() != gr.len() {
        candle_core::bail!("adamw kernel: {} moments, {} gradients", r.len(), gr.len())
    }
    let n = r.len() as i64;
    if n == 0 {
        return Ok(());
    }
    let dev = dst.device.clone();
    let func = dev.get_or_load_custom_func("adamw_moment", ADAMW.name, ADAMW.ptx)?;
    let gv = g.as_cuda_slice::<f32>()?.slice(gr);
    let mut mv = dst.as_cuda_slice_mut::<f32>()?.slice_mut(r);
    let square = i32::from(square);
    let mut a = func.builder();
    a.arg(&mut mv);
    a.arg(&gv);
    a.arg(&n);
    a.arg(&b);
    a.arg(&c);
    a.arg(&square);
    // SAFETY: the arguments are the kernel's (m, g, n, b, c, square); both views
    // hold n f32s.
    unsafe { a.launch(config(n as usize)) }.w()?;
    Ok(())
}

/// θ ← θ·keep − m / (√v / sbc2 + eps) · step, `[keep, sbc2, eps, step]` = consts.
pub(super) fn apply(
    (dst, dl): (&mut CudaStorage, &Layout),
    [(m, ml), (v, vl)]: [(&CudaStorage, &Layout); 2],
    from: usize,
    consts: [f32; 4],
) -> Result<()> {
    let (r, mr, vr) = (range(dl, from)?, range(ml, from)?, range(vl, from)?);
    if r.len() != mr.len() || r.len() != vr.len() {
        candle_core::bail!("adamw kernel: tensors of different sizes")
    }
    let n = r.len() as i64;
    if n == 0 {
        return Ok(());
    }
    let dev = dst.device.clone();
    let func = dev.get_or_load_custom_func("adamw_apply", ADAMW.name, ADAMW.ptx)?;
    let (mv, vv) = (
        m.as_cuda_slice::<f32>()?.slice(mr),
        v.as_cuda_slice::<f32>()?.slice(vr),
    );
    let mut tv = dst.as_cuda_slice_mut::<f32>()?.slice_mut(r);
    let mut a = func.builder();
    a.arg(&mut tv);
    a.arg(&mv);
    a.arg(&vv);
    a.arg(&n);
    for k in &consts {
        a.arg(k);
    }
    // SAFETY: the arguments are the kernel's (theta, m, v, n, keep, sbc2, eps,
    // step); the three views hold n f32s.
    unsafe { a.launch(config(n as usize)) }.w()?;
    Ok(())
}
