//! lm-evaluation-harness's results layout
//! (<https://github.com/EleutherAI/lm-evaluation-harness>, `results_*.json`
//! and `samples_<task>_*.jsonl`), written next to our own fields so that
//! scripts reading harness output (`results[task]["acc,none"]`,
//! `n-samples`, `versions`, `config`, …) read ours unchanged.
//!
//! Every harness number is derived from our counts when a result is
//! written; reading a result ([`super::merge`]) ignores these blocks and
//! recomputes them.

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// The filter name every metric key carries (`acc,none`): no filter.
pub const FILTER: &str = "none";

/// What the harness writes for a standard error it did not compute.
pub const NO_STDERR: &str = "N/A";

/// The `model` of the harness `config` block (its model-type name).
pub const MODEL_TYPE: &str = "tokenformer";

/// One metric of one task.
#[derive(Clone, Debug)]
pub struct Metric {
    /// The harness's metric name (`acc`, `word_perplexity`).
    pub name: &'static str,
    /// Its value (none when nothing was scored).
    pub value: Option<f64>,
    /// Its standard error: `None` is written as the harness's `"N/A"`.
    pub stderr: Option<f64>,
    /// The harness's `higher_is_better` for it.
    pub higher_is_better: bool,
}

/// One task's entry in a harness results file.
#[derive(Clone, Debug)]
pub struct TaskEntry {
    /// The harness's task name (`piqa`, `pile_arxiv`).
    pub name: String,
    /// The task's version in the harness (its yaml `metadata.version`).
    pub version: f64,
    /// The dataset the harness loads it from (`dataset_path`).
    pub dataset_path: &'static str,
    /// Its configuration (`dataset_name`), if it has several.
    pub dataset_name: Option<&'static str>,
    /// The split evaluated (`test` or `validation`), if known.
    pub split: Option<&'static str>,
    /// The harness's request type (`multiple_choice`, `loglikelihood`, …).
    pub output_type: &'static str,
    /// Its metrics.
    pub metrics: Vec<Metric>,
    /// Documents in the data (`n-samples.original`), if known.
    pub original: Option<u64>,
    /// Documents scored (`n-samples.effective`).
    pub effective: u64,
}

/// The model and run settings of the harness `config` block.
#[derive(Clone, Debug)]
pub struct RunConfig<'a> {
    /// The model as resolved (`repo@revision` or a path).
    pub model: &'a str,
    /// The Hub commit of its files.
    pub commit: Option<&'a str>,
    /// The weight dtype it was loaded in.
    pub dtype: Option<&'a str>,
    /// Inputs per forward pass.
    pub batch_size: usize,
    /// Where it ran (`cpu`, `cuda:0`), when known.
    pub device: Option<&'a str>,
    /// Only the first N documents.
    pub limit: Option<usize>,
    /// Seconds of evaluation.
    pub elapsed_seconds: f64,
}

/// `repo@revision` split into the repo and its revision, as the harness
/// records `pretrained=` and `revision=`.
fn split_revision(model: &str) -> (&str, Option<&str>) {
    match model.rsplit_once('@') {
        Some((m, r)) if !m.is_empty() && !r.contains('/') => (m, Some(r)),
        _ => (model, None),
    }
}

/// The `results`, `group_subtasks`, `configs`, `versions`, `n-shot`,
/// `higher_is_better`, `n-samples` and `config` blocks for `tasks`, plus the
/// harness's top-level `model_name`, `date` and
/// `total_evaluation_time_seconds`.
pub fn blocks(tasks: &[TaskEntry], run: &RunConfig) -> Map<String, Value> {
    let (mut results, mut subtasks, mut configs) = (Map::new(), Map::new(), Map::new());
    let (mut versions, mut n_shot, mut better, mut n_samples) =
        (Map::new(), Map::new(), Map::new(), Map::new());
    for t in tasks {
        let mut r = Map::new();
        r.insert("alias".into(), json!(t.name));
        let mut hib = Map::new();
        for m in &t.metrics {
            r.insert(format!("{},{FILTER}", m.name), json!(m.value));
            let se = m.stderr.map_or(json!(NO_STDERR), |s| json!(s));
            r.insert(format!("{}_stderr,{FILTER}", m.name), se);
            hib.insert(m.name.into(), json!(m.higher_is_better));
        }
        results.insert(t.name.clone(), Value::Object(r));
        subtasks.insert(t.name.clone(), json!([]));
        let mut config = json!({
            "task": t.name,
            "dataset_path": t.dataset_path,
            "output_type": t.output_type,
            "num_fewshot": 0,
            "metric_list": t.metrics.iter().map(|m| json!({
                "metric": m.name, "higher_is_better": m.higher_is_better
            })).collect::<Vec<_>>(),
            "metadata": {"version": t.version},
        });
        if let Some(name) = t.dataset_name {
            config["dataset_name"] = json!(name);
        }
        match t.split {
            Some("test") => config["test_split"] = json!("test"),
            Some(split) => config["validation_split"] = json!(split),
            None => {}
        }
        configs.insert(t.name.clone(), config);
        versions.insert(t.name.clone(), json!(t.version));
        n_shot.insert(t.name.clone(), json!(0));
        better.insert(t.name.clone(), Value::Object(hib));
        n_samples.insert(
            t.name.clone(),
            json!({"original": t.original, "effective": t.effective}),
        );
    }
    let (pretrained, revision) = split_revision(run.model);
    let mut model_args = format!("pretrained={pretrained}");
    if let Some(r) = revision {
        model_args.push_str(&format!(",revision={r}"));
    }
    if let Some(d) = run.dtype {
        model_args.push_str(&format!(",dtype={d}"));
    }
    let date = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut out = Map::new();
    out.insert("results".into(), Value::Object(results));
    out.insert("group_subtasks".into(), Value::Object(subtasks));
    out.insert("configs".into(), Value::Object(configs));
    out.insert("versions".into(), Value::Object(versions));
    out.insert("n-shot".into(), Value::Object(n_shot));
    out.insert("higher_is_better".into(), Value::Object(better));
    out.insert("n-samples".into(), Value::Object(n_samples));
    out.insert(
        "config".into(),
        json!({
            "model": MODEL_TYPE,
            "model_args": model_args,
            "model_name": pretrained,
            "model_revision": revision.unwrap_or("main"),
            "model_sha": run.commit,
            "model_dtype": run.dtype,
            "batch_size": run.batch_size,
            "device": run.device,
            "limit": run.limit,
        }),
    );
    out.insert("model_name".into(), json!(pretrained));
    out.insert(
        "model_name_sanitized".into(),
        json!(pretrained.replace(['/', ':'], "__")),
    );
    out.insert("date".into(), json!(date));
    out.insert(
        "total_evaluation_time_seconds".into(),
        json!(run.elapsed_seconds.to_string()),
    );
    out
}

/// `base` (an object) with `extra`'s keys added; our own keys win.
pub fn with_blocks(mut base: Value, extra: Map<String, Value>) -> Value {
    if let Value::Object(m) = &mut base {
        for (k, v) in extra {
            m.entry(k).or_insert(v);
        }
    }
    base
}

/// Hex sha256 of a string (the harness's `hash_string`).
pub fn hash_string(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The harness's file-name time stamp (`datetime.now().isoformat()` with
/// `:` → `-`), in UTC: `2026-11-23T22-30-05.123456`.
pub fn date_id(unix: std::time::Duration) -> String {
    let secs = unix.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}-{:02}-{:02}.{:06}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        unix.subsec_micros()
    )
}

/// The harness's task name of a Pile subset (`meta.pile_set_name`): its
/// `pile_*` tasks; a name the Pile does not have becomes `pile_` + the name
/// lower-cased with every other run of characters a `-`.
pub fn pile_task_name(set_name: &str) -> String {
    const KNOWN: [(&str, &str); 22] = [
        ("ArXiv", "arxiv"),
        ("BookCorpus2", "bookcorpus2"),
        ("Books3", "books3"),
        ("DM Mathematics", "dm-mathematics"),
        ("Enron Emails", "enron"),
        ("EuroParl", "europarl"),
        ("FreeLaw", "freelaw"),
        ("Github", "github"),
        ("Gutenberg (PG-19)", "gutenberg"),
        ("HackerNews", "hackernews"),
        ("NIH ExPorter", "nih-exporter"),
        ("OpenSubtitles", "opensubtitles"),
        ("OpenWebText2", "openwebtext2"),
        ("PhilPapers", "philpapers"),
        ("Pile-CC", "pile-cc"),
        ("PubMed Abstracts", "pubmed-abstracts"),
        ("PubMed Central", "pubmed-central"),
        ("StackExchange", "stackexchange"),
        ("USPTO Backgrounds", "uspto"),
        ("Ubuntu IRC", "ubuntu-irc"),
        ("Wikipedia (en)", "wikipedia"),
        ("YoutubeSubtitles", "youtubesubtitles"),
    ];
    if let Some((_, t)) = KNOWN.iter().find(|(n, _)| *n == set_name) {
        return format!("pile_{t}");
    }
    let mut out = String::from("pile_");
    let mut dash = false;
    for c in set_name.chars().flat_map(char::to_lowercase) {
        if c.is_alphanumeric() {
            out.push(c);
            dash = false;
        } else if !dash && out.len() > 5 {
            out.push('-');
            dash = true;
        }
    }
    out.trim_end_matches('-').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pile_names_are_the_harness_tasks() {
        assert_eq!(pile_task_name("ArXiv"), "pile_arxiv");
        assert_eq!(pile_task_name("Pile-CC"), "pile_pile-cc");
        assert_eq!(pile_task_name("USPTO Backgrounds"), "pile_uspto");
        assert_eq!(pile_task_name("Gutenberg (PG-19)"), "pile_gutenberg");
        assert_eq!(pile_task_name("My Corpus (v2)"), "pile_my-corpus-v2");
        assert_eq!(pile_task_name("doc05"), "pile_doc05");
    }

    #[test]
    fn date_id_is_the_harness_stamp() {
        let t = std::time::Duration::new(1_795_473_005, 123_456_000);
        assert_eq!(date_id(t), "2026-11-23T22-30-05.123456");
        assert_eq!(
            date_id(std::time::Duration::ZERO),
            "1970-01-01T00-00-00.000000"
        );
        // 2000-02-29 (a leap day) 12:00:00 UTC.
        assert_eq!(
            date_id(std::time::Duration::from_secs(951_825_600)),
            "2000-02-29T12-00-00.000000"
        );
    }

    #[test]
    fn revision_is_split_from_the_model() {
        assert_eq!(split_revision("o/n@main"), ("o/n", Some("main")));
        assert_eq!(split_revision("/data/x@y/model"), ("/data/x@y/model", None));
        assert_eq!(split_revision("o/n"), ("o/n", None));
    }
}
