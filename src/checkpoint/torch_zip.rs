//! Writing PyTorch checkpoints: the zip archive `torch.save` produces, so
//! that `torch.load(path, weights_only=True)` (and the official TokenFormer
//! trainer) can read a state dict we export.
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

use std::io::{BufWriter, Write};
use std::path::Path;

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// Record payloads start at multiples of this (torch's `kFieldAlignment`).
pub const ALIGNMENT: u64 = 64;
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
    let mut id_hash = Crc32::new();
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
        u128::from(id_hash.finish()) * 1_000_003 + tensors.len() as u128
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
        let crc = {
            let mut c = Crc32::new();
            c.update(data);
            c.finish()
        };
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

/// CRC-32 (IEEE, reflected, as zip uses), slicing by 8 so that multi-GB
/// checkpoints are checksummed at memory speed.
struct Crc32 {
    state: u32,
}

fn crc_tables() -> &'static [[u32; 256]; 8] {
    static TABLES: std::sync::OnceLock<[[u32; 256]; 8]> = std::sync::OnceLock::new();
    TABLES.get_or_init(|| {
        let mut t = [[0u32; 256]; 8];
        for i in 0..256u32 {
            let mut c = i;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            t[0][i as usize] = c;
        }
        for i in 0..256 {
            for k in 1..8 {
                let prev = t[k - 1][i];
                t[k][i] = (prev >> 8) ^ t[0][(prev & 0xFF) as usize];
            }
        }
        t
    })
}

impl Crc32 {
    fn new() -> Self {
        Self { state: 0xFFFF_FFFF }
    }

    fn update(&mut self, data: &[u8]) {
        let t = crc_tables();
        let mut c = self.state;
        let mut chunks = data.chunks_exact(8);
        for ch in &mut chunks {
            let lo = c ^ u32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]);
            let hi = u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]);
            c = t[7][(lo & 0xFF) as usize]
                ^ t[6][((lo >> 8) & 0xFF) as usize]
                ^ t[5][((lo >> 16) & 0xFF) as usize]
                ^ t[4][(lo >> 24) as usize]
                ^ t[3][(hi & 0xFF) as usize]
                ^ t[2][((hi >> 8) & 0xFF) as usize]
                ^ t[1][((hi >> 16) & 0xFF) as usize]
                ^ t[0][(hi >> 24) as usize];
        }
        for &b in chunks.remainder() {
            c = (c >> 8) ^ t[0][((c ^ b as u32) & 0xFF) as usize];
        }
        self.state = c;
    }

    fn finish(&self) -> u32 {
        !self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_check_value() {
        // The standard check value of CRC-32/ISO-HDLC.
        let mut c = Crc32::new();
        c.update(b"123456789");
        assert_eq!(c.finish(), 0xCBF4_3926);
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(contiguous_strides(&[3, 4, 5]), vec![20, 5, 1]);
        assert_eq!(contiguous_strides(&[7]), vec![1]);
    }
}
