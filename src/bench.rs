//! `te bench`: throughput and latency over loopback or against a `te serve`.

/// Options of `te bench`.
#[derive(clap::Args, Debug)]
pub(crate) struct BenchArgs {}

pub(crate) fn run(_args: BenchArgs) -> te::Result<()> {
    Err(te::Error::new(
        te::ErrorKind::Unsupported,
        "te bench is not built yet",
    ))
}
