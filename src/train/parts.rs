//! Pieces the three trainable models share: their variables with the dtypes of mixed
//! precision ([`Weights`] and the methods [`weights_methods`] gives each model), and
//! the classifier's image embedding (which the merged model's image rows use too).

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};

use super::lm::{Cast, Params};
use crate::checkpoint::Tensors;
use crate::error::{Error, Result};
use crate::models::vit;

/// A trainable model's variables by canonical name, in f32 or f64, and the dtype its
/// forward computes in: theirs, or bf16 or f16 over casts of them (mixed precision,
/// the variables and the optimiser staying in theirs).
pub(crate) struct Weights {
    pub(super) params: BTreeMap<String, Var>,
    pub(super) dtype: DType,
    pub(super) compute: DType,
}

impl Weights {
    /// The tensors of `expected` (name, shape) from `tensors` as variables, as
    /// [`wrap_vars`]; the forward computes in `dtype` until told otherwise.
    pub(crate) fn new(
        expected: Vec<(String, Vec<usize>)>,
        tensors: &Tensors,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            params: wrap_vars(expected, tensors, dtype, device)?,
            dtype,
            compute: dtype,
        })
    }

    /// The variables as the forward reads them.
    pub(crate) fn cast(&self) -> Cast<'_, BTreeMap<String, Var>> {
        Cast {
            params: &self.params,
            dtype: self.compute,
        }
    }
}

/// The public mixed-precision methods of a trainable model whose [`Weights`] are its
/// field `weights`, written once for the three; inherent methods (not a trait's), so
/// that callers need nothing in scope.
macro_rules! weights_methods {
    () => {
        /// The forward in `dtype` (bf16 or f16 for mixed precision; the variables' own
        /// dtype for none): products and activations in it, norms, softmaxes and the loss
        /// in f32, gradients reaching the variables in theirs.
        pub fn with_compute_dtype(mut self, dtype: candle_core::DType) -> Self {
            self.weights.compute = dtype;
            self
        }

        /// The variables' dtype.
        pub fn dtype(&self) -> candle_core::DType {
            self.weights.dtype
        }

        /// The dtype the forward computes in.
        pub fn compute_dtype(&self) -> candle_core::DType {
            self.weights.compute
        }

        /// Every variable by canonical name.
        pub fn params(&self) -> &std::collections::BTreeMap<String, candle_core::Var> {
            &self.weights.params
        }
    };
}
pub(crate) use weights_methods;

/// The tensors of `expected` (name, shape) from `tensors`, converted to `dtype` on
/// `device`, as variables. Every expected tensor must be present with its shape, and
/// none may be left over.
fn wrap_vars(
    expected: Vec<(String, Vec<usize>)>,
    tensors: &Tensors,
    dtype: DType,
    device: &Device,
) -> Result<BTreeMap<String, Var>> {
    let mut params = BTreeMap::new();
    for (name, shape) in expected {
        let Some(t) = tensors.get(&name) else {
            return Err(Error::Tensor {
                name,
                msg: "missing".into(),
            });
        };
        if t.dims() != shape.as_slice() {
            return Err(Error::Tensor {
                msg: format!("has shape {:?}, expected {shape:?}", t.dims()),
                name,
            });
        }
        let t = t.to_device(device)?.to_dtype(dtype)?;
        params.insert(name, Var::from_tensor(&t)?);
    }
    if let Some(extra) = tensors.keys().find(|k| !params.contains_key(*k)) {
        return Err(Error::Tensor {
            name: extra.clone(),
            msg: "is not used by this config".into(),
        });
    }
    Ok(params)
}

/// The device the variables live on (CPU when there are none).
pub(crate) fn device_of(params: &BTreeMap<String, Var>) -> Device {
    params
        .values()
        .next()
        .map_or(Device::Cpu, |v| v.device().clone())
}

/// Image tokens [b, N+1, d] of normalised pixels [b, C, H, W]: the class token, then
/// the patches (the stride-p convolution as unfold + matmul), plus the position
/// embeddings; tensors under `prefix` (`""` or `"vision."`).
pub(crate) fn embed_image<P: Params + ?Sized>(
    params: &P,
    prefix: &str,
    cfg: &vit::Config,
    pixels: &Tensor,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let b = cfg.image_batch(pixels)?;
    let (c, s) = (cfg.num_channels, cfg.image_size);
    let p = |name: &str| -> candle_core::Result<Tensor> {
        super::lm::param(params, &format!("{prefix}{name}"))
    };
    let (ps, d) = (cfg.patch_size, cfg.hidden_size);
    let (gh, gw) = (s / ps, s / ps);
    let patches = pixels
        .to_dtype(dtype)?
        .reshape((b, c, gh, ps, gw, ps))?
        .permute((0, 2, 4, 1, 3, 5))?
        .contiguous()?
        .reshape((b * gh * gw, c * ps * ps))?;
    let weight = p("patch_embed.weight")?.reshape((d, c * ps * ps))?;
    let patches = patches
        .matmul(&weight.t()?)?
        .broadcast_add(&p("patch_embed.bias")?)?
        .reshape((b, gh * gw, d))?;
    let cls = p("cls_token")?.broadcast_as((b, 1, d))?;
    Tensor::cat(&[&cls, &patches], 1)?.broadcast_add(&p("pos_embed")?)
}

/// Σ f(a, b) over 32 independent f32 lanes, added up in f64: one running sum is a
/// serial chain of adds (four cycles an element) and does not vectorise. Inlined into
/// the row kernels compiled by [`by_isa`].
#[inline(always)]
pub(crate) fn lanes(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f64 {
    let mut acc = [0f32; 32];
    let (ca, cb) = (a.chunks_exact(32), b.chunks_exact(32));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..32 {
            acc[k] += f(x[k], y[k]);
        }
    }
    for (k, (&x, &y)) in ra.iter().zip(rb).enumerate() {
        acc[k] += f(x, y);
    }
    acc.iter().map(|&x| f64::from(x)).sum()
}

/// `pub(super) fn NAME(args)` calling `GENERIC(args)` compiled for the instruction set
/// the kernels selected (AVX-512, AVX2 + FMA, or the build target's), so that plain
/// element loops vectorise as wide as the CPU allows.
macro_rules! by_isa {
    ($name:ident($($arg:ident: $ty:ty),*) = $generic:ident) => {
        $crate::train::parts::by_isa!(@one $name($($arg: $ty),*) = $generic, $generic);
    };
    // `GENERIC::<fma>`: GENERIC::<true> where the instruction set has FMA, ::<false> where not.
    ($name:ident($($arg:ident: $ty:ty),*) = $generic:ident::<fma>) => {
        $crate::train::parts::by_isa!(@one $name($($arg: $ty),*) = $generic::<true>, $generic::<false>);
    };
    (@one $name:ident($($arg:ident: $ty:ty),*) = $fast:path, $plain:path) => {
        pub(crate) fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) { $fast($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) { $fast($($arg),*) }
                match $crate::kernels::active().isa() {
                    // SAFETY: the selected ISA is one this CPU supports.
                    $crate::kernels::Isa::Avx512 => return unsafe { v4($($arg),*) },
                    // SAFETY: as above.
                    $crate::kernels::Isa::Avx2 => return unsafe { v3($($arg),*) },
                    $crate::kernels::Isa::Portable => {}
                }
            }
            $plain($($arg),*)
        }
    };
}
pub(crate) use by_isa;
