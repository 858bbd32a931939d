//! The LayerNorm decoders whose layers are not Llama's: GPT-NeoX (Pythia), Phi (phi-1, 1.5, 2),
//! Falcon and BLOOM. Each runs its attention and MLP on LayerNorm outputs (with biases), most of
//! them in parallel: both read the same normalized input and their outputs are summed with the
//! residual once. Each builder follows its transformers modeling file module by module:
//!
//! - GPT-NeoX, `models/gpt_neox/modeling_gpt_neox.py`: `embed_in`, `emb_dropout`, rotary
//!   embedding (partial: `rotary_pct`, the rotated part joined back with `torch.cat`), layers
//!   of `input_layernorm` → `attention` (one fused `query_key_value`) and, with
//!   `use_parallel_residual`, `post_attention_layernorm` of the *layer input* → MLP, summed as
//!   `mlp + attn + hidden`; `final_layer_norm`; an untied `embed_out`.
//! - Phi, `models/phi/modeling_phi.py`: `embed_tokens`, `embed_dropout`, partial rotary, layers of
//!   one `input_layernorm` whose output feeds both `self_attn` (`q_proj`, `k_proj`, `v_proj`,
//!   `dense`, all with biases) and the MLP (`fc1`, act, `fc2`), each through `resid_dropout`,
//!   summed as `attn + ff + residual`; `final_layernorm`; `lm_head` with a bias.
//! - Falcon, `models/falcon/modeling_falcon.py`: `word_embeddings`, rotary (unless `alibi`),
//!   layers whose attention is one fused `query_key_value` of `heads + 2` head widths
//!   (`multi_query`: one shared K/V head), `(heads + 2·num_kv_heads)` (the new decoder
//!   architecture) or `3·heads`; with `parallel_attn` the MLP reads the attention's LayerNorm
//!   output (or its own `ln_mlp` in the new architecture with two norms) and
//!   `mlp_output += attention_output` runs in place; `ln_f`; `lm_head` tied by default.
//! - BLOOM, `models/bloom/modeling_bloom.py`: `word_embeddings`, `word_embeddings_layernorm`,
//!   sequential layers (`input_layernorm`, `self_attention` with one fused `query_key_value`
//!   and ALiBi instead of positions, `post_attention_layernorm`, MLP with `BloomGelu`, the
//!   tanh-approximated GELU that keeps its input); `ln_f`; `lm_head` tied.

use super::Resolved;
use super::config::{Cfg, LnDecoderConfig, layer_count, prob, required};
use super::layers::{
    activation, add, causal_head, embedding, layer, layernorm, linear, module_path, push,
    push_dropout, repeat, with_inputs, with_note,
};
use crate::error::Error;
use crate::spec::{LayerKind as K, LayerSpec, layer_spec};

/// The rotated width of a head: `int(head_dim · factor)` as transformers computes it
/// (`rotary_ndims`).
fn rotary_dims(head_dim: u64, factor: f64) -> u64 {
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let d = (head_dim as f64 * factor) as u64;
    d.max(2)
}

/// The rotary layer of a decoder whose heads rotate `dims` of their width.
fn rotary(name: &str, dims: u64, concat: bool) -> LayerSpec {
    layer_spec! {
        head_dim: Some(dims),
        concat: concat.then_some(true),
        ..layer(K::Rotary, name)
    }
}

/// `partial_rotary_factor` from `rope_parameters`, the top level, or its older name.
fn partial_factor(c: &LnDecoderConfig, old: Option<f64>, default: f64) -> f64 {
    c.rope_parameters
        .as_ref()
        .and_then(|r| r.partial_rotary_factor)
        .or(c.partial_rotary_factor)
        .or(old)
        .unwrap_or(default)
}

/// `hidden / heads`, checked.
fn head_dim(cfg: &Cfg, hidden: u64, heads: u64) -> Result<u64, Error> {
    if hidden.is_multiple_of(heads) {
        Ok(hidden / heads)
    } else {
        Err(cfg.err(format!(
            "`hidden_size` ({hidden}) must be divisible by the number of attention heads ({heads})"
        )))
    }
}

/// `4 × hidden`, checked.
fn four_times(hidden: u64) -> Result<u64, Error> {
    hidden
        .checked_mul(4)
        .ok_or_else(|| Error::Overflow("the MLP width (4 × hidden_size)".into()))
}

/// A two-linear MLP (`fc1`, act, `fc2`) reading `input`; returns the name of its last layer.
#[allow(clippy::too_many_arguments)] // the module names differ per family
fn mlp(
    body: &mut Vec<LayerSpec>,
    input: &str,
    (fc1, act): (&str, LayerSpec),
    fc2: &str,
    width: u64,
    hidden: u64,
    bias: bool,
) -> String {
    push(body, with_inputs(linear(fc1, width, bias), &[input]));
    push(body, act);
    push(body, linear(fc2, hidden, bias))
}

/// GPT-NeoX (`GPTNeoXForCausalLM`, `GPTNeoXForSequenceClassification`, `GPTNeoXModel`); returns
/// the layers and `max_position_embeddings`.
pub(super) fn gpt_neox(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: LnDecoderConfig = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let hidden = required!(cfg, c.hidden_size)?;
    let n_layers = layer_count!(cfg, c.num_hidden_layers)?;
    let heads = required!(cfg, c.num_attention_heads)?;
    let intermediate = required!(cfg, c.intermediate_size)?;
    let hd = head_dim(cfg, hidden, heads)?;
    let positions = c.max_position_embeddings.unwrap_or(2048);
    let act_name = c.hidden_act.as_deref().unwrap_or("gelu");
    let attn_p = prob!(cfg, c.attention_dropout, 0.0)?;
    let hidden_p = prob!(cfg, c.hidden_dropout, 0.0)?;
    let bias = c.attention_bias.unwrap_or(true);
    let parallel = c.use_parallel_residual.unwrap_or(true);
    // GPTNeoXConfig: `rope_parameters.setdefault("partial_rotary_factor", rotary_pct or 0.25)`.
    let rot = rotary_dims(hd, partial_factor(&c, c.rotary_pct, 0.25));

    let p = module_path(head, "gpt_neox");
    let mut out = Vec::new();
    let embed = push(&mut out, embedding(&p("embed_in"), vocab, hidden));
    push_dropout(&mut out, &p("emb_dropout"), hidden_p, embed.clone());
    push(&mut out, rotary(&p("rotary_emb"), rot, true));

    let mut body = Vec::new();
    push(&mut body, layernorm("input_layernorm"));
    let attn = push(
        &mut body,
        with_note(
            layer_spec! {
                heads: Some(heads),
                fused_qkv: Some(true),
                causal: Some(true),
                bias: (!bias).then_some(false),
                rotary: Some(true),
                dropout: (attn_p > 0.0).then_some(attn_p),
                softmax_f32: Some(true),
                ..layer(K::Attention, "attention")
            },
            "query_key_value (fused, viewed per head and chunked) and dense",
        ),
    );
    let attn = push_dropout(&mut body, "post_attention_dropout", hidden_p, attn);
    let act = activation(cfg, "hidden_act", act_name, "mlp.act")?;
    if parallel {
        // `mlp(post_attention_layernorm(hidden_states))`: the layer input, not the attention's.
        let ln = push(
            &mut body,
            with_inputs(layernorm("post_attention_layernorm"), &["input"]),
        );
        let m = mlp(
            &mut body,
            &ln,
            ("mlp.dense_h_to_4h", act),
            "mlp.dense_4h_to_h",
            intermediate,
            hidden,
            true,
        );
        let m = push_dropout(&mut body, "post_mlp_dropout", hidden_p, m);
        let sum = push(&mut body, add("mlp_plus_attn", &m, &attn));
        push(&mut body, add("residual", &sum, "input"));
    } else {
        let residual = push(&mut body, add("residual1", &attn, "input"));
        let ln = push(&mut body, layernorm("post_attention_layernorm"));
        let m = mlp(
            &mut body,
            &ln,
            ("mlp.dense_h_to_4h", act),
            "mlp.dense_4h_to_h",
            intermediate,
            hidden,
            true,
        );
        let m = push_dropout(&mut body, "post_mlp_dropout", hidden_p, m);
        push(&mut body, add("residual2", &m, &residual));
    }
    let tail = Tail {
        blocks: &p("layers"),
        n_layers,
        final_norm: &p("final_layer_norm"),
        head_name: "embed_out",
        vocab,
        bias: false,
        tied_by_default: false,
        embed: &embed,
    };
    tail.finish(&mut out, body, cfg, head)?;
    Ok((out, positions))
}

/// Phi (`PhiForCausalLM`, `PhiForSequenceClassification`, `PhiModel`); returns the layers and
/// `max_position_embeddings`.
pub(super) fn phi(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: LnDecoderConfig = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let hidden = required!(cfg, c.hidden_size)?;
    let n_layers = layer_count!(cfg, c.num_hidden_layers)?;
    let heads = required!(cfg, c.num_attention_heads)?;
    let kv_heads = c.num_key_value_heads.unwrap_or(heads);
    let intermediate = required!(cfg, c.intermediate_size)?;
    let hd = head_dim(cfg, hidden, heads)?;
    let positions = c.max_position_embeddings.unwrap_or(2048);
    let act_name = c.hidden_act.as_deref().unwrap_or("gelu_new");
    let attn_p = prob!(cfg, c.attention_dropout, 0.0)?;
    let resid_p = prob!(cfg, c.resid_pdrop, 0.0)?;
    let embd_p = prob!(cfg, c.embd_pdrop, 0.0)?;
    if c.qk_layernorm.unwrap_or(false) {
        return Err(cfg.err(
            "`qk_layernorm = true` (a LayerNorm on each head's queries and keys) is not supported"
                .into(),
        ));
    }
    // PhiConfig: `kwargs.setdefault("partial_rotary_factor", 0.5)`.
    let rot = rotary_dims(hd, partial_factor(&c, None, 0.5));

    let p = module_path(head, "model");
    let mut out = Vec::new();
    let embed = push(&mut out, embedding(&p("embed_tokens"), vocab, hidden));
    push_dropout(&mut out, &p("embed_dropout"), embd_p, embed.clone());
    push(&mut out, rotary(&p("rotary_emb"), rot, true));

    let mut body = Vec::new();
    let ln = push(&mut body, layernorm("input_layernorm"));
    let attn = push(
        &mut body,
        with_note(
            layer_spec! {
                heads: Some(heads),
                kv_heads: (kv_heads != heads).then_some(kv_heads),
                causal: Some(true),
                rotary: Some(true),
                dropout: (attn_p > 0.0).then_some(attn_p),
                softmax_f32: Some(true),
                ..layer(K::Attention, "self_attn")
            },
            "q_proj, k_proj, v_proj and dense, all with biases",
        ),
    );
    let attn = push_dropout(&mut body, "resid_dropout", resid_p, attn);
    let act = activation(cfg, "hidden_act", act_name, "mlp.activation_fn")?;
    let m = mlp(
        &mut body,
        &ln,
        ("mlp.fc1", act),
        "mlp.fc2",
        intermediate,
        hidden,
        true,
    );
    let m = push_dropout(&mut body, "mlp.resid_dropout", resid_p, m);
    let sum = push(&mut body, add("attn_plus_ff", &attn, &m));
    push(&mut body, add("residual", &sum, "input"));
    let tail = Tail {
        blocks: &p("layers"),
        n_layers,
        final_norm: &p("final_layernorm"),
        head_name: "lm_head",
        vocab,
        bias: true,
        tied_by_default: false,
        embed: &embed,
    };
    tail.finish(&mut out, body, cfg, head)?;
    Ok((out, positions))
}

/// Falcon (`FalconForCausalLM`, `FalconForSequenceClassification`, `FalconModel`); returns the
/// layers and `max_position_embeddings`.
#[allow(clippy::too_many_lines)] // the three layer layouts, in forward order
pub(super) fn falcon(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: LnDecoderConfig = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let hidden = required!(cfg, c.hidden_size)?;
    let n_layers = layer_count!(cfg, c.num_hidden_layers)?;
    let heads = required!(cfg, c.num_attention_heads)?;
    let hd = head_dim(cfg, hidden, heads)?;
    let positions = c.max_position_embeddings.unwrap_or(2048);
    let new_arch = c.new_decoder_architecture.unwrap_or(false);
    let multi_query = c.multi_query.unwrap_or(true);
    let parallel = c.parallel_attn.unwrap_or(true);
    let alibi = c.alibi.unwrap_or(false);
    let bias = c.bias.unwrap_or(false);
    let ffn = match c.ffn_hidden_size {
        Some(n) => n,
        None => four_times(hidden)?,
    };
    let act_name = c.activation.as_deref().unwrap_or("gelu");
    let attn_p = prob!(cfg, c.attention_dropout, 0.0)?;
    let hidden_p = prob!(cfg, c.hidden_dropout, 0.0)?;
    // FalconAttention: the fused projection's K/V heads.
    let kv_heads = if new_arch || !multi_query {
        c.num_kv_heads.unwrap_or(heads)
    } else {
        1
    };
    if !new_arch && !multi_query && kv_heads != heads {
        return Err(cfg.err(format!(
            "`num_kv_heads` = {kv_heads} needs `new_decoder_architecture` or `multi_query` (the original architecture without multi-query has as many K/V heads as query heads)"
        )));
    }
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(cfg.field_err(
            "num_kv_heads",
            format!(
                "`num_attention_heads` ({heads}) must be a multiple of `num_kv_heads` ({kv_heads})"
            ),
        ));
    }
    if c.apply_residual_connection_post_layernorm.unwrap_or(false) {
        return Err(cfg.err(
            "`apply_residual_connection_post_layernorm = true` is not supported for Falcon".into(),
        ));
    }
    // FalconDecoderLayer: the new architecture defaults to two norms.
    let two_norms = new_arch && c.num_ln_in_parallel_attn.unwrap_or(2) == 2;

    let p = module_path(head, "transformer");
    let mut out = Vec::new();
    let embed = push(&mut out, embedding(&p("word_embeddings"), vocab, hidden));
    if !alibi {
        push(&mut out, rotary(&p("rotary_emb"), hd, false));
    }

    let mut body = Vec::new();
    let attn_ln = if two_norms {
        let a = push(&mut body, layernorm("ln_attn"));
        push(&mut body, with_inputs(layernorm("ln_mlp"), &["input"]));
        a
    } else {
        push(&mut body, layernorm("input_layernorm"))
    };
    let note = if alibi {
        "query_key_value (fused) and dense; ALiBi: its [batch·heads, 1, seq] bias, folded into a float [batch, heads, seq, seq] mask, is not counted"
    } else if new_arch {
        "query_key_value (fused: each K/V head after its group of queries) and dense"
    } else if multi_query {
        "query_key_value (fused: all query heads, then one shared key and one value head) and dense"
    } else {
        "query_key_value (fused) and dense"
    };
    let attn = push(
        &mut body,
        with_note(
            layer_spec! {
                heads: Some(heads),
                kv_heads: (kv_heads != heads).then_some(kv_heads),
                fused_qkv: Some(true),
                causal: Some(true),
                bias: (!bias).then_some(false),
                rotary: (!alibi).then_some(true),
                dropout: (alibi && attn_p > 0.0).then_some(attn_p),
                // FalconModel: `create_causal_mask(.., allow_is_causal_skip=False)`.
                bool_mask: Some(true),
                expand_kv: (new_arch && kv_heads != heads).then_some(true),
                ..with_inputs(layer(K::Attention, "self_attention"), &[&attn_ln])
            },
            note,
        ),
    );
    let act = activation(cfg, "activation", act_name, "mlp.act")?;
    if new_arch || parallel {
        let mlp_in = if two_norms {
            "ln_mlp"
        } else {
            attn_ln.as_str()
        };
        let m = mlp(
            &mut body,
            mlp_in,
            ("mlp.dense_h_to_4h", act),
            "mlp.dense_4h_to_h",
            ffn,
            hidden,
            bias,
        );
        // `mlp_output += attention_output`, in place.
        let sum = push(
            &mut body,
            layer_spec! {
                inplace: Some(true),
                ..add("mlp_plus_attn", &m, &attn)
            },
        );
        let sum = push_dropout(&mut body, "hidden_dropout", hidden_p, sum);
        push(&mut body, add("residual", &sum, "input"));
    } else {
        let a = push_dropout(&mut body, "attention_dropout", attn_p, attn);
        let residual = push(&mut body, add("residual1", &a, "input"));
        let ln = push(&mut body, layernorm("post_attention_layernorm"));
        let m = mlp(
            &mut body,
            &ln,
            ("mlp.dense_h_to_4h", act),
            "mlp.dense_4h_to_h",
            ffn,
            hidden,
            bias,
        );
        let m = push_dropout(&mut body, "hidden_dropout", hidden_p, m);
        push(&mut body, add("residual2", &m, &residual));
    }
    let tail = Tail {
        blocks: &p("h"),
        n_layers,
        final_norm: &p("ln_f"),
        head_name: "lm_head",
        vocab,
        bias: false,
        tied_by_default: true,
        embed: &embed,
    };
    tail.finish(&mut out, body, cfg, head)?;
    Ok((out, positions))
}

/// BLOOM (`BloomForCausalLM`, `BloomForSequenceClassification`, `BloomModel`); returns the
/// layers and the default context (BLOOM's ALiBi has no trained limit: 2048).
pub(super) fn bloom(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: LnDecoderConfig = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let hidden = required!(cfg, c.hidden_size)?;
    let n_layers = layer_count!(cfg, c.num_hidden_layers)?;
    let heads = required!(cfg, c.num_attention_heads)?;
    head_dim(cfg, hidden, heads)?;
    let attn_p = prob!(cfg, c.attention_dropout, 0.0)?;
    let hidden_p = prob!(cfg, c.hidden_dropout, 0.0)?;
    let post_ln_residual = c.apply_residual_connection_post_layernorm.unwrap_or(false);
    if c.pretraining_tp.unwrap_or(1) > 1 && c.slow_but_exact.unwrap_or(false) {
        return Err(cfg.err(
            "`pretraining_tp > 1` with `slow_but_exact = true` (sliced linears) is not supported"
                .into(),
        ));
    }

    let p = module_path(head, "transformer");
    let mut out = Vec::new();
    let embed = push(&mut out, embedding(&p("word_embeddings"), vocab, hidden));
    push(&mut out, layernorm(&p("word_embeddings_layernorm")));

    let mut body = Vec::new();
    let ln1 = push(&mut body, layernorm("input_layernorm"));
    let attn = push(
        &mut body,
        with_note(
            layer_spec! {
                heads: Some(heads),
                fused_qkv: Some(true),
                causal: Some(true),
                dropout: (attn_p > 0.0).then_some(attn_p),
                softmax_f32: Some(true),
                ..layer(K::Attention, "self_attention")
            },
            "query_key_value (fused) and dense; always eager: baddbmm of the ALiBi bias, whose [batch·heads, 1, seq] tensor is not counted",
        ),
    );
    let attn = push_dropout(&mut body, "self_attention.hidden_dropout", hidden_p, attn);
    let r1 = if post_ln_residual {
        ln1.as_str()
    } else {
        "input"
    };
    let residual = push(&mut body, add("residual1", &attn, r1));
    let ln2 = push(&mut body, layernorm("post_attention_layernorm"));
    let act = layer_spec! {
        note: Some(
            "BloomGelu (GeLUFunction): tanh-approximated GELU written out in Python, keeps its input"
                .into(),
        ),
        ..layer(K::BloomGelu, "mlp.gelu_impl")
    };
    let m = mlp(
        &mut body,
        &ln2,
        ("mlp.dense_h_to_4h", act),
        "mlp.dense_4h_to_h",
        four_times(hidden)?,
        hidden,
        true,
    );
    let m = push_dropout(&mut body, "mlp.hidden_dropout", hidden_p, m);
    let r2 = if post_ln_residual {
        ln2.as_str()
    } else {
        residual.as_str()
    };
    push(&mut body, add("residual2", &m, r2));
    let tail = Tail {
        blocks: &p("h"),
        n_layers,
        final_norm: &p("ln_f"),
        head_name: "lm_head",
        vocab,
        bias: false,
        tied_by_default: true,
        embed: &embed,
    };
    tail.finish(&mut out, body, cfg, head)?;
    Ok((out, 2048))
}

/// StableLM (`StableLmForCausalLM`, `models/stablelm/modeling_stablelm.py`): LayerNorms, Q/K/V
/// with biases as `use_qkv_bias` says (default false), `o_proj` without, partial rotary
/// (`partial_rotary_factor`, default 0.25, joined back with `cat`), a SiLU-gated MLP without
/// biases, sequential or (`use_parallel_residual`) parallel; `hidden_dropout` on the MLP
/// output; untied head. Returns the layers and `max_position_embeddings`.
pub(super) fn stablelm(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: LnDecoderConfig = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let hidden = required!(cfg, c.hidden_size)?;
    let n_layers = layer_count!(cfg, c.num_hidden_layers)?;
    let heads = required!(cfg, c.num_attention_heads)?;
    let kv_heads = c.num_key_value_heads.unwrap_or(heads);
    let intermediate = required!(cfg, c.intermediate_size)?;
    let hd = head_dim(cfg, hidden, heads)?;
    let positions = c.max_position_embeddings.unwrap_or(4096);
    let act_name = c.hidden_act.as_deref().unwrap_or("silu");
    let attn_p = prob!(cfg, c.attention_dropout, 0.0)?;
    let hidden_p = prob!(cfg, c.hidden_dropout, 0.0)?;
    let qkv_bias = c.use_qkv_bias.unwrap_or(false);
    let parallel = c.use_parallel_residual.unwrap_or(false);
    if c.qk_layernorm.unwrap_or(false) {
        return Err(cfg.err(
            "`qk_layernorm = true` (a LayerNorm per head on the queries and keys) is not supported"
                .into(),
        ));
    }
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(cfg.field_err(
            "num_key_value_heads",
            format!("`num_attention_heads` ({heads}) must be a multiple of `num_key_value_heads` ({kv_heads})"),
        ));
    }
    // StableLmConfig: `kwargs.setdefault("partial_rotary_factor", 0.25)`.
    let rot = rotary_dims(hd, partial_factor(&c, None, 0.25));

    let p = module_path(head, "model");
    let mut out = Vec::new();
    let embed = push(&mut out, embedding(&p("embed_tokens"), vocab, hidden));
    push(&mut out, rotary(&p("rotary_emb"), rot, true));

    let mut body = Vec::new();
    let ln = push(&mut body, layernorm("input_layernorm"));
    let attn = push(
        &mut body,
        layer_spec! {
            heads: Some(heads),
            kv_heads: (kv_heads != heads).then_some(kv_heads),
            causal: Some(true),
            bias: (!qkv_bias).then_some(false),
            out_bias: qkv_bias.then_some(false),
            rotary: Some(true),
            dropout: (attn_p > 0.0).then_some(attn_p),
            softmax_f32: Some(true),
            ..layer(K::Attention, "self_attn")
        },
    );
    let (mlp_in, residual) = if parallel {
        (ln, String::new())
    } else {
        let r = push(&mut body, add("residual1", "input", &attn));
        (push(&mut body, layernorm("post_attention_layernorm")), r)
    };
    push(
        &mut body,
        with_inputs(linear("mlp.gate_proj", intermediate, false), &[&mlp_in]),
    );
    let act = push(
        &mut body,
        activation(cfg, "hidden_act", act_name, "mlp.act_fn")?,
    );
    let up = push(
        &mut body,
        with_inputs(linear("mlp.up_proj", intermediate, false), &[&mlp_in]),
    );
    push(
        &mut body,
        with_inputs(layer(K::Mul, "mlp.gate_mul_up"), &[&act, &up]),
    );
    let m = push(&mut body, linear("mlp.down_proj", hidden, false));
    let m = push_dropout(&mut body, "dropout", hidden_p, m);
    if parallel {
        // `residual + self_attn_output + mlp_output`.
        let sum = push(&mut body, add("residual_plus_attn", "input", &attn));
        push(&mut body, add("residual", &sum, &m));
    } else {
        push(&mut body, add("residual2", &residual, &m));
    }
    let tail = Tail {
        blocks: &p("layers"),
        n_layers,
        final_norm: &p("norm"),
        head_name: "lm_head",
        vocab,
        bias: false,
        tied_by_default: false,
        embed: &embed,
    };
    tail.finish(&mut out, body, cfg, head)?;
    Ok((out, positions))
}

/// StarCoder2 (`Starcoder2ForCausalLM`, `models/starcoder2/modeling_starcoder2.py`): pre-norm
/// LayerNorms, Q/K/V/O and the MLP's `c_fc`, `c_proj` with biases as `use_bias` says (default
/// true), full rotary, `residual_dropout` on the attention and MLP outputs,
/// `embedding_dropout`, `sliding_window`; LM head tied by default. Returns the layers and
/// `max_position_embeddings`.
pub(super) fn starcoder2(cfg: &Cfg, head: Resolved) -> Result<(Vec<LayerSpec>, u64), Error> {
    let c: LnDecoderConfig = cfg.read()?;
    let vocab = required!(cfg, c.vocab_size)?;
    let hidden = required!(cfg, c.hidden_size)?;
    let n_layers = layer_count!(cfg, c.num_hidden_layers)?;
    let heads = required!(cfg, c.num_attention_heads)?;
    let kv_heads = c.num_key_value_heads.unwrap_or(2);
    let intermediate = required!(cfg, c.intermediate_size)?;
    let hd = head_dim(cfg, hidden, heads)?;
    let positions = c.max_position_embeddings.unwrap_or(4096);
    let act_name = c.hidden_act.as_deref().unwrap_or("gelu_pytorch_tanh");
    let attn_p = prob!(cfg, c.attention_dropout, 0.0)?;
    let resid_p = prob!(cfg, c.residual_dropout, 0.0)?;
    let embd_p = prob!(cfg, c.embedding_dropout, 0.0)?;
    let bias = c.use_bias.unwrap_or(true);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(cfg.field_err(
            "num_key_value_heads",
            format!("`num_attention_heads` ({heads}) must be a multiple of `num_key_value_heads` ({kv_heads})"),
        ));
    }

    let p = module_path(head, "model");
    let mut out = Vec::new();
    let embed = push(&mut out, embedding(&p("embed_tokens"), vocab, hidden));
    push_dropout(&mut out, &p("embedding_dropout"), embd_p, embed.clone());
    push(&mut out, rotary(&p("rotary_emb"), hd, false));

    let mut body = Vec::new();
    push(&mut body, layernorm("input_layernorm"));
    let attn = push(
        &mut body,
        layer_spec! {
            heads: Some(heads),
            kv_heads: (kv_heads != heads).then_some(kv_heads),
            causal: Some(true),
            bias: (!bias).then_some(false),
            rotary: Some(true),
            dropout: (attn_p > 0.0).then_some(attn_p),
            softmax_f32: Some(true),
            sliding_window: c.sliding_window.filter(|&w| w > 0),
            ..layer(K::Attention, "self_attn")
        },
    );
    let attn = push_dropout(&mut body, "self_attn.residual_dropout", resid_p, attn);
    let residual = push(&mut body, add("residual1", "input", &attn));
    let ln = push(&mut body, layernorm("post_attention_layernorm"));
    let act = activation(cfg, "hidden_act", act_name, "mlp.act")?;
    let m = mlp(
        &mut body,
        &ln,
        ("mlp.c_fc", act),
        "mlp.c_proj",
        intermediate,
        hidden,
        bias,
    );
    let m = push_dropout(&mut body, "mlp.residual_dropout", resid_p, m);
    push(&mut body, add("residual2", &residual, &m));
    let tail = Tail {
        blocks: &p("layers"),
        n_layers,
        final_norm: &p("norm"),
        head_name: "lm_head",
        vocab,
        bias: false,
        tied_by_default: true,
        embed: &embed,
    };
    tail.finish(&mut out, body, cfg, head)?;
    Ok((out, positions))
}

/// The tail every family here ends with: the repeated decoder blocks, the final LayerNorm, and
/// the causal head under its module name (`embed_out`, `lm_head`), with a bias (Phi) or tied to
/// the embedding when `tie_word_embeddings` (default: the family's) says so.
struct Tail<'a> {
    /// Module path of the blocks (`model.layers`, `transformer.h`).
    blocks: &'a str,
    /// `num_hidden_layers`.
    n_layers: u64,
    /// Module path of the final LayerNorm.
    final_norm: &'a str,
    /// The head's module name.
    head_name: &'a str,
    /// `vocab_size`: the head's output features.
    vocab: u64,
    /// Whether the head has a bias.
    bias: bool,
    /// The family's default for `tie_word_embeddings`.
    tied_by_default: bool,
    /// The token embedding the head may share its weight with.
    embed: &'a String,
}

impl Tail<'_> {
    fn finish(
        self,
        out: &mut Vec<LayerSpec>,
        body: Vec<LayerSpec>,
        cfg: &Cfg,
        head: Resolved,
    ) -> Result<(), Error> {
        push(
            out,
            repeat(self.blocks, "num_hidden_layers", self.n_layers, body),
        );
        push(out, layernorm(self.final_norm));
        let tie = cfg.tie(self.tied_by_default).then_some(self.embed.as_str());
        causal_head(out, cfg, head, self.vocab, tie)?;
        if let Some(lm) = out
            .iter_mut()
            .find(|l| l.name.as_deref() == Some("lm_head"))
        {
            lm.name = Some(self.head_name.to_string());
            lm.bias = (!self.bias).then_some(false);
        }
        Ok(())
    }
}
