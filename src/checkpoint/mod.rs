//! Reading and writing weights: official `pytorch_model.bin` (torch zip
//! pickle, read by our own restricted pickle reader, [`torch_zip`]) and
//! Hugging Face style safetensors (single file, or shards with
//! `model.safetensors.index.json`, 5 GB shards as `huggingface_hub` does).
//! Name maps live in one module per format ([`official`]); everything else
//! works on canonical names. Every size, offset and name read from a file is
//! checked before it is used.

pub mod official;
mod pickle;
pub mod torch_zip;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The Hub convention for shard size.
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;
pub const SAFETENSORS_FILE: &str = "model.safetensors";
pub const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// Tensors by canonical name, in a stable order.
pub type Tensors = BTreeMap<String, Tensor>;

/// `model.safetensors.index.json`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ShardIndex {
    #[serde(default)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub weight_map: BTreeMap<String, String>,
}

/// The largest `model.safetensors.index.json` read (real ones are a few
/// hundred KB).
pub(crate) const MAX_INDEX_BYTES: u64 = 64 << 20;

/// The safetensors files of a model folder: the single file, or the shards
/// listed by the index (each confined to the folder, see [`shard_path`]).
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(SAFETENSORS_INDEX);
    if index.exists() {
        let text = read_text(&index, MAX_INDEX_BYTES)?;
        let idx: ShardIndex = serde_json::from_str(&text)
            .map_err(|e| Error::checkpoint(&index, format!("bad shard index: {e}")))?;
        let mut files: Vec<_> = idx.weight_map.values().collect();
        files.sort();
        files.dedup();
        return files
            .into_iter()
            .map(|f| shard_path(dir, f).map_err(|e| Error::checkpoint(&index, e)))
            .collect();
    }
    let single = dir.join(SAFETENSORS_FILE);
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(Error::checkpoint(
        dir,
        format!("no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in this folder"),
    ))
}

/// The path of a shard named by an index, confined to the model folder: a
/// relative name of plain components (no `..`, `.`, empty component, absolute
/// path or backslash), and, if it exists, a file that resolves inside the
/// folder. In a Hub cache snapshot (`.../snapshots/<commit>/`) files are
/// links into the repo's `blobs/`, which is allowed as well.
pub fn shard_path(dir: &Path, name: &str) -> std::result::Result<PathBuf, String> {
    let refuse = |why: &str| Err(format!("shard file name {name:?} {why}"));
    if name.is_empty() {
        return refuse("is empty");
    }
    if name.contains('\\') || name.contains('\0') {
        return refuse("contains a backslash or NUL");
    }
    if name.starts_with('/') {
        return refuse("is an absolute path");
    }
    if name
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return refuse(
            "has an empty, `.` or `..` component: shards must be inside the model folder",
        );
    }
    let path = dir.join(name);
    let Ok(real) = path.canonicalize() else {
        // Not there (yet): the name alone cannot leave the folder; reading
        // it later resolves the path again.
        return Ok(path);
    };
    let root = dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let hub_blobs = root
        .parent()
        .filter(|p| p.file_name().is_some_and(|n| n == "snapshots"))
        .and_then(Path::parent)
        .map(|repo| repo.join("blobs"));
    if real.starts_with(&root) || hub_blobs.is_some_and(|b| real.starts_with(b)) {
        Ok(path)
    } else {
        Err(format!(
            "shard file {name:?} resolves to {}, outside the model folder {}",
            real.display(),
            root.display()
        ))
    }
}

/// A small text file (config, index), refusing anything that is not a
/// regular file (a FIFO would block) or is larger than `limit` bytes.
pub(crate) fn read_text(path: &Path, limit: u64) -> Result<String> {
    use std::io::Read;
    let invalid = |msg: String| {
        Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, msg),
        )
    };
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(invalid("not a regular file".into()));
    }
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut text = String::new();
    file.take(limit.saturating_add(1))
        .read_to_string(&mut text)
        .map_err(|e| Error::io(path, e))?;
    if text.len() as u64 > limit {
        return Err(invalid(format!(
            "larger than the {limit} bytes accepted for this file"
        )));
    }
    Ok(text)
}

/// Name, dtype and shape of one stored tensor (for `inspect`).
#[derive(Debug, Clone, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
}

/// Lists the tensors of a `.bin` or `.safetensors` file without loading
/// them; the file's structure (record sizes, CRC of the pickle, data offsets
/// against the file size) is checked as when loading.
pub fn tensor_infos(path: &Path) -> Result<Vec<TensorInfo>> {
    let mut out = if is_pickle(path) {
        torch_zip::TorchReader::open(path)?
            .tensors()
            .iter()
            .map(|t| TensorInfo {
                name: t.name.clone(),
                dtype: format!("{:?}", t.dtype).to_lowercase(),
                shape: t.shape.clone(),
            })
            .collect::<Vec<_>>()
    } else {
        let st = SafetensorsFile::open(path)?;
        st.tensors
            .iter()
            .map(|t| TensorInfo {
                name: t.name.clone(),
                dtype: format!("{:?}", t.dtype).to_lowercase(),
                shape: t.shape.clone(),
            })
            .collect()
    };
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn is_pickle(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("bin" | "pt" | "pth")
    )
}

/// Reads every tensor of an official `pytorch_model.bin`, renamed to canonical
/// names and converted to `dtype` one tensor at a time, so that loading fp16
/// weights for f32 compute peaks at the f32 size plus one tensor.
/// Returns the tensors and the official names that have no canonical home.
pub fn read_official_bin(
    path: &Path,
    num_layers: usize,
    dtype: Option<DType>,
    device: &Device,
) -> Result<(Tensors, Vec<String>)> {
    let bin = torch_zip::TorchReader::open(path)?;
    if bin.tensors().is_empty() {
        return Err(Error::checkpoint(path, "contains no tensors"));
    }
    let ignored = bin
        .tensors()
        .iter()
        .filter(|t| official::to_canonical(&t.name, num_layers).is_none())
        .map(|t| t.name.clone())
        .collect();
    let out = bin.read(|n| official::to_canonical(n, num_layers), dtype, device)?;
    Ok((out, ignored))
}

/// Reads every tensor of a torch zip checkpoint (a `pytorch_model.bin` of
/// any state dict) under its own name, converted to `dtype`.
pub fn read_torch_bin(path: &Path, dtype: Option<DType>, device: &Device) -> Result<Tensors> {
    let bin = torch_zip::TorchReader::open(path)?;
    bin.read(|n| Some(n.to_string()), dtype, device)
}

/// Number of transformer layers in an official state dict (from its keys), so
/// a `.bin` can be inspected or mapped without its yml.
pub fn official_num_layers(names: impl IntoIterator<Item = impl AsRef<str>>) -> usize {
    names
        .into_iter()
        .filter_map(|n| {
            let rest = n.as_ref().strip_prefix("sequential.")?;
            let (i, t) = rest.split_once('.')?;
            t.starts_with("attention.")
                .then(|| i.parse::<usize>().ok())
                .flatten()
        })
        .max()
        .map_or(0, |i| i.saturating_sub(1))
}

/// Reads all tensors of safetensors files (canonical names already),
/// converting to `dtype` one at a time.
pub fn read_safetensors(
    files: &[PathBuf],
    dtype: Option<DType>,
    device: &Device,
) -> Result<Tensors> {
    let mut out = Tensors::new();
    for path in files {
        read_safetensors_file(path, dtype, device, &mut out)?;
    }
    Ok(out)
}

/// The largest safetensors header read. The format allows 100 MB; real
/// headers are a few MB at most (about 150 bytes a tensor), and this bound
/// keeps the parsed header (a crafted one can be a long list of shape
/// numbers) within a few hundred MB.
const MAX_HEADER_BYTES: u64 = 64 << 20;

/// One tensor of a safetensors header, checked against the file.
struct SafetensorsEntry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    /// Absolute position and length of its bytes in the file.
    start: u64,
    bytes: usize,
}

/// A safetensors file's header, read with positioned reads and checked: the
/// header length against the file, and every tensor's data offsets against
/// its dtype and shape (the safetensors crate's own validation: contiguous,
/// no overflow) and against the file size.
struct SafetensorsFile {
    file: std::fs::File,
    /// In file order.
    tensors: Vec<SafetensorsEntry>,
}

impl SafetensorsFile {
    fn open(path: &Path) -> Result<Self> {
        use std::os::unix::fs::FileExt;
        let bad = |msg: String| {
            Error::checkpoint(path, format!("not a readable safetensors file: {msg}"))
        };
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        let len = meta.len();
        if len < 8 {
            return Err(bad(format!(
                "{len} bytes is shorter than the header size field"
            )));
        }
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|e| Error::io(path, e))?;
        let header_len = u64::from_le_bytes(n);
        if header_len > MAX_HEADER_BYTES || header_len > len - 8 {
            return Err(bad(format!(
                "header of {header_len} bytes in a {len}-byte file"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| Error::io(path, e))?;
        let meta: safetensors::tensor::Metadata =
            serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
        let data_start = 8 + header_len;
        let mut infos: Vec<_> = meta.tensors().into_iter().collect();
        infos.sort_by_key(|(_, i)| i.data_offsets.0);
        let mut tensors = Vec::with_capacity(infos.len());
        for (name, info) in infos {
            let (start, end) = info.data_offsets;
            let bytes = info
                .shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .and_then(|e| e.checked_mul(info.dtype.bitsize()))
                .map(|bits| bits / 8);
            let abs = |o: usize| (o as u64).checked_add(data_start);
            let fits = matches!((abs(start), abs(end)), (Some(s), Some(e)) if s <= e && e <= len);
            match bytes {
                Some(b) if end.checked_sub(start) == Some(b) && fits => {}
                _ => {
                    return Err(Error::checkpoint(
                        path,
                        format!(
                            "tensor `{name}`: data offsets {start}..{end} do not hold {:?} {:?} in a {len}-byte file",
                            info.dtype, info.shape
                        ),
                    ))
                }
            }
            let dtype = DType::try_from(info.dtype)
                .map_err(|e| Error::checkpoint(path, format!("tensor `{name}`: {e}")))?;
            tensors.push(SafetensorsEntry {
                name,
                dtype,
                shape: info.shape.clone(),
                start: data_start + start as u64,
                bytes: end - start,
            });
        }
        Ok(Self { file, tensors })
    }
}

/// One file, read with positioned reads in file order rather than mapped:
/// a mapping's pages count as resident memory once touched, so mapping an
/// fp16 file while building its f32 copy would peak at both. This way the
/// peak is the converted weights plus one tensor in flight.
fn read_safetensors_file(
    path: &Path,
    dtype: Option<DType>,
    device: &Device,
    out: &mut Tensors,
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let st = SafetensorsFile::open(path)?;
    let mut scratch = Scratch::default();
    for t in &st.tensors {
        let tensor_err =
            |msg: String| Error::checkpoint(path, format!("tensor `{}`: {msg}", t.name));
        let buf = scratch.bytes(t.bytes);
        st.file
            .read_exact_at(buf, t.start)
            .map_err(|e| Error::io(path, e))?;
        let tensor = decode(buf, t.dtype, &t.shape, dtype)
            .and_then(|x| convert(x, dtype, device))
            .map_err(|e| tensor_err(e.to_string()))?;
        if out.insert(t.name.clone(), tensor).is_some() {
            return Err(Error::checkpoint(
                path,
                format!("tensor `{}` appears in two shards", t.name),
            ));
        }
    }
    Ok(())
}

/// One read buffer for all tensors of a file. Reusing it matters because the
/// `tokenformer` binary keeps freed memory (see `alloc::keep_freed_memory`):
/// a fresh buffer per tensor would leave holes that count as resident.
#[derive(Default)]
struct Scratch(Vec<u64>);

impl Scratch {
    /// `n` bytes, 8-byte aligned so they can be viewed as any float type.
    fn bytes(&mut self, n: usize) -> &mut [u8] {
        if self.0.len() * 8 < n {
            self.0 = vec![0; n.div_ceil(8)];
        }
        &mut bytemuck::cast_slice_mut(&mut self.0)[..n]
    }
}

/// The tensor of stored little-endian bytes. Half floats bound for f32 widen
/// straight into the f32 result (no intermediate half tensor), so the only
/// allocation is the tensor that is kept; anything else comes back as stored,
/// for [`convert`].
fn decode(
    buf: &[u8],
    stored: DType,
    shape: &[usize],
    target: Option<DType>,
) -> candle_core::Result<Tensor> {
    use half::slice::HalfFloatSliceExt;
    let widened = match (stored, target) {
        (DType::F16, Some(DType::F32)) => bytemuck::cast_slice::<u8, half::f16>(buf).to_f32_vec(),
        (DType::BF16, Some(DType::F32)) => bytemuck::cast_slice::<u8, half::bf16>(buf).to_f32_vec(),
        _ => return Tensor::from_raw_buffer(buf, stored, shape, &Device::Cpu),
    };
    Tensor::from_vec(widened, shape, &Device::Cpu)
}

fn convert(t: Tensor, dtype: Option<DType>, device: &Device) -> candle_core::Result<Tensor> {
    let t = match dtype {
        Some(d) if d != t.dtype() => t.to_dtype(d)?,
        _ => t,
    };
    t.to_device(device)
}

/// A VarBuilder over loaded tensors (they already have the compute dtype)
/// that hands each tensor over to the model instead of keeping a reference:
/// a layer that re-lays-out its weights (Pattention's transposed keys) frees
/// the original at once, so loading never holds two copies of the weights.
pub fn var_builder(tensors: Tensors, device: &Device) -> candle_nn::VarBuilder<'static> {
    hand_over(tensors, device).0
}

/// [`var_builder`], and what the model built from it did not take.
pub(crate) fn hand_over(
    tensors: Tensors,
    device: &Device,
) -> (candle_nn::VarBuilder<'static>, Untaken) {
    let dtype = tensors.values().next().map_or(DType::F32, |t| t.dtype());
    let backend = HandOver(std::sync::Arc::new(std::sync::Mutex::new(
        tensors.into_iter().collect(),
    )));
    let untaken = Untaken(backend.0.clone());
    let vb = candle_nn::VarBuilder::from_backend(Box::new(backend), dtype, device.clone());
    (vb, untaken)
}

/// The tensors of a [`hand_over`] VarBuilder no model has taken (yet).
pub(crate) struct Untaken(std::sync::Arc<std::sync::Mutex<HashMap<String, Tensor>>>);

impl Untaken {
    /// Their names, sorted.
    pub(crate) fn names(&self) -> Vec<String> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<String> = map.keys().cloned().collect();
        names.sort();
        names
    }
}

/// The tensors not yet taken by the model being built.
struct HandOver(std::sync::Arc<std::sync::Mutex<HashMap<String, Tensor>>>);

impl HandOver {
    fn take(&self, name: &str) -> candle_core::Result<Tensor> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.into() }.bt())
    }
}

impl candle_nn::var_builder::SimpleBackend for HandOver {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.take(name)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt());
        }
        t.to_device(dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.take(name)?.to_device(dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.contains_key(name)
    }
}

/// Writes `tensors` into `dir` as `model.safetensors`, or as shards of at most
/// `max_shard_bytes` with an index when they do not fit in one. The shards
/// are on disk when it returns (as the torch zip writer's archive is): the
/// converters rename their output into place only after, and `bench` times
/// nothing while the kernel is still writing hundreds of MB back.
pub fn write_safetensors(
    dir: &Path,
    tensors: &Tensors,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    let size = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
    let mut shards: Vec<Vec<(&String, &Tensor)>> = vec![vec![]];
    let mut current = 0u64;
    for (name, t) in tensors {
        let s = size(t);
        if current > 0 && current + s > max_shard_bytes {
            shards.push(vec![]);
            current = 0;
        }
        shards.last_mut().expect("non-empty").push((name, t));
        current += s;
    }
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let n = shards.len();
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            SAFETENSORS_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        };
        let path = dir.join(&file);
        safetensors::serialize_to_file(
            shard.iter().map(|(k, t)| (k.as_str(), *t)),
            Some(metadata.clone()),
            &path,
        )
        .map_err(|e| Error::checkpoint(&path, format!("cannot write: {e}")))?;
        // safetensors writes through a 0600 temporary file; give it the mode every
        // other file gets.
        set_default_permissions(&path)?;
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io(&path, e))?;
        for (name, _) in shard {
            weight_map.insert((*name).clone(), file.clone());
        }
        written.push(path);
    }
    if n > 1 {
        let total: u64 = tensors.values().map(size).sum();
        let index = ShardIndex {
            metadata: [("total_size".to_string(), serde_json::Value::from(total))]
                .into_iter()
                .collect(),
            weight_map,
        };
        let path = dir.join(SAFETENSORS_INDEX);
        let text = serde_json::to_string_pretty(&index).expect("serialisable");
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
        written.push(path);
    }
    Ok(written)
}

/// The process umask, read from `/proc/self/status` (no race with other threads, unlike
/// calling `umask` twice); 0o022 where that is not available.
pub(crate) fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

/// Gives `path` the mode a plain `create`/`create_dir` would have given it (0o666 or 0o777
/// less the umask): temporary files and folders are created 0600/0700, and a file
/// renamed out of them keeps that.
pub fn set_default_permissions(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::symlink_metadata(path).map_err(|e| Error::io(path, e))?;
        let base = if meta.is_dir() { 0o777 } else { 0o666 };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(base & !umask()))
            .map_err(|e| Error::io(path, e))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every stored dtype read as f32 (the widening fast path for f16 and
    /// bf16, candle's conversion otherwise) and as stored equals candle's own
    /// conversion of the same values, across shards and a growing buffer.
    #[test]
    fn safetensors_read_converts_exactly_like_candle() -> Result<()> {
        let dev = Device::Cpu;
        let base = Tensor::randn(0f32, 3.0, (37, 5), &dev)?;
        let mut tensors = Tensors::new();
        tensors.insert(
            "small_f16".into(),
            base.narrow(0, 0, 3)?.to_dtype(DType::F16)?,
        );
        tensors.insert("f16".into(), base.to_dtype(DType::F16)?);
        tensors.insert("bf16".into(), base.to_dtype(DType::BF16)?);
        tensors.insert("f32".into(), base.clone());
        tensors.insert("f64".into(), base.to_dtype(DType::F64)?);
        let dir = tempfile::tempdir().map_err(|e| Error::io(std::env::temp_dir(), e))?;
        let files: Vec<_> = write_safetensors(dir.path(), &tensors, 1000)?
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        assert!(files.len() > 1, "expected several shards");
        for target in [None, Some(DType::F32)] {
            let read = read_safetensors(&files, target, &dev)?;
            assert_eq!(read.len(), tensors.len());
            for (name, want) in &tensors {
                let want = match target {
                    Some(d) => want.to_dtype(d)?,
                    None => want.clone(),
                };
                let got = &read[name];
                assert_eq!(
                    (got.dtype(), got.dims()),
                    (want.dtype(), want.dims()),
                    "{name}"
                );
                let (got, want) = (got.to_dtype(DType::F64)?, want.to_dtype(DType::F64)?);
                let diff = (got - want)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f64>()?;
                assert_eq!(diff, 0.0, "{name} read as {target:?}");
            }
        }
        Ok(())
    }
}
