//! Results and data as the ecosystem has them: lm-evaluation-harness's
//! results and samples layout, timm's results CSV, and task data read from
//! Hub dataset repos (`hf://datasets/…`, jsonl and parquet) on the local
//! imitation Hub.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::hub_server::FakeHub;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use serde_json::Value;
use tokenformer::eval::data::{DataFile, JsonLines};
use tokenformer::eval::pile::{self, Method, PileOptions, PileReport, PileTotals, RunInfo, Shard};
use tokenformer::eval::tasks::{build_example, Task};
use tokenformer::eval::Report;
use tokenformer::hub::{dataset, HubClient, HubConfig};

/// One string column's values with their definition and repetition levels.
type Column<'a> = (Vec<&'a str>, Option<Vec<i16>>, Option<Vec<i16>>);

/// A parquet file (snappy) with `schema` whose leaf columns, in order, hold `columns`.
fn write_parquet(schema: &str, columns: &[Column]) -> Vec<u8> {
    let schema = Arc::new(parse_message_type(schema).unwrap());
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build(),
    );
    let mut out = Vec::new();
    let mut w = SerializedFileWriter::new(&mut out, schema, props).unwrap();
    let mut rg = w.next_row_group().unwrap();
    for (values, def, rep) in columns {
        let mut col = rg.next_column().unwrap().unwrap();
        let vals: Vec<ByteArray> = values.iter().map(|s| ByteArray::from(*s)).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&vals, def.as_deref(), rep.as_deref())
            .unwrap();
        col.close().unwrap();
    }
    rg.close().unwrap();
    w.close().unwrap();
    out
}

/// `allenai/winogrande`'s columns, flat.
fn winogrande_parquet() -> Vec<u8> {
    let schema = "message schema {
        REQUIRED BYTE_ARRAY sentence (UTF8);
        REQUIRED BYTE_ARRAY option1 (UTF8);
        REQUIRED BYTE_ARRAY option2 (UTF8);
        REQUIRED BYTE_ARRAY answer (UTF8);
    }";
    write_parquet(
        schema,
        &[
            (
                vec![
                    "The cup fell off the table because _ was wobbly.",
                    "Sam gave Max the book because _ had finished it.",
                    "The ice melted in the sun because _ was hot.",
                ],
                None,
                None,
            ),
            (vec!["the table", "Sam", "the sun"], None, None),
            (vec!["the cup", "Max", "the ice"], None, None),
            (vec!["1", "1", "1"], None, None),
        ],
    )
}

/// `allenai/ai2_arc`'s columns: `choices` a struct of two string lists.
fn arc_parquet() -> Vec<u8> {
    let schema = "message schema {
        REQUIRED BYTE_ARRAY id (UTF8);
        REQUIRED BYTE_ARRAY question (UTF8);
        REQUIRED GROUP choices {
            REQUIRED GROUP text (LIST) { REPEATED GROUP list { REQUIRED BYTE_ARRAY element (UTF8); } }
            REQUIRED GROUP label (LIST) { REPEATED GROUP list { REQUIRED BYTE_ARRAY element (UTF8); } }
        }
        REQUIRED BYTE_ARRAY answerKey (UTF8);
    }";
    let lists = |v: Vec<&'static str>| -> Column<'static> {
        (v, Some(vec![1; 5]), Some(vec![0, 1, 1, 0, 1]))
    };
    write_parquet(
        schema,
        &[
            (vec!["q1", "q2"], None, None),
            (
                vec!["Which is a liquid?", "What do plants need?"],
                None,
                None,
            ),
            lists(vec!["water", "rock", "iron", "light", "sand"]),
            lists(vec!["A", "B", "C", "1", "2"]),
            (vec!["A", "1"], None, None),
        ],
    )
}

fn config(endpoint: &str, hf_home: &Path, offline: bool) -> HubConfig {
    let (home, endpoint) = (hf_home.to_string_lossy().to_string(), endpoint.to_string());
    HubConfig::from_vars(move |k| match k {
        "HF_ENDPOINT" => Some(endpoint.clone()),
        "HF_HOME" => Some(home.clone()),
        "HF_HUB_OFFLINE" if offline => Some("1".into()),
        _ => None,
    })
    .with_retries(0)
    .with_timeouts(Duration::from_secs(2), Duration::from_secs(5))
}

fn rows(path: &Path) -> Vec<Value> {
    JsonLines::new(DataFile::open(path).unwrap())
        .map(|r| r.unwrap().1.unwrap())
        .collect()
}

#[test]
fn dataset_files_come_from_the_hub_verified_cached_and_offline() {
    let hub = FakeHub::start();
    let home = tempfile::tempdir().unwrap();
    let arc = arc_parquet();
    let sha = hub.add_repo(
        "datasets/allenai/ai2_arc",
        &[("ARC-Easy/test.parquet", &arc)],
    );
    let spec = "hf://datasets/allenai/ai2_arc/ARC-Easy/test.parquet";
    let client = HubClient::new(config(&hub.endpoint(), home.path(), false)).unwrap();
    let path = dataset::fetch_with(&client, spec).unwrap();
    let want = home.path().join(format!(
        "hub/datasets--allenai--ai2_arc/snapshots/{sha}/ARC-Easy/test.parquet"
    ));
    assert_eq!(path, want);
    assert_eq!(std::fs::read(&path).unwrap(), arc);
    assert!(hub
        .requests()
        .iter()
        .any(|r| r.path.starts_with("/datasets/allenai/ai2_arc/resolve/")));

    // The rows read as the Hugging Face export of ARC, which the task reads as is.
    let docs = rows(&path);
    assert_eq!(docs.len(), 2);
    assert_eq!(docs[1]["choices"]["label"], serde_json::json!(["1", "2"]));
    let ex = build_example(Task::ArcEasy, &docs[0], None).unwrap();
    assert_eq!(ex.gold, 0);
    assert_eq!(ex.requests[2].1, " iron");
    assert_eq!(ex.requests[0].0, "Question: Which is a liquid?\nAnswer:");
    let ex = build_example(Task::ArcEasy, &docs[1], None).unwrap();
    assert_eq!((ex.gold, ex.requests.len()), (0, 2));

    // Offline with the server gone: found in the cache, same file.
    hub.stop();
    let offline = HubClient::new(config("http://127.0.0.1:9", home.path(), true)).unwrap();
    assert_eq!(dataset::fetch_with(&offline, spec).unwrap(), want);
    // Not cached: a clear error, not a path.
    let e = dataset::fetch_with(
        &offline,
        "hf://datasets/allenai/ai2_arc/ARC-Challenge/test.parquet",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("ARC-Challenge/test.parquet"), "{e}");
}

fn model_dir(dir: &Path) {
    let cfg = common::tiny_config(50_304, 64);
    common::write_lm_folder(dir, &cfg, &common::random_lm_tensors(&cfg, 7));
    std::fs::copy(common::tokenizer_fixture(), dir.join("tokenizer.json")).unwrap();
}

fn cli(hub: &FakeHub, home: &Path, args: &[&str]) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenformer"))
        .args(args)
        .env("HF_ENDPOINT", hub.endpoint())
        .env("HF_HOME", home)
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = args.iter().position(|a| *a == "--json").unwrap();
    serde_json::from_str(&std::fs::read_to_string(args[json + 1]).unwrap()).unwrap()
}

/// The harness's results as the README's Python snippet reads them:
/// `r["results"][task]["acc,none"]`, `["acc_stderr,none"]`,
/// `r["n-samples"][task]["effective"]`, `r["versions"][task]`,
/// `r["n-shot"][task]`, `r["config"]["model_args"]`.
fn read_like_the_harness(r: &Value, task: &str) -> (f64, Value, u64, f64) {
    let t = &r["results"][task];
    (
        t["acc,none"].as_f64().unwrap(),
        t["acc_stderr,none"].clone(),
        r["n-samples"][task]["effective"].as_u64().unwrap(),
        r["versions"][task].as_f64().unwrap(),
    )
}

#[test]
fn tasks_from_hub_datasets_write_harness_results_samples_and_merge() {
    let hub = FakeHub::start();
    let home = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    model_dir(&model);
    hub.add_repo(
        "datasets/allenai/ai2_arc",
        &[("ARC-Easy/test.parquet", &arc_parquet())],
    );
    hub.add_repo(
        "datasets/allenai/winogrande",
        &[("data/validation.parquet", &winogrande_parquet())],
    );
    let arc = "hf://datasets/allenai/ai2_arc/ARC-Easy/test.parquet";
    let wino = "hf://datasets/allenai/winogrande@main/data/validation.parquet";
    let p = |n: &str| dir.path().join(n).to_string_lossy().to_string();
    let (m, whole, samples) = (
        model.to_string_lossy().to_string(),
        p("whole.json"),
        p("samples"),
    );
    let base = [
        "eval",
        "tasks",
        "--model",
        &m,
        "--tasks",
        "arc_easy,winogrande",
    ];
    let data = ["--data", arc, "--data", wino];
    let mut args = base.to_vec();
    args.extend(data);
    args.extend(["--json", &whole, "--log-samples", &samples]);
    let r = cli(&hub, home.path(), &args);

    assert_eq!(r["kind"], "tasks");
    assert_eq!(r["config"]["model"], "tokenformer");
    assert_eq!(r["config"]["model_dtype"], "f32");
    assert!(r["config"]["model_args"]
        .as_str()
        .unwrap()
        .starts_with("pretrained="));
    let ours = r["tasks"].as_array().unwrap();
    assert_eq!(ours.len(), 2);
    for (task, n, has_norm) in [("arc_easy", 2, true), ("winogrande", 3, false)] {
        let mine = ours.iter().find(|t| t["task"] == task).unwrap();
        let (acc, stderr, effective, version) = read_like_the_harness(&r, task);
        assert_eq!(acc, mine["acc"].as_f64().unwrap(), "{task}");
        assert_eq!(stderr, mine["acc_stderr"], "{task}");
        assert_eq!((effective, version), (n, 1.0), "{task}");
        assert_eq!(r["n-samples"][task]["original"], n, "{task}");
        assert_eq!(r["n-shot"][task], 0);
        assert_eq!(r["higher_is_better"][task]["acc"], true);
        assert_eq!(
            r["results"][task].get("acc_norm,none").is_some(),
            has_norm,
            "{task}"
        );
        assert!(mine["data"].as_str().unwrap().starts_with("hf://datasets/"));

        // The samples file: one harness record per document, whose per-document
        // acc averages to the task's acc and whose argmax is that acc.
        let file = std::fs::read_dir(&samples)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|f| {
                let name = f.file_name().unwrap().to_string_lossy().to_string();
                name.starts_with(&format!("samples_{task}_")) && name.ends_with(".jsonl")
            })
            .unwrap();
        let lines: Vec<Value> = std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len() as u64, n);
        let mut sum = 0.0;
        for (i, s) in lines.iter().enumerate() {
            assert_eq!(s["doc_id"], i);
            let lls: Vec<f64> = s["filtered_resps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r[0].as_str().unwrap().parse().unwrap())
                .collect();
            let best = (0..lls.len()).fold(0, |b, j| if lls[j] > lls[b] { j } else { b });
            let gold = s["target"].as_u64().unwrap() as usize;
            assert_eq!(
                s["acc"].as_f64().unwrap(),
                f64::from(u8::from(best == gold))
            );
            assert!(s["arguments"]["gen_args_0"]["arg_0"].is_string());
            assert_eq!(s["resps"].as_array().unwrap().len(), lls.len());
            assert_eq!(s["doc_hash"].as_str().unwrap().len(), 64);
            sum += s["acc"].as_f64().unwrap();
        }
        assert!((sum / n as f64 - acc).abs() < 1e-12, "{task}");
    }

    // Shards of the same run, merged: the same harness numbers.
    let mut shard_files = Vec::new();
    for i in 0..2 {
        let f = p(&format!("s{i}.json"));
        let s = format!("{i}/2");
        let mut args = base.to_vec();
        args.extend(data);
        args.extend(["--shard", &s, "--json", &f]);
        let v = cli(&hub, home.path(), &args);
        assert_eq!(v["n-samples"]["winogrande"]["original"], 3);
        shard_files.push(f);
    }
    let merged = p("merged.json");
    let mg = cli(
        &hub,
        home.path(),
        &[
            "eval",
            "merge",
            &shard_files[0],
            &shard_files[1],
            "--json",
            &merged,
        ],
    );
    for task in ["arc_easy", "winogrande"] {
        let (a, _, n, _) = read_like_the_harness(&mg, task);
        let (b, _, m, _) = read_like_the_harness(&r, task);
        assert!((a - b).abs() < 1e-12 && n == m, "{task}");
    }
}

#[test]
fn pile_subsets_are_the_harness_pile_tasks() {
    let counts = |ll: f64, docs, words, bytes| pile::Counts {
        loglikelihood: ll,
        documents: docs,
        tokens: 10 * docs,
        words,
        bytes,
    };
    let totals = PileTotals {
        overall: counts(-300.0, 6, 90, 400),
        subsets: [
            ("Pile-CC".to_string(), counts(-100.0, 2, 30, 150)),
            ("ArXiv".to_string(), counts(-200.0, 4, 60, 250)),
        ]
        .into(),
        skipped_lines: 0,
    };
    let info = RunInfo {
        model: "o/m@main".into(),
        model_commit: Some("c".repeat(40)),
        weight_dtype: Some("f16".into()),
        device: "cuda:1".into(),
        data: "val.jsonl.zst".into(),
        data_sha256: "d".repeat(64),
        max_length: 2048,
        elapsed_seconds: 1.0,
    };
    let opts = PileOptions {
        method: Method::Rolling,
        batch_size: 4,
        subset: None,
        limit: None,
        shard: Shard::WHOLE,
        skip_bad: false,
        prefix_token: 0,
        max_line_bytes: 1 << 20,
    };
    let report = PileReport::new(info, &opts, &totals);
    let r = report.to_json();
    let arxiv = &r["results"]["pile_arxiv"];
    assert_eq!(
        arxiv["word_perplexity,none"].as_f64().unwrap(),
        (200.0f64 / 60.0).exp()
    );
    assert_eq!(
        arxiv["byte_perplexity,none"].as_f64().unwrap(),
        (200.0f64 / 250.0).exp()
    );
    assert_eq!(
        arxiv["bits_per_byte,none"].as_f64().unwrap(),
        200.0 / 250.0 / std::f64::consts::LN_2
    );
    assert_eq!(arxiv["word_perplexity_stderr,none"], "N/A");
    assert_eq!(
        r["results"]["pile_pile-cc"]["word_perplexity,none"],
        r["subsets"]["Pile-CC"]["word_perplexity"]
    );
    assert_eq!(
        r["results"]["pile"]["bits_per_byte,none"],
        r["bits_per_byte"]
    );
    assert_eq!(r["n-samples"]["pile_arxiv"]["original"], 4);
    assert_eq!(r["n-samples"]["pile_pile-cc"]["effective"], 2);
    assert_eq!(r["versions"]["pile_arxiv"], 2.0);
    assert_eq!(r["higher_is_better"]["pile_arxiv"]["bits_per_byte"], false);
    assert_eq!(r["config"]["model_sha"], "c".repeat(40));
    assert_eq!(r["config"]["model_dtype"], "f16");
    assert_eq!(r["config"]["device"], "cuda:1");
    assert_eq!(
        r["config"]["model_args"],
        "pretrained=o/m,revision=main,dtype=f16"
    );
    // Our own fields are all still there, and the file reads back as ours.
    assert_eq!(r["kind"], "pile");
    let back: PileReport = serde_json::from_value(r.clone()).unwrap();
    assert_eq!(back, report);
}

#[test]
fn imagenet_writes_timm_fields_and_appends_its_csv() {
    let fx = common::fixtures().join("vit-tiny-imagenet");
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("results.csv");
    let json = dir.path().join("r.json");
    let (model, data) = (fx.join("vit-tiny"), fx.join("val"));
    let args = [
        "eval",
        "imagenet",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--quiet",
        "--json",
        json.to_str().unwrap(),
        "--results-file",
        csv.to_str().unwrap(),
    ];
    for _ in 0..2 {
        let (out, _, err) = common::tokenformer(&args);
        assert!(out.status.success(), "{err}");
    }
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let top1 = r["top1"].as_f64().unwrap();
    let round4 = |x: f64| (x * 1e4).round() / 1e4;
    assert_eq!(r["top1_err"].as_f64().unwrap(), round4(100.0 - top1));
    assert_eq!(
        r["top5_err"].as_f64().unwrap(),
        round4(100.0 - r["top5"].as_f64().unwrap())
    );
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(r["img_size"], cfg["image_size"]);
    assert!(r["param_count"].as_f64().unwrap() > 0.0);
    assert_eq!(r["interpolation"], "bicubic");

    // timm's layout: the header once, then one row per run, csv module style.
    let text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = text.split("\r\n").filter(|l| !l.is_empty()).collect();
    assert_eq!(
        lines[0],
        "model,top1,top1_err,top5,top5_err,param_count,img_size,crop_pct,interpolation"
    );
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[1], lines[2]);
    let cells: Vec<&str> = lines[1].split(',').collect();
    assert_eq!(cells[1].parse::<f64>().unwrap(), round4(top1));
    assert_eq!(
        cells[2].parse::<f64>().unwrap(),
        r["top1_err"].as_f64().unwrap()
    );
    assert_eq!(
        cells[5].parse::<f64>().unwrap(),
        r["param_count"].as_f64().unwrap()
    );
    assert_eq!(cells[8], "bicubic");

    // A file that is not timm's CSV is refused, not appended to.
    std::fs::write(&csv, "a,b\n1,2\n").unwrap();
    let res = common::tokenformer(&args);
    common::assert_clean_failure(&res, &["not a timm results CSV"]);
    assert_eq!(std::fs::read_to_string(&csv).unwrap(), "a,b\n1,2\n");
}
