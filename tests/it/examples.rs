//! Every model file under `examples/` (subfolders included, `*.toml` and `*.json`) runs, in
//! training and in inference, and gives a sensible JSON report.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::{describe, memest, path, root};

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let p = entry.unwrap().path();
        if p.is_dir() {
            collect(&p, out);
        } else if matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("toml" | "json")
        ) {
            out.push(p);
        }
    }
}

/// Example files relative to the crate root, sorted.
fn example_files() -> Vec<String> {
    let mut files = Vec::new();
    collect(&path("examples"), &mut files);
    let mut rel: Vec<String> = files
        .iter()
        .map(|p| {
            p.strip_prefix(root())
                .expect("under the crate root")
                .to_str()
                .expect("UTF-8 path")
                .to_string()
        })
        .collect();
    rel.sort();
    rel
}

/// Runs one example; returns a problem description, or the report.
fn run(file: &str, extra: &[&str]) -> Result<Value, String> {
    let mut args = vec![file, "--format", "json"];
    args.extend_from_slice(extra);
    let out = memest(&args);
    let what = format!("memest {}", args.join(" "));
    if out.status.code() != Some(0) || !out.stderr.is_empty() {
        return Err(format!("{what}\n{}", describe(&out)));
    }
    let v: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("{what}: stdout is not JSON: {e}\n{}", describe(&out)))?;
    let get = |k: &str| v[k].as_u64();
    let mut problems = Vec::new();
    match get("param_count") {
        Some(n) if n > 0 => {}
        other => problems.push(format!("param_count is {other:?}")),
    }
    if get("parameters_bytes").unwrap_or(0) == 0 {
        problems.push("parameters_bytes is 0".into());
    }
    if get("total_bytes").is_none() || get("total_bytes") != get("peak_bytes") {
        problems.push(format!(
            "total_bytes {:?} != peak_bytes {:?}",
            get("total_bytes"),
            get("peak_bytes")
        ));
    }
    if get("peak_bytes").unwrap_or(0) < get("parameters_bytes").unwrap_or(u64::MAX) {
        problems.push("peak_bytes below parameters_bytes".into());
    }
    if v["layers"].as_array().is_none_or(Vec::is_empty) {
        problems.push("no layers".into());
    }
    if problems.is_empty() {
        Ok(v)
    } else {
        Err(format!("{what}: {}", problems.join("; ")))
    }
}

#[test]
fn there_are_examples() {
    let files = example_files();
    assert!(files.len() >= 8, "found only {files:?}");
    for name in [
        "examples/mlp.toml",
        "examples/gpt2.toml",
        "examples/resnet50.toml",
    ] {
        assert!(
            files.iter().any(|f| f == name),
            "{name} missing from {files:?}"
        );
    }
}

#[test]
fn every_example_runs_in_training() {
    let mut failures = Vec::new();
    for file in example_files() {
        match run(&file, &[]) {
            Ok(v) => {
                if v["settings"]["mode"] != "train" {
                    failures.push(format!("{file}: mode is {}", v["settings"]["mode"]));
                }
                if v["gradients_bytes"].as_u64().unwrap_or(0) == 0 {
                    failures.push(format!("{file}: no gradients in training"));
                }
                if v["activations_bytes"].as_u64().unwrap_or(0) == 0 {
                    failures.push(format!("{file}: nothing saved for backward in training"));
                }
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_example_runs_in_inference() {
    let mut failures = Vec::new();
    for file in example_files() {
        match run(&file, &["--mode", "infer"]) {
            Ok(v) => {
                for key in [
                    "gradients_bytes",
                    "activations_bytes",
                    "optimizer_state_bytes",
                ] {
                    if v[key] != 0 {
                        failures.push(format!("{file}: {key} is {} in inference", v[key]));
                    }
                }
                if v["peak_activations_bytes"].as_u64().unwrap_or(0) == 0 {
                    failures.push(format!("{file}: no live activations in inference"));
                }
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_example_prints_tables() {
    let mut failures = Vec::new();
    for file in example_files() {
        let out = memest(&[&file, "--per-layer"]);
        let text = String::from_utf8_lossy(&out.stdout);
        if out.status.code() != Some(0) || !text.contains("Total (peak)") || !text.contains("Layer")
        {
            failures.push(format!("{file}\n{}", describe(&out)));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `memest FILE FLAGS --format json` of an example that must succeed.
fn report_of(file: &str, flags: &[&str]) -> Value {
    run(file, flags).unwrap_or_else(|e| panic!("{e}"))
}

/// `report[key]` as a number.
fn num(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// The error of `got` against `measured`, as a fraction.
#[allow(clippy::cast_precision_loss)]
fn error(got: u64, measured: u64) -> f64 {
    got as f64 / measured as f64 - 1.0
}

#[test]
fn unet2d_matches_pytorch() {
    // examples/unet2d.toml against `UNet` in tools/measure_examples.py (PyTorch 2.15, batch 4,
    // AdamW foreach).
    // CPU, float32 (measure.py): saved activations 153,356,804 B, 468,293 parameters.
    let cpu = report_of(
        "examples/unet2d.toml",
        &["--device", "cpu", "--optim", "adamw"],
    );
    assert_eq!(num(&cpu, "activations_bytes"), 153_356_804);
    assert_eq!(num(&cpu, "param_count"), 468_293);
    assert_eq!(num(&cpu, "optimizer_state_bytes"), 3_746_480);
    // The CPU peak was measured at 194,108,768 B; memest gives 193,989,724 B (-0.06 %), with
    // oneDNN's reorders in the convolutions (about 34 MB in the backward of the decoder's
    // 96-channel 128×128 convolution; without them memest read 8.8 % low). Pinned so that a
    // change shows.
    assert_eq!(num(&cpu, "peak_bytes"), 193_989_724);
    let low = error(num(&cpu, "peak_bytes"), 194_108_768);
    assert!((-0.001..0.0).contains(&low), "CPU peak error {low:+.4}");
    // CUDA (measure_fake_cuda.py, sm 9.0), float32: saved 153,356,804 B; peak 177,064,920 B;
    // the caching-allocator model's max allocated 177,093,632 and max reserved 226,492,416.
    let cuda = report_of("examples/unet2d.toml", &["--optim", "adamw"]);
    assert_eq!(num(&cuda, "activations_bytes"), 153_356_804);
    for (key, measured) in [
        ("peak_bytes", 177_064_920),
        ("allocated_peak_bytes", 177_093_632),
        ("reserved_peak_bytes", 226_492_416),
    ] {
        let e = error(num(&cuda, key), measured);
        assert!(e.abs() < 0.001, "CUDA {key}: {e:+.5}");
    }
    // bfloat16 on CUDA: saved 79,824,130 B, peak 91,940,332 B.
    let bf16 = report_of(
        "examples/unet2d.toml",
        &["--optim", "adamw", "--dtype", "bfloat16"],
    );
    let saved = error(num(&bf16, "activations_bytes"), 79_824_130);
    let peak = error(num(&bf16, "peak_bytes"), 91_940_332);
    assert!(
        saved.abs() < 0.0001 && peak.abs() < 0.001,
        "bf16 saved {saved:+.5}, peak {peak:+.5}"
    );
}

#[test]
fn lstm_classifier_matches_pytorch() {
    // examples/lstm_classifier.toml against `LstmClassifier` in tools/measure_examples.py
    // (PyTorch 2.15 CPU, batch 16, AdamW): the LSTM runs oneDNN. Float32: saved activations
    // 174,178,564 B (each layer-direction's workspace 45,363,200 B for layer 0 and 32,681,984
    // for layer 1, as `onednn_lstm_workspace` gives), 4,929,540 parameters.
    let v = report_of(
        "examples/lstm_classifier.toml",
        &["--device", "cpu", "--optim", "adamw"],
    );
    assert_eq!(num(&v, "activations_bytes"), 174_178_564);
    assert_eq!(num(&v, "param_count"), 4_929_540);
    assert_eq!(num(&v, "optimizer_state_bytes"), 39_436_396);
    assert_eq!(num(&v, "gradients_bytes"), 19_718_160);
    // The peak was measured at 257,909,836 B: memest is 6.7 % low, as the backward's oneDNN
    // scratchpad, weight reorders and gradient copies (about 17 MB at the peak) are not
    // modelled. Pinned so that a change shows.
    let low = error(num(&v, "peak_bytes"), 257_909_836);
    assert!((-0.075..-0.06).contains(&low), "peak error {low:+.4}");
    // bfloat16: saved 123,027,586 B (memest 2 B more: the loss's scalar); peak 168,073,000 B,
    // memest 7.0 % low.
    let b = report_of(
        "examples/lstm_classifier.toml",
        &["--device", "cpu", "--optim", "adamw", "--dtype", "bfloat16"],
    );
    let saved = error(num(&b, "activations_bytes"), 123_027_586);
    assert!(saved.abs() < 0.0001, "bf16 saved {saved:+.6}");
    let low = error(num(&b, "peak_bytes"), 168_073_000);
    assert!((-0.08..-0.06).contains(&low), "bf16 peak error {low:+.4}");
}
