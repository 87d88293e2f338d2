//! The output layer and the mean cross-entropy as one node of the training graph.
//!
//! Why: a language model's logits are the step's largest tensor (8 × 256 tokens ×
//! 50,304 classes is 412 MB). As separate nodes, the loss's backward writes a fresh
//! gradient of that size and candle adds it into a zeroed one before the product's
//! backward reads it: about 2 GB of memory traffic a step. Here the forward turns the
//! logits into the loss's gradient where they lie (the loss is the graph's last node,
//! so its gradient is known up to the upstream scalar), and the backward's two
//! products read that buffer directly.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::*;

/// mean over rows of logsumexp(h·Wᵀ) − (h·Wᵀ)[target], for h [n, d] and W [classes,
/// d], one node whose backward gives ∂h and ∂W.
pub(crate) fn head_cross_entropy(h: &Tensor, w: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let (n, _) = h.dims2()?;
    let (classes, _) = w.dims2()?;
    crate::train::loss::check_targets(n, classes, targets)?;
    h.contiguous()?.apply_op2(
        &w.contiguous()?,
        Head {
            targets: targets.to_vec(),
            grad: Mutex::new(None),
        },
    )
}

struct Head {
    targets: Vec<u32>,
    /// (softmax − one-hot) / n of the forward's logits, for the backward (taken by it).
    grad: Mutex<Option<CpuStorage>>,
}

impl Head {
    fn dims(&self, h: &Layout, w: &Layout) -> Result<(usize, usize, usize)> {
        let (n, d) = h.shape().dims2()?;
        let (classes, dw) = w.shape().dims2()?;
        if d != dw || n != self.targets.len() {
            candle_core::bail!(
                "head cross-entropy: hidden {:?}, weights {:?} and {} targets do not fit",
                h.dims(),
                w.dims(),
                self.targets.len()
            )
        }
        Ok((n, d, classes))
    }

    /// The loss, keeping the logits' gradient.
    fn fwd<T: Elem>(&self, h: &[T], w: &[T], (n, d, classes): (usize, usize, usize)) -> f64 {
        let mut logits = T::matmul(
            n,
            classes,
            d,
            Operand::rows(h, d),
            Operand::transposed(w, d),
        );
        let loss = T::loss_and_grad_in_place(&mut logits, classes, &self.targets);
        *self.grad.lock().expect("not poisoned") = Some(T::to_cpu_storage_owned(logits));
        loss
    }

    /// (∂h, ∂W) for an upstream gradient `g` of the loss.
    fn bwd_t<T: Elem>(
        &self,
        h: &[T],
        w: &[T],
        g: f64,
        (n, d, classes): (usize, usize, usize),
    ) -> Result<(Vec<T>, Vec<T>)> {
        let saved = self.grad.lock().expect("not poisoned").take();
        let grad = match saved.map(T::cpu_storage_data) {
            Some(Ok(grad)) => grad,
            Some(Err(_)) => {
                candle_core::bail!("head cross-entropy: a saved gradient of another dtype")
            }
            // A second backward over the same graph recomputes what the first one took.
            None => {
                self.fwd(h, w, (n, d, classes));
                return self.bwd_t(h, w, g, (n, d, classes));
            }
        };
        let mut dh = T::matmul(
            n,
            d,
            classes,
            Operand::rows(&grad, classes),
            Operand::rows(w, d),
        );
        let mut dw = T::matmul(
            classes,
            d,
            n,
            Operand::transposed(&grad, classes),
            Operand::rows(h, d),
        );
        if g != 1.0 {
            let g = T::from_f64(g);
            dh.iter_mut().chain(dw.iter_mut()).for_each(|x| *x *= g);
        }
        Ok((dh, dw))
    }
}

impl CustomOp2 for Head {
    fn name(&self) -> &'static str {
        "head-cross-entropy-train"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims(l1, l2)?;
        let what = "head cross-entropy";
        let out = match s1 {
            CpuStorage::F32(_) => {
                let loss = self.fwd(
                    contiguous::<f32>(s1, l1, what)?,
                    contiguous(s2, l2, what)?,
                    dims,
                );
                CpuStorage::F32(vec![loss as f32])
            }
            CpuStorage::F64(_) => {
                let loss = self.fwd(
                    contiguous::<f64>(s1, l1, what)?,
                    contiguous(s2, l2, what)?,
                    dims,
                );
                CpuStorage::F64(vec![loss])
            }
            _ => candle_core::bail!("{what}: f32 or f64 expected"),
        };
        Ok((out, Shape::from(())))
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        fn run<T: Elem>(op: &Head, h: &Tensor, w: &Tensor, g: f64) -> Result<(Tensor, Tensor)> {
            let what = "head cross-entropy";
            let dims = op.dims(h.layout(), w.layout())?;
            let (dh, dw) =
                read::<T, _>(h, what, |hs| read(w, what, |ws| op.bwd_t(hs, ws, g, dims)))?;
            let cpu = &candle_core::Device::Cpu;
            Ok((
                Tensor::from_vec(dh, h.shape(), cpu)?,
                Tensor::from_vec(dw, w.shape(), cpu)?,
            ))
        }
        let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let (dh, dw) = match h.dtype() {
            DType::F32 => run::<f32>(self, h, w, g)?,
            DType::F64 => run::<f64>(self, h, w, g)?,
            dt => candle_core::bail!("head cross-entropy backward: {dt:?}"),
        };
        Ok((Some(dh), Some(dw)))
    }
}
