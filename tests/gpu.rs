//! The GPU checks of the `--device cuda` issue, in a build with the `cuda` feature on a
//! machine with a GPU (each test says it is skipped and passes where there is none):
//! f32 logits of the official fixture and the shipped models equal the CPU's within
//! 1e-4 relative; cached decoding equals the full forward and greedy generation
//! (also batched, and through `serve`'s engine with log-probabilities) picks the
//! CPU's tokens, for the language model and the merged
//! vision-language model; one training step of each architecture (LM, classifier, the merged model's
//! bridge) equals PyTorch autograd + AdamW (their `train_step.json`) to the CPU's
//! tolerances, the same checks as the CPU's (tests/common/steps.rs); bf16
//! perplexity of the shipped validation text is within 0.5 % of f32, and bf16 top-1
//! (the classifier) and greedy captions (the merged model) equal f32's on the shipped
//! digit images, as does the zero-shot class of scoring captions after an image (f32
//! scores within 1e-4 of the CPU's); the Pile evaluation's batched scoring
//! equals the CPU's; clipped AdamW steps give the CPU's bits (with the kernels: the
//! multi-tensor ones); a training run resumed on the other device equals the
//! uninterrupted one. The project's own CUDA kernels (Θ, flash attention,
//! log-softmax-gather) equal their definitions in plain candle ops on the same GPU
//! (the rotary kernel the CPU's bits, the residual-and-norm kernel the two ops),
//! and the training kernels (Θ, attention's softmax, LayerNorm, cross-entropy, each
//! a kernel each way) equal the CPU's op or the plain ops, values and gradients;
//! they are called directly, so they are checked whatever `TOKENFORMER_CUDA_KERNELS`
//! says, while the model-level tests above take them only under
//! `TOKENFORMER_CUDA_KERNELS=1` (run.sh runs the file both ways). Under
//! `TOKENFORMER_TEST_GPU=cpu` the kernel tests are skipped (they need CUDA).
//! `scripts/gpu-check.sh` builds and runs them there.
#![cfg(feature = "cuda")]

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::*;
use serde_json::Value;
use tokenformer::eval::imagenet::classify_files;
use tokenformer::loader::{self, LocateOptions};
use tokenformer::models::tokenformer::{Cache, TokenFormerLm};
use tokenformer::scoring::score_ids;
use tokenformer::train::{AdamW, AdamWConfig};
use tokenformer::DeviceSpec;

/// The device the checks run on and its `--device` spelling: the first GPU, or
/// `TOKENFORMER_TEST_GPU` (`cpu` checks the tests themselves where there is no GPU);
/// `None` (and a note) where it cannot be opened.
fn gpu() -> Option<(Device, String)> {
    let spec = std::env::var("TOKENFORMER_TEST_GPU").unwrap_or_else(|_| "cuda".into());
    match spec.parse::<DeviceSpec>().map(DeviceSpec::resolve) {
        Ok(Ok(d)) => Some((d, spec)),
        Ok(Err(e)) => {
            eprintln!("skipped: no GPU ({e})");
            None
        }
        Err(e) => panic!("TOKENFORMER_TEST_GPU: {e}"),
    }
}

fn locate(path: &Path) -> loader::ModelFiles {
    let opts = LocateOptions {
        tokenizer: path.ends_with("pytorch_model.bin").then(tokenizer_fixture),
        ..Default::default()
    };
    loader::locate(path.to_str().unwrap(), &opts).unwrap()
}

/// The first index holding a row's maximum (torch's argmax) and how many entries
/// hold it.
fn first_max(row: &[f32]) -> (u32, usize) {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let first = row.iter().position(|&v| v == m).unwrap() as u32;
    (first, row.iter().filter(|&&v| v == m).count())
}

fn logits(model: &TokenFormerLm, ids: &[u32]) -> Vec<f32> {
    let input = Tensor::new(ids, model.device())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    f32s(&model.forward(&input, None).unwrap())
}

#[test]
fn f32_logits_on_the_gpu_equal_the_cpus_and_cached_decoding_the_full_forward() {
    let Some((gpu, _)) = gpu() else { return };
    let fixture_ids: Vec<u32> = serde_json::from_value(expected_lm()["ids"].clone()).unwrap();
    let kjv_ids: Vec<u32> = (0..200).map(|i| (i * 37 + 11) % 2048).collect();
    for (path, ids) in [
        (lm_fixture().join("pytorch_model.bin"), &fixture_ids),
        (zoo("tiny-kjv-lm"), &kjv_ids),
    ] {
        let files = locate(&path);
        let cpu = loader::load_lm(&files, &Device::Cpu).unwrap();
        let on_gpu = loader::load_lm(&files, &gpu).unwrap();
        let ids = &ids[..ids.len().min(cpu.config().max_position_embeddings)];
        let (want, got) = (logits(&cpu, ids), logits(&on_gpu, ids));
        let d = max_rel(&got, &want);
        assert!(d < 1e-4, "{}: GPU vs CPU logits {d}", path.display());
        // One token at a time through the GPU's KV cache.
        let mut cache = Cache::new(on_gpu.config());
        let mut last = Vec::new();
        for &id in ids {
            let x = Tensor::new(&[[id]], &gpu).unwrap();
            last = f32s(&on_gpu.forward(&x, Some(&mut cache)).unwrap());
        }
        let v = on_gpu.config().vocab_size;
        let d = max_rel(&last, &want[(ids.len() - 1) * v..]);
        assert!(d < 1e-4, "{}: cached decoding {d}", path.display());
    }
}

/// Greedy generation on the GPU picks the CPU's tokens (with the kernels on, the
/// pick is made on the GPU and only the token comes back).
#[test]
fn greedy_generation_on_the_gpu_picks_the_cpus_tokens() {
    use tokenformer::generate::generate;
    let Some((gpu, _)) = gpu() else { return };
    let files = locate(&zoo("tiny-kjv-lm"));
    let prompt: Vec<u32> = (0..24).map(|i| (i * 53 + 7) % 2048).collect();
    let run = |device: &Device| {
        let model = loader::load_lm(&files, device).unwrap();
        let params = tokenformer::SamplingParams::default();
        generate(&model, &prompt, 32, params, |_| {
            Ok(std::ops::ControlFlow::Continue(()))
        })
        .unwrap()
    };
    let (want, got) = (run(&Device::Cpu), run(&gpu));
    assert!(want.len() > 1, "{want:?}");
    assert_eq!(got, want);
}

/// Batched generation on the GPU (sequences of different lengths decoded
/// together, each over its own cache) picks the CPU's one-at-a-time tokens.
#[test]
fn batched_generation_on_the_gpu_picks_the_cpus_tokens() {
    use tokenformer::generate::{generate, generate_batch};
    let Some((gpu, _)) = gpu() else { return };
    let files = locate(&zoo("tiny-kjv-lm"));
    let prompts: Vec<Vec<u32>> = [24u32, 5, 13]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 53 + n) % 2048).collect())
        .collect();
    let params = tokenformer::SamplingParams::default();
    let cpu = loader::load_lm(&files, &Device::Cpu).unwrap();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            generate(&cpu, p, 16, params.clone(), |_| {
                Ok(std::ops::ControlFlow::Continue(()))
            })
            .unwrap()
        })
        .collect();
    let on_gpu = loader::load_lm(&files, &gpu).unwrap();
    let kv = tokenformer::KvDtype::F32;
    let got = generate_batch(&on_gpu, kv, &prompts, 16, params, 2, |_, _| {
        Ok(std::ops::ControlFlow::Continue(()))
    })
    .unwrap();
    assert_eq!(got, want);
}

/// `serve`'s engine on the GPU: jobs arriving together get the CPU's greedy
/// tokens, and their log-probabilities (read from the GPU's logits) within
/// 1e-4 of the CPU's.
#[test]
fn serving_on_the_gpu_gives_the_cpus_tokens_and_logprobs() {
    use std::sync::mpsc;
    use tokenformer::generate::{serve_jobs, Event, Job, Logprobs};
    let Some((gpu, _)) = gpu() else { return };
    let files = locate(&zoo("tiny-kjv-lm"));
    let tokenizer = loader::load_tokenizer(&files).unwrap();
    let prompts: Vec<Vec<u32>> = [24u32, 5, 13]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 53 + n) % 2048).collect())
        .collect();
    // Each job's tokens, each with its log-probabilities.
    let serve = |device: &Device| -> Vec<Vec<(u32, Logprobs)>> {
        let model = loader::load_lm(&files, device).unwrap();
        let (jobs, queue) = mpsc::channel();
        let mut runs = Vec::new();
        for prompt in &prompts {
            let (events, rx) = mpsc::channel();
            let params = tokenformer::SamplingParams::default();
            let (max_new_tokens, logprobs) = (12, Some(3));
            let stop = Vec::new();
            let job = Job {
                prompt: prompt.clone(),
                max_new_tokens,
                params,
                stop,
                logprobs,
                prompt_logprobs: false,
                events,
            };
            jobs.send(job).unwrap();
            runs.push(rx);
        }
        drop(jobs);
        serve_jobs(&model, &tokenizer, tokenformer::KvDtype::F32, 2, queue).unwrap();
        runs.into_iter()
            .map(|rx| {
                rx.iter()
                    .filter_map(|e| match e {
                        Event::Token { id, logprobs, .. } => Some((id, logprobs.unwrap())),
                        Event::End { .. } | Event::Prompt(_) => None,
                        Event::Failed(e) => panic!("{e}"),
                    })
                    .collect()
            })
            .collect()
    };
    let (want, got) = (serve(&Device::Cpu), serve(&gpu));
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(w.len(), 12);
        let ids = |v: &[(u32, Logprobs)]| v.iter().map(|t| t.0).collect::<Vec<_>>();
        assert_eq!(ids(g), ids(w));
        for ((_, w), (_, g)) in w.iter().zip(g) {
            assert!((w.logprob - g.logprob).abs() < 1e-4, "{w:?} vs {g:?}");
            // The alternatives' log-probabilities, likeliest first (their ids
            // may swap where two are within rounding of each other).
            assert_eq!(w.top.len(), g.top.len());
            for ((_, a), (_, b)) in w.top.iter().zip(&g.top) {
                assert!((a - b).abs() < 1e-4, "{w:?} vs {g:?}");
            }
        }
    }
}

#[test]
fn f32_vit_logits_on_the_gpu_equal_the_cpus() {
    let Some((gpu, _)) = gpu() else { return };
    let files = locate(&zoo("tiny-digits-vit"));
    let cpu = loader::load_vit(&files, &Device::Cpu).unwrap();
    let on_gpu = loader::load_vit(&files, &gpu).unwrap();
    let cfg = cpu.config();
    let shape = (8, cfg.num_channels, cfg.image_size, cfg.image_size);
    let px = Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap();
    let want = f32s(&cpu.forward(&px).unwrap());
    let got = f32s(&on_gpu.forward(&px.to_device(&gpu).unwrap()).unwrap());
    let d = max_rel(&got, &want);
    assert!(d < 1e-4, "GPU vs CPU ViT logits {d}");
    // The embeddings `embed` writes: the pooled feature, on the GPU as on the CPU.
    let want = f32s(&cpu.pre_logits(&px).unwrap());
    let got = f32s(&on_gpu.pre_logits(&px.to_device(&gpu).unwrap()).unwrap());
    let d = max_rel(&got, &want);
    assert!(d < 1e-4, "GPU vs CPU ViT embeddings {d}");
}

#[test]
fn bf16_on_the_gpu_keeps_perplexity_within_half_a_percent_and_the_digits_top1() {
    let Some((gpu, _)) = gpu() else { return };
    let files = locate(&zoo("tiny-kjv-lm"));
    let tok = loader::load_tokenizer(&files).unwrap();
    let text = std::fs::read_to_string(zoo("examples").join("kjv-val.jsonl")).unwrap();
    let f32_model = loader::load_lm(&files, &Device::Cpu).unwrap();
    let bf16_model = loader::load_lm_in(&files, &gpu, DType::BF16).unwrap();
    let max = f32_model.config().max_position_embeddings;
    let (mut a, mut b, mut n, mut tied) = (0.0, 0.0, 0usize, 0usize);
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let ids = tok
            .encode(v["text"].as_str().unwrap(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        for w in ids.chunks(max).filter(|w| w.len() > 1) {
            a += score_ids(&f32_model, w).unwrap().nll;
            let scored = score_ids(&bf16_model, w).unwrap();
            b += scored.nll;
            n += w.len() - 1;
            // The argmax is the first of tied maxima, as torch's, also where bf16 ties.
            let l = logits(&bf16_model, w);
            let maxima: Vec<(u32, usize)> = l
                .chunks(l.len() / w.len())
                .take(w.len() - 1)
                .map(first_max)
                .collect();
            tied += maxima.iter().filter(|m| m.1 > 1).count();
            let first: Vec<u32> = maxima.iter().map(|m| m.0).collect();
            assert_eq!(scored.argmax, first, "bf16 argmax on the GPU");
        }
    }
    let (ppl32, ppl16) = ((a / n as f64).exp(), (b / n as f64).exp());
    eprintln!("kjv-val perplexity: f32 (CPU) {ppl32:.5}, bf16 (GPU) {ppl16:.5}");
    eprintln!("bf16 argmax: {tied} of {n} positions had tied maxima");
    assert!((ppl16 / ppl32 - 1.0).abs() < 0.005, "{ppl16} vs {ppl32}");

    let vit = locate(&zoo("tiny-digits-vit"));
    let images = digit_images();
    let top1 = |model| -> Vec<usize> {
        classify_files(&model, &images, 1, 16)
            .unwrap()
            .into_iter()
            .map(|(_, r)| r.unwrap()[0].index)
            .collect()
    };
    let want = top1(loader::load_vit(&vit, &Device::Cpu).unwrap());
    let got = top1(loader::load_vit_in(&vit, &gpu, DType::BF16).unwrap());
    let same = want.iter().zip(&got).filter(|(a, b)| a == b).count();
    eprintln!(
        "digits top-1 bf16 (GPU) = f32 (CPU) on {same}/{}",
        want.len()
    );
    assert!(same as f64 >= 0.99 * want.len() as f64);
}

/// One training step of each architecture on the GPU against its PyTorch fixture, to
/// the CPU's tolerances (the same checks as tests/train.rs, train_vit.rs, train_vl.rs).
#[test]
fn one_training_step_on_the_gpu_matches_pytorch() {
    let Some((gpu, _)) = gpu() else { return };
    common::steps::lm_step_matches_pytorch(&gpu);
}

#[test]
fn one_classifier_training_step_on_the_gpu_matches_pytorch() {
    let Some((gpu, _)) = gpu() else { return };
    common::steps::vit_step_matches_pytorch(&gpu);
}

#[test]
fn one_bridge_training_step_of_the_merged_model_on_the_gpu_matches_pytorch() {
    let Some((gpu, _)) = gpu() else { return };
    common::steps::vl_bridge_step_matches_pytorch(&gpu);
}

/// Inputs with nothing in them, and attention with fewer keys than causal queries, are
/// errors naming the shape (or, where the result is well defined, empty results) on
/// the GPU, not the driver's bare "invalid argument" from a launch of an empty grid or
/// the plain path's causal mask counted from a negative past; and a model that rotates
/// no features trains in bf16, where candle's cast of an empty rotary table would
/// launch such a grid.
#[test]
fn empty_inputs_on_the_gpu_are_errors_or_empty_results_not_driver_faults() {
    let Some((gpu, _)) = gpu() else { return };
    let files = locate(&lm_fixture().join("pytorch_model.bin"));
    let model = loader::load_lm(&files, &gpu).unwrap();
    let none = Tensor::zeros((1, 0), DType::U32, &gpu).unwrap();
    let e = model.forward(&none, None).unwrap_err().to_string();
    assert!(e.contains("no tokens to run"), "{e}");

    let attention = tokenformer::kernels::attention;
    let q = Tensor::zeros((1, 2, 0, 8), DType::F32, &gpu).unwrap();
    let k = Tensor::ones((1, 2, 4, 8), DType::F32, &gpu).unwrap();
    assert_eq!(attention(&q, &k, &k, true).unwrap().dims(), [1, 0, 16]);
    let q = Tensor::ones((1, 2, 4, 8), DType::F32, &gpu).unwrap();
    let short = k.narrow(2, 0, 3).unwrap();
    let e = attention(&q, &short, &short, true).unwrap_err().to_string();
    assert!(e.contains("causal queries but only 3 keys"), "{e}");
    let e = attention(
        &q,
        &q.narrow(2, 0, 0).unwrap(),
        &q.narrow(2, 0, 0).unwrap(),
        false,
    );
    assert!(e.unwrap_err().to_string().contains("no keys"));

    let w = loader::read_weights(&files, Some(DType::F32), &gpu).unwrap();
    let mut cfg = loader::lm_config(&w.config, &w.path).unwrap();
    cfg.rotary_pct = 0.5 / cfg.head_dim() as f64;
    assert_eq!(cfg.rotary_dims(), 0);
    let ids = Tensor::new(&[[3u32, 14, 15, 92, 65]], &gpu).unwrap();
    let trainable = tokenformer::train::TrainableLm::new(&cfg, &w.tensors, DType::F32, &gpu)
        .unwrap()
        .with_compute_dtype(DType::BF16);
    let loss = trainable.loss(&ids).unwrap();
    assert!(loss.to_scalar::<f32>().unwrap().is_finite());
    loss.backward().unwrap();
}

/// The shipped merged model (`tiny-digits-vl`) on the GPU: the mixed sequence's image
/// and text logits equal the CPU's, its last text position again from the cache, and
/// greedy generation from an image picks the CPU's tokens, alone and batched.
#[test]
fn the_merged_model_on_the_gpu_equals_the_cpus_and_decodes_from_its_cache() {
    use tokenformer::generate::generate_with_image;
    let Some((gpu, _)) = gpu() else { return };
    let files = locate(&zoo("tiny-digits-vl"));
    let cpu = loader::load_vl(&files, &Device::Cpu).unwrap();
    let on_gpu = loader::load_vl(&files, &gpu).unwrap();
    let v = cpu.vision().config();
    let px = Tensor::randn(
        0f32,
        1.0,
        (2, v.num_channels, v.image_size, v.image_size),
        &Device::Cpu,
    )
    .unwrap();
    let n = 9;
    let ids: Vec<u32> = (0..2 * n as u32).map(|i| (i * 131 + 5) % 2048).collect();
    let ids = Tensor::from_vec(ids, (2, n), &Device::Cpu).unwrap();
    let (img, txt) = cpu.forward_mixed(Some(&px), &ids, None).unwrap();
    let (img_gpu, txt_gpu) = on_gpu
        .forward_mixed(
            Some(&px.to_device(&gpu).unwrap()),
            &ids.to_device(&gpu).unwrap(),
            None,
        )
        .unwrap();
    let d = max_rel(&f32s(&img_gpu.unwrap()), &f32s(&img.unwrap()));
    assert!(d < 1e-4, "GPU vs CPU image logits {d}");
    let want = f32s(&txt);
    let d = max_rel(&f32s(&txt_gpu), &want);
    assert!(d < 1e-4, "GPU vs CPU text logits {d}");
    // The first image and all but the last id, then the last id from the GPU's cache.
    let mut cache = on_gpu.new_cache();
    let first = |t: &Tensor| t.narrow(0, 0, 1).unwrap().to_device(&gpu).unwrap();
    let ids0 = first(&ids);
    on_gpu
        .forward_mixed(
            Some(&first(&px)),
            &ids0.narrow(1, 0, n - 1).unwrap(),
            Some(&mut cache),
        )
        .unwrap();
    let (_, last) = on_gpu
        .forward_mixed(None, &ids0.narrow(1, n - 1, 1).unwrap(), Some(&mut cache))
        .unwrap();
    let vocab = on_gpu.language().config().vocab_size;
    let d = max_rel(&f32s(&last), &want[(n - 1) * vocab..n * vocab]);
    assert!(d < 1e-4, "cached decoding of the mixed sequence {d}");
    let prompt: Vec<u32> = (0..6).map(|i| (i * 53 + 7) % 2048).collect();
    let run = |model: &tokenformer::models::vl::VisionLanguageModel, device: &Device| {
        let image = px.narrow(0, 1, 1).unwrap().to_device(device).unwrap();
        let params = tokenformer::SamplingParams::default();
        generate_with_image(model, &image, &prompt, 16, params, |_| {
            Ok(std::ops::ControlFlow::Continue(()))
        })
        .unwrap()
    };
    let want = run(&cpu, &Device::Cpu);
    assert!(want.len() > 1, "{want:?}");
    assert_eq!(run(&on_gpu, &gpu), want);
    // Both images' prompts decoded together on the GPU: each the CPU's tokens alone.
    let prompts = [prompt.clone(), prompt[..3].to_vec()];
    let alone: Vec<Vec<u32>> = (0..2)
        .map(|i| {
            let image = px.narrow(0, i, 1).unwrap();
            let params = tokenformer::SamplingParams::default();
            generate_with_image(&cpu, &image, &prompts[i], 16, params, |_| {
                Ok(std::ops::ControlFlow::Continue(()))
            })
            .unwrap()
        })
        .collect();
    let images: Vec<Tensor> = (0..2)
        .map(|i| px.narrow(0, i, 1).unwrap().to_device(&gpu).unwrap())
        .collect();
    let kv = tokenformer::KvDtype::F32;
    let params = tokenformer::SamplingParams::default();
    let together = tokenformer::generate::generate_batch_with_images(
        &on_gpu,
        kv,
        &images,
        &prompts,
        16,
        params,
        2,
        |_, _| Ok(std::ops::ControlFlow::Continue(())),
    )
    .unwrap();
    assert_eq!(together, alone);
}

/// The shipped merged model in bf16 on the GPU: the greedy continuation of "a
/// handwritten" after each shipped digit image, decoded together, is the f32 CPU's
/// on at least 99 % of them (as the classifier's top-1).
#[test]
fn the_merged_model_in_bf16_on_the_gpu_captions_the_digits_as_f32_does() {
    let Some((gpu, _)) = gpu() else { return };
    let files = locate(&zoo("tiny-digits-vl"));
    let tok = loader::load_tokenizer(&files).unwrap();
    let cpu = loader::load_vl(&files, &Device::Cpu).unwrap();
    let bf16 = loader::load_vl_in(&files, &gpu, DType::BF16).unwrap();
    let want = digit_captions(&cpu, &tok, &Device::Cpu, 3);
    let got = digit_captions(&bf16, &tok, &gpu, 3);
    let same = want.iter().zip(&got).filter(|(a, b)| a == b).count();
    eprintln!(
        "digit captions bf16 (GPU) = f32 (CPU) on {same}/{}",
        want.len()
    );
    assert!(same as f64 >= 0.99 * want.len() as f64);
}

/// Scoring text after an image on the GPU (`ImageTextModel::loglikelihood`, one image's
/// tokens broadcast to a batch of captions; `score`): in f32 the CPU's log-probabilities
/// within 1e-4, and in bf16 the same zero-shot class as f32 on ≥ 99 % of the digits.
#[test]
fn scoring_captions_after_an_image_on_the_gpu_equals_the_cpu() {
    use tokenformer::{ComputeDtype, ImageTextModel, PretrainedOptions};
    let Some((_, spec)) = gpu() else { return };
    let name = zoo("tiny-digits-vl");
    let name = name.to_str().unwrap();
    let on = |dtype| PretrainedOptions {
        device: spec.parse().unwrap(),
        dtype,
        ..Default::default()
    };
    let cpu = ImageTextModel::from_pretrained(name, &Default::default()).unwrap();
    let f32 = ImageTextModel::from_pretrained(name, &on(ComputeDtype::F32)).unwrap();
    let bf16 = ImageTextModel::from_pretrained(name, &on(ComputeDtype::Bf16)).unwrap();
    let names = [
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    ];
    let pairs: Vec<(&str, String)> = names
        .iter()
        .map(|n| ("a handwritten", format!(" {n}")))
        .collect();
    let best = |ll: &[tokenformer::scoring::Loglikelihood]| {
        (0..ll.len())
            .max_by(|&a, &b| ll[a].logprob.total_cmp(&ll[b].logprob))
            .unwrap()
    };
    let images = digit_images();
    let mut same = 0;
    for (i, image) in images.iter().enumerate() {
        let want = cpu.loglikelihood(image, &pairs).unwrap();
        let got = f32.loglikelihood(image, &pairs).unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g.logprob - w.logprob).abs() < 1e-4,
                "{}: {got:?} vs {want:?}",
                image.display()
            );
            assert_eq!(g.is_greedy, w.is_greedy, "{}", image.display());
        }
        same += usize::from(best(&bf16.loglikelihood(image, &pairs).unwrap()) == best(&want));
        if i == 0 {
            let text = "a handwritten seven";
            let (w, g) = (
                cpu.score(image, text).unwrap(),
                f32.score(image, text).unwrap(),
            );
            close(
                &g.next_token_logprobs,
                &w.next_token_logprobs,
                1e-4,
                "score after an image",
            );
        }
    }
    eprintln!(
        "zero-shot digit class bf16 (GPU) = f32 (CPU) on {same}/{}",
        images.len()
    );
    assert!(same as f64 >= 0.99 * images.len() as f64);
}

/// Three clipped AdamW steps on the GPU against the same steps on the CPU from the same
/// f32 values and gradients: a matrix (weight decay) with frozen rows, a vector (none) and
/// a matrix of 300,000 elements (more than one launch's grid, several pieces of the
/// multi-tensor kernels). With the kernels (`TOKENFORMER_CUDA_KERNELS=1`) the GPU's
/// arithmetic is the CPU's operation for operation, so the bits are equal; with candle's
/// ops, within 1e-6 relative. The gradient norms agree to 1e-12 (both sum in f64).
#[test]
fn clipping_and_adamw_on_the_gpu_equal_the_cpus() {
    use std::collections::BTreeMap;
    use tokenformer::train::clip_grad_norm;
    // Under TOKENFORMER_TEST_GPU=cpu both sides are the CPU: a check of the test itself.
    let Some((gpu, _)) = gpu() else { return };
    let cpu = Device::Cpu;
    let shapes: [(&str, &[usize]); 3] = [("a", &[40, 9]), ("b", &[33]), ("c", &[600, 500])];
    let run = |dev: &Device| -> (Vec<Vec<f32>>, Vec<f64>) {
        let vars: BTreeMap<String, candle_core::Var> = shapes
            .iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let n: usize = shape.iter().product();
                let v: Vec<f32> = (0..n).map(|j| ((j * 7 + i) as f32 * 0.618).sin()).collect();
                let t = Tensor::from_vec(v, *shape, dev).unwrap();
                (name.to_string(), candle_core::Var::from_tensor(&t).unwrap())
            })
            .collect();
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut opt = AdamW::new(vars.clone(), cfg).unwrap();
        opt.freeze_rows("a", 3);
        let mut norms = Vec::new();
        for step in 0..3 {
            // A loss whose gradient is sin(step + 3·x) for each variable, the sines taken
            // on the CPU (a GPU's sin may differ in the last bit) from the variable's
            // values, which the steps keep equal on both devices.
            let loss = vars
                .values()
                .map(|v| {
                    let x = v.as_tensor().to_device(&Device::Cpu).unwrap();
                    let w = ((x * 3.0).unwrap() + step as f64).unwrap().sin().unwrap();
                    (v.as_tensor() * w.to_device(dev).unwrap())
                        .unwrap()
                        .sum_all()
                        .unwrap()
                })
                .reduce(|a, b| (a + b).unwrap())
                .unwrap();
            let mut grads = loss.backward().unwrap();
            norms.push(clip_grad_norm(&mut grads, vars.values(), 100.0).unwrap());
            opt.step(&grads, 1e-2).unwrap();
        }
        let values = vars
            .values()
            .map(|v| f32s(&v.as_tensor().flatten_all().unwrap()))
            .collect();
        (values, norms)
    };
    let ((got, got_norms), (want, want_norms)) = (run(&gpu), run(&cpu));
    // The norm (~350) is above 100 at every step: each step clips.
    for (a, b) in got_norms.iter().zip(&want_norms) {
        assert!(*b > 100.0, "{b}");
        assert!((a - b).abs() <= 1e-12 * b, "gradient norm {a} vs {b}");
    }
    let exact = tokenformer::kernels::cuda_kernels_enabled();
    for ((name, _), (g, w)) in shapes.iter().zip(got.iter().zip(&want)) {
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            if exact {
                assert_eq!(a.to_bits(), b.to_bits(), "{name}[{i}]: {a} vs {b}");
            } else {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "{name}[{i}]: {a} vs {b}"
                );
            }
        }
    }
}

/// `eval pile` through the batched scorer (its reductions on the GPU) against the CPU.
#[test]
fn the_pile_evaluation_on_the_gpu_equals_the_cpus() {
    let Some((_, spec)) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = zoo("examples").join("kjv-val.jsonl");
    let run = |device: &str, dtype: &str| -> Value {
        let json = dir.path().join(format!("{device}-{dtype}.json"));
        let (o, _, err) = tokenformer(&[
            "eval",
            "pile",
            "--model",
            zoo("tiny-kjv-lm").to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--max-length",
            "64",
            "--device",
            device,
            "--dtype",
            dtype,
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{device} {dtype}: {err}");
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
    };
    // The report's first `token_perplexity` (the whole run's).
    fn find(v: &Value) -> Option<f64> {
        match v {
            Value::Object(m) => m
                .get("token_perplexity")
                .and_then(Value::as_f64)
                .or_else(|| m.values().find_map(find)),
            Value::Array(a) => a.iter().find_map(find),
            _ => None,
        }
    }
    let ppl = |v: &Value| find(v).unwrap_or_else(|| panic!("no token_perplexity in {v}"));
    let cpu = ppl(&run("cpu", "f32"));
    let gpu32 = ppl(&run(&spec, "f32"));
    let gpu16 = ppl(&run(&spec, "bf16"));
    eprintln!("eval pile token perplexity: CPU {cpu}, GPU f32 {gpu32}, GPU bf16 {gpu16}");
    assert!((gpu32 / cpu - 1.0).abs() < 1e-5, "{gpu32} vs {cpu}");
    assert!((gpu16 / cpu - 1.0).abs() < 5e-3, "{gpu16} vs {cpu}");
}

/// Two runs of four steps: one whole on `a`, one saved after two steps on `a` and
/// resumed on `b`; the final weights agree (f32 on two devices: to 1e-4).
#[test]
fn a_run_resumed_on_the_other_device_equals_the_uninterrupted_one() {
    let Some((_, spec)) = gpu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let base = train::tiny_lm_run(tmp.path());
    let text = fixtures().join("train-text.txt");
    let text = text.to_str().unwrap();
    let start = |out: &Path, device: &str| -> Vec<String> {
        let mut a = base.clone();
        a.extend(
            [
                "--steps",
                "4",
                "--save-every",
                "2",
                "--out",
                out.to_str().unwrap(),
                "--device",
                device,
            ]
            .map(String::from),
        );
        a
    };
    let resume = |out: &Path, device: &str| -> Vec<String> {
        let o = out.to_str().unwrap();
        [
            "--resume", o, "--out", o, "--data", text, "--device", device,
        ]
        .map(String::from)
        .to_vec()
    };
    let call = |args: Vec<String>, env: &[(&str, &str)]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        train::tokenformer_train(&args, env)
    };
    for (i, (first, then)) in [(spec.as_str(), "cpu"), ("cpu", spec.as_str())]
        .into_iter()
        .enumerate()
    {
        let whole = tmp.path().join(format!("whole-{i}"));
        let parts = tmp.path().join(format!("parts-{i}"));
        let o = call(start(&whole, first), &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let o = call(
            start(&parts, first),
            &[("TOKENFORMER_TRAIN_ABORT_AFTER_STEP", "2")],
        );
        assert_eq!(o.status.code(), Some(137));
        let o = call(resume(&parts, then), &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let a = train::weights(&whole.join("checkpoint-000004"));
        let b = train::weights(&parts.join("checkpoint-000004"));
        for (name, t) in &a {
            let d = max_rel(&f32s(&b[name]), &f32s(t));
            assert!(d < 1e-4, "{first} then {then}: {name} differs by {d}");
        }
    }
}

/// A CUDA device for the tests of the project's own kernels, which have no CPU
/// version: `None` (and a note) without one, `TOKENFORMER_TEST_GPU=cpu` included.
fn cuda() -> Option<Device> {
    let (dev, _) = gpu()?;
    if dev.is_cuda() {
        eprintln!(
            "TOKENFORMER_CUDA_KERNELS in the model paths: {}",
            tokenformer::kernels::cuda_kernels_enabled()
        );
        Some(dev)
    } else {
        eprintln!("skipped: the kernel runs on CUDA only");
        None
    }
}

/// Θ as one GPU kernel (what inference runs there under
/// `TOKENFORMER_CUDA_KERNELS=1`) against its definition in candle ops on the same
/// device, for each activation and dtype.
#[test]
fn the_theta_kernel_equals_the_definition() {
    use tokenformer::pattention::{theta, Activation};
    let Some(gpu) = cuda() else { return };
    // 1000 columns: not a multiple of the block's threads.
    let s = (Tensor::randn(0f32, 1.0, (37, 1000), &gpu).unwrap() * 3.0).unwrap();
    for act in [
        Activation::L2NormGelu,
        Activation::GeluL2Norm,
        Activation::Softmax,
    ] {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 2e-3)] {
            let x = s.to_dtype(dtype).unwrap();
            let want = f32s(&theta(&x.to_dtype(DType::F32).unwrap(), act, 1000).unwrap());
            let got = tokenformer::kernels::cuda::theta(&x, act, 1000).unwrap();
            assert_eq!(got.dtype(), dtype);
            let d = max_rel(&f32s(&got), &want);
            assert!(d < tol, "{act:?} {dtype:?}: {d}");
        }
    }
}

/// Rotary positions for queries and keys stacked as the fused q/k/v product leaves
/// them (one launch) give the CPU's bits in f32, bf16 and f16: the kernel rounds
/// each product and difference as the CPU does, with no fused multiply-add.
#[test]
fn the_rotary_kernel_gives_the_cpus_bits() {
    use tokenformer::kernels::cuda::rotary_heads;
    let Some(gpu) = cuda() else { return };
    let (b, t, h, hd, dims, positions, offset) = (2, 7, 12, 64, 16, 64, 40);
    let angles = Tensor::randn(0f32, 20.0, (positions, dims / 2), &Device::Cpu).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let qkv = Tensor::randn(0f32, 1.0, (3, b, t, h, hd), &Device::Cpu).unwrap();
    // From the first of the stacked q/k/v, and from the second: a view that starts past
    // its storage's start, as the backward's ∂k does.
    for (dtype, first) in [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .flat_map(|d| [(d, 0), (d, 1)])
    {
        let qk = qkv
            .to_dtype(dtype)
            .unwrap()
            .narrow(0, first, 2)
            .unwrap()
            .transpose(2, 3)
            .unwrap();
        let want = rotary_heads(&qk, &cos, &sin, dims, offset).unwrap();
        let on = |x: &Tensor| x.to_device(&gpu).unwrap();
        let got = rotary_heads(&on(&qk), &on(&cos), &on(&sin), dims, offset).unwrap();
        assert_eq!((got.dtype(), got.dims()), (dtype, want.dims()));
        let bits = |x: &Tensor| -> Vec<u32> { f32s(x).iter().map(|v| v.to_bits()).collect() };
        let differ = bits(&got)
            .iter()
            .zip(bits(&want))
            .filter(|(a, b)| *a != b)
            .count();
        assert_eq!(
            differ, 0,
            "{dtype:?} from stack entry {first}: {differ} elements differ from the CPU's"
        );
    }
}

/// Inference's residual and norm in one kernel: the sum is the GPU's own addition bit
/// for bit, and its rows normalised as the LayerNorm kernel normalises that sum.
#[test]
fn the_residual_and_norm_kernel_equals_the_two_ops() {
    use tokenformer::kernels::cuda::{add_layer_norm, layer_norm};
    let Some(gpu) = cuda() else { return };
    let x = Tensor::randn(0f32, 3.0, (5, 7, 768), &gpu).unwrap();
    let a = Tensor::randn(0f32, 1.0, (5, 7, 768), &gpu).unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let (x, a) = (x.to_dtype(dtype).unwrap(), a.to_dtype(dtype).unwrap());
        let out = add_layer_norm(&x, &a, 1e-5).unwrap();
        let sum = (&x + &a).unwrap();
        let want = [sum.clone(), layer_norm(&sum, 1e-5).unwrap()];
        for (i, want) in want.iter().enumerate() {
            let got = out.get(i).unwrap();
            assert_eq!((got.dtype(), got.dims()), (dtype, want.dims()));
            // bf16 and f16 sums: candle may round the addition differently (one ulp).
            let tol = if dtype == DType::F32 { 0.0 } else { 1e-2 };
            let d = max_rel(&f32s(&got), &f32s(want));
            assert!(d <= tol, "{dtype:?} part {i}: {d}");
        }
    }
}

/// Training's Θ on the GPU (`kernels::cuda::trainable_theta`, a CUDA kernel each way)
/// against the same op on the CPU in f64 from the same rounded inputs: values and
/// the gradient of Σ Θ(s)·w, for each dtype; in f32 with an all-zero row (whose
/// clamped norm makes the gradient √n / 1e-30 · GELU′(0) · w, too large for f16).
#[test]
fn the_training_theta_kernels_equal_the_cpus_op_and_its_gradient() {
    use tokenformer::kernels::cuda::trainable_theta;
    let Some(gpu) = cuda() else { return };
    let (rows, n) = (37, 1000);
    let s = (Tensor::randn(0f32, 1.0, (rows, n), &gpu).unwrap() * 3.0).unwrap();
    let zero = Tensor::zeros((1, n), DType::F32, &gpu).unwrap();
    let w = Tensor::randn(0f32, 1.0, (rows + 1, n), &gpu).unwrap();
    let on_cpu = |t: &Tensor| {
        t.to_dtype(DType::F64)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap()
    };
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 2e-3)] {
        let s = if dtype == DType::F32 {
            Tensor::cat(&[&s, &zero], 0).unwrap()
        } else {
            s.clone()
        };
        let s = s.to_dtype(dtype).unwrap();
        let w = w
            .narrow(0, 0, s.dim(0).unwrap())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let theta = |x: &Tensor| trainable_theta(x, n).unwrap();
        let (y, dy) = value_and_grad(&s, &w, theta);
        let (want_y, want_dy) = value_and_grad(&on_cpu(&s), &on_cpu(&w), theta);
        assert_eq!((y.dtype(), dy.dtype()), (dtype, dtype));
        let d = max_rel(&f32s(&y), &f32s(&want_y));
        assert!(d < tol, "{dtype:?} values: {d}");
        let d = max_rel(&f32s(&dy), &f32s(&want_dy));
        assert!(d < tol, "{dtype:?} gradient: {d}");
    }
}

/// f(x) and the gradient of Σ f(x)·w with respect to x.
fn value_and_grad(x: &Tensor, w: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let x = candle_core::Var::from_tensor(x).unwrap();
    let y = f(x.as_tensor());
    let grads = (&y * w).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = grads.get(x.as_tensor()).expect("a gradient").clone();
    (y, dx)
}

/// Training attention's softmax kernel (causal or not, square or over a longer past)
/// against the same softmax in plain candle ops in f32 on the same GPU: values and
/// the gradient of Σ softmax·w, from the same rounded inputs for each dtype.
#[test]
fn the_training_softmax_kernels_equal_the_plain_ops_and_their_gradient() {
    use tokenformer::kernels::cuda::softmax_scaled;
    let Some(gpu) = cuda() else { return };
    let scale = 0.125;
    for (queries, keys) in [(77, 77), (5, 300), (1, 1500)] {
        let s = (Tensor::randn(0f32, 1.0, (2, 3, queries, keys), &gpu).unwrap() * 8.0).unwrap();
        let w = Tensor::randn(0f32, 1.0, s.dims(), &gpu).unwrap();
        // 0 where query q sees key j (j ≤ q + keys − queries), else −∞.
        let mask: Vec<f32> = (0..queries)
            .flat_map(|q| {
                (0..keys).map(move |j| {
                    if j <= q + keys - queries {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (queries, keys), &gpu).unwrap();
        for causal in [false, true] {
            let plain = |x: &Tensor| {
                let mut z = (x * scale).unwrap();
                if causal {
                    z = z.broadcast_add(&mask).unwrap();
                }
                let e = z
                    .broadcast_sub(&z.max_keepdim(3).unwrap())
                    .unwrap()
                    .exp()
                    .unwrap();
                e.broadcast_div(&e.sum_keepdim(3).unwrap()).unwrap()
            };
            for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 2e-3)] {
                let (x, w) = (s.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
                let kernel = |x: &Tensor| softmax_scaled(x, scale, causal).unwrap();
                let what = format!("{queries}x{keys} causal {causal} {dtype:?}");
                equals_the_plain_ops(&x, &w, kernel, plain, tol, &what);
            }
        }
    }
}

fn f32_of(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F32).unwrap()
}

/// `kernel` keeps x's dtype, and its values and the gradient of Σ kernel(x)·w equal
/// `plain`'s in f32 from the same rounded x and w, within `tol`.
fn equals_the_plain_ops(
    x: &Tensor,
    w: &Tensor,
    kernel: impl Fn(&Tensor) -> Tensor,
    plain: impl Fn(&Tensor) -> Tensor,
    tol: f32,
    what: &str,
) {
    let (y, dx) = value_and_grad(x, w, kernel);
    assert_eq!((y.dtype(), dx.dtype()), (x.dtype(), x.dtype()), "{what}");
    let (want, want_dx) = value_and_grad(&f32_of(x), &f32_of(w), plain);
    close(&f32s(&y), &f32s(&want), tol, &format!("{what} values"));
    close(
        &f32s(&dx),
        &f32s(&want_dx),
        tol,
        &format!("{what} gradient"),
    );
}

/// Training's cross-entropy by the log-softmax-gather kernel and its backward against
/// the same loss in plain candle ops in f32 on the same GPU: the loss and the
/// gradient of 3 · loss, from the same rounded logits for each dtype, over a
/// vocabulary-sized row set and the ViT's 10 classes.
#[test]
fn the_training_cross_entropy_kernels_equal_the_plain_ops_and_their_gradient() {
    let Some(gpu) = cuda() else { return };
    let three = Tensor::new(3f32, &gpu).unwrap();
    for (n, classes) in [(37, 50_304), (64, 10)] {
        let x = (Tensor::randn(0f32, 1.0, (n, classes), &gpu).unwrap() * 4.0).unwrap();
        let targets: Vec<u32> = (0..n).map(|i| (i * 7919 % classes) as u32).collect();
        let index = Tensor::new(targets.as_slice(), &gpu)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let plain = |z: &Tensor| {
            let shifted = z.broadcast_sub(&z.max_keepdim(1).unwrap()).unwrap();
            let lse = shifted
                .exp()
                .unwrap()
                .sum_keepdim(1)
                .unwrap()
                .log()
                .unwrap();
            (lse - shifted.gather(&index, 1).unwrap())
                .unwrap()
                .mean_all()
                .unwrap()
        };
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
            let x = x.to_dtype(dtype).unwrap();
            let kernel =
                |x: &Tensor| tokenformer::kernels::cuda::cross_entropy(x, &targets).unwrap();
            let (loss, dx) = value_and_grad(&x, &three, kernel);
            assert_eq!(dx.dtype(), dtype);
            let (want, want_dx) = value_and_grad(&f32_of(&x), &three, plain);
            let what = format!("{n}x{classes} {dtype:?}");
            close(&f32s(&loss), &f32s(&want), 1e-5, &format!("{what} loss"));
            // The gradient's entries are ~1/n; compared relative to the largest.
            let (got, want) = (f32s(&dx), f32s(&want_dx));
            let top = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
            assert!(worst <= tol * top, "{what} gradient: {worst} against {top}");
        }
    }
}

/// Training's LayerNorm kernels (no weight and bias) against the same norm in plain
/// candle ops in f32 on the same GPU: values and the gradient of Σ LN(x)·w, from the
/// same rounded inputs for each dtype, with an offset the mean must remove.
#[test]
fn the_training_layer_norm_kernels_equal_the_plain_ops_and_their_gradient() {
    use tokenformer::kernels::cuda::layer_norm;
    let Some(gpu) = cuda() else { return };
    let eps = 1e-5;
    let plain = |z: &Tensor| {
        let centred = z.broadcast_sub(&z.mean_keepdim(2).unwrap()).unwrap();
        let var = centred.sqr().unwrap().mean_keepdim(2).unwrap();
        centred
            .broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
            .unwrap()
    };
    for n in [768, 1000, 31] {
        let x = (Tensor::randn(0f32, 2.0, (3, 41, n), &gpu).unwrap() + 5.0).unwrap();
        let w = Tensor::randn(0f32, 1.0, x.dims(), &gpu).unwrap();
        for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2), (DType::F16, 5e-3)] {
            let (x, w) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
            let kernel = |x: &Tensor| layer_norm(x, eps).unwrap();
            equals_the_plain_ops(&x, &w, kernel, plain, tol, &format!("n {n} {dtype:?}"));
        }
    }
}

/// `got` equals `want` within `tol` (relative, as [`max_rel`]) where `want` is
/// finite, and exactly where it is not (`max_rel` alone would let a NaN through).
fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_finite() {
            (g - w).abs() / w.abs().max(1.0) < tol
        } else {
            g == w
        };
        assert!(ok, "{what}: [{i}] {g} vs {w} (tolerance {tol})");
    }
}

/// Attention in plain candle ops in f32 (the model's path without the kernel), differentiable:
/// q [b, h, t, hd] over k, v [b, h, keys, hd], causal counting from the end, as
/// [b, t, h·hd].
fn plain_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
    let f = |x: &Tensor| x.to_dtype(DType::F32).unwrap().contiguous().unwrap();
    let (q, k, v) = (f(q), f(k), f(v));
    let (b, h, t, hd) = q.dims4().unwrap();
    let keys = k.dim(2).unwrap();
    let scores = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
    let scores = if causal {
        let past = keys - t;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| {
                (0..keys).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, keys), q.device()).unwrap();
        scores.broadcast_add(&mask).unwrap()
    } else {
        scores
    };
    // The softmax in plain ops: candle's fused softmax has no backward, and the
    // training attention test differentiates this.
    let e = scores
        .broadcast_sub(&scores.max_keepdim(3).unwrap())
        .unwrap()
        .exp()
        .unwrap();
    e.broadcast_div(&e.sum_keepdim(3).unwrap())
        .unwrap()
        .matmul(&v)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((b, t, h * hd))
        .unwrap()
}

/// The flash attention kernel against plain candle ops on the same GPU, with the
/// model's layouts (q a head-split view of [b, t, h·hd], v a view into a longer
/// cache), for tile-ragged lengths, one query, a past (KV cache) and head sizes
/// of each kernel instance, causal and not, in f32, bf16 and f16.
#[test]
fn the_attention_kernel_equals_the_plain_ops() {
    use tokenformer::kernels::cuda::flash_attention;
    // On the CPU, the op's f64 loops in f32: a check of this test itself.
    let Some((gpu, _)) = gpu() else { return };
    let dtypes: &[(DType, f32)] = if gpu.is_cuda() {
        // The tensor-core kernel rounds the weights p to bf16 or f16 before p·v, as
        // FlashAttention does: the emulator puts it within 5.2e-3 and 7.4e-4 of double
        // precision.
        &[
            (DType::F32, 1e-4),
            (DType::BF16, 8e-3),
            (DType::F16, 1.5e-3),
        ]
    } else {
        &[(DType::F32, 1e-4)]
    };
    // (b, h, t, keys, hd): 70 queries are 2 blocks of 32 and a ragged one, 70 and 133
    // keys ragged tiles; t = 1 is a decode step; hd 8, 80, 100 and 200 leave lanes
    // idle, 96 is the 1.5B's (its own tensor-core instance); 40 queries over 150 keys
    // take the tiled f32 kernel over a past; one and five queries over 1,000 and 700
    // cached keys take decoding's split over keys (8 and 11 chunks, merged).
    let cases = [
        (1, 12, 1, 1000, 64),
        (2, 2, 5, 700, 128),
        (2, 3, 70, 70, 64),
        (1, 2, 1, 1, 64),
        (1, 2, 1, 37, 64),
        (2, 2, 5, 133, 128),
        (1, 4, 33, 33, 8),
        (1, 2, 17, 50, 100),
        (1, 2, 40, 90, 80),
        (1, 2, 20, 20, 96),
        (1, 2, 40, 150, 48),
        (1, 1, 40, 40, 256),
        (1, 2, 65, 97, 200),
    ];
    for (b, h, t, keys, hd) in cases {
        // q as the model's split_heads view: [b, t, h, hd] transposed, no copy.
        let q = Tensor::randn(0f32, 1.0, (b, t, h, hd), &gpu)
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let k = (Tensor::randn(0f32, 1.0, (b, h, keys, hd), &gpu).unwrap() * 1.5).unwrap();
        // v as a cache's view: the first `keys` of `keys + 7` positions.
        let v = Tensor::randn(0f32, 1.0, (b, h, keys + 7, hd), &gpu)
            .unwrap()
            .narrow(2, 0, keys)
            .unwrap();
        for causal in [true, false] {
            for &(dtype, tol) in dtypes {
                let c = |x: &Tensor| x.to_dtype(dtype).unwrap();
                let (qd, kd, vd) = (c(&q), c(&k), c(&v));
                // The reference from the same (rounded) inputs, in f32.
                let want = plain_attention(&qd, &kd, &vd, causal);
                let got = flash_attention(&qd, &kd, &vd, causal).unwrap();
                assert_eq!(got.dtype(), dtype);
                assert_eq!(got.dims(), &[b, t, h * hd]);
                let what =
                    format!("b {b} h {h} t {t} keys {keys} hd {hd} causal {causal} {dtype:?}");
                close(&f32s(&got), &f32s(&want), tol, &what);
                if causal && keys == t {
                    // The first query sees only the first key: its output is v's first row.
                    let first = got.narrow(1, 0, 1).unwrap().reshape((b, h, hd)).unwrap();
                    let v0 = vd.narrow(2, 0, 1).unwrap().reshape((b, h, hd)).unwrap();
                    let d = max_rel(&f32s(&first), &f32s(&v0));
                    assert!(d < 1e-6, "{what}: first row {d}");
                }
            }
        }
    }
    // What the kernel does not take is an error, not a wrong answer.
    let q = Tensor::zeros((1, 1, 4, 8), DType::F32, &gpu).unwrap();
    let k = Tensor::zeros((1, 1, 3, 8), DType::F32, &gpu).unwrap();
    assert!(
        flash_attention(&q, &k, &k, true).is_err(),
        "fewer keys than causal queries"
    );
    let big = Tensor::zeros((1, 1, 4, 300), DType::F32, &gpu).unwrap();
    assert!(
        flash_attention(&big, &big, &big, false).is_err(),
        "head size 300"
    );
    let k16 = k.to_dtype(DType::F16).unwrap();
    assert!(
        flash_attention(&q, &k16, &k16, false).is_err(),
        "mixed dtypes"
    );
}

/// Training attention by the flash kernels, forward and backward, against plain candle
/// ops in f32 on the same GPU: values and the gradients of Σ o·w in q, k and v (q the
/// model's head-split view), square with ragged tiles (training's case) and over a
/// longer past, causal and not, in f32, bf16 and f16 from the same rounded inputs (bf16
/// and f16 at head sizes up to 64 take the tensor-core backward, above it the SIMT one).
#[test]
fn the_training_attention_kernels_equal_the_plain_ops_and_their_gradients() {
    use tokenformer::kernels::cuda::flash_attention;
    // On the CPU (`TOKENFORMER_TEST_GPU=cpu`) the op's f64 loops, in f32 only: a check of
    // this test itself.
    let Some((gpu, _)) = gpu() else { return };
    let dtypes: &[(DType, f32)] = if gpu.is_cuda() {
        &[(DType::F32, 1e-4), (DType::BF16, 3e-2), (DType::F16, 4e-3)]
    } else {
        &[(DType::F32, 1e-4)]
    };
    for (b, h, t, keys, hd) in [
        (2, 3, 70, 70, 64),
        (1, 2, 5, 133, 128),
        (1, 2, 33, 33, 8),
        (1, 2, 20, 150, 48),
    ] {
        let q = Tensor::randn(0f32, 1.0, (b, t, h, hd), &gpu).unwrap();
        let k = (Tensor::randn(0f32, 1.0, (b, h, keys, hd), &gpu).unwrap() * 1.5).unwrap();
        let v = Tensor::randn(0f32, 1.0, (b, h, keys, hd), &gpu).unwrap();
        let w = Tensor::randn(0f32, 1.0, (b, t, h * hd), &gpu).unwrap();
        for causal in [true, false] {
            for &(dtype, tol) in dtypes {
                let c = |x: &Tensor| {
                    candle_core::Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap()
                };
                let (qd, kd, vd) = (c(&q), c(&k), c(&v));
                let wd = w.to_dtype(dtype).unwrap();
                let what =
                    format!("b {b} h {h} t {t} keys {keys} hd {hd} causal {causal} {dtype:?}");
                let run = |kernel: bool| {
                    let qv = qd.as_tensor().transpose(1, 2).unwrap();
                    let o = if kernel {
                        flash_attention(&qv, kd.as_tensor(), vd.as_tensor(), causal).unwrap()
                    } else {
                        plain_attention(&qv, kd.as_tensor(), vd.as_tensor(), causal)
                    };
                    let grads = (f32_of(&o) * f32_of(&wd))
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let g = |x: &candle_core::Var| {
                        grads.get(x.as_tensor()).expect("a gradient").clone()
                    };
                    (o, [g(&qd), g(&kd), g(&vd)])
                };
                let (got, got_g) = run(true);
                let (want, want_g) = run(false);
                assert_eq!(got.dtype(), dtype, "{what}");
                close(&f32s(&got), &f32s(&want), tol, &format!("{what}: values"));
                for (name, (a, e)) in ["q", "k", "v"].iter().zip(got_g.iter().zip(&want_g)) {
                    assert_eq!(a.dtype(), dtype, "{what}: ∂{name}");
                    assert_eq!(a.dims(), e.dims(), "{what}: ∂{name}");
                    close(&f32s(a), &f32s(e), tol, &format!("{what}: ∂{name}"));
                }
            }
        }
    }
}

/// The log-softmax-gather kernel against candle's log-softmax, gather and a first
/// argmax on the same GPU: vocabularies that are not a multiple of the block
/// (including 1 and 50,304, the models' own), ties (the first index wins), −inf
/// logits, f32 and half-precision logits (whose reference is computed in f32 from
/// the same rounded values, so the tolerance stays an f32 one).
#[test]
fn the_log_softmax_gather_kernel_equals_the_plain_ops() {
    use tokenformer::kernels::cuda::target_logprobs;
    let Some(gpu) = cuda() else { return };
    for vocab in [1usize, 31, 777, 1000, 50_304] {
        let n = 37;
        let mut rows: Vec<f32> = Tensor::randn(0f32, 4.0, (n, vocab), &Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        if vocab >= 31 {
            // Row 0: one value everywhere (argmax 0); row 1: a maximum at 5 and 9
            // (argmax 5); rows 2 and 3: −inf except at 3 and 20, row 2 scoring 3
            // (log p = log ½), row 3 scoring 4 (log p = −inf).
            rows[..vocab].fill(0.25);
            rows[vocab + 5] = 30.0;
            rows[vocab + 9] = 30.0;
            rows[2 * vocab..4 * vocab].fill(f32::NEG_INFINITY);
            for r in [2, 3] {
                rows[r * vocab + 3] = 1.0;
                rows[r * vocab + 20] = 1.0;
            }
        }
        let mut targets: Vec<u32> = (0..n).map(|i| ((i * 7919 + 3) % vocab) as u32).collect();
        if vocab >= 31 {
            (targets[2], targets[3]) = (3, 4);
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let logits = Tensor::from_vec(rows.clone(), (n, vocab), &gpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let got = target_logprobs(&logits, &targets).unwrap();
            // The reference in f32 from the same (rounded) logits.
            let x = logits.to_dtype(DType::F32).unwrap();
            let logp = candle_nn::ops::log_softmax(&x, 1).unwrap();
            let index = Tensor::new(targets.as_slice(), &gpu)
                .unwrap()
                .unsqueeze(1)
                .unwrap();
            let want_lp = f32s(&logp.gather(&index, 1).unwrap());
            // lse = x − log_softmax(x) at any finite entry: take each row's maximum.
            let host: Vec<Vec<f32>> = x.to_vec2().unwrap();
            let want_lse: Vec<f32> = host
                .iter()
                .map(|r| {
                    let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let s: f64 = r.iter().map(|&v| ((v - m) as f64).exp()).sum();
                    (m as f64 + s.ln()) as f32
                })
                .collect();
            let want_argmax: Vec<u32> = host.iter().map(|r| first_max(r).0).collect();
            let what = format!("vocab {vocab} {dtype:?}");
            close(&got.logprob, &want_lp, 1e-4, &format!("{what}: log p"));
            close(&got.logsumexp, &want_lse, 1e-4, &format!("{what}: lse"));
            assert_eq!(got.argmax, want_argmax, "{what}: argmax");
            if vocab >= 31 {
                assert_eq!(got.argmax[..2], [0, 5], "{what}: ties");
                let lp = got.logprob[2];
                assert!((lp + std::f32::consts::LN_2).abs() < 1e-6, "{what}: {lp}");
                assert_eq!(
                    got.logprob[3],
                    f32::NEG_INFINITY,
                    "{what}: a −inf logit's log p"
                );
            }
            if vocab == 1 {
                assert!(
                    got.logprob.iter().all(|&v| v == 0.0),
                    "{what}: one token is certain"
                );
            }
        }
    }
    let logits = Tensor::zeros((2, 10), DType::F32, &gpu).unwrap();
    assert!(
        target_logprobs(&logits, &[1, 10]).is_err(),
        "a target outside the vocabulary"
    );
    assert!(
        target_logprobs(&logits, &[1]).is_err(),
        "fewer targets than rows"
    );
}
