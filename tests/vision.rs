//! The image classifier and its ImageNet evaluation against Pillow + PyTorch
//! fixtures (`tests/fixtures/vit-tiny-imagenet`, copied from the shared data) and
//! Pillow-made images in the modes it converts specially
//! (`tests/fixtures/vision-pillow`, see its `make_fixtures.py`).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, D};
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokenformer::eval::imagenet::{self, Options};
use tokenformer::loader::{self, LocateOptions};
use tokenformer::models::vit::{self, VisionTransformer};
use tokenformer::vision::{self, dataset, resample::Filter, EvalTransform};

use common::{fixtures, max_abs_diff_of};

fn tiny() -> PathBuf {
    fixtures().join("vit-tiny-imagenet")
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(tiny().join("expected.json")).unwrap()).unwrap()
}

fn load(path: &Path) -> VisionTransformer {
    let files = loader::locate(path.to_str().unwrap(), &LocateOptions::default()).unwrap();
    loader::load_vit(&files, &Device::Cpu).unwrap()
}

fn fixture_pixels() -> Tensor {
    let t =
        candle_core::safetensors::load(tiny().join("pixels.safetensors"), &Device::Cpu).unwrap();
    t["pixels"].clone()
}

#[test]
fn logits_on_pillow_pixels_match_pytorch() {
    let model = load(&tiny().join("vit-tiny"));
    let logits = model
        .forward(&fixture_pixels())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let exp = expected();
    let mut worst = 0f32;
    for (row, img) in logits.iter().zip(exp["images"].as_array().unwrap()) {
        let want: Vec<f32> = serde_json::from_value(img["logits"].clone()).unwrap();
        for (a, b) in row.iter().zip(&want) {
            worst = worst.max((a - b).abs());
        }
        let top5: Vec<usize> = serde_json::from_value(img["top5"].clone()).unwrap();
        assert_eq!(vision::top_k(row, 5), top5, "{}", img["file"]);
    }
    eprintln!("max |logit - PyTorch| = {worst:e}");
    assert!(worst < 1e-4, "max logit error {worst}");
}

/// The image embedding is PyTorch's pre-logits of the same pixels (float64,
/// `scripts/vit_pre_logits.py`), the head of it is the model's logits, and
/// `embed_files` gives each image file's own row, in order, or why it could
/// not be read.
#[test]
fn embeddings_are_pytorch_pre_logits_and_feed_the_head() {
    let model = load(&tiny().join("vit-tiny"));
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("pre_logits.json")).unwrap())
            .unwrap();
    let want: Vec<Vec<f32>> = serde_json::from_value(fixture["pre_logits"].clone()).unwrap();
    let pixels = fixture_pixels();
    let got = model.pre_logits(&pixels).unwrap();
    assert_eq!(got.dims(), &[5, model.config().hidden_size]);
    let rows = got.to_vec2::<f32>().unwrap();
    let worst = max_abs_diff_of(&rows.concat(), &want.concat());
    eprintln!("max |embedding - PyTorch| = {worst:e}");
    assert!(worst < 1e-4, "max embedding error {worst}");
    // The head of the embedding, with the checkpoint's own head read from the file.
    let t = candle_core::safetensors::load(tiny().join("vit-tiny/model.safetensors"), &Device::Cpu)
        .unwrap();
    let logits = got
        .matmul(&t["head.weight"].t().unwrap())
        .unwrap()
        .broadcast_add(&t["head.bias"])
        .unwrap();
    let err = max_abs(&(logits - model.forward(&pixels).unwrap()).unwrap());
    assert!(err < 1e-5, "head of the embedding vs logits {err}");

    // From the files (decoded and resized here, not by Pillow), one missing among them.
    let mut files: Vec<PathBuf> = fixture["pixels_order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| tiny().join("val").join(p.as_str().unwrap()))
        .collect();
    let missing = tiny().join("val/no-such-image.png");
    files.insert(2, missing.clone());
    let embedded =
        imagenet::embed_files(&model, &files, 2, &vision::DecodeLimits::default()).unwrap();
    assert_eq!(embedded.len(), 6);
    let mut want_rows = want.iter();
    for (file, (path, r)) in files.iter().zip(&embedded) {
        assert_eq!(path, file);
        if *file == missing {
            let e = r.as_ref().unwrap_err().to_string();
            assert!(e.contains("no-such-image.png"), "{e}");
            continue;
        }
        let row = r.as_ref().unwrap();
        let w = want_rows.next().unwrap();
        let d = max_abs_diff_of(row, w);
        eprintln!(
            "{}: max |embedding of the file - PyTorch's of Pillow's pixels| = {d:e}",
            file.display()
        );
        assert!(d < 1e-5, "{}: {d}", file.display());
    }
}

/// Un-normalised 0..1 values back from normalised [3, H, W] data.
fn unnormalise(x: &[f32], t: &EvalTransform) -> Vec<f32> {
    let plane = x.len() / 3;
    x.iter()
        .enumerate()
        .map(|(i, v)| v * t.std[i / plane] + t.mean[i / plane])
        .collect()
}

#[test]
fn preprocessing_matches_pillow_within_tolerance() {
    let model_cfg = load(&tiny().join("vit-tiny")).config().clone();
    let t = EvalTransform::from_config(&model_cfg);
    assert_eq!((t.resize, t.crop), (36, 32));
    let pixels = fixture_pixels();
    let order: Vec<String> = serde_json::from_value(expected()["pixels_order"].clone()).unwrap();
    for (i, name) in order.iter().enumerate() {
        let ours = unnormalise(&t.load(&tiny().join("val").join(name)).unwrap(), &t);
        let want = unnormalise(
            &pixels
                .get(i)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap(),
            &t,
        );
        let diffs: Vec<f32> = ours
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() * 255.0)
            .collect();
        let max = diffs.iter().cloned().fold(0.0, f32::max);
        let mean = diffs.iter().sum::<f32>() / diffs.len() as f32;
        eprintln!("{name}: max {max:.3}/255, mean {mean:.4}/255");
        assert!(max <= 3.0 && mean <= 0.5, "{name}: max {max}, mean {mean}");
        // libjpeg-turbo decoding + Pillow's resample: equal to the bit (f32 rounding aside).
        assert!(max < 1e-3, "{name}: differs from Pillow by {max}/255");
    }
}

fn pillow_expected() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        fixtures().join("vision-pillow/expected.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
}

fn u8_of(t: &Tensor) -> Vec<u8> {
    t.flatten_all().unwrap().to_vec1::<u8>().unwrap()
}

/// (max, mean) absolute difference in 0..255 units.
fn diff(a: &[u8], b: &[u8]) -> (u8, f64) {
    assert_eq!(a.len(), b.len());
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0);
    let mean = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y) as f64)
        .sum::<f64>()
        / a.len() as f64;
    (max, mean)
}

#[test]
fn decoding_and_resizing_of_special_modes_match_pillow() {
    let exp = pillow_expected();
    let dir = fixtures().join("vision-pillow");
    let mut checked = 0;
    for (key, want) in &exp {
        let mut parts = key.split('@');
        let file = parts.next().unwrap();
        let lossy = file.ends_with(".jpg");
        let img = vision::open_rgb(&dir.join(file)).unwrap();
        let ours = if parts.clone().next() == Some("decoded") {
            img.data.clone()
        } else {
            let size: usize = parts.next().unwrap().parse().unwrap();
            let crop_pct: f64 = parts.next().unwrap().parse().unwrap();
            let filter = match parts.next().unwrap() {
                "bicubic" => Filter::Bicubic,
                _ => Filter::Bilinear,
            };
            let t = EvalTransform {
                resize: (size as f64 / crop_pct).floor() as usize,
                crop: size,
                filter,
                mean: [0.0; 3],
                std: [1.0; 3],
                resize_mode: tokenformer::models::vit::ResizeMode::ShorterSide,
            };
            let out = t.resize_crop(&img).unwrap();
            assert_eq!((out.width, out.height), (size, size), "{key}");
            out.data
        };
        let (max, mean) = diff(&ours, &u8_of(want));
        if lossy {
            eprintln!("{key}: max {max}, mean {mean:.3}");
        }
        // Same JPEG decoder as Pillow (libjpeg-turbo), same conversions and resample.
        assert_eq!(max, 0, "{key}: differs from Pillow (mean {mean})");
        checked += 1;
    }
    assert_eq!(checked, 34);
}

#[test]
fn grey_and_alpha_conversions_follow_pillow() {
    // Generated here, so the rule itself is checked (not only the fixture).
    let grey = image::GrayImage::from_fn(5, 4, |x, y| image::Luma([(x * 40 + y * 7) as u8]));
    let mut png = Vec::new();
    grey.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    let rgb = vision::decode_bytes(&png).unwrap();
    assert_eq!((rgb.width, rgb.height), (5, 4));
    for (p, g) in rgb.data.chunks(3).zip(grey.as_raw()) {
        assert_eq!(p, [*g, *g, *g]);
    }
    let rgba = image::RgbaImage::from_fn(3, 3, |x, y| {
        image::Rgba([x as u8 * 90, y as u8 * 90, 200, (x * 100) as u8])
    });
    let mut png = Vec::new();
    rgba.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    let rgb = vision::decode_bytes(&png).unwrap();
    // Alpha is dropped, not composited on black or white (even where alpha is 0).
    for (p, q) in rgb.data.chunks(3).zip(rgba.as_raw().chunks(4)) {
        assert_eq!(p, &q[..3]);
    }
}

#[test]
fn eval_transform_sizes_follow_torchvision() {
    let cfg = vit::Config::imagenet(12, 768, 12, 768, 3072);
    let t = EvalTransform::from_config(&cfg);
    assert_eq!((t.resize, t.crop), (256, 224));
    assert_eq!(t.resized_size(500, 375), (341, 256));
    assert_eq!(t.resized_size(375, 500), (256, 341));
    assert_eq!(t.resized_size(333, 500), (256, 384));
    assert_eq!(t.resized_size(20, 13), (393, 256));
    assert_eq!(vision::round_half_even(2.5), 2);
    assert_eq!(vision::round_half_even(3.5), 4);
    assert_eq!(vision::round_half_even(1.4999), 1);
    // crop_pct > 1 leaves the resized image smaller than the crop: zero padding, as torchvision.
    let t = EvalTransform {
        resize: 6,
        crop: 8,
        filter: Filter::Bicubic,
        mean: [0.0; 3],
        std: [1.0; 3],
        resize_mode: tokenformer::models::vit::ResizeMode::ShorterSide,
    };
    let img = vision::RgbImage {
        width: 3,
        height: 3,
        data: vec![200; 27],
    };
    let out = t.resize_crop(&img).unwrap();
    assert_eq!((out.width, out.height), (8, 8));
    assert_eq!(&out.data[..3], &[0, 0, 0]);
    assert_eq!(&out.data[(8 + 1) * 3..(8 + 1) * 3 + 3], &[200, 200, 200]);
}

#[test]
fn eval_imagenet_on_fixture_folder_gives_expected_accuracy() {
    let model = load(&tiny().join("vit-tiny"));
    let r =
        imagenet::evaluate(&model, "vit-tiny", &tiny().join("val"), &Options::default()).unwrap();
    let exp = expected();
    assert_eq!(r.images, 5);
    assert_eq!(r.unreadable, 0);
    assert!(
        (r.top1 - exp["top1"].as_f64().unwrap()).abs() < 1e-4,
        "top1 {}",
        r.top1
    );
    assert!(
        (r.top5 - exp["top5"].as_f64().unwrap()).abs() < 1e-4,
        "top5 {}",
        r.top5
    );
    // Sharding + merging gives the whole run's counts.
    let parts: Vec<Value> = (0..3)
        .map(|i| {
            let opts = Options {
                shard: Some(tokenformer::eval::shard::Shard::new(i, 3).unwrap()),
                batch_size: 2,
                ..Options::default()
            };
            serde_json::to_value(
                imagenet::evaluate(&model, "vit-tiny", &tiny().join("val"), &opts).unwrap(),
            )
            .unwrap()
        })
        .collect();
    assert_eq!(parts[0]["images"], 2);
    let merged = imagenet::merge_results(&parts).unwrap();
    assert_eq!(merged["images"], 5);
    assert_eq!(
        merged["correct_top1"].as_u64().unwrap() as usize,
        r.correct_top1
    );
    assert_eq!(
        merged["correct_top5"].as_u64().unwrap() as usize,
        r.correct_top5
    );
    assert_eq!(merged["top5"].as_f64().unwrap(), r.top5);
    assert!(imagenet::merge_results(&[parts[0].clone(), parts[0].clone()]).is_err());
}

#[test]
fn flat_folder_with_label_files() {
    let model = load(&tiny().join("vit-tiny"));
    let dir = tempfile::tempdir().unwrap();
    let mut csv = String::from("ImageId,PredictionString\n");
    let mut txt = String::new();
    for (i, (wnid, file)) in [
        ("n01443537", "a.JPEG"),
        ("n01491361", "c.JPEG"),
        ("n01518878", "e.JPEG"),
    ]
    .iter()
    .enumerate()
    {
        let name = format!("ILSVRC2012_val_{i:08}.JPEG");
        std::fs::copy(
            tiny().join("val").join(wnid).join(file),
            dir.path().join(&name),
        )
        .unwrap();
        csv += &format!("ILSVRC2012_val_{i:08},{wnid} 1 2 30 40 {wnid} 5 6 7 8\n");
        let idx = model
            .config()
            .class_wnids
            .as_ref()
            .unwrap()
            .iter()
            .position(|w| w == wnid)
            .unwrap();
        txt += &format!("{name} {idx}\n");
    }
    let labels = tempfile::tempdir().unwrap();
    std::fs::write(labels.path().join("LOC_val_solution.csv"), csv).unwrap();
    std::fs::write(labels.path().join("val.txt"), txt).unwrap();
    let whole = imagenet::evaluate(&model, "m", &tiny().join("val"), &Options::default()).unwrap();
    let exp = expected();
    // Expected per-image correctness from the fixture, for a, c and e.
    let want_top5 = ["a.JPEG", "c.JPEG", "e.JPEG"]
        .iter()
        .filter(|f| {
            let img = exp["images"]
                .as_array()
                .unwrap()
                .iter()
                .find(|i| i["file"].as_str().unwrap().ends_with(*f))
                .unwrap();
            img["top5"].as_array().unwrap().contains(&img["label"])
        })
        .count();
    for l in ["LOC_val_solution.csv", "val.txt"] {
        let opts = Options {
            labels: Some(labels.path().join(l)),
            ..Options::default()
        };
        let r = imagenet::evaluate(&model, "m", dir.path(), &opts).unwrap();
        assert_eq!(r.images, 3, "{l}");
        assert_eq!(r.correct_top5, want_top5, "{l}");
    }
    assert!(whole.images == 5);
}

#[test]
fn bad_inputs_are_reported_with_their_paths() {
    let model = load(&tiny().join("vit-tiny"));
    let dir = tempfile::tempdir().unwrap();
    let class = dir.path().join("n01443537");
    std::fs::create_dir(&class).unwrap();
    std::fs::copy(tiny().join("val/n01443537/a.JPEG"), class.join("a.JPEG")).unwrap();
    std::fs::write(class.join("empty.JPEG"), b"").unwrap();
    std::fs::write(class.join("corrupt.png"), b"\x89PNG\r\n\x1a\nnot really").unwrap();
    std::fs::write(
        class.join("garbage.jpg"),
        b"\xff\xd8\xff\xe0 this is no jpeg \xff\xda\xff\xd9",
    )
    .unwrap();
    let whole = std::fs::read(tiny().join("val/n01443537/a.JPEG")).unwrap();
    std::fs::write(class.join("truncated.jpg"), &whole[..whole.len() / 2]).unwrap();
    let r = imagenet::evaluate(&model, "m", dir.path(), &Options::default()).unwrap();
    assert_eq!((r.images, r.unreadable), (1, 4));
    for f in ["empty.JPEG", "corrupt.png", "garbage.jpg", "truncated.jpg"] {
        let err = vision::open_rgb(&class.join(f)).unwrap_err().to_string();
        assert!(err.contains(f), "{err}");
    }
    assert!(vision::open_rgb(&class.join("truncated.jpg"))
        .unwrap_err()
        .to_string()
        .contains("truncated"));
    assert!(r.unreadable_files.iter().any(|f| f.ends_with("empty.JPEG")));
    assert!(r
        .unreadable_files
        .iter()
        .any(|f| f.ends_with("corrupt.png")));
    let err = vision::open_rgb(&class.join("empty.JPEG"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("empty.JPEG") && err.contains("0 bytes"),
        "{err}"
    );

    // A class folder the model does not know.
    std::fs::create_dir(dir.path().join("n99999999")).unwrap();
    std::fs::copy(
        tiny().join("val/n01443537/a.JPEG"),
        dir.path().join("n99999999/x.JPEG"),
    )
    .unwrap();
    let err = imagenet::evaluate(&model, "m", dir.path(), &Options::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("n99999999") && err.contains("class_wnids"),
        "{err}"
    );

    // No images at all.
    let empty = tempfile::tempdir().unwrap();
    std::fs::create_dir(empty.path().join("n01443537")).unwrap();
    let err = imagenet::evaluate(&model, "m", empty.path(), &Options::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("no images"), "{err}");

    // classify reports the bad file and still classifies the good one.
    let res = imagenet::classify_files(
        &model,
        &[class.join("corrupt.png"), class.join("a.JPEG")],
        5,
        8,
    )
    .unwrap();
    assert!(res[0]
        .1
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("corrupt.png"));
    let top = res[1].1.as_ref().unwrap();
    assert_eq!(top.len(), 5);
    assert_eq!(top[0].wnid.as_deref(), Some("n01494475"));
    assert_eq!(top[0].name.as_deref(), Some("hammerhead, hammerhead shark"));
    let total: f32 = top.iter().map(|p| p.prob).sum();
    assert!(total > 0.0 && total <= 1.0 + 1e-6);
}

// ---- an independent plain-tensor reference of the forward, for both pools ----

fn layer_norm(x: &Tensor, w: Option<(&Tensor, &Tensor)>, eps: f64) -> Tensor {
    let mean = x.mean_keepdim(D::Minus1).unwrap();
    let xc = x.broadcast_sub(&mean).unwrap();
    let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let y = xc
        .broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
        .unwrap();
    match w {
        Some((w, b)) => y.broadcast_mul(w).unwrap().broadcast_add(b).unwrap(),
        None => y,
    }
}

fn pattention(x: &Tensor, t: &HashMap<String, Tensor>, name: &str) -> Tensor {
    let k = &t[&format!("{name}.key_param_tokens")];
    let v = &t[&format!("{name}.value_param_tokens")];
    let n = k.dim(0).unwrap() as f64;
    let s = x.broadcast_matmul(&k.t().unwrap()).unwrap();
    let norm = s
        .sqr()
        .unwrap()
        .sum_keepdim(D::Minus1)
        .unwrap()
        .sqrt()
        .unwrap();
    let s = (s.broadcast_div(&norm).unwrap() * n.sqrt())
        .unwrap()
        .gelu_erf()
        .unwrap();
    s.broadcast_matmul(v).unwrap()
}

fn reference_forward(cfg: &vit::Config, t: &HashMap<String, Tensor>, pixels: &Tensor) -> Tensor {
    reference_features(cfg, t, pixels)
        .matmul(&t["head.weight"].t().unwrap())
        .unwrap()
        .broadcast_add(&t["head.bias"])
        .unwrap()
}

/// The pooled, normalised feature [b, d] the head reads.
fn reference_features(cfg: &vit::Config, t: &HashMap<String, Tensor>, pixels: &Tensor) -> Tensor {
    let (b, d, p, h) = (
        pixels.dim(0).unwrap(),
        cfg.hidden_size,
        cfg.patch_size,
        cfg.num_heads,
    );
    let conv = pixels.conv2d(&t["patch_embed.weight"], 0, p, 1, 1).unwrap(); // [b, d, g, g]
    let patches = conv.flatten_from(2).unwrap().transpose(1, 2).unwrap();
    let patches = patches.broadcast_add(&t["patch_embed.bias"]).unwrap();
    let cls = t["cls_token"].broadcast_as((b, 1, d)).unwrap();
    let mut x = Tensor::cat(&[&cls, &patches], 1)
        .unwrap()
        .broadcast_add(&t["pos_embed"])
        .unwrap();
    let n = x.dim(1).unwrap();
    let hd = d / h;
    for l in 0..cfg.num_layers {
        let a = |s: &str| format!("layers.{l}.attention.{s}");
        let y = layer_norm(&x, None, cfg.norm_eps);
        let heads = |z: Tensor| {
            z.reshape((b, n, h, hd))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let q = heads(pattention(&y, t, &a("query")));
        let k = heads(pattention(&y, t, &a("key")));
        let v = heads(pattention(&y, t, &a("value")));
        let att = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
        let att = candle_nn::ops::softmax(&att, D::Minus1).unwrap();
        let o = att
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, n, d))
            .unwrap();
        x = (x + pattention(&o, t, &a("proj"))).unwrap();
        let y = layer_norm(&x, None, cfg.norm_eps);
        x = (&x + pattention(&y, t, &format!("layers.{l}.mlp"))).unwrap();
    }
    match cfg.pool {
        vit::Pool::Mean => {
            let m = x.narrow(1, 1, n - 1).unwrap().mean(1).unwrap();
            layer_norm(
                &m,
                Some((&t["fc_norm.weight"], &t["fc_norm.bias"])),
                cfg.norm_eps,
            )
        }
        vit::Pool::Cls => {
            let all = layer_norm(
                &x,
                Some((&t["final_norm.weight"], &t["final_norm.bias"])),
                cfg.norm_eps,
            );
            all.narrow(1, 0, 1).unwrap().squeeze(1).unwrap()
        }
    }
}

fn random_model(
    pool: vit::Pool,
    seed: u64,
) -> (tempfile::TempDir, vit::Config, HashMap<String, Tensor>) {
    let mut cfg = vit::Config::imagenet(2, 24, 3, 10, 16);
    cfg.image_size = 24;
    cfg.patch_size = 6;
    cfg.proj_tokens = 7;
    cfg.num_classes = 6;
    cfg.pool = pool;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut t = HashMap::new();
    let mut put = |name: &str, shape: &[usize], scale: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * scale)
            .collect();
        t.insert(
            name.to_string(),
            Tensor::from_vec(v, shape, &Device::Cpu).unwrap(),
        );
    };
    let d = cfg.hidden_size;
    put("patch_embed.weight", &[d, 3, 6, 6], 0.2);
    put("patch_embed.bias", &[d], 0.1);
    put("cls_token", &[1, 1, d], 1.0);
    put("pos_embed", &[1, 17, d], 0.5);
    for l in 0..cfg.num_layers {
        for (p, n) in [("query", 10), ("key", 10), ("value", 10), ("proj", 7)] {
            put(
                &format!("layers.{l}.attention.{p}.key_param_tokens"),
                &[n, d],
                0.5,
            );
            put(
                &format!("layers.{l}.attention.{p}.value_param_tokens"),
                &[n, d],
                0.5,
            );
        }
        put(&format!("layers.{l}.mlp.key_param_tokens"), &[16, d], 0.5);
        put(&format!("layers.{l}.mlp.value_param_tokens"), &[16, d], 0.5);
    }
    let norm = if pool == vit::Pool::Cls {
        "final_norm"
    } else {
        "fc_norm"
    };
    put(&format!("{norm}.weight"), &[d], 1.0);
    put(&format!("{norm}.bias"), &[d], 0.5);
    put("head.weight", &[6, d], 0.5);
    put("head.bias", &[6], 0.5);
    let dir = tempfile::tempdir().unwrap();
    candle_core::safetensors::save(&t, dir.path().join("model.safetensors")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .unwrap();
    (dir, cfg, t)
}

#[test]
fn cls_and_mean_pooling_match_an_independent_reference() {
    for (pool, seed) in [(vit::Pool::Cls, 1), (vit::Pool::Mean, 2)] {
        let (dir, cfg, t) = random_model(pool, seed);
        let model = load(dir.path());
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed + 100);
        let v: Vec<f32> = (0..3 * 3 * 24 * 24)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let pixels = Tensor::from_vec(v, (3, 3, 24, 24), &Device::Cpu).unwrap();
        let ours = model.forward(&pixels).unwrap();
        let want = reference_forward(&cfg, &t, &pixels);
        let err = max_abs(&(ours - &want).unwrap());
        let scale = max_abs(&want);
        assert!(scale > 0.1, "degenerate reference");
        assert!(err < 1e-4, "{pool:?}: max error {err}");
        let feat = reference_features(&cfg, &t, &pixels);
        let err = max_abs(&(model.pre_logits(&pixels).unwrap() - &feat).unwrap());
        assert!(err < 1e-4, "{pool:?}: max embedding error {err}");
        // The other pool's norm in the checkpoint is a config/checkpoint mismatch.
        let mut wrong = cfg.clone();
        wrong.pool = if pool == vit::Pool::Cls {
            vit::Pool::Mean
        } else {
            vit::Pool::Cls
        };
        std::fs::write(
            dir.path().join("config.json"),
            serde_json::to_string(&wrong).unwrap(),
        )
        .unwrap();
        let files =
            loader::locate(dir.path().to_str().unwrap(), &LocateOptions::default()).unwrap();
        assert!(loader::load_vit(&files, &Device::Cpu).is_err());
    }
}

#[test]
fn zoo_and_class_list() {
    let (wnids, names) = vision::imagenet_classes();
    assert_eq!((wnids.len(), names.len()), (1000, 1000));
    assert!(wnids.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(wnids[0], "n01440764");
    assert_eq!(names[0], "tench, Tinca tinca");
    let mut seen = 0;
    for e in tokenformer::zoo::entries()
        .iter()
        .filter(|e| e.task == "image-classification" && !e.bundled)
    {
        let cfg: vit::Config = serde_json::from_value(e.config.clone()).expect(&e.name);
        cfg.validate().expect(&e.name);
        assert!(e.weights.is_none() && e.reported["imagenet_top1"].as_f64().unwrap() > 80.0);
        seen += 1;
    }
    assert_eq!(seen, 3);
    let b16 = tokenformer::zoo::find("tokenformer-b-16").unwrap();
    assert_eq!(b16.reported["imagenet_top1"], 82.5);
    let _ = DType::F32;
}

/// `cargo test --release --test vision -- --ignored --nocapture bench`: images/s
/// of a random TokenFormer-B/16 at batch 32, and the patch embedding as
/// unfold + matmul against candle's conv2d.
#[test]
#[ignore]
fn bench_b16_batch32() {
    let dev = Device::Cpu;
    let cfg = vit::Config::imagenet(12, 768, 12, 768, 3072);
    let mut t = HashMap::new();
    let mut put = |name: String, shape: &[usize]| {
        t.insert(
            name,
            (Tensor::randn(0f32, 1.0, shape, &dev).unwrap() * 0.02).unwrap(),
        );
    };
    put("patch_embed.weight".into(), &[768, 3, 16, 16]);
    put("patch_embed.bias".into(), &[768]);
    put("cls_token".into(), &[1, 1, 768]);
    put("pos_embed".into(), &[1, 197, 768]);
    for l in 0..12 {
        for p in ["query", "key", "value", "proj"] {
            put(
                format!("layers.{l}.attention.{p}.key_param_tokens"),
                &[768, 768],
            );
            put(
                format!("layers.{l}.attention.{p}.value_param_tokens"),
                &[768, 768],
            );
        }
        put(format!("layers.{l}.mlp.key_param_tokens"), &[3072, 768]);
        put(format!("layers.{l}.mlp.value_param_tokens"), &[3072, 768]);
    }
    put("fc_norm.weight".into(), &[768]);
    put("fc_norm.bias".into(), &[768]);
    put("head.weight".into(), &[1000, 768]);
    put("head.bias".into(), &[1000]);
    let w = t["patch_embed.weight"].clone();
    let model = VisionTransformer::new(
        &cfg,
        candle_nn::VarBuilder::from_tensors(t, DType::F32, &dev),
    )
    .unwrap();
    let pixels = Tensor::randn(0f32, 1.0, (32, 3, 224, 224), &dev).unwrap();
    let time = |f: &dyn Fn()| {
        f();
        let s = std::time::Instant::now();
        for _ in 0..3 {
            f();
        }
        s.elapsed().as_secs_f64() / 3.0
    };
    let unfold = time(&|| {
        model.embed_patches(&pixels).unwrap();
    });
    let conv = time(&|| {
        pixels
            .conv2d(&w, 0, 16, 1, 1)
            .unwrap()
            .flatten_from(2)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap();
    });
    eprintln!(
        "patch embedding, batch 32: unfold+matmul {:.1} ms, conv2d {:.1} ms",
        unfold * 1e3,
        conv * 1e3
    );
    let s = time(&|| {
        model.forward(&pixels).unwrap();
    });
    eprintln!(
        "TokenFormer-B/16 forward, batch 32: {:.2} s/batch, {:.1} images/s",
        s,
        32.0 / s
    );
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs().unwrap().max_all().unwrap().to_scalar().unwrap()
}

// ---- hardening: pixel limits, links, FIFOs ----

/// CRC-32 (IEEE) as PNG chunks use it.
fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &x in data {
        c ^= x as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// A fixture JPEG whose frame header claims `w`×`h` pixels.
fn jpeg_claiming(w: u16, h: u16) -> Vec<u8> {
    let mut b = std::fs::read(tiny().join("val/n01518878/d.JPEG")).unwrap();
    let sof = b
        .windows(2)
        .position(|x| x[0] == 0xFF && (0xC0..=0xC2).contains(&x[1]))
        .unwrap();
    b[sof + 5..sof + 7].copy_from_slice(&h.to_be_bytes());
    b[sof + 7..sof + 9].copy_from_slice(&w.to_be_bytes());
    b
}

/// A fixture PNG whose header claims `w`×`h` pixels (with a valid CRC).
fn png_claiming(w: u32, h: u32) -> Vec<u8> {
    let mut b = std::fs::read(fixtures().join("vision-pillow/small.png")).unwrap();
    b[16..20].copy_from_slice(&w.to_be_bytes());
    b[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = crc32(&b[12..29]);
    b[29..33].copy_from_slice(&crc.to_be_bytes());
    b
}

#[test]
fn images_above_the_pixel_limit_are_unreadable_not_decoded() {
    let model = load(&tiny().join("vit-tiny"));
    let dir = tempfile::tempdir().unwrap();
    let class = dir.path().join("n01443537");
    std::fs::create_dir(&class).unwrap();
    let a = class.join("a.JPEG");
    std::fs::copy(tiny().join("val/n01443537/a.JPEG"), &a).unwrap();
    std::fs::write(class.join("bomb.JPEG"), jpeg_claiming(65500, 65500)).unwrap();
    std::fs::write(class.join("bomb.png"), png_claiming(65500, 65500)).unwrap();
    // 64 megapixels: under the image crate's own 512 MiB default, above ours.
    std::fs::write(class.join("big.png"), png_claiming(8000, 8000)).unwrap();
    let r = imagenet::evaluate(&model, "m", dir.path(), &Options::default()).unwrap();
    assert_eq!((r.images, r.unreadable), (1, 3), "{:?}", r.unreadable_files);
    for f in ["bomb.JPEG", "bomb.png", "big.png"] {
        assert!(r.unreadable_files.iter().any(|u| u.ends_with(f)), "{f}");
        let e = vision::open_rgb(&class.join(f)).unwrap_err().to_string();
        assert!(e.contains(f) && e.contains("limit"), "{e}");
    }
    let e = vision::open_rgb(&class.join("bomb.JPEG"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("65500x65500"), "{e}");
    assert_eq!(r.max_image_pixels, Some(50_000_000));

    // The limit is configurable and exact: w*h passes, w*h - 1 does not.
    let img = vision::open_rgb(&a).unwrap();
    let n = (img.width * img.height) as u64;
    assert!(vision::open_rgb_with(&a, &vision::DecodeLimits::new(n)).is_ok());
    let e = vision::open_rgb_with(&a, &vision::DecodeLimits::new(n - 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("a.JPEG") && e.contains("limit"), "{e}");
    let png = tiny().join("val/n01443537/b.png");
    let p = vision::open_rgb(&png).unwrap();
    let pn = (p.width * p.height) as u64;
    assert!(vision::open_rgb_with(&png, &vision::DecodeLimits::new(pn - 1)).is_err());
    let low = Options {
        max_image_pixels: n - 1,
        ..Options::default()
    };
    let r = imagenet::evaluate(&model, "m", dir.path(), &low).unwrap();
    assert_eq!((r.images, r.unreadable), (0, 4));
    let res = imagenet::classify_files_with(
        &model,
        &[a.clone(), class.join("bomb.JPEG")],
        5,
        8,
        &vision::DecodeLimits::default(),
    )
    .unwrap();
    assert!(res[0].1.is_ok());
    assert!(res[1].1.as_ref().unwrap_err().to_string().contains("limit"));
}

#[cfg(unix)]
#[test]
fn folders_are_walked_once_and_only_regular_files_are_opened() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("val");
    let class = root.join("n01443537");
    std::fs::create_dir_all(&class).unwrap();
    std::fs::copy(tiny().join("val/n01443537/a.JPEG"), class.join("a.JPEG")).unwrap();
    // Loops back to the root, to the folder itself, and the same folder by another path.
    symlink("..", class.join("loop")).unwrap();
    symlink(".", class.join("self")).unwrap();
    symlink("../n01443537", class.join("again")).unwrap();
    // A second class folder that is a link to the first one.
    symlink("n01443537", root.join("n01491361")).unwrap();
    // A link to a regular file is followed; a dangling one is unreadable.
    symlink(
        tiny().join("val/n01491361/c.JPEG").canonicalize().unwrap(),
        class.join("link.JPEG"),
    )
    .unwrap();
    symlink("/nonexistent/x.png", class.join("dangling.png")).unwrap();
    // A FIFO with an image name: opening it for reading would block forever.
    let fifo = class.join("fifo.JPEG");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);

    let names = |v: &[PathBuf]| -> Vec<String> {
        v.iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    };
    let under = dataset::images_under(&class).unwrap();
    assert_eq!(
        names(&under),
        ["a.JPEG", "dangling.png", "fifo.JPEG", "link.JPEG"]
    );
    let ds = dataset::list(&root, None, None).unwrap();
    assert_eq!(ds.samples.len(), 4);
    assert!(ds.samples.iter().all(|s| s.label == 0));
    for skipped in ["loop", "self", "again", "n01491361"] {
        assert!(
            ds.skipped
                .iter()
                .any(|s| s.contains(&format!("/{skipped}:"))),
            "{skipped} in {:?}",
            ds.skipped
        );
    }
    let e = vision::open_rgb(&fifo).unwrap_err().to_string();
    assert!(e.contains("fifo.JPEG") && e.contains("FIFO"), "{e}");

    // The evaluation finishes (on a thread, so a hang fails the test instead
    // of stalling it), counts each image once and lists the unreadable ones.
    let (tx, rx) = std::sync::mpsc::channel();
    let root2 = root.clone();
    std::thread::spawn(move || {
        let model = load(&tiny().join("vit-tiny"));
        let _ = tx.send(imagenet::evaluate(&model, "m", &root2, &Options::default()));
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("eval imagenet hung on the FIFO")
        .unwrap();
    assert_eq!((r.images, r.unreadable), (2, 2), "{:?}", r.unreadable_files);
    assert!(r.unreadable_files.iter().any(|f| f.ends_with("fifo.JPEG")));
    assert!(r
        .unreadable_files
        .iter()
        .any(|f| f.ends_with("dangling.png")));
    assert_eq!(r.skipped_folders.len(), 4);
}
