//! Progressive scaling by parameter tokens (TokenFormer paper, arXiv 2410.23168, §3.5):
//! new key/value parameter tokens appended after the old ones in every Pattention layer
//! of every block. With zero keys and each layer's √n constant held at its old n, the
//! grown model computes exactly the old function.
//!
//! This is the tensor math shared by `tokenformer-convert grow` (which adds the CLI,
//! the config file and the probe check) and `tokenformer train --grow-at` (which grows
//! in the middle of a run and keeps the optimiser moments of the old tokens).

use candle_core::Tensor;

use crate::checkpoint::Tensors;
use crate::error::{Error, Result};
use crate::init::normal;
use crate::models::block::ScaleTokens;

/// The three Pattention kinds of a block, each with its own token count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Qkv,
    Proj,
    Ffn,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Qkv, Kind::Proj, Kind::Ffn];

    /// The config key of this kind's token count.
    pub fn config_key(self) -> &'static str {
        match self {
            Kind::Qkv => "qkv_tokens",
            Kind::Proj => "proj_tokens",
            Kind::Ffn => "ffn_tokens",
        }
    }

    /// This kind's count in `c`.
    pub fn of(c: &ScaleTokens, k: Kind) -> usize {
        match k {
            Kind::Qkv => c.qkv,
            Kind::Proj => c.proj,
            Kind::Ffn => c.ffn,
        }
    }

    /// Sets this kind's count in `c`.
    pub fn set(c: &mut ScaleTokens, k: Kind, v: usize) {
        match k {
            Kind::Qkv => c.qkv = v,
            Kind::Proj => c.proj = v,
            Kind::Ffn => c.ffn = v,
        }
    }
}

/// Which token count governs a Pattention parameter tensor (None: not one). A
/// Pattention tensor outside q/k/v, proj and mlp of a block is an error: its count
/// is unknown.
pub fn pattention_kind(name: &str) -> Result<Option<Kind>> {
    let Some(module) = name
        .strip_suffix(".key_param_tokens")
        .or_else(|| name.strip_suffix(".value_param_tokens"))
    else {
        return Ok(None);
    };
    let kind = if [".attention.query", ".attention.key", ".attention.value"]
        .iter()
        .any(|m| module.ends_with(m))
    {
        Kind::Qkv
    } else if module.ends_with(".attention.proj") {
        Kind::Proj
    } else if module.ends_with(".mlp") {
        Kind::Ffn
    } else {
        return Err(Error::Tensor {
            name: name.into(),
            msg: "belongs to a Pattention layer that is not q/k/v, proj or mlp of a block: don't know which token count to grow it by".into(),
        });
    };
    Ok(Some(kind))
}

/// Appends `extra` rows to a [n, d] parameter-token tensor, keeping its dtype: zeros,
/// or normal draws (`init` = (std, seed)).
pub fn append_rows(
    t: &Tensor,
    extra: usize,
    init: Option<(f64, u64)>,
    name: &str,
) -> Result<Tensor> {
    let (_, d) = t.dims2().map_err(|_| Error::Tensor {
        name: name.into(),
        msg: format!("is not a matrix (shape {:?})", t.dims()),
    })?;
    let new = match init {
        None => Tensor::zeros((extra, d), t.dtype(), t.device())?,
        Some((std, seed)) => {
            Tensor::from_vec(normal(extra, d, std, seed, name), (extra, d), t.device())?
                .to_dtype(t.dtype())?
        }
    };
    Ok(Tensor::cat(&[t, &new], 0)?)
}

/// How new tokens start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrowInit {
    /// Keys: None = zeros (keeps the function), Some(std) = normal.
    pub key_std: Option<f64>,
    pub value_std: f64,
    pub seed: u64,
}

impl Default for GrowInit {
    /// Zero keys, N(0, 0.02) values, seed 0 (`tokenformer-convert grow`'s defaults).
    fn default() -> Self {
        Self {
            key_std: None,
            value_std: 0.02,
            seed: 0,
        }
    }
}

/// Refuses a `target` below the `old` count of any kind: growing only adds tokens.
pub fn check_target(old: &ScaleTokens, target: &ScaleTokens) -> Result<()> {
    for k in Kind::ALL {
        let (from, to) = (Kind::of(old, k), Kind::of(target, k));
        if to < from {
            return Err(Error::input(format!(
                "cannot grow {} from {from} to {to}: growing only adds tokens (the target must be at least {from})",
                k.config_key()
            )));
        }
    }
    Ok(())
}

/// Grows every Pattention tensor of `tensors` from the `old` token counts to `target`
/// (each at least the old count); other tensors pass through. Returns the tensors and
/// how many tensors of each kind (qkv, proj, ffn) grew.
pub fn grow_tensors(
    tensors: Tensors,
    old: &ScaleTokens,
    target: &ScaleTokens,
    init: &GrowInit,
) -> Result<(Tensors, [usize; 3])> {
    check_target(old, target)?;
    let mut out = Tensors::new();
    let mut grown = [0usize; 3];
    for (name, t) in tensors {
        let Some(kind) = pattention_kind(&name)? else {
            out.insert(name, t);
            continue;
        };
        let (from, to) = (Kind::of(old, kind), Kind::of(target, kind));
        let rows = t.dims().first().copied().unwrap_or(0);
        if rows != from {
            return Err(Error::Tensor {
                name,
                msg: format!(
                    "has {rows} parameter tokens but the config says {} = {from}",
                    kind.config_key()
                ),
            });
        }
        let t = if to > from {
            grown[kind as usize] += 1;
            let init = if name.ends_with(".key_param_tokens") {
                init.key_std.map(|s| (s, init.seed))
            } else {
                Some((init.value_std, init.seed))
            };
            append_rows(&t, to - from, init, &name)?
        } else {
            t
        };
        out.insert(name, t);
    }
    Ok((out, grown))
}

/// The language-model config after growing to `target` with the √n constants kept at
/// their old values (the function-preserving rule), recording the old counts in
/// `grown_from_tokens`.
pub fn grown_lm_config(
    cfg: &crate::models::tokenformer::Config,
    target: &ScaleTokens,
) -> Result<crate::models::tokenformer::Config> {
    let old = ScaleTokens {
        qkv: cfg.qkv_tokens,
        proj: cfg.proj_tokens,
        ffn: cfg.ffn_tokens,
    };
    let mut c = cfg.clone();
    c.pattention_scale_tokens = Some(cfg.pattention_scale_tokens.unwrap_or(old));
    if c.pattention_scale_tokens == Some(*target) {
        c.pattention_scale_tokens = None;
    }
    c.qkv_tokens = target.qkv;
    c.proj_tokens = target.proj;
    c.ffn_tokens = target.ffn;
    c.grown_from_tokens = (old != *target).then_some(old);
    c.validate()
        .map_err(|e| Error::input(format!("the grown config is invalid: {e}")))?;
    Ok(c)
}

/// Parses a growth target such as `ffn=2048` or `qkv=256,proj=256,ffn=1024`; kinds not
/// named keep their count in `current`.
pub fn parse_target(spec: &str, current: &ScaleTokens) -> Result<ScaleTokens> {
    let mut t = *current;
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || {
            Error::input(format!(
                "growth target `{spec}`: expected KIND=N pairs such as `qkv=256,ffn=1024` (KIND: qkv, proj, ffn)"
            ))
        };
        let (k, n) = part.split_once('=').ok_or_else(bad)?;
        let n: usize = n.trim().parse().map_err(|_| bad())?;
        let kind = match k.trim() {
            "qkv" => Kind::Qkv,
            "proj" => Kind::Proj,
            "ffn" => Kind::Ffn,
            _ => return Err(bad()),
        };
        Kind::set(&mut t, kind, n);
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        let cur = ScaleTokens {
            qkv: 8,
            proj: 8,
            ffn: 32,
        };
        let t = parse_target("ffn=64, qkv=16", &cur).unwrap();
        assert_eq!((t.qkv, t.proj, t.ffn), (16, 8, 64));
        assert!(parse_target("mlp=3", &cur).is_err());
        assert!(parse_target("ffn", &cur).is_err());
        assert!(parse_target("ffn=-1", &cur).is_err());
    }

    #[test]
    fn kinds_from_names() {
        let k = |n: &str| pattention_kind(n).unwrap();
        assert_eq!(
            k("layers.3.attention.key.value_param_tokens"),
            Some(Kind::Qkv)
        );
        assert_eq!(
            k("layers.0.attention.proj.key_param_tokens"),
            Some(Kind::Proj)
        );
        assert_eq!(k("layers.11.mlp.value_param_tokens"), Some(Kind::Ffn));
        assert_eq!(k("word_embeddings.weight"), None);
        assert!(pattention_kind("merger.key_param_tokens").is_err());
    }
}
