//! How long an estimate takes, end to end (parse, build, trace, simulate, report), on the
//! bundled examples and on a synthetic deep model. Run with `cargo bench`.

use memest::settings::Overrides;
use memest::spec::Format;

/// The binary's allocator (`src/main.rs`), so these figures are the binary's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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

/// Llama-3.1-405B's config (126 decoder layers), a training step at 8,192 tokens. Target: at
/// most 5 ms. Met on 2026-12-02 (14:40, load ~1.5): median 4.58-4.78 ms, fastest 4.43-4.51,
/// in three runs interleaved with f89e47e's 9.17 ms (fastest 8.81-8.87); the whole suite
/// right after, 4.47 ms. The release binary takes 10.7/11.0 ms task-clock (min/median of 9;
/// f89e47e 14 ms): it adds the process (the dynamic loader's relocations, clap) and the
/// kernel zeroing the huge pages mimalloc touches, a third of its samples.
/// How: on CUDA the caching allocator plays the program of the traces of 4, 5 and 6 layers at
/// 126 copy by copy (its state repeats only every 7-8 layers, which the encoded state does not
/// extend: `sim::periodic::AUTO`), about 58,000 requests and frees. Callgrind instructions of
/// the binary: 77.8 M on f89e47e (two thirds the allocator, 41% a B-tree over the 1,800 free
/// blocks of the large pool); 62.0 M with free blocks by size and size class (`alloc::pool`);
/// 55.2 M with the traces' check made on their streams instead of replaying them, and a
/// copy's temporaries kept by site; 52.8 M with the traces recording the stream without
/// running the allocator; 52.1 M with foldhash in the replay; 50.6 M with a block filed in
/// the place of its size's stale heap top; 49.8 M with a key's first block kept inline in
/// the heap. What is left: the allocator's 58,000 operations (about half, the pool's heaps and
/// classes a third of the time in `perf`), the three traces' replays (a seventh) and their
/// tracing, reports and program.
#[divan::bench(sample_count = 10)]
fn llama_3_1_405b_config(bencher: divan::Bencher) {
    let src = example("hf/llama-3.1-405b.json");
    let overrides = Overrides {
        seq: Some(8192),
        ..Overrides::default()
    };
    bencher.bench(|| {
        memest::estimate(
            divan::black_box(&src),
            Format::Json,
            "llama-3.1-405b",
            &overrides,
            None,
        )
        .expect("config estimates")
    });
}

/// A repeat of 100,000 copies of `linear(512) + relu`, on `--device cpu` and on CUDA (the default
/// device). Target: at most 50 ms and 32 MiB RSS (the RSS is measured on the binary:
/// `/usr/bin/time -f %M memest FILE [--device cpu]`). On the CPU it is extended symbolically from
/// 4, 5 and 6 copies (`src/symbolic.rs`): 0.00-0.01 s user and 5.0 MiB (unrolled before: 0.49 s,
/// 197 MB). On CUDA the caching allocator's state is extended too (`src/sim/periodic.rs`: the
/// activations' 2 KiB blocks as repetitions inside their 2 MiB segments, units of segments and
/// units holding repetitions): the binary 0.26-0.34 s user and 16 MB, the JSON identical to
/// unrolling's (3.6-3.8 s user and 457 MB, load 5-8 on 2 cores); 0.23 s and 17 MB once the
/// stretches outside the runs are played by the allocator itself (interleaved with the
/// previous commit's 0.28-0.32 s, load 6.4); task-clock (`perf stat -r 5`, interleaved, load
/// 9.2) 342-406 -> 215-240 ms once merges compare items in place before copying them and
/// `settle` keeps its window on the stack; this bench then 377-399 ms (wall, load 5.4; the
/// CPU case 0.13-0.55 ms). Still past the target: each filled segment costs a few copies
/// played to see the period again (29,283 copies played of the 1.1 million the step's 11 runs
/// hold), and the encoded state's units are copied on every request and free. 2026-12-02: a
/// repetition's index (a quotient) may move along the periods while its remainder stays in
/// range, so the two backward runs extend too (11,332 -> 4,230 copies played; 22,181 in all):
/// the binary's task-clock min/median of 7, interleaved (load 2.8-3.3), main 208-229/210-277
/// ms -> 154-157/156-166 ms, max RSS 27.1 -> 12.9 MB (a signature kept per copy played).
/// Then periods of periods (`sim::periodic::landing`: the copies where jumps land repeat
/// too, whole segment fills jumped over): min/median of 7, interleaved (load 3.1-5.1), main
/// 155-235/191-254 ms -> 81-91/86-120 ms, max RSS 27.4 -> 17.2 MB; this bench after it
/// (wall, 3 samples, load ~5.4 on 2 cores): cuda 230-260 ms, median 243.5 ms (377-399 ms
/// before at a like load); cpu 0.18-0.77 ms. Still past 50 ms: the
/// runs whose jumps within a segment fill rely on a step between blocks of copies far apart
/// (a merge's `Code`, which changes from one fill to the next) play a few copies per fill.
/// On main (2d3c286), 2026-12-02 08:25, load ~1.5: this bench cuda median 75.0 ms (fastest
/// 74.3), cpu 0.28 ms; the binary task-clock min/median of 9: 81/102 ms, max RSS 17.1 MB.
/// Met since 172e616 (2026-12-02 10:05): the periods of periods rely on an equality that
/// moves (a repetition's count falling toward 0) by its signs and where it meets 0, not its
/// exact value, so every segment fill of the second step's runs is jumped over too (12,869 ->
/// 1,681 copies played). This bench after (load ~1): cuda median 9.8 ms (fastest 9.8), cpu
/// 0.12 ms; the binary task-clock min/median of 7: 74/75 -> 11/11 ms, max RSS 17.7 MB.
#[divan::bench(args = ["cpu", "cuda"], sample_count = 3, sample_size = 1)]
fn repeat_100k_copies(bencher: divan::Bencher, device: &str) {
    let src = "[input]\nshape = [512]\n[[layers]]\nkind = \"repeat\"\ncount = 100000\n[[layers.layers]]\nkind = \"linear\"\nout_features = 512\n[[layers.layers]]\nkind = \"relu\"\n";
    let overrides = Overrides {
        device: Some(if device == "cpu" {
            memest::settings::Device::Cpu
        } else {
            memest::settings::Device::Cuda
        }),
        ..Overrides::default()
    };
    bencher.bench(|| {
        memest::estimate(
            divan::black_box(src),
            Format::Toml,
            "repeat",
            &overrides,
            None,
        )
        .expect("repeat estimates")
    });
}

/// 100,000 `relu` layers in one flat list, named (`name = "rN"`) or not (each gets a default
/// name checked against its siblings' names). Target: at most 300 ms, linear in the count:
/// met since 2026-12-02 08:25 (the last lines). Measured 2026-12-02 on 2 shared cores at load ~7, this bench, median (fastest),
/// before -> after the flat-layer work (toml's `fast_hash`, shapes in place, no `Op` copies in
/// the graph's scopes, the tracer's tables sized up front and only referenced names in scope):
/// (100000, false) 1.745 s (1.522) -> 1.181 s (1.041), (100000, true) 1.628 s (1.338) ->
/// 1.209 s (1.121), (10000, false) 80 ms (72) -> 97 ms (59), (10000, true) 64 ms (57) -> 87 ms
/// (84): the 10k figures are within the noise of a loaded machine. The binary (`perf stat -r 5`
/// task-clock, load 6-7): unnamed TOML 1297 -> 991 ms, named TOML 981 -> 952 ms, unnamed JSON
/// 1111 -> 801 ms, named JSON 1140 -> 762 ms; page faults 111,874 -> 92,766 (TOML) and 88,965 ->
/// 63,039 (JSON); max RSS 274 -> 254 MB. On a quiet machine the same session measured this bench
/// before the work at 717-953 ms (unnamed) and 800-850 ms (named). What is left is mostly
/// memory: each `LayerSpec` is 1,288 bytes with one optional field per key (129 MB for 100,000
/// layers, alive for the whole estimate), and each traced step allocates its small vectors.
/// Both done since (boxed kind keys, `LayerKeys`; in-place `IdList`s in each `Step`); the
/// binary, `/usr/bin/time` user+sys, three runs interleaved at load ~6 (2026-12-02 05:57),
/// main -> boxed keys -> both: unnamed TOML 1.07-1.15 -> 0.71-0.87 -> 0.78-0.82 s, named JSON
/// 0.92-1.07 -> 0.77-0.81 -> 0.68-0.77 s; max RSS 253 -> 160 -> 154 MB (TOML), 258 -> 149 ->
/// 143 MB (JSON); page faults 92,827 -> 53,803 -> 52,015 (TOML), 65,436 -> 38,095 -> 36,308
/// (JSON). Not met still: of the binary's time (perf, unnamed TOML) toml's own document
/// parse is a fifth, the tracer a fifth, the replay a fifth (CUDA allocator model included).
/// The back half since (2026-12-02, release binary, task-clock interleaved with cb8fb7b's at
/// load ~5): the tape's rows smaller (a `Step` 264 -> 120 bytes: 32-bit ids, 16-byte
/// `IdList`s, `RareList`s) and a layer's name kept once in its path, max RSS 212 -> 200 MB,
/// unnamed min/median 294/432 -> 267/363 ms (named within the noise); `--format json`
/// streamed rather than built as a `Value` (25 MB for 100,000 rows): 471/550 -> 307/383 ms.
/// 2026-12-02 07:40-08:05, the binary with mimalloc, task-clock min/median of 11 runs
/// interleaved with main's (cb8fb7b) at load 3.5-6: the `[[layers]]` read ~32 KiB at a time
/// (`spec/chunks.rs`), each layer read straight into `LayerSpec` (no flat struct of every key)
/// and the model's layers dropped after the trace: unnamed TOML 293/413 -> 288/342 ms, named
/// TOML 316/412 -> 282/335 ms; max RSS 211 -> 142 MB (unnamed), 213 -> 144 MB (named).
/// All of it on main (2d3c286), 2026-12-02 08:25, load ~1.5: this bench, median (fastest),
/// (100000, false) 282.4 ms (250.0), (100000, true) 270.5 ms (243.3), (10000, false) 21.8 ms
/// (21.3), (10000, true) 21.3 ms (19.7); the stages (`flat_layers_stage`) parse 73, build 46,
/// trace 45, simulate 49, report 13 ms. The binary, task-clock min/median of 9 (load ~1.4):
/// unnamed TOML 235/270 ms, named TOML 253/304 ms, unnamed JSON 186/273 ms, named JSON
/// 190/238 ms, 10,000 unnamed TOML 41/47 ms; max RSS 126-138 MB; `--format json` (a 25 MB
/// document) 299/351 ms.
#[divan::bench(args = [(10_000, false), (100_000, false), (10_000, true), (100_000, true)], sample_count = 3, sample_size = 1)]
fn flat_layers(bencher: divan::Bencher, (n, named): (usize, bool)) {
    let mut src = String::from("[input]\nshape = [16]\n");
    for i in 0..n {
        src.push_str("[[layers]]\nkind = \"relu\"\n");
        if named {
            src.push_str(&format!("name = \"r{i}\"\n"));
        }
    }
    bencher.bench(|| {
        memest::estimate(
            divan::black_box(&src),
            Format::Toml,
            "flat",
            &Overrides::default(),
            None,
        )
        .expect("flat model estimates")
    });
}

/// One estimate of Llama-2-7B's config in inference at 4,096 tokens and batch 1 with an 80 GB
/// budget: what `llama_2_7b_max_batch` is compared with. Measured: 7.6 ms median (load ~6; 40 ms
/// at load ~13 while the CUDA allocator extension still gave up and the 32 layers unrolled).
/// The binary: 0.00-0.01 s user before the allocator state held repetitions of blocks and
/// nested units, 0.02-0.03 s after (load ~5): a request or free costs more, and 115 of the
/// 120 copies of its runs are still played.
#[divan::bench(sample_count = 20)]
fn llama_2_7b_infer(bencher: divan::Bencher) {
    let src = example("hf/llama-2-7b.json");
    let spec = memest::load_spec(&src, Format::Json, memest::hf::Head::Auto).expect("config");
    let query = memest::Query {
        overrides: Overrides {
            seq: Some(4096),
            mode: Some(memest::settings::Mode::Infer),
            ..Overrides::default()
        },
        budget: Some(80_000_000_000),
        ..memest::Query::default()
    };
    bencher.bench(|| memest::run(divan::black_box(&spec), "llama-2-7b", &query).expect("estimate"));
}

/// `--max-batch` on Llama-2-7B's config, inference at 4,096 tokens with an 80 GB budget, to
/// compare with one estimate of the same query (`llama_2_7b_infer`). Target: at most 3 times one
/// estimate. The search probes batches 1, 2, the crossing 18, and 19. Each probe was a whole
/// estimate, its 32 layers extended from traces of 4, 5 and 6 (three traces, three
/// simulations, the CUDA allocator's program played at 32 copies): 4.2 times one estimate
/// (19.9 ms, quiet). Now the probes share one `search::Prober`: the model traced whole (at 32
/// layers cheaper than extending), batch 1 and 65,536 traced once, and each other batch's
/// tape rewritten in place from them (`trace::derive::Batched`), so a probe is a simulation
/// and a report. Measured 2026-12-02 on 2 shared cores, interleaved, median (one estimate in
/// parentheses): before 60.7, 51.4 ms (13.9, 12.8; load ~9) and 47.4, 40.3 ms (12.7, 10.9;
/// load ~5.7): 3.7 to 4.4 times; with the tapes rebuilt per probe (`at_batch`) 28.8, 36.3 ms
/// (9.5, 11.7; load ~5.7); rewritten in place 21.3, 26.3 ms (8.5, 15.9; load ~5.7): 1.7 to 2.5
/// times. The binary (`perf stat -r 10`, task-clock, load ~5.7, with `--max-batch` / without):
/// before 27.9 / 9.8 and 25.2 / 11.0 ms, rebuilt 18.4 / 6.6 and 20.5 / 9.1 ms, in place
/// 12.4 / 7.9 and 10.4 / 9.2 ms. What is left is the four simulations, a third of each the
/// caching allocator's replay.
#[divan::bench(sample_count = 3, sample_size = 1)]
fn llama_2_7b_max_batch(bencher: divan::Bencher) {
    let src = example("hf/llama-2-7b.json");
    let spec = memest::load_spec(&src, Format::Json, memest::hf::Head::Auto).expect("config");
    let query = memest::Query {
        overrides: Overrides {
            seq: Some(4096),
            mode: Some(memest::settings::Mode::Infer),
            ..Overrides::default()
        },
        budget: Some(80_000_000_000),
        search: Some(memest::report::Dimension::Batch),
        ..memest::Query::default()
    };
    bencher.bench(|| memest::run(divan::black_box(&spec), "llama-2-7b", &query).expect("search"));
}

/// The stages of `flat_layers` (100,000 unnamed `relu` layers) one by one: parsing the TOML,
/// building the graph, tracing, simulating, assembling the report. Measured 2026-12-02, load ~7,
/// median (fastest), before -> after the flat-layer work: parse 498 ms (472) -> 317 ms (292),
/// build 314 (292) -> 259 (168), trace 252 (247) -> 70 (63), simulate 216 (156) -> 188 (153),
/// report 38 (38) -> 21 (18). Earlier on a quiet machine: parse 240, build 143, trace 117,
/// simulate 112, report 20. Main before the boxed kind keys and the in-place step lists, load
/// ~6.5 (05:10): parse 986 ms (954), build 360 (344), trace 379 (317), simulate 322 (319),
/// report 72 (68); after: not measured here (the bench's own release build did not finish
/// under load ~9; see `flat_layers` for the binary).
#[divan::bench(args = ["parse", "build", "trace", "simulate", "report"], sample_count = 3, sample_size = 1)]
fn flat_layers_stage(bencher: divan::Bencher, stage: &str) {
    let mut src = String::from("[input]\nshape = [16]\n");
    for _ in 0..100_000 {
        src.push_str("[[layers]]\nkind = \"relu\"\n");
    }
    let spec = memest::load_spec(&src, Format::Toml, memest::hf::Head::Auto).expect("parses");
    let model = memest::graph::build(&spec, "flat").expect("builds");
    let settings = memest::settings::Settings::resolve(&model.defaults, &Overrides::default())
        .expect("settings");
    let tape = memest::trace::trace(&model, &settings).expect("traces");
    let sim = memest::sim::simulate(&tape, &settings).expect("simulates");
    match stage {
        "parse" => bencher.bench(|| {
            memest::load_spec(divan::black_box(&src), Format::Toml, memest::hf::Head::Auto)
        }),
        "build" => bencher.bench(|| memest::graph::build(divan::black_box(&spec), "flat")),
        "trace" => bencher.bench(|| memest::trace::trace(divan::black_box(&model), &settings)),
        "simulate" => bencher.bench(|| memest::sim::simulate(divan::black_box(&tape), &settings)),
        _ => bencher
            .bench(|| memest::Report::new("flat", &settings, divan::black_box(&tape), &sim, None)),
    }
}
