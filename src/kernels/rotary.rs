//! GPT-NeoX rotary position embedding (rotate-half) as one fused row-parallel
//! pass over the heads; and, for a GPU, one launch that rotates queries and keys
//! stacked [n, b, h, t, hd] as they come out of their products (`cuda/rotary.cu`),
//! where candle's ops took a copy, `rope` and a concatenation each.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::f32_slice;

/// GPT-NeoX rotary embedding (rotate-half) of the first `dims` features of
/// every head, x [b, t, h, hd] contiguous, cos/sin [t, dims/2].
struct Rotary {
    dims: usize,
}

impl candle_core::CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        "rotary"
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
        let x = f32_slice(sx, lx, "rotary")?;
        let (cos, sin) = (f32_slice(sc, lc, "rotary")?, f32_slice(ss, ls, "rotary")?);
        let (_, t, h, hd) = lx.shape().dims4()?;
        let half = self.dims / 2;
        let mut out = x.to_vec();
        // One task per position: all its heads share a row of cos/sin.
        out.par_chunks_mut(h * hd).enumerate().for_each(|(row, o)| {
            let pos = row % t;
            let (c, s) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
            for head in o.chunks_mut(hd) {
                let (x1, x2) = head[..self.dims].split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    x1[i] = a * c[i] - b * s[i];
                    x2[i] = b * c[i] + a * s[i];
                }
            }
        });
        Ok((CpuStorage::F32(out), lx.shape().clone()))
    }
}

/// Rotary positions for x [b, t, h, hd] (contiguous f32 on the CPU) with
/// the cos/sin rows [t, dims/2] of its positions.
pub(crate) fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor, dims: usize) -> Result<Tensor> {
    x.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &Rotary { dims })
}

/// Rotary positions for x [n, b, h, t, hd] (f32, bf16 or f16; each head's
/// features contiguous, other strides free) at positions offset..offset + t,
/// with the model's whole cos/sin tables [positions, dims/2] (f32): a
/// contiguous tensor of x's shape and dtype, the arithmetic in f32 as the CPU
/// kernel above does it. One kernel launch on a GPU; on the CPU the same
/// definition in plain loops, so its indexing is tested where there is no GPU.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
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

/// Whether the model rotates `x` with [`rotary_heads`]: the CUDA kernels turned
/// on, x f32/bf16/f16 on a GPU with each head's features contiguous (the CPU
/// keeps its own kernel above).
#[cfg(feature = "cuda")]
pub(crate) fn heads_serve(x: &Tensor) -> bool {
    super::rows_cuda::serves(x) && x.stride().last() == Some(&1)
}

/// [`rotary_heads`]'s op.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Heads {
    dims: usize,
    offset: usize,
}

impl Heads {
    /// Element i of the contiguous output over x's layout: (index of x's
    /// element, whether it is rotated, the table index, the partner's index and
    /// the partner's sign).
    fn each(&self, l: &Layout, mut visit: impl FnMut(usize, Option<(usize, usize, bool)>)) {
        let d = l.dims();
        let s = l.stride();
        let (half, hd, t) = (self.dims / 2, d[4], d[3]);
        let rows = l.shape().elem_count() / hd.max(1);
        for r in 0..rows {
            let (mut rest, mut at) = (r, l.start_offset());
            for axis in (0..4).rev() {
                at += rest % d[axis] * s[axis];
                rest /= d[axis];
            }
            let pos = (self.offset + r % t) * half;
            for j in 0..hd {
                let rot = if j < half {
                    Some((pos + j, at + j + half, false))
                } else if j < self.dims {
                    Some((pos + j - half, at + j - half, true))
                } else {
                    None
                };
                visit(at + j, rot);
            }
        }
    }

    fn cpu<T: WithDType>(&self, x: &[T], l: &Layout, cos: &[f32], sin: &[f32]) -> Vec<T> {
        let f = |i: usize| x[i].to_f64() as f32;
        let mut out = Vec::with_capacity(l.shape().elem_count());
        self.each(l, |i, rot| {
            let v = match rot {
                None => f(i),
                Some((c, partner, false)) => f(i) * cos[c] - f(partner) * sin[c],
                Some((c, partner, true)) => f(i) * cos[c] + f(partner) * sin[c],
            };
            out.push(T::from_f64(f64::from(v)));
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
    use candle_core::{CudaStorage, DType, Layout, Result};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rotary.ptx"));

    type Arg<'a> = (&'a CudaStorage, &'a Layout);

    pub(super) fn launch(
        x: Arg,
        cos: Arg,
        sin: Arg,
        dims: usize,
        offset: usize,
    ) -> Result<CudaStorage> {
        match x.0.dtype() {
            DType::F32 => run::<f32>("rotary_heads_f32", x, cos, sin, dims, offset),
            DType::BF16 => run::<::half::bf16>("rotary_heads_bf16", x, cos, sin, dims, offset),
            DType::F16 => run::<::half::f16>("rotary_heads_f16", x, cos, sin, dims, offset),
            d => candle_core::bail!("rotary kernel: no {d:?} version"),
        }
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

    /// The fused pass equals candle's `rope` on the rotated features and
    /// leaves the rest alone, for every batch row and position.
    #[test]
    fn matches_candle_rope_and_passes_the_rest_through() {
        let (b, t, h, hd) = (2, 5, 3, 8);
        for dims in [4, 8] {
            let x = spread((b, t, h, hd));
            let cos = spread((t, dims / 2)).cos().unwrap();
            let sin = spread((t, dims / 2)).sin().unwrap();
            let got = rotary(&x, &cos, &sin, dims).unwrap();
            let xh = x.transpose(1, 2).unwrap();
            let rot = xh.narrow(D::Minus1, 0, dims).unwrap().contiguous().unwrap();
            let rot = candle_nn::rotary_emb::rope(&rot, &cos, &sin).unwrap();
            let pass = xh.narrow(D::Minus1, dims, hd - dims).unwrap();
            let want = Tensor::cat(&[&rot, &pass], D::Minus1)
                .unwrap()
                .transpose(1, 2)
                .unwrap();
            let d = max_abs_diff(&got, &want);
            assert!(d <= 1e-6, "dims={dims}: {d}");
            assert!(max_abs_diff(&got, &x) > 0.1, "dims={dims}: nothing rotated");
        }
    }

    /// Queries and keys stacked as a fused q/k/v product leaves them ([2, b, h,
    /// t, hd] over [3, b, t, h, hd]) rotate as the CPU kernel rotates each of
    /// them, bit for bit in f32, at a position offset and with features left
    /// unrotated; bf16 as the model's plain path does it (widened, rotated,
    /// rounded once). Bad tables or offsets are an error, not a read past them.
    #[test]
    fn stacked_heads_rotate_as_the_cpu_kernel_does() {
        let (b, t, h, hd, dims, positions, offset) = (2, 3, 4, 8, 4, 9, 5);
        let qkv = spread((3, b, t, h, hd));
        let qk = qkv.narrow(0, 0, 2).unwrap().transpose(2, 3).unwrap();
        let angles = spread((positions, dims / 2)).affine(7.0, 0.0).unwrap();
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let got = rotary_heads(&qk, &cos, &sin, dims, offset).unwrap();
        assert!(got.is_contiguous());
        let (c, s) = (
            cos.narrow(0, offset, t).unwrap(),
            sin.narrow(0, offset, t).unwrap(),
        );
        for i in 0..2 {
            let rows = qkv.get(i).unwrap().contiguous().unwrap();
            let want = rotary(&rows, &c, &s, dims)
                .unwrap()
                .transpose(1, 2)
                .unwrap();
            let one = got.get(i).unwrap();
            assert_eq!(bits(&one), bits(&want), "part {i}");
            assert!(max_abs_diff(&one, &rows.transpose(1, 2).unwrap()) > 0.1);
        }
        let half = qk.to_dtype(DType::BF16).unwrap();
        let got = rotary_heads(&half, &cos, &sin, dims, offset).unwrap();
        for i in 0..2 {
            let x = half.get(i).unwrap();
            let rot = x
                .narrow(D::Minus1, 0, dims)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let rot = candle_nn::rotary_emb::rope(&rot.contiguous().unwrap(), &c, &s).unwrap();
            let pass = x.narrow(D::Minus1, dims, hd - dims).unwrap();
            let want =
                Tensor::cat(&[&rot.to_dtype(DType::BF16).unwrap(), &pass], D::Minus1).unwrap();
            assert_eq!(bits(&got.get(i).unwrap()), bits(&want), "bf16 part {i}");
        }
        for (dims, offset) in [
            (3, 0),
            (10, 0),
            (2 * (dims / 2) + 2, 0),
            (dims, positions - t + 1),
        ] {
            let e = rotary_heads(&qk, &cos, &sin, dims, offset)
                .unwrap_err()
                .to_string();
            assert!(e.contains("rotary:"), "{dims} {offset}: {e}");
        }
    }
}
