//! The model description as written in a file (TOML or JSON, one schema).
//!
//! These types mirror the file exactly and reject unknown keys, so that a typo is reported with
//! its line and column. [`crate::graph::build`] turns them into a validated [`crate::graph::Model`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::cost::{Optimizer, OptimizerImpl};
use crate::dtype::DType;
use crate::error::{Error, SpecError};
use crate::vocab::{AttentionImpl, Device, Mode};

mod chunks;
mod layer;

pub(crate) use layer::layer_spec;
pub use layer::{
    Approximate, CombineKind, FillMode, LayerKeys, LayerKind, LayerSpec, Pair, QkNormScope, Router,
    Sizes, Style,
};

/// Which syntax a model description is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// TOML (`.toml`).
    Toml,
    /// JSON (`.json`).
    Json,
}

impl Format {
    /// The format named by a file's extension, if it names one.
    #[must_use]
    pub fn from_extension(path: &std::path::Path) -> Option<Format> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "toml" => Some(Format::Toml),
            "json" => Some(Format::Json),
            _ => None,
        }
    }

    /// Guesses the format from the text: JSON starts with `{` (after whitespace), anything else
    /// is read as TOML.
    #[must_use]
    pub fn sniff(text: &str) -> Format {
        if text
            .trim_start_matches('\u{feff}')
            .trim_start()
            .starts_with('{')
        {
            Format::Json
        } else {
            Format::Toml
        }
    }
}

/// A whole model file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Display name; defaults to the file name.
    pub name: Option<String>,
    /// Free text, ignored by the estimator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The longest sequence the model was trained for (a Hugging Face config's
    /// `max_position_embeddings`): a longer `--seq`/`--context` warns, and `--max-context` stops
    /// there unless `--allow-long-context`. A learned position table (`position_embedding`) cannot
    /// go past its `num_positions` at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_positions: Option<u64>,
    /// The hidden size the Hugging Face Trainer reads to fill DeepSpeed sizes left `"auto"`
    /// (`trainer_config_finalize` in `transformers/integrations/deepspeed.py`): a config's
    /// `hidden_size`, else the largest of `hidden_sizes`, else `text_config`'s. A memest file
    /// may give it (`--print-model` writes a config's); without it the width of the first
    /// token embedding stands in. `None` when neither gives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_size: Option<u64>,
    /// The model's input, per sample (no batch dimension): the first layer reads it, and so does
    /// any layer that names `input`.
    pub input: InputSpec,
    /// More named inputs (`[inputs.decoder_input_ids]`, `[inputs.pixel_values]`): each a
    /// tensor of the batch, read by the layers that name it in their `inputs` (an
    /// encoder-decoder's target ids, an image beside a text). Empty for a one-input model.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub inputs: std::collections::BTreeMap<String, InputSpec>,
    /// Defaults for the run settings; command-line flags override them.
    #[serde(default)]
    pub defaults: DefaultsSpec,
    /// The layers, in forward order.
    pub layers: Vec<LayerSpec>,
}

/// The input tensor, without its batch dimension.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InputSpec {
    /// Dimensions after the batch, e.g. `[3, 224, 224]`; the string `"seq"` stands for the
    /// sequence length (`--seq`), e.g. `["seq"]` for token ids.
    pub shape: Vec<DimSpec>,
    /// Element type. An integer type (e.g. `int64`) makes the input token ids; a float input
    /// (the default) follows the model's dtype, as `model.to(dtype)` inputs do.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
}

/// One input dimension: a number, or the sequence length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DimSpec {
    /// A fixed size.
    Fixed(u64),
    /// The sequence length (`--seq`, or `defaults.seq`).
    Seq,
    /// The target sequence length of an encoder-decoder's second input (`--target-seq`, or
    /// `defaults.target_seq`).
    TargetSeq,
}

impl Serialize for DimSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            DimSpec::Fixed(v) => s.serialize_u64(*v),
            DimSpec::Seq => s.serialize_str("seq"),
            DimSpec::TargetSeq => s.serialize_str("target_seq"),
        }
    }
}

impl<'de> Deserialize<'de> for DimSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = DimSpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a positive integer or the string \"seq\" or \"target_seq\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<DimSpec, E> {
                Ok(DimSpec::Fixed(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<DimSpec, E> {
                u64::try_from(v).map(DimSpec::Fixed).map_err(|_| {
                    E::custom(format!(
                        "invalid dimension {v}, expected a positive integer or \"seq\""
                    ))
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DimSpec, E> {
                if v == "seq" {
                    Ok(DimSpec::Seq)
                } else if v == "target_seq" {
                    Ok(DimSpec::TargetSeq)
                } else {
                    Err(E::custom(format!(
                        "invalid dimension \"{v}\", expected a positive integer, \"seq\" or \"target_seq\""
                    )))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Defaults for the run settings, overridden by flags.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DefaultsSpec {
    /// Micro-batch size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<u64>,
    /// Sequence length for `"seq"` input dimensions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// Target sequence length for `"target_seq"` input dimensions (an encoder-decoder's
    /// decoder input).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_seq: Option<u64>,
    /// dtype of parameters and activations.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
    /// Optimizer: any `--optim` name or alias.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<Optimizer>,
    /// How a `torch.optim` optimizer loops over its tensors: any `--optim-impl` name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer_impl: Option<OptimizerImpl>,
    /// `train`, `infer` (aliases `inference`, `eval`) or `generate`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// Tokens `generate` produces after the prompt (`--new-tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_tokens: Option<u64>,
    /// `eager` or `flash` (alias `sdpa`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionImpl>,
    /// `cuda` (alias `gpu`) or `cpu`: whose kernels' saved tensors to model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<Device>,
    /// Micro-batches per optimizer step (gradient accumulation, `--grad-accum`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_accum: Option<u64>,
}

/// The keys each layer kind accepts, in reading order: [`crate::graph::kind_keys`]. The spec does
/// not know them (the graph's per-kind configs declare them); [`parse`] takes them only to word
/// an unknown key in its layer's terms.
pub type KindKeys = fn(LayerKind) -> Vec<&'static str>;

/// Parses a model description.
///
/// # Errors
/// [`Error::Spec`] with the line and column of the first syntax or schema error; an empty file
/// is reported as such.
pub fn parse(src: &str, format: Format, kind_keys: KindKeys) -> Result<ModelSpec, Error> {
    // A UTF-8 byte-order mark is not part of the document.
    let src = src.strip_prefix('\u{feff}').unwrap_or(src);
    if src.trim().is_empty() {
        return Err(Error::Spec(SpecError {
            line: None,
            column: None,
            message: "the model description is empty (expected `[input]` and `[[layers]]`)".into(),
        }));
    }
    match format {
        Format::Toml => {
            // The `[[layers]]` elements a few at a time, when the file cuts plainly (the same
            // spec, in a fraction of the memory); otherwise, and for every error, whole.
            if let Some(spec) = chunks::parse(src) {
                return Ok(spec);
            }
            let de = toml::Deserializer::parse(src).map_err(|e| toml_error(src, &e, None))?;
            // A file that reads is read without tracking the path (which copies every key);
            // one that does not is read again with it, for the error's path.
            if let Ok(spec) = ModelSpec::deserialize(de) {
                return Ok(spec);
            }
            let de = toml::Deserializer::parse(src).map_err(|e| toml_error(src, &e, None))?;
            serde_path_to_error::deserialize::<_, ModelSpec>(de).map_err(|e| {
                let doc = toml::from_str::<serde_json::Value>(src).ok();
                let key = last_key(e.path());
                let mut error = toml_error(src, e.inner(), key.as_deref());
                if let Some((kind_at, message)) = doc
                    .as_ref()
                    .and_then(|d| layer_key_error(d, e.path(), e.inner().message(), kind_keys))
                    && let Error::Spec(s) = &mut error
                {
                    s.message = message;
                    // An unknown kind is told where its layer starts, not at the key.
                    if let Some(at) = kind_at.and_then(|p| toml_layer_position(src, &p)) {
                        (s.line, s.column) = (Some(at.0), Some(at.1));
                    }
                }
                error
            })
        }
        Format::Json if !src.trim_start().starts_with('{') => Err(Error::Spec(SpecError {
            line: Some(1),
            column: Some(1),
            message: "the top level must be a JSON object with `input` and `layers`".into(),
        })),
        Format::Json => {
            // As TOML: the path is tracked only to report an error.
            let mut de = serde_json::Deserializer::from_str(src);
            if let Ok(spec) = ModelSpec::deserialize(&mut de)
                && de.end().is_ok()
            {
                return Ok(spec);
            }
            let mut de = serde_json::Deserializer::from_str(src);
            let spec = serde_path_to_error::deserialize::<_, ModelSpec>(&mut de).map_err(|e| {
                let key = last_key(e.path());
                let mut error = json_error(e.inner(), key.as_deref());
                if let Some((_, message)) = serde_json::from_str::<serde_json::Value>(src)
                    .ok()
                    .and_then(|d| layer_key_error(&d, e.path(), &e.inner().to_string(), kind_keys))
                    && let Error::Spec(s) = &mut error
                {
                    s.message = message;
                }
                if let Error::Spec(s) = &mut error
                    && let Some(token) = python_number_at(src, s.line, s.column)
                {
                    s.message = format!(
                        "`{token}` is not a JSON number (Python's json writes it for a float that is not finite); write a finite number"
                    );
                }
                error
            })?;
            de.end().map_err(|e| json_error(&e, None))?;
            Ok(spec)
        }
    }
}

/// A TOML syntax or schema error at its position; `key` is the key whose value was refused.
fn toml_error(src: &str, e: &toml::de::Error, key: Option<&str>) -> Error {
    let (line, column) = match e.span() {
        Some(span) => line_col(src, span.start),
        None => (None, None),
    };
    Error::Spec(SpecError {
        line,
        column,
        message: improve(e.message(), key),
    })
}

/// A JSON syntax or schema error at its position; `key` is the key whose value was refused.
fn json_error(e: &serde_json::Error, key: Option<&str>) -> Error {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = text.strip_suffix(&suffix).unwrap_or(&text).to_string();
    Error::Spec(SpecError {
        line: (e.line() > 0).then_some(e.line()),
        column: (e.column() > 0).then_some(e.column()),
        message: improve(&message, key),
    })
}

/// An unknown key of a layer, told in that layer's terms: when the layer's `kind` is unknown
/// too, that is the error (the first real one, whatever the keys' order); otherwise the key is
/// unknown to that kind, and the message lists that kind's keys only (with a suggestion among
/// them when one is close), not every key of every kind. `doc` is the whole file as a value,
/// `path` and `message` serde's error. Returns the message, with the layer's 1-based positions
/// (through blocks) when the kind is the error; `None` when the error is not an unknown key
/// inside a layer.
fn layer_key_error(
    doc: &serde_json::Value,
    path: &serde_path_to_error::Path,
    message: &str,
    kind_keys: KindKeys,
) -> Option<(Option<Vec<usize>>, String)> {
    use serde_path_to_error::Segment;
    if let Some(rest) = message.strip_prefix("unknown variant `") {
        return mode_value_error(doc, path, rest).map(|m| (None, m));
    }
    let rest = message.strip_prefix("unknown field `")?;
    let field = rest.split('`').next()?;
    let segments: Vec<&Segment> = path.iter().collect();
    let segments = match segments.split_last() {
        Some((Segment::Map { key }, head)) if key == field => head,
        _ => &segments[..],
    };
    let mut cur = doc;
    let mut positions = Vec::new();
    for seg in segments {
        cur = match seg {
            Segment::Map { key } => cur.get(key)?,
            Segment::Seq { index } => {
                positions.push(index + 1);
                cur.get(index)?
            }
            _ => return None,
        };
    }
    if positions.is_empty() {
        return None;
    }
    let kind = cur.get("kind")?.as_str()?;
    let Some(kind) = LayerKind::parse_name(kind) else {
        return Some((Some(positions), layer::unknown_kind(kind)));
    };
    let own = kind_keys(kind);
    let every: Vec<&str> = LayerKind::ALL.iter().flat_map(|k| kind_keys(*k)).collect();
    // The keys every layer takes (`kind`, `name`, `inputs`, …): the spec's keys no kind reads.
    let common: Vec<&str> = rest
        .split('`')
        .skip(2)
        .step_by(2)
        .filter(|k| !every.contains(k))
        .collect();
    let candidates: Vec<&str> = own.iter().chain(&common).copied().collect();
    let hint = crate::error::nearest(field, &candidates)
        .map(|n| format!(" (did you mean `{n}`?)"))
        .unwrap_or_default();
    Some((
        None,
        format!(
            "unknown key `{field}` for `{kind}`{hint}; its keys: {}; every layer's: {}",
            if own.is_empty() {
                "none".to_string()
            } else {
                own.join(", ")
            },
            common.join(", ")
        ),
    ))
}

/// An unknown `mode` value of an `upsample` or `pad` layer, listing that kind's modes only (the
/// file's `mode` key is one closed set for both kinds, so serde lists all of them). `rest` is
/// serde's message after "unknown variant `".
fn mode_value_error(
    doc: &serde_json::Value,
    path: &serde_path_to_error::Path,
    rest: &str,
) -> Option<String> {
    use serde_path_to_error::Segment;
    let value = rest.split('`').next()?;
    let segments: Vec<&Segment> = path.iter().collect();
    let (Segment::Map { key }, head) = segments.split_last()? else {
        return None;
    };
    if key != "mode" {
        return None;
    }
    let mut cur = doc;
    for seg in head {
        cur = match seg {
            Segment::Map { key } => cur.get(key)?,
            Segment::Seq { index } => cur.get(index)?,
            _ => return None,
        };
    }
    let kind = LayerKind::parse_name(cur.get("kind")?.as_str()?)?;
    let modes: Vec<&str> = match kind {
        LayerKind::Upsample => [FillMode::Nearest, FillMode::Linear, FillMode::Bilinear]
            .map(FillMode::as_str)
            .to_vec(),
        LayerKind::Pad => [
            FillMode::Constant,
            FillMode::Reflect,
            FillMode::Replicate,
            FillMode::Circular,
        ]
        .map(FillMode::as_str)
        .to_vec(),
        _ => return None,
    };
    let hint = crate::error::nearest(value, &modes)
        .map(|n| format!(" (did you mean `{n}`?)"))
        .unwrap_or_default();
    let listed: Vec<String> = modes.iter().map(|m| format!("`{m}`")).collect();
    Some(format!(
        "unknown `mode` value `{value}` for `{kind}`{hint}; expected one of {}",
        listed.join(", ")
    ))
}

/// The non-finite number Python's `json` writes (`NaN`, `Infinity`, `-Infinity`) that starts at
/// the 1-based `line` and `column`, if one does.
fn python_number_at(src: &str, line: Option<usize>, column: Option<usize>) -> Option<&'static str> {
    let text = src.lines().nth(line?.checked_sub(1)?)?;
    let at: String = text.chars().skip(column?.checked_sub(1)?).take(9).collect();
    ["-Infinity", "Infinity", "NaN"]
        .into_iter()
        .find(|t| at.starts_with(t))
}

/// The key an error path ends in (`style` of `layers[3].style`).
fn last_key(path: &serde_path_to_error::Path) -> Option<String> {
    match path.iter().next_back()? {
        serde_path_to_error::Segment::Map { key } => Some(key.clone()),
        _ => None,
    }
}

/// Adds a "did you mean" hint to serde's unknown-field and unknown-variant messages (a key, or
/// a value of a closed set such as `style`, named by its `key` when known).
fn improve(message: &str, key: Option<&str>) -> String {
    let message = message.trim_end();
    let (what, rest) = if let Some(rest) = message.strip_prefix("unknown field `") {
        ("key".to_string(), rest)
    } else if let Some(rest) = message.strip_prefix("unknown variant `") {
        let what = key.map_or_else(|| "value".to_string(), |k| format!("`{k}` value"));
        (what, rest)
    } else {
        let plain = crate::error::humane(message);
        return match key {
            Some(k) if plain != message => format!("`{k}`: {plain}"),
            _ => plain,
        };
    };
    let Some((field, expected)) = rest.split_once('`') else {
        return message.to_string();
    };
    let names: Vec<&str> = expected
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s)
        .collect();
    match crate::error::nearest(field, &names) {
        Some(n) => format!(
            "unknown {what} `{field}` (did you mean `{n}`?){}",
            &expected.replacen(',', ";", 1)
        ),
        None => format!(
            "unknown {what} `{field}`{}",
            &expected.replacen(',', ";", 1)
        ),
    }
}

/// 1-based line and column of a byte offset.
fn line_col(src: &str, offset: usize) -> (Option<usize>, Option<usize>) {
    let offset = offset.min(src.len());
    let before = &src[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(offset, |i| offset - i - 1) + 1;
    (Some(line), Some(column))
}

/// The 1-based line and column where the layer at `positions` (1-based, through blocks, see
/// [`crate::error::LayerAt`]) starts in a TOML description, for errors that name a layer. `None`
/// when `src` does not parse or has no such layer.
#[must_use]
pub fn toml_layer_position(src: &str, positions: &[usize]) -> Option<(usize, usize)> {
    /// Only the layers, with their spans; every other key is ignored.
    #[derive(Deserialize)]
    struct Layers {
        #[serde(default)]
        layers: Vec<toml::Spanned<Layers>>,
    }
    let src = src.strip_prefix('\u{feff}').unwrap_or(src);
    let mut layers = toml::from_str::<Layers>(src).ok()?.layers;
    let mut span = None;
    for &p in positions {
        let layer = layers.into_iter().nth(p.checked_sub(1)?)?;
        span = Some(layer.span());
        layers = layer.into_inner().layers;
    }
    match line_col(src, span?.start) {
        (Some(line), Some(column)) => Some((line, column)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_error_has_line_and_column() {
        let src = "[input]\nshape = [4]\n\n[[layers]]\nkind = \"linear\"\nout_feature = 3\n";
        let Err(Error::Spec(e)) = parse(src, Format::Toml, crate::graph::kind_keys) else {
            panic!("expected a spec error")
        };
        assert_eq!(e.line, Some(6));
        assert_eq!(e.column, Some(1));
        assert!(
            e.message.contains("did you mean `out_features`"),
            "{}",
            e.message
        );
    }

    #[test]
    fn unknown_kind_suggests_nearest() {
        let src = "[input]\nshape = [4]\n[[layers]]\nkind = \"lienar\"\n";
        let Err(Error::Spec(e)) = parse(src, Format::Toml, crate::graph::kind_keys) else {
            panic!("expected a spec error")
        };
        assert_eq!(e.line, Some(4));
        assert!(e.message.contains("did you mean `linear`"), "{}", e.message);
    }

    #[test]
    fn json_error_has_line_and_column() {
        let src = "{\n \"input\": {\"shape\": [4]},\n \"layers\": [{\"kind\": \"linear\", \"out_features\": \"x\"}]\n}";
        let Err(Error::Spec(e)) = parse(src, Format::Json, crate::graph::kind_keys) else {
            panic!("expected a spec error")
        };
        assert_eq!(e.line, Some(3));
        assert_eq!(
            e.message,
            "`out_features`: expected a whole number (0 or more), got the string \"x\""
        );
    }

    #[test]
    fn unknown_style_has_position_and_suggestion() {
        let src = "[input]\nshape = [4]\n[[layers]]\nkind = \"rmsnorm\"\nstyle = \"lama\"\n";
        let Err(Error::Spec(e)) = parse(src, Format::Toml, crate::graph::kind_keys) else {
            panic!("expected a spec error")
        };
        assert_eq!((e.line, e.column), (Some(5), Some(9)));
        assert!(
            e.message.starts_with(
                "unknown `style` value `lama` (did you mean `llama`?); expected one of"
            ),
            "{}",
            e.message
        );
    }

    #[test]
    fn empty_file_is_an_error() {
        assert!(matches!(
            parse("  \n", Format::Toml, crate::graph::kind_keys),
            Err(Error::Spec(_))
        ));
    }

    #[test]
    fn seq_dimension_and_pairs() {
        let src = "[input]\nshape = [\"seq\"]\ndtype = \"int64\"\n[[layers]]\nkind = \"conv2d\"\nkernel = [3, 5]\nstride = 2\n";
        let spec = parse(src, Format::Toml, crate::graph::kind_keys).unwrap();
        assert_eq!(spec.input.shape, vec![DimSpec::Seq]);
        assert_eq!(spec.layers[0].kernel, Some(Pair(3, 5).into()));
        assert_eq!(spec.layers[0].stride, Some(Pair(2, 2).into()));
    }
}
