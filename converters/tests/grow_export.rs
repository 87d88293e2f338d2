//! End-to-end tests of `tokenformer-convert grow` and `export` (and the
//! safety rules every converter follows) on the tiny fixtures: progressive
//! scaling must keep the function exactly when promised (arXiv 2410.23168
//! §3.5), and the official export must round-trip bit for bit.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::{
    bits, cmd, config_u64s, fails_cleanly, fixture_pixels, lm_bin, lm_fixture, load_lm, load_vit,
    locate, max_diff, official_args, ok, run, s, vit_dir,
};
use serde_json::Value;
use tokenformer::checkpoint::{self, torch_zip};
use tokenformer::loader;
use tokenformer::probe::probe_ids;

/// `grow --model <model> --out <out>`, then the whitespace-separated `flags`.
fn grow_args(model: &Path, out: &Path, flags: &str) -> Vec<String> {
    cmd(&["grow", "--model", s(model), "--out", s(out)], flags)
}

/// `export --model <model> --out <out>`, then the whitespace-separated `flags`.
fn export_args(model: &Path, out: &Path, flags: &str) -> Vec<String> {
    cmd(&["export", "--model", s(model), "--out", s(out)], flags)
}

/// A different, longer input of our own for the equality checks.
fn test_ids(vocab: usize) -> Vec<u32> {
    (0..40u64)
        .map(|i| ((i * 7919 + 13) % vocab as u64) as u32)
        .collect()
}

fn lm_logits(model: &Path, ids: &[u32]) -> Tensor {
    let input = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    load_lm(model)
        .forward(&input, None)
        .unwrap()
        .squeeze(0)
        .unwrap()
}

/// How far model `b`'s logits on `ids` are from model `a`'s (max absolute difference).
fn lm_shift(a: &Path, b: &Path, ids: &[u32]) -> f32 {
    max_diff(&lm_logits(a, ids), &lm_logits(b, ids))
}

fn vit_logits(model: &Path, pixels: &Tensor) -> Tensor {
    load_vit(model).forward(pixels).unwrap()
}

fn tensors(model: &Path) -> checkpoint::Tensors {
    loader::read_weights(&locate(model), None, &Device::Cpu)
        .unwrap()
        .tensors
}

fn config(dir: &Path) -> Value {
    common::read_json(&dir.join("config.json"))
}

/// The token counts of both tiny fixtures (LM and ViT): growth keeps them as the
/// scale constants so that the grown model computes the same function.
fn fixture_token_counts() -> Value {
    serde_json::json!({"qkv": 24, "proj": 20, "ffn": 48})
}

/// The front matter of a model card.
fn card(dir: &Path) -> serde_json::Map<String, Value> {
    tokenformer::card::parse(&std::fs::read_to_string(dir.join("README.md")).unwrap())
        .unwrap()
        .0
}

/// The logit shift a grown model's card reports for the probe input.
fn card_shift(dir: &Path) -> f64 {
    card(dir)["tokenformer_growth"]["probe_max_abs_logit_diff"]
        .as_f64()
        .unwrap()
}

/// The number the tool printed after `marker` on stdout (its measured shift).
fn printed_shift(stdout: &str, marker: &str) -> f32 {
    stdout
        .lines()
        .find_map(|l| l.split(marker).nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no shift printed: {stdout}"))
}

/// Asserts that a shift the tool reported (`what`: where it said so) is the real
/// one, to `tol` relative to the larger of the shift and 1.
fn assert_same_shift(what: &str, reported: f32, real: f32, tol: f32) {
    assert!(
        (reported - real).abs() <= tol * real.max(1.0),
        "{what} {reported}, real shift {real}"
    );
}

/// FNV-1a over every file under `p`, to prove an input was not touched.
fn hash_tree(p: &Path) -> BTreeMap<PathBuf, u64> {
    let mut out = BTreeMap::new();
    let mut stack = vec![p.to_path_buf()];
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for b in std::fs::read(&p).unwrap() {
                h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
            let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
            out.insert(
                p,
                h ^ mtime
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64,
            );
        }
    }
    out
}

fn visible_entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn grow_keep_with_zero_keys_is_exact_from_the_bin_and_from_a_converted_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let canonical = tmp.path().join("canonical");
    ok(&official_args(&canonical, ""));
    let before_inputs = hash_tree(&lm_fixture());
    let original = lm_logits(&lm_bin(), &test_ids(50304));
    for (i, src) in [lm_bin(), canonical.clone()].iter().enumerate() {
        let out = tmp.path().join(format!("grown{i}"));
        let flags = "--qkv-tokens 30 --proj-tokens 26 --ffn-tokens 64 --seed 3";
        let stdout = ok(&grow_args(src, &out, flags));
        assert!(stdout.contains("Looks ok!"), "{stdout}");
        let grown = lm_logits(&out, &test_ids(50304));
        let d = max_diff(&original, &grown);
        assert!(d <= 1e-5, "keep + zero keys changed the logits by {d}");

        let cfg = config(&out);
        assert_eq!(
            config_u64s(&cfg, ["qkv_tokens", "proj_tokens", "ffn_tokens"]),
            [Some(30), Some(26), Some(64)]
        );
        assert_eq!(cfg["pattention_scale_tokens"], fixture_token_counts());

        // Old tokens first and untouched, new keys zero, new values random; dtype kept.
        let (old, new) = (tensors(src), tensors(&out));
        assert_eq!(old.len(), new.len());
        for (name, o) in &old {
            let n = &new[name];
            assert_eq!(n.dtype(), DType::F16, "{name}");
            assert_eq!(n.dtype(), o.dtype(), "{name}");
            if !name.contains("_param_tokens") {
                assert_eq!(bits(n), bits(o), "{name}");
                continue;
            }
            let rows = o.dim(0).unwrap();
            assert_eq!(
                bits(&n.narrow(0, 0, rows).unwrap()),
                bits(o),
                "{name}: old tokens changed"
            );
            let added = n
                .narrow(0, rows, n.dim(0).unwrap() - rows)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let abs_max = added
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            if name.ends_with("key_param_tokens") {
                assert_eq!(abs_max, 0.0, "{name}: new keys must be zero");
            } else {
                assert!(abs_max > 0.0, "{name}: new values must be initialised");
            }
        }
        let reported = card_shift(&out);
        assert!(reported <= 1e-5, "reported {reported}");
    }
    assert_eq!(
        hash_tree(&lm_fixture()),
        before_inputs,
        "the input was modified"
    );
}

#[test]
fn grow_scale_grow_changes_the_function_and_reports_the_real_shift() {
    let tmp = tempfile::tempdir().unwrap();
    let (bin, out) = (lm_bin(), tmp.path().join("grown"));
    let flags = "--qkv-tokens 40 --ffn-tokens 96 --scale grow";
    let stdout = ok(&grow_args(&bin, &out, flags));
    assert!(
        config(&out).get("pattention_scale_tokens").is_none(),
        "constants equal the counts: no field"
    );
    let ids = probe_ids(50304, 2048);
    let real = lm_shift(&bin, &out, &ids);
    assert!(
        real > 1e-2,
        "--scale grow should change the logits, shift {real}"
    );
    assert_same_shift("card says", card_shift(&out) as f32, real, 1e-6);
    let printed = printed_shift(&stdout, "grown model = ");
    assert_same_shift("printed", printed, real, 1e-5);

    // Same growth with --scale keep, but random keys: also a change, and different from the above.
    let keep = tmp.path().join("keep-normal");
    let flags = "--qkv-tokens 40 --key-init normal --key-std 0.5";
    ok(&grow_args(&bin, &keep, flags));
    let shift = lm_shift(&bin, &keep, &ids);
    assert!(
        shift > 1e-3,
        "normal keys should change the function, shift {shift}"
    );
}

#[test]
fn grown_twice_along_a_ladder_still_equals_the_original() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("step1"), tmp.path().join("step2"));
    ok(&grow_args(&lm_bin(), &a, "--qkv-tokens 30 --ffn-tokens 60"));
    let flags = "--qkv-tokens 40 --proj-tokens 32 --ffn-tokens 80 --seed 9";
    ok(&grow_args(&a, &b, flags));
    // The constants are the original model's, not the intermediate step's.
    assert_eq!(
        config(&b)["pattention_scale_tokens"],
        fixture_token_counts()
    );
    // The last growth's starting counts, for `train --train new`.
    assert_eq!(
        config(&b)["grown_from_tokens"],
        serde_json::json!({"qkv": 30, "proj": 20, "ffn": 60})
    );
    let d = lm_shift(&lm_bin(), &b, &test_ids(50304));
    assert!(d <= 1e-5, "twice grown differs by {d}");
    assert_eq!(
        tensors(&b)["layers.1.mlp.key_param_tokens"].dims(),
        &[80, 32]
    );
}

#[test]
fn grow_refuses_what_it_cannot_do_without_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let (bin, out) = (lm_bin(), tmp.path().join("out"));
    let err = fails_cleanly(&grow_args(&bin, &out, "--qkv-tokens 16"));
    assert!(err.contains("qkv_tokens") && err.contains("24"), "{err}");
    let err = fails_cleanly(&grow_args(&bin, &out, "--preset 354M"));
    assert!(
        err.contains("tokenformer-ladder-354m") && err.contains("hidden_size"),
        "{err}"
    );
    let err = fails_cleanly(&grow_args(&bin, &out, "--preset 3B"));
    assert!(err.contains("unknown preset"), "{err}");
    // Past the config's limits: refused before any tensor grows (the allocator aborted).
    let err = fails_cleanly(&grow_args(&bin, &out, "--ffn-tokens 100000000000"));
    assert!(
        err.contains("ffn_tokens") && err.contains("100000000000") && err.contains("allowed"),
        "{err}"
    );
    let nope = tmp.path().join("nope");
    let err = fails_cleanly(&grow_args(&nope, &out, "--qkv-tokens 30"));
    assert!(err.contains("nope"), "{err}");
    assert!(!out.exists());
    assert!(
        visible_entries(tmp.path()).is_empty(),
        "{:?}",
        visible_entries(tmp.path())
    );
}

#[test]
fn grow_writes_shards_with_an_index_that_load_back_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, sharded) = (tmp.path().join("one"), tmp.path().join("sharded"));
    let flags = "--qkv-tokens 32 --ffn-tokens 64 --seed 5 --dtype f32";
    ok(&grow_args(&lm_bin(), &one, flags));
    let shard_flags = format!("--max-shard-size 64KB {flags}");
    ok(&grow_args(&lm_bin(), &sharded, &shard_flags));
    assert!(!sharded.join("model.safetensors").exists());
    let index = common::read_json(&sharded.join("model.safetensors.index.json"));
    let files: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(files.len() >= 3, "{files:?}");
    for f in &files {
        let size = std::fs::metadata(sharded.join(f)).unwrap().len();
        // A shard exceeds the limit only when a single tensor does (the embedding).
        let st =
            unsafe { candle_core::safetensors::MmapedSafetensors::new(sharded.join(f)) }.unwrap();
        assert!(
            size <= 64_000 + 4096 || st.tensors().len() == 1,
            "{f}: {size} bytes"
        );
    }
    // The official converter shards the same way.
    let official = tmp.path().join("official-sharded");
    ok(&official_args(&official, "--max-shard-size 10KB"));
    assert!(official.join("model.safetensors.index.json").is_file());
    let (o, src) = (tensors(&official), tensors(&lm_bin()));
    assert_eq!(o.keys().collect::<Vec<_>>(), src.keys().collect::<Vec<_>>());
    assert!(o
        .iter()
        .all(|(n, t)| bits(t) == bits(&src[n]) && t.dtype() == src[n].dtype()));

    let (a, b) = (tensors(&one), tensors(&sharded));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, t) in &a {
        assert_eq!(t.dtype(), DType::F32, "--dtype f32: {name}");
        assert_eq!(bits(t), bits(&b[name]), "{name}");
    }
    assert_eq!(lm_shift(&one, &sharded, &test_ids(50304)), 0.0);
}

#[test]
fn export_round_trips_bit_identically_and_loads_with_the_same_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let canonical = tmp.path().join("canonical");
    ok(&official_args(&canonical, ""));
    let before = hash_tree(&canonical);
    std::fs::create_dir(tmp.path().join("export")).unwrap();
    let bin = tmp.path().join("export/pytorch_model.bin");
    let stdout = ok(&export_args(&canonical, &bin, "--format official"));
    assert!(stdout.contains("Looks ok!"), "{stdout}");
    assert!(bin.with_extension("yml").is_file());
    assert_eq!(hash_tree(&canonical), before, "the input was modified");

    // Read back with the project's official reader: same names, dtypes and bits.
    let src = tensors(&canonical);
    let (back, ignored) = checkpoint::read_official_bin(&bin, 2, None, &Device::Cpu).unwrap();
    assert!(ignored.is_empty(), "{ignored:?}");
    assert_eq!(
        src.keys().collect::<Vec<_>>(),
        back.keys().collect::<Vec<_>>()
    );
    for (name, t) in &src {
        assert_eq!(back[name].dtype(), t.dtype(), "{name}");
        assert_eq!(back[name].dims(), t.dims(), "{name}");
        assert_eq!(bits(&back[name]), bits(t), "{name}");
    }
    // And it equals the released-format fixture it came from, name for name.
    let (orig, _) = checkpoint::read_official_bin(&lm_bin(), 2, None, &Device::Cpu).unwrap();
    for (name, t) in &orig {
        assert_eq!(bits(&back[name]), bits(t), "{name}");
    }
    // The exported .bin + yml is a loadable model with identical logits.
    assert_eq!(lm_shift(&canonical, &bin, &test_ids(50304)), 0.0);

    // Existing output is refused without --force, replaced with it.
    let err = fails_cleanly(&export_args(&canonical, &bin, ""));
    assert!(err.contains("--force"), "{err}");
    ok(&export_args(&canonical, &bin, "--force --dtype bf16"));
    let (bf, _) = checkpoint::read_official_bin(&bin, 2, None, &Device::Cpu).unwrap();
    assert!(bf.values().all(|t| t.dtype() == DType::BF16));
    assert_eq!(visible_entries(&tmp.path().join("export")).len(), 2);
}

#[test]
fn export_refuses_a_function_change_unless_allowed_and_then_reports_it() {
    let tmp = tempfile::tempdir().unwrap();
    let grown = tmp.path().join("grown");
    let flags = "--qkv-tokens 48 --ffn-tokens 96";
    ok(&grow_args(&lm_bin(), &grown, flags));
    let bin = tmp.path().join("grown.bin");
    let err = fails_cleanly(&export_args(&grown, &bin, ""));
    assert!(
        err.contains("--allow-function-change") && err.contains("√n"),
        "{err}"
    );
    assert!(!bin.exists() && !bin.with_extension("yml").exists());

    let stdout = ok(&export_args(&grown, &bin, "--allow-function-change"));
    let ids = probe_ids(50304, 2048);
    let real = lm_shift(&grown, &bin, &ids);
    assert!(
        real > 1e-2,
        "dropping the constants must change the function: {real}"
    );
    let printed = printed_shift(&stdout, "official export = ");
    assert_same_shift("printed", printed, real, 1e-5);
    // The export computes what `--scale grow` (same seed) would have produced: n = token count.
    let official_like = tmp.path().join("scale-grow");
    let scale_grow = format!("{flags} --scale grow");
    ok(&grow_args(&lm_bin(), &official_like, &scale_grow));
    assert_eq!(lm_shift(&official_like, &bin, &ids), 0.0);
    let yml = std::fs::read_to_string(bin.with_extension("yml")).unwrap();
    assert!(
        yml.contains("\"qkv_slot_num\": 48") && yml.contains("\"ffn_slot_num\": 96"),
        "{yml}"
    );
}

#[test]
fn export_refuses_vision_models_and_bad_targets() {
    let tmp = tempfile::tempdir().unwrap();
    let err = fails_cleanly(&export_args(&vit_dir(), &tmp.path().join("vit.bin"), ""));
    assert!(err.contains("no official checkpoint format"), "{err}");
    let safetensors = tmp.path().join("model.safetensors");
    let err = fails_cleanly(&export_args(&lm_bin(), &safetensors, ""));
    assert!(err.contains(".bin"), "{err}");
    let err = fails_cleanly(&export_args(&lm_bin(), &lm_bin(), ""));
    assert!(err.contains("overwrite the input"), "{err}");
    assert!(visible_entries(tmp.path()).is_empty());
}

#[test]
fn converters_refuse_non_empty_output_and_replace_it_with_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    for args in [
        grow_args(&lm_bin(), &out, "--qkv-tokens 30"),
        official_args(&out, ""),
    ] {
        let err = fails_cleanly(&args);
        assert!(err.contains("--force"), "{err}");
        assert_eq!(
            std::fs::read_to_string(out.join("keep.txt")).unwrap(),
            "mine"
        );
    }
    ok(&grow_args(&lm_bin(), &out, "--qkv-tokens 30 --force"));
    assert!(!out.join("keep.txt").exists());
    assert_eq!(config(&out)["qkv_tokens"], 30);
    // Only the finished folder is left: no staging folders, no moved-aside old one.
    assert_eq!(visible_entries(tmp.path()), ["out"]);
}

/// Runs `tokenformer-convert` under umask 027 (through `sh`, which sets it for the child).
fn run_with_umask_027(args: &[String]) {
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg("umask 027 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_tokenformer-convert"))
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn converters_never_write_into_their_input_and_outputs_follow_the_umask() {
    let tmp = tempfile::tempdir().unwrap();
    let lm = tmp.path().join("lm");
    run_with_umask_027(&official_args(&lm, ""));
    // Every written file and folder follows the umask (the weights were 0600, the folder 0700).
    for f in ["model.safetensors", "config.json", "README.md"] {
        assert_eq!(mode(&lm.join(f)), 0o640, "{f}");
    }
    assert_eq!(mode(&lm), 0o750);
    let grown = tmp.path().join("grown");
    run_with_umask_027(&grow_args(&lm, &grown, "--qkv-tokens 30"));
    assert_eq!(mode(&grown.join("model.safetensors")), 0o640);
    assert_eq!(mode(&grown), 0o750);
    let bin = tmp.path().join("x.bin");
    run_with_umask_027(&export_args(&lm, &bin, ""));
    assert_eq!(
        (mode(&bin), mode(&bin.with_extension("yml"))),
        (0o640, 0o640)
    );

    // --out inside the model folder, equal to it, through a link to it, or with `..`.
    let before = hash_tree(&lm);
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&lm, &link).unwrap();
    let dotdot = tmp.path().join("grown/../lm/sub");
    for args in [
        export_args(&lm, &lm.join("x.bin"), ""),
        export_args(&lm, &lm.join("sub/x.bin"), ""),
        grow_args(&lm, &lm.join("sub"), "--qkv-tokens 30"),
        grow_args(&lm, &lm, "--qkv-tokens 30 --force"),
        grow_args(&lm, &link.join("sub"), "--qkv-tokens 30"),
        grow_args(&link, &lm.join("sub"), "--qkv-tokens 30"),
        grow_args(&lm, &dotdot, "--qkv-tokens 30"),
    ] {
        let err = fails_cleanly(&args);
        assert!(err.contains("would overwrite the input"), "{args:?}: {err}");
    }
    assert_eq!(hash_tree(&lm), before);
    let mut entries = visible_entries(&lm);
    entries.sort();
    assert_eq!(entries, ["README.md", "config.json", "model.safetensors"]);
}

#[test]
fn an_invalid_output_path_or_a_kill_leaves_no_output() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = lm_bin();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let under_file = file.join("out");
    let bin_under_file = file.join("m.bin");
    let proc_dir = Path::new("/proc/self/tokenformer-grow-out");
    let proc_bin = Path::new("/proc/self/tokenformer-export.bin");
    for args in [
        grow_args(&bin, &under_file, "--qkv-tokens 30"),
        grow_args(&bin, proc_dir, "--qkv-tokens 30"),
        export_args(&bin, &bin_under_file, ""),
        export_args(&bin, proc_bin, ""),
        official_args(&under_file, ""),
    ] {
        fails_cleanly(&args);
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "x");
    assert_eq!(visible_entries(tmp.path()), ["a-file"]);

    // A process killed just before the final rename leaves no --out behind.
    let out = tmp.path().join("killed");
    let killed_bin = tmp.path().join("killed.bin");
    let env = [("TOKENFORMER_CONVERT_ABORT_BEFORE_COMMIT", "1")];
    let o = run(&grow_args(&bin, &out, "--qkv-tokens 30"), &env);
    assert_eq!(o.status.code(), Some(137));
    let o = run(&export_args(&bin, &killed_bin, ""), &env);
    assert_eq!(o.status.code(), Some(137));
    assert!(!out.exists() && !killed_bin.exists() && !killed_bin.with_extension("yml").exists());
    assert!(visible_entries(tmp.path())
        .iter()
        .all(|n| n == "a-file" || n.starts_with('.')));
}

#[test]
fn torch_zip_archives_are_aligned_and_zip64_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let a = Tensor::arange(0f32, 24.0, &dev)
        .unwrap()
        .reshape((2, 3, 4))
        .unwrap();
    let b = Tensor::new(&[1.5f32, -2.25, 3.0], &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let c = Tensor::new(&[[0.5f32, 7.0], [-1.0, 1e-3]], &dev)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let entries = vec![
        ("a".to_string(), a.clone()),
        ("b.weight".to_string(), b.clone()),
        ("c".to_string(), c.clone()),
    ];
    for force_zip64 in [false, true] {
        let path = tmp.path().join(format!("t{force_zip64}.bin"));
        torch_zip::write_state_dict(&path, &entries, torch_zip::WriteOptions { force_zip64 })
            .unwrap();
        let pth = candle_core::pickle::PthTensors::new(&path, None).unwrap();
        for (name, t) in &entries {
            let back = pth.get(name).unwrap().unwrap();
            assert_eq!(back.dtype(), t.dtype(), "{name}");
            assert_eq!(back.dims(), t.dims(), "{name}");
            assert_eq!(bits(&back), bits(t), "{name}");
        }
        // Every record's payload starts at a multiple of 64 (torch's mmap loading relies on it).
        let bytes = std::fs::read(&path).unwrap();
        let (mut off, mut records) = (0usize, 0);
        while bytes[off..].starts_with(&[0x50, 0x4b, 3, 4]) {
            let u16_at = |i: usize| u16::from_le_bytes([bytes[i], bytes[i + 1]]) as usize;
            let mut size = u32::from_le_bytes(bytes[off + 18..off + 22].try_into().unwrap()) as u64;
            let (name_len, extra_len) = (u16_at(off + 26), u16_at(off + 28));
            if size == 0xFFFF_FFFF {
                assert!(force_zip64);
                let z = off + 30 + name_len; // the zip64 extra comes first
                assert_eq!(u16_at(z), 1);
                size = u64::from_le_bytes(bytes[z + 4..z + 12].try_into().unwrap());
            }
            let data = off + 30 + name_len + extra_len;
            assert_eq!(data % 64, 0, "record {records} payload at {data}");
            off = data + size as usize;
            records += 1;
        }
        // data.pkl, .format_version, .storage_alignment, byteorder, 3 storages, version, serialization id
        assert_eq!(records, 9);
    }
}

#[test]
fn untied_f32_models_with_other_activations_export_and_grow_exactly() {
    use tokenformer::models::tokenformer::Config;
    use tokenformer::pattention::Activation;
    let dev = Device::Cpu;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let mut cfg = Config::released(3, 16, 2);
    (
        cfg.qkv_tokens,
        cfg.proj_tokens,
        cfg.ffn_tokens,
        cfg.vocab_size,
    ) = (12, 10, 20, 96);
    (cfg.max_position_embeddings, cfg.rotary_pct) = (64, 0.5);
    cfg.pattention_activation = Activation::GeluL2Norm;
    cfg.tie_word_embeddings = false;
    let mut t = checkpoint::Tensors::new();
    let mut put = |name: String, shape: &[usize]| {
        let seed = t.len() as f64 + 1.0;
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f64 * 0.7 + seed).sin() * 0.5) as f32)
            .collect();
        t.insert(name, Tensor::from_vec(v, shape, &dev).unwrap());
    };
    put("word_embeddings.weight".into(), &[96, 16]);
    put("final_linear.weight".into(), &[96, 16]);
    put("final_norm.weight".into(), &[16]);
    put("final_norm.bias".into(), &[16]);
    for i in 0..3 {
        for (m, n) in [
            ("attention.query", 12),
            ("attention.key", 12),
            ("attention.value", 12),
            ("attention.proj", 10),
            ("mlp", 20),
        ] {
            put(format!("layers.{i}.{m}.key_param_tokens"), &[n, 16]);
            put(format!("layers.{i}.{m}.value_param_tokens"), &[n, 16]);
        }
    }
    checkpoint::write_safetensors(&src, &t, checkpoint::DEFAULT_SHARD_BYTES).unwrap();
    let write_config = |cfg: &Config| {
        std::fs::write(src.join("config.json"), serde_json::to_string(cfg).unwrap()).unwrap()
    };
    write_config(&cfg);
    let ids: Vec<u32> = (0..30).map(|i| (i * 5 + 1) % 96).collect();
    let original = lm_logits(&src, &ids);

    let bin = tmp.path().join("untied.bin");
    ok(&export_args(&src, &bin, ""));
    assert!(std::fs::read_to_string(bin.with_extension("yml"))
        .unwrap()
        .contains("\"no_weight_tying\": true"));
    let (back, _) = checkpoint::read_official_bin(&bin, 3, None, &dev).unwrap();
    assert_eq!(back.len(), t.len());
    assert!(back
        .iter()
        .all(|(n, x)| x.dtype() == DType::F32 && bits(x) == bits(&t[n])));
    assert_eq!(max_diff(&original, &lm_logits(&bin, &ids)), 0.0);

    let grown = tmp.path().join("grown");
    let flags = "--qkv-tokens 20 --proj-tokens 11 --ffn-tokens 33";
    ok(&grow_args(&bin, &grown, flags));
    let d = max_diff(&original, &lm_logits(&grown, &ids));
    assert!(d <= 1e-5, "{d}");
    assert_eq!(tensors(&grown)["final_linear.weight"].dims(), &[96, 16]);

    // Softmax Θ gives zero keys weight too: growth runs, says so, and reports the shift.
    cfg.pattention_activation = Activation::Softmax;
    write_config(&cfg);
    let soft = tmp.path().join("softmax");
    let stdout = ok(&grow_args(&src, &soft, "--ffn-tokens 40"));
    assert!(stdout.contains("softmax"), "{stdout}");
    let d = lm_shift(&src, &soft, &ids);
    assert!(d > 1e-4, "{d}");
}

#[test]
fn grow_vision_keep_is_exact_grow_reports_the_real_shift_and_ladders_compose() {
    let tmp = tempfile::tempdir().unwrap();
    let vit = vit_dir();
    let pixels = fixture_pixels();
    let before = hash_tree(&vit);
    let original = vit_logits(&vit, &pixels);

    let keep = tmp.path().join("keep");
    let flags = "--qkv-tokens 30 --proj-tokens 24 --ffn-tokens 64";
    let stdout = ok(&grow_args(&vit, &keep, flags));
    assert!(stdout.contains("Looks ok!"), "{stdout}");
    let d = max_diff(&original, &vit_logits(&keep, &pixels));
    assert!(
        d <= 1e-5,
        "vision keep + zero keys changed the logits by {d}"
    );
    let cfg = config(&keep);
    assert_eq!(cfg["pattention_scale_tokens"], fixture_token_counts());
    assert_eq!(cfg["num_classes"], 10, "other config keys are kept");
    assert_eq!(card(&keep)["pipeline_tag"], "image-classification");
    let (old, new) = (tensors(&vit), tensors(&keep));
    assert_eq!(
        bits(&old["patch_embed.weight"]),
        bits(&new["patch_embed.weight"])
    );
    assert_eq!(new["layers.1.mlp.value_param_tokens"].dims(), &[64, 32]);

    // Ladder: grow the grown model again; still the original function.
    let twice = tmp.path().join("twice");
    ok(&grow_args(&keep, &twice, "--qkv-tokens 40 --ffn-tokens 80"));
    let d = max_diff(&original, &vit_logits(&twice, &pixels));
    assert!(d <= 1e-5, "twice grown vision model differs by {d}");

    let grown = tmp.path().join("grow");
    ok(&grow_args(&vit, &grown, &format!("{flags} --scale grow")));
    assert!(config(&grown).get("pattention_scale_tokens").is_none());
    let d = max_diff(&original, &vit_logits(&grown, &pixels));
    assert!(
        d > 1e-3,
        "--scale grow should change the vision logits, shift {d}"
    );
    // The converters' probe image, so the shift checked is the one the tool reports.
    let probe = tokenformer::probe::probe_pixels(1, 3, 32, &Device::Cpu).unwrap();
    let real = max_diff(&vit_logits(&vit, &probe), &vit_logits(&grown, &probe));
    assert_same_shift("card says", card_shift(&grown) as f32, real, 1e-6);
    assert_eq!(hash_tree(&vit), before, "the input was modified");
}
