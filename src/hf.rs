//! Hugging Face `config.json` import.
//!
//! A transformers configuration (detected by a top-level `model_type` or `architectures` key, see
//! [`is_hf_config`]) becomes the same [`ModelSpec`] a memest file describes ([`to_spec`]): the
//! layers of the transformers model, module by module and in the order its `forward` runs them,
//! with transformers 5's defaults for every key the file leaves out. Repeated decoder (or encoder)
//! layers become one `repeat` block of `num_hidden_layers` copies; layers that differ (Qwen-MoE's
//! dense layers, sliding-window layers) split it into consecutive blocks.
//!
//! The head follows `architectures` (`…ForCausalLM` → LM head and causal-LM loss,
//! `BertForMaskedLM` → MLM head, `…ForSequenceClassification` → classifier and cross-entropy,
//! `…Model` → the bare model); [`Head`] picks another.

/// The most layers a config may declare: far beyond any real model, and small enough that
/// building the description cannot exhaust memory.
const MAX_LAYERS: u64 = 100_000;
use serde_json::{Map, Value};

use crate::dtype::DType;
use crate::error::Error;
use crate::spec::{DefaultsSpec, DimSpec, InputSpec, LayerKind as K, LayerSpec, ModelSpec};

/// The `model_type`s memest can import.
pub const SUPPORTED: &[&str] = &[
    "bert",
    "gemma",
    "gpt2",
    "llama",
    "mistral",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "t5",
];

/// Which head sits on the imported model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Head {
    /// The head the config's `architectures` names (the family's usual one when it names none).
    #[default]
    Auto,
    /// The bare model (`LlamaModel`, `BertModel` with its pooler, …), no loss: the training
    /// step backpropagates `out.sum()`.
    None,
    /// The language-model head and its loss: causal LM for decoders, masked LM for BERT,
    /// conditional generation for T5.
    Lm,
    /// Sequence classification (`num_labels`, default 2) with a cross-entropy loss.
    Classification,
}

/// Whether a parsed JSON document is a Hugging Face configuration: an object with a `model_type`
/// or `architectures` key and neither of memest's own `layers` and `input`.
#[must_use]
pub fn is_hf_config(value: &Value) -> bool {
    value.as_object().is_some_and(|o| {
        (o.contains_key("model_type") || o.contains_key("architectures"))
            && !o.contains_key("layers")
            && !o.contains_key("input")
    })
}

/// Builds the memest description of a Hugging Face configuration.
///
/// # Errors
/// [`Error::Setting`] for an unsupported `model_type` (listing the supported ones), an
/// architecture whose head memest does not know, a missing required field (named), a field of
/// the wrong type, or an unsupported activation.
pub fn to_spec(config: &Value, head: Head) -> Result<ModelSpec, Error> {
    let Some(map) = config.as_object() else {
        return Err(Error::Setting(
            "a Hugging Face config must be a JSON object".into(),
        ));
    };
    let model_type = match map.get("model_type") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(Error::Setting(format!(
                "Hugging Face config: `model_type` must be a string, got {other}"
            )));
        }
        None => infer_model_type(map)?,
    };
    let cfg = Cfg {
        map,
        model_type: &model_type,
    };
    let family = Family::from_model_type(&model_type).ok_or_else(|| {
        Error::Setting(format!(
            "Hugging Face config: model_type `{model_type}` is not supported; supported: {}",
            SUPPORTED.join(", ")
        ))
    })?;
    let arch = cfg.architecture()?;
    let head = resolve_head(head, arch.as_deref(), family, &model_type)?;
    let (layers, seq) = match family {
        Family::Gpt2 => gpt2(&cfg, head)?,
        Family::Bert => bert(&cfg, head)?,
        Family::T5 => t5(&cfg, head)?,
        _ => decoder(&cfg, family, head)?,
    };
    let mut dtype = None;
    for key in ["torch_dtype", "dtype"] {
        match map.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "auto" => {}
            Some(v) => {
                let d = v.as_str().and_then(|s| s.parse::<DType>().ok()).filter(|d| d.is_float()).ok_or_else(|| {
                    Error::Setting(format!("Hugging Face config: `{key}` must name a floating-point dtype (e.g. \"bfloat16\"), got {v}"))
                })?;
                dtype = Some(d);
                break;
            }
        }
    }
    let head_name = match head {
        Resolved::Bare => "bare model, no loss",
        Resolved::Lm => match family {
            Family::Bert => "masked-LM head and loss",
            Family::T5 => "LM head and loss",
            _ => "causal-LM head and loss",
        },
        Resolved::Classification => "sequence-classification head and loss",
    };
    let description = format!(
        "{} (model_type {model_type}) from a Hugging Face config, as transformers 5 builds it: {head_name}",
        arch.as_deref().unwrap_or("no architectures")
    );
    Ok(ModelSpec {
        name: None,
        description: Some(description),
        input: InputSpec {
            shape: vec![DimSpec::Seq],
            dtype: Some(DType::Int64),
        },
        defaults: DefaultsSpec {
            seq: Some(seq.clamp(1, DEFAULT_MAX_SEQ)),
            dtype,
            // transformers 5 runs attention through `scaled_dot_product_attention` by default.
            attention: Some("flash".into()),
            ..Default::default()
        },
        layers,
    })
}

/// A model description as TOML, laid out like the hand-written examples: one `[[layers]]`
/// table per layer, the bodies of blocks (`[[layers.layers]]`) indented two spaces per level.
/// Reading the text back gives the same description.
///
/// # Errors
/// [`Error::Setting`] if the description cannot be written as TOML (it always can).
pub fn to_toml(spec: &ModelSpec) -> Result<String, Error> {
    let text = toml::to_string(spec)
        .map_err(|e| Error::Setting(format!("cannot write the model as TOML: {e}")))?;
    // Multi-line strings would change if indented; leave such text as it is.
    if text.contains("\"\"\"") || text.contains("'''") {
        return Ok(text);
    }
    let mut out = String::with_capacity(text.len() + text.len() / 4);
    let mut indent = String::new();
    for line in text.lines() {
        if line.starts_with('[') {
            let depth = line
                .trim_matches(|c| c == '[' || c == ']')
                .split('.')
                .filter(|s| *s == "layers")
                .count()
                .saturating_sub(1);
            indent = "  ".repeat(depth);
        }
        if !line.is_empty() {
            out.push_str(&indent);
        }
        out.push_str(line);
        out.push('\n');
    }
    Ok(out)
}

/// The default sequence length: the model's context, capped at this.
const DEFAULT_MAX_SEQ: u64 = 2048;

fn infer_model_type(map: &Map<String, Value>) -> Result<String, Error> {
    let arch = map
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .unwrap_or("");
    let lower = arch.to_ascii_lowercase();
    // Longest prefixes first (qwen2moe before qwen2).
    let known = [
        ("qwen2moe", "qwen2_moe"),
        ("qwen3", "qwen3"),
        ("qwen2", "qwen2"),
        ("llama", "llama"),
        ("mistral", "mistral"),
        ("mixtral", "mixtral"),
        ("gemma", "gemma"),
        ("phi3", "phi3"),
        ("gpt2", "gpt2"),
        ("bert", "bert"),
        ("t5", "t5"),
    ];
    for (prefix, ty) in known {
        if lower.starts_with(prefix)
            && !lower[prefix.len()..].starts_with(|c: char| c.is_ascii_digit())
        {
            return Ok(ty.to_string());
        }
    }
    Err(Error::Setting(format!(
        "Hugging Face config: no `model_type`, and architecture `{arch}` names no supported family; supported model types: {}",
        SUPPORTED.join(", ")
    )))
}

/// The families memest imports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Llama,
    Mistral,
    Mixtral,
    Qwen2,
    Qwen2Moe,
    Qwen3,
    Gemma,
    Phi3,
    Gpt2,
    Bert,
    T5,
}

impl Family {
    fn from_model_type(t: &str) -> Option<Family> {
        Some(match t {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "mixtral" => Family::Mixtral,
            "qwen2" => Family::Qwen2,
            "qwen2_moe" => Family::Qwen2Moe,
            "qwen3" => Family::Qwen3,
            "gemma" => Family::Gemma,
            "phi3" => Family::Phi3,
            "gpt2" => Family::Gpt2,
            "bert" => Family::Bert,
            "t5" => Family::T5,
            _ => return None,
        })
    }
}

/// The head after resolving [`Head::Auto`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resolved {
    Bare,
    Lm,
    Classification,
}

fn resolve_head(
    head: Head,
    arch: Option<&str>,
    family: Family,
    model_type: &str,
) -> Result<Resolved, Error> {
    match head {
        Head::None => return Ok(Resolved::Bare),
        Head::Lm => return Ok(Resolved::Lm),
        Head::Classification => return Ok(Resolved::Classification),
        Head::Auto => {}
    }
    let Some(arch) = arch else {
        // No `architectures`: the family's usual head.
        return Ok(match family {
            Family::Bert => Resolved::Bare,
            _ => Resolved::Lm,
        });
    };
    let lm_suffixes: &[&str] = match family {
        Family::Bert => &["ForMaskedLM"],
        Family::T5 => &["ForConditionalGeneration"],
        Family::Gpt2 => &["LMHeadModel", "ForCausalLM"],
        _ => &["ForCausalLM"],
    };
    if lm_suffixes.iter().any(|s| arch.ends_with(s)) {
        Ok(Resolved::Lm)
    } else if arch.ends_with("ForSequenceClassification") {
        Ok(Resolved::Classification)
    } else if arch.ends_with("Model") && !arch.contains("For") && !arch.contains("Head") {
        Ok(Resolved::Bare)
    } else {
        Err(Error::Setting(format!(
            "Hugging Face config: architecture `{arch}` is not supported for model_type `{model_type}` (known heads: {}, …ForSequenceClassification and the bare …Model); pick a head with --head none|lm|classification",
            lm_suffixes
                .iter()
                .map(|s| format!("…{s}"))
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }
}

/// Typed access to the config's fields, with errors that name the field.
struct Cfg<'a> {
    map: &'a Map<String, Value>,
    model_type: &'a str,
}

impl<'a> Cfg<'a> {
    fn err(&self, message: String) -> Error {
        Error::Setting(format!(
            "Hugging Face config (model_type {}): {message}",
            self.model_type
        ))
    }

    /// The value of the first of `keys` that is present and not null.
    fn get<'k>(&self, keys: &[&'k str]) -> Option<(&'k str, &'a Value)> {
        keys.iter()
            .find_map(|k| self.map.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)))
    }

    fn opt_u(&self, keys: &[&str]) -> Result<Option<u64>, Error> {
        match self.get(keys) {
            None => Ok(None),
            Some((k, v)) => match v.as_u64() {
                Some(n) => Ok(Some(n)),
                None => Err(self.err(format!("`{k}` must be a non-negative integer, got {v}"))),
            },
        }
    }

    /// A required size: present, an integer, positive.
    fn req(&self, keys: &[&str]) -> Result<u64, Error> {
        match self.opt_u(keys)? {
            Some(0) => Err(self.err(format!("`{}` must be positive, got 0", keys[0]))),
            Some(n) => Ok(n),
            None => Err(self.err(format!(
                "missing `{}` (required to build the model)",
                keys[0]
            ))),
        }
    }

    /// A layer count: required, positive, and at most [`MAX_LAYERS`] (checked before any layer
    /// is built).
    fn layers(&self, keys: &[&str]) -> Result<u64, Error> {
        let n = self.req(keys)?;
        if n > MAX_LAYERS {
            return Err(self.err(format!(
                "`{}` = {n} is more layers than memest traces (at most {MAX_LAYERS})",
                keys[0]
            )));
        }
        Ok(n)
    }

    fn u_or(&self, keys: &[&str], default: u64) -> Result<u64, Error> {
        Ok(self.opt_u(keys)?.unwrap_or(default))
    }

    fn f_or(&self, keys: &[&str], default: f64) -> Result<f64, Error> {
        match self.get(keys) {
            None => Ok(default),
            Some((k, v)) => v
                .as_f64()
                .ok_or_else(|| self.err(format!("`{k}` must be a number, got {v}"))),
        }
    }

    fn b_or(&self, key: &str, default: bool) -> Result<bool, Error> {
        match self.get(&[key]) {
            None => Ok(default),
            Some((k, v)) => v
                .as_bool()
                .ok_or_else(|| self.err(format!("`{k}` must be true or false, got {v}"))),
        }
    }

    fn s_or<'s>(&'s self, keys: &[&str], default: &'s str) -> Result<&'s str, Error> {
        match self.get(keys) {
            None => Ok(default),
            Some((k, v)) => v
                .as_str()
                .ok_or_else(|| self.err(format!("`{k}` must be a string, got {v}"))),
        }
    }

    /// The first entry of `architectures`, if any.
    fn architecture(&self) -> Result<Option<String>, Error> {
        match self.get(&["architectures"]) {
            None => Ok(None),
            Some((_, Value::Array(list))) if list.is_empty() => Ok(None),
            Some((_, Value::Array(list))) => match list[0].as_str() {
                Some(s) => Ok(Some(s.to_string())),
                None => Err(self.err(format!(
                    "`architectures` must list class names, got {}",
                    list[0]
                ))),
            },
            Some((_, v)) => Err(self.err(format!(
                "`architectures` must be a list of class names, got {v}"
            ))),
        }
    }

    /// `num_labels`, else the length of `id2label`, else transformers' default 2.
    fn num_labels(&self) -> Result<u64, Error> {
        if let Some(n) = self.opt_u(&["num_labels"])? {
            return if n == 0 {
                Err(self.err("`num_labels` must be positive, got 0".into()))
            } else {
                Ok(n)
            };
        }
        match self.get(&["id2label"]) {
            Some((_, Value::Object(m))) if !m.is_empty() => Ok(m.len() as u64),
            _ => Ok(2),
        }
    }

    /// A probability (dropout rate) key.
    fn p_or(&self, keys: &[&str], default: f64) -> Result<f64, Error> {
        let p = self.f_or(keys, default)?;
        if (0.0..1.0).contains(&p) {
            Ok(p)
        } else {
            Err(self.err(format!("`{}` must be in [0, 1), got {p}", keys[0])))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Layer constructors

fn layer(kind: K, name: &str) -> LayerSpec {
    LayerSpec {
        kind,
        name: Some(name.to_string()),
        ..Default::default()
    }
}

fn with_inputs(mut l: LayerSpec, inputs: &[&str]) -> LayerSpec {
    l.inputs = Some(inputs.iter().map(|s| (*s).to_string()).collect());
    l
}

fn with_note(mut l: LayerSpec, note: &str) -> LayerSpec {
    l.note = Some(note.to_string());
    l
}

fn linear(name: &str, out: u64, bias: bool) -> LayerSpec {
    LayerSpec {
        out_features: Some(out),
        bias: (!bias).then_some(false),
        ..layer(K::Linear, name)
    }
}

fn embedding(name: &str, num: u64, dim: u64) -> LayerSpec {
    LayerSpec {
        num_embeddings: Some(num),
        embedding_dim: Some(dim),
        ..layer(K::Embedding, name)
    }
}

fn dropout(name: &str, p: f64) -> LayerSpec {
    LayerSpec {
        p: Some(p),
        ..layer(K::Dropout, name)
    }
}

fn add(name: &str, a: &str, b: &str) -> LayerSpec {
    with_inputs(layer(K::Add, name), &[a, b])
}

fn layernorm(name: &str) -> LayerSpec {
    layer(K::LayerNorm, name)
}

/// T5's `T5LayerNorm` (see `graph::Op::RmsNorm`).
fn t5_norm(name: &str) -> LayerSpec {
    LayerSpec {
        style: Some("t5".into()),
        ..rmsnorm(name)
    }
}

fn rmsnorm(name: &str) -> LayerSpec {
    layer(K::RmsNorm, name)
}

/// The family's RMSNorm: Gemma's `GemmaRMSNorm` (`x·(1 + w)` in float32) or Llama's.
fn family_norm(family: Family, name: &str) -> LayerSpec {
    if family == Family::Gemma {
        LayerSpec {
            style: Some("gemma".into()),
            ..rmsnorm(name)
        }
    } else {
        rmsnorm(name)
    }
}

fn cross_entropy(shift: bool, upcast: bool) -> LayerSpec {
    LayerSpec {
        shift: shift.then_some(true),
        upcast: upcast.then_some(true),
        ..layer(K::CrossEntropy, "loss")
    }
}

fn repeat(name: &str, count: u64, body: Vec<LayerSpec>) -> LayerSpec {
    LayerSpec {
        count: Some(count),
        layers: Some(body),
        ..layer(K::Repeat, name)
    }
}

/// Appends `layer` to `out` and returns its name (the next layer's input by default).
fn push(out: &mut Vec<LayerSpec>, l: LayerSpec) -> String {
    let name = l.name.clone().expect("every imported layer is named");
    out.push(l);
    name
}

/// Appends a dropout when it drops anything (`nn.Dropout(0)` is the identity); returns the name
/// of the last layer.
fn push_dropout(out: &mut Vec<LayerSpec>, name: &str, p: f64, prev: String) -> String {
    if p > 0.0 {
        push(out, dropout(name, p))
    } else {
        prev
    }
}

/// transformers' `ACT2FN[name]` as a memest layer.
fn activation(cfg: &Cfg, key: &str, act: &str, name: &str) -> Result<LayerSpec, Error> {
    Ok(match act {
        "silu" | "swish" => layer(K::Silu, name),
        "gelu" => layer(K::Gelu, name),
        "gelu_pytorch_tanh" => LayerSpec {
            approximate: Some("tanh".into()),
            ..layer(K::Gelu, name)
        },
        "gelu_new" => layer(K::GeluNew, name),
        "relu" => layer(K::Relu, name),
        "relu6" => layer(K::Relu6, name),
        "tanh" => layer(K::Tanh, name),
        "sigmoid" => layer(K::Sigmoid, name),
        other => {
            return Err(cfg.err(format!(
                "activation `{other}` in `{key}` is not supported (supported: silu, swish, gelu, gelu_pytorch_tanh, gelu_new, relu, relu6, tanh, sigmoid)"
            )));
        }
    })
}

/// The decoder's head: LM head and causal-LM loss, a last-token classifier, or nothing.
fn causal_head(
    out: &mut Vec<LayerSpec>,
    cfg: &Cfg,
    head: Resolved,
    vocab: u64,
    tie: Option<&str>,
) -> Result<(), Error> {
    match head {
        Resolved::Bare => {}
        Resolved::Lm => {
            let mut lm = linear("lm_head", vocab, false);
            lm.tie = tie.map(str::to_string);
            out.push(lm);
            out.push(cross_entropy(true, true));
        }
        Resolved::Classification => {
            // transformers' GenericForSequenceClassification: `score` on every position, then
            // the logits of the last token.
            out.push(linear("score", cfg.num_labels()?, false));
            out.push(LayerSpec {
                dim: Some(1),
                index: Some(-1),
                ..layer(K::Select, "pooled_logits")
            });
            out.push(cross_entropy(false, false));
        }
    }
    Ok(())
}

/// Consecutive equal items as `(first index, count, item)` runs.
fn runs<T: PartialEq + Clone>(items: &[T]) -> Vec<(usize, u64, T)> {
    let mut out: Vec<(usize, u64, T)> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        match out.last_mut() {
            Some((_, n, last)) if last == it => *n += 1,
            _ => out.push((i, 1, it.clone())),
        }
    }
    out
}

/// The name of a run of repeated layers: the module list's name for a single run, with the
/// index range when the layers split into several runs.
fn run_name(base: &str, all: usize, first: usize, count: u64) -> String {
    if all == 1 {
        base.to_string()
    } else if count == 1 {
        format!("{base}.{first}")
    } else {
        format!("{base}.{first}-{}", first as u64 + count - 1)
    }
}

// ---------------------------------------------------------------------------------------------
// Llama-style decoders: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, gemma, phi3

/// The MLP of one decoder layer.
#[derive(Clone, Debug, PartialEq)]
enum Mlp {
    /// Gated MLP (`gate_proj`, act, `up_proj`, mul, `down_proj`).
    Dense(u64),
    /// Sparse mixture of experts.
    Moe {
        experts: u64,
        top_k: u64,
        intermediate: u64,
        shared: u64,
        shared_gate: bool,
        normalize: bool,
    },
}

/// What may differ from one decoder layer to the next.
#[derive(Clone, Debug, PartialEq)]
struct LayerVariant {
    mlp: Mlp,
    sliding_window: Option<u64>,
}

#[allow(clippy::too_many_lines)] // one place that reads every family's keys
fn decoder(cfg: &Cfg, family: Family, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    use Family as F;
    let vocab = cfg.req(&["vocab_size"])?;
    let hidden = cfg.req(&["hidden_size"])?;
    let n_layers = cfg.layers(&["num_hidden_layers"])?;
    let heads = cfg.req(&["num_attention_heads"])?;
    // transformers' config-class defaults where the file leaves the key out (or null).
    let kv_default = match family {
        F::Mistral | F::Mixtral => 8,
        F::Qwen2 | F::Qwen3 => 32,
        F::Gemma | F::Qwen2Moe => 16,
        _ => heads,
    };
    let kv_heads = cfg.u_or(&["num_key_value_heads"], kv_default)?;
    let head_dim_default = match family {
        F::Qwen3 => 128,
        F::Gemma => 256,
        _ => hidden / heads,
    };
    let head_dim = cfg.u_or(&["head_dim"], head_dim_default)?;
    let max_pos_default = match family {
        F::Mistral | F::Mixtral => 4096 * 32,
        F::Qwen2 | F::Qwen3 | F::Qwen2Moe => 32768,
        F::Gemma => 8192,
        F::Phi3 => 4096,
        _ => 2048,
    };
    let max_pos = cfg.u_or(&["max_position_embeddings"], max_pos_default)?;
    let tie = cfg.b_or("tie_word_embeddings", family == F::Gemma)?;
    let (qkv_bias, out_bias) = match family {
        F::Qwen2 => (true, false),
        F::Qwen2Moe => {
            let b = cfg.b_or("qkv_bias", true)?;
            (b, false)
        }
        F::Llama | F::Qwen3 | F::Gemma => {
            let b = cfg.b_or("attention_bias", false)?;
            (b, b)
        }
        _ => (false, false),
    };
    let mlp_bias = if family == F::Llama {
        cfg.b_or("mlp_bias", false)?
    } else {
        false
    };
    let act_name = cfg.s_or(
        &["hidden_act"],
        if family == F::Gemma {
            "gelu_pytorch_tanh"
        } else {
            "silu"
        },
    )?;
    // GemmaConfig turns the legacy "gelu" of the official releases into the tanh approximation.
    let act_name = if family == F::Gemma && act_name == "gelu" {
        "gelu_pytorch_tanh"
    } else {
        act_name
    };
    let attn_dropout = cfg.p_or(&["attention_dropout"], 0.0)?;
    let resid_dropout = if family == F::Phi3 {
        cfg.p_or(&["resid_pdrop"], 0.0)?
    } else {
        0.0
    };

    // Sliding windows, per layer.
    let window = cfg.opt_u(&["sliding_window"])?.filter(|&w| w > 0);
    let layer_types: Option<Vec<String>> = match cfg.get(&["layer_types"]) {
        Some((_, Value::Array(list))) => Some(
            list.iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| cfg.err(format!("`layer_types` must list strings, got {v}")))
                })
                .collect::<Result<_, _>>()?,
        ),
        Some((_, v)) => return Err(cfg.err(format!("`layer_types` must be a list, got {v}"))),
        None => None,
    };
    let max_window_layers = cfg.u_or(&["max_window_layers"], 28)?;
    let use_sliding = cfg.b_or("use_sliding_window", false)?;
    let sliding_at = |i: u64| -> Option<u64> {
        match family {
            F::Mistral | F::Mixtral | F::Phi3 => window,
            F::Qwen2 | F::Qwen3 | F::Qwen2Moe => {
                let w = window.filter(|_| use_sliding)?;
                let sliding = match &layer_types {
                    Some(types) => types
                        .get(i as usize)
                        .is_some_and(|t| t == "sliding_attention"),
                    None if family == F::Qwen2Moe => (i + 1) % 2 == 1 && i < max_window_layers,
                    None => i >= max_window_layers,
                };
                sliding.then_some(w)
            }
            _ => None,
        }
    };

    // The MLP, per layer.
    let moe = match family {
        F::Mixtral => Some(Mlp::Moe {
            experts: cfg.req(&["num_local_experts"])?,
            top_k: cfg.req(&["num_experts_per_tok"])?,
            intermediate: cfg.req(&["intermediate_size"])?,
            shared: 0,
            shared_gate: false,
            normalize: true,
        }),
        F::Qwen2Moe => {
            let experts = cfg.u_or(&["num_experts"], 60)?;
            (experts > 0)
                .then(|| -> Result<Mlp, Error> {
                    Ok(Mlp::Moe {
                        experts,
                        top_k: cfg.req(&["num_experts_per_tok"])?,
                        intermediate: cfg.req(&["moe_intermediate_size"])?,
                        shared: cfg.req(&["shared_expert_intermediate_size"])?,
                        shared_gate: true,
                        normalize: cfg.b_or("norm_topk_prob", false)?,
                    })
                })
                .transpose()?
        }
        _ => None,
    };
    let dense = || -> Result<Mlp, Error> { Ok(Mlp::Dense(cfg.req(&["intermediate_size"])?)) };
    let sparse_step = if family == F::Qwen2Moe {
        cfg.u_or(&["decoder_sparse_step"], 1)?
    } else {
        1
    };
    let mlp_only: Vec<u64> = match cfg.get(&["mlp_only_layers"]) {
        None => Vec::new(),
        Some((_, Value::Array(list))) => list
            .iter()
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    cfg.err(format!(
                        "`mlp_only_layers` must list layer indices, got {v}"
                    ))
                })
            })
            .collect::<Result<_, _>>()?,
        Some((_, v)) => return Err(cfg.err(format!("`mlp_only_layers` must be a list, got {v}"))),
    };
    let mut variants = Vec::new();
    for i in 0..n_layers {
        let mlp = match &moe {
            Some(m)
                if family == F::Mixtral
                    || (!mlp_only.contains(&i)
                        && sparse_step > 0
                        && (i + 1) % sparse_step == 0) =>
            {
                m.clone()
            }
            _ => dense()?,
        };
        variants.push(LayerVariant {
            mlp,
            sliding_window: sliding_at(i),
        });
    }

    // Rotary embedding (partial rotary: only part of each head rotates).
    let partial = match cfg.get(&["rope_parameters"]) {
        Some((_, Value::Object(m))) => m.get("partial_rotary_factor").and_then(Value::as_f64),
        _ => None,
    }
    .or(cfg
        .get(&["partial_rotary_factor"])
        .and_then(|(_, v)| v.as_f64()))
    .unwrap_or(1.0);
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rotary_dim = ((head_dim as f64 * partial) as u64).max(2);

    let bare = head == Resolved::Bare;
    let p = |s: &str| {
        if bare {
            s.to_string()
        } else {
            format!("model.{s}")
        }
    };
    let mut out = Vec::new();
    let embed = p("embed_tokens");
    push(&mut out, embedding(&embed, vocab, hidden));
    if family == F::Gemma {
        #[allow(clippy::cast_precision_loss)]
        let factor = (hidden as f64).sqrt();
        push(
            &mut out,
            with_note(
                LayerSpec {
                    factor: Some(factor),
                    ..layer(K::Scale, &p("embed_tokens.embed_scale"))
                },
                "Gemma's scaled word embedding: times sqrt(hidden_size)",
            ),
        );
    }
    push(
        &mut out,
        LayerSpec {
            head_dim: Some(rotary_dim),
            // Phi-3's apply_rotary_pos_emb joins the rotated and pass-through parts with torch.cat.
            concat: (family == F::Phi3).then_some(true),
            ..layer(K::Rotary, &p("rotary_emb"))
        },
    );
    let all_runs = runs(&variants);
    for (first, count, v) in &all_runs {
        let body = decoder_layer(
            cfg,
            family,
            act_name,
            DecoderAttn {
                hidden,
                heads,
                kv_heads,
                head_dim,
                qkv_bias,
                out_bias,
                dropout: attn_dropout,
                sliding_window: v.sliding_window,
            },
            &v.mlp,
            mlp_bias,
            resid_dropout,
        )?;
        push(
            &mut out,
            repeat(
                &run_name(&p("layers"), all_runs.len(), *first, *count),
                *count,
                body,
            ),
        );
    }
    push(&mut out, family_norm(family, &p("norm")));
    causal_head(&mut out, cfg, head, vocab, tie.then_some(embed.as_str()))?;
    Ok((out, max_pos))
}

/// The attention of a llama-style decoder layer.
struct DecoderAttn {
    hidden: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    qkv_bias: bool,
    out_bias: bool,
    dropout: f64,
    sliding_window: Option<u64>,
}

fn decoder_layer(
    cfg: &Cfg,
    family: Family,
    act_name: &str,
    a: DecoderAttn,
    mlp: &Mlp,
    mlp_bias: bool,
    resid_dropout: f64,
) -> Result<Vec<LayerSpec>, Error> {
    let mut body = Vec::new();
    push(&mut body, family_norm(family, "input_layernorm"));
    let mut attn = LayerSpec {
        heads: Some(a.heads),
        kv_heads: (a.kv_heads != a.heads).then_some(a.kv_heads),
        head_dim: (a.heads * a.head_dim != a.hidden).then_some(a.head_dim),
        causal: Some(true),
        bias: (!a.qkv_bias).then_some(false),
        out_bias: (a.out_bias != a.qkv_bias).then_some(a.out_bias),
        rotary: Some(true),
        dropout: (a.dropout > 0.0).then_some(a.dropout),
        qk_norm: (family == Family::Qwen3).then_some(true),
        sliding_window: a.sliding_window,
        // Their eager_attention_forward: softmax(.., dtype=torch.float32).to(query.dtype).
        softmax_f32: Some(true),
        ..layer(K::Attention, "self_attn")
    };
    if family == Family::Phi3 {
        attn.fused_qkv = Some(true);
        attn.note = Some("Phi-3's fused qkv_proj".into());
    }
    let prev = push(&mut body, attn);
    let prev = push_dropout(&mut body, "resid_attn_dropout", resid_dropout, prev);
    let residual1 = push(&mut body, add("residual1", "input", &prev));
    let norm2 = push(&mut body, family_norm(family, "post_attention_layernorm"));
    let prev = match mlp {
        Mlp::Dense(intermediate) if family == Family::Phi3 => {
            // Phi3MLP: one fused gate_up_proj, `chunk(2, dim=-1)` into two views of its output,
            // `up * act(gate)`.
            push(
                &mut body,
                linear("mlp.gate_up_proj", 2 * intermediate, mlp_bias),
            );
            let chunks = push(
                &mut body,
                with_note(
                    LayerSpec {
                        shape: Some(vec![
                            -1,
                            2,
                            i64::try_from(*intermediate).map_err(|_| {
                                cfg.err(format!("`intermediate_size` {intermediate} is too large"))
                            })?,
                        ]),
                        ..layer(K::Reshape, "mlp.gate_up_proj.chunk")
                    },
                    "chunk(2, dim=-1) as views: [.., 0, :] is the gate, [.., 1, :] the up states",
                ),
            );
            push(
                &mut body,
                LayerSpec {
                    dim: Some(2),
                    index: Some(0),
                    ..layer(K::Select, "mlp.gate")
                },
            );
            let act = push(
                &mut body,
                activation(cfg, "hidden_act", act_name, "mlp.activation_fn")?,
            );
            let up = push(
                &mut body,
                with_inputs(
                    LayerSpec {
                        dim: Some(2),
                        index: Some(1),
                        ..layer(K::Select, "mlp.up")
                    },
                    &[&chunks],
                ),
            );
            push(
                &mut body,
                with_inputs(layer(K::Mul, "mlp.up_mul_act"), &[&up, &act]),
            );
            push(&mut body, linear("mlp.down_proj", a.hidden, mlp_bias))
        }
        Mlp::Dense(intermediate) => {
            push(&mut body, linear("mlp.gate_proj", *intermediate, mlp_bias));
            let act = push(
                &mut body,
                activation(cfg, "hidden_act", act_name, "mlp.act_fn")?,
            );
            let up = push(
                &mut body,
                with_inputs(linear("mlp.up_proj", *intermediate, mlp_bias), &[&norm2]),
            );
            push(
                &mut body,
                with_inputs(layer(K::Mul, "mlp.gate_mul_up"), &[&act, &up]),
            );
            push(&mut body, linear("mlp.down_proj", a.hidden, mlp_bias))
        }
        Mlp::Moe {
            experts,
            top_k,
            intermediate,
            shared,
            shared_gate,
            normalize,
        } => {
            if act_name != "silu" && act_name != "swish" {
                return Err(cfg.err(format!(
                    "activation `{act_name}` in `hidden_act` is not supported for mixture-of-experts layers (their experts are SiLU-gated)"
                )));
            }
            push(
                &mut body,
                LayerSpec {
                    experts: Some(*experts),
                    top_k: Some(*top_k),
                    intermediate_size: Some(*intermediate),
                    shared_intermediate_size: (*shared > 0).then_some(*shared),
                    shared_gate: shared_gate.then_some(true),
                    normalize_topk: Some(*normalize),
                    ..layer(K::Moe, "mlp")
                },
            )
        }
    };
    let prev = push_dropout(&mut body, "resid_mlp_dropout", resid_dropout, prev);
    push(&mut body, add("residual2", &residual1, &prev));
    Ok(body)
}

// ---------------------------------------------------------------------------------------------
// GPT-2

fn gpt2(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let vocab = cfg.req(&["vocab_size"])?;
    let hidden = cfg.req(&["n_embd", "hidden_size"])?;
    let n_layers = cfg.layers(&["n_layer", "num_hidden_layers"])?;
    let heads = cfg.req(&["n_head", "num_attention_heads"])?;
    let positions = cfg.u_or(&["n_positions", "max_position_embeddings"], 1024)?;
    let inner = cfg.u_or(&["n_inner"], 4 * hidden)?;
    let act_name = cfg.s_or(&["activation_function"], "gelu_new")?;
    let embd_p = cfg.p_or(&["embd_pdrop"], 0.1)?;
    let attn_p = cfg.p_or(&["attn_pdrop"], 0.1)?;
    let resid_p = cfg.p_or(&["resid_pdrop"], 0.1)?;
    let tie = cfg.b_or("tie_word_embeddings", true)?;
    if cfg.b_or("add_cross_attention", false)? {
        return Err(cfg.err("`add_cross_attention = true` (GPT-2 as a decoder with cross-attention) is not supported".into()));
    }

    let bare = head == Resolved::Bare;
    let p = |s: &str| {
        if bare {
            s.to_string()
        } else {
            format!("transformer.{s}")
        }
    };
    let mut out = Vec::new();
    let wte = push(&mut out, embedding(&p("wte"), vocab, hidden));
    push(
        &mut out,
        LayerSpec {
            num_positions: Some(positions),
            ..layer(K::PositionEmbedding, &p("wpe"))
        },
    );
    let prev = p("wpe");
    push_dropout(&mut out, &p("drop"), embd_p, prev);

    let mut body = Vec::new();
    push(&mut body, layernorm("ln_1"));
    let attn = push(
        &mut body,
        LayerSpec {
            heads: Some(heads),
            fused_qkv: Some(true),
            causal: Some(true),
            dropout: (attn_p > 0.0).then_some(attn_p),
            note: Some("c_attn (fused QKV) and c_proj".into()),
            ..layer(K::Attention, "attn")
        },
    );
    let prev = push_dropout(&mut body, "attn.resid_dropout", resid_p, attn);
    let residual1 = push(&mut body, add("residual1", "input", &prev));
    push(&mut body, layernorm("ln_2"));
    push(&mut body, linear("mlp.c_fc", inner, true));
    push(
        &mut body,
        activation(cfg, "activation_function", act_name, "mlp.act")?,
    );
    let prev = push(&mut body, linear("mlp.c_proj", hidden, true));
    let prev = push_dropout(&mut body, "mlp.dropout", resid_p, prev);
    push(&mut body, add("residual2", &residual1, &prev));
    push(&mut out, repeat(&p("h"), n_layers, body));
    push(&mut out, layernorm(&p("ln_f")));
    causal_head(&mut out, cfg, head, vocab, tie.then_some(wte.as_str()))?;
    Ok((out, positions))
}

// ---------------------------------------------------------------------------------------------
// BERT

fn bert(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let vocab = cfg.req(&["vocab_size"])?;
    let hidden = cfg.req(&["hidden_size"])?;
    let n_layers = cfg.layers(&["num_hidden_layers"])?;
    let heads = cfg.req(&["num_attention_heads"])?;
    let intermediate = cfg.req(&["intermediate_size"])?;
    let positions = cfg.u_or(&["max_position_embeddings"], 512)?;
    let types = cfg.u_or(&["type_vocab_size"], 2)?;
    let act_name = cfg.s_or(&["hidden_act"], "gelu")?;
    let hidden_p = cfg.p_or(&["hidden_dropout_prob"], 0.1)?;
    let attn_p = cfg.p_or(&["attention_probs_dropout_prob"], 0.1)?;
    let tie = cfg.b_or("tie_word_embeddings", true)?;
    let position_type = cfg.s_or(&["position_embedding_type"], "absolute")?;
    if position_type != "absolute" {
        return Err(cfg.err(format!(
            "`position_embedding_type = \"{position_type}\"` is not supported (only \"absolute\")"
        )));
    }
    if cfg.b_or("is_decoder", false)? || cfg.b_or("add_cross_attention", false)? {
        return Err(cfg.err(
            "BERT as a decoder (`is_decoder` or `add_cross_attention`) is not supported".into(),
        ));
    }

    let bare = head == Resolved::Bare;
    let p = |s: &str| {
        if bare {
            s.to_string()
        } else {
            format!("bert.{s}")
        }
    };
    let mut out = Vec::new();
    let word = push(
        &mut out,
        embedding(&p("embeddings.word_embeddings"), vocab, hidden),
    );
    push(
        &mut out,
        LayerSpec {
            num_embeddings: Some(types),
            ids_buffer: Some(positions),
            ..layer(
                K::TokenTypeEmbedding,
                &p("embeddings.token_type_embeddings"),
            )
        },
    );
    push(
        &mut out,
        LayerSpec {
            num_positions: Some(positions),
            ids_buffer: Some(positions),
            ..layer(K::PositionEmbedding, &p("embeddings.position_embeddings"))
        },
    );
    let prev = push(&mut out, layernorm(&p("embeddings.LayerNorm")));
    push_dropout(&mut out, &p("embeddings.dropout"), hidden_p, prev);

    let mut body = Vec::new();
    let attn = push(
        &mut body,
        LayerSpec {
            heads: Some(heads),
            dropout: (attn_p > 0.0).then_some(attn_p),
            note: Some("query, key, value and attention.output.dense".into()),
            ..layer(K::Attention, "attention.self")
        },
    );
    let prev = push_dropout(&mut body, "attention.output.dropout", hidden_p, attn);
    push(&mut body, add("attention.residual", "input", &prev));
    let attn_ln = push(&mut body, layernorm("attention.output.LayerNorm"));
    push(&mut body, linear("intermediate.dense", intermediate, true));
    push(
        &mut body,
        activation(
            cfg,
            "hidden_act",
            act_name,
            "intermediate.intermediate_act_fn",
        )?,
    );
    let prev = push(&mut body, linear("output.dense", hidden, true));
    let prev = push_dropout(&mut body, "output.dropout", hidden_p, prev);
    push(&mut body, add("output.residual", &attn_ln, &prev));
    push(&mut body, layernorm("output.LayerNorm"));
    push(&mut out, repeat(&p("encoder.layer"), n_layers, body));

    let pooler = |out: &mut Vec<LayerSpec>| {
        push(
            out,
            LayerSpec {
                dim: Some(1),
                index: Some(0),
                ..layer(K::Select, &p("pooler.first_token"))
            },
        );
        push(out, linear(&p("pooler.dense"), hidden, true));
        push(out, layer(K::Tanh, &p("pooler.activation")))
    };
    match head {
        Resolved::Bare => {
            pooler(&mut out);
        }
        Resolved::Classification => {
            let prev = pooler(&mut out);
            let classifier_p = cfg.p_or(&["classifier_dropout", "hidden_dropout_prob"], 0.1)?;
            push_dropout(&mut out, "dropout", classifier_p, prev);
            push(&mut out, linear("classifier", cfg.num_labels()?, true));
            push(&mut out, cross_entropy(false, false));
        }
        Resolved::Lm => {
            push(
                &mut out,
                linear("cls.predictions.transform.dense", hidden, true),
            );
            push(
                &mut out,
                activation(
                    cfg,
                    "hidden_act",
                    act_name,
                    "cls.predictions.transform.transform_act_fn",
                )?,
            );
            push(&mut out, layernorm("cls.predictions.transform.LayerNorm"));
            let mut decoder = linear("cls.predictions.decoder", vocab, true);
            if tie {
                decoder.tie = Some(word);
                decoder.note =
                    Some("weight tied to the word embeddings; its own [vocab] bias".into());
            }
            push(&mut out, decoder);
            push(&mut out, cross_entropy(false, false));
        }
    }
    Ok((out, positions))
}

// ---------------------------------------------------------------------------------------------
// T5

#[allow(clippy::too_many_lines)] // encoder, decoder and heads, in forward order
fn t5(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let vocab = cfg.req(&["vocab_size"])?;
    let d_model = cfg.req(&["d_model", "hidden_size"])?;
    let d_ff = cfg.req(&["d_ff"])?;
    let enc_layers = cfg.layers(&["num_layers", "num_hidden_layers"])?;
    let dec_layers = match cfg.opt_u(&["num_decoder_layers"])? {
        None => enc_layers,
        Some(_) => cfg.layers(&["num_decoder_layers"])?,
    };
    let heads = cfg.req(&["num_heads", "num_attention_heads"])?;
    let d_kv = cfg.u_or(&["d_kv"], 64)?;
    let buckets = cfg.u_or(&["relative_attention_num_buckets"], 32)?;
    let p_drop = cfg.p_or(&["dropout_rate"], 0.1)?;
    let ff_proj = cfg.s_or(&["feed_forward_proj"], "relu")?;
    let parts: Vec<&str> = ff_proj.split('-').collect();
    let (gated, act_name) = match parts.as_slice() {
        [act] => (false, *act),
        ["gated", act] => (true, *act),
        _ => {
            return Err(cfg.err(format!(
                "`feed_forward_proj = \"{ff_proj}\"` is not valid (expected e.g. \"relu\" or \"gated-gelu\")"
            )));
        }
    };
    // T5Config: "gated-gelu" means the tanh approximation written out (gelu_new).
    let act_name = if ff_proj == "gated-gelu" {
        "gelu_new"
    } else {
        act_name
    };
    // T5Config always ties the LM head; a config that says `tie_word_embeddings = false`
    // (T5 v1.1) only turns off the decoder-output scaling.
    let scale_outputs = cfg.b_or("tie_word_embeddings", true)?;
    let seq = cfg.u_or(&["n_positions"], 512)?;
    let head_dim = (heads * d_kv != d_model).then_some(d_kv);

    let ff = |body: &mut Vec<LayerSpec>, idx: usize, residual: &str| -> Result<String, Error> {
        let n = |s: &str| format!("layer.{idx}.{s}");
        let norm = push(body, t5_norm(&n("layer_norm")));
        if gated {
            push(body, linear(&n("DenseReluDense.wi_0"), d_ff, false));
            let act = push(
                body,
                activation(cfg, "feed_forward_proj", act_name, &n("DenseReluDense.act"))?,
            );
            let lin = push(
                body,
                with_inputs(linear(&n("DenseReluDense.wi_1"), d_ff, false), &[&norm]),
            );
            let prev = push(
                body,
                with_inputs(
                    layer(K::Mul, &n("DenseReluDense.gelu_mul_linear")),
                    &[&act, &lin],
                ),
            );
            push_dropout(body, &n("DenseReluDense.dropout"), p_drop, prev);
        } else {
            push(body, linear(&n("DenseReluDense.wi"), d_ff, false));
            let prev = push(
                body,
                activation(cfg, "feed_forward_proj", act_name, &n("DenseReluDense.act"))?,
            );
            push_dropout(body, &n("DenseReluDense.dropout"), p_drop, prev);
        }
        push(body, linear(&n("DenseReluDense.wo"), d_model, false));
        let prev = n("DenseReluDense.wo");
        let prev = push_dropout(body, &n("dropout"), p_drop, prev);
        Ok(push(body, add(&n("residual"), residual, &prev)))
    };
    let self_attn = |body: &mut Vec<LayerSpec>, causal: bool| -> String {
        push(body, t5_norm("layer.0.layer_norm"));
        let prev = push(
            body,
            LayerSpec {
                heads: Some(heads),
                head_dim,
                causal: causal.then_some(true),
                bias: Some(false),
                position_bias: Some(true),
                dropout: (p_drop > 0.0).then_some(p_drop),
                ..layer(K::Attention, "layer.0.SelfAttention")
            },
        );
        let prev = push_dropout(body, "layer.0.dropout", p_drop, prev);
        push(body, add("layer.0.residual", "input", &prev))
    };
    let rpb = |name: &str| LayerSpec {
        num_buckets: Some(buckets),
        heads: Some(heads),
        note: Some("block 0's relative_attention_bias, shared by every block".into()),
        ..layer(K::RelativePositionBias, name)
    };

    let mut out = Vec::new();
    let shared = push(&mut out, embedding("shared", vocab, d_model));
    // Encoder.
    let prev = shared.clone();
    push_dropout(&mut out, "encoder.dropout", p_drop, prev);
    push(
        &mut out,
        rpb("encoder.block.0.layer.0.SelfAttention.relative_attention_bias"),
    );
    let mut body = Vec::new();
    let r = self_attn(&mut body, false);
    ff(&mut body, 1, &r)?;
    push(&mut out, repeat("encoder.block", enc_layers, body));
    let prev = push(&mut out, t5_norm("encoder.final_layer_norm"));
    let encoder_out = push_dropout(&mut out, "encoder.dropout.final", p_drop, prev);
    // Decoder, on the labels shifted right.
    push(
        &mut out,
        with_inputs(layer(K::ShiftRight, "decoder.shift_right"), &["input"]),
    );
    push(
        &mut out,
        LayerSpec {
            tie: Some(shared.clone()),
            ..embedding("decoder.embed_tokens", vocab, d_model)
        },
    );
    let prev = "decoder.embed_tokens".to_string();
    push_dropout(&mut out, "decoder.dropout", p_drop, prev);
    push(
        &mut out,
        rpb("decoder.block.0.layer.0.SelfAttention.relative_attention_bias"),
    );
    let mut body = Vec::new();
    let r = self_attn(&mut body, true);
    let norm = push(&mut body, t5_norm("layer.1.layer_norm"));
    let prev = push(
        &mut body,
        with_inputs(
            LayerSpec {
                heads: Some(heads),
                head_dim,
                bias: Some(false),
                dropout: (p_drop > 0.0).then_some(p_drop),
                ..layer(K::CrossAttention, "layer.1.EncDecAttention")
            },
            &[&norm, &encoder_out],
        ),
    );
    let prev = push_dropout(&mut body, "layer.1.dropout", p_drop, prev);
    let r = push(&mut body, add("layer.1.residual", &r, &prev));
    ff(&mut body, 2, &r)?;
    push(&mut out, repeat("decoder.block", dec_layers, body));
    let prev = push(&mut out, t5_norm("decoder.final_layer_norm"));
    push_dropout(&mut out, "decoder.dropout.final", p_drop, prev);
    match head {
        Resolved::Bare => {}
        Resolved::Lm => {
            if scale_outputs {
                #[allow(clippy::cast_precision_loss)]
                let factor = (d_model as f64).powf(-0.5);
                push(
                    &mut out,
                    with_note(
                        LayerSpec {
                            factor: Some(factor),
                            ..layer(K::Scale, "decoder_output_scale")
                        },
                        "sequence_output * d_model**-0.5 before the tied head",
                    ),
                );
            }
            let mut lm = linear("lm_head", vocab, false);
            lm.tie = Some(shared);
            push(&mut out, lm);
            push(&mut out, cross_entropy(false, false));
        }
        Resolved::Classification => {
            // T5ForSequenceClassification: the decoder's last (EOS) position, then
            // dropout, dense, tanh, dropout, out_proj.
            push(
                &mut out,
                LayerSpec {
                    dim: Some(1),
                    index: Some(-1),
                    ..layer(K::Select, "eos_representation")
                },
            );
            let classifier_p = cfg.p_or(&["classifier_dropout"], 0.0)?;
            let prev = "eos_representation".to_string();
            push_dropout(&mut out, "classification_head.dropout", classifier_p, prev);
            push(&mut out, linear("classification_head.dense", d_model, true));
            let prev = push(&mut out, layer(K::Tanh, "classification_head.tanh"));
            push_dropout(
                &mut out,
                "classification_head.dropout.2",
                classifier_p,
                prev,
            );
            push(
                &mut out,
                linear("classification_head.out_proj", cfg.num_labels()?, true),
            );
            push(&mut out, cross_entropy(false, false));
        }
    }
    Ok((out, seq))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llama_tiny() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "vocab_size": 32000,
            "torch_dtype": "bfloat16"
        })
    }

    #[test]
    fn detects_hf_configs() {
        assert!(is_hf_config(&json!({"model_type": "llama"})));
        assert!(is_hf_config(&json!({"architectures": ["BertModel"]})));
        assert!(!is_hf_config(&json!({"model_type": "x", "layers": []})));
        assert!(!is_hf_config(
            &json!({"input": {"shape": [4]}, "layers": []})
        ));
        assert!(!is_hf_config(&json!([1, 2])));
    }

    #[test]
    fn llama_has_one_repeat_block_and_a_tied_or_untied_head() {
        let spec = to_spec(&llama_tiny(), Head::Auto).unwrap();
        let kinds: Vec<K> = spec.layers.iter().map(|l| l.kind).collect();
        assert_eq!(
            kinds,
            [
                K::Embedding,
                K::Rotary,
                K::Repeat,
                K::RmsNorm,
                K::Linear,
                K::CrossEntropy
            ]
        );
        assert_eq!(spec.layers[2].count, Some(4));
        assert_eq!(spec.layers[4].tie, None);
        assert_eq!(spec.defaults.dtype, Some(DType::Bfloat16));
        assert_eq!(spec.defaults.seq, Some(2048));
        let body = spec.layers[2].layers.as_ref().unwrap();
        let attn = body.iter().find(|l| l.kind == K::Attention).unwrap();
        assert_eq!((attn.heads, attn.kv_heads), (Some(8), Some(2)));
        assert_eq!(attn.bias, Some(false));

        let mut tied = llama_tiny();
        tied["tie_word_embeddings"] = json!(true);
        let spec = to_spec(&tied, Head::Auto).unwrap();
        assert_eq!(spec.layers[4].tie.as_deref(), Some("model.embed_tokens"));
    }

    #[test]
    fn head_override() {
        let spec = to_spec(&llama_tiny(), Head::None).unwrap();
        assert_eq!(spec.layers.last().unwrap().kind, K::RmsNorm);
        assert_eq!(spec.layers[0].name.as_deref(), Some("embed_tokens"));
        let spec = to_spec(&llama_tiny(), Head::Classification).unwrap();
        let score = spec
            .layers
            .iter()
            .find(|l| l.name.as_deref() == Some("score"))
            .unwrap();
        assert_eq!(score.out_features, Some(2));
    }

    #[test]
    fn unsupported_model_type_lists_the_supported_ones() {
        let Err(Error::Setting(m)) = to_spec(&json!({"model_type": "falcon"}), Head::Auto) else {
            panic!("expected a setting error")
        };
        assert!(
            m.contains("falcon") && m.contains("llama") && m.contains("qwen2_moe"),
            "{m}"
        );
    }

    #[test]
    fn missing_field_is_named() {
        let mut c = llama_tiny();
        c.as_object_mut().unwrap().remove("hidden_size");
        let Err(Error::Setting(m)) = to_spec(&c, Head::Auto) else {
            panic!("expected a setting error")
        };
        assert!(m.contains("`hidden_size`"), "{m}");
    }

    #[test]
    fn qwen2_moe_dense_layers_split_the_blocks() {
        let c = json!({
            "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64, "mlp_only_layers": [0]
        });
        let spec = to_spec(&c, Head::Auto).unwrap();
        let blocks: Vec<(&str, Option<u64>)> = spec
            .layers
            .iter()
            .filter(|l| l.kind == K::Repeat)
            .map(|l| (l.name.as_deref().unwrap(), l.count))
            .collect();
        assert_eq!(
            blocks,
            [("model.layers.0", Some(1)), ("model.layers.1-3", Some(3))]
        );
    }

    #[test]
    fn architecture_without_model_type() {
        let mut c = llama_tiny();
        c.as_object_mut().unwrap().remove("model_type");
        assert!(to_spec(&c, Head::Auto).is_ok());
        let Err(Error::Setting(m)) =
            to_spec(&json!({"architectures": ["FalconForCausalLM"]}), Head::Auto)
        else {
            panic!("expected a setting error")
        };
        assert!(m.contains("FalconForCausalLM"), "{m}");
    }

    #[test]
    fn unknown_architecture_suggests_head() {
        let mut c = llama_tiny();
        c["architectures"] = json!(["LlamaForTokenClassification"]);
        let Err(Error::Setting(m)) = to_spec(&c, Head::Auto) else {
            panic!("expected a setting error")
        };
        assert!(m.contains("--head"), "{m}");
        assert!(to_spec(&c, Head::Lm).is_ok());
    }
}
