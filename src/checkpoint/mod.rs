//! Reading and writing weights: official `pytorch_model.bin` (torch zip
//! pickle, via `candle_core::pickle`) and Hugging Face style safetensors
//! (single file, or shards with `model.safetensors.index.json`, 5 GB shards as
//! `huggingface_hub` does). Name maps live in one module per format
//! ([`official`]); everything else works on canonical names.

pub mod official;
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
pub struct ShardIndex {
    #[serde(default)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub weight_map: BTreeMap<String, String>,
}

/// The safetensors files of a model folder: the single file, or the shards
/// listed by the index.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(SAFETENSORS_INDEX);
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let idx: ShardIndex = serde_json::from_str(&text)
            .map_err(|e| Error::checkpoint(&index, format!("bad shard index: {e}")))?;
        let mut files: Vec<_> = idx.weight_map.values().collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
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

/// Name, dtype and shape of one stored tensor (for `inspect`).
#[derive(Debug, Clone, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
}

/// Lists the tensors of a `.bin` or `.safetensors` file without loading them.
pub fn tensor_infos(path: &Path) -> Result<Vec<TensorInfo>> {
    let mut out = if is_pickle(path) {
        let pth = candle_core::pickle::PthTensors::new(path, None).map_err(|e| {
            Error::checkpoint(path, format!("not a readable PyTorch checkpoint: {e}"))
        })?;
        pth.tensor_infos()
            .iter()
            .map(|(name, ti)| TensorInfo {
                name: name.clone(),
                dtype: format!("{:?}", ti.dtype).to_lowercase(),
                shape: ti.layout.shape().dims().to_vec(),
            })
            .collect::<Vec<_>>()
    } else {
        let st =
            unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }.map_err(|e| {
                Error::checkpoint(path, format!("not a readable safetensors file: {e}"))
            })?;
        st.tensors()
            .into_iter()
            .map(|(name, view)| TensorInfo {
                name,
                dtype: format!("{:?}", view.dtype()).to_lowercase(),
                shape: view.shape().to_vec(),
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
    let pth = candle_core::pickle::PthTensors::new(path, None)
        .map_err(|e| Error::checkpoint(path, format!("not a readable PyTorch checkpoint: {e}")))?;
    let mut names: Vec<String> = pth.tensor_infos().keys().cloned().collect();
    names.sort();
    if names.is_empty() {
        return Err(Error::checkpoint(path, "contains no tensors"));
    }
    let mut out = Tensors::new();
    let mut ignored = Vec::new();
    for name in names {
        let Some(canonical) = official::to_canonical(&name, num_layers) else {
            ignored.push(name);
            continue;
        };
        let t = pth
            .get(&name)
            .map_err(|e| Error::checkpoint(path, format!("tensor `{name}`: {e}")))?
            .ok_or_else(|| {
                Error::checkpoint(path, format!("tensor `{name}` is listed but absent"))
            })?;
        let t = convert(t, dtype, device)
            .map_err(|e| Error::checkpoint(path, format!("tensor `{name}`: {e}")))?;
        out.insert(canonical, t);
    }
    Ok((out, ignored))
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
        .map_or(0, |i| i - 1)
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

/// Header sizes above this are not a safetensors file (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

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
    let bad =
        |msg: String| Error::checkpoint(path, format!("not a readable safetensors file: {msg}"));
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let read_at =
        |buf: &mut [u8], at: u64| file.read_exact_at(buf, at).map_err(|e| Error::io(path, e));
    let mut n = [0u8; 8];
    if len < 8 {
        return Err(bad(format!(
            "{len} bytes is shorter than the header size field"
        )));
    }
    read_at(&mut n, 0)?;
    let header_len = u64::from_le_bytes(n);
    if header_len > MAX_HEADER_BYTES || 8 + header_len > len {
        return Err(bad(format!(
            "header of {header_len} bytes in a {len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    read_at(&mut header, 8)?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let mut infos: Vec<_> = meta.tensors().into_iter().collect();
    infos.sort_by_key(|(_, i)| i.data_offsets.0);
    let data_start = 8 + header_len;
    let mut scratch = Scratch::default();
    for (name, info) in infos {
        let tensor_err = |msg: String| Error::checkpoint(path, format!("tensor `{name}`: {msg}"));
        let (start, end) = info.data_offsets;
        let elems: usize = info.shape.iter().product();
        let bytes = elems * info.dtype.bitsize() / 8;
        if end < start || end - start != bytes || data_start + end as u64 > len {
            return Err(tensor_err(format!(
                "data offsets {start}..{end} do not hold {bytes} bytes of {:?} {:?} in a {len}-byte file",
                info.dtype, info.shape
            )));
        }
        let stored = DType::try_from(info.dtype).map_err(|e| tensor_err(e.to_string()))?;
        let buf = scratch.bytes(bytes);
        read_at(buf, data_start + start as u64)?;
        let t = decode(buf, stored, &info.shape, dtype)
            .and_then(|t| convert(t, dtype, device))
            .map_err(|e| tensor_err(e.to_string()))?;
        if out.insert(name.clone(), t).is_some() {
            return Err(Error::checkpoint(
                path,
                format!("tensor `{name}` appears in two shards"),
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
    let dtype = tensors.values().next().map_or(DType::F32, |t| t.dtype());
    let backend = HandOver(std::sync::Mutex::new(tensors.into_iter().collect()));
    candle_nn::VarBuilder::from_backend(Box::new(backend), dtype, device.clone())
}

/// The tensors not yet taken by the model being built.
struct HandOver(std::sync::Mutex<HashMap<String, Tensor>>);

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
pub fn umask() -> u32 {
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
