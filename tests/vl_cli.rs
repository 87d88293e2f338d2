//! `tokenformer generate --image` on a merged vision-language model built from
//! the shipped fixtures (official-lm-tiny + vit-tiny): the binary's greedy
//! continuation equals the mixed forward pass [image tokens; text tokens]
//! recomputed from scratch at every step, and text-only generation on the
//! merged folder is the source language model's.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use tokenformer::loader;
use tokenformer::models::vl::{self, VisionLanguageModel};
use tokenformer::vision::EvalTransform;

const PROMPT: &str = "A photo of a fish in the";
const NEW_TOKENS: usize = 6;

fn weights(spec: &Path) -> loader::LoadedWeights {
    let files = loader::locate(spec.to_str().unwrap(), &Default::default()).unwrap();
    loader::read_weights(&files, Some(DType::F32), &Device::Cpu).unwrap()
}

/// Writes the merged model (random bridge values, zero bridge keys) into `dir`.
fn write_vl_folder(dir: &Path) {
    let vw = weights(&common::fixtures().join("vit-tiny-imagenet/vit-tiny"));
    let lw = weights(&common::lm_fixture().join("pytorch_model.bin"));
    let vcfg = loader::vit_config(&vw.config, &vw.path).unwrap();
    let lcfg = loader::lm_config(&lw.config, &lw.path).unwrap();
    let cfg = vl::Config::merged(&vcfg, &lcfg, 8).unwrap();
    let mut seed = 10u64;
    let tensors = vl::assemble(&cfg, &vw.tensors, &lw.tensors, |_, r, c| {
        seed += 1;
        Ok(common::randn(
            &mut rand::SeedableRng::seed_from_u64(seed),
            &[r, c],
            0.5,
        ))
    })
    .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .unwrap();
    tokenformer::checkpoint::write_safetensors(dir, &tensors, u64::MAX).unwrap();
    std::fs::copy(common::tokenizer_fixture(), dir.join("tokenizer.json")).unwrap();
}

fn image() -> PathBuf {
    common::fixtures().join("vit-tiny-imagenet/val/n01443537/a.JPEG")
}

/// Greedy continuation without any cache: the whole sequence is run again
/// for every new token, so a cache or routing bug in the CLI path would show.
fn greedy_uncached(
    model: &VisionLanguageModel,
    pixels: Option<&Tensor>,
    prompt: &[u32],
) -> Vec<u32> {
    let eos = model.language().config().eos_token_id;
    let mut ids = prompt.to_vec();
    let mut out = vec![];
    for _ in 0..NEW_TOKENS {
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let (_, logits) = model.forward_mixed(pixels, &input, None).unwrap();
        let last = logits.squeeze(0).unwrap().get(ids.len() - 1).unwrap();
        let next = last.argmax(0).unwrap().to_scalar::<u32>().unwrap();
        out.push(next);
        if next == eos {
            break;
        }
        ids.push(next);
    }
    out
}

fn generate(model: &str, extra: &[&str]) -> String {
    let n = NEW_TOKENS.to_string();
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        &n,
    ];
    args.extend_from_slice(extra);
    let (out, stdout, stderr) = common::tokenformer(&args);
    assert!(out.status.success(), "{args:?}: {stderr}");
    stdout
}

#[test]
fn generate_with_an_image_equals_the_mixed_forward_and_text_only_equals_the_lm() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("vl");
    write_vl_folder(&dir);
    let files = loader::locate(dir.to_str().unwrap(), &Default::default()).unwrap();
    let model = loader::load_vl(&files, &Device::Cpu).unwrap();
    let tokenizer = loader::load_tokenizer(&files).unwrap();
    let prompt = tokenizer.encode(PROMPT, false).unwrap().get_ids().to_vec();
    let transform = EvalTransform::from_config(model.vision().config());
    let pixels = transform
        .batch(vec![transform.load(&image()).unwrap()], &Device::Cpu)
        .unwrap();

    let with_image = greedy_uncached(&model, Some(&pixels), &prompt);
    let text_only = greedy_uncached(&model, None, &prompt);
    assert_eq!(with_image.len(), NEW_TOKENS, "{with_image:?}");
    assert_ne!(
        with_image, text_only,
        "the image should change the continuation"
    );
    let expected = format!(
        "{PROMPT}{}\n",
        tokenizer.decode(&with_image, false).unwrap()
    );

    // The binary: KV cache, image first, greedy by default.
    let image = image();
    let got = generate(dir.to_str().unwrap(), &["--image", image.to_str().unwrap()]);
    assert_eq!(got, expected);

    // The library entry point the CLI uses returns the same ids.
    let ids = tokenformer::generate::generate_with_image(
        &model,
        &pixels,
        &prompt,
        NEW_TOKENS,
        Default::default(),
        |_| Ok(std::ops::ControlFlow::Continue(())),
    )
    .unwrap();
    assert_eq!(ids, with_image);
    // With an f16 KV cache (image keys included): greedy picks the same
    // tokens on this model, by the library and the binary.
    let ids16 = tokenformer::generate::generate_with_image_kv(
        &model,
        tokenformer::KvDtype::F16,
        &pixels,
        &prompt,
        NEW_TOKENS,
        Default::default(),
        |_| Ok(std::ops::ControlFlow::Continue(())),
    )
    .unwrap();
    assert_eq!(ids16, with_image);
    let args = ["--image", image.to_str().unwrap(), "--kv-dtype", "f16"];
    assert_eq!(generate(dir.to_str().unwrap(), &args), expected);

    // Without --image the merged folder generates as the source language model.
    let lm = common::lm_fixture().join("pytorch_model.bin");
    let tok = common::tokenizer_fixture();
    let from_lm = generate(
        lm.to_str().unwrap(),
        &["--tokenizer", tok.to_str().unwrap()],
    );
    let from_vl = generate(dir.to_str().unwrap(), &[]);
    assert_eq!(from_vl, from_lm);
    assert_eq!(
        from_vl,
        format!("{PROMPT}{}\n", tokenizer.decode(&text_only, false).unwrap())
    );
}

#[test]
fn image_with_a_language_model_or_an_unreadable_image_is_a_clear_error() {
    let lm = common::lm_fixture().join("pytorch_model.bin");
    let tok = common::tokenizer_fixture();
    let image = image();
    let vit = common::fixtures().join("vit-tiny-imagenet/vit-tiny");
    for (model, named) in [
        (&lm, &["--image", "tokenformer-vl", "tokenformer-lm"][..]),
        (&vit, &["--image", "tokenformer-vit"][..]),
    ] {
        let res = common::tokenformer(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--tokenizer",
            tok.to_str().unwrap(),
            "--prompt",
            PROMPT,
            "--image",
            image.to_str().unwrap(),
        ]);
        common::assert_clean_failure(&res, named);
    }

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("vl");
    write_vl_folder(&dir);
    let missing = tmp.path().join("missing.jpg");
    let res = common::tokenformer(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        PROMPT,
        "--image",
        missing.to_str().unwrap(),
    ]);
    common::assert_clean_failure(&res, &["missing.jpg"]);

    // 8-bit weights quantise language models only: refused by name.
    let res = common::tokenformer(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        PROMPT,
        "--image",
        image.to_str().unwrap(),
        "--weight-dtype",
        "q8",
    ]);
    common::assert_clean_failure(&res, &["--image", "--weight-dtype q8", "f16"]);
}

/// The shipped merged model in bf16 and f16 (`--dtype`; on the CPU here, the
/// path a GPU takes) and with f16 weights: `generate --image` names the digit
/// of the image as f32 does, alone and as a `--prompts` line.
#[test]
fn generate_with_an_image_in_half_precision_gives_f32s_text() {
    let model = common::zoo("tiny-digits-vl");
    let model = model.to_str().unwrap();
    let digits = common::zoo("examples").join("digits");
    let image = digits.join("seven/0005.png");
    let run = |extra: &[&str]| -> String {
        let mut args = vec!["generate", "--model", model, "--max-new-tokens", "2"];
        args.extend_from_slice(extra);
        let (out, stdout, stderr) = common::tokenformer(&args);
        assert!(out.status.success(), "{args:?}: {stderr}");
        stdout
    };
    let alone = [
        "--prompt",
        "a handwritten",
        "--image",
        image.to_str().unwrap(),
    ];
    let want = run(&alone);
    assert!(want.starts_with("a handwritten seven"), "{want:?}");
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("prompts.jsonl");
    let line = serde_json::json!({ "prompt": "a handwritten", "image": image });
    std::fs::write(&file, format!("{line}\n")).unwrap();
    for flags in [
        ["--dtype", "bf16"],
        ["--dtype", "f16"],
        ["--weight-dtype", "f16"],
    ] {
        let got = run(&[&alone[..], &flags].concat());
        assert_eq!(got, want, "{flags:?}");
        let lines = run(&[
            &["--prompts", file.to_str().unwrap(), "--quiet"],
            &flags[..],
        ]
        .concat());
        let v: serde_json::Value = serde_json::from_str(lines.trim()).unwrap();
        assert_eq!(
            format!("a handwritten{}\n", v["generated_text"].as_str().unwrap()),
            want,
            "--prompts {flags:?}"
        );
    }
}

/// `generate --prompts` on a merged model: a line with an `image` (relative to
/// the file's folder) gets what `generate --image` gives it, a line without one
/// what `generate` gives it (the language route), in the file's order, with
/// fewer sequences in flight than lines; an image line on a language model is
/// an error naming the line.
#[test]
fn prompts_with_images_each_get_what_generate_gives_them_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("vl");
    write_vl_folder(&dir);
    let data = tmp.path().join("data");
    std::fs::create_dir_all(data.join("img")).unwrap();
    let val = common::fixtures().join("vit-tiny-imagenet/val");
    for (from, to) in [("n01443537/a.JPEG", "a.jpg"), ("n01518878/d.JPEG", "d.jpg")] {
        std::fs::copy(val.join(from), data.join("img").join(to)).unwrap();
    }
    let lines = [
        (PROMPT, Some("img/a.jpg")),
        ("A photo of", Some("img/d.jpg")),
        (PROMPT, None),
        ("A photo of", Some("img/a.jpg")),
    ];
    let file = data.join("prompts.jsonl");
    let text: String = lines
        .iter()
        .map(|(p, image)| {
            let mut v = serde_json::json!({ "prompt": p });
            if let Some(i) = image {
                v["image"] = (*i).into();
            }
            format!("{v}\n")
        })
        .collect();
    std::fs::write(&file, text).unwrap();
    let model = dir.to_str().unwrap();
    let n = NEW_TOKENS.to_string();
    let (out, stdout, stderr) = common::tokenformer(&[
        "generate",
        "--model",
        model,
        "--prompts",
        file.to_str().unwrap(),
        "--quiet",
        "--batch-size",
        "2",
        "--max-new-tokens",
        &n,
    ]);
    assert!(out.status.success(), "{stderr}");
    let got: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(got.len(), lines.len());
    let mut texts = vec![];
    for (k, ((prompt, image), line)) in lines.iter().zip(&got).enumerate() {
        assert_eq!(line["line"], k + 1);
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--prompt",
            prompt,
            "--max-new-tokens",
            &n,
        ];
        let path = image.map(|i| data.join(i));
        if let Some(p) = &path {
            args.extend(["--image", p.to_str().unwrap()]);
        }
        let (out, alone, stderr) = common::tokenformer(&args);
        assert!(out.status.success(), "{stderr}");
        let want = alone
            .strip_prefix(prompt)
            .unwrap()
            .strip_suffix('\n')
            .unwrap();
        assert_eq!(line["generated_text"], want, "line {}", k + 1);
        texts.push(want.to_string());
    }
    // The image changes the continuation, so no line passes by another's text.
    assert_ne!(texts[0], texts[2]);
    assert_ne!(texts[1], texts[3]);

    let lm = common::lm_fixture().join("pytorch_model.bin");
    let tok = common::tokenizer_fixture();
    let res = common::tokenformer(&[
        "generate",
        "--model",
        lm.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--prompts",
        file.to_str().unwrap(),
        "--quiet",
    ]);
    common::assert_clean_failure(
        &res,
        &["prompts.jsonl line 1", "tokenformer-vl", "tokenformer-lm"],
    );
}

/// The library's front door for merged models, `ImageTextModel`: what `generate
/// --image` prints for one image, the same per pair when several are decoded
/// together, in bf16 and with f16 weights too, and clear errors for a language
/// model, weights it cannot keep and images that do not pair with the prompts.
#[test]
fn image_text_model_generates_what_the_command_line_does() {
    use tokenformer::{ComputeDtype, ImageTextModel, PretrainedOptions, SamplingParams};
    let name = common::zoo("tiny-digits-vl");
    let name = name.to_str().unwrap();
    let vl = ImageTextModel::from_pretrained(name, &Default::default()).unwrap();
    let digits = common::zoo("examples").join("digits");
    let images: Vec<PathBuf> = ["seven", "two", "nine"]
        .iter()
        .map(|d| digits.join(d).join("0010.png"))
        .collect();
    let cli = |image: &Path| -> String {
        let args = [
            "generate",
            "--model",
            name,
            "--prompt",
            "a handwritten",
            "--max-new-tokens",
            "2",
            "--image",
            image.to_str().unwrap(),
        ];
        let (out, stdout, stderr) = common::tokenformer(&args);
        assert!(out.status.success(), "{stderr}");
        stdout
            .strip_prefix("a handwritten")
            .unwrap()
            .trim_end()
            .to_string()
    };
    let want: Vec<String> = images.iter().map(|i| cli(i)).collect();
    assert_eq!(want, [" seven", " two", " nine"]);
    let none: &[&str] = &[];
    let params = SamplingParams::default;
    let one = vl
        .generate(&images[0], "a handwritten", 2, params(), none)
        .unwrap();
    assert_eq!(one.generated_text, want[0]);
    let prompt = vl.tokenizer().encode("a handwritten", false).unwrap();
    assert_eq!(one.prompt_tokens, prompt.get_ids().len());
    assert_eq!(one.generated_tokens, 2);
    let prompts = ["a handwritten"; 3];
    let bf16 = PretrainedOptions {
        dtype: ComputeDtype::Bf16,
        ..Default::default()
    };
    let half = ImageTextModel::from_pretrained(name, &bf16).unwrap();
    assert_eq!(half.model().compute_dtype(), DType::BF16);
    let f16 = PretrainedOptions {
        weights: tokenformer::WeightPrecision::F16,
        ..Default::default()
    };
    let f16 = ImageTextModel::from_pretrained(name, &f16).unwrap();
    let bytes = |m: &ImageTextModel| m.model().language().weight_bytes();
    assert_eq!(2 * bytes(&f16), bytes(&vl));
    for model in [&vl, &half, &f16] {
        let all = model
            .generate_batch(&images, &prompts, 2, params(), none, 2)
            .unwrap();
        let texts: Vec<&str> = all.iter().map(|g| g.generated_text.as_str()).collect();
        assert_eq!(texts, want);
    }

    let err = |r: tokenformer::Result<ImageTextModel>| r.err().expect("refused").to_string();
    let lm = common::zoo("tiny-kjv-lm");
    let e = err(ImageTextModel::from_pretrained(
        lm.to_str().unwrap(),
        &Default::default(),
    ));
    assert!(
        e.contains("tokenformer-lm") && e.contains("tokenformer-vl"),
        "{e}"
    );
    let q8 = PretrainedOptions {
        weights: tokenformer::WeightPrecision::Q8,
        ..Default::default()
    };
    let e = err(ImageTextModel::from_pretrained(name, &q8));
    assert!(
        e.contains("8-bit weights quantise language models only"),
        "{e}"
    );
    // Refused before the model is looked for (or downloaded).
    let e = err(ImageTextModel::from_pretrained("no/such-model-here", &q8));
    assert!(e.contains("8-bit weights"), "{e}");
    let both = PretrainedOptions {
        weights: tokenformer::WeightPrecision::F16,
        dtype: ComputeDtype::Bf16,
        ..Default::default()
    };
    let e = err(ImageTextModel::from_pretrained(name, &both));
    assert!(e.contains("apply to f32 computation"), "{e}");
    let e = vl
        .generate_batch(&images[..2], &prompts, 2, params(), none, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 images for 3 prompts"), "{e}");
    let missing = digits.join("missing.png");
    let e = vl
        .generate(&missing, "a handwritten", 2, params(), none)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.png"), "{e}");
}

#[test]
fn image_text_model_scores_text_after_its_image_and_classifies_the_digits_zero_shot() {
    use candle_core::D;
    use tokenformer::{ComputeDtype, ImageTextModel, PretrainedOptions};
    let name = common::zoo("tiny-digits-vl");
    let name = name.to_str().unwrap();
    let vl = ImageTextModel::from_pretrained(name, &Default::default()).unwrap();
    let digits = common::zoo("examples").join("digits");
    let seven = digits.join("seven").join("0005.png");

    // Each token's log p against a log-softmax of the mixed forward's logits.
    let text = "a handwritten seven";
    let s = vl.score(&seven, text).unwrap();
    let ids = vl
        .tokenizer()
        .encode(text, false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(s.ids, ids);
    let input = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let pixels = vl.load_image(&seven).unwrap();
    let (_, logits) = vl
        .model()
        .forward_mixed(Some(&pixels), &input, None)
        .unwrap();
    let want = candle_nn::ops::log_softmax(&logits.squeeze(0).unwrap(), D::Minus1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(s.next_token_logprobs.len(), ids.len() - 1);
    for (t, lp) in s.next_token_logprobs.iter().enumerate() {
        let w = want[t][ids[t + 1] as usize];
        assert!((lp - w).abs() < 1e-5, "token {}: {lp} vs {w}", t + 1);
    }
    // One image for several texts, or one each; not 2 for 3.
    let two = Tensor::cat(&[&pixels, &pixels], 0).unwrap();
    let three_rows = input.repeat((3, 1)).unwrap();
    let e = vl
        .model()
        .forward_mixed(Some(&two), &three_rows, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 images for 3 texts"), "{e}");
    let (_, rows) = vl
        .model()
        .forward_mixed(Some(&pixels), &three_rows, None)
        .unwrap();
    let diff = common::max_abs_diff(&rows.get(2).unwrap(), &logits.squeeze(0).unwrap());
    assert!(diff < 1e-5, "one image before three texts: {diff}");

    // The image is what the caption's likelihood rests on.
    let three = vl
        .score(digits.join("three").join("0005.png"), text)
        .unwrap();
    let last = |s: &tokenformer::SequenceScore| *s.next_token_logprobs.last().unwrap();
    assert!(last(&s) > last(&three) + 1.0, "{s:?} {three:?}");

    // The command line prints the same numbers.
    let args = [
        "score",
        "--model",
        name,
        "--image",
        seven.to_str().unwrap(),
        "--text",
        text,
        "--json",
    ];
    let (out, stdout, stderr) = common::tokenformer(&args);
    assert!(out.status.success(), "{stderr}");
    let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let cli: Vec<f64> = json["next_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(cli.len(), s.next_token_logprobs.len());
    for (c, l) in cli.iter().zip(&s.next_token_logprobs) {
        assert!((c - *l as f64).abs() < 1e-6, "{c} vs {l}");
    }

    // One image before many (context, continuation) pairs of different
    // lengths: batched equals alone equals the tokens' scores summed.
    let names = [
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    ];
    let mut pairs: Vec<(String, String)> = names
        .iter()
        .map(|n| ("a handwritten".to_string(), format!(" {n}")))
        .collect();
    pairs.push(("a".into(), " handwritten seven".into()));
    let all = vl.loglikelihood(&seven, &pairs).unwrap();
    for (i, (c, x)) in pairs.iter().enumerate() {
        let alone = vl.loglikelihood(&seven, &pairs[i..i + 1]).unwrap()[0];
        assert!((all[i].logprob - alone.logprob).abs() < 1e-5, "{c}{x}");
        assert_eq!(all[i].is_greedy, alone.is_greedy, "{c}{x}");
        let whole = vl.score(&seven, &format!("{c}{x}")).unwrap();
        let k = vl.tokenizer().encode(x.as_str(), false).unwrap().len();
        let summed: f64 = whole.next_token_logprobs[whole.next_token_logprobs.len() - k..]
            .iter()
            .map(|&v| v as f64)
            .sum();
        assert!((all[i].logprob - summed).abs() < 1e-4, "{c}{x}: {all:?}");
    }
    assert!(all[10].is_greedy, "the model's own caption: {all:?}");

    // Zero-shot: the most likely of the ten captions names every shipped
    // digit's folder, and it alone is what greedy decoding would say.
    let pairs = &pairs[..10];
    let bf16 = PretrainedOptions {
        dtype: ComputeDtype::Bf16,
        ..Default::default()
    };
    let half = ImageTextModel::from_pretrained(name, &bf16).unwrap();
    for image in common::digit_images() {
        let label = image
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap();
        let ll = vl.loglikelihood(&image, pairs).unwrap();
        let best = (0..10)
            .max_by(|&a, &b| ll[a].logprob.total_cmp(&ll[b].logprob))
            .unwrap();
        assert_eq!(names[best], label, "{}: {ll:?}", image.display());
        let greedy: Vec<usize> = (0..10).filter(|&i| ll[i].is_greedy).collect();
        assert_eq!(greedy, [best], "{}", image.display());
        if image.file_name().unwrap() == "0005.png" {
            let lh = half.loglikelihood(&image, pairs).unwrap();
            for (h, f) in lh.iter().zip(&ll) {
                assert!((h.logprob - f.logprob).abs() < 0.1, "bf16 {lh:?} vs {ll:?}");
            }
        }
    }

    // Errors: a missing image names the file; nothing to score is nothing.
    let missing = digits.join("missing.png");
    let e = vl.loglikelihood(&missing, pairs).unwrap_err().to_string();
    assert!(e.contains("missing.png"), "{e}");
    let e = vl.score(&missing, text).unwrap_err().to_string();
    assert!(e.contains("missing.png"), "{e}");
    let none: &[(&str, &str)] = &[];
    assert!(vl.loglikelihood(&seven, none).unwrap().is_empty());
    let e = vl.score(&seven, "a").unwrap_err().to_string();
    assert!(e.contains("at least 2 tokens"), "{e}");
    let lm = common::zoo("tiny-kjv-lm");
    let args = [
        "score",
        "--model",
        lm.to_str().unwrap(),
        "--image",
        seven.to_str().unwrap(),
        "--text",
        text,
    ];
    let (out, _, stderr) = common::tokenformer(&args);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--image needs a vision-language model"),
        "{stderr}"
    );

    // A file of lines, each text after its own image or after none (the
    // language route, as `score` without --image runs on a merged folder).
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(&seven, dir.path().join("seven.png")).unwrap();
    let lines = dir.path().join("texts.jsonl");
    let three_png = digits.join("three").join("0005.png");
    std::fs::write(
        &lines,
        format!(
            "{}\n{}\n{}\n",
            serde_json::json!({"text": text, "image": "seven.png"}),
            serde_json::json!({"text": text}),
            serde_json::json!({"text": text, "image": three_png}),
        ),
    )
    .unwrap();
    let args = ["score", "--model", name, "--file", lines.to_str().unwrap()];
    let (out, stdout, stderr) = common::tokenformer(&args);
    assert!(out.status.success(), "{stderr}");
    let got: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let text_only = tokenformer::LanguageModel::from_pretrained(name, &Default::default())
        .unwrap()
        .score(text)
        .unwrap();
    let want = [&s, &text_only, &three];
    assert_eq!(got.len(), 3);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g["line"], i + 1);
        let nll = g["nll"].as_f64().unwrap();
        assert!(
            (nll - w.nll).abs() < 1e-6,
            "line {}: {nll} vs {}",
            i + 1,
            w.nll
        );
    }
    let args = [
        "score",
        "--model",
        lm.to_str().unwrap(),
        "--file",
        lines.to_str().unwrap(),
    ];
    let (out, _, stderr) = common::tokenformer(&args);
    assert!(!out.status.success());
    assert!(
        stderr.contains("texts.jsonl line 1: an `image` needs a vision-language model"),
        "{stderr}"
    );
    let args = [
        "score",
        "--model",
        name,
        "--file",
        lines.to_str().unwrap(),
        "--image",
        seven.to_str().unwrap(),
    ];
    let (out, _, stderr) = common::tokenformer(&args);
    assert!(!out.status.success());
    assert!(
        stderr.contains("each line may name its `image`"),
        "{stderr}"
    );
}
