//! Download and upload progress as events for the caller to display; the library
//! draws nothing itself (the command line turns the events into terminal bars).

use std::fmt;
use std::sync::Arc;

use hf_hub::progress::{ProgressEvent, ProgressHandler};

/// What a download reports while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DownloadEvent<'a> {
    /// A file's content starts to arrive (`total_bytes` if the server said).
    Started {
        file: &'a str,
        total_bytes: Option<u64>,
    },
    /// Bytes of the file received so far.
    Progress {
        file: &'a str,
        bytes: u64,
        total_bytes: Option<u64>,
    },
    /// Another process downloads the same file; this one waits for it.
    Waiting { file: &'a str },
    /// The file is in the cache, checked.
    Finished { file: &'a str },
}

/// What a publish reports while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UploadEvent<'a> {
    /// The commit to `repo` starts (`repo` as `owner/name@revision`).
    Started { repo: &'a str },
    /// Bytes sent so far, of `total_bytes`.
    Progress { bytes: u64, total_bytes: u64 },
    /// All content is sent; the commit is being created.
    Committing,
    /// The commit is done (`ok`) or failed.
    Finished { ok: bool },
}

/// A download progress callback that option structs can hold and clone.
#[derive(Clone)]
pub struct DownloadProgress(Arc<dyn Fn(&DownloadEvent) + Send + Sync>);

impl DownloadProgress {
    pub fn new(f: impl Fn(&DownloadEvent) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    pub fn report(&self, e: &DownloadEvent) {
        (self.0)(e)
    }
}

impl fmt::Debug for DownloadProgress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DownloadProgress(..)")
    }
}

/// An upload progress callback that [`PublishOptions`](super::PublishOptions) can hold.
#[derive(Clone)]
pub struct UploadProgress(Arc<dyn Fn(&UploadEvent) + Send + Sync>);

impl UploadProgress {
    pub fn new(f: impl Fn(&UploadEvent) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    pub fn report(&self, e: &UploadEvent) {
        (self.0)(e)
    }
}

impl fmt::Debug for UploadProgress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UploadProgress(..)")
    }
}

/// Feeds `hf-hub`'s upload events to an [`UploadProgress`].
pub(crate) struct UploadHandler(pub(crate) UploadProgress);

impl ProgressHandler for UploadHandler {
    fn on_progress(&self, event: &ProgressEvent) {
        use hf_hub::progress::UploadEvent as Hf;
        let e = match event {
            ProgressEvent::Upload(Hf::Progress {
                bytes_completed,
                total_bytes,
                ..
            }) => UploadEvent::Progress {
                bytes: *bytes_completed,
                total_bytes: *total_bytes,
            },
            ProgressEvent::Upload(Hf::Start { total_bytes, .. }) => UploadEvent::Progress {
                bytes: 0,
                total_bytes: *total_bytes,
            },
            ProgressEvent::Upload(Hf::Committing) => UploadEvent::Committing,
            _ => return,
        };
        self.0.report(&e)
    }
}
