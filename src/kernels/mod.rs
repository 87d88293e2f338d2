//! Fused CPU kernels for the hot loops that candle would otherwise run as
//! several single-threaded passes or copies. They are row-parallel with
//! rayon and fall back to plain tensor ops for other devices, dtypes or
//! layouts.
//!
//! Every kernel exists for three instruction-set [`Isa`]s: portable Rust,
//! AVX2+FMA+F16C and AVX-512. The best one the CPU has is chosen once per
//! process, unless the environment variable `TOKENFORMER_KERNELS`
//! (`portable`, `avx2`, `avx512` or `auto`) asks for another, so one machine
//! can run (and test) every path it supports; the large products follow the
//! same choice (the gemm crate's kernels, or on AVX2 our own `sgemm`).
//! `TOKENFORMER_KERNELS=none` turns every fused kernel off, inference and
//! training alike: the CPU then runs the plain candle ops a GPU runs, so
//! that path can be checked against the fixtures without one.
//! The row kernels are written so that all paths add in the same order, and
//! where they do the results are the same to the bit (tested).
//!
//! - `math`: vectorisable erf, exp and GELU;
//! - `rows`: per-row primitives (dot, axpy, sums, softmax) and the dispatch
//!   between instruction sets;
//! - [`theta`]: Θ, the Pattention non-linearity (reference and fused);
//! - `rotary`: GPT-NeoX rotary embeddings (also on a GPU);
//! - `attention`: fused token-token attention;
//! - `attention_avx512`: its blocks of prefill queries on AVX-512 (keys and
//!   values read where they lie, the softmax down the lanes);
//! - `gemv`: the matrix-vector products of decoding (f32 or f16 weights,
//!   the latter widened by `half`);
//! - [`q8`]: 8-bit weights (int8 blocks of 32 with an f32 scale each);
//! - `norm`: LayerNorm of bf16/f16 rows, summed in f32;
//! - `amx`: bf16 products on Intel AMX, for models computing in bf16 on the
//!   AVX-512 path (Θ and attention of such models run the f32 kernels on
//!   widened rows);
//! - `sgemm`: the packed f32 product of the AVX2 path;
//! - `matmul`: the products' entry points, gemm for the compute-bound ones.
//!
//! With the `cuda` feature, kernels of our own for a GPU (`cuda/*.cu`, PTX
//! built by build.rs): Θ, flash-style attention and scoring's
//! log-softmax-gather for inference; for training, Θ's backward, the
//! attention's backward (`flash`: no [b, h, t, t] tensors) and three
//! ops with a kernel each way (`masked_softmax`, `nonparam_norm`, and
//! `logprob`'s cross-entropy), one op for every device (their CPU sides
//! are f64 loops for the tests; the row ops share `row_op`). They are experimental:
//! written, compiled and emulated on the CPU but not yet run on a GPU, so
//! they stay off unless `TOKENFORMER_CUDA_KERNELS=1` (see
//! [`cuda_kernels_enabled`]); without it a GPU runs plain candle ops.

use std::sync::OnceLock;

use candle_core::{CpuStorage, Layout, Result};

#[cfg(target_arch = "x86_64")]
mod amx;
mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_avx512;
#[cfg(feature = "cuda")]
pub(crate) mod attention_cuda;
pub(crate) mod flash;
mod gemv;
mod half;
mod logprob;
#[cfg(feature = "cuda")]
mod logprob_cuda;
pub(crate) mod masked_softmax;
pub(crate) mod math;
mod matmul;
pub(crate) mod nonparam_norm;
mod norm;
pub mod q8;
mod rotary;
mod row_op;
mod rows;
#[cfg(feature = "cuda")]
pub(crate) mod rows_cuda;
#[cfg(target_arch = "x86_64")]
mod sgemm;
pub mod theta;
#[cfg(feature = "cuda")]
pub(crate) mod theta_cuda;

/// A raw pointer handed to the tasks of one kernel, which read through it or
/// write disjoint parts of what it points to.
#[derive(Clone, Copy)]
pub(super) struct SharedPtr(pub(super) *mut f32);
// SAFETY: the kernels that share one keep it valid for their whole run and
// give each task its own part to write.
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

/// The GPU kernels' entry points, called directly by the GPU tests (which
/// check them whatever `TOKENFORMER_CUDA_KERNELS` says) and by the model and
/// scoring paths when [`cuda_kernels_enabled`].
#[cfg(feature = "cuda")]
pub mod cuda {
    pub use super::attention_cuda::flash_attention;
    pub use super::logprob_cuda::target_logprobs;

    /// Training's mean cross-entropy of `logits` [n, classes] on a GPU by the
    /// log-softmax-gather kernel and its backward (what `train` takes there under
    /// `TOKENFORMER_CUDA_KERNELS=1`); called directly by the GPU tests.
    pub fn cross_entropy(
        logits: &candle_core::Tensor,
        targets: &[u32],
    ) -> candle_core::Result<candle_core::Tensor> {
        let (n, classes) = logits.dims2()?;
        crate::train::loss::check_targets(n, classes, targets)?;
        super::logprob::cross_entropy(logits, targets)
    }
    pub use super::masked_softmax::softmax_scaled;
    pub use super::nonparam_norm::{add_layer_norm, layer_norm};
    pub use super::rotary::rotary_heads;
    pub use super::theta_cuda::theta;

    /// Θ (`l2_norm_gelu`) as training runs it, with its backward: on a GPU both
    /// passes are CUDA kernels, on the CPU the fused f32/f64 passes. What the
    /// training path takes under `TOKENFORMER_CUDA_KERNELS=1`; called directly by
    /// the GPU tests.
    pub fn trainable_theta(
        scores: &candle_core::Tensor,
        scale_tokens: usize,
    ) -> candle_core::Result<candle_core::Tensor> {
        crate::train::theta::l2_norm_gelu(scores, scale_tokens)
    }
}

pub use attention::attention;
pub(crate) use matmul::{gemm_f32, gemm_parallelism};
pub use matmul::{matmul_nn, matmul_nt, matmul_nt_q8, SMALL_ROWS};
pub(crate) use norm::layer_norm_rows;
pub use q8::Q8Matrix;
pub(crate) use rotary::{rotary_heads, serves as rotary_heads_serve};
pub(crate) use rows::max_of;
pub use rows::{max_and_exp_sum, sum};
pub use theta::theta_owned;

/// An instruction-set level the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust for the build target (SSE2 on x86-64), and gemm's scalar kernels.
    Portable,
    /// AVX2 + FMA + F16C: 256-bit registers.
    Avx2,
    /// AVX-512F (with AVX2, FMA and F16C): 512-bit registers.
    Avx512,
}

impl Isa {
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// The name `TOKENFORMER_KERNELS` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The CPU features the path's code is compiled for.
    pub fn features(self) -> &'static [&'static str] {
        match self {
            Isa::Portable => &[],
            Isa::Avx2 => &["avx2", "fma", "f16c"],
            Isa::Avx512 => &["avx512f", "avx2", "fma", "f16c"],
        }
    }

    /// Whether this CPU has every feature the path uses.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let v3 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            match self {
                Isa::Portable => true,
                Isa::Avx2 => v3,
                Isa::Avx512 => v3 && is_x86_feature_detected!("avx512f"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Portable
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An [`Isa`] this CPU supports. Kernels take a `Path`, never a bare `Isa`,
/// so code compiled for a feature cannot run on a CPU without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Path(Isa);

impl Path {
    /// `isa`, if this CPU supports it.
    pub fn new(isa: Isa) -> Option<Path> {
        isa.is_supported().then_some(Path(isa))
    }

    pub fn isa(self) -> Isa {
        self.0
    }

    /// Every path this CPU supports, portable first.
    pub(crate) fn all() -> Vec<Path> {
        Isa::ALL.into_iter().filter_map(Path::new).collect()
    }

    /// The fastest path this CPU supports.
    pub(crate) fn best() -> Path {
        *Path::all().last().expect("portable is always supported")
    }
}

/// The environment variable that forces a kernel path.
pub(crate) const KERNELS_ENV: &str = "TOKENFORMER_KERNELS";

/// Per-row results of scoring's fused log-softmax-gather (the GPU kernel
/// `cuda::target_logprobs`), on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetLogprobs {
    /// log p(target) = log-softmax of the row at its target.
    pub logprob: Vec<f32>,
    /// log Σ exp of the row.
    pub logsumexp: Vec<f32>,
    /// The first index holding the row's maximum (torch's argmax on ties).
    pub argmax: Vec<u32>,
}

/// Whether scoring's log-softmax-gather takes the GPU kernel for `logits`.
#[cfg(feature = "cuda")]
pub(crate) fn logprob_cuda_serves(logits: &candle_core::Tensor) -> bool {
    logprob_cuda::serves(logits)
}

/// The environment variable that turns on the project's own CUDA kernels.
pub const CUDA_KERNELS_ENV: &str = "TOKENFORMER_CUDA_KERNELS";

/// Whether a `TOKENFORMER_CUDA_KERNELS` value turns the CUDA kernels on:
/// `1`, `on` or `true` (any case); anything else, or unset, leaves them off.
pub(crate) fn cuda_kernels_requested(value: Option<&str>) -> bool {
    value.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "on" | "true"))
}

/// Whether the model and scoring paths use the project's CUDA kernels (Θ,
/// attention, log-softmax-gather) on a GPU: only when
/// `TOKENFORMER_CUDA_KERNELS=1` and the fused kernels are not turned off
/// (`TOKENFORMER_KERNELS=none`). Off by default because they have not been
/// run on a GPU yet, so that a wrong kernel cannot change a default result.
/// Read once per process.
pub fn cuda_kernels_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        cuda_kernels_requested(std::env::var(CUDA_KERNELS_ENV).ok().as_deref()) && selection().fused
    })
}

/// The kernel path of this process and how it was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub path: Path,
    /// What was asked for: `auto` when `TOKENFORMER_KERNELS` is unset or empty.
    pub requested: String,
    /// Why the request could not be honoured (an unknown name, or a path this
    /// CPU lacks); the best supported path is used instead. For the caller
    /// to show: the library prints nothing.
    pub warning: Option<String>,
    /// False for `none`: no fused kernel runs, only plain candle ops.
    pub fused: bool,
}

/// The path for a `TOKENFORMER_KERNELS` value (`None`, empty or `auto`: the best).
pub(crate) fn select(request: Option<&str>) -> Selection {
    let requested = request.map(str::trim).filter(|r| !r.is_empty());
    let requested = requested.unwrap_or("auto").to_ascii_lowercase();
    let best = Path::best();
    let chosen = |path: Path, warning: Option<String>| Selection {
        path,
        requested: requested.clone(),
        warning,
        fused: requested != "none",
    };
    if requested == "auto" || requested == "none" {
        return chosen(best, None);
    }
    match Isa::ALL.into_iter().find(|i| i.as_str() == requested) {
        Some(isa) => match Path::new(isa) {
            Some(path) => chosen(path, None),
            None => chosen(
                best,
                Some(format!(
                    "{KERNELS_ENV}={requested}: this CPU lacks {}; using {}",
                    isa.features().join("+"),
                    best.isa()
                )),
            ),
        },
        None => chosen(
            best,
            Some(format!(
                "{KERNELS_ENV}={requested} is not one of auto, portable, avx2, avx512, none; using {}",
                best.isa()
            )),
        ),
    }
}

/// The selection of this process, made from `TOKENFORMER_KERNELS` on first use.
pub fn selection() -> &'static Selection {
    static SELECTION: OnceLock<Selection> = OnceLock::new();
    SELECTION.get_or_init(|| select(std::env::var(KERNELS_ENV).ok().as_deref()))
}

/// The path every kernel of this process takes.
#[inline]
pub(crate) fn active() -> Path {
    selection().path
}

/// The dtype the reductions over `dtype` activations run in: f32 for half
/// precision (a 768-term bf16 sum is ten times less accurate), else its own.
pub(crate) fn reduction_dtype(dtype: candle_core::DType) -> candle_core::DType {
    use candle_core::DType;
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// `x` in its [`reduction_dtype`] (the same tensor for f32 and f64).
pub(crate) fn widened(x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    x.to_dtype(reduction_dtype(x.dtype()))
}

/// The dtypes a model computes in (`with_compute_dtype` of each model).
pub(crate) fn check_compute_dtype(dtype: candle_core::DType) -> crate::Result<()> {
    use candle_core::DType;
    if matches!(dtype, DType::F32 | DType::BF16 | DType::F16 | DType::F64) {
        Ok(())
    } else {
        Err(crate::Error::input(format!(
            "a model computes in f32, bf16, f16 or f64, not {dtype:?}"
        )))
    }
}

/// Whether the fused CPU kernels may take `t`: it is on the CPU and they are
/// not turned off (`TOKENFORMER_KERNELS=none`). Every other tensor takes
/// plain candle ops, the path of every other device.
#[inline]
pub(crate) fn fused_on(t: &candle_core::Tensor) -> bool {
    t.device().is_cpu() && selection().fused
}

/// Whether this CPU's streaming kernels run fastest as dot products with
/// whole weight rows (everything but Intel's), or as weighted sums of rows
/// with software prefetch (Intel), see docs/PERFORMANCE.md. Decides how
/// Pattention lays out f32 weights (half-precision ones always stream as rows).
pub(crate) fn prefers_row_products() -> bool {
    !gemv::is_intel()
}

/// Runs a model's forward over `rows` input rows (tokens × batch): small
/// inputs on a rayon worker, where the kernels' parallel calls fork and join
/// instead of putting the caller to sleep each time; larger ones on the
/// calling thread, whose malloc arena keeps freed activations
/// (docs/PERFORMANCE.md).
pub(crate) fn run_forward<R: Send>(
    device: &candle_core::Device,
    rows: usize,
    forward: impl FnOnce() -> R + Send,
) -> R {
    // A GPU's forward does not use the CPU's workers: nothing to keep awake.
    if device.is_cpu() && rows <= SMALL_ROWS {
        with_workers_awake(forward)
    } else {
        forward()
    }
}

/// How long a worker kept awake by [`with_workers_awake`] waits for work
/// before it goes back to rayon's own idling: longer than the serial stretches
/// between a decode step's parallel kernels, short enough that a stray
/// keeper never holds a thread for long.
const AWAKE_IDLE: std::time::Duration = std::time::Duration::from_millis(1);

/// Runs `f` on a rayon worker while the pool's other workers look for its
/// tasks without sleeping. Between a decode step's ~130 short parallel
/// kernels the main worker runs serial code (norms, Θ, residuals); rayon
/// puts idle workers to sleep after a few tens of µs, and waking one costs
/// about as much again, so a kernel after a longer serial stretch ran on one
/// thread until the other woke (docs/PERFORMANCE.md). Each keeper steals
/// and runs tasks until `f` returns or it has been idle for [`AWAKE_IDLE`],
/// so two forwards sharing the pool cannot hold each other's keepers.
fn with_workers_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    let done = AtomicBool::new(false);
    let done = &done;
    rayon::scope(|s| {
        for _ in 1..rayon::current_num_threads() {
            s.spawn(move |_| {
                let mut idle_since = std::time::Instant::now();
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Executed) {
                        idle_since = std::time::Instant::now();
                    } else if idle_since.elapsed() > AWAKE_IDLE {
                        break;
                    } else {
                        std::hint::spin_loop();
                    }
                }
            });
        }
        let r = f();
        done.store(true, Ordering::Release);
        r
    })
}

/// The contiguous f32 data of a CPU tensor.
fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(d) = s else {
        candle_core::bail!("{what}: f32 only")
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{what}: contiguous input only")
    };
    Ok(&d[a..b])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_honours_supported_requests_and_warns_otherwise() {
        let best = Path::best();
        for unset in [None, Some(""), Some("auto"), Some(" AUTO ")] {
            assert_eq!(select(unset).path, best, "{unset:?}");
            assert_eq!(select(unset).warning, None);
            assert!(select(unset).fused);
        }
        // `none`: no fused kernel at all (the plain ops of other devices).
        let s = select(Some("None"));
        assert_eq!((s.fused, s.warning), (false, None));
        assert!(select(Some("avx3")).fused && select(Some("portable")).fused);
        for isa in Isa::ALL {
            let s = select(Some(isa.as_str()));
            if isa.is_supported() {
                assert_eq!((s.path.isa(), s.warning), (isa, None));
            } else {
                assert_eq!(s.path, best);
                let w = s.warning.expect("a warning for a missing feature");
                assert!(w.contains("lacks") && w.contains(isa.features()[0]), "{w}");
            }
        }
        let s = select(Some("avx3"));
        assert_eq!(s.path, best);
        assert!(s.warning.unwrap().contains("not one of"));
        // Portable is always there, and listed first.
        assert_eq!(Path::all()[0].isa(), Isa::Portable);
    }

    #[test]
    fn the_cuda_kernels_are_off_unless_asked_for() {
        for off in [
            None,
            Some(""),
            Some("0"),
            Some("off"),
            Some("yes please"),
            Some("2"),
        ] {
            assert!(!cuda_kernels_requested(off), "{off:?}");
        }
        for on in [Some("1"), Some(" 1 "), Some("on"), Some("TRUE")] {
            assert!(cuda_kernels_requested(on), "{on:?}");
        }
    }

    #[test]
    fn kept_awake_workers_run_the_tasks_of_concurrent_forwards() {
        use rayon::prelude::*;
        use std::collections::HashSet;
        use std::sync::Mutex;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        // Two callers share the pool, each with its own keeper, serial
        // stretches longer than a keeper's patience between parallel sums:
        // every call returns its own value (no keeper holds the other call).
        let threads = Mutex::new(HashSet::new());
        std::thread::scope(|s| {
            for caller in 0..2u64 {
                let (pool, threads) = (&pool, &threads);
                s.spawn(move || {
                    for round in 0..20u64 {
                        let got = pool.install(|| {
                            with_workers_awake(|| {
                                let mut total = 0;
                                for part in 0..3u64 {
                                    total += (0..20_000usize)
                                        .into_par_iter()
                                        .with_max_len(100)
                                        .map(|i| {
                                            threads
                                                .lock()
                                                .unwrap()
                                                .insert(std::thread::current().id());
                                            i as u64 * (caller + round + part)
                                        })
                                        .sum::<u64>();
                                    if round % 5 == 0 {
                                        std::thread::sleep(2 * AWAKE_IDLE);
                                    }
                                }
                                total
                            })
                        });
                        let want = 19_999 * 20_000 / 2 * (3 * (caller + round) + 3);
                        assert_eq!(got, want, "caller {caller} round {round}");
                    }
                });
            }
        });
        // The sums were split over both of the pool's workers.
        assert_eq!(threads.into_inner().unwrap().len(), 2);
    }
}

/// Deterministic inputs and comparisons shared by the kernels' tests.
#[cfg(test)]
pub(crate) mod test_util {
    use candle_core::{DType, Device, Tensor};

    /// Deterministic values of unit-ish spread (an unseeded randn would make
    /// the tolerances a matter of luck).
    pub(crate) fn spread(shape: impl Into<candle_core::Shape>) -> Tensor {
        let shape = shape.into();
        let v: Vec<f32> = (0..shape.elem_count())
            .map(|i| ((i as f32 * 0.754_877_7).fract() - 0.5) * 3.4)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// softmax(q·kᵀ/√hd)·v for q [b, h, t, hd] over k, v [b, h, keys, hd] in tensor
    /// ops (differentiable: max, exp, sum rather than a fused softmax), causal
    /// counting from the end, as [b, t, h·hd]: the definition the attention
    /// kernels are tested against.
    pub(crate) fn attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
        let (b, h, t, hd) = q.dims4().unwrap();
        let keys = k.dim(2).unwrap();
        let q = q.contiguous().unwrap();
        let s = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| {
                (0..keys).map(move |j| {
                    if causal && j > keys - t + i {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, keys), q.device())
            .unwrap()
            .to_dtype(s.dtype())
            .unwrap();
        let s = s.broadcast_add(&mask).unwrap();
        let e = s
            .broadcast_sub(&s.max_keepdim(candle_core::D::Minus1).unwrap())
            .unwrap()
            .exp()
            .unwrap();
        let p = e
            .broadcast_div(&e.sum_keepdim(candle_core::D::Minus1).unwrap())
            .unwrap();
        p.matmul(&v.contiguous().unwrap())
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, t, h * hd))
            .unwrap()
    }

    pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
        d.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// The largest |element| of `t`, in f64: a size to scale a tolerance by.
    pub(crate) fn max_abs(t: &Tensor) -> f64 {
        max_abs_diff(t, &t.zeros_like().unwrap())
    }

    /// One rounding of a half type, relative: 2⁻⁷ for bf16, 2⁻¹⁰ for f16.
    pub(crate) fn half_ulp(dtype: DType) -> f64 {
        if dtype == DType::BF16 {
            1.0 / 128.0
        } else {
            1.0 / 1024.0
        }
    }

    /// Every element of `got` within `tol(w)` of `want`'s element w.
    pub(crate) fn assert_close(got: &Tensor, want: &Tensor, tol: impl Fn(f64) -> f64, what: &str) {
        let (g, w) = (f64s(got), f64s(want));
        assert_eq!(g.len(), w.len(), "{what}: sizes");
        for (a, b) in g.iter().zip(&w) {
            assert!((a - b).abs() <= tol(*b), "{what}: {a} vs {b}");
        }
    }

    /// Every element, widened to f64 (exact from any float dtype).
    pub(crate) fn f64s(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// The f32 bits of every element (half-precision ones widened, exactly).
    pub(crate) fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }
}
