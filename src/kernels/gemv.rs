//! The matrix products of decoding (a few rows against a weight matrix):
//! f32, f16 ([`super::half`]) or 8-bit ([`super::q8`]) weights streamed once
//! from memory instead of being packed as gemm would on every call.

use candle_core::{CpuStorage, Layout, Result, Shape};
use rayon::prelude::*;

use super::q8::Q8Matrix;
use super::rows::{axpy_on, dot_on};
use super::{f32_slice, half, q8, Path};

/// A weight matrix [n, k] in its stored precision. Narrow rows are widened
/// to f32 in registers, so the arithmetic is f32 either way and decoding
/// reads fewer bytes.
enum Weights<'a> {
    F32(&'a [f32]),
    F16(&'a [::half::f16]),
    BF16(&'a [::half::bf16]),
    /// int8 values and one scale per block of a row ([`q8::BLOCK`]), taken
    /// with x quantised alike ([`Rows::Q8`]).
    Q8(&'a [i8], &'a [f32]),
}

/// The rows of x [m, k] as the weights take them: f32, or for 8-bit
/// weights quantised per block ([`q8::quantize_row`]).
enum Rows<'a> {
    F32(&'a [f32]),
    Q8(&'a [i8], &'a [f32]),
}

impl Rows<'_> {
    /// Row i of width k.
    fn row(&self, i: usize, k: usize) -> Rows<'_> {
        match self {
            Self::F32(x) => Rows::F32(&x[i * k..(i + 1) * k]),
            Self::Q8(q, s) => {
                let b = k.div_ceil(q8::BLOCK);
                Rows::Q8(&q[i * k..(i + 1) * k], &s[i * b..(i + 1) * b])
            }
        }
    }
}

impl<'a> Weights<'a> {
    fn of(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<Self> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("{what}: contiguous weights only")
        };
        match s {
            CpuStorage::F32(d) => Ok(Self::F32(&d[a..b])),
            CpuStorage::F16(d) => Ok(Self::F16(&d[a..b])),
            CpuStorage::BF16(d) => Ok(Self::BF16(&d[a..b])),
            _ => candle_core::bail!("{what}: f32, f16 or bf16 weights only"),
        }
    }

    /// x · (row j of width k), x one row of the kind the weights take.
    #[inline]
    fn dot(&self, path: Path, j: usize, k: usize, x: &Rows) -> f32 {
        match (self, x) {
            (Self::F32(w), Rows::F32(x)) => dot_on(path, x, &w[j * k..(j + 1) * k]),
            (Self::F16(w), Rows::F32(x)) => half::dot_on(path, x, &w[j * k..(j + 1) * k]),
            (Self::BF16(w), Rows::F32(x)) => half::dot_on(path, x, &w[j * k..(j + 1) * k]),
            (Self::Q8(q, s), Rows::Q8(xq, xs)) => {
                let b = k.div_ceil(q8::BLOCK);
                q8::dot_on(path, xq, xs, &q[j * k..(j + 1) * k], &s[j * b..(j + 1) * b])
            }
            _ => unreachable!("x is quantised exactly when the weights are"),
        }
    }

    /// out[r] = x · (row j + r of width k), for every r of out.
    #[inline]
    fn dot_rows(&self, path: Path, j: usize, k: usize, x: &Rows, out: &mut [f32]) {
        let rows = j * k..(j + out.len()) * k;
        match (self, x) {
            (Self::F32(w), Rows::F32(x)) => {
                super::rows::dot_rows_on(path, x, &w[rows], k, 1.0, out)
            }
            (Self::F16(w), Rows::F32(x)) => half::dot_rows_on(path, x, &w[rows], out),
            (Self::BF16(w), Rows::F32(x)) => half::dot_rows_on(path, x, &w[rows], out),
            (Self::Q8(q, s), Rows::Q8(xq, xs)) => {
                let b = k.div_ceil(q8::BLOCK);
                let scales = &s[j * b..(j + out.len()) * b];
                q8::dot_rows_on(path, xq, xs, &q[rows], scales, out)
            }
            _ => unreachable!("x is quantised exactly when the weights are"),
        }
    }

    /// Bytes of a row of width k in the main array (values; q8's scales
    /// are an eighth of that on top, prefetched with them).
    fn row_bytes(&self, k: usize) -> usize {
        match self {
            Self::F32(_) => 4 * k,
            Self::F16(_) | Self::BF16(_) => 2 * k,
            Self::Q8(..) => k,
        }
    }

    /// How many rows ahead of the one in use to prefetch: [`PREFETCH_BYTES`]
    /// worth, at least one.
    fn rows_ahead(&self, k: usize) -> usize {
        PREFETCH_BYTES.div_ceil(self.row_bytes(k).max(1))
    }

    /// Asks for row j, if there is one, to be brought into L2 (on CPUs
    /// where that helps, see [`software_prefetch`]).
    #[inline]
    fn prefetch(&self, j: usize, k: usize) {
        #[cfg(target_arch = "x86_64")]
        if software_prefetch() {
            let rows = j * k..(j + 1) * k;
            let start = match self {
                Self::F32(w) => w.get(rows).map(|r| r.as_ptr().cast::<i8>()),
                Self::F16(w) => w.get(rows).map(|r| r.as_ptr().cast::<i8>()),
                Self::BF16(w) => w.get(rows).map(|r| r.as_ptr().cast::<i8>()),
                Self::Q8(q, s) => {
                    let b = k.div_ceil(q8::BLOCK);
                    if let Some(r) = s.get(j * b..(j + 1) * b) {
                        prefetch_bytes(r.as_ptr().cast(), 4 * b);
                    }
                    q.get(rows).map(|r| r.as_ptr())
                }
            };
            if let Some(start) = start {
                prefetch_bytes(start, self.row_bytes(k));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (j, k);
    }

    /// y += Σ_r a[r] · (row j + r of width k), each element's terms added
    /// in row order: [`Self::axpy`] row by row (the same bits), with y read
    /// and written once per group instead of once per row.
    #[inline]
    fn axpy_rows(&self, path: Path, j: usize, k: usize, a: &[f32], y: &mut [f32]) {
        let rows = j * k..(j + a.len()) * k;
        match self {
            Self::F32(w) => super::rows::axpy_rows_on(path, a, &w[rows], k, y),
            Self::F16(w) => half::axpy_rows_on(path, a, &w[rows], k, y),
            Self::BF16(w) => half::axpy_rows_on(path, a, &w[rows], k, y),
            Self::Q8(..) => unreachable!("8-bit weights are only multiplied transposed"),
        }
    }

    /// How many rows one-row weighted sums take per pass over y: for f16,
    /// y's loads and stores per weight byte are twice f32's, and four rows
    /// a pass made f16 decode faster on the Xeon (f32's was unchanged;
    /// docs/PERFORMANCE.md).
    fn rows_per_axpy(&self) -> usize {
        match self {
            Self::F16(_) | Self::BF16(_) => 4,
            _ => 1,
        }
    }

    /// y += a · (row j of width k).
    #[inline]
    fn axpy(&self, path: Path, j: usize, k: usize, a: f32, y: &mut [f32]) {
        match self {
            Self::F32(w) => axpy_on(path, a, &w[j * k..(j + 1) * k], y),
            Self::F16(w) => half::axpy_on(path, a, &w[j * k..(j + 1) * k], y),
            Self::BF16(w) => half::axpy_on(path, a, &w[j * k..(j + 1) * k], y),
            Self::Q8(..) => unreachable!("8-bit weights are only multiplied transposed"),
        }
    }
}

/// Whether the streaming kernels prefetch weights in software: on Intel
/// only, since on AMD's Zen the hardware prefetchers keep up and the extra
/// instructions compete with the loads (docs/PERFORMANCE.md).
fn software_prefetch() -> bool {
    is_intel()
}

/// Whether the CPU is Intel's (cpuid vendor string).
pub(super) fn is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *INTEL.get_or_init(|| {
            // SAFETY: cpuid leaf 0 exists on every x86-64 CPU.
            #[allow(unused_unsafe)]
            let id = unsafe { std::arch::x86_64::__cpuid(0) };
            let vendor: Vec<u8> = [id.ebx, id.edx, id.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .collect();
            vendor == b"GenuineIntel"
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Prefetches the `len` bytes from `start` (inside one allocation) into L2:
/// into L1 (T0) the output layer's product ran ~20 % slower with f16 weights
/// and ~4 % with f32 (docs/PERFORMANCE.md).
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_bytes(start: *const i8, len: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    for off in (0..len).step_by(64) {
        // SAFETY: the address is inside the caller's slice (and a prefetch
        // is only a hint that never faults).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(start.add(off)) };
    }
}

/// The matrix products of decoding, where the weights are read once and not
/// packed: `x · wᵀ` when `transposed` (w [n, k], dot products with weight
/// rows), else `x · w` (w [n, k], weighted sums of weight rows).
pub(super) struct SmallMatmul {
    pub(super) transposed: bool,
    pub(super) path: Path,
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
                CpuStorage::F32(matmul_nt_rows(self.path, &Rows::F32(x), &w, m, n, k)),
                Shape::from((m, n)),
            )
        } else {
            (
                CpuStorage::F32(matmul_nn_rows(self.path, x, &w, m, n, k)),
                Shape::from((m, k)),
            )
        })
    }
}

/// `x · wᵀ` for 8-bit weights w [n, k] and a few rows x [m, k].
pub(super) struct SmallMatmulQ8<'a> {
    pub(super) w: &'a Q8Matrix,
    pub(super) path: Path,
}

impl candle_core::CustomOp1 for SmallMatmulQ8<'_> {
    fn name(&self) -> &'static str {
        "matmul-small-q8"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s, l, "matmul-small-q8")?;
        let (m, k) = l.shape().dims2()?;
        let (n, wk) = self.w.dims();
        if k != wk {
            candle_core::bail!(
                "matmul-small-q8: x [{m}, {k}] and wᵀ of [{n}, {wk}] do not multiply"
            )
        }
        let (q, s) = self.w.data();
        let (xq, xs) = q8::quantize_rows(self.path, x, m, k);
        let out = matmul_nt_rows(self.path, &Rows::Q8(&xq, &xs), &Weights::Q8(q, s), m, n, k);
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }
}

/// How far ahead the streaming kernels prefetch weights: the hardware
/// prefetcher alone left them short of the machine's bandwidth
/// (docs/PERFORMANCE.md).
const PREFETCH_BYTES: usize = 12 << 10;

/// x [m, k] · wᵀ: each task owns whole weight rows, so the result is built
/// transposed ([n, m]) and turned around at the end.
fn matmul_nt_rows(path: Path, x: &Rows, w: &Weights, m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut t = vec![0f32; n * m];
    let ahead = w.rows_ahead(k);
    t.par_chunks_mut(m * 64).enumerate().for_each(|(c, out)| {
        if m == 1 && !software_prefetch() {
            // Decoding's case: one loop over the chunk's rows inside the kernel.
            return w.dot_rows(path, c * 64, k, x, out);
        }
        for (r, o) in out.chunks_mut(m).enumerate() {
            let j = c * 64 + r;
            w.prefetch(j + ahead, k);
            for (i, oi) in o.iter_mut().enumerate() {
                *oi = w.dot(path, j, k, &x.row(i, k));
            }
        }
    });
    if m == 1 {
        return t;
    }
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
fn matmul_nn_rows(path: Path, x: &[f32], w: &Weights, m: usize, n: usize, k: usize) -> Vec<f32> {
    // About four blocks per thread: fewer, larger blocks left threads idle
    // (docs/PERFORMANCE.md).
    let block = n.div_ceil(4 * rayon::current_num_threads()).max(32);
    let ahead = w.rows_ahead(k);
    let partial: Vec<Vec<f32>> = (0..n.div_ceil(block))
        .into_par_iter()
        .map(|b| {
            let mut acc = vec![0f32; m * k];
            let end = ((b + 1) * block).min(n);
            let g = w.rows_per_axpy();
            if m == 1 && g > 1 {
                let mut j = b * block;
                while j < end {
                    let rows = g.min(end - j);
                    for r in 0..rows {
                        if j + r + ahead < end {
                            w.prefetch(j + r + ahead, k);
                        }
                    }
                    w.axpy_rows(path, j, k, &x[j..j + rows], &mut acc);
                    j += rows;
                }
                return acc;
            }
            for j in b * block..end {
                if j + ahead < end {
                    w.prefetch(j + ahead, k);
                }
                for i in 0..m {
                    w.axpy(path, j, k, x[i * n + j], &mut acc[i * k..(i + 1) * k]);
                }
            }
            acc
        })
        .collect();
    // Added in block order, not in rayon's reduction tree (whose shape
    // depends on work stealing): the same inputs always give the same bits.
    let mut out = vec![0f32; m * k];
    for p in &partial {
        out.iter_mut().zip(p).for_each(|(o, v)| *o += v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::matmul::{matmul_nn, matmul_nt};
    use super::super::test_util::{max_abs_diff, spread};

    /// One row against f16 weights, taken four rows a pass, gives the bits
    /// of the row-by-row f32 sums on the widened weights, on every path
    /// (row counts that leave a partial group in a block).
    #[test]
    fn grouped_f16_weighted_sums_give_the_row_by_row_bits() {
        use super::{matmul_nn_rows, Weights};
        use ::half::f16;
        for (n, k) in [(301, 77), (130, 768), (7, 16)] {
            let w: Vec<f16> = (0..n * k)
                .map(|i| f16::from_f32((i as f32 * 0.37).sin()))
                .collect();
            let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            for path in super::Path::all() {
                let got = matmul_nn_rows(path, &x, &Weights::F16(&w), 1, n, k);
                let want = matmul_nn_rows(path, &x, &Weights::F32(&wide), 1, n, k);
                let b = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(b(&got), b(&want), "n={n} k={k} {:?}", path.isa());
            }
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
}
