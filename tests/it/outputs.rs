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
/// batch 4, seq 256, eager attention) keeps each block's attention probabilities `[4, 12, 256, 256]` f32
/// (12 MiB) at its backward peak, 12 of them: 144 MiB.
#[test]
fn explain_counts_the_copies_of_a_block() {
    let r = report(&[
        "examples/gpt2.toml",
        "--batch",
        "4",
        "--attention",
        "eager",
        "--explain",
    ]);
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
    let out = memest(&[
        "examples/gpt2.toml",
        "--batch",
        "4",
        "--attention",
        "eager",
        "--explain",
    ]);
    assert_eq!(code(&out), 0);
    assert!(stdout(&out).contains("│ output                        ┆ h.attn     ┆ _softmax       ┆ [4, 12, 256, 256] ┆ f32   ┆ 12.00 MiB ┆ 12 ┆ 144.0 MiB ┆ Activations │"), "{}", stdout(&out));
}

/// The live set at the peak is the tape's share of the peak: with the optimizer state and the
/// step's temporaries (not tensors of the tape) it sums to the peak exactly. MLP: parameters
/// and gradients 16,412,400 B each, input 128,000, output 12,800 (+4 B of the `sum` loss) =
/// 32,965,604; Adam's moments 32,824,800 (its six 4 B `step` counters are host tensors, not in
/// the CUDA peak) and the foreach temporaries 16,412,400 make 82,202,804.
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
    assert_eq!(state, 32_824_800);
    assert_eq!(live + state + sim.optimizer_temp_bytes, sim.peak_bytes);
    assert_eq!(sim.peak_bytes, 82_202_804);
    // Observing changes no figure.
    let plain = memest::sim::simulate(&tape, &settings).unwrap();
    assert_eq!(plain.peak_bytes, sim.peak_bytes);
    assert_eq!(plain.at_peak, sim.at_peak);
    assert_eq!(plain.category_max, sim.category_max);
}

/// `--format csv`: one header row, then one row per estimate, byte counts as integers under
/// `*_bytes` names. The MLP's row holds the JSON's figures.
#[test]
fn csv_has_one_row_per_estimate() {
    let out = memest(&[MLP, "--format", "csv", "--budget", "80MB"]);
    assert_eq!(code(&out), 1, "82,202,804 B > 80,000,000 B");
    let text = stdout(&out);
    let mut rd = csv::Reader::from_reader(text.as_bytes());
    let header: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
    let rows: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
    assert_eq!(rows.len(), 1);
    let get = |k: &str| rows[0][header.iter().position(|h| h == k).unwrap()].to_string();
    assert_eq!(get("model"), "mlp");
    assert_eq!(get("batch"), "32");
    assert_eq!(get("seq"), "");
    assert_eq!(get("total_bytes"), "82202804");
    // Adam's moments; its six `step` counters (24 B) are host tensors, not in the CUDA peak.
    assert_eq!(get("at_peak_optimizer_state_bytes"), "32824800");
    assert_eq!(get("optimizer_state_bytes"), "32824824");
    assert_eq!(get("at_peak_activations_bytes"), "12804");
    assert_eq!(get("peak_phase"), "optimizer_step");
    assert_eq!(get("budget_bytes"), "80000000");
    assert_eq!(get("fits"), "false");
    for h in &header {
        let bytes = h.ends_with("_bytes");
        let numeric = [
            "batch",
            "gpus",
            "data_parallel",
            "param_count",
            "trainable_param_count",
        ]
        .contains(&h.as_str());
        if bytes || numeric {
            get(h)
                .parse::<u64>()
                .unwrap_or_else(|_| panic!("{h} is not an integer"));
        }
    }
    // The JSON agrees, key by key.
    let r = report(&[MLP]);
    for k in [
        "parameters_bytes",
        "gradients_bytes",
        "activations_bytes",
        "peak_activations_bytes",
    ] {
        assert_eq!(get(k), u(&r, k).to_string(), "{k}");
    }
}

/// `--format markdown`: the table's rows as a GitHub table, and the peak and budget verdict.
#[test]
fn markdown_has_the_tables_rows() {
    let out = memest(&[MLP, "--format", "markdown", "--budget", "1GiB"]);
    assert_eq!(code(&out), 0);
    let text = stdout(&out);
    assert!(
        text.contains(
            "| Category | At peak | Share | Step maximum |\n| --- | ---: | ---: | ---: |\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("| Optimizer state | 31.30 MiB | 39.9% | 31.30 MiB |\n"),
        "{text}"
    );
    assert!(
        text.contains("| Total (peak) | 78.39 MiB | 100.0% |  |\n"),
        "{text}"
    );
    // The budget checks the device figure (reserve + context + workspaces): what is left is
    // the budget less that figure, not less the tensor peak.
    assert!(text.contains("peak: 78.39 MiB during the optimizer step; device figure 596.0 MiB: **fits** the 1.00 GiB budget, 428.0 MiB to spare"), "{text}");
    // The same rows as the terminal table.
    let table = stdout(&memest(&[MLP]));
    for row in [
        "Parameters",
        "Gradients",
        "Optimizer state",
        "Activations",
        "Temporaries",
        "Input batch",
    ] {
        assert!(table.contains(&format!("│ {row} ")), "{row}");
        assert!(text.contains(&format!("| {row} | ")), "{row}");
    }
}

/// `--format markdown` and `--format csv` name the parallel plan as the table and the JSON do
/// (issue 12's trial: they did not). The tiny Llama on 4 GPUs, tensor parallel 2 and ZeRO-1
/// over the 2 data-parallel ranks: per GPU 44,049,408 B of weights (half of 88,089,600),
/// 60,433,408 B of gradients, 88,098,820 B of optimizer state (half of 176,179,356, plus the
/// step counters) and 44,049,408 B of master weights, the figures the JSON's `parallel` holds.
#[test]
fn markdown_and_csv_name_the_parallel_plan() {
    let args = [
        "examples/llama_tiny.toml",
        "--gpus",
        "4",
        "--tp",
        "2",
        "--zero",
        "1",
    ];
    let json = report(&args);
    let plan = "dtensor tensor parallel 2; DeepSpeed ZeRO-1 over 2 data-parallel ranks";
    assert_eq!(json["parallel"]["description"], plan);
    assert_eq!(
        u(&json["parallel"]["per_gpu"], "optimizer_state_bytes"),
        88_098_820
    );
    let md = stdout(&memest(
        &[&args[..], &["--format", "markdown", "--si"]].concat(),
    ));
    assert!(
        md.contains(&format!(
            "per GPU: {plan}; data parallel 2; every figure below is one GPU's\n"
        )),
        "{md}"
    );
    for row in [
        "| Model state | Whole model | Per GPU |\n| --- | ---: | ---: |\n",
        "| Parameters | 88.09 MB | 44.05 MB |\n",
        "| Gradients | 88.09 MB | 60.43 MB |\n",
        "| Optimizer state | 176.2 MB | 88.10 MB |\n",
        "| Master weights | 0 B | 44.05 MB |\n",
    ] {
        assert!(md.contains(row), "{row}: {md}");
    }
    let csv_text = stdout(&memest(&[&args[..], &["--format", "csv"]].concat()));
    let mut rd = csv::Reader::from_reader(csv_text.as_bytes());
    let header: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
    let rows: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
    let get = |k: &str| rows[0][header.iter().position(|h| h == k).unwrap()].to_string();
    assert_eq!(get("gpus"), "4");
    assert_eq!(get("parallel"), plan);
    assert_eq!(get("data_parallel"), "2");
    assert_eq!(get("total_bytes"), u(&json, "total_bytes").to_string());
    // One GPU: no plan, `gpus` 1, an empty `parallel`, and no plan line in markdown.
    let one = stdout(&memest(&[MLP, "--format", "csv"]));
    let mut rd = csv::Reader::from_reader(one.as_bytes());
    let header: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
    let row = rd.records().next().unwrap().unwrap();
    let at = |k: &str| row[header.iter().position(|h| h == k).unwrap()].to_string();
    assert_eq!(
        (at("gpus"), at("parallel"), at("data_parallel")),
        ("1".into(), String::new(), "1".into())
    );
    assert!(!stdout(&memest(&[MLP, "--format", "markdown"])).contains("per GPU:"));
    // A sweep names it once, above its rows.
    let sweep = stdout(&memest(
        &[&args[..], &["--sweep", "batch=1,2", "--format", "markdown"]].concat(),
    ));
    assert!(
        sweep.contains(&format!(
            "per GPU: {plan}; data parallel 2; every figure is one GPU's\n"
        )),
        "{sweep}"
    );
}

/// `--sweep batch=1..8`: one estimate per value (1, 2, 4, 8) in every format, each the estimate
/// at that batch. The MLP's input batch is batch × 4,000 B.
#[test]
fn sweep_prints_one_row_per_value() {
    let r = report(&[MLP, "--sweep", "batch=1..8"]);
    assert_eq!(r["dimension"], "batch");
    assert_eq!(r["values"], serde_json::json!([1, 2, 4, 8]));
    let sweep = r["sweep"].as_array().unwrap();
    assert_eq!(sweep.len(), 4);
    for (i, b) in [1u64, 2, 4, 8].into_iter().enumerate() {
        assert_eq!(u(&sweep[i]["settings"], "batch"), b);
        assert_eq!(u(&sweep[i], "input_bytes"), b * 4000);
        let alone = report(&[MLP, "--batch", &b.to_string()]);
        assert_eq!(sweep[i], alone, "batch {b}");
    }
    let csv = stdout(&memest(&[MLP, "--sweep", "batch=1..8", "--format", "csv"]));
    assert_eq!(csv.lines().count(), 5);
    assert!(
        csv.lines()
            .nth(3)
            .unwrap()
            .starts_with("mlp,4,,float32,train,adam,fp32,")
    );
    let md = stdout(&memest(&[
        MLP,
        "--sweep",
        "batch=1,2",
        "--format",
        "markdown",
    ]));
    assert!(md.contains("| batch | Parameters | Gradients | Optimizer state | Activations | Temporaries | Input batch | Total (peak) |\n"), "{md}");
    assert_eq!(
        md.lines()
            .filter(|l| l.starts_with("| 1 |") || l.starts_with("| 2 |"))
            .count(),
        2
    );
    let table = stdout(&memest(&[MLP, "--sweep", "seq=1", "--mode", "infer"]));
    assert!(table.contains("sweep over seq: 1 value\n"), "{table}");
}

/// A sweep over the budget exits 1 and names the values that do not fit; bad syntax exits 2.
#[test]
fn sweep_budget_and_bad_syntax() {
    // 82,202,828 B at batch 32 (on the CPU, with Adam's step counters); batch 64 adds 32 inputs (128,000 B) and outputs (12,800 B):
    // 82,343,628 B, over a budget of 82,300,000 B.
    let out = memest(&[
        MLP,
        "--sweep",
        "batch=32,64",
        "--budget",
        "82300000",
        "--device",
        "cpu",
        "--optim-impl",
        "foreach",
    ]);
    assert_eq!(code(&out), 1);
    assert_eq!(
        crate::common::stderr(&out),
        "memest: over budget 78.49 MiB at batch 64\n"
    );
    for bad in [
        "batch=0",
        "batch=8..1",
        "lr=1",
        "batch=1..100:1",
        "batch=1,,2",
        "batch",
    ] {
        let out = memest(&[MLP, "--sweep", bad]);
        assert_eq!(code(&out), 2, "{bad}");
    }
    let out = memest(&[MLP, "--sweep", "batch=1,2", "--batch", "4"]);
    assert_eq!(code(&out), 2);
    let out = memest(&[
        MLP,
        "--sweep",
        "batch=1,2",
        "--max-batch",
        "--budget",
        "1GiB",
    ]);
    assert_eq!(code(&out), 2);
}

/// With `--budget` on a GPU, every sweep format shows the figure the budget checks (`--budget-on`,
/// `device` by default: reserve + CUDA context + cuBLAS workspaces) beside the tensor peak, so a
/// row's verdict can be read from it: gpt2 at batch 8 peaks at 5.08 GiB of tensors and shows
/// 5.86 GiB (6,289,358,848 B) on the device, over 4 GiB: NO; batch 4, 3.24 GiB of tensors,
/// shows 3.96 GiB (4,257,218,560 B): yes.
#[test]
fn sweep_shows_the_figure_the_budget_checks() {
    let args = [
        "examples/gpt2.toml",
        "--sweep",
        "batch=1,2,4,8",
        "--budget",
        "4GiB",
    ];
    let budget = 4u64 << 30;
    let cells = |line: &str, sep: char| -> Vec<String> {
        line.split(sep)
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty())
            .collect()
    };

    // The table: `Device figure` before `Fits`.
    let out = memest(&args);
    assert_eq!(code(&out), 1);
    let table = stdout(&out);
    let header = cells(table.lines().find(|l| l.contains("Fits")).unwrap(), '┆');
    let col = |name: &str| header.iter().position(|h| h.contains(name)).unwrap();
    let (device, fits) = (col("Device figure"), col("Fits"));
    assert_eq!(device + 1, fits, "{table}");
    let row = |b: &str| {
        let line = table
            .lines()
            .find(|l| {
                l.trim_start_matches('│')
                    .trim()
                    .starts_with(&format!("{b} "))
            })
            .unwrap();
        cells(line.trim_matches('│'), '┆')
    };
    assert_eq!(row("8")[fits], "NO");
    assert_eq!(row("8")[device], "5.88 GiB");
    assert_eq!(row("4")[fits], "yes");
    assert_eq!(row("4")[device], "3.97 GiB");

    // CSV: the JSON's name, `device_bytes`, after `fits`; over the budget exactly where not fitting.
    let mut csv_args = args.to_vec();
    csv_args.extend(["--format", "csv"]);
    let csv = stdout(&memest(&csv_args));
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(header.last(), Some(&"device_bytes"));
    let at = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 4);
    for r in &rows {
        let checked: u64 = r[at("device_bytes")].parse().unwrap();
        assert_eq!(r[at("fits")] == "false", checked > budget, "{r:?}");
    }
    assert_eq!(rows[3][at("batch")], "8");
    assert_eq!(rows[3][at("device_bytes")], "6318718976");
    assert_eq!(rows[3][at("fits")], "false");
    assert_eq!(rows[2][at("device_bytes")], "4267704320");
    assert_eq!(rows[2][at("fits")], "true");

    // Markdown and JSON: the same figure.
    let mut md_args = args.to_vec();
    md_args.extend(["--format", "markdown"]);
    let md = stdout(&memest(&md_args));
    assert!(
        md.contains("| Total (peak) | Device figure | Fits |"),
        "{md}"
    );
    assert!(md.contains("| 5.08 GiB | 5.88 GiB | NO |"), "{md}");
    let mut json_args = args.to_vec();
    json_args.extend(["--format", "json"]);
    let out = memest(&json_args);
    assert_eq!(code(&out), 1);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let b8 = &json["sweep"][3];
    assert_eq!(u(b8, "device_bytes"), 6_318_718_976);
    assert_eq!(u(&b8["budget"], "checked_bytes"), 6_318_718_976);
    assert_eq!(b8["budget"]["on"], "device");
}

/// On the CPU the budget checks the total itself: no extra column.
#[test]
fn cpu_sweep_has_no_checked_column() {
    let args = [
        MLP,
        "--sweep",
        "batch=1,2",
        "--budget",
        "1GiB",
        "--device",
        "cpu",
    ];
    let table = stdout(&memest(&args));
    assert!(!table.contains("figure"), "{table}");
    let mut csv_args = args.to_vec();
    csv_args.extend(["--format", "csv"]);
    let csv = stdout(&memest(&csv_args));
    assert!(csv.lines().next().unwrap().ends_with(",fits"), "{csv}");
}

/// Writes `--timeline` for `args` to a temporary file and returns the JSON report and the SVG.
fn timeline(args: &[&str]) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("step.svg");
    let mut all = args.to_vec();
    all.extend(["--timeline", file.to_str().unwrap(), "--format", "json"]);
    let out = memest(&all);
    assert!(
        matches!(code(&out), 0 | 1),
        "{}",
        crate::common::describe(&out)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (json, std::fs::read_to_string(&file).unwrap())
}

/// `--timeline`: a well-formed SVG whose labelled peak is the JSON's `peak_bytes`, with one area
/// per category that is ever live, the phases named, and the same figures as without it.
#[test]
fn timeline_is_well_formed_and_its_peak_is_the_reports() {
    for args in [
        &[MLP][..],
        &[
            "examples/gpt2.toml",
            "--batch",
            "4",
            "--checkpoint",
            "--budget",
            "4GiB",
        ],
        &["examples/hf/llama_tiny.json", "--context", "64"],
    ] {
        let (json, svg) = timeline(args);
        let doc = roxmltree::Document::parse(&svg).expect("well-formed XML");
        let root = doc.root_element();
        assert_eq!(root.tag_name().name(), "svg");
        assert_eq!(
            root.tag_name().namespace(),
            Some("http://www.w3.org/2000/svg")
        );
        let peak = doc
            .descendants()
            .find(|n| n.attribute("id") == Some("peak"))
            .expect("a peak marker");
        let peak_bytes: u64 = peak.attribute("data-peak-bytes").unwrap().parse().unwrap();
        assert_eq!(peak_bytes, u(&json, "peak_bytes"), "{args:?}");
        let label: String = peak
            .descendants()
            .filter(|n| n.is_text())
            .filter_map(|n| n.text())
            .collect();
        let table = stdout(&memest(args));
        let shown = table
            .lines()
            .find_map(|l| l.strip_prefix("peak: "))
            .and_then(|l| l.split(" during").next())
            .unwrap()
            .to_string();
        assert!(
            label.starts_with(&format!("peak {shown} · ")),
            "{label} / {shown}"
        );
        if let Some(layer) = json["peak_layer"].as_str() {
            assert!(label.ends_with(&format!(" · {layer}")), "{label}");
        }
        let areas: Vec<&str> = doc
            .descendants()
            .filter(|n| n.attribute("class") == Some("area"))
            .map(|n| n.attribute("data-category").unwrap())
            .collect();
        for c in Category::ALL {
            // `comm_buffers_bytes` is left out on one GPU.
            let live = json["category_max"]
                .get(c.key())
                .and_then(serde_json::Value::as_u64)
                > Some(0);
            let key = c.key().trim_end_matches("_bytes");
            assert_eq!(areas.contains(&key), live, "{args:?} {key}");
        }
        let phases: Vec<&str> = doc
            .descendants()
            .filter(|n| n.attribute("class") == Some("phase"))
            .map(|n| n.attribute("data-phase").unwrap())
            .collect();
        if json["settings"]["mode"] == "train" {
            assert_eq!(
                phases,
                ["forward", "backward", "optimizer_step"],
                "{args:?}"
            );
        } else {
            assert_eq!(phases, ["forward"], "{args:?}");
        }
        let mut plain = report(args);
        let mut with = json.clone();
        plain.as_object_mut().unwrap().remove("explain");
        with.as_object_mut().unwrap().remove("explain");
        assert_eq!(with, plain, "{args:?}: --timeline changes no figure");
    }
}

/// The timeline keeps at most 2000 points and always the peak's event; the MLP's 14 events
/// (the start, 6 forward operators, 6 backward, the optimizer step) are all kept, and the
/// peak (82,202,804 B) is the optimizer step, the last.
#[test]
fn timeline_series_keeps_the_peak() {
    let src = std::fs::read_to_string(crate::common::path(MLP)).unwrap();
    let spec = memest::load_spec(&src, memest::spec::Format::Toml, memest::hf::Head::Auto).unwrap();
    let observe = Observe {
        timeline: true,
        explain: false,
    };
    let r = memest::estimate_observed(&spec, "mlp", &Default::default(), None, observe).unwrap();
    let t = r.timeline.unwrap();
    assert_eq!(t.events, 14);
    assert_eq!(t.points.len(), 14);
    assert_eq!(t.peak, 13);
    assert_eq!(t.points[13].total(), 82_202_804);
    let phases: Vec<_> = t.phases.iter().map(|p| (p.1, p.2)).collect();
    assert_eq!(phases, [(0, 7), (7, 13), (13, 14)]);
    // A long step is downsampled, the peak kept.
    let src = std::fs::read_to_string(crate::common::path("examples/hf/llama-3-8b.json")).unwrap();
    let spec = memest::load_spec(&src, memest::spec::Format::Json, memest::hf::Head::Auto).unwrap();
    let o = memest::settings::Overrides {
        seq: Some(16),
        ..Default::default()
    };
    let r = memest::estimate_observed(&spec, "llama", &o, None, observe).unwrap();
    let t = r.timeline.as_ref().unwrap();
    assert!(t.events > memest::sim::TIMELINE_POINTS, "{}", t.events);
    assert!(t.points.len() <= memest::sim::TIMELINE_POINTS);
    assert_eq!(t.points[t.peak].total(), r.peak_bytes);
    assert!(t.points.iter().all(|p| p.total() <= r.peak_bytes));
}

/// The table's rows are the JSON's `at_peak` and `category_max`, and the summary line is
/// `peak_activations_bytes` (inference) or `activations_bytes` (training): one meaning each.
#[test]
fn table_rows_and_summary_lines_are_the_jsons() {
    use memest::units::{UnitSystem, format_bytes};
    for args in [
        &[MLP][..],
        &["examples/gpt2.toml", "--batch", "2"],
        &["examples/hf/llama_tiny.json", "--context", "64"],
    ] {
        let r = report(args);
        let table = stdout(&memest(args));
        let fmt = |b: u64| format_bytes(b, UnitSystem::Iec);
        for c in Category::ALL {
            // `comm_buffers_bytes` is left out on one GPU.
            let get = |v: &serde_json::Value| {
                v.get(c.key())
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0)
            };
            let (at, max) = (get(&r["at_peak"]), get(&r["category_max"]));
            let Some(line) = table
                .lines()
                .find(|l| l.starts_with(&format!("│ {} ", c.title())))
            else {
                assert_eq!((at, max), (0, 0), "{args:?}: {} missing", c.title());
                continue;
            };
            let cells: Vec<&str> = line.split(['│', '┆']).map(str::trim).collect();
            assert_eq!(cells[2], fmt(at), "{args:?} {}", c.title());
            assert_eq!(cells[4], fmt(max), "{args:?} {}", c.title());
        }
        if r["settings"]["mode"] == "train" {
            let saved = format!("saved for backward: {};", fmt(u(&r, "activations_bytes")));
            assert!(table.contains(&saved), "{args:?}: {saved}");
        } else {
            let live = format!(
                "live activations at most: {} (activations + temporaries in forward",
                fmt(u(&r, "peak_activations_bytes"))
            );
            assert!(table.contains(&live), "{args:?}: {live}");
            // The KV cache is apart from every activation figure.
            let kv = u(&r, "kv_cache_bytes");
            assert!(kv > 0);
            assert!(table.contains(&format!("; KV cache apart: {})", fmt(kv))));
            let at = &r["at_peak"];
            assert!(
                u(&r, "peak_activations_bytes")
                    >= u(at, "activations_bytes") + u(at, "temporaries_bytes")
            );
        }
    }
}
