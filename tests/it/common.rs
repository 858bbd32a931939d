//! Helpers shared by the integration tests: running the binary, temporary model files, JSON.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

/// The crate root (where `examples/` and `tests/` live); the binary runs from here.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A path relative to the crate root.
pub fn path(rel: &str) -> PathBuf {
    root().join(rel)
}

fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_memest"));
    // A fixed terminal width, in case help text is ever wrapped to the terminal.
    cmd.args(args).current_dir(root()).env("COLUMNS", "100");
    cmd
}

/// Runs `memest ARGS` from the crate root, with an empty standard input.
pub fn memest(args: &[&str]) -> Output {
    command(args)
        .stdin(Stdio::null())
        .output()
        .expect("failed to run the memest binary")
}

/// Runs `memest ARGS` from the crate root with `stdin` as standard input.
pub fn memest_stdin(args: &[&str], stdin: &str) -> Output {
    let mut child = command(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("failed to start the memest binary");
    {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        // memest may exit before reading everything (e.g. on a usage error); ignore EPIPE.
        let _ = pipe.write_all(stdin.as_bytes());
    }
    child
        .wait_with_output()
        .expect("failed to wait for the memest binary")
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
    path: PathBuf,
}

impl TempModel {
    /// Writes `contents` to a new file with a unique name ending in `.ext` (`toml`, `json`, or
    /// anything else to exercise content sniffing).
    pub fn new(ext: &str, contents: &str) -> TempModel {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = std::env::temp_dir().join(format!(
            "memest-it-{}-{n}-{nanos}.{ext}",
            std::process::id()
        ));
        std::fs::write(&path, contents).expect("failed to write a temporary model file");
        TempModel { path }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's path as `&str`, for argument lists.
    pub fn arg(&self) -> &str {
        self.path.to_str().expect("temporary paths are UTF-8")
    }
}

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Relative difference `(est - truth) / truth` in percent (`truth` must be non-zero).
#[allow(clippy::cast_precision_loss)] // byte counts far below 2^52
pub fn err_pct(est: u64, truth: u64) -> f64 {
    (est as f64 - truth as f64) / truth as f64 * 100.0
}
