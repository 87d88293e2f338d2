//! `tokenformer-convert`: checkpoint conversion for TokenFormer models
//! (<https://arxiv.org/abs/2410.23168>). Every converter writes into a
//! temporary folder, checks its result against the source on a probe input,
//! and only then moves it into place.

mod args;
mod export;
mod family;
mod grow;
mod import;
mod merge;
mod official;
mod output;
mod probe;
#[path = "../../src/cli/progress.rs"]
mod progress;
mod publish;
#[path = "../../src/cli/shell.rs"]
mod shell;
#[path = "../../src/cli/stdout.rs"]
mod stdout;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tokenformer-convert",
    version,
    about = "Convert, grow, merge, export and publish TokenFormer checkpoints"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Official pytorch_model.bin + yml (or zoo config) → canonical safetensors folder.
    Official(official::OfficialArgs),
    /// Append parameter tokens to every Pattention layer (progressive scaling), exactly.
    Grow(grow::GrowArgs),
    /// Canonical language model → official pytorch_model.bin (torch zip) + eval yml.
    Export(export::ExportArgs),
    /// Validate a model folder, refresh its model card and upload it to the Hub.
    Publish(publish::PublishArgs),
    /// Hugging Face GPT-NeoX/Pythia or ViT weights → a TokenFormer, with a fidelity report.
    Import(import::ImportArgs),
    /// A vision and a language TokenFormer of the same shape → one tokenformer-vl model.
    Merge(merge::MergeArgs),
    /// Print a shell completion script (bash, zsh, fish, powershell, elvish).
    Completions(shell::CompletionsArgs),
}

fn main() {
    if std::env::var_os("TOKENFORMER_BACKTRACE").is_none() {
        // candle's errors carry a backtrace when this is set; users want the message.
        std::env::set_var("RUST_BACKTRACE", "0");
    }
    let cli = Cli::parse();
    let r: Result<()> = match cli.command {
        Command::Official(a) => official::run(a),
        Command::Grow(a) => grow::run(a),
        Command::Export(a) => export::run(a),
        Command::Publish(a) => publish::run(a),
        Command::Import(a) => import::run(a),
        Command::Merge(a) => merge::run(a),
        Command::Completions(a) => shell::print::<Cli>(&a),
    };
    if let Err(e) = r {
        if stdout::is_closed_pipe(&e) {
            std::process::exit(stdout::CLOSED_PIPE_STATUS);
        }
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn every_flag_and_command_has_help() {
        let cmd = super::Cli::command();
        cmd.clone().debug_assert();
        assert_eq!(super::shell::undocumented(&cmd), Vec::<String>::new());
    }
}
