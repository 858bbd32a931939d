//! Fuzz cases built from a stream of decisions (bytes), so that proptest's shrinking (fewer,
//! smaller bytes) and libFuzzer's mutations both mean "a simpler case": a byte of 0, or the end
//! of the stream, always takes the simplest choice.
//!
//! A case starts from a seed model (a bundled example or fixture, a Hugging Face config, a
//! corpus case) or from a model built from scratch out of the real layer kinds and their keys
//! ([`memest::graph::kind_keys`]); then structured mutations (a key set to a value of its type
//! or of another, a key dropped, a kind changed, a layer added, copied or removed, the input or
//! the defaults changed, a config field changed), output as TOML or JSON; sometimes a few
//! edits of the text itself; and a random set of flags.

use std::path::Path;

use memest::cost::{Amp, Optimizer, OptimizerImpl, RecipeName};
use memest::spec::LayerKind;
use memest::vocab::{AttentionImpl, Device, Mode, Vocab};
use serde_json::{Map, Value, json};

/// A stream of decisions.
pub struct Choices<'a> {
    bytes: &'a [u8],
}

impl<'a> Choices<'a> {
    /// Decisions read from `bytes`; past their end every choice is 0.
    #[must_use]
    pub fn new(bytes: &'a [u8]) -> Self {
        Choices { bytes }
    }

    fn byte(&mut self) -> u8 {
        match self.bytes.split_first() {
            Some((&b, rest)) => {
                self.bytes = rest;
                b
            }
            None => 0,
        }
    }

    /// A number in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: usize) -> usize {
        if n <= 1 {
            return 0;
        }
        let v = if n <= 256 {
            usize::from(self.byte())
        } else {
            usize::from(self.byte()) << 8 | usize::from(self.byte())
        };
        v % n
    }

    /// True with about `percent` % chance (never at the end of the stream).
    fn chance(&mut self, percent: u8) -> bool {
        let b = self.byte();
        b != 0 && u32::from(b) * 100 <= u32::from(percent) * 256
    }

    fn pick<'b, T>(&mut self, xs: &'b [T]) -> &'b T {
        &xs[self.below(xs.len())]
    }
}

/// The seed models: a case text each.
pub struct Seeds {
    /// memest's own descriptions (TOML or JSON) and corpus cases.
    pub models: Vec<String>,
    /// Hugging Face `config.json` files.
    pub configs: Vec<String>,
}

impl Seeds {
    /// Reads the seeds under the crate root `root`: the small examples, the test fixtures, the
    /// Hugging Face configs, and the fuzz corpus.
    #[must_use]
    pub fn load(root: &Path) -> Seeds {
        let mut seeds = Seeds {
            models: Vec::new(),
            configs: Vec::new(),
        };
        for dir in [
            "tests/fixtures/kinds",
            "tests/fixtures/extra",
            "tests/fixtures/hf",
            "tests/fixtures",
            "examples",
            "examples/hf",
            "tests/fuzz/corpus",
        ] {
            let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
                continue;
            };
            let mut paths: Vec<_> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
            paths.sort();
            for p in paths.into_iter().filter(|p| !is_open_finding(p)) {
                // The large CNNs cost more than they find; they run in the other tests.
                let small = std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.len() <= 8_000);
                let Some(text) = small.then(|| std::fs::read_to_string(&p).ok()).flatten() else {
                    continue;
                };
                let hf = serde_json::from_str::<Value>(&text)
                    .is_ok_and(|v| memest::hf::is_hf_config(&v));
                if hf {
                    seeds.configs.push(text);
                } else {
                    seeds.models.push(text);
                }
            }
        }
        seeds
    }
}

/// A corpus file of a finding not fixed yet (`open_…`): kept, and run by its ignored test in
/// `regressions.rs`, but neither a seed nor part of the corpus test until it is fixed.
#[must_use]
pub fn is_open_finding(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("open_"))
}

const SIZES: [u64; 12] = [1, 2, 3, 4, 8, 16, 6, 12, 32, 7, 64, 5];
const WEIRD_NUMBERS: [i64; 8] = [0, -1, 1 << 20, 1 << 40, i64::MAX, 1000, 127, 4097];
/// Keys whose value multiplies the operators traced: kept small so a case stays fast (a large
/// `count` is slow today: issue 12, "Never slow, never big").
const COUNT_KEYS: [&str; 11] = [
    "count",
    "experts",
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "num_decoder_layers",
    "num_experts",
    "num_local_experts",
    "n_layers",
    "num_encoder_layers",
    "n_head",
];

fn size(c: &mut Choices) -> Value {
    json!(*c.pick(&SIZES))
}

/// A value for `key`: usually of the key's type and in a plausible range.
fn value_for(c: &mut Choices, key: &str, names: &[String]) -> Value {
    if c.chance(8) {
        return weird_value(c, names);
    }
    match key {
        "name" | "tie" | "note" => match names.is_empty() || key == "note" {
            true => json!(format!("l{}", c.below(8))),
            false => json!(c.pick(names)),
        },
        "inputs" => {
            let n = 1 + c.below(3);
            let picked: Vec<Value> = (0..n)
                .map(|_| match names.is_empty() || c.chance(10) {
                    true => json!("input"),
                    false => json!(c.pick(names)),
                })
                .collect();
            Value::Array(picked)
        }
        "bias"
        | "trainable"
        | "quantize"
        | "ceil_mode"
        | "affine"
        | "track_running_stats"
        | "inplace"
        | "kv_cache"
        | "causal"
        | "fused_qkv"
        | "out_bias"
        | "k_bias"
        | "scale_query"
        | "contiguous_heads"
        | "rotary"
        | "shared_gate"
        | "normalize_topk"
        | "qk_norm"
        | "concat"
        | "tables_f32"
        | "shift"
        | "upcast" => json!(c.chance(50)),
        "kernel" | "stride" | "padding" | "output_padding" | "dilation" | "output_size" => {
            if c.chance(30) {
                json!([*c.pick(&[1u64, 2, 3, 0]), *c.pick(&[1u64, 2, 3, 5])])
            } else {
                json!(*c.pick(&[1u64, 3, 2, 0, 7]))
            }
        }
        "p" | "dropout" | "factor" => json!(*c.pick(&[0.1, 0.0, 0.5, 1.0, 2.0, -0.5])),
        "dim" | "start_dim" | "end_dim" | "index" => json!(*c.pick(&[-1i64, 1, 0, 2, -2, 3])),
        "shape" | "dims" => {
            let n = 1 + c.below(4);
            Value::Array(
                (0..n)
                    .map(|_| json!(*c.pick(&[-1i64, 2, 4, 1, 8, 0, 3])))
                    .collect(),
            )
        }
        "approximate" => json!(*c.pick(&["none", "tanh"])),
        "combine" => json!(*c.pick(&["add", "mul", "concat"])),
        "style" => json!(*c.pick(&["llama", "t5", "gemma", "olmo2", "transformers", "torch"])),
        "qk_norm_scope" => json!(*c.pick(&["head", "projection"])),
        "kind" => json!(kind_name(c)),
        k if COUNT_KEYS.contains(&k) => json!(*c.pick(&[1u64, 2, 3, 0, 8])),
        _ => size(c),
    }
}

/// A value of any type.
fn weird_value(c: &mut Choices, names: &[String]) -> Value {
    match c.below(9) {
        0 => json!(*c.pick(&WEIRD_NUMBERS)),
        1 => json!(*c.pick(&[0.5, -0.0, 1e300, 3.0])),
        2 => json!(*c.pick(&["", "seq", "x", "\u{1b}[31mred", "Ä\u{feff}", "input"])),
        3 => json!(true),
        4 => json!([]),
        5 => json!({}),
        6 => match names.is_empty() {
            true => json!("missing"),
            false => json!(c.pick(names)),
        },
        7 => json!([1, "seq", 2]),
        _ => json!(u64::MAX),
    }
}

fn kind_name(c: &mut Choices) -> &'static str {
    let kinds = LayerKind::ALL;
    kinds[c.below(kinds.len())].as_str()
}

/// A layer of a random kind with some of its keys.
fn layer(c: &mut Choices, names: &[String], depth: usize) -> Value {
    let kinds = LayerKind::ALL;
    let kind = kinds[c.below(kinds.len())];
    let mut m = Map::new();
    m.insert("kind".into(), json!(kind.as_str()));
    for key in memest::graph::kind_keys(kind) {
        if key == "layers" {
            if depth < 2 {
                let n = 1 + c.below(3);
                let body = (0..n).map(|_| layer(c, names, depth + 1)).collect();
                m.insert("layers".into(), Value::Array(body));
            }
        } else if c.chance(45) {
            m.insert(key.into(), value_for(c, key, names));
        }
    }
    if c.chance(30) {
        m.insert("name".into(), json!(format!("l{}", names.len())));
    }
    Value::Object(m)
}

/// The input of a model built from scratch.
fn input(c: &mut Choices) -> Value {
    match c.below(6) {
        0 => json!({ "shape": ["seq"], "dtype": "int64" }),
        1 => json!({ "shape": [*c.pick(&SIZES)] }),
        2 => json!({ "shape": [*c.pick(&[1u64, 3]), *c.pick(&SIZES), *c.pick(&SIZES)] }),
        3 => json!({ "shape": ["seq", *c.pick(&SIZES)] }),
        4 => json!({ "shape": [*c.pick(&SIZES), *c.pick(&SIZES)] }),
        _ => json!({ "shape": [*c.pick(&SIZES), *c.pick(&SIZES)], "dtype": "int64" }),
    }
}

/// A model built from scratch.
fn scratch(c: &mut Choices) -> Value {
    let n = 1 + c.below(6);
    let mut layers = Vec::new();
    let mut names = Vec::new();
    for _ in 0..n {
        let l = layer(c, &names, 0);
        if let Some(name) = l.get("name").and_then(Value::as_str) {
            names.push(name.to_string());
        }
        layers.push(l);
    }
    let mut m = Map::new();
    m.insert("input".into(), input(c));
    if c.chance(40) {
        m.insert(
            "defaults".into(),
            json!({ "batch": *c.pick(&SIZES), "seq": *c.pick(&SIZES) }),
        );
    }
    m.insert("layers".into(), Value::Array(layers));
    Value::Object(m)
}

/// Every layer table of `v` (through repeat bodies), as JSON pointers.
fn layer_pointers(v: &Value, at: &str, out: &mut Vec<String>) {
    if let Some(layers) = v.get("layers").and_then(Value::as_array) {
        for (i, l) in layers.iter().enumerate() {
            let p = format!("{at}/layers/{i}");
            out.push(p.clone());
            layer_pointers(l, &p, out);
        }
    }
}

fn layer_names(v: &Value) -> Vec<String> {
    let mut ptrs = Vec::new();
    layer_pointers(v, "", &mut ptrs);
    ptrs.iter()
        .filter_map(|p| v.pointer(p)?.get("name")?.as_str().map(str::to_string))
        .collect()
}

/// One structured mutation of a memest description.
fn mutate_model(c: &mut Choices, v: &mut Value) {
    let names = layer_names(v);
    let mut ptrs = Vec::new();
    layer_pointers(v, "", &mut ptrs);
    let choice = c.below(10);
    if ptrs.is_empty() || choice >= 8 {
        // The input or the defaults.
        let Some(m) = v.as_object_mut() else { return };
        if choice == 9 || ptrs.is_empty() {
            let key = *c.pick(&[
                "batch",
                "seq",
                "dtype",
                "optimizer",
                "mode",
                "attention",
                "optimizer_impl",
                "new_tokens",
                "device",
                "grad_accum",
            ]);
            let value = match key {
                "batch" | "seq" | "new_tokens" | "grad_accum" => size(c),
                "device" => json!(vocab_name::<Device>(c)),
                "dtype" => json!(*c.pick(&DTYPES)),
                "optimizer" => json!(vocab_name::<Optimizer>(c)),
                "mode" => json!(vocab_name::<Mode>(c)),
                "attention" => json!(vocab_name::<AttentionImpl>(c)),
                _ => json!(vocab_name::<OptimizerImpl>(c)),
            };
            let d = m.entry("defaults").or_insert_with(|| json!({}));
            if let Some(d) = d.as_object_mut() {
                d.insert(key.into(), value);
            }
        } else {
            m.insert("input".into(), input(c));
        }
        return;
    }
    let at = c.pick(&ptrs).clone();
    let (parent, index) = at.rsplit_once('/').expect("a layer pointer");
    let index: usize = index.parse().expect("an index");
    match choice {
        0..=2 => {
            // A key of the layer's kind set to a new value.
            let Some(l) = v.pointer_mut(&at).and_then(Value::as_object_mut) else {
                return;
            };
            let kind = l.get("kind").and_then(Value::as_str).unwrap_or("linear");
            let keys = LayerKind::ALL
                .iter()
                .find(|k| k.as_str() == kind)
                .map(|&k| memest::graph::kind_keys(k))
                .unwrap_or_default();
            if keys.is_empty() {
                return;
            }
            let key = *c.pick(&keys);
            if key != "layers" {
                let value = value_for(c, key, &names);
                l.insert(key.into(), value);
            }
        }
        3 => {
            // A key dropped.
            let Some(l) = v.pointer_mut(&at).and_then(Value::as_object_mut) else {
                return;
            };
            let keys: Vec<String> = l.keys().cloned().collect();
            if !keys.is_empty() {
                let key = c.pick(&keys).clone();
                if key != "kind" || c.chance(10) {
                    l.remove(&key);
                }
            }
        }
        4 => {
            // The kind changed.
            if let Some(l) = v.pointer_mut(&at).and_then(Value::as_object_mut) {
                l.insert("kind".into(), json!(kind_name(c)));
            }
        }
        5 => {
            // A new layer after it.
            let new = layer(c, &names, 1);
            if let Some(list) = v.pointer_mut(parent).and_then(Value::as_array_mut) {
                list.insert(index + 1, new);
            }
        }
        6 => {
            // A copy of it after it (names clash unless changed).
            if let Some(list) = v.pointer_mut(parent).and_then(Value::as_array_mut) {
                let copy = list[index].clone();
                list.insert(index + 1, copy);
            }
        }
        _ => {
            if let Some(list) = v.pointer_mut(parent).and_then(Value::as_array_mut) {
                list.remove(index);
            }
        }
    }
}

/// One mutation of a Hugging Face config: a field changed, dropped or added.
fn mutate_config(c: &mut Choices, v: &mut Value) {
    let Some(m) = v.as_object_mut() else { return };
    let keys: Vec<String> = m.keys().cloned().collect();
    if keys.is_empty() {
        return;
    }
    let key = c.pick(&keys).clone();
    match c.below(8) {
        0 => {
            m.remove(&key);
        }
        1 => {
            m.insert(key, weird_value(c, &[]));
        }
        2 => {
            let extra = *c.pick(&[
                "head_dim",
                "num_key_value_heads",
                "sliding_window",
                "tie_word_embeddings",
                "num_labels",
                "rope_scaling",
                "qk_layernorm",
                "moe_intermediate_size",
                "hidden_act",
                "max_position_embeddings",
            ]);
            let value = match extra {
                "tie_word_embeddings" | "qk_layernorm" => json!(c.chance(50)),
                "hidden_act" => {
                    json!(*c.pick(&["silu", "gelu", "relu", "gelu_new", "tanh", "swish"]))
                }
                "rope_scaling" => json!({ "type": "linear", "factor": 2.0 }),
                _ => size(c),
            };
            m.insert(extra.into(), value);
        }
        3 => {
            m.insert("model_type".into(), json!(*c.pick(&MODEL_TYPES)));
        }
        _ => {
            // A number scaled, or set small (layer counts stay small).
            let Some(n) = m.get(&key).and_then(Value::as_u64) else {
                return;
            };
            let new = if COUNT_KEYS.contains(&key.as_str()) {
                *c.pick(&[0u64, 1, 2, 3])
            } else {
                match c.below(6) {
                    0 => 0,
                    1 => 1,
                    2 => n / 2,
                    3 => n.saturating_mul(2),
                    4 => n.saturating_add(1),
                    _ => *c.pick(&SIZES),
                }
            };
            m.insert(key, json!(new));
        }
    }
}

const MODEL_TYPES: [&str; 12] = [
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "gemma",
    "phi3",
    "gpt2",
    "bert",
    "t5",
    "olmo2",
];

const DTYPES: [&str; 12] = [
    "float32",
    "bfloat16",
    "float16",
    "fp16",
    "float64",
    "int64",
    "fp8",
    "int8",
    "bool",
    "torch.bfloat16",
    "half",
    "e5m2",
];

fn vocab_name<T: Vocab>(c: &mut Choices) -> String {
    let names = T::names();
    let names: Vec<&str> = names.split(", ").collect();
    let name = (*c.pick(&names)).to_string();
    match c.below(40) {
        1 => name.to_ascii_uppercase(),
        2 => name.replace('-', "_"),
        3 => format!("{name}x"),
        4 => name.chars().skip(1).collect(),
        _ => name,
    }
}

/// A name of a clap `ValueEnum` (`--qlora-stack`, `--fsdp`, `--ema`, `--head`, `--format`),
/// sometimes misspelled or in another case.
fn value_enum_name<T: clap::ValueEnum>(c: &mut Choices) -> String {
    let names: Vec<String> = T::value_variants()
        .iter()
        .filter_map(|v| v.to_possible_value().map(|p| p.get_name().to_string()))
        .collect();
    let name = c.pick(&names).clone();
    match c.below(40) {
        1 => name.to_ascii_uppercase(),
        2 => format!("{name}x"),
        _ => name,
    }
}

/// A `--gpu` name: a catalog id or alias, sometimes (in a wild set) in another spelling or
/// unknown.
fn gpu_name(c: &mut Choices, wild: bool) -> String {
    let all = memest::gpu::catalog().unwrap_or_default();
    let mut names: Vec<&str> = all.iter().map(|g| g.id.as_str()).collect();
    names.extend(
        all.iter()
            .flat_map(|g| g.aliases.iter().map(String::as_str)),
    );
    if names.is_empty() || (wild && c.chance(20)) {
        return (*c.pick(&["h100x", "gpu", "", "RTX"])).to_string();
    }
    let name = (*c.pick(&names)).to_string();
    match if wild { c.below(20) } else { 0 } {
        1 => name.to_ascii_uppercase(),
        2 => name.replace('-', "_"),
        _ => name,
    }
}

/// How far the flags stray: a wild set has values out of range, misspelled names and flags
/// that conflict; a tame one (most cases) mostly reaches an estimate.
#[derive(Clone, Copy)]
struct Wild(bool);

impl Wild {
    /// From `good`, or, in a wild set now and then, from `bad`.
    fn pick<T: Copy>(self, c: &mut Choices, good: &[T], bad: &[T]) -> T {
        if self.0 && c.chance(25) {
            *c.pick(bad)
        } else {
            *c.pick(good)
        }
    }

    fn number(self, c: &mut Choices, good: &[u64], bad: &[u64]) -> String {
        self.pick(c, good, bad).to_string()
    }

    fn text(self, c: &mut Choices, good: &[&str], bad: &[&str]) -> String {
        self.pick(c, good, bad).to_string()
    }

    /// A name of a closed set: misspelled only in a wild set.
    fn vocab<T: Vocab>(self, c: &mut Choices) -> String {
        if self.0 {
            return vocab_name::<T>(c);
        }
        let names = T::names();
        let names: Vec<&str> = names.split(", ").collect();
        (*c.pick(&names)).to_string()
    }

    fn value_enum<T: clap::ValueEnum>(self, c: &mut Choices) -> String {
        if self.0 {
            return value_enum_name::<T>(c);
        }
        let names: Vec<String> = T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value().map(|p| p.get_name().to_string()))
            .collect();
        c.pick(&names).clone()
    }
}

/// A random set of flags, each present with some chance: every flag `memest --help` lists,
/// with values in and out of range (out of range, misspelled or conflicting mostly in a
/// "wild" set, a quarter of the cases).
#[allow(clippy::too_many_lines)] // one flag after another, in `--help`'s order
fn flags(c: &mut Choices) -> Vec<String> {
    use memest::cli::OutputFormat;
    use memest::hf::Head;
    use memest::parallel::FsdpStrategy;
    use memest::settings::{EmaPrecision, QloraStack};
    use memest::vocab::BudgetOn;

    let w = Wild(c.chance(25));
    let mut out: Vec<String> = Vec::new();
    let mut add = |f: &str, v: Option<String>| {
        out.push(f.to_string());
        out.extend(v);
    };
    let sweep = c.chance(6).then(|| {
        w.text(
            c,
            &["batch=1,2,4", "seq=8..64", "batch=1..16:3", "seq=16,32"],
            &["seq=1,0", "batch=", "depth=2", "batch=1..1000000000"],
        )
    });
    let sweeps_batch = sweep.as_deref().is_some_and(|s| s.starts_with("batch"));
    let sweeps_seq = sweep.as_deref().is_some_and(|s| s.starts_with("seq"));
    if c.chance(50) && (w.0 || !sweeps_batch) {
        let b = w.number(
            c,
            &[1, 2, 3, 4, 8, 16, 64, 5, 7, 12, 1, 2, 3, 4, 1, 2, 1 << 20],
            &[0, u64::MAX],
        );
        add(if c.chance(10) { "-b" } else { "--batch" }, Some(b));
    }
    let mode = c.chance(25).then(|| w.vocab::<Mode>(c));
    let generate = mode.as_deref() == Some("generate") || (mode.is_none() && c.chance(8));
    let infer = mode
        .as_deref()
        .is_some_and(|m| m.starts_with("inf") || m == "eval");
    let mut context = false;
    if c.chance(30) && (w.0 || !sweeps_seq) {
        let s = w.number(
            c,
            &[1, 7, 16, 128, 4096, 3, 8, 32, 64, 1 << 20],
            &[0, u64::MAX / 2],
        );
        if generate && c.chance(70) {
            add("--prompt", Some(s));
        } else if (w.0 || mode.is_none()) && c.chance(20) {
            context = true;
            add("--context", Some(s));
        } else {
            add("--seq", Some(s));
        }
    }
    if let Some(m) = mode
        && (w.0 || !context)
    {
        add("--mode", Some(m));
    }
    if generate && (!w.0 || c.chance(70)) {
        add(
            "--new-tokens",
            Some(w.number(c, &[8, 1, 2, 64, 1000], &[0])),
        );
    }
    if c.chance(40) {
        let d = match c.chance(30) {
            true => w.text(c, &["nf4", "int8", "int4", "fp8"], &["NF4", "int3"]),
            false => (*c.pick(&DTYPES)).to_string(),
        };
        add("--dtype", Some(d));
    }
    if c.chance(40) {
        add("--optim", Some(w.vocab::<Optimizer>(c)));
    }
    if c.chance(15) {
        add("--optim-impl", Some(w.vocab::<OptimizerImpl>(c)));
    }
    if c.chance(20) {
        add("--attention", Some(w.vocab::<AttentionImpl>(c)));
    }
    if c.chance(20) {
        add("--amp", Some(w.vocab::<Amp>(c)));
    }
    if c.chance(20) {
        add("--recipe", Some(w.vocab::<RecipeName>(c)));
    }
    if c.chance(15) {
        add("--device", Some(w.vocab::<Device>(c)));
    }
    if c.chance(20) {
        add("--checkpoint", None);
    }
    if c.chance(10) {
        let loss = w.text(
            c,
            &[
                "ce",
                "none",
                "chunked-ce",
                "chunked-ce:4",
                "CE",
                "chunked_ce:1",
            ],
            &["chunked-ce:0", "mse"],
        );
        add("--loss", Some(loss));
    }
    if c.chance(15) {
        add(
            "--lora-rank",
            Some(w.number(c, &[8, 1, 64], &[1_000_000, 0])),
        );
        if c.chance(50) {
            let t = w.text(
                c,
                &[
                    "q,v",
                    "q_proj,v_proj",
                    "gate,up,down",
                    "o",
                    "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                ],
                &["fc1", "q,foo", ""],
            );
            add("--lora-targets", Some(t));
        }
        if c.chance(25) {
            add("--lora-dtype", Some((*c.pick(&DTYPES)).to_string()));
        }
        if c.chance(25) {
            let p = w.text(c, &["0.05", "0", "0.5"], &["1", "-0.1", "nan"]);
            add("--lora-dropout", Some(p));
        }
    }
    if c.chance(8) {
        add("--qlora-stack", Some(w.value_enum::<QloraStack>(c)));
    }
    if c.chance(10) && (w.0 || infer || context) {
        add("--kv-dtype", Some((*c.pick(&DTYPES)).to_string()));
    }
    if c.chance(8) {
        add(
            "--group-size",
            Some(w.number(c, &[64, 1, 128], &[100_000, 0])),
        );
    }
    if c.chance(8) {
        add(
            "--double-quant",
            Some(w.text(c, &["false", "true"], &["yes"])),
        );
    }
    if c.chance(10) {
        add(
            "--grad-accum",
            Some(w.number(c, &[2, 4, 1, 8], &[0, 1 << 40])),
        );
    }
    if c.chance(6) {
        add("--optim-in-backward", None);
    }
    if c.chance(5) {
        add("--keep-grads", None);
    }
    if c.chance(4) {
        add("--target-seq", Some(w.number(c, &[8, 1, 64], &[0])));
    }
    if c.chance(6) {
        add("--paged", None);
    }
    if c.chance(6) {
        let precision = c.chance(50).then(|| w.value_enum::<EmaPrecision>(c));
        add("--ema", precision);
    }
    if c.chance(5) {
        add("--expandable-segments", None);
    }
    let gpu = c.chance(10);
    if gpu {
        add("--gpu", Some(gpu_name(c, w.0)));
    }
    let budget = c.chance(25);
    if budget {
        let b = w.text(
            c,
            &["24GiB", "1MB", "80G", "1", "1.5GiB", "10KiB", "2TB", "24gb"],
            &["0", "-1", "1.5.5G"],
        );
        add("--budget", Some(b));
    }
    if (budget || gpu || (w.0 && c.chance(3))) && sweep.is_none() && c.chance(25) {
        add(
            if c.chance(50) {
                "--max-batch"
            } else {
                "--max-context"
            },
            None,
        );
    }
    if c.chance(8) {
        add("--budget-on", Some(w.vocab::<BudgetOn>(c)));
    }
    if c.chance(5) {
        let size = w.text(
            c,
            &["500MiB", "0", "1GiB", "1"],
            &["18446744073709551615", "x"],
        );
        add("--cuda-context", Some(size));
    }
    if c.chance(8) {
        let size = w.text(
            c,
            &["64MiB", "0", "1GiB", "512"],
            &["18446744073709551615", "x"],
        );
        add("--cudnn-workspace", Some(size));
    }
    if c.chance(12) {
        // Several GPUs: a count, an engine and its options (a tame set keeps each option to
        // its engine).
        if w.0 && c.chance(15) {
            // An engine without --gpus.
        } else {
            add("--gpus", Some(w.number(c, &[2, 4, 8, 1, 3, 16], &[0])));
        }
        let engine = c.below(4);
        match engine {
            0 => add("--ddp", None),
            1 => add("--zero", Some(w.number(c, &[1, 2, 3, 0], &[4, 255]))),
            2 => add("--fsdp", Some(w.value_enum::<FsdpStrategy>(c))),
            _ => {}
        }
        let ddp = engine == 0 || engine == 3;
        if c.chance(20) && (w.0 || ddp) {
            let cap = w.text(c, &["25", "1", "0.5"], &["0", "-1", "1e300", "nan"]);
            add("--bucket-cap-mb", Some(cap));
        }
        if c.chance(15) && (w.0 || ddp) {
            add("--gradient-as-bucket-view", None);
        }
        if c.chance(15) && (w.0 || engine == 2) {
            add("--gpus-per-node", Some(w.number(c, &[8, 2, 1, 4], &[0])));
        }
        if c.chance(15) && (w.0 || engine == 1) {
            let size = w.number(c, &[500_000_000, 1, 1000, 50_000_000], &[0]);
            add("--reduce-bucket-size", Some(size));
        }
        if c.chance(15) && (w.0 || engine != 0) {
            add(
                "--offload",
                Some(w.value_enum::<memest::parallel::OffloadFlag>(c)),
            );
        }
        if c.chance(20) {
            // Tensor, sequence and context parallelism.
            add("--tp", Some(w.number(c, &[2, 1, 4], &[0, 3])));
            if c.chance(40) {
                add("--sp", None);
            }
            if c.chance(30) {
                add(
                    "--tp-style",
                    Some(w.value_enum::<memest::parallel::TpStyle>(c)),
                );
            }
        }
        if c.chance(10) {
            add("--cp", Some(w.number(c, &[2, 1], &[0, 3])));
        }
        if c.chance(10) {
            // A DeepSpeed or accelerate config from the fixtures (or one that is not there).
            let (flag, file) = match c.below(3) {
                0 => ("--deepspeed", "ds_zero2_offload.json"),
                1 => ("--deepspeed", "ds_zero3_hf.json"),
                _ => ("--accelerate", "accelerate_fsdp.yaml"),
            };
            let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/parallel/");
            let file = if w.0 && c.chance(20) {
                "missing.json"
            } else {
                file
            };
            add(flag, Some(format!("{dir}{file}")));
        }
        if c.chance(8) && (w.0 || sweep.is_none()) {
            add("--plan", Some(w.text(c, &["auto"], &["manual"])));
        } else if c.chance(8) && (w.0 || sweep.is_none()) {
            add("--min-gpus", None);
        }
    }
    if c.chance(if w.0 { 4 } else { 1 }) {
        add("--head", Some(w.value_enum::<Head>(c)));
    }
    if c.chance(3) {
        add(
            "--image",
            Some(w.text(c, &["512", "64", "768x512"], &["0", "500", "8x"])),
        );
    }
    if c.chance(if w.0 { 5 } else { 2 }) {
        add("--print-model", None);
    }
    if c.chance(6) {
        add("--allow-long-context", None);
    }
    if c.chance(8) && (w.0 || sweep.is_none()) {
        add("--explain", None);
    }
    if c.chance(8) && (w.0 || sweep.is_none()) {
        // Written where the binary would write it; the fuzzer checks the chart in memory.
        add("--timeline", Some("/dev/null".to_string()));
    }
    let sweeping = sweep.is_some();
    if let Some(s) = sweep {
        add("--sweep", Some(s));
    }
    if c.chance(15) {
        add("--format", Some(w.value_enum::<OutputFormat>(c)));
    }
    if c.chance(5) {
        add("--si", None);
    }
    if c.chance(5) && (w.0 || !sweeping) {
        add("--per-layer", None);
    }
    if w.0 && c.chance(3) {
        let flag: &&str = c.pick(&["--help", "--version", "-h", "--nonsense"]);
        add(flag, None);
    }
    out
}

/// Writes `v` as TOML when asked and possible, else as pretty JSON.
fn emit(c: &mut Choices, v: &Value, toml_ok: bool) -> String {
    if toml_ok
        && c.byte().is_multiple_of(2)
        && let Ok(text) = toml::to_string(v)
    {
        return text;
    }
    serde_json::to_string_pretty(v).unwrap_or_default()
}

/// Pieces the text edits insert.
const TOKENS: [&str; 16] = [
    "\"",
    "[",
    "]",
    "{",
    "}",
    "=",
    ",",
    "\n",
    "-1",
    "1e309",
    "\"seq\"",
    "NaN",
    "Infinity",
    "\u{feff}",
    "[[layers]]\nkind = \"relu\"\n",
    "99999999999999999999",
];

/// A few edits of the text itself (on character boundaries).
fn mutate_text(c: &mut Choices, text: &mut String) {
    for _ in 0..=c.below(3) {
        let bounds: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .collect();
        let at = *c.pick(&bounds);
        match c.below(3) {
            0 => {
                let token: &str = TOKENS[c.below(TOKENS.len())];
                text.insert_str(at, token);
            }
            1 => {
                let len = 1 + c.below(16);
                let end = bounds
                    .iter()
                    .copied()
                    .find(|&b| b >= at + len)
                    .unwrap_or(text.len());
                text.replace_range(at..end, "");
            }
            _ => {
                let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
                let line_end = text[at..].find('\n').map_or(text.len(), |i| at + i + 1);
                let line = text[line_start..line_end].to_string();
                text.insert_str(line_end, &line);
            }
        }
    }
}

/// Keys that give a Hugging Face config's depth.
const DEPTH_KEYS: [&str; 6] = [
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "num_decoder_layers",
    "n_layers",
    "num_encoder_layers",
];

/// Makes a seed shallow: two copies of each repeated block (a config's depth, a description's
/// `count`). Most cases run so: a 32-layer 7B model unrolled through the allocator model costs
/// seconds in a debug build, and the layers repeat what two copies already exercise.
fn shallow(v: &mut Value, hf: bool) {
    let Some(m) = v.as_object_mut() else { return };
    if hf {
        for key in DEPTH_KEYS {
            if let Some(n) = m.get_mut(key).filter(|n| n.as_u64().is_some_and(|n| n > 2)) {
                *n = json!(2);
            }
        }
        return;
    }
    if let Some(layers) = m.get_mut("layers").and_then(Value::as_array_mut) {
        for l in layers {
            if let Some(n) = l
                .get_mut("count")
                .filter(|n| n.as_u64().is_some_and(|n| n > 2))
            {
                *n = json!(2);
            }
        }
    }
}

/// The case that `bytes` decide, from `seeds`.
#[must_use]
pub fn case(bytes: &[u8], seeds: &Seeds) -> String {
    let mut c = Choices::new(bytes);
    let source = c.below(10);
    let (value, text, toml_ok) = match source {
        // From scratch.
        0..=2 => (Some(scratch(&mut c)), None, true),
        // A Hugging Face config.
        3..=4 if !seeds.configs.is_empty() => {
            let seed = c.pick(&seeds.configs).clone();
            (serde_json::from_str::<Value>(&seed).ok(), Some(seed), false)
        }
        // A memest description or a corpus case.
        _ if !seeds.models.is_empty() => {
            let seed = c.pick(&seeds.models).clone();
            let (words, model) = crate::case::split(&seed);
            let flags: Vec<String> = words.iter().map(|w| (*w).to_string()).collect();
            if !flags.is_empty() && c.chance(50) {
                return seed;
            }
            let _ = flags;
            let value = match memest::spec::Format::sniff(model) {
                memest::spec::Format::Json => serde_json::from_str::<Value>(model).ok(),
                memest::spec::Format::Toml => toml::from_str::<Value>(model).ok(),
            };
            (value, Some(model.to_string()), true)
        }
        _ => (Some(scratch(&mut c)), None, true),
    };
    let mut model = match value {
        Some(mut v) => {
            let hf = memest::hf::is_hf_config(&v);
            if !c.chance(15) {
                shallow(&mut v, hf);
            }
            for _ in 0..c.below(5) {
                if hf {
                    mutate_config(&mut c, &mut v);
                } else {
                    mutate_model(&mut c, &mut v);
                }
            }
            emit(&mut c, &v, toml_ok && !hf)
        }
        None => text.unwrap_or_default(),
    };
    if c.chance(12) {
        mutate_text(&mut c, &mut model);
    }
    let flags = flags(&mut c);
    crate::case::join(&flags, &model)
}
