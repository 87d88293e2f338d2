//! AdamW on the CPU as three passes over memory, in place: the moments, then the
//! variable. The same arithmetic as [`super::AdamW::step`]'s tensor ops (each scalar
//! rounded to the tensor's dtype where candle's affine rounds it), which took a dozen
//! passes and as many allocations per tensor: a tenth of the `small` model's step, most
//! of it the embedding's. The passes, and gradient clipping's norm and scaling, run on
//! every thread, f32 compiled for the selected instruction set: on one thread they were
//! a tenth of the step again (docs/PERFORMANCE.md). On a GPU, `cuda` does them.

use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Tensor, WithDType};
use rayon::prelude::*;

use super::super::fused::read;
use super::super::parts::by_isa;
use super::Update;

/// Elements a parallel task takes.
const CHUNK: usize = 1 << 15;

/// Tensors shorter than this run on the calling thread: handing a pass to the
/// thread pool costs a wake-up (tens of µs) that a small tensor's pass does not
/// repay, and a model has dozens of small tensors.
const PARALLEL_FROM: usize = 4 * CHUNK;

/// Whether the passes here serve `t`: contiguous f32 or f64 on the CPU.
fn serves(t: &Tensor) -> bool {
    crate::kernels::fused_on(t) && matches!(t.dtype(), DType::F32 | DType::F64) && t.is_contiguous()
}

/// Whether the GPU's AdamW and clipping kernels serve `t` (`cuda::step_all`, ...):
/// contiguous f32 on a GPU, with the CUDA kernels turned on.
#[cfg(feature = "cuda")]
fn gpu_serves(t: &Tensor) -> bool {
    crate::kernels::cuda_kernels_enabled()
        && t.device().is_cuda()
        && t.dtype() == DType::F32
        && t.is_contiguous()
}

#[cfg(not(feature = "cuda"))]
fn gpu_serves(_: &Tensor) -> bool {
    false
}

/// Whether [`step_all`] serves these four: all of one dtype and shape, and
/// contiguous f32 or f64 on the CPU or contiguous f32 on a GPU.
pub(super) fn serves_all(theta: &Tensor, m: &Tensor, v: &Tensor, g: &Tensor) -> bool {
    let same = |t: &Tensor| t.dtype() == theta.dtype() && t.dims() == theta.dims();
    let all = |on: fn(&Tensor) -> bool| [theta, m, v, g].into_iter().all(|t| on(t) && same(t));
    all(serves) || all(gpu_serves)
}

/// One tensor's in-place step: the variable, its moments, its gradient.
pub(super) struct Job {
    pub theta: Tensor,
    pub m: Tensor,
    pub v: Tensor,
    pub g: Tensor,
    pub update: Update,
}

/// Steps every job's variable and moments in place ([`serves_all`] held for each),
/// the tensors in parallel: a model's dozens of small tensors then cost one hand-off
/// to the thread pool, not one each.
pub(super) fn step_all(jobs: &[Job]) -> Result<()> {
    let step = |j: &Job| {
        let u = &j.update;
        let moment = |beta, square| Moment {
            beta,
            square,
            from: u.from,
        };
        j.m.inplace_op2(&j.g, &moment(u.beta1, false))?;
        j.v.inplace_op2(&j.g, &moment(u.beta2, true))?;
        j.theta.inplace_op3(&j.m, &j.v, &Apply(u))
    };
    if jobs.iter().any(|j| j.theta.device().is_cuda()) {
        #[cfg(feature = "cuda")]
        if cuda::step_all(jobs)? {
            return Ok(());
        }
        // Kernel launches on the device's one stream, in order.
        return jobs.iter().try_for_each(step);
    }
    jobs.par_iter().try_for_each(step)
}

/// A pass over one tensor's elements, written once for f32 and f64.
trait Pass: Sync {
    type Out: Send;
    fn run<T: Elem>(&self, x: &[T], t: &Tensor) -> Result<Self::Out>;
}

/// `pass` over each of `ts`, the tensors in parallel, results in order; `None` unless
/// every one is contiguous f32 or f64 on the CPU.
fn each<P: Pass>(ts: &[&Tensor], pass: &P) -> Result<Option<Vec<P::Out>>> {
    if !ts.iter().all(|t| serves(t)) {
        return Ok(None);
    }
    ts.par_iter()
        .map(|t| match t.dtype() {
            DType::F32 => read(t, "clip", |x: &[f32]| pass.run(x, t)),
            _ => read(t, "clip", |x: &[f64]| pass.run(x, t)),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// Σ x² over the elements of all of `ts`, each widened to f64 first (an f32 sum over
/// a large embedding gradient drifts by ~1e-5), when every one is contiguous f32 or
/// f64 on the CPU. Partial sums are added in order, so the result does not depend
/// on how the threads split the work.
pub(super) fn sum_sq_all(ts: &[&Tensor]) -> Result<Option<f64>> {
    struct SumSq;
    impl Pass for SumSq {
        type Out = f64;
        fn run<T: Elem>(&self, x: &[T], _: &Tensor) -> Result<f64> {
            if x.len() < PARALLEL_FROM {
                return Ok(T::sum_sq(x));
            }
            let parts: Vec<f64> = x.par_chunks(CHUNK).map(T::sum_sq).collect();
            Ok(parts.iter().sum())
        }
    }
    #[cfg(feature = "cuda")]
    if !ts.is_empty() && ts.iter().all(|t| gpu_serves(t)) {
        return cuda::sum_sq_all(ts).map(Some);
    }
    Ok(each(ts, &SumSq)?.map(|parts| parts.iter().sum()))
}

/// Each of `ts` · c as a new tensor (as `t * c` computes it), when every one is
/// contiguous f32 or f64 on the CPU.
pub(super) fn scaled_all(ts: &[&Tensor], c: f64) -> Result<Option<Vec<Tensor>>> {
    struct Scale(f64);
    impl Pass for Scale {
        type Out = Tensor;
        fn run<T: Elem>(&self, x: &[T], t: &Tensor) -> Result<Tensor> {
            let c = T::from_f64(self.0);
            let y: Vec<T> = if x.len() < PARALLEL_FROM {
                x.iter().map(|&x| x * c).collect()
            } else {
                x.par_iter().with_min_len(CHUNK).map(|&x| x * c).collect()
            };
            Tensor::from_vec(y, t.shape(), t.device())
        }
    }
    #[cfg(feature = "cuda")]
    if !ts.is_empty() && ts.iter().all(|t| gpu_serves(t)) {
        return cuda::scaled_all(ts, c as f32).map(Some);
    }
    each(ts, &Scale(c))
}

/// f32 or f64, with the passes' element loops: f32's compiled for the selected
/// instruction set, f64's (the tests' dtype) as they are.
trait Elem: WithDType {
    fn storage_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    fn sum_sq(x: &[Self]) -> f64;
    fn moment(m: &mut [Self], g: &[Self], k: MomentConsts<Self>);
    fn apply(theta: &mut [Self], m: &[Self], v: &[Self], k: ApplyConsts<Self>);
}

/// β and 1 − β in the element type, and whether the moment is of g².
#[derive(Clone, Copy)]
pub(super) struct MomentConsts<T> {
    b: T,
    c: T,
    square: bool,
}

/// 1 − lr·decay, √bc2, eps and lr / bc1 in the element type.
#[derive(Clone, Copy)]
pub(super) struct ApplyConsts<T> {
    keep: T,
    sbc2: T,
    eps: T,
    step: T,
}

impl<T: WithDType> MomentConsts<T> {
    /// β and 1 − β rounded to the element type, as every pass takes them (the CPU's
    /// and the GPU's kernels, per tensor or all at once).
    pub(super) fn of(beta: f64, square: bool) -> Self {
        Self {
            b: T::from_f64(beta),
            c: T::from_f64(1.0 - beta),
            square,
        }
    }
}

impl<T: WithDType> ApplyConsts<T> {
    /// `u`'s constants rounded to the element type, as every pass takes them.
    pub(super) fn of(u: &Update) -> Self {
        Self {
            keep: T::from_f64(1.0 - u.lr * u.decay),
            sbc2: T::from_f64(u.bc2.sqrt()),
            eps: T::from_f64(u.eps),
            step: T::from_f64(u.lr / u.bc1),
        }
    }
}

/// m ← β·m + (1 − β)·g, or v ← β·v + (1 − β)·g².
#[inline(always)]
fn moment_generic<T: WithDType>(m: &mut [T], g: &[T], k: MomentConsts<T>) {
    if k.square {
        m.iter_mut()
            .zip(g)
            .for_each(|(m, &g)| *m = *m * k.b + g * g * k.c);
    } else {
        m.iter_mut()
            .zip(g)
            .for_each(|(m, &g)| *m = *m * k.b + g * k.c);
    }
}

/// θ ← θ·(1 − lr·decay) − lr/bc1 · m / (√v / √bc2 + eps).
#[inline(always)]
fn apply_generic<T: WithDType>(
    theta: &mut [T],
    m: &[T],
    v: &[T],
    k: ApplyConsts<T>,
    sqrt: impl Fn(T) -> T,
) {
    for ((t, &m), &v) in theta.iter_mut().zip(m).zip(v) {
        *t = *t * k.keep - m / (sqrt(v) / k.sbc2 + k.eps) * k.step;
    }
}

/// Σ (x as f64)² over eight f64 lanes.
#[inline(always)]
fn sum_sq_generic<T: WithDType + Into<f64>>(x: &[T]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut blocks = x.chunks_exact(8);
    for b in &mut blocks {
        for (l, &x) in lanes.iter_mut().zip(b) {
            let x: f64 = x.into();
            *l += x * x;
        }
    }
    let tail: f64 = blocks
        .remainder()
        .iter()
        .map(|&x| x.into() * x.into())
        .sum();
    lanes.iter().sum::<f64>() + tail
}

#[inline(always)]
fn sum_sq_f32_generic(x: &[f32], out: &mut f64) {
    *out = sum_sq_generic(x);
}

#[inline(always)]
fn moment_f32_generic(m: &mut [f32], g: &[f32], k: MomentConsts<f32>) {
    moment_generic(m, g, k)
}

#[inline(always)]
fn apply_f32_generic(theta: &mut [f32], m: &[f32], v: &[f32], k: ApplyConsts<f32>) {
    apply_generic(theta, m, v, k, f32::sqrt)
}

by_isa!(sum_sq_f32(x: &[f32], out: &mut f64) = sum_sq_f32_generic);
by_isa!(moment_f32(m: &mut [f32], g: &[f32], k: MomentConsts<f32>) = moment_f32_generic);
by_isa!(apply_f32(theta: &mut [f32], m: &[f32], v: &[f32], k: ApplyConsts<f32>) = apply_f32_generic);

impl Elem for f32 {
    fn storage_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
    fn sum_sq(x: &[Self]) -> f64 {
        let mut out = 0.0;
        sum_sq_f32(x, &mut out);
        out
    }
    fn moment(m: &mut [Self], g: &[Self], k: MomentConsts<Self>) {
        moment_f32(m, g, k)
    }
    fn apply(theta: &mut [Self], m: &[Self], v: &[Self], k: ApplyConsts<Self>) {
        apply_f32(theta, m, v, k)
    }
}

impl Elem for f64 {
    fn storage_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
        match s {
            CpuStorage::F64(v) => Some(v),
            _ => None,
        }
    }
    fn sum_sq(x: &[Self]) -> f64 {
        sum_sq_generic(x)
    }
    fn moment(m: &mut [Self], g: &[Self], k: MomentConsts<Self>) {
        moment_generic(m, g, k)
    }
    fn apply(theta: &mut [Self], m: &[Self], v: &[Self], k: ApplyConsts<Self>) {
        apply_generic(theta, m, v, k, f64::sqrt)
    }
}

fn slice<'a, T: Elem>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    super::super::fused::contiguous(s, l, "adamw")
}

fn slice_mut<'a, T: Elem>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [T]> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("adamw: contiguous tensors expected")
    };
    match T::storage_mut(s) {
        Some(v) => Ok(&mut v[a..b]),
        None => candle_core::bail!("adamw: tensors of one dtype expected"),
    }
}

/// m ← β·m + (1 − β)·g, or v ← β·v + (1 − β)·g².
struct Moment {
    beta: f64,
    square: bool,
    from: usize,
}

impl Moment {
    fn run<T: Elem>(&self, m: &mut [T], g: &[T]) {
        let k = MomentConsts::of(self.beta, self.square);
        let (m, g) = (&mut m[self.from..], &g[self.from..]);
        if m.len() < PARALLEL_FROM {
            return T::moment(m, g, k);
        }
        m.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .for_each(|(m, g)| T::moment(m, g, k));
    }
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let k = MomentConsts::<f32>::of(self.beta, self.square);
        cuda::moment((dst, dl), (g, gl), self.from, [k.b, k.c], k.square)
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
    ) -> Result<()> {
        match dst {
            CpuStorage::F32(_) => {
                let g = slice::<f32>(g, gl)?;
                self.run(slice_mut::<f32>(dst, dl)?, g);
            }
            _ => {
                let g = slice::<f64>(g, gl)?;
                self.run(slice_mut::<f64>(dst, dl)?, g);
            }
        }
        Ok(())
    }
}

/// θ ← θ·(1 − lr·decay) − lr/bc1 · m / (√v / √bc2 + eps), as torch.
struct Apply<'a>(&'a Update);

impl Apply<'_> {
    fn run<T: Elem>(&self, theta: &mut [T], m: &[T], v: &[T]) {
        let u = self.0;
        let k = ApplyConsts::of(u);
        let (theta, m, v) = (&mut theta[u.from..], &m[u.from..], &v[u.from..]);
        if theta.len() < PARALLEL_FROM {
            return T::apply(theta, m, v, k);
        }
        theta
            .par_chunks_mut(CHUNK)
            .zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK)))
            .for_each(|(t, (m, v))| T::apply(t, m, v, k));
    }
}

impl InplaceOp3 for Apply<'_> {
    fn name(&self) -> &'static str {
        "adamw-apply"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &Layout,
        m: &candle_core::CudaStorage,
        ml: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<()> {
        let k = ApplyConsts::<f32>::of(self.0);
        let consts = [k.keep, k.sbc2, k.eps, k.step];
        cuda::apply((dst, dl), [(m, ml), (v, vl)], self.0.from, consts)
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        m: &CpuStorage,
        ml: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<()> {
        match dst {
            CpuStorage::F32(_) => {
                let (m, v) = (slice::<f32>(m, ml)?, slice::<f32>(v, vl)?);
                self.run(slice_mut::<f32>(dst, dl)?, m, v);
            }
            _ => {
                let (m, v) = (slice::<f64>(m, ml)?, slice::<f64>(v, vl)?);
                self.run(slice_mut::<f64>(dst, dl)?, m, v);
            }
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod cuda;
