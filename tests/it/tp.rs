//! Tensor, sequence and context parallelism (`--tp`, `--sp`, `--cp`, `--tp-style`).
//!
//! - [`measured_tensor_parallel_ranks`]: DTensor tensor-parallel steps measured per rank
//!   (`tools/measure_dist.py` on `tools/tp_cases.json`: `parallelize_module` with
//!   `ColwiseParallel`/`RowwiseParallel`/`SequenceParallel`, gloo on the CPU, one process per
//!   rank), kept in `tests/data/tp-reference-dist.json`, and the tensor-parallel case of
//!   `reference-dist.json`; `tp-cases-cli.json` says how each is asked of memest.
//! - [`korthikanti_activations_per_layer`]: the cross-check against Korthikanti et al. 2022.
//! - [`splitting_keeps_every_byte`]: the property that tensor and context parallelism never
//!   lose or invent bytes.

use memest::parallel::{PlanFlags, TpStyle};
use memest::report::Report;
use memest::settings::{Device, Overrides};
use serde_json::Value;

use crate::common::{err_pct, path, report, u};

fn load(rel: &str) -> Value {
    let text = std::fs::read_to_string(path(rel)).expect("test data");
    serde_json::from_str(&text).expect("JSON")
}

fn get(v: &Value, pointer: &str) -> u64 {
    v.pointer(pointer).and_then(Value::as_u64).unwrap_or(0)
}

/// Per case, the rank with the largest peak (every rank measured the same here): parameters,
/// gradients and optimizer state to the byte, saved activations within 1 %, the peak
/// (`peak_without_gloo_scratch`) within 5 %.
///
/// What memest gives on these cases (measured → memest):
///
/// | case | parameters | gradients | activations | peak |
/// |---|---|---|---|---|
/// | Llama, TP 2 | 88,098,816 | 120,866,816 | 61,172,740 exact | 506,538,420 → 506,624,416 (+0.02 %) |
/// | Llama, TP 2 + SP | 88,098,816 | 120,866,816 | 56,449,540 exact | 506,556,852 → 506,624,416 (+0.01 %) |
/// | Llama (4 KV heads), TP 4 | 44,582,912 | 93,734,912 | 54,348,804 exact | 305,342,908 → 305,428,896 (+0.03 %) |
/// | GPT-NeoX, TP 2 | 11,359,232 | 15,455,232 | 15,036,420 exact | 73,690,272 → 73,692,308 (+0.00 %) |
/// | GPT-NeoX, TP 2 + SP | 11,359,232 | 15,455,232 | 14,113,796 exact | 72,767,648 → 72,769,684 (+0.00 %) |
///
/// The gradients exceed the parameters by half the embedding: DTensor's vocab-parallel
/// embedding gets a whole (replicated) weight gradient.
#[test]
fn measured_tensor_parallel_ranks() {
    let cases = load("tests/data/tp-cases-cli.json");
    let mut records: Vec<Value> = load("tests/data/tp-reference-dist.json")
        .as_array()
        .expect("list")
        .clone();
    records.extend(
        load("tests/data/reference-dist.json")
            .as_array()
            .expect("list")
            .iter()
            .filter(|r| r["case"]["parallel"]["kind"] == "tp")
            .cloned(),
    );
    let mut failures = Vec::new();
    let mut table = String::new();
    for rec in &records {
        let id = rec["id"].as_str().expect("id");
        let args: Vec<&str> = cases[id]
            .as_array()
            .unwrap_or_else(|| panic!("{id} has no command line"))
            .iter()
            .map(|a| a.as_str().expect("arg"))
            .collect();
        let r = report(&args);
        let rank = rec["ranks"]
            .as_array()
            .expect("ranks")
            .iter()
            .max_by_key(|k| get(k, "/peak_without_gloo_scratch"))
            .expect("a rank");
        for (field, est, truth) in [
            (
                "parameters_bytes",
                u(&r, "parameters_bytes"),
                get(rank, "/params/bytes"),
            ),
            (
                "gradients_bytes",
                u(&r, "gradients_bytes"),
                get(rank, "/grads_bytes"),
            ),
            (
                "optimizer_state_bytes",
                u(&r, "optimizer_state_bytes"),
                get(rank, "/optimizer_state_bytes"),
            ),
        ] {
            table.push_str(&format!("{id:30} {field:24} {est:>12} {truth:>12}\n"));
            if est != truth {
                failures.push(format!("{id}: {field} {est} != measured {truth}"));
            }
        }
        let act = (
            u(&r, "activations_bytes"),
            get(rank, "/saved_activations_bytes"),
        );
        let peak = (u(&r, "peak_bytes"), get(rank, "/peak_without_gloo_scratch"));
        let (act_err, peak_err) = (err_pct(act.0, act.1), err_pct(peak.0, peak.1));
        table.push_str(&format!(
            "{id:30} activations {:>12} {:>12} {act_err:+.3}%\n{id:30} peak        {:>12} {:>12} {peak_err:+.3}%\n",
            act.0, act.1, peak.0, peak.1
        ));
        if act_err.abs() > 1.0 {
            failures.push(format!("{id}: activations {act_err:+.2}% (tolerance 1%)"));
        }
        if peak_err.abs() > 5.0 {
            failures.push(format!("{id}: peak {peak_err:+.2}% (tolerance 5%)"));
        }
    }
    eprintln!("{table}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Estimates `tests/fixtures/dist/gpt3_layer.toml` (CUDA kernels: `native_dropout`'s 1-byte
/// masks, as the paper counts them) with `flags`.
fn gpt3_layer(flags: PlanFlags, selective: bool) -> Report {
    let src = std::fs::read_to_string(path("tests/fixtures/dist/gpt3_layer.toml")).expect("model");
    let overrides = Overrides {
        device: Some(Device::Cuda),
        selective_recompute: selective,
        parallel: flags.resolve().expect("plan"),
        ..Overrides::default()
    };
    memest::estimate(
        &src,
        memest::spec::Format::Toml,
        "gpt3_layer",
        &overrides,
        None,
    )
    .expect("estimate")
}

/// The transformer layer's own saved activations (the layers inside the repeated block), in
/// bytes.
fn layer_bytes(r: &Report) -> u64 {
    r.layers
        .iter()
        .filter(|l| l.path.starts_with("layers."))
        .map(|l| l.activation_bytes)
        .sum()
}

/// Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
/// §4 and table 2: the activations one GPT-3-style layer keeps for backward, in bytes at 16 bits,
/// for sequence `s`, micro-batch `b`, hidden `h`, `a` heads and tensor-parallel degree `t`:
///
/// | plan | paper | memest on `gpt3_layer.toml` (s 2048, b 1, h 12288, a 96, t 8) |
/// |---|---|---|
/// | one GPU | `sbh(34 + 5as/h)` = 114.0 sbh | 114.0013 sbh |
/// | selective recompute | `34 sbh` | 34.0013 sbh |
/// | TP | `sbh(10 + 24/t + 5as/(ht))` = 23.0 sbh | 23.0013 sbh |
/// | TP + selective | `sbh(10 + 24/t)` = 13.0 sbh | 13.0013 sbh |
/// | TP + SP | `sbh/t · (34 + 5as/h)` = 14.25 sbh | 14.2502 sbh |
/// | TP + SP + selective | `34 sbh/t` = 4.25 sbh | 4.2502 sbh |
///
/// memest sums what each operator saves; term by term against the paper (§4.1):
///
/// - LayerNorm input, 2sbh each (the paper's 4sbh): `native_layer_norm` saves its input, and
///   also its `mean` and `rstd`, float32 `[b, s, 1]` each: 8sb bytes per norm that the paper
///   leaves out. This is the whole difference, 16sb per layer = 16/h sbh = +0.0013 sbh (divided
///   by `t` under sequence parallel, where the norms see `s/t` positions).
/// - QKV input 2sbh; Q and K 4sbh; V 2sbh: the linear saves its input (the norm's output);
///   `matmul` of the heads split out of the fused projection copies Q and K to contiguous
///   `[b·a, s, h/a]` operands, which `bmm` saves, and V is saved by attention over values:
///   6sbh, as the paper.
/// - Softmax output 2as²b, its dropout mask as²b (1-byte bool on CUDA), the dropout output
///   2as²b (saved by attention over values): 5as²b, as the paper.
/// - Output projection input 2sbh (the merged heads), its dropout mask sbh: as the paper.
/// - MLP: first linear's input 2sbh, GeLU input 8sbh, second linear's input 8sbh, dropout mask
///   sbh: 19sbh, as the paper.
/// - With TP the split regions (QKV, attention, 24sbh and 5as²b) divide by `t`; the norms'
///   inputs, their outputs saved by the column-parallel linears, and the two dropout masks stay
///   whole (10sbh). With SP (Megatron style: the column-parallel linears keep their
///   sequence-sharded input) those divide by `t` too.
/// - Selective recompute checkpoints the attention core: its 5as²b are recomputed; Q, K and V
///   (read from outside the checkpoint) stay.
#[test]
fn korthikanti_activations_per_layer() {
    let (s, b, h, a, t) = (2048.0, 1.0, 12288.0, 96.0, 8.0);
    let sbh = s * b * h;
    let tp = |sp: bool| PlanFlags {
        tp: Some(8),
        sp,
        tp_style: Some(TpStyle::Megatron),
        ..PlanFlags::default()
    };
    let cases = [
        (
            "one GPU",
            PlanFlags::default(),
            false,
            34.0 + 5.0 * a * s / h,
        ),
        ("selective recompute", PlanFlags::default(), true, 34.0),
        (
            "TP",
            tp(false),
            false,
            10.0 + 24.0 / t + 5.0 * a * s / (h * t),
        ),
        ("TP + selective", tp(false), true, 10.0 + 24.0 / t),
        ("TP + SP", tp(true), false, (34.0 + 5.0 * a * s / h) / t),
        ("TP + SP + selective", tp(true), true, 34.0 / t),
    ];
    let mut failures = Vec::new();
    for (name, flags, selective, paper) in cases {
        let sp = flags.sp;
        let r = gpt3_layer(flags, selective);
        #[allow(clippy::cast_precision_loss)] // well under 2^53
        let ours = layer_bytes(&r) as f64 / sbh;
        let err = (ours - paper) / paper * 100.0;
        eprintln!("{name:22} paper {paper:8.4} sbh  memest {ours:8.4} sbh  {err:+.3}%");
        if err.abs() > 5.0 {
            failures.push(format!("{name}: {err:+.2}%"));
        }
        // The per-term account above: memest's only extra is the norms' statistics.
        let extra = if sp { 16.0 / h / t } else { 16.0 / h };
        if (ours - paper - extra).abs() > 1e-9 {
            failures.push(format!(
                "{name}: {ours} sbh is not the paper's {paper} plus the norms' statistics {extra}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Per layer (all its copies), its parameter bytes, keyed by path.
fn layer_params(r: &Report) -> std::collections::BTreeMap<&str, u64> {
    r.layers
        .iter()
        .map(|l| (l.path.as_str(), l.parameter_bytes))
        .collect()
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config {
        cases: 12,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(20_261_202),
        ..proptest::test_runner::Config::default()
    })]

    /// Tensor and context parallelism never lose or invent bytes. For random plans over the
    /// tiny Llama with 4 KV heads (every split dimension divides by the degrees: heads 8 and 4,
    /// MLP 1408, vocabulary 32000, sequence 64/128 over up to 4 × 2 ranks), against the same
    /// step on one GPU:
    ///
    /// - every layer's parameters are either whole on each rank (replicated) or exactly one
    ///   `tp`-th of them, so per-GPU parameters × `tp` = the whole model's + (`tp` − 1) × the
    ///   replicated ones, and the report's `unsharded` figures are the one-GPU ones;
    /// - gradients: the same, plus, under DTensor, the vocab-parallel embedding's whole
    ///   gradient on every rank; optimizer state (AdamW, 8 bytes per element and a 4-byte step
    ///   per tensor): per-GPU × `tp` = whole + (`tp` − 1) × (the replicated parameters' state
    ///   and every tensor's step);
    /// - activations: no layer keeps more per rank than the whole step does, and all the ranks
    ///   of a tensor- and context-parallel group together keep at least as much; under
    ///   Megatron-style sequence parallelism without context parallelism, each decoder layer's
    ///   saved bytes × `tp` are the whole step's exactly;
    /// - the categories at the peak add up to the peak, and the communication buffers are their
    ///   own category.
    #[test]
    fn splitting_keeps_every_byte(
        log_tp in 0u32..3,
        sp in proptest::bool::ANY,
        megatron in proptest::bool::ANY,
        cp in 1u64..3,
        dp in 1u64..3,
        batch in 1u64..3,
        seq in 1u64..3,
    ) {
        let tp = 1u64 << log_tp;
        let seq = 64 * seq;
        let src = std::fs::read_to_string(path("tests/fixtures/dist/llama_tiny_kv4.toml")).unwrap();
        let estimate = |flags: Option<PlanFlags>| {
            let overrides = Overrides {
                batch: Some(batch),
                seq: Some(seq),
                dtype: Some(memest::dtype::DType::Float32),
                device: Some(Device::Cpu),
                parallel: flags.and_then(|f| f.resolve().unwrap()),
                ..Overrides::default()
            };
            memest::estimate(&src, memest::spec::Format::Toml, "llama", &overrides, None).unwrap()
        };
        let style = if megatron { TpStyle::Megatron } else { TpStyle::Dtensor };
        let flags = PlanFlags {
            gpus: Some(tp * cp * dp),
            tp: Some(tp),
            cp: Some(cp),
            sp: sp && tp > 1,
            tp_style: (tp > 1).then_some(style),
            ..PlanFlags::default()
        };
        let r = estimate(Some(flags));
        let w = estimate(None);
        let p = r.parallel.as_ref().unwrap();
        proptest::prop_assert_eq!(p.data_parallel, dp);
        proptest::prop_assert_eq!(p.unsharded.parameters_bytes, w.parameters_bytes);
        proptest::prop_assert_eq!(p.unsharded.gradients_bytes, w.gradients_bytes);
        proptest::prop_assert_eq!(p.unsharded.optimizer_state_bytes, w.optimizer_state_bytes);
        // Parameters, layer by layer.
        let (per, whole) = (layer_params(&r), layer_params(&w));
        let mut replicated = 0u64;
        let mut embedding = (0u64, 0u64);
        for (path, &bytes) in &whole {
            let local = per[path];
            if local == bytes {
                replicated += bytes;
            } else {
                proptest::prop_assert_eq!(local * tp, bytes, "{} is neither whole nor split", path);
            }
            if *path == "embed_tokens" {
                embedding = (local, bytes);
            }
        }
        proptest::prop_assert_eq!(r.parameters_bytes * tp, w.parameters_bytes + (tp - 1) * replicated);
        let whole_grad = if tp > 1 && !megatron { embedding.1 - embedding.0 } else { 0 };
        proptest::prop_assert_eq!(r.gradients_bytes, r.parameters_bytes + whole_grad);
        let tensors = 39u64;
        proptest::prop_assert_eq!(
            r.optimizer_state_bytes * tp,
            w.optimizer_state_bytes + (tp - 1) * (2 * replicated + 4 * tensors)
        );
        // Activations, layer by layer.
        let ranks = tp * cp;
        let mut block = (0u64, 0u64);
        for (l, lw) in r.layers.iter().zip(&w.layers) {
            proptest::prop_assert_eq!(&l.path, &lw.path);
            proptest::prop_assert!(l.activation_bytes <= lw.activation_bytes, "{} keeps more per rank", l.path);
            proptest::prop_assert!(l.activation_bytes * ranks >= lw.activation_bytes, "{} loses bytes", l.path);
            if l.path.starts_with("layers.") {
                block.0 += l.activation_bytes;
                block.1 += lw.activation_bytes;
            }
        }
        if sp && megatron && tp > 1 && cp == 1 {
            proptest::prop_assert_eq!(block.0 * tp, block.1);
        }
        let parts: u64 = memest::sim::Category::ALL.iter().map(|&c| r.at_peak.get(c)).sum();
        proptest::prop_assert_eq!(parts, r.peak_bytes);
        proptest::prop_assert_eq!(p.comm_buffers_bytes, r.category_max.comm_buffers_bytes);
    }
}

/// The flags: `--tp`/`--cp` alone span `tp · cp` GPUs; the data-parallel degree is
/// `gpus / (tp · cp)`; `--sp` and `--tp-style` need `--tp`; the GPUs must be a multiple of
/// `tp · cp`; `--tp` must divide the heads (exit 2 for each refusal, naming the flag).
#[test]
fn plan_flags() {
    use crate::common::{code, memest, stderr};
    let base = ["examples/llama_tiny.toml", "--batch", "1", "--seq", "64"];
    let run = |extra: &[&str]| memest(&[&base[..], extra].concat());
    let r = report(&[&base[..], &["--tp", "2", "--cp", "2"]].concat());
    assert_eq!(r["parallel"]["world_size"], 4);
    assert_eq!(r["parallel"]["data_parallel"], 1);
    assert_eq!(
        r["parallel"]["description"],
        "dtensor tensor parallel 2, context parallel 2 over 4 GPUs"
    );
    let r = report(
        &[
            &base[..],
            &["--gpus", "8", "--tp", "2", "--sp", "--zero", "1"],
        ]
        .concat(),
    );
    assert_eq!(r["parallel"]["data_parallel"], 4);
    for (extra, says) in [
        (&["--sp"][..], "--sp and --tp-style"),
        (&["--tp-style", "megatron"][..], "--sp and --tp-style"),
        (
            &["--gpus", "6", "--tp", "4"][..],
            "not a multiple of --tp 4",
        ),
        (
            &["--tp", "4"][..],
            "must divide the attention heads (8) and key/value heads (2)",
        ),
    ] {
        let out = run(extra);
        assert_eq!(code(&out), 2, "{extra:?}");
        assert!(stderr(&out).contains(says), "{extra:?}: {}", stderr(&out));
    }
}

/// Layers whose tensor-parallel split is not modelled are refused under `--tp` (exit 2, naming
/// the layer and what Megatron does), not traced whole on every rank: a mixture of experts
/// (Qwen2-MoE), multi-head latent attention (DeepSeek-V3), cross-attention (mT5). Without
/// `--tp` the same models estimate.
#[test]
fn unsplit_layers_are_refused_under_tp() {
    use crate::common::{code, memest, stderr};
    for (model, says) in [
        (
            "tests/fixtures/hf/qwen2_moe_tiny.json",
            "`mlp` is a mixture-of-experts layer",
        ),
        (
            "tests/fixtures/hf/deepseek_v3_tiny.json",
            "`self_attn` is a multi-head latent attention layer",
        ),
        (
            "tests/fixtures/hf/mt5_tiny.json",
            "`layer.1.EncDecAttention` is a cross-attention layer",
        ),
    ] {
        let base = [model, "--batch", "1", "--seq", "32"];
        let out = memest(&[&base[..], &["--tp", "2"]].concat());
        assert_eq!(code(&out), 2, "{model}");
        let err = stderr(&out);
        assert!(
            err.contains("--tp 2: ") && err.contains(says),
            "{model}: {err}"
        );
        assert_eq!(code(&memest(&base)), 0, "{model}");
    }
}
