//! Training the merged vision-language model: its differentiable forward computes the
//! inference model's mixed sequence, and `tokenformer train --train bridge` on
//! (image, caption) pairs moves only the bridge tokens while the caption loss falls.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::train::bits;
use tokenformer::checkpoint::{self, Tensors};
use tokenformer::loader;
use tokenformer::models::vl::{self, VisionLanguageModel};
use tokenformer::train::vl::TrainableVl;

fn weights(spec: &Path) -> loader::LoadedWeights {
    let files = loader::locate(spec.to_str().unwrap(), &Default::default()).unwrap();
    loader::read_weights(&files, Some(DType::F32), &Device::Cpu).unwrap()
}

/// The shipped tiny classifier and language model merged with 6 bridge tokens whose
/// keys and values are random (non-zero keys: the bridge takes part in both routes).
fn merged() -> (vl::Config, Tensors) {
    let vw = weights(&common::fixtures().join("vit-tiny-imagenet/vit-tiny"));
    let lw = weights(&common::lm_fixture().join("pytorch_model.bin"));
    let vcfg = loader::vit_config(&vw.config, &vw.path).unwrap();
    let lcfg = loader::lm_config(&lw.config, &lw.path).unwrap();
    let cfg = vl::Config::merged(&vcfg, &lcfg, 6).unwrap();
    let mut seed = 1u64;
    let mut t = vl::assemble(&cfg, &vw.tensors, &lw.tensors, |_, r, c| {
        seed += 1;
        Ok(common::randn(
            &mut rand::SeedableRng::seed_from_u64(seed),
            &[r, c],
            0.05,
        ))
    })
    .unwrap();
    for (name, v) in t.iter_mut() {
        if name.ends_with("key_param_tokens") {
            let n = v.dim(0).unwrap();
            seed += 1;
            let keys = common::randn(&mut rand::SeedableRng::seed_from_u64(seed), &[6, 32], 0.3);
            *v = Tensor::cat(&[&v.narrow(0, 0, n - 6).unwrap(), &keys], 0).unwrap();
        }
    }
    (cfg, t)
}

fn pixels() -> Tensor {
    candle_core::safetensors::load(
        common::fixtures().join("vit-tiny-imagenet/pixels.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
    .remove("pixels")
    .unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Checks the training forward against the inference model's mixed sequence on the
/// fixture pixels and ids; returns the inference logits.
fn training_forward_equals_inference(cfg: &vl::Config, tensors: &Tensors) -> Tensor {
    let dev = Device::Cpu;
    let inference = VisionLanguageModel::from_tensors(cfg, tensors, &dev).unwrap();
    let train = TrainableVl::new(cfg, tensors, DType::F32, &dev).unwrap();
    let px = pixels();
    let b = px.dim(0).unwrap();
    let ids: Vec<u32> = (0..b * 12).map(|i| (i * 7919 % 50000) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, 12), &dev).unwrap();
    let (_, want) = inference.forward_mixed(Some(&px), &ids, None).unwrap();
    let diff = max_abs(&(train.forward(&px, &ids).unwrap() - &want).unwrap());
    let scale = max_abs(&want);
    assert!(
        diff <= 1e-5 * scale.max(1.0),
        "max |Δ logit| {diff} (scale {scale})"
    );
    want
}

#[test]
fn the_training_forward_of_the_merged_model_computes_the_mixed_sequence() {
    let (cfg, tensors) = merged();
    training_forward_equals_inference(&cfg, &tensors);
}

#[test]
fn the_training_forward_of_the_merged_model_keeps_a_parallel_residual() {
    let (mut cfg, tensors) = merged();
    let seq = training_forward_equals_inference(&cfg, &tensors);
    cfg.language.parallel_residual = true;
    let want = training_forward_equals_inference(&cfg, &tensors);
    // Not the sequential block's logits.
    assert!(max_abs(&(seq - want).unwrap()) > 1e-3);
}

/// A 32×32 image: red, green or blue dominant with noise.
fn image(class: usize, seed: u32) -> image::RgbImage {
    let mut s = seed.wrapping_mul(2_654_435_761) | 1;
    image::RgbImage::from_fn(32, 32, |_, _| {
        let mut px = [0u8; 3];
        for (c, v) in px.iter_mut().enumerate() {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            *v = (s % 100) as u8 + if c == class { 150 } else { 0 };
        }
        image::Rgb(px)
    })
}

#[test]
fn train_bridge_moves_only_the_bridge_and_lowers_the_caption_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, tensors) = merged();
    let model = tmp.path().join("merged");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    checkpoint::write_safetensors(&model, &tensors, checkpoint::DEFAULT_SHARD_BYTES).unwrap();
    std::fs::copy(common::tokenizer_fixture(), model.join("tokenizer.json")).unwrap();
    let colours = ["red", "green", "blue"];
    let mut jsonl = String::new();
    for i in 0..6u32 {
        let c = i as usize % 3;
        let file = format!("{i}.png");
        image(c, i + 1).save(tmp.path().join(&file)).unwrap();
        jsonl += &serde_json::json!({"image": file, "text": format!("a {} square", colours[c])})
            .to_string();
        jsonl.push('\n');
    }
    let pairs = tmp.path().join("pairs.jsonl");
    std::fs::write(&pairs, jsonl).unwrap();
    let out = tmp.path().join("run");
    let (m, p, o) = (
        model.to_str().unwrap(),
        pairs.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let (status, _, stderr) = common::tokenformer(&[
        "train",
        "--model",
        m,
        "--data",
        p,
        "--out",
        o,
        "--train",
        "bridge",
        "--steps",
        "20",
        "--batch-size",
        "3",
        "--lr",
        "1e-2",
        "--warmup-steps",
        "2",
        "--seq-len",
        "16",
    ]);
    assert!(status.status.success(), "{stderr}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let loss = |i: usize| lines[i]["loss"].as_f64().unwrap();
    let (first, last) = ((loss(0) + loss(1)) / 2.0, (loss(18) + loss(19)) / 2.0);
    // Six bridge tokens per layer on a random-weight language model: a nat in 20 steps.
    assert!(last < first - 0.5, "caption loss {first} -> {last}");
    let end = weights(&out.join("checkpoint-000020")).tensors;
    let mut moved = 0;
    for (name, t) in &tensors {
        let after = &end[name];
        if !name.starts_with("layers.") {
            assert_eq!(bits(t), bits(after), "{name}");
            continue;
        }
        let n = t.dim(0).unwrap();
        let (old, new) = (n - 6, 6);
        assert_eq!(
            bits(&t.narrow(0, 0, old).unwrap()),
            bits(&after.narrow(0, 0, old).unwrap()),
            "{name}"
        );
        let (b0, b1) = (
            bits(&t.narrow(0, old, new).unwrap()),
            bits(&after.narrow(0, old, new).unwrap()),
        );
        if b0 != b1 {
            moved += 1;
        }
    }
    assert_eq!(moved, 2 * 5 * 2, "every bridge tensor trains");
}

#[test]
fn one_bridge_training_step_matches_pytorch_autograd_and_adamw() {
    let diff = common::steps::vl_bridge_step_matches_pytorch(&Device::Cpu);
    eprintln!(
        "VL bridge step vs PyTorch: max relative {:e}, max absolute {:e}",
        diff.rel, diff.abs
    );
}

/// Six (image, caption) pairs in `dir`; returns the JSONL.
fn pairs_file(dir: &Path) -> std::path::PathBuf {
    let colours = ["red", "green", "blue"];
    let mut jsonl = String::new();
    for i in 0..6u32 {
        let c = i as usize % 3;
        let file = format!("{i}.png");
        image(c, i + 1).save(dir.join(&file)).unwrap();
        jsonl += &serde_json::json!({"image": file, "text": format!("a {} square", colours[c])})
            .to_string();
        jsonl.push('\n');
    }
    let pairs = dir.join("pairs.jsonl");
    std::fs::write(&pairs, jsonl).unwrap();
    pairs
}

#[test]
fn a_fresh_merged_model_trains_and_resumes_exactly_and_a_kill_in_save_keeps_the_last() {
    let tmp = tempfile::tempdir().unwrap();
    // The fixture's shape at 32² images with the tokenizer's vocabulary, from --init.
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixtures().join("vl-train-step/config.json")).unwrap(),
    )
    .unwrap();
    cfg["vision"]["image_size"] = 32.into();
    cfg["vision"]["patch_size"] = 8.into();
    cfg["language"]["vocab_size"] = 50304.into();
    let init = tmp.path().join("vl.json");
    std::fs::write(&init, cfg.to_string()).unwrap();
    let pairs = pairs_file(tmp.path());
    let (i, p, tok) = (
        init.to_str().unwrap(),
        pairs.to_str().unwrap(),
        common::tokenizer_fixture(),
    );
    let tok = tok.to_str().unwrap();
    let start = [
        "--init",
        i,
        "--tokenizer",
        tok,
        "--data",
        p,
        "--batch-size",
        "2",
        "--lr",
        "1e-2",
        "--warmup-steps",
        "1",
        "--seq-len",
        "8",
        "--seed",
        "2",
    ];
    common::train::assert_resume_equals_uninterrupted(tmp.path(), &start, &["--data", p], 2);
    // Fresh weights as --init draws them (the vision head has no gradient from captions,
    // so it is still the draw): N(0, 0.02) matrices, zero biases.
    let vcfg: vl::Config = serde_json::from_value(cfg).unwrap();
    let fresh = tokenformer::train::vl::init_tensors(&vcfg, 2, &Device::Cpu).unwrap();
    let w = common::train::weights(&tmp.path().join("whole/checkpoint-000004"));
    for name in ["vision.head.weight", "vision.head.bias"] {
        assert_eq!(bits(&fresh[name]), bits(&w[name]), "{name}");
    }
    let emb = &fresh["language.word_embeddings.weight"];
    let std = emb
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt();
    assert!((std - 0.02).abs() < 2e-4, "embedding std {std}");
}

#[test]
fn caption_ids_beyond_the_vocabulary_are_a_clean_error() {
    let tmp = tempfile::tempdir().unwrap();
    // The fixture's 64-entry vocabulary against the GPT-NeoX tokenizer.
    let init = common::fixtures().join("vl-train-step/config.json");
    let pairs = pairs_file(tmp.path());
    let out = tmp.path().join("run");
    let res = common::tokenformer(&[
        "train",
        "--init",
        init.to_str().unwrap(),
        "--tokenizer",
        common::tokenizer_fixture().to_str().unwrap(),
        "--data",
        pairs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--steps",
        "1",
    ]);
    common::assert_clean_failure(&res, &["a caption of", "vocabulary has 64 entries"]);
}
