//! Fused multi-head attention for the CPU: softmax(q·kᵀ/√d)·v per (batch,
//! head, block of queries) on one thread each, so the score block stays in L2
//! and no [heads, t, t] tensor exists (FlashAttention's idea without online
//! rescaling: a whole score row fits in cache at these context lengths).
//! q/k/v are read through their strides (head-transposed views need no copy);
//! the output is written straight into [b, t, h·d]. Keys and values may be
//! f32 or f16 (an f16 KV cache): f16 rows are widened in registers as they
//! are read.

use ::half::f16;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::matmul::gemm_f32;
use super::{active, Path};
use std::cell::RefCell;

/// Queries per task: 128 rows × 2048 keys of f32 scores is 1 MiB, inside a
/// 2 MiB L2 (block sizes compared in docs/PERFORMANCE.md).
const QUERY_BLOCK: usize = 128;

/// Queries per task on the AVX-512 block kernel.
#[cfg(target_arch = "x86_64")]
const FAST_BLOCK: usize = super::attention_avx512::BLOCK;
#[cfg(not(target_arch = "x86_64"))]
const FAST_BLOCK: usize = QUERY_BLOCK;

/// Keys from which the AVX-512 kernel's strided f32 keys and values are laid
/// out per head: a third faster at 2,048, even at 1,024, slower below
/// (the copy is not repaid by the few blocks that read it).
#[cfg(target_arch = "x86_64")]
const LAY_OUT_FROM: usize = 1024;

/// Blocks of at most this many queries (decoding) take dot products and
/// weighted sums with the cached rows instead of gemm.
const FEW_QUERIES: usize = 8;

struct Attention {
    causal: bool,
    scale: f32,
    path: Path,
}

/// The element types of keys and values: the row kernels of decoding, and
/// rows as f32 for gemm.
trait KvElem: Copy + Sync {
    fn data(s: &CpuStorage) -> Option<&[Self]>;
    /// out[j] = scale · (q · row j), rows `stride` apart.
    fn dot_rows(path: Path, q: &[f32], rows: &[Self], stride: usize, scale: f32, out: &mut [f32]);
    /// out += Σ_j p[j] · row j, rows `stride` apart.
    fn axpy_rows(path: Path, p: &[f32], rows: &[Self], stride: usize, out: &mut [f32]);
    /// Whether rows are widened to be read as f32.
    const HALF: bool;
    /// A row as f32 into `dst` (copied or widened).
    fn widen(row: &[Self], dst: &mut [f32]);
    /// `n` rows of `hd` features `stride` apart from `rows` as f32 for gemm:
    /// (pointer, row stride), the rows themselves or widened into `buf`.
    ///
    /// # Safety
    /// The n rows must be readable.
    unsafe fn as_f32(
        rows: *const Self,
        stride: usize,
        n: usize,
        hd: usize,
        buf: &mut Vec<f32>,
    ) -> (*const f32, usize);
}

impl KvElem for f32 {
    const HALF: bool = false;
    fn widen(row: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(row)
    }
    fn data(s: &CpuStorage) -> Option<&[f32]> {
        match s {
            CpuStorage::F32(d) => Some(d),
            _ => None,
        }
    }
    fn dot_rows(path: Path, q: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
        super::rows::dot_rows_on(path, q, rows, stride, scale, out)
    }
    fn axpy_rows(path: Path, p: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        super::rows::axpy_rows_on(path, p, rows, stride, out)
    }
    unsafe fn as_f32(
        rows: *const f32,
        stride: usize,
        _: usize,
        _: usize,
        _: &mut Vec<f32>,
    ) -> (*const f32, usize) {
        (rows, stride)
    }
}

/// Half-precision keys and values (an f16 KV cache, or a model computing in
/// bf16 or f16): the row kernels of [`super::half`], rows widened for gemm.
macro_rules! half_kv {
    ($t:ty, $variant:ident) => {
        impl KvElem for $t {
            const HALF: bool = true;
            fn widen(row: &[$t], dst: &mut [f32]) {
                use ::half::slice::HalfFloatSliceExt;
                row.convert_to_f32_slice(dst)
            }
            fn data(s: &CpuStorage) -> Option<&[$t]> {
                match s {
                    CpuStorage::$variant(d) => Some(d),
                    _ => None,
                }
            }
            fn dot_rows(
                path: Path,
                q: &[f32],
                rows: &[$t],
                stride: usize,
                scale: f32,
                out: &mut [f32],
            ) {
                super::half::dot_rows_strided_on(path, q, rows, stride, scale, out)
            }
            fn axpy_rows(path: Path, p: &[f32], rows: &[$t], stride: usize, out: &mut [f32]) {
                super::half::axpy_rows_on(path, p, rows, stride, out)
            }
            unsafe fn as_f32(
                rows: *const $t,
                stride: usize,
                n: usize,
                hd: usize,
                buf: &mut Vec<f32>,
            ) -> (*const f32, usize) {
                // Widening once per query block is a small part of a prefill's gemm.
                buf.resize(n * hd, 0.0);
                for (r, dst) in buf.chunks_exact_mut(hd).enumerate() {
                    // SAFETY: the caller guarantees the n rows.
                    Self::widen(
                        unsafe { std::slice::from_raw_parts(rows.add(r * stride), hd) },
                        dst,
                    );
                }
                (buf.as_ptr(), hd)
            }
        }
    };
}
half_kv!(f16, F16);
half_kv!(::half::bf16, BF16);

/// Offset and [b, h, t, hd] strides of a CPU tensor of `T`s whose last axis is contiguous.
fn view<'a, T: KvElem>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<(&'a [T], usize, [usize; 3])> {
    let Some(data) = T::data(s) else {
        candle_core::bail!("attention {what}: unexpected dtype {:?}", s.dtype())
    };
    let st = l.stride();
    if st.len() != 4 || st[3] != 1 {
        candle_core::bail!("attention {what}: expected [b, h, t, hd] with a contiguous last axis")
    }
    Ok((data, l.start_offset(), [st[0], st[1], st[2]]))
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match (sk, sv) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => self.run::<f32>(sq, lq, sk, lk, sv, lv),
            (CpuStorage::F16(_), CpuStorage::F16(_)) => self.run::<f16>(sq, lq, sk, lk, sv, lv),
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => {
                self.run::<::half::bf16>(sq, lq, sk, lk, sv, lv)
            }
            _ => candle_core::bail!(
                "attention: keys {:?} and values {:?}: both f32, both f16 or both bf16",
                sk.dtype(),
                sv.dtype()
            ),
        }
    }
}

impl Attention {
    /// The kernel for keys and values of type `T` (queries and output f32).
    fn run<T: KvElem>(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, hd) = lq.shape().dims4()?;
        let keys = lk.shape().dims4()?.2;
        if lk.shape() != lv.shape() || lk.dims()[..2] != [b, h] || lk.dims()[3] != hd {
            candle_core::bail!(
                "attention: q {:?}, k {:?}, v {:?} do not match",
                lq.dims(),
                lk.dims(),
                lv.dims()
            )
        }
        if self.causal && keys < t {
            candle_core::bail!("attention: {t} causal queries but only {keys} keys")
        }
        let (q, q0, qs) = view::<f32>(sq, lq, "q")?;
        let (k, k0, ks) = view::<T>(sk, lk, "k")?;
        let (v, v0, vs) = view::<T>(sv, lv, "v")?;
        let mut out = vec![0f32; b * t * h * hd];
        // Every task writes a distinct (batch, head, query block) region.
        let out_ptr = super::SharedPtr(out.as_mut_ptr());
        // On AVX-512 the block kernel that packs neither keys nor values.
        #[cfg(target_arch = "x86_64")]
        let fast = self.path.isa() == super::Isa::Avx512 && super::attention_avx512::serves(hd);
        #[cfg(not(target_arch = "x86_64"))]
        let fast = false;
        let block = if fast { FAST_BLOCK } else { QUERY_BLOCK };
        // The block kernel reads all of a head's keys and values for each
        // block: half rows are widened once here, and strided ones (heads
        // interleaved, as projections leave them) are laid out as contiguous
        // f32 rows per head once there are enough of them that their reads
        // miss the TLB and the prefetchers (docs/PERFORMANCE.md).
        #[cfg(target_arch = "x86_64")]
        let laid = (fast
            && t > FEW_QUERIES
            && (T::HALF || ((ks[2] != hd || vs[2] != hd) && keys >= LAY_OUT_FROM)))
            .then(|| {
                (
                    heads_f32(k, k0, ks, (b, h, keys, hd)),
                    heads_f32(v, v0, vs, (b, h, keys, hd)),
                )
            });
        let blocks = t.div_ceil(block);
        let past = keys - t;
        (0..b * h * blocks).into_par_iter().for_each(|task| {
            let (bh, blk) = (task / blocks, task % blocks);
            let (bi, hi) = (bh / h, bh % h);
            let start = blk * block;
            let rows = block.min(t - start);
            // Causal: the block's last query sees keys up to its own position.
            let seen = if self.causal {
                past + start + rows
            } else {
                keys
            };
            let out = out_ptr;
            // Offsets inside each tensor (shapes checked above).
            let qp = q[q0 + bi * qs[0] + hi * qs[1] + start * qs[2]..].as_ptr();
            let kp = k[k0 + bi * ks[0] + hi * ks[1]..].as_ptr();
            let vp = v[v0 + bi * vs[0] + hi * vs[1]..].as_ptr();
            #[cfg(target_arch = "x86_64")]
            if fast && rows > FEW_QUERIES {
                // Empty unless rows are widened, which `laid` has done already.
                let (mut wk, mut wv) = (Vec::new(), Vec::new());
                // SAFETY: the block's rows lie inside q, k and v (shapes checked
                // above) or their laid-out copies; its output rows (bi, start..,
                // hi) belong to this task only.
                unsafe {
                    let ((k, k_stride), (v, v_stride)) = match &laid {
                        Some((kl, vl)) => {
                            let head = bh * keys * hd;
                            ((kl[head..].as_ptr(), hd), (vl[head..].as_ptr(), hd))
                        }
                        None => (
                            T::as_f32(kp, ks[2], seen, hd, &mut wk),
                            T::as_f32(vp, vs[2], seen, hd, &mut wv),
                        ),
                    };
                    let blk = super::attention_avx512::Block {
                        q: qp,
                        q_stride: qs[2],
                        k,
                        k_stride,
                        v,
                        v_stride,
                        out: out.0.add(((bi * t + start) * h + hi) * hd),
                        out_stride: h * hd,
                        rows,
                        hd,
                        seen,
                        first: self.causal.then_some(past + start + 1),
                        scale: self.scale,
                    };
                    FAST.with(|f| super::attention_avx512::block(&blk, &mut f.borrow_mut()));
                }
                return;
            }
            SCORES.with(|s| {
                let mut s = s.borrow_mut();
                if s.len() < rows * seen {
                    s.resize(rows * seen, 0.0);
                }
                let s = &mut s[..rows * seen];
                // SAFETY: offsets stay inside each tensor (shapes checked above);
                // the output rows (bi, start.., hi) belong to this task only.
                unsafe {
                    if rows <= FEW_QUERIES {
                        // Decoding: gemm would pack the cached keys and values
                        // (the bytes this step is bound by) to use them once.
                        for (r, sr) in s.chunks_mut(seen).enumerate() {
                            let valid = if self.causal {
                                past + start + r + 1
                            } else {
                                seen
                            };
                            let qr = std::slice::from_raw_parts(qp.add(r * qs[2]), hd);
                            let span = |stride: usize| (valid - 1) * stride + hd;
                            let keys = std::slice::from_raw_parts(kp, span(ks[2]));
                            T::dot_rows(self.path, qr, keys, ks[2], self.scale, &mut sr[..valid]);
                            super::rows::softmax_row_on(self.path, sr, valid);
                            let o = std::slice::from_raw_parts_mut(
                                out.0.add(((bi * t + start + r) * h + hi) * hd),
                                hd,
                            );
                            let values = std::slice::from_raw_parts(vp, span(vs[2]));
                            T::axpy_rows(self.path, &sr[..valid], values, vs[2], o);
                        }
                        return;
                    }
                    let mut wide = WIDE.with(|w| std::mem::take(&mut *w.borrow_mut()));
                    // s = scale · q_blk · kᵀ   [rows, seen]
                    let (kp, kstride) = T::as_f32(kp, ks[2], seen, hd, &mut wide);
                    gemm_f32(
                        self.path,
                        (rows, seen, hd),
                        (s.as_mut_ptr(), 1, seen as isize),
                        (qp, 1, qs[2] as isize),
                        (kp, kstride as isize, 1),
                        self.scale,
                        gemm::Parallelism::None,
                    );
                    for (r, row) in s.chunks_mut(seen).enumerate() {
                        let valid = if self.causal {
                            past + start + r + 1
                        } else {
                            seen
                        };
                        super::rows::softmax_row_on(self.path, row, valid);
                    }
                    // out[bi, start.., hi, :] = p · v   [rows, hd]
                    let op = out.0.add(((bi * t + start) * h + hi) * hd);
                    let (vp, vstride) = T::as_f32(vp, vs[2], seen, hd, &mut wide);
                    gemm_f32(
                        self.path,
                        (rows, hd, seen),
                        (op, 1, (h * hd) as isize),
                        (s.as_ptr(), 1, seen as isize),
                        (vp, 1, vstride as isize),
                        1.0,
                        gemm::Parallelism::None,
                    );
                    WIDE.with(|w| *w.borrow_mut() = wide);
                }
            });
        });
        Ok((CpuStorage::F32(out), Shape::from((b, t, h * hd))))
    }
}

/// The keys or values of every (batch, head) as contiguous f32 rows,
/// [b, h, n, hd], from `data` at `off` with [b, h, row] strides `st`.
#[cfg(target_arch = "x86_64")]
fn heads_f32<T: KvElem>(
    data: &[T],
    off: usize,
    st: [usize; 3],
    (b, h, n, hd): (usize, usize, usize, usize),
) -> Vec<f32> {
    let mut out = vec![0f32; b * h * n * hd];
    out.par_chunks_mut((n * hd).max(1))
        .enumerate()
        .for_each(|(bh, dst)| {
            let base = off + bh / h * st[0] + bh % h * st[1];
            for (r, row) in dst.chunks_exact_mut(hd).enumerate() {
                T::widen(&data[base + r * st[2]..][..hd], row);
            }
        });
    out
}

thread_local! {
    /// Each worker's score block, reused across tasks and calls.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Each worker's f16 keys or values widened for gemm.
    static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Each worker's buffers for the AVX-512 block kernel.
    #[cfg(target_arch = "x86_64")]
    static FAST: RefCell<super::attention_avx512::Scratch> = RefCell::default();
}

/// softmax(q·kᵀ/√hd)·v for q [b, h, t, hd] and k, v [b, h, T, hd] → [b, t, h·hd].
/// `causal`: query i (of the last t positions) sees keys 0..=T−t+i.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    let keys = k.dims4()?.2;
    // Checked before any path: the plain one (every GPU path the kernels do not take)
    // would count the causal past as keys − t, and a softmax over no keys has no value.
    if keys == 0 {
        candle_core::bail!("attention: {t} queries over no keys")
    }
    if causal && keys < t {
        candle_core::bail!("attention: {t} causal queries but only {keys} keys")
    }
    if b * h * t == 0 {
        return Tensor::zeros((b, t, h * hd), q.dtype(), q.device());
    }
    #[cfg(feature = "cuda")]
    if super::attention_cuda::serves(q, k, v, causal) {
        return super::attention_cuda::flash_attention(q, k, v, causal);
    }
    let scale = 1.0 / (hd as f64).sqrt();
    let cpu = [q, k, v].iter().all(|x| super::fused_on(x));
    let kv_float =
        v.dtype() == k.dtype() && matches!(k.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if cpu && matches!(q.dtype(), DType::BF16 | DType::F16) && kv_float {
        // A model computing in half precision on the CPU: the f32 kernel on
        // widened queries (its sums are f32 either way), the output rounded
        // back. Decoding's keys and values, whatever the cache keeps, are
        // read as they are by the row kernels; a prefill's half ones are
        // widened once here, not once per block of queries.
        let wide = DType::F32;
        let out = if t <= FEW_QUERIES || k.dtype() == wide {
            attention(&q.to_dtype(wide)?, k, v, causal)?
        } else {
            attention(
                &q.to_dtype(wide)?,
                &k.to_dtype(wide)?,
                &v.to_dtype(wide)?,
                causal,
            )?
        };
        return out.to_dtype(q.dtype());
    }
    let kv = k.dtype();
    let fused = cpu
        && q.dtype() == DType::F32
        && v.dtype() == kv
        && matches!(kv, DType::F32 | DType::F16 | DType::BF16);
    if fused {
        // The kernel reads any strides but needs each row's features contiguous.
        let unit = |x: &Tensor| -> Result<Tensor> {
            if x.stride()[3] == 1 {
                Ok(x.clone())
            } else {
                x.contiguous()
            }
        };
        return unit(q)?.apply_op3_no_bwd(
            &unit(k)?,
            &unit(v)?,
            &Attention {
                causal,
                scale: scale as f32,
                path: active(),
            },
        );
    }
    plain_in_parts(q, k, v, causal, crate::device::max_op_elements(q.device()))
}

/// [`plain_attention`] a slice of the batch at a time, or of the heads, so that no
/// call has more than `max_scores` scores; one head's queries × keys must fit.
fn plain_in_parts(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    max_scores: usize,
) -> Result<Tensor> {
    let (b, h, t, _) = q.dims4()?;
    let keys = k.dim(2)?;
    let item = h * t * keys;
    if b * item <= max_scores {
        return plain_attention(q, k, v, causal);
    }
    let (dim, n, per_step) = if item <= max_scores {
        (0, b, max_scores / item)
    } else if t * keys <= max_scores {
        (1, h, max_scores / (t * keys))
    } else {
        candle_core::bail!(
            "attention over {t} queries and {keys} keys: more than {max_scores} scores a head, \
             the most the plain path computes at once"
        )
    };
    let parts = (0..n)
        .step_by(per_step)
        .map(|i| {
            let m = per_step.min(n - i);
            let part = |x: &Tensor| x.narrow(dim, i, m);
            plain_in_parts(&part(q)?, &part(k)?, &part(v)?, causal, max_scores)
        })
        .collect::<Result<Vec<_>>>()?;
    // The output is [b, t, h·hd]: batch slices join on the first axis, head slices on the last.
    Tensor::cat(&parts, if dim == 0 { 0 } else { 2 })
}

/// Attention in plain tensor ops: the path of devices and dtypes the fused kernels
/// do not take.
fn plain_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    let scale = 1.0 / (hd as f64).sqrt();
    // An f16 KV cache with queries of another dtype or device: computed in the queries' dtype.
    let (k, v) = (&k.to_dtype(q.dtype())?, &v.to_dtype(q.dtype())?);
    // Products in the inputs' dtype, the softmax in f32 at least (as the
    // reductions of every other op).
    let scores = q.contiguous()?.matmul(&k.contiguous()?.t()?)?;
    let wide = (super::widened(&scores)? * scale)?;
    let probs = if causal {
        causal_softmax(&wide)?
    } else {
        candle_nn::ops::softmax_last_dim(&wide)?
    };
    probs
        .to_dtype(q.dtype())?
        .matmul(&v.contiguous()?)?
        .transpose(1, 2)?
        .reshape((b, t, h * hd))
}

/// Softmax over the last axis of scores [.., t, total] where query i (of the
/// last t) may see keys 0..=past+i, past = total − t; masked entries are 0.
/// Plain tensor ops: the path of devices and dtypes the fused attention
/// kernel does not take.
pub(crate) fn causal_softmax(scores: &Tensor) -> Result<Tensor> {
    let dims = scores.dims();
    let (t, total) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let past = total - t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..total).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, total), scores.device())?.to_dtype(scores.dtype())?;
    candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{attention_reference, bits, max_abs_diff, spread};
    use super::*;
    use candle_core::{DType, Device};

    /// The fused kernel against plain f64 tensor ops: several query blocks,
    /// cached keys before the queries, and q/k/v as head-transposed views;
    /// and decoding-sized query blocks (the dot-product path), with a head
    /// width that is not a multiple of 16. The models' head sizes (32 to
    /// 96, and 128) over whole and partial blocks of the AVX-512 kernel,
    /// with fewer keys than its tile and a last block of one query, and
    /// enough keys that the kernel lays them out per head.
    #[test]
    fn fused_attention_equals_reference() {
        for (t, past, hd) in [
            (300, 20, 16),
            (1, 40, 24),
            (5, 37, 16),
            (8, 0, 24),
            (200, 7, 64),
            (97, 0, 80),
            (130, 33, 96),
            (40, 0, 128),
            (9, 2, 32),
            (193, 0, 48),
            (20, 1010, 32),
        ] {
            attention_equals_reference(t, past, hd);
        }
    }

    fn attention_equals_reference(t: usize, past: usize, hd: usize) {
        let (b, h) = (2, 3);
        let heads = |rows: usize, salt: f32| {
            (spread((b, rows, h, hd)) + salt as f64)
                .unwrap()
                .transpose(1, 2)
                .unwrap()
        };
        let q = heads(t, 0.1);
        let (k, v) = (heads(past + t, -0.2), heads(past + t, 0.3));
        assert!(t == 1 || !q.is_contiguous());
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
            assert!(d < 1e-5, "t={t} past={past} hd={hd} causal={causal}: {d}");
        }
    }

    /// bf16 queries, keys and values (a model computing in bf16 on the CPU):
    /// the f32 kernel on their widened values, rounded to bf16 once.
    #[test]
    fn bf16_attention_is_the_f32_attention_of_its_values_rounded() {
        let (b, h, t, hd) = (1, 2, 150, 64);
        let x = |salt: f64| {
            (spread((b, t, h, hd)) + salt)
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let (q, k, v) = (x(0.1), x(-0.2), x(0.3));
        let f = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
        // A prefill's queries and decoding-sized ones (the row kernels), over
        // bf16 keys and values and over an f32 cache (generate's default for
        // a bf16 model, read as it is).
        for rows in [t, 3] {
            let qr = q.narrow(2, t - rows, rows).unwrap();
            for (kc, vc, cache) in [(k.clone(), v.clone(), "bf16"), (f(&k), f(&v), "f32")] {
                let got = attention(&qr, &kc, &vc, true).unwrap();
                assert_eq!(got.dtype(), DType::BF16);
                let want = attention(&f(&qr), &f(&k), &f(&v), true)
                    .unwrap()
                    .to_dtype(DType::BF16)
                    .unwrap();
                assert_eq!(bits16(&got), bits16(&want), "{rows} queries, {cache} cache");
            }
        }
    }

    fn bits16(t: &Tensor) -> Vec<u16> {
        let v: Vec<::half::bf16> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn every_path_gives_the_portable_attention() {
        let (b, h, t, hd) = (1, 2, 150, 16);
        let x = |salt: f64| {
            (spread((b, t, h, hd)) + salt)
                .unwrap()
                .transpose(1, 2)
                .unwrap()
        };
        let (q, k, v) = (x(0.1), x(-0.2), x(0.3));
        // The last 3 queries alone take the decoding path.
        let few = q.narrow(2, t - 3, 3).unwrap();
        let run = |q: &Tensor, path: Path| {
            let op = Attention {
                causal: true,
                scale: 0.25,
                path,
            };
            q.apply_op3_no_bwd(&k, &v, &op).unwrap()
        };
        let portable = Path::new(super::super::Isa::Portable).unwrap();
        let (want, want_few) = (run(&q, portable), run(&few, portable));
        for path in Path::all() {
            // gemm's kernels for each path block the sums differently; the
            // decoding path's dot products and sums are the same on every path.
            let d = max_abs_diff(&run(&q, path), &want);
            assert!(d < 1e-5, "{:?}: {d}", path.isa());
            assert_eq!(bits(&run(&few, path)), bits(&want_few), "{:?}", path.isa());
        }
        // And the decoding path agrees with gemm's on the same queries.
        let d = max_abs_diff(&want_few, &want.narrow(1, t - 3, 3).unwrap());
        assert!(d < 1e-5, "few queries vs blocks: {d}");
    }

    /// f16 keys and values (an f16 KV cache's strided views), on every
    /// path, against plain f64 ops on the f16-rounded values; and to the
    /// bit the kernel on those values widened to f32 (the f16 row kernels
    /// follow the f32 ones' order, and gemm sees the same numbers).
    #[test]
    fn f16_keys_and_values_equal_the_reference_on_every_path() {
        let (b, h) = (2, 3);
        for (t, past, hd) in [(1, 700, 64), (3, 41, 24), (200, 30, 16), (1, 0, 72)] {
            let heads = |rows: usize, salt: f64| {
                (spread((b, rows, h, hd)) + salt)
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
            };
            let q = heads(t, 0.1);
            // A cache holds more positions than it has filled: views of a
            // longer buffer, rows hd apart, heads `cap` rows apart.
            let cache = |salt: f64| {
                let cap = past + t + 5;
                let full = (spread((b, h, cap, hd)) + salt).unwrap();
                full.to_dtype(DType::F16)
                    .unwrap()
                    .narrow(2, 0, past + t)
                    .unwrap()
            };
            let (k, v) = (cache(-0.2), cache(0.3));
            assert!(!k.is_contiguous());
            let f = |x: &Tensor| x.to_dtype(DType::F64).unwrap().contiguous().unwrap();
            for causal in [true, false] {
                let want = attention_reference(&f(&q), &f(&k), &f(&v), causal);
                let (kw, vw) = (
                    k.to_dtype(DType::F32).unwrap(),
                    v.to_dtype(DType::F32).unwrap(),
                );
                for path in Path::all() {
                    let op = Attention {
                        causal,
                        scale: (1.0 / (hd as f64).sqrt()) as f32,
                        path,
                    };
                    let got = q.apply_op3_no_bwd(&k, &v, &op).unwrap();
                    let d = max_abs_diff(&got, &want);
                    let at = format!("t={t} past={past} hd={hd} causal={causal} {:?}", path.isa());
                    assert!(d < 1e-5, "{at}: {d}");
                    let wide = q.apply_op3_no_bwd(&kw, &vw, &op).unwrap();
                    assert_eq!(bits(&got), bits(&wide), "{at}");
                }
            }
        }
        // The kernel refuses keys and values of different dtypes rather than
        // misread them; `attention` gives them to the plain ops, in f32.
        let q = spread((1, 1, 2, 16));
        let k = q.to_dtype(DType::F16).unwrap();
        let op = Attention {
            causal: true,
            scale: 0.25,
            path: active(),
        };
        assert!(q.apply_op3_no_bwd(&k, &q, &op).is_err());
        let mixed = attention(&q, &k, &q, true).unwrap();
        let d = max_abs_diff(&mixed, &attention(&q, &q, &q, true).unwrap());
        assert!(d < 1e-2, "{d}");
    }

    #[test]
    fn causal_softmax_equals_f64_and_masks() {
        let dev = Device::Cpu;
        let sc = spread((2, 3, 5, 9));
        let a = causal_softmax(&sc).unwrap();
        let b = causal_softmax(
            &sc.t()
                .unwrap()
                .t()
                .unwrap()
                .broadcast_add(&Tensor::zeros(1, DType::F32, &dev).unwrap())
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap(),
        )
        .unwrap();
        let d = max_abs_diff(&a, &b);
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

    /// The plain path in slices of the batch, of the heads, or of both (a head slice
    /// still too large for the cap), gives the whole computation's bits; one head's
    /// scores over the cap are an error naming the sizes.
    #[test]
    fn plain_attention_in_parts_equals_it_whole() {
        let (b, h, t, keys, hd) = (3, 4, 5, 7, 8);
        let q = spread((b, h, t, hd));
        let k = (spread((b, h, keys, hd)) * 0.7).unwrap();
        let v = (spread((b, h, keys, hd)) * -1.3).unwrap();
        for causal in [false, true] {
            let whole = plain_attention(&q, &k, &v, causal).unwrap();
            // 420 scores in all: whole (420); batch slices of 2 and 1 (300); single
            // items (140); head slices of 2, each then a batch item at a time (100);
            // single heads of single items (35).
            for max in [420, 300, 140, 100, 35] {
                let parts = plain_in_parts(&q, &k, &v, causal, max).unwrap();
                assert_eq!(bits(&parts), bits(&whole), "causal {causal}, at most {max}");
            }
            let e = plain_in_parts(&q, &k, &v, causal, 34)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("5 queries and 7 keys") && e.contains("34"),
                "{e}"
            );
        }
    }

    /// What the plain path (f64 here; every dtype and device the kernels do not take)
    /// cannot compute is refused before it: fewer keys than causal queries (its mask
    /// would count the past as keys − t) and no keys at all; no queries give an empty
    /// result of the output's shape.
    #[test]
    fn attention_refuses_too_few_keys_and_returns_nothing_for_no_queries() {
        let f64s = |x: Tensor| x.to_dtype(DType::F64).unwrap();
        let (q, k) = (f64s(spread((2, 3, 4, 8))), f64s(spread((2, 3, 3, 8))));
        let e = attention(&q, &k, &k, true).unwrap_err().to_string();
        assert!(e.contains("4 causal queries but only 3 keys"), "{e}");
        let none = k.narrow(2, 0, 0).unwrap();
        let e = attention(&q, &none, &none, false).unwrap_err().to_string();
        assert!(e.contains("no keys"), "{e}");
        let empty = attention(&q.narrow(2, 0, 0).unwrap(), &k, &k, true).unwrap();
        assert_eq!(empty.dims(), [2, 0, 24]);
        assert_eq!(empty.dtype(), DType::F64);
        // With enough keys the plain path still runs: 4 causal queries over 5 keys.
        let k5 = f64s(spread((2, 3, 5, 8)));
        assert_eq!(attention(&q, &k5, &k5, true).unwrap().dims(), [2, 4, 24]);
    }
}
