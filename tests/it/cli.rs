//! The command line: exit statuses, the JSON contract, flags over file defaults, units, stdin.

use memest::units::{UnitSystem, format_bytes};
use serde_json::Value;

use crate::common::{
    TempModel, assert_success, code, describe, json, memest, memest_stdin, path, report, stderr,
    stdout, u,
};

const MLP: &str = "examples/mlp.toml";

/// Parameters of examples/mlp.toml: 1000→2000→1000→100 with biases.
const MLP_PARAMS: u64 = 1000 * 2000 + 2000 + 2000 * 1000 + 1000 + 1000 * 100 + 100;

#[test]
fn normal_run_exits_zero_and_prints_a_table() {
    let out = memest(&[MLP]);
    assert_success(&out);
    let text = stdout(&out);
    for needle in [
        "model: mlp",
        "Parameters",
        "Gradients",
        "Optimizer state",
        "Activations",
        "Total (peak)",
        "4,103,100",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn json_has_the_contract_keys() {
    let v = report(&[MLP]);
    for key in [
        "param_count",
        "trainable_param_count",
        "parameters_bytes",
        "buffers_bytes",
        "gradients_bytes",
        "optimizer_state_bytes",
        "activations_bytes",
        "total_bytes",
        "peak_bytes",
    ] {
        assert!(
            v[key].is_u64(),
            "`{key}` should be an unsigned integer in {v:#}"
        );
    }
    let layers = v["layers"].as_array().expect("`layers` is an array");
    assert_eq!(layers.len(), 5, "{v:#}");
    for l in layers {
        assert!(l["name"].is_string(), "{l:#}");
        assert!(l["kind"].is_string(), "{l:#}");
        assert!(l["output_shape"].is_array(), "{l:#}");
        assert!(l["params"].is_u64(), "{l:#}");
        assert!(l["parameter_bytes"].is_u64(), "{l:#}");
        assert!(l["activation_bytes"].is_u64(), "{l:#}");
    }
    let names: Vec<&str> = layers.iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names[0], "fc1");
    assert_eq!(names[2], "fc2");
    assert_eq!(names[4], "fc3");
    assert_eq!(layers[0]["output_shape"], serde_json::json!([32, 2000]));
    assert_eq!(layers[4]["output_shape"], serde_json::json!([32, 100]));
    assert_eq!(layers[0]["params"], 1000 * 2000 + 2000);
    assert_eq!(layers[0]["parameter_bytes"], 4 * (1000 * 2000 + 2000));
    let layer_params: u64 = layers.iter().map(|l| l["params"].as_u64().unwrap()).sum();
    assert_eq!(layer_params, MLP_PARAMS);
}

#[test]
fn mlp_figures() {
    let v = report(&[MLP]);
    assert_eq!(u(&v, "param_count"), MLP_PARAMS);
    assert_eq!(u(&v, "trainable_param_count"), MLP_PARAMS);
    assert_eq!(u(&v, "parameters_bytes"), 4 * MLP_PARAMS);
    assert_eq!(u(&v, "gradients_bytes"), 4 * MLP_PARAMS);
    assert_eq!(u(&v, "buffers_bytes"), 0);
    // The two ReLUs keep their outputs: [32, 2000] and [32, 1000] float32.
    assert_eq!(u(&v, "activations_bytes"), 4 * 32 * (2000 + 1000));
}

#[test]
fn total_equals_peak() {
    for file in [MLP, "examples/resnet50.toml", "examples/gpt2.toml"] {
        let v = report(&[file]);
        assert_eq!(u(&v, "total_bytes"), u(&v, "peak_bytes"), "{file}");
        assert!(u(&v, "peak_bytes") > u(&v, "parameters_bytes"), "{file}");
    }
}

#[test]
fn peak_covers_the_persistent_state() {
    let v = report(&[MLP]);
    let persistent = u(&v, "parameters_bytes")
        + u(&v, "gradients_bytes")
        + u(&v, "optimizer_state_bytes")
        + u(&v, "buffers_bytes");
    assert!(u(&v, "peak_bytes") >= persistent, "{v:#}");
}

fn total(args: &[&str]) -> u64 {
    u(&report(args), "total_bytes")
}

#[test]
fn budget_above_the_total_exits_zero() {
    let t = total(&[MLP]);
    for budget in [t + 1, t, t * 2] {
        let b = budget.to_string();
        let out = memest(&[MLP, "--budget", &b]);
        assert_success(&out);
        assert!(stdout(&out).contains("fits"), "{}", describe(&out));
    }
    let out = memest(&[MLP, "--budget", "80GB"]);
    assert_success(&out);
}

#[test]
fn budget_below_the_total_exits_one() {
    let t = total(&[MLP]);
    let budget = t - 1;
    let b = budget.to_string();
    let out = memest(&[MLP, "--budget", &b]);
    assert_eq!(code(&out), 1, "{}", describe(&out));
    let err = stderr(&out);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one line on stderr:\n{err}");
    let line = lines[0];
    assert!(line.contains("over budget"), "{line}");
    assert!(
        line.contains(&format_bytes(t, UnitSystem::Iec)),
        "the total should appear in {line:?}"
    );
    // A budget 1 byte below shows as the same rounded size, so also check a clearly smaller one.
    let out = memest(&[MLP, "--budget", "1KiB"]);
    assert_eq!(code(&out), 1, "{}", describe(&out));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("over budget"), "{err}");
    assert!(err.contains(&format_bytes(t, UnitSystem::Iec)), "{err}");
    assert!(err.contains("1.00 KiB"), "{err}");
    // The estimate is still printed.
    assert!(stdout(&out).contains("Total (peak)"), "{}", describe(&out));
}

#[test]
fn budget_in_json_output() {
    let t = total(&[MLP]);
    let out = memest(&[MLP, "--format", "json", "--budget", "1MiB"]);
    assert_eq!(code(&out), 1, "{}", describe(&out));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON even when over budget");
    assert_eq!(v["budget"]["budget_bytes"], 1 << 20);
    assert_eq!(v["budget"]["fits"], false);
    assert_eq!(v["budget"]["overshoot_bytes"], t - (1 << 20));
}

#[test]
fn bad_budget_exits_two() {
    let out = memest(&[MLP, "--budget", "12XB"]);
    assert_eq!(code(&out), 2, "{}", describe(&out));
    assert!(stderr(&out).contains("12XB"), "{}", describe(&out));
}

#[test]
fn batch_flag_overrides_the_file() {
    let base = report(&[MLP]);
    assert_eq!(base["input_shape"], serde_json::json!([32, 1000]));
    let v = report(&[MLP, "--batch", "64"]);
    assert_eq!(v["input_shape"], serde_json::json!([64, 1000]));
    assert_eq!(v["settings"]["batch"], 64);
    let (a32, a64) = (u(&base, "activations_bytes"), u(&v, "activations_bytes"));
    assert!(a32 > 0);
    let off = crate::common::err_pct(a64, 2 * a32);
    assert!(off.abs() < 1.0, "activations 32→64: {a32} → {a64}");
    // Parameters do not depend on the batch.
    assert_eq!(u(&v, "parameters_bytes"), u(&base, "parameters_bytes"));
    let short = report(&[MLP, "-b", "8"]);
    assert_eq!(short["input_shape"], serde_json::json!([8, 1000]));
}

#[test]
fn optim_flag_overrides_the_file() {
    let sgd = report(&[MLP, "--optim", "sgd"]);
    assert_eq!(u(&sgd, "optimizer_state_bytes"), 0);
    assert_eq!(sgd["settings"]["optimizer"], "sgd");
    let momentum = report(&[MLP, "--optim", "sgd-momentum"]);
    assert_eq!(u(&momentum, "optimizer_state_bytes"), 4 * MLP_PARAMS);
    // exp_avg and exp_avg_sq per parameter, and a float32 step per tensor (3 weights, 3 biases).
    let adam = report(&[MLP, "--optim", "adam"]);
    assert_eq!(
        u(&adam, "optimizer_state_bytes"),
        2 * u(&adam, "parameters_bytes") + 4 * 6
    );
    let adamw = report(&[MLP, "--optim", "adamw"]);
    assert_eq!(
        u(&adamw, "optimizer_state_bytes"),
        u(&adam, "optimizer_state_bytes")
    );
    assert!(u(&sgd, "peak_bytes") < u(&adam, "peak_bytes"));
}

#[test]
fn dtype_bfloat16_halves_the_parameters() {
    let fp32 = report(&[MLP]);
    let bf16 = report(&[MLP, "--dtype", "bfloat16"]);
    assert_eq!(
        u(&bf16, "parameters_bytes") * 2,
        u(&fp32, "parameters_bytes")
    );
    assert_eq!(u(&bf16, "param_count"), u(&fp32, "param_count"));
    assert_eq!(bf16["settings"]["dtype"], "bfloat16");
}

#[test]
fn amp_keeps_float32_weights() {
    let fp32 = report(&["examples/resnet50.toml"]);
    let amp = report(&["examples/resnet50.toml", "--amp", "bf16"]);
    assert_eq!(u(&amp, "parameters_bytes"), u(&fp32, "parameters_bytes"));
    assert_eq!(u(&amp, "gradients_bytes"), u(&fp32, "gradients_bytes"));
    assert_eq!(amp["settings"]["amp"], "bf16");
    // Autocast saves 16-bit activations, so fewer bytes are kept.
    assert!(u(&amp, "activations_bytes") < u(&fp32, "activations_bytes"));
}

#[test]
fn infer_mode_keeps_nothing_for_backward() {
    for file in [MLP, "examples/resnet50.toml", "examples/gpt2.toml"] {
        let v = report(&[file, "--mode", "infer"]);
        assert_eq!(u(&v, "gradients_bytes"), 0, "{file}");
        assert_eq!(u(&v, "activations_bytes"), 0, "{file}");
        assert_eq!(u(&v, "optimizer_state_bytes"), 0, "{file}");
        assert!(u(&v, "peak_activations_bytes") > 0, "{file}");
        assert_eq!(v["settings"]["mode"], "infer", "{file}");
        let train = report(&[file]);
        assert!(u(&v, "peak_bytes") < u(&train, "peak_bytes"), "{file}");
        assert_eq!(
            u(&v, "parameters_bytes"),
            u(&train, "parameters_bytes"),
            "{file}"
        );
    }
}

#[test]
fn checkpointing_lowers_gpt2_activations() {
    let plain = report(&["examples/gpt2.toml"]);
    let ckpt = report(&["examples/gpt2.toml", "--checkpoint"]);
    assert!(
        u(&ckpt, "activations_bytes") < u(&plain, "activations_bytes") / 2,
        "checkpointed {} vs plain {}",
        u(&ckpt, "activations_bytes"),
        u(&plain, "activations_bytes")
    );
    assert_eq!(u(&ckpt, "parameters_bytes"), u(&plain, "parameters_bytes"));
    assert_eq!(ckpt["settings"]["checkpoint"], true);
}

#[test]
fn seq_flag_overrides_the_file() {
    let v = report(&["examples/gpt2.toml", "--seq", "128"]);
    assert_eq!(v["input_shape"], serde_json::json!([4, 128]));
    let base = report(&["examples/gpt2.toml"]);
    assert_eq!(base["input_shape"], serde_json::json!([4, 256]));
    assert!(u(&v, "activations_bytes") < u(&base, "activations_bytes"));
}

#[test]
fn attention_flag_changes_what_is_kept() {
    let eager = report(&["examples/gpt2.toml", "--attention", "eager"]);
    let flash = report(&["examples/gpt2.toml", "--attention", "flash"]);
    assert!(u(&flash, "activations_bytes") < u(&eager, "activations_bytes"));
}

#[test]
fn default_units_are_iec() {
    let text = stdout(&memest(&[MLP]));
    assert!(text.contains(" MiB"), "{text}");
    assert!(!text.contains(" MB"), "{text}");
}

#[test]
fn si_flag_prints_si_units() {
    let text = stdout(&memest(&[MLP, "--si"]));
    assert!(text.contains(" MB"), "{text}");
    assert!(!text.contains("MiB") && !text.contains("KiB"), "{text}");
    let big = stdout(&memest(&["examples/vgg16.toml", "--si"]));
    assert!(big.contains(" GB"), "{big}");
    let big = stdout(&memest(&["examples/vgg16.toml"]));
    assert!(big.contains(" GiB"), "{big}");
}

#[test]
fn per_layer_prints_a_second_table() {
    let plain = stdout(&memest(&[MLP]));
    let out = memest(&[MLP, "--per-layer"]);
    assert_success(&out);
    let text = stdout(&out);
    assert_eq!(plain.matches('┌').count(), 1, "{plain}");
    assert_eq!(text.matches('┌').count(), 2, "{text}");
    assert!(text.starts_with(&plain), "the summary comes first:\n{text}");
    for needle in [
        "Layer",
        "Output shape",
        "fc1",
        "fc2",
        "fc3",
        "[32, 2000]",
        "2,002,000",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn stdin_toml() {
    let src = std::fs::read_to_string(path(MLP)).unwrap();
    let v = json(&memest_stdin(&["-", "--format", "json"], &src));
    assert_eq!(v, report(&[MLP]));
}

#[test]
fn stdin_json_is_sniffed() {
    let src = std::fs::read_to_string(path("tests/fixtures/mlp.json")).unwrap();
    let v = json(&memest_stdin(&["-", "--format", "json"], &src));
    assert_eq!(v, report(&[MLP]));
    // Leading whitespace before the brace is still JSON.
    let v = json(&memest_stdin(
        &["-", "--format", "json"],
        &format!("\n  {src}"),
    ));
    assert_eq!(u(&v, "param_count"), MLP_PARAMS);
}

#[test]
fn stdin_model_without_a_name_is_called_model() {
    let src = "[input]\nshape = [4]\n[[layers]]\nkind = \"linear\"\nout_features = 2\n";
    let v = json(&memest_stdin(&["-", "--format", "json"], src));
    assert_eq!(v["model"], "model");
    assert_eq!(u(&v, "param_count"), 4 * 2 + 2);
}

#[test]
fn json_model_gives_the_same_report_as_toml() {
    let toml = report(&[MLP]);
    let json = report(&["tests/fixtures/mlp.json"]);
    assert_eq!(json, toml);
    let toml = stdout(&memest(&[MLP, "--format", "json", "--batch", "7"]));
    let json = stdout(&memest(&[
        "tests/fixtures/mlp.json",
        "--format",
        "json",
        "--batch",
        "7",
    ]));
    assert_eq!(json, toml, "byte-identical JSON output");
}

#[test]
fn unknown_extension_is_sniffed() {
    let toml = TempModel::new("txt", &std::fs::read_to_string(path(MLP)).unwrap());
    assert_eq!(report(&[toml.arg()]), report(&[MLP]));
    let json = TempModel::new(
        "model",
        &std::fs::read_to_string(path("tests/fixtures/mlp.json")).unwrap(),
    );
    assert_eq!(report(&[json.arg()]), report(&[MLP]));
}

#[test]
fn file_name_is_the_default_model_name() {
    let m = TempModel::new(
        "toml",
        "[input]\nshape = [4]\n[[layers]]\nkind = \"relu\"\n",
    );
    let v = report(&[m.arg()]);
    let stem = m.path().file_stem().unwrap().to_str().unwrap();
    assert_eq!(v["model"], stem);
    assert_eq!(u(&v, "param_count"), 0);
}

#[test]
fn help_mentions_the_exit_status() {
    for flag in ["--help", "-h"] {
        let out = memest(&[flag]);
        assert_success(&out);
        let text = stdout(&out);
        assert!(text.contains("Exit status"), "{flag}:\n{text}");
        assert!(text.contains("1 = over the --budget"), "{flag}:\n{text}");
        assert!(text.contains("2 = bad input"), "{flag}:\n{text}");
    }
}

#[test]
fn version_flag() {
    let out = memest(&["--version"]);
    assert_success(&out);
    assert!(stdout(&out).contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn no_arguments_is_a_usage_error() {
    let out = memest(&[]);
    assert_eq!(code(&out), 2, "{}", describe(&out));
    assert!(stderr(&out).contains("Usage"), "{}", describe(&out));
}

#[test]
fn broken_pipe_is_not_an_error() {
    use std::process::{Command, Stdio};
    // `memest ... | head -c 1`: closing stdout early must not print an error.
    let mut child = Command::new(env!("CARGO_BIN_EXE_memest"))
        .args(["examples/resnet50.toml", "--per-layer"])
        .current_dir(crate::common::root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(!stderr(&out).contains("panicked"), "{}", describe(&out));
    assert!(matches!(out.status.code(), Some(0)), "{}", describe(&out));
}
