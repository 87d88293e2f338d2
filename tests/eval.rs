//! Language evaluation (`tokenformer eval pile | tasks | merge`) against
//! lm-evaluation-harness's rules, checked by brute force on a tiny random
//! model with a 16-token context (so documents span several windows).

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use tokenformer::checkpoint::{write_safetensors, Tensors};
use tokenformer::eval::imagenet;
use tokenformer::eval::merge::{merge_pile, merge_results};
use tokenformer::eval::pile::{
    self, count_words, rolling_windows, strided_windows, Method, PileOptions, PileReport,
    PileTotals, RunInfo, Shard,
};
use tokenformer::eval::tasks::{self, build_example, encode_pair, Task, TaskCounts, TaskOptions};
use tokenformer::loader::{self, LocateOptions};
use tokenformer::models::tokenformer::{Config, TokenFormerLm};
use tokenformer::scoring::{Request, Scorer};

const MAX_POS: usize = 16;
const TOKENIZER: &str = "tests/fixtures/gpt-neox-20b-tokenizer.json";

fn req(context: &[u32], continuation: &[u32]) -> Request {
    Request {
        context: context.to_vec(),
        continuation: continuation.to_vec(),
    }
}

// ---------- window construction ----------

#[test]
fn rolling_windows_issue_example() {
    let toks: Vec<u32> = (0..10).collect();
    let w = rolling_windows(&toks, 99, 4);
    assert_eq!(
        w,
        vec![
            req(&[99], &[0, 1, 2, 3]),
            req(&[3], &[4, 5, 6, 7]),
            req(&[5, 6, 7], &[8, 9])
        ]
    );
}

#[test]
fn rolling_windows_edge_cases() {
    // Shorter than one window: one window given the prefix.
    assert_eq!(
        rolling_windows(&[7, 8, 9], 0, 4),
        vec![req(&[0], &[7, 8, 9])]
    );
    // Exactly one window.
    assert_eq!(
        rolling_windows(&[7, 8, 9, 10], 0, 4),
        vec![req(&[0], &[7, 8, 9, 10])]
    );
    // Exactly two windows: the second is conditioned on one token.
    assert_eq!(
        rolling_windows(&[1, 2, 3, 4, 5, 6, 7, 8], 0, 4),
        vec![req(&[0], &[1, 2, 3, 4]), req(&[4], &[5, 6, 7, 8])]
    );
    // One token past a window: right-aligned to a full input of 4 tokens.
    assert_eq!(
        rolling_windows(&[1, 2, 3, 4, 5], 0, 4),
        vec![req(&[0], &[1, 2, 3, 4]), req(&[1, 2, 3, 4], &[5])]
    );
    // Empty text: nothing to score.
    assert!(rolling_windows(&[], 0, 4).is_empty());
    // Window of one token.
    assert_eq!(
        rolling_windows(&[5, 6], 0, 1),
        vec![req(&[0], &[5]), req(&[5], &[6])]
    );
}

#[test]
fn strided_windows_follow_hf_guide() {
    let toks: Vec<u32> = (0..10).collect();
    // max 4, stride 2: windows [0,4) [2,6) [4,8) [6,10); each scores what is new.
    assert_eq!(
        strided_windows(&toks, 4, 2),
        vec![
            req(&[0], &[1, 2, 3]),
            req(&[2, 3], &[4, 5]),
            req(&[4, 5], &[6, 7]),
            req(&[6, 7], &[8, 9])
        ]
    );
    // stride = max: the first token of every window is not scored.
    assert_eq!(
        strided_windows(&toks, 4, 4),
        vec![
            req(&[0], &[1, 2, 3]),
            req(&[4], &[5, 6, 7]),
            req(&[8], &[9])
        ]
    );
    assert!(strided_windows(&[3], 4, 2).is_empty());
    assert!(strided_windows(&[], 4, 2).is_empty());
    assert_eq!(
        strided_windows(&[3, 4, 5, 6], 4, 2),
        vec![req(&[3], &[4, 5, 6])]
    );
}

#[test]
fn words_follow_python_re_split() {
    // len(re.split(r"\s+", s)) in CPython.
    assert_eq!(count_words(""), 1);
    assert_eq!(count_words("   "), 2);
    assert_eq!(count_words("a"), 1);
    assert_eq!(count_words(" a  b\n"), 4);
    assert_eq!(count_words("a\u{1c}b\u{a0}c\u{3000}d"), 4);
    assert_eq!(count_words("a\u{200b}b"), 1);
}

#[test]
fn shard_parsing() {
    assert_eq!(
        "2/4".parse::<Shard>().unwrap(),
        Shard { index: 2, count: 4 }
    );
    assert!("4/4".parse::<Shard>().is_err());
    assert!("1/0".parse::<Shard>().is_err());
    assert!("x".parse::<Shard>().is_err());
}

// ---------- a tiny model ----------

/// Deterministic pseudo-normal values (sum of uniforms), scaled.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut u = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32) / (1u64 << 24) as f32
    };
    (0..n)
        .map(|_| ((0..4).map(|_| u()).sum::<f32>() - 2.0) * scale)
        .collect()
}

/// A random canonical model folder (config.json, model.safetensors, tokenizer.json).
fn tiny_model_dir(dir: &Path) {
    let mut cfg = Config::released(2, 32, 2);
    cfg.qkv_tokens = 24;
    cfg.proj_tokens = 20;
    cfg.ffn_tokens = 48;
    cfg.max_position_embeddings = MAX_POS;
    random_model_dir(dir, &cfg);
}

/// Writes random weights for `cfg` (scales keep activations in a sane range).
fn random_model_dir(dir: &Path, cfg: &Config) {
    model_dir_with_norm(dir, cfg, 1.0);
}

/// The tiny model with every final-norm weight NaN: it outputs NaN logits.
fn nan_model_dir(dir: &Path) {
    let mut cfg = Config::released(2, 32, 2);
    cfg.qkv_tokens = 24;
    cfg.proj_tokens = 20;
    cfg.ffn_tokens = 48;
    cfg.max_position_embeddings = MAX_POS;
    model_dir_with_norm(dir, &cfg, f32::NAN);
}

/// Random weights for `cfg`, the final norm's weights all `norm`.
fn model_dir_with_norm(dir: &Path, cfg: &Config, norm: f32) {
    let d = cfg.hidden_size;
    let mut t = Tensors::new();
    let mut seed = 1;
    let mut add = |name: String, shape: (usize, usize), scale: f32| {
        seed += 1;
        let v = values(shape.0 * shape.1, seed, scale);
        t.insert(name, Tensor::from_vec(v, shape, &Device::Cpu).unwrap());
    };
    add("word_embeddings.weight".into(), (cfg.vocab_size, d), 1.0);
    for i in 0..cfg.num_layers {
        for (m, n) in cfg.pattentions() {
            add(format!("layers.{i}.{m}.key_param_tokens"), (n, d), 0.5);
            add(format!("layers.{i}.{m}.value_param_tokens"), (n, d), 0.5);
        }
    }
    t.insert(
        "final_norm.weight".into(),
        Tensor::full(norm, d, &Device::Cpu).unwrap(),
    );
    t.insert(
        "final_norm.bias".into(),
        Tensor::zeros(d, DType::F32, &Device::Cpu).unwrap(),
    );
    write_safetensors(dir, &t, u64::MAX).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    std::fs::copy(TOKENIZER, dir.join("tokenizer.json")).unwrap();
}

struct Fixture {
    _dir: tempfile::TempDir,
    model: TokenFormerLm,
    tok: tokenizers::Tokenizer,
}

/// The language model and tokenizer of a model folder.
fn load_model(path: &Path) -> (TokenFormerLm, tokenizers::Tokenizer) {
    let files = loader::locate(path.to_str().unwrap(), &LocateOptions::default()).unwrap();
    let model = loader::load_lm(&files, &Device::Cpu).unwrap();
    (model, loader::load_tokenizer(&files).unwrap())
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model");
    std::fs::create_dir(&path).unwrap();
    tiny_model_dir(&path);
    let (model, tok) = load_model(&path);
    Fixture {
        _dir: dir,
        model,
        tok,
    }
}

fn encode(tok: &tokenizers::Tokenizer, s: &str) -> Vec<u32> {
    tok.encode(s, false).unwrap().get_ids().to_vec()
}

/// log p(target | context), one forward pass on exactly `context`.
fn brute(model: &TokenFormerLm, context: &[u32], target: u32) -> f64 {
    let ids = Tensor::new(context, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model.forward(&ids, None).unwrap().squeeze(0).unwrap();
    let row: Vec<f64> = logits
        .get(context.len() - 1)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect();
    let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    row[target as usize] - lse
}

/// The rolling rule stated directly: token i of block k = i / L is
/// conditioned on tokens[end-L-1 .. i], end = min((k+1)L, n); block 0 on EOS.
fn brute_rolling(model: &TokenFormerLm, t: &[u32], l: usize) -> f64 {
    (0..t.len())
        .map(|i| {
            let ctx: Vec<u32> = if i < l {
                std::iter::once(0).chain(t[..i].iter().copied()).collect()
            } else {
                let end = ((i / l + 1) * l).min(t.len());
                t[end - l - 1..i].to_vec()
            };
            brute(model, &ctx, t[i])
        })
        .sum()
}

/// Hugging Face's strided loop, one token at a time.
fn brute_strided(model: &TokenFormerLm, t: &[u32], l: usize, stride: usize) -> (f64, u64) {
    let (mut ll, mut n, mut prev_end, mut begin) = (0.0, 0, 0, 0);
    while begin < t.len() {
        let end = (begin + l).min(t.len());
        let trg_len = end - prev_end;
        for j in (end - trg_len).max(begin + 1)..end {
            ll += brute(model, &t[begin..j], t[j]);
            n += 1;
        }
        prev_end = end;
        if end == t.len() {
            break;
        }
        begin += stride;
    }
    (ll, n)
}

const WORDS: [&str; 16] = [
    "the", "cat", "sat", "on", "mat", "and", "dog", "ran", "to", "house", "big", "red", "tree",
    "water", "book", "night",
];

/// Documents of 0..=40 words (one-token words: exact window boundaries).
fn documents() -> Vec<String> {
    let mut docs = Vec::new();
    for (k, n) in [0usize, 1, 3, 15, 16, 17, 32, 40, 7, 33].iter().enumerate() {
        let words: Vec<&str> = (0..*n)
            .map(|i| WORDS[(i * 7 + k * 3) % WORDS.len()])
            .collect();
        docs.push(words.join(" "));
    }
    docs.push("  Leading and trailing\twhitespace, punctuation; ünïcödé… 123 \n".into());
    docs
}

fn write_jsonl(path: &Path, docs: &[String]) {
    let lines: Vec<String> = docs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            json!({"text": d, "meta": {"pile_set_name": format!("doc{i:02}")}}).to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn opts(method: Method, batch: usize) -> PileOptions {
    PileOptions {
        method,
        batch_size: batch,
        subset: None,
        limit: None,
        shard: Shard::WHOLE,
        skip_bad: false,
        prefix_token: 0,
        max_line_bytes: pile::DEFAULT_MAX_LINE_BYTES,
    }
}

/// The run of a local model `m` on data `d` taking `secs`.
fn run_info(secs: f64) -> RunInfo {
    RunInfo {
        model: "m".into(),
        model_commit: None,
        weight_dtype: None,
        device: "cpu".into(),
        data: "d".into(),
        data_sha256: "x".into(),
        max_length: MAX_POS,
        elapsed_seconds: secs,
    }
}

/// A Hub model's run on `data` whose hashes repeat `commit` and `sha`.
fn hub_run_info(data: &str, commit: &str, sha: &str, dtype: &str, secs: f64) -> RunInfo {
    RunInfo {
        model: "acme/m@main".into(),
        model_commit: Some(commit.repeat(40)),
        weight_dtype: Some(dtype.into()),
        data: data.into(),
        data_sha256: sha.repeat(64),
        ..run_info(secs)
    }
}

fn task_opts(batch: usize) -> TaskOptions {
    TaskOptions {
        batch_size: batch,
        limit: None,
        shard: Shard::WHOLE,
        skip_bad: false,
        prefix_token: 0,
        max_line_bytes: pile::DEFAULT_MAX_LINE_BYTES,
    }
}

/// A tasks report of shard `i` of 2 as JSON.
fn task_shard(info: RunInfo, task: Task, o: &TaskOptions, i: usize, c: TaskCounts) -> Value {
    let o = TaskOptions {
        shard: Shard { index: i, count: 2 },
        ..o.clone()
    };
    serde_json::to_value(tasks::TaskReport::new(info, task, &o, c)).unwrap()
}

fn run(f: &Fixture, path: &Path, o: &PileOptions) -> tokenformer::Result<PileTotals> {
    // No token cap: `batch` windows of mixed lengths really share a padded pass.
    let scorer = Scorer::new(&f.model, None)?.with_batch_tokens(1 << 20);
    pile::evaluate(&scorer, &f.tok, path, o, |_| {})
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn pile_matches_brute_force_and_is_batch_invariant() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let docs = documents();
    let data = dir.path().join("docs.jsonl");
    write_jsonl(&data, &docs);
    let toks: Vec<Vec<u32>> = docs.iter().map(|d| encode(&f.tok, d)).collect();
    assert!(toks.iter().any(|t| t.len() == MAX_POS) && toks.iter().any(|t| t.len() == 2 * MAX_POS));
    assert!(toks
        .iter()
        .any(|t| t.len() > 2 * MAX_POS && t.len() % MAX_POS != 0));

    let rolling = run(&f, &data, &opts(Method::Rolling, 8)).unwrap();
    let strided = run(&f, &data, &opts(Method::Strided { stride: 5 }, 8)).unwrap();
    let strided_full = run(&f, &data, &opts(Method::Strided { stride: MAX_POS }, 3)).unwrap();
    let mut total = 0.0;
    for (i, (d, t)) in docs.iter().zip(&toks).enumerate() {
        let c = &rolling.subsets[&format!("doc{i:02}")];
        let expect = brute_rolling(&f.model, t, MAX_POS);
        total += expect;
        assert!(
            close(c.loglikelihood, expect, 1e-4),
            "doc {i}: {} vs {expect}",
            c.loglikelihood
        );
        assert_eq!(c.tokens, t.len() as u64);
        assert_eq!(c.words, count_words(d));
        assert_eq!(c.bytes, d.len() as u64);
        assert_eq!(c.documents, 1);
        for (res, stride) in [(&strided, 5), (&strided_full, MAX_POS)] {
            let (ll, n) = brute_strided(&f.model, t, MAX_POS, stride);
            let c = &res.subsets[&format!("doc{i:02}")];
            assert!(
                close(c.loglikelihood, ll, 1e-4),
                "strided {stride} doc {i}: {} vs {ll}",
                c.loglikelihood
            );
            assert_eq!(c.tokens, n);
        }
    }
    assert!(close(rolling.overall.loglikelihood, total, 1e-4));
    assert_eq!(rolling.overall.documents, docs.len() as u64);

    // Batch size does not change the numbers.
    let one = run(&f, &data, &opts(Method::Rolling, 1)).unwrap();
    assert!(close(
        one.overall.loglikelihood,
        rolling.overall.loglikelihood,
        1e-5
    ));
    for (k, c) in &one.subsets {
        assert!(
            close(c.loglikelihood, rolling.subsets[k].loglikelihood, 1e-5),
            "{k}"
        );
        assert_eq!(c.tokens, rolling.subsets[k].tokens);
    }

    // The metrics are the harness's aggregations of these sums.
    let m = rolling.overall.metrics();
    let (ll, c) = (rolling.overall.loglikelihood, &rolling.overall);
    assert!(close(
        m.word_perplexity.unwrap(),
        (-ll / c.words as f64).exp(),
        1e-12
    ));
    assert!(close(
        m.bits_per_byte.unwrap(),
        -ll / c.bytes as f64 / 2f64.ln(),
        1e-12
    ));
    assert!(close(
        m.token_perplexity.unwrap(),
        (-ll / c.tokens as f64).exp(),
        1e-12
    ));
}

#[test]
fn zstd_shards_limit_subset() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let docs = documents();
    let data = dir.path().join("docs.jsonl");
    write_jsonl(&data, &docs);
    let zst = dir.path().join("docs.jsonl.zst");
    std::fs::write(
        &zst,
        zstd::encode_all(&std::fs::read(&data).unwrap()[..], 3).unwrap(),
    )
    .unwrap();
    let o = opts(Method::Rolling, 4);
    let plain = run(&f, &data, &o).unwrap();
    assert_eq!(run(&f, &zst, &o).unwrap(), plain);

    // Shards + merge = one run.
    let info = run_info;
    let whole = PileReport::new(info(3.0), &o, &plain);
    let parts: Vec<PileReport> = (0..3)
        .map(|i| {
            let so = PileOptions {
                shard: Shard { index: i, count: 3 },
                ..o.clone()
            };
            let t = run(&f, &zst, &so).unwrap();
            assert!(t.overall.documents < plain.overall.documents);
            PileReport::new(info(1.0), &so, &t)
        })
        .collect();
    let merged = merge_pile(&parts).unwrap();
    let t = merged.totals();
    assert_eq!(t.overall.tokens, plain.overall.tokens);
    assert_eq!(t.overall.words, plain.overall.words);
    assert_eq!(t.overall.documents, plain.overall.documents);
    assert!(close(
        t.overall.loglikelihood,
        plain.overall.loglikelihood,
        1e-7
    ));
    assert!(close(
        merged.metrics.word_perplexity.unwrap(),
        whole.metrics.word_perplexity.unwrap(),
        1e-7
    ));
    assert_eq!(
        merged.subsets.keys().collect::<Vec<_>>(),
        whole.subsets.keys().collect::<Vec<_>>()
    );
    assert_eq!(merged.shard, None);
    // Through the JSON dispatcher too; incomplete or duplicated shard sets are refused.
    let vals: Vec<Value> = parts
        .iter()
        .map(|p| serde_json::to_value(p).unwrap())
        .collect();
    let m2: PileReport = serde_json::from_value(merge_results(&vals).unwrap()).unwrap();
    assert_eq!(m2, merged);
    assert!(merge_results(&vals[..2]).is_err());
    assert!(merge_results(&[
        vals[0].clone(),
        vals[0].clone(),
        vals[1].clone(),
        vals[2].clone()
    ])
    .is_err());
    // An ImageNet result is dispatched to the ImageNet merge, which wants its counts.
    let img = json!({"kind": "imagenet"});
    assert!(merge_results(&[img]).is_err());

    // --subset and --limit select before sharding.
    let sub = run(
        &f,
        &data,
        &PileOptions {
            subset: Some("doc07".into()),
            ..o.clone()
        },
    )
    .unwrap();
    assert_eq!(sub.overall, plain.subsets["doc07"]);
    let lim = run(
        &f,
        &data,
        &PileOptions {
            limit: Some(4),
            ..o.clone()
        },
    )
    .unwrap();
    let expect: u64 = (0..4)
        .map(|i| plain.subsets[&format!("doc{i:02}")].tokens)
        .sum();
    assert_eq!((lim.overall.documents, lim.overall.tokens), (4, expect));
    assert!(run(
        &f,
        &data,
        &PileOptions {
            subset: Some("nope".into()),
            ..o
        }
    )
    .is_err());
}

#[test]
fn txt_is_one_document() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen\n";
    let p = dir.path().join("a.txt");
    std::fs::write(&p, text).unwrap();
    let r = run(&f, &p, &opts(Method::Rolling, 2)).unwrap();
    let t = encode(&f.tok, text);
    assert_eq!(
        (r.overall.documents, r.overall.tokens, r.overall.words),
        (1, t.len() as u64, 18)
    );
    assert!(close(
        r.overall.loglikelihood,
        brute_rolling(&f.model, &t, MAX_POS),
        1e-4
    ));
    assert!(r.subsets.is_empty());
}

#[test]
fn bad_input_is_reported() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let o = opts(Method::Rolling, 2);
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let good = r#"{"text": "hello world"}"#;
    let cases: [(&str, Vec<u8>, &str); 4] = [
        (
            "malformed.jsonl",
            format!("{good}\n\n{{\"text\": \"oops\"\n{good}\n").into_bytes(),
            "line 3: malformed JSON",
        ),
        (
            "notext.jsonl",
            format!("{good}\n{{\"txt\": \"x\"}}\n").into_bytes(),
            "line 2: no `text` field",
        ),
        (
            "nonstring.jsonl",
            format!("{{\"text\": 5}}\n{good}\n").into_bytes(),
            "line 1: field `text` is not a string",
        ),
        (
            "utf8.jsonl",
            [good.as_bytes(), b"\n{\"text\": \"a\xff\"}\n"].concat(),
            "line 2: invalid UTF-8",
        ),
    ];
    for (name, bytes, msg) in &cases {
        let p = write(name, bytes);
        let e = run(&f, &p, &o).unwrap_err().to_string();
        assert!(e.contains(msg), "{name}: {e}");
        let skipped = run(
            &f,
            &p,
            &PileOptions {
                skip_bad: true,
                ..o.clone()
            },
        )
        .unwrap();
        assert_eq!(skipped.skipped_lines, 1, "{name}");
        let n_good = String::from_utf8_lossy(bytes).matches(good).count() as u64;
        assert_eq!(skipped.overall.documents, n_good, "{name}");
    }
    let empty = write("empty.jsonl", b"");
    assert!(run(&f, &empty, &o)
        .unwrap_err()
        .to_string()
        .contains("empty"));
    let blank = write("blank.jsonl", b"\n  \n");
    assert!(run(&f, &blank, &o)
        .unwrap_err()
        .to_string()
        .contains("empty"));
    let txt = write("bad.txt", b"ok \xc3\x28");
    assert!(run(&f, &txt, &o)
        .unwrap_err()
        .to_string()
        .contains("invalid UTF-8"));
    let zst = write("broken.jsonl.zst", b"\x28\xb5\x2f\xfd garbage");
    assert!(run(&f, &zst, &o).is_err());
    let so = opts(
        Method::Strided {
            stride: MAX_POS + 1,
        },
        2,
    );
    assert!(run(&f, &write("ok.jsonl", good.as_bytes()), &so).is_err());

    // Every line bad: skipping them leaves nothing to measure, which is an error
    // (a report of zero documents would read as a result), for pile and tasks alike.
    let all_bad = write("allbad.jsonl", b"{\"txt\": 1}\n[1]\n");
    let skip = PileOptions {
        skip_bad: true,
        ..o.clone()
    };
    let e = run(&f, &all_bad, &skip).unwrap_err().to_string();
    assert!(
        e.contains("allbad.jsonl: no documents (2 of its 2 lines skipped as bad)"),
        "{e}"
    );
    let scorer = Scorer::new(&f.model, None).unwrap();
    let topts = TaskOptions {
        skip_bad: true,
        ..task_opts(2)
    };
    let e = tasks::evaluate(
        &scorer,
        &f.tok,
        Task::Lambada,
        &all_bad,
        None,
        &topts,
        |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("allbad.jsonl: no lambada_openai documents (all 2 lines skipped as bad)"),
        "{e}"
    );
    // One good line among them is a result.
    let one_good = write("onegood.jsonl", format!("[1]\n{good}\n").as_bytes());
    assert_eq!(run(&f, &one_good, &skip).unwrap().overall.documents, 1);
}

/// Not a test: writes a random full-size TokenFormer-150M folder to
/// $TOKENFORMER_BENCH_DIR for timing `eval pile` (`cargo test --release
/// --test eval -- --ignored write_random_150m`).
#[test]
#[ignore]
fn write_random_150m() {
    let dir =
        PathBuf::from(std::env::var("TOKENFORMER_BENCH_DIR").expect("set TOKENFORMER_BENCH_DIR"));
    std::fs::create_dir_all(&dir).unwrap();
    random_model_dir(&dir, &Config::released(12, 768, 12));
}

/// The scoring core on the official-format fixture reproduces PyTorch's
/// per-token log-probs and greedy argmax (expected.json), in one padded batch.
#[test]
fn scorer_matches_official_reference() {
    let files = loader::locate(
        "tests/fixtures/official-lm-tiny/pytorch_model.bin",
        &LocateOptions::default(),
    )
    .unwrap();
    let model = loader::load_lm(&files, &Device::Cpu).unwrap();
    let e: Value = serde_json::from_str(
        &std::fs::read_to_string("tests/fixtures/official-lm-tiny/expected.json").unwrap(),
    )
    .unwrap();
    let ids: Vec<u32> = e["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let lp: Vec<f64> = e["next_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let argmax: Vec<u32> = e["argmax"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let scorer = Scorer::new(&model, None).unwrap().with_greedy(true);
    // Each request scores token k+1.. of a prefix; a short one pads the batch.
    let reqs: Vec<Request> = [5usize, 20, ids.len() - 1, 1]
        .iter()
        .map(|&k| req(&ids[..k], &ids[k..(k + 7).min(ids.len())]))
        .collect();
    let refs: Vec<&Request> = reqs.iter().collect();
    let got = scorer.score_batch(&refs).unwrap();
    for (r, g) in reqs.iter().zip(&got) {
        let k = r.context.len();
        let expect: f64 = lp[k - 1..k - 1 + r.continuation.len()].iter().sum();
        assert!(close(g.logprob, expect, 1e-4), "{} vs {expect}", g.logprob);
        let greedy = (k..k + r.continuation.len()).all(|j| argmax[j - 1] == ids[j]);
        assert_eq!(g.is_greedy, greedy);
    }
    // A continuation equal to the greedy path is greedy.
    let g = scorer
        .score_batch(&[&req(&ids[..10], &[argmax[9]])])
        .unwrap();
    assert!(g[0].is_greedy);
}

// ---------- tasks ----------

fn ex(task: Task, line: &str) -> tasks::Example {
    build_example(task, &serde_json::from_str(line).unwrap(), None).unwrap()
}

fn pairs(e: &tasks::Example) -> Vec<(&str, &str)> {
    e.requests
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect()
}

#[test]
fn task_formats() {
    let e = ex(Task::Lambada, r#"{"text": "He said that it was his  dog"}"#);
    assert_eq!(pairs(&e), [("He said that it was his ", " dog")]);
    let e = ex(Task::Lambada, r#"{"text": "alone"}"#);
    assert_eq!(pairs(&e), [("", " alone")]);

    let hs = r#"{"ind": 4, "activity_label": "Removing ice from car", "ctx_a": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes smiles.", "ctx_b": "then", "ctx": "...", "split": "val", "split_type": "indomain", "endings": [", the man adds wax to the windshield and cuts it.", " [title] A person board skiing [step] The man puts on skis.", "  the man continues removing the snow on his car.  ", "x [header] y [title] z"], "label": "3", "source_id": "s"}"#;
    let e = ex(Task::Hellaswag, hs);
    let q = "Removing ice from car: Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes smiles. Then";
    assert_eq!(e.requests[0].0, q);
    let conts: Vec<&str> = e.requests.iter().map(|r| r.1.as_str()).collect();
    assert_eq!(
        conts,
        [
            " , the man adds wax to the windshield and cuts it.",
            // strip() first, so the leading " [title]" is just removed (Python gives the same).
            "  A person board skiing The man puts on skis.",
            " the man continues removing the snow on his car.",
            " x y. z"
        ]
    );
    assert_eq!(e.choices[1], " A person board skiing The man puts on skis.");
    assert_eq!(e.gold, 3);
    assert_eq!(tasks::py_capitalize("hELLO World"), "Hello world");
    assert_eq!(tasks::py_capitalize("ßa"), "Ssa");
    assert_eq!(tasks::py_capitalize(""), "");

    let e = ex(
        Task::Piqa,
        r#"{"goal": "Make tea", "sol1": "Boil water.", "sol2": "Freeze water.", "label": 0}"#,
    );
    assert_eq!(
        pairs(&e),
        [
            ("Question: Make tea\nAnswer:", " Boil water."),
            ("Question: Make tea\nAnswer:", " Freeze water.")
        ]
    );
    let no_label: Value =
        serde_json::from_str(r#"{"goal": "g", "sol1": "a", "sol2": "b"}"#).unwrap();
    assert!(build_example(Task::Piqa, &no_label, None)
        .unwrap_err()
        .contains("labels file"));
    assert_eq!(
        build_example(Task::Piqa, &no_label, Some("1"))
            .unwrap()
            .gold,
        1
    );

    let orig = r#"{"id": "q1", "question": {"stem": "Which is a gas?", "choices": [{"text": "ice", "label": "A"}, {"text": "steam", "label": "B"}, {"text": "rock", "label": "C"}]}, "answerKey": "B"}"#;
    let hf = r#"{"id": "q1", "question": "Which is a gas?", "choices": {"text": ["ice", "steam", "rock"], "label": ["1", "2", "3"]}, "answerKey": "2"}"#;
    for line in [orig, hf] {
        let e = ex(Task::ArcEasy, line);
        assert_eq!(
            e.requests[1],
            ("Question: Which is a gas?\nAnswer:".into(), " steam".into())
        );
        assert_eq!((e.requests.len(), e.gold), (3, 1));
    }

    let e = ex(
        Task::Winogrande,
        r#"{"qID": "x", "sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.", "option1": "Sarah", "option2": "Maria", "answer": "1"}"#,
    );
    assert_eq!(
        pairs(&e),
        [
            (
                "Sarah was a much better surgeon than Maria so Sarah",
                " always got the harder cases."
            ),
            (
                "Sarah was a much better surgeon than Maria so Maria",
                " always got the harder cases."
            )
        ]
    );
    assert_eq!(e.gold, 0);
    let bad: Value = serde_json::from_str(
        r#"{"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}"#,
    )
    .unwrap();
    assert!(build_example(Task::Winogrande, &bad, None).is_err());
}

#[test]
fn encode_pair_like_harness() {
    let tok = tokenizers::Tokenizer::from_file(TOKENIZER).unwrap();
    // Trailing space of the context moves to the continuation.
    let r = encode_pair(&tok, 0, "He said that it was his ", " dog").unwrap();
    assert_eq!(r.context, encode(&tok, "He said that it was his"));
    let whole = encode(&tok, "He said that it was his  dog");
    assert_eq!(r.continuation, whole[r.context.len()..].to_vec());
    assert_eq!([r.context.clone(), r.continuation.clone()].concat(), whole);
    // Empty context: the prefix token.
    let r = encode_pair(&tok, 0, "", " alone").unwrap();
    assert_eq!(
        (r.context, r.continuation),
        (vec![0], encode(&tok, " alone"))
    );
    // A whitespace-only context counts as empty; its spaces join the continuation.
    let r = encode_pair(&tok, 0, " ", "alone").unwrap();
    assert_eq!(
        (r.context, r.continuation),
        (vec![0], encode(&tok, " alone"))
    );
    // A continuation starting with the prefix token keeps it as context.
    let r = encode_pair(&tok, 0, "", "<|endoftext|>hi").unwrap();
    assert_eq!(r.context, vec![0]);
    assert_eq!(r.continuation, encode(&tok, "hi"));
}

#[test]
fn tasks_score_like_brute_force_and_merge() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let lines = [
        r#"{"goal": "Make tea", "sol1": "Boil water.", "sol2": "Freeze the water now.", "label": 0}"#,
        r#"{"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Sing.", "label": 1}"#,
        r#"{"goal": "Dry hair", "sol1": "Use a towel.", "sol2": "Use a cup of water.", "label": "0"}"#,
    ];
    let data = dir.path().join("piqa.jsonl");
    std::fs::write(&data, lines.join("\n")).unwrap();
    let scorer = Scorer::new(&f.model, None).unwrap();
    let o = task_opts(3);
    let counts = tasks::evaluate(&scorer, &f.tok, Task::Piqa, &data, None, &o, |_, _| {}).unwrap();
    let (mut acc, mut acc_norm) = (0, 0);
    for l in &lines {
        let e = ex(Task::Piqa, l);
        let lls: Vec<f64> = e
            .requests
            .iter()
            .map(|(c, x)| {
                let r = encode_pair(&f.tok, 0, c, x).unwrap();
                let all = [r.context.clone(), r.continuation.clone()].concat();
                // The harness's left truncation: the input is the last L+1 tokens minus one.
                let first = all.len().saturating_sub(MAX_POS + 1);
                (all.len() - r.continuation.len()..all.len())
                    .map(|j| brute(&f.model, &all[first..j], all[j]))
                    .sum()
            })
            .collect();
        let best = |v: &[f64]| (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b });
        acc += (best(&lls) == e.gold) as u64;
        let norm: Vec<f64> = lls
            .iter()
            .zip(&e.choices)
            .map(|(l, c)| l / c.chars().count() as f64)
            .collect();
        acc_norm += (best(&norm) == e.gold) as u64;
    }
    assert_eq!(
        (counts.documents, counts.correct, counts.correct_norm),
        (3, acc, acc_norm)
    );
    // The harness's mean_stderr of [1, 1, 0]: sample std / sqrt(n).
    let (mu, xs) = (2.0 / 3.0, [1.0, 1.0, 0.0f64]);
    let sample_std = (xs.iter().map(|x| (x - mu) * (x - mu)).sum::<f64>() / 2.0).sqrt();
    assert!(close(
        tasks::acc_stderr(2, 3).unwrap(),
        sample_std / 3f64.sqrt(),
        1e-12
    ));

    // Lambada: greedy + loglikelihood; shards merge to the whole.
    let lam = dir.path().join("lambada.jsonl");
    std::fs::write(&lam, "{\"text\": \"the cat sat on the mat\"}\n{\"text\": \"a dog ran to the house\"}\n{\"text\": \"night\"}\n").unwrap();
    let greedy = Scorer::new(&f.model, None).unwrap().with_greedy(true);
    let whole = tasks::evaluate(&greedy, &f.tok, Task::Lambada, &lam, None, &o, |_, _| {}).unwrap();
    let r = encode_pair(&f.tok, 0, "the cat sat on the", " mat").unwrap();
    let all = [r.context.clone(), r.continuation.clone()].concat();
    let ll0: f64 = (r.context.len()..all.len())
        .map(|j| brute(&f.model, &all[..j], all[j]))
        .sum();
    let first = tasks::evaluate(
        &greedy,
        &f.tok,
        Task::Lambada,
        &lam,
        None,
        &TaskOptions {
            limit: Some(1),
            ..o.clone()
        },
        |_, _| {},
    )
    .unwrap();
    assert!(close(first.loglikelihood, ll0, 1e-4));
    let mut reports = Vec::new();
    for i in 0..2 {
        let so = TaskOptions {
            shard: Shard { index: i, count: 2 },
            ..o.clone()
        };
        let c =
            tasks::evaluate(&greedy, &f.tok, Task::Lambada, &lam, None, &so, |_, _| {}).unwrap();
        // Each shard on its own GPU, as the README's `--shard I/N --device cuda:I`.
        let info = RunInfo {
            device: format!("cuda:{i}"),
            ..run_info(1.0)
        };
        reports.push(task_shard(info, Task::Lambada, &o, i, c));
    }
    let merged = merge_results(&reports).unwrap();
    assert_eq!(merged["device"], "cuda:0,cuda:1");
    assert_eq!(merged["config"]["device"], "cuda:0,cuda:1");
    // A shard written before the device was recorded: the merge does not say one.
    let mut old = reports.clone();
    old[1].as_object_mut().unwrap().remove("device");
    assert_eq!(merge_results(&old).unwrap()["device"], Value::Null);
    assert_eq!(merged["documents"], json!(3));
    assert_eq!(merged["correct"], json!(whole.correct));
    let ppl = (-whole.loglikelihood / 3.0).exp();
    let got = merged["perplexity"].as_f64().unwrap();
    // The shards batch the documents differently from the whole run, and a
    // batch of a few tokens takes the decoding kernels instead of gemm: the
    // same sums in another order, a few ulps apart.
    assert!(close(got, ppl, 1e-5), "{got} vs {ppl}");
}

// ---------- the command line ----------

fn cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tokenformer"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn cli_pile_json_shards_merge_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    tiny_model_dir(&model);
    let data = dir.path().join("docs.jsonl");
    write_jsonl(&data, &documents());
    let (m, d) = (model.to_str().unwrap(), data.to_str().unwrap());
    let out_path = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let whole = out_path("whole.json");
    let o = cli(&[
        "eval",
        "pile",
        "--model",
        m,
        "--data",
        d,
        "--json",
        &whole,
        "--batch-size",
        "3",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let w: Value = serde_json::from_str(&std::fs::read_to_string(&whole).unwrap()).unwrap();
    for k in [
        "kind",
        "model",
        "data_sha256",
        "method",
        "loglikelihood",
        "documents",
        "tokens",
        "words",
        "bytes",
        "word_perplexity",
        "byte_perplexity",
        "bits_per_byte",
        "token_perplexity",
        "subsets",
        "elapsed_seconds",
        "tokens_per_second",
    ] {
        assert!(w.get(k).is_some(), "missing {k}");
    }
    assert_eq!(w["kind"], "pile");
    assert_eq!(w["data_sha256"].as_str().unwrap().len(), 64);
    assert!(w["subsets"]["doc05"]["word_perplexity"].as_f64().unwrap() > 0.0);

    let mut shards = Vec::new();
    for i in 0..2 {
        let p = out_path(&format!("s{i}.json"));
        let s = format!("{i}/2");
        let o = cli(&[
            "eval", "pile", "--model", m, "--data", d, "--shard", &s, "--json", &p,
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        shards.push(p);
    }
    let merged = out_path("merged.json");
    let o = cli(&["eval", "merge", &shards[0], &shards[1], "--json", &merged]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mg: Value = serde_json::from_str(&std::fs::read_to_string(&merged).unwrap()).unwrap();
    for k in ["documents", "tokens", "words", "bytes"] {
        assert_eq!(mg[k], w[k], "{k}");
    }
    for k in [
        "loglikelihood",
        "word_perplexity",
        "byte_perplexity",
        "bits_per_byte",
    ] {
        assert!(
            close(mg[k].as_f64().unwrap(), w[k].as_f64().unwrap(), 1e-7),
            "{k}"
        );
    }
    let subsets = |v: &Value| {
        v["subsets"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(subsets(&mg), subsets(&w));

    // Bad input: non-zero exit, the line named.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"a\"}\nnot json\n").unwrap();
    let o = cli(&[
        "eval",
        "pile",
        "--model",
        m,
        "--data",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("line 2"));

    // Tasks: --help names the fields.
    let o = cli(&["eval", "tasks", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(
        help.contains("activity_label") && help.contains("answerKey") && help.contains("option1")
    );
}

/// The library's errors name its options; the command line names its flags
/// in their place, in the same words as before.
#[test]
fn errors_name_options_in_the_library_and_flags_on_the_command_line() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    tiny_model_dir(&model);
    let long = dir.path().join("long.jsonl");
    std::fs::write(&long, with_long_line(3000)).unwrap();
    let limited = PileOptions {
        max_line_bytes: 1000,
        ..opts(Method::Rolling, 2)
    };
    // The long line's bytes with its newline.
    let n = with_long_line(3000).lines().nth(1).unwrap().len() + 1;
    let e = run(&f, &long, &limited).unwrap_err().to_string();
    assert!(
        e.ends_with(&format!(
            "line 2: line of {n} bytes, longer than the limit of 1000 bytes \
             (the max_line_bytes option) (set skip_bad to skip and count bad lines)"
        )),
        "{e}"
    );
    assert!(!e.contains("--"), "{e}");
    let (m, d) = (model.to_str().unwrap(), long.to_str().unwrap());
    for cmd in [
        vec!["eval", "pile", "--model", m, "--data", d],
        vec![
            "eval", "tasks", "--model", m, "--task", "lambada", "--data", d,
        ],
    ] {
        let o = cli(&[cmd.as_slice(), &["--max-line-bytes", "1000"]].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!(
                "line 2: line of {n} bytes, longer than the limit of 1000 bytes (--max-line-bytes)"
            )) && err
                .trim_end()
                .ends_with("(pass --skip-bad to skip and count bad lines)")
                && !err.contains("max_line_bytes option")
                && !err.contains("set skip_bad"),
            "{err}"
        );
    }
}

// ---------- hardening: long lines, NaN models, merging untrusted results ----------

/// A lambada-style file of three lines whose middle one is `long` bytes of text.
fn with_long_line(long: usize) -> String {
    let good = r#"{"text": "the cat sat on the mat"}"#;
    let body = "ab ".repeat(long / 3);
    format!("{good}\n{{\"text\": \"{body}\"}}\n{good}\n")
}

#[test]
fn long_lines_are_named_or_skipped_and_counted() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let text = with_long_line(3000);
    let plain = dir.path().join("long.jsonl");
    std::fs::write(&plain, &text).unwrap();
    let zst = dir.path().join("long.jsonl.zst");
    std::fs::write(&zst, zstd::encode_all(text.as_bytes(), 3).unwrap()).unwrap();
    let limited = PileOptions {
        max_line_bytes: 1000,
        ..opts(Method::Rolling, 2)
    };
    for p in [&plain, &zst] {
        let name = p.file_name().unwrap().to_str().unwrap();
        let e = run(&f, p, &limited).unwrap_err().to_string();
        assert!(
            e.contains(name) && e.contains("line 2") && e.contains("limit of 1000 bytes"),
            "{e}"
        );
        let skipped = run(
            &f,
            p,
            &PileOptions {
                skip_bad: true,
                ..limited.clone()
            },
        )
        .unwrap();
        assert_eq!(
            (skipped.skipped_lines, skipped.overall.documents),
            (1, 2),
            "{name}"
        );
        // Under the default limit the line is an ordinary document.
        let all = run(&f, p, &opts(Method::Rolling, 2)).unwrap();
        assert_eq!((all.skipped_lines, all.overall.documents), (0, 3));
    }
    // The limit is on the line's bytes without its newline: exactly at it passes.
    let good = r#"{"text": "hello world"}"#;
    let exact = dir.path().join("exact.jsonl");
    std::fs::write(&exact, format!("{good}\n{good}")).unwrap();
    let at = |n: usize| {
        run(
            &f,
            &exact,
            &PileOptions {
                max_line_bytes: n,
                ..opts(Method::Rolling, 2)
            },
        )
    };
    assert_eq!(at(good.len()).unwrap().overall.documents, 2);
    assert!(at(good.len() - 1)
        .unwrap_err()
        .to_string()
        .contains("line 1"));
    // A .txt is one document: longer than the limit is an error.
    let txt = dir.path().join("doc.txt");
    std::fs::write(&txt, "word ".repeat(400)).unwrap();
    let e = run(&f, &txt, &limited).unwrap_err().to_string();
    assert!(e.contains("doc.txt") && e.contains("limit of 1000"), "{e}");

    // Tasks read lines the same way.
    let lam = dir.path().join("lambada.jsonl");
    std::fs::write(&lam, with_long_line(3000)).unwrap();
    let scorer = Scorer::new(&f.model, None).unwrap().with_greedy(true);
    let o = TaskOptions {
        max_line_bytes: 1000,
        ..task_opts(4)
    };
    let e = tasks::evaluate(&scorer, &f.tok, Task::Lambada, &lam, None, &o, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 2") && e.contains("limit of 1000"), "{e}");
    let c = tasks::evaluate(
        &scorer,
        &f.tok,
        Task::Lambada,
        &lam,
        None,
        &TaskOptions {
            skip_bad: true,
            ..o
        },
        |_, _| {},
    )
    .unwrap();
    assert_eq!((c.documents, c.skipped_lines), (2, 1));
}

#[cfg(unix)]
#[test]
fn a_fifo_as_data_is_refused_without_blocking() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("data.jsonl");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // Opening a FIFO for reading would block until a writer appears.
    let e = run(&f, &fifo, &opts(Method::Rolling, 2))
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.jsonl") && e.contains("FIFO"), "{e}");
    assert!(pile::sha256_file(&fifo).is_err());
}

#[test]
fn a_nan_model_is_an_error_naming_the_document() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("nan");
    std::fs::create_dir(&model_dir).unwrap();
    nan_model_dir(&model_dir);
    let (model, tok) = load_model(&model_dir);

    let data = dir.path().join("docs.jsonl");
    write_jsonl(&data, &["the cat sat".to_string(), "a dog ran".to_string()]);
    let scorer = Scorer::new(&model, None).unwrap();
    let e = pile::evaluate(&scorer, &tok, &data, &opts(Method::Rolling, 2), |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("docs.jsonl line 1") && e.contains("non-finite"),
        "{e}"
    );

    let piqa = dir.path().join("piqa.jsonl");
    std::fs::write(
        &piqa,
        "{\"goal\": \"Make tea\", \"sol1\": \"Boil water.\", \"sol2\": \"Freeze it.\", \"label\": 0}\n",
    )
    .unwrap();
    let o = task_opts(2);
    let e = tasks::evaluate(&scorer, &tok, Task::Piqa, &piqa, None, &o, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("piqa.jsonl line 1") && e.contains("non-finite"),
        "{e}"
    );
    let e = tokenformer::scoring::score_ids(&model, &[1, 2, 3])
        .unwrap_err()
        .to_string();
    assert!(e.contains("token 1") && e.contains("non-finite"), "{e}");

    // The commands fail cleanly and name the document.
    let m = model_dir.to_str().unwrap();
    for args in [
        vec![
            "eval",
            "pile",
            "--model",
            m,
            "--data",
            data.to_str().unwrap(),
        ],
        vec![
            "eval",
            "tasks",
            "--model",
            m,
            "--task",
            "piqa",
            "--data",
            piqa.to_str().unwrap(),
        ],
    ] {
        let o = cli(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains("line 1") && err.contains("non-finite") && !err.contains("panicked"),
            "{err}"
        );
    }
    let text = dir.path().join("prompt.txt");
    std::fs::write(&text, "the cat sat on the mat").unwrap();
    let o = cli(&["score", "--model", m, "--file", text.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("prompt.txt") && err.contains("non-finite"),
        "{err}"
    );
}

/// Two task shards of one run, as JSON.
fn task_shards() -> Vec<Value> {
    (0..2usize)
        .map(|i| {
            let info = hub_run_info("piqa.jsonl", "a", "d", "f32", 1.0);
            let counts = TaskCounts {
                documents: 10,
                correct: 6 + i as u64,
                correct_norm: 5,
                loglikelihood: 0.0,
                skipped_lines: 0,
            };
            let o = TaskOptions {
                max_line_bytes: 1000,
                ..task_opts(3)
            };
            let mut v = task_shard(info, Task::Piqa, &o, i, counts);
            v["labels"] = json!("valid-labels.lst");
            v["labels_sha256"] = json!("1".repeat(64));
            v
        })
        .collect()
}

/// Two Pile shards of one run, as JSON.
fn pile_shards() -> Vec<Value> {
    (0..2)
        .map(|i| {
            let o = PileOptions {
                shard: Shard { index: i, count: 2 },
                ..opts(Method::Strided { stride: 8 }, 2)
            };
            let totals = PileTotals {
                overall: pile::Counts {
                    loglikelihood: -100.0,
                    documents: 4,
                    tokens: 40,
                    words: 30,
                    bytes: 150,
                },
                subsets: [(
                    "Pile-CC".to_string(),
                    pile::Counts {
                        loglikelihood: -50.0,
                        documents: 2,
                        tokens: 20,
                        words: 15,
                        bytes: 75,
                    },
                )]
                .into(),
                skipped_lines: 0,
            };
            let info = hub_run_info("val.jsonl.zst", "b", "e", "f16", 2.0);
            serde_json::to_value(PileReport::new(info, &o, &totals)).unwrap()
        })
        .collect()
}

/// Merging `parts` fails with a message containing `needle`.
fn refused(parts: &[Value], needle: &str) {
    match merge_results(parts) {
        Ok(_) => panic!("merge accepted shards that should be refused ({needle})"),
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains(needle), "expected {needle:?} in: {e}");
        }
    }
}

/// `parts` with `edit` applied to the second one.
fn edited(parts: &[Value], edit: impl FnOnce(&mut Value)) -> Vec<Value> {
    let mut v = parts.to_vec();
    edit(&mut v[1]);
    v
}

#[test]
fn merge_refuses_shards_of_different_runs() {
    let t = task_shards();
    let merged = merge_results(&t).unwrap();
    assert_eq!(
        (merged["documents"].clone(), merged["correct"].clone()),
        (json!(20), json!(13))
    );
    assert_eq!(merged["model_commit"], json!("a".repeat(40)));
    for (key, value, needle) in [
        ("model_commit", json!("c".repeat(40)), "model commit"),
        ("model_commit", Value::Null, "model commit"),
        ("labels_sha256", json!("2".repeat(64)), "labels file sha256"),
        ("data_sha256", json!("f".repeat(64)), "data_sha256"),
        ("weight_dtype", json!("f16"), "weight dtype"),
        ("task", json!("arc_easy"), "task"),
        ("max_length", json!(8), "max_length"),
        ("max_line_bytes", json!(2000), "max_line_bytes"),
        ("model", json!("acme/other@main"), "model"),
    ] {
        refused(&edited(&t, |v| v[key] = value.clone()), needle);
    }
    let p = pile_shards();
    assert_eq!(merge_results(&p).unwrap()["documents"], json!(8));
    for (key, value, needle) in [
        ("stride", json!(4), "stride"),
        ("method", json!("rolling"), "method"),
        ("model_commit", json!("c".repeat(40)), "model commit"),
        ("weight_dtype", json!("f32"), "weight dtype"),
        ("data_sha256", json!("0".repeat(64)), "data_sha256"),
    ] {
        refused(&edited(&p, |v| v[key] = value.clone()), needle);
    }
}

#[test]
fn merge_refuses_impossible_counts_and_shard_ids() {
    let t = task_shards();
    for (key, value, needle) in [
        ("correct", json!(11), "impossible"),
        ("correct_norm", json!(11), "impossible"),
        ("correct", json!(-1), "not a valid result"),
        ("documents", json!(2.5), "not a valid result"),
        ("documents", json!("10"), "not a valid result"),
        ("loglikelihood", json!(3.0), "impossible"),
        ("elapsed_seconds", json!(-1.0), "impossible"),
    ] {
        refused(&edited(&t, |v| v[key] = value.clone()), needle);
    }
    let p = pile_shards();
    for (edit, needle) in [
        (json!({"words": 1}), "words"),
        (json!({"loglikelihood": 5.0}), "impossible"),
        (json!({"tokens": 0}), "0 tokens"),
        (json!({"tokens": -3}), "not a valid result"),
    ] {
        refused(
            &edited(&p, |v| {
                for (k, x) in edit.as_object().unwrap() {
                    v[k] = x.clone();
                }
            }),
            needle,
        );
    }
    // A subset larger than the whole.
    refused(
        &edited(&p, |v| v["subsets"]["Pile-CC"]["documents"] = json!(9)),
        "subsets",
    );
    // Shard ids: malformed, out of range, repeated, missing, absurd N.
    for (shards, needle) in [
        (["0/2", "2/2"], "shard `2/2`"),
        (["0/2", "x/2"], "shard `x/2`"),
        (["0/2", "1/0"], "shard `1/0`"),
        (["0/2", "0/2"], "appears twice"),
        (["0/2", "1/3"], "different shard counts"),
        (["0/3", "1/3"], "missing 2/3"),
        (
            ["0/18446744073709551615", "1/18446744073709551615"],
            "2 of 18446744073709551615 shards",
        ),
    ] {
        let mut v = t.clone();
        v[0]["shard"] = json!(shards[0]);
        v[1]["shard"] = json!(shards[1]);
        refused(&v, needle);
    }
    refused(
        &edited(&t, |v| v["shard"] = Value::Null),
        "not from a sharded run",
    );
}

#[test]
fn imagenet_merge_refuses_mismatches_and_impossible_counts() {
    let shard = |i: usize| {
        json!({
            "kind": "imagenet", "model": "acme/vit@main", "model_commit": "a".repeat(40),
            "data": "val", "data_sha256": "d".repeat(64), "label_source": "x",
            "labels_sha256": "1".repeat(64), "max_image_pixels": 50_000_000u64,
            "images": 10, "correct_top1": 4, "correct_top5": 7, "top1": 40.0, "top5": 70.0,
            "unreadable": 1, "unreadable_files": [format!("val/n1/{i}.JPEG")],
            "seconds": 1.0, "images_per_second": 10.0, "batch_size": 32,
            "shard": format!("{i}/2")
        })
    };
    let good = vec![shard(0), shard(1)];
    let m = merge_results(&good).unwrap();
    assert_eq!(
        (
            m["images"].clone(),
            m["correct_top5"].clone(),
            m["unreadable"].clone()
        ),
        (json!(20), json!(14), json!(2))
    );
    for (key, value, needle) in [
        ("labels_sha256", json!("2".repeat(64)), "labels file sha256"),
        ("model_commit", json!("c".repeat(40)), "model commit"),
        ("data_sha256", json!("0".repeat(64)), "data listing"),
        ("max_image_pixels", json!(1000), "pixel limit"),
        ("correct_top1", json!(8), "impossible"),
        ("correct_top5", json!(11), "impossible"),
        ("unreadable", json!(5), "impossible"),
        (
            "images",
            json!(-1),
            "not a `tokenformer eval imagenet` result",
        ),
        ("shard", json!("2/2"), "shard `2/2`"),
        ("shard", json!("0/2"), "appears twice"),
        ("shard", json!("1/3"), "different shard counts"),
    ] {
        refused(&edited(&good, |v| v[key] = value.clone()), needle);
    }
    refused(&good[..1], "1 of 2 shards");
}

/// ImageNet progress and unreadable images reach the caller through the
/// callback, once per batch; the command line prints the warnings.
#[test]
fn imagenet_progress_and_unreadable_images_go_through_the_callback() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vit-tiny-imagenet");
    let vit = tiny.join("vit-tiny");
    let files = loader::locate(vit.to_str().unwrap(), &LocateOptions::default()).unwrap();
    let model = loader::load_vit(&files, &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let class = dir.path().join("n01443537");
    std::fs::create_dir(&class).unwrap();
    std::fs::copy(tiny.join("val/n01443537/a.JPEG"), class.join("a.JPEG")).unwrap();
    std::fs::write(class.join("empty.JPEG"), b"").unwrap();
    let opts = imagenet::Options {
        batch_size: 1,
        ..Default::default()
    };
    let mut seen = Vec::new();
    let r =
        imagenet::evaluate_with(&model, "m", dir.path(), &opts, |p| seen.push(p.clone())).unwrap();
    assert_eq!((r.images, r.unreadable), (1, 1));
    let done: Vec<(u64, u64)> = seen.iter().map(|p| (p.done, p.total)).collect();
    assert_eq!(done, [(1, 2), (2, 2)]);
    let unreadable: Vec<&String> = seen.iter().flat_map(|p| &p.unreadable).collect();
    assert_eq!(unreadable.len(), 1);
    assert!(unreadable[0].contains("empty.JPEG"), "{unreadable:?}");
    let last = seen.last().unwrap();
    assert_eq!((last.images, last.correct_top1), (1, r.correct_top1));

    let o = cli(&[
        "eval",
        "imagenet",
        "--quiet",
        "--model",
        vit.to_str().unwrap(),
        "--data",
        dir.path().to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let warnings: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("warning: unreadable image, counted and skipped: "))
        .collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(warnings[0].contains("empty.JPEG"), "{err}");
}
