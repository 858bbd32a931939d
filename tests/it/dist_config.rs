//! Several GPUs from configuration files and their searches: `--deepspeed`, `--accelerate`,
//! `--offload`, NCCL's line, `--min-gpus` and `--plan auto`.
//!
//! The model is the tiny Llama of `examples/llama_tiny.toml` (44,044,800 parameters; its largest
//! parameters are the embedding and the LM head, 32,000 × 512 = 16,384,000 elements), in float32
//! on the CPU as the measured cases of `tests/it/dist.rs` run it. A DeepSpeed config that states a
//! measured case's plan gives that case's report exactly, so the config path inherits the
//! measured per-rank checks. The offload figures are derived by hand below from DeepSpeed's
//! allocations (`stage_1_and_2.py`, `stage3.py`); they are not measured (DeepSpeedCPUAdam needs
//! its C++ op built, which this machine does not run).

use serde_json::Value;

use crate::common::{code, memest, stderr, stdout, u};

const LLAMA: &str = "examples/llama_tiny.toml";
/// The measured cases' settings (`tests/data/dist-cases-cli.json`) less the plan.
const CASE: &[&str] = &[
    LLAMA,
    "--seq",
    "128",
    "--dtype",
    "float32",
    "--attention",
    "flash",
    "--device",
    "cpu",
    "--optim-impl",
    "foreach",
];

fn with(extra: &[&str]) -> Vec<&'static str> {
    let mut all: Vec<&'static str> = CASE.to_vec();
    for e in extra {
        all.push(Box::leak(e.to_string().into_boxed_str()));
    }
    all
}

/// The report without its warnings (a config may warn where flags do not).
fn figures(mut v: Value) -> Value {
    v.as_object_mut().expect("object").remove("warnings");
    v
}

/// `memest ARGS --format json`, parsed: exit 0 or 1 (over the budget), warnings allowed.
fn report(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["--format", "json"]);
    let out = memest(&all);
    assert!(matches!(code(&out), 0 | 1), "{all:?}: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("JSON")
}

fn parallel(v: &Value, key: &str) -> u64 {
    v["parallel"][key].as_u64().expect(key)
}

/// `ds_measured_zeroN.json` (stage N, `reduce_bucket_size` 5e6, micro-batch 2, `train_batch_size`
/// 4, AdamW) is the measured case `--gpus 2 --zero N --reduce-bucket-size 5000000 --batch 2
/// --optim adamw`: same report, byte for byte. The world size comes from `train_batch_size / (2 ·
/// 1)` = 2.
#[test]
fn deepspeed_config_is_the_measured_plan() {
    for stage in ["1", "2", "3"] {
        let file = format!("tests/fixtures/parallel/ds_measured_zero{stage}.json");
        let from_config = report(&with(&["--deepspeed", &file]));
        let from_flags = report(&with(&[
            "--gpus",
            "2",
            "--zero",
            stage,
            "--reduce-bucket-size",
            "5000000",
            "--batch",
            "2",
            "--optim",
            "adamw",
        ]));
        assert_eq!(figures(from_config), figures(from_flags), "stage {stage}");
    }
}

/// Flags override the config: `--zero 3` over the stage-2 file keeps its bucket size.
#[test]
fn flags_override_the_config() {
    let r = report(&with(&[
        "--deepspeed",
        "tests/fixtures/parallel/ds_measured_zero2.json",
        "--zero",
        "3",
        "--batch",
        "2",
    ]));
    let z = &r["parallel"]["plan"]["sharding"];
    assert_eq!(z["stage"], 3);
    assert_eq!(z["reduce_bucket_elems"], 5_000_000);
    // `train_batch_size` 4 is checked against the flags: micro-batch 4 × 1 × 2 ranks = 8.
    // (Without --gpus, micro-batch 4 makes the world size 4 / 4 = 1.)
    let out = memest(&with(&[
        "--deepspeed",
        "tests/fixtures/parallel/ds_measured_zero2.json",
        "--batch",
        "4",
        "--gpus",
        "2",
    ]));
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("train_batch_size 4 is not train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 1 × 2 data-parallel GPUs"),
        "{}",
        stderr(&out)
    );
}

/// The Hugging Face Trainer's `"auto"` sizes from the model's hidden size (512 here):
/// `reduce_bucket_size` 512² = 262,144, `stage3_prefetch_bucket_size` ⌊0.9 · 262,144⌋ = 235,929,
/// `stage3_param_persistence_threshold` 10 · 512 = 5,120; all three are modelled, so no key
/// is named.
#[test]
fn hf_auto_values() {
    let args = with(&[
        "--deepspeed",
        "tests/fixtures/parallel/ds_zero3_hf.json",
        "--gpus",
        "4",
        "--batch",
        "2",
    ]);
    let r = report(&args);
    let z = &r["parallel"]["plan"]["sharding"];
    assert_eq!(z["reduce_bucket_elems"], 262_144);
    assert_eq!(z["prefetch_bucket_elems"], 235_929);
    assert_eq!(z["param_persistence_threshold"], 5_120);
    assert_eq!(z["overlap_comm"], true);
    assert!(r.get("warnings").is_none(), "{}", r["warnings"]);
}

/// Vision models' `"auto"` sizes follow the config's `hidden_size` (64 in each tiny config:
/// 64² = 4,096, ⌊0.9 · 4,096⌋ = 3,686, 10 · 64 = 640), not DeepSpeed's defaults (they have no
/// token embedding to read a width from); a model with no hidden size at all is refused, naming
/// the `"auto"` keys, as the Hugging Face Trainer refuses it.
#[test]
fn auto_sizes_of_vision_models() {
    for model in [
        "tests/fixtures/hf/vit_tiny.json",
        "tests/fixtures/hf/dinov2_tiny.json",
        "tests/fixtures/hf/clip_vision_tiny.json",
    ] {
        let r = report(&[
            model,
            "--deepspeed",
            "tests/fixtures/parallel/ds_zero3_hf.json",
            "--gpus",
            "2",
            "--batch",
            "2",
            "--device",
            "cpu",
        ]);
        let z = &r["parallel"]["plan"]["sharding"];
        assert_eq!(z["reduce_bucket_elems"], 4_096, "{model}");
        assert_eq!(z["prefetch_bucket_elems"], 3_686, "{model}");
        assert_eq!(z["param_persistence_threshold"], 640, "{model}");
    }
    let base = [
        "examples/resnet18.toml",
        "--deepspeed",
        "tests/fixtures/parallel/ds_zero3_hf.json",
        "--gpus",
        "2",
        "--device",
        "cpu",
    ];
    let out = memest(&base);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(
        stderr(&out).contains(r#"no hidden size to fill the DeepSpeed config's "auto" zero_optimization.reduce_bucket_size, zero_optimization.stage3_prefetch_bucket_size, zero_optimization.stage3_param_persistence_threshold from"#),
        "{}",
        stderr(&out)
    );
    let mut a = base.to_vec();
    a.extend(["--reduce-bucket-size", "1000000"]);
    let out = memest(&a);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains(r#""auto" zero_optimization.stage3_prefetch_bucket_size, zero_optimization.stage3_param_persistence_threshold from"#),
        "{}",
        stderr(&out)
    );
}

/// Flags over a config: `--reduce-bucket-size` wins over the file's `"auto"` (which the model's
/// hidden size, 512, would have filled with 262,144), the other `"auto"` sizes still follow the
/// model; `--zero 2` keeps the file's explicit `overlap_comm: true`; a file that leaves
/// `overlap_comm` out gets DeepSpeed's default for the stage the flag sets (true for 3 only).
#[test]
fn flags_override_config_auto_and_stage() {
    let base = [
        "--deepspeed",
        "tests/fixtures/parallel/ds_zero3_hf.json",
        "--gpus",
        "4",
        "--batch",
        "2",
    ];
    let mut a = base.to_vec();
    a.extend(["--reduce-bucket-size", "1000000"]);
    let r = report(&with(&a));
    let z = &r["parallel"]["plan"]["sharding"];
    assert_eq!(z["reduce_bucket_elems"], 1_000_000);
    assert_eq!(z["prefetch_bucket_elems"], 235_929);
    assert_eq!(z["param_persistence_threshold"], 5_120);
    let mut a = base.to_vec();
    a.extend(["--zero", "2"]);
    let r = report(&with(&a));
    let z = &r["parallel"]["plan"]["sharding"];
    assert_eq!(z["stage"], 2);
    assert_eq!(z["overlap_comm"], true);
    assert_eq!(z["reduce_bucket_elems"], 262_144);
    for (file, zero, overlap) in [
        ("tests/fixtures/parallel/ds_measured_zero2.json", "3", true),
        ("tests/fixtures/parallel/ds_measured_zero3.json", "2", false),
        ("tests/fixtures/parallel/ds_measured_zero3.json", "3", true),
    ] {
        let r = report(&with(&["--deepspeed", file, "--gpus", "2", "--zero", zero]));
        let z = &r["parallel"]["plan"]["sharding"];
        assert_eq!(z["overlap_comm"], overlap, "{file} --zero {zero}");
    }
}

/// Unknown keys get a did-you-mean, keys that change memory in ways memest does not model are
/// named, keys without effect (and features turned off) are silent.
#[test]
fn unknown_and_unmodelled_keys_warn() {
    let out = memest(&with(&[
        "--deepspeed",
        "tests/fixtures/parallel/ds_unknown_keys.json",
        "--gpus",
        "2",
    ]));
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let err = stderr(&out);
    for line in [
        "warning: tests/fixtures/parallel/ds_unknown_keys.json: train_batch_sizes: not a DeepSpeed key memest knows; ignored (did you mean train_batch_size?)",
        "warning: tests/fixtures/parallel/ds_unknown_keys.json: zero_optimization.reduce_bucket_sise: not a DeepSpeed key memest knows; ignored (did you mean reduce_bucket_size?)",
        "warning: tests/fixtures/parallel/ds_unknown_keys.json: zero_optimization.zero_quantized_gradients: read, not modelled",
    ] {
        assert!(err.contains(line), "{line}\n{err}");
    }
    assert!(!err.contains("flops_profiler"), "{err}");
}

/// ZeRO-Offload, by hand. World 2: the flat group of 44,044,800 elements is already a multiple
/// of 2·2, so each partition is 22,022,400 elements, 88,089,600 B in float32.
///
/// - ZeRO-1/2 `offload_optimizer`: host = Adam's moments over the partition (2 × 88,089,600 +
///   a 4-byte `step` = 176,179,204) + the float32 master partition (88,089,600, always pinned) +
///   its float32 gradient (88,089,600) + `temp_grad_buffer_for_cpu_offload` (the largest
///   parameter, 16,384,000 × 4 = 65,536,000) = 417,894,404 B. The GPU keeps no optimizer state,
///   no master weights, no ZeRO-2 gradient partition, and gains the staging buffer
///   `temp_grad_buffer_for_gpu_offload` (65,536,000) beside the reduce bucket (5e6 × 4 =
///   20,000,000): communication buffers 85,536,000 B.
/// - ZeRO-3 `offload_optimizer`: host = 176,179,204 + 88,089,600 (master) + 88,089,600 (its
///   gradient) + 88,089,600 (`grad_partitions_flat_buffer`) = 440,448,004 B; parameters stay.
/// - ZeRO-3 both: plus the parameter partitions (88,089,600, always pinned) = 528,537,604 B.
#[test]
fn offload_moves_state_to_the_host() {
    let base = [
        "--gpus",
        "2",
        "--reduce-bucket-size",
        "5000000",
        "--batch",
        "2",
        "--optim",
        "adamw",
    ];
    let run = |stage: &str, what: &str| {
        let mut extra = base.to_vec();
        extra.extend(["--zero", stage, "--offload", what]);
        report(&with(&extra))
    };
    for stage in ["1", "2"] {
        let r = run(stage, "optimizer");
        assert_eq!(parallel(&r, "cpu_bytes"), 417_894_404, "stage {stage}");
        assert_eq!(
            parallel(&r, "cpu_pinned_bytes"),
            88_089_600,
            "stage {stage}"
        );
        assert_eq!(
            parallel(&r, "comm_buffers_bytes"),
            85_536_000,
            "stage {stage}"
        );
        assert_eq!(u(&r, "optimizer_state_bytes"), 0);
        assert_eq!(u(&r, "master_weights_bytes"), 0);
        assert_eq!(u(&r, "parameters_bytes"), 176_179_200);
    }
    assert_eq!(u(&run("2", "optimizer"), "gradients_bytes"), 0);
    let r = run("3", "optimizer");
    assert_eq!(parallel(&r, "cpu_bytes"), 440_448_004);
    assert_eq!(parallel(&r, "cpu_pinned_bytes"), 0);
    assert_eq!(u(&r, "parameters_bytes"), 88_089_600);
    assert_eq!(u(&r, "gradients_bytes"), 0);
    let r = run("3", "both");
    assert_eq!(parallel(&r, "cpu_bytes"), 528_537_604);
    assert_eq!(parallel(&r, "cpu_pinned_bytes"), 88_089_600);
    assert_eq!(u(&r, "parameters_bytes"), 0);
    // Offload never loses bytes: per stage, the host holds what the GPU no longer does.
    for (stage, extra) in [
        ("1", 88_089_600 + 65_536_000),
        ("2", 88_089_600 + 65_536_000),
        ("3", 2 * 88_089_600),
    ] {
        let mut plain = base.to_vec();
        plain.extend(["--zero", stage]);
        let p = report(&with(&plain));
        let o = run(stage, "optimizer");
        assert_eq!(
            parallel(&o, "cpu_bytes"),
            u(&p, "optimizer_state_bytes") + u(&p, "master_weights_bytes") + extra,
            "stage {stage}"
        );
    }
}

/// Offload details from DeepSpeed's source, by hand on the world-2 case above (flat partition
/// 22,022,400 elements; master, float32 gradient and ZeRO-3 gradient partitions 88,089,600 B each;
/// AdamW's state 176,179,204 B; staging buffer 65,536,000 B):
///
/// - `offload_optimizer.device: nvme` at ZeRO-2 is host offload (`stage_1_and_2.py`:
///   `cpu_offload = device != none`): the same report as `--offload optimizer`;
/// - ZeRO-2 with `gradient_accumulation_steps` 2 adds `accumulated_grads_in_cpu`: the whole
///   numel of every parameter overlapping rank 0's partition (the embedding, layers 0 and 1 and
///   layer 2's first RMSNorm: 16,384,000 + 2 · 2,819,072 + 512 = 22,022,656 elements, the last
///   rank's part is as large), 88,090,624 B, pinned with `pin_memory`: host 417,894,404 +
///   88,090,624 = 505,985,028 B; pinned 88,089,600 (master) + 88,089,600 (float32 gradient) +
///   65,536,000 (staging) + 88,090,624 = 329,805,824 B;
/// - ZeRO-3 with parameters to NVMe and the optimizer to the CPU: the optimizer side stays on
///   the host (440,448,004 B), the parameters are on disk;
/// - ZeRO-3 with `offload_optimizer.pin_memory` true and `offload_param.pin_memory` false: the
///   float32 gradient and gradient partitions are pinned (2 × 88,089,600), the parameter
///   partitions always are (88,089,600), the float32 master partition never is
///   (`.to(cpu).clone()`): 264,268,800 of 528,537,604 B.
#[test]
fn offload_follows_deepspeed() {
    let base = [
        "--gpus",
        "2",
        "--reduce-bucket-size",
        "5000000",
        "--batch",
        "2",
        "--optim",
        "adamw",
    ];
    let run = |extra: &[&str]| {
        let mut all = base.to_vec();
        all.extend(extra);
        report(&with(&all))
    };
    let nvme = run(&["--deepspeed", "tests/fixtures/parallel/ds_zero2_nvme.json"]);
    let cpu = run(&["--zero", "2", "--offload", "optimizer"]);
    assert_eq!(parallel(&nvme, "cpu_bytes"), 417_894_404);
    assert_eq!(figures(nvme), figures(cpu));
    let accum = run(&[
        "--deepspeed",
        "tests/fixtures/parallel/ds_zero2_offload_accum.json",
    ]);
    assert_eq!(parallel(&accum, "cpu_bytes"), 505_985_028);
    assert_eq!(parallel(&accum, "cpu_pinned_bytes"), 329_805_824);
    let r = run(&[
        "--deepspeed",
        "tests/fixtures/parallel/ds_zero3_param_nvme.json",
    ]);
    assert_eq!(parallel(&r, "cpu_bytes"), 440_448_004);
    assert_eq!(parallel(&r, "cpu_pinned_bytes"), 0);
    assert_eq!(u(&r, "parameters_bytes"), 0);
    let r = run(&[
        "--deepspeed",
        "tests/fixtures/parallel/ds_zero3_pinned.json",
    ]);
    assert_eq!(parallel(&r, "cpu_bytes"), 528_537_604);
    assert_eq!(parallel(&r, "cpu_pinned_bytes"), 264_268_800);
}

/// The precision wrappers DeepSpeed runs outside ZeRO (and at ZeRO-1 with bf16 and float32
/// gradient accumulation) are refused, naming them (`engine.py`,
/// `_do_optimizer_sanity_check`).
#[test]
fn deepspeed_precision_wrappers_are_refused() {
    for (file, says) in [
        (
            "tests/fixtures/parallel/ds_zero0_bf16.json",
            "DeepSpeed ZeRO-0 with bf16 runs BF16_Optimizer (older DeepSpeed) or FP16_Optimizer over bfloat16 (recent DeepSpeed's DDP_BFLOAT16)",
        ),
        (
            "tests/fixtures/parallel/ds_zero1_bf16_fp32_accum.json",
            "DeepSpeed ZeRO-1 with bf16 runs BF16_Optimizer",
        ),
    ] {
        let out = memest(&with(&["--deepspeed", file, "--gpus", "2"]));
        assert_eq!(code(&out), 2, "{file}");
        assert!(stderr(&out).contains(says), "{}", stderr(&out));
    }
    let out = memest(&with(&[
        "--deepspeed",
        "tests/fixtures/parallel/ds_measured_zero1.json",
        "--zero",
        "0",
    ]));
    // No bf16/fp16 section in the file: DeepSpeed runs float32, no wrapper.
    assert_eq!(code(&out), 0, "{}", stderr(&out));
}

/// accelerate's DeepSpeed plugin defaults to ZeRO-2 (`DeepSpeedPlugin.__post_init__`:
/// `ACCELERATE_DEEPSPEED_ZERO_STAGE`, default 2): a `deepspeed_config` without `zero_stage` is
/// `--zero 2`.
#[test]
fn accelerate_deepspeed_defaults_to_zero2() {
    let base = [
        LLAMA, "--seq", "128", "--device", "cpu", "--batch", "2", "--optim", "adamw",
    ];
    let mut a = base.to_vec();
    a.extend([
        "--accelerate",
        "tests/fixtures/parallel/accelerate_ds_default_stage.yaml",
    ]);
    let mut b = base.to_vec();
    b.extend(["--gpus", "2", "--zero", "2"]);
    assert_eq!(figures(report(&a)), figures(report(&b)));
}

/// FSDP2's `CPUOffloadPolicy`: the parameter, gradient and optimizer-state shards on the host.
/// World 2: parameter shards 88,089,600 B (every dim-0 divides by 2), gradient shards as many,
/// AdamW's moments 176,179,200 + one 4-byte `step` per parameter tensor (39 tensors: 156 B)
/// = 352,358,556 B; pinned: the parameter and gradient shards, 176,179,200 B.
#[test]
fn fsdp_cpu_offload() {
    let r = report(&with(&[
        "--gpus",
        "2",
        "--fsdp",
        "full-shard",
        "--offload",
        "params",
        "--batch",
        "2",
        "--optim",
        "adamw",
    ]));
    assert_eq!(parallel(&r, "cpu_bytes"), 352_358_556);
    assert_eq!(parallel(&r, "cpu_pinned_bytes"), 176_179_200);
    assert_eq!(u(&r, "parameters_bytes"), 0);
    assert_eq!(u(&r, "optimizer_state_bytes"), 0);
    let out = memest(&with(&[
        "--gpus",
        "2",
        "--fsdp",
        "full-shard",
        "--offload",
        "optimizer",
    ]));
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("CPUOffloadPolicy"),
        "{}",
        stderr(&out)
    );
    let out = memest(&with(&["--gpus", "2", "--offload", "optimizer"]));
    assert_eq!(code(&out), 2);
    let out = memest(&with(&[
        "--gpus",
        "2",
        "--zero",
        "2",
        "--offload",
        "params",
    ]));
    assert!(
        stderr(&out).contains("valid only with ZeRO stage 3"),
        "{}",
        stderr(&out)
    );
}

/// `--reduce-dtype` is FSDP's: refused without it, the flag's error named; with it, a
/// bfloat16 reduce-scatter under `mixed-bf16` lowers the measured peak (its figures are in
/// `tests/it/dist.rs`), and `fp32` is PyTorch's default for float32 parameters.
#[test]
fn reduce_dtype_needs_fsdp() {
    for engine in [&["--gpus", "2"][..], &["--gpus", "2", "--zero", "2"]] {
        let mut a = engine.to_vec();
        a.extend(["--reduce-dtype", "bf16"]);
        let out = memest(&with(&a));
        assert_eq!(code(&out), 2, "{a:?}");
        assert!(
            stderr(&out).contains(
                "--reduce-dtype bf16 is FSDP's MixedPrecisionPolicy.reduce_dtype: it needs --fsdp"
            ),
            "{}",
            stderr(&out)
        );
    }
    let base = [
        LLAMA,
        "--seq",
        "128",
        "--device",
        "cpu",
        "--batch",
        "2",
        "--optim",
        "adamw",
        "--gpus",
        "2",
        "--fsdp",
        "full-shard",
        "--recipe",
        "mixed-bf16",
    ];
    let peak = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend(extra);
        u(&report(&a), "peak_bytes")
    };
    assert_eq!(peak(&[]), peak(&["--reduce-dtype", "fp32"]));
    assert!(peak(&["--reduce-dtype", "bf16"]) < peak(&[]));
}

/// The accelerate configs are the flags they stand for (FSDP with `mixed_precision: bf16`:
/// accelerate's policy reduces in bfloat16 too, `--reduce-dtype bf16`).
#[test]
fn accelerate_configs_are_their_flags() {
    let cases: [(&str, &[&str]); 3] = [
        (
            "tests/fixtures/parallel/accelerate_fsdp.yaml",
            &[
                "--gpus",
                "8",
                "--fsdp",
                "full-shard",
                "--recipe",
                "mixed-bf16",
                "--reduce-dtype",
                "bf16",
            ],
        ),
        (
            "tests/fixtures/parallel/accelerate_deepspeed.yaml",
            &[
                "--gpus",
                "4",
                "--zero",
                "3",
                "--offload",
                "optimizer",
                "--dtype",
                "bfloat16",
            ],
        ),
        (
            "tests/fixtures/parallel/accelerate_ds_file.yaml",
            &[
                "--gpus",
                "2",
                "--zero",
                "2",
                "--reduce-bucket-size",
                "5000000",
            ],
        ),
    ];
    for (file, flags) in cases {
        // The measured settings carry --dtype float32; a config's precision applies only
        // without a precision flag, so these run on the model's own dtype.
        let base = [
            LLAMA, "--seq", "128", "--device", "cpu", "--batch", "2", "--optim", "adamw",
        ];
        let mut a = base.to_vec();
        a.extend(["--accelerate", file]);
        let mut b = base.to_vec();
        b.extend(flags);
        assert_eq!(figures(report(&a)), figures(report(&b)), "{file}");
    }
}

/// NCCL's buffers: 16 channels × 3 receive connections (ring predecessor, tree child and
/// parent) × (4 MiB Simple + 4,915,200 B LL128 + 512 KiB LL) = 462,422,016 B per GPU on CUDA,
/// counted in `device_bytes`; none on the CPU (gloo). Two ranks have one tree peer: 2
/// connections, 308,281,344 B. Each parallel dimension has its own communicator: `--tp 2` over
/// 8 GPUs pays for a data-parallel group of 4 and a tensor-parallel group of 2.
#[test]
fn nccl_line() {
    let r = report(&[LLAMA, "--gpus", "8", "--zero", "3"]);
    assert_eq!(parallel(&r, "nccl_bytes"), 462_422_016);
    let two = report(&[LLAMA, "--gpus", "2", "--zero", "3"]);
    assert_eq!(parallel(&two, "nccl_bytes"), 308_281_344);
    let tp = report(&[LLAMA, "--gpus", "8", "--tp", "2"]);
    assert_eq!(parallel(&tp, "nccl_bytes"), 462_422_016 + 308_281_344);
    let single = report(&[LLAMA]);
    // The same tensors, context and workspaces; the plan changes the tensors, so compare the
    // device figure's parts instead: device = peak + context + workspaces + NCCL.
    assert_eq!(
        u(&r, "device_bytes"),
        u(&r, "peak_bytes") + u(&r, "cuda_context_bytes") + u(&r, "workspace_bytes") + 462_422_016
    );
    assert!(single.get("parallel").is_none());
    let cpu = report(&[LLAMA, "--gpus", "8", "--zero", "3", "--device", "cpu"]);
    assert_eq!(parallel(&cpu, "nccl_bytes"), 0);
}

/// `--min-gpus` over data-parallel ranks alone (`--tp 1` fixes the model-parallel degrees):
/// ZeRO-3 (bucket 5e6) of the tiny Llama in bfloat16 on the CPU needs 4 GPUs of 400 MiB and
/// 28 of 250 MiB; the answer fits and one fewer does not. DDP shards nothing: no number of
/// GPUs brings it under its single-GPU figure. Without `--tp 1`, tensor parallelism fits 250
/// MiB on 10 GPUs (TP 2 with sequence parallelism, ZeRO-3 over 5 data-parallel ranks:
/// 252,250,872 B).
#[test]
fn min_gpus() {
    let base = [
        LLAMA,
        "--seq",
        "128",
        "--batch",
        "2",
        "--optim",
        "adamw",
        "--dtype",
        "bf16",
        "--device",
        "cpu",
        "--zero",
        "3",
        "--reduce-bucket-size",
        "5000000",
    ];
    for (budget, n) in [("400MiB", 4u64), ("250MiB", 28)] {
        let mut a = base.to_vec();
        a.extend(["--min-gpus", "--tp", "1", "--budget", budget]);
        let r = report(&a);
        assert_eq!(r["parallel"]["min_gpus"]["gpus"], n, "{budget}");
        assert_eq!(r["parallel"]["world_size"], n);
        assert_eq!(r["budget"]["fits"], true);
        let fewer = (n - 1).to_string();
        let mut b = base.to_vec();
        b.extend(["--gpus", &fewer, "--budget", budget]);
        assert_eq!(report(&b)["budget"]["fits"], false, "{budget} at {fewer}");
    }
    let mut a = base.to_vec();
    a.extend(["--min-gpus", "--budget", "250MiB"]);
    let r = report(&a);
    assert_eq!(r["parallel"]["min_gpus"]["gpus"], 10);
    assert_eq!(
        r["parallel"]["description"],
        "dtensor tensor parallel 2 + sequence parallel; DeepSpeed ZeRO-3 over 5 data-parallel ranks"
    );
    assert_eq!(u(&r["budget"], "checked_bytes"), 252_250_872);
    let r = report(&[
        LLAMA,
        "--seq",
        "128",
        "--batch",
        "2",
        "--optim",
        "adamw",
        "--device",
        "cpu",
        "--min-gpus",
        "--tp",
        "1",
        "--budget",
        "300MiB",
    ]);
    assert_eq!(r["parallel"]["min_gpus"]["gpus"], Value::Null);
    // The stop rule compares doublings from two ranks on: 2 and 4.
    assert_eq!(r["parallel"]["min_gpus"]["searched_up_to"], 4);
    // Why, with the figures at 4 GPUs: DDP divides nothing, so the whole 545,450,272 B is
    // fixed: 16,908,292 B saved, 88,089,600 B of temporaries, 4,096 B of input and a
    // 88,089,600 B bucket (193,091,588 B), and the replicated weights, gradients, AdamW state
    // and 128 B of buffers (352,358,684 B); on the CPU nothing beside the tensors.
    assert_eq!(
        r["parallel"]["min_gpus"]["fixed"],
        serde_json::json!({
            "gpus": 4,
            "checked_bytes": 545_450_272u64,
            "fixed_bytes": 545_450_272u64,
            "runtime_bytes": 0,
            "activations_bytes": 193_091_588u64,
            "replicated_bytes": 352_358_684u64,
        })
    );
    // A config's train_batch_size (16 = 2 × 1 × 8) does not pin the search's world size.
    let r = report(&[
        LLAMA,
        "--seq",
        "128",
        "--device",
        "cpu",
        "--deepspeed",
        "tests/fixtures/parallel/ds_zero2_offload.json",
        "--min-gpus",
        "--budget",
        "500MiB",
    ]);
    assert_eq!(r["parallel"]["min_gpus"]["gpus"], 1);
    let out = memest(&[LLAMA, "--zero", "3", "--min-gpus"]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("--min-gpus needs a --budget or a --gpu"),
        "{}",
        stderr(&out)
    );
}

/// `--min-gpus` on CUDA, where NCCL's buffers appear at two ranks (308,281,344 B) and grow at
/// more (462,422,016 B): ZeRO-3 SGD with momentum of the tiny Llama (bf16, batch 1, seq 16)
/// checks 1,178,840,708 B on one GPU, 1,222,853,252 B on two and 1,244,859,524 B on four (each
/// more), then falls: 1,150,478,048 B on 14, 1,147,961,264 B on 15. Under 1,150,000,000 B it
/// needs 15 GPUs and 14 do not fit (the search stopped at 2, answering none, when a rise in
/// NCCL's buffers ended it).
#[test]
fn min_gpus_cuda_past_the_communicator() {
    let base = [
        LLAMA,
        "--seq",
        "16",
        "--batch",
        "1",
        "--optim",
        "sgd-momentum",
        "--dtype",
        "bf16",
        "--zero",
        "3",
        "--reduce-bucket-size",
        "5000000",
        "--budget",
        "1150000000",
    ];
    let mut a = base.to_vec();
    a.extend(["--min-gpus", "--tp", "1"]);
    let r = report(&a);
    assert_eq!(r["parallel"]["min_gpus"]["gpus"], 15);
    assert_eq!(r["parallel"]["min_gpus"]["searched_up_to"], 16);
    assert_eq!(u(&r["budget"], "checked_bytes"), 1_147_961_264);
    assert_eq!(r["budget"]["fits"], true);
    let mut b = base.to_vec();
    b.extend(["--gpus", "14"]);
    let r = report(&b);
    assert_eq!(u(&r["budget"], "checked_bytes"), 1_150_478_048);
    assert_eq!(r["budget"]["fits"], false);
    // Under 10^9 B no number fits, whatever the search tries (up to 65,536 GPUs): there each
    // GPU holds 1,362 B of weights and of gradients and 2,724 B each of momentum and float32
    // master partition (8,172 B, what more GPUs shrink); the rest is fixed: the CUDA context
    // (426 MiB), cuBLAS workspaces (66 MiB) and NCCL buffers (441 MiB), 978,321,408 B; the
    // activations, temporaries, input and the 98,089,600 B of communication buffers
    // (101,635,588 B); a layer's whole gradients before their reduce-scatter and the buffers
    // (32,768,128 B). That alone is over the budget.
    let mut c = base.to_vec();
    c.extend(["--min-gpus", "--tp", "1"]);
    let at = c.len() - 4;
    c[at] = "1000000000";
    let r = report(&c);
    let m = &r["parallel"]["min_gpus"];
    assert_eq!(m["gpus"], Value::Null);
    assert_eq!(
        m["fixed"],
        serde_json::json!({
            "gpus": 65_536,
            "checked_bytes": 1_112_733_296u64,
            "fixed_bytes": 1_112_725_124u64,
            "runtime_bytes": 978_321_408u64,
            "activations_bytes": 101_635_588u64,
            "replicated_bytes": 32_768_128u64,
        })
    );
    let text = stdout(&memest(&c));
    assert!(
        text.contains("no number of GPUs fits 953.7 MiB each (tried up to 65536): at 65536 GPUs each needs 1.04 GiB, of which 1.04 GiB no further sharding removes (933.0 MiB CUDA context, workspaces and NCCL buffers, 96.93 MiB activations, temporaries, input and communication buffers, 31.25 MiB model states not divided among the GPUs); that fixed cost alone exceeds the budget by 107.5 MiB, so more GPUs cannot help this plan"),
        "{text}"
    );
}

/// `--plan auto` on 16 GPUs: the twelve data-parallel plans (hybrid-shard past one node of 8)
/// and fifteen tensor/pipeline-parallel ones (the tiny Llama: 8 heads and 2 key/value heads,
/// so TP 2; 4 blocks, so PP 2 or 4; three engines at each of the five pairs besides (1, 1),
/// as each leaves data-parallel ranks), sorted by the checked figure; each row is the
/// estimate of its own flags.
#[test]
fn plan_auto() {
    let base = [
        LLAMA, "--seq", "128", "--batch", "2", "--optim", "adamw", "--dtype", "bf16", "--device",
        "cpu",
    ];
    let mut a = base.to_vec();
    a.extend([
        "--gpus", "16", "--plan", "auto", "--budget", "400MiB", "--format", "json",
    ]);
    let out = memest(&a);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let plans = v["plans"].as_array().unwrap();
    assert_eq!(plans.len(), 12 + 15);
    let checked: Vec<u64> = plans
        .iter()
        .map(|p| p["checked_bytes"].as_u64().unwrap())
        .collect();
    assert!(checked.windows(2).all(|w| w[0] <= w[1]), "{checked:?}");
    let fsdp = plans
        .iter()
        .find(|p| p["description"] == "FSDP full-shard over 16 GPUs")
        .expect("full-shard");
    let mut b = base.to_vec();
    b.extend(["--gpus", "16", "--fsdp", "full-shard"]);
    assert_eq!(fsdp["peak_bytes"], report(&b)["peak_bytes"]);
    let ddp = plans
        .iter()
        .find(|p| p["description"] == "DDP over 16 GPUs, 25 MiB buckets")
        .unwrap();
    assert_eq!(ddp["fits"], false);
    assert_eq!(fsdp["fits"], true);
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config {
        cases: 12,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(9),
        ..proptest::test_runner::Config::default()
    })]

    /// For random ZeRO plans, sharding and offload neither lose nor invent bytes. With `n` =
    /// 44,044,800 elements over `dp` ranks:
    ///
    /// - AdamW's moments per GPU × `dp` are the flat group padded to a multiple of `2·dp`
    ///   (ZeRO's alignment) times 8 bytes, and each rank keeps one 4-byte `step` where the whole
    ///   model keeps one per tensor (39): `per_gpu · dp − 4·dp − 8·pad = unsharded − 156`;
    /// - ZeRO-2's gradient partitions likewise: `per_gpu · dp − 4·pad = unsharded`;
    /// - ZeRO-3's parameters: each tensor padded to a multiple of `dp`;
    /// - with `--offload optimizer` the host holds what the GPU no longer does (state, master
    ///   partition) plus the float32 gradient partition and the staging buffer (ZeRO-1/2) or
    ///   the gradient partitions (ZeRO-3), and the GPU's parameters are unchanged.
    #[test]
    fn sharding_and_offload_keep_every_byte(dp in 1u64..=64, stage in 1u8..=3) {
        let n: u64 = 44_044_800;
        let gpus = dp.to_string();
        let zero = stage.to_string();
        let base = ["--gpus", gpus.as_str(), "--zero", zero.as_str(), "--reduce-bucket-size", "5000000", "--batch", "2", "--optim", "adamw"];
        let plain = report(&with(&base));
        let mut off = base.to_vec();
        off.extend(["--offload", "optimizer"]);
        let offloaded = report(&with(&off));
        let whole = |k: &str| plain["parallel"]["unsharded"][k].as_u64().unwrap();
        let per = |k: &str| plain["parallel"]["per_gpu"][k].as_u64().unwrap();
        let padded = n.div_ceil(2 * dp) * 2 * dp;
        if stage < 3 {
            proptest::prop_assert_eq!(per("optimizer_state_bytes") * dp - 4 * dp - 8 * (padded - n), whole("optimizer_state_bytes") - 156);
        }
        if stage == 2 {
            proptest::prop_assert_eq!(per("gradients_bytes") * dp - 4 * (padded - n), whole("gradients_bytes"));
        }
        if stage == 3 {
            // Every tensor of the tiny Llama: 32,000 × 512 twice, 4 × (512² · 2 + 512·128 · 2 +
            // 3 · 512·1408 + 2 · 512), and the final norm's 512.
            let mut sizes = vec![16_384_000u64, 16_384_000, 512];
            for _ in 0..4 {
                sizes.extend([262_144, 65_536, 65_536, 262_144, 720_896, 720_896, 720_896, 512, 512]);
            }
            proptest::prop_assert_eq!(sizes.iter().sum::<u64>(), n);
            let padded3: u64 = sizes.iter().map(|s| s.div_ceil(dp) * dp).sum();
            proptest::prop_assert_eq!(per("parameters_bytes") * dp, 4 * padded3);
        }
        let extra = if stage < 3 {
            u(&plain, "master_weights_bytes") + 65_536_000
        } else {
            u(&plain, "master_weights_bytes") + per("gradients_bytes")
        };
        proptest::prop_assert_eq!(
            parallel(&offloaded, "cpu_bytes"),
            u(&plain, "optimizer_state_bytes") + u(&plain, "master_weights_bytes") + extra
        );
        proptest::prop_assert_eq!(u(&offloaded, "optimizer_state_bytes"), 0);
        proptest::prop_assert_eq!(u(&offloaded, "master_weights_bytes"), 0);
        proptest::prop_assert_eq!(u(&offloaded, "parameters_bytes"), u(&plain, "parameters_bytes"));
    }
}

/// `--plan auto` varies tensor and pipeline parallelism on a real config: Llama-3-8B (32
/// heads, 8 key/value heads, 32 layers) on 8 GPUs, bf16, seq 4096, activation checkpointing.
/// TP divides the key/value heads' gcd with the heads (8) and PP the layers, `tp · pp` the
/// GPUs: besides (1, 1)'s eleven data-parallel plans, DDP, ZeRO-1 and FSDP full-shard at
/// (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), and the model-parallel plan alone at (1, 8),
/// (2, 4), (4, 2), (8, 1). Each row is its flags' estimate; sorted cheapest first; only plain
/// DDP does not fit an H100.
#[test]
fn plan_auto_varies_tensor_and_pipeline_parallelism() {
    let base = [
        "examples/hf/llama-3-8b.json",
        "--seq",
        "4096",
        "--batch",
        "1",
        "--optim",
        "adamw",
        "--dtype",
        "bf16",
        "--checkpoint",
        "--gpu",
        "h100",
    ];
    let mut a = base.to_vec();
    a.extend(["--gpus", "8", "--plan", "auto", "--format", "json"]);
    let out = memest(&a);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let plans = v["plans"].as_array().unwrap();
    let key = |p: &Value| {
        let pl = &p["plan"];
        let sh = &pl["sharding"];
        let engine = match sh["engine"].as_str().unwrap() {
            "zero" => format!("zero{}", sh["stage"]),
            "fsdp" => format!("fsdp-{}", sh["strategy"].as_str().unwrap()),
            e => e.to_string(),
        };
        let off = if pl["offload"]["params"].is_null() {
            if pl["offload"]["optimizer"].is_null() {
                ""
            } else {
                "+opt-offload"
            }
        } else {
            "+offload"
        };
        format!("tp{} pp{} {engine}{off}", pl["tp"], pl["pp"])
    };
    let mut got: Vec<String> = plans.iter().map(key).collect();
    got.sort();
    let mut want: Vec<String> = [
        "tp1 pp1 ddp",
        "tp1 pp1 zero1",
        "tp1 pp1 zero2",
        "tp1 pp1 zero3",
        "tp1 pp1 fsdp-full-shard",
        "tp1 pp1 fsdp-shard-grad-op",
        "tp1 pp1 zero1+opt-offload",
        "tp1 pp1 zero2+opt-offload",
        "tp1 pp1 zero3+opt-offload",
        "tp1 pp1 zero3+offload",
        "tp1 pp1 fsdp-full-shard+offload",
        "tp1 pp8 ddp",
        "tp2 pp4 ddp",
        "tp4 pp2 ddp",
        "tp8 pp1 ddp",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    for (tp, pp) in [(1, 2), (2, 1), (1, 4), (2, 2), (4, 1)] {
        for e in ["ddp", "zero1", "fsdp-full-shard"] {
            want.push(format!("tp{tp} pp{pp} {e}"));
        }
    }
    want.sort();
    assert_eq!(got, want);
    let checked: Vec<u64> = plans
        .iter()
        .map(|p| p["checked_bytes"].as_u64().unwrap())
        .collect();
    assert!(checked.windows(2).all(|w| w[0] <= w[1]), "{checked:?}");
    let fits: Vec<String> = plans
        .iter()
        .filter(|p| p["fits"] == false)
        .map(key)
        .collect();
    assert_eq!(fits, ["tp1 pp1 ddp"]);
    // Rows are their flags' estimates, and sequence parallelism comes with tensor parallelism.
    for (flags, desc) in [
        (
            &["--gpus", "8", "--tp", "8", "--sp"][..],
            "dtensor tensor parallel 8 + sequence parallel over 8 GPUs",
        ),
        (
            &["--gpus", "8", "--tp", "2", "--sp", "--pp", "4"][..],
            "dtensor tensor parallel 2 + sequence parallel; no data parallelism; pipeline of 4 stages (1F1B, 4 micro-batches)",
        ),
        (
            &["--gpus", "8", "--tp", "4", "--sp", "--fsdp", "full-shard"][..],
            "dtensor tensor parallel 4 + sequence parallel; FSDP full-shard over 2 data-parallel ranks",
        ),
    ] {
        let row = plans
            .iter()
            .find(|p| p["description"] == desc)
            .unwrap_or_else(|| panic!("{desc}"));
        let r = report(&[&base[..], flags].concat());
        assert_eq!(row["peak_bytes"], r["peak_bytes"], "{desc}");
        assert_eq!(r["parallel"]["description"], desc);
    }
}

/// `--min-gpus` tries tensor and pipeline parallelism too: Llama-3-8B in bf16 with AdamW at
/// seq 4096, checkpointed, under 40 GB per GPU (the plan given is DDP, which shards nothing:
/// it never fits on data parallelism alone, ~98 GB a GPU). No 2-GPU plan fits (TP 2:
/// 41,728,714,128 B; PP 2: 41,202,000,460 B); on 4 GPUs TP 4 + SP checks 21,916,394,896 B,
/// below TP 2 × PP 2 (23,753,433,676 B) and PP 4 (25,887,818,028 B), and is the answer. With
/// `--pp 4` given only that degree is searched (4 GPUs, 25,887,818,028 B); with `--tp 2`
/// given there is none (DDP: more ranks shard nothing).
#[test]
fn min_gpus_varies_tensor_and_pipeline_parallelism() {
    let base = [
        "examples/hf/llama-3-8b.json",
        "--seq",
        "4096",
        "--batch",
        "1",
        "--optim",
        "adamw",
        "--dtype",
        "bf16",
        "--checkpoint",
        "--device",
        "cpu",
        "--budget",
        "40GB",
        "--min-gpus",
    ];
    let r = report(&base);
    assert_eq!(r["parallel"]["min_gpus"]["gpus"], 4);
    assert_eq!(
        r["parallel"]["description"],
        "dtensor tensor parallel 4 + sequence parallel over 4 GPUs"
    );
    assert_eq!(u(&r["budget"], "checked_bytes"), 21_916_394_896);
    let r = report(&[&base[..], &["--pp", "4"]].concat());
    assert_eq!(r["parallel"]["min_gpus"]["gpus"], 4);
    assert_eq!(u(&r["budget"], "checked_bytes"), 25_887_818_028);
    let r = report(&[&base[..], &["--tp", "2", "--sp"]].concat());
    assert_eq!(r["parallel"]["min_gpus"]["gpus"], Value::Null);
}

/// DeepSpeed ZeRO-3's prefetch (`PartitionedParameterCoordinator.fetch_sub_module`), by hand
/// on `examples/mlp.toml` in float32 over 2 GPUs: fc1 `[2000, 1000]` + 2,000 (2,002,000
/// elements, 8,008,000 B), fc2 `[1000, 2000]` + 1,000 (2,001,000, 8,004,000 B), fc3
/// `[100, 1000]` + 100 (100,100, 400,400 B), a reduce bucket of 1,000 elements (4,000 B, all
/// step), `stage3_max_reuse_distance` 0 (each layer released after its forward but the last)
/// and `stage3_param_persistence_threshold` 0 (nothing persistent). Each layer's start, in
/// forward and in backward (the ReLUs too), prefetches.
/// - No prefetch bucket: the most gathered at once is fc1 alone: 8,012,000 B with the bucket.
/// - A bucket of 1 element: each prefetch starts the next parameter of the queue not available
///   (one is ≥ 1 element: it stops there). Backward reaches fc2 with fc1's weight prefetched by
///   the ReLU before it and its bias by fc2: fc2 and fc1 whole, 16,016,000 B.
/// - `stage3_max_live_parameters` 2,001,000 too: a prefetch has room only while less is
///   gathered. The most is at fc3's forward: fc3 (100,100 elements available) prefetches fc2's
///   weight, next in the backward order: 8,400,400 B, 8,404,400 with the bucket.
/// - The default bucket (5e7): fc1's fetch gathers the whole model, 16,416,400 B.
#[test]
fn zero3_prefetch_bucket_and_max_live() {
    let src = std::fs::read_to_string(crate::common::path("examples/mlp.toml")).unwrap();
    let comm = |bucket: u64, max_live: u64| {
        let flags = memest::parallel::PlanFlags {
            gpus: Some(2),
            zero: Some(3),
            reduce_bucket_size: Some(1_000),
            ..memest::parallel::PlanFlags::default()
        };
        let mut plan = flags.resolve().unwrap().unwrap();
        let memest::parallel::Sharding::Zero(z) = &mut plan.sharding else {
            panic!("ZeRO")
        };
        z.max_reuse_distance_elems = 0;
        z.param_persistence_threshold = 0;
        z.prefetch_bucket_elems = bucket;
        z.max_live_parameters = max_live;
        let overrides = memest::settings::Overrides {
            dtype: Some(memest::dtype::DType::Float32),
            device: Some(memest::settings::Device::Cpu),
            parallel: Some(plan),
            ..Default::default()
        };
        let r =
            memest::estimate(&src, memest::spec::Format::Toml, "mlp", &overrides, None).unwrap();
        r.category_max.comm_buffers_bytes
    };
    assert_eq!(comm(0, 1_000_000_000), 8_008_000 + 4_000);
    assert_eq!(comm(1, 1_000_000_000), 8_004_000 + 8_008_000 + 4_000);
    assert_eq!(comm(1, 2_001_000), 400_400 + 8_000_000 + 4_000);
    assert_eq!(
        comm(50_000_000, 1_000_000_000),
        8_008_000 + 8_004_000 + 400_400 + 4_000
    );
}
