//! PyTorch checkpoints: the zip archive `torch.save` produces. Writing, so
//! that `torch.load(path, weights_only=True)` (and the official TokenFormer
//! trainer) can read a state dict we export; and reading, with the restricted
//! pickle reader of `super::pickle`, every record's CRC-32 checked and every
//! tensor view checked against its storage record before anything is read.
//!
//! Layout (PyTorch serialization format, `torch/serialization.py` and
//! `caffe2/serialize/inline_container.cc`): every record is stored
//! uncompressed under one top-level folder; `data.pkl` is a protocol-2 pickle
//! of an `OrderedDict` name → `torch._utils._rebuild_tensor_v2(storage, offset,
//! size, stride, requires_grad, hooks)`, where each storage is a persistent id
//! `("storage", torch.HalfStorage, key, "cpu", numel)` whose bytes are the
//! record `data/<key>` (little-endian). `byteorder`, `version` (3),
//! `.format_version`, `.storage_alignment` and `.data/serialization_id` are
//! what torch ≥ 2 writes beside it; record payloads start at multiples of 64
//! bytes (padding in a local extra field), as torch's reader expects for
//! memory mapping. Archives past 4 GiB use the zip64 extensions.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::{convert, decode, pickle, Scratch, Tensors};
use crate::error::{Error, Result};

/// Record payloads start at multiples of this (torch's `kFieldAlignment`).
pub(crate) const ALIGNMENT: u64 = 64;
const ARCHIVE: &str = "archive";

/// Options for [`write_state_dict`].
#[derive(Clone, Copy, Debug, Default)]
pub struct WriteOptions {
    /// Use zip64 records even for a small archive (they are needed past 4 GiB;
    /// forcing them lets tests cover that path on small files).
    pub force_zip64: bool,
}

/// Writes `tensors` (name → tensor, in the given order) as a torch state dict
/// at `path`. Each tensor gets its own storage, stored contiguously.
pub fn write_state_dict(
    path: &Path,
    tensors: &[(String, Tensor)],
    opts: WriteOptions,
) -> Result<()> {
    let io = |e: std::io::Error| Error::io(path, e);
    let file = std::fs::File::create(path).map_err(io)?;
    let mut zip = ZipWriter::new(BufWriter::with_capacity(1 << 20, file), opts.force_zip64);
    let pickle = state_dict_pickle(tensors).map_err(|e| Error::checkpoint(path, e))?;
    zip.add(&format!("{ARCHIVE}/data.pkl"), &pickle)
        .map_err(io)?;
    zip.add(&format!("{ARCHIVE}/.format_version"), b"1")
        .map_err(io)?;
    zip.add(
        &format!("{ARCHIVE}/.storage_alignment"),
        ALIGNMENT.to_string().as_bytes(),
    )
    .map_err(io)?;
    zip.add(&format!("{ARCHIVE}/byteorder"), b"little")
        .map_err(io)?;
    let mut id_hash = crc32fast::Hasher::new();
    for (i, (name, t)) in tensors.iter().enumerate() {
        let bytes = tensor_bytes(t)
            .map_err(|e| Error::checkpoint(path, format!("tensor `{name}`: {e}")))?;
        let crc = zip
            .add(&format!("{ARCHIVE}/data/{i}"), &bytes)
            .map_err(io)?;
        id_hash.update(&crc.to_le_bytes());
    }
    zip.add(&format!("{ARCHIVE}/version"), b"3\n").map_err(io)?;
    // torch writes a 40-digit id; ours is derived from the content, so that
    // exporting the same model twice gives the same file.
    let id = format!(
        "{:040}",
        u128::from(id_hash.finalize()) * 1_000_003 + tensors.len() as u128
    );
    zip.add(&format!("{ARCHIVE}/.data/serialization_id"), id.as_bytes())
        .map_err(io)?;
    let mut w = zip.finish().map_err(io)?;
    w.flush().map_err(io)?;
    w.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)
}

fn storage_class(dtype: DType) -> std::result::Result<&'static str, String> {
    Ok(match dtype {
        DType::F32 => "FloatStorage",
        DType::F16 => "HalfStorage",
        DType::BF16 => "BFloat16Storage",
        DType::F64 => "DoubleStorage",
        DType::I64 => "LongStorage",
        DType::U8 => "ByteStorage",
        other => return Err(format!("dtype {other:?} has no torch storage class here")),
    })
}

/// The raw little-endian bytes of a tensor in row-major order.
fn tensor_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    let t = t.to_device(&candle_core::Device::Cpu)?.contiguous()?;
    Ok(safetensors::View::data(&t).into_owned())
}

/// The `data.pkl` of a state dict (pickle protocol 2, as `torch.save` writes it).
fn state_dict_pickle(tensors: &[(String, Tensor)]) -> std::result::Result<Vec<u8>, String> {
    let mut p = Pickler(Vec::with_capacity(256 * tensors.len() + 64));
    p.op(&[0x80, 2]); // PROTO 2
    p.global("collections", "OrderedDict");
    p.op(b")R"); // EMPTY_TUPLE, REDUCE: OrderedDict()
    if !tensors.is_empty() {
        p.op(b"("); // MARK
        for (i, (name, t)) in tensors.iter().enumerate() {
            let class = storage_class(t.dtype()).map_err(|e| format!("tensor `{name}`: {e}"))?;
            p.unicode(name);
            p.global("torch._utils", "_rebuild_tensor_v2");
            p.op(b"("); // MARK for the argument tuple
            p.op(b"("); // MARK for the persistent id
            p.unicode("storage");
            p.global("torch", class);
            p.unicode(&i.to_string());
            p.unicode("cpu");
            p.int(t.elem_count() as u64);
            p.op(b"tQ"); // TUPLE, BINPERSID
            p.int(0); // storage offset
            p.tuple(t.dims());
            p.tuple(&contiguous_strides(t.dims()));
            p.op(&[0x89]); // NEWFALSE: requires_grad
            p.global("collections", "OrderedDict");
            p.op(b")R"); // backward hooks: OrderedDict()
            p.op(b"tR"); // TUPLE, REDUCE
        }
        p.op(b"u"); // SETITEMS
    }
    p.op(b"."); // STOP
    Ok(p.0)
}

fn contiguous_strides(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

/// The few pickle opcodes a state dict needs.
struct Pickler(Vec<u8>);

impl Pickler {
    fn op(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
    fn global(&mut self, module: &str, name: &str) {
        self.0.push(b'c');
        self.0
            .extend_from_slice(format!("{module}\n{name}\n").as_bytes());
    }
    fn unicode(&mut self, s: &str) {
        self.0.push(b'X');
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn int(&mut self, v: u64) {
        if v < 0x100 {
            self.0.extend_from_slice(&[b'K', v as u8]);
        } else if v < 0x1_0000 {
            self.0.push(b'M');
            self.0.extend_from_slice(&(v as u16).to_le_bytes());
        } else if v < 0x8000_0000 {
            self.0.push(b'J');
            self.0.extend_from_slice(&(v as u32).to_le_bytes());
        } else {
            // LONG1: little-endian two's complement; a 9th byte keeps it positive.
            self.0.extend_from_slice(&[0x8a, 9]);
            self.0.extend_from_slice(&v.to_le_bytes());
            self.0.push(0);
        }
    }
    fn tuple(&mut self, items: &[usize]) {
        self.0.push(b'(');
        for &i in items {
            self.int(i as u64);
        }
        self.0.push(b't');
    }
}

/// One finished record, for the central directory.
struct Entry {
    name: String,
    crc: u32,
    size: u64,
    offset: u64,
}

/// A minimal zip writer: stored (uncompressed) records with known sizes,
/// payloads aligned to [`ALIGNMENT`], zip64 where sizes or offsets need it.
struct ZipWriter<W: Write> {
    w: W,
    pos: u64,
    entries: Vec<Entry>,
    force_zip64: bool,
}

const U32_MAX: u64 = 0xFFFF_FFFF;
/// DOS date 1980-01-01, time 00:00 (fixed, so the output is reproducible).
const DOS_DATE: u16 = (1 << 5) | 1;

impl<W: Write> ZipWriter<W> {
    fn new(w: W, force_zip64: bool) -> Self {
        Self {
            w,
            pos: 0,
            entries: vec![],
            force_zip64,
        }
    }

    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.w.write_all(bytes)?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Appends a record and returns its CRC-32.
    fn add(&mut self, name: &str, data: &[u8]) -> std::io::Result<u32> {
        let offset = self.pos;
        let size = data.len() as u64;
        let crc = crc32fast::hash(data);
        let zip64 = self.force_zip64 || size >= U32_MAX;
        let mut extra = Vec::new();
        if zip64 {
            extra.extend_from_slice(&1u16.to_le_bytes());
            extra.extend_from_slice(&16u16.to_le_bytes());
            extra.extend_from_slice(&size.to_le_bytes());
            extra.extend_from_slice(&size.to_le_bytes());
        }
        // Pad with an unregistered extra field (torch uses id "FB") so the
        // payload starts on an ALIGNMENT boundary.
        let unpadded = offset + 30 + name.len() as u64 + extra.len() as u64;
        let mut pad = (ALIGNMENT - unpadded % ALIGNMENT) % ALIGNMENT;
        if pad != 0 && pad < 4 {
            pad += ALIGNMENT;
        }
        if pad != 0 {
            extra.extend_from_slice(b"FB");
            extra.extend_from_slice(&((pad - 4) as u16).to_le_bytes());
            extra.resize(extra.len() + pad as usize - 4, b'Z');
        }
        let small = if zip64 { U32_MAX as u32 } else { size as u32 };
        let mut h = Vec::with_capacity(30 + name.len() + extra.len());
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&(if zip64 { 45u16 } else { 20 }).to_le_bytes()); // version needed
        h.extend_from_slice(&0u16.to_le_bytes()); // flags
        h.extend_from_slice(&0u16.to_le_bytes()); // stored
        h.extend_from_slice(&0u16.to_le_bytes()); // time
        h.extend_from_slice(&DOS_DATE.to_le_bytes());
        h.extend_from_slice(&crc.to_le_bytes());
        h.extend_from_slice(&small.to_le_bytes()); // compressed size
        h.extend_from_slice(&small.to_le_bytes()); // uncompressed size
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&(extra.len() as u16).to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        h.extend_from_slice(&extra);
        self.put(&h)?;
        debug_assert_eq!(self.pos % ALIGNMENT, 0);
        self.put(data)?;
        self.entries.push(Entry {
            name: name.to_string(),
            crc,
            size,
            offset,
        });
        Ok(crc)
    }

    fn finish(mut self) -> std::io::Result<W> {
        let cd_start = self.pos;
        let entries = std::mem::take(&mut self.entries);
        for e in &entries {
            let big_size = self.force_zip64 || e.size >= U32_MAX;
            let big_offset = self.force_zip64 || e.offset >= U32_MAX;
            let mut extra = Vec::new();
            if big_size || big_offset {
                let mut fields = Vec::new();
                if big_size {
                    fields.extend_from_slice(&e.size.to_le_bytes());
                    fields.extend_from_slice(&e.size.to_le_bytes());
                }
                if big_offset {
                    fields.extend_from_slice(&e.offset.to_le_bytes());
                }
                extra.extend_from_slice(&1u16.to_le_bytes());
                extra.extend_from_slice(&(fields.len() as u16).to_le_bytes());
                extra.extend_from_slice(&fields);
            }
            let version: u16 = if extra.is_empty() { 20 } else { 45 };
            let size32 = if big_size {
                U32_MAX as u32
            } else {
                e.size as u32
            };
            let offset32 = if big_offset {
                U32_MAX as u32
            } else {
                e.offset as u32
            };
            let mut h = Vec::with_capacity(46 + e.name.len() + extra.len());
            h.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
            h.extend_from_slice(&version.to_le_bytes()); // made by
            h.extend_from_slice(&version.to_le_bytes()); // needed
            h.extend_from_slice(&0u16.to_le_bytes()); // flags
            h.extend_from_slice(&0u16.to_le_bytes()); // stored
            h.extend_from_slice(&0u16.to_le_bytes()); // time
            h.extend_from_slice(&DOS_DATE.to_le_bytes());
            h.extend_from_slice(&e.crc.to_le_bytes());
            h.extend_from_slice(&size32.to_le_bytes());
            h.extend_from_slice(&size32.to_le_bytes());
            h.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
            h.extend_from_slice(&(extra.len() as u16).to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes()); // comment
            h.extend_from_slice(&0u16.to_le_bytes()); // disk
            h.extend_from_slice(&0u16.to_le_bytes()); // internal attributes
            h.extend_from_slice(&0u32.to_le_bytes()); // external attributes
            h.extend_from_slice(&offset32.to_le_bytes());
            h.extend_from_slice(e.name.as_bytes());
            h.extend_from_slice(&extra);
            self.put(&h)?;
        }
        let cd_size = self.pos - cd_start;
        let n = entries.len() as u64;
        let zip64 = self.force_zip64 || n >= 0xFFFF || cd_start >= U32_MAX || cd_size >= U32_MAX;
        if zip64 {
            let eocd64 = self.pos;
            let mut r = Vec::with_capacity(56 + 20);
            r.extend_from_slice(&0x0606_4b50u32.to_le_bytes());
            r.extend_from_slice(&44u64.to_le_bytes()); // size of the rest of this record
            r.extend_from_slice(&45u16.to_le_bytes());
            r.extend_from_slice(&45u16.to_le_bytes());
            r.extend_from_slice(&0u32.to_le_bytes()); // this disk
            r.extend_from_slice(&0u32.to_le_bytes()); // disk with the directory
            r.extend_from_slice(&n.to_le_bytes());
            r.extend_from_slice(&n.to_le_bytes());
            r.extend_from_slice(&cd_size.to_le_bytes());
            r.extend_from_slice(&cd_start.to_le_bytes());
            // The locator.
            r.extend_from_slice(&0x0706_4b50u32.to_le_bytes());
            r.extend_from_slice(&0u32.to_le_bytes());
            r.extend_from_slice(&eocd64.to_le_bytes());
            r.extend_from_slice(&1u32.to_le_bytes());
            self.put(&r)?;
        }
        let n16 = if zip64 { 0xFFFF } else { n as u16 };
        let cap32 = |v: u64| if zip64 { U32_MAX as u32 } else { v as u32 };
        let mut r = Vec::with_capacity(22);
        r.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        r.extend_from_slice(&0u16.to_le_bytes());
        r.extend_from_slice(&0u16.to_le_bytes());
        r.extend_from_slice(&n16.to_le_bytes());
        r.extend_from_slice(&n16.to_le_bytes());
        r.extend_from_slice(&cap32(cd_size).to_le_bytes());
        r.extend_from_slice(&cap32(cd_start).to_le_bytes());
        r.extend_from_slice(&0u16.to_le_bytes()); // comment
        self.put(&r)?;
        Ok(self.w)
    }
}

/// The largest `data.pkl` read: a state dict of 100,000 tensors needs about
/// 20 MB.
pub(crate) const MAX_PICKLE_BYTES: u64 = 64 << 20;

/// Where one record's bytes are, and their CRC-32 from the central directory.
#[derive(Clone, Copy, Debug)]
struct Record {
    start: u64,
    size: u64,
    crc: u32,
}

/// One tensor of a torch checkpoint: its storage's dtype and the view
/// (element offset, shape, strides) of the storage record it reads.
#[derive(Clone, Debug)]
pub(crate) struct StoredTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    stride: Vec<usize>,
    offset: usize,
    storage: String,
}

impl StoredTensor {
    /// Elements of the tensor (checked against its storage at open).
    pub(crate) fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A torch zip checkpoint opened for reading: the directory and the state
/// dict are parsed and checked; tensor bytes are read by [`Self::read`].
#[derive(Debug)]
pub(crate) struct TorchReader {
    path: PathBuf,
    file: std::fs::File,
    /// Sorted by name.
    tensors: Vec<StoredTensor>,
    /// Storage key → its record.
    storages: HashMap<String, Record>,
    /// The archive's folder (`archive/`), for record names in messages.
    prefix: String,
}

impl TorchReader {
    /// Opens `path`: reads the zip directory, checks `byteorder`, reads
    /// `data.pkl` (CRC-checked) with the restricted pickle reader, and checks
    /// that every tensor's storage record exists, has exactly the storage's
    /// size, and holds the tensor's whole view.
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let bad = |msg: String| {
            Error::checkpoint(path, format!("not a readable PyTorch checkpoint: {msg}"))
        };
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        let len = meta.len();
        let mut zip = zip::ZipArchive::new(&file).map_err(|e| bad(format!("zip: {e}")))?;
        let mut records: HashMap<String, Record> = HashMap::new();
        for i in 0..zip.len() {
            let f = zip
                .by_index_raw(i)
                .map_err(|e| bad(format!("zip entry {i}: {e}")))?;
            let name = f
                .name()
                .map_err(|e| bad(format!("zip entry {i}: {e}")))?
                .into_owned();
            if f.is_dir() {
                continue;
            }
            if f.encrypted() || f.compression() != zip::CompressionMethod::Stored {
                return Err(bad(format!(
                    "record `{name}` is compressed or encrypted ({}); torch stores records as they are",
                    f.compression()
                )));
            }
            let size = f.size();
            let start = f
                .data_start()
                .ok_or_else(|| bad(format!("record `{name}` has no data offset")))?;
            if f.compressed_size() != size || start.checked_add(size).is_none_or(|end| end > len) {
                return Err(bad(format!(
                    "record `{name}` ({size} bytes at {start}) does not fit in the {len}-byte file"
                )));
            }
            let rec = Record {
                start,
                size,
                crc: f.crc32(),
            };
            if records.insert(name.clone(), rec).is_some() {
                return Err(bad(format!("record `{name}` appears twice")));
            }
        }
        let pickles: Vec<&String> = records
            .keys()
            .filter(|n| n.as_str() == "data.pkl" || n.ends_with("/data.pkl"))
            .collect();
        let [pkl_name] = pickles.as_slice() else {
            return Err(bad(format!(
                "expected one `data.pkl` record, found {}",
                pickles.len()
            )));
        };
        let prefix = pkl_name
            .strip_suffix("data.pkl")
            .unwrap_or_default()
            .to_string();
        let read_record = |name: &str, limit: u64| -> Result<Vec<u8>> {
            let rec = records
                .get(name)
                .copied()
                .ok_or_else(|| bad(format!("record `{name}` is missing")))?;
            if rec.size > limit {
                return Err(bad(format!(
                    "record `{name}` has {} bytes (at most {limit} expected)",
                    rec.size
                )));
            }
            let mut buf = vec![0u8; rec.size as usize];
            file.read_exact_at(&mut buf, rec.start)
                .map_err(|e| Error::io(path, e))?;
            check_crc(path, name, &rec, &buf)?;
            Ok(buf)
        };
        // The small records beside the pickle (version, byteorder, ...) are
        // checked too: a changed byte anywhere but in a tensor nobody reads
        // means the file is damaged.
        let data_prefix = format!("{prefix}data/");
        for (name, rec) in &records {
            if !name.starts_with(&data_prefix) && name != *pkl_name && rec.size <= 1 << 16 {
                read_record(name, 1 << 16)?;
            }
        }
        let byteorder = format!("{prefix}byteorder");
        if records.contains_key(&byteorder) {
            let order = read_record(&byteorder, 16)?;
            if order != b"little" {
                return Err(bad(format!(
                    "byte order `{}` (only little-endian checkpoints are read)",
                    String::from_utf8_lossy(&order)
                )));
            }
        }
        let pkl = read_record(pkl_name, MAX_PICKLE_BYTES)?;
        let pickled = pickle::state_dict(&pkl).map_err(|e| bad(format!("{pkl_name}: {e}")))?;
        let mut storages = HashMap::new();
        let mut tensors = Vec::with_capacity(pickled.len());
        for t in pickled {
            let record_name = format!("{prefix}data/{}", t.storage_key);
            let tensor_err =
                |msg: String| Error::checkpoint(path, format!("tensor `{}`: {msg}", t.name));
            let rec = *records
                .get(&record_name)
                .ok_or_else(|| tensor_err(format!("storage record `{record_name}` is missing")))?;
            let elem = t.dtype.size_in_bytes() as u64;
            let want = t.storage_numel.checked_mul(elem);
            if want != Some(rec.size) {
                return Err(tensor_err(format!(
                    "storage `{}` declares {} {:?} values but its record `{record_name}` has {} bytes",
                    t.storage_key, t.storage_numel, t.dtype, rec.size
                )));
            }
            let offset =
                check_view(&t.shape, &t.stride, t.offset, t.storage_numel).map_err(tensor_err)?;
            storages.insert(t.storage_key.clone(), rec);
            tensors.push(StoredTensor {
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                stride: t.stride,
                offset,
                storage: t.storage_key,
            });
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Self {
            path: path.to_path_buf(),
            file,
            tensors,
            storages,
            prefix,
        })
    }

    /// The tensors, sorted by name.
    pub(crate) fn tensors(&self) -> &[StoredTensor] {
        &self.tensors
    }

    /// Reads the tensors that `rename` gives a name (original name → new
    /// name, or None to skip), converted to `dtype` on `device`. Storage
    /// records are read in file order with positioned reads into one reused
    /// buffer and CRC-checked before use, so the peak is the converted
    /// tensors plus one record.
    pub(crate) fn read(
        &self,
        mut rename: impl FnMut(&str) -> Option<String>,
        dtype: Option<DType>,
        device: &Device,
    ) -> Result<Tensors> {
        let path = self.path.as_path();
        // Record start → (storage key, record, its tensors with new names).
        type Wanted<'a> = (&'a str, Record, Vec<(&'a StoredTensor, String)>);
        let mut by_record: BTreeMap<u64, Wanted> = BTreeMap::new();
        for t in &self.tensors {
            let Some(new_name) = rename(&t.name) else {
                continue;
            };
            let rec = *self.storages.get(&t.storage).ok_or_else(|| {
                Error::checkpoint(path, format!("tensor `{}`: no storage record", t.name))
            })?;
            by_record
                .entry(rec.start)
                .or_insert_with(|| (t.storage.as_str(), rec, vec![]))
                .2
                .push((t, new_name));
        }
        let mut scratch = Scratch::default();
        let mut gathered = Scratch::default();
        let mut out = Tensors::new();
        for (key, rec, list) in by_record.values() {
            let size = usize::try_from(rec.size).map_err(|_| {
                Error::checkpoint(path, format!("storage `{key}` is too large for memory"))
            })?;
            let buf = scratch.bytes(size);
            self.file
                .read_exact_at(buf, rec.start)
                .map_err(|e| Error::io(path, e))?;
            check_crc(path, &format!("{}data/{key}", self.prefix), rec, buf)?;
            for (t, new_name) in list {
                let tensor_err =
                    |msg: String| Error::checkpoint(path, format!("tensor `{}`: {msg}", t.name));
                let bytes = view_bytes(t, buf, &mut gathered).map_err(tensor_err)?;
                let tensor = decode(bytes, t.dtype, &t.shape, dtype)
                    .and_then(|x| convert(x, dtype, device))
                    .map_err(|e| tensor_err(e.to_string()))?;
                if out.insert(new_name.clone(), tensor).is_some() {
                    return Err(tensor_err(format!("two tensors map to `{new_name}`")));
                }
            }
        }
        Ok(out)
    }
}

fn check_crc(path: &Path, name: &str, rec: &Record, bytes: &[u8]) -> Result<()> {
    let crc = crc32fast::hash(bytes);
    if crc != rec.crc {
        return Err(Error::checkpoint(
            path,
            format!(
                "record `{name}` fails its CRC-32 check (stored {:08x}, computed {crc:08x}): the file is corrupt",
                rec.crc
            ),
        ));
    }
    Ok(())
}

/// Checks that a view (in elements) lies inside a storage of `numel`
/// elements and holds no more elements than the storage (a view that repeats
/// elements through zero or overlapping strides would allocate more than the
/// file holds). Returns the offset as a usize.
fn check_view(
    shape: &[usize],
    stride: &[usize],
    offset: u64,
    numel: u64,
) -> std::result::Result<usize, String> {
    let describe = || format!("view (offset {offset}, shape {shape:?}, stride {stride:?})");
    let elems = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| format!("{} has too many elements", describe()))?;
    if elems == 0 {
        return usize::try_from(offset.min(numel)).map_err(|_| describe());
    }
    if elems > numel {
        return Err(format!(
            "{} has {elems} elements but its storage only {numel}",
            describe()
        ));
    }
    shape
        .iter()
        .zip(stride)
        .try_fold(offset, |acc, (&d, &s)| {
            (d as u64 - 1)
                .checked_mul(s as u64)
                .and_then(|x| acc.checked_add(x))
        })
        .filter(|&last| last < numel)
        .ok_or_else(|| {
            format!(
                "{} reaches past the end of its storage of {numel} elements",
                describe()
            )
        })?;
    usize::try_from(offset).map_err(|_| describe())
}

/// The bytes of a tensor in row-major order: a slice of the record when the
/// view is contiguous, else gathered element by element into `gathered`.
fn view_bytes<'a>(
    t: &StoredTensor,
    record: &'a [u8],
    gathered: &'a mut Scratch,
) -> std::result::Result<&'a [u8], String> {
    let es = t.dtype.size_in_bytes();
    let n = t.elem_count();
    let out_of_range = || "view out of range of its storage".to_string();
    let mut expect = 1usize;
    let mut contiguous = true;
    for (&d, &s) in t.shape.iter().zip(&t.stride).rev() {
        if d != 1 && s != expect {
            contiguous = false;
        }
        expect = expect.saturating_mul(d);
    }
    if contiguous || n == 0 {
        let start = t.offset.checked_mul(es).ok_or_else(out_of_range)?;
        let end = n
            .checked_mul(es)
            .and_then(|b| b.checked_add(start))
            .ok_or_else(out_of_range)?;
        return record.get(start..end).ok_or_else(out_of_range);
    }
    let dst = gathered.bytes(n.checked_mul(es).ok_or_else(out_of_range)?);
    let dims: Vec<(usize, usize)> = t
        .shape
        .iter()
        .copied()
        .zip(t.stride.iter().copied())
        .collect();
    let mut idx = vec![0usize; dims.len()];
    let mut src = t.offset;
    for out in dst.chunks_exact_mut(es) {
        let from = src.checked_mul(es).ok_or_else(out_of_range)?;
        let bytes = from
            .checked_add(es)
            .and_then(|end| record.get(from..end))
            .ok_or_else(out_of_range)?;
        out.copy_from_slice(bytes);
        // Odometer over the dims, last fastest; `src` follows the strides
        // (wrapping: the intermediate sums may pass the end, the results that
        // are read do not, as `check_view` showed).
        for (i, &(size, stride)) in idx.iter_mut().zip(&dims).rev() {
            *i += 1;
            src = src.wrapping_add(stride);
            if *i < size {
                break;
            }
            src = src.wrapping_sub(stride.wrapping_mul(size));
            *i = 0;
        }
    }
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What we write, our reader reads back exactly: every storage dtype,
    /// a scalar and an empty tensor, with and without zip64 records.
    #[test]
    fn written_state_dicts_read_back_exactly() {
        let dev = Device::Cpu;
        let base = Tensor::arange(0f32, 24.0, &dev)
            .unwrap()
            .reshape((4, 6))
            .unwrap();
        let tensors: Vec<(String, Tensor)> = [
            ("f16", base.to_dtype(DType::F16).unwrap()),
            ("bf16", base.to_dtype(DType::BF16).unwrap()),
            ("f32", (&base * 0.5).unwrap()),
            ("f64", base.to_dtype(DType::F64).unwrap()),
            ("i64", base.to_dtype(DType::I64).unwrap()),
            ("u8", base.to_dtype(DType::U8).unwrap()),
            ("scalar", Tensor::new(3.5f32, &dev).unwrap()),
            ("empty", Tensor::zeros((0, 3), DType::F16, &dev).unwrap()),
        ]
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
        for force_zip64 in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.bin");
            write_state_dict(&path, &tensors, WriteOptions { force_zip64 }).unwrap();
            let r = TorchReader::open(&path).unwrap();
            assert_eq!(r.tensors().len(), tensors.len());
            for target in [None, Some(DType::F32)] {
                let read = r.read(|n| Some(format!("x.{n}")), target, &dev).unwrap();
                for (name, want) in &tensors {
                    let got = &read[&format!("x.{name}")];
                    let want = match target {
                        Some(d) => want.to_dtype(d).unwrap(),
                        None => want.clone(),
                    };
                    assert_eq!(
                        (got.dtype(), got.dims()),
                        (want.dtype(), want.dims()),
                        "{name}"
                    );
                    let flat = |t: &Tensor| -> Vec<f64> {
                        t.flatten_all()
                            .unwrap()
                            .to_dtype(DType::F64)
                            .unwrap()
                            .to_vec1()
                            .unwrap()
                    };
                    assert_eq!(flat(got), flat(&want), "{name} as {target:?}");
                }
            }
        }
    }

    #[test]
    fn views_must_fit_their_storage() {
        assert_eq!(check_view(&[2, 3], &[3, 1], 4, 10), Ok(4));
        assert!(check_view(&[2, 3], &[3, 1], 5, 10).is_err());
        assert!(check_view(&[11], &[1], 0, 10).is_err());
        // A stride-0 view repeating one element more often than the storage holds.
        assert!(check_view(&[1 << 40], &[0], 0, 10).is_err());
        assert!(check_view(&[1 << 40, 1 << 40], &[1, 1], 0, 10).is_err());
        assert!(check_view(&[2, 2], &[usize::MAX, 1], 0, 10).is_err());
        assert_eq!(check_view(&[0, 1 << 40], &[1, 1], 3, 10), Ok(3));
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(contiguous_strides(&[3, 4, 5]), vec![20, 5, 1]);
        assert_eq!(contiguous_strides(&[7]), vec![1]);
    }
}
