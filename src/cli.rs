//! The command line: clap's flags and their translation into a typed [`Request`].

use std::io::{self, IsTerminal, Read};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};

use memest::Query;
use memest::cost::{Amp, Optimizer, OptimizerImpl, Quant, RecipeName};
use memest::dtype::DType;
use memest::gpu::Gpu;
use memest::hf::Head;
use memest::report::Dimension;
use memest::settings::{Lora, Loss, Overrides};
use memest::spec::Format;
use memest::sweep::Sweep;
use memest::units::{UnitSystem, parse_size};
use memest::vocab::{AttentionImpl, BudgetOn, Device, Mode, VocabParser};

const EXIT_STATUS: &str = "`memest gpus` lists the GPUs --gpu knows.\n\nExit status: 0 = estimate printed (and it fits the --budget), 1 = over the --budget, 2 = bad input or usage.";

/// Estimate the GPU memory of a PyTorch training step or inference pass from a model description.
#[derive(Parser, Debug)]
#[command(name = "memest", version, about, after_help = EXIT_STATUS)]
#[command(group(clap::ArgGroup::new("budget_source").args(["budget", "gpu"]).multiple(true)))]
pub struct Cli {
    /// Model description (TOML or JSON); `-` reads standard input.
    model: PathBuf,
    /// Micro-batch size.
    #[arg(long, short = 'b', value_parser = parse_positive)]
    batch: Option<u64>,
    /// Sequence length for token inputs.
    #[arg(long, value_parser = parse_positive)]
    seq: Option<u64>,
    /// Target sequence length: the length of an encoder-decoder's second input (a model
    /// input dimension "target_seq", e.g. a seq2seq file's decoder ids; imported T5 and
    /// Whisper configs read their decoder ids with --seq).
    #[arg(long, value_parser = parse_positive)]
    target_seq: Option<u64>,
    /// Optimizer whose state is counted.
    #[arg(long, value_parser = VocabParser::<Optimizer>::new())]
    optim: Option<Optimizer>,
    /// How a torch.optim optimizer loops over its tensors (its `foreach` and `fused`
    /// arguments); default: foreach.
    #[arg(long, value_parser = VocabParser::<OptimizerImpl>::new())]
    optim_impl: Option<OptimizerImpl>,
    /// dtype of parameters and activations (float32, bfloat16, float16, float64, …), or a
    /// weight quantization of the linear projections (nf4, int8, int4, fp8) with bfloat16 for
    /// everything else.
    #[arg(long, value_parser = parse_dtype_arg)]
    dtype: Option<DtypeArg>,
    /// Weights per group of `--dtype int4` (GPTQ/AWQ group size) [default: 128]
    #[arg(
        long,
        value_parser = parse_positive,
        long_help = "Weights per group of `--dtype int4` (GPTQ/AWQ group size)\n\n[default: 128]"
    )]
    group_size: Option<u64>,
    /// Double quantization of `--dtype nf4`'s absmax scales (bitsandbytes
    /// `bnb_4bit_use_double_quant`) [default: true] [possible values: true, false]
    #[arg(
        long,
        action = clap::ArgAction::Set,
        hide_possible_values = true,
        long_help = "Double quantization of `--dtype nf4`'s absmax scales (bitsandbytes `bnb_4bit_use_double_quant`)\n\n[default: true]\n[possible values: true, false]"
    )]
    double_quant: Option<bool>,
    /// LoRA: freeze the model and train rank-R adapters on the --lora-targets projections.
    #[arg(long, value_parser = parse_positive)]
    lora_rank: Option<u64>,
    /// dtype of the LoRA adapters [default: float32 beside a 16-bit base (PEFT); bfloat16 with
    /// --qlora-stack torchtune|litgpt]
    #[arg(long, value_parser = parse_dtype, requires = "lora_rank")]
    lora_dtype: Option<DType>,
    /// LoRA dropout on each adapter's input (PEFT's lora_dropout; it keeps its mask) [default: 0]
    #[arg(long, value_name = "P", value_parser = parse_probability, requires = "lora_rank")]
    lora_dropout: Option<f64>,
    /// The QLoRA stack whose choices to follow: peft, trl, torchtune or litgpt (which
    /// projections are quantized, the dtype of the weights it does not quantize).
    #[arg(long, value_enum, value_name = "STACK")]
    qlora_stack: Option<memest::settings::QloraStack>,
    /// Projections that get LoRA adapters: q, k, v, o (attention) and linear-layer names or
    /// suffixes, in memest's or PEFT's spelling (gate or gate_proj match *.gate_proj; q_proj is
    /// q). A given entry that matches nothing is an error [default: those of
    /// q,k,v,o,gate,up,down the model has]
    #[arg(long, value_delimiter = ',', requires = "lora_rank")]
    lora_targets: Option<Vec<String>>,
    /// Inference over N tokens of context: --mode infer with a sequence length of N (the KV cache
    /// of causal attention holds N tokens). --mode infer and --seq N agree with it.
    #[arg(long, value_parser = parse_positive)]
    context: Option<u64>,
    /// Text generation (`model.generate`) from a prompt of N tokens: --mode generate with a
    /// sequence length of N. --mode generate and --seq N agree with it.
    #[arg(long, value_parser = parse_positive)]
    prompt: Option<u64>,
    /// Tokens `generate` produces after the prompt (--mode generate; implies it).
    #[arg(long, value_parser = parse_positive)]
    new_tokens: Option<u64>,
    /// How the loss is computed: ce (the model's own loss layer), none (no loss: the step ends
    /// at the model's output), chunked-ce[:N] (torchtune's chunked cross-entropy: the LM head
    /// and the loss in N pieces along the sequence, default 8) [default: ce]
    #[arg(long, value_parser = parse_loss)]
    loss: Option<Loss>,
    /// dtype of the inference KV cache (e.g. fp8, bfloat16); default: the activation dtype.
    #[arg(long, value_parser = parse_dtype)]
    kv_dtype: Option<DType>,
    /// With --budget (or --gpu): find the largest micro-batch that fits, and report at it.
    #[arg(long, requires = "budget_source", conflicts_with = "max_context")]
    max_batch: bool,
    /// With --budget (or --gpu): find the longest context (sequence length) that fits, and
    /// report at it; it stops at the model's max_position_embeddings unless
    /// --allow-long-context.
    #[arg(long, requires = "budget_source")]
    max_context: bool,
    /// A sequence past the model's max_position_embeddings neither warns nor stops
    /// --max-context (for long-context fine-tuning or RoPE scaling).
    #[arg(long)]
    allow_long_context: bool,
    /// Training step or inference forward pass.
    #[arg(long, value_parser = VocabParser::<Mode>::new())]
    mode: Option<Mode>,
    /// How attention is computed.
    #[arg(long, value_parser = VocabParser::<AttentionImpl>::new())]
    attention: Option<AttentionImpl>,
    /// Mixed precision: float32 weights under torch.autocast.
    #[arg(long, value_parser = VocabParser::<Amp>::new())]
    amp: Option<Amp>,
    /// Precision recipe: the dtypes of weights, gradients, master weights and optimizer state
    /// (fp32, bf16, fp16, amp-bf16, amp-fp16, mixed-bf16, mixed-fp16, mixed-bf16-fp32-grads);
    /// default: what --dtype and --amp imply.
    #[arg(long, value_parser = VocabParser::<RecipeName>::new())]
    recipe: Option<RecipeName>,
    /// Activation checkpointing of every repeated block.
    #[arg(long)]
    checkpoint: bool,
    /// Selective activation recomputation (Megatron-LM's --recompute-granularity selective):
    /// each attention's core (QKᵀ, softmax, dropout, attention over values) is recomputed in
    /// backward instead of kept.
    #[arg(long)]
    selective_recompute: bool,
    /// Gradient accumulation: N micro-batches of --batch per optimizer step; gradients persist
    /// from one micro-batch to the next [default: 1]
    #[arg(long, value_name = "N", value_parser = parse_positive)]
    grad_accum: Option<u64>,
    /// Apply the optimizer inside backward (torchtune's optimizer_in_bwd): each parameter is
    /// updated and its gradient freed as soon as the gradient is ready.
    #[arg(long)]
    optim_in_backward: bool,
    /// bitsandbytes' paged optimizer (PagedAdamW, PagedAdamW8bit, PagedLion): its state lives
    /// in CUDA unified memory, outside PyTorch's allocator; shown on its own line, not in the peak.
    #[arg(long)]
    paged: bool,
    /// Keep an EMA copy of the weights, in their own dtype (`weights`) or in float32.
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "weights", value_name = "PRECISION")]
    ema: Option<memest::settings::EmaPrecision>,
    /// Whose kernels' saved tensors to model: cuda (default, alias gpu) or cpu (a CPU run).
    #[arg(long, value_parser = VocabParser::<Device>::new())]
    device: Option<Device>,
    /// Model the CUDA caching allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True:
    /// segments grow by 2 MiB (small pool) and 20 MiB (large pool) pages instead of one
    /// cudaMalloc per segment.
    #[arg(long)]
    expandable_segments: bool,
    /// Gradients stay allocated between steps, zeroed in place: zero_grad(set_to_none=False),
    /// PyTorch's default before 2.0 (HF Trainer's model.zero_grad() until then); each backward
    /// adds into them.
    #[arg(long)]
    keep_grads: bool,
    /// Fail (exit 1) when the estimate exceeds this size, e.g. 24GiB, 24G, 80GB, 1073741824 (G and
    /// GiB are 2^30 bytes, GB 10^9; any case).
    #[arg(long, value_parser = parse_budget)]
    budget: Option<u64>,
    /// The GPU (`memest gpus` lists them): its compute capability chooses the kernels (which
    /// fused attention runs), its total memory is the budget unless --budget is given.
    #[arg(long, value_name = "NAME", value_parser = parse_gpu)]
    gpu: Option<&'static Gpu>,
    /// Which figure the budget checks on a GPU: device (what nvidia-smi shows: reserved +
    /// CUDA context + cuBLAS workspaces; default), reserved (max_memory_reserved) or
    /// allocated (max_memory_allocated).
    #[arg(long, value_parser = VocabParser::<BudgetOn>::new())]
    budget_on: Option<BudgetOn>,
    /// Size of the CUDA context and PyTorch's loaded kernels, e.g. 500MiB [default: 426MiB,
    /// measured with lazy module loading]
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    cuda_context: Option<u64>,
    /// cuDNN's workspace per convolution call, e.g. 256MiB (the cap CUDNN_CONV_WSCAP_DBG sets):
    /// each convolution's forward and its two backward convolutions take one from the caching
    /// allocator and free it after, as PyTorch's cuDNN convolutions do [default: not counted;
    /// their size depends on the engine cuDNN picks]
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    cudnn_workspace: Option<u64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    format: OutputFormat,
    /// Print SI units (MB, GB) instead of IEC (MiB, GiB).
    #[arg(long)]
    si: bool,
    /// Also print a per-layer table (output shape, parameters, what each layer keeps).
    #[arg(long)]
    per_layer: bool,
    /// One estimate per value of the micro-batch or sequence length: batch=1,2,4,8, batch=1..64
    /// (doubling), seq=128..1024:128 (stepping); at most 64 values. One row per value in every
    /// format.
    #[arg(
        long,
        value_name = "DIM=VALUES",
        value_parser = parse_sweep,
        conflicts_with_all = ["max_batch", "max_context", "per_layer", "explain", "timeline"]
    )]
    sweep: Option<Sweep>,
    /// Also list the ten largest tensors live at the peak: the layer and ATen operator that
    /// made each, its shape, dtype, size and category (JSON: `explain`).
    #[arg(long)]
    explain: bool,
    /// Write the simulated step to PATH as an SVG chart: live memory over time, stacked by
    /// category, with the phases and the peak marked.
    #[arg(long, value_name = "PATH")]
    timeline: Option<PathBuf>,
    /// Head on a Hugging Face config.json: `auto` follows its `architectures`; `none` is the bare
    /// model without a loss.
    #[arg(long, value_enum, default_value_t = Head::Auto)]
    head: Head,
    /// Image size in pixels: 512 or HEIGHTxWIDTH (1024x768). A diffusers UNet config reads the
    /// VAE's latent of it, [channels, H/8, W/8], a multiple of 8 (default: the config's
    /// sample_size · 8); a vision or multimodal transformers config (ViT, CLIP, LLaVA, …) reads
    /// its image_size and checks this against it; DINOv2 reads any size, its position table
    /// interpolated to the image's patches.
    #[arg(long, value_name = "SIZE")]
    image: Option<memest::hf::ImageSize>,
    /// Print the model as a memest description (TOML), e.g. translated from a Hugging Face
    /// config.json, and exit (no estimate: the estimate, output and budget flags are refused with
    /// it).
    #[arg(
        long,
        conflicts_with_all = [
            "batch", "seq", "optim", "optim_impl", "dtype", "group_size", "double_quant",
            "lora_rank", "lora_targets", "context", "prompt", "new_tokens", "loss", "kv_dtype", "max_batch", "max_context",
            "allow_long_context", "mode", "attention", "amp", "recipe", "checkpoint", "device",
            "expandable_segments", "keep_grads", "format", "budget", "si", "per_layer", "sweep", "explain", "timeline",
            "grad_accum", "optim_in_backward", "paged", "ema", "lora_dtype", "lora_dropout",
            "qlora_stack",
            "gpu", "budget_on", "cuda_context", "cudnn_workspace",
        ]
    )]
    print_model: bool,
    /// GPUs in all, for data parallelism: every figure is then per GPU (the worst rank). Alone
    /// it means DDP; with --zero or --fsdp, those shard the model states.
    #[arg(long, value_parser = parse_positive, help_heading = "Several GPUs")]
    gpus: Option<u64>,
    /// PyTorch DistributedDataParallel (the default with --gpus): every GPU holds the whole
    /// model, gradients are all-reduced through buckets.
    #[arg(long, conflicts_with_all = ["zero", "fsdp"], help_heading = "Several GPUs")]
    ddp: bool,
    /// DeepSpeed ZeRO stage: 1 shards the optimizer state (and keeps float32 master
    /// partitions), 2 also the gradients, 3 also the parameters.
    #[arg(
        long,
        value_name = "STAGE",
        conflicts_with = "fsdp",
        help_heading = "Several GPUs"
    )]
    zero: Option<u8>,
    /// PyTorch FSDP (fully_shard) sharding strategy.
    #[arg(
        long,
        value_enum,
        value_name = "STRATEGY",
        help_heading = "Several GPUs"
    )]
    fsdp: Option<memest::parallel::FsdpStrategy>,
    /// DDP's bucket_cap_mb (MiB; default 25).
    #[arg(long, value_name = "MIB", help_heading = "Several GPUs")]
    bucket_cap_mb: Option<f64>,
    /// DDP's gradient_as_bucket_view: gradients are views into the buckets (no second copy).
    #[arg(long, help_heading = "Several GPUs")]
    gradient_as_bucket_view: bool,
    /// GPUs per node: the shard group of --fsdp hybrid-shard (default 8).
    #[arg(long, value_parser = parse_positive, help_heading = "Several GPUs")]
    gpus_per_node: Option<u64>,
    /// FSDP2's MixedPrecisionPolicy reduce_dtype: the dtype gradients are reduce-scattered in
    /// (default: the parameters' own dtype, float32 under --recipe mixed-bf16). Needs --fsdp.
    #[arg(long, value_enum, value_name = "DTYPE", help_heading = "Several GPUs")]
    reduce_dtype: Option<memest::parallel::ReduceDtype>,
    /// DeepSpeed's reduce_bucket_size, in elements (default 500000000).
    #[arg(long, value_parser = parse_positive, value_name = "ELEMENTS", help_heading = "Several GPUs")]
    reduce_bucket_size: Option<u64>,
    /// Read a DeepSpeed config (ZeRO stage and buckets, offload, bf16/fp16, micro-batch,
    /// accumulation); the flags override it. Keys memest does not model are named.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "accelerate",
        help_heading = "Several GPUs"
    )]
    deepspeed: Option<PathBuf>,
    /// Read an accelerate config (FSDP or DeepSpeed plugin, num_processes, mixed_precision);
    /// the flags override it.
    #[arg(long, value_name = "FILE", help_heading = "Several GPUs")]
    accelerate: Option<PathBuf>,
    /// Keep state in CPU memory (ZeRO-Offload, ZeRO-3 parameter offload, FSDP CPU offload):
    /// the GPU no longer holds it; the CPU figure is reported.
    #[arg(long, value_enum, value_name = "WHAT", help_heading = "Several GPUs")]
    offload: Option<memest::parallel::OffloadFlag>,
    /// How many GPUs of the --gpu's (or --budget's) size the plan needs: the fewest that fit.
    #[arg(long, help_heading = "Several GPUs", conflicts_with_all = ["max_batch", "max_context", "sweep", "plan"])]
    min_gpus: bool,
    /// `auto`: list the plans (DDP, ZeRO-1/2/3, FSDP, with and without offload) on --gpus N,
    /// cheapest in memory first, and whether each fits the --budget/--gpu (a table or JSON).
    #[arg(long, value_name = "auto", value_parser = ["auto"], help_heading = "Several GPUs", conflicts_with_all = ["max_batch", "max_context", "sweep", "per_layer", "explain", "timeline"])]
    plan: Option<String>,
    /// Tensor-parallel degree (Megatron-style column/row splits of attention heads and MLP,
    /// vocab-parallel embedding and LM head); data parallel = gpus / (tp · pp · cp). Without
    /// --gpus, the plan spans tp · cp GPUs.
    #[arg(long, value_parser = parse_positive, value_name = "T", help_heading = "Several GPUs")]
    tp: Option<u64>,
    /// Sequence parallel with --tp: norms, dropout and residual adds hold seq / tp positions.
    #[arg(long, help_heading = "Several GPUs")]
    sp: bool,
    /// Context-parallel degree: each rank holds seq / cp positions; ring attention passes
    /// key/value chunks between ranks.
    #[arg(long, value_parser = parse_positive, value_name = "C", help_heading = "Several GPUs")]
    cp: Option<u64>,
    /// Whose tensor parallelism: PyTorch DTensor (default) or Megatron-LM.
    #[arg(long, value_enum, value_name = "STYLE", help_heading = "Several GPUs")]
    tp_style: Option<memest::parallel::TpStyle>,
    /// Pipeline-parallel stages: the repeated blocks split evenly across P GPUs (embeddings on
    /// the first stage, head and loss on the last); figures are the worst stage's.
    #[arg(long, value_parser = parse_positive, value_name = "P", help_heading = "Several GPUs")]
    pp: Option<u64>,
    /// The pipeline schedule (default 1f1b).
    #[arg(long, value_enum, requires = "pp", help_heading = "Several GPUs")]
    schedule: Option<memest::parallel::Schedule>,
    /// Micro-batches per step, each of --batch samples (default: --pp).
    #[arg(long, value_parser = parse_positive, value_name = "M", requires = "pp", help_heading = "Several GPUs")]
    micro_batches: Option<u64>,
    /// Model chunks per GPU of the interleaved schedule (default 2).
    #[arg(long, value_parser = parse_positive, value_name = "V", requires = "pp", help_heading = "Several GPUs")]
    virtual_stages: Option<u64>,
    /// Expert-parallel ranks: each mixture-of-experts layer's experts divided across E GPUs.
    #[arg(long, value_parser = parse_positive, value_name = "E", help_heading = "Several GPUs")]
    ep: Option<u64>,
    /// Expert capacity factor under --ep (default: dropless).
    #[arg(
        long,
        value_name = "FACTOR",
        requires = "ep",
        help_heading = "Several GPUs"
    )]
    capacity_factor: Option<f64>,
}

/// How the report is printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[allow(missing_docs)] // the comments below are plain: clap would list doc comments in `--help`
pub enum OutputFormat {
    // Tables for people. (No doc comments here: clap would list them in `--help`.)
    Table,
    // One JSON object, described by `schema/report.schema.json`.
    Json,
    // GitHub-flavoured markdown (a pull-request comment).
    Markdown,
    // A header row and one row per estimate.
    Csv,
}

/// A `--dtype` value: a float dtype for the whole model, or a weight quantization.
#[derive(Clone, Copy, Debug)]
enum DtypeArg {
    Float(DType),
    Quant(Quant),
}

fn parse_dtype_arg(s: &str) -> Result<DtypeArg, String> {
    match s.parse::<Quant>() {
        Ok(q) => Ok(DtypeArg::Quant(q)),
        Err(_) => parse_dtype(s).map(DtypeArg::Float),
    }
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
        .map_err(|e: memest::dtype::DTypeParseError| e.to_string())
}

fn parse_loss(s: &str) -> Result<Loss, String> {
    s.parse()
}

fn parse_sweep(s: &str) -> Result<Sweep, String> {
    s.parse()
        .map_err(|e: memest::sweep::SweepError| e.to_string())
}

/// A count of at least 1 (`--batch`, `--seq`, …), with a message in plain words.
fn parse_positive(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err("expected a whole number of at least 1, got 0".into()),
        Ok(n) => Ok(n),
        Err(_) if !s.trim().is_empty() && s.trim().bytes().all(|b| b.is_ascii_digit()) => Err(
            format!("expected a whole number of at least 1, got {s}, which is too large"),
        ),
        Err(_) => Err(format!("expected a whole number of at least 1, got `{s}`")),
    }
}

/// A probability in [0, 1) (`--lora-dropout`).
fn parse_probability(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(p) if (0.0..1.0).contains(&p) => Ok(p),
        _ => Err(format!(
            "expected a probability from 0 up to (not including) 1, got `{s}`"
        )),
    }
}

fn parse_budget(s: &str) -> Result<u64, String> {
    match parse_size(s).map_err(|e| e.to_string())? {
        0 => Err(format!(
            "a budget must be positive: `{s}` is 0 bytes (give the memory one GPU has, e.g. 24GiB)"
        )),
        n => Ok(n),
    }
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn parse_gpu(s: &str) -> Result<&'static Gpu, String> {
    memest::gpu::find(s)
}

/// `memest gpus`: the GPUs `--gpu` knows.
#[derive(Parser, Debug)]
#[command(
    name = "memest gpus",
    about = "List the GPUs --gpu knows: total memory as the driver reports it, compute capability, sources."
)]
pub struct GpusCli {
    /// Output format.
    #[arg(long, value_enum, default_value_t = GpusFormat::Table)]
    pub format: GpusFormat,
    /// Print SI units (MB, GB) instead of IEC (MiB, GiB).
    #[arg(long)]
    pub si: bool,
}

/// How `memest gpus` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GpusFormat {
    /// A table for people.
    Table,
    /// A JSON array, one object per GPU.
    Json,
}

/// Where the model description comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InputSource {
    /// Standard input (`-`).
    Stdin,
    /// A file.
    Path(PathBuf),
}

/// A model description read into memory.
#[derive(Clone, Debug)]
pub struct Input {
    /// The text.
    pub src: String,
    /// How errors and warnings name it: the path, or `<stdin>`.
    pub origin: String,
    /// Its syntax: from the extension, else sniffed.
    pub format: Format,
    /// The model's name when the file gives none: the file stem, or `model`.
    pub name: String,
}

impl InputSource {
    /// Reads the description.
    ///
    /// # Errors
    /// When the file or standard input cannot be read.
    pub fn read(&self) -> Result<Input> {
        match self {
            InputSource::Stdin => {
                if io::stdin().is_terminal() {
                    eprintln!("memest: reading the model description from standard input");
                }
                let src = read_bounded(io::stdin().lock(), "standard input")?;
                let format = Format::sniff(&src);
                Ok(Input {
                    src,
                    origin: "<stdin>".into(),
                    format,
                    name: "model".into(),
                })
            }
            InputSource::Path(path) => {
                let what = path.display().to_string();
                let file =
                    std::fs::File::open(path).with_context(|| format!("failed to read {what}"))?;
                let src = read_bounded(file, &what)?;
                let format = Format::from_extension(path).unwrap_or_else(|| Format::sniff(&src));
                let name = model_name(path, &src);
                Ok(Input {
                    src,
                    origin: path.display().to_string(),
                    format,
                    name,
                })
            }
        }
    }
}

/// The model's name when the file gives none: the file name without its extension, except for a
/// downloaded `config.json`, named by its `_name_or_path` ([`memest::hf::name_or_path`]) or its
/// folder (`models--org--name/snapshots/<hash>/config.json` in the Hugging Face cache is
/// `org/name`).
fn model_name(path: &Path, src: &str) -> String {
    let stem = path
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    if stem != "config" {
        return stem;
    }
    if let Some(name) = memest::hf::name_or_path(src) {
        return name;
    }
    let folders: Vec<String> = std::path::absolute(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .ancestors()
        .skip(1)
        .take(3)
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    match folders.as_slice() {
        [_, snapshots, repo, ..] if snapshots == "snapshots" && repo.starts_with("models--") => {
            repo["models--".len()..].replace("--", "/")
        }
        [folder, ..] => folder.clone(),
        [] => stem,
    }
}

/// Reads at most [`memest::MAX_INPUT_BYTES`] bytes of UTF-8 text from `reader` (`what` names it
/// in errors): a larger input is refused after reading one byte past the limit, so that
/// `/dev/zero` or an endless pipe cannot exhaust memory or run forever.
///
/// # Errors
/// When reading fails, the input is over the limit, or it is not UTF-8.
fn read_bounded(reader: impl Read, what: &str) -> Result<String> {
    let limit = memest::MAX_INPUT_BYTES;
    let mut bytes = Vec::new();
    reader
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("failed to read {what}"))?;
    if bytes.len() as u64 > limit {
        anyhow::bail!(
            "{what} is larger than {} MiB ({limit} bytes), the most memest reads as a model description",
            limit >> 20
        );
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{what} is not UTF-8 text (invalid byte at offset {}): a model description is TOML or JSON",
            e.utf8_error().valid_up_to()
        )
    })
}

/// How to print the report.
#[derive(Clone, Debug)]
pub struct OutputOpts {
    /// Table or JSON.
    pub format: OutputFormat,
    /// IEC or SI units in tables.
    pub units: UnitSystem,
    /// Also the per-layer table.
    pub per_layer: bool,
    /// Also the table of the largest tensors at the peak.
    pub explain: bool,
    /// Where to write the SVG timeline.
    pub timeline: Option<PathBuf>,
}

/// What the command line asks for, resolved and typed.
#[derive(Clone, Debug)]
pub struct Request {
    /// The model description.
    pub input: InputSource,
    /// The head on a Hugging Face config.
    pub head: Head,
    /// `--image`: the image size a diffusers UNet or a vision or multimodal config reads.
    pub image: Option<memest::hf::ImageSize>,
    /// Overrides, budget, search and the warnings the flags raise.
    pub query: Query,
    /// How to print.
    pub output: OutputOpts,
    /// `--print-model`: print the description as TOML instead of estimating.
    pub print_model: bool,
    /// `--sweep`: one estimate per value.
    pub sweep: Option<Sweep>,
    /// `--plan auto`: the parallel flags to plan from.
    pub plans: Option<memest::parallel::PlanFlags>,
}

impl Cli {
    /// Reads `--deepspeed` or `--accelerate` (and the DeepSpeed file an accelerate config
    /// names): the file as given, and the plan it states.
    ///
    /// # Errors
    /// When a file cannot be read or does not parse as its format.
    fn read_config(&self) -> Result<Option<(String, memest::parallel::ConfigPlan)>> {
        use memest::parallel::{accelerate, deepspeed};
        let read = |path: &Path| -> Result<String> {
            let file = std::fs::File::open(path)
                .with_context(|| format!("failed to read {}", path.display()))?;
            read_bounded(file, &path.display().to_string())
        };
        if let Some(path) = &self.deepspeed {
            let plan =
                deepspeed::read(&read(path)?).with_context(|| format!("{}", path.display()))?;
            return Ok(Some((path.display().to_string(), plan)));
        }
        let Some(path) = &self.accelerate else {
            return Ok(None);
        };
        let acc = accelerate::read(&read(path)?).with_context(|| format!("{}", path.display()))?;
        let plan = match &acc.deepspeed_config_file {
            Some(ds) => {
                let ds_path = Path::new(ds);
                let ds_plan = deepspeed::read(&read(ds_path)?)
                    .with_context(|| format!("{}", ds_path.display()))?;
                accelerate::merge_deepspeed(acc.plan, ds_plan)
            }
            None => acc.plan,
        };
        Ok(Some((path.display().to_string(), plan)))
    }

    /// Resolves the flags into a [`Request`].
    ///
    /// # Errors
    /// Flag combinations clap cannot check: `--context` against a different `--mode` or
    /// `--seq` (an agreeing one is accepted), `--sweep` against the size it sets, `--plan auto`
    /// with `--format csv` or `markdown`.
    pub fn into_request(self) -> Result<Request> {
        if self.plan.is_some() && matches!(self.format, OutputFormat::Csv | OutputFormat::Markdown)
        {
            anyhow::bail!(
                "--plan auto prints its plans as a table or as JSON: --format {} is not supported with it (use --format table or json)",
                match self.format {
                    OutputFormat::Csv => "csv",
                    _ => "markdown",
                }
            );
        }
        if let Some(sweep) = &self.sweep {
            let given = match sweep.dimension {
                Dimension::Batch => self.batch.is_some(),
                Dimension::Context => {
                    self.seq.is_some() || self.context.is_some() || self.prompt.is_some()
                }
            };
            if given {
                anyhow::bail!(
                    "--sweep {}=… sets the {} itself: drop --{}",
                    sweep.name(),
                    sweep.name(),
                    match sweep.dimension {
                        Dimension::Batch => "batch",
                        Dimension::Context => "seq/--context/--prompt",
                    }
                );
            }
        }
        if let Some(n) = self.context {
            if let Some(mode) = self.mode.filter(|m| *m != Mode::Infer) {
                anyhow::bail!(
                    "--context {n} is one inference pass over {n} tokens (--mode infer); it cannot be combined with --mode {mode} (drop one of them)"
                );
            }
            if let Some(seq) = self.seq.filter(|s| *s != n) {
                anyhow::bail!(
                    "--context {n} sets the sequence length to {n}; it cannot be combined with --seq {seq} (drop one of them)"
                );
            }
        }
        if let Some(n) = self.prompt {
            if let Some(c) = self.context {
                anyhow::bail!(
                    "--prompt {n} generates after a prompt (--mode generate) and --context {c} is one inference pass; give one of them"
                );
            }
            if let Some(seq) = self.seq.filter(|s| *s != n) {
                anyhow::bail!(
                    "--prompt {n} sets the sequence length to {n}; it cannot be combined with --seq {seq} (drop one of them)"
                );
            }
        }
        let generate = self.prompt.is_some() || self.new_tokens.is_some();
        if generate {
            let flag = match (self.prompt, self.new_tokens) {
                (Some(n), _) => format!("--prompt {n}"),
                (None, Some(m)) => format!("--new-tokens {m}"),
                (None, None) => unreachable!("generate"),
            };
            if let Some(mode) = self.mode.filter(|m| *m != Mode::Generate) {
                anyhow::bail!(
                    "{flag} belongs to text generation (--mode generate); it cannot be combined with --mode {mode} (drop one of them)"
                );
            }
            if let Some(c) = self.context {
                anyhow::bail!(
                    "{flag} belongs to text generation (--mode generate) and --context {c} is one inference pass; give --prompt {c} instead"
                );
            }
        }
        let (dtype, base_quant) = match self.dtype {
            None => (None, None),
            Some(DtypeArg::Float(d)) => (Some(d), None),
            // Quantized projections; the other weights take the dtype --amp (float32 under
            // autocast: peft's `prepare_model_for_kbit_training` casts them so) or --recipe
            // implies, else bfloat16.
            Some(DtypeArg::Quant(q)) if self.amp.is_some() || self.recipe.is_some() => {
                (None, Some(q))
            }
            Some(DtypeArg::Quant(q)) => (Some(DType::Bfloat16), Some(q)),
        };
        let (quant, mut quant_warnings) =
            Quant::resolve(base_quant, self.group_size, self.double_quant);
        let config = self.read_config()?;
        if let Some((file, c)) = &config {
            quant_warnings.extend(c.notes.iter().map(|n| memest::report::Warning::ConfigKey {
                file: file.clone(),
                key: n.key.clone(),
                message: n.message.clone(),
            }));
        }
        let config = config.map(|c| c.1);
        let cfg = config.as_ref();
        // The config's precision applies only when no precision flag is given.
        let precision_given = dtype.is_some() || self.amp.is_some() || self.recipe.is_some();
        let cfg_precision = cfg.filter(|_| !precision_given);
        let dtype = dtype.or(cfg_precision.and_then(|c| c.dtype));
        let amp = self.amp.or(cfg_precision.and_then(|c| c.amp));
        let recipe = self.recipe.or(cfg_precision.and_then(|c| c.recipe));
        let batch = self.batch.or(cfg.and_then(|c| c.micro_batch));
        let grad_accum = self.grad_accum.or(cfg.and_then(|c| c.grad_accum));
        let plan_flags = memest::parallel::PlanFlags {
            gpus: self.gpus,
            ddp: self.ddp,
            zero: self.zero,
            fsdp: self.fsdp,
            bucket_cap_mb: self.bucket_cap_mb,
            gradient_as_bucket_view: self.gradient_as_bucket_view,
            gpus_per_node: self.gpus_per_node,
            reduce_bucket_size: self.reduce_bucket_size,
            reduce_dtype: self.reduce_dtype,
            offload: self.offload,
            // The searches vary the world size, which a config's train_batch_size would fix.
            config: config.clone().map(|c| memest::parallel::ConfigPlan {
                train_batch: c
                    .train_batch
                    .filter(|_| !self.min_gpus && self.plan.is_none()),
                ..c
            }),
            batch_and_accum: (batch, grad_accum),
            tp: self.tp,
            sp: self.sp,
            cp: self.cp,
            tp_style: self.tp_style,
            pipeline: memest::parallel::PipelineFlags {
                pp: self.pp,
                schedule: self.schedule,
                micro_batches: self.micro_batches,
                virtual_stages: self.virtual_stages,
            },
            ep: self.ep,
            capacity_factor: self.capacity_factor,
        };
        let overrides = Overrides {
            batch,
            seq: self.context.or(self.prompt).or(self.seq),
            target_seq: self.target_seq,
            dtype,
            optimizer: self.optim.or(cfg.and_then(|c| c.optimizer)),
            optimizer_impl: self.optim_impl,
            mode: if self.context.is_some() {
                Some(Mode::Infer)
            } else if generate {
                Some(Mode::Generate)
            } else {
                self.mode
            },
            attention: self.attention,
            amp,
            checkpoint: self.checkpoint || cfg.and_then(|c| c.checkpoint) == Some(true),
            selective_recompute: self.selective_recompute,
            device: self.device,
            lora: self.lora_rank.map(|rank| Lora {
                rank,
                strict: self.lora_targets.is_some(),
                targets: self.lora_targets.as_ref().map_or_else(
                    || Lora::DEFAULT_TARGETS.map(str::to_string).to_vec(),
                    |given| given.iter().map(|t| t.trim().to_string()).collect(),
                ),
            }),
            quant,
            kv_dtype: self.kv_dtype,
            recipe,
            parallel: memest::parallel::PlanFlags {
                // `--min-gpus` resolves the plan at each world size it tries; here at one
                // data-parallel rank of the model-parallel degrees given.
                gpus: self.gpus.or_else(|| {
                    self.min_gpus.then(|| {
                        [plan_flags.tp, plan_flags.pipeline.pp, plan_flags.cp]
                            .into_iter()
                            .fold(1u64, |a, d| a.saturating_mul(d.unwrap_or(1).max(1)))
                    })
                }),
                ..plan_flags.clone()
            }
            .resolve()?,
            expandable_segments: self.expandable_segments,
            keep_grads: self.keep_grads,
            grad_accum,
            optim_in_backward: self.optim_in_backward,
            paged: self.paged,
            ema: self.ema,
            new_tokens: self.new_tokens,
            loss: self.loss,
            lora_dtype: self.lora_dtype,
            lora_dropout: self.lora_dropout,
            qlora_stack: self.qlora_stack,
            gpu: self.gpu,
            cuda_context: self.cuda_context,
            cudnn_workspace: self.cudnn_workspace,
            budget_on: self.budget_on,
        };
        let search = if self.max_batch {
            Some(Dimension::Batch)
        } else if self.max_context {
            Some(Dimension::Context)
        } else {
            None
        };
        Ok(Request {
            input: if self.model.as_os_str() == "-" {
                InputSource::Stdin
            } else {
                InputSource::Path(self.model)
            },
            head: self.head,
            image: self.image,
            query: Query {
                overrides,
                budget: self.budget.or(self.gpu.map(|g| g.total_bytes)),
                search,
                warnings: quant_warnings,
                observe: memest::sim::Observe {
                    timeline: self.timeline.is_some(),
                    explain: self.explain,
                },
                allow_long_context: self.allow_long_context,
                min_gpus: self.min_gpus.then(|| plan_flags.clone()),
            },
            plans: self.plan.is_some().then_some(plan_flags),
            output: OutputOpts {
                format: self.format,
                units: if self.si {
                    UnitSystem::Si
                } else {
                    UnitSystem::Iec
                },
                per_layer: self.per_layer,
                explain: self.explain,
                timeline: self.timeline,
            },
            print_model: self.print_model,
            sweep: self.sweep,
        })
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

    fn request(args: &[&str]) -> Request {
        let mut argv = vec!["memest", "m.toml"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().into_request().unwrap()
    }

    #[test]
    fn quant_options_apply_to_their_format() {
        let r = request(&["--dtype", "int4", "--group-size", "64"]);
        assert_eq!(
            r.query.overrides.quant,
            Some(Quant::Int4 { group_size: 64 })
        );
        assert_eq!(r.query.overrides.dtype, Some(DType::Bfloat16));
        assert!(r.query.warnings.is_empty());
        let r = request(&["--dtype", "NF4", "--double-quant", "false"]);
        assert_eq!(
            r.query.overrides.quant,
            Some(Quant::Nf4 {
                double_quant: false
            })
        );
        let r = request(&["--dtype", "nf4"]);
        assert_eq!(
            r.query.overrides.quant,
            Some(Quant::Nf4 { double_quant: true })
        );
    }

    #[test]
    fn quant_options_without_quant_warn() {
        let r = request(&["--group-size", "64"]);
        assert_eq!(r.query.overrides.quant, None);
        assert_eq!(
            r.query.warnings,
            [memest::report::Warning::QuantFlagsWithoutQuant]
        );
        assert!(request(&["--dtype", "bf16"]).query.warnings.is_empty());
    }

    #[test]
    fn context_means_inference_at_that_length() {
        let r = request(&["--context", "512", "--budget", "1GiB", "--max-context"]);
        assert_eq!(r.query.overrides.seq, Some(512));
        assert_eq!(r.query.overrides.mode, Some(Mode::Infer));
        assert_eq!(r.query.search, Some(Dimension::Context));
        assert_eq!(r.query.budget, Some(1 << 30));
    }

    /// `--context N` agrees with `--mode infer` and `--seq N`; only a contradiction is refused,
    /// naming the values given.
    #[test]
    fn context_accepts_agreeing_flags_and_names_contradictions() {
        for args in [
            &["--context", "8192", "--mode", "infer"][..],
            &["--context", "8192", "--mode", "eval"],
            &["--context", "8192", "--seq", "8192"],
            &["--context", "8192", "--seq", "8192", "--mode", "inference"],
        ] {
            let r = request(args);
            assert_eq!(r.query.overrides.seq, Some(8192), "{args:?}");
            assert_eq!(r.query.overrides.mode, Some(Mode::Infer), "{args:?}");
        }
        let refused = |args: &[&str]| {
            let mut argv = vec!["memest", "m.toml"];
            argv.extend_from_slice(args);
            Cli::try_parse_from(argv)
                .unwrap()
                .into_request()
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            refused(&["--context", "8192", "--mode", "train"]),
            "--context 8192 is one inference pass over 8192 tokens (--mode infer); it cannot be combined with --mode train (drop one of them)"
        );
        assert_eq!(
            refused(&["--context", "8192", "--seq", "4096"]),
            "--context 8192 sets the sequence length to 8192; it cannot be combined with --seq 4096 (drop one of them)"
        );
    }

    #[test]
    fn input_is_read_up_to_the_limit() {
        let limit = usize::try_from(memest::MAX_INPUT_BYTES).unwrap();
        let at_limit = vec![b' '; limit];
        assert_eq!(read_bounded(&at_limit[..], "x").unwrap().len(), limit);
        let over = vec![b' '; limit + 1];
        let err = read_bounded(&over[..], "x").unwrap_err().to_string();
        assert!(err.starts_with("x is larger than 64 MiB"), "{err}");
        let err = read_bounded(&b"ab\xffc"[..], "x").unwrap_err().to_string();
        assert!(err.contains("invalid byte at offset 2"), "{err}");
    }
}
