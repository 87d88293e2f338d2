//! Hostile checkpoints and configs (issue 15: items 7, 9, 10, 11, 12 and the
//! mutation fuzz). Every input goes through the real loader in-process and
//! must end in `Ok` or a clean `Err`: never a panic (caught and counted), an
//! abort, or a single allocation above [`ALLOC_LIMIT`] (this binary's global
//! allocator refuses those and the test fails). Malicious pickles are refused
//! with an error naming the global or the limit, and nothing in them runs.
//!
//! The fuzz is deterministic (own PRNG, fixed seed) and sized to run in well
//! under a minute in release; `TOKENFORMER_FUZZ_SCALE=N` multiplies the case
//! counts and `TOKENFORMER_FUZZ_SEED` changes the seed, for longer runs.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use tokenformer::checkpoint;
use tokenformer::loader::{self, LocateOptions};

use common::{fixtures, lm_fixture};

// ---------------------------------------------------------------------------
// Allocation guard

/// No single allocation may exceed this (the fixtures are a few MB).
const ALLOC_LIMIT: usize = 512 << 20;
static OVER_LIMIT: AtomicUsize = AtomicUsize::new(0);
static LARGEST_REFUSED: AtomicUsize = AtomicUsize::new(0);

struct Guard;

impl Guard {
    fn refuse(size: usize) -> *mut u8 {
        OVER_LIMIT.fetch_add(1, Ordering::SeqCst);
        LARGEST_REFUSED.fetch_max(size, Ordering::SeqCst);
        std::ptr::null_mut()
    }
}

unsafe impl GlobalAlloc for Guard {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            return Self::refuse(layout.size());
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            return Self::refuse(layout.size());
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_LIMIT {
            return Self::refuse(new_size);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Guard = Guard;

fn assert_no_large_allocation(what: &str) {
    let n = OVER_LIMIT.load(Ordering::SeqCst);
    assert_eq!(
        n,
        0,
        "{what}: {n} allocation(s) above {ALLOC_LIMIT} bytes were attempted (largest {})",
        LARGEST_REFUSED.load(Ordering::SeqCst)
    );
}

// ---------------------------------------------------------------------------
// Panics: caught per case; the hook stays quiet only on a fuzzing thread.

thread_local! {
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

fn install_quiet_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                default(info)
            }
        }));
    });
}

/// What one case ended in.
enum Outcome {
    Ok,
    Err(String),
    Panic(String),
}

fn run_case(f: impl FnOnce() -> Result<(), String>) -> Outcome {
    install_quiet_hook();
    QUIET.with(|q| q.set(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(false));
    match r {
        Ok(Ok(())) => Outcome::Ok,
        Ok(Err(e)) => Outcome::Err(e),
        Err(p) => Outcome::Panic(
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        ),
    }
}

// ---------------------------------------------------------------------------
// Deterministic PRNG (SplitMix64)

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
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
    fn nonzero_byte(&mut self) -> u8 {
        1 + self.below(255) as u8
    }
}

fn fuzz_scale() -> usize {
    std::env::var("TOKENFORMER_FUZZ_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
}

fn fuzz_seed() -> u64 {
    std::env::var("TOKENFORMER_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x7F0C_E15E_ED15_2024)
}

// ---------------------------------------------------------------------------
// A minimal torch zip: stored records with correct CRCs.

fn zip_records(records: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data) in records {
        let offset = out.len() as u32;
        let crc = crc32fast::hash(data);
        let mut h = Vec::new();
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&20u16.to_le_bytes());
        h.extend_from_slice(&[0; 4]); // flags, method (stored)
        h.extend_from_slice(&[0; 4]); // time, date
        h.extend_from_slice(&crc.to_le_bytes());
        h.extend_from_slice(&(data.len() as u32).to_le_bytes());
        h.extend_from_slice(&(data.len() as u32).to_le_bytes());
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(data);
        let mut c = Vec::new();
        c.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        c.extend_from_slice(&20u16.to_le_bytes());
        c.extend_from_slice(&20u16.to_le_bytes());
        c.extend_from_slice(&[0; 4]);
        c.extend_from_slice(&[0; 4]);
        c.extend_from_slice(&crc.to_le_bytes());
        c.extend_from_slice(&(data.len() as u32).to_le_bytes());
        c.extend_from_slice(&(data.len() as u32).to_le_bytes());
        c.extend_from_slice(&(name.len() as u16).to_le_bytes());
        // Extra and comment lengths, disk, internal and external attributes.
        c.extend_from_slice(&[0; 12]);
        c.extend_from_slice(&offset.to_le_bytes());
        c.extend_from_slice(name.as_bytes());
        central.extend_from_slice(&c);
    }
    let cd_start = out.len() as u32;
    out.extend_from_slice(&central);
    let n = records.len() as u16;
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&cd_start.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

/// A record of the original fixture: name, payload range, header positions.
#[derive(Clone, Debug)]
struct ZipEntry {
    name: String,
    local: usize,
    central: usize,
    data: std::ops::Range<usize>,
}

fn u16_at(b: &[u8], i: usize) -> usize {
    u16::from_le_bytes([b[i], b[i + 1]]) as usize
}
fn u32_at(b: &[u8], i: usize) -> usize {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]) as usize
}

/// Parses a well-formed zip without comment or zip64 (the fixture).
fn zip_entries(b: &[u8]) -> (Vec<ZipEntry>, usize) {
    let eocd = b.len() - 22;
    assert_eq!(u32_at(b, eocd), 0x0605_4b50);
    let n = u16_at(b, eocd + 10);
    let mut at = u32_at(b, eocd + 16);
    let mut out = Vec::new();
    for _ in 0..n {
        assert_eq!(u32_at(b, at), 0x0201_4b50);
        let size = u32_at(b, at + 24);
        let (nl, el, cl) = (u16_at(b, at + 28), u16_at(b, at + 30), u16_at(b, at + 32));
        let local = u32_at(b, at + 42);
        let name = String::from_utf8(b[at + 46..at + 46 + nl].to_vec()).unwrap();
        let start = local + 30 + u16_at(b, local + 26) + u16_at(b, local + 28);
        out.push(ZipEntry {
            name,
            local,
            central: at,
            data: start..start + size,
        });
        at += 46 + nl + el + cl;
    }
    (out, eocd)
}

// ---------------------------------------------------------------------------
// A minimal pickler for hand-made state dicts.

#[derive(Default)]
struct Pickle(Vec<u8>);

impl Pickle {
    fn new() -> Self {
        Pickle(vec![0x80, 2])
    }
    fn op(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.0.push(b'c');
        self.0
            .extend_from_slice(format!("{module}\n{name}\n").as_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.0.push(b'X');
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn int(&mut self, v: i64) -> &mut Self {
        self.0.extend_from_slice(&[0x8a, 8]);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn tuple(&mut self, items: &[i64]) -> &mut Self {
        self.0.push(b'(');
        for &i in items {
            self.int(i);
        }
        self.0.push(b't');
        self
    }
    /// `name: _rebuild_tensor_v2(storage(key, class, numel), offset, shape, stride, False, OrderedDict())`.
    /// `storage`: (key, storage class, numel); `view`: (offset, shape, stride).
    fn tensor(
        &mut self,
        name: &str,
        (key, class, numel): (&str, &str, i64),
        (offset, shape, stride): (i64, &[i64], &[i64]),
    ) -> &mut Self {
        self.str(name)
            .global("torch._utils", "_rebuild_tensor_v2")
            .op(b"((")
            .str("storage")
            .global("torch", class)
            .str(key)
            .str("cpu")
            .int(numel)
            .op(b"tQ")
            .int(offset)
            .tuple(shape)
            .tuple(stride)
            .op(&[0x89])
            .global("collections", "OrderedDict")
            .op(b")RtR")
    }
    fn state_dict(tensors: impl FnOnce(&mut Pickle)) -> Vec<u8> {
        let mut p = Pickle::new();
        p.global("collections", "OrderedDict").op(b")R(");
        tensors(&mut p);
        p.op(b"u.");
        p.0
    }
}

/// A torch zip of `pickle` with float32 storages `data/<key>` of the given sizes.
fn torch_zip(pickle: &[u8], storages: &[(&str, usize)]) -> Vec<u8> {
    let mut records = vec![("archive/data.pkl".to_string(), pickle.to_vec())];
    for (key, bytes) in storages {
        let data: Vec<u8> = (0..*bytes).map(|i| (i % 7) as u8 * 16).collect();
        records.push((format!("archive/data/{key}"), data));
    }
    records.push(("archive/byteorder".into(), b"little".to_vec()));
    zip_records(&records)
}

// ---------------------------------------------------------------------------
// Loading through the real loader

/// A scratch folder holding a copy of the official fixture (bin + yml).
fn official_copy() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for f in ["pytorch_model.bin", "config.yml"] {
        std::fs::copy(lm_fixture().join(f), d.path().join(f)).unwrap();
    }
    d
}

fn vit_fixture() -> PathBuf {
    fixtures().join("vit-tiny-imagenet/vit-tiny")
}

fn vit_copy() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(vit_fixture().join(f), d.path().join(f)).unwrap();
    }
    d
}

fn all_finite(t: &Tensor) -> Result<bool, String> {
    let v: Vec<f32> = t
        .flatten_all()
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1())
        .map_err(|e| e.to_string())?;
    Ok(v.iter().all(|x| x.is_finite()))
}

/// Loads a language model by path (an official .bin with its yml, or a
/// folder), lists its tensors as `inspect` does, and runs three tokens: a
/// model that loads must give finite logits.
fn load_lm(path: &Path) -> Result<(), String> {
    let files = loader::locate(path.to_str().unwrap(), &LocateOptions::default())
        .map_err(|e| e.to_string())?;
    if let loader::Weights::OfficialBin(b) = &files.weights {
        checkpoint::tensor_infos(b).map_err(|e| e.to_string())?;
    }
    let model = loader::load_lm(&files, &Device::Cpu).map_err(|e| e.to_string())?;
    let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu).map_err(|e| e.to_string())?;
    let logits = model.forward(&ids, None).map_err(|e| e.to_string())?;
    if !all_finite(&logits)? {
        return Err("SILENT: loaded, but the logits are not finite".into());
    }
    Ok(())
}

/// Loads the image classifier of a folder and classifies a grey image.
fn load_vit(dir: &Path) -> Result<(), String> {
    let files = loader::locate(dir.to_str().unwrap(), &LocateOptions::default())
        .map_err(|e| e.to_string())?;
    if let loader::Weights::Safetensors(fs) = &files.weights {
        for f in fs {
            checkpoint::tensor_infos(f).map_err(|e| e.to_string())?;
        }
    }
    let model = loader::load_vit(&files, &Device::Cpu).map_err(|e| e.to_string())?;
    let s = model.config().image_size;
    let px = Tensor::zeros((1, 3, s, s), DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    let logits = model.forward(&px).map_err(|e| e.to_string())?;
    if !all_finite(&logits)? {
        return Err("SILENT: loaded, but the logits are not finite".into());
    }
    Ok(())
}

fn load_bin(bytes: &[u8]) -> Result<(), String> {
    let d = official_copy();
    let bin = d.path().join("pytorch_model.bin");
    std::fs::write(&bin, bytes).unwrap();
    load_lm(&bin)
}

fn expect_err(r: Result<(), String>, needles: &[&str]) -> String {
    let e = match r {
        Ok(()) => panic!("expected an error containing {needles:?}, got Ok"),
        Err(e) => e,
    };
    for n in needles {
        assert!(e.contains(n), "error {e:?} does not contain {n:?}");
    }
    e
}

// ---------------------------------------------------------------------------
// The fuzz

#[derive(Default)]
struct Tally {
    tried: usize,
    ok: usize,
    err: usize,
    panics: Vec<String>,
    silent: Vec<String>,
    slowest: Duration,
    slowest_case: String,
}

impl Tally {
    fn record(&mut self, case: &str, f: impl FnOnce() -> Result<(), String>) {
        self.record_expecting(case, false, f)
    }

    /// `must_fail`: the input is known to be wrong (e.g. a changed weight
    /// byte), so `Ok` would be a silently wrong result.
    fn record_expecting(
        &mut self,
        case: &str,
        must_fail: bool,
        f: impl FnOnce() -> Result<(), String>,
    ) {
        let t0 = Instant::now();
        let out = run_case(f);
        let took = t0.elapsed();
        if took > self.slowest {
            self.slowest = took;
            self.slowest_case = case.chars().take(200).collect();
        }
        self.tried += 1;
        match out {
            Outcome::Ok if must_fail => self.silent.push(format!("{case}: loaded")),
            Outcome::Ok => self.ok += 1,
            Outcome::Err(e) if e.starts_with("SILENT") => self.silent.push(format!("{case}: {e}")),
            Outcome::Err(_) => self.err += 1,
            Outcome::Panic(p) => self.panics.push(format!("{case}: {p}")),
        }
        assert_no_large_allocation(case);
    }

    fn row(&self, area: &str) -> String {
        format!(
            "{area} | {} | {} | {} | 0 (slowest case {:.0} ms) | {} | 0 | (loaded fine: {})",
            self.tried,
            self.err,
            self.panics.len(),
            self.slowest.as_secs_f64() * 1e3,
            self.silent.len(),
            self.ok
        )
    }

    fn check(&self, area: &str) {
        println!("{}", self.row(area));
        println!("  slowest: {}", self.slowest_case);
        assert!(
            self.panics.is_empty(),
            "{area}: {} panic(s), e.g. {:?}",
            self.panics.len(),
            &self.panics[..self.panics.len().min(5)]
        );
        assert!(
            self.silent.is_empty(),
            "{area}: {} silently wrong result(s), e.g. {:?}",
            self.silent.len(),
            &self.silent[..self.silent.len().min(5)]
        );
        // No case may take anywhere near a hang.
        assert!(
            self.slowest < Duration::from_secs(10),
            "{area}: a case took {:?}",
            self.slowest
        );
    }
}

/// Interesting replacement values for a 16- or 32-bit header field.
fn field_value(rng: &mut Rng, orig: u64, max: u64) -> u64 {
    match rng.below(7) {
        0 => 0,
        1 => 1,
        2 => max,
        3 => orig.wrapping_add(1) & max,
        4 => orig.wrapping_sub(1) & max,
        5 => (orig ^ (1 << rng.below(if max > 0xFFFF { 32 } else { 16 }))) & max,
        _ => rng.next() & max,
    }
}

fn put_le(b: &mut [u8], at: usize, width: usize, v: u64) {
    b[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
}

fn get_le(b: &[u8], at: usize, width: usize) -> u64 {
    let mut x = [0u8; 8];
    x[..width].copy_from_slice(&b[at..at + width]);
    u64::from_le_bytes(x)
}

/// Mutates pickle bytes: flips, deletions, duplications, random opcodes,
/// and edits of the integer/length arguments that follow opcodes.
fn mutate_pickle(rng: &mut Rng, p: &[u8]) -> Vec<u8> {
    let mut b = p.to_vec();
    let n = b.len();
    match rng.below(8) {
        0 => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(n);
                b[i] ^= rng.nonzero_byte();
            }
        }
        1 => b.truncate(rng.below(n)),
        2 => {
            let i = rng.below(n);
            let len = 1 + rng.below(32.min(n - i));
            b.drain(i..i + len);
        }
        3 => {
            let i = rng.below(n);
            let len = 1 + rng.below(64.min(n - i));
            let chunk = b[i..i + len].to_vec();
            let at = rng.below(n);
            b.splice(at..at, chunk);
        }
        4 => {
            // Insert opcodes, some with arguments.
            const OPS: &[&[u8]] = &[
                b"(",
                b")",
                b"]",
                b"}",
                b"t",
                b"l",
                b"d",
                b"a",
                b"e",
                b"s",
                b"u",
                b"R",
                b"b",
                b"Q",
                b"N",
                b"0",
                b"1",
                b"2",
                b"\x85",
                b"\x86",
                b"\x87",
                b"\x88",
                b"\x89",
                b"q\x00",
                b"h\x00",
                b"h\x07",
                b"r\xff\xff\xff\xff",
                b"j\xff\xff\xff\x7f",
                b"K\xff",
                b"J\xff\xff\xff\xff",
                b"\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f",
                b"X\xff\xff\xff\xff",
                b"\x94",
                b"\x93",
                b"\x81",
                b"cos\nsystem\n",
                b"ctorch\nFloatStorage\n",
                b".",
            ];
            let at = rng.below(n);
            let mut ins: Vec<u8> = Vec::new();
            for _ in 0..1 + rng.below(4) {
                let op: &&[u8] = rng.pick(OPS);
                ins.extend_from_slice(op);
            }
            b.splice(at..at, ins);
        }
        5 => {
            // Integer and length arguments: BININT1/2/4, BINUNICODE, memo indices.
            let sites: Vec<(usize, usize)> = (0..n)
                .filter_map(|i| match p[i] {
                    b'K' | b'q' | b'h' => Some((i + 1, 1)),
                    b'M' => Some((i + 1, 2)),
                    b'J' | b'X' | b'r' | b'j' => Some((i + 1, 4)),
                    _ => None,
                })
                .filter(|&(a, w)| a + w <= n)
                .collect();
            if let Some(&(at, w)) = (!sites.is_empty()).then(|| rng.pick(&sites)) {
                let max = if w == 8 {
                    u64::MAX
                } else {
                    (1u64 << (8 * w)) - 1
                };
                let v = field_value(rng, get_le(&b, at, w), max);
                put_le(&mut b, at, w, v);
            }
        }
        6 => {
            // Replace one byte by a random opcode.
            let i = rng.below(n);
            b[i] = *rng.pick(
                b"()]}tladsuRbQN012q h j K M J X c \x80\x85\x86\x87\x88\x89\x8a\x8c\x93\x94\x95",
            );
        }
        _ => {
            // Swap two 16-byte windows (reorders opcodes).
            let i = rng.below(n.saturating_sub(16));
            let j = rng.below(n.saturating_sub(16));
            for k in 0..16.min(n - i.max(j)) {
                b.swap(i + k, j + k);
            }
        }
    }
    b
}

#[test]
fn fuzz_official_checkpoint() {
    let scale = fuzz_scale();
    let mut rng = Rng(fuzz_seed());
    let orig = std::fs::read(lm_fixture().join("pytorch_model.bin")).unwrap();
    let (entries, eocd) = zip_entries(&orig);
    let pkl = entries
        .iter()
        .find(|e| e.name.ends_with("data.pkl"))
        .unwrap();
    let pickle = orig[pkl.data.clone()].to_vec();
    let records: Vec<(String, Vec<u8>)> = entries
        .iter()
        .map(|e| (e.name.clone(), orig[e.data.clone()].to_vec()))
        .collect();
    let d = official_copy();
    let bin = d.path().join("pytorch_model.bin");
    let mut tally = Tally::default();
    let case = |tally: &mut Tally, name: String, bytes: &[u8], must_fail: bool| {
        std::fs::write(&bin, bytes).unwrap();
        tally.record_expecting(&name, must_fail, || load_lm(&bin));
    };

    // The original loads (else every case below would be an error for
    // the wrong reason).
    case(&mut tally, "original".into(), &orig, false);
    assert_eq!(tally.ok, 1, "the unmodified fixture must load");

    for i in 0..150 * scale {
        // Truncations: anywhere, and within the last 4 KB (directory).
        let len = if i % 2 == 0 {
            rng.below(orig.len())
        } else {
            orig.len() - 1 - rng.below(4096)
        };
        case(&mut tally, format!("truncate to {len}"), &orig[..len], true);
    }
    for _ in 0..200 * scale {
        // A changed byte inside a record's payload must never load.
        let e = rng.pick(&entries);
        if e.data.is_empty() {
            continue;
        }
        let at = e.data.start + rng.below(e.data.len());
        let mut b = orig.clone();
        b[at] ^= rng.nonzero_byte();
        case(
            &mut tally,
            format!("flip byte {at} in `{}`", e.name),
            &b,
            true,
        );
    }
    for _ in 0..100 * scale {
        // Flips anywhere (headers, padding, directory).
        let mut b = orig.clone();
        let at = orig.len() - 1 - rng.below(orig.len().min(8192));
        b[at] ^= rng.nonzero_byte();
        case(
            &mut tally,
            format!("flip byte {at} near the end"),
            &b,
            false,
        );
    }
    // Header fields: (offset in the header, width).
    const LOCAL: &[(usize, usize)] = &[
        (0, 4),
        (4, 2),
        (6, 2),
        (8, 2),
        (14, 4),
        (18, 4),
        (22, 4),
        (26, 2),
        (28, 2),
    ];
    const CENTRAL: &[(usize, usize)] = &[
        (0, 4),
        (6, 2),
        (8, 2),
        (10, 2),
        (16, 4),
        (20, 4),
        (24, 4),
        (28, 2),
        (30, 2),
        (32, 2),
        (34, 2),
        (42, 4),
    ];
    const EOCD: &[(usize, usize)] = &[
        (0, 4),
        (4, 2),
        (6, 2),
        (8, 2),
        (10, 2),
        (12, 4),
        (16, 4),
        (20, 2),
    ];
    for _ in 0..300 * scale {
        let mut b = orig.clone();
        let (base, (off, w), what) = match rng.below(3) {
            0 => {
                let e = rng.pick(&entries);
                (
                    e.local,
                    *rng.pick(LOCAL),
                    format!("local header of `{}`", e.name),
                )
            }
            1 => {
                let e = rng.pick(&entries);
                (
                    e.central,
                    *rng.pick(CENTRAL),
                    format!("central header of `{}`", e.name),
                )
            }
            _ => (
                eocd,
                *rng.pick(EOCD),
                "end of central directory".to_string(),
            ),
        };
        let max = if w == 4 {
            u32::MAX as u64
        } else {
            u16::MAX as u64
        };
        let v = field_value(&mut rng, get_le(&b, base + off, w), max);
        put_le(&mut b, base + off, w, v);
        case(&mut tally, format!("{what}: field +{off} = {v}"), &b, false);
    }
    for _ in 0..900 * scale {
        // The pickle, with the zip rebuilt so its CRC is right: these reach
        // the pickle reader and the tensor checks.
        let p = mutate_pickle(&mut rng, &pickle);
        let recs: Vec<(String, Vec<u8>)> = records
            .iter()
            .map(|(n, data)| {
                (
                    n.clone(),
                    if n.ends_with("data.pkl") {
                        p.clone()
                    } else {
                        data.clone()
                    },
                )
            })
            .collect();
        let name = format!("pickle mutation ({} bytes)", p.len());
        case(&mut tally, name, &zip_records(&recs), false);
    }
    tally.check("checkpoints: official .bin (zip + pickle)");
}

/// Numbers and YAML constructs that a config must survive.
const NASTY_NUMBERS: &[&str] = &[
    "0",
    "-1",
    "1",
    "2",
    "3",
    "1000000000",
    "4294967296",
    "4611686018427387904",
    "18446744073709551616",
    "1e309",
    "-1e-5",
    "0.0",
    "1e-300",
    ".nan",
    ".inf",
    "-.inf",
    "NaN",
    "\"7\"",
    "null",
    "[]",
    "{}",
    "True",
];

#[test]
fn fuzz_official_config() {
    let scale = fuzz_scale();
    let mut rng = Rng(fuzz_seed() ^ 1);
    let orig = std::fs::read_to_string(lm_fixture().join("config.yml")).unwrap();
    let d = official_copy();
    let yml = d.path().join("config.yml");
    let bin = d.path().join("pytorch_model.bin");
    let mut tally = Tally::default();
    // (start, end) of every number in the text.
    let numbers: Vec<(usize, usize)> = {
        let b = orig.as_bytes();
        let mut v = vec![];
        let mut i = 0;
        while i < b.len() {
            if b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_alphanumeric()) {
                let s = i;
                while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.' || b[i] == b'e') {
                    i += 1;
                }
                v.push((s, i));
            }
            i += 1;
        }
        v
    };
    assert!(numbers.len() > 5);
    for i in 0..500 * scale {
        let text: Vec<u8> = match i % 5 {
            0 | 1 => {
                let (s, e) = *rng.pick(&numbers);
                format!("{}{}{}", &orig[..s], rng.pick(NASTY_NUMBERS), &orig[e..]).into_bytes()
            }
            2 => {
                let mut b = orig.clone().into_bytes();
                let at = rng.below(b.len());
                b[at] ^= rng.nonzero_byte();
                b
            }
            3 => orig.as_bytes()[..rng.below(orig.len())].to_vec(),
            _ => {
                // YAML features a config never needs.
                let inserts = [
                    "&a ",
                    "*a",
                    "!!python/object/apply:os.system ",
                    "[[[[[[[[",
                    "{{{{",
                    "? ",
                    "!!binary ",
                    "%YAML 1.1\n",
                    "---\n",
                    "...\n",
                    "<<: *a\n",
                ];
                let at = rng.below(orig.len());
                format!("{}{}{}", &orig[..at], rng.pick(&inserts), &orig[at..]).into_bytes()
            }
        };
        std::fs::write(&yml, &text).unwrap();
        tally.record(
            &format!("yml case {i}: {:?}", String::from_utf8_lossy(&text)),
            || load_lm(&bin),
        );
    }
    tally.check("configs: official .yml");
}

#[test]
fn fuzz_vit_safetensors_and_config() {
    let scale = fuzz_scale();
    let mut rng = Rng(fuzz_seed() ^ 2);
    let st = std::fs::read(vit_fixture().join("model.safetensors")).unwrap();
    let cfg_text = std::fs::read_to_string(vit_fixture().join("config.json")).unwrap();
    let cfg: Value = serde_json::from_str(&cfg_text).unwrap();
    let hlen = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&st[8..8 + hlen]).unwrap().to_string();
    let data = st[8 + hlen..].to_vec();
    let d = vit_copy();
    let (st_path, cfg_path) = (
        d.path().join("model.safetensors"),
        d.path().join("config.json"),
    );
    let mut tally = Tally::default();
    let case = |tally: &mut Tally, name: String, bytes: &[u8]| {
        std::fs::write(&st_path, bytes).unwrap();
        tally.record(&name, || load_vit(d.path()));
    };
    case(&mut tally, "original".into(), &st);
    assert_eq!(tally.ok, 1, "the unmodified fixture must load");
    let with_header = |h: &str, data: &[u8]| {
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(h.as_bytes());
        b.extend_from_slice(data);
        b
    };
    for i in 0..600 * scale {
        let bytes = match i % 6 {
            0 => st[..rng.below(st.len())].to_vec(),
            1 => {
                // The header length field.
                let mut b = st.clone();
                let v = match rng.below(4) {
                    0 => rng.next(),
                    1 => (st.len() as u64).wrapping_sub(rng.below(16) as u64),
                    2 => u64::MAX - rng.below(8) as u64,
                    _ => hlen as u64 ^ (1 << rng.below(64)),
                };
                b[..8].copy_from_slice(&v.to_le_bytes());
                b
            }
            2 | 3 => {
                // A number of the JSON header (offsets, shapes) replaced.
                let nums: Vec<(usize, usize)> = header
                    .char_indices()
                    .filter(|&(j, c)| {
                        c.is_ascii_digit()
                            && !header[..j].ends_with(|p: char| p.is_ascii_alphanumeric())
                    })
                    .map(|(j, _)| {
                        let e = header[j..]
                            .find(|c: char| !c.is_ascii_digit())
                            .map_or(header.len(), |k| j + k);
                        (j, e)
                    })
                    .collect();
                let (s, e) = *rng.pick(&nums);
                let v = *rng.pick(&[
                    "0",
                    "1",
                    "4294967296",
                    "18446744073709551615",
                    "18446744073709551616",
                    "9223372036854775807",
                    "-1",
                    "1e3",
                    "4611686018427387904",
                ]);
                with_header(&format!("{}{}{}", &header[..s], v, &header[e..]), &data)
            }
            4 => {
                // A header byte changed (keys, dtypes, brackets).
                let mut h = header.clone().into_bytes();
                let at = rng.below(h.len());
                h[at] = *rng.pick(b"{}[]\",:0123456789FBIU_ a");
                let h = String::from_utf8_lossy(&h).into_owned();
                with_header(&h, &data)
            }
            _ => {
                let mut b = st.clone();
                let at = rng.below(8 + hlen);
                b[at] ^= rng.nonzero_byte();
                b
            }
        };
        case(&mut tally, format!("safetensors case {i}"), &bytes);
    }
    std::fs::write(&st_path, &st).unwrap();
    // config.json: every key set to nasty values, removed, or the text broken.
    let keys: Vec<String> = cfg.as_object().unwrap().keys().cloned().collect();
    let nasty: Vec<Value> = vec![
        json!(0),
        json!(-1),
        json!(1),
        json!(3),
        json!(1_000_000_000u64),
        json!(u64::MAX),
        json!(4_294_967_296u64),
        json!(-1e-5),
        json!(1e-300),
        json!(1e300),
        json!(0.0),
        json!(2.5),
        json!(null),
        json!("x"),
        json!([]),
        json!([0.0, 0.0, 0.0]),
        json!([-1.0, 1e-30, 1e30]),
        Value::Array(vec![json!("n01440764"); 10]),
        json!({}),
    ];
    for i in 0..400 * scale {
        let text = match i % 4 {
            0 | 1 => {
                let mut c = cfg.clone();
                let k = rng.pick(&keys).clone();
                c[k.as_str()] = rng.pick(&nasty).clone();
                serde_json::to_string(&c).unwrap()
            }
            2 => {
                let mut c = cfg.clone();
                c.as_object_mut().unwrap().remove(rng.pick(&keys).as_str());
                serde_json::to_string(&c).unwrap()
            }
            _ => {
                let mut b = cfg_text.clone().into_bytes();
                let at = rng.below(b.len());
                b[at] ^= rng.nonzero_byte();
                String::from_utf8_lossy(&b).into_owned()
            }
        };
        std::fs::write(&cfg_path, &text).unwrap();
        tally.record(&format!("config.json case {i}: {text}"), || {
            load_vit(d.path())
        });
    }
    tally.check("checkpoints + configs: ViT .safetensors / config.json");
}

// ---------------------------------------------------------------------------
// Item 9: malicious pickles are refused by name; nothing runs.

#[test]
fn pickles_naming_other_globals_are_refused_and_nothing_runs() {
    let d = tempfile::tempdir().unwrap();
    let marker = d.path().join("pwned");
    let cmd = format!("touch {}", marker.display());
    // os.system("touch ...") via GLOBAL + REDUCE (protocol 2).
    let mut p = Pickle::new();
    p.global("os", "system").str(&cmd).op(b"\x85R.");
    expect_err(
        load_bin(&torch_zip(&p.0, &[])),
        &["`os.system`", "not allowed"],
    );
    // posix.system inside an otherwise valid state dict.
    let p = Pickle::state_dict(|p| {
        p.str("x").global("posix", "system").str(&cmd).op(b"\x85R");
    });
    expect_err(load_bin(&torch_zip(&p, &[])), &["`posix.system`"]);
    // builtins.eval via STACK_GLOBAL (protocol 4).
    let mut p = Pickle::new();
    p.op(b"\x8c\x08builtins\x8c\x04eval\x93")
        .str("__import__('os').system('true')")
        .op(b"\x85R.");
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["`builtins.eval`"]);
    // The __reduce__ of other objects: any class or function outside the list.
    for (m, n) in [
        ("subprocess", "Popen"),
        ("builtins", "getattr"),
        ("torch", "load"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("__builtin__", "object"),
        ("torch._utils", "_rebuild_device_tensor_from_numpy"),
    ] {
        let mut p = Pickle::new();
        p.global(m, n).op(b")R.");
        expect_err(load_bin(&torch_zip(&p.0, &[])), &[&format!("`{m}.{n}`")]);
    }
    // Allowed names cannot be misused: a storage class is not callable,
    // objects cannot be created, BUILD only sets a dict's or tensor's state.
    let mut p = Pickle::new();
    p.global("torch", "FloatStorage").op(b")R.");
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["may not be called"]);
    let mut p = Pickle::new();
    p.global("collections", "OrderedDict").op(b")\x81.");
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["NEWOBJ", "not allowed"]);
    let mut p = Pickle::new();
    p.global("torch._utils", "_rebuild_tensor_v2").op(b"}b.");
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["BUILD", "not allowed"]);
    assert!(!marker.exists(), "a pickle ran a command");
}

#[test]
fn pickle_bombs_and_short_arguments_end_in_clean_errors() {
    // 1 MB of MARK, of EMPTY_LIST + APPEND-free nesting, and of TUPLE1.
    let mut p = Pickle::new();
    p.op(&vec![b'('; 1 << 20]);
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["nested marks"]);
    let mut p = Pickle::new();
    p.op(&b"(]".repeat(1 << 19));
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["nested marks"]);
    let mut p = Pickle::new();
    p.op(b"]").op(&vec![0x85; 1 << 20]).op(b".");
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["nested deeper than 64"]);
    // Lists appended into lists through the memo.
    let mut p = Pickle::new();
    p.op(b"]q\x00");
    for _ in 0..100_000 {
        p.op(b"]h\x00a0q\x00");
    }
    p.op(b"h\x00.");
    let r = load_bin(&torch_zip(&p.0, &[]));
    assert!(r.is_err(), "{r:?}");
    // Memo bombs: a huge index stores one entry, not four billion.
    let mut p = Pickle::new();
    p.op(b"}r\xff\xff\xff\xffj\xff\xff\xff\xff0.");
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["contains no tensors"]);
    let mut p = Pickle::new();
    p.op(b"}j\xfe\xff\xff\xff.");
    expect_err(
        load_bin(&torch_zip(&p.0, &[])),
        &["memo entry 4294967294 was never stored"],
    );
    // Billion laughs: doubling a tuple 100 times through the memo.
    let mut p = Pickle::new();
    p.op(b"]q\x00");
    for _ in 0..100 {
        p.op(b"h\x00h\x00\x86q\x00");
    }
    p.op(b".");
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["nested deeper"]);
    // Copy-on-write amplification: a memoised list grown one item at a
    // time costs its length each step, within the value budget.
    let mut p = Pickle::new();
    p.op(b"]");
    for _ in 0..200_000 {
        p.op(b"q\x00Na");
    }
    p.op(b".");
    expect_err(load_bin(&torch_zip(&p.0, &[])), &["more than"]);
    // Short and wrong argument tuples to the tensor-rebuild functions.
    for args in [
        &b")"[..],
        b"(K\x00t",
        b"(NK\x00(K\x01t(K\x01t\x89}t",
        b"((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x01tQK\x00(K\x01K\x02t(K\x01t\x89}t",
    ] {
        let p = Pickle::state_dict(|p| {
            p.str("w").global("torch._utils", "_rebuild_tensor_v2").op(args).op(b"R");
        });
        let e = load_bin(&torch_zip(&p, &[("0", 4)])).unwrap_err();
        assert!(
            e.contains("_rebuild_tensor_v2") || e.contains("storage"),
            "{e}"
        );
    }
    let p = Pickle::state_dict(|p| {
        p.str("w")
            .global("torch._utils", "_rebuild_parameter")
            .op(b"(NtR");
    });
    expect_err(
        load_bin(&torch_zip(&p, &[])),
        &["_rebuild_parameter", "takes 3"],
    );
    assert_no_large_allocation("pickle bombs");
}

#[test]
fn tensor_views_are_checked_against_their_storage_records() {
    let f32s = "FloatStorage";
    // (pickle, storage records (key, bytes), expected error)
    type Case<'a> = (Vec<u8>, Vec<(&'a str, usize)>, &'a str);
    let cases: Vec<Case> = vec![
        // 1000 elements of a 10-element storage.
        (
            Pickle::state_dict(|p| {
                p.tensor("w", ("0", f32s, 10), (0, &[1000], &[1]));
            }),
            vec![("0", 40)],
            "but its storage only 10",
        ),
        // A view past the end through its offset and strides.
        (
            Pickle::state_dict(|p| {
                p.tensor("w", ("0", f32s, 10), (8, &[2, 2], &[2, 1]));
            }),
            vec![("0", 40)],
            "reaches past the end",
        ),
        // A storage whose record is smaller than it says.
        (
            Pickle::state_dict(|p| {
                p.tensor(
                    "w",
                    ("0", f32s, 1 << 40),
                    (0, &[1 << 20, 1 << 20], &[1 << 20, 1]),
                );
            }),
            vec![("0", 40)],
            "declares 1099511627776",
        ),
        // Shapes whose product overflows.
        (
            Pickle::state_dict(|p| {
                p.tensor("w", ("0", f32s, 10), (0, &[1 << 40, 1 << 40], &[1, 1]));
            }),
            vec![("0", 40)],
            "too many elements",
        ),
        // A storage key that tries to name another record.
        (
            Pickle::state_dict(|p| {
                p.tensor("w", ("../data.pkl", f32s, 10), (0, &[10], &[1]));
            }),
            vec![("0", 40)],
            "not a record name",
        ),
        // A missing record.
        (
            Pickle::state_dict(|p| {
                p.tensor("w", ("7", f32s, 10), (0, &[10], &[1]));
            }),
            vec![("0", 40)],
            "record `archive/data/7` is missing",
        ),
        // Negative sizes.
        (
            Pickle::state_dict(|p| {
                p.tensor("w", ("0", f32s, 10), (0, &[-1], &[1]));
            }),
            vec![("0", 40)],
            "not a non-negative integer",
        ),
    ];
    for (pickle, storages, needle) in cases {
        let e = load_bin(&torch_zip(&pickle, &storages)).unwrap_err();
        assert!(e.contains(needle), "{e:?} should contain {needle:?}");
    }
    // A transposed (non-contiguous) view is read element by element.
    let pickle = Pickle::state_dict(|p| {
        p.tensor("t", ("0", f32s, 6), (0, &[3, 2], &[1, 3]));
    });
    let values: Vec<u8> = [1f32, 2., 3., 4., 5., 6.]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let bytes = zip_records(&[("a/data.pkl".into(), pickle), ("a/data/0".into(), values)]);
    let d = tempfile::tempdir().unwrap();
    let bin = d.path().join("t.bin");
    std::fs::write(&bin, bytes).unwrap();
    let t = checkpoint::read_torch_bin(&bin, None, &Device::Cpu).unwrap();
    let got: Vec<Vec<f32>> = t["t"].to_vec2().unwrap();
    assert_eq!(got, vec![vec![1., 4.], vec![2., 5.], vec![3., 6.]]);
}

// ---------------------------------------------------------------------------
// Item 11: zip CRCs

#[test]
fn a_changed_weight_byte_fails_the_crc_check() {
    let orig = std::fs::read(lm_fixture().join("pytorch_model.bin")).unwrap();
    let (entries, _) = zip_entries(&orig);
    for name in [
        "pytorch_model/data/0",
        "pytorch_model/data/21",
        "pytorch_model/data.pkl",
    ] {
        let e = entries.iter().find(|e| e.name == name).unwrap();
        let mut b = orig.clone();
        // One bit of one weight (or of a string in the pickle).
        let at = e.data.start + e.data.len() / 2 + 1;
        b[at] ^= 0x10;
        expect_err(load_bin(&b), &["CRC-32", name]);
    }
    // The unchanged file loads.
    load_bin(&orig).unwrap();
}

// ---------------------------------------------------------------------------
// Item 9: YAML alias bombs

#[test]
fn yaml_aliases_and_anchors_are_refused() {
    let bomb = "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n\
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n\
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n\
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n\
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\ni: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]\n";
    assert!(bomb.len() < 400);
    let d = official_copy();
    let yml = d.path().join("config.yml");
    let fixture = std::fs::read_to_string(&yml).unwrap();
    assert!(fixture.contains("num_layers"));
    std::fs::write(&yml, format!("{bomb}num_layers: 2\n")).unwrap();
    let e = expect_err(load_lm(&d.path().join("pytorch_model.bin")), &["anchors"]);
    assert!(e.contains("config.yml"), "{e}");
    // An alias alone (to an anchor-free document it is still an error).
    std::fs::write(&yml, "num_layers: *x\n").unwrap();
    expect_err(load_lm(&d.path().join("pytorch_model.bin")), &["anchor"]);
    assert_no_large_allocation("yaml bomb");
}

// ---------------------------------------------------------------------------
// Item 10: config bounds, each naming the key

/// A canonical language-model folder (config.json + model.safetensors) made
/// from the official fixture, with `edit` applied to its config.
fn lm_folder(edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let files = loader::locate(
        lm_fixture().join("pytorch_model.bin").to_str().unwrap(),
        &LocateOptions::default(),
    )
    .unwrap();
    let w = loader::read_weights(&files, None, &Device::Cpu).unwrap();
    let d = tempfile::tempdir().unwrap();
    checkpoint::write_safetensors(d.path(), &w.tensors, u64::MAX).unwrap();
    let mut cfg = w.config.clone();
    edit(&mut cfg);
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    d
}

#[test]
fn language_model_config_values_out_of_range_are_refused_by_name() {
    // The folder loads as made.
    load_lm(lm_folder(|_| {}).path()).unwrap();
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "max_position_embeddings",
            json!(1_000_000_000u64),
            "allowed 1..=1048576",
        ),
        (
            "max_position_embeddings",
            json!(1u64 << 62),
            "allowed 1..=1048576",
        ),
        ("max_position_embeddings", json!(0), "allowed 1..="),
        ("rotary_base", json!(0.0), "rotary_base"),
        ("rotary_base", json!(-10000.0), "rotary_base"),
        ("norm_eps", json!(-1e-5), "norm_eps"),
        ("norm_eps", json!(0.0), "norm_eps"),
        ("rotary_pct", json!(0.0), "rotary_pct"),
        ("rotary_pct", json!(1.5), "rotary_pct"),
        ("eos_token_id", json!(4_000_000_000u64), "eos_token_id"),
        ("num_heads", json!(0), "num_heads"),
        ("num_heads", json!(3), "divisible"),
        ("hidden_size", json!(1u64 << 40), "hidden_size"),
        ("num_layers", json!(1u64 << 40), "num_layers"),
        ("vocab_size", json!(0), "vocab_size"),
        ("qkv_tokens", json!(0), "qkv_tokens"),
        (
            "pattention_scale_tokens",
            json!({"qkv": 0, "proj": 20, "ffn": 48}),
            "pattention_scale_tokens.qkv",
        ),
    ];
    for (key, v, needle) in cases {
        let d = lm_folder(|c| c[key] = v.clone());
        let e = expect_err(load_lm(d.path()), &[needle, "config.json"]);
        assert!(e.contains(key), "{key}: {e}");
    }
    // The same bounds for the official yml.
    let d = official_copy();
    let yml = d.path().join("config.yml");
    let text = std::fs::read_to_string(&yml).unwrap();
    for (from, to, key) in [
        (
            "\"max_position_embeddings\": 2048",
            "\"max_position_embeddings\": 1000000000",
            "max_position_embeddings",
        ),
        (
            "\"rotary_pct\": 0.25",
            "\"rotary_pct\": 0.25, \"rotary_emb_base\": -1",
            "rotary_emb_base",
        ),
        (
            "\"rotary_pct\": 0.25",
            "\"rotary_pct\": 0.25, \"layernorm_epsilon\": -0.00001",
            "layernorm_epsilon",
        ),
        (
            "\"num_attention_heads\": 2",
            "\"num_attention_heads\": 0",
            "num_attention_heads",
        ),
        (
            "\"num_layers\": 2",
            "\"num_layers\": 4611686018427387904",
            "num_layers",
        ),
    ] {
        assert!(text.contains(from));
        std::fs::write(&yml, text.replace(from, to)).unwrap();
        expect_err(
            load_lm(&d.path().join("pytorch_model.bin")),
            &[key, "config.yml"],
        );
    }
}

#[test]
fn vit_config_values_out_of_range_are_refused_by_name() {
    load_vit(&vit_fixture()).unwrap();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(vit_fixture().join("config.json")).unwrap())
            .unwrap();
    let mut dup = cfg["class_wnids"].clone();
    dup[3] = dup[1].clone();
    let cases: Vec<(&str, Value, &str)> = vec![
        ("crop_pct", json!(0.0), "crop_pct"),
        ("crop_pct", json!(-0.5), "crop_pct"),
        ("crop_pct", json!(1e-9), "crop_pct"),
        ("crop_pct", json!(7.0), "crop_pct"),
        ("std", json!([0.229, 0.0, 0.225]), "std[1]"),
        ("std", json!([-0.229, 0.224, 0.225]), "std[0]"),
        ("mean", json!([0.5, 1e30, 0.5]), "mean[1]"),
        ("class_wnids", dup, "twice"),
        ("image_size", json!(1u64 << 40), "image_size"),
        ("patch_size", json!(0), "patch_size"),
        ("num_heads", json!(0), "num_heads"),
        ("norm_eps", json!(-1.0), "norm_eps"),
        ("ffn_tokens", json!(1u64 << 40), "ffn_tokens"),
    ];
    for (key, v, needle) in cases {
        let d = vit_copy();
        let mut c = cfg.clone();
        c[key] = v;
        std::fs::write(d.path().join("config.json"), c.to_string()).unwrap();
        let e = expect_err(load_vit(d.path()), &[needle]);
        assert!(e.contains("config.json") || e.contains(key), "{e}");
    }
}

// ---------------------------------------------------------------------------
// Item 7 (local side): shard names confined to the model folder

#[test]
fn shard_names_outside_the_model_folder_are_refused() {
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    let src = lm_folder(|_| {});
    std::fs::copy(src.path().join("config.json"), dir.join("config.json")).unwrap();
    // A decoy outside the folder: the real weights, which would load.
    std::fs::copy(
        src.path().join("model.safetensors"),
        base.path().join("x.safetensors"),
    )
    .unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::copy(
        src.path().join("model.safetensors"),
        outside.path().join("w.safetensors"),
    )
    .unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.join("sub")).unwrap();
    std::os::unix::fs::symlink(
        outside.path().join("w.safetensors"),
        dir.join("link.safetensors"),
    )
    .unwrap();
    let index = |shard: &str| {
        json!({"metadata": {}, "weight_map": {"word_embeddings.weight": shard}}).to_string()
    };
    for (shard, why) in [
        ("../x.safetensors", "`..`"),
        ("/etc/passwd", "absolute"),
        ("sub\\..\\..\\x.safetensors", "backslash"),
        ("./model.safetensors", "`.`"),
        ("a//b.safetensors", "empty"),
        ("", "empty"),
        ("sub/w.safetensors", "outside the model folder"),
        ("link.safetensors", "outside the model folder"),
    ] {
        std::fs::write(dir.join(checkpoint::SAFETENSORS_INDEX), index(shard)).unwrap();
        let e = expect_err(load_lm(&dir), &[why, checkpoint::SAFETENSORS_INDEX]);
        assert!(e.contains(&format!("{shard:?}")) || shard.is_empty(), "{e}");
    }
    // A shard inside the folder (here in a real subfolder) is fine.
    std::fs::create_dir(dir.join("shards")).unwrap();
    std::fs::copy(
        src.path().join("model.safetensors"),
        dir.join("shards/a.safetensors"),
    )
    .unwrap();
    let w = loader::read_weights(
        &loader::locate(src.path().to_str().unwrap(), &LocateOptions::default()).unwrap(),
        None,
        &Device::Cpu,
    )
    .unwrap();
    let map: serde_json::Map<String, Value> = w
        .tensors
        .keys()
        .map(|k| (k.clone(), json!("shards/a.safetensors")))
        .collect();
    std::fs::write(
        dir.join(checkpoint::SAFETENSORS_INDEX),
        json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    load_lm(&dir).unwrap();
}

// ---------------------------------------------------------------------------
// Item 12: `inspect` of a crafted shape

#[test]
fn inspect_refuses_a_shape_its_storage_cannot_hold() {
    // 2^31 × 2^31 (4.6e18 "parameters") over a 40-byte storage.
    let pickle = Pickle::state_dict(|p| {
        p.tensor(
            "huge",
            ("0", "FloatStorage", 10),
            (0, &[1 << 31, 1 << 31], &[1 << 31, 1]),
        );
    });
    let d = tempfile::tempdir().unwrap();
    let bin = d.path().join("pytorch_model.bin");
    std::fs::write(&bin, torch_zip(&pickle, &[("0", 40)])).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenformer"))
        .args(["inspect", bin.to_str().unwrap()])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "inspect succeeded: {stdout}");
    assert!(stderr.contains("`huge`"), "{stderr}");
    assert!(!stdout.contains("4611686018427387904"), "{stdout}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
