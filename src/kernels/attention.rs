//! Fused multi-head attention for the CPU: softmax(q·kᵀ/√d)·v per (batch,
//! head, block of queries) on one thread each, so the score block stays in L2
//! and no [heads, t, t] tensor exists (FlashAttention's idea without online
//! rescaling: a whole score row fits in cache at these context lengths).
//! q/k/v are read through their strides (head-transposed views need no copy);
//! the output is written straight into [b, t, h·d].

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::matmul::gemm_f32;
use super::rows::{axpy_rows_on, dot_rows_on};
use super::{active, Path};
use std::cell::RefCell;

/// Queries per task: 128 rows × 2048 keys of f32 scores is 1 MiB, inside a
/// 2 MiB L2 (block sizes compared in docs/PERFORMANCE.md).
const QUERY_BLOCK: usize = 128;

/// Blocks of at most this many queries (decoding) take dot products and
/// weighted sums with the cached rows instead of gemm.
const FEW_QUERIES: usize = 8;

struct Attention {
    causal: bool,
    scale: f32,
    path: Path,
}

/// A raw output pointer shared by tasks that write disjoint rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a distinct (batch, head, query block) region.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Offset and [b, h, t, hd] strides of an f32 CPU tensor whose last axis is contiguous.
fn view<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<(&'a [f32], usize, [usize; 3])> {
    let CpuStorage::F32(data) = s else {
        candle_core::bail!("attention {what}: f32 only")
    };
    let st = l.stride();
    if st.len() != 4 || st[3] != 1 {
        candle_core::bail!("attention {what}: expected [b, h, t, hd] with a contiguous last axis")
    }
    Ok((data.as_slice(), l.start_offset(), [st[0], st[1], st[2]]))
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
        let (q, q0, qs) = view(sq, lq, "q")?;
        let (k, k0, ks) = view(sk, lk, "k")?;
        let (v, v0, vs) = view(sv, lv, "v")?;
        let mut out = vec![0f32; b * t * h * hd];
        let out_ptr = OutPtr(out.as_mut_ptr());
        let blocks = t.div_ceil(QUERY_BLOCK);
        let past = keys - t;
        (0..b * h * blocks).into_par_iter().for_each(|task| {
            let (bh, blk) = (task / blocks, task % blocks);
            let (bi, hi) = (bh / h, bh % h);
            let start = blk * QUERY_BLOCK;
            let rows = QUERY_BLOCK.min(t - start);
            // Causal: the block's last query sees keys up to its own position.
            let seen = if self.causal {
                past + start + rows
            } else {
                keys
            };
            SCORES.with(|s| {
                let mut s = s.borrow_mut();
                if s.len() < rows * seen {
                    s.resize(rows * seen, 0.0);
                }
                let s = &mut s[..rows * seen];
                let out = out_ptr;
                // SAFETY: offsets stay inside each tensor (shapes checked above);
                // the output rows (bi, start.., hi) belong to this task only.
                unsafe {
                    let qp = q.as_ptr().add(q0 + bi * qs[0] + hi * qs[1] + start * qs[2]);
                    let kp = k.as_ptr().add(k0 + bi * ks[0] + hi * ks[1]);
                    let vp = v.as_ptr().add(v0 + bi * vs[0] + hi * vs[1]);
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
                            dot_rows_on(self.path, qr, keys, ks[2], self.scale, &mut sr[..valid]);
                            super::rows::softmax_row_on(self.path, sr, valid);
                            let o = std::slice::from_raw_parts_mut(
                                out.0.add(((bi * t + start + r) * h + hi) * hd),
                                hd,
                            );
                            let values = std::slice::from_raw_parts(vp, span(vs[2]));
                            axpy_rows_on(self.path, &sr[..valid], values, vs[2], o);
                        }
                        return;
                    }
                    // s = scale · q_blk · kᵀ   [rows, seen]
                    gemm_f32(
                        self.path,
                        (rows, seen, hd),
                        (s.as_mut_ptr(), 1, seen as isize),
                        (qp, 1, qs[2] as isize),
                        (kp, ks[2] as isize, 1),
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
                    gemm_f32(
                        self.path,
                        (rows, hd, seen),
                        (op, 1, (h * hd) as isize),
                        (s.as_ptr(), 1, seen as isize),
                        (vp, 1, vs[2] as isize),
                        1.0,
                        gemm::Parallelism::None,
                    );
                }
            });
        });
        Ok((CpuStorage::F32(out), Shape::from((b, t, h * hd))))
    }
}

thread_local! {
    /// Each worker's score block, reused across tasks and calls.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// softmax(q·kᵀ/√hd)·v for q [b, h, t, hd] and k, v [b, h, T, hd] → [b, t, h·hd].
/// `causal`: query i (of the last t positions) sees keys 0..=T−t+i.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    let scale = 1.0 / (hd as f64).sqrt();
    let fused = [q, k, v]
        .iter()
        .all(|x| super::fused_on(x) && x.dtype() == DType::F32);
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
    // Products in the inputs' dtype, the softmax in f32 at least (as the
    // reductions of every other op).
    let scores = (q.contiguous()?.matmul(&k.contiguous()?.t()?)? * scale)?;
    let wide = match scores.dtype() {
        DType::BF16 | DType::F16 => scores.to_dtype(DType::F32)?,
        _ => scores,
    };
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
    use super::super::test_util::{bits, max_abs_diff, spread};
    use super::*;
    use candle_core::{DType, Device};

    /// The fused kernel against plain f64 tensor ops: several query blocks,
    /// cached keys before the queries, and q/k/v as head-transposed views;
    /// and decoding-sized query blocks (the dot-product path), with a head
    /// width that is not a multiple of 16.
    #[test]
    fn fused_attention_equals_reference() {
        for (t, past, hd) in [(300, 20, 16), (1, 40, 24), (5, 37, 16), (8, 0, 24)] {
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
}
