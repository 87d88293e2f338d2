//! Fused CPU kernels for the hot loops that candle would otherwise run as
//! several single-threaded passes or copies. They are row-parallel with
//! rayon, compiled for AVX2/AVX-512 and chosen at run time, and fall back to
//! plain tensor ops for other devices, dtypes or layouts, so results never
//! depend on the path.
//!
//! - [`math`]: vectorisable erf, exp and GELU;
//! - [`rows`]: per-row primitives (dot, axpy, sums, softmax) and the dispatch
//!   between instruction sets;
//! - [`theta`]: Θ, the Pattention non-linearity (reference and fused);
//! - [`rotary`]: GPT-NeoX rotary embeddings;
//! - [`attention`]: fused token-token attention;
//! - [`gemv`]: the matrix-vector products of decoding (f32 or f16 weights,
//!   the latter widened by [`half`]);
//! - [`matmul`]: the products' entry points, gemm for the compute-bound ones.

use candle_core::{CpuStorage, Layout, Result};

mod attention;
mod gemv;
mod half;
mod math;
mod matmul;
mod rotary;
mod rows;
pub mod theta;

pub use attention::{attention, causal_softmax};
pub use math::{erf_f32, exp_f32, gelu_erf_f32};
pub use matmul::{matmul_nn, matmul_nt, SMALL_ROWS};
pub use rotary::rotary;
pub use rows::{max_and_exp_sum, sum};
pub use theta::theta_owned;

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

/// Deterministic inputs and comparisons shared by the kernels' tests.
#[cfg(test)]
pub(crate) mod test_util {
    use candle_core::{DType, Device, Tensor};

    /// Deterministic values of unit-ish spread (an unseeded randn would make
    /// the tolerances a matter of luck).
    pub fn spread(shape: impl Into<candle_core::Shape>) -> Tensor {
        let shape = shape.into();
        let v: Vec<f32> = (0..shape.elem_count())
            .map(|i| ((i as f32 * 0.754_877_7).fract() - 0.5) * 3.4)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
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

    pub fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }
}
