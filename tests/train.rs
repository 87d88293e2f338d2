//! The training path against PyTorch autograd (tests/fixtures/official-lm-tiny/
//! train_step.json: one AdamW step of the official model on the fixture), against the
//! inference forward, and each Θ variant's gradient against central finite differences.

mod common;

use candle_core::{DType, Device, Tensor};
use common::train::{
    assert_resume_equals_uninterrupted, bits, metrics, ok, tokenformer_train, weights,
};
use common::{lm_fixture, random_lm_tensors, tiny_config};
use serde_json::Value;
use tokenformer::loader::{self, LocateOptions};
use tokenformer::models::tokenformer::{Config, ScaleTokens};
use tokenformer::pattention::Activation;
use tokenformer::train::{LrSchedule, TrainableLm};

fn fixture() -> (Config, tokenformer::checkpoint::Tensors) {
    let files = loader::locate(
        lm_fixture().join("pytorch_model.bin").to_str().unwrap(),
        &LocateOptions::default(),
    )
    .unwrap();
    let w = loader::read_weights(&files, Some(DType::F32), &Device::Cpu).unwrap();
    (loader::lm_config(&w.config, &w.path).unwrap(), w.tensors)
}

fn expected(file: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(lm_fixture().join(file)).unwrap()).unwrap()
}

fn fixture_ids() -> Tensor {
    let ids: Vec<u32> = expected("expected.json")["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let n = ids.len();
    Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap()
}

#[test]
fn one_training_step_matches_pytorch_autograd_and_adamw() {
    common::steps::lm_step_matches_pytorch(&Device::Cpu);
}

#[test]
fn the_training_forward_computes_the_inference_forward() {
    let (cfg, tensors) = fixture();
    let ids = fixture_ids();
    let train = TrainableLm::new(&cfg, &tensors, DType::F32, &Device::Cpu).unwrap();
    let vb = tokenformer::checkpoint::var_builder(tensors, &Device::Cpu);
    let infer = tokenformer::models::tokenformer::TokenFormerLm::new(&cfg, vb).unwrap();
    let a = train.forward(&ids).unwrap();
    let b = infer.forward(&ids, None).unwrap();
    let diff = common::max_abs_diff(&a, &b);
    assert!(diff < 2e-4, "max |Δ logit| {diff}");
}

#[test]
fn the_training_forward_supports_the_parallel_residual() {
    let (mut cfg, tensors) = fixture();
    let ids = fixture_ids();
    let seq = TrainableLm::new(&cfg, &tensors, DType::F32, &Device::Cpu)
        .unwrap()
        .forward(&ids)
        .unwrap();
    cfg.parallel_residual = true;
    let train = TrainableLm::new(&cfg, &tensors, DType::F32, &Device::Cpu).unwrap();
    let vb = tokenformer::checkpoint::var_builder(tensors, &Device::Cpu);
    let infer = tokenformer::models::tokenformer::TokenFormerLm::new(&cfg, vb).unwrap();
    let a = train.forward(&ids).unwrap();
    let b = infer.forward(&ids, None).unwrap();
    let max_abs = |t: Tensor| {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let diff = max_abs((&a - b).unwrap());
    assert!(diff < 2e-4, "max |Δ logit| {diff}");
    // The block structure really changed (the MLP no longer sees the attention output).
    assert!(max_abs((a - seq).unwrap()) > 1e-2);
}

/// d loss / d θ by central differences in f64, against autograd, for a few entries of
/// every tensor of a small model.
fn check_gradients(cfg: &Config, seed: u64) {
    let tensors = random_lm_tensors(cfg, seed);
    let dev = Device::Cpu;
    let ids = Tensor::new(&[[1u32, 5, 9, 3, 7, 2, 11, 4]], &dev).unwrap();
    let model = TrainableLm::new(cfg, &tensors, DType::F64, &dev).unwrap();
    let grads = model.loss(&ids).unwrap().backward().unwrap();
    let loss_at = |name: &str, idx: usize, delta: f64| -> f64 {
        let mut t = model.tensors();
        let flat: Vec<f64> = t[name].flatten_all().unwrap().to_vec1().unwrap();
        let mut flat = flat;
        flat[idx] += delta;
        let shape = t[name].dims().to_vec();
        t.insert(name.into(), Tensor::from_vec(flat, shape, &dev).unwrap());
        TrainableLm::new(cfg, &t, DType::F64, &dev)
            .unwrap()
            .loss(&ids)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let h = 1e-6;
    for (name, var) in model.params() {
        let g: Vec<f64> = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient reached {name}"))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // The entries with the largest gradients (the embedding rows of unused ids have none).
        let mut order: Vec<usize> = (0..g.len()).collect();
        order.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
        for &i in order.iter().take(3) {
            let fd = (loss_at(name, i, h) - loss_at(name, i, -h)) / (2.0 * h);
            assert!(
                (fd - g[i]).abs() <= 1e-6 + 1e-5 * fd.abs(),
                "{:?} {name}[{i}]: autograd {} vs finite difference {fd}",
                cfg.pattention_activation,
                g[i]
            );
        }
    }
}

#[test]
fn every_theta_variant_has_the_gradient_of_finite_differences() {
    for (k, activation) in [
        Activation::L2NormGelu,
        Activation::GeluL2Norm,
        Activation::Softmax,
    ]
    .into_iter()
    .enumerate()
    {
        let mut cfg = tiny_config(16, 16);
        cfg.hidden_size = 8;
        cfg.num_heads = 2;
        cfg.qkv_tokens = 6;
        cfg.proj_tokens = 5;
        cfg.ffn_tokens = 7;
        cfg.rotary_pct = 0.5;
        cfg.pattention_activation = activation;
        if k == 1 {
            // A grown model's fixed √n constants, and a separate output matrix.
            cfg.pattention_scale_tokens = Some(ScaleTokens {
                qkv: 4,
                proj: 3,
                ffn: 5,
            });
            cfg.tie_word_embeddings = false;
        }
        check_gradients(&cfg, 7 + k as u64);
    }
}

#[test]
fn the_schedule_warms_up_linearly_then_decays_by_cosine_to_the_minimum() {
    let s = LrSchedule {
        lr: 1e-3,
        min_lr: 1e-4,
        warmup: 10,
        total: 110,
    };
    assert!((s.at(0) - 1e-4).abs() < 1e-12);
    assert!((s.at(9) - 1e-3).abs() < 1e-12);
    assert!((s.at(10) - 1e-3).abs() < 1e-12);
    // Halfway through the decay: the mean of lr and min_lr.
    assert!((s.at(60) - 5.5e-4).abs() < 1e-12);
    assert!((s.at(110) - 1e-4).abs() < 1e-12);
    assert!((s.at(500) - 1e-4).abs() < 1e-12);
}

/// A tiny config for training tests, written into `dir`.
fn init_config(dir: &std::path::Path) -> std::path::PathBuf {
    let mut cfg = tiny_config(50304, 64);
    cfg.hidden_size = 32;
    cfg.num_heads = 2;
    let p = dir.join("init.json");
    std::fs::write(&p, serde_json::to_string(&cfg).unwrap()).unwrap();
    p
}

fn train_args<'a>(init: &'a str, out: &'a str, text: &'a str, steps: &'a str) -> Vec<&'a str> {
    let mut v = base_args(init, text);
    v.extend(["--out", out, "--steps", steps]);
    v
}

/// Everything but `--out` and `--steps`.
fn base_args<'a>(init: &'a str, text: &'a str) -> Vec<&'a str> {
    vec![
        "--init",
        init,
        "--data",
        text,
        "--tokenizer",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/gpt-neox-20b-tokenizer.json"
        ),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "5",
        "--seed",
        "3",
    ]
}

fn text() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/train-text.txt").to_string()
}

#[test]
fn training_a_tiny_model_on_a_short_text_lowers_its_loss_far_below_the_start() {
    let tmp = tempfile::tempdir().unwrap();
    let init = init_config(tmp.path());
    let out = tmp.path().join("run");
    let (i, o, t) = (init.to_str().unwrap(), out.to_str().unwrap(), text());
    let mut args = train_args(i, o, &t, "150");
    args.extend(["--val-data", &t, "--eval-every", "50", "--json"]);
    let summary: Value = serde_json::from_str(&ok(&tokenformer_train(&args, &[]))).unwrap();
    let m = metrics(&out);
    assert_eq!(m.len(), 150);
    let first = m[0]["loss"].as_f64().unwrap();
    // Fresh weights predict every one of the 50,304 ids about equally: ln 50304 = 10.83.
    assert!((first - 50304f64.ln()).abs() < 0.1, "first loss {first}");
    let val = summary["val_loss"].as_f64().unwrap();
    assert!(
        val < 0.5 * first,
        "validation loss {val} after 150 steps, start {first}"
    );
    assert_eq!(summary["steps"], 150);
    assert_eq!(summary["tokens"], 150 * 4 * 32);
    // The checkpoint is a model folder every command loads, with its card.
    let ckpt = out.join("checkpoint-000150");
    let lm = loader::load_lm(
        &loader::locate(ckpt.to_str().unwrap(), &LocateOptions::default()).unwrap(),
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(lm.config().hidden_size, 32);
    let card = std::fs::read_to_string(ckpt.join("README.md")).unwrap();
    assert!(card.contains("150 of 150 steps"), "{card}");
}

#[test]
fn a_resumed_run_equals_an_uninterrupted_one_and_a_kill_in_save_keeps_the_last_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let init = init_config(tmp.path());
    let t = text();
    assert_resume_equals_uninterrupted(
        tmp.path(),
        &base_args(init.to_str().unwrap(), &t),
        &["--data", &t],
        4,
    );
}

#[test]
fn frozen_tensors_stay_bit_identical_and_the_selected_ones_train() {
    let tmp = tempfile::tempdir().unwrap();
    let init = init_config(tmp.path());
    let out = tmp.path().join("run");
    let t = text();
    let mut a = train_args(init.to_str().unwrap(), out.to_str().unwrap(), &t, "3");
    a.extend(["--train", "layers.1.mlp.*,final_norm.bias"]);
    ok(&tokenformer_train(&a, &[]));
    let cfg: Config = serde_json::from_str(&std::fs::read_to_string(&init).unwrap()).unwrap();
    let start = tokenformer::train::lm::init_tensors(&cfg, 3, &Device::Cpu).unwrap();
    let end = weights(&out.join("checkpoint-000003"));
    for (name, t) in &start {
        let trained = name.starts_with("layers.1.mlp.") || name == "final_norm.bias";
        assert_eq!(bits(t) != bits(&end[name]), trained, "{name}");
    }
}

#[test]
fn token_ids_beyond_the_vocabulary_are_a_clean_error() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(64, 64);
    cfg.hidden_size = 32;
    let init = tmp.path().join("init.json");
    std::fs::write(&init, serde_json::to_string(&cfg).unwrap()).unwrap();
    let out = tmp.path().join("run");
    let t = text();
    let o = tokenformer_train(
        &train_args(init.to_str().unwrap(), out.to_str().unwrap(), &t, "1"),
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("vocabulary has 64 entries") && !err.contains("panicked"),
        "{err}"
    );
    assert!(
        !out.exists(),
        "a run that fails at its first step leaves no --out"
    );
}

#[test]
fn bad_options_name_the_field_in_the_library_and_the_flag_on_the_command_line() {
    let opts = tokenformer::train::TrainOptions {
        steps: 10,
        batch_size: 2,
        grad_accum: 1,
        seq_len: 16,
        lr: 0.1,
        min_lr: 0.5,
        warmup_steps: 0,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
        clip_grad: 1.0,
        seed: 0,
        train: vec!["*".into()],
        grow_at: vec![],
        augment: Default::default(),
    };
    let e = opts.validate().unwrap_err().to_string();
    assert_eq!(e, "`min_lr` 0.5 is above the peak learning rate 0.1");

    let tmp = tempfile::tempdir().unwrap();
    let init = init_config(tmp.path());
    let out = tmp.path().join("run");
    let t = text();
    let mut args = train_args(init.to_str().unwrap(), out.to_str().unwrap(), &t, "2");
    args.push("--clip-grad=-1");
    let o = tokenformer_train(&args, &[]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--clip-grad must be non-negative, got -1") && !err.contains('`'),
        "{err}"
    );
    assert!(!out.exists(), "a refused run writes nothing");
}
