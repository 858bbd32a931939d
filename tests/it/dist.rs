//! Several GPUs, per rank, against the measured cases of `tests/data/reference-dist.json`
//! (copied verbatim from `../shared/groundtruth/`, measured by its `measure_dist.py`: the tiny
//! Llama in float32, batch 2 per rank, seq 128, AdamW, world 2, CPU processes with gloo).
//! `dist-cases-cli.json` says how each case is asked of memest. `extra-reference-dist.json` holds
//! more plans measured the same way (`tools/dist_cases.json`: DDP with
//! `gradient_as_bucket_view`, FSDP2 without `reshard_after_forward`, FSDP2 with a bfloat16
//! `MixedPrecisionPolicy` (with and without `reshard_after_forward`, and on the MLP), world 4;
//! FSDP2 with two micro-batches of gradient accumulation
//! (`"grad_accum": 2`, saved activations of the last micro-batch), with and without
//! `reshard_after_forward`; a three-layer MLP under one FSDP2 unit with and without
//! accumulation; a three-layer convolutional net with Adafactor under DDP and FSDP2; DDP's
//! `bucket_cap_mb` at its default, 0.25 and 100 MiB, each with and without
//! `gradient_as_bucket_view`, on a three-layer MLP, and at 4 MiB on the tiny Llama), with the
//! same checks.
//!
//! Per case, the rank with the largest peak is compared:
//! - model states to the byte: parameters (this rank's shard), optimizer state, master weights
//!   (DeepSpeed's float32 partitions: `master_params_bytes`, which ZeRO-3 measures as
//!   `fp32_partitioned_groups_flat`), gradients (`.grad`, or ZeRO-3's
//!   `grad_partitions_flat_buffer`; ZeRO-1/2 free their gradient partition after the step, so
//!   there is nothing measured to compare);
//! - DDP's gradient buckets, bucket by bucket: as constructed and as rebuilt at the second
//!   iteration (the Reducer's `bucket_sizes` and `rebuilt_bucket_sizes` logging data);
//! - saved activations within 1 %;
//! - the peak (`peak_without_gloo_scratch`: gloo's collectives make a full-size scratch copy
//!   that NCCL does not) within 5 %, or, for the plans whose peak memest does not reach yet,
//!   within the allowance in `PEAK_GAPS` (the error when it was set plus 1 point), so that a
//!   regression fails and an improvement shows.

use serde_json::Value;

use crate::common::{err_pct, path, report, u};

/// Saved activations, per the issue: within 1 %.
const ACT_TOL_PCT: f64 = 1.0;
/// The peak, per the issue: within 5 %.
const PEAK_TOL_PCT: f64 = 5.0;
/// Plans whose peak is not within 5 % yet: case, allowed |error| in percent, and why.
const PEAK_GAPS: &[(&str, f64, &str)] = &[];

fn load(rel: &str) -> Value {
    let text = std::fs::read_to_string(path(rel)).expect("test data");
    serde_json::from_str(&text).expect("JSON")
}

fn get(v: &Value, pointer: &str) -> u64 {
    v.pointer(pointer).and_then(Value::as_u64).unwrap_or(0)
}

/// One row per case: memest's figure beside the measured one.
#[test]
fn measured_ranks() {
    let cases = load("tests/data/dist-cases-cli.json");
    let mut records = load("tests/data/reference-dist.json")
        .as_array()
        .expect("list")
        .clone();
    records.extend(
        load("tests/data/extra-reference-dist.json")
            .as_array()
            .expect("list")
            .iter()
            .cloned(),
    );
    let mut failures = Vec::new();
    let mut table = String::new();
    for rec in &records {
        let id = rec["id"].as_str().expect("id");
        let Some(args) = cases.get(id).and_then(Value::as_array) else {
            // The tensor-parallel case is checked in tests/it/tp.rs.
            assert_eq!(
                rec["case"]["parallel"]["kind"], "tp",
                "{id} has no command line"
            );
            continue;
        };
        let args: Vec<&str> = args.iter().map(|a| a.as_str().expect("arg")).collect();
        let r = report(&args);
        let rank = rec["ranks"]
            .as_array()
            .expect("ranks")
            .iter()
            .max_by_key(|k| get(k, "/peak_without_gloo_scratch"))
            .expect("a rank");
        let ds = |name: &str| get(rank, &format!("/deepspeed_optimizer_tensors/{name}"));
        let mut exact = vec![
            (
                "parameters_bytes",
                u(&r, "parameters_bytes"),
                get(rank, "/params/bytes"),
            ),
            (
                "optimizer_state_bytes",
                u(&r, "optimizer_state_bytes"),
                get(rank, "/optimizer_state_bytes"),
            ),
            (
                "master_weights_bytes",
                u(&r, "master_weights_bytes"),
                get(rank, "/master_params_bytes") + ds("fp32_partitioned_groups_flat"),
            ),
        ];
        let kind = rec["case"]["parallel"]["kind"].as_str().expect("kind");
        let stage = get(rec, "/case/parallel/stage");
        if kind != "deepspeed" {
            exact.push((
                "gradients_bytes",
                u(&r, "gradients_bytes"),
                get(rank, "/grads_bytes"),
            ));
        } else if stage == 3 {
            exact.push((
                "gradients_bytes",
                u(&r, "gradients_bytes"),
                ds("grad_partitions_flat_buffer"),
            ));
        }
        if let Some(cap) = rec["case"]["parallel"]["bucket_cap_mb"].as_f64() {
            let said = format!("{cap} MiB buckets");
            let description = r["parallel"]["description"].as_str().expect("description");
            if !description.contains(&said) {
                failures.push(format!("{id}: {description:?} does not say {said:?}"));
            }
        }
        if kind == "ddp" {
            // DDP's buckets, bucket by bucket, as the Reducer's logging data lists them.
            let measured = |key: &str| -> Vec<u64> {
                rank["ddp_buckets"][key]
                    .as_str()
                    .unwrap_or_else(|| panic!("{id}: no measured ddp_buckets.{key}"))
                    .split(',')
                    .map(|b| b.trim().parse().expect("bytes"))
                    .collect()
            };
            let est = |key: &str| -> Vec<u64> {
                r["parallel"]["ddp_buckets"][key]
                    .as_array()
                    .unwrap_or_else(|| panic!("{id}: no parallel.ddp_buckets.{key}"))
                    .iter()
                    .map(|b| b.as_u64().expect("bytes"))
                    .collect()
            };
            for (field, key) in [
                ("initial_bytes", "bucket_sizes"),
                ("rebuilt_bytes", "rebuilt_bucket_sizes"),
            ] {
                let (e, m) = (est(field), measured(key));
                table.push_str(&format!("{id:32} buckets {field:16} {e:?} {m:?}\n"));
                if e != m {
                    failures.push(format!("{id}: DDP buckets {field} {e:?} != measured {m:?}"));
                }
            }
        }
        for (field, est, truth) in exact {
            table.push_str(&format!("{id:32} {field:24} {est:>12} {truth:>12}\n"));
            if est != truth {
                failures.push(format!("{id}: {field} {est} != measured {truth}"));
            }
        }
        let act = (
            u(&r, "activations_bytes"),
            get(rank, "/saved_activations_bytes"),
        );
        let act_err = err_pct(act.0, act.1);
        let peak = (u(&r, "peak_bytes"), get(rank, "/peak_without_gloo_scratch"));
        let peak_err = err_pct(peak.0, peak.1);
        table.push_str(&format!(
            "{id:32} activations {:>12} {:>12} {act_err:+.2}%\n{id:32} peak        {:>12} {:>12} {peak_err:+.2}%\n",
            act.0, act.1, peak.0, peak.1
        ));
        if act_err.abs() > ACT_TOL_PCT {
            failures.push(format!(
                "{id}: activations {act_err:+.2}% (tolerance {ACT_TOL_PCT}%)"
            ));
        }
        let allowed = PEAK_GAPS
            .iter()
            .find(|g| g.0 == id)
            .map_or(PEAK_TOL_PCT, |g| g.1);
        if peak_err.abs() > allowed {
            failures.push(format!("{id}: peak {peak_err:+.2}% (allowed {allowed}%)"));
        }
        if allowed > PEAK_TOL_PCT && peak_err.abs() <= PEAK_TOL_PCT {
            failures.push(format!(
                "{id}: peak {peak_err:+.2}% is within {PEAK_TOL_PCT}%: remove its PEAK_GAPS entry"
            ));
        }
    }
    eprintln!("{table}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Adafactor on DTensor parameters (FSDP2, DTensor tensor parallelism): PyTorch 2.15's
/// `torch.optim.Adafactor` raises on a sharded 2-D DTensor (measured with gloo on two CPU
/// ranks, foreach and for-loop: "in-place operations that require placement changes are not
/// supported"), so memest refuses it, naming the optimizer; plain (DDP, FSDP no-shard,
/// Megatron-style TP) and flat (DeepSpeed ZeRO) parameters step. `--plan auto` leaves the
/// refused plans out.
#[test]
fn adafactor_refuses_sharded_2d_dtensors() {
    use memest::parallel::{FsdpStrategy, PlanFlags, TpStyle};
    let src = std::fs::read_to_string(path("examples/llama_tiny.toml")).unwrap();
    let run = |flags: &PlanFlags| {
        let overrides = memest::settings::Overrides {
            seq: Some(64),
            optimizer: Some(memest::settings::Optimizer::Adafactor),
            device: Some(memest::settings::Device::Cpu),
            parallel: flags.resolve().unwrap(),
            ..Default::default()
        };
        memest::estimate(&src, memest::spec::Format::Toml, "llama", &overrides, None)
    };
    let gpus = |n| PlanFlags {
        gpus: Some(n),
        ..PlanFlags::default()
    };
    let fsdp = |s, node| PlanFlags {
        fsdp: Some(s),
        gpus_per_node: node,
        ..gpus(2)
    };
    let tp = |style| PlanFlags {
        tp: Some(2),
        tp_style: Some(style),
        ..PlanFlags::default()
    };
    for refused in [
        fsdp(FsdpStrategy::FullShard, None),
        fsdp(FsdpStrategy::ShardGradOp, None),
        // One GPU per node: a (2, 1) mesh, still DTensors.
        fsdp(FsdpStrategy::HybridShard, Some(1)),
        tp(TpStyle::Dtensor),
    ] {
        let err = run(&refused).unwrap_err();
        assert!(
            matches!(
                err,
                memest::Error::Setting(memest::error::SettingError {
                    key: memest::error::SettingKey::Optimizer,
                    ..
                })
            ),
            "{refused:?}: {err}"
        );
    }
    for stepped in [
        gpus(2),
        fsdp(FsdpStrategy::NoShard, None),
        PlanFlags {
            zero: Some(3),
            ..gpus(2)
        },
        tp(TpStyle::Megatron),
    ] {
        assert!(run(&stepped).is_ok(), "{stepped:?}");
    }
    let out = crate::common::memest(&[
        "examples/llama_tiny.toml",
        "--seq",
        "64",
        "--optim",
        "adafactor",
        "--device",
        "cpu",
        "--gpus",
        "2",
        "--plan",
        "auto",
        "--format",
        "json",
    ]);
    let plans = crate::common::json(&out);
    let names: Vec<&str> = plans["plans"]
        .as_array()
        .expect("plans")
        .iter()
        .map(|p| p["description"].as_str().expect("description"))
        .collect();
    assert!(names.iter().any(|d| d.contains("ZeRO-3")), "{names:?}");
    assert!(!names.iter().any(|d| d.contains("FSDP")), "{names:?}");
}

/// The plans the property draws from: DDP (with or without bucket views), ZeRO 0–3, FSDP
/// full-shard, shard-grad-op and no-shard.
fn plan(engine: u8, gpus: u64) -> memest::parallel::PlanFlags {
    use memest::parallel::{FsdpStrategy, PlanFlags};
    let mut f = PlanFlags {
        gpus: Some(gpus),
        ..PlanFlags::default()
    };
    match engine {
        0 => f.ddp = true,
        1 => f.gradient_as_bucket_view = true,
        2..=5 => f.zero = Some(engine - 2),
        6 => f.fsdp = Some(FsdpStrategy::FullShard),
        7 => f.fsdp = Some(FsdpStrategy::ShardGradOp),
        _ => f.fsdp = Some(FsdpStrategy::NoShard),
    }
    f
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config {
        cases: 16,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(20_261_201),
        ..proptest::test_runner::Config::default()
    })]

    /// Sharding never loses or invents bytes: on a model whose every dimension divides by the
    /// GPUs (the tiny Llama: 512, 1408, 32000 over 1–8), each model state per GPU times the ranks
    /// sharing it is the whole model's, plus the parts every rank keeps whole (Adam's 4-byte
    /// `step`, one per tensor it updates: per parameter under FSDP, one per flat partition
    /// under ZeRO); DeepSpeed's float32 master partitions add up to the float32 model; the
    /// communication buffers are their own category; and the categories at the peak add up to
    /// the peak.
    #[test]
    fn sharding_keeps_every_byte(engine in 0u8..9, log2 in 0u32..4, batch in 1u64..3) {
        let gpus = 1u64 << log2;
        let src = std::fs::read_to_string(path("examples/llama_tiny.toml")).unwrap();
        let flags = plan(engine, gpus);
        let parallel = flags.resolve().unwrap();
        let overrides = memest::settings::Overrides {
            batch: Some(batch),
            seq: Some(64),
            dtype: Some(memest::dtype::DType::Float32),
            device: Some(memest::settings::Device::Cpu),
            parallel,
            ..Default::default()
        };
        let r = memest::estimate(&src, memest::spec::Format::Toml, "llama", &overrides, None).unwrap();
        let p = r.parallel.as_ref().unwrap();
        let split = p.plan.split();
        let (whole, per) = (p.unsharded, p.per_gpu);
        let tensors = 39u64;
        let numel = r.trainable_param_count;
        proptest::prop_assert_eq!(per.parameters_bytes * split.params, whole.parameters_bytes);
        proptest::prop_assert_eq!(per.gradients_bytes * split.grads, whole.gradients_bytes);
        let zero = matches!(p.plan.sharding, memest::parallel::Sharding::Zero(z) if z.stage >= 1);
        let (steps_whole, steps_per) = if zero { (4 * tensors, 4) } else { (4 * tensors, 4 * tensors) };
        proptest::prop_assert_eq!(
            (per.optimizer_state_bytes - steps_per) * split.optimizer,
            whole.optimizer_state_bytes - steps_whole
        );
        if zero {
            proptest::prop_assert_eq!(per.master_weights_bytes * split.optimizer, 4 * numel);
        } else {
            proptest::prop_assert_eq!(per.master_weights_bytes, whole.master_weights_bytes);
        }
        // The report's top-level figures are the per-GPU ones.
        proptest::prop_assert_eq!(r.parameters_bytes, per.parameters_bytes);
        proptest::prop_assert_eq!(r.optimizer_state_bytes, per.optimizer_state_bytes);
        let parts: u64 = memest::sim::Category::ALL.iter().map(|&c| r.at_peak.get(c)).sum();
        proptest::prop_assert_eq!(parts, r.peak_bytes);
        proptest::prop_assert_eq!(p.comm_buffers_bytes, r.category_max.comm_buffers_bytes);
    }
}

/// FSDP2 with gradient accumulation: after a unit's reduce-scatter its whole gradients are
/// gone (`unsharded_param.grad = None`) and only the shard stays as `.grad`, so the second
/// micro-batch makes the whole gradients again and holds them until the unit's next
/// reduce-scatter, beside the carried shard (`foreach_reduce` then adds the new shard into
/// it). Two linears under one unit (the root), float32, 8,005,000 parameters over 2 ranks:
/// the whole gradients (32,020,000 B) with the carried shard (16,010,000 B) at the end of the
/// second backward; one micro-batch holds the whole gradients only.
#[test]
fn fsdp_accumulation_remakes_whole_gradients() {
    let at = |accum: &str| {
        report(&[
            "tests/fixtures/dist/two_linears.toml",
            "--batch",
            "1",
            "--optim",
            "sgd",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--gpus",
            "2",
            "--fsdp",
            "full-shard",
            "--grad-accum",
            accum,
        ])
    };
    assert_eq!(u(&at("1")["category_max"], "gradients_bytes"), 32_020_000);
    let two = at("2");
    assert_eq!(u(&two["category_max"], "gradients_bytes"), 48_030_000);
    assert_eq!(u(&two, "gradients_bytes"), 16_010_000);
}

/// The caching allocator under `--gpus`: each rank's figures come from replaying that rank's own
/// stream (its parameter shards, DDP's buckets, FSDP2's gathers and reduce-scatters, its part
/// of the optimizer). The references were measured on the CPU (gloo), so only their tensor
/// peak is a reference: the allocated peak must sit at most 3 % above memest's own tensor peak
/// (each tensor rounded to 512 B, and a block over 1 MiB keeps a rest of up to 1 MiB unsplit,
/// which counts as allocated: 0.4 % on the Llama without FSDP2, 1.0 to 1.5 % with it, 2.6 %
/// on the 58 MB MLP step) and within 3 % of the measured peak where memest's tensor peak is
/// within 1 % of it. The streams differ by rank count (FSDP2's shards shrink from 2 to
/// 4 ranks), by engine (DDP holds a second, bucketed copy of the gradients that bucket views
/// fold into the gradients) and from one GPU's.
#[test]
fn the_allocator_replays_each_ranks_stream() {
    let cases = load("tests/data/dist-cases-cli.json");
    let mut records = load("tests/data/reference-dist.json")
        .as_array()
        .expect("list")
        .clone();
    records.extend(
        load("tests/data/extra-reference-dist.json")
            .as_array()
            .expect("list")
            .iter()
            .cloned(),
    );
    let cuda = |id: &str| -> Value {
        let mut args: Vec<&str> = cases[id]
            .as_array()
            .expect("args")
            .iter()
            .map(|a| a.as_str().expect("arg"))
            .collect();
        let at = args
            .iter()
            .position(|&a| a == "--device")
            .expect("--device");
        args[at + 1] = "cuda";
        report(&args)
    };
    let mut figures = std::collections::HashMap::new();
    let mut failures = Vec::new();
    for rec in &records {
        let id = rec["id"].as_str().expect("id");
        let kind = rec["case"]["parallel"]["kind"].as_str().unwrap_or("none");
        if !["none", "ddp", "fsdp2"].contains(&kind) || !cases[id].is_array() {
            continue;
        }
        let r = cuda(id);
        let (tensor, allocated, reserved) = (
            u(&r, "peak_bytes"),
            u(&r, "allocated_peak_bytes"),
            u(&r, "reserved_peak_bytes"),
        );
        let measured = rec["ranks"]
            .as_array()
            .expect("ranks")
            .iter()
            .map(|k| get(k, "/peak_without_gloo_scratch"))
            .max()
            .expect("a rank");
        // The allocated figure counts whole blocks: 512-B rounding, and a large-pool block
        // keeps a remainder under 1 MiB unsplit (`CUDACachingAllocator.cpp`, `should_split`),
        // so on a model of a few tens of MB (the MLP under mixed precision: 53 MB, with 4 MB
        // bfloat16 gradients and a 4 MB cast copy live at the peak) a couple of such
        // remainders pass 3 %: the slack allowed is 3 % or 2 MiB, whichever is larger.
        let slack = |of: u64| (of / 100 * 3).max(2 << 20);
        if !(tensor <= allocated && allocated - tensor <= slack(tensor) && allocated <= reserved) {
            failures.push(format!(
                "{id}: tensor {tensor} <= allocated {allocated} (+3 % or 2 MiB at most) <= reserved {reserved}"
            ));
        }
        if err_pct(tensor, measured).abs() <= 1.0 && allocated.abs_diff(measured) > slack(measured)
        {
            failures.push(format!(
                "{id}: allocated {allocated} is {:+.2}% from the measured peak {measured}",
                err_pct(allocated, measured)
            ));
        }
        figures.insert(
            id.to_string(),
            (allocated, u(&r, "gradients_bytes"), tensor),
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let a = |id: &str| figures[id].0;
    // DDP's buckets (a second copy of the gradients, live all step) beside the gradients, to
    // within the allocator's slack: a large-pool block keeps a remainder under 1 MiB unsplit
    // (`CUDACachingAllocator.cpp`, `should_split`), so the one-process run's blocks can hold
    // more than DDP's, whose rebuilt buckets are cut from the freed construction bucket
    // (176,179,200 B): at most what its blocks hold beyond its tensors at its peak (allocated
    // less the tensor peak: 3,147,004 B, the allocated figure being measure_fake_cuda.py's
    // replay to the byte, 917,863,936 B).
    let grads = figures["llama-fp32-b2s128-ddp-w2"].1;
    let (none_allocated, _, none_tensor) = figures["llama-fp32-b2s128-none"];
    assert!(
        a("llama-fp32-b2s128-ddp-w2") + (none_allocated - none_tensor) >= none_allocated + grads,
        "{figures:?}"
    );
    // Bucket views: the gradients are the buckets.
    assert!(
        a("llama-fp32-b2s128-ddp-view-w2").abs_diff(a("llama-fp32-b2s128-none")) < 1 << 20,
        "{figures:?}"
    );
    // FSDP2: smaller shards on more ranks.
    assert!(
        a("llama-fp32-b2s128-fsdp2-w4") < a("llama-fp32-b2s128-fsdp2-w2"),
        "{figures:?}"
    );
    assert!(
        a("llama-fp32-b2s128-fsdp2-w2") < a("llama-fp32-b2s128-none"),
        "{figures:?}"
    );
}

/// `--budget` and `--max-batch` are per GPU: the tiny Llama in float32 (seq 128, AdamW, CPU)
/// under a 700 MiB budget fits no batch on one GPU (batch 1 already needs more), 3 per GPU
/// under FSDP full-shard on 2 GPUs and 5 on 4 (smaller shards). At the batch found, each GPU's
/// figure is within the budget, one more is over it.
#[test]
fn max_batch_is_per_gpu() {
    let base = [
        "examples/llama_tiny.toml",
        "--seq",
        "128",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--budget",
        "700MiB",
    ];
    // Exit 1 when over budget: the report is on stdout all the same.
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = base.to_vec();
        args.extend(extra);
        args.extend(["--format", "json"]);
        let out = crate::common::memest(&args);
        serde_json::from_slice(&out.stdout).expect("a JSON report")
    };
    assert_eq!(u(&run(&["--max-batch"]), "max_batch"), 0);
    for (gpus, found) in [("2", 3u64), ("4", 5)] {
        let plan = ["--gpus", gpus, "--fsdp", "full-shard"];
        let mut extra = plan.to_vec();
        extra.push("--max-batch");
        let r = run(&extra);
        assert_eq!(u(&r, "max_batch"), found, "{gpus} GPUs");
        assert!(r["budget"]["fits"].as_bool().expect("fits"), "{gpus} GPUs");
        let next = (found + 1).to_string();
        let mut extra = plan.to_vec();
        extra.extend(["--batch", next.as_str()]);
        let over = run(&extra);
        assert!(
            !over["budget"]["fits"].as_bool().expect("fits"),
            "{gpus} GPUs"
        );
        assert!(u(&over, "peak_bytes") > 700 << 20, "{gpus} GPUs");
    }
}
