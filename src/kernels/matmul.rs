//! The products' entry points: the streaming kernels of [`super::gemv`] for
//! a few rows, gemm straight into an uninitialised output for the
//! compute-bound rest (prefill, evaluation, images), bf16 ones on AMX where
//! the CPU has it, plain candle otherwise.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

use super::gemv::{SmallMatmul, SmallMatmulQ8};
use super::q8::Q8Matrix;
use super::{active, f32_slice, Isa, Path};

/// Rows at or below which the matrix-vector kernels beat a packed gemm:
/// decoding is bound by reading the weights once, and gemm would first copy
/// (pack) them.
pub const SMALL_ROWS: usize = 8;

fn small_ok(x: &Tensor, w: &Tensor) -> bool {
    super::fused_on(x)
        && match x.dtype() {
            DType::F32 => matches!(w.dtype(), DType::F32 | DType::F16 | DType::BF16),
            DType::BF16 => w.dtype() == DType::BF16,
            _ => false,
        }
        && x.is_contiguous()
        && w.is_contiguous()
        && x.rank() == 2
        && x.dim(0).is_ok_and(|m| m <= SMALL_ROWS)
}

fn gemm_ok(x: &Tensor, w: &Tensor) -> bool {
    super::fused_on(x)
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
/// extra pass over a buffer gemm then overwrites (docs/PERFORMANCE.md).
struct Gemm {
    transposed: bool,
    path: Path,
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
        let (m, n, k, dims) = product_dims(l1, l2, self.transposed, "gemm")?;
        if m * n * k == 0 {
            return Ok((CpuStorage::F32(vec![0.0; m * n]), Shape::from(dims)));
        }
        // w's element (row kk, column j) of the product's right-hand side.
        let (rhs_rs, rhs_cs) = if self.transposed { (1, k) } else { (n, 1) };
        let mut out = Vec::<f32>::with_capacity(m * n);
        // SAFETY: x holds m·k and w k·n elements (shapes checked above) and
        // `out` has room for m·n; gemm writes every element of dst without
        // reading it, so the length can be set after.
        unsafe {
            gemm_f32_rows(
                self.path,
                (m, n, k),
                (out.as_mut_ptr(), 1, n as isize),
                (x.as_ptr(), 1, k as isize),
                (w.as_ptr(), rhs_cs as isize, rhs_rs as isize),
            );
            out.set_len(m * n);
        }
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}

/// A decoding product: f32 rows as they are; a bf16 model's rows (against
/// bf16 weights) widened first and the result rounded back, the weights read
/// as bf16 (half f32's bytes).
fn small(x: &Tensor, w: &Tensor, op: SmallMatmul) -> Result<Tensor> {
    if x.dtype() == DType::F32 {
        return x.apply_op2_no_bwd(w, &op);
    }
    x.to_dtype(DType::F32)?
        .apply_op2_no_bwd(w, &op)?
        .to_dtype(x.dtype())
}

/// x · w (or wᵀ when `transposed`) on AMX (`super::amx`), when they take
/// it: on the CPU on the AVX-512 path, both bf16, more rows than decoding's
/// few (those take the streaming kernels), and a CPU and OS with AMX.
fn amx(x: &Tensor, w: &Tensor, transposed: bool) -> Option<Result<Tensor>> {
    #[cfg(target_arch = "x86_64")]
    if super::fused_on(x)
        && active().isa() == Isa::Avx512
        && x.dtype() == DType::BF16
        && w.dtype() == DType::BF16
        && x.is_contiguous()
        && w.is_contiguous()
        && x.rank() >= 1
        && w.rank() == 2
        && x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1) > SMALL_ROWS
        && super::amx::available()
    {
        return Some(x.apply_op2_no_bwd(w, &AmxGemm { transposed }));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, w, transposed);
    None
}

/// The contiguous bf16 data of a CPU tensor.
#[cfg(target_arch = "x86_64")]
fn bf16_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [::half::bf16]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::BF16(d), Some((a, b))) => Ok(&d[a..b]),
        _ => candle_core::bail!("gemm-amx: contiguous bf16 only"),
    }
}

/// bf16 x [.., k] times w [k, n] (or wᵀ for w [n, k]) on AMX, bf16 out.
#[cfg(target_arch = "x86_64")]
struct AmxGemm {
    transposed: bool,
}

#[cfg(target_arch = "x86_64")]
impl candle_core::CustomOp2 for AmxGemm {
    fn name(&self) -> &'static str {
        "gemm-amx"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (bf16_slice(s1, l1)?, bf16_slice(s2, l2)?);
        let (m, n, k, dims) = product_dims(l1, l2, self.transposed, "gemm-amx")?;
        let (rs, cs) = if self.transposed { (1, k) } else { (n, 1) };
        let mut out = Vec::with_capacity(m * n);
        // SAFETY: x holds m·k and w k·n elements (shapes checked above), the
        // output m·n; amx_ok checked the CPU; gemm writes every element.
        unsafe {
            super::amx::gemm(
                (m, n, k),
                super::amx::Operand {
                    ptr: x.as_ptr(),
                    rs: k,
                    cs: 1,
                },
                super::amx::Operand {
                    ptr: w.as_ptr(),
                    rs,
                    cs,
                },
                &mut out.spare_capacity_mut()[..m * n],
            );
            out.set_len(m * n);
        }
        Ok((CpuStorage::BF16(out), Shape::from(dims)))
    }
}

/// (m, n, k) and the output's dims of x [.., k] times w [k, n], or wᵀ for
/// w [n, k] when `transposed`.
fn product_dims(
    l1: &Layout,
    l2: &Layout,
    transposed: bool,
    what: &str,
) -> Result<(usize, usize, usize, Vec<usize>)> {
    let (r, c) = l2.shape().dims2()?;
    let (k, n) = if transposed { (c, r) } else { (r, c) };
    let mut dims = l1.shape().dims().to_vec();
    if dims.last() != Some(&k) {
        candle_core::bail!(
            "{what}: shapes {:?} and {:?}{} do not multiply",
            l1.shape(),
            l2.shape(),
            if transposed { "ᵀ" } else { "" }
        )
    }
    let m = dims[..dims.len() - 1].iter().product::<usize>();
    *dims.last_mut().expect("rank ≥ 1") = n;
    Ok((m, n, k, dims))
}

/// gemm on candle's thread count (rayon's pool), or on the caller alone for one.
pub(crate) fn gemm_parallelism() -> gemm::Parallelism {
    match gemm_threads() {
        t if t > 1 => gemm::Parallelism::Rayon(t),
        _ => gemm::Parallelism::None,
    }
}

/// candle's thread count, asked once: without `RAYON_NUM_THREADS`, each
/// `candle_core::utils::get_num_threads` call counts the physical cores by
/// reading and parsing `/proc/cpuinfo`, which cost ~0.1–0.2 ms a product
/// (docs/PERFORMANCE.md, forty-fourth session).
fn gemm_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(candle_core::utils::get_num_threads)
}

/// dst = scale · lhs · rhs for f32 [m, k] · [k, n] with the kernels of
/// `path`: our own packed gemm on AVX2 (faster there than the gemm crate's),
/// the gemm crate's otherwise (its own choice is always the CPU's best, so a
/// forced portable path calls its scalar kernels directly). dst is written,
/// never read. Operands are (pointer, column stride, row stride) in elements.
///
/// # Safety
/// The pointers and strides must address m×n, m×k and k×n valid elements,
/// and dst must not overlap the inputs.
pub(crate) unsafe fn gemm_f32(
    path: Path,
    (m, n, k): (usize, usize, usize),
    (dst, dst_cs, dst_rs): (*mut f32, isize, isize),
    (lhs, lhs_cs, lhs_rs): (*const f32, isize, isize),
    (rhs, rhs_cs, rhs_rs): (*const f32, isize, isize),
    scale: f32,
    parallelism: gemm::Parallelism,
) {
    // One argument list for gemm's entry points: `$f` with its own leading
    // and trailing arguments around the shared ones.
    macro_rules! call {
        ($f:expr, [$($pre:expr),*], [$($post:expr),*]) => {
            $f(
                $($pre,)* m, n, k, dst, dst_cs, dst_rs, false, lhs, lhs_cs, lhs_rs, rhs, rhs_cs,
                rhs_rs, 0.0, scale, false, false, false, $($post,)* parallelism,
            )
        };
    }
    #[cfg(target_arch = "x86_64")]
    if path.isa() == Isa::Avx2 {
        use super::sgemm::{sgemm, Operand};
        let threads = match parallelism {
            gemm::Parallelism::Rayon(t) => t,
            _ => 1,
        };
        // SAFETY: the caller's contract; a Path exists only for a CPU with
        // the path's features.
        return unsafe {
            sgemm(
                (m, n, k),
                Operand {
                    ptr: dst,
                    rs: dst_rs,
                    cs: dst_cs,
                },
                Operand {
                    ptr: lhs,
                    rs: lhs_rs,
                    cs: lhs_cs,
                },
                Operand {
                    ptr: rhs,
                    rs: rhs_rs,
                    cs: rhs_cs,
                },
                scale,
                threads,
            )
        };
    }
    if path.isa() == Isa::Portable {
        use gemm_f32::microkernel::scalar::f32 as ukr;
        // gemm's generic driver with its scalar microkernels (one f32 a
        // "register").
        // SAFETY: the caller's contract; the kernels are gemm's own scalar ones.
        return unsafe {
            call!(
                gemm_common::gemm::gemm_basic_generic::<
                    _,
                    f32,
                    1,
                    { ukr::MR_DIV_N },
                    { ukr::NR },
                    { ukr::MR_DIV_N },
                    { ukr::H_M },
                    { ukr::H_N },
                >,
                [gemm_common::simd::Scalar],
                [|a, b, c| a * b + c, &ukr::UKR, &ukr::H_UKR, false]
            )
        };
    }
    // SAFETY: the caller's contract.
    unsafe { call!(gemm::gemm, [], []) }
}

/// [`gemm_f32`] of a model's product: with enough rows per thread and weights
/// that fit the caches, the rows are split between the threads, each a
/// single-threaded gemm, instead of the gemm crate's own threading (which
/// shares one packed copy of the weights between threads); docs/PERFORMANCE.md
/// has the measurements.
///
/// # Safety
/// As [`gemm_f32`].
unsafe fn gemm_f32_rows(
    path: Path,
    (m, n, k): (usize, usize, usize),
    (dst, dst_cs, dst_rs): (*mut f32, isize, isize),
    (lhs, lhs_cs, lhs_rs): (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
) {
    let parallelism = gemm_parallelism();
    let threads = match parallelism {
        gemm::Parallelism::Rayon(t) => t,
        _ => 1,
    };
    // Our own sgemm (AVX2) threads its own way.
    if threads < 2 || m < SPLIT_FROM * threads || k * n > SPLIT_WEIGHTS || path.isa() == Isa::Avx2 {
        // SAFETY: the caller's contract.
        return unsafe {
            gemm_f32(
                path,
                (m, n, k),
                (dst, dst_cs, dst_rs),
                (lhs, lhs_cs, lhs_rs),
                rhs,
                1.0,
                parallelism,
            )
        };
    }
    use rayon::prelude::*;
    let rows = m.div_ceil(threads);
    use super::SharedPtr;
    let (dst, lhs, rhs_ptr) = (
        SharedPtr(dst),
        SharedPtr(lhs.cast_mut()),
        SharedPtr(rhs.0.cast_mut()),
    );
    (0..m.div_ceil(rows)).into_par_iter().for_each(|part| {
        let (dst, lhs, rhs_ptr) = (dst, lhs, rhs_ptr);
        let first = part * rows;
        let offset = |rs: isize| first as isize * rs;
        // SAFETY: the caller's contract, for rows first..first + rows of dst
        // and lhs; each task writes its own rows of dst.
        unsafe {
            gemm_f32(
                path,
                (rows.min(m - first), n, k),
                (dst.0.offset(offset(dst_rs)), dst_cs, dst_rs),
                (lhs.0.offset(offset(lhs_rs)), lhs_cs, lhs_rs),
                (rhs_ptr.0, rhs.1, rhs.2),
                1.0,
                gemm::Parallelism::None,
            )
        }
    });
}

/// Rows per thread from which [`gemm_f32_rows`] splits: below it the
/// weights' packing, repeated on every thread, costs more than it saves.
const SPLIT_FROM: usize = 256;

/// Weights (k·n elements) up to which [`gemm_f32_rows`] splits: a
/// 768×3072 matrix; the output layer's 768×50,304 keeps gemm's threading.
const SPLIT_WEIGHTS: usize = 768 * 3072;

/// Half-precision weights widened for gemm (compute-bound there, so the
/// one-off conversion costs little next to the product).
fn as_f32(w: &Tensor) -> Result<Tensor> {
    w.to_dtype(DType::F32)
}

/// The weights in the activations' dtype, for candle's own matmul: the
/// path of every other device and of bf16/f16/f64 computation (a no-op
/// when they already agree).
fn like(w: &Tensor, x: &Tensor) -> Result<Tensor> {
    w.to_dtype(x.dtype())
}

/// x [m, k] · wᵀ (w [n, k], f32 or f16, or bf16 for bf16 x); on the CPU the
/// streaming kernel for few rows, gemm (f32) or AMX (bf16) otherwise;
/// elsewhere candle's matmul in x's dtype. The result has x's dtype.
pub fn matmul_nt(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    matmul_nt_on(active(), x, w)
}

pub(super) fn matmul_nt_on(path: Path, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let transposed = true;
    if small_ok(x, w) {
        small(x, w, SmallMatmul { transposed, path })
    } else if gemm_ok(x, w) {
        x.apply_op2_no_bwd(&as_f32(w)?, &Gemm { transposed, path })
    } else if let Some(y) = amx(x, w, transposed) {
        y
    } else {
        x.matmul(&like(w, x)?.t()?)
    }
}

/// x [m, n] · w (w [n, k]), as [`matmul_nt`].
pub fn matmul_nn(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    matmul_nn_on(active(), x, w)
}

pub(super) fn matmul_nn_on(path: Path, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let transposed = false;
    if small_ok(x, w) {
        small(x, w, SmallMatmul { transposed, path })
    } else if gemm_ok(x, w) {
        x.apply_op2_no_bwd(&as_f32(w)?, &Gemm { transposed, path })
    } else if let Some(y) = amx(x, w, transposed) {
        y
    } else {
        x.matmul(&like(w, x)?)
    }
}

/// x [.., k] · wᵀ for 8-bit weights w [n, k], with x quantised per block
/// as the weights are ([`super::q8`]): the streaming integer kernel for a
/// few f32 rows on the CPU, gemm on the dequantised x and weights otherwise.
/// The result is f32 [.., n].
pub fn matmul_nt_q8(x: &Tensor, w: &Q8Matrix) -> Result<Tensor> {
    matmul_nt_q8_on(active(), x, w)
}

pub(super) fn matmul_nt_q8_on(path: Path, x: &Tensor, w: &Q8Matrix) -> Result<Tensor> {
    let (n, k) = w.dims();
    let mut dims = x.dims().to_vec();
    let rows = x.elem_count() / k.max(1);
    if dims.last() != Some(&k) {
        candle_core::bail!(
            "matmul: x {:?} and wᵀ of [{n}, {k}] do not multiply",
            x.dims()
        )
    }
    *dims.last_mut().expect("rank ≥ 1") = n;
    let small = x.device().is_cpu() && x.dtype() == DType::F32 && rows <= SMALL_ROWS;
    let out = if small {
        x.contiguous()?
            .reshape((rows, k))?
            .apply_op1_no_bwd(&SmallMatmulQ8 { w, path })?
    } else {
        // x as the kernel quantises it, so that every row count computes alike.
        let flat = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let x = super::q8::requantized(path, &flat, rows, k)?.to_device(x.device())?;
        let wide = w.dequantize()?.to_device(x.device())?;
        matmul_nt_on(path, &x, &wide)?
    };
    out.reshape(dims)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, bits, half_ulp, max_abs_diff, spread};
    use super::*;

    /// The largest |a − b| relative to the largest |b|.
    fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
        let scale = max_abs_diff(b, &b.zeros_like().unwrap());
        max_abs_diff(a, b) / scale.max(1e-30)
    }

    /// Enough rows that the products split them between the threads (and a
    /// ragged last share), in both weight layouts, against f64.
    #[test]
    fn products_split_by_rows_equal_the_reference() {
        let threads = candle_core::utils::get_num_threads().max(2);
        let (m, k, n) = (SPLIT_FROM * threads + 37, 24, 40);
        let x = spread((m, k));
        let f = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        for transposed in [false, true] {
            let w = if transposed {
                spread((n, k))
            } else {
                spread((k, n))
            };
            let got = x
                .apply_op2_no_bwd(
                    &w,
                    &Gemm {
                        transposed,
                        path: active(),
                    },
                )
                .unwrap();
            let wf = if transposed {
                f(&w).t().unwrap()
            } else {
                f(&w)
            };
            let want = f(&x).matmul(&wf).unwrap();
            let d = rel_diff(&got.to_dtype(DType::F64).unwrap(), &want);
            assert!(d < 1e-6, "transposed={transposed}: {d}");
        }
    }

    #[test]
    fn every_path_gives_the_portable_products() {
        let portable = Path::new(Isa::Portable).unwrap();
        let w = spread((300, 77));
        let half = w.to_dtype(DType::F16).unwrap();
        let q = Q8Matrix::quantize(&w, "w").unwrap();
        for path in Path::all() {
            let at = |what: &str, m: usize| format!("{what} m={m} {:?}", path.isa());
            // The streaming kernels (m ≤ SMALL_ROWS) add in the same order on
            // every path; gemm's kernels block the sums differently, so they
            // agree to rounding only.
            for m in [1, 3, 8, 9, 40] {
                let x = (spread((m, 77)) * 0.7).unwrap();
                let s = (spread((m, 300)) * 0.3).unwrap();
                let pairs = [
                    (
                        at("nt f32", m),
                        matmul_nt_on(path, &x, &w),
                        matmul_nt_on(portable, &x, &w),
                    ),
                    (
                        at("nt f16", m),
                        matmul_nt_on(path, &x, &half),
                        matmul_nt_on(portable, &x, &half),
                    ),
                    (
                        at("nn f32", m),
                        matmul_nn_on(path, &s, &w),
                        matmul_nn_on(portable, &s, &w),
                    ),
                    (
                        at("nn f16", m),
                        matmul_nn_on(path, &s, &half),
                        matmul_nn_on(portable, &s, &half),
                    ),
                    (
                        at("nt q8", m),
                        matmul_nt_q8_on(path, &x, &q),
                        matmul_nt_q8_on(portable, &x, &q),
                    ),
                ];
                for (what, a, b) in pairs {
                    let (a, b) = (a.unwrap(), b.unwrap());
                    if m <= SMALL_ROWS {
                        assert_eq!(bits(&a), bits(&b), "{what}");
                    } else {
                        let d = rel_diff(&a, &b);
                        assert!(d < 1e-6, "{what}: {d}");
                    }
                }
            }
        }
    }

    #[test]
    fn q8_products_are_f32_products_on_dequantized_inputs_and_weights() {
        // Decode-sized inputs take the 8-bit kernel, larger ones gemm on the
        // dequantised x and matrix (bit for bit); both are the f32 product of
        // x and w each quantised per block, up to the order of the additions.
        let w = spread((130, 77));
        let q = Q8Matrix::quantize(&w, "w").unwrap();
        let wide = q.dequantize().unwrap();
        for rows in [1, 5, 300] {
            let x = spread((2, rows, 77));
            let got = matmul_nt_q8(&x, &q).unwrap();
            assert_eq!(got.dims(), &[2, rows, 130]);
            let flat: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let xq = super::super::q8::requantized(Path::best(), &flat, 2 * rows, 77)
                .and_then(|t| t.reshape((2, rows, 77)))
                .unwrap();
            let want = matmul_nt(&xq, &wide).unwrap();
            if 2 * rows <= SMALL_ROWS {
                let d = rel_diff(&got, &want);
                assert!(d < 1e-6, "rows={rows}: {d}");
            } else {
                assert_eq!(bits(&got), bits(&want), "rows={rows}");
            }
            // And close to the unquantised product (8 bits: ~1 % of a row's scale).
            let exact = matmul_nt(&x, &w).unwrap();
            assert!(rel_diff(&got, &exact) < 0.02, "rows={rows}");
        }
        let err = matmul_nt_q8(&spread((2, 76)), &q).unwrap_err();
        assert!(err.to_string().contains("do not multiply"), "{err}");
    }

    /// bf16 products (AMX where the CPU has it for a prefill's rows, candle's
    /// otherwise): the f32 product of the same bf16 values, rounded to bf16,
    /// for both weight layouts.
    #[test]
    fn bf16_products_are_f32_products_of_their_values_rounded() {
        // Decoding's few rows (the streaming kernels on bf16 weights) and a prefill's.
        for m in [3, 40] {
            bf16_products(m);
        }
    }

    fn bf16_products(m: usize) {
        let (k, n) = (96, 70);
        let x = spread((m, k)).to_dtype(DType::BF16).unwrap();
        let w = (spread((n, k)) * 0.5)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let want = f(&x).matmul(&f(&w).t().unwrap()).unwrap();
        let wt = w.t().unwrap().contiguous().unwrap();
        for got in [matmul_nt(&x, &w).unwrap(), matmul_nn(&x, &wt).unwrap()] {
            assert_eq!(got.dtype(), DType::BF16);
            // One bf16 rounding of the result (plus f32 summation order).
            let tol = |b: f64| b.abs() * half_ulp(DType::BF16) + 1e-4;
            assert_close(&got, &want, tol, &format!("{m} rows"));
        }
    }

    #[test]
    fn large_matmuls_equal_candle() {
        // Past SMALL_ROWS the products go to gemm with the strides candle's
        // matmul uses: on the paths that call the gemm crate (AVX-512,
        // portable) the results are candle's to the bit when gemm itself
        // would pick that path (the CPU's best); the AVX2 path's own sgemm
        // adds in another order, so it agrees to rounding. x may carry batch
        // axes, and f16 weights are widened first.
        for path in Path::all() {
            let exact = path == Path::best() && path.isa() != Isa::Avx2;
            large_matmuls_equal_candle_on(path, exact);
        }
    }

    fn large_matmuls_equal_candle_on(path: Path, exact: bool) {
        let nt = |x: &Tensor, w: &Tensor| matmul_nt_on(path, x, w).unwrap();
        let nn = |x: &Tensor, w: &Tensor| matmul_nn_on(path, x, w).unwrap();
        let same = |a: &Tensor, b: &Tensor| {
            if exact {
                assert_eq!(bits(a), bits(b), "{:?}", path.isa());
            } else {
                let d = rel_diff(a, b);
                assert!(d < 1e-6, "{:?}: {d}", path.isa());
            }
        };
        for rows in [9, 300] {
            let x = spread((3, rows, 77));
            let w = spread((130, 77));
            let flat = x.reshape((3 * rows, 77)).unwrap();
            let want = flat
                .matmul(&w.t().unwrap())
                .unwrap()
                .reshape((3, rows, 130));
            same(&nt(&x, &w), &want.unwrap());
            let v = spread((77, 130));
            let want = flat.matmul(&v).unwrap().reshape((3, rows, 130)).unwrap();
            same(&nn(&x, &v), &want);
            let half = v.to_dtype(DType::F16).unwrap();
            let wide = half.to_dtype(DType::F32).unwrap();
            let want = flat.matmul(&wide).unwrap().reshape((3, rows, 130)).unwrap();
            same(&nn(&x, &half), &want);
        }
        let err = matmul_nn(&spread((20, 5)), &spread((6, 4))).unwrap_err();
        assert!(err.to_string().contains("do not multiply"), "{err}");
        let empty = matmul_nn(&spread((20, 0)), &spread((0, 4))).unwrap();
        assert_eq!(empty.to_vec2::<f32>().unwrap(), vec![vec![0f32; 4]; 20]);
    }
}
