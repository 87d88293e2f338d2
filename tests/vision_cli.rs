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
