//! Random models of the released shapes (no download), for the CLI's
//! benchmark and the tests, and how far two sets of logits disagree.

use candle_core::{DType, Device, Tensor};

use crate::checkpoint::Tensors;
use crate::error::Result;
use crate::models::lm::Config;

/// The released language-model shapes by short name.
pub fn lm_config(name: &str) -> Option<Config> {
    let (l, d, h) = match name.to_ascii_lowercase().as_str() {
        "150m" => (12, 768, 12),
        "450m" => (24, 1024, 16),
        "900m" => (32, 1280, 16),
        "1.5b" | "1-5b" => (40, 1536, 16),
        _ => return None,
    };
    Some(Config::released(l, d, h))
}

/// Random weights with the statistics of the peer: keys N(0, 1), values and
/// embeddings N(0, 0.02), final norm identity. Each tensor is drawn from the
/// stream of (`seed`, its name) ([`crate::init`]), so a seed gives the same
/// model on every run and machine; the tensors are drawn in parallel.
pub fn random_lm_tensors(
    cfg: &Config,
    dtype: DType,
    seed: u64,
    device: &Device,
) -> Result<Tensors> {
    use rayon::prelude::*;
    let d = cfg.hidden_size;
    let mut draws = vec![("word_embeddings.weight".to_string(), cfg.vocab_size, 0.02)];
    for i in 0..cfg.num_layers {
        for (m, n) in cfg.pattentions() {
            draws.push((format!("layers.{i}.{m}.key_param_tokens"), n, 1.0));
            draws.push((format!("layers.{i}.{m}.value_param_tokens"), n, 0.02));
        }
    }
    let mut t: Tensors = draws
        .into_par_iter()
        .map(|(name, rows, std)| {
            let w = crate::init::normal_tensor((rows, d), std, seed, &name, device)?;
            Ok((name, w.to_dtype(dtype)?))
        })
        .collect::<Result<_>>()?;
    t.insert("final_norm.weight".into(), Tensor::ones(d, dtype, device)?);
    t.insert("final_norm.bias".into(), Tensor::zeros(d, dtype, device)?);
    Ok(t)
}

/// How far one model's next-token distributions are from a reference's on
/// the same positions ([`logit_agreement`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitAgreement {
    /// Perplexity of the reference on the next tokens.
    pub reference_perplexity: f64,
    /// Perplexity of the other model on the same tokens.
    pub perplexity: f64,
    /// Mean KL(reference ‖ other) in nats.
    pub mean_kl: f64,
    /// Fraction of positions where both pick the same most likely token
    /// (teacher-forced: each position sees the same prefix, so one early
    /// difference does not decide the rest, as it does in free decoding).
    pub top1_agreement: f64,
}

/// How far `other`'s next-token distributions are from `reference`'s on
/// `ids` (logits [t, vocab] of the same t positions), over the t − 1
/// positions that have a next token.
pub fn logit_agreement(reference: &Tensor, other: &Tensor, ids: &[u32]) -> Result<LogitAgreement> {
    use crate::generate::first_argmax;
    let a = reference.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    let b = other.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    if a.len() != b.len() || a.len() != ids.len() || a.len() < 2 {
        return Err(crate::Error::input(format!(
            "logit_agreement: {} and {} positions for {} ids",
            a.len(),
            b.len(),
            ids.len()
        )));
    }
    let log_softmax = |row: &[f64]| -> Vec<f64> {
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        row.iter().map(|v| v - lse).collect()
    };
    let (mut nll_a, mut nll_b, mut kl, mut same) = (0f64, 0f64, 0f64, 0usize);
    let n = ids.len() - 1;
    for t in 0..n {
        let (la, lb) = (log_softmax(&a[t]), log_softmax(&b[t]));
        let next = ids[t + 1] as usize;
        nll_a -= la[next];
        nll_b -= lb[next];
        kl += la
            .iter()
            .zip(&lb)
            .map(|(p, q)| p.exp() * (p - q))
            .sum::<f64>();
        same += usize::from(first_argmax(&a[t]) == first_argmax(&b[t]));
    }
    let n = n as f64;
    Ok(LogitAgreement {
        reference_perplexity: (nll_a / n).exp(),
        perplexity: (nll_b / n).exp(),
        mean_kl: kl / n,
        top1_agreement: same as f64 / n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_agreement_is_perplexity_and_kl() {
        let dev = Device::Cpu;
        // Two positions over a vocabulary of 2; next tokens 1 then 0.
        let a = Tensor::new(&[[0f32, 0.0], [1.0, 0.0], [5.0, 5.0]], &dev).unwrap();
        let b = Tensor::new(&[[0f32, 2f32.ln()], [1.0, 0.0], [0.0, 0.0]], &dev).unwrap();
        let got = logit_agreement(&a, &b, &[7, 1, 0]).unwrap();
        let (pa, pb, kl) = (got.reference_perplexity, got.perplexity, got.mean_kl);
        let e = std::f64::consts::E;
        // a: p(1) = 1/2 at t=0, p(0) = e/(e+1) at t=1.
        let want_a = (0.5 * e / (e + 1.0)).powf(-0.5);
        assert!((pa - want_a).abs() < 1e-9, "{pa} vs {want_a}");
        // b: p(1) = 2/3 at t=0, same as a at t=1.
        let want_b = (2.0 / 3.0 * e / (e + 1.0)).powf(-0.5);
        assert!((pb - want_b).abs() < 1e-9, "{pb} vs {want_b}");
        // KL((1/2, 1/2) ‖ (1/3, 2/3)) at t=0, 0 at t=1; the last position has no next token.
        let want_kl = (0.5 * (1.5f64).ln() + 0.5 * (0.75f64).ln()) / 2.0;
        assert!((kl - want_kl).abs() < 1e-9, "{kl} vs {want_kl}");
        // Top choices: 1 against 0 at t=0 (b's larger logit), both 0 at t=1;
        // the last position (no next token) is not counted.
        assert_eq!(got.top1_agreement, 0.5);
        assert!(logit_agreement(&a, &b, &[1, 2]).is_err());
    }

    #[test]
    fn random_models_are_seeded_per_tensor_with_the_peer_statistics() {
        let dev = Device::Cpu;
        let cfg = Config {
            vocab_size: 50,
            ..Config::released(2, 16, 2)
        };
        let draw = |seed| random_lm_tensors(&cfg, DType::F32, seed, &dev).unwrap();
        let (a, again, b) = (draw(3), draw(3), draw(4));
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a.len(), 3 + 2 * 2 * cfg.pattentions().len());
        for (name, t) in &a {
            assert_eq!(values(t), values(&again[name]), "{name}: not reproducible");
            if name.starts_with("final_norm") {
                assert_eq!(values(t), values(&b[name]), "{name}");
                continue;
            }
            assert_ne!(
                values(t),
                values(&b[name]),
                "{name}: the seed changes nothing"
            );
            // Each tensor has its own stream (seed, name), not a shared one.
            let key = &a["layers.0.mlp.key_param_tokens"];
            if name != "layers.0.mlp.key_param_tokens" && t.dims() == key.dims() {
                assert_ne!(values(t), values(key), "{name}");
            }
            let v = values(t);
            let std = (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
            let want = if name.ends_with("key_param_tokens") {
                1.0
            } else {
                0.02
            };
            assert!(
                (std / want - 1.0).abs() < 0.2,
                "{name}: std {std}, want {want}"
            );
        }
        let half = random_lm_tensors(&cfg, DType::F16, 3, &dev).unwrap();
        let widened = half["word_embeddings.weight"].to_dtype(DType::F32).unwrap();
        let rounded = a["word_embeddings.weight"]
            .to_dtype(DType::F16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        assert_eq!(values(&widened), values(&rounded));
    }
}
