//! Dot and axpy against half-precision weight rows with f32 arithmetic: the
//! decode kernels for f16 weights. Each 16 halves are widened in registers
//! (`vcvtph2ps`) right after the load, so memory traffic is half that of f32
//! weights and nothing is converted into a buffer first.

use ::half::f16;

/// Σ x[i]·w[i].
pub fn dot(x: &[f32], w: &[f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { avx512::dot(x, w) };
    }
    x.iter().zip(w).map(|(a, b)| a * b.to_f32()).sum()
}

/// y[i] += a·w[i].
pub fn axpy(a: f32, w: &[f16], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { avx512::axpy(a, w, y) };
    }
    for (o, v) in y.iter_mut().zip(w) {
        *o += a * v.to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use ::half::f16;
    use std::arch::x86_64::*;

    /// 16 halves at `w` widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(w: *const f16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable halves (f16 is a u16).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(w as *const __m256i)) }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot(x: &[f32], w: &[f16]) -> f32 {
        let n = x.len().min(w.len());
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load is within 0..n of both slices.
        unsafe {
            while i + 64 <= n {
                for (j, a) in acc.iter_mut().enumerate() {
                    let o = i + 16 * j;
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(o)), load16(wp.add(o)), *a);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(i)), load16(wp.add(i)), acc[0]);
                i += 16;
            }
        }
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let tail: f32 = x[i..n]
            .iter()
            .zip(&w[i..n])
            .map(|(a, b)| a * b.to_f32())
            .sum();
        _mm512_reduce_add_ps(sum) + tail
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy(a: f32, w: &[f16], y: &mut [f32]) {
        let n = y.len().min(w.len());
        let (wp, yp) = (w.as_ptr(), y.as_mut_ptr());
        let av = _mm512_set1_ps(a);
        let mut i = 0;
        // SAFETY: every access is within 0..n of both slices.
        unsafe {
            while i + 16 <= n {
                let v = _mm512_fmadd_ps(av, load16(wp.add(i)), _mm512_loadu_ps(yp.add(i)));
                _mm512_storeu_ps(yp.add(i), v);
                i += 16;
            }
        }
        for (o, v) in y[i..n].iter_mut().zip(&w[i..n]) {
            *o += a * v.to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_kernels_equal_widened_f32() {
        // 147 = two 64-blocks, one 16-block and a 3-element tail.
        let w: Vec<f16> = (0..147)
            .map(|i| f16::from_f32((i as f32 * 0.37).sin()))
            .collect();
        let x: Vec<f32> = (0..147).map(|i| (i as f32 * 0.11).cos()).collect();
        let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let want: f64 = x
            .iter()
            .zip(&wide)
            .map(|(a, b)| (*a as f64) * (*b as f64))
            .sum();
        assert!(
            (dot(&x, &w) as f64 - want).abs() < 1e-4,
            "{} vs {want}",
            dot(&x, &w)
        );
        let mut y = x.clone();
        axpy(0.5, &w, &mut y);
        for i in 0..147 {
            assert!((y[i] - (x[i] + 0.5 * wide[i])).abs() < 1e-6, "at {i}");
        }
    }
}
