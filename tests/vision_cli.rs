//! `classify` and `eval imagenet` through the binary: the JSON shapes the
//! issue fixes, and `--shard` runs merged by `eval merge` equal one whole run.

mod common;

use common::*;
use serde_json::Value;

fn vit() -> String {
    fixtures()
        .join("vit-tiny-imagenet/vit-tiny")
        .display()
        .to_string()
}

fn val() -> String {
    fixtures()
        .join("vit-tiny-imagenet/val")
        .display()
        .to_string()
}

#[test]
fn classify_json_has_top5_with_names_and_probabilities() {
    let img = fixtures().join("vit-tiny-imagenet/val/n01443537/a.JPEG");
    let (out, stdout, err) = tokenformer(&[
        "classify",
        "--model",
        &vit(),
        "--json",
        img.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{err}");
    let v: Value = serde_json::from_str(&stdout).unwrap();
    let top5 = v[0]["top5"].as_array().unwrap();
    assert_eq!(top5.len(), 5);
    // The fixture's PyTorch top-5 for this image, in order.
    let exp: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("vit-tiny-imagenet/expected.json")).unwrap(),
    )
    .unwrap();
    let want: Vec<u64> = exp["images"][0]["top5"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    let got: Vec<u64> = top5.iter().map(|e| e["index"].as_u64().unwrap()).collect();
    assert_eq!(got, want);
    let probs: Vec<f64> = top5.iter().map(|e| e["prob"].as_f64().unwrap()).collect();
    assert!(probs.windows(2).all(|w| w[0] >= w[1]) && probs.iter().sum::<f64>() <= 1.0 + 1e-6);
    assert_eq!(top5[0]["wnid"], "n01494475");
    assert!(top5[0]["name"].as_str().unwrap().contains("hammerhead"));
}

/// A folder is its images, recursively and sorted, as timm's inference script
/// reads one; `--top-k` takes that many classes (at most the model's) under
/// the key `top{k}`, and the batches do not change the answer.
#[test]
fn classify_walks_folders_and_takes_top_k() {
    let exp: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("vit-tiny-imagenet/expected.json")).unwrap(),
    )
    .unwrap();
    let (model, data) = (vit(), val());
    let (o, stdout, e) = tokenformer(&[
        "classify",
        "--model",
        &model,
        "--json",
        "--top-k",
        "3",
        "--batch-size",
        "2",
        &data,
    ]);
    assert!(o.status.success(), "{e}");
    let got: Value = serde_json::from_str(&stdout).unwrap();
    let got = got.as_array().unwrap();
    let want = exp["images"].as_array().unwrap();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        let file = g["file"].as_str().unwrap();
        assert!(
            file.ends_with(w["file"].as_str().unwrap()),
            "{file} vs {}",
            w["file"]
        );
        assert!(g.get("top5").is_none(), "{g}");
        let top: Vec<&Value> = g["top3"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| &p["index"])
            .collect();
        let want_top: Vec<&Value> = w["top5"].as_array().unwrap().iter().take(3).collect();
        assert_eq!(top, want_top, "{file}");
    }
    // A file and a folder together, and K above the model's 10 classes.
    let first = format!("{}/n01443537/a.JPEG", val());
    let sub = format!("{}/n01518878", val());
    let (o, stdout, e) = tokenformer(&[
        "classify", "--model", &model, "--json", "--topk", "50", &first, &sub,
    ]);
    assert!(o.status.success(), "{e}");
    let got: Value = serde_json::from_str(&stdout).unwrap();
    let files: Vec<&str> = got
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["file"].as_str().unwrap())
        .collect();
    assert_eq!(
        files,
        [
            first.clone(),
            format!("{sub}/d.JPEG"),
            format!("{sub}/e.JPEG")
        ]
    );
    let all = got[0]["top10"].as_array().unwrap();
    assert_eq!(all.len(), 10);
    let total: f64 = all.iter().map(|p| p["prob"].as_f64().unwrap()).sum();
    assert!((total - 1.0).abs() < 1e-5, "{total}");
    // A folder with no image in it is an error that names it, before any work.
    let empty = tempfile::tempdir().unwrap();
    std::fs::write(empty.path().join("notes.txt"), "not an image").unwrap();
    let r = tokenformer(&[
        "classify",
        "--model",
        &model,
        empty.path().to_str().unwrap(),
    ]);
    assert_clean_failure(&r, &[empty.path().to_str().unwrap(), "no image files"]);
}

#[test]
fn sharded_runs_merge_into_the_whole_run() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    // The whole run, then shards 0/2 and 1/2.
    for (shard, out) in [
        (None, "all.json"),
        (Some("0/2"), "s0.json"),
        (Some("1/2"), "s1.json"),
    ] {
        let (model, data, json) = (vit(), val(), p(out));
        let mut args = vec![
            "eval", "imagenet", "--model", &model, "--data", &data, "--json", &json,
        ];
        if let Some(s) = shard {
            args.extend(["--shard", s]);
        }
        let (o, _, e) = tokenformer(&args);
        assert!(o.status.success(), "{e}");
    }
    let (o, _, e) = tokenformer(&[
        "eval",
        "merge",
        &p("s0.json"),
        &p("s1.json"),
        "--json",
        &p("merged.json"),
    ]);
    assert!(o.status.success(), "{e}");
    let read = |n: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(p(n)).unwrap()).unwrap()
    };
    let (all, merged) = (read("all.json"), read("merged.json"));
    for k in [
        "images",
        "correct_top1",
        "correct_top5",
        "top1",
        "top5",
        "unreadable",
    ] {
        assert_eq!(all[k], merged[k], "{k}");
    }
    assert_eq!(all["images"], 5);
    assert_eq!(all["top5"], 60.0);
    // A shard alone is refused.
    let r = tokenformer(&["eval", "merge", &p("s0.json")]);
    assert_clean_failure(&r, &[]);
}

/// A fixture JPEG whose frame header claims 65500×65500 pixels (9 KB that
/// would decode to 12 GB).
fn bomb_jpeg() -> Vec<u8> {
    let mut b = std::fs::read(fixtures().join("vit-tiny-imagenet/val/n01518878/d.JPEG")).unwrap();
    let sof = b
        .windows(2)
        .position(|x| x[0] == 0xFF && (0xC0..=0xC2).contains(&x[1]))
        .unwrap();
    b[sof + 5..sof + 9].copy_from_slice(&[0xFF, 0xDC, 0xFF, 0xDC]);
    b
}

/// Runs `tokenformer` with one extra environment variable.
fn tokenformer_env(args: &[&str], key: &str, value: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_tokenformer"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env(key, value)
        .output()
        .unwrap()
}

#[test]
fn classify_refuses_images_above_the_pixel_limit() {
    let dir = tempfile::tempdir().unwrap();
    let bomb = dir.path().join("bomb.JPEG");
    std::fs::write(&bomb, bomb_jpeg()).unwrap();
    let (out, stdout, err) = tokenformer(&["classify", "--model", &vit(), bomb.to_str().unwrap()]);
    assert_clean_failure(
        &(out, stdout.clone(), err),
        &["could not be read", "bomb.JPEG", "65500x65500", "limit"],
    );
    assert!(
        stdout.contains("bomb.JPEG") && stdout.contains("65500x65500") && stdout.contains("limit"),
        "{stdout}"
    );
    // The limit is a flag and an environment variable.
    let img = fixtures().join("vit-tiny-imagenet/val/n01443537/a.JPEG");
    let img = img.to_str().unwrap();
    let r = tokenformer(&[
        "classify",
        "--model",
        &vit(),
        "--max-image-pixels",
        "100",
        img,
    ]);
    assert_clean_failure(&r, &["could not be read"]);
    assert!(r.1.contains("limit of 100 pixels"), "{}", r.1);
    let o = tokenformer_env(
        &["classify", "--model", &vit(), img],
        "TOKENFORMER_MAX_IMAGE_PIXELS",
        "100",
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stdout).contains("limit of 100 pixels"));
    let (o, _, e) = tokenformer(&[
        "classify",
        "--model",
        &vit(),
        "--max-image-pixels",
        "1000000000",
        img,
    ]);
    assert!(o.status.success(), "{e}");
}

#[cfg(unix)]
#[test]
fn eval_imagenet_lists_bombs_and_fifos_as_unreadable() {
    let dir = tempfile::tempdir().unwrap();
    let val = dir.path().join("val");
    for (class, files) in [
        ("n01443537", &["a.JPEG", "b.png"][..]),
        ("n01491361", &["c.JPEG"][..]),
        ("n01518878", &["d.JPEG", "e.JPEG"][..]),
    ] {
        std::fs::create_dir_all(val.join(class)).unwrap();
        for f in files {
            std::fs::copy(
                fixtures().join("vit-tiny-imagenet/val").join(class).join(f),
                val.join(class).join(f),
            )
            .unwrap();
        }
    }
    std::fs::write(val.join("n01443537/bomb.JPEG"), bomb_jpeg()).unwrap();
    let fifo = val.join("n01491361/x.JPEG");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let json = dir.path().join("r.json");
    let (o, stdout, e) = tokenformer(&[
        "eval",
        "imagenet",
        "--model",
        &vit(),
        "--data",
        val.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(o.status.success(), "{e}");
    assert!(
        stdout.contains("bomb.JPEG") && stdout.contains("x.JPEG"),
        "{stdout}"
    );
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["images"], 5);
    assert_eq!(r["unreadable"], 2);
    assert_eq!(r["top5"], 60.0);
    assert_eq!(r["max_image_pixels"], 50_000_000);
    assert_eq!(r["data_sha256"].as_str().unwrap().len(), 64);
    assert_eq!(r["model_commit"], Value::Null);
}

/// Runs `tokenformer` against a fake Hub with its own cache.
fn hub_cli(hub: &str, home: &std::path::Path, args: &[&str]) -> (std::process::Output, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenformer"))
        .args(args)
        .env("HF_ENDPOINT", hub)
        .env("HF_HOME", home)
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("HF_TOKEN")
        .env("HF_HUB_OFFLINE", "0")
        .env("TOKENFORMER_HUB_RETRIES", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, err)
}

#[test]
fn results_record_the_resolved_commit_and_merge_refuses_two_commits() {
    let hub = common::hub_server::FakeHub::start();
    let vit_dir = fixtures().join("vit-tiny-imagenet/vit-tiny");
    let first = hub.add_folder("acme/vit-tiny", "main", &vit_dir);
    let home = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let run = |shard: &str, out: &str| {
        let (o, e) = hub_cli(
            &hub.endpoint(),
            home.path(),
            &[
                "eval",
                "imagenet",
                "--model",
                "acme/vit-tiny",
                "--data",
                &val(),
                "--shard",
                shard,
                "--json",
                &p(out),
                "--quiet",
            ],
        );
        assert!(o.status.success(), "{e}");
        let v: Value = serde_json::from_str(&std::fs::read_to_string(p(out)).unwrap()).unwrap();
        v
    };
    let s0 = run("0/2", "s0.json");
    assert_eq!(s0["model"], "acme/vit-tiny@main");
    assert_eq!(s0["model_commit"], Value::String(first.clone()));
    // `main` moves on between the two shards: the second runs another commit.
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&vit_dir)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            (
                path.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&path).unwrap(),
            )
        })
        .collect();
    files.push(("README.md".into(), b"changed".to_vec()));
    let borrowed: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (n.as_str(), &b[..])).collect();
    let second = hub.add_commit("acme/vit-tiny", "main", &borrowed);
    assert_ne!(first, second);
    let s1 = run("1/2", "s1.json");
    assert_eq!(s1["model_commit"], Value::String(second.clone()));
    let r = tokenformer(&["eval", "merge", &p("s0.json"), &p("s1.json")]);
    assert_clean_failure(&r, &["model commit", &first, &second]);
}

/// The embeddings and file list of an `embed --out` file.
fn read_embeddings(path: &std::path::Path) -> (Vec<Vec<f32>>, Vec<String>, String) {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    let files: Vec<String> = serde_json::from_str(&meta["files"]).unwrap();
    let t = candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu).unwrap();
    let rows = t["embeddings"].to_vec2::<f32>().unwrap();
    (rows, files, meta["model"].clone())
}

/// `embed` writes, for a folder of images, one row per image in the order of the
/// `files` it lists: the library's embeddings, whose head is `classify`'s answer.
/// It refuses to replace a file without --force, and an unreadable image fails the
/// run by name while the file keeps the others.
#[test]
fn embed_writes_a_row_per_image_and_keeps_what_it_could_read() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("emb.safetensors");
    let out_s = out.to_str().unwrap();
    let (model, data) = (vit(), val());
    // `embed --model M --out OUT [extra...] INPUT`
    let embed = |out: &std::path::Path, input: &str, extra: &[&str]| {
        let mut args = vec!["embed", "--model", &model, "--out", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        args.push(input);
        tokenformer(&args)
    };
    let r = embed(&out, &data, &["--batch-size", "2"]);
    assert!(r.0.status.success(), "{}", r.2);
    let (rows, files, source) = read_embeddings(&out);
    let listed = tokenformer::vision::dataset::image_files(&[data.clone().into()]).unwrap();
    let listed: Vec<String> = listed.iter().map(|p| p.display().to_string()).collect();
    assert_eq!(files, listed);
    assert_eq!(source, model);
    assert_eq!((rows.len(), rows[0].len()), (5, 32));
    // The library's rows (another batch size: float rounding only), and their head.
    let vit_model = {
        let f = tokenformer::loader::locate(&model, &Default::default()).unwrap();
        tokenformer::loader::load_vit(&f, &candle_core::Device::Cpu).unwrap()
    };
    let paths: Vec<std::path::PathBuf> = files.iter().map(Into::into).collect();
    let lib = tokenformer::eval::imagenet::embed_files(&vit_model, &paths, 32, &Default::default())
        .unwrap();
    let exp: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("vit-tiny-imagenet/expected.json")).unwrap(),
    )
    .unwrap();
    let t = candle_core::safetensors::load(
        fixtures().join("vit-tiny-imagenet/vit-tiny/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let (w, b) = (
        t["head.weight"].to_vec2::<f32>().unwrap(),
        t["head.bias"].to_vec1::<f32>().unwrap(),
    );
    for (i, (row, (_, want))) in rows.iter().zip(&lib).enumerate() {
        let want = want.as_ref().unwrap();
        let d = max_abs_diff_of(row, want);
        assert!(d < 1e-5, "{}: {d}", files[i]);
        let logits: Vec<f32> = w
            .iter()
            .zip(&b)
            .map(|(wc, bc)| wc.iter().zip(row).map(|(x, y)| x * y).sum::<f32>() + bc)
            .collect();
        let top = tokenformer::vision::top_k(&logits, 1)[0] as u64;
        assert_eq!(
            top,
            exp["images"][i]["top5"][0].as_u64().unwrap(),
            "{}",
            files[i]
        );
    }

    // An existing file is not replaced without --force.
    std::fs::write(&out, b"keep me").unwrap();
    let r = embed(&out, &data, &[]);
    assert_clean_failure(&r, &[out_s, "--force"]);
    assert_eq!(std::fs::read(&out).unwrap(), b"keep me");
    let r = embed(&out, &data, &["--force"]);
    assert!(r.0.status.success(), "{}", r.2);
    assert_eq!(read_embeddings(&out).0, rows);
    // A folder as --out is refused by name.
    let r = embed(dir.path(), &data, &[]);
    assert_clean_failure(&r, &[dir.path().to_str().unwrap(), "folder"]);
    // So is a file in a folder that is not there, before any image runs.
    let nowhere = dir.path().join("no/such/folder/e.safetensors");
    let r = embed(&nowhere, &data, &[]);
    assert_clean_failure(&r, &["cannot write into", "no/such/folder"]);
    // A path the `files` list (JSON) cannot hold is refused before the work.
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let odd = tempfile::tempdir().unwrap();
        let name = std::ffi::OsStr::from_bytes(b"caf\xe9.png");
        std::fs::copy(&paths[1], odd.path().join(name)).unwrap();
        let e = dir.path().join("odd.safetensors");
        let r = embed(&e, odd.path().to_str().unwrap(), &[]);
        assert_clean_failure(&r, &["not a UTF-8 path"]);
        assert!(!e.exists());
    }

    // A broken image among good ones: the run fails naming it, the file holds the rest.
    let imgs = tempfile::tempdir().unwrap();
    for (i, f) in paths.iter().take(3).enumerate() {
        std::fs::copy(
            f,
            imgs.path()
                .join(format!("{i}.{}", f.extension().unwrap().to_str().unwrap())),
        )
        .unwrap();
    }
    std::fs::write(imgs.path().join("1b.png"), b"not a png").unwrap();
    let part = dir.path().join("part.safetensors");
    let r = embed(&part, imgs.path().to_str().unwrap(), &[]);
    assert_clean_failure(&r, &["1b.png", "1 of 4 image(s)", "holds the other 3"]);
    let (part_rows, part_files, _) = read_embeddings(&part);
    let names: Vec<&str> = part_files
        .iter()
        .map(|f| f.rsplit('/').next().unwrap())
        .collect();
    assert_eq!(names.len(), 3);
    assert!(!names.contains(&"1b.png"), "{names:?}");
    for (i, row) in part_rows.iter().enumerate() {
        let d = max_abs_diff_of(row, &rows[i]);
        assert!(d < 1e-5, "{}: {d}", part_files[i]);
    }
}
