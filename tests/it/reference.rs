//! Estimates checked against measured figures (`tests/data/`, see its README).
//!
//! Each case of `cases-cli.json` runs `memest ARGS --format json` from the crate root and is
//! compared with its record in `reference.json`: parameter, gradient and optimizer-state bytes
//! and the parameter count exactly, saved activations within 0.1 %, the step's peak within its
//! case's allowance in `peak-allowance.json` (the error achieved plus 1 point, rounded up to
//! 0.1: an allowance looser than that fails, so none is left stale), and over all cases the median absolute errors within 0.01 % (activations)
//! and 0.5 % (peak). The tolerances follow what is achieved, so that a regression fails.
//!
//! Every compared figure is also pinned to the byte by a snapshot of the comparison table
//! (`tests/it/snapshots/reference_*.snap`): a change to any case's estimate shows as a diff.
//!
//! The same checks run on a second set, `extra-cases-cli.json` / `extra-reference.json`: models
//! outside `../shared/groundtruth` (other torchvision CNNs, T5, Mixtral, autocast and inference
//! runs), defined in `tools/extra_cases.json` and measured with the same `measure.py`, so that
//! the per-operator rules are checked on models they were not written against.
//!
//! A third set, `hf-cases-cli.json` / `hf-reference.json` (tiny Hugging Face configs, one per
//! family, `tools/hf_cases.json`), runs through the same harness from `tests/it/hf.rs`.
//!
//! Each set also exists as a CUDA GPU runs it (`*-cuda.json`: CUDA kernels on fake tensors,
//! emulated H100, measured by `tools/measure_fake_cuda.py`), asked with `--device cuda` and
//! checked the same way, with per-case peak allowances in `peak-allowance-cuda.json`.
//!
//! A CUDA record also carries `measure_fake_cuda.py`'s replay of the step through its model of
//! the caching allocator (`cuda_sim`); memest's `allocated_peak_bytes` and `reserved_peak_bytes`
//! are checked against its `max_allocated` within 1 % and `max_reserved` within 5 % (issue 8's
//! bar), except the cases listed, with the reason, in `allocator-allowance-cuda.json`.

use std::fmt::Write as _;

use serde_json::Value;

use crate::common::{err_pct, path, report, u};

/// Saved activations: the worst case today is +0.022 % (bert-base bf16).
const ACT_TOL_PCT: f64 = 0.1;
/// Median |error| over a set, saved activations (today: 0 % and 0.000006 %).
const MEDIAN_ACT_TOL_PCT: f64 = 0.01;
/// Median |error| over a set, peak (today: 0.0002 % and 0.38 %).
const MEDIAN_PEAK_TOL_PCT: f64 = 0.5;
/// Per case: the largest |error| allowed on the peak, in percent.
const PEAK_ALLOWANCE: &str = "tests/data/peak-allowance.json";
/// `allocated_peak_bytes` against `cuda_sim.max_allocated`, in percent.
const ALLOCATED_TOL_PCT: f64 = 1.0;
/// `reserved_peak_bytes` against `cuda_sim.max_reserved`, in percent.
const RESERVED_TOL_PCT: f64 = 5.0;
/// The cases whose allocator figures miss those bars, each with its allowance and why.
const ALLOCATOR_ALLOWANCE: &str = "tests/data/allocator-allowance-cuda.json";

/// How one figure is judged.
#[derive(Clone, Copy, PartialEq)]
enum Check {
    Exact,
    WithinPct(f64),
}

/// One compared figure of one case.
pub(crate) struct Row {
    case: String,
    field: &'static str,
    memest: u64,
    measured: u64,
    check: Check,
}

impl Row {
    fn err(&self) -> Option<f64> {
        (self.measured != 0).then(|| err_pct(self.memest, self.measured))
    }

    fn ok(&self) -> bool {
        match self.check {
            Check::Exact => self.memest == self.measured,
            Check::WithinPct(tol) => match self.err() {
                None => self.memest == 0,
                Some(e) => e.abs() <= tol,
            },
        }
    }
}

fn load(rel: &str) -> Value {
    let p = path(rel);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn get_u64(v: &Value, pointer: &str, case: &str) -> u64 {
    v.pointer(pointer)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("reference case {case}: `{pointer}` missing"))
}

/// A set of measured cases: how each is asked of memest, the measurements, and the per-case
/// peak allowances.
pub(crate) struct Set {
    cli: &'static str,
    reference: &'static str,
    allowance: &'static str,
    min_cases: usize,
}

pub(crate) const SHARED: Set = Set {
    cli: "tests/data/cases-cli.json",
    reference: "tests/data/reference.json",
    allowance: PEAK_ALLOWANCE,
    min_cases: 13,
};
/// Tiny Hugging Face configs of each family (`tools/hf_cases.json`), run from `tests/it/hf.rs`.
pub(crate) const HF: Set = Set {
    cli: "tests/data/hf-cases-cli.json",
    reference: "tests/data/hf-reference.json",
    allowance: PEAK_ALLOWANCE,
    min_cases: 11,
};
pub(crate) const EXTRA: Set = Set {
    cli: "tests/data/extra-cases-cli.json",
    reference: "tests/data/extra-reference.json",
    allowance: PEAK_ALLOWANCE,
    min_cases: 6,
};

/// Per case of the CUDA sets: the largest |error| allowed on the peak, in percent.
const PEAK_ALLOWANCE_CUDA: &str = "tests/data/peak-allowance-cuda.json";

/// The shared cases as a CUDA GPU runs them (emulated H100, `tools/measure_fake_cuda.py`), asked
/// with `--device cuda`.
pub(crate) const SHARED_CUDA: Set = Set {
    cli: "tests/data/cases-cli-cuda.json",
    reference: "tests/data/reference-cuda.json",
    allowance: PEAK_ALLOWANCE_CUDA,
    min_cases: 13,
};
/// The extra cases on CUDA kernels (`tools/extra_cases.json`, `tools/measure_fake_cuda.py`).
pub(crate) const EXTRA_CUDA: Set = Set {
    cli: "tests/data/extra-cases-cli-cuda.json",
    reference: "tests/data/extra-reference-cuda.json",
    allowance: PEAK_ALLOWANCE_CUDA,
    min_cases: 30,
};
/// The tiny Hugging Face configs on CUDA kernels, run from `tests/it/hf.rs`.
pub(crate) const HF_CUDA: Set = Set {
    cli: "tests/data/hf-cases-cli-cuda.json",
    reference: "tests/data/hf-reference-cuda.json",
    allowance: PEAK_ALLOWANCE_CUDA,
    min_cases: 11,
};

/// Every case: (id, memest arguments, reference record), in the order of `cases-cli.json`.
fn cases() -> Vec<(String, Vec<String>, Value)> {
    cases_in(&SHARED)
}

/// The cases of `set`: (id, memest arguments, reference record).
pub(crate) fn cases_in(set: &Set) -> Vec<(String, Vec<String>, Value)> {
    let cli = load(set.cli);
    let refs = load(set.reference);
    let refs = refs.as_array().expect("reference.json is an array");
    let cli = cli.as_object().expect("cases-cli.json is an object");
    let mut out = Vec::new();
    for (id, args) in cli.iter().filter(|(k, _)| !k.starts_with('_')) {
        let args: Vec<String> = args
            .as_array()
            .unwrap_or_else(|| panic!("cases-cli.json: {id} is not a list"))
            .iter()
            .map(|a| a.as_str().expect("arguments are strings").to_string())
            .collect();
        let record = refs
            .iter()
            .find(|r| r["id"] == id.as_str())
            .unwrap_or_else(|| panic!("cases-cli.json names {id}, which reference.json lacks"))
            .clone();
        out.push((id.clone(), args, record));
    }
    out
}

/// Runs memest on every case and lists every compared figure.
fn compare_all() -> Vec<Row> {
    compare_set(&SHARED)
}

/// The peak allowance of case `id`, from `allowances` (the file `file`).
fn peak_allowance(allowances: &Value, file: &str, id: &str) -> f64 {
    allowances[id]
        .as_f64()
        .unwrap_or_else(|| panic!("{file} has no allowance for case {id}"))
}

/// Runs memest on every case of `set` and lists every compared figure; fails when a case's
/// peak allowance is looser than the rule ([`allowance_rule`]).
pub(crate) fn compare_set(set: &Set) -> Vec<Row> {
    let cases = cases_in(set);
    assert!(
        cases.len() >= set.min_cases,
        "expected at least {} measured cases in {}, found {}",
        set.min_cases,
        set.cli,
        cases.len()
    );
    let rows = compare_cases_with(&cases, set.allowance);
    assert_allowances_follow_the_rule(&rows, set.allowance);
    rows
}

/// The peak allowance a case's error earns: the |error| achieved plus 1 point, rounded up to
/// 0.1 (`peak-allowance*.json`'s `_about`). The product is rounded to 1e-9 first, so that an
/// error of exactly 0.2 % gives 1.2, not 1.3.
fn allowance_rule(err_pct: f64) -> f64 {
    let tenths = ((err_pct.abs() + 1.0) * 10.0 * 1e9).round() / 1e9;
    tenths.ceil() / 10.0
}

/// Every peak allowance is at most what the rule gives the case's error today: an allowance
/// left loose after memest came closer fails here, naming the value to lower it to.
fn assert_allowances_follow_the_rule(rows: &[Row], file: &str) {
    let loose: Vec<String> = rows
        .iter()
        .filter(|r| r.field == "peak_bytes")
        .filter_map(|r| {
            let Check::WithinPct(allowed) = r.check else {
                return None;
            };
            let err = r.err().unwrap_or(0.0);
            let rule = allowance_rule(err);
            (allowed > rule + 1e-9).then(|| {
                format!(
                    "{}: {allowed} allowed, the error is {err:+.3} %, so at most {rule}",
                    r.case
                )
            })
        })
        .collect();
    assert!(
        loose.is_empty(),
        "{file}: allowances looser than the error plus 1 point (rounded up to 0.1); lower them:\n{}",
        loose.join("\n")
    );
}

#[test]
fn allowance_rule_rounds_up_to_a_tenth() {
    assert!((allowance_rule(0.0) - 1.0).abs() < 1e-12);
    assert!((allowance_rule(0.2) - 1.2).abs() < 1e-12);
    assert!((allowance_rule(-0.007) - 1.1).abs() < 1e-12);
    assert!((allowance_rule(-5.781) - 6.8).abs() < 1e-12);
    assert!((allowance_rule(3.003) - 4.1).abs() < 1e-12);
}

/// Runs memest on each `(id, arguments, reference record)` and lists every compared figure
/// (peak allowances from [`PEAK_ALLOWANCE`]).
pub(crate) fn compare_cases(cases: &[(String, Vec<String>, Value)]) -> Vec<Row> {
    compare_cases_with(cases, PEAK_ALLOWANCE)
}

/// Optimizer state as measured: on CUDA, `measure_fake_cuda.py` counts the state on the device
/// (`optimizer_state_bytes`) and Adam's `step` scalars, which `foreach` keeps on the host
/// (`optimizer_state_bytes_host`), apart; memest's figure is the whole state.
fn measured_optimizer_state(r: &Value, id: &str) -> u64 {
    get_u64(r, "/optimizer_state_bytes", id)
        + r.pointer("/optimizer_state_bytes_host")
            .and_then(Value::as_u64)
            .unwrap_or(0)
}

/// [`compare_cases`] with the peak allowances of the file `allowance`.
fn compare_cases_with(cases: &[(String, Vec<String>, Value)], allowance: &str) -> Vec<Row> {
    let allowances = load(allowance);
    let allocator = load(ALLOCATOR_ALLOWANCE);
    let mut rows = Vec::new();
    for (id, args, r) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let est = report(&args);
        let mut row = |field, memest, measured, check| {
            rows.push(Row {
                case: id.clone(),
                field,
                memest,
                measured,
                check,
            });
        };
        row(
            "param_count",
            u(&est, "param_count"),
            get_u64(r, "/params/count", id),
            Check::Exact,
        );
        row(
            "parameters_bytes",
            u(&est, "parameters_bytes"),
            get_u64(r, "/params/bytes", id),
            Check::Exact,
        );
        row(
            "gradients_bytes",
            u(&est, "gradients_bytes"),
            get_u64(r, "/grads_bytes", id),
            Check::Exact,
        );
        row(
            "optimizer_state_bytes",
            u(&est, "optimizer_state_bytes"),
            measured_optimizer_state(r, id),
            Check::Exact,
        );
        row(
            "activations_bytes",
            u(&est, "activations_bytes"),
            get_u64(r, "/saved_activations_bytes", id),
            Check::WithinPct(ACT_TOL_PCT),
        );
        row(
            "peak_bytes",
            u(&est, "peak_bytes"),
            get_u64(r, "/timeline/peak_total", id),
            Check::WithinPct(peak_allowance(&allowances, allowance, id)),
        );
        if r.pointer("/cuda_sim/max_allocated").is_some() {
            let tol = |field: &str, default: f64| {
                allocator[id.as_str()][field].as_f64().unwrap_or(default)
            };
            row(
                "allocated_peak_bytes",
                u(&est, "allocated_peak_bytes"),
                get_u64(r, "/cuda_sim/max_allocated", id),
                Check::WithinPct(tol("allocated_peak_bytes", ALLOCATED_TOL_PCT)),
            );
            row(
                "reserved_peak_bytes",
                u(&est, "reserved_peak_bytes"),
                get_u64(r, "/cuda_sim/max_reserved", id),
                Check::WithinPct(tol("reserved_peak_bytes", RESERVED_TOL_PCT)),
            );
        }
    }
    rows
}

/// Each exception in `allocator-allowance-cuda.json` is needed (its case misses the bar it
/// lifts) and says why; a case that comes within the bar must leave the file.
#[test]
fn allocator_exceptions_are_needed() {
    let allowances = load(ALLOCATOR_ALLOWANCE);
    let all: Vec<(String, Vec<String>, Value)> = [&SHARED_CUDA, &EXTRA_CUDA, &HF_CUDA]
        .iter()
        .flat_map(|set| cases_in(set))
        .collect();
    let mut seen = 0;
    for (id, entry) in allowances.as_object().expect("an object") {
        if id.starts_with('_') {
            continue;
        }
        seen += 1;
        assert!(
            entry["why"].as_str().is_some_and(|w| !w.is_empty()),
            "{id}: no reason"
        );
        let (_, args, r) = all
            .iter()
            .find(|(c, _, _)| c == id)
            .unwrap_or_else(|| panic!("{ALLOCATOR_ALLOWANCE} names {id}, no CUDA case"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let est = report(&args);
        for (field, measured, bar) in [
            (
                "allocated_peak_bytes",
                "/cuda_sim/max_allocated",
                ALLOCATED_TOL_PCT,
            ),
            (
                "reserved_peak_bytes",
                "/cuda_sim/max_reserved",
                RESERVED_TOL_PCT,
            ),
        ] {
            if entry.get(field).is_some() {
                let e = err_pct(u(&est, field), get_u64(r, measured, id));
                assert!(
                    e.abs() > bar,
                    "{id} {field}: {e:+.3}% is within {bar}%: drop it"
                );
            }
        }
    }
    // One reserved miss of one 2 MiB segment: phi3 tiny fp32 (a 38 MiB step). The tiny Flux
    // transformer (-12.5 %) met the bar once diffusers' rotary ran as its operators.
    assert!(
        seen <= 1,
        "more than 1 exception: the allocator model needs work"
    );
}

/// A readable table of every row, failing ones marked.
fn table(rows: &[Row]) -> String {
    let mut s = format!(
        "{:<38} {:<22} {:>15} {:>15} {:>8}  {}\n",
        "case", "field", "memest", "measured", "err%", "check"
    );
    for r in rows {
        let err = r
            .err()
            .map_or_else(|| "-".to_string(), |e| format!("{e:+.2}"));
        let check = match r.check {
            Check::Exact => "exact".to_string(),
            Check::WithinPct(t) => format!("±{t}%"),
        };
        let _ = writeln!(
            s,
            "{:<38} {:<22} {:>15} {:>15} {:>8}  {}{}",
            r.case,
            r.field,
            r.memest,
            r.measured,
            err,
            check,
            if r.ok() { "" } else { "  <-- FAIL" }
        );
    }
    s
}

/// The figures of every row (no tolerances), for the snapshot.
fn figures(rows: &[Row]) -> String {
    let mut s = format!(
        "{:<38} {:<22} {:>15} {:>15} {:>8}\n",
        "case", "field", "memest", "measured", "err%"
    );
    for r in rows {
        let err = r
            .err()
            .map_or_else(|| "-".to_string(), |e| format!("{e:+.3}"));
        let _ = writeln!(
            s,
            "{:<38} {:<22} {:>15} {:>15} {:>8}",
            r.case, r.field, r.memest, r.measured, err
        );
    }
    s
}

/// Pins every figure of `rows` to the byte (`tests/it/snapshots/{name}.snap`).
pub(crate) fn snapshot(name: &str, rows: &[Row]) {
    let mut settings = insta::Settings::clone_current();
    settings.set_prepend_module_to_snapshot(false);
    settings.set_omit_expression(true);
    settings.set_snapshot_path("snapshots");
    settings.set_description("memest's figures against the measured ones, every case");
    settings.bind(|| insta::assert_snapshot!(name, figures(rows)));
}

#[test]
fn every_case_matches_the_measurements() {
    let rows = compare_all();
    assert_all_ok(&rows);
    assert_medians(&rows);
    snapshot("reference_shared", &rows);
}

#[test]
fn models_outside_the_reference_match_our_measurements() {
    let rows = compare_set(&EXTRA);
    assert_all_ok(&rows);
    assert_medians(&rows);
    snapshot("reference_extra", &rows);
}

/// The CUDA figures of the shared and extra cases (emulated H100): the same checks as on the
/// CPU, with the CUDA sets' own peak allowances.
#[test]
fn cuda_cases_match_the_emulated_measurements() {
    for (set, name) in [
        (&SHARED_CUDA, "reference_shared_cuda"),
        (&EXTRA_CUDA, "reference_extra_cuda"),
    ] {
        let rows = compare_set(set);
        assert_all_ok(&rows);
        assert_medians(&rows);
        snapshot(name, &rows);
    }
}

/// Every measured case has a peak allowance, and every allowance names a measured case.
#[test]
fn peak_allowances_match_the_cases() {
    for (file, sets) in [
        (PEAK_ALLOWANCE, [&SHARED, &EXTRA, &HF]),
        (PEAK_ALLOWANCE_CUDA, [&SHARED_CUDA, &EXTRA_CUDA, &HF_CUDA]),
    ] {
        let allowances = load(file);
        let mut ids: Vec<String> = sets
            .iter()
            .flat_map(|set| cases_in(set).into_iter().map(|(id, _, _)| id))
            .collect();
        ids.sort();
        let mut named: Vec<String> = allowances
            .as_object()
            .unwrap_or_else(|| panic!("{file} is an object"))
            .keys()
            .filter(|k| !k.starts_with('_'))
            .cloned()
            .collect();
        named.sort();
        assert_eq!(named, ids, "{file}");
    }
}

/// Measured but not compared, each with why: the only records of `*reference*.json` that no
/// cases-cli file asks of memest, and the only CPU cases without their CUDA measurement.
const NOT_COMPARED: &[(&str, &str)] = &[
    (
        "mixtral-tiny-eagerexperts-b4-s64-fp32-adamw",
        "transformers' eager experts loop (`experts_implementation = \"eager\"`): memest models \
         the grouped_mm experts only",
    ),
    (
        "deepseek_v3-tiny-b2-s64-bf16-adamw",
        "CUDA only: the measurement is not repeatable (three runs of measure_fake_cuda.py saved \
         5,676,628, 5,677,652 and 5,681,236 B: DeepSeek's group-limited routing is not the fixed \
         balanced routing the script imposes on other MoE models); memest's 5,685,844 B is \
         +0.08 % to +0.16 % of them, the bar is 0.1 %. The CPU case is exact",
    ),
];

/// Every measured record is compared (CPU and CUDA), and every CPU case has its CUDA
/// measurement beside it, but for the cases listed in `NOT_COMPARED`.
#[test]
fn every_measured_case_is_compared() {
    let listed = |id: &str| NOT_COMPARED.iter().any(|(c, _)| *c == id);
    let ids =
        |set: &Set| -> Vec<String> { cases_in(set).into_iter().map(|(id, _, _)| id).collect() };
    for set in [&SHARED, &EXTRA, &HF, &SHARED_CUDA, &EXTRA_CUDA, &HF_CUDA] {
        let asked = ids(set);
        for r in load(set.reference).as_array().expect("an array") {
            let id = r["id"].as_str().expect("an id");
            assert!(
                asked.iter().any(|a| a == id) || listed(id),
                "{}: {id} is measured but {} does not ask it",
                set.reference,
                set.cli
            );
        }
    }
    for (cpu, cuda) in [
        (&SHARED, &SHARED_CUDA),
        (&EXTRA, &EXTRA_CUDA),
        (&HF, &HF_CUDA),
    ] {
        let on_cuda = ids(cuda);
        for id in ids(cpu) {
            assert!(
                on_cuda.contains(&id) || listed(&id),
                "{id}: in {} but not measured on CUDA ({})",
                cpu.cli,
                cuda.cli
            );
        }
    }
    // Each exception is still one.
    for (id, _) in NOT_COMPARED {
        let everywhere: Vec<String> = [&SHARED_CUDA, &EXTRA_CUDA, &HF_CUDA]
            .iter()
            .flat_map(|s| ids(s))
            .collect();
        assert!(
            !everywhere.contains(&(*id).to_string()),
            "{id} is compared now: unlist it"
        );
    }
}

/// One README accuracy-table row per case of `cpu` (in its cases-cli order), from the figures
/// pinned in the snapshots `{snap}.snap` and `{snap}_cuda.snap` (which the comparison tests keep
/// equal to memest's figures): parameter, gradient and optimizer bytes (`ok` when exact, else
/// the difference), then the errors in percent of the saved activations and the peak, on the CPU
/// and on CUDA (`ok` where both are 0).
fn readme_rows(cpu: &Set, snap: &str) -> String {
    let figures = |name: &str| {
        let text = std::fs::read_to_string(path(&format!("tests/it/snapshots/{name}.snap")))
            .unwrap_or_else(|e| panic!("{name}.snap: {e}"));
        let body = text.splitn(3, "---").nth(2).expect("a snapshot body");
        let mut m = std::collections::HashMap::new();
        for line in body.lines().skip(2) {
            let p: Vec<&str> = line.split_whitespace().collect();
            if let [case, field, memest, measured, ..] = p[..] {
                let n = |s: &str| s.parse::<u64>().expect("a figure");
                m.insert(
                    (case.to_string(), field.to_string()),
                    (n(memest), n(measured)),
                );
            }
        }
        m
    };
    let (on_cpu, on_cuda) = (figures(snap), figures(&format!("{snap}_cuda")));
    let exact = |(m, r): (u64, u64)| {
        if m == r {
            "ok".to_string()
        } else {
            format!("{:+}", i128::from(m) - i128::from(r))
        }
    };
    let pct = |(m, r): (u64, u64)| {
        if r == 0 {
            if m == 0 {
                "ok".to_string()
            } else {
                "-".to_string()
            }
        } else {
            format!("{:+.1}", err_pct(m, r))
        }
    };
    let mut out = format!(
        "{:<38} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9}\n",
        "case", "params", "grads", "optim", "act err%", "peak err%", "CUDA act", "CUDA peak"
    );
    for (id, _, _) in cases_in(cpu) {
        let get = |m: &std::collections::HashMap<(String, String), (u64, u64)>, f: &str| {
            *m.get(&(id.clone(), f.to_string()))
                .unwrap_or_else(|| panic!("{snap}: no {f} of {id}"))
        };
        let _ = writeln!(
            out,
            "{:<38} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9}",
            id,
            exact(get(&on_cpu, "parameters_bytes")),
            exact(get(&on_cpu, "gradients_bytes")),
            exact(get(&on_cpu, "optimizer_state_bytes")),
            pct(get(&on_cpu, "activations_bytes")),
            pct(get(&on_cpu, "peak_bytes")),
            pct(get(&on_cuda, "activations_bytes")),
            pct(get(&on_cuda, "peak_bytes")),
        );
    }
    out
}

/// The README's two accuracy tables ("### Accuracy": the shared cases, then the extra ones) are
/// the figures the tests pin, with a CUDA column. `MEMEST_UPDATE_README=1 cargo test --test it
/// readme_accuracy` rewrites them.
#[test]
fn readme_accuracy_tables_match_the_figures() {
    let file = path("README.md");
    let readme = std::fs::read_to_string(&file).unwrap();
    let start = readme
        .find("### Accuracy")
        .expect("README has an Accuracy section");
    let end = start
        + readme[start..]
            .find("### CPU and CUDA kernels")
            .expect("the next section");
    let mut section = readme[start..end].to_string();
    let mut at = 0;
    for (set, snap) in [(&SHARED, "reference_shared"), (&EXTRA, "reference_extra")] {
        let open = at + section[at..].find("```text\n").expect("a table") + "```text\n".len();
        let close = open + section[open..].find("```").expect("the table's end");
        let want = readme_rows(set, snap);
        if std::env::var_os("MEMEST_UPDATE_README").is_some() {
            section.replace_range(open..close, &want);
        } else {
            assert_eq!(
                section[open..close],
                want,
                "README's accuracy table of {} is stale: MEMEST_UPDATE_README=1 cargo test --test it readme_accuracy",
                set.cli
            );
        }
        at = open + want.len();
    }
    if std::env::var_os("MEMEST_UPDATE_README").is_some() {
        std::fs::write(
            &file,
            format!("{}{section}{}", &readme[..start], &readme[end..]),
        )
        .unwrap();
    }
}

/// Fails, with the whole table, if a figure is outside its tolerance.
pub(crate) fn assert_all_ok(rows: &[Row]) {
    let failed: Vec<&Row> = rows.iter().filter(|r| !r.ok()).collect();
    let names: Vec<String> = failed
        .iter()
        .map(|r| format!("{} {}", r.case, r.field))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} figures are outside tolerance ({}):\n{}",
        failed.len(),
        rows.len(),
        names.join(", "),
        table(rows)
    );
}

fn median(mut xs: Vec<f64>) -> f64 {
    assert!(!xs.is_empty(), "no errors to take the median of");
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        f64::midpoint(xs[n / 2 - 1], xs[n / 2])
    }
}

/// Fails if the median errors of `rows` exceed the set-wide limits.
pub(crate) fn assert_medians(rows: &[Row]) {
    let abs_errs = |field: &str| -> Vec<f64> {
        rows.iter()
            .filter(|r| r.field == field)
            .filter_map(Row::err)
            .map(f64::abs)
            .collect()
    };
    let act = median(abs_errs("activations_bytes"));
    let peak = median(abs_errs("peak_bytes"));
    assert!(
        act <= MEDIAN_ACT_TOL_PCT && peak <= MEDIAN_PEAK_TOL_PCT,
        "median |error|: activations {act:.4}% (limit {MEDIAN_ACT_TOL_PCT}%), \
         peak {peak:.4}% (limit {MEDIAN_PEAK_TOL_PCT}%)\n{}",
        table(rows)
    );
}

#[test]
fn median_is_the_middle_value() {
    assert!((median(vec![3.0, 1.0, 2.0]) - 2.0).abs() < 1e-12);
    assert!((median(vec![4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-12);
}

/// The inference cases keep nothing for backward: the reference says 0, and so must memest.
#[test]
fn inference_cases_save_nothing() {
    let mut seen = 0;
    for (id, args, r) in cases() {
        if r["saved_activations_bytes"] != 0 {
            continue;
        }
        seen += 1;
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let est = report(&args);
        assert_eq!(u(&est, "activations_bytes"), 0, "{id}");
        assert_eq!(u(&est, "gradients_bytes"), 0, "{id}");
        assert_eq!(u(&est, "optimizer_state_bytes"), 0, "{id}");
    }
    assert!(seen >= 2, "expected the two inference cases, found {seen}");
}
