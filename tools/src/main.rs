//! The `cachealloc` command line; see the `cachealloc_tools` library for what it does.

use std::io::Write;
use std::process::ExitCode;

use cachealloc_tools::{Error, commands};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "cachealloc",
    version,
    about = "Inspect cachealloc traces of GPU memory, offline."
)]
struct Cli {
    #[command(subcommand)]
    command: commands::Command,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = commands::run(cli.command, &mut out).and_then(|code| {
        out.flush()?;
        Ok(code)
    });
    match result {
        Ok(code) => code,
        Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(Error::Io(e)) => {
            eprintln!("cachealloc: {e}");
            ExitCode::FAILURE
        }
        Err(Error::Message(m)) => {
            eprintln!("cachealloc: {m}");
            ExitCode::FAILURE
        }
    }
}
