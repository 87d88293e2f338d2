//! `--device` and `TOKENFORMER_DEVICE` through the `tokenformer` binary of the
//! default build (no `cuda` feature): CUDA is refused with how to build it,
//! before any model is looked up or any file written; a bad value is named;
//! `cpu` (and `auto`, which is the CPU here) run as before.

use std::process::{Command, Output};

/// Runs the binary with no Hub and no inherited `TOKENFORMER_DEVICE` (the
/// caller's shell must not decide what these tests see), plus `env`.
fn tokenformer(args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tokenformer"));
    c.args(args)
        .env_remove("TOKENFORMER_DEVICE")
        .env("HF_HUB_OFFLINE", "1")
        .env(
            "HF_HOME",
            std::env::temp_dir().join("tokenformer-tests-no-hub"),
        );
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("binary runs");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    (out, err)
}

/// Every command with `--device`, with its required arguments. The paths
/// need not exist: the device is checked first.
#[cfg(not(feature = "cuda"))]
fn commands(out: &str) -> Vec<Vec<String>> {
    let cmds: [&[&str]; 8] = [
        &["generate", "--model", "no-such-model", "--prompt", "a"],
        &["score", "--model", "no-such-model", "--text", "a"],
        &[
            "eval",
            "pile",
            "--model",
            "no-such-model",
            "--data",
            "none.jsonl",
        ],
        &[
            "eval",
            "tasks",
            "--model",
            "no-such-model",
            "--tasks",
            "lambada",
            "--data",
            "none.jsonl",
        ],
        &[
            "eval",
            "imagenet",
            "--model",
            "no-such-model",
            "--data",
            "none",
        ],
        &["classify", "--model", "no-such-model", "none.png"],
        &[
            "train",
            "--model",
            "no-such-model",
            "--data",
            "none.txt",
            "--out",
            out,
        ],
        &["bench", "--only", "matmul"],
    ];
    cmds.iter()
        .map(|c| c.iter().map(|s| s.to_string()).collect())
        .collect()
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_says_how_to_build_it_on_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    for args in commands(out.to_str().unwrap()) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        for (flag, env) in [
            (Some("cuda"), None),
            (Some("cuda:1"), None),
            (None, Some("cuda")),
        ] {
            let mut a = args.clone();
            if let Some(d) = flag {
                a.extend(["--device", d]);
            }
            let env: Vec<(&str, &str)> =
                env.map(|d| ("TOKENFORMER_DEVICE", d)).into_iter().collect();
            let (o, err) = tokenformer(&a, &env);
            assert_eq!(o.status.code(), Some(1), "{a:?} {env:?}: {err}");
            let spec = flag.or(env.first().map(|e| e.1)).unwrap();
            assert!(err.contains(&format!("device `{spec}`")), "{a:?}: {err}");
            assert!(err.contains("no CUDA support"), "{a:?}: {err}");
            assert!(err.contains("--features cuda"), "{a:?}: {err}");
            // Refused before the model is looked up.
            assert!(!err.contains("no-such-model"), "{a:?}: {err}");
        }
    }
    assert!(
        !out.exists(),
        "train wrote {} before refusing",
        out.display()
    );
}

#[test]
fn a_bad_device_is_named() {
    let args = ["score", "--model", "tiny-kjv-lm", "--ids", "1,2,3"];
    let (o, err) = tokenformer(&[&args[..], &["--device", "bogus"]].concat(), &[]);
    assert_eq!(o.status.code(), Some(2), "a usage error: {err}");
    assert!(err.contains("unknown device `bogus`"), "{err}");
    assert!(err.contains("cpu, cuda, cuda:N"), "{err}");
    let (o, err) = tokenformer(&args, &[("TOKENFORMER_DEVICE", "gpu0")]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown device `gpu0`"), "{err}");
}

#[test]
fn cpu_from_the_flag_or_the_environment_runs_as_without() {
    let args = [
        "score",
        "--model",
        "tiny-kjv-lm",
        "--ids",
        "1,2,3,4,5",
        "--json",
    ];
    let (o, err) = tokenformer(&args, &[]);
    assert!(o.status.success(), "{err}");
    let want = o.stdout;
    assert!(!want.is_empty());
    let mut runs = vec![
        tokenformer(&args, &[("TOKENFORMER_DEVICE", "cpu")]),
        tokenformer(&[&args[..], &["--device", "cpu"]].concat(), &[]),
        // The flag wins over the environment.
        tokenformer(
            &[&args[..], &["--device", "cpu"]].concat(),
            &[("TOKENFORMER_DEVICE", "cuda")],
        ),
    ];
    // `auto` is the CPU in a build without CUDA.
    if cfg!(not(feature = "cuda")) {
        runs.push(tokenformer(
            &[&args[..], &["--device", "auto"]].concat(),
            &[],
        ));
    }
    for (o, err) in runs {
        assert!(o.status.success(), "{err}");
        assert_eq!(o.stdout, want);
    }
}

#[test]
fn the_help_says_cuda_needs_the_feature() {
    let (o, _) = tokenformer(&["generate", "--help"], &[]);
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("--device"), "{help}");
    assert!(help.contains("TOKENFORMER_DEVICE"), "{help}");
    assert!(help.contains("--features cuda"), "{help}");
}

/// `--dtype` computes in bf16 (so the scores move, a little) and refuses a
/// `--weight-dtype` it would ignore; `classify` takes it too.
#[test]
fn dtype_bf16_scores_close_to_f32_and_conflicting_flags_are_refused() {
    let args = [
        "score",
        "--model",
        "tiny-kjv-lm",
        "--text",
        "In the beginning God created the heaven and the earth.",
        "--json",
    ];
    let nll = |extra: &[&str]| -> f64 {
        let (o, err) = tokenformer(&[&args[..], extra].concat(), &[]);
        assert!(o.status.success(), "{extra:?}: {err}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["nll"].as_f64().unwrap()
    };
    let (f32, bf16) = (nll(&[]), nll(&["--dtype", "bf16"]));
    assert_ne!(f32, bf16);
    assert!((bf16 / f32 - 1.0).abs() < 0.01, "{bf16} vs {f32}");
    let (o, err) = tokenformer(
        &[&args[..], &["--dtype", "bf16", "--weight-dtype", "q8"]].concat(),
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--weight-dtype q8 applies to f32 computation"),
        "{err}"
    );
    let img = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/zoo/examples/digits/seven/0005.png"
    );
    let (o, err) = tokenformer(
        &[
            "classify",
            "--model",
            "tiny-digits-vit",
            "--dtype",
            "bf16",
            img,
        ],
        &[],
    );
    assert!(o.status.success(), "{err}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("seven"));
}
