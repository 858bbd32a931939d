//! The CUDA caching allocator's figures (`allocated_peak_bytes`, `reserved_peak_bytes`): when
//! they appear, how they relate to the step's peak, and `--expandable-segments`. Their accuracy
//! against `measure_fake_cuda.py`'s allocator replay is checked with the CUDA reference sets in
//! `reference.rs`; the allocator itself by unit tests in `src/alloc.rs`.

use serde_json::Value;

use crate::common::{memest, report, stderr, u};

const MLP: &str = "examples/mlp.toml";
const MIB: u64 = 1 << 20;

fn opt(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

/// On the CPU there is no caching allocator: the keys are absent, and
/// `--expandable-segments` says it has no effect.
#[test]
fn no_allocator_figures_on_the_cpu() {
    let cpu = report(&[MLP, "--device", "cpu"]);
    assert_eq!(opt(&cpu, "allocated_peak_bytes"), None);
    assert_eq!(opt(&cpu, "reserved_peak_bytes"), None);
    let out = memest(&[MLP, "--device", "cpu", "--expandable-segments"]);
    assert!(
        stderr(&out).contains("--expandable-segments has no effect"),
        "{}",
        stderr(&out)
    );
    let cuda = report(&[MLP, "--expandable-segments"]);
    assert!(cuda["warnings"].is_null(), "{cuda}");
    assert_eq!(cuda["settings"]["expandable_segments"], true);
}

/// With SGD (no host-side step counters) every byte of the step goes through the allocator:
/// the allocated peak is at least the step's peak (each tensor rounded up to 512 B), and the
/// reserved peak at least the allocated one, in whole 2 MiB units.
#[test]
fn allocated_and_reserved_bound_the_peak() {
    for args in [
        &[MLP, "--batch", "32", "--optim", "sgd-momentum"][..],
        &["examples/resnet50.toml", "--batch", "2", "--optim", "sgd"][..],
        &["examples/gpt2.toml", "--seq", "128", "--mode", "infer"][..],
    ] {
        let r = report(args);
        let (peak, allocated, reserved) = (
            u(&r, "peak_bytes"),
            u(&r, "allocated_peak_bytes"),
            u(&r, "reserved_peak_bytes"),
        );
        assert!(allocated >= peak, "{args:?}: {allocated} < {peak}");
        assert!(reserved >= allocated, "{args:?}: {reserved} < {allocated}");
        assert_eq!(reserved % (2 * MIB), 0, "{args:?}");
    }
}

/// The MLP's measured step (`mlp-b32-fp32-adam`, `measure_fake_cuda.py`): 82,207,232 B
/// allocated at most, 109,051,904 B (104 MiB) reserved. Its parameters are 4, 8 and 0.4 MB;
/// Adam's moments, gradients and `_foreach_sqrt` temporaries repeat those sizes, so each
/// fills a 20 MiB segment's rest or a segment of its own.
#[test]
fn mlp_matches_the_allocator_replay() {
    let r = report(&[MLP, "--batch", "32", "--optim", "adam"]);
    assert_eq!(u(&r, "allocated_peak_bytes"), 82_207_232);
    assert_eq!(u(&r, "reserved_peak_bytes"), 109_051_904);
}

/// Expandable segments split every block exactly, so the allocated peak is the step's
/// tensors rounded to 512 B (never more than with fixed segments, which keep up to 1 MiB
/// unsplit), and the pools grow by 2 MiB and 20 MiB pages.
#[test]
fn expandable_segments_split_exactly() {
    for args in [
        &[MLP, "--batch", "32", "--optim", "adam"][..],
        &["examples/gpt2.toml", "--seq", "128", "--batch", "2"][..],
        &[
            "examples/resnet50.toml",
            "--batch",
            "4",
            "--optim",
            "sgd-momentum",
        ][..],
    ] {
        let fixed = report(args);
        let mut with = args.to_vec();
        with.push("--expandable-segments");
        let grown = report(&with);
        let a = u(&grown, "allocated_peak_bytes");
        assert!(a <= u(&fixed, "allocated_peak_bytes"), "{args:?}");
        let reserved = u(&grown, "reserved_peak_bytes");
        assert!(reserved >= a, "{args:?}");
        assert_eq!(reserved % (2 * MIB), 0, "{args:?}");
    }
}

/// An EMA copy of the weights lives in the allocator from the start: the allocated peak
/// grows by at least its bytes.
#[test]
fn an_ema_copy_is_allocated() {
    let plain = report(&[MLP, "--batch", "32"]);
    let ema = report(&[MLP, "--batch", "32", "--ema", "float32"]);
    let grew = u(&ema, "allocated_peak_bytes") - u(&plain, "allocated_peak_bytes");
    assert!(grew >= u(&ema, "ema_bytes"), "{grew}");
}
