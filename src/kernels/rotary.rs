//! GPT-NeoX rotary position embedding (rotate-half) as one op for the CPU and a
//! GPU: a row-parallel pass over the heads on the CPU, one launch on a GPU
//! (`cuda/rotary.cu`), both reading queries and keys through their strides
//! (stacked [n, b, h, t, hd] as the fused q/k/v product leaves them, or one at a
//! time), where candle's ops took a copy, `rope` and a concatenation each.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::f32_slice;

/// Rotary positions for x [n, b, h, t, hd] (f32, bf16 or f16; each head's
/// features contiguous, other strides free) at positions offset..offset + t,
/// with the model's whole cos/sin tables [positions, dims/2] (f32): a
/// contiguous tensor of x's shape and dtype, the arithmetic in f32 with each
/// product and difference rounded (`rope`'s on widened features), so both
/// devices give the same bits.
pub fn rotary_heads(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    dims: usize,
    offset: usize,
) -> Result<Tensor> {
    let (_, _, _, t, hd) = x.dims5()?;
    let (positions, half) = cos.dims2()?;
    let tables = sin.dims() == [positions, half] && [cos.dtype(), sin.dtype()] == [DType::F32; 2];
    if !tables || dims != 2 * half || dims > hd || offset + t > positions || x.stride()[4] != 1 {
        candle_core::bail!(
            "rotary: {dims} rotated features of {hd}, positions {offset}..{} of f32 tables \
             {:?} and {:?}, strides {:?} (each head's features must be contiguous)",
            offset + t,
            cos.dims(),
            sin.dims(),
            x.stride()
        )
    }
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    x.apply_op3_no_bwd(&cos, &sin, &Heads { dims, offset })
}

/// Whether the model rotates `x` with [`rotary_heads`]: f32/bf16/f16 with each
/// head's features contiguous, on the CPU with its fused kernels on or on a GPU
/// with the CUDA kernels on.
pub(crate) fn serves(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    let gpu = super::rows_cuda::serves(x);
    #[cfg(not(feature = "cuda"))]
    let gpu = false;
    let float = matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16);
    (gpu || (super::fused_on(x) && float)) && x.stride().last() == Some(&1)
}

/// [`rotary_heads`]'s op.
struct Heads {
    dims: usize,
    offset: usize,
}

impl Heads {
    /// x's rotated rows into a contiguous output, a task per row of hd
    /// features: each row's start from x's strides, its position from its t index.
    fn cpu<T: WithDType>(&self, x: &[T], l: &Layout, cos: &[f32], sin: &[f32]) -> Vec<T> {
        let (d, s) = (l.dims(), l.stride());
        let (half, t, hd) = (self.dims / 2, d[3], d[4].max(1));
        let mut out = vec![T::zero(); l.shape().elem_count()];
        // Tasks of at least ~16K elements: a decoding step's few rows stay on
        // this thread instead of waking the others.
        let min_rows = (16_384 / hd).max(1);
        let wide = |v: T| v.to_f64() as f32;
        let round = |v: f32| T::from_f64(f64::from(v));
        out.par_chunks_mut(hd)
            .with_min_len(min_rows)
            .enumerate()
            .for_each(|(r, o)| {
                let (mut rest, mut at) = (r, l.start_offset());
                for axis in (0..4).rev() {
                    at += rest % d[axis] * s[axis];
                    rest /= d[axis];
                }
                let row = &x[at..at + hd];
                let pos = (self.offset + r % t) * half;
                let (c, sn) = (&cos[pos..pos + half], &sin[pos..pos + half]);
                let (x1, x2) = row[..self.dims].split_at(half);
                let (o1, o) = o.split_at_mut(half);
                let (o2, pass) = o.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (wide(x1[i]), wide(x2[i]));
                    o1[i] = round(a * c[i] - b * sn[i]);
                    o2[i] = round(b * c[i] + a * sn[i]);
                }
                pass.copy_from_slice(&row[self.dims..]);
            });
        out
    }
}

impl candle_core::CustomOp3 for Heads {
    fn name(&self) -> &'static str {
        "rotary-heads"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
        ss: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (cos, sin) = (f32_slice(sc, lc, "rotary")?, f32_slice(ss, ls, "rotary")?);
        let out = match sx {
            CpuStorage::F32(x) => CpuStorage::F32(self.cpu(x, lx, cos, sin)),
            CpuStorage::BF16(x) => CpuStorage::BF16(self.cpu(x, lx, cos, sin)),
            CpuStorage::F16(x) => CpuStorage::F16(self.cpu(x, lx, cos, sin)),
            s => candle_core::bail!("rotary: f32, bf16 or f16, not {:?}", s.dtype()),
        };
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sc: &candle_core::CudaStorage,
        lc: &Layout,
        ss: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::launch((sx, lx), (sc, lc), (ss, ls), self.dims, self.offset)?;
        Ok((out, lx.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Result};

    use super::super::rows_cuda::by_dtype;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rotary.ptx"));

    type Arg<'a> = (&'a CudaStorage, &'a Layout);

    pub(super) fn launch(
        x: Arg,
        cos: Arg,
        sin: Arg,
        dims: usize,
        offset: usize,
    ) -> Result<CudaStorage> {
        by_dtype!(x.0.dtype(), "rotary kernel", |T, name| {
            run::<T>(&format!("rotary_heads_{name}"), x, cos, sin, dims, offset)
        })
    }

    fn run<T: DeviceRepr + CudaDType>(
        kernel: &str,
        (sx, lx): Arg,
        (sc, lc): Arg,
        (ss, ls): Arg,
        dims: usize,
        offset: usize,
    ) -> Result<CudaStorage> {
        let d = lx.dims();
        let total = lx.shape().elem_count();
        let dev = &sx.device;
        // SAFETY: the kernel writes every element before anything reads it.
        let out = unsafe { dev.alloc::<T>(total)? };
        if total == 0 {
            return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
        }
        let int = |v: usize| -> Result<i32> {
            i32::try_from(v)
                .map_err(|_| candle_core::Error::Msg(format!("rotary kernel: {v} too large")))
        };
        let ints = [
            int(d[1])?,
            int(d[2])?,
            int(d[3])?,
            int(d[4])?,
            int(dims)?,
            int(offset)?,
        ];
        let longs: Vec<i64> = lx.stride()[..4]
            .iter()
            .map(|&s| s as i64)
            .chain([total as i64])
            .collect();
        let x = sx.as_cuda_slice::<T>()?.slice(lx.start_offset()..);
        let cos = sc.as_cuda_slice::<f32>()?.slice(lc.start_offset()..);
        let sin = ss.as_cuda_slice::<f32>()?.slice(ls.start_offset()..);
        let func = dev.get_or_load_custom_func(kernel, "tokenformer_rotary", PTX)?;
        const THREADS: usize = 256;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(THREADS).min(1 << 20) as u32, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&x).arg(&out).arg(&cos).arg(&sin);
        for i in &ints {
            b.arg(i);
        }
        for l in &longs {
            b.arg(l);
        }
        // SAFETY: the arguments are rotary.cu's (x, y, cos, sin, b, h, t, hd, dims,
        // offset, four strides, total); rotary_heads checked that positions
        // offset..offset + t are in the tables and that x's strides stay inside it.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{bits, max_abs_diff, spread};
    use candle_core::D;

    /// The model's plain path: `rope` on the rotated features (widened to f32),
    /// the rest passed through, x [b, h, t, hd] at positions offset..offset + t.
    fn plain(x: &Tensor, cos: &Tensor, sin: &Tensor, dims: usize, offset: usize) -> Tensor {
        let (_, _, t, hd) = x.dims4().unwrap();
        let (c, s) = (
            cos.narrow(0, offset, t).unwrap(),
            sin.narrow(0, offset, t).unwrap(),
        );
        let rot = x
            .narrow(D::Minus1, 0, dims)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let rot = candle_nn::rotary_emb::rope(&rot.contiguous().unwrap(), &c, &s).unwrap();
        let pass = x.narrow(D::Minus1, dims, hd - dims).unwrap();
        Tensor::cat(&[&rot.to_dtype(x.dtype()).unwrap(), &pass], D::Minus1).unwrap()
    }

    /// Queries and keys stacked as a fused q/k/v product leaves them ([2, b, h,
    /// t, hd] over [3, b, t, h, hd]), and one of them alone, rotate as candle's
    /// `rope` on the rotated features does, bit for bit in f32 and bf16, at a
    /// position offset, with the other features passed through (or none).
    /// Bad tables or offsets are an error, not a read past them.
    #[test]
    fn rotates_as_candle_rope_does() {
        let (b, t, h, hd, positions, offset) = (2, 3, 4, 8, 9, 5);
        let qkv = spread((3, b, t, h, hd));
        for dims in [4, 8] {
            let angles = spread((positions, dims / 2)).affine(7.0, 0.0).unwrap();
            let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
            for dtype in [DType::F32, DType::BF16] {
                let x = qkv.to_dtype(dtype).unwrap();
                let qk = x.narrow(0, 0, 2).unwrap().transpose(2, 3).unwrap();
                let got = rotary_heads(&qk, &cos, &sin, dims, offset).unwrap();
                assert!(got.is_contiguous() && got.dtype() == dtype);
                for i in 0..2 {
                    let one = qk.get(i).unwrap();
                    let want = plain(&one, &cos, &sin, dims, offset);
                    assert_eq!(
                        bits(&got.get(i).unwrap()),
                        bits(&want),
                        "{dims} {dtype:?} {i}"
                    );
                    let alone = rotary_heads(&one.unsqueeze(0).unwrap(), &cos, &sin, dims, offset);
                    assert_eq!(
                        bits(&alone.unwrap()),
                        bits(&want),
                        "{dims} {dtype:?} {i} alone"
                    );
                    assert!(max_abs_diff(&want, &one) > 0.1, "nothing rotated");
                }
            }
        }
        let qk = qkv.narrow(0, 0, 2).unwrap().transpose(2, 3).unwrap();
        let angles = spread((positions, 2)).cos().unwrap();
        for (dims, offset) in [(3, 0), (10, 0), (6, 0), (4, positions - t + 1)] {
            let e = rotary_heads(&qk, &angles, &angles, dims, offset)
                .unwrap_err()
                .to_string();
            assert!(e.contains("rotary:"), "{dims} {offset}: {e}");
        }
    }
}
