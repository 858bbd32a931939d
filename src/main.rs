//! The `memest` command line: a thin front end over the library.

use std::io::{self, IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};

use memest::dtype::DType;
use memest::hf::Head;
use memest::settings::{
    Amp, AttentionImpl, Device, Lora, Mode, Optimizer, Overrides, Quant, RecipeName,
};
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
    /// dtype of parameters and activations (float32, bfloat16, float16, float64, …), or a
    /// weight quantization of the linear projections (nf4, int8, int4, fp8) with bfloat16 for
    /// everything else.
    #[arg(long, value_parser = parse_dtype_arg)]
    dtype: Option<DtypeArg>,
    /// Weights per group of `--dtype int4` (GPTQ/AWQ group size).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    group_size: u64,
    /// Double quantization of `--dtype nf4`'s absmax scales (bitsandbytes
    /// `bnb_4bit_use_double_quant`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    double_quant: bool,
    /// LoRA: freeze the model and train rank-R adapters on the --lora-targets projections.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    lora_rank: Option<u64>,
    /// Projections that get LoRA adapters: q, k, v, o (attention) and linear-layer names or
    /// suffixes (gate, up, down match *.gate_proj, *.up_proj, *.down_proj).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "q,k,v,o,gate,up,down",
        requires = "lora_rank"
    )]
    lora_targets: Vec<String>,
    /// Inference over N tokens of context: --mode infer with a sequence length of N (the KV cache
    /// of causal attention holds N tokens).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), conflicts_with_all = ["mode", "seq"])]
    context: Option<u64>,
    /// dtype of the inference KV cache (e.g. fp8, bfloat16); default: the activation dtype.
    #[arg(long, value_parser = parse_dtype)]
    kv_dtype: Option<DType>,
    /// With --budget: find the largest micro-batch that fits, and report at it.
    #[arg(long, requires = "budget", conflicts_with = "max_context")]
    max_batch: bool,
    /// With --budget: find the longest context (sequence length) that fits, and report at it.
    #[arg(long, requires = "budget")]
    max_context: bool,
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

/// A `--dtype` value: a float dtype for the whole model, or a weight quantization.
#[derive(Clone, Copy, Debug)]
enum DtypeArg {
    Float(DType),
    Quant(Quant),
}

fn parse_dtype_arg(s: &str) -> Result<DtypeArg, String> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "nf4" => DtypeArg::Quant(Quant::Nf4 { double_quant: true }),
        "int8" => DtypeArg::Quant(Quant::Int8),
        "int4" => DtypeArg::Quant(Quant::Int4 { group_size: 128 }),
        "fp8" => DtypeArg::Quant(Quant::Fp8),
        _ => DtypeArg::Float(parse_dtype(s)?),
    })
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
    let (dtype, quant) = match cli.dtype {
        None => (None, None),
        Some(DtypeArg::Float(d)) => (Some(d), None),
        Some(DtypeArg::Quant(q)) => {
            let q = match q {
                Quant::Nf4 { .. } => Quant::Nf4 {
                    double_quant: cli.double_quant,
                },
                Quant::Int4 { .. } => Quant::Int4 {
                    group_size: cli.group_size,
                },
                other => other,
            };
            (Some(DType::Bfloat16), Some(q))
        }
    };
    let overrides = Overrides {
        batch: cli.batch,
        seq: cli.context.or(cli.seq),
        dtype,
        optimizer: cli.optim,
        mode: if cli.context.is_some() {
            Some(Mode::Infer)
        } else {
            cli.mode
        },
        attention: cli.attention,
        amp: cli.amp,
        checkpoint: cli.checkpoint,
        device: cli.device,
        lora: cli.lora_rank.map(|rank| Lora {
            rank,
            targets: cli.lora_targets.clone(),
        }),
        quant,
        kv_dtype: cli.kv_dtype,
        recipe: cli.recipe,
    };
    let mut spec = memest::load_spec(&src, format, cli.head)
        .map_err(|e| anyhow::anyhow!("{display}:{}{e}", sep(&e)))?;
    if cli.print_model {
        spec.name.get_or_insert(name);
        let text =
            memest::print_model::to_toml(&spec).map_err(|e| anyhow::anyhow!("{display}: {e}"))?;
        let mut out = io::stdout().lock();
        write!(out, "{text}")?;
        out.flush()?;
        return Ok(ExitCode::SUCCESS);
    }
    if (cli.seq.is_some() || cli.context.is_some())
        && !spec.input.shape.contains(&memest::spec::DimSpec::Seq)
    {
        eprintln!(
            "warning: --seq/--context set no length: the input of {display} has no \"seq\" dimension"
        );
    }
    let quant_flags =
        std::env::args().any(|a| a.starts_with("--group-size") || a.starts_with("--double-quant"));
    if quant_flags && quant.is_none() {
        eprintln!("warning: --group-size and --double-quant apply only to --dtype int4 and nf4");
    }
    let mut report = memest::estimate_spec(&spec, &name, &overrides, cli.budget)
        .map_err(|e| anyhow::anyhow!("{display}:{}{e}", sep(&e)))?;
    let mut found = None;
    if let (Some(budget), true) = (cli.budget, cli.max_batch || cli.max_context) {
        use memest::search::Dimension;
        let (dim, start) = if cli.max_batch {
            (Dimension::Batch, report.settings.batch)
        } else {
            let seq = report.settings.seq.ok_or_else(|| {
                anyhow::anyhow!(
                    "{display}: --max-context needs a model with a \"seq\" input dimension"
                )
            })?;
            (Dimension::Context, seq)
        };
        let what = dim.name();
        match memest::search::max_fitting(&spec, &name, &overrides, budget, dim, start) {
            Some((v, r)) => {
                report = r;
                found = Some((what, v));
            }
            None => found = Some((what, 0)),
        }
    }
    if cli.checkpoint
        && !report
            .layers
            .iter()
            .any(|l| l.kind == "repeat" || l.kind == "block")
    {
        eprintln!(
            "warning: --checkpoint has no effect: {display} has no repeated blocks to checkpoint"
        );
    }
    let units = if cli.si {
        UnitSystem::Si
    } else {
        UnitSystem::Iec
    };
    let mut out = io::stdout().lock();
    match cli.format {
        OutputFormat::Json => {
            let mut value =
                serde_json::to_value(&report).context("failed to serialize the report")?;
            if let (Some((what, v)), Some(map)) = (found, value.as_object_mut()) {
                map.insert(format!("max_{what}"), serde_json::Value::from(v));
            }
            let text =
                serde_json::to_string_pretty(&value).context("failed to serialize the report")?;
            writeln!(out, "{text}")?;
        }
        OutputFormat::Table => {
            if let Some((what, v)) = found {
                let budget = memest::units::format_bytes(cli.budget.unwrap_or(0), units);
                if v == 0 {
                    writeln!(
                        out,
                        "largest {what} that fits {budget}: none (the estimate below is at the size asked for)"
                    )?;
                } else {
                    writeln!(out, "largest {what} that fits {budget}: {v}")?;
                }
            }
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
