//! Attention softmax(q·kᵀ/√hd)·v as one differentiable op that never holds the
//! [queries, keys] scores: the forward keeps each query row's log-sum-exp, and the
//! backward recomputes the probabilities from it (FlashAttention-2's scheme):
//! ∂q_i = s·Σ_j p_ij (dp_ij − D_i) k_j, ∂k_j = s·Σ_i p_ij (dp_ij − D_i) q_i,
//! ∂v_j = Σ_i p_ij ∂o_i, with dp_ij = ∂o_i·v_j and D_i = ∂o_i·o_i. On a GPU both
//! passes are `cuda/attention.cu`'s kernels (`attention_cuda`: inference and, under
//! `TOKENFORMER_CUDA_KERNELS=1`, training attention without [b, h, t, t] tensors); on
//! the CPU they are plain f64 loops of the same formulas, so the op's values and
//! backward are tested where there is no GPU.
// Without the `cuda` feature only the tests below use the op.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};

use super::row_op::{self, f64s};

/// softmax(q·kᵀ/√hd)·v for q [b, h, t, hd] over k, v [b, h, keys, hd] (each row's
/// features contiguous, other strides free), causal counting from the end (query i
/// sees keys 0..=keys − t + i), as [b, t, h·hd] in q's dtype; differentiable in q, k
/// and v. On a GPU f32, bf16 or f16; on the CPU f32 or f64.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    let ([q, k, v], op) = prepared(q, k, v, causal)?;
    q.apply_op3(&k, &v, op)
}

/// [`attention`] outside the graph, for a backward written out by hand: the output
/// and what [`Saved::grads`] needs besides it.
pub(crate) fn forward(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<(Tensor, Saved)> {
    let ([q, k, v], op) = prepared(q, k, v, causal)?;
    let out = q.apply_op3_no_bwd(&k, &v, &op)?;
    Ok((out, Saved { q, k, v, op }))
}

/// What the backward of [`forward`] reads: its operands as the kernels took them and
/// the rows' log-sum-exp.
pub(crate) struct Saved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    op: Flash,
}

impl Saved {
    /// ∂q [b, h, t, hd] and ∂k, ∂v [b, h, keys, hd] from the forward's output and ∂o,
    /// both [b, t, h·hd].
    pub(crate) fn grads(&self, out: &Tensor, dout: &Tensor) -> Result<[Tensor; 3]> {
        self.op.grads(&self.q, &self.k, &self.v, out, dout)
    }
}

/// The operands as the kernels take them, checked, and the op.
fn prepared(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<([Tensor; 3], Flash)> {
    if let Err(e) = fits(q, k, v, causal) {
        candle_core::bail!("flash attention: {e}")
    }
    // The GPU kernels read rows through strides; the CPU's loops take contiguous inputs.
    let unit = |x: &Tensor| -> Result<Tensor> {
        if x.stride()[3] == 1 && !x.device().is_cpu() {
            Ok(x.clone())
        } else {
            x.contiguous()
        }
    };
    let hd = q.dim(3)?;
    let op = Flash {
        causal,
        scale: 1.0 / (hd as f64).sqrt(),
        lse: Mutex::new(None),
    };
    Ok(([unit(q)?, unit(k)?, unit(v)?], op))
}

/// The head sizes the GPU kernels' instances take (the smallest that fits runs).
pub(crate) const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Keys a thread block takes in decoding's split over keys on a GPU
/// (`flash_attention_*` with partials, in `cuda/attention.cu`), or `None` for the
/// one-pass launch:
/// the split serves one block of queries a head (t ≤ `rows`, a decoding step)
/// when the heads alone would leave most of a GPU's 100-odd multiprocessors
/// idle (fewer than 128 blocks), with whole tiles of keys and at least two chunks.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn split_chunk(
    b: usize,
    h: usize,
    t: usize,
    keys: usize,
    hd: usize,
    rows: usize,
) -> Option<usize> {
    const BLOCKS: usize = 256;
    let maxd = HEAD_DIMS.into_iter().find(|&m| hd <= m)?;
    // The kernels' keys a tile: 32 KiB of f32 K and V tiles.
    let tile = 4096 / maxd;
    if b * h == 0 || t > rows || b * h * 2 > BLOCKS || keys < 2 * tile {
        return None;
    }
    let chunks = (BLOCKS / (b * h)).min(keys / tile);
    let chunk = keys.div_ceil(chunks).next_multiple_of(tile);
    (keys.div_ceil(chunk) > 1).then_some(chunk)
}

/// Why the op cannot take q, k and v, if it cannot: one device, one dtype (f32, bf16
/// or f16 on a GPU; f32 or f64 on the CPU), rank 4 with matching batch, heads and
/// head size, 1 ≤ hd ≤ 256, at least one sequence, head and key (and, causal, at
/// least as many keys as queries), shapes within one GPU launch.
pub(crate) fn fits(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
) -> std::result::Result<(), String> {
    let dev = q.device();
    if !(dev.same_device(k.device()) && dev.same_device(v.device())) {
        return Err("q, k and v must be on one device".into());
    }
    let dtype = q.dtype();
    let dtypes: &[DType] = if dev.is_cpu() {
        &[DType::F32, DType::F64]
    } else {
        &[DType::F32, DType::BF16, DType::F16]
    };
    if k.dtype() != dtype || v.dtype() != dtype || !dtypes.contains(&dtype) {
        return Err(format!(
            "q, k, v {:?}/{:?}/{:?}: one of {dtypes:?} for all three",
            dtype,
            k.dtype(),
            v.dtype()
        ));
    }
    let (Ok((b, h, t, hd)), Ok((kb, kh, keys, khd))) = (q.dims4(), k.dims4()) else {
        return Err(format!(
            "q {:?}, k {:?}: rank 4 expected",
            q.dims(),
            k.dims()
        ));
    };
    if (kb, kh, khd) != (b, h, hd) || v.dims() != k.dims() {
        return Err(format!(
            "q {:?}, k {:?}, v {:?} do not match",
            q.dims(),
            k.dims(),
            v.dims()
        ));
    }
    if b == 0
        || h == 0
        || hd == 0
        || hd > HEAD_DIMS[2]
        || t == 0
        || keys == 0
        || (causal && keys < t)
    {
        return Err(format!(
            "batch {b}, {h} heads (1 or more), head size {hd} (1 to 256), {t} queries, {keys} keys{}",
            if causal {
                " (causal: keys ≥ queries)"
            } else {
                ""
            }
        ));
    }
    if b > 65_535 || h > 65_535 || t > i32::MAX as usize || keys > i32::MAX as usize {
        return Err(format!("[{b}, {h}, {t}] is more than one launch takes"));
    }
    Ok(())
}

/// The forward; keeps the rows' log-sum-exp [b, t, h] (f32 on a GPU, f64 on the
/// CPU) for the backward.
struct Flash {
    causal: bool,
    scale: f64,
    lse: Mutex<Option<Tensor>>,
}

/// The op's shape: batch, heads, queries, keys, head size.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub b: usize,
    pub h: usize,
    pub t: usize,
    pub keys: usize,
    pub hd: usize,
}

impl Dims {
    fn of(q: &Layout, k: &Layout) -> Result<Self> {
        let (b, h, t, hd) = q.shape().dims4()?;
        Ok(Self {
            b,
            h,
            t,
            keys: k.dims()[2],
            hd,
        })
    }
    /// Each (batch, head) pair with its index in [b, h] order.
    fn heads(&self) -> impl Iterator<Item = (usize, (usize, usize))> {
        let h = self.h;
        (0..self.b)
            .flat_map(move |b| (0..h).map(move |i| (b, i)))
            .enumerate()
    }
    /// Keys query i sees.
    fn seen(&self, causal: bool, i: usize) -> usize {
        if causal {
            self.keys - self.t + i + 1
        } else {
            self.keys
        }
    }
}

impl CustomOp3 for Flash {
    fn name(&self) -> &'static str {
        "flash-attention"
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
        let d = Dims::of(lq, lk)?;
        let (q, k, v) = (f64s(sq, lq)?, f64s(sk, lk)?, f64s(sv, lv)?);
        let (mut out, mut lse) = (
            vec![0.0; d.b * d.t * d.h * d.hd],
            vec![0.0; d.b * d.t * d.h],
        );
        for (bh, (b, h)) in d.heads() {
            let (qo, ko) = (bh * d.t * d.hd, bh * d.keys * d.hd);
            for i in 0..d.t {
                let r = (b * d.t + i) * d.h + h;
                let p = probabilities(&q, &k, qo, ko, d, i, self.causal, self.scale);
                lse[r] = p.lse;
                for (j, w) in p.weights.iter().enumerate() {
                    for c in 0..d.hd {
                        out[r * d.hd + c] += w * v[ko + j * d.hd + c];
                    }
                }
            }
        }
        self.keep(Tensor::from_vec(
            lse,
            (d.b, d.t, d.h),
            &candle_core::Device::Cpu,
        )?);
        Ok((row_op::like(sq, out), Shape::from((d.b, d.t, d.h * d.hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sq: &candle_core::CudaStorage,
        lq: &Layout,
        sk: &candle_core::CudaStorage,
        lk: &Layout,
        sv: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = Dims::of(lq, lk)?;
        let (out, lse) = super::attention_cuda::forward(
            (sq, lq),
            (sk, lk),
            (sv, lv),
            self.causal,
            self.scale as f32,
        )?;
        self.keep(Tensor::from_storage(
            Storage::Cuda(lse),
            (d.b, d.t, d.h),
            candle_core::op::BackpropOp::none(),
            false,
        ));
        Ok((out, Shape::from((d.b, d.t, d.h * d.hd))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dq, dk, dv] = self.grads(q, k, v, out, dout)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl Flash {
    fn keep(&self, lse: Tensor) {
        *self.lse.lock().expect("not poisoned") = Some(lse);
    }

    /// The backward: ∂q, ∂k and ∂v of the forward's operands from its output and ∂o.
    fn grads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<[Tensor; 3]> {
        let lse = self.lse.lock().expect("not poisoned").clone();
        let Some(lse) = lse else {
            candle_core::bail!("flash attention: backward before forward")
        };
        let (b, h, t, hd) = q.dims4()?;
        // D_i = ∂o_i·o_i, summed in the log-sum-exp's dtype (f32 on a GPU).
        let wide = |x: &Tensor| x.to_dtype(lse.dtype());
        let delta = (wide(dout)? * wide(out)?)?
            .reshape((b, t, h, hd))?
            .sum(3)?
            .contiguous()?;
        let dout = dout.contiguous()?;
        let grad = |part| Grad {
            part,
            causal: self.causal,
            scale: self.scale,
            dout: dout.clone(),
            lse: lse.clone(),
            delta: delta.clone(),
        };
        let dq = q.apply_op3_no_bwd(k, v, &grad(Part::Q))?;
        let dkv = q.apply_op3_no_bwd(k, v, &grad(Part::KV))?;
        Ok([dq, dkv.get(0)?, dkv.get(1)?])
    }
}

/// One query row's attention weights over the keys it sees, and its log-sum-exp.
struct Row {
    weights: Vec<f64>,
    lse: f64,
}

/// Row i of softmax(scale·q·kᵀ) for the (batch, head) whose q and k start at qo, ko.
#[allow(clippy::too_many_arguments)]
fn probabilities(
    q: &[f64],
    k: &[f64],
    qo: usize,
    ko: usize,
    d: Dims,
    i: usize,
    causal: bool,
    scale: f64,
) -> Row {
    let qi = &q[qo + i * d.hd..qo + (i + 1) * d.hd];
    let s: Vec<f64> = (0..d.seen(causal, i))
        .map(|j| scale * dot(qi, &k[ko + j * d.hd..ko + (j + 1) * d.hd]))
        .collect();
    let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
    Row {
        weights: s.iter().map(|x| (x - m).exp() / z).collect(),
        lse: m + z.ln(),
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Which gradient a [`Grad`] computes: ∂q [b, h, t, hd], or ∂k and ∂v stacked as
/// [2, b, h, keys, hd].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Part {
    Q,
    KV,
}

/// The backward of [`Flash`] for q, k and v (its arguments), from ∂o [b, t, h·hd]
/// (contiguous), the forward's log-sum-exp and D, both [b, t, h].
struct Grad {
    part: Part,
    causal: bool,
    scale: f64,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
}

impl CustomOp3 for Grad {
    fn name(&self) -> &'static str {
        "flash-attention-grad"
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
        let d = Dims::of(lq, lk)?;
        let (q, k, v) = (f64s(sq, lq)?, f64s(sk, lk)?, f64s(sv, lv)?);
        let cpu = |t: &Tensor| -> Result<Vec<f64>> {
            let (s, l) = t.storage_and_layout();
            match &*s {
                Storage::Cpu(s) => f64s(s, l),
                _ => candle_core::bail!("flash attention: a saved tensor is not on the CPU"),
            }
        };
        let (dout, lse, delta) = (cpu(&self.dout)?, cpu(&self.lse)?, cpu(&self.delta)?);
        let hd = d.hd;
        let plane = d.b * d.h * d.keys * hd;
        let (mut dq, mut dkv) = match self.part {
            Part::Q => (vec![0.0; d.b * d.h * d.t * hd], vec![]),
            Part::KV => (vec![], vec![0.0; 2 * plane]),
        };
        for (bh, (b, h)) in d.heads() {
            let (qo, ko) = (bh * d.t * hd, bh * d.keys * hd);
            for i in 0..d.t {
                let r = (b * d.t + i) * d.h + h;
                let (qi, di) = (&q[qo + i * hd..][..hd], &dout[r * hd..][..hd]);
                for j in 0..d.seen(self.causal, i) {
                    let (kj, vj) = (&k[ko + j * hd..][..hd], &v[ko + j * hd..][..hd]);
                    let p = (self.scale * dot(qi, kj) - lse[r]).exp();
                    let ds = p * (dot(di, vj) - delta[r]);
                    if self.part == Part::Q {
                        for c in 0..hd {
                            dq[qo + i * hd + c] += self.scale * ds * kj[c];
                        }
                    } else {
                        for c in 0..hd {
                            dkv[ko + j * hd + c] += self.scale * ds * qi[c];
                            dkv[plane + ko + j * hd + c] += p * di[c];
                        }
                    }
                }
            }
        }
        Ok(match self.part {
            Part::Q => (row_op::like(sq, dq), Shape::from((d.b, d.h, d.t, hd))),
            Part::KV => (
                row_op::like(sq, dkv),
                Shape::from((2, d.b, d.h, d.keys, hd)),
            ),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sq: &candle_core::CudaStorage,
        lq: &Layout,
        sk: &candle_core::CudaStorage,
        lk: &Layout,
        sv: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = Dims::of(lq, lk)?;
        let (dout, ldout) = self.dout.storage_and_layout();
        let (lse, llse) = self.lse.storage_and_layout();
        let (delta, ldelta) = self.delta.storage_and_layout();
        let (Storage::Cuda(dout), Storage::Cuda(lse), Storage::Cuda(delta)) =
            (&*dout, &*lse, &*delta)
        else {
            candle_core::bail!("flash attention: a saved tensor is not on the GPU")
        };
        let storage = super::attention_cuda::grad(
            self.part,
            [(sq, lq), (sk, lk), (sv, lv)],
            [(dout, ldout), (lse, llse), (delta, ldelta)],
            self.causal,
            self.scale as f32,
        )?;
        let shape = match self.part {
            Part::Q => Shape::from((d.b, d.h, d.t, d.hd)),
            Part::KV => Shape::from((2, d.b, d.h, d.keys, d.hd)),
        };
        Ok((storage, shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::attention_reference;
    use candle_core::{Device, Var};

    fn filled(shape: (usize, usize, usize, usize), salt: f64) -> Tensor {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        let v: Vec<f64> = (0..n)
            .map(|i| ((i as f64 * 0.618_034 + salt).fract() - 0.5) * 3.0)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn flat(t: &Tensor) -> Vec<f64> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Values and the gradients of Σ o·w in q, k and v equal the definition's under
    /// candle's autograd, causal or not, square (training's case) and over a longer
    /// past, with q read through a transposed view as the model passes it.
    #[test]
    fn equals_the_definition_and_its_autograd() {
        let (b, h, hd) = (2, 3, 5);
        for (t, keys) in [(4, 4), (3, 7)] {
            // q as the model's head-split view: [b, t, h, hd] transposed.
            let q = Var::from_tensor(&filled((b, t, h, hd), 0.1)).unwrap();
            let k = Var::from_tensor(&filled((b, h, keys, hd), 0.2)).unwrap();
            let v = Var::from_tensor(&filled((b, h, keys, hd), 0.3)).unwrap();
            let w = Tensor::arange(0f64, (b * t * h * hd) as f64, &Device::Cpu)
                .unwrap()
                .reshape((b, t, h * hd))
                .unwrap()
                .cos()
                .unwrap();
            let qv = q.as_tensor().transpose(1, 2).unwrap();
            for causal in [false, true] {
                let got = attention(&qv, k.as_tensor(), v.as_tensor(), causal).unwrap();
                let want = attention_reference(&qv, k.as_tensor(), v.as_tensor(), causal);
                let what = format!("{t}x{keys} causal {causal}");
                for (a, b) in flat(&got).iter().zip(flat(&want)) {
                    assert!((a - b).abs() < 1e-12, "{what}: {a} vs {b}");
                }
                let g = (&got * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let e = (&want * &w).unwrap().sum_all().unwrap().backward().unwrap();
                for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
                    let (a, b) = (
                        flat(g.get(x.as_tensor()).unwrap()),
                        flat(e.get(x.as_tensor()).unwrap()),
                    );
                    let worst = a
                        .iter()
                        .zip(&b)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f64::max);
                    assert!(worst < 1e-10, "{what}: ∂{name} off by {worst}");
                    assert!(b.iter().any(|x| x.abs() > 1e-3), "{what}: ∂{name} is all 0");
                }
            }
        }
    }

    /// f32 inputs give f32 results close to the f64 ones; what the op cannot take is
    /// an error naming why.
    #[test]
    fn takes_f32_and_refuses_what_does_not_fit() {
        let (q, k) = (filled((1, 2, 3, 4), 0.4), filled((1, 2, 3, 4), 0.5));
        let f = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
        let got = attention(&f(&q), &f(&k), &f(&k), true).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        let want = attention(&q, &k, &k, true).unwrap();
        let got: Vec<f64> = flat(&got.to_dtype(DType::F64).unwrap());
        for (a, b) in got.iter().zip(flat(&want)) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        let short = filled((1, 2, 2, 4), 0.6);
        let e = attention(&q, &short, &short, true).unwrap_err().to_string();
        assert!(e.contains("keys ≥ queries"), "{e}");
        let e = attention(&f(&q), &k, &k, false).unwrap_err().to_string();
        assert!(e.contains("one of"), "{e}");
        // No sequence or no head: refused by name, where a GPU launch of an empty grid
        // would fail with the driver's bare "invalid argument".
        for dims in [(0, 2, 3, 4), (1, 0, 3, 4)] {
            let x = filled(dims, 0.4);
            let e = attention(&x, &x, &x, false).unwrap_err().to_string();
            assert!(e.contains("1 or more"), "{dims:?}: {e}");
        }
    }

    /// Decoding's split over keys: a decoding step of the 150M (12 heads of 64)
    /// splits 512 cached keys into whole tiles; prefill, many heads, a short cache
    /// or a head size no kernel takes do not split.
    #[test]
    fn decoding_splits_its_keys_and_nothing_else_does() {
        assert_eq!(split_chunk(1, 12, 1, 512, 64, 32), Some(64));
        assert_eq!(split_chunk(1, 12, 1, 2048, 64, 32), Some(128));
        assert_eq!(split_chunk(1, 2, 1, 300, 128, 32), Some(64));
        assert_eq!(split_chunk(4, 16, 1, 4096, 128, 32), Some(1024));
        assert_eq!(split_chunk(8, 32, 1, 4096, 128, 32), None);
        assert_eq!(split_chunk(1, 12, 2048, 2048, 64, 32), None);
        assert_eq!(split_chunk(1, 12, 1, 100, 64, 32), None);
        assert_eq!(split_chunk(1, 12, 1, 512, 300, 32), None);
        assert_eq!(split_chunk(0, 12, 1, 512, 64, 32), None);
        assert_eq!(split_chunk(1, 0, 1, 512, 64, 32), None);
        for keys in [128, 129, 1000, 4097] {
            let chunk = split_chunk(1, 1, 1, keys, 256, 32).unwrap();
            assert_eq!(chunk % 16, 0);
            assert!((2..=256).contains(&keys.div_ceil(chunk)), "{keys}: {chunk}");
        }
    }
}
