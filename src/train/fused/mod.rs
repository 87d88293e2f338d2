//! The training forward's hot pieces as single nodes of candle's graph, each with its
//! own backward, on the CPU in f32 and f64: a whole Pattention Θ(x·Kᵀ)·V
//! (`pattention.rs`), attention over all heads (`attention.rs`), the non-parametric
//! LayerNorm and a scaled softmax (`rows.rs`); this file holds what they share (the
//! element types, the products, the candle plumbing) and their tests. Composed from candle ops, one
//! Pattention is six nodes and a LayerNorm seven; candle's backward then allocates a
//! zeroed gradient for every node and adds into it, so most of a small model's step
//! went to element-wise passes, not to products (docs/PERFORMANCE.md). Other devices
//! and dtypes keep the composite ops in [`super::lm`], which are also what the tests
//! hold these against.

use candle_core::{
    CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor,
    WithDType,
};
use rayon::prelude::*;

use super::theta;

mod attention;
mod block;
mod head;
mod pattention;
mod rows;

/// A row normalised in place with f32 sums over 32 lanes, added in f64 (no weight or bias),
/// on the selected instruction set: also the CPU inference LayerNorm's.
pub(crate) use rows::fast::layer_norm_row as layer_norm_row_f32;

pub(super) use attention::attention;
pub(crate) use block::{block, BlockSpec, RotaryTables};
pub(crate) use head::head_cross_entropy;
pub(super) use pattention::pattention;
use rows::last_dim;
pub(super) use rows::{layer_norm, softmax_scaled};

/// Whether the fused ops serve `t`: f32 or f64 on the CPU.
pub(super) fn serves(t: &Tensor) -> bool {
    crate::kernels::fused_on(t) && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// The element types of the fused ops.
trait Elem: WithDType + Copy + Send + Sync + Into<f64> {
    /// e^x (f32: the inference kernels' vectorisable exp, ≈1 ulp).
    fn exp_fast(self) -> Self;

    /// dst (m rows of n, row i at `dst + i·rs`) = lhs · rhs on `par`'s threads; dst is
    /// written, never read.
    ///
    /// # Safety
    /// The operands cover m×k and k×n elements (k > 0), dst addresses (m−1)·rs + n
    /// writable elements and overlaps neither operand.
    unsafe fn matmul_raw(
        par: gemm::Parallelism,
        dst: *mut Self,
        rs: usize,
        mnk: (usize, usize, usize),
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    );

    /// dst [m, n] (row-major, fresh) = lhs · rhs on `par`'s threads.
    fn matmul_on(
        par: gemm::Parallelism,
        mnk: (usize, usize, usize),
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    ) -> Vec<Self> {
        product(mnk, &lhs, &rhs, |dst| {
            // SAFETY: `product` checked the operands and gives room for m·n.
            unsafe { Self::matmul_raw(par, dst, mnk.1, mnk, lhs, rhs) }
        })
    }

    /// Rows of dst [m, n] (row i at `dst[i·rs..]`) = lhs · rhs on `par`'s threads: a
    /// product into columns of a wider buffer, or into a block of a larger one.
    fn matmul_into(
        par: gemm::Parallelism,
        dst: &mut [Self],
        rs: usize,
        mnk: (usize, usize, usize),
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    ) {
        product_into(dst, rs, mnk, &lhs, &rhs, |dst| {
            // SAFETY: `product_into` checked the operands and dst's extent.
            unsafe { Self::matmul_raw(par, dst, rs, mnk, lhs, rhs) }
        })
    }

    /// dst [m, n] = lhs · rhs on all threads.
    fn matmul(m: usize, n: usize, k: usize, lhs: Operand<Self>, rhs: Operand<Self>) -> Vec<Self> {
        Self::matmul_on(crate::kernels::gemm_parallelism(), (m, n, k), lhs, rhs)
    }

    /// dst [m, n] = lhs · rhs for a long inner dimension (weight gradients: k is every
    /// row of the batch, m and n the token and feature counts): each thread multiplies
    /// its own stretch of k, then the partial products are added. gemm itself splits
    /// only m and n, which left one of two cores idle on 192 × 4160 × 192 (173 against
    /// 308 GFLOP/s on a Xeon).
    fn matmul_long(
        m: usize,
        n: usize,
        k: usize,
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    ) -> Vec<Self> {
        let threads = rayon::current_num_threads();
        if threads < 2 || k < 4 * m.max(n) || k < 2 * threads {
            return Self::matmul(m, n, k, lhs, rhs);
        }
        let step = k.div_ceil(threads);
        let part = |p0: usize| {
            let kk = step.min(k - p0);
            let lhs = Operand {
                data: &lhs.data[p0 * lhs.cs..],
                ..lhs
            };
            let rhs = Operand {
                data: &rhs.data[p0 * rhs.rs..],
                ..rhs
            };
            Self::matmul_serial(m, n, kk, lhs, rhs)
        };
        (0..k)
            .step_by(step)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(part)
            .reduce_with(|mut a, b| {
                a.iter_mut().zip(&b).for_each(|(a, &b)| *a += b);
                a
            })
            .unwrap_or_else(|| vec![Self::zero(); m * n])
    }

    /// dst [m, n] = lhs · rhs on the calling thread (for products run in parallel).
    fn matmul_serial(
        m: usize,
        n: usize,
        k: usize,
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    ) -> Vec<Self> {
        Self::matmul_on(gemm::Parallelism::None, (m, n, k), lhs, rhs)
    }
    /// out = Θ(s) for rows of n, on the calling thread.
    fn theta_rows(s: &[Self], out: &mut [Self], n: usize, c: f64);
    /// Θ's backward for rows of n on the calling thread: the scores become ∂L/∂s.
    fn theta_grad_rows(s: &mut [Self], dy: &[Self], n: usize, c: f64);
    /// dst = softmax(scale · src) for one row (exact zeros below e^−87; a row of
    /// nothing but −∞ gets all zeros).
    fn softmax_row(src: &[Self], dst: &mut [Self], scale: f64) {
        rows::softmax_row(src, dst, scale)
    }
    /// dP becomes dS = scale · P · (dP − Σ dP·P) for one row.
    fn softmax_grad_row(dp: &mut [Self], p: &[Self], scale: f64) {
        rows::softmax_grad_row(dp, p, scale)
    }
    /// A row becomes (x − mean) / √(var + eps).
    fn layer_norm_row(row: &mut [Self], eps: f64) {
        rows::layer_norm_row(row, eps)
    }
    /// The upstream gradient `dx` of one row becomes ∂x, from the row's input and output.
    fn layer_norm_grad_row(dx: &mut [Self], x: &[Self], y: &[Self], eps: f64) {
        rows::layer_norm_grad_row(dx, x, y, eps)
    }
    /// The mean cross-entropy of logits [rows, v] against `targets`, the logits
    /// turned into its gradient (softmax − one-hot) / rows in place.
    fn loss_and_grad_in_place(x: &mut [Self], v: usize, targets: &[u32]) -> f64 {
        super::loss::loss_and_grad_in_place(x, v, targets, Self::from_f64)
    }
}

/// A matrix operand: element (i, j) at `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
struct Operand<'a, T> {
    data: &'a [T],
    rs: usize,
    cs: usize,
}

impl<'a, T> Operand<'a, T> {
    fn rows(data: &'a [T], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    fn transposed(data: &'a [T], cols: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: cols,
        }
    }

    /// Whether elements (m−1, k−1) and everything before lie inside the slice.
    fn covers(&self, m: usize, k: usize) -> bool {
        m == 0 || k == 0 || (m - 1) * self.rs + (k - 1) * self.cs < self.data.len()
    }
}

/// The product's checks and zero cases shared by both element types; `call` runs the
/// kernel into a buffer of m·n.
fn product<T: WithDType>(
    (m, n, k): (usize, usize, usize),
    lhs: &Operand<T>,
    rhs: &Operand<T>,
    call: impl FnOnce(*mut T),
) -> Vec<T> {
    assert!(
        lhs.covers(m, k) && rhs.covers(k, n),
        "fused product out of bounds"
    );
    if m * n == 0 || k == 0 {
        return vec![T::zero(); m * n];
    }
    let mut dst = Vec::<T>::with_capacity(m * n);
    call(dst.as_mut_ptr());
    // SAFETY: the kernel wrote all m·n elements of dst (it never reads them).
    unsafe { dst.set_len(m * n) };
    dst
}

/// Checks that `dst` holds m rows of n at stride `rs` and the operands cover their
/// parts, then runs `call` with dst's pointer (nothing when the product is empty).
fn product_into<T: Copy>(
    dst: &mut [T],
    rs: usize,
    (m, n, k): (usize, usize, usize),
    lhs: &Operand<T>,
    rhs: &Operand<T>,
    call: impl FnOnce(*mut T),
) {
    assert!(
        lhs.covers(m, k)
            && rhs.covers(k, n)
            && n <= rs
            && (m == 0 || (m - 1) * rs + n <= dst.len()),
        "fused product out of bounds"
    );
    if m * n > 0 && k > 0 {
        call(dst.as_mut_ptr());
    } else if k == 0 {
        assert!(m * n == 0, "fused product of depth 0");
    }
}

impl Elem for f32 {
    fn exp_fast(self) -> Self {
        crate::kernels::math::exp_f32(self)
    }
    unsafe fn matmul_raw(
        par: gemm::Parallelism,
        dst: *mut Self,
        rs: usize,
        mnk: (usize, usize, usize),
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    ) {
        // SAFETY: the caller's contract.
        unsafe { gemm_f32_raw(crate::kernels::active(), par, (dst, rs), mnk, lhs, rhs) }
    }
    fn theta_rows(s: &[Self], out: &mut [Self], n: usize, c: f64) {
        theta::forward_f32_serial(s, out, n, c)
    }
    fn theta_grad_rows(s: &mut [Self], dy: &[Self], n: usize, c: f64) {
        theta::backward_f32_serial(s, dy, n, c)
    }
    fn softmax_row(src: &[Self], dst: &mut [Self], scale: f64) {
        rows::fast::softmax_row(src, dst, scale)
    }
    fn loss_and_grad_in_place(x: &mut [Self], v: usize, targets: &[u32]) -> f64 {
        super::loss::loss_and_grad_in_place_f32(x, v, targets)
    }
    fn softmax_grad_row(dp: &mut [Self], p: &[Self], scale: f64) {
        rows::fast::softmax_grad_row(dp, p, scale)
    }
    fn layer_norm_row(row: &mut [Self], eps: f64) {
        rows::fast::layer_norm_row(row, eps)
    }
    fn layer_norm_grad_row(dx: &mut [Self], x: &[Self], y: &[Self], eps: f64) {
        rows::fast::layer_norm_grad_row(dx, x, y, eps)
    }
}

/// The f32 product on the kernels of `path` (our own sgemm on AVX2, the gemm crate's
/// otherwise).
#[cfg(test)]
fn matmul_f32_on(
    path: crate::kernels::Path,
    par: gemm::Parallelism,
    mnk: (usize, usize, usize),
    lhs: Operand<f32>,
    rhs: Operand<f32>,
) -> Vec<f32> {
    product(mnk, &lhs, &rhs, |dst| {
        // SAFETY: `product` checked the operands and gives room for m·n.
        unsafe { gemm_f32_raw(path, par, (dst, mnk.1), mnk, lhs, rhs) }
    })
}

/// # Safety
/// As [`Elem::matmul_raw`].
unsafe fn gemm_f32_raw(
    path: crate::kernels::Path,
    par: gemm::Parallelism,
    (dst, rs): (*mut f32, usize),
    mnk: (usize, usize, usize),
    lhs: Operand<f32>,
    rhs: Operand<f32>,
) {
    // SAFETY: the caller's contract.
    unsafe {
        crate::kernels::gemm_f32(
            path,
            mnk,
            (dst, 1, rs as isize),
            (lhs.data.as_ptr(), lhs.cs as isize, lhs.rs as isize),
            (rhs.data.as_ptr(), rhs.cs as isize, rhs.rs as isize),
            1.0,
            par,
        )
    }
}

/// The f64 product by gemm (tests and the f64 checks), dst rows `rs` apart.
///
/// # Safety
/// As `gemm::gemm`: the operands and dst address their elements, dst overlaps neither.
unsafe fn gemm_f64(
    par: gemm::Parallelism,
    (m, n, k): (usize, usize, usize),
    (dst, rs): (*mut f64, usize),
    lhs: Operand<f64>,
    rhs: Operand<f64>,
) {
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            rs as isize,
            false,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

impl Elem for f64 {
    fn exp_fast(self) -> Self {
        f64::exp(self)
    }
    unsafe fn matmul_raw(
        par: gemm::Parallelism,
        dst: *mut Self,
        rs: usize,
        mnk: (usize, usize, usize),
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    ) {
        // SAFETY: the caller's contract.
        unsafe { gemm_f64(par, mnk, (dst, rs), lhs, rhs) }
    }
    fn theta_rows(s: &[Self], out: &mut [Self], n: usize, c: f64) {
        theta::forward_serial(s, out, n, c)
    }
    fn theta_grad_rows(s: &mut [Self], dy: &[Self], n: usize, c: f64) {
        theta::backward_serial(s, dy, n, c)
    }
}

/// The elements of a contiguous CPU operand of type T (also AdamW's, in [`super::optim`]).
pub(super) fn contiguous<'a, T: WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    let Ok(v) = T::cpu_storage_as_slice(s) else {
        candle_core::bail!("{what}: operands of one dtype, f32 or f64, expected")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{what}: contiguous operands expected"),
    }
}

/// Runs `f` on the contiguous CPU elements of `t`.
pub(super) fn read<T: WithDType, R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(s) = &*storage else {
        candle_core::bail!("{what}: CPU tensors expected")
    };
    f(contiguous(s, layout, what)?)
}

/// An op of three operands with its own backward, written once for f32 and f64;
/// [`Three`] makes it a candle op.
trait ThreeOp: Send + Sync {
    const NAME: &'static str;
    type Dims: Copy;
    fn dims(&self, a: &Layout, b: &Layout, c: &Layout) -> Result<Self::Dims>;
    fn out_shape(&self, a: &Layout, dims: Self::Dims) -> Shape;
    fn fwd<T: Elem>(&self, a: &[T], b: &[T], c: &[T], dims: Self::Dims) -> Vec<T>;
    /// The gradients of the three operands (each of its operand's shape) from the
    /// operands and the upstream gradient, in that order.
    fn bwd<T: Elem>(&self, ops: (&[T], &[T], &[T], &[T]), dims: Self::Dims) -> Result<[Vec<T>; 3]>;
}

struct Three<O>(O);

impl<O: ThreeOp> CustomOp3 for Three<O> {
    fn name(&self) -> &'static str {
        O::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<O: ThreeOp, T: Elem>(
            op: &O,
            ops: [(&CpuStorage, &Layout); 3],
            dims: O::Dims,
        ) -> Result<CpuStorage> {
            let [a, b, c] = ops.map(|(s, l)| contiguous::<T>(s, l, O::NAME));
            Ok(T::to_cpu_storage_owned(op.fwd(a?, b?, c?, dims)))
        }
        let dims = self.0.dims(l1, l2, l3)?;
        let ops = [(s1, l1), (s2, l2), (s3, l3)];
        let out = match s1 {
            CpuStorage::F32(_) => run::<O, f32>(&self.0, ops, dims)?,
            CpuStorage::F64(_) => run::<O, f64>(&self.0, ops, dims)?,
            _ => candle_core::bail!("{}: f32 or f64 expected", O::NAME),
        };
        Ok((out, self.0.out_shape(l1, dims)))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        fn run<O: ThreeOp, T: Elem>(op: &O, [a, b, c, g]: [&Tensor; 4]) -> Result<[Tensor; 3]> {
            let dims = op.dims(a.layout(), b.layout(), c.layout())?;
            let grads = read::<T, _>(a, O::NAME, |x| {
                read(b, O::NAME, |y| {
                    read(c, O::NAME, |z| {
                        read(g, O::NAME, |g| op.bwd((x, y, z, g), dims))
                    })
                })
            })?;
            let [da, db, dc] = grads;
            let cpu = &Device::Cpu;
            Ok([
                Tensor::from_vec(da, a.shape(), cpu)?,
                Tensor::from_vec(db, b.shape(), cpu)?,
                Tensor::from_vec(dc, c.shape(), cpu)?,
            ])
        }
        let g = grad.contiguous()?;
        let [da, db, dc] = match a.dtype() {
            DType::F32 => run::<O, f32>(&self.0, [a, b, c, &g])?,
            DType::F64 => run::<O, f64>(&self.0, [a, b, c, &g])?,
            dt => candle_core::bail!("{} backward: {dt:?}", O::NAME),
        };
        Ok((Some(da), Some(db), Some(dc)))
    }
}

/// An op over rows of the last axis with its own backward, written once for f32 and
/// f64; [`Rows`] makes it a candle op.
trait RowOp: Send + Sync {
    const NAME: &'static str;
    fn fwd<T: Elem>(&self, x: &[T], n: usize) -> Vec<T>;
    /// ∂x from the input, the output and the upstream gradient.
    fn bwd<T: Elem>(&self, x: &[T], y: &[T], g: &[T], n: usize) -> Vec<T>;
}

struct Rows<O>(O);

impl<O: RowOp> CustomOp1 for Rows<O> {
    fn name(&self) -> &'static str {
        O::NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = last_dim(l);
        let y = match s {
            CpuStorage::F32(_) => {
                f32::to_cpu_storage_owned(self.0.fwd(contiguous::<f32>(s, l, O::NAME)?, n))
            }
            CpuStorage::F64(_) => {
                f64::to_cpu_storage_owned(self.0.fwd(contiguous::<f64>(s, l, O::NAME)?, n))
            }
            _ => candle_core::bail!("{}: f32 or f64 expected", O::NAME),
        };
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        fn run<O: RowOp, T: Elem>(
            op: &O,
            arg: &Tensor,
            res: &Tensor,
            g: &Tensor,
        ) -> Result<Tensor> {
            let n = last_dim(arg.layout());
            let out = read::<T, _>(arg, O::NAME, |x| {
                read(res, O::NAME, |y| {
                    read(g, O::NAME, |g| Ok(op.bwd(x, y, g, n)))
                })
            })?;
            Tensor::from_vec(out, arg.shape(), &Device::Cpu)
        }
        let g = grad.contiguous()?;
        Ok(Some(match arg.dtype() {
            DType::F32 => run::<O, f32>(&self.0, arg, res, &g)?,
            DType::F64 => run::<O, f64>(&self.0, arg, res, &g)?,
            dt => candle_core::bail!("{} backward: {dt:?}", O::NAME),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Var, D};

    /// Deterministic values in about [-1.5, 1.5].
    fn values(n: usize, seed: usize) -> Vec<f64> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 211) as f64 - 105.0) / 70.0)
            .collect()
    }

    fn input(shape: &[usize], seed: usize) -> Var {
        let n = shape.iter().product();
        Var::from_tensor(&Tensor::from_vec(values(n, seed), shape, &Device::Cpu).unwrap()).unwrap()
    }

    use crate::kernels::test_util::f64s as flat;

    fn max_diff(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()))
    }

    type Op = dyn Fn(&[Tensor]) -> Result<Tensor>;

    /// The fused op against a composite of candle ops in f64: values, and the gradients
    /// of Σ out·w (w fixed) for every input; then central differences of the fused op
    /// for a few elements of each input; then the f32 path against the f64 one.
    fn check(fused: &Op, reference: &Op, shapes: &[&[usize]]) {
        let vars: Vec<Var> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| input(s, i + 1))
            .collect();
        let args: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let (out, want) = (fused(&args).unwrap(), reference(&args).unwrap());
        assert_eq!(out.dims(), want.dims());
        assert!(max_diff(&flat(&out), &flat(&want)) < 1e-12);
        let w = Tensor::from_vec(values(out.elem_count(), 99), out.shape(), &Device::Cpu).unwrap();
        let objective =
            |f: &Op, args: &[Tensor]| (f(args).unwrap() * &w).unwrap().sum_all().unwrap();
        let (got, exp) = (
            objective(fused, &args).backward().unwrap(),
            objective(reference, &args).backward().unwrap(),
        );
        for (i, v) in vars.iter().enumerate() {
            let g = flat(got.get(v.as_tensor()).expect("a gradient"));
            let e = flat(exp.get(v.as_tensor()).expect("a gradient"));
            let scale = e.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            assert!(
                max_diff(&g, &e) < 1e-10 * scale,
                "input {i}: {g:?} vs {e:?}"
            );
            // Central differences of the fused op on the first elements.
            let base = flat(v.as_tensor());
            for j in 0..base.len().min(6) {
                let at = |delta: f64| -> f64 {
                    let mut x = base.clone();
                    x[j] += delta;
                    let mut a = args.clone();
                    a[i] = Tensor::from_vec(x, shapes[i], &Device::Cpu).unwrap();
                    objective(fused, &a).to_scalar::<f64>().unwrap()
                };
                // A step near the f64 optimum for central differences (ε^⅓ ≈ 6e-6).
                let fd = (at(1e-5) - at(-1e-5)) / 2e-5;
                assert!(
                    (g[j] - fd).abs() < 1e-6 * fd.abs().max(1.0),
                    "input {i}[{j}]: {} vs {fd}",
                    g[j]
                );
            }
        }
        // The f32 path (its own gemm and exp) agrees with f64 to f32 precision.
        let args32: Vec<Tensor> = args
            .iter()
            .map(|a| a.to_dtype(DType::F32).unwrap())
            .collect();
        let (v32, v64) = (flat(&fused(&args32).unwrap()), flat(&out));
        let scale = v64.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
        assert!(max_diff(&v32, &v64) < 1e-5 * scale);
        // So do its gradients (the f32 row kernels are separate code).
        let vars32: Vec<Var> = args32
            .iter()
            .map(|a| Var::from_tensor(a).unwrap())
            .collect();
        let args32: Vec<Tensor> = vars32.iter().map(|v| v.as_tensor().clone()).collect();
        let w32 = w.to_dtype(DType::F32).unwrap();
        let loss32 = (fused(&args32).unwrap() * &w32).unwrap().sum_all().unwrap();
        let got32 = loss32.backward().unwrap();
        for (i, (v32, v64)) in vars32.iter().zip(&vars).enumerate() {
            let g32 = flat(got32.get(v32.as_tensor()).expect("a gradient"));
            let g64 = flat(got.get(v64.as_tensor()).expect("a gradient"));
            let scale = g64.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            assert!(
                max_diff(&g32, &g64) < 1e-4 * scale,
                "input {i}: f32 {g32:?} vs f64 {g64:?}"
            );
        }
    }

    fn composite_softmax(x: &Tensor) -> Result<Tensor> {
        let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?)?.exp()?;
        e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
    }

    /// Every kernel path's f32 product on the operand layouts the ops use (rows,
    /// transposed, one head of interleaved heads) equals the product summed in f64.
    #[test]
    fn products_on_every_path_take_the_strided_operands() {
        let (m, n, k, heads) = (37, 29, 70, 2);
        let a: Vec<f32> = values(m * k * heads, 3).iter().map(|&x| x as f32).collect();
        let b: Vec<f32> = values(k * n, 4).iter().map(|&x| x as f32).collect();
        // (lhs element (i, p), the operand) for: rows of [m, k]; the transpose of [k, m];
        // head 1 of [m, heads·k].
        type Element<'a> = Box<dyn Fn(usize, usize) -> f32 + 'a>;
        let layouts: [(Element, Operand<f32>); 3] = [
            (Box::new(|i, p| a[i * k + p]), Operand::rows(&a, k)),
            (Box::new(|i, p| a[p * m + i]), Operand::transposed(&a, m)),
            (
                Box::new(|i, p| a[i * heads * k + k + p]),
                Operand {
                    data: &a[k..],
                    rs: heads * k,
                    cs: 1,
                },
            ),
        ];
        for path in crate::kernels::Path::all() {
            for (at, lhs) in &layouts {
                for par in [gemm::Parallelism::None, gemm::Parallelism::Rayon(2)] {
                    let got = matmul_f32_on(path, par, (m, n, k), *lhs, Operand::rows(&b, n));
                    for i in 0..m {
                        for j in 0..n {
                            let want: f64 = (0..k)
                                .map(|p| f64::from(at(i, p)) * f64::from(b[p * n + j]))
                                .sum();
                            let g = f64::from(got[i * n + j]);
                            assert!(
                                (g - want).abs() < 1e-4,
                                "{path:?} ({i}, {j}): {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Against products and the Θ op of the unfused path (candle's own `gelu_erf`
    /// gradient is off by ~2e-5 relative, see [`theta`]'s tests).
    /// Also on more rows than two of the row-blocked passes' blocks, the last one short.
    #[test]
    fn pattention_has_the_composite_values_and_gradients() {
        for rows in [5, 2 * pattention::BLOCK_ROWS + 37] {
            check(
                &|a| pattention(&a[0], &a[1], &a[2], 9),
                &|a| theta::l2_norm_gelu(&a[0].matmul(&a[1].t()?)?, 9)?.matmul(&a[2]),
                &[&[rows, 7], &[6, 7], &[6, 4]],
            );
        }
    }

    /// No tokens, no input features or no output features: zeros of the right shapes
    /// and gradients, as the composite gives, not a panic.
    #[test]
    fn an_empty_pattention_gives_zeros() {
        for (x, k, v) in [
            ([3, 4], [0, 4], [0, 2]),
            ([3, 0], [5, 0], [5, 2]),
            ([3, 4], [5, 4], [5, 0]),
            ([0, 4], [5, 4], [5, 2]),
        ] {
            let vars = [input(&x, 1), input(&k, 2), input(&v, 3)];
            let y = pattention(&vars[0], &vars[1], &vars[2], 5).unwrap();
            assert_eq!(y.dims(), &[x[0], v[1]]);
            assert!(flat(&y).iter().all(|&e| e == 0.0));
            let grads = y.sum_all().unwrap().backward().unwrap();
            for var in &vars {
                let g = grads.get(var.as_tensor()).expect("a gradient");
                assert_eq!(g.dims(), var.dims());
                assert!(flat(g).iter().all(|&e| e == 0.0), "{:?}", var.dims());
            }
        }
    }

    #[test]
    fn layer_norm_has_the_composite_values_and_gradients() {
        // Rows shorter and longer than the f32 kernels' 32 lanes.
        for shape in [[2, 3, 10], [2, 2, 75]] {
            check(
                &|a| layer_norm(&a[0], 1e-5),
                &|a| {
                    let c = a[0].broadcast_sub(&a[0].mean_keepdim(D::Minus1)?)?;
                    c.broadcast_div(&(c.sqr()?.mean_keepdim(D::Minus1)? + 1e-5)?.sqrt()?)
                },
                &[&shape],
            );
        }
    }

    #[test]
    fn scaled_softmax_has_the_composite_values_and_gradients() {
        for shape in [[3, 2, 9], [2, 2, 70]] {
            check(
                &|a| softmax_scaled(&a[0], 0.7),
                &|a| composite_softmax(&(&a[0] * 0.7)?),
                &[&shape],
            );
        }
        // Masked entries get exactly 0 and pass no gradient; a fully masked row is zeros.
        let x = Tensor::new(
            &[[1f32, f32::NEG_INFINITY, 2.0], [f32::NEG_INFINITY; 3]],
            &Device::Cpu,
        )
        .unwrap();
        let y: Vec<Vec<f32>> = softmax_scaled(&x, 1.0).unwrap().to_vec2().unwrap();
        assert_eq!(y[0][1], 0.0);
        assert!((y[0][0] - 1.0 / (1.0 + 1f32.exp())).abs() < 1e-7);
        assert_eq!(y[1], vec![0.0; 3]);
    }

    /// The composite per-head attention of [`super::super::lm::attention`]'s other path.
    fn composite_attention(a: &[Tensor], heads: usize, causal: bool) -> Result<Tensor> {
        let (b, t, d) = a[0].dims3()?;
        let split = |x: &Tensor| {
            x.reshape((b, t, heads, d / heads))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(&a[0])?, split(&a[1])?, split(&a[2])?);
        let mut s = (q.matmul(&k.t()?.contiguous()?)? * 0.5)?;
        if causal {
            let mask: Vec<f64> = (0..t * t)
                .map(|i| {
                    if i % t <= i / t {
                        0.0
                    } else {
                        f64::NEG_INFINITY
                    }
                })
                .collect();
            s = s.broadcast_add(&Tensor::from_vec(mask, (t, t), &Device::Cpu)?)?;
        }
        composite_softmax(&s)?
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, d))
    }

    #[test]
    fn attention_has_the_composite_values_and_gradients() {
        for causal in [false, true] {
            check(
                &move |a| attention(&a[0], &a[1], &a[2], 3, 0.5, causal),
                &move |a| composite_attention(a, 3, causal),
                &[&[2, 5, 6], &[2, 5, 6], &[2, 5, 6]],
            );
        }
    }

    /// The block as the separate ops compose it: LayerNorms, Pattentions (Θ by its
    /// own op), rotary, attention and the residual additions.
    fn composite_block(
        a: &[Tensor],
        spec: &BlockSpec,
        rot: Option<&RotaryTables>,
    ) -> Result<Tensor> {
        let (x, keys, values) = (&a[0], &a[1], &a[2]);
        let (b, t, d) = x.dims3()?;
        let ln = |x: &Tensor| -> Result<Tensor> {
            let c = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
            c.broadcast_div(&(c.sqr()?.mean_keepdim(D::Minus1)? + spec.eps)?.sqrt()?)
        };
        let [nq, no, _] = spec.tokens;
        let starts = [0, nq, 2 * nq, 3 * nq, 3 * nq + no];
        let part = |i: usize, input: &Tensor| -> Result<Tensor> {
            let n = [nq, nq, nq, no, spec.tokens[2]][i];
            let (k, v) = (
                keys.narrow(0, starts[i], n)?,
                values.narrow(0, starts[i], n)?,
            );
            let scale = spec.scale_tokens[[0, 0, 0, 1, 2][i]];
            theta::l2_norm_gelu(&input.reshape((b * t, d))?.matmul(&k.t()?)?, scale)?
                .matmul(&v)?
                .reshape((b, t, d))
        };
        let rotate = |x: Tensor| -> Result<Tensor> {
            let Some(r) = rot else { return Ok(x) };
            let table = |v: &[f64]| {
                Tensor::from_vec(v[..t * r.dims].to_vec(), (t, 1, r.dims), &Device::Cpu)
            };
            let hd = d / spec.heads;
            super::super::lm::rotate(
                &x.reshape((b, t, spec.heads, hd))?,
                r.dims,
                &table(&r.cos)?,
                &table(&r.sin)?,
            )?
            .reshape((b, t, d))
        };
        let h = ln(x)?;
        let (q, k, v) = (rotate(part(0, &h)?)?, rotate(part(1, &h)?)?, part(2, &h)?);
        let attn = part(
            3,
            &composite_attention(&[q, k, v], spec.heads, spec.causal)?,
        )?;
        let x1 = (x + attn)?;
        if spec.parallel_residual {
            x1 + part(4, &h)?
        } else {
            let h2 = ln(&x1)?;
            &x1 + part(4, &h2)?
        }
    }

    #[test]
    fn a_block_has_the_composite_values_and_gradients() {
        // d 8 in 2 heads of 4 (composite_attention scales by 1/√4), 3/4/6 tokens.
        let t = 5;
        let tables = RotaryTables {
            dims: 2,
            cos: (0..t * 2).map(|i| ((i / 2) as f64 * 0.7).cos()).collect(),
            sin: (0..t * 2).map(|i| ((i / 2) as f64 * 0.7).sin()).collect(),
        };
        // The last case on more rows than two of the Pattentions' row blocks.
        let many = (2 * pattention::BLOCK_ROWS).div_ceil(t) + 7;
        for (causal, parallel, rotary, batch) in [
            (false, false, false, 2),
            (true, false, true, 2),
            (true, true, true, 2),
            (true, false, true, many),
        ] {
            let spec = BlockSpec {
                heads: 2,
                tokens: [3, 4, 6],
                scale_tokens: [3, 5, 7],
                causal,
                parallel_residual: parallel,
                eps: 1e-5,
            };
            let rot = rotary.then(|| tables.clone());
            let (s1, s2, r1, r2) = (spec.clone(), spec.clone(), rot.clone(), rot.clone());
            check(
                &move |a| block(&a[0], &a[1], &a[2], &s1, r1.clone()),
                &move |a| composite_block(a, &s2, r2.as_ref()),
                &[&[batch, t, 8], &[19, 8], &[19, 8]],
            );
        }
    }

    #[test]
    fn the_head_and_loss_have_the_composite_values_and_gradients() {
        let targets = [3u32, 0, 8, 8, 5];
        check(
            &move |a| head_cross_entropy(&a[0], &a[1], &targets),
            &move |a| super::super::loss::cross_entropy(&a[0].matmul(&a[1].t()?)?, &targets),
            &[&[5, 7], &[9, 7]],
        );
    }
}
