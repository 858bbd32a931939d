//! Helpers shared by the integration tests: running the binary, temporary model files, JSON.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use serde_json::Value;

/// The crate root (where `examples/` and `tests/` live); the binary runs from here.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A path relative to the crate root.
pub fn path(rel: &str) -> PathBuf {
    root().join(rel)
}

/// `memest ARGS` from the crate root, with a fixed terminal width (in case help text is ever
/// wrapped to the terminal) and a time limit, so that a hang fails instead of blocking the suite.
/// The model file or HF config at `rel` (from the repository root), read as its extension says.
pub fn spec(rel: &str) -> memest::spec::ModelSpec {
    let src = std::fs::read_to_string(path(rel)).expect("an example");
    let format = if rel.ends_with(".json") {
        memest::spec::Format::Json
    } else {
        memest::spec::Format::Toml
    };
    memest::load_spec(&src, format, memest::hf::Head::Auto).expect("the example reads")
}

fn command(args: &[&str]) -> assert_cmd::Command {
    let mut cmd = assert_cmd::cargo::cargo_bin_cmd!("memest");
    cmd.args(args)
        .current_dir(root())
        .env("COLUMNS", "100")
        .timeout(Duration::from_secs(120));
    cmd
}

/// Runs `memest ARGS` from the crate root, with an empty standard input.
pub fn memest(args: &[&str]) -> Output {
    command(args)
        .output()
        .expect("failed to run the memest binary")
}

/// Runs `memest ARGS` from the crate root with `stdin` as standard input (memest may exit
/// before reading it all, e.g. on a usage error: assert_cmd ignores the broken pipe).
pub fn memest_stdin(args: &[&str], stdin: &str) -> Output {
    command(args)
        .write_stdin(stdin)
        .output()
        .expect("failed to run the memest binary")
}

/// The exit code (panics when the process was killed by a signal).
pub fn code(out: &Output) -> i32 {
    out.status
        .code()
        .unwrap_or_else(|| panic!("memest was killed by a signal\n{}", describe(out)))
}

/// Standard output as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Standard error as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Status, stdout and stderr, for assertion messages.
pub fn describe(out: &Output) -> String {
    format!(
        "status: {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status.code(),
        stdout(out),
        stderr(out)
    )
}

/// Asserts exit code 0 and no output on stderr.
pub fn assert_success(out: &Output) {
    assert_eq!(code(out), 0, "expected success\n{}", describe(out));
    assert!(
        out.stderr.is_empty(),
        "expected nothing on stderr\n{}",
        describe(out)
    );
}

/// Parses standard output as JSON, after checking the run succeeded.
pub fn json(out: &Output) -> Value {
    assert_success(out);
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON: {e}\n{}", describe(out)))
}

/// Runs `memest ARGS --format json` and parses the report.
pub fn report(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["--format", "json"]);
    json(&memest(&all))
}

/// A top-level integer field of a report.
pub fn u(v: &Value, key: &str) -> u64 {
    v.get(key)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("`{key}` is missing or not an unsigned integer in {v:#}"))
}

/// A model file under the system temporary folder, removed when dropped.
pub struct TempModel {
    file: tempfile::NamedTempFile,
}

impl TempModel {
    /// Writes `contents` to a new file with a unique name ending in `.ext` (`toml`, `json`, or
    /// anything else to exercise content sniffing).
    pub fn new(ext: &str, contents: &str) -> TempModel {
        let file = tempfile::Builder::new()
            .prefix("memest-it-")
            .suffix(&format!(".{ext}"))
            .tempfile()
            .expect("failed to create a temporary model file");
        std::fs::write(file.path(), contents).expect("failed to write a temporary model file");
        TempModel { file }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The file's path as `&str`, for argument lists.
    pub fn arg(&self) -> &str {
        self.path().to_str().expect("temporary paths are UTF-8")
    }
}

/// Relative difference `(est - truth) / truth` in percent (`truth` must be non-zero).
#[allow(clippy::cast_precision_loss)] // byte counts far below 2^52
pub fn err_pct(est: u64, truth: u64) -> f64 {
    (est as f64 - truth as f64) / truth as f64 * 100.0
}

/// Asserts that `est` is within `pct` percent of the measured `truth`, naming `what` and both
/// figures when it is not.
pub fn within(est: u64, truth: u64, pct: f64, what: &str) {
    let e = err_pct(est, truth);
    assert!(
        e.abs() <= pct,
        "{what}: memest {est}, measured {truth} ({e:+.3}%, allowed ±{pct}%)"
    );
}
