//! `tokenformer zoo list` and `tokenformer zoo show NAME`.

use crate::cli::stdout::outln;
use anyhow::{anyhow, Result};
use clap::Subcommand;
use tokenformer::zoo;

#[derive(Subcommand, Debug)]
pub enum ZooCommand {
    /// A table of the registered models.
    List {
        /// Print the registry as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Everything the registry knows about one model.
    Show {
        /// The model's zoo name (`tokenformer zoo list`).
        name: String,
    },
}

pub fn run(c: ZooCommand) -> Result<()> {
    match c {
        ZooCommand::List { json } => {
            if json {
                outln!("{}", serde_json::to_string_pretty(zoo::entries())?)?;
                return Ok(());
            }
            outln!(
                "{:<26} {:<20} {:>6}  {:<30} {:>9}",
                "name",
                "task",
                "params",
                "weights",
                "metric"
            )?;
            for e in zoo::entries() {
                let repo = match &e.weights {
                    Some(w) => w.repo.clone(),
                    None if e.bundled => "(in the binary, offline)".to_string(),
                    None => "(config only, no weights)".to_string(),
                };
                let metric = [
                    "pile_perplexity",
                    "imagenet_top1",
                    "kjv_val_perplexity",
                    "digits_val_top1",
                    "caption_accuracy",
                ]
                .iter()
                .find_map(|k| {
                    e.reported
                        .get(*k)
                        .map(|v| format!("{}={v}", k.split('_').next().unwrap_or(k)))
                })
                .unwrap_or_default();
                outln!(
                    "{:<26} {:<20} {:>6}  {:<30} {:>9}",
                    e.name,
                    e.task,
                    e.params,
                    repo,
                    metric
                )?;
            }
            Ok(())
        }
        ZooCommand::Show { name } => {
            let e = zoo::find(&name).ok_or_else(|| {
                anyhow!("`{name}` is not in the zoo (see `tokenformer zoo list`)")
            })?;
            if e.weights.is_none() && !e.bundled {
                outln!(
                    "note: {} has no released weights; it is a configuration.",
                    e.name
                )?;
            }
            outln!("{}", serde_json::to_string_pretty(e)?)?;
            Ok(())
        }
    }
}
