//! Shell completions and the help-text check, shared by both binaries
//! (`tokenformer-convert` includes this file).

use clap::{Args, CommandFactory};
use clap_complete::Shell;

/// `completions SHELL`: the completion script on stdout.
#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// bash, zsh, fish, powershell or elvish. E.g. `tokenformer completions bash >
    /// ~/.local/share/bash-completion/completions/tokenformer`.
    #[arg(value_enum)]
    pub shell: Shell,
}

/// Writes the completion script of `C` for `a.shell` to stdout (made in
/// memory first: clap_complete panics on a failed write, such as `| head`).
pub fn print<C: CommandFactory>(a: &CompletionsArgs) -> anyhow::Result<()> {
    use std::io::Write;
    let mut cmd = C::command();
    let name = cmd.get_name().to_string();
    let mut script = Vec::new();
    clap_complete::generate(a.shell, &mut cmd, name, &mut script);
    std::io::stdout().write_all(&script)?;
    Ok(())
}

/// `command path --flag` of every argument (flags and positionals) without
/// help text, in the whole command tree.
#[cfg(test)]
pub fn undocumented(cmd: &clap::Command) -> Vec<String> {
    fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        let path = format!("{path} {}", cmd.get_name()).trim().to_string();
        for arg in cmd.get_arguments() {
            let builtin = matches!(arg.get_id().as_str(), "help" | "version");
            if !builtin && arg.get_help().is_none() && arg.get_long_help().is_none() {
                let name = arg
                    .get_long()
                    .map(|l| format!("--{l}"))
                    .unwrap_or_else(|| arg.get_id().to_string());
                out.push(format!("{path} {name}"));
            }
        }
        for sub in cmd.get_subcommands() {
            if sub.get_about().is_none() && sub.get_name() != "help" {
                out.push(format!("{path} {} (no about)", sub.get_name()));
            }
            walk(sub, &path, out);
        }
    }
    let mut out = Vec::new();
    walk(cmd, "", &mut out);
    out
}
