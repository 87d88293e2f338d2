//! Opening files a user names (data, labels, images, results) without being
//! tricked by what sits at the path: only regular files are opened, checked
//! before `open` so that a FIFO never blocks the process, and reads are
//! bounded so that a huge or endless file cannot exhaust memory.
//!
//! `open` itself uses `O_NONBLOCK` and the opened file is checked again
//! (`fstat`), so a path swapped for a FIFO between the check and the open is
//! still refused rather than waited on.

use std::fs::{File, FileType, Metadata};
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// What a non-regular file is, for messages.
pub(crate) fn kind(ft: &FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO";
        }
        if ft.is_socket() {
            return "a socket";
        }
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
    }
    if ft.is_dir() {
        "a folder"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

fn not_regular(path: &Path, what: &str) -> Error {
    Error::io(
        path,
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("not a regular file ({what}); refusing to read it"),
        ),
    )
}

/// The metadata of `path` (symlinks followed) if it is a regular file.
pub fn regular_metadata(path: &Path) -> Result<Metadata> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(not_regular(path, kind(&meta.file_type())));
    }
    Ok(meta)
}

/// Opens `path` for reading if it is a regular file (symlinks followed);
/// anything else (FIFO, socket, device, folder) is refused without blocking.
pub(crate) fn open_regular(path: &Path) -> Result<File> {
    let before = regular_metadata(path)?;
    let file = open_nonblocking(path)?;
    let after = file.metadata().map_err(|e| Error::io(path, e))?;
    if !after.is_file() {
        return Err(not_regular(path, kind(&after.file_type())));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if (before.dev(), before.ino()) != (after.dev(), after.ino()) {
            return Err(Error::io(
                path,
                std::io::Error::other("the file was replaced while being opened"),
            ));
        }
    }
    #[cfg(not(unix))]
    let _ = before;
    Ok(file)
}

#[cfg(unix)]
fn open_nonblocking(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    // Regular files ignore O_NONBLOCK; cleared anyway so the descriptor is ordinary.
    // SAFETY: fcntl on a descriptor this function owns, with integer arguments only.
    unsafe {
        let fd = file.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok(file)
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| Error::io(path, e))
}

/// Reads a whole regular file of at most `max_bytes` bytes; a larger file is
/// an error naming the limit (also if it grows while being read).
pub(crate) fn read_bounded(path: &Path, max_bytes: u64) -> Result<Vec<u8>> {
    let file = open_regular(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let too_big = |n: u64| {
        Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{n} bytes or more, above the limit of {max_bytes} bytes for this file"),
            ),
        )
    };
    if len > max_bytes {
        return Err(too_big(len));
    }
    let mut out = Vec::with_capacity(len as usize);
    file.take(max_bytes.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| Error::io(path, e))?;
    if out.len() as u64 > max_bytes {
        return Err(too_big(out.len() as u64));
    }
    Ok(out)
}

/// `read_bounded` as UTF-8 text.
pub fn read_to_string_bounded(path: &Path, max_bytes: u64) -> Result<String> {
    let bytes = read_bounded(path, max_bytes)?;
    String::from_utf8(bytes).map_err(|e| {
        Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "not UTF-8 text (invalid byte at offset {})",
                    e.utf8_error().valid_up_to()
                ),
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("x.JPEG");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_regular(&fifo).unwrap_err().to_string();
        assert!(e.contains("x.JPEG") && e.contains("FIFO"), "{e}");
        let e = read_bounded(&fifo, 10).unwrap_err().to_string();
        assert!(e.contains("FIFO"), "{e}");
        // A symlink to it is refused the same way; a folder too.
        let link = dir.path().join("link.png");
        std::os::unix::fs::symlink(&fifo, &link).unwrap();
        assert!(open_regular(&link)
            .unwrap_err()
            .to_string()
            .contains("FIFO"));
        assert!(open_regular(dir.path())
            .unwrap_err()
            .to_string()
            .contains("folder"));
    }

    #[test]
    fn reads_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.txt");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_bounded(&p, 10).unwrap(), b"0123456789");
        let e = read_bounded(&p, 9).unwrap_err().to_string();
        assert!(e.contains("a.txt") && e.contains("limit of 9"), "{e}");
        std::fs::write(&p, b"ok \xff").unwrap();
        assert!(read_to_string_bounded(&p, 100)
            .unwrap_err()
            .to_string()
            .contains("offset 3"));
    }
}
