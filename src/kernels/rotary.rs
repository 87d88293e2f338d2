//! GPT-NeoX rotary position embedding (rotate-half) as one fused row-parallel
//! pass over the heads.

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{max_abs_diff, spread};
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
}
