//! AdamW as PyTorch's `torch.optim.AdamW` computes it (decoupled weight decay, bias
//! correction), with the official parameter groups (weight decay on matrices only),
//! global-norm gradient clipping as `torch.nn.utils.clip_grad_norm_`, and linear
//! warm-up then cosine decay to a minimum learning rate.
//!
//! candle-nn's `AdamW` applies one weight decay to every variable and keeps its moments
//! private; training here needs per-tensor decay, and moments that survive a checkpoint
//! and a growth step (old tokens keep theirs, appended tokens start at zero).

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

/// Hyper-parameters of [`AdamW`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// The official TokenFormer configs: betas (0.9, 0.95), eps 1e-8, weight decay 0.1.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// First and second moments of one variable.
#[derive(Clone, Debug)]
pub struct Moments {
    pub m: Tensor,
    pub v: Tensor,
}

/// AdamW over named variables; only the names given are updated.
pub struct AdamW {
    cfg: AdamWConfig,
    vars: BTreeMap<String, Var>,
    moments: BTreeMap<String, Moments>,
    /// Leading rows that stay as they are (the old tokens of a grown tensor).
    frozen_rows: BTreeMap<String, usize>,
    /// Per-variable factors of the update, broadcast to its shape (a diagonal
    /// preconditioner, e.g. one per parameter token).
    update_scales: BTreeMap<String, Tensor>,
    step: u64,
}

impl AdamW {
    /// Optimises `vars` (name → variable), moments starting at zero.
    pub fn new(vars: BTreeMap<String, Var>, cfg: AdamWConfig) -> Result<Self> {
        let moments = vars
            .iter()
            .map(|(k, v)| {
                // Two allocations: the step updates each moment in place.
                let z = || v.as_tensor().zeros_like();
                Ok((k.clone(), Moments { m: z()?, v: z()? }))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            cfg,
            vars,
            moments,
            frozen_rows: BTreeMap::new(),
            update_scales: BTreeMap::new(),
            step: 0,
        })
    }

    /// Keeps the first `rows` rows of `name` bit for bit: only the rows after them are
    /// updated (and decayed), and only their moments change.
    pub fn freeze_rows(&mut self, name: &str, rows: usize) {
        self.frozen_rows.insert(name.to_string(), rows);
    }

    /// Multiplies `name`'s update (not its decay) by `scale`, broadcast to its shape
    /// (e.g. [rows, 1]: one factor per parameter token). Adam's update is about `lr` per
    /// element whatever the element's scale; where a tensor's rows differ by orders of
    /// magnitude in how much they move the output (an imported Pattention's anchor and
    /// bias tokens), a factor per row gives each the step its scale needs.
    pub fn scale_updates(&mut self, name: &str, scale: Tensor) -> Result<()> {
        let Some(var) = self.vars.get(name) else {
            candle_core::bail!("`{name}` is not optimised")
        };
        scale.broadcast_as(var.dims())?;
        self.update_scales.insert(name.to_string(), scale);
        Ok(())
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Steps taken (the bias-correction count).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The moments by variable name (for checkpoints).
    pub fn moments(&self) -> &BTreeMap<String, Moments> {
        &self.moments
    }

    /// Restores a checkpoint's moments and step count. Each given moment must match its
    /// variable's shape, except that a variable grown along its first axis (appended
    /// parameter tokens) keeps the old rows and starts the new ones at zero.
    pub fn restore(&mut self, step: u64, moments: BTreeMap<String, Moments>) -> Result<()> {
        for (name, saved) in moments {
            let Some(var) = self.vars.get(&name) else {
                continue; // frozen in this run
            };
            let shape = var.as_tensor().dims().to_vec();
            let grown = |t: &Tensor| -> Result<Tensor> {
                let old = t.dims();
                if old == shape.as_slice() {
                    return Ok(t.clone());
                }
                if old.len() == shape.len() && old[1..] == shape[1..] && old[0] < shape[0] {
                    let mut pad = shape.clone();
                    pad[0] -= old[0];
                    let zeros = Tensor::zeros(pad, t.dtype(), t.device())?;
                    return Tensor::cat(&[t, &zeros], 0);
                }
                candle_core::bail!(
                    "optimiser state of `{name}` has shape {old:?}, the tensor {shape:?}"
                )
            };
            // Copies of their own on the tensor's device (a run saved on one
            // device resumes on another): the step updates moments in place.
            let own = |t: Tensor| -> Result<Tensor> {
                let t = t.to_dtype(var.dtype())?;
                if t.device().same_device(var.device()) {
                    t.copy()
                } else {
                    t.to_device(var.device())
                }
            };
            let m = own(grown(&saved.m)?)?;
            let v = own(grown(&saved.v)?)?;
            self.moments.insert(name, Moments { m, v });
        }
        self.step = step;
        Ok(())
    }

    /// One AdamW step at learning rate `lr` with the gradients in `grads`. Weight decay
    /// applies to variables of two or more dimensions only.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.step += 1;
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.cfg;
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
        // The tensors stepped in place, all at once at the end (in parallel).
        let mut in_place = Vec::new();
        for (name, var) in &self.vars {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let mom = self.moments.get_mut(name).expect("one moment per variable");
            let full = var.as_tensor();
            let r0 = self.frozen_rows.get(name).copied().unwrap_or(0);
            let n = full.dim(0).unwrap_or(0);
            // The trainable rows only (all of them when nothing is frozen).
            let rows = |t: &Tensor| -> Result<Tensor> {
                if r0 == 0 {
                    Ok(t.clone())
                } else {
                    t.narrow(0, r0, n - r0)
                }
            };
            let decay = if full.rank() >= 2 { weight_decay } else { 0.0 };
            let update = Update {
                beta1,
                beta2,
                lr,
                decay,
                bc1,
                bc2,
                eps,
                from: r0 * full.elem_count() / n.max(1),
            };
            let scale = self.update_scales.get(name);
            if scale.is_none() && in_place::serves_all(full, &mom.m, &mom.v, g) {
                in_place.push(in_place::Job {
                    theta: full.clone(),
                    m: mom.m.clone(),
                    v: mom.v.clone(),
                    g: g.clone(),
                    update,
                });
                continue;
            }
            // Detached: a gradient can carry its graph, and moments that kept it would
            // chain every step's activations to the next (memory growing without bound).
            let (g, theta) = (rows(&g.detach())?, rows(&full.detach())?);
            let m = ((rows(&mom.m)? * beta1)? + (&g * (1.0 - beta1))?)?.detach();
            let v = ((rows(&mom.v)? * beta2)? + (g.sqr()? * (1.0 - beta2))?)?.detach();
            let decayed = (&theta * (1.0 - lr * decay))?;
            // torch: θ -= lr/bc1 · m / (√v / √bc2 + eps)
            let denom = ((v.sqrt()? / bc2.sqrt())? + eps)?;
            let mut update = ((&m / denom)? * (lr / bc1))?;
            if let Some(scale) = scale {
                let scale = scale.broadcast_as(full.dims())?.to_dtype(full.dtype())?;
                update = (update * rows(&scale)?)?;
            }
            let new = (decayed - update)?;
            if r0 == 0 {
                var.set(&new)?;
                *mom = Moments { m, v };
            } else {
                let keep =
                    |t: &Tensor, tail: &Tensor| Tensor::cat(&[&t.narrow(0, 0, r0)?, tail], 0);
                var.set(&keep(full, &new)?)?;
                *mom = Moments {
                    m: keep(&mom.m, &m)?,
                    v: keep(&mom.v, &v)?,
                };
            }
        }
        in_place::step_all(&in_place)
    }
}

/// One variable's AdamW step: everything [`in_place::step`] needs besides the tensors.
struct Update {
    beta1: f64,
    beta2: f64,
    lr: f64,
    decay: f64,
    bc1: f64,
    bc2: f64,
    eps: f64,
    /// The first element updated (the frozen rows' elements before it stay).
    from: usize,
}

/// AdamW on the CPU as three passes over memory, in place: the moments, then the
/// variable. The same arithmetic as the tensor-op path above (each scalar rounded to
/// the tensor's dtype where candle's affine rounds it), which took a dozen passes and
/// as many allocations per tensor: a tenth of the `small` model's step, most of it the
/// embedding's. The passes, and gradient clipping's norm and scaling, run on every
/// thread, f32 compiled for the selected instruction set: on one thread they were a
/// tenth of the step again (docs/PERFORMANCE.md).
mod in_place {
    use candle_core::{
        CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Tensor, WithDType,
    };
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
        crate::kernels::fused_on(t)
            && matches!(t.dtype(), DType::F32 | DType::F64)
            && t.is_contiguous()
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
            let k = MomentConsts {
                b: T::from_f64(self.beta),
                c: T::from_f64(1.0 - self.beta),
                square: self.square,
            };
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
            let consts = [self.beta as f32, (1.0 - self.beta) as f32];
            cuda::moment((dst, dl), (g, gl), self.from, consts, self.square)
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
            let k = ApplyConsts {
                keep: T::from_f64(1.0 - u.lr * u.decay),
                sbc2: T::from_f64(u.bc2.sqrt()),
                eps: T::from_f64(u.eps),
                step: T::from_f64(u.lr / u.bc1),
            };
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
            let u = self.0;
            // As `run` rounds them for f32.
            let consts = [
                (1.0 - u.lr * u.decay) as f32,
                u.bc2.sqrt() as f32,
                u.eps as f32,
                (u.lr / u.bc1) as f32,
            ];
            cuda::apply((dst, dl), [(m, ml), (v, vl)], u.from, consts)
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

    /// The passes on a GPU: `cuda/adamw.cu`'s kernels, one launch each, in place from
    /// element `from` on (the frozen rows' elements before it stay); and their
    /// multi-tensor forms, one launch for all of a step's tensors.
    #[cfg(feature = "cuda")]
    mod cuda {
        use candle_core::cuda_backend::cudarc::driver::{
            CudaSlice, DevicePtr, LaunchConfig, PushKernelArg,
        };
        use candle_core::cuda_backend::WrapErr;
        use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

        use super::Job;
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
            fn upload(
                self,
                width: usize,
            ) -> Result<Option<(CudaDevice, CudaSlice<u64>, LaunchConfig)>> {
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
                        candle_core::bail!(
                            "adamw kernel: a variable, its moments and gradient differ"
                        )
                    }
                    at[k + 1] = a;
                }
                // As `Apply::run` rounds it for f32.
                let keep = (1.0 - j.update.lr * j.update.decay) as f32;
                table.add(dev, &at, n, &[u64::from(keep.to_bits())])?;
            }
            let Some((dev, table, cfg)) = table.upload(6)? else {
                return Ok(true);
            };
            let func = dev.get_or_load_custom_func("adamw_step_multi", ADAMW.name, ADAMW.ptx)?;
            // As `Moment::cuda_fwd` and `Apply::cuda_fwd` round them.
            let consts = [
                u.beta1 as f32,
                (1.0 - u.beta1) as f32,
                u.beta2 as f32,
                (1.0 - u.beta2) as f32,
                u.bc2.sqrt() as f32,
                u.eps as f32,
                (u.lr / u.bc1) as f32,
            ];
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
    }
}

/// Scales the gradients of `vars` so their global L2 norm is at most `max_norm`
/// (`max_norm` ≤ 0: no clipping), as `clip_grad_norm_` does (coefficient
/// max_norm / (norm + 1e-6), applied only when below 1). Returns the norm before.
pub fn clip_grad_norm<'a>(
    grads: &mut GradStore,
    vars: impl IntoIterator<Item = &'a Var> + Clone,
    max_norm: f64,
) -> Result<f64> {
    let (vars, owned): (Vec<&Var>, Vec<Tensor>) = vars
        .into_iter()
        .filter_map(|v| grads.get(v.as_tensor()).map(|g| (v, g.clone())))
        .unzip();
    let gs: Vec<&Tensor> = owned.iter().collect();
    let norm = match in_place::sum_sq_all(&gs)? {
        Some(sq) => sq.sqrt(),
        None => {
            // In f64 (an f32 sum over a large embedding gradient drifts by ~1e-5), the
            // per-tensor sums added where they are, in order: on a GPU one transfer and
            // one wait, not one per tensor.
            let mut sq: Option<Tensor> = None;
            for g in &gs {
                let s = g.to_dtype(candle_core::DType::F64)?.sqr()?.sum_all()?;
                sq = Some(match sq {
                    Some(acc) => (acc + s)?,
                    None => s,
                });
            }
            sq.map_or(Ok(0.0), |s| s.to_scalar::<f64>())?.sqrt()
        }
    };
    let coef = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coef < 1.0 {
        let scaled = match in_place::scaled_all(&gs, coef)? {
            Some(scaled) => scaled,
            None => gs.iter().map(|&g| g * coef).collect::<Result<Vec<_>>>()?,
        };
        for (v, g) in vars.iter().zip(scaled) {
            grads.insert(v.as_tensor(), g);
        }
    }
    Ok(norm)
}

/// Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to `min_lr`
/// at `total` steps (constant after), as GPT-NeoX's `cosine` schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    pub total: u64,
}

impl LrSchedule {
    /// The learning rate of step `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        if self.warmup > 0 && step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup.min(step)) as f64 / span).min(1.0);
        self.min_lr
            + (self.lr - self.min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The tests' hyper-parameters: torch's betas and eps, weight decay 0.1.
    fn decayed() -> AdamWConfig {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }

    /// Three in-place steps (one of them with the first row frozen) against torch's
    /// AdamW written out per element in f64, for a matrix (decayed) and a vector (not).
    #[test]
    fn in_place_steps_follow_torchs_adamw_per_element() {
        let (dev, cfg) = (Device::Cpu, decayed());
        let init =
            |n: usize, s: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 - 2.5) * s).collect() };
        let w = Var::from_tensor(&Tensor::from_vec(init(6, 0.3), (3, 2), &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::from_vec(init(2, 0.5), 2, &dev).unwrap()).unwrap();
        let vars: BTreeMap<String, Var> =
            [("w".to_string(), w.clone()), ("b".to_string(), b.clone())].into();
        let mut opt = AdamW::new(vars, cfg).unwrap();
        // (θ, m, v, decay) per tensor.
        type Expected = (Vec<f64>, Vec<f64>, Vec<f64>, f64);
        let mut want: Vec<Expected> = vec![
            (init(6, 0.3), vec![0.0; 6], vec![0.0; 6], cfg.weight_decay),
            (init(2, 0.5), vec![0.0; 2], vec![0.0; 2], 0.0),
        ];
        let now = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let mut kept = None;
        for step in 1..=3 {
            let lr = 0.01 * step as f64;
            let frozen = if step == 3 { 1 } else { 0 };
            if step == 3 {
                opt.freeze_rows("w", 1);
                kept = Some((now(w.as_tensor()), now(&opt.moments()["w"].m)));
            }
            let grads: Vec<Vec<f64>> = want
                .iter()
                .map(|(t, ..)| t.iter().map(|x| x * x - 0.2 * step as f64).collect())
                .collect();
            let loss = ((w.as_tensor()
                * Tensor::from_vec(grads[0].clone(), (3, 2), &dev).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
                + (b.as_tensor() * Tensor::from_vec(grads[1].clone(), 2, &dev).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap())
            .unwrap();
            opt.step(&loss.backward().unwrap(), lr).unwrap();
            let (bc1, bc2) = (1.0 - 0.9f64.powi(step), 1.0 - 0.95f64.powi(step));
            for (k, ((t, m, v, decay), g)) in want.iter_mut().zip(&grads).enumerate() {
                let first = if k == 0 { 2 * frozen } else { 0 };
                for i in first..t.len() {
                    m[i] = 0.9 * m[i] + 0.1 * g[i];
                    v[i] = 0.95 * v[i] + 0.05 * g[i] * g[i];
                    t[i] = t[i] * (1.0 - lr * *decay)
                        - lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + 1e-8);
                }
            }
            for (var, (t, ..)) in [&w, &b].into_iter().zip(&want) {
                let got: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                for (g, e) in got.iter().zip(t) {
                    assert!((g - e).abs() < 1e-14, "step {step}: {got:?} vs {t:?}");
                }
            }
        }
        // The frozen row kept its values and moments of step 2 bit for bit.
        let (theta, m) = kept.expect("set at step 3");
        assert_eq!(now(w.as_tensor())[..2], theta[..2]);
        assert_eq!(now(&opt.moments()["w"].m)[..2], m[..2]);
        assert_ne!(now(w.as_tensor())[2..], theta[2..]);
    }

    /// The f32 passes (the clipping norm and scaling, the moments, the update) over a
    /// tensor of several of their parallel chunks, rows frozen at its start: each
    /// element as the formulas give it in f32, to the bit.
    #[test]
    fn f32_passes_over_many_chunks_follow_the_formulas_per_element() {
        let (dev, cfg) = (Device::Cpu, decayed());
        let (rows, cols, frozen) = (10_007, 7, 3);
        let n = rows * cols;
        let wave = |i: usize, a: f32, b: f32| (i as f32 * a).sin() * b;
        let theta0: Vec<f32> = (0..n).map(|i| wave(i, 0.37, 0.5)).collect();
        let g: Vec<f32> = (0..n).map(|i| wave(i, 1.13, 0.02)).collect();
        let w = Var::from_tensor(&Tensor::from_vec(theta0.clone(), (rows, cols), &dev).unwrap())
            .unwrap();
        let mut opt = AdamW::new([("w".to_string(), w.clone())].into(), cfg).unwrap();
        opt.freeze_rows("w", frozen);
        let loss = (w.as_tensor() * Tensor::from_vec(g.clone(), (rows, cols), &dev).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let mut grads = loss.backward().unwrap();
        let norm = clip_grad_norm(&mut grads, [&w], 0.5).unwrap();
        let want_norm = g.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        assert!(
            (norm / want_norm - 1.0).abs() < 1e-12,
            "{norm} vs {want_norm}"
        );
        let lr = 1e-3;
        opt.step(&grads, lr).unwrap();

        let c = (0.5 / (norm + 1e-6)) as f32;
        let (b1, c1, b2, c2) = (
            0.9f32,
            (1.0 - 0.9f64) as f32,
            0.95f32,
            (1.0 - 0.95f64) as f32,
        );
        let keep = (1.0 - lr * cfg.weight_decay) as f32;
        let (sbc2, eps, step) = (
            (1.0 - 0.95f64).sqrt() as f32,
            1e-8f64 as f32,
            (lr / (1.0 - 0.9f64)) as f32,
        );
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (theta, m, v) = (
            flat(w.as_tensor()),
            flat(&opt.moments()["w"].m),
            flat(&opt.moments()["w"].v),
        );
        for i in 0..n {
            if i < frozen * cols {
                assert_eq!((theta[i], m[i], v[i]), (theta0[i], 0.0, 0.0), "{i}");
                continue;
            }
            let gc = g[i] * c;
            let mi = 0.0 * b1 + gc * c1;
            let vi = 0.0 * b2 + gc * gc * c2;
            let ti = theta0[i] * keep - mi / (vi.sqrt() / sbc2 + eps) * step;
            assert_eq!((theta[i], m[i], v[i]), (ti, mi, vi), "element {i}");
        }
    }
}
