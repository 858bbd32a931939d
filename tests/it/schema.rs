//! The JSON output's schema: `schema/report.schema.json` is generated from the `Report` type and
//! every `--format json` output validates against it.

use serde_json::Value;

use crate::common::{memest, path, report};

const SCHEMA: &str = "schema/report.schema.json";

fn generated() -> String {
    let schema = serde_json::to_string_pretty(&memest::report::json_schema()).unwrap();
    format!("{schema}\n")
}

/// The committed schema is the generated one. `MEMEST_UPDATE_SCHEMA=1 cargo test schema`
/// rewrites it after a deliberate change to the report.
#[test]
fn committed_schema_is_up_to_date() {
    let file = path(SCHEMA);
    let fresh = generated();
    if std::env::var_os("MEMEST_UPDATE_SCHEMA").is_some() {
        std::fs::write(&file, &fresh).unwrap();
    }
    let committed = std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        committed == fresh,
        "{SCHEMA} is out of date: run `MEMEST_UPDATE_SCHEMA=1 cargo test --test it schema` and commit it"
    );
}

fn validator() -> jsonschema::Validator {
    let text = std::fs::read_to_string(path(SCHEMA)).unwrap();
    let schema: Value = serde_json::from_str(&text).unwrap();
    jsonschema::validator_for(&schema).unwrap()
}

fn assert_valid(v: &jsonschema::Validator, args: &[&str], instance: &Value) {
    let errors: Vec<String> = v
        .iter_errors(instance)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "memest {args:?}:\n{}", errors.join("\n"));
}

#[test]
fn json_output_validates_against_the_schema() {
    let v = validator();
    let cases: &[&[&str]] = &[
        &["examples/mlp.toml"],
        &["examples/resnet18.toml", "--batch", "8", "--budget", "1GiB"],
        &[
            "examples/gpt2.toml",
            "--recipe",
            "mixed-bf16",
            "--checkpoint",
        ],
        &[
            "examples/llama_tiny.toml",
            "--dtype",
            "nf4",
            "--lora-rank",
            "8",
        ],
        &[
            "examples/llama_tiny.toml",
            "--context",
            "256",
            "--kv-dtype",
            "fp8",
        ],
        &[
            "examples/llama_tiny.toml",
            "--budget",
            "1GiB",
            "--max-batch",
        ],
        &[
            "examples/llama_tiny.toml",
            "--budget",
            "1KiB",
            "--max-context",
        ],
        &[
            "examples/hf/mixtral-8x7b.json",
            "--dtype",
            "int4",
            "--optim",
            "adafactor",
        ],
        &["examples/gpt2.toml", "--batch", "2", "--explain"],
        &[
            "examples/mlp.toml",
            "--seq",
            "8",
            "--checkpoint",
            "--group-size",
            "64",
        ],
    ];
    for args in cases {
        let mut all = args.to_vec();
        all.extend(["--format", "json"]);
        let out = memest(&all);
        // 1: over the budget, which still prints the report.
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "{args:?}: {out:?}"
        );
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_valid(&v, args, &json);
    }
}

#[test]
fn the_schema_rejects_what_is_not_a_report() {
    let v = validator();
    let mut r = report(&["examples/mlp.toml"]);
    assert!(v.is_valid(&r));
    r["at_peak"]["parameters_bytes"] = Value::from(-1);
    assert!(!v.is_valid(&r), "a negative byte count");
    let mut r = report(&["examples/mlp.toml"]);
    r["surprise"] = Value::from(1);
    assert!(!v.is_valid(&r), "an unknown top-level key");
    // Over budget: the report still validates (exit 1 is not an error).
    let out = memest(&["examples/mlp.toml", "--budget", "1KiB", "--format", "json"]);
    assert_eq!(out.status.code(), Some(1));
    assert_valid(
        &v,
        &["--budget", "1KiB"],
        &serde_json::from_slice(&out.stdout).unwrap(),
    );
}

const SWEEP_SCHEMA: &str = "schema/sweep.schema.json";

/// `schema/sweep.schema.json` (a `--sweep`'s JSON) is the generated one, rewritten with
/// `MEMEST_UPDATE_SCHEMA=1`, and a sweep's output validates against it.
#[test]
fn sweep_schema_is_up_to_date_and_validates() {
    let file = path(SWEEP_SCHEMA);
    let fresh = format!(
        "{}\n",
        serde_json::to_string_pretty(&memest::report::sweep_json_schema()).unwrap()
    );
    if std::env::var_os("MEMEST_UPDATE_SCHEMA").is_some() {
        std::fs::write(&file, &fresh).unwrap();
    }
    let committed = std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        committed == fresh,
        "{SWEEP_SCHEMA} is out of date: run `MEMEST_UPDATE_SCHEMA=1 cargo test --test it schema` and commit it"
    );
    let schema: Value = serde_json::from_str(&committed).unwrap();
    let v = jsonschema::validator_for(&schema).unwrap();
    let args = [
        "examples/mlp.toml",
        "--sweep",
        "batch=1,2",
        "--budget",
        "1GiB",
        "--format",
        "json",
    ];
    let out = memest(&args);
    assert_eq!(out.status.code(), Some(0));
    assert_valid(&v, &args, &serde_json::from_slice(&out.stdout).unwrap());
}

const PLANS_SCHEMA: &str = "schema/plans.schema.json";

/// `schema/plans.schema.json` (`--plan auto`'s JSON) is the generated one, rewritten with
/// `MEMEST_UPDATE_SCHEMA=1`, and a plan listing validates against it.
#[test]
fn plans_schema_is_up_to_date_and_validates() {
    let file = path(PLANS_SCHEMA);
    let fresh = format!(
        "{}\n",
        serde_json::to_string_pretty(&memest::report::plans_json_schema()).unwrap()
    );
    if std::env::var_os("MEMEST_UPDATE_SCHEMA").is_some() {
        std::fs::write(&file, &fresh).unwrap();
    }
    let committed = std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        committed == fresh,
        "{PLANS_SCHEMA} is out of date: run `MEMEST_UPDATE_SCHEMA=1 cargo test --test it schema` and commit it"
    );
    let schema: Value = serde_json::from_str(&committed).unwrap();
    let v = jsonschema::validator_for(&schema).unwrap();
    let args = [
        "examples/mlp.toml",
        "--gpus",
        "16",
        "--plan",
        "auto",
        "--optim",
        "adamw",
        "--budget",
        "1GiB",
        "--format",
        "json",
    ];
    let out = memest(&args);
    assert_eq!(out.status.code(), Some(0));
    assert_valid(&v, &args, &serde_json::from_slice(&out.stdout).unwrap());
}
