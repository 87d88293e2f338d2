//! Per-row primitives (dot, axpy, sums, maxima, softmax) written as plain
//! loops over fixed-width lane arrays, and [`dispatch!`], which compiles a
//! generic body for AVX2+FMA and for AVX-512 and picks one at run time.

use super::math::exp_f32;

/// The same loops compiled for AVX2+FMA / AVX-512 and chosen at run time: the
/// default x86-64 target only has SSE2, which halves these bandwidth- and
/// erf-bound loops. The bodies are the generic ones, so results do not depend
/// on the CPU beyond float rounding.
macro_rules! dispatch {
    ($($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $generic:ident;)*) => {$(
        $(#[$doc])*
        #[inline]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? { $generic($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? { $generic($($arg),*) }
                if is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: as above.
                    return unsafe { v3($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    )*};
}
pub(super) use dispatch;

/// Σ x² with 8 independent accumulators (vectorises, and is more accurate
/// than one running sum).
#[inline(always)]
pub(super) fn sum_sq(row: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            acc[k] += c[k] * c[k];
        }
    }
    acc.iter().sum::<f32>() + tail.iter().map(|v| v * v).sum::<f32>()
}

/// The largest value, with 16 running maxima so it vectorises (a fold over
/// `f32::max` is a serial chain of NaN-aware compares).
#[inline(always)]
fn max_of(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..16 {
            acc[k] = if c[k] > acc[k] { c[k] } else { acc[k] };
        }
    }
    tail.iter()
        .chain(&acc)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

#[inline(always)]
fn max_and_exp_sum_generic(row: &[f32]) -> (f32, f64) {
    let max = max_of(row);
    let whole = row.len() / 16 * 16;
    let mut sum = 0f64;
    // f32 lanes, flushed to f64 every 4096 values to keep the sum exact enough
    // for a vocabulary-sized row.
    for block in row[..whole].chunks(4096) {
        let mut acc = [0f32; 16];
        for c in block.chunks_exact(16) {
            for k in 0..16 {
                acc[k] += exp_f32(c[k] - max);
            }
        }
        sum += acc.iter().map(|&v| v as f64).sum::<f64>();
    }
    sum += row[whole..]
        .iter()
        .map(|&v| exp_f32(v - max) as f64)
        .sum::<f64>();
    (max, sum)
}

/// In-place softmax of `row[..valid]`; entries from `valid` on become 0
/// (the causal mask).
#[inline(always)]
pub(super) fn softmax_row_generic(row: &mut [f32], valid: usize) {
    let (live, masked) = row.split_at_mut(valid);
    let max = max_of(live);
    let mut acc = [0f32; 16];
    let mut chunks = live.chunks_exact_mut(16);
    for c in &mut chunks {
        for k in 0..16 {
            c[k] = exp_f32(c[k] - max);
            acc[k] += c[k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp_f32(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    live.iter_mut().for_each(|v| *v *= inv);
    masked.fill(0.0);
}

#[inline(always)]
fn axpy_generic(a: f32, x: &[f32], y: &mut [f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..16 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + ta.iter().zip(tb).map(|(x, y)| x * y).sum::<f32>()
}

fn sum_generic(a: &[f32]) -> f32 {
    // Four vectors of partial sums, so the adds' latency never limits the read.
    let mut acc = [0f32; 64];
    let c = a.chunks_exact(64);
    let tail = c.remainder();
    for x in c {
        for k in 0..64 {
            acc[k] += x[k];
        }
    }
    acc.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

dispatch! {
    pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 = dot_generic;
    pub(super) fn axpy(a: f32, x: &[f32], y: &mut [f32]) = axpy_generic;
    pub(super) fn softmax_row(row: &mut [f32], valid: usize) = softmax_row_generic;
    /// The row's maximum and Σ exp(v − max): a log-softmax's two reductions,
    /// vectorised (the output layer's rows are vocabulary-sized).
    pub fn max_and_exp_sum(row: &[f32]) -> (f32, f64) = max_and_exp_sum_generic;
    /// Σ a, vectorised: the streaming read the benchmark measures bandwidth with.
    pub fn sum(a: &[f32]) -> f32 = sum_generic;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_matches_f64_sum() {
        // Lengths around the 64-wide chunks, so the tail is exercised too.
        for n in [0, 1, 63, 64, 65, 1000, 4099] {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 8.0)
                .collect();
            let want: f64 = v.iter().map(|&x| x as f64).sum();
            assert!((sum(&v) as f64 - want).abs() < 1e-3, "n={n}");
        }
    }
}
