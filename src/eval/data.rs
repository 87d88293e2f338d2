//! Reading evaluation data: a `.txt`, `.jsonl`, `.jsonl.zst` or `.parquet`
//! file streamed line by line with a bounded line length (a parquet file's
//! rows as JSON lines, through the `parquet` crate's record API), and the
//! sha256 results record.
//!
//! A line longer than the limit is never held in memory (the reader skips to
//! its end) and is a bad line; a `.txt` longer than the limit (one document)
//! is an error; the `.zst` decoder accepts windows of at most
//! 2^[`MAX_ZSTD_WINDOW_LOG`] bytes; only regular files are opened.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Counts a reader's compressed input position (for progress and ETA).
struct Counting<R> {
    inner: R,
    read: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The default longest line (a `.txt`: document) read, in bytes: far above
/// the Pile's documents (a few MB at most, JSON-escaped), and it bounds the
/// tokenizer's memory, a large multiple of the text's size (README, Evaluation).
pub const DEFAULT_MAX_LINE_BYTES: usize = 16 << 20;

/// The largest zstd window accepted (2^27 = 128 MiB, zstd's own default
/// bound; `zstd --long` up to 27 stays readable): a frame cannot make the
/// decoder allocate more.
pub const MAX_ZSTD_WINDOW_LOG: u32 = 27;

/// Ends an error about a line (or `.txt` document) above the line limit:
/// names the option that sets it (a command line puts its flag in its place).
pub const NOTE_MAX_LINE_BYTES: &str = "(the max_line_bytes option)";

/// Ends an error about a bad line: names the option that skips bad lines
/// instead (a command line puts its flag in its place).
pub const NOTE_SKIP_BAD: &str = "(set skip_bad to skip and count bad lines)";

/// A data file opened for streaming: decompressed if `.zst`.
pub struct DataFile {
    /// The file, for errors.
    pub path: PathBuf,
    /// The decompressed bytes.
    pub reader: Box<dyn BufRead + Send>,
    /// Bytes of the file (compressed) read so far.
    pub position: Arc<AtomicU64>,
    /// The file's size in bytes.
    pub size: u64,
    /// `.txt` (or `.txt.zst`): the whole file is one document.
    pub is_text: bool,
    /// Lines (a `.txt`: the document) longer than this are bad lines.
    pub max_line_bytes: usize,
}

impl DataFile {
    /// Opens `path` with the default line limit.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, DEFAULT_MAX_LINE_BYTES)
    }

    /// Opens `path` (a regular file only) for streaming; lines longer than
    /// `max_line_bytes` will be reported as bad lines.
    pub fn open_with(path: &Path, max_line_bytes: usize) -> Result<Self> {
        let file = crate::fsutil::open_regular(path)?;
        let size = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let position = Arc::new(AtomicU64::new(0));
        let counting = Counting {
            inner: file,
            read: position.clone(),
        };
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        let (stem, zst) = match name.strip_suffix(".zst") {
            Some(s) => (s.to_string(), true),
            None => (name.clone(), false),
        };
        let reader: Box<dyn BufRead + Send> = if name.ends_with(".parquet") {
            let rows = ParquetLines::open(path, position.clone(), size)?;
            Box::new(BufReader::with_capacity(1 << 20, rows))
        } else if zst {
            let mut dec = zstd::Decoder::new(counting).map_err(|e| Error::io(path, e))?;
            dec.window_log_max(MAX_ZSTD_WINDOW_LOG)
                .map_err(|e| Error::io(path, e))?;
            Box::new(BufReader::with_capacity(1 << 20, dec))
        } else {
            Box::new(BufReader::with_capacity(1 << 20, counting))
        };
        Ok(Self {
            path: path.to_path_buf(),
            reader,
            position,
            size,
            is_text: stem.ends_with(".txt"),
            max_line_bytes,
        })
    }

    /// Standard input as JSON lines, named `<stdin>` in errors.
    pub fn stdin(max_line_bytes: usize) -> Self {
        let position = Arc::new(AtomicU64::new(0));
        let counting = Counting {
            inner: std::io::stdin(),
            read: position.clone(),
        };
        Self {
            path: PathBuf::from("<stdin>"),
            reader: Box::new(BufReader::with_capacity(1 << 20, counting)),
            position,
            size: 0,
            is_text: false,
            max_line_bytes,
        }
    }

    /// The whole stream as one document (a `.txt`), at most `max_line_bytes`.
    pub fn read_document(&mut self) -> Result<Vec<u8>> {
        let mut raw = Vec::new();
        (&mut self.reader)
            .take((self.max_line_bytes as u64).saturating_add(1))
            .read_to_end(&mut raw)
            .map_err(|e| Error::io(&self.path, e))?;
        if raw.len() > self.max_line_bytes {
            return Err(Error::input(format!(
                "{}: the document is longer than the limit of {} bytes {NOTE_MAX_LINE_BYTES}",
                self.path.display(),
                self.max_line_bytes
            )));
        }
        Ok(raw)
    }
}

/// A parquet file's rows as JSON lines (one object per row, columns by
/// name; nested lists and structs as JSON arrays and objects). The position
/// advances by the file's size over its rows.
struct ParquetLines {
    path: PathBuf,
    rows: parquet::record::reader::RowIter<'static>,
    line: Vec<u8>,
    at: usize,
    done_rows: u64,
    total_rows: u64,
    size: u64,
    position: Arc<AtomicU64>,
}

impl ParquetLines {
    fn open(path: &Path, position: Arc<AtomicU64>, size: u64) -> Result<Self> {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let bad = |e: parquet::errors::ParquetError| {
            Error::input(format!(
                "{}: not a readable parquet file: {e}",
                path.display()
            ))
        };
        let file = crate::fsutil::open_regular(path)?;
        let reader = SerializedFileReader::new(file).map_err(bad)?;
        let total_rows = reader.metadata().file_metadata().num_rows().max(0) as u64;
        Ok(Self {
            path: path.to_path_buf(),
            rows: reader.into_iter(),
            line: Vec::new(),
            at: 0,
            done_rows: 0,
            total_rows,
            size,
            position,
        })
    }
}

impl Read for ParquetLines {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.at == self.line.len() {
            let Some(row) = self.rows.next() else {
                return Ok(0);
            };
            let row = row.map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: row {}: {e}", self.path.display(), self.done_rows + 1),
                )
            })?;
            self.line.clear();
            self.at = 0;
            serde_json::to_writer(&mut self.line, &row.to_json_value())
                .map_err(std::io::Error::other)?;
            self.line.push(b'\n');
            self.done_rows += 1;
            let pos = self.size as u128 * self.done_rows as u128 / self.total_rows.max(1) as u128;
            self.position
                .store(pos.min(self.size as u128) as u64, Ordering::Relaxed);
        }
        let n = buf.len().min(self.line.len() - self.at);
        buf[..n].copy_from_slice(&self.line[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// How a bounded line read ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LineEnd {
    Eof,
    Line,
    /// The line had this many bytes (newline included), above the limit; its
    /// bytes were read and dropped.
    TooLong(u64),
}

/// `read_until(b'\n')` that keeps at most `max` bytes of a line (without its
/// newline) in `buf`: a longer line is consumed to its end but not stored.
fn read_line_bounded(
    r: &mut dyn BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<LineEnd> {
    buf.clear();
    let mut total = 0u64;
    let mut too_long = false;
    loop {
        let avail = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(match (total, too_long) {
                (0, _) => LineEnd::Eof,
                (_, false) => LineEnd::Line,
                (n, true) => LineEnd::TooLong(n),
            });
        }
        let newline = avail.iter().position(|&b| b == b'\n');
        let n = newline.map_or(avail.len(), |i| i + 1);
        total += n as u64;
        if !too_long {
            let content = buf.len() + n - usize::from(newline.is_some());
            if content > max {
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(&avail[..n]);
            }
        }
        r.consume(n);
        if newline.is_some() {
            return Ok(if too_long {
                LineEnd::TooLong(total)
            } else {
                LineEnd::Line
            });
        }
    }
}

/// One non-blank line of a JSON-lines file: its 1-based number and either the
/// parsed value or why it is bad (too long, invalid UTF-8, malformed JSON).
pub type Line = (usize, std::result::Result<Value, String>);

/// Iterates the non-blank lines of a JSON-lines stream; I/O and decompression
/// failures are errors, bad lines are reported to the caller.
pub struct JsonLines {
    file: DataFile,
    line: usize,
    buf: Vec<u8>,
}

impl JsonLines {
    /// Iterates the lines of `file`.
    pub fn new(file: DataFile) -> Self {
        Self {
            file,
            line: 0,
            buf: Vec::new(),
        }
    }
    /// Bytes of the data file read so far (shared with the reader).
    pub fn position(&self) -> Arc<AtomicU64> {
        self.file.position.clone()
    }
}

impl Iterator for JsonLines {
    type Item = Result<Line>;
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let max = self.file.max_line_bytes;
            let end = match read_line_bounded(&mut self.file.reader, &mut self.buf, max) {
                Ok(LineEnd::Eof) => return None,
                Ok(end) => end,
                Err(e) => return Some(Err(Error::io(&self.file.path, e))),
            };
            self.line += 1;
            if let LineEnd::TooLong(n) = end {
                let msg = format!(
                    "line of {n} bytes, longer than the limit of {max} bytes {NOTE_MAX_LINE_BYTES}"
                );
                return Some(Ok((self.line, Err(msg))));
            }
            let text = match std::str::from_utf8(&self.buf) {
                Ok(t) => t,
                Err(e) => {
                    let msg = format!("invalid UTF-8 at byte {} of the line", e.valid_up_to());
                    return Some(Ok((self.line, Err(msg))));
                }
            };
            if text.trim().is_empty() {
                continue;
            }
            let parsed =
                serde_json::from_str::<Value>(text).map_err(|e| format!("malformed JSON: {e}"));
            return Some(Ok((self.line, parsed)));
        }
    }
}

/// Hex sha256 of a file (read in 1 MiB blocks).
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = crate::fsutil::open_regular(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The error for a document whose log-likelihood is NaN or infinite.
pub(crate) fn non_finite(path: &Path, line: usize, value: f64) -> Error {
    Error::input(format!(
        "{} line {line}: the document's log-likelihood is {value}: the model outputs non-finite \
         values (NaN or infinity), so no perplexity or accuracy can be computed",
        path.display()
    ))
}
