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
