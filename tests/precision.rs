//! One model code for every device and dtype. Off the CPU's f32 fast path
//! (a GPU, or another dtype) the models run on plain candle ops; here that
//! path runs on the CPU in f64 and must equal the fused f32 kernels and the
//! PyTorch fixture, and bf16/f16 computation (reductions in f32) must stay as
//! close to f32 as the GPU issue requires: perplexity within 0.5 % on the
//! shipped `tiny-kjv-lm` validation text, and the same top-1 class on the
//! shipped digit images.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::*;
use tokenformer::eval::imagenet::classify_files;
use tokenformer::loader::{self, LocateOptions};
use tokenformer::models::tokenformer::{Cache, Logits, TokenFormerLm};
use tokenformer::scoring::score_ids;

fn fixture_files() -> loader::ModelFiles {
    let opts = LocateOptions {
        tokenizer: Some(tokenizer_fixture()),
        ..Default::default()
    };
    let bin = lm_fixture().join("pytorch_model.bin");
    loader::locate(bin.to_str().unwrap(), &opts).unwrap()
}

fn locate(path: &Path) -> loader::ModelFiles {
    loader::locate(path.to_str().unwrap(), &LocateOptions::default()).unwrap()
}

fn logits(model: &TokenFormerLm, ids: &[u32]) -> Vec<f32> {
    let input = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let out = model.forward(&input, None).unwrap();
    assert_eq!(out.dtype(), DType::F32, "logits come out as f32");
    f32s(&out)
}

#[test]
fn the_plain_op_path_equals_the_fused_kernels_and_pytorch() {
    let files = fixture_files();
    let fused = loader::load_lm(&files, &Device::Cpu).unwrap();
    let plain = loader::load_lm_in(&files, &Device::Cpu, DType::F64).unwrap();
    assert_eq!(plain.compute_dtype(), DType::F64);
    let exp = expected_lm();
    let ids: Vec<u32> = serde_json::from_value(exp["ids"].clone()).unwrap();
    let (a, b) = (logits(&fused, &ids), logits(&plain, &ids));
    let d = max_rel(&a, &b);
    assert!(d < 1e-4, "f64 plain ops vs f32 fused kernels: {d}");
    // And the PyTorch truth (logits of ids 0..8 at every position).
    let vocab = fused.config().vocab_size;
    let first8: Vec<Vec<f32>> = serde_json::from_value(exp["logits_first8"].clone()).unwrap();
    for (t, row) in first8.iter().enumerate() {
        for (j, want) in row.iter().enumerate() {
            let got = b[t * vocab + j];
            assert!(
                (got - want).abs() < 1e-4,
                "logit {j} at {t}: {got} vs {want}"
            );
        }
    }
    // Decoding through the KV cache on the same path (rotary offsets, the
    // cache's own dtype) gives the full forward's last logits.
    let mut cache = Cache::new(plain.config());
    let mut last = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        let input = Tensor::new(&[id], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let out = plain.forward(&input, Some(&mut cache)).unwrap();
        if i + 1 == ids.len() {
            last = f32s(&out);
        }
    }
    let n = ids.len();
    let d = max_rel(&last, &b[(n - 1) * vocab..n * vocab]);
    assert!(d < 1e-5, "cached decoding vs full forward: {d}");
}

/// Perplexity of the shipped validation text in each half dtype, within
/// 0.5 % of f32, and really computed in it (not silently f32).
#[test]
fn half_precision_perplexity_is_within_half_a_percent_of_f32() {
    let files = locate(&zoo("tiny-kjv-lm"));
    let tok = loader::load_tokenizer(&files).unwrap();
    let text = std::fs::read_to_string(zoo("examples").join("kjv-val.jsonl")).unwrap();
    let docs: Vec<String> = text
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["text"].as_str().unwrap().to_string()
        })
        .collect();
    let f32_model = loader::load_lm(&files, &Device::Cpu).unwrap();
    let max = f32_model.config().max_position_embeddings;
    let nll = |model: &TokenFormerLm| -> (f64, usize) {
        let mut total = (0.0, 0);
        for d in &docs {
            let ids = tok.encode(d.as_str(), false).unwrap().get_ids().to_vec();
            for w in ids.chunks(max) {
                if w.len() < 2 {
                    continue;
                }
                let s = score_ids(model, w).unwrap();
                total.0 += s.nll;
                total.1 += w.len() - 1;
            }
        }
        total
    };
    let (base, tokens) = nll(&f32_model);
    assert!(tokens > 500, "{tokens} tokens scored");
    for dtype in [DType::BF16, DType::F16] {
        let model = loader::load_lm_in(&files, &Device::Cpu, dtype).unwrap();
        assert_eq!(model.compute_dtype(), dtype);
        let (nll, n) = nll(&model);
        assert_eq!(n, tokens);
        let (ppl, want) = ((nll / n as f64).exp(), (base / n as f64).exp());
        let change = ppl / want - 1.0;
        assert!(
            change.abs() < 0.005,
            "{dtype:?}: perplexity {ppl} vs f32 {want}"
        );
        assert_ne!(nll, base, "{dtype:?} computed exactly as f32");
        // Logits in the compute dtype are what `forward` widens to f32.
        let ids = Tensor::new(&[[5u32, 17, 42, 7, 99, 3]], &Device::Cpu).unwrap();
        let own = model
            .forward_in_compute_dtype(&ids, None, Logits::All)
            .unwrap();
        assert_eq!(own.dtype(), dtype);
        let f32 = model.forward(&ids, None).unwrap();
        assert_eq!(f32s(&own.to_dtype(DType::F32).unwrap()), f32s(&f32));
    }
}

/// The ViT on the same path: f64 logits equal f32's, and bf16 (and f16)
/// pick f32's top-1 class on every shipped digit image (the issue asks for
/// at least 99 %, which of 50 images is all of them).
#[test]
fn the_vit_in_f64_and_bf16_classifies_like_f32() {
    let files = locate(&zoo("tiny-digits-vit"));
    let images = digit_images();
    assert!(images.len() >= 50, "{} images", images.len());
    let top1 = |dtype: DType| -> Vec<(usize, f32)> {
        let model = loader::load_vit_in(&files, &Device::Cpu, dtype).unwrap();
        classify_files(&model, &images, 1, 16)
            .unwrap()
            .into_iter()
            .map(|(_, r)| {
                let p = &r.unwrap()[0];
                (p.index, p.prob)
            })
            .collect()
    };
    let base = top1(DType::F32);
    let wide = top1(DType::F64);
    for (i, (a, b)) in base.iter().zip(&wide).enumerate() {
        assert_eq!(a.0, b.0, "{}", images[i].display());
        assert!(
            (a.1 - b.1).abs() < 1e-5,
            "{}: {a:?} vs {b:?}",
            images[i].display()
        );
    }
    for dtype in [DType::BF16, DType::F16] {
        let half = top1(dtype);
        let same = base.iter().zip(&half).filter(|(a, b)| a.0 == b.0).count();
        assert_eq!(same, base.len(), "{dtype:?}: top-1 agreement");
        let moved = base.iter().zip(&half).any(|(a, b)| a.1 != b.1);
        assert!(moved, "{dtype:?} computed exactly as f32");
    }
}

/// The fixture's global gradient norm, from the per-tensor norms PyTorch reports.
fn global_norm(grads: &candle_core::backprop::GradStore, vars: &[&candle_core::Var]) -> f64 {
    vars.iter()
        .map(|v| {
            let g = grads
                .get(v.as_tensor())
                .expect("every variable has a gradient");
            assert_eq!(
                g.dtype(),
                DType::F32,
                "gradients reach the f32 variables in f32"
            );
            g.to_dtype(DType::F64)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        })
        .sum::<f64>()
        .sqrt()
}

/// bf16-mixed training (f32 variables, bf16 products, f32 reductions): one step of
/// the official fixture LM and of the ViT fixture has PyTorch's f32 loss within
/// 1 % and its gradient norm within 2 %, the merged model's its loss within 1 %,
/// and the variables stay f32.
#[test]
fn bf16_mixed_training_steps_stay_close_to_pytorchs_f32_step() {
    use tokenformer::train::{vit::TrainableVit, TrainableLm};
    let json = |p: PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let close = |what: &str, got: f64, want: f64, rel: f64| {
        assert!(
            (got / want - 1.0).abs() < rel,
            "{what}: {got} vs PyTorch f32 {want}"
        );
    };
    // The language model.
    let files = fixture_files();
    let w = loader::read_weights(&files, Some(DType::F32), &Device::Cpu).unwrap();
    let cfg = loader::lm_config(&w.config, &w.path).unwrap();
    let want = json(lm_fixture().join("train_step.json"));
    let ids: Vec<u32> = serde_json::from_value(expected_lm()["ids"].clone()).unwrap();
    let n = ids.len();
    let ids = Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap();
    let model = TrainableLm::new(&cfg, &w.tensors, DType::F32, &Device::Cpu)
        .unwrap()
        .with_compute_dtype(DType::BF16);
    let loss = model.loss(&ids).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    let l = loss.to_scalar::<f32>().unwrap() as f64;
    close("LM loss", l, want["loss"].as_f64().unwrap(), 0.01);
    assert_ne!(l, want["loss"].as_f64().unwrap());
    let grads = loss.backward().unwrap();
    let vars: Vec<_> = model.params().values().collect();
    let norm = global_norm(&grads, &vars);
    close(
        "LM gradient norm",
        norm,
        want["grad_global_norm_before_clip"].as_f64().unwrap(),
        0.02,
    );
    assert!(vars.iter().all(|v| v.dtype() == DType::F32));

    // The classifier.
    let dir = fixtures().join("vit-train-step");
    let want = json(dir.join("train_step.json"));
    let cfg: tokenformer::models::vit::Config =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let read = |f: &str| {
        tokenformer::checkpoint::read_safetensors(&[dir.join(f)], None, &Device::Cpu).unwrap()
    };
    let (w, px) = (read("model.safetensors"), read("pixels.safetensors"));
    let labels: Vec<u32> = serde_json::from_value(want["labels"].clone()).unwrap();
    let labels = Tensor::from_vec(labels, 4, &Device::Cpu).unwrap();
    let model = TrainableVit::new(&cfg, &w, DType::F32, &Device::Cpu)
        .unwrap()
        .with_compute_dtype(DType::BF16);
    let loss = model.loss(&px["pixels"], &labels).unwrap();
    close(
        "ViT loss",
        loss.to_scalar::<f32>().unwrap() as f64,
        want["loss"].as_f64().unwrap(),
        0.01,
    );
    let grads = loss.backward().unwrap();
    let vars: Vec<_> = model.params().values().collect();
    let want_norm = want["grad_norm"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap().powi(2))
        .sum::<f64>()
        .sqrt();
    close(
        "ViT gradient norm",
        global_norm(&grads, &vars),
        want_norm,
        0.02,
    );

    // The merged vision-language model (its caption loss over [image; caption]).
    let dir = fixtures().join("vl-train-step");
    let want = json(dir.join("train_step.json"));
    let cfg: tokenformer::models::vl::Config =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let read = |f: &str| {
        tokenformer::checkpoint::read_safetensors(&[dir.join(f)], None, &Device::Cpu).unwrap()
    };
    let (w, batch) = (read("model.safetensors"), read("batch.safetensors"));
    let model = tokenformer::train::vl::TrainableVl::new(&cfg, &w, DType::F32, &Device::Cpu)
        .unwrap()
        .with_compute_dtype(DType::BF16);
    let loss = model
        .loss(&batch["pixels"], &batch["ids"], &batch["mask"])
        .unwrap();
    let l = loss.to_scalar::<f32>().unwrap() as f64;
    close("VL loss", l, want["loss"].as_f64().unwrap(), 0.01);
    assert_ne!(l, want["loss"].as_f64().unwrap());
    // Every Pattention tensor has an f32 gradient (the vision head and norms have
    // no part in the caption loss).
    let grads = loss.backward().unwrap();
    let vars: Vec<_> = model
        .params()
        .iter()
        .filter(|(n, _)| n.starts_with("layers."))
        .map(|(_, v)| v)
        .collect();
    assert!(vars.len() >= 20);
    assert!(global_norm(&grads, &vars) > 0.0);
}

/// `train --precision bf16-mixed` on the CPU: the loss falls as f32's does, and the
/// checkpoint's weights are f32.
#[test]
fn train_bf16_mixed_learns_like_f32_and_saves_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let base = common::train::tiny_lm_run(tmp.path());
    let last_loss = |precision: &str| -> f64 {
        let out = tmp.path().join(precision);
        let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
        args.extend([
            "--steps",
            "40",
            "--out",
            out.to_str().unwrap(),
            "--precision",
            precision,
        ]);
        let o = common::train::tokenformer_train(&args, &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let w = common::train::weights(&out.join("checkpoint-000040"));
        assert!(w.values().all(|t| t.dtype() == DType::F32), "{precision}");
        let m = common::train::metrics(&out);
        let tail: Vec<f64> = m[30..]
            .iter()
            .map(|r| r["loss"].as_f64().unwrap())
            .collect();
        tail.iter().sum::<f64>() / tail.len() as f64
    };
    let (f32, bf16) = (last_loss("f32"), last_loss("bf16-mixed"));
    // Fresh weights start at ln 50304 = 10.8.
    assert!(f32 < 8.0 && bf16 < 8.0, "f32 {f32}, bf16-mixed {bf16}");
    assert!(
        (bf16 / f32 - 1.0).abs() < 0.05,
        "f32 {f32}, bf16-mixed {bf16}"
    );
}

/// The merged model (`tiny-digits-vl`) on the same path: in f64 its mixed
/// sequence's image and text logits equal f32's, with f16 weights they are
/// f32's bits (an fp16 checkpoint), and in bf16 and f16 the greedy
/// continuation of "a handwritten" after each shipped digit image, decoded
/// together as `generate --prompts` does, is f32's (the GPU issue asks for
/// 99 % top-1 agreement; of 50 images that is all of them).
#[test]
fn the_merged_model_in_f64_and_half_precision_generates_like_f32() {
    use tokenformer::vision::EvalTransform;
    let files = locate(&zoo("tiny-digits-vl"));
    let base = loader::load_vl(&files, &Device::Cpu).unwrap();
    let tok = loader::load_tokenizer(&files).unwrap();
    let transform = EvalTransform::from_config(base.vision().config());
    let seven = transform
        .load(&zoo("examples/digits/seven/0005.png"))
        .unwrap();
    let seven = transform.batch(vec![seven], &Device::Cpu).unwrap();
    let prompt = tok.encode("a handwritten", false).unwrap();
    let ids = Tensor::new(prompt.get_ids(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mixed = |m: &tokenformer::VisionLanguageModel| {
        let (img, txt) = m.forward_mixed(Some(&seven), &ids, None).unwrap();
        (f32s(&img.unwrap()), f32s(&txt))
    };
    let captions = |m: &tokenformer::VisionLanguageModel| digit_captions(m, &tok, &Device::Cpu, 3);
    let (img, txt) = mixed(&base);
    let want = captions(&base);
    assert!(want.len() >= 50, "{} images", want.len());
    // Each digit's own word: the captions say something of the image.
    let distinct: std::collections::BTreeSet<_> = want.iter().collect();
    assert!(distinct.len() >= 10, "{} distinct captions", distinct.len());
    let wide = loader::load_vl_in(&files, &Device::Cpu, DType::F64).unwrap();
    assert_eq!(wide.compute_dtype(), DType::F64);
    let (wide_img, wide_txt) = mixed(&wide);
    let d = max_rel(&img, &wide_img).max(max_rel(&txt, &wide_txt));
    assert!(d < 1e-4, "f64 vs f32 logits of the mixed sequence: {d}");
    // f16 weights with f32 computation: this fp16 checkpoint's own values, so
    // f32's logits from half the bytes, up to the order in which the
    // products sum (the same order, so the same bits, where f32 weights are
    // laid out as rows too: not on Intel hosts; see `pattention::Layout`);
    // the merged folder's language route alone keeps f16 weights too.
    let f16_weights = loader::load_vl_as(&files, &Device::Cpu, DType::F16).unwrap();
    assert_eq!(f16_weights.compute_dtype(), DType::F32);
    let (half_img, half_txt) = mixed(&f16_weights);
    let d = max_rel(&half_img, &img).max(max_rel(&half_txt, &txt));
    assert!(
        d < 1e-5,
        "f16 weights vs f32 logits of the mixed sequence: {d}"
    );
    let bytes = |m: &TokenFormerLm| m.weight_bytes();
    assert_eq!(2 * bytes(f16_weights.language()), bytes(base.language()));
    let route = loader::load_lm_as(&files, &Device::Cpu, DType::F16).unwrap();
    assert_eq!(
        2 * bytes(&route),
        bytes(&loader::load_lm(&files, &Device::Cpu).unwrap())
    );
    for dtype in [DType::BF16, DType::F16] {
        let half = loader::load_vl_in(&files, &Device::Cpu, dtype).unwrap();
        assert_eq!(half.compute_dtype(), dtype);
        assert_eq!(half.vision().compute_dtype(), dtype);
        let (_, half_txt) = mixed(&half);
        assert_ne!(half_txt, txt, "{dtype:?} computed exactly as f32");
        let got = captions(&half);
        let same = want.iter().zip(&got).filter(|(a, b)| a == b).count();
        assert_eq!(same, want.len(), "{dtype:?}: captions equal to f32's");
    }
}
