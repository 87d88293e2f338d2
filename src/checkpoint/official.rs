//! The official release format (GPT-NeoX pipeline state dict + eval yml):
//! the one place where official tensor names and config keys are mapped to
//! ours. Reference: Haiyang-W/TokenFormer, `megatron/model/tokenformer_model.py`
//! (module order of the `sequential` pipeline) and `configs/tokenformer/*_eval.yml`.
//!
//! Pipeline indices: 0 = embedding, 1 = a lambda, 2..L+1 = the L blocks,
//! L+2 = a lambda, L+3 = the final norm, L+4 = the untied output layer.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::models::tokenformer::Config;
use crate::pattention::Activation;

/// Official state-dict key → canonical key, or None if the key is not ours.
pub(crate) fn to_canonical(name: &str, num_layers: usize) -> Option<String> {
    let rest = name.strip_prefix("sequential.")?;
    let (idx, tail) = rest.split_once('.')?;
    let idx: usize = idx.parse().ok()?;
    match (idx, tail) {
        (0, "word_embeddings.weight") => Some("word_embeddings.weight".into()),
        // Index arithmetic on the file's numbers without overflow.
        (i, t) if i.checked_sub(2).is_some_and(|l| l < num_layers) && is_block_tensor(t) => {
            Some(format!("layers.{}.{t}", i - 2))
        }
        (i, t @ ("norm.weight" | "norm.bias")) if i.checked_sub(3) == Some(num_layers) => {
            Some(format!("final_{t}"))
        }
        (i, "final_linear.weight") if i.checked_sub(4) == Some(num_layers) => {
            Some("final_linear.weight".into())
        }
        _ => None,
    }
}

/// Canonical key → official state-dict key (the inverse of `to_canonical`).
pub fn to_official(name: &str, num_layers: usize) -> Option<String> {
    if name == "word_embeddings.weight" {
        return Some("sequential.0.word_embeddings.weight".into());
    }
    if let Some(t) = name.strip_prefix("final_") {
        return match t {
            "norm.weight" | "norm.bias" => Some(format!("sequential.{}.{t}", num_layers + 3)),
            "linear.weight" => Some(format!("sequential.{}.final_linear.weight", num_layers + 4)),
            _ => None,
        };
    }
    let rest = name.strip_prefix("layers.")?;
    let (i, t) = rest.split_once('.')?;
    let i: usize = i.parse().ok()?;
    (i < num_layers && is_block_tensor(t)).then(|| format!("sequential.{}.{t}", i + 2))
}

fn is_block_tensor(t: &str) -> bool {
    let Some((module, param)) = t.rsplit_once('.') else {
        return false;
    };
    matches!(param, "key_param_tokens" | "value_param_tokens")
        && matches!(
            module,
            "attention.query" | "attention.key" | "attention.value" | "attention.proj" | "mlp"
        )
}

/// The largest YAML text parsed (official eval configs are about 2 KB).
pub(crate) const MAX_YAML_BYTES: usize = 1 << 20;
/// Deepest nesting of YAML mappings and sequences accepted.
pub(crate) const MAX_YAML_DEPTH: usize = 32;

/// The first document of a YAML text, refusing what a config or a model
/// card never needs and an attacker would use: anchors and aliases (an alias
/// bomb of a few hundred bytes expands to gigabytes), nesting deeper than
/// [`MAX_YAML_DEPTH`] and text longer than [`MAX_YAML_BYTES`]. The events
/// are checked before any document is built.
pub(crate) fn load_yaml(text: &str) -> std::result::Result<Option<yaml_rust2::Yaml>, String> {
    use yaml_rust2::parser::{Event, Parser};
    if text.len() > MAX_YAML_BYTES {
        return Err(format!(
            "{} bytes of YAML is more than the {MAX_YAML_BYTES} accepted",
            text.len()
        ));
    }
    let mut parser = Parser::new_from_str(text);
    let mut depth = 0usize;
    loop {
        let (ev, mark) = parser
            .next_token()
            .map_err(|e| format!("not valid YAML: {e}"))?;
        let anchor = match ev {
            Event::Alias(_) => {
                return Err(format!(
                    "line {}: YAML aliases (`*name`) are not allowed",
                    mark.line()
                ))
            }
            Event::Scalar(_, _, anchor, _) => anchor,
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                depth += 1;
                if depth > MAX_YAML_DEPTH {
                    return Err(format!(
                        "line {}: YAML nested deeper than {MAX_YAML_DEPTH}",
                        mark.line()
                    ));
                }
                anchor
            }
            Event::SequenceEnd | Event::MappingEnd => {
                depth = depth.saturating_sub(1);
                0
            }
            Event::StreamEnd => break,
            _ => 0,
        };
        if anchor != 0 {
            return Err(format!(
                "line {}: YAML anchors (`&name`) are not allowed",
                mark.line()
            ));
        }
    }
    let docs =
        yaml_rust2::YamlLoader::load_from_str(text).map_err(|e| format!("not valid YAML: {e}"))?;
    Ok(docs.into_iter().next())
}

/// Parses the official eval yml: a JSON-like YAML mapping with `#` comments
/// and Python literals (`False`), read by NeoX with PyYAML.
pub(crate) fn parse_yml(text: &str, path: &Path) -> Result<Map<String, Value>> {
    let doc = load_yaml(text).map_err(|e| Error::config(path, e))?;
    match doc.map(yaml_to_json) {
        Some(Value::Object(m)) => Ok(m),
        _ => Err(Error::config(path, "expected a mapping of settings")),
    }
}

/// Reads and parses an official eval yml.
pub(crate) fn read_yml(path: &Path) -> Result<Map<String, Value>> {
    let text = crate::checkpoint::read_text(path, MAX_YAML_BYTES as u64)?;
    parse_yml(&text, path)
}

fn yaml_to_json(y: yaml_rust2::Yaml) -> Value {
    use yaml_rust2::Yaml;
    match y {
        Yaml::Real(s) => s
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map_or(Value::String(s), Value::Number),
        Yaml::Integer(i) => Value::from(i),
        Yaml::String(s) => match s.as_str() {
            // PyYAML (YAML 1.1) reads these as booleans/None.
            "True" | "TRUE" => Value::Bool(true),
            "False" | "FALSE" => Value::Bool(false),
            "None" => Value::Null,
            _ => Value::String(s),
        },
        Yaml::Boolean(b) => Value::Bool(b),
        Yaml::Array(a) => Value::Array(a.into_iter().map(yaml_to_json).collect()),
        Yaml::Hash(h) => Value::Object(
            h.into_iter()
                .filter_map(|(k, v)| match k {
                    Yaml::String(k) => Some((k, yaml_to_json(v))),
                    Yaml::Integer(i) => Some((i.to_string(), yaml_to_json(v))),
                    _ => None,
                })
                .collect(),
        ),
        Yaml::Alias(_) | Yaml::Null | Yaml::BadValue => Value::Null,
    }
}

/// Our config from an official yml. `vocab_size` comes from the checkpoint
/// (the padded embedding rows), since the yml does not carry it.
pub fn config_from_yml(path: &Path, vocab_size: usize) -> Result<Config> {
    config_from_settings(&read_yml(path)?, path, vocab_size)
}

pub(crate) fn config_from_settings(
    m: &Map<String, Value>,
    path: &Path,
    vocab_size: usize,
) -> Result<Config> {
    let err = |msg: String| Error::config(path, msg);
    let uint = |k: &str| -> Result<Option<usize>> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|v| Some(v as usize))
                .ok_or_else(|| err(format!("`{k}` must be a non-negative integer, got {v}"))),
        }
    };
    let need = |k: &str| uint(k)?.ok_or_else(|| err(format!("missing `{k}`")));
    let float = |k: &str, default: f64| -> Result<f64> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| err(format!("`{k}` must be a number, got {v}"))),
        }
    };
    let string = |k: &str| m.get(k).and_then(Value::as_str);
    if let Some(p) = string("pos_emb") {
        if p != "rotary" {
            return Err(err(format!("pos_emb `{p}` is not supported (only rotary)")));
        }
    }
    if let Some(n) = string("norm") {
        if n != "layernorm_nonparam" {
            return Err(err(format!(
                "norm `{n}` is not supported (TokenFormer blocks use layernorm_nonparam)"
            )));
        }
    }
    let activation = match string("norm_activation_type") {
        None => Activation::L2NormGelu,
        Some(s) => s.parse().map_err(err)?,
    };
    let hidden_size = need("hidden_size")?;
    let no_weight_tying = m
        .get("no_weight_tying")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let cfg = Config {
        hidden_size,
        num_layers: need("num_layers")?,
        num_heads: need("num_attention_heads")?,
        qkv_tokens: need("qkv_slot_num")?,
        proj_tokens: uint("proj_slot_num")?.unwrap_or(hidden_size),
        ffn_tokens: need("ffn_slot_num")?,
        vocab_size,
        max_position_embeddings: match uint("max_position_embeddings")? {
            Some(v) => v,
            None => need("seq_length")?,
        },
        rotary_pct: float("rotary_pct", 1.0)?,
        rotary_base: float("rotary_emb_base", 10_000.0)?,
        norm_eps: float("layernorm_epsilon", 1e-5)?,
        pattention_activation: activation,
        eos_token_id: 0,
        tie_word_embeddings: !no_weight_tying,
        pattention_scale_tokens: None,
        grown_from_tokens: None,
        parallel_residual: false,
    };
    cfg.validate().map_err(|e| err(official_key_names(&e)))?;
    Ok(cfg)
}

/// A validation message with our key names replaced by the yml's.
fn official_key_names(msg: &str) -> String {
    [
        ("`num_heads`", "`num_attention_heads`"),
        ("`qkv_tokens`", "`qkv_slot_num`"),
        ("`proj_tokens`", "`proj_slot_num`"),
        ("`ffn_tokens`", "`ffn_slot_num`"),
        ("`rotary_base`", "`rotary_emb_base`"),
        ("`norm_eps`", "`layernorm_epsilon`"),
    ]
    .iter()
    .fold(msg.to_string(), |m, (ours, theirs)| m.replace(ours, theirs))
}

/// The official yml for a config (what `export --format official` writes).
pub fn config_to_yml(cfg: &Config) -> String {
    format!(
        r#"# TokenFormer eval config (official GPT-NeoX format), written by tokenformer-convert
{{
  "num_layers": {},
  "hidden_size": {},
  "num_attention_heads": {},
  "qkv_slot_num": {},
  "proj_slot_num": {},
  "ffn_slot_num": {},
  "seq_length": {},
  "max_position_embeddings": {},
  "pos_emb": "rotary",
  "rotary_pct": {},
  "rotary_emb_base": {},
  "no_weight_tying": {},
  "norm": "layernorm_nonparam",
  "final_norm": "layernorm",
  "layernorm_epsilon": {},
  "norm_activation_type": "{}",
  "tokenizer-type": "HFTokenizer",
  "vocab-file": "./tokenizer.json",
}}
"#,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.qkv_tokens,
        cfg.proj_tokens,
        cfg.ffn_tokens,
        cfg.max_position_embeddings,
        cfg.max_position_embeddings,
        cfg.rotary_pct,
        cfg.rotary_base,
        !cfg.tie_word_embeddings,
        cfg.norm_eps,
        cfg.pattention_activation.as_str(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let l = 12;
        for (off, ours) in [
            (
                "sequential.0.word_embeddings.weight",
                "word_embeddings.weight",
            ),
            (
                "sequential.2.attention.query.key_param_tokens",
                "layers.0.attention.query.key_param_tokens",
            ),
            (
                "sequential.13.mlp.value_param_tokens",
                "layers.11.mlp.value_param_tokens",
            ),
            ("sequential.15.norm.bias", "final_norm.bias"),
            ("sequential.16.final_linear.weight", "final_linear.weight"),
        ] {
            assert_eq!(to_canonical(off, l).as_deref(), Some(ours));
            assert_eq!(to_official(ours, l).as_deref(), Some(off));
        }
        assert_eq!(
            to_canonical("sequential.14.mlp.value_param_tokens", l),
            None
        );
        assert_eq!(to_canonical("sequential.2.attention.dense.weight", l), None);
        // Numbers from a file never overflow the index arithmetic.
        let huge = format!("sequential.{}.final_linear.weight", usize::MAX);
        assert_eq!(to_canonical(&huge, usize::MAX), None);
        assert_eq!(
            to_canonical("sequential.1.mlp.key_param_tokens", usize::MAX),
            None
        );
    }

    #[test]
    fn yml_with_python_literals_and_comments() {
        let text = "{\n  # c\n  \"num_layers\": 2, \"hidden_size\": 32, \"num_attention_heads\": 2,\n  \"qkv_slot_num\": 24, \"proj_slot_num\": 20, \"ffn_slot_num\": 48,\n  \"seq_length\": 2048, \"rotary_pct\": 0.25,\n  \"norm_activation_type\": \"softmax\", # \"a\", \"b\"\n  \"x\": False,\n}\n";
        let cfg = config_from_settings(
            &parse_yml(text, Path::new("t.yml")).unwrap(),
            Path::new("t.yml"),
            64,
        )
        .unwrap();
        assert_eq!(
            (
                cfg.num_layers,
                cfg.qkv_tokens,
                cfg.proj_tokens,
                cfg.ffn_tokens
            ),
            (2, 24, 20, 48)
        );
        assert_eq!(cfg.max_position_embeddings, 2048);
        assert_eq!(cfg.pattention_activation, Activation::Softmax);
        assert_eq!(
            config_from_settings(
                &parse_yml(&config_to_yml(&cfg), Path::new("o")).unwrap(),
                Path::new("o"),
                64
            )
            .unwrap(),
            cfg
        );
    }
}
