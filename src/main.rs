//! The `tokenformer` command: run, score, evaluate and inspect TokenFormer
//! models (<https://arxiv.org/abs/2410.23168>).

mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "tokenformer", version, about = "TokenFormer models on candle: download, run, evaluate")]
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
    /// Top-5 ImageNet classes and probabilities of images.
    Classify(cli::vision::ClassifyArgs),
    /// Benchmark evaluations.
    #[command(subcommand)]
    Eval(EvalCommand),
}

#[derive(Subcommand, Debug)]
enum EvalCommand {
    /// Top-1/top-5 of an image classifier on an ImageNet-style folder (timm eval preprocessing).
    Imagenet(cli::vision::ImagenetArgs),
}

fn main() {
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
        Command::Classify(a) => cli::vision::classify_cmd(a),
        Command::Eval(EvalCommand::Imagenet(a)) => cli::vision::imagenet_cmd(a),
    }
}
