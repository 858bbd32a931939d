//! `attention`, `cross_attention`, `moe`.

use super::RmsStyle;
use super::keys::{KeyReader, key};
use crate::spec::{QkNormScope, Router, Style};

/// Whose attention module an `attention` layer follows (`style`); they lay tensors out
/// differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnStyle {
    /// transformers' attention modules: `[B, S, H]` projections split into heads with
    /// `view` + `transpose(1, 2)`, merged back with `transpose(1, 2).contiguous()`.
    Transformers,
    /// `torch.nn.MultiheadAttention(batch_first=True)` (torchvision's ViT): a packed
    /// in-projection of the sequence-first input, always through `scaled_dot_product_attention`.
    TorchMha,
}

/// Where an attention layer RMS-normalizes its queries and keys (`qk_norm`, `qk_norm_scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// Per head, over `head_dim`, on the `[B, S, heads, head_dim]` view (Qwen3's
    /// `q_norm`/`k_norm`, `LlamaRMSNorm`): params `2·head_dim`.
    Head,
    /// Over the whole projection `[B, S, heads·head_dim]` before the heads are split
    /// (OLMo-2's `q_norm`/`k_norm`, `Olmo2RMSNorm`): params `(heads + kv_heads)·head_dim`.
    Projection,
}

/// Multi-head attention on `[B, S, H]`: Q, K, V projections (`heads·head_dim`,
/// `kv_heads·head_dim`, `kv_heads·head_dim` outputs, fused or not), attention, and the output
/// projection back to `H`. `attention` is self-attention; `cross_attention` (T5's decoder) takes
/// its queries from the first input and projects keys and values from the second (the encoder
/// output `[B, S_enc, H]`), with the keys `heads`, `head_dim`, `bias`, `out_bias`, `k_bias`,
/// `scale_query`, `contiguous_heads`, `dropout` and `kv_cache` only.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionCfg {
    /// Whose module is modelled.
    pub style: AttnStyle,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: u64,
    /// Head dimension (default `H / heads`).
    pub head_dim: Option<u64>,
    /// Causal mask (decoders).
    pub causal: bool,
    /// Causal attention stores K and V in transformers' `DynamicCache` (`use_cache`), which
    /// copies them, in training too (default: true for causal attention).
    pub kv_cache: bool,
    /// Biases on the Q, K, V projections.
    pub bias: bool,
    /// Bias on the output projection (default: `bias`).
    pub out_bias: bool,
    /// Bias on the K projection (default: `bias`; Whisper's `WhisperAttention` builds `k_proj`
    /// with `bias=False` and Q, V, O with biases).
    pub k_bias: bool,
    /// The Q projection is multiplied by `head_dim^-0.5` into a new tensor (`mul.Scalar`, which
    /// saves nothing) before the heads are split, and attention runs with scale 1 (Whisper's
    /// `(self.q_proj(hidden_states) * self.scaling)`).
    pub scale_query: bool,
    /// Q, K and V are copied to contiguous `[B, heads, S, head_dim]` tensors before the cache and
    /// the kernel (Whisper's `.view(..).transpose(1, 2).contiguous()`): the kernel's output then
    /// follows the heads-first order on the CPU and merging the heads is a copy.
    pub contiguous_heads: bool,
    /// One fused QKV projection (GPT-2's `c_attn`, ViT's `in_proj`).
    pub fused_qkv: bool,
    /// Attention per chunk, one chunk per batch row (Qwen2-VL's vision attention, one image a
    /// row): Q, K and V are split per image, each image gets its own attention call and its
    /// heads merged, and `torch.cat` joins the images.
    pub chunked: bool,
    /// Rotary embedding applied to Q and K.
    pub rotary: bool,
    /// Dropout on the attention probabilities (training only).
    pub dropout: f64,
    /// Which RMSNorm `qk_norm` applies (`qk_norm_style`): `LlamaRMSNorm` (default, Qwen3) or
    /// `GemmaRMSNorm` (`x·(1 + w)` in float32, Gemma 3's `q_norm`/`k_norm`).
    pub qk_norm_style: RmsStyle,
    /// RMSNorm on Q and K (Qwen3 per head, OLMo-2 over the projection).
    pub qk_norm: Option<QkNorm>,
    /// Adds the shared relative position bias (T5) to the scores.
    pub position_bias: bool,
    /// Sliding-window attention (Mistral): the inference KV cache holds at most this many
    /// tokens.
    pub sliding_window: Option<u64>,
    /// Eager softmax in float32 (`softmax(.., dtype=torch.float32).to(query.dtype)`, as
    /// transformers' Llama-family and T5 attention do): in a 16-bit model it keeps a float32
    /// copy of the probabilities and a 16-bit one.
    pub softmax_f32: bool,
    /// The causal mask is a materialized boolean `[B, 1, S, S_kv]` tensor (Falcon's
    /// `create_causal_mask(.., allow_is_causal_skip=False)`), which
    /// `scaled_dot_product_attention` converts on every call into a float mask of the query's
    /// dtype (`convert_boolean_attn_mask` in ATen's `transformers/attention.cpp`) that its
    /// backward keeps. Only the fused kernel (`flash`) is affected.
    pub bool_mask: bool,
    /// K and V are broadcast to every query head right after the projection, before rotary,
    /// cache and attention (Falcon's new decoder architecture: `torch.broadcast_to(key,
    /// query.shape)` then `flatten(2, 3)`): the parameters count `kv_heads`, the activations
    /// `heads`.
    pub expand_kv: bool,
    /// Soft-capping of the eager scores, `tanh(scores / cap) · cap` (Gemma 2's
    /// `attn_logit_softcapping`): two scalar products and a `tanh`, which keeps its output
    /// `[B, heads, S, S_kv]`. SDPA has no such option (transformers runs Gemma 2 eagerly); the
    /// fused path ignores it.
    pub softcap: Option<f64>,
    /// A learned sink logit per head (`sinks`, a `[heads]` parameter; GPT-OSS's
    /// `GptOssAttention.sinks`): the eager path joins it to the masked scores as one more
    /// column (`torch.cat`, `[B, heads, S, S_kv + 1]`), subtracts the row maximum (`max.dim`
    /// keeps its int64 indices), takes the softmax in the scores' dtype (keeping its output)
    /// and drops the sink column (a view the second `bmm` keeps). SDPA has no such option
    /// (transformers runs GPT-OSS eagerly); the fused path ignores the sink column.
    pub sinks: bool,
}

impl AttentionCfg {
    /// Reads an `attention` layer.
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let style = r.opt(key!(s.style));
        let kv_cache = r.or(key!(s.kv_cache), true);
        let heads = r.pos(key!(s.heads));
        let kv_heads = r.pos_or(key!(s.kv_heads), heads);
        let head_dim = r.pos_opt(key!(s.head_dim));
        let causal = r.or(key!(s.causal), false);
        let bias = r.or(key!(s.bias), true);
        let out_bias = r.or(key!(s.out_bias), bias);
        let k_bias = r.or(key!(s.k_bias), bias);
        let scale_query = r.or(key!(s.scale_query), false);
        let contiguous_heads = r.or(key!(s.contiguous_heads), false);
        let fused_qkv = r.or(key!(s.fused_qkv), false);
        let chunked = r.or(key!(s.chunked), false);
        let rotary = r.or(key!(s.rotary), false);
        let dropout = r.prob(key!(s.dropout), 0.0);
        let qk_norm = r.or(key!(s.qk_norm), false);
        let qk_norm_scope = r.opt(key!(s.qk_norm_scope));
        let qk_norm_style: Option<Style> = r.opt(key!(s.qk_norm_style));
        let position_bias = r.or(key!(s.position_bias), false);
        let sliding_window = r.pos_opt(key!(s.sliding_window));
        let softmax_f32 = r.or(key!(s.softmax_f32), false);
        let bool_mask = r.or(key!(s.bool_mask), false);
        let expand_kv = r.or(key!(s.expand_kv), false);
        let softcap: Option<f64> = r.opt(key!(s.softcap));
        let sinks = r.or(key!(s.sinks), false);
        r.finish()?;
        if let Some(cap) = softcap
            && !(cap.is_finite() && cap > 0.0)
        {
            return Err(format!("`softcap` must be a positive number, got {cap}"));
        }
        let style = match style {
            None | Some(Style::Transformers) => AttnStyle::Transformers,
            Some(Style::Torch) => AttnStyle::TorchMha,
            Some(other) => {
                return Err(format!(
                    "`style` value `{}` does not apply to `attention`, expected \"transformers\" or \"torch\"",
                    other.as_str()
                ));
            }
        };
        if !heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "`heads` ({heads}) must be a multiple of `kv_heads` ({kv_heads})"
            ));
        }
        let qk_norm = match (qk_norm, qk_norm_scope) {
            (false, None) => None,
            (false, Some(_)) => return Err("`qk_norm_scope` needs `qk_norm = true`".into()),
            (true, None | Some(QkNormScope::Head)) => Some(QkNorm::Head),
            (true, Some(QkNormScope::Projection)) => Some(QkNorm::Projection),
        };
        let qk_norm_style = match qk_norm_style {
            None | Some(Style::Llama) => RmsStyle::Llama,
            Some(Style::Gemma) => RmsStyle::Gemma,
            Some(other) => {
                return Err(format!(
                    "`qk_norm_style` value `{}` does not apply, expected \"llama\" or \"gemma\"",
                    other.as_str()
                ));
            }
        };
        if qk_norm_style != RmsStyle::Llama && qk_norm != Some(QkNorm::Head) {
            return Err("`qk_norm_style` needs `qk_norm = true` per head".into());
        }
        if (k_bias != bias || scale_query || contiguous_heads)
            && (fused_qkv || style == AttnStyle::TorchMha)
        {
            return Err("`k_bias`, `scale_query` and `contiguous_heads` need separate Q, K and V projections (not `fused_qkv` or style = \"torch\")".into());
        }
        if qk_norm.is_some() && (fused_qkv || style == AttnStyle::TorchMha) {
            return Err("`qk_norm` needs separate Q and K projections (not `fused_qkv` or style = \"torch\")".into());
        }
        Ok(AttentionCfg {
            style,
            heads,
            kv_heads,
            head_dim,
            causal,
            kv_cache,
            bias,
            out_bias,
            k_bias,
            scale_query,
            contiguous_heads,
            fused_qkv,
            chunked,
            rotary,
            dropout,
            qk_norm_style,
            qk_norm,
            position_bias,
            sliding_window,
            softmax_f32,
            bool_mask,
            expand_kv,
            softcap,
            sinks,
        })
    }

    /// Reads a `cross_attention` layer: non-causal, one projection per input; `kv_cache`
    /// (default true) keeps transformers' encoder-decoder cache of the projected keys and
    /// values (T5's `EncoderDecoderCache`), false for a model that has none (diffusers'
    /// `Attention`).
    pub(super) fn read_cross(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let heads = r.pos(key!(s.heads));
        let head_dim = r.pos_opt(key!(s.head_dim));
        let bias = r.or(key!(s.bias), true);
        let out_bias = r.or(key!(s.out_bias), bias);
        let k_bias = r.or(key!(s.k_bias), bias);
        let scale_query = r.or(key!(s.scale_query), false);
        let contiguous_heads = r.or(key!(s.contiguous_heads), false);
        let dropout = r.prob(key!(s.dropout), 0.0);
        let kv_cache = r.or(key!(s.kv_cache), true);
        r.finish()?;
        Ok(AttentionCfg {
            style: AttnStyle::Transformers,
            heads,
            kv_heads: heads,
            head_dim,
            causal: false,
            kv_cache,
            bias,
            out_bias,
            k_bias,
            scale_query,
            contiguous_heads,
            fused_qkv: false,
            chunked: false,
            rotary: false,
            dropout,
            qk_norm_style: RmsStyle::Llama,
            qk_norm: None,
            position_bias: false,
            sliding_window: None,
            softmax_f32: false,
            bool_mask: false,
            expand_kv: false,
            softcap: None,
            sinks: false,
        })
    }
}

/// A sparse mixture-of-experts MLP on `[B, S, H]` (Mixtral, Qwen-MoE) as transformers 5 runs it
/// (`grouped_mm` experts): a router `H → experts`, softmax, top-k, tokens gathered per expert,
/// SiLU-gated experts of width `intermediate_size`, weighted and scattered back; with a shared
/// expert (Qwen-MoE) of width `shared_intermediate_size` on every token, optionally gated.
/// Params: `experts·H + experts·3·H·I (+ 3·H·I_shared + H)`. Routing is assumed balanced: each
/// expert sees `B·S·top_k/experts` tokens. GPT-OSS's MLP (`GptOssMLP`) is the `gpt_oss` router,
/// `expert_bias` and `swiglu_limit`: params `experts·(H + 1) + experts·(3·H·I + 2·I + H)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeCfg {
    /// Experts.
    pub experts: u64,
    /// Experts per token.
    pub top_k: u64,
    /// Expert FFN width.
    pub intermediate_size: u64,
    /// Shared expert width (0: none).
    pub shared_intermediate_size: u64,
    /// Sigmoid gate on the shared expert.
    pub shared_gate: bool,
    /// Renormalize the top-k routing weights (Mixtral: yes; Qwen-MoE: `norm_topk_prob`).
    pub normalize_topk: bool,
    /// How the experts are picked (`router`, default softmax).
    pub router: Router,
    /// Expert groups of DeepSeek's group-limited routing (`groups`, default 1: none).
    pub groups: u64,
    /// Groups kept per token (`topk_groups`, default `groups`).
    pub topk_groups: u64,
    /// The experts have biases (`expert_bias`): `gate_up_proj_bias` `[experts, 2·I]` and
    /// `down_proj_bias` `[experts, H]`, each gathered per routed row (`bias[sorted expert
    /// ids]`, an `index` that keeps the int64 ids) and added in place to the grouped product
    /// (`integrations/moe.py` `_grouped_linear`).
    pub expert_bias: bool,
    /// GPT-OSS's clamped SwiGLU (`swiglu_limit`; `GptOssExperts._apply_gate`): gate and up are
    /// the interleaved columns of the grouped product (`[..., ::2]`, `[..., 1::2]`), `gate`
    /// clamped above and `up` on both sides at the limit (each `clamp` keeps the product),
    /// then `gate·sigmoid(alpha·gate)·(up + 1)`; `None`: SiLU-gated (`chunk`).
    pub swiglu_limit: Option<f64>,
}

impl MoeCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = MoeCfg {
            experts: r.pos(key!(s.experts)),
            top_k: r.pos(key!(s.top_k)),
            intermediate_size: r.pos(key!(s.intermediate_size)),
            shared_intermediate_size: r.or(key!(s.shared_intermediate_size), 0),
            shared_gate: r.or(key!(s.shared_gate), false),
            normalize_topk: r.or(key!(s.normalize_topk), true),
            router: r.or(key!(s.router), Router::Softmax),
            groups: r.pos_or(key!(s.groups), 1),
            topk_groups: 0,
            expert_bias: r.or(key!(s.expert_bias), false),
            swiglu_limit: r.opt(key!(s.swiglu_limit)),
        };
        let cfg = MoeCfg {
            topk_groups: r.pos_or(key!(s.topk_groups), cfg.groups),
            ..cfg
        };
        r.finish()?;
        if !cfg.experts.is_multiple_of(cfg.groups) || cfg.topk_groups > cfg.groups {
            return Err(format!(
                "`groups` ({}) must divide `experts` ({}) and `topk_groups` ({}) cannot exceed it",
                cfg.groups, cfg.experts, cfg.topk_groups
            ));
        }
        if let Some(limit) = cfg.swiglu_limit
            && !(limit.is_finite() && limit > 0.0)
        {
            return Err(format!(
                "`swiglu_limit` must be a positive number, got {limit}"
            ));
        }
        if cfg.groups > 1 && matches!(cfg.router, Router::Softmax | Router::GptOss) {
            return Err(
                "`groups` needs a group-limited `router` (\"deepseek_v2\" or \"deepseek_v3\")"
                    .into(),
            );
        }
        if cfg.router == Router::DeepseekV3 && cfg.experts / cfg.groups < 2 {
            return Err("the \"deepseek_v3\" router ranks groups by their two best experts: each group needs at least 2".into());
        }
        if cfg.top_k > cfg.experts {
            return Err(format!(
                "`top_k` ({}) cannot exceed `experts` ({})",
                cfg.top_k, cfg.experts
            ));
        }
        Ok(cfg)
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3's `DeepseekV3Attention`, `mla`) on `[B, S, H]`:
/// queries through a low-rank `q_a_proj` (`H → q_lora_rank`), its RMSNorm and `q_b_proj`
/// (`→ heads·(qk_nope_head_dim + qk_rope_head_dim)`), or one `q_proj` without `q_lora_rank`;
/// keys and values from one compressed projection `kv_a_proj_with_mqa`
/// (`H → kv_lora_rank + qk_rope_head_dim`), whose latent part is RMS-normalized and whose
/// rotary part is one key head shared by every query head. The KV cache holds these two
/// compressed parts (`[B, 1, S, kv_lora_rank]` and `[B, 1, S, qk_rope_head_dim]`); `kv_b_proj`
/// (`kv_lora_rank → heads·(qk_nope_head_dim + v_head_dim)`) expands the cached latents into
/// per-head keys and values on every forward, and `o_proj` maps `heads·v_head_dim` back to `H`.
/// Needs a `rotary` layer of `head_dim = qk_rope_head_dim` before it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaCfg {
    /// Query heads (as many key and value heads after the expansion).
    pub heads: u64,
    /// Rank of the query compression (`None`: one `q_proj`, DeepSeek-V2-Lite).
    pub q_lora_rank: Option<u64>,
    /// Rank of the key/value compression: the cached latent width.
    pub kv_lora_rank: u64,
    /// Per-head query/key width without rotary embedding.
    pub qk_nope_head_dim: u64,
    /// Per-head query/key width with rotary embedding (the key part is shared by all heads).
    pub qk_rope_head_dim: u64,
    /// Per-head value width.
    pub v_head_dim: u64,
    /// Biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` (`attention_bias`).
    pub bias: bool,
    /// Dropout on the attention probabilities (training only).
    pub dropout: f64,
    /// The compressed latents go through transformers' `DynamicCache` (`use_cache`).
    pub kv_cache: bool,
}

impl MlaCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = MlaCfg {
            heads: r.pos(key!(s.heads)),
            q_lora_rank: r.pos_opt(key!(s.q_lora_rank)),
            kv_lora_rank: r.pos(key!(s.kv_lora_rank)),
            qk_nope_head_dim: r.pos(key!(s.qk_nope_head_dim)),
            qk_rope_head_dim: r.pos(key!(s.qk_rope_head_dim)),
            v_head_dim: r.pos(key!(s.v_head_dim)),
            bias: r.or(key!(s.bias), false),
            dropout: r.prob(key!(s.dropout), 0.0),
            kv_cache: r.or(key!(s.kv_cache), true),
        };
        r.finish()?;
        if !cfg.qk_rope_head_dim.is_multiple_of(2) {
            return Err(format!(
                "`qk_rope_head_dim` must be even for rotary embeddings, got {}",
                cfg.qk_rope_head_dim
            ));
        }
        Ok(cfg)
    }
}

/// `F.scaled_dot_product_attention` of three inputs (queries, keys, values), as diffusers'
/// attention processors call it after building Q, K and V themselves: no projections, no
/// mask, no dropout.
///
/// # Shapes
/// `dim = 1`: `[B, heads, S, head_dim]` each (keys and values `[B, heads, S_kv, head_dim]`),
/// output `[B, heads, S, head_dim_v]`; `dim = 2`: `[B, S, heads, head_dim]` each, transposed to
/// heads-first views and the output transposed back (diffusers' `dispatch_attention_fn`).
/// No parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SdpaCfg {
    /// The heads' dimension: 1 or 2.
    pub heads_dim: usize,
    /// `is_causal`.
    pub causal: bool,
    /// Q and K are rotated first with the last `rotary` layer's tables (Flux's
    /// `apply_rotary_emb` on the joined queries and keys).
    pub rotary: bool,
}

impl SdpaCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let dim = r.or(key!(s.dim), 1);
        let causal = r.or(key!(s.causal), false);
        let rotary = r.or(key!(s.rotary), false);
        r.finish()?;
        let heads_dim = match dim {
            1 => 1,
            2 => 2,
            d => {
                return Err(format!(
                    "`dim` (the heads' dimension) must be 1 ([B, heads, S, head_dim]) or 2 ([B, S, heads, head_dim]), got {d}"
                ));
            }
        };
        Ok(SdpaCfg {
            heads_dim,
            causal,
            rotary,
        })
    }
}

/// DeBERTa-v2's disentangled self-attention (`DisentangledSelfAttention` in transformers'
/// `models/deberta_v2/modeling_deberta_v2.py`) and its output projection
/// (`attention.output.dense`), on `[B, S, H]`: `query_proj`, `key_proj`, `value_proj`
/// (`H → heads·head_dim`, biased), the content scores `q·(kᵀ / √(head_dim·f))` with `f = 1 +
/// c2p + p2c`, plus the relative scores: the relative embeddings of the last
/// `relative_embeddings` layer (`[2·span, H]`, dropped out with `pos_dropout`) projected per head
/// (`pos_key_proj`/`pos_query_proj`, or `key_proj`/`query_proj` again with `share_att_key`) and
/// repeated over the batch; content-to-position `gather(q·pos_kᵀ, -1, c2p_pos)` and
/// position-to-content `gather(k·pos_qᵀ, -1, p2c_pos)ᵀ`, each divided by the scale. The sum
/// is masked (`masked_fill` of the inverted `[B, 1, S, S]` mask), soft-maxed, dropped out and
/// applied to the values; the heads are merged and projected back to `H`.
///
/// Params: `4·(H·heads·head_dim) + 3·heads·head_dim + H`, plus `H·heads·head_dim +
/// heads·head_dim` for each of `pos_key_proj` (c2p) and `pos_query_proj` (p2c) without
/// `share_att_key`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DisentangledAttentionCfg {
    /// Heads.
    pub heads: u64,
    /// Head dimension (default `H / heads`; transformers' `attention_head_size`).
    pub head_dim: Option<u64>,
    /// Content-to-position scores.
    pub c2p: bool,
    /// Position-to-content scores.
    pub p2c: bool,
    /// The relative embeddings go through `query_proj`/`key_proj` (`share_att_key`).
    pub share_att_key: bool,
    /// Relative distance span (`pos_ebd_size`: `position_buckets`, or `max_relative_positions`):
    /// the relative embeddings have `2·span` rows.
    pub span: u64,
    /// Dropout on the attention probabilities (training only).
    pub dropout: f64,
    /// Dropout on the relative embeddings (`pos_dropout`, `hidden_dropout_prob`).
    pub pos_dropout: f64,
}

impl DisentangledAttentionCfg {
    pub(super) fn read(r: &mut KeyReader<'_>) -> Result<Self, String> {
        let s = r.spec();
        let cfg = DisentangledAttentionCfg {
            heads: r.pos(key!(s.heads)),
            head_dim: r.pos_opt(key!(s.head_dim)),
            c2p: r.or(key!(s.c2p), true),
            p2c: r.or(key!(s.p2c), true),
            share_att_key: r.or(key!(s.share_att_key), false),
            span: r.pos(key!(s.num_positions)),
            dropout: r.prob(key!(s.dropout), 0.0),
            pos_dropout: r.prob(key!(s.pos_dropout), 0.0),
        };
        r.finish()?;
        if !cfg.c2p && !cfg.p2c {
            return Err("`c2p` and `p2c` are both false: give at least one relative score (for attention without relative positions use `attention`)".into());
        }
        Ok(cfg)
    }
}
