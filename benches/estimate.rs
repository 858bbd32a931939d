//! How long an estimate takes, end to end (parse, build, trace, simulate, report), on the
//! bundled examples and on a synthetic deep model. Run with `cargo bench`.

use memest::settings::Overrides;
use memest::spec::Format;

fn main() {
    divan::main();
}

fn example(name: &str) -> String {
    let path = format!("{}/examples/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// One of the bundled model files, as the README's first command runs it.
#[divan::bench(args = ["mlp.toml", "resnet50.toml", "vit_b_16.toml", "gpt2.toml", "llama_tiny.toml"])]
fn bundled_example(bencher: divan::Bencher, name: &str) {
    let src = example(name);
    let overrides = Overrides::default();
    bencher.bench(|| {
        memest::estimate(divan::black_box(&src), Format::Toml, name, &overrides, None)
            .expect("example estimates")
    });
}

/// A Hugging Face config: Llama-2-7B (32 decoder layers traced one by one), training step.
#[divan::bench]
fn llama_2_7b_config(bencher: divan::Bencher) {
    let src = example("hf/llama-2-7b.json");
    let overrides = Overrides {
        batch: Some(1),
        seq: Some(4096),
        ..Overrides::default()
    };
    bencher.bench(|| {
        memest::estimate(
            divan::black_box(&src),
            Format::Json,
            "llama-2-7b",
            &overrides,
            None,
        )
        .expect("config estimates")
    });
}

/// A repeated block of 12 layers with `count` copies: the trace grows linearly with the count.
#[divan::bench(args = [10, 100, 1000])]
fn deep_mlp(bencher: divan::Bencher, count: u64) {
    let src = format!(
        "[input]\nshape = [512]\n[[layers]]\nkind = \"repeat\"\ncount = {count}\n{}",
        (0..6)
            .map(|i| format!("  [[layers.layers]]\n  kind = \"linear\"\n  name = \"fc{i}\"\n  out_features = 512\n  [[layers.layers]]\n  kind = \"relu\"\n  name = \"act{i}\"\n"))
            .collect::<String>()
    );
    let overrides = Overrides {
        batch: Some(32),
        ..Overrides::default()
    };
    bencher.bench(|| {
        memest::estimate(
            divan::black_box(&src),
            Format::Toml,
            "deep",
            &overrides,
            None,
        )
        .expect("deep model estimates")
    });
}
