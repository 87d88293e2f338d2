//! Fused CPU kernels for the hot loops that candle would otherwise run as
//! several single-threaded passes or copies: Θ (normalise + GELU over the
//! token-parameter scores), softmax, rotary embeddings, token-token attention
//! ([`attention`]), and the matrix-vector products of decoding (f32 or f16
//! weights, [`half_kernels`]). They are row-parallel with rayon, compiled
//! for AVX2/AVX-512 and chosen at run time, and fall back to plain tensor ops
//! for other devices, dtypes or layouts, so results never depend on the path.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::pattention::{self, Activation};

mod attention;
pub use attention::attention;

/// erf(x) for f32 as a clamped odd rational function (max abs error ≈ 3e-7
/// on all of R, checked in the tests), branch-free so it vectorises. Plain
/// `*`/`+` on purpose: without a target FMA, `mul_add` is a libm call.
#[inline(always)]
pub fn erf_f32(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = -2.726_142_3e-10_f32;
    p = p * x2 + 2.770_681_4e-8;
    p = p * x2 + -2.101_024e-6;
    p = p * x2 + -5.692_506_4e-5;
    p = p * x2 + -7.349_906_3e-4;
    p = p * x2 + -2.954_600_3e-3;
    p = p * x2 + -1.609_603_3e-2;
    let mut q = -1.456_607_2e-5_f32;
    q = q * x2 + -2.133_740_6e-4;
    q = q * x2 + -1.682_827e-3;
    q = q * x2 + -7.373_329e-3;
    q = q * x2 + -1.426_474e-2;
    x * p / q
}

/// eˣ for f32 (Cephes' `expf` reduction and polynomial, ≈1 ulp), branch-free
/// so softmax rows vectorise instead of calling libm per element. Inputs are
/// clamped to [−87, 88]: below, the result is ~1e-38 rather than 0.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round x·log2(e) to the nearest integer n with the 1.5·2²³ trick: the
    // sum's low mantissa bits then hold n itself, so 2ⁿ is built with integer
    // ops on those bits (a float→int cast would not vectorise).
    let shifted = x * std::f32::consts::LOG2_E + 12_582_912.0;
    let n = shifted - 12_582_912.0;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(shifted.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23)
}

/// Exact (erf) GELU.
#[inline(always)]
pub fn gelu_erf_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// Σ x² with 8 independent accumulators (vectorises, and is more accurate
/// than one running sum).
#[inline(always)]
fn sum_sq(row: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            acc[k] += c[k] * c[k];
        }
    }
    acc.iter().sum::<f32>() + tail.iter().map(|v| v * v).sum::<f32>()
}

/// Θ of one score row, in place.
#[inline(always)]
fn theta_row_generic(row: &mut [f32], activation: Activation, n: f32) {
    const MIN_NORM: f32 = 1e-30;
    match activation {
        Activation::L2NormGelu => {
            let f = n.sqrt() / sum_sq(row).sqrt().max(MIN_NORM);
            row.iter_mut().for_each(|v| *v = gelu_erf_f32(*v * f));
        }
        Activation::GeluL2Norm => {
            row.iter_mut().for_each(|v| *v = gelu_erf_f32(*v));
            let f = n.sqrt() / sum_sq(row).sqrt().max(MIN_NORM);
            row.iter_mut().for_each(|v| *v *= f);
        }
        Activation::Softmax => {
            softmax_row_generic(row, row.len());
            row.iter_mut().for_each(|v| *v *= n);
        }
    }
}

/// The largest value, with 16 running maxima so it vectorises (a fold over
/// `f32::max` is a serial chain of NaN-aware compares).
#[inline(always)]
fn max_of(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..16 {
            acc[k] = if c[k] > acc[k] { c[k] } else { acc[k] };
        }
    }
    tail.iter()
        .chain(&acc)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

#[inline(always)]
fn max_and_exp_sum_generic(row: &[f32]) -> (f32, f64) {
    let max = max_of(row);
    let whole = row.len() / 16 * 16;
    let mut sum = 0f64;
    // f32 lanes, flushed to f64 every 4096 values to keep the sum exact enough
    // for a vocabulary-sized row.
    for block in row[..whole].chunks(4096) {
        let mut acc = [0f32; 16];
        for c in block.chunks_exact(16) {
            for k in 0..16 {
                acc[k] += exp_f32(c[k] - max);
            }
        }
        sum += acc.iter().map(|&v| v as f64).sum::<f64>();
    }
    sum += row[whole..]
        .iter()
        .map(|&v| exp_f32(v - max) as f64)
        .sum::<f64>();
    (max, sum)
}

/// In-place softmax of `row[..valid]`; entries from `valid` on become 0
/// (the causal mask).
#[inline(always)]
fn softmax_row_generic(row: &mut [f32], valid: usize) {
    let (live, masked) = row.split_at_mut(valid);
    let max = max_of(live);
    let mut acc = [0f32; 16];
    let mut chunks = live.chunks_exact_mut(16);
    for c in &mut chunks {
        for k in 0..16 {
            c[k] = exp_f32(c[k] - max);
            acc[k] += c[k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp_f32(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    live.iter_mut().for_each(|v| *v *= inv);
    masked.fill(0.0);
}

#[inline(always)]
fn axpy_generic(a: f32, x: &[f32], y: &mut [f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// The same loops compiled for AVX2+FMA / AVX-512 and chosen at run time: the
/// default x86-64 target only has SSE2, which halves these bandwidth- and
/// erf-bound loops. The bodies are the generic ones, so results do not depend
/// on the CPU beyond float rounding.
macro_rules! dispatch {
    ($($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $generic:ident;)*) => {$(
        $(#[$doc])*
        #[inline]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? { $generic($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? { $generic($($arg),*) }
                if is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: as above.
                    return unsafe { v3($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    )*};
}

dispatch! {
    fn dot(a: &[f32], b: &[f32]) -> f32 = dot_generic;
    fn axpy(a: f32, x: &[f32], y: &mut [f32]) = axpy_generic;
    fn theta_row(row: &mut [f32], activation: Activation, n: f32) = theta_row_generic;
    fn softmax_row(row: &mut [f32], valid: usize) = softmax_row_generic;
    /// The row's maximum and Σ exp(v − max): a log-softmax's two reductions,
    /// vectorised (the output layer's rows are vocabulary-sized).
    pub fn max_and_exp_sum(row: &[f32]) -> (f32, f64) = max_and_exp_sum_generic;
    /// Σ a, vectorised: the streaming read the benchmark measures bandwidth with.
    pub fn sum(a: &[f32]) -> f32 = sum_generic;
}

struct ThetaOp {
    activation: Activation,
    scale_tokens: usize,
}

impl ThetaOp {
    fn apply(&self, rows: &mut [f32], n: usize) {
        let scale = self.scale_tokens as f32;
        rows.par_chunks_mut(n)
            .for_each(|r| theta_row(r, self.activation, scale));
    }
}

impl candle_core::InplaceOp1 for ThetaOp {
    fn name(&self) -> &'static str {
        "pattention-theta-in-place"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let n = layout.dims().last().copied().unwrap_or(1).max(1);
        let (CpuStorage::F32(d), Some((a, b))) = (storage, layout.contiguous_offsets()) else {
            candle_core::bail!("theta kernel: contiguous f32 only")
        };
        self.apply(&mut d[a..b], n);
        Ok(())
    }
}

fn fused_ok(scores: &Tensor) -> bool {
    scores.device().is_cpu() && scores.dtype() == DType::F32 && scores.is_contiguous()
}

/// Θ over the last axis of scores nobody else holds (a fresh matmul
/// output): the fused kernel works in the scores' own buffer for contiguous
/// f32 CPU tensors, saving a scores-sized allocation.
pub fn theta_owned(scores: Tensor, activation: Activation, scale_tokens: usize) -> Result<Tensor> {
    if fused_ok(&scores) {
        scores.inplace_op1(&ThetaOp {
            activation,
            scale_tokens,
        })?;
        Ok(scores)
    } else {
        pattention::theta(&scores, activation, scale_tokens)
    }
}

/// Softmax over the last axis of scores [.., t, total] where query i (of the
/// last t) may see keys 0..=past+i, past = total − t; masked entries are 0.
/// Plain tensor ops: the path of devices and dtypes the fused attention
/// kernel does not take.
pub fn causal_softmax(scores: &Tensor) -> Result<Tensor> {
    let dims = scores.dims();
    let (t, total) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let past = total - t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..total).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, total), scores.device())?.to_dtype(scores.dtype())?;
    candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)
}

/// GPT-NeoX rotary embedding (rotate-half) of the first `dims` features of
/// every head, x [b, t, h, hd] contiguous, cos/sin [t, dims/2].
struct Rotary {
    dims: usize,
}

impl candle_core::CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        "rotary"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
        ss: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(sx, lx, "rotary")?;
        let (cos, sin) = (f32_slice(sc, lc, "rotary")?, f32_slice(ss, ls, "rotary")?);
        let (_, t, h, hd) = lx.shape().dims4()?;
        let half = self.dims / 2;
        let mut out = x.to_vec();
        // One task per position: all its heads share a row of cos/sin.
        out.par_chunks_mut(h * hd).enumerate().for_each(|(row, o)| {
            let pos = row % t;
            let (c, s) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
            for head in o.chunks_mut(hd) {
                let (x1, x2) = head[..self.dims].split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    x1[i] = a * c[i] - b * s[i];
                    x2[i] = b * c[i] + a * s[i];
                }
            }
        });
        Ok((CpuStorage::F32(out), lx.shape().clone()))
    }
}

/// Rotary positions for x [b, t, h, hd] (contiguous f32 on the CPU) with
/// the cos/sin rows [t, dims/2] of its positions.
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor, dims: usize) -> Result<Tensor> {
    x.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &Rotary { dims })
}

/// Rows at or below which the matrix-vector kernels beat a packed gemm:
/// decoding is bound by reading the weights once, and gemm would first copy
/// (pack) them.
pub const SMALL_ROWS: usize = 8;

#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..16 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + ta.iter().zip(tb).map(|(x, y)| x * y).sum::<f32>()
}

fn sum_generic(a: &[f32]) -> f32 {
    // Four vectors of partial sums, so the adds' latency never limits the read.
    let mut acc = [0f32; 64];
    let c = a.chunks_exact(64);
    let tail = c.remainder();
    for x in c {
        for k in 0..64 {
            acc[k] += x[k];
        }
    }
    acc.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(d) = s else {
        candle_core::bail!("{what}: f32 only")
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{what}: contiguous input only")
    };
    Ok(&d[a..b])
}

mod half_kernels;

/// A weight matrix in its stored precision. Half-precision rows are widened
/// to f32 just before use, so the arithmetic is f32 either way and decoding
/// reads half the bytes.
enum Weights<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
}

impl<'a> Weights<'a> {
    fn of(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<Self> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("{what}: contiguous weights only")
        };
        match s {
            CpuStorage::F32(d) => Ok(Self::F32(&d[a..b])),
            CpuStorage::F16(d) => Ok(Self::F16(&d[a..b])),
            _ => candle_core::bail!("{what}: f32 or f16 weights only"),
        }
    }

    /// x · (row j of width k).
    #[inline]
    fn dot(&self, j: usize, k: usize, x: &[f32]) -> f32 {
        match self {
            Self::F32(w) => dot(x, &w[j * k..(j + 1) * k]),
            Self::F16(w) => half_kernels::dot(x, &w[j * k..(j + 1) * k]),
        }
    }

    /// Bytes in a row of width k.
    fn row_bytes(&self, k: usize) -> usize {
        match self {
            Self::F32(_) => 4 * k,
            Self::F16(_) => 2 * k,
        }
    }

    /// How many rows ahead of the one in use to prefetch: [`PREFETCH_BYTES`]
    /// worth, at least one.
    fn rows_ahead(&self, k: usize) -> usize {
        PREFETCH_BYTES.div_ceil(self.row_bytes(k).max(1))
    }

    /// Asks for row j, if there is one, to be brought into L1.
    #[inline]
    fn prefetch(&self, j: usize, k: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let rows = j * k..(j + 1) * k;
            let start = match self {
                Self::F32(w) => w.get(rows).map(|r| r.as_ptr().cast::<i8>()),
                Self::F16(w) => w.get(rows).map(|r| r.as_ptr().cast::<i8>()),
            };
            let Some(start) = start else { return };
            for off in (0..self.row_bytes(k)).step_by(64) {
                // SAFETY: the address is inside the row (and a prefetch is
                // only a hint that never faults).
                unsafe { _mm_prefetch::<_MM_HINT_T0>(start.add(off)) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (j, k);
    }

    /// y += a · (row j of width k).
    #[inline]
    fn axpy(&self, j: usize, k: usize, a: f32, y: &mut [f32]) {
        match self {
            Self::F32(w) => axpy(a, &w[j * k..(j + 1) * k], y),
            Self::F16(w) => half_kernels::axpy(a, &w[j * k..(j + 1) * k], y),
        }
    }
}

/// The matrix products of decoding, where the weights are read once and not
/// packed: `x · wᵀ` when `transposed` (w [n, k], dot products with weight
/// rows), else `x · w` (w [n, k], weighted sums of weight rows).
struct SmallMatmul {
    transposed: bool,
}

impl candle_core::CustomOp2 for SmallMatmul {
    fn name(&self) -> &'static str {
        "matmul-small"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "matmul-small")?;
        let w = Weights::of(s2, l2, "matmul-small")?;
        let (m, _) = l1.shape().dims2()?;
        let (n, k) = l2.shape().dims2()?;
        Ok(if self.transposed {
            (
                CpuStorage::F32(matmul_nt_rows(x, &w, m, n, k)),
                Shape::from((m, n)),
            )
        } else {
            (
                CpuStorage::F32(matmul_nn_rows(x, &w, m, n, k)),
                Shape::from((m, k)),
            )
        })
    }
}

/// How far ahead the streaming kernels prefetch weights. The hardware
/// prefetcher alone left them 10-15 % under the bandwidth of PyTorch's gemv on
/// the benchmark machine (768² f32 blocks, median of 12 interleaved runs:
/// 10.0 → 11.5 GB/s; one 600 MB matrix: 10.7 → 12.4); 3-12 rows ahead all
/// gained about the same.
const PREFETCH_BYTES: usize = 12 << 10;

/// x [m, k] · wᵀ: each task owns whole weight rows, so the result is built
/// transposed ([n, m]) and turned around at the end.
fn matmul_nt_rows(x: &[f32], w: &Weights, m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut t = vec![0f32; n * m];
    let ahead = w.rows_ahead(k);
    t.par_chunks_mut(m * 64).enumerate().for_each(|(c, out)| {
        for (r, o) in out.chunks_mut(m).enumerate() {
            let j = c * 64 + r;
            w.prefetch(j + ahead, k);
            for (i, oi) in o.iter_mut().enumerate() {
                *oi = w.dot(j, k, &x[i * k..(i + 1) * k]);
            }
        }
    });
    let mut out = vec![0f32; m * n];
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = t[j * m + i];
        }
    }
    out
}

/// x [m, n] · w: split over threads by blocks of weight rows, each with its
/// own partial sums, added up at the end.
fn matmul_nn_rows(x: &[f32], w: &Weights, m: usize, n: usize, k: usize) -> Vec<f32> {
    // About four blocks per thread: 768 rows in blocks of 256 left one of
    // two threads idle a third of the time.
    let block = n.div_ceil(4 * rayon::current_num_threads()).max(32);
    let ahead = w.rows_ahead(k);
    (0..n.div_ceil(block))
        .into_par_iter()
        .map(|b| {
            let mut acc = vec![0f32; m * k];
            let end = ((b + 1) * block).min(n);
            for j in b * block..end {
                if j + ahead < end {
                    w.prefetch(j + ahead, k);
                }
                for i in 0..m {
                    let a = x[i * n + j];
                    if a != 0.0 {
                        w.axpy(j, k, a, &mut acc[i * k..(i + 1) * k]);
                    }
                }
            }
            acc
        })
        .reduce(
            || vec![0f32; m * k],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                a
            },
        )
}

fn small_ok(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && x.dtype() == DType::F32
        && matches!(w.dtype(), DType::F32 | DType::F16)
        && x.is_contiguous()
        && w.is_contiguous()
        && x.rank() == 2
        && x.dim(0).is_ok_and(|m| m <= SMALL_ROWS)
}

fn gemm_ok(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && x.dtype() == DType::F32
        && matches!(w.dtype(), DType::F32 | DType::F16)
        && x.is_contiguous()
        && w.is_contiguous()
        && x.rank() >= 1
        && w.rank() == 2
}

/// The compute-bound products (prefill, evaluation, images): x [.., k] times
/// w [k, n], or wᵀ for w [n, k] when `transposed`, by gemm straight into an
/// uninitialised output. candle's matmul zero-fills its output first, a whole
/// extra pass over a buffer gemm then overwrites (~2 % of a 2048-token prefill).
struct Gemm {
    transposed: bool,
}

impl candle_core::CustomOp2 for Gemm {
    fn name(&self) -> &'static str {
        "gemm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "gemm")?;
        let w = f32_slice(s2, l2, "gemm")?;
        let (r, c) = l2.shape().dims2()?;
        let (k, n) = if self.transposed { (c, r) } else { (r, c) };
        let mut dims = l1.shape().dims().to_vec();
        if dims.last() != Some(&k) {
            candle_core::bail!(
                "gemm: shapes {:?} and {:?}{} do not multiply",
                l1.shape(),
                l2.shape(),
                if self.transposed { "ᵀ" } else { "" }
            )
        }
        let m = dims[..dims.len() - 1].iter().product::<usize>();
        *dims.last_mut().expect("rank ≥ 1") = n;
        if m * n * k == 0 {
            return Ok((CpuStorage::F32(vec![0.0; m * n]), Shape::from(dims)));
        }
        // w's element (row kk, column j) of the product's right-hand side.
        let (rhs_rs, rhs_cs) = if self.transposed { (1, k) } else { (n, 1) };
        let threads = candle_core::utils::get_num_threads();
        let parallelism = if threads > 1 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        let mut out = Vec::<f32>::with_capacity(m * n);
        // SAFETY: x holds m·k and w k·n elements (shapes checked above) and
        // `out` has room for m·n; with read_dst false gemm writes every
        // element of dst before reading it, so the length can be set after.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                rhs_cs as isize,
                rhs_rs as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
            out.set_len(m * n);
        }
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}

/// Half-precision weights widened for gemm (compute-bound there, so the
/// one-off conversion costs little next to the product).
fn as_f32(w: &Tensor) -> Result<Tensor> {
    w.to_dtype(DType::F32)
}

/// x [m, k] · wᵀ (w [n, k], f32 or f16); the streaming kernel for few rows,
/// gemm otherwise. The result is f32.
pub fn matmul_nt(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if small_ok(x, w) {
        x.apply_op2_no_bwd(w, &SmallMatmul { transposed: true })
    } else if gemm_ok(x, w) {
        x.apply_op2_no_bwd(&as_f32(w)?, &Gemm { transposed: true })
    } else {
        x.matmul(&as_f32(w)?.t()?)
    }
}

/// x [m, n] · w (w [n, k], f32 or f16); the streaming kernel for few rows,
/// gemm otherwise. The result is f32.
pub fn matmul_nn(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if small_ok(x, w) {
        x.apply_op2_no_bwd(w, &SmallMatmul { transposed: false })
    } else if gemm_ok(x, w) {
        x.apply_op2_no_bwd(&as_f32(w)?, &Gemm { transposed: false })
    } else {
        x.matmul(&as_f32(w)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// erf by its Taylor series in f64 (accurate to ~1e-9 for |x| ≤ 4.5) and 1 beyond.
    fn erf_ref(x: f64) -> f64 {
        if x.abs() > 4.5 {
            return x.signum();
        }
        let (mut term, mut sum, mut n) = (x, x, 0.0);
        while term.abs() > 1e-17 {
            n += 1.0;
            term *= -x * x / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    /// Deterministic values of unit-ish spread (an unseeded randn would make
    /// the tolerances below a matter of luck).
    fn spread(shape: impl Into<candle_core::Shape>) -> Tensor {
        let shape = shape.into();
        let v: Vec<f32> = (0..shape.elem_count())
            .map(|i| ((i as f32 * 0.754_877_7).fract() - 0.5) * 3.4)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn erf_is_accurate() {
        let mut worst = 0f64;
        for i in -6000..=6000 {
            let x = i as f64 / 1000.0;
            worst = worst.max((erf_f32(x as f32) as f64 - erf_ref(x)).abs());
        }
        assert!(worst < 5e-7, "max |erf error| {worst}");
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        for i in -87_000..=88_000 {
            let x = i as f64 / 1000.0;
            let e = (x as f32) as f64;
            worst = worst.max((exp_f32(x as f32) as f64 / e.exp() - 1.0).abs());
        }
        assert!(worst < 3e-7, "max relative exp error {worst}");
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
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

    /// The fused kernel against plain f64 tensor ops: several query blocks,
    /// cached keys before the queries, and q/k/v as head-transposed views.
    #[test]
    fn fused_attention_equals_reference() {
        let (b, h, t, past, hd) = (2, 3, 300, 20, 16);
        let heads = |rows: usize, salt: f32| {
            (spread((b, rows, h, hd)) + salt as f64)
                .unwrap()
                .transpose(1, 2)
                .unwrap()
        };
        let q = heads(t, 0.1);
        let (k, v) = (heads(past + t, -0.2), heads(past + t, 0.3));
        assert!(!q.is_contiguous());
        for causal in [true, false] {
            let got = attention(&q, &k, &v, causal).unwrap();
            let f = |x: &Tensor| x.to_dtype(DType::F64).unwrap().contiguous().unwrap();
            let scores = (f(&q).matmul(&f(&k).t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
            let mask: Vec<f64> = (0..t)
                .flat_map(|i| {
                    (0..past + t).map(move |j| {
                        if causal && j > past + i {
                            f64::NEG_INFINITY
                        } else {
                            0.0
                        }
                    })
                })
                .collect();
            let mask = Tensor::from_vec(mask, (t, past + t), &Device::Cpu).unwrap();
            let p =
                candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask).unwrap()).unwrap();
            let want = p
                .matmul(&f(&v))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .reshape((b, t, h * hd))
                .unwrap();
            let d = max_abs_diff(&got, &want);
            assert!(d < 1e-5, "causal={causal}: {d}");
        }
    }

    #[test]
    fn small_row_matmuls_equal_gemm() {
        for m in [1, 3, 8] {
            let x = spread((m, 77));
            let w = spread((300, 77));
            let a = matmul_nt(&x, &w).unwrap();
            let b = x.matmul(&w.t().unwrap().contiguous().unwrap()).unwrap();
            let d = max_abs_diff(&a, &b);
            assert!(d < 1e-4, "nt m={m}: {d}");
            let s = spread((m, 300));
            let a = matmul_nn(&s, &w).unwrap();
            let b = s.matmul(&w).unwrap();
            assert_eq!(a.dims(), &[m, 77]);
            let d = max_abs_diff(&a, &b);
            assert!(d < 1e-4, "nn m={m}: {d}");
        }
    }

    #[test]
    fn large_matmuls_equal_candle_bit_for_bit() {
        // Past SMALL_ROWS the products go to gemm with the strides candle's
        // matmul uses, so the results are the same to the bit; x may carry
        // batch axes, and f16 weights are widened first.
        for rows in [9, 300] {
            let x = spread((3, rows, 77));
            let w = spread((130, 77));
            let flat = x.reshape((3 * rows, 77)).unwrap();
            let want = flat
                .matmul(&w.t().unwrap())
                .unwrap()
                .reshape((3, rows, 130));
            assert_eq!(bits(&matmul_nt(&x, &w).unwrap()), bits(&want.unwrap()));
            let v = spread((77, 130));
            let want = flat.matmul(&v).unwrap().reshape((3, rows, 130)).unwrap();
            assert_eq!(bits(&matmul_nn(&x, &v).unwrap()), bits(&want));
            let half = v.to_dtype(DType::F16).unwrap();
            let wide = half.to_dtype(DType::F32).unwrap();
            let want = flat.matmul(&wide).unwrap().reshape((3, rows, 130)).unwrap();
            assert_eq!(bits(&matmul_nn(&x, &half).unwrap()), bits(&want));
        }
        let err = matmul_nn(&spread((20, 5)), &spread((6, 4))).unwrap_err();
        assert!(err.to_string().contains("do not multiply"), "{err}");
        let empty = matmul_nn(&spread((20, 0)), &spread((0, 4))).unwrap();
        assert_eq!(empty.to_vec2::<f32>().unwrap(), vec![vec![0f32; 4]; 20]);
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn fused_kernels_equal_tensor_ops() {
        let dev = Device::Cpu;
        let s = (spread((37, 53)) * 3.0).unwrap();
        for act in [
            Activation::L2NormGelu,
            Activation::GeluL2Norm,
            Activation::Softmax,
        ] {
            let a = theta_owned(s.copy().unwrap(), act, 40).unwrap();
            let b = pattention::theta(&s, act, 40).unwrap();
            let d = max_abs_diff(&a, &b);
            assert!(d < 1e-5, "{act:?}: {d}");
        }
        // An all-zero row gives zeros, not NaN.
        let z = theta_owned(
            Tensor::zeros((2, 8), candle_core::DType::F32, &dev).unwrap(),
            Activation::L2NormGelu,
            8,
        )
        .unwrap();
        assert_eq!(
            z.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0.0; 16]
        );

        let sc = spread((2, 3, 5, 9));
        let a = causal_softmax(&sc).unwrap();
        let b = causal_softmax(
            &sc.t()
                .unwrap()
                .t()
                .unwrap()
                .broadcast_add(&Tensor::zeros(1, candle_core::DType::F32, &dev).unwrap())
                .unwrap()
                .to_dtype(candle_core::DType::F64)
                .unwrap(),
        )
        .unwrap();
        let d: f64 = (a.to_dtype(candle_core::DType::F64).unwrap() - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap();
        assert!(d < 1e-6, "causal softmax {d}");
        // Row 0 of a 5-query block after 4 cached keys sees exactly 5 keys.
        let row: Vec<f32> = a
            .get(0)
            .unwrap()
            .get(0)
            .unwrap()
            .get(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(row[..5].iter().all(|&p| p > 0.0) && row[5..].iter().all(|&p| p == 0.0));
    }

    #[test]
    fn sum_matches_f64_sum() {
        // Lengths around the 64-wide chunks, so the tail is exercised too.
        for n in [0, 1, 63, 64, 65, 1000, 4099] {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 8.0)
                .collect();
            let want: f64 = v.iter().map(|&x| x as f64).sum();
            assert!((sum(&v) as f64 - want).abs() < 1e-3, "n={n}");
        }
    }
}
