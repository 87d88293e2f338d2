//! Download progress as events for the caller to display, and the terminal bar that the
//! `progress: bool` convenience entry points draw with them.

use hf_hub::progress::{ProgressEvent, ProgressHandler, UploadEvent};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

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

fn new_bar(label: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{msg:24!} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(label.to_string());
    bar
}

/// A stderr bar per downloaded file, driven by [`DownloadEvent`]s.
#[derive(Default)]
pub(crate) struct DownloadBar(Option<ProgressBar>);

impl DownloadBar {
    pub(crate) fn on(&mut self, e: &DownloadEvent) {
        match *e {
            DownloadEvent::Started { file, total_bytes } => {
                let bar = new_bar(file);
                bar.set_length(total_bytes.unwrap_or(0));
                self.0 = Some(bar);
            }
            DownloadEvent::Progress {
                bytes, total_bytes, ..
            } => {
                if let Some(bar) = &self.0 {
                    if let Some(t) = total_bytes {
                        bar.set_length(t);
                    }
                    bar.set_position(bytes);
                }
            }
            DownloadEvent::Waiting { file } => {
                let bar = new_bar(&format!("{file} (other process)"));
                self.0 = Some(bar);
            }
            DownloadEvent::Finished { .. } => {
                if let Some(bar) = self.0.take() {
                    bar.finish();
                }
            }
        }
    }
}

impl Drop for DownloadBar {
    fn drop(&mut self) {
        if let Some(bar) = self.0.take() {
            bar.abandon();
        }
    }
}

/// An upload bar fed by `hf-hub`'s progress events.
pub(crate) fn upload_bar(label: &str) -> ProgressBar {
    new_bar(label)
}

pub(crate) struct UploadBar(pub ProgressBar);

impl ProgressHandler for UploadBar {
    fn on_progress(&self, event: &ProgressEvent) {
        let bar = &self.0;
        match event {
            ProgressEvent::Upload(UploadEvent::Start { total_bytes, .. }) => {
                bar.set_length(*total_bytes)
            }
            ProgressEvent::Upload(UploadEvent::Progress {
                bytes_completed,
                total_bytes,
                ..
            }) => {
                bar.set_length(*total_bytes);
                bar.set_position(*bytes_completed);
            }
            ProgressEvent::Upload(UploadEvent::Committing) => bar.set_message("committing"),
            _ => {}
        }
    }
}
