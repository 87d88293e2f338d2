//! The matrix products of decoding (a few rows of activations against a
//! weight matrix): weights are streamed once from memory, with software
//! prefetch, instead of being packed as gemm would on every call. Weights are
//! f32 or f16 (widened in registers by [`super::half`]); arithmetic is f32.

use candle_core::{CpuStorage, Layout, Result, Shape};
use rayon::prelude::*;

use super::rows::{axpy, dot};
use super::{f32_slice, half};

/// A weight matrix in its stored precision. Half-precision rows are widened
/// to f32 just before use, so the arithmetic is f32 either way and decoding
/// reads half the bytes.
enum Weights<'a> {
    F32(&'a [f32]),
    F16(&'a [::half::f16]),
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
            Self::F16(w) => half::dot(x, &w[j * k..(j + 1) * k]),
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
            Self::F16(w) => half::axpy(a, &w[j * k..(j + 1) * k], y),
        }
    }
}

/// The matrix products of decoding, where the weights are read once and not
/// packed: `x · wᵀ` when `transposed` (w [n, k], dot products with weight
/// rows), else `x · w` (w [n, k], weighted sums of weight rows).
pub(super) struct SmallMatmul {
    pub(super) transposed: bool,
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

/// How far ahead the streaming kernels prefetch weights: the hardware
/// prefetcher alone left them short of the machine's bandwidth
/// (docs/PERFORMANCE.md).
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
    // About four blocks per thread: fewer, larger blocks left threads idle
    // (docs/PERFORMANCE.md).
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

#[cfg(test)]
mod tests {
    use super::super::matmul::{matmul_nn, matmul_nt};
    use super::super::test_util::{max_abs_diff, spread};

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
