//! Model cards: the `README.md` of a model folder, with the YAML front matter
//! the Hugging Face Hub reads (license, tags, pipeline_tag, datasets,
//! base_model, model-index). Reference:
//! <https://huggingface.co/docs/hub/model-cards>. No `library_name`: the Hub
//! accepts only the libraries it lists (huggingface.js `model-libraries.ts`),
//! and neither this toolkit nor candle is one of them.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::error::{Error, Result};

/// What a card says. `metadata` is the front matter (as JSON, emitted as YAML).
#[derive(Clone, Debug, Default)]
pub struct ModelCard {
    pub metadata: Map<String, Value>,
    pub title: String,
    /// Markdown sections, (heading, body), in order.
    pub sections: Vec<(String, String)>,
}

impl ModelCard {
    /// A card with the metadata every TokenFormer folder carries.
    pub fn new(title: impl Into<String>, pipeline_tag: &str) -> Self {
        let mut metadata = Map::new();
        metadata.insert("license".into(), json!("apache-2.0"));
        metadata.insert(
            "tags".into(),
            json!(["tokenformer", "pattention", "candle", "safetensors"]),
        );
        metadata.insert("pipeline_tag".into(), json!(pipeline_tag));
        Self {
            metadata,
            title: title.into(),
            sections: vec![],
        }
    }

    pub fn set(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.insert(key.into(), value);
        self
    }

    pub fn section(&mut self, heading: impl Into<String>, body: impl Into<String>) -> &mut Self {
        self.sections.push((heading.into(), body.into()));
        self
    }

    pub fn render(&self) -> String {
        let mut out = String::from("---\n");
        out.push_str(&to_yaml(&Value::Object(self.metadata.clone())));
        out.push_str("---\n\n");
        out.push_str(&format!("# {}\n\n", self.title));
        for (h, b) in &self.sections {
            out.push_str(&format!("## {h}\n\n{}\n\n", b.trim_end()));
        }
        out
    }

    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join("README.md");
        std::fs::write(&path, self.render()).map_err(|e| Error::io(&path, e))
    }
}

/// Splits a README into (front matter as JSON, body); no front matter → empty
/// map. Front matter that is not a YAML mapping, or uses anchors/aliases
/// (see `crate::checkpoint::official::load_yaml`), is an error rather than
/// dropped, so refreshing a card never loses what it said.
pub fn parse(text: &str) -> std::result::Result<(Map<String, Value>, String), String> {
    let Some(rest) = text.strip_prefix("---\n") else {
        return Ok((Map::new(), text.to_string()));
    };
    let Some((front, body)) = rest.split_once("\n---\n") else {
        return Ok((Map::new(), text.to_string()));
    };
    let meta = match crate::checkpoint::official::load_yaml(front)
        .map_err(|e| format!("front matter: {e}"))?
        .map(yaml_to_json)
    {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m,
        Some(_) => return Err("front matter is not a mapping of keys".into()),
    };
    Ok((meta, body.trim_start().to_string()))
}

fn yaml_to_json(y: yaml_rust2::Yaml) -> Value {
    use yaml_rust2::Yaml;
    match y {
        Yaml::Real(s) => s
            .parse::<f64>()
            .map(Value::from)
            .unwrap_or(Value::String(s)),
        Yaml::Integer(i) => Value::from(i),
        Yaml::String(s) => Value::String(s),
        Yaml::Boolean(b) => Value::Bool(b),
        Yaml::Array(a) => Value::Array(a.into_iter().map(yaml_to_json).collect()),
        Yaml::Hash(h) => Value::Object(
            h.into_iter()
                .filter_map(|(k, v)| k.as_str().map(|k| (k.to_string(), yaml_to_json(v))))
                .collect(),
        ),
        _ => Value::Null,
    }
}

fn json_to_yaml(v: &Value) -> yaml_rust2::Yaml {
    use yaml_rust2::Yaml;
    match v {
        Value::Null => Yaml::Null,
        Value::Bool(b) => Yaml::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Yaml::Integer(i),
            None => Yaml::Real(n.to_string()),
        },
        Value::String(s) => Yaml::String(s.clone()),
        Value::Array(a) => Yaml::Array(a.iter().map(json_to_yaml).collect()),
        Value::Object(m) => Yaml::Hash(
            m.iter()
                .map(|(k, v)| (Yaml::String(k.clone()), json_to_yaml(v)))
                .collect(),
        ),
    }
}

/// Block-style YAML for front matter (without the leading `---`).
pub(crate) fn to_yaml(v: &Value) -> String {
    let mut s = String::new();
    yaml_rust2::YamlEmitter::new(&mut s)
        .dump(&json_to_yaml(v))
        .expect("writing to a String cannot fail");
    let s = s.strip_prefix("---").unwrap_or(&s).trim_start_matches('\n');
    format!("{s}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn front_matter_round_trips() {
        let mut c = ModelCard::new("T", "text-generation");
        c.set("base_model", json!("Haiyang-W/TokenFormer-150M"));
        c.set("model-index", json!([{"name": "m", "results": [{"metrics": [{"type": "perplexity", "value": 10.5}]}]}]));
        c.section("Conversion", "max |Δ logit| = 0");
        let (meta, body) = parse(&c.render()).unwrap();
        assert_eq!(Value::Object(meta), Value::Object(c.metadata.clone()));
        assert!(body.starts_with("# T\n"));
        assert!(body.contains("max |Δ logit| = 0"));
    }

    /// Front matter that cannot be read is an error, not silently dropped
    /// (publish would otherwise replace it); anchors and aliases are refused.
    #[test]
    fn unreadable_front_matter_is_an_error() {
        let bomb = "---\na: &a [x, x, x]\nb: [*a, *a, *a]\n---\n\n# T\n";
        assert!(parse(bomb).unwrap_err().contains("anchors"));
        let alias = "---\nlicense: *x\n---\nbody";
        let e = parse(alias).unwrap_err();
        assert!(e.contains("anchor"), "{e}");
        let alias = "---\nx: &a 1\nlicense: *a\n---\nbody";
        assert!(parse(alias).unwrap_err().contains("anchors"));
        assert!(parse("---\nlicense: [unclosed\n---\nbody").is_err());
        assert!(parse("---\n- a list\n---\nbody").is_err());
        let (meta, body) = parse("no front matter").unwrap();
        assert!(meta.is_empty() && body == "no front matter");
    }
}
