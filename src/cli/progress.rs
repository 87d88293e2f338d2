//! Terminal bars for the library's progress events, on stderr. Shared by both
//! binaries (`tokenformer-convert` includes this file), so the rules are one:
//! no bars under `HF_HUB_DISABLE_PROGRESS_BARS`, and none when stderr is not a
//! terminal (indicatif draws nothing then).

use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokenformer::hub::{env_flag, DownloadEvent, DownloadProgress, UploadEvent, UploadProgress};

/// False when the user turned bars off, as `huggingface_hub` lets them.
pub fn enabled() -> bool {
    !env_flag("HF_HUB_DISABLE_PROGRESS_BARS")
}

/// A stderr bar of `len` steps with `template`, hidden when bars are off.
pub fn bar(len: u64, template: &str) -> ProgressBar {
    if !enabled() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(template)
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

fn bytes_bar(label: &str) -> ProgressBar {
    let b = bar(
        0,
        "{msg:24!} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
    );
    b.set_message(label.to_string());
    b
}

/// The bar of the file being downloaded, if any.
#[derive(Default)]
struct DownloadBar(Option<ProgressBar>);

impl DownloadBar {
    fn on(&mut self, e: &DownloadEvent) {
        match *e {
            DownloadEvent::Started { file, total_bytes } => {
                let bar = bytes_bar(file);
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
                self.0 = Some(bytes_bar(&format!("{file} (other process)")));
            }
            DownloadEvent::Finished { .. } => {
                if let Some(bar) = self.0.take() {
                    bar.finish();
                }
            }
            _ => {}
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

/// A callback drawing a stderr bar per downloaded file.
pub fn download_bars() -> DownloadProgress {
    let bar = Mutex::new(DownloadBar::default());
    DownloadProgress::new(move |e| {
        if let Ok(mut b) = bar.lock() {
            b.on(e)
        }
    })
}

/// A callback drawing one stderr bar for a publish (bytes sent, then the commit).
#[allow(dead_code)] // only `tokenformer-convert publish` uploads
pub fn upload_bars() -> UploadProgress {
    let bar: Mutex<Option<ProgressBar>> = Mutex::new(None);
    UploadProgress::new(move |e| {
        let Ok(mut slot) = bar.lock() else { return };
        match *e {
            UploadEvent::Started { repo } => *slot = Some(bytes_bar(repo)),
            UploadEvent::Progress { bytes, total_bytes } => {
                if let Some(b) = slot.as_ref() {
                    b.set_length(total_bytes);
                    b.set_position(bytes);
                }
            }
            UploadEvent::Committing => {
                if let Some(b) = slot.as_ref() {
                    b.set_message("creating the commit");
                }
            }
            UploadEvent::Finished { ok } => {
                if let Some(b) = slot.take() {
                    if ok {
                        b.finish()
                    } else {
                        b.abandon()
                    }
                }
            }
            _ => {}
        }
    })
}
