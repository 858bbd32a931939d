//! diffusers' `UNet2DConditionModel` (Stable Diffusion 1.x/2.x and SDXL), read from its
//! `config.json` (the `_class_name` key `ConfigMixin` writes), module by module in the order
//! `UNet2DConditionModel.forward` runs them (diffusers 0.42: `models/unets/unet_2d_condition.py`,
//! `unet_2d_blocks.py`, `resnet.py`, `transformers/transformer_2d.py`, `attention.py`,
//! `attention_processor.py`'s `AttnProcessor2_0`, `activations.py`'s `GEGLU`,
//! `embeddings.py`).
//!
//! The model reads three inputs: the noisy latent `sample` `[batch, in_channels, h, w]` (the
//! model's input, `h = w = sample_size` by default), the text encoder's states
//! `encoder_hidden_states` `[batch, seq, cross_attention_dim]` (`--seq`, 77 by default: CLIP's
//! context) and `t_emb` `[batch, block_out_channels[0]]`, the sinusoidal embedding of the
//! timestep (`Timesteps`: `arange`, `exp`, `sin`, `cos` and `cat` on the timestep, none of which
//! needs a gradient, cast to the model's dtype). SDXL's `addition_embed_type: "text_time"` adds
//! `add_embeds` `[batch, projection_class_embeddings_input_dim]`, the pooled text embedding
//! joined to the sinusoidal embedding of the six size/crop ids, likewise without gradient.
//! Taking `t_emb` and `add_embeds` as inputs leaves out those small `[batch, 320]`-sized
//! tensors made before the first linear layer.

use serde::Deserialize;

use super::config::{Cfg, Header, OneOrTwo};
use super::layers::{activation, add, layer, linear, push, push_dropout, with_inputs};
use crate::error::Error;
use crate::spec::{
    DefaultsSpec, DimSpec, FillMode, InputSpec, LayerKind as K, LayerSpec, ModelSpec, Pair, Sizes,
    layer_spec,
};
use crate::vocab::AttentionImpl;

/// The `_class_name`s memest builds.
pub(super) const CLASSES: &[&str] = &[
    "FluxTransformer2DModel",
    "SD3Transformer2DModel",
    "UNet2DConditionModel",
];

/// The `UNet2DConditionModel` config keys memest reads (`UNet2DConditionModel.__init__`'s
/// arguments); unknown keys are ignored.
#[derive(Debug, Default, Deserialize)]
struct UnetConfig {
    sample_size: Option<OneOrTwo>,
    in_channels: Option<u64>,
    out_channels: Option<u64>,
    center_input_sample: Option<bool>,
    down_block_types: Option<Vec<String>>,
    mid_block_type: Option<Option<String>>,
    up_block_types: Option<Vec<String>>,
    only_cross_attention: Option<OneOrTwo<bool>>,
    block_out_channels: Option<Vec<u64>>,
    layers_per_block: Option<OneOrTwo>,
    downsample_padding: Option<u64>,
    mid_block_scale_factor: Option<f64>,
    dropout: Option<f64>,
    act_fn: Option<String>,
    norm_num_groups: Option<Option<u64>>,
    cross_attention_dim: Option<OneOrTwo>,
    transformer_layers_per_block: Option<serde_json::Value>,
    reverse_transformer_layers_per_block: Option<serde_json::Value>,
    encoder_hid_dim: Option<u64>,
    attention_head_dim: Option<OneOrTwo>,
    num_attention_heads: Option<serde_json::Value>,
    dual_cross_attention: Option<bool>,
    use_linear_projection: Option<bool>,
    class_embed_type: Option<String>,
    addition_embed_type: Option<String>,
    addition_time_embed_dim: Option<u64>,
    num_class_embeds: Option<u64>,
    resnet_time_scale_shift: Option<String>,
    resnet_skip_time_act: Option<bool>,
    time_embedding_type: Option<String>,
    time_embedding_dim: Option<u64>,
    time_embedding_act_fn: Option<String>,
    timestep_post_act: Option<String>,
    time_cond_proj_dim: Option<u64>,
    conv_in_kernel: Option<u64>,
    conv_out_kernel: Option<u64>,
    projection_class_embeddings_input_dim: Option<u64>,
    attention_type: Option<String>,
    class_embeddings_concat: Option<bool>,
    mid_block_only_cross_attention: Option<bool>,
    cross_attention_norm: Option<String>,
}

/// What the UNet reads besides its `sample`.
pub(super) struct Unet {
    pub layers: Vec<LayerSpec>,
    /// `sample`: `[in_channels, h, w]`.
    pub sample: [u64; 3],
    /// `encoder_hidden_states`' width (`cross_attention_dim`).
    pub cross_attention_dim: u64,
    /// `t_emb`'s width (`block_out_channels[0]`).
    pub time_proj_dim: u64,
    /// SDXL's `add_embeds` width (`projection_class_embeddings_input_dim`).
    pub add_embeds: Option<u64>,
}

/// The named inputs of a [`Unet`] (`[inputs.NAME]`), the model dtype unless said.
pub(super) fn named_inputs(u: &Unet) -> std::collections::BTreeMap<String, InputSpec> {
    let mut m = std::collections::BTreeMap::new();
    m.insert(
        ENCODER_STATES.to_string(),
        InputSpec {
            shape: vec![DimSpec::Seq, DimSpec::Fixed(u.cross_attention_dim)],
            dtype: None,
        },
    );
    m.insert(
        T_EMB.to_string(),
        InputSpec {
            shape: vec![DimSpec::Fixed(u.time_proj_dim)],
            dtype: None,
        },
    );
    if let Some(w) = u.add_embeds {
        m.insert(
            ADD_EMBEDS.to_string(),
            InputSpec {
                shape: vec![DimSpec::Fixed(w)],
                dtype: None,
            },
        );
    }
    m
}

const ENCODER_STATES: &str = "encoder_hidden_states";
const T_EMB: &str = "t_emb";
const ADD_EMBEDS: &str = "add_embeds";

/// A per-block list written as one value or one per down block (`attention_head_dim: 8`,
/// `[5, 10, 20, 20]`).
fn per_block(
    cfg: &Cfg,
    key: &str,
    v: Option<&OneOrTwo>,
    default: u64,
    n: usize,
) -> Result<Vec<u64>, Error> {
    match v.map(|v| v.0.as_slice()) {
        None => Ok(vec![default; n]),
        Some([one]) => Ok(vec![*one; n]),
        Some(list) if list.len() == n => Ok(list.to_vec()),
        Some(list) => Err(cfg.field_err(
            key,
            format!(
                "`{key}` has {} entries for {n} down blocks; give one value or one per block",
                list.len()
            ),
        )),
    }
}

/// `transformer_layers_per_block`: one count, or one per down block (a list of lists, one
/// count per layer, is not supported).
fn per_block_json(
    cfg: &Cfg,
    key: &str,
    v: Option<&serde_json::Value>,
    n: usize,
) -> Result<Option<Vec<u64>>, Error> {
    let bad = || {
        cfg.field_err(
            key,
            format!("`{key}` must be a whole number or one per down block ({n} entries)"),
        )
    };
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Number(x)) => Ok(Some(vec![x.as_u64().ok_or_else(bad)?; n])),
        Some(serde_json::Value::Array(a)) if a.len() == n => a
            .iter()
            .map(|x| x.as_u64().ok_or_else(bad))
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(bad()),
    }
}

fn conv(name: &str, out: u64, kernel: u64, stride: u64, padding: u64) -> LayerSpec {
    layer_spec! {
        out_channels: Some(out),
        kernel: Some(Sizes(vec![kernel])),
        stride: (stride != 1).then(|| Sizes(vec![stride])),
        padding: (padding != 0).then(|| Sizes(vec![padding])),
        ..layer(K::Conv2d, name)
    }
}

fn group_norm(name: &str, groups: u64) -> LayerSpec {
    layer_spec! {
        num_groups: Some(groups),
        ..layer(K::GroupNorm, name)
    }
}

fn reshape(name: &str, shape: &[i64]) -> LayerSpec {
    layer_spec! {
        shape: Some(shape.to_vec()),
        ..layer(K::Reshape, name)
    }
}

fn permute(name: &str, dims: &[i64]) -> LayerSpec {
    layer_spec! {
        dims: Some(dims.to_vec()),
        ..layer(K::Permute, name)
    }
}

fn scale(name: &str, factor: f64) -> LayerSpec {
    layer_spec! {
        factor: Some(factor),
        ..layer(K::Scale, name)
    }
}

fn narrow(name: &str, input: &str, start: i64, length: u64) -> LayerSpec {
    with_inputs(
        layer_spec! {
            dim: Some(-1),
            start: Some(start),
            length: Some(length),
            ..layer(K::Narrow, name)
        },
        &[input],
    )
}

/// A size as a tensor dimension (`i64`), refused naming `key` past `i64::MAX`.
fn dim(cfg: &Cfg, key: &str, v: u64) -> Result<i64, Error> {
    i64::try_from(v).map_err(|_| {
        cfg.field_err(
            key,
            format!("`{key}` gives {v}, more than a tensor dimension holds"),
        )
    })
}

/// The UNet's builder state: the layers so far and the settings every block shares.
struct Builder<'a> {
    cfg: &'a Cfg<'a>,
    out: Vec<LayerSpec>,
    groups: u64,
    act: String,
    dropout: f64,
    use_linear_projection: bool,
    /// The time embedding every resnet reads (`emb`).
    emb: String,
}

impl Builder<'_> {
    fn act(&mut self, name: &str, input: &str) -> Result<String, Error> {
        let l = activation(self.cfg, "act_fn", &self.act, name)?;
        Ok(push(&mut self.out, with_inputs(l, &[input])))
    }

    /// `ResnetBlock2D` (`time_embedding_norm = "default"`): `norm1`, act, `conv1`, the time
    /// embedding (act, `time_emb_proj`, `[:, :, None, None]`) added, `norm2`, act, dropout,
    /// `conv2`, the shortcut (a 1×1 `conv_shortcut` when the channels change) added, and the sum
    /// divided by `output_scale_factor` (`(input_tensor + hidden_states) / factor`: a new tensor
    /// even for 1.0). Returns the output's name.
    fn resnet(
        &mut self,
        p: &str,
        input: &str,
        in_ch: u64,
        out_ch: u64,
        factor: f64,
    ) -> Result<String, Error> {
        let g = self.groups;
        let n1 = push(
            &mut self.out,
            with_inputs(group_norm(&format!("{p}.norm1"), g), &[input]),
        );
        let a1 = self.act(&format!("{p}.act1"), &n1)?;
        let c1 = push(
            &mut self.out,
            with_inputs(conv(&format!("{p}.conv1"), out_ch, 3, 1, 1), &[&a1]),
        );
        let emb = self.emb.clone();
        let ta = self.act(&format!("{p}.time_act"), &emb)?;
        push(
            &mut self.out,
            with_inputs(linear(&format!("{p}.time_emb_proj"), out_ch, true), &[&ta]),
        );
        let tv = push(
            &mut self.out,
            reshape(&format!("{p}.time_emb_view"), &[-1, 1, 1]),
        );
        push(&mut self.out, add(&format!("{p}.add_time"), &c1, &tv));
        let n2 = push(&mut self.out, group_norm(&format!("{p}.norm2"), g));
        let a2 = self.act(&format!("{p}.act2"), &n2)?;
        let d = push_dropout(&mut self.out, &format!("{p}.dropout"), self.dropout, a2);
        let c2 = push(
            &mut self.out,
            with_inputs(conv(&format!("{p}.conv2"), out_ch, 3, 1, 1), &[&d]),
        );
        let short = if in_ch == out_ch {
            input.to_string()
        } else {
            push(
                &mut self.out,
                with_inputs(
                    conv(&format!("{p}.conv_shortcut"), out_ch, 1, 1, 0),
                    &[input],
                ),
            )
        };
        let sum = push(&mut self.out, add(&format!("{p}.add"), &short, &c2));
        Ok(push(
            &mut self.out,
            with_inputs(scale(&format!("{p}.output_scale"), 1.0 / factor), &[&sum]),
        ))
    }

    /// `Transformer2DModel` on continuous input (`norm_type = "layer_norm"`): GroupNorm, the
    /// input projection (a 1×1 conv before flattening, or a linear after it with
    /// `use_linear_projection`), `layers` `BasicTransformerBlock`s, the output projection and
    /// the residual. `[B, C, h, w] → [B, C, h, w]`.
    #[allow(clippy::too_many_arguments)] // the block's sizes, as diffusers passes them
    fn transformer(
        &mut self,
        p: &str,
        input: &str,
        ch: u64,
        heads: u64,
        layers: u64,
        hw: (u64, u64),
    ) -> Result<String, Error> {
        let cfg = self.cfg;
        // `Transformer2DModel(num_attention_heads, out_channels // num_attention_heads, ..)`.
        let head_dim = ch / heads;
        if head_dim == 0 {
            return Err(cfg.field_err(
                "attention_head_dim",
                format!("{heads} attention heads over {ch} channels leave no channel per head"),
            ));
        }
        let inner = heads * head_dim;
        let inner_d = dim(cfg, "block_out_channels", inner)?;
        let (h, w) = (
            dim(cfg, "sample_size", hw.0)?,
            dim(cfg, "sample_size", hw.1)?,
        );
        push(
            &mut self.out,
            with_inputs(group_norm(&format!("{p}.norm"), self.groups), &[input]),
        );
        // `permute(0, 2, 3, 1).reshape(batch, h·w, inner)`, after a 1×1 conv `proj_in` or
        // before a linear one.
        let proj_in = if self.use_linear_projection {
            linear(&format!("{p}.proj_in"), inner, true)
        } else {
            conv(&format!("{p}.proj_in"), inner, 1, 1, 0)
        };
        let flatten = [
            permute(&format!("{p}.permute_in"), &[0, 2, 3, 1]),
            reshape(&format!("{p}.flatten_in"), &[-1, inner_d]),
        ];
        if self.use_linear_projection {
            self.out.extend(flatten);
            self.out.push(proj_in);
        } else {
            self.out.push(proj_in);
            self.out.extend(flatten);
        }
        let body = self.basic_block(heads, head_dim, inner)?;
        let name = if layers == 1 {
            format!("{p}.transformer_blocks.0")
        } else {
            format!("{p}.transformer_blocks")
        };
        push(
            &mut self.out,
            super::layers::repeat(&name, "transformer_layers_per_block", layers, body),
        );
        // `reshape(b, h, w, inner).permute(0, 3, 1, 2).contiguous()`: the reshape of a
        // permuted tensor to its own shape is the `contiguous()` copy.
        let unflatten = |b: &mut Self, what: &str| {
            push(
                &mut b.out,
                reshape(&format!("{p}.unflatten_{what}"), &[h, w, inner_d]),
            );
            push(
                &mut b.out,
                permute(&format!("{p}.permute_{what}"), &[0, 3, 1, 2]),
            );
            push(
                &mut b.out,
                reshape(&format!("{p}.contiguous_{what}"), &[inner_d, h, w]),
            )
        };
        if self.use_linear_projection {
            push(&mut self.out, linear(&format!("{p}.proj_out"), ch, true));
            unflatten(self, "out");
        } else {
            unflatten(self, "out");
            push(&mut self.out, conv(&format!("{p}.proj_out"), ch, 1, 1, 0));
        }
        let last = self
            .out
            .last()
            .and_then(|l| l.name.clone())
            .unwrap_or_default();
        Ok(push(&mut self.out, add(&format!("{p}.add"), &last, input)))
    }

    /// One `BasicTransformerBlock` (`norm_type = "layer_norm"`, GEGLU feed-forward) on
    /// `[B, h·w, inner]`: self-attention, cross-attention on `encoder_hidden_states`, each
    /// through `AttnProcessor2_0` (`to_q`/`to_k`/`to_v` without bias, SDPA, `to_out[0]` with
    /// bias, then `/ rescale_output_factor`, a new tensor), and `GEGLU`: `proj` to twice the
    /// width, `chunk(2)`, `hidden * gelu(gate)`, then `net.2`.
    fn basic_block(&self, heads: u64, head_dim: u64, inner: u64) -> Result<Vec<LayerSpec>, Error> {
        let mut b = Vec::new();
        let attn = |name: &str, kind: K| {
            layer_spec! {
                heads: Some(heads),
                head_dim: Some(head_dim),
                bias: Some(false),
                out_bias: Some(true),
                kv_cache: (kind == K::CrossAttention).then_some(false),
                ..layer(kind, name)
            }
        };
        push(&mut b, layer(K::LayerNorm, "norm1"));
        push(&mut b, attn("attn1", K::Attention));
        push(&mut b, scale("attn1.rescale_output", 1.0));
        push(&mut b, add("add1", "attn1.rescale_output", "input"));
        push(&mut b, layer(K::LayerNorm, "norm2"));
        push(
            &mut b,
            with_inputs(attn("attn2", K::CrossAttention), &["norm2", ENCODER_STATES]),
        );
        push(&mut b, scale("attn2.rescale_output", 1.0));
        push(&mut b, add("add2", "attn2.rescale_output", "add1"));
        push(&mut b, layer(K::LayerNorm, "norm3"));
        let ff = inner
            .checked_mul(4)
            .ok_or_else(|| self.cfg.err("the feed-forward width overflows".into()))?;
        push(&mut b, linear("ff.net.0.proj", 2 * ff, true));
        push(&mut b, narrow("ff.hidden", "ff.net.0.proj", 0, ff));
        let ff_d = dim(self.cfg, "block_out_channels", ff)?;
        push(&mut b, narrow("ff.gate", "ff.net.0.proj", ff_d, ff));
        push(&mut b, layer(K::Gelu, "ff.gelu"));
        push(
            &mut b,
            with_inputs(layer(K::Mul, "ff.mul"), &["ff.hidden", "ff.gelu"]),
        );
        push(&mut b, linear("ff.net.2", inner, true));
        push(&mut b, add("add3", "ff.net.2", "add2"));
        Ok(b)
    }

    /// `TimestepEmbedding`: `linear_1`, act, `linear_2`.
    fn time_embedding(&mut self, p: &str, input: &str, width: u64) -> Result<String, Error> {
        push(
            &mut self.out,
            with_inputs(linear(&format!("{p}.linear_1"), width, true), &[input]),
        );
        let last = self
            .out
            .last()
            .and_then(|l| l.name.clone())
            .unwrap_or_default();
        self.act(&format!("{p}.act"), &last)?;
        Ok(push(
            &mut self.out,
            linear(&format!("{p}.linear_2"), width, true),
        ))
    }
}

/// One entry of the skip connections (`down_block_res_samples`): its layer, channels, size.
struct Skip {
    name: String,
    ch: u64,
    hw: (u64, u64),
}

/// The pixels per latent element of Stable Diffusion's VAE (`vae_scale_factor`).
pub(super) const VAE_SCALE: u64 = 8;

/// Builds `UNet2DConditionModel` for a latent of `latent` `(height, width)`, `sample_size` when
/// `None`.
#[allow(clippy::too_many_lines)] // the model's forward, block by block
pub(super) fn unet(cfg: &Cfg, latent: Option<(u64, u64)>) -> Result<Unet, Error> {
    let c: UnetConfig = cfg.read()?;
    let refuse = |key: &str, what: &str| {
        Err(cfg.field_err(key, format!("`{key}`: {what} is not supported yet")))
    };
    // Keys whose non-default values change the model in ways memest does not build.
    if c.center_input_sample == Some(true) {
        return refuse("center_input_sample", "true");
    }
    if c.only_cross_attention
        .as_ref()
        .is_some_and(|o| o.0.iter().any(|b| *b))
    {
        return refuse("only_cross_attention", "true");
    }
    if c.dual_cross_attention == Some(true) {
        return refuse("dual_cross_attention", "true");
    }
    if c.mid_block_only_cross_attention == Some(true) {
        return refuse("mid_block_only_cross_attention", "true");
    }
    for (key, v) in [
        ("class_embed_type", c.class_embed_type.as_deref()),
        ("cross_attention_norm", c.cross_attention_norm.as_deref()),
        ("timestep_post_act", c.timestep_post_act.as_deref()),
        ("time_embedding_act_fn", c.time_embedding_act_fn.as_deref()),
    ] {
        if let Some(v) = v {
            return refuse(key, &format!("\"{v}\""));
        }
    }
    for (key, v) in [
        ("encoder_hid_dim", c.encoder_hid_dim),
        ("num_class_embeds", c.num_class_embeds),
        ("time_cond_proj_dim", c.time_cond_proj_dim),
    ] {
        if let Some(v) = v {
            return refuse(key, &v.to_string());
        }
    }
    if c.class_embeddings_concat == Some(true) {
        return refuse("class_embeddings_concat", "true");
    }
    for (key, v, default) in [
        (
            "resnet_time_scale_shift",
            c.resnet_time_scale_shift.as_deref(),
            "default",
        ),
        (
            "time_embedding_type",
            c.time_embedding_type.as_deref(),
            "positional",
        ),
        ("attention_type", c.attention_type.as_deref(), "default"),
    ] {
        if let Some(v) = v.filter(|v| *v != default) {
            return refuse(key, &format!("\"{v}\""));
        }
    }
    if c.resnet_skip_time_act == Some(true) {
        return refuse("resnet_skip_time_act", "true");
    }
    if c.reverse_transformer_layers_per_block
        .as_ref()
        .is_some_and(|v| !v.is_null())
    {
        return refuse("reverse_transformer_layers_per_block", "a value");
    }
    if c.num_attention_heads.as_ref().is_some_and(|v| !v.is_null()) {
        // UNet2DConditionModel.__init__ raises for it too (#2011): heads come from
        // `attention_head_dim`.
        return refuse(
            "num_attention_heads",
            "a value (diffusers reads heads from `attention_head_dim`)",
        );
    }
    let aug = match c.addition_embed_type.as_deref() {
        None => None,
        Some("text_time") => {
            let w = cfg.required(
                "projection_class_embeddings_input_dim",
                c.projection_class_embeddings_input_dim,
            )?;
            cfg.required("addition_time_embed_dim", c.addition_time_embed_dim)?;
            Some(w)
        }
        Some(other) => return refuse("addition_embed_type", &format!("\"{other}\"")),
    };

    let boc = c
        .block_out_channels
        .clone()
        .unwrap_or_else(|| vec![320, 640, 1280, 1280]);
    // `UNet2DConditionModel.__init__`'s defaults: three cross-attention levels and a plain one.
    let default_types = |attn: &str, plain: &str, plain_first: bool| {
        let mut v = vec![attn.to_string(); 3];
        v.insert(if plain_first { 0 } else { 3 }, plain.to_string());
        v
    };
    let down_types: Vec<String> = c
        .down_block_types
        .clone()
        .unwrap_or_else(|| default_types("CrossAttnDownBlock2D", "DownBlock2D", false));
    let up_types: Vec<String> = c
        .up_block_types
        .clone()
        .unwrap_or_else(|| default_types("CrossAttnUpBlock2D", "UpBlock2D", true));
    for (key, types, ok) in [
        (
            "down_block_types",
            &down_types,
            ["CrossAttnDownBlock2D", "DownBlock2D"],
        ),
        (
            "up_block_types",
            &up_types,
            ["CrossAttnUpBlock2D", "UpBlock2D"],
        ),
    ] {
        if let Some(t) = types.iter().find(|t| !ok.contains(&t.as_str())) {
            return Err(cfg.field_err(
                key,
                format!(
                    "`{key}`: block `{t}` is not supported yet (supported: {})",
                    ok.join(", ")
                ),
            ));
        }
    }
    let n = boc.len();
    if n == 0 || down_types.len() != n || up_types.len() != n {
        return Err(cfg.field_err(
            "block_out_channels",
            format!(
                "`block_out_channels` ({n}), `down_block_types` ({}) and `up_block_types` ({}) must have the same number of entries, at least one",
                down_types.len(),
                up_types.len()
            ),
        ));
    }
    for (i, ch) in boc.iter().enumerate() {
        cfg.required(&format!("block_out_channels.{i}"), Some(*ch))?;
    }
    let mid = match &c.mid_block_type {
        None => true,
        Some(None) => false,
        Some(Some(t)) if t == "UNetMidBlock2DCrossAttn" => true,
        Some(Some(t)) => {
            return Err(cfg.field_err(
                "mid_block_type",
                format!("`mid_block_type`: `{t}` is not supported yet (supported: UNetMidBlock2DCrossAttn, null)"),
            ));
        }
    };
    let in_ch = cfg.required("in_channels", Some(c.in_channels.unwrap_or(4)))?;
    let out_ch = cfg.required("out_channels", Some(c.out_channels.unwrap_or(4)))?;
    let groups = match c.norm_num_groups {
        None => 32,
        Some(Some(g)) => cfg.required("norm_num_groups", Some(g))?,
        Some(None) => return refuse("norm_num_groups", "null (no GroupNorm)"),
    };
    let act = c.act_fn.clone().unwrap_or_else(|| "silu".into());
    let dropout = cfg.prob("dropout", c.dropout, 0.0)?;
    let layers_per_block = per_block(cfg, "layers_per_block", c.layers_per_block.as_ref(), 2, n)?;
    let heads = per_block(
        cfg,
        "attention_head_dim",
        c.attention_head_dim.as_ref(),
        8,
        n,
    )?;
    let cross = per_block(
        cfg,
        "cross_attention_dim",
        c.cross_attention_dim.as_ref(),
        1280,
        n,
    )?;
    if cross.iter().any(|d| *d != cross[0]) {
        return refuse("cross_attention_dim", "a different width per block");
    }
    let cross_dim = cfg.required("cross_attention_dim", Some(cross[0]))?;
    let tlpb = per_block_json(
        cfg,
        "transformer_layers_per_block",
        c.transformer_layers_per_block.as_ref(),
        n,
    )?
    .unwrap_or_else(|| vec![1; n]);
    for (i, v) in layers_per_block
        .iter()
        .chain(&heads)
        .chain(&tlpb)
        .enumerate()
    {
        let key = [
            "layers_per_block",
            "attention_head_dim",
            "transformer_layers_per_block",
        ][i / n];
        cfg.layers(key, Some(*v))?;
    }
    let kernel = |key: &str, v: Option<u64>| -> Result<u64, Error> {
        let k = cfg.required(key, Some(v.unwrap_or(3)))?;
        if k % 2 == 0 {
            return Err(cfg.field_err(
                key,
                format!("`{key}` = {k}: only odd kernels keep the size"),
            ));
        }
        Ok(k)
    };
    let k_in = kernel("conv_in_kernel", c.conv_in_kernel)?;
    let k_out = kernel("conv_out_kernel", c.conv_out_kernel)?;
    let pad_down = c.downsample_padding.unwrap_or(1);
    if pad_down > 1 {
        return refuse("downsample_padding", &pad_down.to_string());
    }
    let size = match c.sample_size.as_ref().map(|s| s.0.as_slice()) {
        None => (64, 64),
        Some([s]) => (*s, *s),
        Some([h, w]) => (*h, *w),
        Some(other) => {
            return Err(cfg.field_err(
                "sample_size",
                format!("`sample_size` = {other:?}: expected a size or [height, width]"),
            ));
        }
    };
    let size = latent.unwrap_or(size);
    for side in [size.0, size.1] {
        cfg.required("sample_size", Some(side))?;
        dim(cfg, "sample_size", side)?;
    }
    let time_dim = match c.time_embedding_dim {
        Some(d) => cfg.required("time_embedding_dim", Some(d))?,
        None => boc[0]
            .checked_mul(4)
            .ok_or_else(|| cfg.err("the time embedding width overflows".into()))?,
    };
    for ch in &boc {
        if !ch.is_multiple_of(groups) {
            return Err(cfg.field_err(
                "norm_num_groups",
                format!("{ch} channels are not divisible into {groups} groups"),
            ));
        }
    }

    let mut b = Builder {
        cfg,
        out: Vec::new(),
        groups,
        act,
        dropout,
        use_linear_projection: c.use_linear_projection.unwrap_or(false),
        emb: String::new(),
    };
    // Time embedding (`time_embedding`), SDXL's added embedding, their sum: `emb`.
    let t = b.time_embedding("time_embedding", T_EMB, time_dim)?;
    b.emb = if aug.is_some() {
        let a = b.time_embedding("add_embedding", ADD_EMBEDS, time_dim)?;
        push(&mut b.out, add("emb", &t, &a))
    } else {
        t
    };
    let conv_in = push(
        &mut b.out,
        with_inputs(conv("conv_in", boc[0], k_in, 1, (k_in - 1) / 2), &["input"]),
    );
    let mut skips = vec![Skip {
        name: conv_in.clone(),
        ch: boc[0],
        hw: size,
    }];
    let mut x = conv_in;
    let mut hw = size;
    let mut ch = boc[0];
    for (i, ty) in down_types.iter().enumerate() {
        let p = format!("down_blocks.{i}");
        let out = boc[i];
        let attn = ty == "CrossAttnDownBlock2D";
        for j in 0..layers_per_block[i] {
            let in_c = if j == 0 { ch } else { out };
            x = b.resnet(&format!("{p}.resnets.{j}"), &x, in_c, out, 1.0)?;
            if attn {
                x = b.transformer(
                    &format!("{p}.attentions.{j}"),
                    &x,
                    out,
                    heads[i],
                    tlpb[i],
                    hw,
                )?;
            }
            skips.push(Skip {
                name: x.clone(),
                ch: out,
                hw,
            });
        }
        ch = out;
        if i + 1 < n {
            let d = format!("{p}.downsamplers.0");
            if pad_down == 0 {
                push(
                    &mut b.out,
                    layer_spec! {
                        pad: Some(vec![0, 1, 0, 1]),
                        mode: Some(FillMode::Constant),
                        ..with_inputs(layer(K::Pad, &format!("{d}.pad")), &[&x])
                    },
                );
            }
            let prev = b
                .out
                .last()
                .and_then(|l| l.name.clone())
                .unwrap_or_default();
            let src = if pad_down == 0 { prev } else { x.clone() };
            x = push(
                &mut b.out,
                with_inputs(conv(&format!("{d}.conv"), out, 3, 2, pad_down), &[&src]),
            );
            // (H + 2p − 3) / 2 + 1; with p = 0 the input was padded by one.
            hw = (hw.0.div_ceil(2), hw.1.div_ceil(2));
            if hw.0 == 0 || hw.1 == 0 {
                return Err(cfg.field_err(
                    "sample_size",
                    "`sample_size` is too small for the downsamplers".into(),
                ));
            }
            skips.push(Skip {
                name: x.clone(),
                ch: out,
                hw,
            });
        }
    }
    if mid {
        let p = "mid_block";
        let last = boc[n - 1];
        let factor = c.mid_block_scale_factor.unwrap_or(1.0);
        if !(factor.is_finite() && factor != 0.0) {
            return refuse("mid_block_scale_factor", &factor.to_string());
        }
        x = b.resnet(&format!("{p}.resnets.0"), &x, last, last, factor)?;
        x = b.transformer(
            &format!("{p}.attentions.0"),
            &x,
            last,
            heads[n - 1],
            tlpb[n - 1],
            hw,
        )?;
        x = b.resnet(&format!("{p}.resnets.1"), &x, last, last, factor)?;
    }
    let rev = |v: &[u64]| v.iter().rev().copied().collect::<Vec<_>>();
    let (r_boc, r_heads, r_layers, r_tlpb) =
        (rev(&boc), rev(&heads), rev(&layers_per_block), rev(&tlpb));
    let mut out_c = r_boc[0];
    for (i, ty) in up_types.iter().enumerate() {
        let p = format!("up_blocks.{i}");
        let prev_out = out_c;
        out_c = r_boc[i];
        let in_c = r_boc[(i + 1).min(n - 1)];
        let attn = ty == "CrossAttnUpBlock2D";
        let count = r_layers[i] + 1;
        for j in 0..count {
            let skip = skips.pop().ok_or_else(|| {
                cfg.err("the up blocks take more skip connections than the down blocks make".into())
            })?;
            let skip_ch = if j + 1 == count { in_c } else { out_c };
            let res_in = if j == 0 { prev_out } else { out_c };
            if skip.ch != skip_ch || skip.hw != hw {
                return Err(cfg.err(format!(
                    "up block {i} layer {j} expects a {skip_ch}-channel skip connection of size {hw:?}; the down blocks give {} channels of size {:?} (layers_per_block and block_out_channels must mirror)",
                    skip.ch, skip.hw
                )));
            }
            let cat = push(
                &mut b.out,
                layer_spec! {
                    dim: Some(1),
                    ..with_inputs(layer(K::Concat, &format!("{p}.cat.{j}")), &[&x, &skip.name])
                },
            );
            let cin = res_in
                .checked_add(skip_ch)
                .ok_or_else(|| cfg.err("the concatenated channels overflow".into()))?;
            x = b.resnet(&format!("{p}.resnets.{j}"), &cat, cin, out_c, 1.0)?;
            if attn {
                x = b.transformer(
                    &format!("{p}.attentions.{j}"),
                    &x,
                    out_c,
                    r_heads[i],
                    r_tlpb[i],
                    hw,
                )?;
            }
        }
        if i + 1 < n {
            // `F.interpolate(scale_factor=2.0, mode="nearest")`, or to the next skip
            // connection's size when the latent is not divisible by 2^upsamplers.
            let next = skips.last().map_or(hw, |s| s.hw);
            let up = if next == (hw.0.saturating_mul(2), hw.1.saturating_mul(2)) {
                layer_spec! {
                    scale_factor: Some(2.0),
                    ..layer(K::Upsample, &format!("{p}.upsamplers.0.interpolate"))
                }
            } else {
                layer_spec! {
                    size: Some(Pair(next.0, next.1)),
                    ..layer(K::Upsample, &format!("{p}.upsamplers.0.interpolate"))
                }
            };
            push(&mut b.out, with_inputs(up, &[&x]));
            hw = next;
            x = push(
                &mut b.out,
                conv(&format!("{p}.upsamplers.0.conv"), out_c, 3, 1, 1),
            );
        }
    }
    if !skips.is_empty() {
        return Err(cfg.err(format!(
            "the up blocks leave {} skip connections unused (layers_per_block must mirror)",
            skips.len()
        )));
    }
    push(
        &mut b.out,
        with_inputs(group_norm("conv_norm_out", groups), &[&x]),
    );
    b.act("conv_act", "conv_norm_out")?;
    push(
        &mut b.out,
        conv("conv_out", out_ch, k_out, 1, (k_out - 1) / 2),
    );
    Ok(Unet {
        layers: b.out,
        sample: [in_ch, size.0, size.1],
        cross_attention_dim: cross_dim,
        time_proj_dim: boc[0],
        add_embeds: aug,
    })
}

/// The memest description of a diffusers config whose `_class_name` is `class` (one of
/// [`CLASSES`]): the model, its inputs (the latent `sample` as the model's input, the named
/// ones of [`named_inputs`]), `seq` 77 (CLIP's context) and SDPA attention, as diffusers'
/// `AttnProcessor2_0` runs it. With `loss`, the output ends in the denoising loss of diffusers'
/// training scripts (`train_dreambooth.py`, `train_text_to_image.py`):
/// `F.mse_loss(model_pred.float(), target.float())` (`mse_loss` with `upcast`); without it
/// (`--head none`) the training step backpropagates `out.sum()`.
///
/// # Errors
/// [`Error::Hf`] naming the field for a value of the wrong type, a block type or option memest
/// does not build, or sizes that do not fit together.
pub(super) fn to_spec(
    text: &str,
    class: &str,
    image: Option<super::ImageSize>,
    loss: bool,
) -> Result<ModelSpec, Error> {
    let cfg = Cfg {
        text,
        model_type: class,
        header: Header::default(),
    };
    // Stable Diffusion's VAE halves the image three times (`vae_scale_factor` 8: its four
    // `block_out_channels`); diffusers' pipelines refuse sizes that are not multiples of 8.
    let latent = match image {
        None => None,
        Some(i) if i.height % VAE_SCALE == 0 && i.width % VAE_SCALE == 0 => {
            Some((i.height / VAE_SCALE, i.width / VAE_SCALE))
        }
        Some(i) => {
            return Err(Error::setting(
                crate::error::SettingKey::Image,
                format!(
                    "--image {i}: height and width must be multiples of {VAE_SCALE} pixels (the VAE's scale factor)"
                ),
            ));
        }
    };
    match class {
        "SD3Transformer2DModel" => {
            return Ok(dit_spec(class, super::dit::sd3(&cfg, latent)?, loss));
        }
        "FluxTransformer2DModel" => {
            return Ok(dit_spec(class, super::dit::flux(&cfg, latent)?, loss));
        }
        _ => {}
    }
    let mut u = unet(&cfg, latent)?;
    if loss {
        u.layers.push(mse_loss());
    }
    let [c, h, w] = u.sample;
    Ok(ModelSpec {
        name: None,
        description: Some(format!(
            "{class} from a diffusers config, as diffusers 0.42 builds it: the noise prediction for a latent of [{c}, {h}, {w}], {}",
            loss_note(loss)
        )),
        max_positions: None,
        input: InputSpec {
            shape: vec![DimSpec::Fixed(c), DimSpec::Fixed(h), DimSpec::Fixed(w)],
            dtype: None,
        },
        inputs: named_inputs(&u),
        defaults: DefaultsSpec {
            seq: Some(77),
            attention: Some(AttentionImpl::Flash),
            ..Default::default()
        },
        layers: u.layers,
        hidden_size: None,
    })
}

/// `F.mse_loss(model_pred.float(), target.float())`.
fn mse_loss() -> LayerSpec {
    layer_spec! {
        upcast: Some(true),
        ..layer(K::MseLoss, "loss")
    }
}

fn loss_note(loss: bool) -> &'static str {
    if loss {
        "MSE denoising loss on float32 copies (diffusers' training scripts)"
    } else {
        "no loss (the training step backpropagates out.sum())"
    }
}

/// The description of a DiT (`SD3Transformer2DModel`, `FluxTransformer2DModel`): its latent
/// as the model input, its named inputs, its default text length and SDPA attention.
fn dit_spec(class: &str, mut d: super::dit::Dit, loss: bool) -> ModelSpec {
    if loss {
        d.layers.push(mse_loss());
    }
    ModelSpec {
        name: None,
        description: Some(format!(
            "{class} from a diffusers config, as diffusers 0.42 builds it: {}, {}",
            d.what,
            loss_note(loss)
        )),
        max_positions: None,
        input: InputSpec {
            shape: d.input,
            dtype: None,
        },
        inputs: d.inputs,
        defaults: DefaultsSpec {
            seq: Some(d.seq),
            attention: Some(AttentionImpl::Flash),
            ..Default::default()
        },
        layers: d.layers,
        hidden_size: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> serde_json::Value {
        json!({
            "_class_name": "UNet2DConditionModel",
            "sample_size": 16,
            "block_out_channels": [32, 64],
            "layers_per_block": 1,
            "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
            "cross_attention_dim": 32,
            "attention_head_dim": 4,
            "norm_num_groups": 8
        })
    }

    fn message(v: &serde_json::Value) -> String {
        match to_spec(&v.to_string(), "UNet2DConditionModel", None, true) {
            Err(Error::Hf(e)) => e.message,
            other => panic!("expected an import error, got {other:?}"),
        }
    }

    #[test]
    fn inputs_are_the_latent_the_text_states_and_the_timestep_embedding() {
        let spec = to_spec(&tiny().to_string(), "UNet2DConditionModel", None, true).unwrap();
        assert_eq!(
            spec.input.shape,
            [DimSpec::Fixed(4), DimSpec::Fixed(16), DimSpec::Fixed(16)]
        );
        let names: Vec<&str> = spec.inputs.keys().map(String::as_str).collect();
        assert_eq!(names, [ENCODER_STATES, T_EMB]);
        assert_eq!(
            spec.inputs[ENCODER_STATES].shape,
            [DimSpec::Seq, DimSpec::Fixed(32)]
        );
        assert_eq!(spec.inputs[T_EMB].shape, [DimSpec::Fixed(32)]);
        assert_eq!(spec.defaults.seq, Some(77));
        // Two down levels of one resnet: conv_in, down 0 (resnet + attention), its
        // downsampler and down 1's resnet are the four skip connections; the up blocks
        // concatenate all four.
        let cats = spec.layers.iter().filter(|l| l.kind == K::Concat).count();
        assert_eq!(cats, 4);
        let mut sdxl = tiny();
        sdxl["addition_embed_type"] = json!("text_time");
        sdxl["addition_time_embed_dim"] = json!(8);
        sdxl["projection_class_embeddings_input_dim"] = json!(64);
        let spec = to_spec(&sdxl.to_string(), "UNet2DConditionModel", None, true).unwrap();
        assert_eq!(spec.inputs[ADD_EMBEDS].shape, [DimSpec::Fixed(64)]);
    }

    #[test]
    fn options_not_built_are_refused_by_name() {
        for (key, value, want) in [
            (
                "class_embed_type",
                json!("timestep"),
                "`class_embed_type`: \"timestep\" is not supported yet",
            ),
            (
                "addition_embed_type",
                json!("image"),
                "`addition_embed_type`: \"image\" is not supported yet",
            ),
            (
                "resnet_time_scale_shift",
                json!("scale_shift"),
                "`resnet_time_scale_shift`: \"scale_shift\"",
            ),
            (
                "only_cross_attention",
                json!([true, false]),
                "`only_cross_attention`: true",
            ),
            (
                "down_block_types",
                json!(["AttnDownBlock2D", "DownBlock2D"]),
                "block `AttnDownBlock2D` is not supported yet (supported: CrossAttnDownBlock2D, DownBlock2D)",
            ),
            (
                "mid_block_type",
                json!("UNetMidBlock2DSimpleCrossAttn"),
                "`UNetMidBlock2DSimpleCrossAttn` is not supported yet",
            ),
            (
                "attention_head_dim",
                json!([4, 4, 4]),
                "`attention_head_dim` has 3 entries for 2 down blocks",
            ),
            (
                "norm_num_groups",
                json!(7),
                "32 channels are not divisible into 7 groups",
            ),
            (
                "transformer_layers_per_block",
                json!([[1], [1]]),
                "`transformer_layers_per_block` must be a whole number or one per down block",
            ),
        ] {
            let mut c = tiny();
            c[key] = value;
            let m = message(&c);
            assert!(m.contains(want), "{key}: {m}");
        }
        let mut c = tiny();
        c["layers_per_block"] = json!([1, 2]);
        c["up_block_types"] = json!(["UpBlock2D", "CrossAttnUpBlock2D"]);
        // Up blocks take layers_per_block + 1 skips each, reversed: they still mirror.
        assert!(to_spec(&c.to_string(), "UNet2DConditionModel", None, true).is_ok());
    }
}
