//! The command-line habits people bring from other tools: prompts and texts
//! from files and stdin, stop strings, a repetition penalty, many texts
//! scored in one run, shell completions and help on every flag. Run on the
//! shipped `tiny-kjv-lm`, whose text is real enough for stop strings to
//! land mid-generation.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use candle_core::{Tensor, D};
use common::tokenformer;
use tokenformer::{LanguageModel, PretrainedOptions};

fn kjv() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/zoo/tiny-kjv-lm").to_string()
}

/// Runs the binary with `input` on stdin; returns (success, stdout, stderr).
fn with_stdin(args: &[&str], input: &str) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tokenformer"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn generate(extra: &[&str]) -> String {
    let model = kjv();
    let mut args = vec![
        "generate",
        "--model",
        model.as_str(),
        "--max-new-tokens",
        "40",
    ];
    args.extend(extra);
    let (out, so, se) = tokenformer(&args);
    assert!(out.status.success(), "{args:?}: {se}");
    so
}

const PROMPT: &str = "And God said unto Moses,";

#[test]
fn generate_stops_before_a_stop_string() {
    let full = generate(&["--prompt", PROMPT]);
    let cont = full
        .strip_prefix(PROMPT)
        .unwrap()
        .strip_suffix('\n')
        .unwrap();
    // A stop string taken from the middle of what greedy decoding writes.
    let words: Vec<&str> = cont.split_whitespace().collect();
    assert!(words.len() > 6, "continuation too short: {cont:?}");
    let stop = format!(" {}", words[3]);
    let at = cont.find(&stop).unwrap();
    let stopped = generate(&["--prompt", PROMPT, "--stop", &stop, "--stop", "zzzz"]);
    assert_eq!(stopped, format!("{PROMPT}{}\n", &cont[..at]));
    // The library does the same.
    let lm = LanguageModel::from_pretrained(&kjv(), &PretrainedOptions::default()).unwrap();
    let text = lm
        .generate_until(PROMPT, 40, Default::default(), &[stop.as_str()])
        .unwrap();
    assert_eq!(text, &cont[..at]);
    assert_eq!(lm.generate(PROMPT, 40, Default::default()).unwrap(), cont);
}

#[test]
fn generate_reads_the_prompt_from_a_file_or_stdin() {
    let full = generate(&["--prompt", PROMPT]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, PROMPT).unwrap();
    assert_eq!(generate(&["--prompt-file", file.to_str().unwrap()]), full);
    let model = kjv();
    let base = [
        "generate",
        "--model",
        model.as_str(),
        "--max-new-tokens",
        "40",
    ];
    let (ok, so, se) = with_stdin(&base, PROMPT);
    assert!(ok, "{se}");
    assert_eq!(so, full);
    let mut dash = base.to_vec();
    dash.extend(["--prompt-file", "-"]);
    let (ok, so, se) = with_stdin(&dash, PROMPT);
    assert!(ok, "{se}");
    assert_eq!(so, full);
    // An empty pipe is an error that says what to give.
    let (ok, _, se) = with_stdin(&base, "");
    assert!(!ok && se.contains("--prompt"), "{se}");
}

/// Greedy decoding with transformers' repetition penalty, written out: the
/// whole sequence through the model each step (no cache), the penalty on
/// every distinct token of the last `last_n`.
fn penalised_greedy(
    lm: &LanguageModel,
    prompt: &str,
    n: usize,
    penalty: f32,
    last_n: usize,
) -> String {
    let mut ids = lm.encode(prompt).unwrap();
    let start = ids.len();
    for _ in 0..n {
        let input = Tensor::new(ids.as_slice(), &candle_core::Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = lm.model().forward(&input, None).unwrap();
        let mut last: Vec<f32> = logits
            .squeeze(0)
            .unwrap()
            .get(ids.len() - 1)
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut window: Vec<u32> = ids[ids.len().saturating_sub(last_n)..].to_vec();
        window.sort();
        window.dedup();
        for t in window {
            let l = &mut last[t as usize];
            *l = if *l < 0.0 { *l * penalty } else { *l / penalty };
        }
        let next = Tensor::new(last.as_slice(), &candle_core::Device::Cpu)
            .unwrap()
            .argmax(D::Minus1)
            .unwrap()
            .to_scalar::<u32>()
            .unwrap();
        ids.push(next);
    }
    lm.decode(&ids[start..]).unwrap()
}

#[test]
fn generate_applies_a_repetition_penalty() {
    let lm = LanguageModel::from_pretrained(&kjv(), &PretrainedOptions::default()).unwrap();
    let plain = generate(&["--prompt", PROMPT]);
    let got = generate(&[
        "--prompt",
        PROMPT,
        "--repeat-penalty",
        "1.5",
        "--repeat-last-n",
        "16",
    ]);
    let want = penalised_greedy(&lm, PROMPT, 40, 1.5, 16);
    assert_eq!(got, format!("{PROMPT}{want}\n"));
    assert!(
        !plain.starts_with(got.trim_end()),
        "the penalty changed nothing"
    );
    // Settings out of range are refused by flag, before the model is loaded.
    for (flag, value) in [
        ("--repeat-penalty", "0"),
        ("--temperature", "nan"),
        ("--temperature=-1", ""),
        ("--top-p", "2"),
    ] {
        let mut args = vec![
            "generate",
            "--model",
            "no/such-model",
            "--prompt",
            "x",
            flag,
        ];
        if !value.is_empty() {
            args.push(value);
        }
        let (out, _, se) = tokenformer(&args);
        let name = flag.split('=').next().unwrap();
        assert_eq!(out.status.code(), Some(1), "{flag} {value}: {se}");
        assert!(
            se.contains(&format!("{name} must be")),
            "{flag} {value}: {se}"
        );
    }
}

fn score_json(text: &str) -> serde_json::Value {
    let (out, so, se) = tokenformer(&["score", "--model", &kjv(), "--text", text, "--json"]);
    assert!(out.status.success(), "{se}");
    serde_json::from_str(&so).unwrap()
}

#[test]
fn score_takes_many_texts_from_json_lines_and_stdin() {
    let texts = [
        "In the beginning God created the heaven and the earth.",
        "And the earth was without form, and void.",
        "Jesus wept.",
    ];
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("texts.jsonl");
    let body: String = texts
        .iter()
        .map(|t| format!("{}\n\n", serde_json::json!({"text": t, "id": 1})))
        .collect();
    std::fs::write(&file, &body).unwrap();
    let model = kjv();
    let (out, so, se) =
        tokenformer(&["score", "--model", &model, "--file", file.to_str().unwrap()]);
    assert!(out.status.success(), "{se}");
    let lines: Vec<serde_json::Value> = so
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for (i, (got, text)) in lines.iter().zip(texts).enumerate() {
        let mut want = score_json(text);
        want["line"] = (2 * i + 1).into();
        assert_eq!(got, &want, "{text}");
    }
    // The same lines on stdin with --jsonl, and one text on stdin.
    let (ok, so2, se) = with_stdin(&["score", "--model", &model, "--jsonl"], &body);
    assert!(ok, "{se}");
    assert_eq!(so2, so);
    let (ok, one, se) = with_stdin(&["score", "--model", &model, "--json"], texts[0]);
    assert!(ok, "{se}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&one).unwrap(),
        score_json(texts[0])
    );
    // A bad line is named, after the good lines before it were printed.
    std::fs::write(
        &file,
        format!(
            "{}\n{{\"txt\": 1}}\n",
            serde_json::json!({"text": texts[2]})
        ),
    )
    .unwrap();
    let (out, so, se) =
        tokenformer(&["score", "--model", &model, "--file", file.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        se.contains("texts.jsonl line 2") && se.contains("`text`"),
        "{se}"
    );
    assert_eq!(so.lines().count(), 1);
}

#[test]
fn completions_cover_the_subcommands_and_flags() {
    let (out, bash, se) = tokenformer(&["completions", "bash"]);
    assert!(out.status.success(), "{se}");
    assert!(
        bash.contains("_tokenformer()"),
        "a bash completion function"
    );
    for word in [
        "generate",
        "--repeat-penalty",
        "--prompt-file",
        "imagenet",
        "--log-samples",
    ] {
        assert!(bash.contains(word), "bash completion knows {word}");
    }
    let (out, zsh, _) = tokenformer(&["completions", "zsh"]);
    assert!(out.status.success() && zsh.starts_with("#compdef tokenformer"));
    let (out, fish, _) = tokenformer(&["completions", "fish"]);
    assert!(out.status.success() && fish.contains("complete -c tokenformer"));
    let (out, _, se) = tokenformer(&["completions", "tcsh"]);
    assert!(!out.status.success() && se.contains("bash"), "{se}");
}

/// The logits of every position of `ids` decoded through `cache`: an
/// 8-token prefill, then one token at a time (the decoding kernels).
fn decoded_logits(
    lm: &LanguageModel,
    ids: &[u32],
    mut cache: tokenformer::models::lm::Cache,
) -> Vec<Vec<f32>> {
    let mut rows = Vec::new();
    let mut pos = 0;
    for chunk in std::iter::once(8).chain(std::iter::repeat(1)) {
        if pos >= ids.len() {
            break;
        }
        let part = &ids[pos..(pos + chunk).min(ids.len())];
        let x = Tensor::new(part, &candle_core::Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = lm
            .model()
            .forward(&x, Some(&mut cache))
            .unwrap()
            .squeeze(0)
            .unwrap();
        rows.extend(logits.to_vec2::<f32>().unwrap());
        pos += part.len();
    }
    rows
}

#[test]
fn an_f16_kv_cache_decodes_close_to_the_f32_cache() {
    use tokenformer::models::lm::Cache;
    use tokenformer::KvDtype;
    let lm = LanguageModel::from_pretrained(&kjv(), &PretrainedOptions::default()).unwrap();
    // A real text of most of the model's context (256 positions).
    let mut ids = lm.encode(PROMPT).unwrap();
    let params = Default::default();
    let more = tokenformer::generate::generate(lm.model(), &ids, 200, params, |_| {
        Ok(std::ops::ControlFlow::Continue(()))
    })
    .unwrap();
    ids.extend(more);
    assert!(ids.len() > 200);
    let cfg = lm.model().config();
    let wide = decoded_logits(&lm, &ids, Cache::new(cfg));
    let half = decoded_logits(&lm, &ids, Cache::with_dtype(cfg, KvDtype::F16));
    let (mut worst, mut worst_lp) = (0f32, 0f64);
    for (t, (a, b)) in wide.iter().zip(&half).enumerate() {
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        worst = worst.max(d);
        // The log-probability of the text's next token.
        if let Some(&next) = ids.get(t + 1) {
            let lp = |r: &[f32]| {
                let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                let z: f64 = r.iter().map(|&v| (v as f64 - m).exp()).sum();
                r[next as usize] as f64 - m - z.ln()
            };
            worst_lp = worst_lp.max((lp(a) - lp(b)).abs());
        }
        let argmax = |r: &[f32]| {
            r.iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |m, (i, &v)| if v > m.1 { (i, v) } else { m },
                )
                .0
        };
        assert_eq!(argmax(a), argmax(b), "greedy token at {t}");
    }
    // Keys and values rounded to f16 (2^-11 relative): the logits move, by
    // little. Zero would mean the cache was not f16 at all.
    assert!(worst > 0.0, "the f16 cache changed nothing");
    assert!(worst < 0.013, "max logit difference {worst}");
    assert!(
        worst_lp < 0.005,
        "max log-probability difference {worst_lp}"
    );
}

#[test]
fn generate_takes_an_f16_kv_cache_and_refuses_other_dtypes() {
    let lm = LanguageModel::from_pretrained(
        &kjv(),
        &PretrainedOptions {
            kv_cache: tokenformer::KvDtype::F16,
            ..Default::default()
        },
    )
    .unwrap();
    let got = generate(&["--prompt", PROMPT, "--kv-dtype", "f16"]);
    let want = lm.generate(PROMPT, 40, Default::default()).unwrap();
    assert_eq!(got, format!("{PROMPT}{want}\n"));
    assert_eq!(
        generate(&["--prompt", PROMPT, "--kv-dtype", "f32"]),
        generate(&["--prompt", PROMPT])
    );
    let (out, _, se) = tokenformer(&[
        "generate",
        "--model",
        &kjv(),
        "--prompt",
        "x",
        "--kv-dtype",
        "bf16",
    ]);
    assert!(!out.status.success());
    assert!(
        se.contains("invalid value 'bf16' for '--kv-dtype")
            && se.contains("[possible values: f32, f16]"),
        "{se}"
    );
}

#[test]
fn bench_names_a_bad_kv_dtype_or_decode_context() {
    let (out, _, se) = tokenformer(&["bench", "--only", "decode", "--kv-dtype", "f8"]);
    assert!(!out.status.success());
    assert!(se.contains("invalid value 'f8' for '--kv-dtype"), "{se}");
    let (out, _, se) = tokenformer(&["bench", "--only", "decode", "--decode-context", "2000"]);
    assert!(!out.status.success());
    assert!(
        se.contains("--decode-context 2000: between 1 and 1984"),
        "{se}"
    );
    // A part that does not exist here (`ops` is the GPU's) is named, with the CPU's list.
    let (out, _, se) = tokenformer(&["bench", "--only", "prefill,ops"]);
    assert!(!out.status.success());
    assert!(
        se.contains("--only ops: not a part of `bench` on this device (load, prefill, decode"),
        "{se}"
    );
    assert!(!se.contains("panicked"), "{se}");
}

#[test]
fn inspect_takes_model_names_as_the_other_commands_do() {
    let json = |model: &str| -> serde_json::Value {
        let (out, so, se) = tokenformer(&["inspect", model, "--json"]);
        assert!(out.status.success(), "{model}: {se}");
        serde_json::from_str(&so).unwrap()
    };
    // The bundled model by zoo name, against its folder in the repo.
    let by_name = json("tiny-kjv-lm");
    let by_path = json(&kjv());
    assert_eq!(by_name["tensors"], by_path["tensors"]);
    assert_eq!(by_name["architecture"], "tokenformer-lm");
    let st = candle_core::safetensors::load(
        std::path::Path::new(&kjv()).join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let elements: usize = st.values().map(|t| t.elem_count()).sum();
    assert_eq!(by_name["parameters"], elements as u64);
    assert_eq!(by_path["parameters"], elements as u64);
    let (out, _, se) = tokenformer(&["inspect", "no-such-model"]);
    assert_eq!(out.status.code(), Some(1), "{se}");
    assert!(se.contains("no-such-model"), "{se}");
}

/// `generate --json` holds the text the stream prints, why it ended (the
/// length, a stop string, the end-of-text token) and the counts.
#[test]
fn generate_json_says_why_it_ended() {
    let json = |extra: &[&str]| -> serde_json::Value {
        let mut args = extra.to_vec();
        args.push("--json");
        serde_json::from_str(&generate(&args)).unwrap()
    };
    let streamed = |extra: &[&str]| -> String {
        let full = generate(extra);
        full.strip_prefix(PROMPT)
            .unwrap()
            .strip_suffix('\n')
            .unwrap()
            .to_string()
    };
    let cont = streamed(&["--prompt", PROMPT]);
    let v = json(&["--prompt", PROMPT]);
    assert_eq!(v["generated_text"], cont.as_str());
    assert_eq!(v["prompt"], PROMPT);
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["generated_tokens"], 40);
    let lm = LanguageModel::from_pretrained(&kjv(), &PretrainedOptions::default()).unwrap();
    assert_eq!(v["prompt_tokens"], lm.encode(PROMPT).unwrap().len());
    let (first, all) = (
        v["first_token_seconds"].as_f64().unwrap(),
        v["seconds"].as_f64().unwrap(),
    );
    assert!(0.0 < first && first <= all, "{v}");
    assert!(v["decode_tokens_per_second"].as_f64().unwrap() > 0.0, "{v}");

    let words: Vec<&str> = cont.split_whitespace().collect();
    let stop = format!(" {}", words[3]);
    let v = json(&["--prompt", PROMPT, "--stop", &stop]);
    assert_eq!(v["finish_reason"], "stop_sequence");
    assert_eq!(v["generated_text"], &cont[..cont.find(&stop).unwrap()]);
    assert!(v["generated_tokens"].as_u64().unwrap() < 40, "{v}");

    // Sampling ends some texts with the end-of-text token (seeds 0 and 4 of
    // the first 64 on the host this was written on); search rather than pin
    // one, as a sample may turn on rounding.
    let found = (0..256).map(|s| s.to_string()).find_map(|seed| {
        let args = ["--prompt", PROMPT, "--temperature", "1", "--seed", &seed];
        let v = json(&args);
        (v["finish_reason"] == "eos_token").then(|| (streamed(&args), v))
    });
    let (text, v) = found.expect("no seed of 256 ended with the end-of-text token");
    assert_eq!(v["generated_text"], text.as_str());
    assert!(v["generated_tokens"].as_u64().unwrap() <= 40, "{v}");
}

/// `generate --prompts`: many prompts decoded together, one JSON line out per
/// prompt in the file's order, each what `generate --json` gives that prompt
/// alone (text, finish reason, counts); bad lines named, the batch flags
/// refused without it.
#[test]
fn generate_prompts_file_gives_each_prompt_its_own_result() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompts.jsonl");
    let prompts = [PROMPT, "a handwritten", "In the beginning", "Jesus"];
    let mut text = String::new();
    for (i, p) in prompts.iter().enumerate() {
        text.push_str(&serde_json::json!({ "prompt": p, "id": i }).to_string());
        text.push_str("\n\n");
    }
    std::fs::write(&file, &text).unwrap();
    let f = file.to_str().unwrap();
    let words: Vec<String> = generate(&["--prompt", PROMPT])
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let stop = format!(" {}", words[6]);
    let common = ["--stop", &stop, "--temperature", "0.7", "--seed", "5"];
    let mut args = vec!["--prompts", f, "--batch-size", "3", "--quiet"];
    args.extend(common);
    let out = generate(&args);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), prompts.len(), "{out}");
    let mut reasons = Vec::new();
    for (i, (v, p)) in lines.iter().zip(prompts).enumerate() {
        assert_eq!(v["line"], 2 * i + 1, "blank lines are counted, not read");
        assert_eq!(v["prompt"], p);
        let mut alone = vec!["--prompt", p, "--json"];
        alone.extend(common);
        let want: serde_json::Value = serde_json::from_str(&generate(&alone)).unwrap();
        for key in [
            "generated_text",
            "finish_reason",
            "prompt_tokens",
            "generated_tokens",
        ] {
            assert_eq!(v[key], want[key], "{p}: {key}");
        }
        reasons.push(v["finish_reason"].as_str().unwrap().to_string());
    }
    assert!(reasons.contains(&"stop_sequence".into()), "{reasons:?}");
    assert!(reasons.contains(&"eos_token".into()), "{reasons:?}");

    std::fs::write(&file, "{\"prompt\": \"And\"}\n{\"text\": \"x\"}\n").unwrap();
    let model = kjv();
    let res = tokenformer(&["generate", "--model", &model, "--prompts", f]);
    common::assert_clean_failure(&res, &["prompts.jsonl line 2", "no `prompt`"]);
    let res = tokenformer(&[
        "generate",
        "--model",
        &model,
        "--prompt",
        "x",
        "--batch-size",
        "2",
    ]);
    common::assert_clean_failure(&res, &["--batch-size", "--prompts"]);
}

/// Output into a pipe whose reader has gone (`| head`) ends the command
/// quietly with the status a shell shows for tools SIGPIPE ends (141), as
/// other command-line tools end, not with a panic; a full disk is still an
/// error that says so.
#[test]
fn a_closed_pipe_ends_quietly_and_a_full_disk_is_an_error() {
    let model = kjv();
    let digits = concat!(env!("CARGO_MANIFEST_DIR"), "/zoo/examples/digits");
    let runs: [&[&str]; 4] = [
        &["zoo", "list"],
        &["completions", "bash"],
        &[
            "score",
            "--model",
            &model,
            "--text",
            "And God said unto Moses",
        ],
        &["classify", "--model", "tiny-digits-vit", digits],
    ];
    for args in runs {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_tokenformer"))
            .args(args)
            .env("HF_HUB_OFFLINE", "1")
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
    if std::path::Path::new("/dev/full").exists() {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_tokenformer"))
            .args(["zoo", "list"])
            .stdout(full)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("No space left"), "{stderr}");
    }
}
