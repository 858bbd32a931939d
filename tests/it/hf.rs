//! Hugging Face `config.json` import (`examples/hf/`): exact parameter counts, heads, the measured
//! reference cases loaded from their configs, `--print-model` round trips, and errors.

use serde_json::Value;

use crate::common::{TempModel, code, describe, err_pct, memest, path, report, stderr, stdout, u};

/// Every shipped config with its exact parameter count as transformers 5.24 builds the class its
/// `architectures` names (counted on the meta device; tied weights once).
const PARAM_COUNTS: &[(&str, u64)] = &[
    ("examples/hf/llama-2-7b.json", 6_738_415_616),
    ("examples/hf/llama-3-8b.json", 8_030_261_248),
    ("examples/hf/mistral-7b-v0.1.json", 7_241_732_096),
    ("examples/hf/mixtral-8x7b.json", 46_702_792_704),
    ("examples/hf/gpt2.json", 124_439_808),
    ("examples/hf/bert-base-uncased.json", 109_514_298),
    ("examples/hf/qwen2-7b.json", 7_615_616_512),
    ("examples/hf/qwen3-8b.json", 8_190_735_360),
    ("examples/hf/gemma-7b.json", 8_537_680_896),
    ("examples/hf/phi-3-mini.json", 3_821_079_552),
    ("examples/hf/qwen1.5-moe-a2.7b.json", 14_315_784_192),
    ("examples/hf/t5-small.json", 60_506_624),
    ("examples/hf/llama_tiny.json", 44_044_800),
    ("examples/hf/bert_base_cls.json", 109_483_778),
];

/// Runs a report with a short sequence (the counts do not depend on it).
fn params(args: &[&str]) -> u64 {
    let mut all = args.to_vec();
    all.extend(["--seq", "64"]);
    u(&report(&all), "param_count")
}

#[test]
fn parameter_counts_are_exact() {
    let mut wrong = Vec::new();
    for &(file, expected) in PARAM_COUNTS {
        let got = params(&[file]);
        if got != expected {
            wrong.push(format!("{file}: memest {got}, transformers {expected}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_shipped_config_is_counted() {
    let mut files: Vec<String> = std::fs::read_dir(path("examples/hf"))
        .unwrap()
        .map(|e| format!("examples/hf/{}", e.unwrap().file_name().to_string_lossy()))
        .filter(|f| f.ends_with(".json"))
        .collect();
    files.sort();
    for f in &files {
        assert!(
            PARAM_COUNTS.iter().any(|(p, _)| p == f),
            "{f} has no exact parameter count in PARAM_COUNTS"
        );
    }
}

#[test]
fn head_flag_picks_another_head() {
    let cases: &[(&[&str], u64)] = &[
        // bare BertModel, pooler included
        (
            &["examples/hf/bert-base-uncased.json", "--head", "none"],
            109_482_240,
        ),
        (
            &[
                "examples/hf/bert-base-uncased.json",
                "--head",
                "classification",
            ],
            109_483_778,
        ),
        (
            &["examples/hf/bert_base_cls.json", "--head", "lm"],
            109_514_298,
        ),
        // GPT-2's head is tied: the bare model has as many parameters
        (&["examples/hf/gpt2.json", "--head", "none"], 124_439_808),
        (
            &["examples/hf/gpt2.json", "--head", "classification"],
            124_441_344,
        ),
        (
            &["examples/hf/llama_tiny.json", "--head", "none"],
            27_660_800,
        ),
        (
            &["examples/hf/llama_tiny.json", "--head", "classification"],
            27_661_824,
        ),
        (
            &["examples/hf/llama_tiny.json", "--head", "auto"],
            44_044_800,
        ),
        (
            &["examples/hf/qwen3-8b.json", "--head", "classification"],
            7_568_413_696,
        ),
        (&["examples/hf/t5-small.json", "--head", "none"], 60_506_624),
        (
            &["examples/hf/t5-small.json", "--head", "classification"],
            60_770_306,
        ),
    ];
    for (args, expected) in cases {
        assert_eq!(params(args), *expected, "memest {}", args.join(" "));
    }
}

#[test]
fn bare_model_has_no_loss() {
    let v = report(&[
        "examples/hf/llama_tiny.json",
        "--head",
        "none",
        "--seq",
        "32",
    ]);
    let layers = v["layers"].as_array().unwrap();
    assert!(
        layers.iter().all(|l| l["kind"] != "cross_entropy"),
        "{layers:#?}"
    );
    let v = report(&["examples/hf/llama_tiny.json", "--seq", "32"]);
    let last = v["layers"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["kind"], "cross_entropy");
}

/// What the model description of a config looks like, through `--print-model`.
fn printed(args: &[&str]) -> toml::Table {
    let mut all = vec!["--print-model"];
    all.extend_from_slice(args);
    let out = memest(&all);
    assert_eq!(code(&out), 0, "{}", describe(&out));
    stdout(&out)
        .parse::<toml::Table>()
        .unwrap_or_else(|e| panic!("--print-model is not TOML: {e}\n{}", describe(&out)))
}

fn layers(t: &toml::Table) -> Vec<toml::Table> {
    t["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l.as_table().unwrap().clone())
        .collect()
}

#[test]
fn decoder_layers_are_one_repeat_block() {
    for (file, count) in [
        ("examples/hf/llama-2-7b.json", 32),
        ("examples/hf/mixtral-8x7b.json", 32),
        ("examples/hf/qwen3-8b.json", 36),
        ("examples/hf/gemma-7b.json", 28),
    ] {
        let t = printed(&[file]);
        let repeats: Vec<_> = layers(&t)
            .into_iter()
            .filter(|l| l["kind"].as_str() == Some("repeat"))
            .collect();
        assert_eq!(repeats.len(), 1, "{file}");
        assert_eq!(repeats[0]["count"].as_integer(), Some(count), "{file}");
    }
}

/// The attention layer of the (first) repeated block.
fn attention(file: &str) -> toml::Table {
    let t = printed(&[file]);
    let block = layers(&t)
        .into_iter()
        .find(|l| l["kind"].as_str() == Some("repeat"))
        .expect("a repeat block");
    block["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_table().unwrap().clone())
        .find(|l| l["kind"].as_str() == Some("attention"))
        .expect("an attention layer")
}

#[test]
fn family_attention_keys() {
    let a = attention("examples/hf/llama-3-8b.json");
    assert_eq!(a["kv_heads"].as_integer(), Some(8));
    assert_eq!(a["bias"].as_bool(), Some(false));
    assert_eq!(a["rotary"].as_bool(), Some(true));
    let a = attention("examples/hf/mistral-7b-v0.1.json");
    assert_eq!(a["sliding_window"].as_integer(), Some(4096));
    let a = attention("examples/hf/qwen2-7b.json");
    assert!(a.get("bias").is_none(), "qwen2 has q/k/v biases: {a:?}");
    assert_eq!(a["out_bias"].as_bool(), Some(false));
    assert!(
        a.get("sliding_window").is_none(),
        "use_sliding_window is false"
    );
    let a = attention("examples/hf/qwen3-8b.json");
    assert_eq!(a["qk_norm"].as_bool(), Some(true));
    let a = attention("examples/hf/gemma-7b.json");
    assert_eq!(a["head_dim"].as_integer(), Some(256));
    let a = attention("examples/hf/phi-3-mini.json");
    assert_eq!(a["fused_qkv"].as_bool(), Some(true));
    let t = printed(&["examples/hf/gemma-7b.json"]);
    let l = layers(&t);
    assert_eq!(l[1]["kind"].as_str(), Some("scale"));
    let lm = l
        .iter()
        .find(|l| l["name"].as_str() == Some("lm_head"))
        .unwrap();
    assert_eq!(lm["tie"].as_str(), Some("model.embed_tokens"));
}

#[test]
fn defaults_come_from_the_config() {
    let t = printed(&["examples/hf/llama-2-7b.json"]);
    assert_eq!(t["defaults"]["dtype"].as_str(), Some("float16"));
    assert_eq!(t["defaults"]["seq"].as_integer(), Some(2048));
    assert_eq!(
        t["input"]["shape"].as_array().unwrap()[0].as_str(),
        Some("seq")
    );
    assert_eq!(t["input"]["dtype"].as_str(), Some("int64"));
    let t = printed(&["examples/hf/bert-base-uncased.json"]);
    assert_eq!(t["defaults"]["seq"].as_integer(), Some(512));
    assert!(t["defaults"].get("dtype").is_none());
    let v = report(&["examples/hf/llama-3-8b.json"]);
    assert_eq!(v["settings"]["dtype"], "bfloat16");
    assert_eq!(v["settings"]["seq"], 2048);
}

/// The hand-written examples whose measured cases also run from a Hugging Face config.
const FROM_CONFIG: &[(&str, &str)] = &[
    ("examples/llama_tiny.toml", "examples/hf/llama_tiny.json"),
    ("examples/gpt2.toml", "examples/hf/gpt2.json"),
    ("examples/bert_base.toml", "examples/hf/bert_base_cls.json"),
];

fn load(rel: &str) -> Value {
    let text = std::fs::read_to_string(path(rel)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The measured cases of `tests/data/` whose model has a config under `examples/hf/`, with the
/// arguments switched to the config.
fn config_cases() -> Vec<(String, Vec<String>, Vec<String>, Value)> {
    let cli = load("tests/data/cases-cli.json");
    let refs = load("tests/data/reference.json");
    let mut out = Vec::new();
    for (id, args) in cli.as_object().unwrap() {
        let Some(args) = args.as_array() else {
            continue;
        };
        let args: Vec<String> = args
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        let Some(&(_, config)) = FROM_CONFIG.iter().find(|(f, _)| *f == args[0]) else {
            continue;
        };
        let mut hf_args = args.clone();
        hf_args[0] = config.to_string();
        let record = refs
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["id"] == id.as_str())
            .unwrap_or_else(|| panic!("reference.json lacks {id}"))
            .clone();
        out.push((id.clone(), args, hf_args, record));
    }
    out
}

#[test]
fn reference_cases_from_configs_match_the_measurements() {
    let cases = config_cases();
    assert!(
        cases.len() >= 6,
        "expected the llama-tiny, gpt2 and bert cases, found {}",
        cases.len()
    );
    let mut problems = Vec::new();
    for (id, _, hf_args, r) in &cases {
        let args: Vec<&str> = hf_args.iter().map(String::as_str).collect();
        let est = report(&args);
        for (field, pointer) in [
            ("param_count", "/params/count"),
            ("parameters_bytes", "/params/bytes"),
            ("gradients_bytes", "/grads_bytes"),
            ("optimizer_state_bytes", "/optimizer_state_bytes"),
        ] {
            let measured = r.pointer(pointer).and_then(Value::as_u64).unwrap();
            if u(&est, field) != measured {
                problems.push(format!(
                    "{id} {field}: memest {}, measured {measured}",
                    u(&est, field)
                ));
            }
        }
        let act = r["saved_activations_bytes"].as_u64().unwrap();
        let got = u(&est, "activations_bytes");
        let ok = if act == 0 {
            got == 0
        } else {
            err_pct(got, act).abs() <= 5.0
        };
        if !ok {
            problems.push(format!("{id} activations: memest {got}, measured {act}"));
        }
        let peak = r
            .pointer("/timeline/peak_total")
            .and_then(Value::as_u64)
            .unwrap();
        let got = u(&est, "peak_bytes");
        if err_pct(got, peak).abs() > 10.0 {
            problems.push(format!("{id} peak: memest {got}, measured {peak}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn configs_give_the_hand_written_estimates() {
    for (id, args, hf_args, _) in config_cases() {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let b: Vec<&str> = hf_args.iter().map(String::as_str).collect();
        let (hand, config) = (report(&a), report(&b));
        for field in [
            "param_count",
            "parameters_bytes",
            "buffers_bytes",
            "gradients_bytes",
            "optimizer_state_bytes",
            "activations_bytes",
            "peak_bytes",
        ] {
            assert_eq!(
                u(&hand, field),
                u(&config, field),
                "{id}: {field} differs between {} and {}",
                args[0],
                hf_args[0]
            );
        }
    }
}

#[test]
fn print_model_round_trips() {
    for &(file, _) in PARAM_COUNTS {
        let out = memest(&["--print-model", file]);
        assert_eq!(code(&out), 0, "{}", describe(&out));
        let toml = TempModel::new("toml", &stdout(&out));
        for extra in [
            &["--seq", "128"][..],
            &["--seq", "64", "--mode", "infer"][..],
        ] {
            let mut a = vec![file];
            a.extend_from_slice(extra);
            let mut b = vec![toml.arg()];
            b.extend_from_slice(extra);
            assert_eq!(
                report(&a),
                report(&b),
                "{file}: the printed TOML gives another estimate"
            );
        }
    }
}

#[test]
fn print_model_round_trips_memest_files() {
    for file in [
        "examples/gpt2.toml",
        "examples/resnet50.toml",
        "examples/vit_b_16.toml",
        "tests/fixtures/mlp.json",
    ] {
        let out = memest(&["--print-model", file]);
        assert_eq!(code(&out), 0, "{}", describe(&out));
        let toml = TempModel::new("toml", &stdout(&out));
        assert_eq!(
            report(&[file]),
            report(&[toml.arg()]),
            "{file}: the printed TOML gives another estimate"
        );
    }
}

#[test]
fn print_model_of_a_memest_file_is_toml_too() {
    let t = printed(&["examples/mlp.toml"]);
    assert_eq!(t["name"].as_str(), Some("mlp"));
    assert_eq!(layers(&t).len(), 5);
}

/// Runs memest expecting a usage/input error; returns stderr.
fn fails(args: &[&str]) -> String {
    let out = memest(args);
    assert_eq!(code(&out), 2, "expected exit status 2\n{}", describe(&out));
    assert!(out.stdout.is_empty(), "{}", describe(&out));
    let err = stderr(&out);
    assert!(
        err.starts_with("error:") && !err.contains("panicked"),
        "{err}"
    );
    err
}

#[test]
fn unsupported_model_type_lists_the_supported_ones() {
    let f = TempModel::new(
        "json",
        r#"{"model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 64}"#,
    );
    let err = fails(&[f.arg()]);
    for needle in [
        "falcon",
        "not supported",
        "llama",
        "mixtral",
        "qwen2_moe",
        "t5",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in {err}");
    }
}

#[test]
fn missing_field_is_named() {
    let f = TempModel::new(
        "json",
        r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(err.contains("`hidden_size`"), "{err}");
    assert!(err.contains(f.arg()), "the message names the file: {err}");
}

#[test]
fn wrong_field_type_is_named() {
    let f = TempModel::new(
        "json",
        r#"{"model_type": "gpt2", "vocab_size": 100, "n_embd": "768", "n_layer": 2, "n_head": 4}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(err.contains("`n_embd`"), "{err}");
}

#[test]
fn unknown_architecture_suggests_the_head_flag() {
    let f = TempModel::new(
        "json",
        r#"{"model_type": "bert", "architectures": ["BertForQuestionAnswering"], "vocab_size": 100,
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128}"#,
    );
    let err = fails(&[f.arg()]);
    assert!(
        err.contains("BertForQuestionAnswering") && err.contains("--head"),
        "{err}"
    );
    let v = report(&[f.arg(), "--head", "none", "--seq", "16"]);
    assert!(u(&v, "param_count") > 0);
}

#[test]
fn head_flag_needs_a_hugging_face_config() {
    let err = fails(&["examples/mlp.toml", "--head", "lm"]);
    assert!(err.contains("--head"), "{err}");
}

#[test]
fn config_on_standard_input() {
    let text = std::fs::read_to_string(path("examples/hf/gpt2.json")).unwrap();
    let out = crate::common::memest_stdin(&["-", "--format", "json", "--seq", "32"], &text);
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(u(&v, "param_count"), 124_439_808);
}

/// Configs of measured cases outside `../shared/groundtruth` (see `tests/data/extra-*.json`),
/// as transformers' `config.json` would hold them.
const EXTRA_CONFIGS: &[(&str, &str)] = &[
    (
        "t5-tiny-relu-b4-s64-fp32-adamw",
        r#"{"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 256,
            "d_kv": 64, "num_layers": 2, "num_heads": 4, "d_ff": 512, "vocab_size": 1000,
            "feed_forward_proj": "relu", "decoder_start_token_id": 0, "pad_token_id": 0,
            "eos_token_id": 1}"#,
    ),
    (
        "t5-tiny-gatedgelu-b4-s64-fp32-adamw",
        r#"{"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 256,
            "d_kv": 64, "num_layers": 2, "num_heads": 4, "d_ff": 512, "vocab_size": 1000,
            "feed_forward_proj": "gated-gelu", "decoder_start_token_id": 0, "pad_token_id": 0,
            "eos_token_id": 1}"#,
    ),
    (
        "mixtral-tiny-b4-s64-fp32-adamw",
        r#"{"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
            "vocab_size": 1000, "max_position_embeddings": 256}"#,
    ),
];

#[test]
fn t5_and_mixtral_configs_match_their_measurements() {
    let cli = load("tests/data/extra-cases-cli.json");
    let refs = load("tests/data/extra-reference.json");
    let mut problems = Vec::new();
    for &(id, config) in EXTRA_CONFIGS {
        let args: Vec<String> = cli[id]
            .as_array()
            .unwrap_or_else(|| panic!("extra-cases-cli.json lacks {id}"))
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        let r = refs
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("extra-reference.json lacks {id}"));
        let file = TempModel::new("json", config);
        let mut argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let hand = report(&argv);
        argv[0] = file.arg();
        let est = report(&argv);
        for (field, pointer) in [
            ("param_count", "/params/count"),
            ("parameters_bytes", "/params/bytes"),
            ("gradients_bytes", "/grads_bytes"),
            ("optimizer_state_bytes", "/optimizer_state_bytes"),
        ] {
            let measured = r.pointer(pointer).and_then(Value::as_u64).unwrap();
            if u(&est, field) != measured {
                problems.push(format!(
                    "{id} {field}: memest {}, measured {measured}",
                    u(&est, field)
                ));
            }
        }
        let act = r["saved_activations_bytes"].as_u64().unwrap();
        let peak = r
            .pointer("/timeline/peak_total")
            .and_then(Value::as_u64)
            .unwrap();
        let (got_act, got_peak) = (u(&est, "activations_bytes"), u(&est, "peak_bytes"));
        if err_pct(got_act, act).abs() > 5.0 {
            problems.push(format!(
                "{id} activations: memest {got_act}, measured {act}"
            ));
        }
        if err_pct(got_peak, peak).abs() > 10.0 {
            problems.push(format!("{id} peak: memest {got_peak}, measured {peak}"));
        }
        // The hand-written description of the same model gives the same estimate.
        if (u(&hand, "activations_bytes"), u(&hand, "peak_bytes")) != (got_act, got_peak) {
            problems.push(format!(
                "{id}: {} gives activations {}, peak {}; the config {got_act}, {got_peak}",
                args[0],
                u(&hand, "activations_bytes"),
                u(&hand, "peak_bytes")
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A tiny config of one family and what one real training step of it kept (batch 4, seq 64,
/// AdamW, float32), measured with `../shared/groundtruth/measure.py` (PyTorch 2.15 on the CPU,
/// transformers 5.24, the class `architectures` names, `attn` as given).
struct Measured {
    config: &'static str,
    attention: &'static str,
    params: u64,
    params_bytes: u64,
    optimizer_bytes: u64,
    activations: u64,
    peak: u64,
}

const TINY: &[Measured] = &[
    Measured {
        config: r#"{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256, "tie_word_embeddings": true}"#,
        attention: "flash",
        params: 1_437_952,
        params_bytes: 5_751_808,
        optimizer_bytes: 11_503_720,
        activations: 10_771_460,
        peak: 31_099_120,
    },
    Measured {
        config: r#"{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000, "max_position_embeddings": 256}"#,
        attention: "flash",
        params: 1_496_448,
        params_bytes: 5_985_792,
        optimizer_bytes: 11_971_684,
        activations: 10_767_364,
        peak: 31_796_908,
    },
    Measured {
        config: r#"{"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 1000, "max_position_embeddings": 256}"#,
        attention: "flash",
        params: 1_371_392,
        params_bytes: 5_485_568,
        optimizer_bytes: 10_971_216,
        activations: 10_514_436,
        peak: 30_043_356,
    },
    Measured {
        config: r#"{"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 256, "resid_pdrop": 0.1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}"#,
        attention: "flash",
        params: 1_824_000,
        params_bytes: 7_296_000,
        optimizer_bytes: 14_592_060,
        activations: 12_868_612,
        peak: 38_554_828,
    },
    Measured {
        config: r#"{"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 256, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "mlp_only_layers": [0]}"#,
        attention: "flash",
        params: 2_877_952,
        params_bytes: 11_511_808,
        optimizer_bytes: 23_023_804,
        activations: 18_689_060,
        peak: 60_158_284,
    },
    Measured {
        config: r#"{"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256, "sliding_window": 4096}"#,
        attention: "flash",
        params: 1_692_928,
        params_bytes: 6_771_712,
        optimizer_bytes: 13_543_508,
        activations: 10_771_460,
        peak: 35_409_140,
    },
    Measured {
        config: r#"{"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 128}"#,
        attention: "eager",
        params: 1_411_304,
        params_bytes: 5_645_216,
        optimizer_bytes: 11_290_600,
        activations: 11_522_564,
        peak: 31_534_496,
    },
    Measured {
        config: r#"{"model_type": "llama", "architectures": ["LlamaForSequenceClassification"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256, "pad_token_id": 0}"#,
        attention: "flash",
        params: 1_437_440,
        params_bytes: 5_749_760,
        optimizer_bytes: 11_499_604,
        activations: 9_745_508,
        peak: 29_275_428,
    },
    Measured {
        config: r#"{"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"], "n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 128, "pad_token_id": 0}"#,
        attention: "eager",
        params: 1_869_312,
        params_bytes: 7_477_248,
        optimizer_bytes: 14_954_612,
        activations: 18_098_788,
        peak: 43_157_244,
    },
];

#[test]
fn tiny_configs_of_each_family_match_measurements() {
    let mut problems = Vec::new();
    for m in TINY {
        let file = TempModel::new("json", m.config);
        let args = [
            file.arg(),
            "--batch",
            "4",
            "--seq",
            "64",
            "--optim",
            "adamw",
            "--attention",
            m.attention,
        ];
        let est = report(&args);
        let what = m.config.split('"').nth(7).unwrap_or(m.config);
        for (field, measured) in [
            ("param_count", m.params),
            ("parameters_bytes", m.params_bytes),
            ("gradients_bytes", m.params_bytes),
            ("optimizer_state_bytes", m.optimizer_bytes),
        ] {
            if u(&est, field) != measured {
                problems.push(format!(
                    "{what} {field}: memest {}, measured {measured}",
                    u(&est, field)
                ));
            }
        }
        let (act, peak) = (u(&est, "activations_bytes"), u(&est, "peak_bytes"));
        if err_pct(act, m.activations).abs() > 5.0 {
            problems.push(format!(
                "{what} activations: memest {act}, measured {}",
                m.activations
            ));
        }
        if err_pct(peak, m.peak).abs() > 10.0 {
            problems.push(format!("{what} peak: memest {peak}, measured {}", m.peak));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
