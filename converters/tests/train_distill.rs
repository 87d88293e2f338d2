//! `tokenformer train --distill-from SOURCE` against `tokenformer-convert import
//! --recover-steps`: the same distillation from the same start on the same data must
//! give the same model, on the random fixture sources (`tests/fixtures/import`); bad
//! sources fail with the file or tensor named; calibration data comes from a Hub
//! dataset (a fake Hub on 127.0.0.1) as from a local file.

mod common;
#[path = "../../tests/common/hub_server.rs"]
mod hub_server;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{Device, Tensor};
use common::{ok, read_json, s, tokenformer_bin};
use serde_json::Value;

fn import_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/import")
}

fn samples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/samples")
}

/// Runs `tokenformer` with `args` (and a fake Hub's environment when given).
fn tokenformer(args: &[&str], hub: Option<(&str, &Path)>) -> Output {
    let mut c = Command::new(tokenformer_bin());
    c.args(args);
    if let Some((endpoint, home)) = hub {
        hub_env(&mut c, endpoint, home);
    }
    c.output().unwrap()
}

fn hub_env(c: &mut Command, endpoint: &str, home: &Path) {
    c.env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", home)
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("HF_TOKEN")
        .env("HF_HUB_OFFLINE", "0")
        .env("TOKENFORMER_HUB_RETRIES", "0")
        .env("TOKENFORMER_HUB_TIMEOUT", "5");
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn weights(dir: &Path) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

/// The largest absolute difference between same-named tensors of two folders (which
/// must hold the same names).
fn max_weight_diff(a: &Path, b: &Path) -> f32 {
    let (wa, wb) = (weights(a), weights(b));
    let mut names: Vec<_> = wa.keys().collect();
    names.sort();
    let mut wb_names: Vec<_> = wb.keys().collect();
    wb_names.sort();
    assert_eq!(names, wb_names);
    names
        .iter()
        .map(|n| common::max_diff(&wa[*n], &wb[*n]))
        .fold(0.0, f32::max)
}

fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn train_distill_from_gives_what_import_recover_steps_gives() {
    let root = tempfile::tempdir().unwrap();
    let text = import_fixtures().join("pythia-eval.txt");
    let steps = "6";
    for (fixture, from) in [
        ("pythia", "gpt-neox"),
        ("vit-hf", "vit"),
        ("vit-timm", "vit"),
    ] {
        let src = import_fixtures().join(fixture);
        let eval: Vec<&str> = match from {
            "vit" => vec![],
            _ => vec!["--eval-text", s(&text)],
        };
        // The start: the fitted import; the reference: the same import recovered.
        let fitted = root.path().join(format!("{fixture}-fitted"));
        ok(&common::import_args(from, &src, &fitted, &eval));
        let recovered = root.path().join(format!("{fixture}-recovered"));
        let mut flags = eval.clone();
        flags.extend(["--recover-steps", steps]);
        ok(&common::import_args(from, &src, &recovered, &flags));

        let out = root.path().join(format!("{fixture}-distilled"));
        let mut args = vec![
            "train",
            "--model",
            s(&fitted),
            "--distill-from",
            s(&src),
            "--steps",
            steps,
            "--out",
            s(&out),
        ];
        if from != "vit" {
            args.extend(["--val-data", s(&text)]);
        }
        let o = tokenformer(&args, None);
        assert!(o.status.success(), "{fixture}: {}", stderr(&o));
        let ckpt = out.join("checkpoint-000006");
        // The same model: the same windows or views, update scales and steps.
        let d = max_weight_diff(&ckpt, &recovered);
        assert!(d <= 1e-6, "{fixture}: weights differ by {d}");
        // And it did train: the values moved from the fitted import.
        let moved = max_weight_diff(&ckpt, &fitted);
        assert!(moved > 1e-5, "{fixture}: the values moved only {moved}");
        let (m_train, m_import) = (metrics(&out), metrics(&recovered));
        assert_eq!(m_train.len(), 6);
        for (a, b) in m_train.iter().zip(&m_import) {
            for k in ["loss", "kl", "hidden_mse"] {
                let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs().max(1e-9),
                    "{fixture} {k}: {x} vs {y}"
                );
            }
        }
        assert!(out.join("loss.png").is_file());
        // A model folder any command loads, with its tokenizer for text.
        assert_eq!(
            read_json(&ckpt.join("config.json")),
            read_json(&fitted.join("config.json"))
        );
        assert_eq!(ckpt.join("tokenizer.json").is_file(), from != "vit");
        // Shipped eval photos and a 292-token page are too few to mean much: said so.
        assert!(stderr(&o).contains("too small a sample"), "{}", stderr(&o));
        // Run again into the same folder: refused, the checkpoint left as it was.
        let again = tokenformer(&args, None);
        assert!(!again.status.success());
        assert!(
            stderr(&again).contains("already exists"),
            "{}",
            stderr(&again)
        );
        assert!(max_weight_diff(&ckpt, &recovered) <= 1e-6);
    }
}

/// Copies a fixture source folder to `dir`, rewriting its weights with `edit`.
fn edited_source(
    fixture: &str,
    dir: &Path,
    edit: impl FnOnce(&mut std::collections::HashMap<String, Tensor>),
) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(import_fixtures().join(fixture)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let mut w = weights(dir);
    edit(&mut w);
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    dir.to_path_buf()
}

#[test]
fn bad_sources_fail_with_the_file_or_tensor_named_and_write_nothing() {
    let root = tempfile::tempdir().unwrap();
    let lm = root.path().join("lm");
    ok(&common::import_args(
        "gpt-neox",
        &import_fixtures().join("pythia"),
        &lm,
        &["--fit", "none"],
    ));
    let vit = root.path().join("vit");
    ok(&common::import_args(
        "vit",
        &import_fixtures().join("vit-hf"),
        &vit,
        &["--fit", "none"],
    ));

    // A source missing a layer's tensors: config.json says 2 layers.
    let one_layer = edited_source("pythia", &root.path().join("one-layer"), |w| {
        w.retain(|k, _| !k.starts_with("gpt_neox.layers.1."));
    });
    let misshapen = edited_source("pythia", &root.path().join("misshapen"), |w| {
        let t = w["embed_out.weight"].narrow(1, 0, 16).unwrap();
        w.insert("embed_out.weight".into(), t);
    });
    let no_weights = root.path().join("no-weights");
    std::fs::create_dir_all(&no_weights).unwrap();
    std::fs::copy(
        import_fixtures().join("pythia/config.json"),
        no_weights.join("config.json"),
    )
    .unwrap();
    let no_config = edited_source("pythia", &root.path().join("no-config"), |_| {});
    std::fs::remove_file(no_config.join("config.json")).unwrap();

    let cases: Vec<(&Path, PathBuf, Vec<&str>)> = vec![
        // Wrong architecture: a ViT source for a language model, and the reverse.
        (
            &lm,
            import_fixtures().join("vit-hf"),
            vec!["model_type `vit`", "config.json"],
        ),
        (
            &vit,
            import_fixtures().join("pythia"),
            vec!["vit.embeddings.cls_token", "cls_token"],
        ),
        // Tensors that do not match the source's own config.json, named with the file.
        (
            &lm,
            one_layer.clone(),
            vec!["gpt_neox.layers.1.", "model.safetensors"],
        ),
        (
            &lm,
            misshapen.clone(),
            vec!["embed_out.weight", "[", "model.safetensors"],
        ),
        // Missing files.
        (
            &lm,
            no_weights.clone(),
            vec!["no model.safetensors", "no-weights"],
        ),
        (
            &lm,
            no_config.clone(),
            vec!["missing config.json", "no-config"],
        ),
        (
            &lm,
            root.path().join("nowhere"),
            vec!["nowhere", "no such folder"],
        ),
    ];
    for (i, (model, source, want)) in cases.into_iter().enumerate() {
        let out = root.path().join(format!("out-{i}"));
        let o = tokenformer(
            &[
                "train",
                "--model",
                s(model),
                "--distill-from",
                s(&source),
                "--steps",
                "2",
                "--out",
                s(&out),
            ],
            None,
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{source:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains("--distill-from"), "{source:?}: {err}");
        for w in want {
            assert!(err.contains(w), "{source:?}: wanted `{w}` in: {err}");
        }
        assert!(!out.exists(), "{source:?}: wrote {out:?}");
    }

    // A source that does not fit the TokenFormer: the student's config named, the key
    // and both values given. (The ViT student has 10 classes; a source with 5.)
    let fewer_classes = edited_source("vit-hf", &root.path().join("fewer-classes"), |w| {
        let h = w["classifier.weight"].narrow(0, 0, 5).unwrap();
        let b = w["classifier.bias"].narrow(0, 0, 5).unwrap();
        w.insert("classifier.weight".into(), h);
        w.insert("classifier.bias".into(), b);
    });
    let cfg_path = fewer_classes.join("config.json");
    let mut cfg = read_json(&cfg_path);
    if let Some(m) = cfg.get_mut("id2label").and_then(Value::as_object_mut) {
        m.retain(|k, _| k.parse::<usize>().is_ok_and(|i| i < 5));
    }
    if let Some(m) = cfg.get_mut("label2id").and_then(Value::as_object_mut) {
        m.retain(|_, v| v.as_u64().is_some_and(|i| i < 5));
    }
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let classes = weights(&vit)["head.weight"].dim(0).unwrap();
    let out = root.path().join("out-classes");
    let o = tokenformer(
        &[
            "train",
            "--model",
            s(&vit),
            "--distill-from",
            s(&fewer_classes),
            "--steps",
            "2",
            "--out",
            s(&out),
        ],
        None,
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("`num_classes` is")
            && err.contains(&classes.to_string())
            && err.contains("source's is 5")
            && err.contains(s(&vit.join("config.json"))),
        "{err}"
    );
    assert!(!out.exists());

    // Options the distillation sets itself are refused, not ignored.
    let o = tokenformer(
        &[
            "train",
            "--model",
            s(&lm),
            "--distill-from",
            s(&one_layer),
            "--steps",
            "2",
            "--out",
            s(&out),
            "--weight-decay",
            "0.1",
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--weight-decay"), "{}", stderr(&o));

    // So is a GPU: the recovery is CPU code (before this was checked, the weights went to
    // the GPU and met the source's CPU tensors in a product).
    let o = tokenformer(
        &[
            "train",
            "--model",
            s(&lm),
            "--distill-from",
            s(&import_fixtures().join("pythia")),
            "--steps",
            "2",
            "--out",
            s(&out),
            "--device",
            "cuda",
        ],
        None,
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--distill-from runs on the CPU only") && err.contains("--device cuda"),
        "{err}"
    );
    assert!(!out.exists());
}

#[test]
fn calibration_data_from_a_hub_dataset_is_the_local_data() {
    let hub = hub_server::FakeHub::start();
    let home = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    // A text dataset: the shipped calibration page as one .jsonl document, the eval
    // page as .txt; a photo dataset: the shipped calibration photos under cal/.
    let cal_text = std::fs::read_to_string(samples().join("text/calibration.txt")).unwrap();
    let eval_text = std::fs::read(import_fixtures().join("pythia-eval.txt")).unwrap();
    let jsonl = format!("{}\n", serde_json::json!({ "text": cal_text, "id": 1 }));
    hub.add_repo(
        "datasets/me/pages",
        &[
            ("cal.jsonl", jsonl.as_bytes()),
            ("eval/page.txt", eval_text.as_slice()),
        ],
    );
    let photos = root.path().join("photos");
    std::fs::create_dir_all(photos.join("cal")).unwrap();
    for e in std::fs::read_dir(samples().join("photos/calibration")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, photos.join("cal").join(p.file_name().unwrap())).unwrap();
    }
    std::fs::write(photos.join("notes.md"), "not an image").unwrap();
    hub.add_folder("datasets/me/photos", "main", &photos);
    let endpoint = hub.endpoint();
    let convert = |args: &[String]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_tokenformer-convert"));
        c.args(args);
        hub_env(&mut c, &endpoint, home.path());
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    };

    // Text: the Hub's .jsonl document and .txt page, and the same text locally.
    let local = root.path().join("lm-local");
    let eval_path = import_fixtures().join("pythia-eval.txt");
    let pythia = import_fixtures().join("pythia");
    convert(&common::import_args(
        "gpt-neox",
        &pythia,
        &local,
        &["--eval-text", s(&eval_path), "--recover-steps", "3"],
    ));
    let remote = root.path().join("lm-hub");
    convert(&common::import_args(
        "gpt-neox",
        &pythia,
        &remote,
        &[
            "--calibration-text",
            "hf://datasets/me/pages/cal.jsonl",
            "--eval-text",
            "hf://datasets/me/pages/eval/page.txt",
            "--recover-steps",
            "3",
        ],
    ));
    assert_eq!(max_weight_diff(&local, &remote), 0.0);
    let (rl, rr) = (
        read_json(&local.join("import_report.json")),
        read_json(&remote.join("import_report.json")),
    );
    assert_eq!(
        rr["calibration"]["source"],
        "hf://datasets/me/pages/cal.jsonl"
    );
    assert_eq!(rr["calibration"]["items"], rl["calibration"]["items"]);
    assert!(rr["calibration"]["items"].as_u64().unwrap() > 1000);
    assert_eq!(rr["end_to_end"], rl["end_to_end"]);
    // User eval data of 292 tokens is too small a sample too: the report says so.
    assert!(rl["end_to_end"]["sample_note"]
        .as_str()
        .is_some_and(|n| n.contains("too small")));

    // Photos: a folder of the Hub dataset (other files left alone), as the local folder.
    let local = root.path().join("vit-local");
    let vit_hf = import_fixtures().join("vit-hf");
    convert(&common::import_args(
        "vit",
        &vit_hf,
        &local,
        &["--calibration-images", s(&photos.join("cal"))],
    ));
    let remote = root.path().join("vit-hub");
    convert(&common::import_args(
        "vit",
        &vit_hf,
        &remote,
        &["--calibration-images", "hf://datasets/me/photos/cal"],
    ));
    assert_eq!(max_weight_diff(&local, &remote), 0.0);
    let r = read_json(&remote.join("import_report.json"));
    assert_eq!(r["calibration"]["items"], 8);
    assert!(!hub
        .requests()
        .iter()
        .any(|q| q.path.contains("notes.md") && q.path.contains("/resolve/")));

    // train --distill-from reads its --data from the Hub the same way.
    let out = root.path().join("distilled");
    let o = tokenformer(
        &[
            "train",
            "--model",
            s(&root.path().join("lm-local")),
            "--distill-from",
            s(&pythia),
            "--steps",
            "2",
            "--data",
            "hf://datasets/me/pages/cal.jsonl",
            "--val-data",
            "hf://datasets/me/pages/eval/page.txt",
            "--out",
            s(&out),
            "--json",
        ],
        Some((&endpoint, home.path())),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let summary: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["calibration"]["items"], rl["calibration"]["items"]);
    assert!(summary["sample_note"]
        .as_str()
        .is_some_and(|n| n.contains("292")));

    // A Hub file that is not there is named, and nothing is written.
    let out = root.path().join("missing");
    let args = common::import_args(
        "gpt-neox",
        &pythia,
        &out,
        &["--calibration-text", "hf://datasets/me/pages/nope.jsonl"],
    );
    let mut c = Command::new(env!("CARGO_BIN_EXE_tokenformer-convert"));
    c.args(&args);
    hub_env(&mut c, &endpoint, home.path());
    let o = c.output().unwrap();
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--calibration-text hf://datasets/me/pages/nope.jsonl"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
}
