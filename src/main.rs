//! The `tokenformer` command: run, score, evaluate and inspect TokenFormer
//! models (<https://arxiv.org/abs/2410.23168>).

mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOC: tokenformer::alloc::HugePages = tokenformer::alloc::HugePages;

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
    /// Serve a language model over the OpenAI completions API (continuous batching across requests).
    Serve(cli::serve::ServeArgs),
    /// List the tensors, architecture and parameter count of a checkpoint.
    Inspect(cli::inspect::InspectArgs),
    /// Throughput on random weights of the real sizes (compare with the PyTorch peer).
    Bench(cli::bench::BenchArgs),
    /// The model registry.
    #[command(subcommand)]
    Zoo(cli::zoo::ZooCommand),
    /// The most likely classes of images or folders of images, with their probabilities.
    Classify(cli::vision::ClassifyArgs),
    /// Image embeddings (the pooled feature a classifier's head reads) into a safetensors file.
    Embed(cli::vision::EmbedArgs),
    /// Train a language model, classifier or vision-language model (from a checkpoint or fresh weights).
    Train(cli::train::TrainArgs),
    /// Evaluate: Pile perplexity, zero-shot tasks, ImageNet, merging shard results.
    #[command(subcommand)]
    Eval(EvalCommand),
    /// Print a shell completion script (bash, zsh, fish, powershell, elvish).
    Completions(cli::shell::CompletionsArgs),
}

#[derive(Subcommand, Debug)]
enum EvalCommand {
    /// Top-1/top-5 of an image classifier on an ImageNet-style folder (timm eval preprocessing).
    Imagenet(cli::vision::ImagenetArgs),
    /// Perplexity of documents (the Pile's val/test.jsonl.zst, .jsonl, .txt), overall and per subset.
    Pile(cli::eval_lm::PileArgs),
    /// Zero-shot accuracy on lambada, hellaswag, piqa, arc_easy, arc_challenge or winogrande.
    Tasks(cli::eval_lm::TasksArgs),
    /// Combine the --json results of --shard runs into those of one whole run.
    Merge(cli::eval_lm::MergeArgs),
}

fn main() {
    quiet_backtraces();
    tokenformer::alloc::keep_freed_memory();
    let cli = Cli::parse();
    // A TOKENFORMER_KERNELS request this CPU cannot honour (the library only returns it).
    if let Some(w) = &tokenformer::kernels::selection().warning {
        eprintln!("warning: {w}");
    }
    if let Err(e) = run(cli) {
        if cli::stdout::is_closed_pipe(&e) {
            std::process::exit(cli::stdout::CLOSED_PIPE_STATUS);
        }
        eprintln!("error: {}", cli::describe(&e));
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(a) => cli::lm::generate_cmd(a),
        Command::Score(a) => cli::lm::score_cmd(a),
        Command::Serve(a) => cli::serve::serve_cmd(a),
        Command::Inspect(a) => cli::inspect::run(a),
        Command::Zoo(c) => cli::zoo::run(c),
        Command::Bench(a) => cli::bench::run(a),
        Command::Classify(a) => cli::vision::classify_cmd(a),
        Command::Embed(a) => cli::vision::embed_cmd(a),
        Command::Train(a) => cli::train::run(a),
        Command::Eval(EvalCommand::Imagenet(a)) => cli::vision::imagenet_cmd(a),
        Command::Eval(EvalCommand::Pile(a)) => cli::eval_lm::pile_cmd(a),
        Command::Eval(EvalCommand::Tasks(a)) => cli::eval_lm::tasks_cmd(a),
        Command::Eval(EvalCommand::Merge(a)) => cli::eval_lm::merge_cmd(a),
        Command::Completions(a) => cli::shell::print::<Cli>(&a),
    }
}

/// candle attaches a backtrace to its errors when RUST_BACKTRACE is set; a
/// command-line user wants the message, so keep them only on request.
fn quiet_backtraces() {
    if std::env::var_os("TOKENFORMER_BACKTRACE").is_none() {
        std::env::set_var("RUST_BACKTRACE", "0");
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn every_flag_and_command_has_help() {
        let cmd = super::Cli::command();
        cmd.clone().debug_assert();
        assert_eq!(super::cli::shell::undocumented(&cmd), Vec::<String>::new());
    }

    /// A doc comment cannot name a constant: the default it spells out is checked here.
    #[test]
    fn the_batch_size_help_gives_the_librarys_default() {
        let cmd = super::Cli::command();
        let generate = cmd.find_subcommand("generate").expect("generate");
        let arg = generate
            .get_arguments()
            .find(|a| a.get_id() == "batch_size")
            .expect("--batch-size");
        let help = arg.get_help().expect("help").to_string();
        let default = tokenformer::generate::DEFAULT_BATCH_SIZE;
        assert!(help.contains(&format!("(default {default})")), "{help}");
    }
}
