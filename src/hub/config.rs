//! Where and how to reach the Hub: endpoint, cache, token, offline mode, timeouts, retries
//! and how long to wait for another process's download, from the environment variables of
//! Python's `huggingface_hub` plus a few `TOKENFORMER_HUB_*` knobs.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// The public Hub, used when `HF_ENDPOINT` is unset.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Retries of a request after a transient failure (connection error, timeout, 429, 5xx).
pub const DEFAULT_MAX_RETRIES: usize = 5;
/// Time allowed to open a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time allowed for the response headers, and between two reads of a body.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// First delay of the exponential backoff between retries.
pub const DEFAULT_RETRY_BASE_DELAY: Duration = Duration::from_secs(1);
/// Longest single wait between retries, also for a server's `Retry-After`.
pub const DEFAULT_MAX_RETRY_WAIT: Duration = Duration::from_secs(60);
/// Longest wait for another process that downloads the same file (while it progresses).
pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(6 * 3600);

/// Where and how to reach the Hub. Build it with [`HubConfig::from_env`] (or
/// [`HubConfig::from_vars`], which tests use instead of mutating the process environment)
/// and adjust with the `with_*` overrides.
#[derive(Clone)]
pub struct HubConfig {
    /// Hub base URL, no trailing slash (`HF_ENDPOINT`).
    pub endpoint: String,
    /// `HF_HOME` (holds the `token` file).
    pub hf_home: PathBuf,
    /// The hub cache (`HF_HUB_CACHE`, default `$HF_HOME/hub`).
    pub cache_dir: PathBuf,
    /// Use only the cache, never the network (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// Retries for transient failures (5xx, 429, connection errors, timeouts); 0 = fail
    /// fast (`TOKENFORMER_HUB_RETRIES`).
    pub max_retries: usize,
    /// Base delay of the exponential backoff between retries (`TOKENFORMER_HUB_RETRY_DELAY`,
    /// seconds).
    pub retry_base_delay: Duration,
    /// Cap of one wait between retries, `Retry-After` included
    /// (`TOKENFORMER_HUB_MAX_RETRY_WAIT`, seconds).
    pub max_retry_wait: Duration,
    /// Connect timeout (`TOKENFORMER_HUB_CONNECT_TIMEOUT`, seconds).
    pub connect_timeout: Duration,
    /// Time allowed for response headers and between two body reads: a stalled server
    /// fails the request after this long (`TOKENFORMER_HUB_TIMEOUT`, or
    /// `HF_HUB_DOWNLOAD_TIMEOUT`, seconds).
    pub read_timeout: Duration,
    /// Overall bound on waiting for another process downloading the same file
    /// (`TOKENFORMER_HUB_LOCK_WAIT`, seconds). The wait also ends, with an error, when that
    /// process shows no progress for longer than a stalled request could take.
    pub lock_wait: Duration,
    token: Option<String>,
    /// Environment values that did not parse; reported by `HubClient::new`.
    pub(crate) invalid: Vec<String>,
}

impl HubConfig {
    /// Read the standard `huggingface_hub` environment variables.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Same as [`from_env`](Self::from_env) with variables looked up through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let get = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let home = get("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let expand = |p: String| match p.strip_prefix("~/") {
            Some(rest) => home.join(rest),
            None => PathBuf::from(p),
        };
        let hf_home = get("HF_HOME").map(expand).unwrap_or_else(|| {
            get("XDG_CACHE_HOME")
                .map(|x| expand(x).join("huggingface"))
                .unwrap_or_else(|| home.join(".cache").join("huggingface"))
        });
        let cache_dir = get("HF_HUB_CACHE")
            .or_else(|| get("HUGGINGFACE_HUB_CACHE"))
            .map(expand)
            .unwrap_or_else(|| hf_home.join("hub"));
        let offline = get("HF_HUB_OFFLINE")
            .or_else(|| get("TRANSFORMERS_OFFLINE"))
            .is_some_and(|v| is_truthy(&v));
        let token = if get("HF_HUB_DISABLE_IMPLICIT_TOKEN").is_some_and(|v| is_truthy(&v)) {
            None
        } else {
            get("HF_TOKEN")
                .or_else(|| get("HUGGING_FACE_HUB_TOKEN"))
                .map(|t| t.trim().to_string())
                .or_else(|| {
                    let file = get("HF_TOKEN_PATH")
                        .map(expand)
                        .unwrap_or_else(|| hf_home.join("token"));
                    std::fs::read_to_string(file)
                        .ok()
                        .map(|t| t.trim().to_string())
                        .filter(|t| !t.is_empty())
                })
        };
        let mut invalid = Vec::new();
        let mut secs = |keys: &[&str], default: Duration| -> Duration {
            for k in keys {
                if let Some(v) = get(k) {
                    match parse_seconds(&v) {
                        Some(d) => return d,
                        None => invalid.push(format!(
                            "{k}={v:?} is not a number of seconds (> 0, at most a week)"
                        )),
                    }
                }
            }
            default
        };
        let connect_timeout = secs(
            &["TOKENFORMER_HUB_CONNECT_TIMEOUT"],
            DEFAULT_CONNECT_TIMEOUT,
        );
        let read_timeout = secs(
            &["TOKENFORMER_HUB_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"],
            DEFAULT_READ_TIMEOUT,
        );
        let retry_base_delay = secs(&["TOKENFORMER_HUB_RETRY_DELAY"], DEFAULT_RETRY_BASE_DELAY);
        let max_retry_wait = secs(&["TOKENFORMER_HUB_MAX_RETRY_WAIT"], DEFAULT_MAX_RETRY_WAIT);
        let lock_wait = secs(&["TOKENFORMER_HUB_LOCK_WAIT"], DEFAULT_LOCK_WAIT);
        // Not a huggingface_hub variable: lets scripts and tests fail fast.
        let max_retries = match get("TOKENFORMER_HUB_RETRIES") {
            None => DEFAULT_MAX_RETRIES,
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) if n <= 100 => n,
                _ => {
                    invalid.push(format!(
                        "TOKENFORMER_HUB_RETRIES={v:?} is not a whole number from 0 to 100"
                    ));
                    DEFAULT_MAX_RETRIES
                }
            },
        };
        HubConfig {
            endpoint: get("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
                .trim()
                .trim_end_matches('/')
                .to_string(),
            hf_home,
            cache_dir,
            offline,
            max_retries,
            retry_base_delay,
            max_retry_wait,
            connect_timeout,
            read_timeout,
            lock_wait,
            token,
            invalid,
        }
    }

    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = endpoint.into().trim().trim_end_matches('/').to_string();
        self
    }

    pub fn with_cache_dir(mut self, cache_dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = cache_dir.into();
        self
    }

    /// Send this token (`Authorization: Bearer ...`, only to the endpoint's own host).
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into()).filter(|t| !t.is_empty());
        self
    }

    /// Send no token. (Publishing goes through `hf-hub`, which may still pick up an
    /// ambient `HF_TOKEN` / token file of the process: it has no "anonymous" switch.)
    pub fn without_token(mut self) -> Self {
        self.token = None;
        self
    }

    pub fn with_offline(mut self, offline: bool) -> Self {
        self.offline = offline;
        self
    }

    pub fn with_retries(mut self, max_retries: usize) -> Self {
        self.max_retries = max_retries;
        self
    }

    pub fn with_retry_base_delay(mut self, delay: Duration) -> Self {
        self.retry_base_delay = delay;
        self
    }

    pub fn with_max_retry_wait(mut self, wait: Duration) -> Self {
        self.max_retry_wait = wait;
        self
    }

    /// Connect and read (idle) timeouts.
    pub fn with_timeouts(mut self, connect: Duration, read: Duration) -> Self {
        self.connect_timeout = connect;
        self.read_timeout = read;
        self
    }

    pub fn with_lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    /// Whether a token will be sent.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    pub(crate) fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// How long a download-lock holder may show no sign of life before a waiter gives up:
    /// longer than any single stalled request or retry wait of a healthy holder.
    pub(crate) fn lock_stall_limit(&self) -> Duration {
        (self.connect_timeout + self.read_timeout * 2 + self.max_retry_wait)
            .max(Duration::from_secs(2))
    }

    /// Replace every occurrence of the token in `text` (defence in depth for messages that
    /// echo server responses or URLs).
    pub(crate) fn scrub(&self, text: String) -> String {
        match &self.token {
            Some(t) if t.len() >= 4 && text.contains(t.as_str()) => {
                text.replace(t.as_str(), "<redacted>")
            }
            _ => text,
        }
    }
}

impl fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubConfig")
            .field("endpoint", &self.endpoint)
            .field("hf_home", &self.hf_home)
            .field("cache_dir", &self.cache_dir)
            .field("offline", &self.offline)
            .field("max_retries", &self.max_retries)
            .field("retry_base_delay", &self.retry_base_delay)
            .field("max_retry_wait", &self.max_retry_wait)
            .field("connect_timeout", &self.connect_timeout)
            .field("read_timeout", &self.read_timeout)
            .field("lock_wait", &self.lock_wait)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Whether the environment variable `name` is set to a true value, as
/// `huggingface_hub` reads its flags (`1`, `true`, `yes`, `on`, any case).
pub fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| is_truthy(&v))
}

/// `huggingface_hub`'s notion of a true environment flag.
fn is_truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// Seconds (fractions allowed) as a duration: positive and at most a week.
fn parse_seconds(v: &str) -> Option<Duration> {
    let s: f64 = v.trim().parse().ok()?;
    (s.is_finite() && s > 0.0 && s <= 7.0 * 86400.0).then(|| Duration::from_secs_f64(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_from_vars_follows_huggingface_hub() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "hf_file_token\n").unwrap();
        let home = dir.path().to_string_lossy().to_string();
        let c = HubConfig::from_vars(|k| match k {
            "HF_HOME" => Some(home.clone()),
            "HF_HUB_OFFLINE" => Some("yes".into()),
            "HF_ENDPOINT" => Some("http://x:1/".into()),
            _ => None,
        });
        assert_eq!(c.cache_dir, dir.path().join("hub"));
        assert!(c.offline);
        assert_eq!(c.endpoint, "http://x:1");
        assert_eq!(c.token.as_deref(), Some("hf_file_token"));
        assert!(!format!("{c:?}").contains("hf_file_token"));
        assert_eq!(c.read_timeout, DEFAULT_READ_TIMEOUT);
        assert_eq!(c.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert!(c.invalid.is_empty());
        let c = HubConfig::from_vars(|k| match k {
            "HF_HOME" => Some(home.clone()),
            "HF_TOKEN" => Some("hf_env".into()),
            "HF_HUB_OFFLINE" => Some("0".into()),
            "TOKENFORMER_HUB_TIMEOUT" => Some("0.25".into()),
            "TOKENFORMER_HUB_CONNECT_TIMEOUT" => Some("2".into()),
            "HF_HUB_DOWNLOAD_TIMEOUT" => Some("99".into()),
            _ => None,
        });
        assert_eq!(c.token.as_deref(), Some("hf_env"));
        assert!(!c.offline);
        assert_eq!(c.read_timeout, Duration::from_millis(250));
        assert_eq!(c.connect_timeout, Duration::from_secs(2));
        let c = HubConfig::from_vars(|k| match k {
            "HF_HOME" => Some(home.clone()),
            "HF_HUB_DISABLE_IMPLICIT_TOKEN" => Some("1".into()),
            "HF_HUB_DOWNLOAD_TIMEOUT" => Some("7".into()),
            _ => None,
        });
        assert!(!c.has_token());
        assert_eq!(c.read_timeout, Duration::from_secs(7));
    }

    #[test]
    fn bad_numbers_are_reported_not_ignored() {
        let c = HubConfig::from_vars(|k| match k {
            "TOKENFORMER_HUB_TIMEOUT" => Some("-1".into()),
            "TOKENFORMER_HUB_RETRIES" => Some("many".into()),
            "TOKENFORMER_HUB_LOCK_WAIT" => Some("inf".into()),
            _ => None,
        });
        assert_eq!(c.invalid.len(), 3, "{:?}", c.invalid);
        assert!(c.invalid[0].contains("TOKENFORMER_HUB_TIMEOUT"));
        assert_eq!(c.read_timeout, DEFAULT_READ_TIMEOUT);
    }
}
