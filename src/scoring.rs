//! Log-likelihood scoring: per-position log p(next token), used by `score`
//! and (batched) by the evaluation commands.

use candle_core::{Tensor, D};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::models::tokenformer::TokenFormerLm;

/// Per-position scores of one sequence of ids.
#[derive(Clone, Debug, Serialize)]
pub struct SequenceScore {
    pub ids: Vec<u32>,
    /// `[t]` = log p(ids[t+1] | ids[..=t]).
    pub next_token_logprobs: Vec<f32>,
    /// `[t]` = argmax of the logits at position t.
    pub argmax: Vec<u32>,
    /// `[t]` = logsumexp of the logits at position t.
    pub logsumexp: Vec<f32>,
    /// −Σ next_token_logprobs.
    pub nll: f64,
    /// exp(nll / number of predictions).
    pub perplexity: f64,
}

/// Scores every next-token prediction of `ids` in one forward pass.
pub fn score_ids(model: &TokenFormerLm, ids: &[u32]) -> Result<SequenceScore> {
    if ids.len() < 2 {
        return Err(Error::input(format!(
            "scoring needs at least 2 tokens (got {}): the first token is only context",
            ids.len()
        )));
    }
    let max = model.config().max_position_embeddings;
    if ids.len() > max {
        return Err(Error::input(format!(
            "the input has {} tokens but the model's context is {max} positions; use `tokenformer eval pile` for long documents",
            ids.len()
        )));
    }
    let input = Tensor::new(ids, model.device())?.unsqueeze(0)?;
    let logits = model.forward(&input, None)?.squeeze(0)?; // [t, vocab]
    let n = ids.len() - 1;
    let logits = logits.narrow(0, 0, n)?;
    let lse = logsumexp(&logits)?;
    let targets = Tensor::new(&ids[1..], model.device())?.unsqueeze(1)?;
    let picked = logits.gather(&targets, 1)?.squeeze(1)?;
    let lp = (picked - &lse)?.to_vec1::<f32>()?;
    let argmax = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let nll = -lp.iter().map(|&x| x as f64).sum::<f64>();
    Ok(SequenceScore {
        ids: ids.to_vec(),
        perplexity: (nll / n as f64).exp(),
        nll,
        next_token_logprobs: lp,
        argmax,
        logsumexp: lse.to_vec1::<f32>()?,
    })
}

/// logsumexp over the last axis, with the max subtracted for stability.
pub fn logsumexp(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let s = x.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok((s + max)?.squeeze(D::Minus1)?)
}
