//! Typed errors of the library. The binary adds the file name and maps every error to exit 2.

use std::fmt;

use crate::shape::Shape;

/// Anything that stops an estimate. Each variant keeps where the error is (a position in the
/// file, a layer, a setting, a config field); `Display` writes the message people read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// The file could not be read as a model description (syntax, unknown key, wrong type).
    Spec(SpecError),
    /// The model as a whole is invalid (an empty or zero input shape, no layers), or cannot be
    /// written back as a description.
    Model(String),
    /// A layer is invalid: a missing or inapplicable key, a zero size, an unknown input name,
    /// or a shape mismatch.
    Layer(LayerError),
    /// A setting (from the file's `[defaults]` or a flag) has an invalid value.
    Setting(SettingError),
    /// A Hugging Face `config.json` cannot be imported.
    Hf(HfError),
    /// A size computation overflowed 64 bits.
    Overflow(String),
    /// memest broke one of its own invariants (a bug): what went wrong.
    Internal(&'static str),
}

/// A syntax or schema error, with its 1-based position when known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    /// 1-based line.
    pub line: Option<usize>,
    /// 1-based column.
    pub column: Option<usize>,
    /// What was wrong.
    pub message: String,
}

/// An error in one layer, naming it by position, name and kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerError {
    /// Which layer.
    pub layer: LayerAt,
    /// What was wrong.
    pub kind: LayerErrorKind,
}

/// Where a layer is in the model description.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LayerAt {
    /// Its 1-based position in each enclosing block, from the top level down: `[5, 2]` is the
    /// second layer of the body of the fifth top-level layer.
    pub positions: Vec<usize>,
    /// How errors name it: position, name and kind, e.g. `layer #3 "fc2" (linear)` or
    /// `layer #5 "blocks" (repeat) > layer #2 "attn" (attention)`.
    pub label: String,
}

impl fmt::Display for LayerAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label)
    }
}

/// What is wrong with a layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerErrorKind {
    /// Its description: a missing, inapplicable or out-of-range key, a bad name or reference
    /// (found when the graph is built).
    Invalid(String),
    /// It cannot apply to its input, or to where it sits in the model (found while tracing).
    Input(String),
    /// The input has the wrong rank, e.g. a `conv2d` on `[batch, features]`.
    Rank {
        /// The input's shape.
        input: Shape,
        /// What the layer takes, e.g. `rank 4 [batch, channels, height, width]`.
        expected: String,
    },
    /// One dimension of the input disagrees with the layer's key, e.g. `in_features`.
    Size {
        /// The input's shape.
        input: Shape,
        /// What the dimension holds: `features`, `channels`.
        what: &'static str,
        /// Its size in the input.
        got: u64,
        /// The key that fixes it: `in_features`, `in_channels`, `num_features`.
        key: &'static str,
        /// The key's value.
        expected: u64,
    },
    /// A repeated block traces to more operators than [`crate::trace::MAX_STEPS`], estimated
    /// from its first copy before the others are traced.
    TooManyOperators {
        /// The key its copy count comes from: `count`, or a Hugging Face config's field
        /// (`num_hidden_layers`).
        key: &'static str,
        /// The copy count.
        count: u64,
        /// The copies of the enclosing blocks, their counts multiplied (1 outside blocks).
        enclosing: u64,
        /// Operators traced by one copy.
        per_copy: u64,
        /// The limit.
        limit: usize,
    },
}

impl fmt::Display for LayerErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerErrorKind::Invalid(m) | LayerErrorKind::Input(m) => f.write_str(m),
            LayerErrorKind::Rank { input, expected } => write!(
                f,
                "input {input} has rank {}, expected {expected}",
                input.rank()
            ),
            LayerErrorKind::Size {
                input,
                what,
                got,
                key,
                expected,
            } => write!(
                f,
                "input {input} has {got} {what}, expected {key} = {expected}"
            ),
            LayerErrorKind::TooManyOperators {
                key,
                count,
                enclosing: 1,
                per_copy,
                limit,
            } => write!(
                f,
                "{count} copies (`{key}`) of {per_copy} operators each are more than the {limit} operators memest traces; lower `{key}`"
            ),
            LayerErrorKind::TooManyOperators {
                key,
                count,
                enclosing,
                per_copy,
                limit,
            } => write!(
                f,
                "{count} copies (`{key}`) of {per_copy} operators each, in {enclosing} copies of the enclosing blocks, make {} operators, more than the {limit} operators memest traces; lower `{key}` or the enclosing blocks' `count`",
                u128::from(*count) * u128::from(*per_copy) * u128::from(*enclosing)
            ),
        }
    }
}

/// The setting an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettingKey {
    /// `--batch`, `defaults.batch`.
    Batch,
    /// `--seq`, `--context`, `defaults.seq`.
    Seq,
    /// `--mode`, `defaults.mode`.
    Mode,
    /// `--optim`, `defaults.optimizer`.
    Optimizer,
    /// `--optim-impl`, `defaults.optimizer_impl`.
    OptimizerImpl,
    /// `--attention`, `defaults.attention`.
    Attention,
    /// `--dtype`, `defaults.dtype`.
    Dtype,
    /// `--amp`.
    Amp,
    /// `--kv-dtype`.
    KvDtype,
    /// `--recipe`.
    Recipe,
    /// `--lora-rank`, `--lora-targets`.
    Lora,
    /// `--head`.
    Head,
    /// `--image`.
    Image,
    /// `--max-batch`, `--max-context`.
    Search,
    /// `--gpus`, `--ddp`, `--zero`, `--fsdp` and their options.
    Parallel,
    /// `--grad-accum`, `defaults.grad_accum`.
    GradAccum,
    /// `--optim-in-backward`, `--paged`, `--ema`: how the optimizer runs.
    OptimizerRun,
    /// `--device`, `--gpu`, `--budget-on`, `--cuda-context`, `defaults.device`.
    Device,
}

/// An invalid setting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingError {
    /// Which setting.
    pub key: SettingKey,
    /// What was wrong.
    pub message: String,
}

/// A Hugging Face `config.json` that memest cannot import.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfError {
    /// The config's `model_type`, once known.
    pub model_type: Option<String>,
    /// The field at fault, as a path (`n_embd`, `rope_scaling.factor`), when one is.
    pub field: Option<String>,
    /// 1-based line and column in the file, for a field of the wrong type.
    pub position: Option<(usize, usize)>,
    /// What was wrong (naming the field, as people read it).
    pub message: String,
}

impl fmt::Display for HfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((line, column)) = self.position {
            write!(f, "{line}:{column}: ")?;
        }
        f.write_str("Hugging Face config")?;
        if let Some(t) = &self.model_type {
            write!(f, " (model_type {t})")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Spec(e) => match (e.line, e.column) {
                (Some(l), Some(c)) => write!(f, "{l}:{c}: {}", e.message),
                (Some(l), None) => write!(f, "{l}: {}", e.message),
                _ => f.write_str(&e.message),
            },
            Error::Layer(e) => write!(f, "{}: {}", e.layer, e.kind),
            Error::Setting(e) => f.write_str(&e.message),
            Error::Hf(e) => e.fmt(f),
            Error::Model(m) => f.write_str(m),
            Error::Overflow(what) => write!(f, "size overflow: {what} does not fit in 64 bits"),
            Error::Internal(what) => write!(f, "internal error: {what} (a bug in memest)"),
        }
    }
}

impl std::error::Error for Error {}

impl Error {
    /// An invalid setting.
    pub fn setting(key: SettingKey, message: impl Into<String>) -> Error {
        Error::Setting(SettingError {
            key,
            message: message.into(),
        })
    }

    /// An error in `layer`.
    #[must_use]
    pub fn layer(layer: LayerAt, kind: LayerErrorKind) -> Error {
        Error::Layer(LayerError { layer, kind })
    }

    /// The 1-based line and column this error points at, when it has a position.
    #[must_use]
    pub fn position(&self) -> Option<(usize, Option<usize>)> {
        match self {
            Error::Spec(SpecError {
                line: Some(l),
                column,
                ..
            }) => Some((*l, *column)),
            Error::Hf(HfError {
                position: Some((l, c)),
                ..
            }) => Some((*l, Some(*c))),
            _ => None,
        }
    }

    /// This error as found in `origin` (a file name, `<stdin>`).
    #[must_use]
    pub fn at(self, origin: impl Into<String>) -> Located {
        Located {
            origin: origin.into(),
            position: None,
            error: self,
        }
    }
}

/// An error with the input it came from. Displays as `origin:line:col: message` when the error
/// has a position, else `origin: message`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    /// The file the error is in (`<stdin>` for standard input).
    pub origin: String,
    /// The 1-based line and column of what the error is about, when the error itself has no
    /// position: the layer of a layer error in a TOML file (see `memest::locate`).
    pub position: Option<(usize, usize)>,
    /// The error.
    pub error: Error,
}

impl fmt::Display for Located {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.position {
            Some((line, column)) => write!(f, "{}:{line}:{column}: {}", self.origin, self.error),
            // A positioned error displays as `line:col: message` itself.
            None if self.error.position().is_some() => write!(f, "{}:{}", self.origin, self.error),
            None => write!(f, "{}: {}", self.origin, self.error),
        }
    }
}

/// No `source`: the message already includes the error's (`{:#}` chains would repeat it).
impl std::error::Error for Located {}

/// serde's type and value complaints in a reader's words: `invalid type: string "x", expected
/// u64` becomes `expected a whole number (0 or more), got the string "x"`, `integer \`-3\``
/// becomes `-3`, `integer \`N\` as i128` becomes `N`, and Rust type names (`u64`, `f64`, `bool`,
/// `a sequence`, `struct …`) become `a whole number`, `a number`, `true or false`, `a list`,
/// `a table`. Any other message is returned as it is.
#[must_use]
pub fn humane(message: &str) -> String {
    let Some(rest) = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "))
    else {
        return message.to_string();
    };
    let Some((got, expected)) = rest.rsplit_once(", expected ") else {
        return message.to_string();
    };
    let quoted = |s: &str| s.split('`').nth(1).map(str::to_string);
    let got = if let Some(s) = got.strip_prefix("string ") {
        format!("the string {s}")
    } else if got.ends_with(" as i128") || got.ends_with(" as u128") {
        format!("{}, which is too large", quoted(got).unwrap_or_default())
    } else if got.starts_with("integer `") || got.starts_with("floating point `") {
        quoted(got).unwrap_or_else(|| got.to_string())
    } else if got.starts_with("boolean `") {
        quoted(got).unwrap_or_else(|| got.to_string())
    } else {
        match got {
            "sequence" => "a list".to_string(),
            "map" => "a table".to_string(),
            "unit value" | "null" => "nothing (null)".to_string(),
            other => other.to_string(),
        }
    };
    let expected = match expected.trim() {
        "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => "a whole number (0 or more)".to_string(),
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "a whole number".to_string(),
        "f32" | "f64" => "a number".to_string(),
        "a boolean" | "bool" => "true or false".to_string(),
        "a sequence" => "a list".to_string(),
        "a string" => "text (a quoted string)".to_string(),
        e if e.starts_with("struct ") || e == "a map" => "a table of keys".to_string(),
        e => e.to_string(),
    };
    format!("expected {expected}, got {got}")
}

/// How similar a candidate must be to be suggested: its normalized Damerau-Levenshtein
/// similarity (1 − edits / longer length, a transposition counting as one edit).
const MIN_SIMILARITY: f64 = 0.6;

/// The longest word (in characters) [`nearest`] looks for a suggestion for: longer words are not
/// typos of a key, kind or layer name, and comparing them costs seconds.
pub const MAX_SUGGESTED_LEN: usize = 64;

/// The candidate most like `word` (the first of equals), if it is close enough to be a likely
/// typo: the same word in another case (`AdamW` is `adamw`), or at most 2 edits in 5
/// characters, 4 in 10 (see `MIN_SIMILARITY`), compared without case. Not suggested, because
/// they name another thing rather than misspell this one: a candidate that differs only in its
/// digits (`conv3d` is not `conv1d`), or, for a word under 5 characters, one that does not start
/// with the same letter (`elu` is not `relu`).
/// Words longer than [`MAX_SUGGESTED_LEN`] characters get no suggestion (the comparison costs
/// the product of the two lengths).
#[must_use]
pub fn nearest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let len = word.chars().count();
    if len > MAX_SUGGESTED_LEN {
        return None;
    }
    if let Some(&same) = candidates
        .iter()
        .find(|c| c.chars().count() == len && c.eq_ignore_ascii_case(word))
    {
        return Some(same);
    }
    let lower = word.to_lowercase();
    let letters = |s: &str| -> String { s.chars().filter(|c| !c.is_ascii_digit()).collect() };
    let first = |s: &str| s.chars().next().map(|c| c.to_ascii_lowercase());
    let mut best: Option<(f64, &'a str)> = None;
    for &c in candidates {
        let c_lower = c.to_lowercase();
        if c_lower != lower && letters(&c_lower) == letters(&lower) && c_lower.len() == lower.len()
        {
            continue;
        }
        if len < 5 && first(c) != first(word) {
            continue;
        }
        // The edit distance is at least the difference of the lengths, so a candidate whose
        // length ratio is under the threshold (with a character to spare against rounding)
        // cannot be close enough: skipped before the quadratic comparison.
        let c_len = c.chars().count();
        let (short, long) = (len.min(c_len), len.max(c_len));
        #[allow(clippy::cast_precision_loss)] // lengths of at most a few million characters
        if (short as f64) + 1.0 < MIN_SIMILARITY * long as f64 {
            continue;
        }
        let score = strsim::normalized_damerau_levenshtein(&lower, &c_lower);
        if score >= MIN_SIMILARITY && best.is_none_or(|(b, _)| score > b) {
            best = Some((score, c));
        }
    }
    best.map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_finds_typos() {
        assert_eq!(nearest("lienar", &["linear", "relu"]), Some("linear"));
        assert_eq!(
            nearest("out_feature", &["out_features", "bias"]),
            Some("out_features")
        );
        assert_eq!(nearest("zzzzzz", &["linear", "relu"]), None);
        assert_eq!(
            nearest("fc", &["fc1", "fc2"]),
            Some("fc1"),
            "the first of equals"
        );
        assert_eq!(nearest("stide", &["stride", "kernel"]), Some("stride"));
        // Long words get no suggestion, and long candidates are skipped unread.
        let long = "a".repeat(1 << 20);
        assert_eq!(nearest(&long, &["linear"]), None);
        assert_eq!(
            nearest("lienar", &[long.as_str(), "linear"]),
            Some("linear")
        );
        // The length filter drops only candidates that could not reach the threshold.
        assert_eq!(nearest("abc", &["abcde"]), Some("abcde")); // 3/5 = 0.6
    }

    #[test]
    fn serde_words_become_plain_ones() {
        assert_eq!(
            humane("invalid type: string \"x\", expected u64"),
            "expected a whole number (0 or more), got the string \"x\""
        );
        assert_eq!(
            humane("invalid value: integer `-3`, expected u64"),
            "expected a whole number (0 or more), got -3"
        );
        assert_eq!(
            humane("invalid type: integer `99999999999999999999` as i128, expected u64"),
            "expected a whole number (0 or more), got 99999999999999999999, which is too large"
        );
        assert_eq!(
            humane("invalid type: floating point `1.5`, expected u64"),
            "expected a whole number (0 or more), got 1.5"
        );
        assert_eq!(
            humane("invalid type: string \"yes\", expected a boolean"),
            "expected true or false, got the string \"yes\""
        );
        assert_eq!(humane("missing field `kind`"), "missing field `kind`");
    }

    #[test]
    fn nearest_knows_case_and_other_things() {
        assert_eq!(nearest("AdamW", &["adam", "adamw"]), Some("adamw"));
        assert_eq!(nearest("ReLU", &["relu6", "relu"]), Some("relu"));
        assert_eq!(nearest("Lienar", &["linear"]), Some("linear"));
        // Real names of other things: no suggestion.
        assert_eq!(nearest("elu", &["relu", "gelu", "silu"]), None);
        assert_eq!(nearest("conv3d", &["conv1d", "conv2d"]), None);
        assert_eq!(
            nearest("batchnorm3d", &["batchnorm1d", "batchnorm2d"]),
            None
        );
        // Typos still are.
        assert_eq!(nearest("rleu", &["relu", "gelu"]), Some("relu"));
        assert_eq!(nearest("conv2", &["conv1d", "conv2d"]), Some("conv2d"));
    }

    #[test]
    fn located_errors_put_the_origin_first() {
        let spec = Error::Spec(SpecError {
            line: Some(3),
            column: Some(7),
            message: "unknown key `x`".into(),
        });
        assert_eq!(spec.position(), Some((3, Some(7))));
        assert_eq!(spec.at("m.toml").to_string(), "m.toml:3:7: unknown key `x`");
        let setting = Error::setting(SettingKey::Batch, "batch size must be at least 1");
        assert_eq!(setting.position(), None);
        assert_eq!(
            setting.at("<stdin>").to_string(),
            "<stdin>: batch size must be at least 1"
        );
    }

    #[test]
    fn hf_errors_keep_field_and_position() {
        let e = Error::Hf(HfError {
            model_type: Some("gpt2".into()),
            field: Some("n_embd".into()),
            position: Some((1, 62)),
            message: "`n_embd`: invalid type: string \"768\", expected u64".into(),
        });
        assert_eq!(
            e.at("c.json").to_string(),
            "c.json:1:62: Hugging Face config (model_type gpt2): `n_embd`: invalid type: string \"768\", expected u64"
        );
        let e = Error::Hf(HfError {
            model_type: None,
            field: Some("model_type".into()),
            position: None,
            message: "model_type `falcon` is not supported".into(),
        });
        assert_eq!(
            e.to_string(),
            "Hugging Face config: model_type `falcon` is not supported"
        );
    }

    #[test]
    fn layer_errors_word_their_kind() {
        let rank = Error::layer(
            LayerAt {
                positions: vec![1],
                label: "layer #1 \"c\" (conv2d)".into(),
            },
            LayerErrorKind::Rank {
                input: Shape::from([8, 100]),
                expected: "rank 4 [batch, channels, height, width]".into(),
            },
        );
        assert_eq!(
            rank.to_string(),
            "layer #1 \"c\" (conv2d): input [8, 100] has rank 2, expected rank 4 [batch, channels, height, width]"
        );
        let size = LayerErrorKind::Size {
            input: Shape::from([8, 100]),
            what: "features",
            got: 100,
            key: "in_features",
            expected: 64,
        };
        assert_eq!(
            size.to_string(),
            "input [8, 100] has 100 features, expected in_features = 64"
        );
    }

    #[test]
    fn nearest_stays_quiet_when_nothing_is_close() {
        // Levenshtein within max(len/3, 2) suggested all of these.
        assert_eq!(nearest("x", &["p", "dim"]), None);
        assert_eq!(nearest("eps", &["p", "tie"]), None);
        assert_eq!(nearest("gru", &["gelu", "relu"]), None);
        assert_eq!(nearest("mha", &["mul", "moe"]), None);
        assert_eq!(nearest("bn", &["ln", "fc1"]), None);
    }
}
