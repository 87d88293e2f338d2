//! Output to stdout that a closed pipe cannot turn into a panic. `println!`
//! panics when the reader has gone (`tokenformer zoo list | head -1`); these
//! macros return the error instead, and [`is_closed_pipe`] lets `main` end
//! quietly on it, as other command-line tools do. Shared by both binaries
//! (`tokenformer-convert` includes this file).

/// `println!` that returns the write's `io::Result`.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($t)*)
    }};
}

/// `print!` that returns the write's `io::Result`.
#[allow(unused_macros)] // only `tokenformer-convert` prints without a newline
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout(), $($t)*)
    }};
}

#[allow(unused_imports)] // each binary uses what it prints with
pub(crate) use {out, outln};

/// Whether `e` (or what caused it) is a write to a pipe whose reader has gone.
pub fn is_closed_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The exit status of a process a closed pipe ended (128 + SIGPIPE), as a
/// shell reports it for the tools the signal kills.
pub const CLOSED_PIPE_STATUS: i32 = 141;
