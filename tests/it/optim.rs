//! Optimizers and precision recipes: state bytes against PyTorch measurements, the recipe in the
//! table and the JSON, and contradictory flags.

use serde_json::Value;

use crate::common::{TempModel, code, describe, memest, report, stderr, stdout, u};

const MLP: &str = "examples/mlp.toml";
const VIT: &str = "examples/vit_b_16.toml";

/// Parameters of examples/mlp.toml (1000→2000→1000→100 with biases), in 6 tensors.
const MLP_PARAMS: u64 = 1000 * 2000 + 2000 + 2000 * 1000 + 1000 + 1000 * 100 + 100;
const MLP_TENSORS: u64 = 6;

const ALL_OPTIMIZERS: [&str; 12] = [
    "sgd",
    "sgd-momentum",
    "sgd-nesterov",
    "adam",
    "adamw",
    "adagrad",
    "rmsprop",
    "rmsprop-momentum",
    "adafactor",
    "lion",
    "lamb",
    "adam-8bit",
];

/// torchvision's `vit_b_16` measured with PyTorch 2.15 on the CPU, batch 1, after one warm-up
/// step: the bytes of every tensor in `optimizer.state` (each storage once), and the peak of
/// the bytes `step()` allocates above what was live when it started (`profile_memory=True`).
/// `torch.optim` optimizers with `foreach=True` and default hyperparameters;
/// `lion_pytorch.foreach.Lion` 0.2.5, `timm.optim.Lamb` 1.0.31 (`foreach=True`),
/// `bitsandbytes.optim.Adam8bit` 0.50.2. `None`: the CPU step is not the CUDA one (bitsandbytes
/// falls back to unfused CPU code that allocates; its CUDA kernel updates in place).
const VIT_MEASURED: [(&str, u64, u64, Option<u64>); 22] = [
    ("adam", 32, 692_541_856, Some(346_270_636)),
    ("adamw", 32, 692_541_856, Some(346_270_636)),
    ("sgd-momentum", 32, 346_270_624, Some(12)),
    ("sgd-nesterov", 32, 346_270_624, Some(12)),
    ("adagrad", 32, 346_271_232, Some(692_541_260)),
    ("rmsprop", 32, 346_271_232, Some(346_270_636)),
    ("rmsprop-momentum", 32, 692_541_856, Some(346_270_636)),
    ("adafactor", 32, 1_391_800, Some(346_270_624)),
    ("lion", 32, 346_270_624, Some(346_270_624)),
    ("lamb", 32, 692_541_248, Some(1_038_816_896)),
    ("adam-8bit", 32, 176_582_008, None),
    ("adam", 16, 346_271_232, Some(173_135_322)),
    ("adamw", 16, 346_271_232, Some(173_135_322)),
    ("sgd-momentum", 16, 173_135_312, Some(10)),
    ("sgd-nesterov", 16, 173_135_312, Some(10)),
    ("adagrad", 16, 173_135_920, Some(346_270_634)),
    ("rmsprop", 16, 173_135_920, Some(173_135_322)),
    ("rmsprop-momentum", 16, 346_271_232, Some(173_135_322)),
    ("adafactor", 16, 696_204, Some(173_135_312)),
    ("lion", 16, 173_135_312, Some(173_135_312)),
    ("lamb", 16, 346_270_624, Some(519_408_524)),
    ("adam-8bit", 16, 176_582_008, None),
];

#[test]
fn vit_state_bytes_equal_the_measurement() {
    for (opt, bits, state, temps) in VIT_MEASURED {
        let recipe = if bits == 32 { "fp32" } else { "bf16" };
        // measured with foreach=True; on the CPU torch.optim's default is the for-loop
        let mut args = vec![
            VIT, "--device", "cpu", "--batch", "1", "--optim", opt, "--recipe", recipe,
        ];
        if !matches!(opt, "lion" | "lamb" | "adam-8bit") {
            args.extend(["--optim-impl", "foreach"]);
        }
        let v = report(&args);
        assert_eq!(
            u(&v, "optimizer_state_bytes"),
            state,
            "{opt} {recipe}: optimizer state"
        );
        if let Some(t) = temps {
            // the measurement adds a few scalars (norms, step increments): at most 8 KiB
            let est = u(&v, "optimizer_temporaries_bytes");
            assert!(
                t.abs_diff(est) <= 8 * 1024,
                "{opt} {recipe}: temporaries {est}, measured {t}"
            );
        }
    }
}

/// The same ViT-B/16 step with `foreach=False` (`--optim-impl for-loop`) and `fused=True`
/// (`--optim-impl fused`), measured by `tools/measure_optim.py` (PyTorch 2.15, CPU, batch 1,
/// after one warm-up step): the state in `optimizer.state` and the peak `step()` allocates above
/// what was live when it started (`profile_memory=True`). Columns: optimizer, implementation,
/// bits, measured state, measured temporaries, memest's temporaries.
///
/// The for-loop step needs one tensor's temporaries at a time, plus what the loop's variables
/// still hold of the previous tensor: AdamW peaks at `mlp.3.weight` [768, 3072] (P = 9,437,184
/// B in float32), whose square root and quotient (2P) are alive while `mlp.0.bias`'s `denom`
/// (12,288 B) is still bound: 18,886,656. The measurement adds the step scalars (12 B in
/// float32, 10 B in bfloat16). Fused steps update in place.
const VIT_IMPL_MEASURED: [(&str, &str, u64, u64, u64, u64); 30] = [
    ("adamw", "for-loop", 32, 692_541_856, 18_886_668, 18_886_656),
    ("adam", "for-loop", 32, 692_541_856, 18_886_668, 18_886_656),
    ("sgd", "for-loop", 32, 0, 0, 0),
    ("sgd-momentum", "for-loop", 32, 346_270_624, 12, 0),
    (
        "sgd-nesterov",
        "for-loop",
        32,
        346_270_624,
        9_437_184,
        9_437_184,
    ),
    ("adagrad", "for-loop", 32, 346_271_232, 9_449_484, 9_449_472),
    ("rmsprop", "for-loop", 32, 346_271_232, 9_449_472, 9_449_472),
    (
        "rmsprop-momentum",
        "for-loop",
        32,
        692_541_856,
        9_449_472,
        9_449_472,
    ),
    ("adafactor", "for-loop", 32, 1_391_800, 9_477_136, 9_477_120),
    ("adamw", "for-loop", 16, 346_271_232, 9_443_338, 9_443_328),
    ("adam", "for-loop", 16, 346_271_232, 9_443_338, 9_443_328),
    ("sgd", "for-loop", 16, 0, 0, 0),
    ("sgd-momentum", "for-loop", 16, 173_135_312, 10, 0),
    (
        "sgd-nesterov",
        "for-loop",
        16,
        173_135_312,
        4_718_592,
        4_718_592,
    ),
    ("adagrad", "for-loop", 16, 173_135_920, 4_724_746, 4_724_736),
    ("rmsprop", "for-loop", 16, 173_135_920, 4_724_736, 4_724_736),
    (
        "rmsprop-momentum",
        "for-loop",
        16,
        346_271_232,
        4_724_736,
        4_724_736,
    ),
    // 140,928 B short: the CPU's bfloat16 `mm` for `row_var @ col_var` [768, 1] @ [1, 3072]
    // allocates that much scratch beside its output (not modelled)
    ("adafactor", "for-loop", 16, 696_204, 4_879_488, 4_738_560),
    ("adamw", "fused", 32, 692_541_856, 12, 0),
    ("adam", "fused", 32, 692_541_856, 12, 0),
    ("sgd", "fused", 32, 0, 0, 0),
    ("sgd-momentum", "fused", 32, 346_270_624, 0, 0),
    ("sgd-nesterov", "fused", 32, 346_270_624, 0, 0),
    ("adagrad", "fused", 32, 346_271_232, 12, 0),
    ("adamw", "fused", 16, 346_271_232, 12, 0),
    ("adam", "fused", 16, 346_271_232, 12, 0),
    ("sgd", "fused", 16, 0, 0, 0),
    ("sgd-momentum", "fused", 16, 173_135_312, 0, 0),
    ("sgd-nesterov", "fused", 16, 173_135_312, 0, 0),
    ("adagrad", "fused", 16, 173_135_920, 12, 0),
];

#[test]
fn vit_for_loop_and_fused_steps_equal_the_measurement() {
    for (opt, imp, bits, state, measured, estimate) in VIT_IMPL_MEASURED {
        let recipe = if bits == 32 { "fp32" } else { "bf16" };
        let args = [
            VIT,
            "--device",
            "cpu",
            "--batch",
            "1",
            "--optim",
            opt,
            "--optim-impl",
            imp,
            "--recipe",
            recipe,
        ];
        let v = report(&args);
        assert_eq!(u(&v, "optimizer_state_bytes"), state, "{args:?}: state");
        assert_eq!(
            u(&v, "optimizer_temporaries_bytes"),
            estimate,
            "{args:?}: temporaries"
        );
        assert_eq!(v["settings"]["optimizer_impl"], imp, "{args:?}");
        // within the step scalars of the measurement, but for bfloat16 Adafactor's scratch
        if (opt, bits) != ("adafactor", 16) {
            assert!(measured - estimate <= 16, "{args:?}: measured {measured}");
        }
    }
    // foreach stays the default and is left out of the JSON
    let v = report(&[VIT, "--batch", "1"]);
    assert!(v["settings"].get("optimizer_impl").is_none(), "{v:#}");
}

#[test]
fn optim_impl_is_refused_outside_torch_optim() {
    for (opt, imp) in [
        ("lion", "for-loop"),
        ("lamb", "foreach"),
        ("adam-8bit", "fused"),
        ("rmsprop", "fused"),
        ("adafactor", "fused"),
    ] {
        let out = memest(&[MLP, "--optim", opt, "--optim-impl", imp]);
        assert_eq!(code(&out), 2, "{opt} {imp}: {}", describe(&out));
        assert!(stderr(&out).contains("--optim-impl"), "{}", describe(&out));
    }
}

/// The file's `[defaults]` and the flags take the same names and aliases, in any case.
#[test]
fn flags_take_the_file_aliases() {
    for (flag, alias, key, canonical) in [
        ("--optim", "adam8bit", "optimizer", "adam-8bit"),
        ("--optim", "SGD_Nesterov", "optimizer", "sgd-nesterov"),
        ("--optim", "momentum", "optimizer", "sgd-momentum"),
        ("--attention", "sdpa", "attention", "flash"),
        ("--mode", "eval", "mode", "infer"),
        ("--mode", "inference", "mode", "infer"),
        ("--optim-impl", "for_loop", "optimizer_impl", "for-loop"),
    ] {
        let v = report(&["examples/gpt2.toml", flag, alias]);
        assert_eq!(v["settings"][key], canonical, "{flag} {alias}");
        let m = TempModel::new(
            "toml",
            &format!(
                "[input]\nshape = [8]\n[defaults]\n{key} = \"{alias}\"\n[[layers]]\nkind = \"linear\"\nout_features = 4\n"
            ),
        );
        let v = report(&[m.arg()]);
        assert_eq!(v["settings"][key], canonical, "file {key} = {alias}");
    }
}

#[test]
fn every_optimizer_runs_and_is_echoed() {
    for opt in ALL_OPTIMIZERS {
        let v = report(&[MLP, "--optim", opt]);
        assert_eq!(v["settings"]["optimizer"], opt);
        let table = stdout(&memest(&[MLP, "--optim", opt]));
        assert!(table.contains(&format!("({opt}")), "{opt}:\n{table}");
    }
}

#[test]
fn file_default_optimizer_accepts_the_new_names() {
    for (name, canonical) in [
        ("adam-8bit", "adam-8bit"),
        ("adam8bit", "adam-8bit"),
        ("sgd_nesterov", "sgd-nesterov"),
        ("lion", "lion"),
    ] {
        let m = TempModel::new(
            "toml",
            &format!(
                "[input]\nshape = [8]\n[defaults]\noptimizer = \"{name}\"\n[[layers]]\nkind = \"linear\"\nout_features = 4\n"
            ),
        );
        let v = report(&[m.arg()]);
        assert_eq!(v["settings"]["optimizer"], canonical, "{name}");
    }
}

fn bytes_per_param(v: &Value) -> [f64; 5] {
    let b = &v["recipe"]["bytes_per_param"];
    [
        "weights",
        "gradients",
        "master_weights",
        "optimizer_state",
        "total",
    ]
    .map(|k| {
        b[k].as_f64()
            .unwrap_or_else(|| panic!("{k} missing in {b}"))
    })
}

#[test]
fn recipes_report_their_bytes_per_parameter() {
    for (recipe, expected) in [
        ("fp32", [4.0, 4.0, 0.0, 8.0, 16.0]),
        ("bf16", [2.0, 2.0, 0.0, 4.0, 8.0]),
        ("fp16", [2.0, 2.0, 0.0, 4.0, 8.0]),
        ("amp-bf16", [4.0, 4.0, 0.0, 8.0, 16.0]),
        ("amp-fp16", [4.0, 4.0, 0.0, 8.0, 16.0]),
        ("mixed-bf16", [2.0, 2.0, 4.0, 8.0, 16.0]),
        ("mixed-fp16", [2.0, 2.0, 4.0, 8.0, 16.0]),
        ("mixed-bf16-fp32-grads", [2.0, 4.0, 4.0, 8.0, 18.0]),
    ] {
        let v = report(&[MLP, "--optim", "adam", "--recipe", recipe]);
        assert_eq!(v["recipe"]["name"], recipe);
        assert_eq!(v["recipe"]["explicit"], true);
        assert_eq!(v["settings"]["recipe"], recipe);
        assert_eq!(bytes_per_param(&v), expected, "{recipe}");
        // whole numbers are JSON integers
        assert!(v["recipe"]["bytes_per_param"]["total"].is_u64(), "{recipe}");
        // the bytes the estimate carries agree with the recipe
        let [w, g, m, _, _] = expected.map(|x| x as u64);
        assert_eq!(u(&v, "parameters_bytes"), w * MLP_PARAMS, "{recipe}");
        assert_eq!(u(&v, "gradients_bytes"), g * MLP_PARAMS, "{recipe}");
        assert_eq!(u(&v, "master_weights_bytes"), m * MLP_PARAMS, "{recipe}");
        let state_elem = if m > 0 { 4 } else { w };
        assert_eq!(
            u(&v, "optimizer_state_bytes"),
            2 * state_elem * MLP_PARAMS + 4 * MLP_TENSORS,
            "{recipe}"
        );
    }
}

#[test]
fn the_table_names_the_recipe() {
    for (args, line) in [
        (
            vec!["--optim", "adam", "--recipe", "mixed-bf16"],
            "recipe: mixed-bf16: 2 (weights) + 2 (grads) + 4 (master) + 8 (adam) = 16 bytes/parameter",
        ),
        (
            vec!["--optim", "adamw", "--recipe", "mixed-bf16-fp32-grads"],
            "recipe: mixed-bf16-fp32-grads: 2 (weights) + 4 (grads) + 4 (master) + 8 (adamw) = 18 bytes/parameter",
        ),
        (
            vec!["--optim", "adamw"],
            "recipe: fp32: 4 (weights) + 4 (grads) + 8 (adamw) = 16 bytes/parameter",
        ),
        (
            vec!["--optim", "sgd", "--amp", "bf16"],
            "recipe: amp-bf16: 4 (weights) + 4 (grads) + 0 (sgd) = 8 bytes/parameter; autocast to bfloat16",
        ),
        (
            vec!["--optim", "adam-8bit", "--dtype", "bfloat16"],
            "recipe: bf16: 2 (weights) + 2 (grads) + 2.031 (adam-8bit) = 6.031 bytes/parameter",
        ),
        (
            vec!["--mode", "infer", "--dtype", "float16"],
            "recipe: fp16: 2 (weights) = 2 bytes/parameter (inference",
        ),
    ] {
        let mut all = vec![MLP];
        all.extend(&args);
        let out = memest(&all);
        assert_eq!(code(&out), 0, "{}", describe(&out));
        let text = stdout(&out);
        assert!(text.contains(line), "{args:?}: missing {line:?} in\n{text}");
    }
    let text = stdout(&memest(&[MLP, "--recipe", "mixed-fp16"]));
    assert!(text.contains("Master weights"), "{text}");
    assert!(text.contains("master weights: 15.65 MiB"), "{text}");
}

#[test]
fn recipe_without_the_flag_follows_dtype_and_amp() {
    for (args, name) in [
        (vec![], "fp32"),
        (vec!["--dtype", "bfloat16"], "bf16"),
        (vec!["--dtype", "float16"], "fp16"),
        (vec!["--amp", "fp16"], "amp-fp16"),
        (vec!["--dtype", "float64"], "pure-float64"),
    ] {
        let mut all = vec![MLP];
        all.extend(&args);
        let v = report(&all);
        assert_eq!(v["recipe"]["name"], name, "{args:?}");
        assert_eq!(v["recipe"]["explicit"], false, "{args:?}");
    }
}

#[test]
fn amp_recipe_equals_the_amp_flag() {
    let a = report(&[VIT, "--batch", "2", "--recipe", "amp-bf16"]);
    let b = report(&[VIT, "--batch", "2", "--amp", "bf16"]);
    assert_eq!(u(&a, "total_bytes"), u(&b, "total_bytes"));
    assert_eq!(u(&a, "activations_bytes"), u(&b, "activations_bytes"));
    assert_eq!(a["settings"]["amp"], "bf16");
}

#[test]
fn mixed_recipes_run_16_bit_activations() {
    let mixed = report(&[VIT, "--batch", "2", "--recipe", "mixed-bf16"]);
    let pure = report(&[VIT, "--batch", "2", "--recipe", "bf16"]);
    assert_eq!(
        u(&mixed, "activations_bytes"),
        u(&pure, "activations_bytes")
    );
    assert_eq!(mixed["recipe"]["activations_dtype"], "bfloat16");
    assert_eq!(mixed["recipe"]["optimizer_state_dtype"], "float32");
}

/// Under `mixed-bf16` the step hands the optimizer float32 copies of the bfloat16 gradients and
/// frees those (Megatron's `_copy_model_grads_to_main_grads`), then runs Adam's `foreach`
/// temporaries: with a batch of 1 the MLP peaks there.
#[test]
fn mixed_step_replaces_16_bit_gradients_with_float32_copies() {
    let n = MLP_PARAMS;
    let v = report(&[
        MLP,
        "--batch",
        "1",
        "--optim",
        "adam",
        "--recipe",
        "mixed-bf16",
    ]);
    assert_eq!(v["peak_phase"], "optimizer_step");
    assert_eq!(u(&v, "optimizer_temporaries_bytes"), 4 * n + 4 * n);
    let at = &v["at_peak"];
    assert_eq!(u(at, "gradients_bytes"), 0);
    assert_eq!(u(at, "temporaries_bytes"), 8 * n);
    assert_eq!(u(at, "master_weights_bytes"), 4 * n);
    // Adam's moments; its `step` counters (4 B a tensor) are host tensors on CUDA, in
    // `optimizer_state_bytes` but not in the peak.
    assert_eq!(u(at, "optimizer_state_bytes"), 8 * n);
    assert_eq!(u(&v, "optimizer_state_bytes"), 8 * n + 4 * MLP_TENSORS);
    let sum: u64 = at
        .as_object()
        .unwrap()
        .values()
        .map(|x| x.as_u64().unwrap())
        .sum();
    assert_eq!(sum, u(&v, "peak_bytes"));

    // a float32 accumulation buffer is handed over as it is: no copy
    let f = report(&[
        MLP,
        "--batch",
        "1",
        "--optim",
        "adam",
        "--recipe",
        "mixed-bf16-fp32-grads",
    ]);
    assert_eq!(u(&f, "optimizer_temporaries_bytes"), 4 * n);
    assert_eq!(u(&f["at_peak"], "gradients_bytes"), 4 * n);
}

#[test]
fn inference_has_no_master_weights() {
    let v = report(&[MLP, "--mode", "infer", "--recipe", "mixed-bf16"]);
    assert_eq!(u(&v, "master_weights_bytes"), 0);
    assert_eq!(bytes_per_param(&v), [2.0, 0.0, 0.0, 0.0, 2.0]);
    assert_eq!(v["recipe"]["gradients_dtype"], Value::Null);
}

#[test]
fn adafactor_shows_this_models_average() {
    let v = report(&[MLP, "--optim", "adafactor"]);
    let b = bytes_per_param(&v);
    // factored: (rows + columns) per matrix, a full vector per bias, far below 1 element each
    assert!(b[3] > 0.0 && b[3] < 0.1, "{b:?}");
    assert_eq!(
        u(&v, "optimizer_state_bytes"),
        4 * ((2000 + 1000) + 2000 + (1000 + 2000) + 1000 + (100 + 1000) + 100) + 4 * MLP_TENSORS
    );
}

#[test]
fn contradictory_recipe_flags_are_usage_errors() {
    for (args, needles) in [
        (
            vec!["--recipe", "mixed-bf16", "--amp", "fp16"],
            vec!["--recipe mixed-bf16", "--amp fp16"],
        ),
        (
            vec!["--recipe", "amp-fp16", "--amp", "bf16"],
            vec!["autocast in float16"],
        ),
        (
            vec!["--recipe", "bf16", "--dtype", "float32"],
            vec!["bfloat16 weights", "--dtype float32"],
        ),
        (
            vec!["--recipe", "mixed-fp16", "--dtype", "bfloat16"],
            vec!["float16 weights"],
        ),
    ] {
        let mut all = vec![MLP];
        all.extend(&args);
        let out = memest(&all);
        assert_eq!(code(&out), 2, "{args:?}\n{}", describe(&out));
        let err = stderr(&out);
        for n in needles {
            assert!(err.contains(n), "{args:?}: missing {n:?} in {err}");
        }
    }
    let out = memest(&[MLP, "--recipe", "mixed-bf32"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("mixed-bf16"), "{}", stderr(&out));
}
