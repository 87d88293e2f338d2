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
/// embeddings N(0, 0.02), final norm identity.
pub fn random_lm_tensors(cfg: &Config, dtype: DType, device: &Device) -> Result<Tensors> {
    let d = cfg.hidden_size;
    let mut t = Tensors::new();
    let r = |shape: (usize, usize), std: f32| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std, shape, device)?.to_dtype(dtype)?)
    };
    t.insert(
        "word_embeddings.weight".into(),
        r((cfg.vocab_size, d), 0.02)?,
    );
    for i in 0..cfg.num_layers {
        for (m, n) in cfg.pattentions() {
            t.insert(format!("layers.{i}.{m}.key_param_tokens"), r((n, d), 1.0)?);
            t.insert(
                format!("layers.{i}.{m}.value_param_tokens"),
                r((n, d), 0.02)?,
            );
        }
    }
    t.insert("final_norm.weight".into(), Tensor::ones(d, dtype, device)?);
    t.insert("final_norm.bias".into(), Tensor::zeros(d, dtype, device)?);
    Ok(t)
}

/// How far `other`'s next-token distributions are from `reference`'s on
/// `ids` (logits [t, vocab] of the same t positions): (perplexity of
/// `reference`, perplexity of `other`, mean KL(reference ‖ other) in nats),
/// over the t − 1 positions that have a next token.
pub fn logit_agreement(reference: &Tensor, other: &Tensor, ids: &[u32]) -> Result<(f64, f64, f64)> {
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
    let (mut nll_a, mut nll_b, mut kl) = (0f64, 0f64, 0f64);
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
    }
    let n = n as f64;
    Ok(((nll_a / n).exp(), (nll_b / n).exp(), kl / n))
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
        let (pa, pb, kl) = logit_agreement(&a, &b, &[7, 1, 0]).unwrap();
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
        assert!(logit_agreement(&a, &b, &[1, 2]).is_err());
    }
}
