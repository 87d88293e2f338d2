//! Training text as GPT-NeoX packs it: documents tokenised, joined with EOS, and cut
//! into windows of `seq_len + 1` tokens (inputs and next-token targets) that overlap by
//! one token, streamed from `.txt`, `.jsonl` or `.jsonl.zst` files (the `text` field),
//! so the data need not fit in memory. A `.txt` file is one document, tokenised in
//! paragraph-aligned chunks.

use std::collections::VecDeque;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use crate::eval::pile::{DataFile, JsonLines};

/// Text of a `.txt` document tokenised at a time, cut at a line end.
const TXT_CHUNK_BYTES: usize = 1 << 16;
/// The longest line of a `.txt` file read (its bytes are held and tokenised at once).
const MAX_LINE_BYTES: usize = 16 << 20;

/// Documents of one file, in order.
enum Docs {
    Json(JsonLines),
    Text(DataFile),
}

/// An endless, deterministic stream of packed token windows over one or more files:
/// after the last file it starts again from the first (the next epoch).
pub struct TokenWindows {
    files: Vec<PathBuf>,
    tokenizer: Tokenizer,
    eos: u32,
    window: usize,
    file: usize,
    docs: Option<Docs>,
    pending: VecDeque<u32>,
    /// Windows produced so far (the data position a checkpoint records).
    produced: u64,
    epoch: u64,
    /// Documents read in this pass, and which of them this stream keeps.
    doc_index: u64,
    split: Split,
}

/// Which documents a stream takes: all, or one side of a held-out split that puts every
/// `every`-th document (counting from the `every`-th) into validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    All,
    Train { every: u64 },
    Validation { every: u64 },
}

impl Split {
    /// The split for a validation fraction (`0 < fraction < 1`): one document in
    /// round(1/fraction) is held out.
    pub fn every_for(fraction: f64) -> Result<u64> {
        if !(fraction > 0.0 && fraction < 1.0) {
            return Err(Error::input(format!(
                "the validation fraction must be between 0 and 1, got {fraction}"
            )));
        }
        Ok((1.0 / fraction).round().max(2.0) as u64)
    }

    fn keeps(&self, doc: u64) -> bool {
        match *self {
            Split::All => true,
            Split::Train { every } => doc % every != every - 1,
            Split::Validation { every } => doc % every == every - 1,
        }
    }
}

impl TokenWindows {
    /// Windows of `seq_len + 1` tokens from `files`, documents separated by `eos`.
    pub fn new(
        files: Vec<PathBuf>,
        tokenizer: Tokenizer,
        eos: u32,
        seq_len: usize,
        split: Split,
    ) -> Result<Self> {
        if files.is_empty() {
            return Err(Error::input("no training data files"));
        }
        if seq_len == 0 {
            return Err(Error::input("the sequence length must be positive"));
        }
        Ok(Self {
            files,
            tokenizer,
            eos,
            window: seq_len + 1,
            file: 0,
            docs: None,
            pending: VecDeque::new(),
            produced: 0,
            epoch: 0,
            doc_index: 0,
            split,
        })
    }

    /// Windows produced so far.
    pub fn position(&self) -> u64 {
        self.produced
    }

    /// Full passes over the data completed.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Skips `n` windows (resuming a run at its recorded data position).
    pub fn skip(&mut self, n: u64) -> Result<()> {
        for _ in 0..n {
            self.next_window()?;
        }
        Ok(())
    }

    /// The next window of `seq_len + 1` tokens.
    pub fn next_window(&mut self) -> Result<Vec<u32>> {
        let mut added_since_wrap = true;
        while self.pending.len() < self.window {
            if self.read_more()? {
                added_since_wrap = true;
                continue;
            }
            // End of the last file: start the next epoch, unless a whole pass added nothing.
            if !added_since_wrap {
                return Err(Error::input(format!(
                    "the training data ({}) holds fewer than {} tokens",
                    self.describe(),
                    self.window
                )));
            }
            added_since_wrap = false;
            self.epoch += 1;
            self.file = 0;
            self.docs = None;
            self.doc_index = 0;
        }
        let w: Vec<u32> = self.pending.iter().take(self.window).copied().collect();
        // Consecutive windows share one token: the last target is the next first input.
        self.pending.drain(..self.window - 1);
        self.produced += 1;
        Ok(w)
    }

    fn describe(&self) -> String {
        let names: Vec<String> = self.files.iter().map(|p| p.display().to_string()).collect();
        names.join(", ")
    }

    /// Tokenises the next document (or `.txt` chunk) into `pending`; false at the end
    /// of the last file.
    fn read_more(&mut self) -> Result<bool> {
        loop {
            if self.file >= self.files.len() {
                return Ok(false);
            }
            if self.docs.is_none() {
                let path = &self.files[self.file];
                let f = DataFile::open(path)?;
                self.docs = Some(if f.is_text {
                    Docs::Text(f)
                } else {
                    Docs::Json(JsonLines::new(f))
                });
            }
            let path = self.files[self.file].clone();
            let text = match self.docs.as_mut().expect("opened") {
                Docs::Json(lines) => match lines.next() {
                    None => None,
                    Some(line) => {
                        let (n, value) = line?;
                        let value = value.map_err(|e| bad_line(&path, n, &e))?;
                        let text = value
                            .get("text")
                            .and_then(|t| t.as_str())
                            .ok_or_else(|| bad_line(&path, n, "no string field `text`"))?;
                        Some((text.to_string(), true))
                    }
                },
                Docs::Text(f) => read_chunk(f)?,
            };
            match text {
                None => {
                    self.docs = None;
                    self.file += 1;
                }
                Some((text, end_of_document)) => {
                    let doc = self.doc_index;
                    if end_of_document {
                        self.doc_index += 1;
                    }
                    if !self.split.keeps(doc) {
                        continue;
                    }
                    let enc = self.tokenizer.encode(text.as_str(), false).map_err(|e| {
                        Error::input(format!("{}: cannot tokenise: {e}", path.display()))
                    })?;
                    self.pending.extend(enc.get_ids());
                    if end_of_document {
                        self.pending.push_back(self.eos);
                    }
                    return Ok(true);
                }
            }
        }
    }
}

fn bad_line(path: &Path, line: usize, why: &str) -> Error {
    Error::input(format!("{}: line {line}: {why}", path.display()))
}

/// About [`TXT_CHUNK_BYTES`] of a `.txt` document, ending at a line end; `true` when it
/// is the document's last chunk. `None` once the file is exhausted.
fn read_chunk(f: &mut DataFile) -> Result<Option<(String, bool)>> {
    let mut buf = Vec::new();
    loop {
        let n = (&mut f.reader)
            .take((MAX_LINE_BYTES + 1) as u64)
            .read_until(b'\n', &mut buf)
            .map_err(|e| Error::io(&f.path, e))?;
        if n > MAX_LINE_BYTES {
            return Err(Error::input(format!(
                "{}: a line is longer than {MAX_LINE_BYTES} bytes",
                f.path.display()
            )));
        }
        if n == 0 {
            if buf.is_empty() {
                return Ok(None);
            }
            break;
        }
        if buf.len() >= TXT_CHUNK_BYTES {
            let at_end = f
                .reader
                .fill_buf()
                .map_err(|e| Error::io(&f.path, e))?
                .is_empty();
            return Ok(Some((utf8(f, buf)?, at_end)));
        }
    }
    Ok(Some((utf8(f, buf)?, true)))
}

fn utf8(f: &DataFile, buf: Vec<u8>) -> Result<String> {
    String::from_utf8(buf).map_err(|e| {
        Error::input(format!(
            "{}: invalid UTF-8 at byte {}",
            f.path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}
