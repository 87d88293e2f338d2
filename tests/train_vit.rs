//! Training the image classifier: one step against PyTorch autograd and AdamW
//! (tests/fixtures/vit-train-step, made by scripts/vit_train_step.py), and
//! `tokenformer train` on a small generated image folder learning its classes.

mod common;

use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::Value;
use tokenformer::checkpoint;
use tokenformer::models::vit::Config;
use tokenformer::train::vit::TrainTransform;

fn fixture() -> std::path::PathBuf {
    common::fixtures().join("vit-train-step")
}

#[test]
fn one_classifier_training_step_matches_pytorch_autograd_and_adamw() {
    common::steps::vit_step_matches_pytorch(&Device::Cpu);
}

#[test]
fn random_resized_crops_follow_torchvisions_ranges() {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let (mut small, mut n) = (0, 0);
    for _ in 0..2000 {
        let (x, y, w, h) = TrainTransform::crop_box(100, 100, (0.08, 1.0), &mut rng);
        assert!(x + w <= 100 && y + h <= 100 && w > 0 && h > 0);
        let area = (w * h) as f64 / 10000.0;
        assert!((0.07..=1.0).contains(&area), "area {area}");
        // Rounding moves the ratio a little past the range on small crops.
        let r = w as f64 / h as f64;
        if area > 0.2 && (0.7..=1.4).contains(&r) {
            n += 1;
        }
        small += usize::from(area < 0.3);
    }
    // The scale is uniform on (0.08, 1): about a quarter of the draws (0.22 / 0.92, a
    // little more as large crops of extreme ratio are redrawn) are below 0.3.
    assert!((400..650).contains(&small), "{small}");
    assert!(n > 1000, "{n}");
}

/// A 24×24 image of `class`: red, green or blue dominant, with noise.
fn image(class: usize, seed: u32) -> image::RgbImage {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(class as u32);
    image::RgbImage::from_fn(24, 24, |_, _| {
        let mut px = [0u8; 3];
        for (c, v) in px.iter_mut().enumerate() {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let noise = (s % 120) as u8;
            *v = if c == class { 120 + noise } else { noise };
        }
        image::Rgb(px)
    })
}

#[test]
fn training_a_tiny_classifier_on_generated_images_learns_its_classes() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let classes = ["n01", "n02", "n03"];
    for (split, count) in [("train", 12), ("val", 4)] {
        for (c, wnid) in classes.iter().enumerate() {
            let dir = data.join(split).join(wnid);
            std::fs::create_dir_all(&dir).unwrap();
            for i in 0..count {
                let seed = i + if split == "val" { 1000 } else { 0 };
                image(c, seed).save(dir.join(format!("{i}.png"))).unwrap();
            }
        }
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    cfg["image_size"] = 16.into();
    cfg["class_wnids"] = serde_json::json!(classes);
    let init = tmp.path().join("init.json");
    std::fs::write(&init, cfg.to_string()).unwrap();
    let out = tmp.path().join("run");
    let (i, d, o) = (
        init.to_str().unwrap(),
        data.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let (output, stdout, stderr) = common::tokenformer(&[
        "train",
        "--init",
        i,
        "--data",
        d,
        "--out",
        o,
        "--steps",
        "60",
        "--batch-size",
        "8",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "5",
        "--eval-every",
        "30",
        "--json",
    ]);
    assert!(output.status.success(), "{stderr}");
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    let lines: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let first = lines[0]["loss"].as_f64().unwrap();
    assert!((first - 3f64.ln()).abs() < 0.3, "first loss {first}");
    let val = summary["val_loss"].as_f64().unwrap();
    assert!(val < 0.5 * first, "validation loss {val}, start {first}");
    assert!(summary["val_top1"].as_f64().unwrap() >= 0.9, "{summary}");
    assert_eq!(summary["images"], 60 * 8);
    let ckpt = out.join("checkpoint-000060");
    let card = std::fs::read_to_string(ckpt.join("README.md")).unwrap();
    assert!(card.contains("60 of 60 steps"), "{card}");
    // Every command loads the checkpoint; loss.png is a real picture.
    let files = tokenformer::loader::locate(ckpt.to_str().unwrap(), &Default::default()).unwrap();
    let model = tokenformer::loader::load_vit(&files, &Device::Cpu).unwrap();
    assert_eq!(model.config().num_classes, 3);
    let png = image::open(out.join("loss.png")).unwrap().to_rgb8();
    assert_eq!(png.dimensions(), (800, 480));
    let orange = png.pixels().filter(|p| p.0 == [255, 127, 14]).count();
    let blue = png.pixels().filter(|p| p.0 == [31, 119, 180]).count();
    assert!(orange > 100 && blue > 100, "{orange} {blue}");
}

/// A folder of 16×16-class images (`train/` only) and a 16² classifier config with
/// those classes; returns (data, init).
fn small_run(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let data = dir.join("data");
    let classes = ["n01", "n02", "n03"];
    for (c, wnid) in classes.iter().enumerate() {
        let d = data.join("train").join(wnid);
        std::fs::create_dir_all(&d).unwrap();
        for i in 0..4 {
            image(c, i).save(d.join(format!("{i}.png"))).unwrap();
        }
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    cfg["image_size"] = 16.into();
    cfg["class_wnids"] = serde_json::json!(classes);
    let init = dir.join("init.json");
    std::fs::write(&init, cfg.to_string()).unwrap();
    (data, init)
}

const SMALL: [&str; 8] = [
    "--batch-size",
    "4",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "1",
    "--seed",
    "5",
];

#[test]
fn a_resumed_classifier_run_equals_an_uninterrupted_one_and_a_kill_in_save_keeps_the_last() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, init) = small_run(tmp.path());
    let (d, i) = (data.to_str().unwrap(), init.to_str().unwrap());
    let mut start = vec!["--init", i, "--data", d];
    start.extend(SMALL);
    common::train::assert_resume_equals_uninterrupted(tmp.path(), &start, &["--data", d], 2);
}

#[test]
fn train_new_on_a_grown_classifier_moves_only_the_appended_tokens_and_grow_at_grows_in_the_run() {
    use common::train::{bits, ok, tokenformer_train, weights};
    use tokenformer::grow::{grow_tensors, GrowInit};
    use tokenformer::models::tokenformer::ScaleTokens;
    let tmp = tempfile::tempdir().unwrap();
    let (data, init) = small_run(tmp.path());
    let d = data.to_str().unwrap();
    let cfg: Config = serde_json::from_str(&std::fs::read_to_string(&init).unwrap()).unwrap();
    let old = ScaleTokens {
        qkv: cfg.qkv_tokens,
        proj: cfg.proj_tokens,
        ffn: cfg.ffn_tokens,
    };
    let target = ScaleTokens {
        qkv: 16,
        proj: 10,
        ffn: 32,
    };
    // Grown as `tokenformer-convert grow` does: zero keys, √n kept, old counts recorded.
    let start = tokenformer::train::vit::init_tensors(&cfg, 9, &Device::Cpu).unwrap();
    let init_grow = GrowInit {
        seed: 4,
        ..GrowInit::default()
    };
    let (grown, _) = grow_tensors(start, &old, &target, &init_grow).unwrap();
    let gcfg = tokenformer::train::vit::grown_config(&cfg, &target).unwrap();
    assert_eq!(gcfg.grown_from_tokens, Some(old));
    let model = tmp.path().join("grown");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        serde_json::to_string(&gcfg).unwrap(),
    )
    .unwrap();
    checkpoint::write_safetensors(&model, &grown, checkpoint::DEFAULT_SHARD_BYTES).unwrap();

    let out = tmp.path().join("new");
    let (m, o) = (model.to_str().unwrap(), out.to_str().unwrap());
    let mut args = vec![
        "--model", m, "--data", d, "--out", o, "--train", "new", "--steps", "3",
    ];
    args.extend(SMALL);
    ok(&tokenformer_train(&args, &[]));
    let end = weights(&out.join("checkpoint-000003"));
    let mut moved = 0;
    for (name, t) in &grown {
        let after = &end[name];
        let rows = match tokenformer::grow::pattention_kind(name).unwrap() {
            Some(k) => tokenformer::grow::Kind::of(&old, k),
            None => t.dim(0).unwrap(),
        };
        // The old rows (every row of a tensor that did not grow) stay bit-identical.
        assert_eq!(
            bits(&t.narrow(0, 0, rows).unwrap()),
            bits(&after.narrow(0, 0, rows).unwrap()),
            "{name}"
        );
        let n = t.dim(0).unwrap();
        if n > rows {
            let new = |x: &Tensor| bits(&x.narrow(0, rows, n - rows).unwrap());
            moved += usize::from(new(t) != new(after));
        }
    }
    // q, k, v and the MLP grew (proj did not): 4 Pattentions × keys and values × 2 layers.
    assert_eq!(moved, 4 * 2 * 2);

    // --grow-at: the same growth after step 2 of a fresh run; the checkpoint is the
    // grown model, its old counts recorded, and the appended tokens trained since.
    let out = tmp.path().join("grow-at");
    let (i, o) = (init.to_str().unwrap(), out.to_str().unwrap());
    let mut args = vec![
        "--init",
        i,
        "--data",
        d,
        "--out",
        o,
        "--steps",
        "4",
        "--grow-at",
        "2:qkv=16,ffn=32",
    ];
    args.extend(SMALL);
    ok(&tokenformer_train(&args, &[]));
    let ckpt = out.join("checkpoint-000004");
    let saved: Config =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("config.json")).unwrap()).unwrap();
    assert_eq!((saved.qkv_tokens, saved.ffn_tokens), (16, 32));
    assert_eq!(saved.grown_from_tokens, Some(old));
    assert_eq!(
        saved.pattention_scale_tokens,
        Some(old),
        "√n kept at the old counts"
    );
    let w = weights(&ckpt);
    let keys = w["layers.0.mlp.key_param_tokens"].narrow(0, 24, 8).unwrap();
    assert!(
        keys.abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            > 0.0,
        "the appended keys (zero at growth) trained in steps 3 and 4"
    );
    let files = tokenformer::loader::locate(ckpt.to_str().unwrap(), &Default::default()).unwrap();
    tokenformer::loader::load_vit(&files, &Device::Cpu).unwrap();
}
