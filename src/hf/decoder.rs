//! Llama-style decoders, one builder for every row of [`super::DECODERS`]: embedding, rotary
//! embedding, runs of decoder layers (attention and MLP with residuals, the norms before or
//! after them), final norm, head.
//!
//! The row says what is data (defaults, biases, norm style and placement, fused projections,
//! q/k norms); what stays code is real control flow: which layers use a sliding window or a
//! mixture of experts ([`Sliding`], [`Moe`]), the runs of equal layers, and the heads.

use super::Resolved;
use super::config::{Cfg, DecoderConfig, layer_count, prob, required};
use super::layers::{
    activation, add, causal_head, embedding, layer, linear, push, push_dropout, repeat, rmsnorm,
    run_name, runs, with_inputs, with_note,
};
use crate::error::Error;
use crate::spec::{LayerKind as K, LayerSpec, QkNormScope, Router, Style, layer_spec};

/// One Llama-style decoder family: the defaults of its transformers config class
/// (`configuration_<family>.py`) and how its modeling file (`modeling_<family>.py`) differs from
/// Llama's. See [`super::DECODERS`].
#[derive(Clone, Copy, Debug)]
pub(super) struct DecoderFamily {
    /// `model_type` in `config.json`.
    pub model_type: &'static str,
    /// Its `architectures` class names, lowercased, start with this (`Qwen2MoeForCausalLM` →
    /// `qwen2moe`); used when a config has no `model_type`.
    pub arch_prefix: &'static str,
    /// `num_key_value_heads` when the config leaves it out.
    pub kv_heads: KvHeads,
    /// `head_dim` when the config leaves it out (`None`: `hidden_size / num_attention_heads`).
    pub head_dim: Option<u64>,
    /// `max_position_embeddings` when the config leaves it out.
    pub max_positions: u64,
    /// `tie_word_embeddings` when the config leaves it out.
    pub tie: bool,
    /// `hidden_act` when the config leaves it out.
    pub act: &'static str,
    /// An activation name the config class rewrites, `(from, to)`.
    pub act_rename: Option<(&'static str, &'static str)>,
    /// Biases of the attention projections.
    pub bias: Bias,
    /// Whether the MLP's biases follow `mlp_bias` (Llama; others have none).
    pub mlp_bias: bool,
    /// Whether `resid_pdrop` drops out the attention and MLP outputs (Phi-3).
    pub resid_dropout: bool,
    /// Which RMSNorm every norm of the model is.
    pub norm: Norm,
    /// Where each decoder layer normalizes.
    pub placement: NormPlacement,
    /// Separate `q_proj`/`k_proj`/`v_proj` or one fused `qkv_proj`.
    pub qkv: Qkv,
    /// Separate `gate_proj`/`up_proj` or one fused `gate_up_proj`.
    pub gate_up: GateUp,
    /// RMSNorm on the queries and keys.
    pub qk_norm: QkNorm,
    /// The word embedding is scaled by `sqrt(hidden_size)` (Gemma).
    pub embed_scale: bool,
    /// `apply_rotary_pos_emb` joins the rotated and pass-through parts with `torch.cat` (Phi-3).
    pub rotary_concat: bool,
    /// The rotary embedding returns float32 `cos`/`sin` and `apply_rotary_pos_emb` casts Q and
    /// K back (OLMo-2; Llama casts the tables to the activation dtype).
    pub rotary_f32: bool,
    /// Which layers attend through a sliding window.
    pub sliding: Sliding,
    /// Which layers are a mixture of experts.
    pub moe: Moe,
    /// Granite's scalar multipliers (`modeling_granite.py`): the embeddings times
    /// `embedding_multiplier`, each attention and MLP output times `residual_multiplier` before
    /// its residual sum, the logits divided by `logits_scaling`; each a new tensor, nothing kept.
    pub multipliers: bool,
    /// Soft-capping (Gemma 2, Gemma 3): the attention scores as `attn_logit_softcapping` says
    /// and the logits as `final_logit_softcapping` says, each `tanh(x / cap) · cap`, with these
    /// defaults when the config leaves a key out; `null` turns one off. `None`: the family
    /// reads neither key.
    pub softcap: Option<SoftCaps>,
    /// Multi-head latent attention (DeepSeek-V2/V3: `mla`) instead of `self_attn`'s Q/K/V
    /// projections.
    pub mla: bool,
    /// Cohere: Q and K are rotated in float32 (`apply_rotary_pos_emb` upcasts them, the tables
    /// stay in the activation dtype) and cast back.
    pub rotary_upcast: bool,
    /// Cohere: the logits times `logit_scale` (this default when the config leaves it out)
    /// before the loss.
    pub logit_scale: Option<f64>,
    /// Gemma 3: a second rotary table (`rope_local_base_freq`) for the sliding-window layers;
    /// `Gemma3TextModel.forward` computes one `cos`/`sin` pair per layer type present.
    pub rotary_local: bool,
    /// GPT-OSS: a learned sink logit per head joins the eager attention scores
    /// (`GptOssAttention.sinks`), and the softmax runs in the scores' dtype.
    pub sinks: bool,
    /// GPT-OSS: `head_dim/2`-wide rotary tables, each half of a head rotated against them and
    /// the halves joined with `torch.cat` (`_apply_rotary_emb`).
    pub rotary_halves: bool,
}

/// The soft-capping defaults of a family's config class: `(attn_logit_softcapping,
/// final_logit_softcapping)`.
#[derive(Clone, Copy, Debug)]
pub(super) struct SoftCaps {
    pub attn: Option<f64>,
    pub logits: Option<f64>,
}

/// Default of `num_key_value_heads`.
#[derive(Clone, Copy, Debug)]
pub(super) enum KvHeads {
    /// As many as attention heads (multi-head attention).
    SameAsHeads,
    /// A fixed count.
    Fixed(u64),
}

/// Biases on the attention projections.
#[derive(Clone, Copy, Debug)]
pub(super) enum Bias {
    /// None (Mistral, Mixtral, Phi-3).
    None,
    /// On Q, K and V, not on the output projection (Qwen2).
    Qkv,
    /// On Q, K and V as `qkv_bias` says (default true), not on the output (Qwen2-MoE).
    QkvFromKey,
    /// On all four as `attention_bias` says (default false).
    AllFromKey,
    /// On all four as `attention_bias` says, default true (`GptOssConfig`).
    AllFromKeyOn,
}

/// Which transformers RMSNorm the family's norms are (memest's `rmsnorm` `style`).
#[derive(Clone, Copy, Debug)]
pub(super) enum Norm {
    /// `LlamaRMSNorm`: normalized in float32, cast back, times the weight.
    Llama,
    /// `GemmaRMSNorm`: `x·(1 + w)` in float32, cast back.
    Gemma,
    /// `Olmo2RMSNorm`: the weight times the float32 normalized tensor, cast back.
    Olmo2,
    /// `OlmoLayerNorm`: a LayerNorm without weight or bias over a float32 copy, cast back
    /// (memest's `layernorm` with `affine = false`, `upcast = true`).
    OlmoLayer,
    /// `CohereLayerNorm`: a LayerNorm with a weight and no bias written out in float32, cast
    /// back (memest's `layernorm` with `style = "cohere"`).
    Cohere,
}

/// Where a decoder layer normalizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NormPlacement {
    /// Before attention and MLP (`input_layernorm`, `post_attention_layernorm`).
    Pre,
    /// After attention and MLP, inside the residual (OLMo-2: `post_attention_layernorm`,
    /// `post_feedforward_layernorm`).
    Post,
    /// Before and after each (Gemma 2: `input_layernorm`, attention,
    /// `post_attention_layernorm`, residual, `pre_feedforward_layernorm`, MLP,
    /// `post_feedforward_layernorm`, residual).
    Sandwich,
    /// One norm whose output feeds attention and MLP in parallel, summed as
    /// `residual + attn + mlp` (Cohere's `CohereDecoderLayer`: `input_layernorm` only).
    Parallel,
}

/// The Q/K/V projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Qkv {
    /// `q_proj`, `k_proj`, `v_proj`.
    Separate,
    /// One `qkv_proj` (Phi-3).
    Fused,
}

/// The gate and up projections of a dense MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GateUp {
    /// `gate_proj` and `up_proj`.
    Separate,
    /// One `gate_up_proj`, split with `chunk(2, dim=-1)` (Phi-3).
    FusedChunk,
}

/// RMSNorm on the queries and keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum QkNorm {
    /// None.
    None,
    /// Per head, over `head_dim` (Qwen3).
    Head,
    /// Over the whole projection, `heads·head_dim` (OLMo-2).
    Projection,
}

/// Which layers attend through `sliding_window`.
#[derive(Clone, Copy, Debug)]
pub(super) enum Sliding {
    /// None.
    None,
    /// Every layer, when `sliding_window` is set (Mistral, Mixtral, Phi-3).
    Always,
    /// With `use_sliding_window`: the layers `layer_types` marks, else those from
    /// `max_window_layers` on (Qwen2, Qwen3).
    Qwen2,
    /// With `use_sliding_window`: the layers `layer_types` marks, else the even-numbered ones
    /// below `max_window_layers` (Qwen2-MoE's config class).
    Qwen2Moe,
    /// The layers `layer_types` marks, else every other one from layer 0 (`Gemma2Config`),
    /// with `sliding_window` (default 4096).
    Gemma2,
    /// As Gemma 2 (`GptOssConfig.__post_init__`: layer `i` slides when `(i + 1) % 2`), with
    /// `sliding_window` default 128.
    GptOss,
    /// The layers `layer_types` marks, else all but every `sliding_window_pattern`-th (default
    /// 6: layer `i` slides when `(i + 1) % 6 != 0`, `Gemma3TextConfig.__post_init__`), with
    /// `sliding_window` (default 4096).
    Gemma3,
}

/// Which layers are a sparse mixture of experts.
#[derive(Clone, Copy, Debug)]
pub(super) enum Moe {
    /// None.
    None,
    /// Every layer: `num_local_experts`, top `num_experts_per_tok`, renormalized (Mixtral).
    Mixtral,
    /// `num_experts` (default 60) with a gated shared expert, on every `decoder_sparse_step`-th
    /// layer not in `mlp_only_layers` (Qwen2-MoE).
    Qwen2,
    /// `num_experts` (default 128) of `moe_intermediate_size` (default 768), no shared expert,
    /// renormalized as `norm_topk_prob` says (default false), on the layers Qwen2-MoE's rule
    /// picks (Qwen3-MoE: `Qwen3MoeSparseMoeBlock`, a router and the experts).
    Qwen3,
    /// DeepSeek (`DeepseekV2Moe`, `DeepseekV3MoE`): `n_routed_experts` of
    /// `moe_intermediate_size`, top `num_experts_per_tok`, an ungated shared expert of
    /// `n_shared_experts · moe_intermediate_size`, on the layers from `first_k_dense_replace`
    /// on; V2 routes by softmax (`topk_method` `greedy`, or `group_limited_greedy` over
    /// `n_group` groups), V3 by sigmoid over `n_group` groups, renormalized as `norm_topk_prob`
    /// says.
    Deepseek {
        /// V3's router (else V2's).
        v3: bool,
    },
    /// Every layer (`GptOssMLP`): `num_local_experts` of `intermediate_size` with biases, top
    /// `num_experts_per_tok` of the biased router logits, softmax over those, the clamped
    /// SwiGLU (`swiglu_limit`, default 7).
    GptOss,
}

/// `max_window_layers` when the config leaves it out (Qwen2 and Qwen2-MoE config classes).
const MAX_WINDOW_LAYERS: u64 = 28;
/// `num_experts` when the config leaves it out (`Qwen2MoeConfig`).
const QWEN2_MOE_EXPERTS: u64 = 60;
/// `num_experts` and `moe_intermediate_size` when the config leaves them out
/// (`Qwen3MoeConfig`).
const QWEN3_MOE_EXPERTS: u64 = 128;
const QWEN3_MOE_INTERMEDIATE: u64 = 768;

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
        router: Router,
        groups: u64,
        topk_groups: u64,
        expert_bias: bool,
        swiglu_limit: Option<f64>,
    },
}

/// What may differ from one decoder layer to the next.
#[derive(Clone, Debug, PartialEq)]
struct LayerVariant {
    mlp: Mlp,
    sliding_window: Option<u64>,
}

/// The sliding window of layer `i`, if it has one.
fn sliding_at(row: &DecoderFamily, c: &DecoderConfig, i: u64) -> Option<u64> {
    let window = c.sliding_window.filter(|&w| w > 0);
    let max_window_layers = c.max_window_layers.unwrap_or(MAX_WINDOW_LAYERS);
    let marked = |i: u64| {
        c.layer_types.as_ref().map(|types| {
            usize::try_from(i)
                .ok()
                .and_then(|i| types.get(i))
                .is_some_and(|t| t == "sliding_attention")
        })
    };
    match row.sliding {
        Sliding::None => None,
        Sliding::Always => window,
        Sliding::Gemma2 | Sliding::GptOss => {
            let default = if matches!(row.sliding, Sliding::GptOss) {
                128
            } else {
                4096
            };
            let w = c.sliding_window.unwrap_or(default);
            (w > 0 && marked(i).unwrap_or(i.is_multiple_of(2))).then_some(w)
        }
        Sliding::Gemma3 => {
            let w = c.sliding_window.unwrap_or(4096);
            let pattern = c.sliding_window_pattern.unwrap_or(6);
            let by_pattern = pattern == 0 || !(i + 1).is_multiple_of(pattern);
            (w > 0 && marked(i).unwrap_or(by_pattern)).then_some(w)
        }
        Sliding::Qwen2 | Sliding::Qwen2Moe => {
            let w = window.filter(|_| c.use_sliding_window.unwrap_or(false))?;
            let sliding = marked(i).unwrap_or(match row.sliding {
                Sliding::Qwen2Moe => (i + 1) % 2 == 1 && i < max_window_layers,
                _ => i >= max_window_layers,
            });
            sliding.then_some(w)
        }
    }
}

/// The MLP of every layer.
fn mlps(
    cfg: &Cfg,
    row: &DecoderFamily,
    c: &DecoderConfig,
    n_layers: u64,
) -> Result<Vec<Mlp>, Error> {
    let moe = match row.moe {
        Moe::None | Moe::Deepseek { .. } => None,
        Moe::Mixtral => Some(Mlp::Moe {
            experts: required!(cfg, c.num_local_experts)?,
            top_k: required!(cfg, c.num_experts_per_tok)?,
            intermediate: required!(cfg, c.intermediate_size)?,
            shared: 0,
            shared_gate: false,
            normalize: true,
            router: Router::Softmax,
            groups: 1,
            topk_groups: 1,
            expert_bias: false,
            swiglu_limit: None,
        }),
        // GptOssConfig's defaults: 128 experts, top 4, width 2880, limit 7.0.
        Moe::GptOss => Some(Mlp::Moe {
            experts: c.num_local_experts.unwrap_or(128),
            top_k: c.num_experts_per_tok.unwrap_or(4),
            intermediate: c.intermediate_size.unwrap_or(2880),
            shared: 0,
            shared_gate: false,
            normalize: false,
            router: Router::GptOss,
            groups: 1,
            topk_groups: 1,
            expert_bias: true,
            swiglu_limit: Some(c.swiglu_limit.unwrap_or(7.0)),
        }),
        Moe::Qwen3 => {
            let experts = c.num_experts.unwrap_or(QWEN3_MOE_EXPERTS);
            if experts > 0 {
                Some(Mlp::Moe {
                    experts,
                    top_k: c.num_experts_per_tok.unwrap_or(8),
                    intermediate: c.moe_intermediate_size.unwrap_or(QWEN3_MOE_INTERMEDIATE),
                    shared: 0,
                    shared_gate: false,
                    normalize: c.norm_topk_prob.unwrap_or(false),
                    router: Router::Softmax,
                    groups: 1,
                    topk_groups: 1,
                    expert_bias: false,
                    swiglu_limit: None,
                })
            } else {
                None
            }
        }
        Moe::Qwen2 => {
            let experts = c.num_experts.unwrap_or(QWEN2_MOE_EXPERTS);
            if experts > 0 {
                Some(Mlp::Moe {
                    experts,
                    top_k: required!(cfg, c.num_experts_per_tok)?,
                    intermediate: required!(cfg, c.moe_intermediate_size)?,
                    shared: required!(cfg, c.shared_expert_intermediate_size)?,
                    shared_gate: true,
                    normalize: c.norm_topk_prob.unwrap_or(false),
                    router: Router::Softmax,
                    groups: 1,
                    topk_groups: 1,
                    expert_bias: false,
                    swiglu_limit: None,
                })
            } else {
                None
            }
        }
    };
    let moe = match row.moe {
        Moe::Deepseek { v3 } => {
            let experts = required!(cfg, c.n_routed_experts)?;
            let inter = required!(cfg, c.moe_intermediate_size)?;
            // V2: group-limited only with `topk_method = "group_limited_greedy"`; V3 always
            // ranks `n_group` groups (default 8, `topk_group` 4).
            let (groups, topk_groups) = if v3 {
                (c.n_group.unwrap_or(8), c.topk_group.unwrap_or(4))
            } else if c.topk_method.as_deref() == Some("group_limited_greedy") {
                (required!(cfg, c.n_group)?, required!(cfg, c.topk_group)?)
            } else {
                (1, 1)
            };
            Some(Mlp::Moe {
                experts,
                top_k: if v3 {
                    c.num_experts_per_tok.unwrap_or(8)
                } else {
                    required!(cfg, c.num_experts_per_tok)?
                },
                intermediate: inter,
                shared: inter
                    .checked_mul(c.n_shared_experts.unwrap_or(if v3 { 1 } else { 2 }))
                    .ok_or_else(|| {
                        Error::Overflow(
                            "the shared experts' width (n_shared_experts × moe_intermediate_size)"
                                .into(),
                        )
                    })?,
                shared_gate: false,
                normalize: v3 && c.norm_topk_prob.unwrap_or(true),
                router: if v3 {
                    Router::DeepseekV3
                } else {
                    Router::DeepseekV2
                },
                groups,
                topk_groups,
                expert_bias: false,
                swiglu_limit: None,
            })
        }
        _ => moe,
    };
    let first_dense = match row.moe {
        Moe::Deepseek { v3 } => c.first_k_dense_replace.unwrap_or(if v3 { 3 } else { 0 }),
        _ => 0,
    };
    let sparse_step = match row.moe {
        Moe::Qwen2 | Moe::Qwen3 => c.decoder_sparse_step.unwrap_or(1),
        _ => 1,
    };
    let mlp_only = c.mlp_only_layers.as_deref().unwrap_or_default();
    (0..n_layers)
        .map(|i| match &moe {
            Some(m) if matches!(row.moe, Moe::Deepseek { .. }) && i >= first_dense => Ok(m.clone()),
            Some(m)
                if matches!(row.moe, Moe::Mixtral | Moe::GptOss)
                    || (!matches!(row.moe, Moe::Deepseek { .. })
                        && !mlp_only.contains(&i)
                        && sparse_step > 0
                        && (i + 1) % sparse_step == 0) =>
            {
                Ok(m.clone())
            }
            _ => Ok(Mlp::Dense(required!(cfg, c.intermediate_size)?)),
        })
        .collect()
}

/// Builds a decoder family's layers from its row; returns them and the model's context length.
pub(super) fn decoder(
    cfg: &Cfg,
    row: &DecoderFamily,
    head: Resolved,
) -> Result<(Vec<LayerSpec>, u64), Error> {
    let base = if head == Resolved::Bare { "" } else { "model" };
    decoder_at(cfg, row, head, base)
}

/// [`decoder`] with the base model's module path `base` (`model`, or a multimodal model's
/// `model.language_model`; empty: the names as they are).
#[allow(clippy::too_many_lines)] // embeddings, rotary, runs of layers, norm, heads
pub(super) fn decoder_at(
    cfg: &Cfg,
    row: &DecoderFamily,
    head: Resolved,
    base: &str,
) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: DecoderConfig = cfg.read()?;
    if c.clip_qkv.is_some() {
        return Err(cfg.field_err(
            "clip_qkv",
            "`clip_qkv` (OLMo's in-place clamp of Q, K and V) is not supported".into(),
        ));
    }
    if c.use_qk_norm == Some(true) {
        return Err(cfg.field_err(
            "use_qk_norm",
            "`use_qk_norm = true` (Cohere's LayerNorm on each head's queries and keys, Command R+) is not supported".into(),
        ));
    }
    let vocab = required!(cfg, c.vocab_size)?;
    let hidden = required!(cfg, c.hidden_size)?;
    let n_layers = layer_count!(cfg, c.num_hidden_layers)?;
    let heads = required!(cfg, c.num_attention_heads)?;
    let kv_heads = c.num_key_value_heads.unwrap_or(match row.kv_heads {
        KvHeads::SameAsHeads => heads,
        KvHeads::Fixed(n) => n,
    });
    let head_dim = c.head_dim.unwrap_or(row.head_dim.unwrap_or(hidden / heads));
    let max_pos = c.max_position_embeddings.unwrap_or(row.max_positions);
    let tie = cfg.tie(row.tie);
    let (qkv_bias, out_bias) = match row.bias {
        Bias::None => (false, false),
        Bias::Qkv => (true, false),
        Bias::QkvFromKey => (c.qkv_bias.unwrap_or(true), false),
        Bias::AllFromKey => {
            let b = c.attention_bias.unwrap_or(false);
            (b, b)
        }
        Bias::AllFromKeyOn => {
            let b = c.attention_bias.unwrap_or(true);
            (b, b)
        }
    };
    let mlp_bias = row.mlp_bias && c.mlp_bias.unwrap_or(false);
    // Gemma 2 names it `hidden_activation`.
    let act_name = c
        .hidden_activation
        .as_deref()
        .or(c.hidden_act.as_deref())
        .unwrap_or(row.act);
    let act_name = match row.act_rename {
        Some((from, to)) if act_name == from => to,
        _ => act_name,
    };
    let attn_dropout = prob!(cfg, c.attention_dropout, 0.0)?;
    let resid_dropout = if row.resid_dropout {
        prob!(cfg, c.resid_pdrop, 0.0)?
    } else {
        0.0
    };
    let (attn_softcap, final_softcap) = match row.softcap {
        Some(d) => (
            soft_cap(
                cfg,
                "attn_logit_softcapping",
                c.attn_logit_softcapping,
                d.attn,
            )?,
            soft_cap(
                cfg,
                "final_logit_softcapping",
                c.final_logit_softcapping,
                d.logits,
            )?,
        ),
        None => (None, None),
    };
    let variants: Vec<LayerVariant> = mlps(cfg, row, &c, n_layers)?
        .into_iter()
        .zip(0..)
        .map(|(mlp, i)| LayerVariant {
            mlp,
            sliding_window: sliding_at(row, &c, i),
        })
        .collect();

    // Rotary embedding (partial rotary: only part of each head rotates).
    let partial = c
        .rope_parameters
        .as_ref()
        .and_then(|r| r.partial_rotary_factor)
        .or(c.partial_rotary_factor)
        .unwrap_or(1.0);
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rotary_dim = ((head_dim as f64 * partial) as u64).max(2);

    let mla = if row.mla {
        Some((
            match c.q_lora_rank {
                Some(r) => r,
                None => Some(1536),
            },
            c.kv_lora_rank.unwrap_or(512),
            c.qk_nope_head_dim.unwrap_or(128),
            c.qk_rope_head_dim.unwrap_or(64),
            c.v_head_dim.unwrap_or(128),
        ))
    } else {
        None
    };
    // DeepSeek's rotary embedding covers the `qk_rope_head_dim` part only.
    let rotary_dim = mla.map_or(rotary_dim, |m| m.3);
    let p = |s: &str| {
        if base.is_empty() {
            s.to_string()
        } else {
            format!("{base}.{s}")
        }
    };
    let mut out = Vec::new();
    let embed = p("embed_tokens");
    push(&mut out, embedding(&embed, vocab, hidden));
    if row.multipliers {
        push(
            &mut out,
            with_note(
                layer_spec! {
                    factor: Some(c.embedding_multiplier.unwrap_or(1.0)),
                    ..layer(K::Scale, &p("embedding_multiplier"))
                },
                "Granite: inputs_embeds * embedding_multiplier",
            ),
        );
    }
    if row.embed_scale {
        #[allow(clippy::cast_precision_loss)]
        let factor = (hidden as f64).sqrt();
        push(
            &mut out,
            with_note(
                layer_spec! {
                    factor: Some(factor),
                    ..layer(K::Scale, &p("embed_tokens.embed_scale"))
                },
                "Gemma's scaled word embedding: times sqrt(hidden_size)",
            ),
        );
    }
    let rotary = layer_spec! {
        head_dim: Some(rotary_dim),
        concat: row.rotary_halves.then_some(true),
        concat_each: row.rotary_concat.then_some(true),
        half_tables: row.rotary_halves.then_some(true),
        tables_f32: row.rotary_f32.then_some(true),
        upcast: row.rotary_upcast.then_some(true),
        ..layer(K::Rotary, &p("rotary_emb"))
    };
    if row.rotary_local {
        // Gemma3RotaryEmbedding: one cos/sin pair per layer type present, the sliding layers'
        // from `rope_local_base_freq` (same size).
        let sliding = variants
            .iter()
            .filter(|v| v.sliding_window.is_some())
            .count();
        if sliding < variants.len() {
            push(
                &mut out,
                layer_spec! {
                    name: Some(p("rotary_emb.full_attention")),
                    ..rotary.clone()
                },
            );
        }
        if sliding > 0 {
            push(
                &mut out,
                layer_spec! {
                    name: Some(p("rotary_emb.sliding_attention")),
                    local: Some(true),
                    ..rotary
                },
            );
        }
    } else {
        push(&mut out, rotary);
    }
    let all_runs = runs(&variants);
    for (first, count, v) in &all_runs {
        let body = decoder_layer(
            cfg,
            row,
            act_name,
            &DecoderAttn {
                hidden,
                heads,
                kv_heads,
                head_dim,
                qkv_bias,
                out_bias,
                dropout: attn_dropout,
                sliding_window: v.sliding_window,
                residual_multiplier: row
                    .multipliers
                    .then(|| c.residual_multiplier.unwrap_or(1.0)),
                softcap: attn_softcap,
                mla,
            },
            &v.mlp,
            mlp_bias,
            resid_dropout,
        )?;
        push(
            &mut out,
            repeat(
                &run_name(&p("layers"), all_runs.len(), *first, *count),
                "num_hidden_layers",
                *count,
                body,
            ),
        );
    }
    push(&mut out, family_norm(row, &p("norm")));
    causal_head(&mut out, cfg, head, vocab, tie.then_some(embed.as_str()))?;
    if let (Some(cap), Resolved::Lm) = (final_softcap, head) {
        // Gemma2ForCausalLM, Gemma3ForCausalLM: `logits / cap`, `tanh`, `* cap`, before the loss.
        let loss = out.pop().expect("the causal head ends in its loss");
        push(
            &mut out,
            layer_spec! {
                factor: Some(1.0 / cap),
                ..layer(K::Scale, "final_logit_softcapping.div")
            },
        );
        push(&mut out, layer(K::Tanh, "final_logit_softcapping.tanh"));
        push(
            &mut out,
            layer_spec! {
                factor: Some(cap),
                ..layer(K::Scale, "final_logit_softcapping.mul")
            },
        );
        out.push(loss);
    }
    if row.multipliers && head == Resolved::Lm {
        // GraniteForCausalLM: `logits = logits / self.config.logits_scaling`, before the loss.
        let loss = out.pop().expect("the causal head ends in its loss");
        push(
            &mut out,
            with_note(
                layer_spec! {
                    factor: Some(1.0 / c.logits_scaling.unwrap_or(1.0)),
                    ..layer(K::Scale, "logits_scaling")
                },
                "Granite: logits / logits_scaling",
            ),
        );
        out.push(loss);
    }
    if let (Some(default), Resolved::Lm) = (row.logit_scale, head) {
        // CohereForCausalLM: `logits = logits * self.logit_scale`, before the loss.
        if let Some(scale) = c.logit_scale.unwrap_or(Some(default)) {
            let loss = out.pop().expect("the causal head ends in its loss");
            push(
                &mut out,
                with_note(
                    layer_spec! {
                        factor: Some(scale),
                        ..layer(K::Scale, "logit_scale")
                    },
                    "Cohere: logits * logit_scale",
                ),
            );
            out.push(loss);
        }
    }
    Ok((out, max_pos))
}

/// The family's RMSNorm.
fn family_norm(row: &DecoderFamily, name: &str) -> LayerSpec {
    let style = match row.norm {
        Norm::Llama => None,
        Norm::Gemma => Some(Style::Gemma),
        Norm::Olmo2 => Some(Style::Olmo2),
        Norm::OlmoLayer => {
            return layer_spec! {
                affine: Some(false),
                upcast: Some(true),
                ..layer(K::LayerNorm, name)
            };
        }
        Norm::Cohere => {
            return layer_spec! {
                style: Some(Style::Cohere),
                ..layer(K::LayerNorm, name)
            };
        }
    };
    layer_spec! {
        style: style,
        ..rmsnorm(name)
    }
}

/// The attention of a decoder layer.
struct DecoderAttn {
    hidden: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    qkv_bias: bool,
    out_bias: bool,
    dropout: f64,
    sliding_window: Option<u64>,
    /// Granite's `residual_multiplier` (`None` for the other families).
    residual_multiplier: Option<f64>,
    /// Gemma 2's `attn_logit_softcapping`.
    softcap: Option<f64>,
    /// DeepSeek's multi-head latent attention: `(q_lora_rank, kv_lora_rank, qk_nope_head_dim,
    /// qk_rope_head_dim, v_head_dim)`.
    mla: Option<(Option<u64>, u64, u64, u64, u64)>,
}

/// One decoder layer: attention and MLP, each with its residual, normalized before
/// (`input_layernorm`, `post_attention_layernorm`) or after (`post_attention_layernorm`,
/// `post_feedforward_layernorm`) as the row says.
#[allow(clippy::too_many_lines)] // the dense, fused and expert MLPs, in forward order
fn decoder_layer(
    cfg: &Cfg,
    row: &DecoderFamily,
    act_name: &str,
    a: &DecoderAttn,
    mlp: &Mlp,
    mlp_bias: bool,
    resid_dropout: f64,
) -> Result<Vec<LayerSpec>, Error> {
    let post = row.placement == NormPlacement::Post;
    let mut body = Vec::new();
    if !post {
        push(&mut body, family_norm(row, "input_layernorm"));
    }
    if let Some((q_lora_rank, kv_lora_rank, nope, rope, v)) = a.mla {
        // DeepseekV3Attention (modeling_deepseek_v3.py): multi-head latent attention.
        let prev = push(
            &mut body,
            layer_spec! {
                heads: Some(a.heads),
                q_lora_rank: q_lora_rank,
                kv_lora_rank: Some(kv_lora_rank),
                qk_nope_head_dim: Some(nope),
                qk_rope_head_dim: Some(rope),
                v_head_dim: Some(v),
                bias: a.out_bias.then_some(true),
                dropout: (a.dropout > 0.0).then_some(a.dropout),
                ..layer(K::Mla, "self_attn")
            },
        );
        return finish_layer(
            cfg,
            row,
            act_name,
            a,
            mlp,
            mlp_bias,
            resid_dropout,
            body,
            prev,
        );
    }
    let mut attn = layer_spec! {
        heads: Some(a.heads),
        kv_heads: (a.kv_heads != a.heads).then_some(a.kv_heads),
        head_dim: (a.heads.checked_mul(a.head_dim) != Some(a.hidden)).then_some(a.head_dim),
        causal: Some(true),
        bias: (!a.qkv_bias).then_some(false),
        out_bias: (a.out_bias != a.qkv_bias).then_some(a.out_bias),
        rotary: Some(true),
        dropout: (a.dropout > 0.0).then_some(a.dropout),
        qk_norm: (row.qk_norm != QkNorm::None).then_some(true),
        qk_norm_scope: (row.qk_norm == QkNorm::Projection).then_some(QkNormScope::Projection),
        // Gemma 3's q_norm/k_norm are GemmaRMSNorms.
        qk_norm_style: (row.qk_norm == QkNorm::Head && matches!(row.norm, Norm::Gemma))
            .then_some(Style::Gemma),
        sliding_window: a.sliding_window,
        // Their eager_attention_forward: softmax(.., dtype=torch.float32).to(query.dtype);
        // GPT-OSS's: softmax(.., dtype=combined_logits.dtype), after the sink column.
        softmax_f32: (!row.sinks).then_some(true),
        softcap: a.softcap,
        sinks: row.sinks.then_some(true),
        ..layer(K::Attention, "self_attn")
    };
    if row.qkv == Qkv::Fused {
        attn.fused_qkv = Some(true);
        attn.note = Some("Phi-3's fused qkv_proj".into());
    }
    let prev = push(&mut body, attn);
    finish_layer(
        cfg,
        row,
        act_name,
        a,
        mlp,
        mlp_bias,
        resid_dropout,
        body,
        prev,
    )
}

/// The rest of a decoder layer after its attention (`prev`): the norms after it, the residual,
/// the MLP and its residual.
#[allow(clippy::too_many_arguments, clippy::too_many_lines)]
fn finish_layer(
    cfg: &Cfg,
    row: &DecoderFamily,
    act_name: &str,
    a: &DecoderAttn,
    mlp: &Mlp,
    mlp_bias: bool,
    resid_dropout: f64,
    mut body: Vec<LayerSpec>,
    prev: String,
) -> Result<Vec<LayerSpec>, Error> {
    let post = row.placement == NormPlacement::Post;
    let sandwich = row.placement == NormPlacement::Sandwich;
    let parallel = row.placement == NormPlacement::Parallel;
    let prev = if post || sandwich {
        push(&mut body, family_norm(row, "post_attention_layernorm"))
    } else {
        prev
    };
    let prev = push_dropout(&mut body, "resid_attn_dropout", resid_dropout, prev);
    let prev = residual_scale(
        &mut body,
        a.residual_multiplier,
        "attn_residual_multiplier",
        prev,
    );
    let attn_out = prev;
    let residual1 = if parallel {
        String::new()
    } else {
        push(&mut body, add("residual1", "input", &attn_out))
    };
    let mlp_in = if parallel {
        "input_layernorm".to_string()
    } else if post {
        residual1.clone()
    } else if sandwich {
        push(&mut body, family_norm(row, "pre_feedforward_layernorm"))
    } else {
        push(&mut body, family_norm(row, "post_attention_layernorm"))
    };
    if parallel && (row.gate_up == GateUp::FusedChunk || matches!(mlp, Mlp::Moe { .. })) {
        return Err(cfg
            .err("a parallel block with a fused gate_up_proj or experts is not supported".into()));
    }
    let prev = match mlp {
        Mlp::Dense(intermediate) if row.gate_up == GateUp::FusedChunk => {
            // Phi3MLP: one fused gate_up_proj, `chunk(2, dim=-1)` into two views of its output,
            // `up * act(gate)`.
            push(
                &mut body,
                linear(
                    "mlp.gate_up_proj",
                    intermediate.checked_mul(2).ok_or_else(|| {
                        Error::Overflow(
                            "the fused gate_up_proj width (2 × intermediate_size)".into(),
                        )
                    })?,
                    mlp_bias,
                ),
            );
            let chunks = push(
                &mut body,
                with_note(
                    layer_spec! {
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
                layer_spec! {
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
                    layer_spec! {
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
            let gate = linear("mlp.gate_proj", *intermediate, mlp_bias);
            push(
                &mut body,
                if parallel {
                    with_inputs(gate, &[&mlp_in])
                } else {
                    gate
                },
            );
            let act = push(
                &mut body,
                activation(cfg, "hidden_act", act_name, "mlp.act_fn")?,
            );
            let up = push(
                &mut body,
                with_inputs(linear("mlp.up_proj", *intermediate, mlp_bias), &[&mlp_in]),
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
            router,
            groups,
            topk_groups,
            expert_bias,
            swiglu_limit,
        } => {
            if act_name != "silu" && act_name != "swish" {
                return Err(cfg.err(format!(
                    "activation `{act_name}` in `hidden_act` is not supported for mixture-of-experts layers (their experts are SiLU-gated)"
                )));
            }
            push(
                &mut body,
                layer_spec! {
                    experts: Some(*experts),
                    top_k: Some(*top_k),
                    intermediate_size: Some(*intermediate),
                    shared_intermediate_size: (*shared > 0).then_some(*shared),
                    shared_gate: shared_gate.then_some(true),
                    normalize_topk: Some(*normalize),
                    router: (*router != Router::Softmax).then_some(*router),
                    groups: (*groups > 1).then_some(*groups),
                    topk_groups: (*topk_groups != *groups).then_some(*topk_groups),
                    expert_bias: expert_bias.then_some(true),
                    swiglu_limit: *swiglu_limit,
                    ..layer(K::Moe, "mlp")
                },
            )
        }
    };
    let prev = if post || sandwich {
        push(&mut body, family_norm(row, "post_feedforward_layernorm"))
    } else {
        prev
    };
    let prev = push_dropout(&mut body, "resid_mlp_dropout", resid_dropout, prev);
    let prev = residual_scale(
        &mut body,
        a.residual_multiplier,
        "mlp_residual_multiplier",
        prev,
    );
    if parallel {
        // `residual + hidden_states_attention + hidden_states_mlp`, once the MLP has run.
        let sum = push(&mut body, add("residual1", "input", &attn_out));
        push(&mut body, add("residual2", &sum, &prev));
    } else {
        push(&mut body, add("residual2", &residual1, &prev));
    }
    Ok(body)
}

/// A soft-capping value: the config's (`null` turns it off), else `default`; positive.
fn soft_cap(
    cfg: &Cfg,
    key: &str,
    value: Option<Option<f64>>,
    default: Option<f64>,
) -> Result<Option<f64>, Error> {
    match value.unwrap_or(default) {
        Some(cap) if !(cap.is_finite() && cap > 0.0) => Err(cfg.field_err(
            key,
            format!("`{key}` must be a positive number or null, got {cap}"),
        )),
        v => Ok(v),
    }
}

/// Granite's `hidden_states * residual_multiplier` before a residual sum; returns the name of
/// the last layer.
fn residual_scale(
    body: &mut Vec<LayerSpec>,
    multiplier: Option<f64>,
    name: &str,
    prev: String,
) -> String {
    match multiplier {
        Some(m) => push(
            body,
            layer_spec! {
                factor: Some(m),
                ..layer(K::Scale, name)
            },
        ),
        None => prev,
    }
}
