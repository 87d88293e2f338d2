//! Training a grown model: `--train new` moves only the appended parameter tokens,
//! growth in the middle of a run keeps the function and the old tokens' AdamW moments,
//! and resuming a checkpoint grown since equals growing inside the run.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::tiny_config;
use tokenformer::checkpoint::{self, Tensors};
use tokenformer::grow::{grow_tensors, grown_lm_config, GrowInit};
use tokenformer::loader::{self, LocateOptions};
use tokenformer::models::tokenformer::{Config, ScaleTokens};
use tokenformer::train::trainer::TrainOptions;
use tokenformer::train::{lm::init_tensors, LmTrainer, Split, TokenWindows, TrainableLm};

const TOKENIZER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/gpt-neox-20b-tokenizer.json"
);
const TEXT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/train-text.txt");

fn config() -> Config {
    let mut c = tiny_config(50304, 64);
    c.hidden_size = 32;
    c.num_heads = 2;
    c
}

fn counts(c: &Config) -> ScaleTokens {
    ScaleTokens {
        qkv: c.qkv_tokens,
        proj: c.proj_tokens,
        ffn: c.ffn_tokens,
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn weights(dir: &Path) -> Tensors {
    let files = loader::locate(dir.to_str().unwrap(), &LocateOptions::default()).unwrap();
    loader::read_weights(&files, None, &Device::Cpu)
        .unwrap()
        .tensors
}

/// Writes a model folder of `cfg` and `tensors`.
fn write_model(dir: &Path, cfg: &Config, tensors: &Tensors) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string(cfg).unwrap()).unwrap();
    checkpoint::write_safetensors(dir, tensors, checkpoint::DEFAULT_SHARD_BYTES).unwrap();
}

/// `cfg`/`tensors` grown to `target` as `tokenformer-convert grow` does (zero keys).
fn grown(cfg: &Config, tensors: Tensors, target: &ScaleTokens, seed: u64) -> (Config, Tensors) {
    let init = GrowInit {
        seed,
        ..GrowInit::default()
    };
    let (t, _) = grow_tensors(tensors, &counts(cfg), target, &init).unwrap();
    (grown_lm_config(cfg, target).unwrap(), t)
}

fn train(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_tokenformer"));
    c.arg("train").args(args).env("HF_HUB_OFFLINE", "1");
    c.args([
        "--data",
        TEXT,
        "--tokenizer",
        TOKENIZER,
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "2",
        "--seed",
        "3",
    ]);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn ok(o: &std::process::Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn train_new_moves_only_the_appended_tokens_and_refuses_an_ungrown_model() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config();
    let start = init_tensors(&cfg, 5, &Device::Cpu).unwrap();
    let target = ScaleTokens {
        qkv: 28,
        proj: 20,
        ffn: 56,
    };
    let (gcfg, gt) = grown(&cfg, start.clone(), &target, 1);
    assert_eq!(gcfg.grown_from_tokens, Some(counts(&cfg)));
    let model = tmp.path().join("grown");
    write_model(&model, &gcfg, &gt);
    let out = tmp.path().join("run");
    let args = ["--model", s(&model), "--out", s(&out), "--steps", "3"];
    ok(&train(&[&args[..], &["--train", "new"]].concat(), &[]));
    let end = weights(&out.join("checkpoint-000003"));
    let mut moved = 0;
    for (name, t) in &gt {
        let after = &end[name];
        assert_eq!(t.dims(), after.dims(), "{name}");
        // proj did not grow: nothing of it is new.
        let old_rows = if name.contains(".mlp.") {
            48
        } else if name.contains(".attention.") && !name.contains(".proj.") {
            24
        } else {
            t.dim(0).unwrap()
        };
        let n = t.dim(0).unwrap();
        let rows = |x: &Tensor, a: usize, len: usize| bits(&x.narrow(0, a, len).unwrap());
        assert_eq!(rows(t, 0, old_rows), rows(after, 0, old_rows), "{name}");
        if old_rows < n {
            let (b, a) = (
                rows(t, old_rows, n - old_rows),
                rows(after, old_rows, n - old_rows),
            );
            assert!(b.iter().zip(&a).all(|(x, y)| x != y), "{name}: new rows");
            moved += 1;
        }
    }
    // q, k, v and mlp keys and values in two layers.
    assert_eq!(moved, 2 * 4 * 2);

    let plain = tmp.path().join("plain");
    write_model(&plain, &cfg, &start);
    let out2 = tmp.path().join("run2");
    let o = train(
        &[
            "--model",
            s(&plain),
            "--out",
            s(&out2),
            "--steps",
            "1",
            "--train",
            "new",
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("grown_from_tokens"),
        "{err}"
    );
}

#[test]
fn growth_in_a_run_keeps_the_function_and_the_old_moments() {
    let cfg = config();
    let dev = Device::Cpu;
    let tensors = init_tensors(&cfg, 5, &dev).unwrap();
    let model = TrainableLm::new(&cfg, &tensors, DType::F32, &dev).unwrap();
    let tokenizer = tokenizers::Tokenizer::from_file(TOKENIZER).unwrap();
    let data = TokenWindows::new(
        vec![PathBuf::from(TEXT)],
        tokenizer.clone(),
        0,
        16,
        Split::All,
    )
    .unwrap();
    let opts = TrainOptions {
        steps: 10,
        batch_size: 2,
        grad_accum: 1,
        seq_len: 16,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 0,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        clip_grad: 1.0,
        seed: 1,
        train: vec!["*".into()],
        grow_at: vec![],
        augment: Default::default(),
    };
    let mut t = LmTrainer::new(model, data, opts, None).unwrap();
    t.step().unwrap();
    t.step().unwrap();
    let mut val =
        TokenWindows::new(vec![PathBuf::from(TEXT)], tokenizer, 0, 16, Split::All).unwrap();
    let windows: Vec<Vec<u32>> = (0..4).map(|_| val.next_window().unwrap()).collect();
    let before = t.evaluate(&windows, 2).unwrap();
    let moments = t.optimizer().moments().clone();
    let target = ScaleTokens {
        qkv: 30,
        proj: 26,
        ffn: 60,
    };
    t.grow(&target, &GrowInit::default()).unwrap();
    let after = t.evaluate(&windows, 2).unwrap();
    assert!(
        (after - before).abs() <= 1e-6 * before,
        "loss {before} before growth, {after} after"
    );
    assert_eq!(t.model().config().ffn_tokens, 60);
    assert_eq!(t.optimizer().step_count(), 2);
    for (name, m) in &moments {
        let now = &t.optimizer().moments()[name];
        let n = m.m.dim(0).unwrap();
        for (old, new) in [(&m.m, &now.m), (&m.v, &now.v)] {
            assert_eq!(bits(old), bits(&new.narrow(0, 0, n).unwrap()), "{name}");
            let extra = new.dim(0).unwrap() - n;
            if extra > 0 {
                assert!(bits(&new.narrow(0, n, extra).unwrap())
                    .iter()
                    .all(|&b| b == 0));
            }
        }
        // The old tokens had moved: their moments are not zero.
        assert!(bits(&m.v).iter().any(|&b| b != 0), "{name}");
    }
    // The run goes on with the grown model.
    let r = t.step().unwrap();
    assert!(r.loss.is_finite() && r.step == 3);
}

#[test]
fn resuming_a_checkpoint_grown_since_equals_growing_in_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let init = tmp.path().join("init.json");
    std::fs::write(&init, serde_json::to_string(&config()).unwrap()).unwrap();
    let (a, b, b2) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("b2"),
    );
    let common = ["--init", s(&init), "--steps", "6", "--save-every", "3"];
    let spec = "qkv=28,ffn=56";
    ok(&train(
        &[
            &common[..],
            &["--out", s(&a), "--grow-at", &format!("3:{spec}")],
        ]
        .concat(),
        &[],
    ));
    let o = train(
        &[&common[..], &["--out", s(&b)]].concat(),
        &[("TOKENFORMER_TRAIN_ABORT_AFTER_STEP", "3")],
    );
    assert_eq!(o.status.code(), Some(137));
    // Grow the step-3 checkpoint as the run grows (its seed: run seed ^ step).
    let ckpt = b.join("checkpoint-000003");
    let files = loader::locate(s(&ckpt), &LocateOptions::default()).unwrap();
    let w = loader::read_weights(&files, None, &Device::Cpu).unwrap();
    let cfg = loader::lm_config(&w.config, &w.config_path).unwrap();
    let target = tokenformer::grow::parse_target(spec, &counts(&cfg)).unwrap();
    let (gcfg, gt) = grown(&cfg, w.tensors, &target, 3 ^ 3);
    let g = tmp.path().join("grown");
    write_model(&g, &gcfg, &gt);
    ok(&train(
        &["--resume", s(&ckpt), "--model", s(&g), "--out", s(&b2)],
        &[],
    ));
    let (wa, wb) = (
        weights(&a.join("checkpoint-000006")),
        weights(&b2.join("checkpoint-000006")),
    );
    assert_eq!(wa["layers.0.mlp.key_param_tokens"].dims(), &[56, 32]);
    for (name, t) in &wa {
        assert_eq!(bits(t), bits(&wb[name]), "{name}");
    }
    let opt = |d: &Path| {
        checkpoint::read_safetensors(
            &[d.join("checkpoint-000006/optimizer.safetensors")],
            Some(DType::F32),
            &Device::Cpu,
        )
        .unwrap()
    };
    let (oa, ob) = (opt(&a), opt(&b2));
    for (name, t) in &oa {
        assert_eq!(bits(t), bits(&ob[name]), "{name}");
    }
    // Training FLOPs count each step at the size it trained, across the growth
    // and across the resume: 6 per weight of every product (five Pattentions a
    // layer with keys and values, the tied head) plus the causal attention.
    let fpt = |c: &Config| {
        let (d, l) = (c.hidden_size as f64, c.num_layers as f64);
        let tokens = (3 * c.qkv_tokens + c.proj_tokens + c.ffn_tokens) as f64;
        6.0 * (2.0 * tokens * d * l + c.vocab_size as f64 * d) + 6.0 * l * 16.0 * d
    };
    let flops = |d: &Path| -> Vec<f64> {
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter_map(|v| v["flops"].as_f64())
            .collect()
    };
    let per_step = 2.0 * 16.0;
    let want = 3.0 * per_step * (fpt(&cfg) + fpt(&gcfg));
    let (fa, fb) = (flops(&a), flops(&b2));
    assert_eq!(fa.len(), 6);
    assert!((fa[5] - want).abs() <= 1e-9 * want, "{} vs {want}", fa[5]);
    assert!((fa[2] - 3.0 * per_step * fpt(&cfg)).abs() <= 1e-9 * want);
    assert_eq!(
        fb.last(),
        fa.last(),
        "the resumed run counts the same FLOPs"
    );
}
