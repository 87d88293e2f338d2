//! Command-line pieces several converters share: where a model folder is written
//! (`--out`, `--force`), the storage dtype and the shard size.

use std::path::PathBuf;

use candle_core::DType;
use clap::{Args, ValueEnum};

/// `--out` and `--force` of a converter that writes a model folder.
#[derive(Args, Debug)]
pub struct FolderOut {
    /// The folder to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace a non-empty --out.
    #[arg(long)]
    pub force: bool,
}

/// Storage dtype for written weights.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DtypeArg {
    F32,
    F16,
    Bf16,
}

impl From<DtypeArg> for DType {
    fn from(d: DtypeArg) -> Self {
        match d {
            DtypeArg::F32 => DType::F32,
            DtypeArg::F16 => DType::F16,
            DtypeArg::Bf16 => DType::BF16,
        }
    }
}

/// `--dtype`: the storage dtype of the written weights, if not the input's.
#[derive(Args, Debug)]
pub struct Storage {
    /// Store weights in this dtype (default: as in the input).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
}

impl Storage {
    /// The dtype to read the input as (None: as stored).
    pub fn dtype(&self) -> Option<DType> {
        self.dtype.map(Into::into)
    }

    /// The probe tolerance of a conversion that should be exact: `exact` when the
    /// weights keep their dtype, the rounding of a dtype change otherwise.
    pub fn tolerance(&self, exact: f32) -> f32 {
        if self.dtype.is_some() {
            1e-1
        } else {
            exact
        }
    }
}

/// `5GB`, `200MB`, `64KiB` or a byte count.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size such as 5GB or 1000000"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit `{other}` in `{s}` (use B, KB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    match n.checked_mul(mult) {
        Some(0) | None => Err(format!("`{s}` is not a usable shard size")),
        Some(v) => Ok(v),
    }
}

/// `--max-shard-size` (hidden): the largest safetensors file written.
#[derive(Args, Debug)]
pub struct Shards {
    /// Largest safetensors shard, e.g. 5GB (default, the Hub's) or 200MB.
    #[arg(long, hide = true, default_value = "5GB", value_parser = parse_size)]
    pub max_shard_size: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("64KiB"), Ok(65_536));
        assert_eq!(parse_size("1234"), Ok(1234));
        assert!(parse_size("0").is_err());
        assert!(parse_size("5XB").is_err());
    }
}
