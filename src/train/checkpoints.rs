//! Checkpoints of a training run: `checkpoint-{step:06}/` in the output folder, a
//! canonical model folder (loadable by every command) plus `optimizer.safetensors` (AdamW
//! moments) and `trainer_state.json`. Each is written into a hidden temporary folder,
//! synced and renamed into place, so a kill at any moment leaves the previous
//! checkpoints intact; listing, pruning and reading them back for `--resume`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::optim::{AdamW, Moments};
use super::trainer::TrainerState;
use crate::checkpoint::{self, Tensors};
use crate::error::{Error, Result};

pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "trainer_state.json";
const CHECKPOINT_PREFIX: &str = "checkpoint-";

/// Writes `checkpoint-{state.step}` into `out` atomically (temporary folder, then
/// rename): config, weights, optimiser moments, trainer state and the `extra` files.
pub(crate) fn write_checkpoint(
    out: &Path,
    config: &str,
    tensors: &Tensors,
    opt: &AdamW,
    state: &TrainerState,
    extra: &[(&str, Vec<u8>)],
) -> Result<PathBuf> {
    place_checkpoint(out, state.step, config, tensors, extra, true, |dir| {
        let mut moments = Tensors::new();
        for (k, m) in opt.moments() {
            moments.insert(format!("m.{k}"), m.m.clone());
            moments.insert(format!("v.{k}"), m.v.clone());
        }
        let opt_path = dir.join(OPTIMIZER_FILE);
        safetensors::serialize_to_file(&moments, None, &opt_path)
            .map_err(|e| Error::checkpoint(&opt_path, format!("cannot write: {e}")))?;
        checkpoint::set_default_permissions(&opt_path)?;
        let state = serde_json::to_string_pretty(state).expect("serialisable");
        write(dir, STATE_FILE, state.as_bytes())
    })
}

/// Writes `checkpoint-{step}` into `out` atomically as a model folder (config, weights
/// and the `extra` files, no optimiser state: a run such as a distillation that is not
/// resumed). Refuses to replace a checkpoint of that step already there.
pub fn write_model(
    out: &Path,
    step: u64,
    config: &str,
    tensors: &Tensors,
    extra: &[(&str, Vec<u8>)],
) -> Result<PathBuf> {
    place_checkpoint(out, step, config, tensors, extra, false, |_| Ok(()))
}

/// The checkpoint folder of `step` in `out`.
pub fn checkpoint_path(out: &Path, step: u64) -> PathBuf {
    out.join(format!("{CHECKPOINT_PREFIX}{step:06}"))
}

/// Writes a checkpoint folder in a hidden temporary folder beside it (`more` adds
/// files), syncs it, then renames it into place (`replace`: over an older one).
fn place_checkpoint(
    out: &Path,
    step: u64,
    config: &str,
    tensors: &Tensors,
    extra: &[(&str, Vec<u8>)],
    replace: bool,
    more: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let target = checkpoint_path(out, step);
    if !replace && target.exists() {
        return Err(Error::input(format!(
            "{}: already exists; remove it or write to another folder",
            target.display()
        )));
    }
    let name = format!("{CHECKPOINT_PREFIX}{step:06}");
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}.partial-"))
        .tempdir_in(out)
        .map_err(|e| Error::io(out, e))?;
    let dir = tmp.path();
    write(dir, "config.json", config.as_bytes())?;
    checkpoint::write_safetensors(dir, tensors, checkpoint::DEFAULT_SHARD_BYTES)?;
    more(dir)?;
    for (file, bytes) in extra {
        write(dir, file, bytes)?;
    }
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let p = entry.map_err(|e| Error::io(dir, e))?.path();
        std::fs::File::open(&p)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io(&p, e))?;
    }
    checkpoint::set_default_permissions(dir)?;
    if std::env::var_os("TOKENFORMER_TRAIN_ABORT_IN_SAVE").is_some() {
        // Test hook: die like a killed process would, with the checkpoint half placed.
        std::process::exit(137);
    }
    let kept = tmp.keep();
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(|e| Error::io(&target, e))?;
    }
    std::fs::rename(&kept, &target).map_err(|e| Error::io(&target, e))?;
    Ok(target)
}

fn write(dir: &Path, file: &str, bytes: &[u8]) -> Result<()> {
    let p = dir.join(file);
    std::fs::write(&p, bytes).map_err(|e| Error::io(&p, e))
}

/// The checkpoints in `out`, oldest first (only complete ones: partial folders are hidden
/// and never renamed into place).
pub fn checkpoints(out: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut v = Vec::new();
    let rd = match std::fs::read_dir(out) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(v),
        Err(e) => return Err(Error::io(out, e)),
    };
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(out, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(step) = name
            .strip_prefix(CHECKPOINT_PREFIX)
            .and_then(|s| s.parse::<u64>().ok())
        {
            v.push((step, entry.path()));
        }
    }
    v.sort();
    Ok(v)
}

/// Removes all but the newest `keep` checkpoints.
pub fn prune(out: &Path, keep: usize) -> Result<()> {
    let all = checkpoints(out)?;
    for (_, p) in all.iter().take(all.len().saturating_sub(keep)) {
        std::fs::remove_dir_all(p).map_err(|e| Error::io(p, e))?;
    }
    Ok(())
}

/// The checkpoint to resume from: `dir` itself if it holds trainer state, else its
/// newest checkpoint.
pub fn resume_dir(dir: &Path) -> Result<PathBuf> {
    if dir.join(STATE_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    checkpoints(dir)?
        .pop()
        .map(|(_, p)| p)
        .ok_or_else(|| Error::input(format!("{}: no checkpoint to resume from", dir.display())))
}

/// Reads a checkpoint's trainer state and optimiser moments.
pub fn read_resume_state(dir: &Path) -> Result<(TrainerState, BTreeMap<String, Moments>)> {
    let sp = dir.join(STATE_FILE);
    let text = crate::fsutil::read_to_string_bounded(&sp, crate::loader::MAX_CONFIG_BYTES)?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| Error::config(&sp, e))?;
    let op = dir.join(OPTIMIZER_FILE);
    let tensors =
        checkpoint::read_safetensors(std::slice::from_ref(&op), Some(DType::F32), &Device::Cpu)?;
    let mut moments: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
    for (k, t) in tensors {
        if let Some(n) = k.strip_prefix("m.") {
            moments.entry(n.to_string()).or_default().0 = Some(t);
        } else if let Some(n) = k.strip_prefix("v.") {
            moments.entry(n.to_string()).or_default().1 = Some(t);
        } else {
            return Err(Error::checkpoint(&op, format!("unexpected tensor `{k}`")));
        }
    }
    let moments = moments
        .into_iter()
        .map(|(k, pair)| match pair {
            (Some(m), Some(v)) => Ok((k, Moments { m, v })),
            _ => Err(Error::checkpoint(
                &op,
                format!("`{k}` lacks its first or second moment"),
            )),
        })
        .collect::<Result<_>>()?;
    Ok((state, moments))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversized_trainer_state_is_refused_before_reading() {
        let dir = tempfile::tempdir().unwrap();
        // Sparse: the size is checked before anything is read.
        std::fs::File::create(dir.path().join(STATE_FILE))
            .unwrap()
            .set_len(crate::loader::MAX_CONFIG_BYTES + 1)
            .unwrap();
        let err = read_resume_state(dir.path()).unwrap_err().to_string();
        assert!(err.contains(STATE_FILE) && err.contains("limit"), "{err}");
    }
}
