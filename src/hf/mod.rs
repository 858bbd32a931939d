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
use crate::spec::{DefaultsSpec, DimSpec, InputSpec, ModelSpec};

mod bert;
mod config;
mod decoder;
mod gpt2;
mod layers;
mod t5;

use config::Cfg;

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
        Family::Gpt2 => gpt2::gpt2(&cfg, head)?,
        Family::Bert => bert::bert(&cfg, head)?,
        Family::T5 => t5::t5(&cfg, head)?,
        _ => decoder::decoder(&cfg, family, head)?,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::LayerKind as K;
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
