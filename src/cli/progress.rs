//! Terminal bars for the library's download events (one bar per file, on stderr).

use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokenformer::hub::{DownloadEvent, DownloadProgress};

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

/// The bar of the file being downloaded, if any.
#[derive(Default)]
struct DownloadBar(Option<ProgressBar>);

impl DownloadBar {
    fn on(&mut self, e: &DownloadEvent) {
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
                self.0 = Some(new_bar(&format!("{file} (other process)")));
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
