//! Seeded random initialisation: the one generator the toolkit draws new weights from
//! (grown parameter tokens, a merged model's bridge values, a fresh model to train).
//!
//! Each tensor draws from its own stream, seeded by the run's seed and the tensor's
//! name, so a tensor's values do not depend on which other tensors were drawn or in
//! what order; the same (seed, name, shape, std) gives the same values on every machine.
//!
//! ```
//! let a = tokenformer::init::normal(4, 8, 0.02, 7, "layers.0.mlp.value_param_tokens");
//! assert_eq!(a.len(), 32);
//! assert_eq!(a, tokenformer::init::normal(4, 8, 0.02, 7, "layers.0.mlp.value_param_tokens"));
//! assert_ne!(a, tokenformer::init::normal(4, 8, 0.02, 7, "layers.1.mlp.value_param_tokens"));
//! ```

use candle_core::{Device, Result, Shape, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// 64-bit FNV-1a of `name`: the per-tensor part of a stream's seed.
fn fnv1a(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// `rows × cols` samples of N(0, `std`²), row-major, from the stream of (`seed`,
/// `name`): a `StdRng` seeded with `seed ^ FNV-1a(name)`, turned into normals by
/// Box–Muller, which gives two samples (cos and sin) per pair of uniforms.
pub fn normal(rows: usize, cols: usize, std: f64, seed: u64, name: &str) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed ^ fnv1a(name));
    let n = rows * cols;
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // 1 − u ∈ (0, 1], so the logarithm is finite.
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        out.push((std * r * a.cos()) as f32);
        out.push((std * r * a.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// [`normal`] as an f32 tensor of any `shape` (the values of a `[rows, cols]` draw,
/// laid out row-major).
pub fn normal_tensor<S: Into<Shape>>(
    shape: S,
    std: f64,
    seed: u64,
    name: &str,
    device: &Device,
) -> Result<Tensor> {
    let shape = shape.into();
    let values = normal(shape.elem_count(), 1, std, seed, name);
    Tensor::from_vec(values, shape, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_have_the_requested_spread_and_are_seeded_per_name() {
        let v = normal(200, 50, 0.5, 7, "x");
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.02, "std {}", var.sqrt());
        assert_eq!(v, normal(200, 50, 0.5, 7, "x"));
        assert_ne!(v, normal(200, 50, 0.5, 8, "x"));
        assert_ne!(v, normal(200, 50, 0.5, 7, "y"));
        // The stream depends on the count only through its length.
        assert_eq!(normal(3, 5, 0.5, 7, "x"), v[..15]);
        assert_eq!(normal(15, 1, 0.5, 7, "x"), v[..15]);
    }

    #[test]
    fn the_stream_is_stdrng_box_muller_with_both_outputs() {
        // Written out independently: the first pair of uniforms gives samples 0 and 1.
        let mut rng = StdRng::seed_from_u64(3 ^ fnv1a("w"));
        let u1 = 1.0 - rng.random::<f64>();
        let u2 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let want = [
            (r * (std::f64::consts::TAU * u2).cos()) as f32,
            (r * (std::f64::consts::TAU * u2).sin()) as f32,
        ];
        assert_eq!(normal(1, 2, 1.0, 3, "w"), want);
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn tensors_hold_the_same_values() {
        let t = normal_tensor((3, 4), 0.1, 9, "t", &Device::Cpu).unwrap();
        assert_eq!(t.dims(), &[3, 4]);
        assert_eq!(
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            normal(3, 4, 0.1, 9, "t")
        );
    }
}
