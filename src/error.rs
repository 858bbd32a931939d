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
                per_copy,
                limit,
            } => write!(
                f,
                "{count} copies (`{key}`) of {per_copy} operators each are more than the {limit} operators memest traces; lower `{key}`"
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
    /// `--max-batch`, `--max-context`.
    Search,
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

/// How similar a candidate must be to be suggested: its normalized Damerau-Levenshtein
/// similarity (1 − edits / longer length, a transposition counting as one edit).
const MIN_SIMILARITY: f64 = 0.6;

/// The longest word (in characters) [`nearest`] looks for a suggestion for: longer words are not
/// typos of a key, kind or layer name, and comparing them costs seconds.
pub const MAX_SUGGESTED_LEN: usize = 64;

/// The candidate most like `word` (the first of equals), if it is close enough to be a likely
/// typo: at most 2 edits in 5 characters, 4 in 10 (see `MIN_SIMILARITY`).
/// Words longer than [`MAX_SUGGESTED_LEN`] characters get no suggestion (the comparison costs
/// the product of the two lengths).
#[must_use]
pub fn nearest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let len = word.chars().count();
    if len > MAX_SUGGESTED_LEN {
        return None;
    }
    let mut best: Option<(f64, &'a str)> = None;
    for &c in candidates {
        // The edit distance is at least the difference of the lengths, so a candidate whose
        // length ratio is under the threshold (with a character to spare against rounding)
        // cannot be close enough: skipped before the quadratic comparison.
        let c_len = c.chars().count();
        let (short, long) = (len.min(c_len), len.max(c_len));
        #[allow(clippy::cast_precision_loss)] // lengths of at most a few million characters
        if (short as f64) + 1.0 < MIN_SIMILARITY * long as f64 {
            continue;
        }
        let score = strsim::normalized_damerau_levenshtein(word, c);
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
