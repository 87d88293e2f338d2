//! A whole transformer block as one node of the training graph on any device, its
//! backward written out in tensor ops and the project's row, Θ and flash-attention
//! ops (each also run outside the graph): the GPU's counterpart of [`super::fused`]'s
//! block, whose raw loops are the CPU's.
//!
//! Why: composed from candle ops a block is some sixty nodes, and candle's backward
//! gives every argument of every node a zeroed gradient and adds into it, so a small
//! model's GPU step is thousands of launches (docs/PERFORMANCE.md). Here the forward
//! runs detached, the node's output is a copy of its result, and the backward writes
//! each gradient once: about fifty launches a block both ways, counted from the code.
//!
//! The block: h = LN(x); q, k, v = Θ(h·K_gᵀ)·V_g for their three token groups (one
//! scores product over the stacked keys, one Θ, one batched value product); q and k
//! rotated together (one op); o = attention(q, k, v); x₁ = x + Θ(o·K_pᵀ)·V_p; y = x₁ + Θ(LN(x₁)·K_fᵀ)·V_f
//! (or y = x + Θ(o·K_pᵀ)·V_p + Θ(h·K_fᵀ)·V_f with a parallel residual).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};

use super::fused::BlockSpec;
use super::theta::{l2_norm_gelu, l2_norm_gelu_grad};
use crate::kernels::flash;
use crate::kernels::nonparam_norm::{layer_norm, layer_norm_grad};

/// GPT-NeoX rotary (rotate-half) on the first `dims` features of each head, from the
/// model's tables cos and sin [positions, dims/2] (f32).
#[derive(Clone)]
pub(crate) struct Rotary {
    dims: usize,
    cos: Tensor,
    sin: Tensor,
    /// −sin: the rotation by −θ, the rotation's transpose (the backward's).
    neg_sin: Tensor,
}

impl Rotary {
    pub(crate) fn new(dims: usize, cos: &Tensor, sin: &Tensor) -> Result<Self> {
        Ok(Self {
            dims,
            cos: cos.clone(),
            sin: sin.clone(),
            neg_sin: sin.neg()?,
        })
    }

    /// The rotation by −θ.
    fn inverse(&self) -> Self {
        Self {
            sin: self.neg_sin.clone(),
            neg_sin: self.sin.clone(),
            ..self.clone()
        }
    }

    /// x [n, b, heads, t, hd] (each head's features contiguous) rotated at positions
    /// 0..t, contiguous: in one op for f32, bf16 and f16 (one launch on a GPU, row
    /// loops on the CPU), composed from tensor ops in f64 (the unit test's exact path).
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype() != DType::F64 {
            return crate::kernels::rotary_heads(x, &self.cos, &self.sin, self.dims, 0);
        }
        let full = |table: &Tensor| super::lm::full_table(table, x.dim(3)?, DType::F64);
        super::lm::rotate(x, self.dims, &full(&self.cos)?, &full(&self.sin)?)?.contiguous()
    }
}

/// Whether the node serves x [b, t, d]: on a GPU with the project's kernels on, where
/// the norms, Θ and the flash attention over `heads` take it. `TOKENFORMER_DEVICE_BLOCK`
/// `0` keeps the composed block there (to compare); `cpu` also takes the node on the
/// CPU where its fused block does not serve (f64 loops: for tests of its wiring).
pub(crate) fn serves(x: &Tensor, heads: usize, causal: bool) -> bool {
    static MODE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let mode = MODE.get_or_init(|| std::env::var("TOKENFORMER_DEVICE_BLOCK").ok());
    let Ok((b, t, d)) = x.dims3() else {
        return false;
    };
    if mode.as_deref() == Some("0") || heads == 0 || d % heads != 0 {
        return false;
    }
    // q's view of x has the shape and dtype of the real q.
    let Ok(q) = x
        .reshape((b, t, heads, d / heads))
        .and_then(|q| q.transpose(1, 2))
    else {
        return false;
    };
    if x.device().is_cpu() {
        return mode.as_deref() == Some("cpu") && flash::fits(&q, &q, &q, causal).is_ok();
    }
    #[cfg(feature = "cuda")]
    {
        crate::kernels::nonparam_norm::serves(x)
            && crate::kernels::attention_cuda::serves(&q, &q, &q, causal)
    }
    #[cfg(not(feature = "cuda"))]
    false
}

/// The block on x [b, t, d], with the q, k, v, proj and mlp key tokens stacked in that
/// order in `keys` [N, d] and their value tokens in `values` [N, d] (q, k and v of one
/// size), as one node whose backward gives ∂x, ∂keys and ∂values.
pub(crate) fn block(
    x: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    spec: &BlockSpec,
    rotary: Option<&Rotary>,
) -> Result<Tensor> {
    let (y, saved) = forward(
        &x.detach().contiguous()?,
        &keys.detach().contiguous()?,
        &values.detach().contiguous()?,
        spec,
        rotary,
    )?;
    x.apply_op3(
        keys,
        values,
        Node {
            y,
            spec: spec.clone(),
            rotary: rotary.cloned(),
            saved: Mutex::new(Some(saved)),
        },
    )
}

/// What the backward reads, all [rows, ·] unless said otherwise.
struct Saved {
    keys: Tensor,
    values: Tensor,
    x: Tensor,
    h: Tensor,
    /// q/k/v scores [rows, 3n] and their Θ grouped [3, rows, n].
    s_qkv: Tensor,
    w_qkv: Tensor,
    attention: flash::Saved,
    /// The attention's output [b, t, d].
    o: Tensor,
    s_proj: Tensor,
    w_proj: Tensor,
    /// x₁ = x + the attention branch.
    x1: Tensor,
    /// The feed-forward's input: LN(x₁), or h with a parallel residual.
    h_ffn: Tensor,
    s_ffn: Tensor,
    w_ffn: Tensor,
}

/// Θ(x·Kᵀ) of one Pattention: its scores and weights.
fn scores_theta(x: &Tensor, keys: &Tensor, scale_tokens: usize) -> Result<(Tensor, Tensor)> {
    let s = x.matmul(&keys.t()?)?;
    let w = l2_norm_gelu(&s, scale_tokens)?;
    Ok((s, w))
}

/// (∂x, ∂K, ∂V) of y = Θ(x·Kᵀ)·V from ∂y, with its saved scores and weights.
#[allow(clippy::too_many_arguments)]
fn pattention_grads(
    dy: &Tensor,
    x: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    s: &Tensor,
    w: &Tensor,
    scale_tokens: usize,
) -> Result<[Tensor; 3]> {
    let dv = w.t()?.matmul(dy)?;
    let dw = dy.matmul(&values.t()?)?;
    let ds = l2_norm_gelu_grad(s, &dw, scale_tokens)?;
    Ok([ds.matmul(keys)?, ds.t()?.matmul(x)?, dv])
}

/// x [n, b, heads, t, hd] rotated by `r`, if any.
fn rotate(x: Tensor, r: Option<&Rotary>) -> Result<Tensor> {
    match r {
        Some(r) => r.apply(&x),
        None => Ok(x),
    }
}

fn forward(
    x: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    spec: &BlockSpec,
    rotary: Option<&Rotary>,
) -> Result<(Tensor, Saved)> {
    let (b, t, d) = x.dims3()?;
    let (rows, heads) = (b * t, spec.heads);
    let [nq, np, nf] = spec.tokens;
    let [cq, cp, cf] = spec.scale_tokens;
    let part = |m: &Tensor, at: usize, n: usize| m.narrow(0, at, n);
    let x = x.reshape((rows, d))?;
    let h = layer_norm(&x, spec.eps)?;
    // q, k and v: one scores product, Θ over each group's rows, one batched product.
    let s_qkv = h.matmul(&part(keys, 0, 3 * nq)?.t()?)?;
    let w_qkv = l2_norm_gelu(&s_qkv.reshape((rows * 3, nq))?, cq)?
        .reshape((rows, 3, nq))?
        .transpose(0, 1)?
        .contiguous()?;
    // [3, b, heads, t, hd] over the product's [3, b, t, heads, hd]; q and k rotated
    // together.
    let qkv = w_qkv
        .matmul(&part(values, 0, 3 * nq)?.reshape((3, nq, d))?)?
        .reshape((3, b, t, heads, d / heads))?
        .transpose(2, 3)?;
    let qk = rotate(qkv.narrow(0, 0, 2)?, rotary)?;
    let (o, attention) = flash::forward(&qk.get(0)?, &qk.get(1)?, &qkv.get(2)?, spec.causal)?;
    let o2 = o.reshape((rows, d))?;
    let (s_proj, w_proj) = scores_theta(&o2, &part(keys, 3 * nq, np)?, cp)?;
    let a = w_proj.matmul(&part(values, 3 * nq, np)?)?;
    let x1 = (&x + a)?;
    let h_ffn = if spec.parallel_residual {
        h.clone()
    } else {
        layer_norm(&x1, spec.eps)?
    };
    let (s_ffn, w_ffn) = scores_theta(&h_ffn, &part(keys, 3 * nq + np, nf)?, cf)?;
    let f = w_ffn.matmul(&part(values, 3 * nq + np, nf)?)?;
    let y = (&x1 + f)?;
    let saved = Saved {
        keys: keys.clone(),
        values: values.clone(),
        x,
        h,
        s_qkv,
        w_qkv,
        attention,
        o,
        s_proj,
        w_proj,
        x1,
        h_ffn,
        s_ffn,
        w_ffn,
    };
    Ok((y.reshape((b, t, d))?, saved))
}

fn backward(
    s: &Saved,
    dy: &Tensor,
    spec: &BlockSpec,
    rotary: Option<&Rotary>,
) -> Result<[Tensor; 3]> {
    let (b, t, d) = dy.dims3()?;
    let rows = b * t;
    let [nq, np, nf] = spec.tokens;
    let [cq, cp, cf] = spec.scale_tokens;
    let part = |m: &Tensor, at: usize, n: usize| m.narrow(0, at, n);
    let dy = dy.reshape((rows, d))?.contiguous()?;
    let (kp, vp) = (part(&s.keys, 3 * nq, np)?, part(&s.values, 3 * nq, np)?);
    let (kf, vf) = (
        part(&s.keys, 3 * nq + np, nf)?,
        part(&s.values, 3 * nq + np, nf)?,
    );
    let [dh_ffn, dk_ffn, dv_ffn] =
        pattention_grads(&dy, &s.h_ffn, &kf, &vf, &s.s_ffn, &s.w_ffn, cf)?;
    // ∂x₁: the residual's ∂y and, in sequence, the feed-forward's norm.
    let dx1 = if spec.parallel_residual {
        dy.clone()
    } else {
        (&dy + layer_norm_grad(&s.x1, &dh_ffn, spec.eps)?)?
    };
    let o2 = s.o.reshape((rows, d))?;
    let [do2, dk_proj, dv_proj] = pattention_grads(&dx1, &o2, &kp, &vp, &s.s_proj, &s.w_proj, cp)?;
    // ∂q, ∂k and ∂v [b, heads, t, hd]; q's and k's rotated back; all three as rows
    // [3, rows, d] (one copy each, from [heads, t] to [t, heads]).
    let [dq, dk, dv] = s.attention.grads(&s.o, &do2.reshape((b, t, d))?)?;
    let back = rotary.map(Rotary::inverse);
    let one = |g: Tensor| g.unsqueeze(0);
    let dq = rotate(one(dq)?, back.as_ref())?;
    let dk = rotate(one(dk)?, back.as_ref())?;
    let rows_first = |g: &Tensor| g.transpose(2, 3);
    let dqkv = Tensor::cat(
        &[rows_first(&dq)?, rows_first(&dk)?, rows_first(&one(dv)?)?],
        0,
    )?
    .reshape((3, rows, d))?;
    let v_qkv = part(&s.values, 0, 3 * nq)?.reshape((3, nq, d))?;
    let dv_qkv = s
        .w_qkv
        .transpose(1, 2)?
        .matmul(&dqkv)?
        .reshape((3 * nq, d))?;
    let dw = dqkv
        .matmul(&v_qkv.transpose(1, 2)?)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((rows * 3, nq))?;
    let ds =
        l2_norm_gelu_grad(&s.s_qkv.reshape((rows * 3, nq))?, &dw, cq)?.reshape((rows, 3 * nq))?;
    let k_qkv = part(&s.keys, 0, 3 * nq)?;
    let dk_qkv = ds.t()?.matmul(&s.h)?;
    let mut dh = ds.matmul(&k_qkv)?;
    if spec.parallel_residual {
        dh = (dh + dh_ffn)?;
    }
    let dx = (dx1 + layer_norm_grad(&s.x, &dh, spec.eps)?)?;
    let dkeys = Tensor::cat(&[dk_qkv, dk_proj, dk_ffn], 0)?;
    let dvalues = Tensor::cat(&[dv_qkv, dv_proj, dv_ffn], 0)?;
    Ok([dx.reshape((b, t, d))?, dkeys, dvalues])
}

/// The graph's node: its output is the detached forward's, its backward [`backward`].
struct Node {
    y: Tensor,
    spec: BlockSpec,
    rotary: Option<Rotary>,
    /// Taken by the backward, so the activations go as soon as it has run.
    saved: Mutex<Option<Saved>>,
}

impl Node {
    /// The output's storage, a copy of the forward's result (fresh and contiguous).
    fn output(&self) -> Result<(Storage, Shape)> {
        let (storage, layout) = self.y.storage_and_layout();
        if !layout.is_contiguous() || layout.start_offset() != 0 {
            candle_core::bail!("device block: the forward's result is not a fresh tensor")
        }
        let copy = match &*storage {
            Storage::Cpu(s) => Storage::Cpu(s.try_clone(layout)?),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Storage::Cuda(s.try_clone(layout)?),
            _ => candle_core::bail!("device block: not on the CPU or a CUDA GPU"),
        };
        Ok((copy, layout.shape().clone()))
    }
}

impl CustomOp3 for Node {
    fn name(&self) -> &'static str {
        "device-block"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match self.output()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            _ => candle_core::bail!("device block: the forward ran on another device"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match self.output()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            _ => candle_core::bail!("device block: the forward ran on another device"),
        }
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _keys: &Tensor,
        _values: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(saved) = self.saved.lock().expect("not poisoned").take() else {
            candle_core::bail!("device block: a second backward through the same forward")
        };
        let [dx, dkeys, dvalues] = backward(&saved, grad_res, &self.spec, self.rotary.as_ref())?;
        Ok((Some(dx), Some(dkeys), Some(dvalues)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{max_abs, max_abs_diff};
    use candle_core::{DType, Device, Var, D};

    /// Deterministic, irregular values of `shape`, different for each salt (rows that
    /// differ by a constant would all normalise alike).
    fn filled(shape: &[usize], salt: f64, scale: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n)
            .map(|i| {
                (((i as f64 * 12.9898 + salt * 78.233).sin() * 43758.5453).fract() - 0.5) * scale
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The tests' block: x [2, 5, 8] in two heads of 4; 6 q/k/v, 4 proj and 10
    /// feed-forward parameter tokens (`TOKENS` in all).
    const SHAPE: (usize, usize, usize) = (2, 5, 8);
    const TOKENS: usize = 3 * 6 + 4 + 10;

    fn spec(causal: bool, parallel_residual: bool) -> BlockSpec {
        BlockSpec {
            heads: 2,
            tokens: [6, 4, 10],
            scale_tokens: [6, 5, 10],
            causal,
            parallel_residual,
            eps: 1e-5,
        }
    }

    /// The node against the same block composed from candle ops (the training path of
    /// every other device), in f64: outputs, ∂x, ∂keys and ∂values of a weighted sum.
    #[test]
    fn the_node_computes_and_differentiates_the_composite_block() {
        let ((b, t, d), n) = (SHAPE, TOKENS);
        for parallel in [false, true] {
            for with_rotary in [false, true] {
                let spec = spec(with_rotary, parallel);
                let x = Var::from_tensor(&filled(&[b, t, d], 0.1, 2.0)).unwrap();
                let keys = Var::from_tensor(&filled(&[n, d], 0.3, 1.0)).unwrap();
                let values = Var::from_tensor(&filled(&[n, d], 0.7, 0.5)).unwrap();
                let rotary = with_rotary.then(|| tables(t, DType::F64));
                let weight = filled(&[b, t, d], 0.9, 1.0);
                let node = block(&x, &keys, &values, &spec, rotary.as_ref()).unwrap();
                let want = composite(&x, &keys, &values, &spec, rotary.as_ref());
                let case = format!("parallel {parallel}, rotary {with_rotary}");
                assert!(max_abs_diff(&node, &want) < 1e-12, "output ({case})");
                let loss = |y: &Tensor| (y * &weight).unwrap().sum_all().unwrap();
                let (got, auto) = (
                    loss(&node).backward().unwrap(),
                    loss(&want).backward().unwrap(),
                );
                for (v, what) in [(&x, "∂x"), (&keys, "∂keys"), (&values, "∂values")] {
                    let (g, a) = (got.get(v).unwrap(), auto.get(v).unwrap());
                    // candle's own GELU backward is good to ~1e-7 (finite differences
                    // agree with the node's Θ to 1e-10 where they differ from it).
                    assert!(max_abs_diff(g, a) < 1e-6 * max_abs(a), "{what} ({case})");
                    // Central differences of the loss on a few elements.
                    let base = v
                        .as_tensor()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap();
                    let g = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                    for i in [0, base.len() / 2, base.len() - 1] {
                        let at = |delta: f64| {
                            let mut moved = base.clone();
                            moved[i] += delta;
                            v.set(&Tensor::from_vec(moved, v.shape(), &Device::Cpu).unwrap())
                                .unwrap();
                            let y = composite(&x, &keys, &values, &spec, rotary.as_ref());
                            loss(&y).to_scalar::<f64>().unwrap()
                        };
                        let fd = (at(1e-6) - at(-1e-6)) / 2e-6;
                        at(0.0);
                        assert!(
                            (fd - g[i]).abs() < 1e-7,
                            "{what}[{i}] ({case}): {} vs {fd}",
                            g[i]
                        );
                    }
                }
            }
        }
    }

    /// Rotary tables for positions 0..t of 2 rotated features a head (the rotary path
    /// of the heads of 4 in these tests: the first two features, the others passed on).
    fn tables(t: usize, dtype: DType) -> Rotary {
        let angle = Tensor::arange(0.0, t as f64, &Device::Cpu)
            .unwrap()
            .affine(0.3, 0.0)
            .unwrap()
            .reshape((t, 1))
            .unwrap();
        let of = |a: Tensor| a.to_dtype(dtype).unwrap();
        Rotary::new(2, &of(angle.cos().unwrap()), &of(angle.sin().unwrap())).unwrap()
    }

    /// The node in f32, whose rotation is the `rotary_heads` op (the GPU's kernel, here
    /// its CPU loops), against the node in f64 (composed rotation, which the test above
    /// holds to candle's autograd and finite differences): the output and ∂x, ∂keys,
    /// ∂values of a weighted sum, to f32's precision.
    #[test]
    fn in_f32_the_node_rotates_with_the_kernel_op_as_in_f64() {
        let ((b, t, d), n) = (SHAPE, TOKENS);
        for parallel in [false, true] {
            let spec = spec(true, parallel);
            let inputs = [
                filled(&[b, t, d], 0.1, 2.0),
                filled(&[n, d], 0.3, 1.0),
                filled(&[n, d], 0.7, 0.5),
            ];
            let weight = filled(&[b, t, d], 0.9, 1.0);
            let run = |dtype: DType| {
                let [x, keys, values] = inputs
                    .clone()
                    .map(|v| Var::from_tensor(&v.to_dtype(dtype).unwrap()).unwrap());
                let rotary = tables(t, DType::F32);
                let y = block(&x, &keys, &values, &spec, Some(&rotary)).unwrap();
                let loss = (&y * weight.to_dtype(dtype).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let g = loss.backward().unwrap();
                let wide = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
                [&x, &keys, &values]
                    .map(|v| wide(g.get(v).unwrap()))
                    .to_vec()
                    .into_iter()
                    .chain([wide(&y)])
                    .collect::<Vec<_>>()
            };
            let (f32s, f64s) = (run(DType::F32), run(DType::F64));
            for ((a, e), what) in f32s.iter().zip(&f64s).zip(["∂x", "∂keys", "∂values", "y"])
            {
                let (diff, size) = (max_abs_diff(a, e), max_abs(e));
                assert!(
                    diff < 2e-5 * size,
                    "{what} (parallel {parallel}): {diff} of {size}"
                );
            }
        }
    }

    /// The block from candle ops, differentiated by candle's autograd.
    fn composite(
        x: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        spec: &BlockSpec,
        rotary: Option<&Rotary>,
    ) -> Tensor {
        let (b, t, d) = x.dims3().unwrap();
        let [nq, np, nf] = spec.tokens;
        let [cq, cp, cf] = spec.scale_tokens;
        let norm = |x: &Tensor| {
            let mean = x.mean_keepdim(D::Minus1).unwrap();
            let c = x.broadcast_sub(&mean).unwrap();
            let var = c.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            c.broadcast_div(&(var + spec.eps).unwrap().sqrt().unwrap())
                .unwrap()
        };
        let pattention = |x: &Tensor, at: usize, n: usize, c: usize| {
            let s = x
                .matmul(&keys.narrow(0, at, n).unwrap().t().unwrap())
                .unwrap();
            crate::pattention::theta(&s, crate::pattention::Activation::L2NormGelu, c)
                .unwrap()
                .matmul(&values.narrow(0, at, n).unwrap())
                .unwrap()
        };
        let x2 = x.reshape((b * t, d)).unwrap();
        let h = norm(&x2);
        let heads = |x: Tensor| x.reshape((b, t, spec.heads, d / spec.heads)).unwrap();
        let first = |x: Tensor| x.transpose(1, 2).unwrap().contiguous().unwrap();
        let rot = |x: Tensor| {
            let x = x.unsqueeze(0).unwrap();
            rotate(x, rotary).unwrap().squeeze(0).unwrap()
        };
        let q = rot(first(heads(pattention(&h, 0, nq, cq))));
        let k = rot(first(heads(pattention(&h, nq, nq, cq))));
        let v = first(heads(pattention(&h, 2 * nq, nq, cq)));
        let scores = q.matmul(&k.t().unwrap()).unwrap();
        let hd = (d / spec.heads) as f64;
        let p = super::super::lm::masked_softmax(&scores, 1.0 / hd.sqrt(), spec.causal).unwrap();
        let o = p
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b * t, d))
            .unwrap();
        let a = pattention(&o, 3 * nq, np, cp);
        let y = if spec.parallel_residual {
            ((&x2 + a).unwrap() + pattention(&h, 3 * nq + np, nf, cf)).unwrap()
        } else {
            let x1 = (&x2 + a).unwrap();
            (&x1 + pattention(&norm(&x1), 3 * nq + np, nf, cf)).unwrap()
        };
        assert_eq!(y.dtype(), DType::F64);
        y.reshape((b, t, d)).unwrap()
    }
}
