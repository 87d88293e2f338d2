//! Helpers of the training tests: running `tokenformer train`, reading what a run
//! wrote, and the resume and kill checks every architecture's trainer passes.

use std::path::Path;
use std::process::Output;

use candle_core::{Device, Tensor};
use serde_json::Value;
use tokenformer::checkpoint::Tensors;
use tokenformer::loader::{self, LocateOptions};

/// Every element of `t`, widened to f64.
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(candle_core::DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A tiny language model (d 32, 2 heads, the GPT-NeoX vocabulary) written into
/// `dir` as init.json, and the `train` arguments that start it on the shipped
/// text: everything but `--out`, `--steps` and the options a test varies.
pub fn tiny_lm_run(dir: &Path) -> Vec<String> {
    let mut cfg = super::tiny_config(50304, 64);
    cfg.hidden_size = 32;
    cfg.num_heads = 2;
    let init = dir.join("init.json");
    std::fs::write(&init, serde_json::to_string(&cfg).unwrap()).unwrap();
    let (text, tok) = (
        super::fixtures().join("train-text.txt"),
        super::tokenizer_fixture(),
    );
    [
        "--init",
        init.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--lr",
        "3e-3",
    ]
    .map(String::from)
    .to_vec()
}

/// Runs `tokenformer train ARGS` with extra environment variables.
pub fn tokenformer_train(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = std::process::Command::new(super::bin());
    c.arg("train").args(args).env("HF_HUB_OFFLINE", "1");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// Asserts success; returns stdout.
pub fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The lines of `out/metrics.jsonl`.
pub fn metrics(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The tensors of a model folder, as stored.
pub fn weights(dir: &Path) -> Tensors {
    let files = loader::locate(dir.to_str().unwrap(), &LocateOptions::default()).unwrap();
    loader::read_weights(&files, None, &Device::Cpu)
        .unwrap()
        .tensors
}

/// The bit patterns of an f32 tensor.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// A run of `2 * half` steps (`start`: every argument but `--out`, `--steps` and
/// `--save-every`) against the same run killed right after its step-`half` checkpoint,
/// resumed (`resume`: the arguments besides `--resume` and `--out`) and killed while
/// placing the next checkpoint, then resumed to the end: the kill during the save leaves
/// the step-`half` checkpoint loadable and no later one, and the resumed run's metrics
/// and final weights equal the uninterrupted run's bit for bit.
pub fn assert_resume_equals_uninterrupted(tmp: &Path, start: &[&str], resume: &[&str], half: u64) {
    let (whole, parts) = (tmp.join("whole"), tmp.join("parts"));
    let (steps, every) = ((2 * half).to_string(), half.to_string());
    let run = |out: &Path| -> Vec<String> {
        let mut v: Vec<String> = start.iter().map(|s| s.to_string()).collect();
        v.extend(["--out".into(), out.display().to_string()]);
        v.extend([
            "--steps".into(),
            steps.clone(),
            "--save-every".into(),
            every.clone(),
        ]);
        v
    };
    let call = |v: Vec<String>, env: &[(&str, &str)]| {
        let args: Vec<&str> = v.iter().map(String::as_str).collect();
        tokenformer_train(&args, env)
    };
    ok(&call(run(&whole), &[]));
    let o = call(
        run(&parts),
        &[("TOKENFORMER_TRAIN_ABORT_AFTER_STEP", &every)],
    );
    assert_eq!(
        o.status.code(),
        Some(137),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let p = parts.display().to_string();
    let mut again: Vec<String> = ["--resume", &p, "--out", &p]
        .iter()
        .map(|s| s.to_string())
        .collect();
    again.extend(resume.iter().map(|s| s.to_string()));
    // Killed while placing the next checkpoint: the step-`half` one is untouched and loads.
    let o = call(again.clone(), &[("TOKENFORMER_TRAIN_ABORT_IN_SAVE", "1")]);
    assert_eq!(
        o.status.code(),
        Some(137),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let names: Vec<String> = std::fs::read_dir(&parts)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    let (kept, next) = (
        format!("checkpoint-{half:06}"),
        format!("checkpoint-{:06}", 2 * half),
    );
    assert!(names.contains(&kept) && !names.contains(&next), "{names:?}");
    weights(&parts.join(&kept));
    // Resumed from step `half` (the killed runs appended lines for the steps after it
    // too, so compare the resumed run's own lines and the final weights).
    std::fs::remove_file(parts.join("metrics.jsonl")).unwrap();
    ok(&call(again, &[]));
    let (w, p) = (metrics(&whole), metrics(&parts));
    assert_eq!(p.len() as u64, half);
    for (x, y) in w[half as usize..].iter().zip(&p) {
        assert_eq!(x, y, "step {}", x["step"]);
    }
    let (ww, pw) = (weights(&whole.join(&next)), weights(&parts.join(&next)));
    assert_eq!(ww.len(), pw.len());
    for (name, t) in &ww {
        assert_eq!(bits(t), bits(&pw[name]), "{name}");
    }
}
