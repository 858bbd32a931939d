//! Pipeline and expert parallelism.
//!
//! Pipeline stages against `tests/data/reference-pp.json`, measured by `tools/measure_dist.py`
//! (its `pp` kind: `torch.distributed.pipelining` over gloo, one CPU process per pipeline rank,
//! `ScheduleGPipe` or `Schedule1F1B` with one `PipelineStage` per rank, or
//! `ScheduleInterleaved1F1B` with two per rank, `return_outputs=False`; the tiny Llama of
//! `examples/llama_tiny.toml` in float32, micro-batches of 2 × 128 tokens, AdamW; cases in
//! `tools/pp_cases.json`).
//! `pp-cases-cli.json` says how each case is asked of memest. Per stage (pipeline rank):
//! parameters, gradients and optimizer state to the byte; what one micro-batch saves for
//! backward within 1 %; the peak within 5 %.

use serde_json::Value;

use crate::common::{err_pct, memest, path, report, u};

/// What one micro-batch saves, per the issue: within 1 %.
const ACT_TOL_PCT: f64 = 1.0;
/// Each stage's peak, per the issue: within 5 %.
const PEAK_TOL_PCT: f64 = 5.0;

fn load(rel: &str) -> Value {
    let text = std::fs::read_to_string(path(rel)).expect("test data");
    serde_json::from_str(&text).expect("JSON")
}

fn get(v: &Value, pointer: &str) -> u64 {
    v.pointer(pointer).and_then(Value::as_u64).unwrap_or(0)
}

/// Every measured stage, figure by figure.
#[test]
fn measured_stages() {
    let cases = load("tests/data/pp-cases-cli.json");
    let records = load("tests/data/reference-pp.json");
    let mut failures = Vec::new();
    let mut table = String::new();
    for rec in records.as_array().expect("list") {
        let id = rec["id"].as_str().expect("id");
        let args: Vec<&str> = cases[id]
            .as_array()
            .unwrap_or_else(|| panic!("{id} has no command line"))
            .iter()
            .map(|a| a.as_str().expect("arg"))
            .collect();
        let r = report(&args);
        let stages = r["parallel"]["stages"].as_array().expect("stages");
        let ranks = rec["ranks"].as_array().expect("ranks");
        assert_eq!(stages.len(), ranks.len(), "{id}: one stage per rank");
        for rank in ranks {
            let k = get(rank, "/rank");
            let s = &stages[usize::try_from(k).expect("rank")];
            // One stage per rank, or (interleaved) the rank's chunks, each `[lo, hi)`.
            let layers = &rank["pp"]["layers"];
            let chunks = if layers[0].is_array() {
                layers.clone()
            } else {
                serde_json::json!([layers])
            };
            assert_eq!(s["blocks"], chunks, "{id} stage {k}");
            for (field, est, truth) in [
                (
                    "parameters",
                    get(s, "/model_states/parameters_bytes"),
                    get(rank, "/params/bytes"),
                ),
                (
                    "gradients",
                    get(s, "/model_states/gradients_bytes"),
                    get(rank, "/grads_bytes"),
                ),
                (
                    "optimizer state",
                    get(s, "/model_states/optimizer_state_bytes"),
                    get(rank, "/optimizer_state_bytes"),
                ),
            ] {
                table.push_str(&format!("{id:34} {k} {field:16} {est:>12} {truth:>12}\n"));
                if est != truth {
                    failures.push(format!("{id} stage {k}: {field} {est} != measured {truth}"));
                }
            }
            let act = (
                get(s, "/saved_per_micro_batch_bytes"),
                get(rank, "/pp/saved_activations_bytes_per_micro_batch"),
            );
            let peak = (
                get(s, "/peak_bytes"),
                get(rank, "/peak_without_gloo_scratch"),
            );
            let (ae, pe) = (err_pct(act.0, act.1), err_pct(peak.0, peak.1));
            table.push_str(&format!(
                "{id:34} {k} saved/mb {:>12} {:>12} {ae:+.2}%\n{id:34} {k} peak     {:>12} {:>12} {pe:+.2}%\n",
                act.0, act.1, peak.0, peak.1
            ));
            if ae.abs() > ACT_TOL_PCT {
                failures.push(format!("{id} stage {k}: saved per micro-batch {ae:+.2}%"));
            }
            if pe.abs() > PEAK_TOL_PCT {
                failures.push(format!("{id} stage {k}: peak {pe:+.2}%"));
            }
        }
        // The report's own figures are the worst stage's.
        let worst = stages.iter().map(|s| get(s, "/peak_bytes")).max();
        assert_eq!(Some(u(&r, "peak_bytes")), worst, "{id}");
    }
    eprintln!("{table}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The schedules' micro-batches in flight: GPipe all `M`; 1F1B `min(M, P − s)`; Megatron's
/// interleaved schedule on the first rank holds `L·(1 + (P − 1)/(P·V))` layers' worth
/// (Korthikanti et al. 2022, §4.2.3) for `L/P` layers per rank of `L/(P·V)` per chunk.
#[test]
fn micro_batches_in_flight() {
    use memest::parallel::{Pipeline, Schedule};
    let p = |schedule, m, v| Pipeline {
        stages: 4,
        schedule,
        micro_batches: m,
        virtual_stages: v,
    };
    let gpipe = p(Schedule::Gpipe, 8, 1);
    assert!((0..4).all(|s| gpipe.in_flight(s, 0) == 8));
    let one = p(Schedule::OneFOneB, 8, 1);
    assert_eq!(
        (0..4).map(|s| one.in_flight(s, 0)).collect::<Vec<_>>(),
        [4, 3, 2, 1]
    );
    // Fewer micro-batches than stages: all of them.
    assert_eq!(p(Schedule::OneFOneB, 2, 1).in_flight(0, 0), 2);
    // Interleaved, P = 4, V = 2, M = 8: rank 0 runs (4 − 1)·2 + (2 − 1)·4 = 10 warm-up
    // forwards, then one more: 11 chunk micro-batches (chunk 0: 4 + 3, chunk 1: 4).
    let inter = p(Schedule::Interleaved, 8, 2);
    assert_eq!((inter.in_flight(0, 0), inter.in_flight(0, 1)), (7, 4));
    // Korthikanti: chunk micro-batches of L/(P·V) layers adding up to L·(1 + (P − 1)/(P·V)),
    // i.e. P·V + P − 1 = 11 of them.
    let chunks: u64 = (0..2).map(|k| inter.in_flight(0, k)).sum();
    assert_eq!(chunks, 4 * 2 + (4 - 1));
    // The last rank: (2 − 1)·4 = 4 warm-up forwards, then one more.
    assert_eq!((inter.in_flight(3, 0), inter.in_flight(3, 1)), (4, 1));
}

/// The stages hold the whole model between them: their parameters, gradients and optimizer
/// state add up to the model's, for every split of the tiny Llama's 4 decoder layers.
#[test]
fn stages_hold_the_whole_model() {
    for pp in ["2", "3", "4"] {
        let r = report(&[
            "examples/llama_tiny.toml",
            "--batch",
            "1",
            "--seq",
            "32",
            "--dtype",
            "float32",
            "--pp",
            pp,
        ]);
        let p = &r["parallel"];
        let stages = p["stages"].as_array().expect("stages");
        assert_eq!(stages.len().to_string(), pp);
        for key in [
            "parameters_bytes",
            "gradients_bytes",
            "optimizer_state_bytes",
        ] {
            let sum: u64 = stages
                .iter()
                .map(|s| get(s, &format!("/model_states/{key}")))
                .sum();
            assert_eq!(
                sum,
                get(p, &format!("/unsharded/{key}")),
                "--pp {pp}: {key}"
            );
        }
        // Blocks in order, all of them, each once.
        let mut next = 0;
        for s in stages {
            assert_eq!(get(s, "/blocks/0/0"), next);
            next = get(s, "/blocks/0/1");
        }
        assert_eq!(next, 4);
    }
}

/// More stages than decoder layers, or GPUs that the pipeline does not divide, are bad input.
#[test]
fn pipeline_errors() {
    for (args, needle) in [
        (&["--pp", "5"][..], "needs at least 5 repeated blocks"),
        (
            &["--gpus", "3", "--pp", "2"][..],
            "not a multiple of --pp 2",
        ),
        (
            &["--pp", "2", "--virtual-stages", "2"][..],
            "--schedule interleaved",
        ),
        (
            &[
                "--pp",
                "2",
                "--schedule",
                "interleaved",
                "--virtual-stages",
                "4",
            ][..],
            "needs at least 8 repeated blocks",
        ),
    ] {
        let mut all = vec!["examples/llama_tiny.toml"];
        all.extend(args);
        let out = memest(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// Expert parallelism on Mixtral-8x7B (`examples/hf/mixtral-8x7b.json`: hidden 4096, 14336
/// per expert, 32 layers, 8 experts, 32 heads, 8 KV heads, vocab 32000, untied), bfloat16,
/// AdamW, 8 GPUs with `--ep 8`: each GPU keeps 1 of the 8 experts of every layer and the rest
/// whole.
///
/// - Experts: 3 · 4096 · 14336 = 176,160,768 elements each, 8 per layer, 32 layers:
///   45,097,156,608 in all, 5,637,144,576 per GPU.
/// - The rest: embeddings and head 2 · 32000 · 4096 = 262,144,000; per layer attention
///   4096 · (4096 + 1024 + 1024 + 4096) = 41,943,040, router 4096 · 8 = 32,768 and two norms
///   8,192 (41,984,000; 1,343,488,000 for 32); the final norm 4,096: 1,605,636,096.
/// - Per GPU 7,242,780,672 elements: 14,485,561,344 bytes of parameters and as many of
///   gradients; AdamW keeps two bfloat16 moments per element and a float32 `step` per tensor
///   (291: 9 per layer and 3 outside), 28,971,122,688 + 1,164 bytes.
#[test]
fn mixtral_expert_parallel_model_states() {
    let r = report(&[
        "examples/hf/mixtral-8x7b.json",
        "--batch",
        "1",
        "--seq",
        "256",
        "--dtype",
        "bfloat16",
        "--optim",
        "adamw",
        "--gpus",
        "8",
        "--ep",
        "8",
    ]);
    let p = &r["parallel"];
    let per_gpu = 1_605_636_096u64 + 45_097_156_608 / 8;
    assert_eq!(get(p, "/per_gpu/parameters_bytes"), 2 * per_gpu);
    assert_eq!(get(p, "/per_gpu/gradients_bytes"), 2 * per_gpu);
    assert_eq!(
        get(p, "/per_gpu/optimizer_state_bytes"),
        4 * per_gpu + 4 * 291
    );
    // One GPU alone would hold every expert.
    let whole = 1_605_636_096u64 + 45_097_156_608;
    assert_eq!(get(p, "/unsharded/parameters_bytes"), 2 * whole);
    assert_eq!(get(p, "/unsharded/gradients_bytes"), 2 * whole);
    assert_eq!(u(&r, "gradients_bytes"), 2 * per_gpu);
}

/// GPT-OSS under `--ep 2`: each rank keeps half of every expert weight and half of the
/// experts' biases. The tiny config, by hand: per layer gate_up 4·256·256 + its bias 4·256,
/// down 4·128·256 + its bias 4·256 = 395_264 expert parameters; two layers in float32 are
/// 3_162_112 B, half of it (1_581_056 B) on another rank; 6_802_496 B in all.
#[test]
fn gpt_oss_expert_parallel_divides_the_expert_biases() {
    let r = report(&[
        "tests/fixtures/hf/gpt_oss_tiny.json",
        "--seq",
        "64",
        "--gpus",
        "4",
        "--ep",
        "2",
    ]);
    let p = &r["parallel"];
    assert_eq!(get(p, "/unsharded/parameters_bytes"), 6_802_496);
    assert_eq!(
        get(p, "/per_gpu/parameters_bytes"),
        6_802_496 - 3_162_112 / 2
    );
}

/// A capacity factor pads every expert's rows to its capacity: at 2.0 the experts run on
/// twice the routed rows, so they save more than dropless; the all-to-all buffers are
/// communication buffers; `--ep` needs experts that divide and a model that has them.
#[test]
fn expert_capacity_and_errors() {
    let base = [
        "tests/fixtures/hf/qwen3_moe_tiny.json",
        "--batch",
        "2",
        "--seq",
        "64",
        "--dtype",
        "float32",
        "--gpus",
        "2",
        "--ep",
        "2",
    ];
    let dropless = report(&base);
    let mut padded = base.to_vec();
    padded.extend(["--capacity-factor", "2.0"]);
    let padded = report(&padded);
    assert!(u(&padded, "activations_bytes") > u(&dropless, "activations_bytes"));
    assert!(get(&dropless, "/category_max/comm_buffers_bytes") > 0);
    for (args, needle) in [
        (
            &["examples/llama_tiny.toml", "--gpus", "2", "--ep", "2"][..],
            "this model has none",
        ),
        (
            &[
                "tests/fixtures/hf/qwen3_moe_tiny.json",
                "--gpus",
                "3",
                "--ep",
                "3",
            ][..],
            "do not divide",
        ),
        (
            &[
                "examples/llama_tiny.toml",
                "--gpus",
                "2",
                "--ep",
                "2",
                "--zero",
                "2",
            ][..],
            "not modelled yet",
        ),
    ] {
        let out = memest(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config {
        cases: 10,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(20_261_203),
        ..proptest::test_runner::Config::default()
    })]

    /// Pipeline stages with a data-parallel engine inside each never lose or invent bytes: for
    /// random plans of the tiny Llama (float32, AdamW; 4 blocks over `pp` ∈ {2, 4} stages;
    /// `dp` ∈ {1, 2, 4} data-parallel ranks, each of whose dimensions divides by them) the
    /// stages' per-GPU model states, summed over the stages, are the whole model's under DDP;
    /// under FSDP full-shard they are its `dp`-th part, less each rank's own AdamW `step` (4
    /// bytes for each of the 39 parameter tensors, kept whole on every rank): `Σ params · dp
    /// = whole`, `Σ grads · dp = whole`, `Σ state · dp = whole + 156 · (dp − 1)`; the report's
    /// peak is the worst stage's, and its categories at the peak add up to it.
    #[test]
    fn pipeline_stages_keep_every_byte(log_pp in 1u32..3, log_dp in 0u32..3, fsdp in proptest::bool::ANY) {
        let (pp, dp) = (1u64 << log_pp, 1u64 << log_dp);
        let gpus = (pp * dp).to_string();
        let pps = pp.to_string();
        let mut args = vec![
            "examples/llama_tiny.toml", "--batch", "1", "--seq", "32", "--dtype", "float32",
            "--optim", "adamw", "--device", "cpu", "--gpus", &gpus, "--pp", &pps,
        ];
        if fsdp {
            args.extend(["--fsdp", "full-shard"]);
        }
        let r = report(&args);
        let p = &r["parallel"];
        let stages = p["stages"].as_array().expect("stages");
        proptest::prop_assert_eq!(stages.len() as u64, pp);
        let sum = |key: &str| -> u64 {
            stages.iter().map(|s| get(s, &format!("/model_states/{key}"))).sum()
        };
        let whole = |key: &str| get(p, &format!("/unsharded/{key}"));
        let n = if fsdp { dp } else { 1 };
        proptest::prop_assert_eq!(sum("parameters_bytes") * n, whole("parameters_bytes"));
        proptest::prop_assert_eq!(sum("gradients_bytes") * n, whole("gradients_bytes"));
        proptest::prop_assert_eq!(
            sum("optimizer_state_bytes") * n,
            whole("optimizer_state_bytes") + 156 * (n - 1)
        );
        let worst = stages.iter().map(|s| get(s, "/peak_bytes")).max();
        proptest::prop_assert_eq!(Some(u(&r, "peak_bytes")), worst);
        let parts: u64 = r["at_peak"]
            .as_object()
            .expect("at_peak")
            .values()
            .filter_map(Value::as_u64)
            .sum();
        proptest::prop_assert_eq!(parts, u(&r, "peak_bytes"));
    }
}
