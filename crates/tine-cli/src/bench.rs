use crate::output::CliError;
#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand { Fs }
pub fn run(_w: &BenchCommand, _json: bool) -> Result<(), CliError> { Ok(()) }
