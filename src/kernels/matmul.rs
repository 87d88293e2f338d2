//! The products' entry points: the streaming kernels of [`super::gemv`] for
//! a few rows, gemm straight into an uninitialised output for the
//! compute-bound rest (prefill, evaluation, images), plain candle otherwise.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

use super::f32_slice;
use super::gemv::SmallMatmul;

/// Rows at or below which the matrix-vector kernels beat a packed gemm:
/// decoding is bound by reading the weights once, and gemm would first copy
/// (pack) them.
pub const SMALL_ROWS: usize = 8;

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
/// extra pass over a buffer gemm then overwrites (docs/PERFORMANCE.md).
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
    use super::super::test_util::{bits, spread};
    use super::*;

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
}
