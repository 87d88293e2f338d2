//! The training forward's hot pieces as single nodes of candle's graph, each with its
//! own backward, on the CPU in f32 and f64: a whole Pattention Θ(x·Kᵀ)·V, the
//! non-parametric LayerNorm and a scaled softmax. Composed from candle ops, one
//! Pattention is six nodes and a LayerNorm seven; candle's backward then allocates a
//! zeroed gradient for every node and adds into it, so most of a small model's step
//! went to element-wise passes, not to products (docs/PERFORMANCE.md). Other devices
//! and dtypes keep the composite ops in [`super::lm`], which are also what the tests
//! hold these against.

use std::sync::Mutex;

use candle_core::{
    CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor,
    WithDType,
};
use rayon::prelude::*;

use super::theta;

/// Whether the fused ops serve `t`: f32 or f64 on the CPU.
pub(super) fn serves(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// The element types of the fused ops.
trait Elem: WithDType + Copy + Send + Sync + Into<f64> {
    /// e^x (f32: the inference kernels' vectorisable exp, ≈1 ulp).
    fn exp_fast(self) -> Self;
    /// dst [m, n] (row-major, fresh) = lhs · rhs on `par`'s threads.
    fn matmul_on(
        par: gemm::Parallelism,
        mnk: (usize, usize, usize),
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    ) -> Vec<Self>;

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
    fn theta(s: &[Self], n: usize, c: f64) -> Vec<Self>;
    /// Θ's backward, the scores turned into their gradient in place.
    fn theta_grad(s: Vec<Self>, dy: &[Self], n: usize, c: f64) -> Vec<Self>;
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
fn product<T: Copy + Default>(
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
        return vec![T::default(); m * n];
    }
    let mut dst = Vec::<T>::with_capacity(m * n);
    call(dst.as_mut_ptr());
    // SAFETY: the kernel wrote all m·n elements of dst (it never reads them).
    unsafe { dst.set_len(m * n) };
    dst
}

impl Elem for f32 {
    fn exp_fast(self) -> Self {
        crate::kernels::math::exp_f32(self)
    }
    fn matmul_on(
        par: gemm::Parallelism,
        mnk: (usize, usize, usize),
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    ) -> Vec<Self> {
        matmul_f32_on(crate::kernels::active(), par, mnk, lhs, rhs)
    }
    fn theta(s: &[Self], n: usize, c: f64) -> Vec<Self> {
        theta::forward_f32(s, n, c)
    }
    fn theta_grad(mut s: Vec<Self>, dy: &[Self], n: usize, c: f64) -> Vec<Self> {
        theta::backward_f32_in_place(&mut s, dy, n, c);
        s
    }
}

/// The f32 product on the kernels of `path` (our own sgemm on AVX2, the gemm crate's
/// otherwise).
fn matmul_f32_on(
    path: crate::kernels::Path,
    par: gemm::Parallelism,
    (m, n, k): (usize, usize, usize),
    lhs: Operand<f32>,
    rhs: Operand<f32>,
) -> Vec<f32> {
    product((m, n, k), &lhs, &rhs, |dst| {
        // SAFETY: the operands cover m×k and k×n elements (checked by `product`), dst
        // has room for m·n and overlaps neither.
        unsafe {
            crate::kernels::gemm_f32(
                path,
                (m, n, k),
                (dst, 1, n as isize),
                (lhs.data.as_ptr(), lhs.cs as isize, lhs.rs as isize),
                (rhs.data.as_ptr(), rhs.cs as isize, rhs.rs as isize),
                1.0,
                par,
            )
        }
    })
}

impl Elem for f64 {
    fn exp_fast(self) -> Self {
        f64::exp(self)
    }
    fn matmul_on(
        par: gemm::Parallelism,
        (m, n, k): (usize, usize, usize),
        lhs: Operand<Self>,
        rhs: Operand<Self>,
    ) -> Vec<Self> {
        product((m, n, k), &lhs, &rhs, |dst| {
            // SAFETY: as for f32.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    dst,
                    1,
                    n as isize,
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
        })
    }
    fn theta(s: &[Self], n: usize, c: f64) -> Vec<Self> {
        theta::forward(s, n, c)
    }
    fn theta_grad(s: Vec<Self>, dy: &[Self], n: usize, c: f64) -> Vec<Self> {
        theta::backward(&s, dy, n, c)
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
fn read<T: Elem, R>(t: &Tensor, what: &str, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
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

/// Θ(x·Kᵀ)·V with Θ = l2_norm_gelu of constant √`scale_tokens`, for x [.., d] (any
/// leading axes: rows), K [n, d] and V [n, out], as one node whose backward gives ∂x,
/// ∂K and ∂V. Taking x as it is saves reshape nodes, each of which costs the backward
/// a zeroed gradient and an addition.
pub(super) fn pattention(
    x: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale_tokens: usize,
) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        Three(Pattention {
            c: (scale_tokens as f64).sqrt(),
            saved: Mutex::new(None),
        }),
    )
}

struct Pattention {
    c: f64,
    /// The forward's scores and weights, for the backward (taken by it).
    saved: Mutex<Option<(CpuStorage, CpuStorage)>>,
}

/// Rows, inner width, tokens and output width of a Pattention's operands.
fn pattention_dims(x: &Layout, k: &Layout, v: &Layout) -> Result<(usize, usize, usize, usize)> {
    let (d, r) = match x.dims() {
        [lead @ .., d] if !lead.is_empty() => (*d, lead.iter().product()),
        _ => candle_core::bail!("pattention: x of shape {:?} has no rows", x.dims()),
    };
    let (n, dk) = k.shape().dims2()?;
    let (nv, o) = v.shape().dims2()?;
    if d != dk || n != nv {
        candle_core::bail!(
            "pattention: x {:?}, keys {:?} and values {:?} do not fit",
            x.dims(),
            k.dims(),
            v.dims()
        )
    }
    Ok((r, d, n, o))
}

impl Pattention {
    /// Scores x·Kᵀ [r, n] and weights Θ(scores).
    fn scores<T: Elem>(
        &self,
        x: &[T],
        k: &[T],
        (r, d, n): (usize, usize, usize),
    ) -> (Vec<T>, Vec<T>) {
        let s = T::matmul(r, n, d, Operand::rows(x, d), Operand::transposed(k, d));
        let w = T::theta(&s, n, self.c);
        (s, w)
    }

    fn fwd<T: Elem>(
        &self,
        x: &[T],
        k: &[T],
        v: &[T],
        dims: (usize, usize, usize, usize),
    ) -> Vec<T> {
        let (r, d, n, o) = dims;
        let (s, w) = self.scores(x, k, (r, d, n));
        let y = T::matmul(r, o, n, Operand::rows(&w, n), Operand::rows(v, o));
        *self.saved.lock().expect("not poisoned") =
            Some((T::to_cpu_storage_owned(s), T::to_cpu_storage_owned(w)));
        y
    }

    /// (∂x, ∂K, ∂V) from ∂y; `g` [r, o].
    fn bwd_t<T: Elem>(
        &self,
        (x, k, v, g): (&[T], &[T], &[T], &[T]),
        (r, d, n, o): (usize, usize, usize, usize),
    ) -> Result<[Vec<T>; 3]> {
        let saved = self.saved.lock().expect("not poisoned").take();
        // A second backward over the same graph recomputes what the first one took.
        let (s, w) = match saved {
            Some((s, w)) => match (T::cpu_storage_data(s), T::cpu_storage_data(w)) {
                (Ok(s), Ok(w)) => (s, w),
                _ => candle_core::bail!("pattention: saved scores of another dtype"),
            },
            None => self.scores(x, k, (r, d, n)),
        };
        let dw = T::matmul(r, n, o, Operand::rows(g, o), Operand::transposed(v, o));
        let dv = T::matmul_long(n, o, r, Operand::transposed(&w, n), Operand::rows(g, o));
        drop(w);
        let ds = T::theta_grad(s, &dw, n, self.c);
        drop(dw);
        let dx = T::matmul(r, d, n, Operand::rows(&ds, n), Operand::rows(k, d));
        let dk = T::matmul_long(n, d, r, Operand::transposed(&ds, n), Operand::rows(x, d));
        Ok([dx, dk, dv])
    }
}

impl ThreeOp for Pattention {
    const NAME: &'static str = "pattention-train";
    type Dims = (usize, usize, usize, usize);

    fn dims(&self, x: &Layout, k: &Layout, v: &Layout) -> Result<Self::Dims> {
        pattention_dims(x, k, v)
    }

    fn out_shape(&self, x: &Layout, (.., o): Self::Dims) -> Shape {
        let mut shape = x.dims().to_vec();
        *shape.last_mut().expect("checked by pattention_dims") = o;
        Shape::from(shape)
    }

    fn fwd<T: Elem>(&self, x: &[T], k: &[T], v: &[T], dims: Self::Dims) -> Vec<T> {
        Pattention::fwd(self, x, k, v, dims)
    }

    fn bwd<T: Elem>(&self, ops: (&[T], &[T], &[T], &[T]), dims: Self::Dims) -> Result<[Vec<T>; 3]> {
        self.bwd_t(ops, dims)
    }
}

/// (x − mean) / √(var + eps) over the last axis (biased variance, as torch), one node.
pub(super) fn layer_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Rows(LayerNorm { eps }))
}

struct LayerNorm {
    eps: f64,
}

/// A row's mean and 1/√(var + eps), summed in f64.
fn moments<T: Elem>(row: &[T], eps: f64) -> (f64, f64) {
    let n = row.len().max(1) as f64;
    let mean = row.iter().map(|&x| x.into()).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&x| {
            let c = x.into() - mean;
            c * c
        })
        .sum::<f64>()
        / n;
    (mean, 1.0 / (var + eps).sqrt())
}

fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1).max(1)
}

impl LayerNorm {
    fn fwd<T: Elem>(&self, x: &[T], n: usize) -> Vec<T> {
        let mut y = x.to_vec();
        y.par_chunks_mut(n).for_each(|row| {
            let (mean, inv) = moments(row, self.eps);
            for v in row.iter_mut() {
                *v = T::from_f64(((*v).into() - mean) * inv);
            }
        });
        y
    }

    /// ∂x = (g − mean(g) − x̂ · mean(g · x̂)) / σ, with x̂ the forward's output.
    fn bwd_t<T: Elem>(&self, x: &[T], y: &[T], g: &[T], n: usize) -> Vec<T> {
        let mut dx = g.to_vec();
        dx.par_chunks_mut(n)
            .zip(x.par_chunks(n).zip(y.par_chunks(n)))
            .for_each(|(dx, (x, y))| {
                let (_, inv) = moments(x, self.eps);
                let (mut sg, mut sgy) = (0f64, 0f64);
                for (&g, &y) in dx.iter().zip(y) {
                    sg += g.into();
                    sgy += g.into() * y.into();
                }
                let (mg, mgy) = (sg / n as f64, sgy / n as f64);
                for (g, &y) in dx.iter_mut().zip(y) {
                    *g = T::from_f64(((*g).into() - mg - y.into() * mgy) * inv);
                }
            });
        dx
    }
}

impl RowOp for LayerNorm {
    const NAME: &'static str = "layer-norm-train";

    fn fwd<T: Elem>(&self, x: &[T], n: usize) -> Vec<T> {
        LayerNorm::fwd(self, x, n)
    }

    fn bwd<T: Elem>(&self, x: &[T], y: &[T], g: &[T], n: usize) -> Vec<T> {
        self.bwd_t(x, y, g, n)
    }
}

/// softmax(scale · x) over the last axis, one node. Entries of −∞ (a mask) get weight
/// 0; a row of nothing but −∞ gets all zeros (no NaN).
pub(super) fn softmax_scaled(x: &Tensor, scale: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Rows(Softmax { scale }))
}

struct Softmax {
    scale: f64,
}

/// dst = softmax(scale · src) for one row; a row of nothing but −∞ gets all zeros.
fn softmax_row<T: Elem>(src: &[T], dst: &mut [T], scale: f64) {
    let max = src
        .iter()
        .map(|&x| x.into())
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        dst.iter_mut().for_each(|v| *v = T::zero());
        return;
    }
    let shift = T::from_f64(max * scale);
    let scale = T::from_f64(scale);
    // Arguments below ln(f32::MIN_POSITIVE) (masked ones among them) give an exact 0:
    // weights of ~1e-38 would make the backward's products subnormal, and subnormal
    // arithmetic is ~100 times slower.
    let floor = T::from_f64(-87.0);
    let mut sum = 0f64;
    for (d, &x) in dst.iter_mut().zip(src) {
        let a = x * scale - shift;
        let e = if a < floor { T::zero() } else { a.exp_fast() };
        sum += e.into();
        *d = e;
    }
    let inv = T::from_f64(1.0 / sum);
    dst.iter_mut().for_each(|v| *v *= inv);
}

/// dP becomes dS = scale · P · (dP − Σ dP·P) for one row.
fn softmax_grad_row<T: Elem>(dp: &mut [T], p: &[T], scale: f64) {
    let dot: f64 = dp.iter().zip(p).map(|(&g, &y)| g.into() * y.into()).sum();
    let (dot, scale) = (T::from_f64(dot), T::from_f64(scale));
    for (g, &y) in dp.iter_mut().zip(p) {
        *g = scale * y * (*g - dot);
    }
}

impl Softmax {
    fn fwd<T: Elem>(&self, x: &[T], n: usize) -> Vec<T> {
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(n)
            .zip(x.par_chunks(n))
            .for_each(|(y, x)| softmax_row(x, y, self.scale));
        y
    }

    /// ∂x = scale · y · (g − Σ g·y).
    fn bwd_t<T: Elem>(&self, y: &[T], g: &[T], n: usize) -> Vec<T> {
        let mut dx = g.to_vec();
        dx.par_chunks_mut(n)
            .zip(y.par_chunks(n))
            .for_each(|(dx, y)| softmax_grad_row(dx, y, self.scale));
        dx
    }
}

impl RowOp for Softmax {
    const NAME: &'static str = "softmax-train";

    fn fwd<T: Elem>(&self, x: &[T], n: usize) -> Vec<T> {
        Softmax::fwd(self, x, n)
    }

    fn bwd<T: Elem>(&self, _: &[T], y: &[T], g: &[T], n: usize) -> Vec<T> {
        self.bwd_t(y, g, n)
    }
}

/// softmax(scale · q_h·k_hᵀ)·v_h for every head h, causal (query i sees keys 0..=i) or
/// not, for q, k, v [b, t, d] with `heads` heads of d/heads side by side along d (the
/// Pattention outputs as they are, no transposition), one node whose backward gives
/// ∂q, ∂k and ∂v. Heads run in parallel, each product on one thread.
pub(super) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    scale: f64,
    causal: bool,
) -> Result<Tensor> {
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        Three(Attention {
            heads,
            scale,
            causal,
            saved: Mutex::new(None),
        }),
    )
}

struct Attention {
    heads: usize,
    scale: f64,
    causal: bool,
    /// The forward's probabilities [b·heads, t, t], for the backward (taken by it).
    saved: Mutex<Option<CpuStorage>>,
}

/// (batch, tokens, width) of q, k and v.
fn attention_dims(
    q: &Layout,
    k: &Layout,
    v: &Layout,
    heads: usize,
) -> Result<(usize, usize, usize)> {
    let dims = q.shape().dims3()?;
    if k.shape().dims3()? != dims || v.shape().dims3()? != dims || heads == 0 || dims.2 % heads != 0
    {
        candle_core::bail!(
            "attention: q {:?}, k {:?}, v {:?} with {heads} heads do not fit",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    Ok(dims)
}

impl Attention {
    /// Head `bh` (batch·heads + head) of x [b, t, d] as a [t, d/heads] operand, or as
    /// its transpose.
    fn head<'a, T>(
        &self,
        x: &'a [T],
        (t, d): (usize, usize),
        bh: usize,
        transposed: bool,
    ) -> Operand<'a, T> {
        let hd = d / self.heads;
        let data = &x[(bh / self.heads) * t * d + (bh % self.heads) * hd..];
        if transposed {
            Operand { data, rs: 1, cs: d }
        } else {
            Operand { data, rs: d, cs: 1 }
        }
    }

    /// Per-head [t, d/heads] blocks back into one [b, t, d] buffer.
    fn gather<T: Elem>(&self, blocks: &[Vec<T>], (b, t, d): (usize, usize, usize)) -> Vec<T> {
        let hd = d / self.heads;
        let mut out = vec![T::zero(); b * t * d];
        out.par_chunks_mut(t * d).enumerate().for_each(|(bi, out)| {
            for h in 0..self.heads {
                let block = &blocks[bi * self.heads + h];
                for (row, src) in out.chunks_mut(d).zip(block.chunks(hd)) {
                    row[h * hd..(h + 1) * hd].copy_from_slice(src);
                }
            }
        });
        out
    }

    fn probs<T: Elem>(&self, q: &[T], k: &[T], (b, t, d): (usize, usize, usize)) -> Vec<T> {
        let hd = d / self.heads;
        let mut p = vec![T::zero(); b * self.heads * t * t];
        p.par_chunks_mut(t * t).enumerate().for_each(|(bh, p)| {
            let s = T::matmul_serial(
                t,
                t,
                hd,
                self.head(q, (t, d), bh, false),
                self.head(k, (t, d), bh, true),
            );
            for (i, (p, s)) in p.chunks_mut(t).zip(s.chunks(t)).enumerate() {
                let keys = if self.causal { i + 1 } else { t };
                softmax_row(&s[..keys], &mut p[..keys], self.scale);
            }
        });
        p
    }

    fn fwd<T: Elem>(&self, q: &[T], k: &[T], v: &[T], dims: (usize, usize, usize)) -> Vec<T> {
        let (b, t, d) = dims;
        let hd = d / self.heads;
        let p = self.probs(q, k, dims);
        let blocks: Vec<Vec<T>> = (0..b * self.heads)
            .into_par_iter()
            .map(|bh| {
                T::matmul_serial(
                    t,
                    hd,
                    t,
                    Operand::rows(&p[bh * t * t..], t),
                    self.head(v, (t, d), bh, false),
                )
            })
            .collect();
        *self.saved.lock().expect("not poisoned") = Some(T::to_cpu_storage_owned(p));
        self.gather(&blocks, dims)
    }

    fn bwd_t<T: Elem>(
        &self,
        (q, k, v, g): (&[T], &[T], &[T], &[T]),
        dims: (usize, usize, usize),
    ) -> Result<[Vec<T>; 3]> {
        let (b, t, d) = dims;
        let hd = d / self.heads;
        let saved = self.saved.lock().expect("not poisoned").take();
        let p = match saved.map(T::cpu_storage_data) {
            Some(Ok(p)) => p,
            Some(Err(_)) => candle_core::bail!("attention: saved probabilities of another dtype"),
            None => self.probs(q, k, dims),
        };
        let grads: Vec<[Vec<T>; 3]> = (0..b * self.heads)
            .into_par_iter()
            .map(|bh| {
                let p = &p[bh * t * t..(bh + 1) * t * t];
                let head = |x, transposed| self.head(x, (t, d), bh, transposed);
                let dv = T::matmul_serial(t, hd, t, Operand::transposed(p, t), head(g, false));
                let mut ds = T::matmul_serial(t, t, hd, head(g, false), head(v, true));
                for (ds, p) in ds.chunks_mut(t).zip(p.chunks(t)) {
                    softmax_grad_row(ds, p, self.scale);
                }
                let dq = T::matmul_serial(t, hd, t, Operand::rows(&ds, t), head(k, false));
                let dk = T::matmul_serial(t, hd, t, Operand::transposed(&ds, t), head(q, false));
                [dq, dk, dv]
            })
            .collect();
        let [mut dq, mut dk, mut dv] = [vec![], vec![], vec![]];
        for [q, k, v] in grads {
            dq.push(q);
            dk.push(k);
            dv.push(v);
        }
        Ok([
            self.gather(&dq, dims),
            self.gather(&dk, dims),
            self.gather(&dv, dims),
        ])
    }
}

impl ThreeOp for Attention {
    const NAME: &'static str = "attention-train";
    type Dims = (usize, usize, usize);

    fn dims(&self, q: &Layout, k: &Layout, v: &Layout) -> Result<Self::Dims> {
        attention_dims(q, k, v, self.heads)
    }

    fn out_shape(&self, _: &Layout, dims: Self::Dims) -> Shape {
        Shape::from(dims)
    }

    fn fwd<T: Elem>(&self, q: &[T], k: &[T], v: &[T], dims: Self::Dims) -> Vec<T> {
        Attention::fwd(self, q, k, v, dims)
    }

    fn bwd<T: Elem>(&self, ops: (&[T], &[T], &[T], &[T]), dims: Self::Dims) -> Result<[Vec<T>; 3]> {
        self.bwd_t(ops, dims)
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

    fn flat(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

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
                let fd = (at(1e-6) - at(-1e-6)) / 2e-6;
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
    #[test]
    fn pattention_has_the_composite_values_and_gradients() {
        check(
            &|a| pattention(&a[0], &a[1], &a[2], 9),
            &|a| theta::l2_norm_gelu(&a[0].matmul(&a[1].t()?)?, 9)?.matmul(&a[2]),
            &[&[5, 7], &[6, 7], &[6, 4]],
        );
    }

    #[test]
    fn layer_norm_has_the_composite_values_and_gradients() {
        check(
            &|a| layer_norm(&a[0], 1e-5),
            &|a| {
                let c = a[0].broadcast_sub(&a[0].mean_keepdim(D::Minus1)?)?;
                c.broadcast_div(&(c.sqr()?.mean_keepdim(D::Minus1)? + 1e-5)?.sqrt()?)
            },
            &[&[2, 3, 10]],
        );
    }

    #[test]
    fn scaled_softmax_has_the_composite_values_and_gradients() {
        check(
            &|a| softmax_scaled(&a[0], 0.7),
            &|a| composite_softmax(&(&a[0] * 0.7)?),
            &[&[3, 2, 9]],
        );
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
}
