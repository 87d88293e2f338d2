//! The tasks, their documents' fields in each public layout, and the
//! harness's prompts and context/continuation token split.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::eval::pytext::{py_isspace, py_strip};
use crate::scoring::Request;

use super::*;

/// Names PIQA's answers file in errors (a command line puts its flag in its
/// place).
pub const NOTE_LABELS: &str = "the labels file (valid-labels.lst)";

/// A zero-shot task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// `lambada_openai`: the last word given the passage.
    Lambada,
    /// HellaSwag: the ending of an activity.
    Hellaswag,
    /// PIQA: the solution of a physical goal.
    Piqa,
    /// ARC-Easy: grade-school science questions.
    ArcEasy,
    /// ARC-Challenge: the harder ARC questions.
    ArcChallenge,
    /// WinoGrande: which option fills the blank.
    Winogrande,
}

impl std::str::FromStr for Task {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "lambada" | "lambada_openai" => Task::Lambada,
            "hellaswag" => Task::Hellaswag,
            "piqa" => Task::Piqa,
            "arc_easy" => Task::ArcEasy,
            "arc_challenge" => Task::ArcChallenge,
            "winogrande" => Task::Winogrande,
            _ => {
                return Err(format!(
                    "unknown task `{s}` (expected lambada, hellaswag, piqa, arc_easy, arc_challenge or winogrande)"
                ))
            }
        })
    }
}

impl Task {
    /// Every task, in the paper's order.
    pub const ALL: [Task; 6] = [
        Task::Lambada,
        Task::Hellaswag,
        Task::Piqa,
        Task::ArcEasy,
        Task::ArcChallenge,
        Task::Winogrande,
    ];

    /// The harness's task name.
    pub fn name(&self) -> &'static str {
        match self {
            Task::Lambada => "lambada_openai",
            Task::Hellaswag => "hellaswag",
            Task::Piqa => "piqa",
            Task::ArcEasy => "arc_easy",
            Task::ArcChallenge => "arc_challenge",
            Task::Winogrande => "winogrande",
        }
    }

    /// The JSONL fields each line must have (for `--help` and errors).
    pub fn fields(&self) -> &'static str {
        match self {
            Task::Lambada => {
                r#"{"text"} (lambada_test.jsonl; the target is the last space-separated word)"#
            }
            Task::Hellaswag => {
                r#"{"activity_label", "ctx_a", "ctx_b", "endings": [4], "label": 0-3 or "0"-"3"}"#
            }
            Task::Piqa => {
                r#"{"goal", "sol1", "sol2", "label": 0|1} or, without "label", the labels file (valid-labels.lst)"#
            }
            Task::ArcEasy | Task::ArcChallenge => {
                r#"{"question": {"stem", "choices": [{"text", "label"}]}, "answerKey"} or HF {"question", "choices": {"text": [], "label": []}, "answerKey"}"#
            }
            Task::Winogrande => {
                r#"{"sentence" (one "_"), "option1", "option2", "answer": "1"|"2"}"#
            }
        }
    }

    /// The Hub dataset the harness loads the task from (its `dataset_path`).
    pub fn dataset_path(&self) -> &'static str {
        match self {
            Task::Lambada => "EleutherAI/lambada_openai",
            Task::Hellaswag => "Rowan/hellaswag",
            Task::Piqa => "ybisk/piqa",
            Task::ArcEasy | Task::ArcChallenge => "allenai/ai2_arc",
            Task::Winogrande => "allenai/winogrande",
        }
    }

    /// The configuration of [`dataset_path`](Self::dataset_path) (the harness's `dataset_name`).
    pub fn dataset_name(&self) -> Option<&'static str> {
        match self {
            Task::Lambada => Some("default"),
            Task::ArcEasy => Some("ARC-Easy"),
            Task::ArcChallenge => Some("ARC-Challenge"),
            Task::Winogrande => Some("winogrande_xl"),
            Task::Hellaswag | Task::Piqa => None,
        }
    }

    /// The split the harness evaluates (the test split where it is labelled).
    pub fn split(&self) -> &'static str {
        match self {
            Task::Lambada | Task::ArcEasy | Task::ArcChallenge => "test",
            Task::Hellaswag | Task::Piqa | Task::Winogrande => "validation",
        }
    }

    /// The harness's request type for the task.
    pub fn output_type(&self) -> &'static str {
        match self {
            Task::Lambada => "loglikelihood",
            _ => "multiple_choice",
        }
    }

    /// Whether the task reports `acc_norm` (winogrande and lambada do not).
    pub fn has_acc_norm(&self) -> bool {
        !matches!(self, Task::Lambada | Task::Winogrande)
    }
}

/// One document as the harness builds its requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    /// (context, continuation) strings: one per choice, or lambada's one.
    pub requests: Vec<(String, String)>,
    /// Index of the right choice (0 for lambada).
    pub gold: usize,
    /// The choices without the target delimiter: their character counts
    /// normalise `acc_norm`.
    pub choices: Vec<String>,
}

fn field<'a>(doc: &'a Value, name: &str) -> std::result::Result<&'a Value, String> {
    doc.get(name).ok_or_else(|| format!("no `{name}` field"))
}

fn string<'a>(doc: &'a Value, name: &str) -> std::result::Result<&'a str, String> {
    field(doc, name)?
        .as_str()
        .ok_or_else(|| format!("field `{name}` is not a string"))
}

/// A label that may be a number or a numeric string (HF exports differ).
fn index(v: &Value, name: &str) -> std::result::Result<usize, String> {
    match v {
        Value::Number(n) => n.as_u64().map(|x| x as usize),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
    .ok_or_else(|| format!("field `{name}` is not a label index: {v}"))
}

/// HellaSwag's cleaning (harness `hellaswag/utils.py::preprocess`): strip,
/// " \[title\]" → ". ", drop `[...]` (WikiHow artefacts), "  " → " ".
pub fn hellaswag_preprocess(text: &str) -> String {
    static BRACKETS: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = BRACKETS.get_or_init(|| regex::Regex::new(r"\[.*?\]").expect("valid regex"));
    let t = py_strip(text).replace(" [title]", ". ");
    re.replace_all(&t, "").replace("  ", " ")
}

/// The harness's requests for one JSONL document. `label` is PIQA's answer
/// from a separate labels file.
pub fn build_example(
    task: Task,
    doc: &Value,
    label: Option<&str>,
) -> std::result::Result<Example, String> {
    let mc = |context: String, choices: Vec<String>, gold: usize| {
        if gold >= choices.len() {
            return Err(format!(
                "label {gold} is out of range for {} choices",
                choices.len()
            ));
        }
        Ok(Example {
            requests: choices
                .iter()
                .map(|c| (context.clone(), format!(" {c}")))
                .collect(),
            gold,
            choices,
        })
    };
    match task {
        Task::Lambada => {
            let text = string(doc, "text")?;
            let (context, last) = match text.rsplit_once(' ') {
                Some((c, l)) => (c, l),
                None => ("", text),
            };
            Ok(Example {
                requests: vec![(context.to_string(), format!(" {last}"))],
                gold: 0,
                choices: vec![],
            })
        }
        Task::Hellaswag => {
            let ctx = format!(
                "{} {}",
                string(doc, "ctx_a")?,
                py_capitalize(string(doc, "ctx_b")?)
            );
            let query = hellaswag_preprocess(&format!("{}: {ctx}", string(doc, "activity_label")?));
            let endings = field(doc, "endings")?
                .as_array()
                .ok_or("field `endings` is not a list")?
                .iter()
                .map(|e| {
                    e.as_str()
                        .map(hellaswag_preprocess)
                        .ok_or("an ending is not a string")
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            mc(query, endings, index(field(doc, "label")?, "label")?)
        }
        Task::Piqa => {
            let context = format!("Question: {}\nAnswer:", string(doc, "goal")?);
            let choices = vec![
                string(doc, "sol1")?.to_string(),
                string(doc, "sol2")?.to_string(),
            ];
            let gold = match (doc.get("label"), label) {
                (_, Some(l)) => index(&Value::String(l.into()), "label (labels file)")?,
                (Some(v), None) => index(v, "label")?,
                (None, None) => {
                    return Err("no `label` field: pass the labels file (valid-labels.lst)".into())
                }
            };
            mc(context, choices, gold)
        }
        Task::ArcEasy | Task::ArcChallenge => {
            let q = field(doc, "question")?;
            let (stem, texts, labels) = match q {
                Value::String(s) => {
                    let ch = field(doc, "choices")?;
                    let list = |k: &str| -> std::result::Result<Vec<String>, String> {
                        field(ch, k)?
                            .as_array()
                            .ok_or(format!("`choices.{k}` is not a list"))?
                            .iter()
                            .map(|v| {
                                v.as_str()
                                    .map(str::to_string)
                                    .ok_or(format!("a `choices.{k}` is not a string"))
                            })
                            .collect()
                    };
                    (s.as_str(), list("text")?, list("label")?)
                }
                Value::Object(_) => {
                    let stem = string(q, "stem")?;
                    let ch = field(q, "choices")?
                        .as_array()
                        .ok_or("`question.choices` is not a list")?;
                    let mut texts = Vec::new();
                    let mut labels = Vec::new();
                    for c in ch {
                        texts.push(string(c, "text")?.to_string());
                        labels.push(string(c, "label")?.to_string());
                    }
                    (stem, texts, labels)
                }
                _ => return Err("field `question` is neither a string nor an object".into()),
            };
            let key = string(doc, "answerKey")?;
            let gold = labels
                .iter()
                .position(|l| l == key)
                .ok_or_else(|| format!("answerKey `{key}` is not among the labels {labels:?}"))?;
            mc(format!("Question: {stem}\nAnswer:"), texts, gold)
        }
        Task::Winogrande => {
            let sentence = string(doc, "sentence")?;
            let blank = sentence.find('_').ok_or("`sentence` has no `_` blank")?;
            let rest = py_strip(&sentence[blank + 1..]);
            let options = [string(doc, "option1")?, string(doc, "option2")?];
            let gold = match field(doc, "answer")? {
                Value::String(s) if s == "1" => 0,
                Value::String(s) if s == "2" => 1,
                Value::Number(n) if n.as_u64() == Some(1) => 0,
                Value::Number(n) if n.as_u64() == Some(2) => 1,
                v => return Err(format!("field `answer` is not \"1\" or \"2\": {v}")),
            };
            Ok(Example {
                requests: options
                    .iter()
                    .map(|o| (format!("{}{o}", &sentence[..blank]), format!(" {rest}")))
                    .collect(),
                gold,
                choices: vec![],
            })
        }
    }
}

fn encode(tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok
        .encode_fast(text, false)
        .map_err(|e| Error::input(format!("cannot tokenize {text:?}: {e}")))?
        .get_ids()
        .to_vec())
}

/// Context/continuation tokens as the harness: trailing whitespace of the
/// context moves into the continuation; the continuation is the tokens of
/// context+continuation after those of the context; an empty context becomes
/// the prefix token (or the continuation's first token if it is that token).
pub fn encode_pair(
    tok: &tokenizers::Tokenizer,
    prefix: u32,
    context: &str,
    continuation: &str,
) -> Result<Request> {
    // A whitespace-only context has no tokens: treated as empty (the
    // harness would score from no context at all, which a causal LM cannot).
    if context.trim_end_matches(py_isspace).is_empty() {
        let cont = encode(tok, &format!("{context}{continuation}"))?;
        return Ok(if cont.first() == Some(&prefix) {
            Request {
                context: cont[..1].to_vec(),
                continuation: cont[1..].to_vec(),
            }
        } else {
            Request {
                context: vec![prefix],
                continuation: cont,
            }
        });
    }
    let trimmed = context.trim_end_matches(py_isspace);
    let moved = format!("{}{continuation}", &context[trimmed.len()..]);
    let whole = encode(tok, &format!("{trimmed}{moved}"))?;
    let ctx = encode(tok, trimmed)?;
    let split = ctx.len().min(whole.len());
    Ok(Request {
        context: ctx,
        continuation: whole[split..].to_vec(),
    })
}
