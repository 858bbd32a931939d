//! Issue 12's outputs: `--explain`, `--timeline`, `--format markdown|csv`, `--sweep`. Exact
//! figures are derived in the comments.

use memest::sim::{Category, Observe};

use crate::common::{code, memest, report, stdout, u};

const MLP: &str = "examples/mlp.toml";

/// The MLP (1000 → 2000 → 1000 → 100, batch 32, Adam) peaks in the optimizer step with every
/// parameter and its gradient live: fc1's and fc2's weights (2000 × 1000 × 4 B = 8,000,000 B)
/// and their gradients lead the list, then fc3's weight and gradient (400,000 B), the input
/// batch (32 × 1000 × 4 = 128,000 B) and the held output (32 × 100 × 4 = 12,800 B, made by
/// `addmm`).
#[test]
fn explain_lists_the_largest_live_tensors() {
    let r = report(&[MLP, "--explain"]);
    let e = r["explain"].as_array().unwrap();
    assert_eq!(e.len(), 10);
    let row = |i: usize| {
        let t = &e[i];
        (
            t["what"].as_str().unwrap().to_string(),
            t["layer"].as_str().unwrap().to_string(),
            t["op"].as_str().unwrap_or("-").to_string(),
            t["category"].as_str().unwrap().to_string(),
            u(t, "bytes"),
            u(t, "count"),
            u(t, "total_bytes"),
        )
    };
    let p = |what: &str, layer: &str, cat: &str, b: u64| {
        (what.into(), layer.into(), "-".into(), cat.into(), b, 1, b)
    };
    assert_eq!(row(0), p("parameter", "fc1", "parameters", 8_000_000));
    assert_eq!(row(1), p("parameter", "fc2", "parameters", 8_000_000));
    assert_eq!(
        row(2),
        p("parameter gradient", "fc2", "gradients", 8_000_000)
    );
    assert_eq!(
        row(3),
        p("parameter gradient", "fc1", "gradients", 8_000_000)
    );
    assert_eq!(row(4), p("parameter", "fc3", "parameters", 400_000));
    assert_eq!(row(5), p("parameter gradient", "fc3", "gradients", 400_000));
    assert_eq!(row(6), p("input batch", "input", "input", 128_000));
    assert_eq!(
        row(7),
        (
            "output".into(),
            "fc3".into(),
            "addmm".into(),
            "activations".into(),
            12_800,
            1,
            12_800
        )
    );
    assert_eq!(e[0]["shape"], serde_json::json!([2000, 1000]));
    assert_eq!(e[0]["dtype"], "float32");
    // The figures are those without --explain.
    let mut plain = report(&[MLP]);
    let mut with = r.clone();
    with.as_object_mut().unwrap().remove("explain");
    plain.as_object_mut().unwrap().remove("explain");
    assert_eq!(with, plain);
}

/// The copies of a repeated block's tensor are one entry with their count: GPT-2 (12 blocks,
/// batch 4, seq 256) keeps each block's attention probabilities `[4, 12, 256, 256]` f32
/// (12 MiB) at its backward peak, 12 of them: 144 MiB.
#[test]
fn explain_counts_the_copies_of_a_block() {
    let r = report(&["examples/gpt2.toml", "--batch", "4", "--explain"]);
    let e = r["explain"].as_array().unwrap();
    let softmax = e
        .iter()
        .find(|t| t["op"] == "_softmax")
        .expect("the attention probabilities");
    assert_eq!(softmax["layer"], "h.attn");
    assert_eq!(u(softmax, "bytes"), 4 * 12 * 256 * 256 * 4);
    assert_eq!(u(softmax, "count"), 12);
    assert_eq!(u(softmax, "total_bytes"), 12 * 12 * (1 << 20));
    // The table shows the same list.
    let out = memest(&["examples/gpt2.toml", "--batch", "4", "--explain"]);
    assert_eq!(code(&out), 0);
    assert!(stdout(&out).contains("│ output                        ┆ h.attn     ┆ _softmax       ┆ [4, 12, 256, 256] ┆ f32   ┆ 12.00 MiB ┆ 12 ┆ 144.0 MiB ┆ Activations │"), "{}", stdout(&out));
}

/// The live set at the peak is the tape's share of the peak: with the optimizer state and the
/// step's temporaries (not tensors of the tape) it sums to the peak exactly. MLP: parameters
/// and gradients 16,412,400 B each, input 128,000, output 12,800 (+4 B of the `sum` loss) =
/// 32,965,604; Adam's state 32,824,824 and the foreach temporaries 16,412,400 make 82,202,828.
#[test]
fn live_set_at_the_peak_sums_to_the_peak() {
    let src = std::fs::read_to_string(crate::common::path(MLP)).unwrap();
    let spec = memest::load_spec(&src, memest::spec::Format::Toml, memest::hf::Head::Auto).unwrap();
    let model = memest::graph::build(&spec, "mlp").unwrap();
    let settings =
        memest::settings::Settings::resolve(&model.defaults, &Default::default()).unwrap();
    let tape = memest::trace::trace(&model, &settings).unwrap();
    let observe = Observe {
        timeline: false,
        explain: true,
    };
    let sim = memest::sim::simulate_observed(&tape, &settings, observe).unwrap();
    let live: u64 = sim
        .live_at_peak
        .as_ref()
        .unwrap()
        .iter()
        .map(|t| t.bytes)
        .sum();
    assert_eq!(live, 32_965_604);
    let state = sim.at_peak[Category::ALL
        .iter()
        .position(|c| *c == Category::OptimizerState)
        .unwrap()];
    assert_eq!(state, 32_824_824);
    assert_eq!(live + state + sim.optimizer_temp_bytes, sim.peak_bytes);
    assert_eq!(sim.peak_bytes, 82_202_828);
    // Observing changes no figure.
    let plain = memest::sim::simulate(&tape, &settings).unwrap();
    assert_eq!(plain.peak_bytes, sim.peak_bytes);
    assert_eq!(plain.at_peak, sim.at_peak);
    assert_eq!(plain.category_max, sim.category_max);
}
