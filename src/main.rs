//! The `tokenformer` command: run, score, evaluate and inspect TokenFormer
//! models (<https://arxiv.org/abs/2410.23168>).

mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tokenformer",
    version,
    about = "TokenFormer models on candle: download, run, evaluate"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Continue a prompt (KV-cache decoding, greedy or sampled), streamed to stdout.
    Generate(cli::lm::GenerateArgs),
    /// Per-position log p(next token), total NLL and perplexity of a text or ids.
    Score(cli::lm::ScoreArgs),
    /// List the tensors, architecture and parameter count of a checkpoint.
    Inspect(cli::inspect::InspectArgs),
    /// The model registry.
    #[command(subcommand)]
    Zoo(cli::zoo::ZooCommand),
}

fn main() {
    quiet_backtraces();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(a) => cli::lm::generate_cmd(a),
        Command::Score(a) => cli::lm::score_cmd(a),
        Command::Inspect(a) => cli::inspect::run(a),
        Command::Zoo(c) => cli::zoo::run(c),
    }
}

/// candle attaches a backtrace to its errors when RUST_BACKTRACE is set; a
/// command-line user wants the message, so keep them only on request.
fn quiet_backtraces() {
    if std::env::var_os("TOKENFORMER_BACKTRACE").is_none() {
        std::env::set_var("RUST_BACKTRACE", "0");
    }
}
