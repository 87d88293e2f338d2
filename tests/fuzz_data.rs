//! Deterministic mutation fuzzing of the data readers (seeded, a few thousand
//! cases, bounded to well under a minute in release): truncations, byte flips,
//! insertions and header edits of `.jsonl`, `.jsonl.zst` and the shipped
//! image fixtures, each read in-process through the real readers (the JSON
//! lines reader and the task/Pile document parsers, `eval pile` and `eval
//! tasks` on a tiny model, the image decoders and the eval transform). Every
//! case must end in `Ok` or `Err`: a panic that escapes, an abort, or a single
//! allocation above [`ALLOC_BOUND`] (this binary's global allocator refuses
//! and records it) fails the test and names the case.
//!
//! Also here, because they need the counting allocator: a decompression-bomb
//! JPEG header and a 256 MiB line in a `.jsonl.zst` are refused without
//! allocating anything near their size.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::Device;
use tokenformer::eval::pile::{self, DataFile, JsonLines, Method, PileOptions, Shard};
use tokenformer::eval::tasks::{self, Task, TaskOptions};
use tokenformer::loader::{self, LocateOptions};
use tokenformer::scoring::Scorer;
use tokenformer::vision::{self, resample::Filter, DecodeLimits, EvalTransform};

use common::*;

// ---------- an allocator that refuses (and records) huge single allocations ----------

/// No single allocation of a reader may exceed this.
const ALLOC_BOUND: usize = 512 << 20;

static LARGEST: AtomicUsize = AtomicUsize::new(0);
static TRIPPED: AtomicUsize = AtomicUsize::new(0);
static TRACKING: AtomicBool = AtomicBool::new(false);

struct Bounded;

impl Bounded {
    fn check(size: usize) -> bool {
        if TRACKING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(size, Ordering::Relaxed);
        }
        if size > ALLOC_BOUND {
            TRIPPED.fetch_max(size, Ordering::Relaxed);
            return false;
        }
        true
    }
}

// SAFETY: forwards to `System`, only refusing (null) some sizes.
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !Self::check(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !Self::check(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !Self::check(new_size) {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: Bounded = Bounded;

/// The tests of this binary share the allocator's counters: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f`, returning the largest single allocation made meanwhile.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.store(0, Ordering::Relaxed);
    TRACKING.store(true, Ordering::Relaxed);
    let out = f();
    TRACKING.store(false, Ordering::Relaxed);
    (out, LARGEST.load(Ordering::Relaxed))
}

// ---------- a seeded generator and the mutations ----------

/// SplitMix64: small, seeded, the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

/// One generic mutation of `b`, described for failure messages.
fn mutate(rng: &mut Rng, b: &mut Vec<u8>) -> String {
    let n = b.len();
    match rng.below(6) {
        0 => {
            let at = rng.below(n + 1);
            b.truncate(at);
            format!("truncate at {at}")
        }
        1 => {
            let k = 1 + rng.below(8);
            for _ in 0..k {
                if n > 0 {
                    let i = rng.below(n);
                    b[i] ^= 1 << rng.below(8);
                }
            }
            format!("flip {k} bits")
        }
        2 => {
            let k = 1 + rng.below(4);
            for _ in 0..k {
                if n > 0 {
                    let i = rng.below(n);
                    b[i] = rng.byte();
                }
            }
            format!("set {k} bytes")
        }
        3 => {
            let at = rng.below(n + 1);
            let k = 1 + rng.below(16);
            let ins: Vec<u8> = (0..k).map(|_| rng.byte()).collect();
            b.splice(at..at, ins);
            format!("insert {k} bytes at {at}")
        }
        4 => {
            let at = rng.below(n + 1);
            let len = rng.below(n - at + 1).min(64);
            b.drain(at..at + len);
            format!("delete {len} bytes at {at}")
        }
        _ => {
            let at = rng.below(n + 1);
            let len = rng.below(n - at + 1).min(256);
            let copy = b[at..at + len].to_vec();
            let to = rng.below(b.len() + 1);
            b.splice(to..to, copy);
            format!("duplicate {len} bytes from {at} to {to}")
        }
    }
}

/// Dimensions worth trying in headers: zero, tiny, large, at the format's maximum.
fn interesting_dim(rng: &mut Rng) -> u32 {
    const DIMS: [u32; 12] = [0, 1, 2, 7, 255, 256, 1000, 2000, 8191, 16383, 65500, 65535];
    if rng.below(4) == 0 {
        rng.next() as u32
    } else {
        DIMS[rng.below(DIMS.len())]
    }
}

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

/// Offset of a JPEG's start-of-frame segment (SOF0..SOF2).
fn jpeg_sof(b: &[u8]) -> Option<usize> {
    b.windows(2)
        .position(|w| w[0] == 0xFF && (0xC0..=0xC2).contains(&w[1]))
}

/// Edits the image header fields decoders allocate from.
fn header_edit(rng: &mut Rng, b: &mut [u8]) -> String {
    let (w, h) = (interesting_dim(rng), interesting_dim(rng));
    if b.starts_with(&[0xFF, 0xD8]) {
        if let Some(sof) = jpeg_sof(b) {
            if sof + 10 <= b.len() {
                match rng.below(3) {
                    0 => {
                        b[sof + 5..sof + 7].copy_from_slice(&(h as u16).to_be_bytes());
                        b[sof + 7..sof + 9].copy_from_slice(&(w as u16).to_be_bytes());
                        return format!("JPEG SOF {}x{}", w as u16, h as u16);
                    }
                    1 => {
                        b[sof + 9] = rng.byte() % 6;
                        return format!("JPEG components {}", b[sof + 9]);
                    }
                    _ => {
                        b[sof + 4] = rng.byte();
                        return format!("JPEG precision {}", b[sof + 4]);
                    }
                }
            }
        }
    } else if b.starts_with(b"\x89PNG") && b.len() >= 33 {
        match rng.below(3) {
            0 => {
                b[16..20].copy_from_slice(&w.to_be_bytes());
                b[20..24].copy_from_slice(&h.to_be_bytes());
            }
            1 => b[24] = [1, 2, 4, 8, 16, 3, 0][rng.below(7)],
            _ => b[25] = [0, 2, 3, 4, 6, 1, 7][rng.below(7)],
        }
        // Mostly with a valid CRC, so the edit reaches the decoder.
        if rng.below(4) != 0 {
            let crc = crc32(&b[12..29]);
            b[29..33].copy_from_slice(&crc.to_be_bytes());
        }
        return format!("PNG IHDR {w}x{h} depth {} colour {}", b[24], b[25]);
    } else if b.starts_with(b"RIFF") && b.len() >= 30 {
        // VP8/VP8L/VP8X dimensions live in the first chunk's first bytes.
        let at = 20 + rng.below(10);
        b[at] = rng.byte();
        b[at + 1] = rng.byte();
        return format!("WebP header bytes at {at}");
    } else if b.starts_with(&[0x28, 0xB5, 0x2F, 0xFD]) && b.len() >= 14 {
        match rng.below(3) {
            0 => {
                // No single segment, then a window descriptor of up to 2^41 bytes.
                b[4] &= !0x20;
                b[5] = rng.byte() | 0x80;
                return format!("zstd window descriptor {:#x}", b[5]);
            }
            1 => {
                // A frame content size claiming up to 2^64 bytes.
                b[4] = 0xE0 | (b[4] & 0x07);
                for x in &mut b[5..13] {
                    *x = 0xFF;
                }
                return "zstd content size 2^64-1".into();
            }
            _ => {
                let i = 4 + rng.below(10);
                b[i] = rng.byte();
                return format!("zstd header byte {i}");
            }
        }
    }
    mutate(rng, &mut b.to_vec())
}

// ---------- running the cases ----------

/// Failures so far, each naming its case.
#[derive(Default)]
struct Report {
    cases: usize,
    errors: usize,
    failures: Vec<String>,
}

impl Report {
    /// Runs one case: it must return (Ok or Err) without a panic escaping and
    /// without a refused allocation.
    fn run<T, E>(&mut self, name: &str, f: impl FnOnce() -> Result<T, E>) {
        self.cases += 1;
        TRIPPED.store(0, Ordering::Relaxed);
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => self.errors += 1,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                self.failures.push(format!("{name}: panicked: {msg}"));
            }
        }
        let tripped = TRIPPED.swap(0, Ordering::Relaxed);
        if tripped > 0 {
            self.failures.push(format!(
                "{name}: tried to allocate {tripped} bytes at once (bound {ALLOC_BOUND})"
            ));
        }
    }

    fn finish(self, what: &str) {
        assert!(
            self.failures.is_empty(),
            "{what}: {} of {} cases failed:\n{}",
            self.failures.len(),
            self.cases,
            self.failures.join("\n")
        );
        // Most mutations must be caught as errors, and some must still read.
        assert!(
            self.errors > 0 && self.errors < self.cases,
            "{what}: {} errors in {} cases",
            self.errors,
            self.cases
        );
        eprintln!(
            "{what}: {} cases, {} clean errors, 0 panics",
            self.cases, self.errors
        );
    }
}

fn image_fixtures() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in ["vit-tiny-imagenet/val", "vision-pillow"] {
        let mut stack = vec![fixtures().join(dir)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if vision::dataset::is_image(&p) {
                    out.push(p);
                }
            }
        }
    }
    out.sort();
    assert!(out.len() >= 12, "image fixtures: {out:?}");
    out
}

fn transform() -> EvalTransform {
    EvalTransform {
        resize: 36,
        crop: 32,
        filter: Filter::Bicubic,
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
        resize_mode: tokenformer::models::vit::ResizeMode::ShorterSide,
    }
}

#[test]
fn mutated_images_decode_or_fail_cleanly() {
    let _g = serial();
    let mut rng = Rng(0x1DA7_A5EE_D000_0015);
    let t = transform();
    // A lower pixel limit than the default keeps each decode fast; the
    // default limit is exercised by the header edits' huge sizes too.
    let small = DecodeLimits::new(4_000_000);
    let mut report = Report::default();
    let dir = tempfile::tempdir().unwrap();
    for path in image_fixtures() {
        let original = std::fs::read(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // The fixture itself decodes.
        vision::decode_bytes_with(&original, &small).unwrap();
        for k in 0..150 {
            let mut b = original.clone();
            let mut what = Vec::new();
            for _ in 0..1 + rng.below(3) {
                what.push(if rng.below(3) == 0 {
                    header_edit(&mut rng, &mut b)
                } else {
                    mutate(&mut rng, &mut b)
                });
            }
            let case = format!("{name} #{k} [{}]", what.join(", "));
            let limits = if k % 10 == 0 {
                DecodeLimits::default()
            } else {
                small
            };
            if k % 10 == 5 {
                // Through the file reader too.
                let p = dir.path().join(format!("case{}", name));
                std::fs::write(&p, &b).unwrap();
                report.run(&case, || t.load_with(&p, &small));
            } else {
                report.run(&case, || {
                    vision::decode_bytes_with(&b, &limits).and_then(|img| {
                        if img.width as u64 * img.height as u64 > limits.max_pixels {
                            panic!("decoded {}x{} above the limit", img.width, img.height);
                        }
                        t.apply(&img).map_err(|e| e.to_string())
                    })
                });
            }
        }
    }
    report.finish("images");
}

/// Pile-style and task-style lines with escapes, Unicode and nesting.
fn jsonl_text() -> String {
    let docs = [
        r#"{"text": "The cat sat on the mat.\nIt was \"happy\".", "meta": {"pile_set_name": "Pile-CC"}}"#,
        r#"{"text": "ünïcödé … 日本語 \ud83d\ude00 tabs\tand\\backslashes", "meta": {"pile_set_name": "ArXiv"}}"#,
        r#"{"text": "a dog ran to the house", "goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Sing.", "label": 1}"#,
        r#"{"ctx_a": "A man", "ctx_b": "is cooking", "activity_label": "Cooking", "endings": ["a", "b", "c", "d"], "label": "2", "text": "x y"}"#,
        r#"{"sentence": "The trophy did not fit because _ was big.", "option1": "trophy", "option2": "case", "answer": "1"}"#,
        r#"{"question": {"stem": "What is 2+2?", "choices": [{"text": "4", "label": "A"}, {"text": "5", "label": "B"}]}, "answerKey": "A"}"#,
        r#"{"question": "Sky colour?", "choices": {"text": ["blue", "red"], "label": ["A", "B"]}, "answerKey": "A", "text": "blue sky"}"#,
        r#"{"text": "", "meta": {}}"#,
        r#"{"text": "numbers 1e308 -0 123456789012345678901234567890", "meta": {"pile_set_name": null}}"#,
    ];
    docs.join("\n") + "\n"
}

/// Text-specific edits: structure characters, long lines, deep nesting, bad UTF-8.
fn text_edit(rng: &mut Rng, b: &mut Vec<u8>) -> String {
    let at = rng.below(b.len() + 1);
    let ins: Vec<u8> = match rng.below(6) {
        0 => vec![[b'\n', b'"', b'\\', b'{', b'}', b'[', b':', b','][rng.below(8)]],
        1 => vec![b'x'; 2000 + rng.below(4000)],
        2 => {
            let d = 100 + rng.below(5000);
            [vec![b'['; d], vec![b']'; d]].concat()
        }
        3 => vec![0xFF, 0xFE, 0xC3],
        4 => b"\\ud800".to_vec(),
        _ => vec![0],
    };
    let what = format!("insert {} text bytes at {at}", ins.len());
    b.splice(at..at, ins);
    what
}

/// Reads every line and builds every task's example from each parsed one.
fn read_all(path: &Path, max_line: usize) -> tokenformer::Result<usize> {
    let mut n = 0;
    for item in JsonLines::new(DataFile::open_with(path, max_line)?) {
        let (_, value) = item?;
        if let Ok(v) = value {
            for task in Task::ALL {
                let _ = tasks::build_example(task, &v, Some("1"));
                let _ = tasks::build_example(task, &v, None);
            }
        }
        n += 1;
    }
    Ok(n)
}

#[test]
fn mutated_jsonl_and_zst_read_or_fail_cleanly() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("model");
    let cfg = tiny_config(50_304, 16);
    write_lm_folder(&model_dir, &cfg, &random_lm_tensors(&cfg, 7));
    std::fs::copy(tokenizer_fixture(), model_dir.join("tokenizer.json")).unwrap();
    let files = loader::locate(model_dir.to_str().unwrap(), &LocateOptions::default()).unwrap();
    let model = loader::load_lm(&files, &Device::Cpu).unwrap();
    let tok = loader::load_tokenizer(&files).unwrap();
    let scorer = Scorer::new(&model, None).unwrap().with_greedy(true);
    let popts = |skip_bad| PileOptions {
        method: Method::Rolling,
        batch_size: 8,
        subset: None,
        limit: None,
        shard: Shard::WHOLE,
        skip_bad,
        prefix_token: 0,
        max_line_bytes: 4096,
    };
    let topts = TaskOptions {
        batch_size: 8,
        limit: None,
        shard: Shard::WHOLE,
        skip_bad: true,
        prefix_token: 0,
        max_line_bytes: 4096,
    };

    let text = jsonl_text().into_bytes();
    let zst = zstd::encode_all(&text[..], 3).unwrap();
    let mut rng = Rng(0x0F0F_5EED_0000_0014);
    let mut report = Report::default();
    for k in 0..1000 {
        let mut b = text.clone();
        let mut what = Vec::new();
        for _ in 0..1 + rng.below(3) {
            what.push(if rng.below(2) == 0 {
                text_edit(&mut rng, &mut b)
            } else {
                mutate(&mut rng, &mut b)
            });
        }
        let p = dir.path().join(format!("case{k}.jsonl"));
        std::fs::write(&p, &b).unwrap();
        let case = format!("jsonl #{k} [{}]", what.join(", "));
        report.run(&case, || read_all(&p, 4096));
        if k % 10 == 3 {
            // The same bytes as a `.txt` document.
            let t = dir.path().join(format!("case{k}.txt"));
            std::fs::write(&t, &b).unwrap();
            report.run(&format!("{case} as .txt"), || {
                pile::evaluate(&scorer, &tok, &t, &popts(false), |_| {})
            });
        }
        if k % 5 == 0 {
            report.run(&format!("{case} eval pile"), || {
                pile::evaluate(&scorer, &tok, &p, &popts(k % 10 == 0), |_| {})
            });
            report.run(&format!("{case} eval tasks"), || {
                tasks::evaluate(&scorer, &tok, Task::Lambada, &p, None, &topts, |_, _| {})
            });
        }
    }
    for k in 0..1000 {
        let mut b = zst.clone();
        let mut what = Vec::new();
        for _ in 0..1 + rng.below(2) {
            what.push(if rng.below(3) == 0 {
                header_edit(&mut rng, &mut b)
            } else {
                mutate(&mut rng, &mut b)
            });
        }
        let p = dir.path().join(format!("case{k}.jsonl.zst"));
        std::fs::write(&p, &b).unwrap();
        let case = format!("jsonl.zst #{k} [{}]", what.join(", "));
        report.run(&case, || read_all(&p, 4096));
    }
    report.finish("text data");
}

#[test]
fn a_bomb_jpeg_header_is_refused_before_allocating() {
    let _g = serial();
    let mut b = std::fs::read(fixtures().join("vit-tiny-imagenet/val/n01518878/d.JPEG")).unwrap();
    let sof = jpeg_sof(&b).unwrap();
    b[sof + 5..sof + 9].copy_from_slice(&[0xFF, 0xDC, 0xFF, 0xDC]); // 65500 x 65500
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bomb.JPEG");
    std::fs::write(&p, &b).unwrap();
    TRIPPED.store(0, Ordering::Relaxed);
    let (r, largest) = largest_allocation(|| vision::open_rgb(&p));
    let e = r.unwrap_err().to_string();
    assert!(
        e.contains("bomb.JPEG") && e.contains("65500x65500") && e.contains("limit"),
        "{e}"
    );
    assert_eq!(
        TRIPPED.load(Ordering::Relaxed),
        0,
        "a huge allocation was attempted"
    );
    assert!(largest < 16 << 20, "largest allocation {largest} bytes");
}

#[test]
fn a_256_mib_line_is_refused_without_holding_it() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let line_len: usize = 256 << 20;
    let write = |name: &str, prefix: &[u8], suffix: &[u8]| {
        let p = dir.path().join(name);
        let mut enc = zstd::Encoder::new(std::fs::File::create(&p).unwrap(), 1).unwrap();
        enc.write_all(prefix).unwrap();
        let chunk = vec![b'a'; 1 << 20];
        for _ in 0..line_len >> 20 {
            enc.write_all(&chunk).unwrap();
        }
        enc.write_all(suffix).unwrap();
        enc.finish().unwrap();
        p
    };
    let jsonl = write(
        "big.jsonl.zst",
        b"{\"text\": \"short\"}\n{\"text\": \"",
        b"\"}\n{\"text\": \"after\"}\n",
    );
    let (lines, largest) = largest_allocation(|| {
        JsonLines::new(DataFile::open(&jsonl).unwrap())
            .map(|r| r.unwrap())
            .map(|(n, v)| (n, v.is_ok()))
            .collect::<Vec<_>>()
    });
    // The long line is a bad line (named by number); the lines around it read.
    assert_eq!(lines, vec![(1, true), (2, false), (3, true)]);
    assert!(largest < 64 << 20, "largest allocation {largest} bytes");

    let txt = write("big.txt.zst", b"", b"");
    let (r, largest) = largest_allocation(|| DataFile::open(&txt).unwrap().read_document());
    let e = r.unwrap_err().to_string();
    assert!(e.contains("big.txt.zst") && e.contains("limit"), "{e}");
    assert!(largest < 64 << 20, "largest allocation {largest} bytes");
}

#[test]
fn a_zstd_frame_asking_for_a_huge_window_is_refused() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    // Frame header: magic, descriptor 0 (no single segment, no content size),
    // window descriptor for 2^31 bytes, then a raw last block of 5 bytes.
    let mut frame = vec![0x28, 0xB5, 0x2F, 0xFD, 0x00, (31 - 10) << 3];
    let block_header = (5u32 << 3) | 1; // raw block, last
    frame.extend_from_slice(&block_header.to_le_bytes()[..3]);
    frame.extend_from_slice(b"{}\n{}");
    let p = dir.path().join("window.jsonl.zst");
    std::fs::write(&p, &frame).unwrap();
    let (r, largest) = largest_allocation(|| read_all(&p, 4096));
    let e = r.unwrap_err().to_string();
    assert!(e.contains("window.jsonl.zst"), "{e}");
    assert!(largest < 16 << 20, "largest allocation {largest} bytes");
}
