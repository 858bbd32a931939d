//! The `memest` command line: a thin front end over the library.

use std::io::{self, IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};

use memest::dtype::DType;
use memest::hf::Head;
use memest::settings::{Amp, AttentionImpl, Device, Mode, Optimizer, Overrides, RecipeName};
use memest::spec::Format;
use memest::units::{UnitSystem, parse_size};

const EXIT_STATUS: &str = "Exit status: 0 = estimate printed (and it fits the --budget), 1 = over the --budget, 2 = bad input or usage.";

/// Estimate the GPU memory of a PyTorch training step or inference pass from a model description.
#[derive(Parser, Debug)]
#[command(version, about, after_help = EXIT_STATUS)]
struct Cli {
    /// Model description (TOML or JSON); `-` reads standard input.
    model: PathBuf,
    /// Micro-batch size.
    #[arg(long, short = 'b', value_parser = clap::value_parser!(u64).range(1..))]
    batch: Option<u64>,
    /// Sequence length for token inputs.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    seq: Option<u64>,
    /// Optimizer whose state is counted.
    #[arg(long, value_enum)]
    optim: Option<Optimizer>,
    /// dtype of parameters and activations (float32, bfloat16, float16, float64, …).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Training step or inference forward pass.
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// How attention is computed.
    #[arg(long, value_enum)]
    attention: Option<AttentionImpl>,
    /// Mixed precision: float32 weights under torch.autocast.
    #[arg(long, value_enum)]
    amp: Option<Amp>,
    /// Precision recipe: the dtypes of weights, gradients, master weights and optimizer state
    /// (fp32, bf16, fp16, amp-bf16, amp-fp16, mixed-bf16, mixed-fp16, mixed-bf16-fp32-grads);
    /// default: what --dtype and --amp imply.
    #[arg(long, value_enum)]
    recipe: Option<RecipeName>,
    /// Activation checkpointing of every repeated block.
    #[arg(long)]
    checkpoint: bool,
    /// Whose kernels' saved tensors to model (the measured reference is cpu).
    #[arg(long, value_enum)]
    device: Option<Device>,
    /// Fail (exit 1) when the estimate exceeds this size, e.g. 24GiB, 80GB, 1073741824.
    #[arg(long, value_parser = parse_budget)]
    budget: Option<u64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    format: OutputFormat,
    /// Print SI units (MB, GB) instead of IEC (MiB, GiB).
    #[arg(long)]
    si: bool,
    /// Also print a per-layer table (output shape, parameters, what each layer keeps).
    #[arg(long)]
    per_layer: bool,
    /// Head on a Hugging Face config.json: `auto` follows its `architectures`; `none` is the bare
    /// model without a loss.
    #[arg(long, value_enum, default_value_t = Head::Auto)]
    head: Head,
    /// Print the model as a memest description (TOML), e.g. translated from a Hugging Face
    /// config.json, and exit.
    #[arg(long)]
    print_model: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OutputFormat {
    Table,
    Json,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
        .map_err(|e: memest::dtype::DTypeParseError| e.to_string())
}

fn parse_budget(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(code) => code,
        Err(err) => {
            if err.chain().any(|c| {
                c.downcast_ref::<io::Error>()
                    .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
            }) {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: &Cli) -> Result<ExitCode> {
    let (src, display, format, name) = if cli.model.as_os_str() == "-" {
        let mut src = String::new();
        if io::stdin().is_terminal() {
            eprintln!("memest: reading the model description from standard input");
        }
        io::stdin()
            .read_to_string(&mut src)
            .context("failed to read standard input")?;
        let format = Format::sniff(&src);
        (src, "<stdin>".to_string(), format, "model".to_string())
    } else {
        let path = &cli.model;
        let src = std::fs::read_to_string(path)
            .with_context(|| format!("failed to read {}", path.display()))?;
        let format = Format::from_extension(path).unwrap_or_else(|| Format::sniff(&src));
        let name = path
            .file_stem()
            .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned());
        (src, path.display().to_string(), format, name)
    };
    let overrides = Overrides {
        batch: cli.batch,
        seq: cli.seq,
        dtype: cli.dtype,
        optimizer: cli.optim,
        mode: cli.mode,
        attention: cli.attention,
        amp: cli.amp,
        checkpoint: cli.checkpoint,
        device: cli.device,
        lora: None,
        quant: None,
        kv_dtype: None,
        recipe: cli.recipe,
    };
    let mut spec = memest::load_spec(&src, format, cli.head)
        .map_err(|e| anyhow::anyhow!("{display}:{}{e}", sep(&e)))?;
    if cli.print_model {
        spec.name.get_or_insert(name);
        let text = toml::to_string_pretty(&spec).context("failed to write the model as TOML")?;
        let mut out = io::stdout().lock();
        write!(out, "{text}")?;
        out.flush()?;
        return Ok(ExitCode::SUCCESS);
    }
    let report = memest::estimate_spec(&spec, &name, &overrides, cli.budget)
        .map_err(|e| anyhow::anyhow!("{display}:{}{e}", sep(&e)))?;
    let units = if cli.si {
        UnitSystem::Si
    } else {
        UnitSystem::Iec
    };
    let mut out = io::stdout().lock();
    match cli.format {
        OutputFormat::Json => {
            let text =
                serde_json::to_string_pretty(&report).context("failed to serialize the report")?;
            writeln!(out, "{text}")?;
        }
        OutputFormat::Table => {
            write!(out, "{}", memest::render::summary(&report, units))?;
            if cli.per_layer {
                write!(out, "{}", memest::render::per_layer(&report, units))?;
            }
        }
    }
    out.flush()?;
    if let Some(b) = report.budget.as_ref().filter(|b| !b.fits) {
        eprintln!(
            "memest: over budget: total {} > budget {} (over by {})",
            memest::units::format_bytes(report.total_bytes, units),
            memest::units::format_bytes(b.budget_bytes, units),
            memest::units::format_bytes(b.overshoot_bytes, units)
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// `file:line:col: msg` for positioned errors, `file: msg` otherwise.
fn sep(e: &memest::Error) -> &'static str {
    match e {
        memest::Error::Spec(s) if s.line.is_some() => "",
        _ => " ",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }
}
