//! Reading a layer's keys: the allow-list of a kind is the set of keys its reader asks for.
//!
//! Each kind's config reads its keys through a [`KeyReader`] (`r.pos(key!(s.out_features))`,
//! `r.or(key!(s.bias), true)`, …) and then calls [`KeyReader::finish`], which rejects any key
//! that is set but was never read, listing the keys that were read as the kind's keys. Reads do
//! not stop at the first bad value: they record it and return a placeholder, so that `finish`
//! sees every key the kind reads and an inapplicable key is reported before a missing one. Use
//! the values only after `finish` returned `Ok`.

use crate::spec::{LayerKind, LayerSpec, Pair, Sizes};

/// One key of a [`LayerSpec`]: its name and its value. Built by [`key!`] from the field itself,
/// so the name cannot drift from the field.
pub(crate) struct Key<T> {
    name: &'static str,
    value: Option<T>,
}

impl<T> Key<T> {
    /// A key named `name` (the `LayerSpec` field's name) with its value.
    pub(crate) fn new(name: &'static str, value: Option<T>) -> Self {
        Key { name, value }
    }
}

/// `key!(s.bias)`: the `bias` key of the layer spec `s`, for a [`KeyReader`] (a copy of its
/// value; `key!(ref s.layers)` borrows it instead).
macro_rules! key {
    ($s:ident . $field:ident) => {
        $crate::graph::keys::Key::new(stringify!($field), $s.$field.clone())
    };
    (ref $s:ident . $field:ident) => {
        $crate::graph::keys::Key::new(stringify!($field), $s.$field.as_ref())
    };
}
pub(crate) use key;

/// Records which keys a kind reads and the first invalid value.
pub(crate) struct KeyReader<'a> {
    spec: &'a LayerSpec,
    name: &'a str,
    read: Vec<&'static str>,
    error: Option<String>,
}

impl<'a> KeyReader<'a> {
    /// A reader of `spec`, the layer called `name` (its given name or `<kind><index>`).
    pub(crate) fn new(spec: &'a LayerSpec, name: &'a str) -> Self {
        KeyReader {
            spec,
            name,
            read: Vec::new(),
            error: None,
        }
    }

    /// The layer as written.
    pub(crate) fn spec(&self) -> &'a LayerSpec {
        self.spec
    }

    /// The layer's kind.
    pub(crate) fn kind(&self) -> LayerKind {
        self.spec.kind
    }

    /// The keys read so far, in reading order.
    pub(crate) fn keys(&self) -> &[&'static str] {
        &self.read
    }

    /// The layer's name.
    pub(crate) fn name(&self) -> &'a str {
        self.name
    }

    fn take<T>(&mut self, key: Key<T>) -> Option<T> {
        if !self.read.contains(&key.name) {
            self.read.push(key.name);
        }
        key.value
    }

    /// Records an invalid value (the first one is reported by [`KeyReader::finish`]).
    pub(crate) fn fail(&mut self, message: String) {
        self.error.get_or_insert(message);
    }

    /// An optional key.
    pub(crate) fn opt<T>(&mut self, key: Key<T>) -> Option<T> {
        self.take(key)
    }

    /// An optional key with a default.
    pub(crate) fn or<T>(&mut self, key: Key<T>, default: T) -> T {
        self.take(key).unwrap_or(default)
    }

    /// A required key; `hint` follows "missing `key`" in the error (e.g. an example).
    pub(crate) fn req<T: Default>(&mut self, key: Key<T>, hint: &str) -> T {
        let name = key.name;
        self.take(key).unwrap_or_else(|| {
            self.fail(format!("missing `{name}`{hint}"));
            T::default()
        })
    }

    fn check_positive(&mut self, name: &str, v: u64) -> u64 {
        if v == 0 {
            self.fail(format!("`{name}` must be positive, got 0"));
            1
        } else {
            v
        }
    }

    /// A required positive size.
    pub(crate) fn pos(&mut self, key: Key<u64>) -> u64 {
        let name = key.name;
        match self.take(key) {
            Some(v) => self.check_positive(name, v),
            None => {
                self.fail(format!("missing `{name}`"));
                1
            }
        }
    }

    /// An optional positive size with a default.
    pub(crate) fn pos_or(&mut self, key: Key<u64>, default: u64) -> u64 {
        let name = key.name;
        let v = self.take(key).unwrap_or(default);
        self.check_positive(name, v)
    }

    /// An optional positive size.
    pub(crate) fn pos_opt(&mut self, key: Key<u64>) -> Option<u64> {
        let name = key.name;
        self.take(key).map(|v| self.check_positive(name, v))
    }

    fn check_pair(&mut self, name: &str, p: Pair) -> Pair {
        if p.0 == 0 || p.1 == 0 {
            self.fail(format!("`{name}` must be positive, got [{}, {}]", p.0, p.1));
            Pair(1, 1)
        } else {
            p
        }
    }

    /// A required pair of positive sizes.
    pub(crate) fn pair(&mut self, key: Key<Pair>) -> Pair {
        let name = key.name;
        match self.take(key) {
            Some(p) => self.check_pair(name, p),
            None => {
                self.fail(format!("missing `{name}`"));
                Pair(1, 1)
            }
        }
    }

    /// An optional pair of positive sizes with a default.
    pub(crate) fn pair_or(&mut self, key: Key<Pair>, default: Pair) -> Pair {
        let name = key.name;
        let p = self.take(key).unwrap_or(default);
        self.check_pair(name, p)
    }

    /// An optional pair of positive sizes.
    pub(crate) fn pair_opt(&mut self, key: Key<Pair>) -> Option<Pair> {
        let name = key.name;
        self.take(key).map(|p| self.check_pair(name, p))
    }

    /// A window key of a 1-D or 2-D kind as a [`Pair`] (one number is both sizes), for the
    /// pair readers; three sizes are an error.
    pub(crate) fn two(&mut self, key: Key<Sizes>) -> Key<Pair> {
        let name = key.name;
        let value = match key.value.as_ref().map(|s| s.0.as_slice()) {
            None => None,
            Some([one]) => Some(Pair(*one, *one)),
            Some([h, w]) => Some(Pair(*h, *w)),
            Some(many) => {
                self.fail(format!(
                    "`{name}` {many:?} gives {} sizes; `{}` takes one or [h, w]",
                    many.len(),
                    self.spec.kind
                ));
                Some(Pair(1, 1))
            }
        };
        Key { name, value }
    }

    /// A required window key of a 1-D or 2-D kind, positive ([`KeyReader::pair`]).
    pub(crate) fn win(&mut self, key: Key<Sizes>) -> Pair {
        let k = self.two(key);
        self.pair(k)
    }

    /// An optional positive window key of a 1-D or 2-D kind ([`KeyReader::pair_or`]).
    pub(crate) fn win_or(&mut self, key: Key<Sizes>, default: Pair) -> Pair {
        let k = self.two(key);
        self.pair_or(k, default)
    }

    /// An optional window key of a 1-D or 2-D kind that may be 0 (padding).
    pub(crate) fn win0(&mut self, key: Key<Sizes>, default: Pair) -> Pair {
        let k = self.two(key);
        self.or(k, default)
    }

    /// A probability in `[0, 1)`, with a default.
    pub(crate) fn prob(&mut self, key: Key<f64>, default: f64) -> f64 {
        let name = key.name;
        let p = self.take(key).unwrap_or(default);
        if (0.0..1.0).contains(&p) {
            p
        } else {
            self.fail(format!("`{name}` must be in [0, 1), got {p}"));
            0.0
        }
    }

    /// Rejects a set key that the kind did not read (naming the kind's keys and the nearest
    /// one), then the first invalid value.
    ///
    /// # Errors
    /// The message for the layer's error.
    pub(crate) fn finish(&mut self) -> Result<(), String> {
        for key in self.spec.set_keys() {
            if !self.read.contains(&key) {
                let valid = if self.read.is_empty() {
                    "none".to_string()
                } else {
                    self.read.join(", ")
                };
                let hint = crate::error::nearest(key, &self.read)
                    .map(|n| format!("did you mean `{n}`? "))
                    .unwrap_or_default();
                return Err(format!(
                    "key `{key}` does not apply to `{}` ({hint}its keys: {valid})",
                    self.spec.kind
                ));
            }
        }
        self.error.take().map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::layer_spec;

    fn spec(kind: LayerKind) -> LayerSpec {
        layer_spec! {
            kind: kind,
            ..LayerSpec::default()
        }
    }

    #[test]
    fn unread_key_is_rejected_with_the_kinds_keys_and_a_suggestion() {
        let s = layer_spec! {
            dims: Some(vec![1]),
            ..spec(LayerKind::Softmax)
        };
        let mut r = KeyReader::new(&s, "sm");
        r.or(key!(s.dim), -1);
        assert_eq!(
            r.finish().unwrap_err(),
            "key `dims` does not apply to `softmax` (did you mean `dim`? its keys: dim)"
        );
        let s = layer_spec! {
            out_channels: Some(3),
            ..spec(LayerKind::Linear)
        };
        let mut r = KeyReader::new(&s, "fc");
        r.pos(key!(s.out_features));
        r.or(key!(s.bias), true);
        assert_eq!(
            r.finish().unwrap_err(),
            "key `out_channels` does not apply to `linear` (its keys: out_features, bias)"
        );
    }

    #[test]
    fn inapplicable_key_comes_before_a_missing_one() {
        let s = layer_spec! {
            kernel: Some(Pair(3, 3).into()),
            ..spec(LayerKind::Linear)
        };
        let mut r = KeyReader::new(&s, "fc");
        r.pos(key!(s.out_features));
        let e = r.finish().unwrap_err();
        assert!(e.starts_with("key `kernel` does not apply"), "{e}");
    }

    #[test]
    fn first_invalid_value_is_reported() {
        let s = layer_spec! {
            groups: Some(0),
            p: Some(1.5),
            ..spec(LayerKind::Conv2d)
        };
        let mut r = KeyReader::new(&s, "c");
        assert_eq!(r.pos_or(key!(s.groups), 1), 1);
        r.prob(key!(s.p), 0.0);
        r.pos(key!(s.out_channels));
        assert_eq!(r.finish().unwrap_err(), "`groups` must be positive, got 0");
    }

    #[test]
    fn a_kind_without_keys_says_none() {
        let s = layer_spec! {
            dim: Some(1),
            ..spec(LayerKind::Tanh)
        };
        assert_eq!(
            KeyReader::new(&s, "t").finish().unwrap_err(),
            "key `dim` does not apply to `tanh` (its keys: none)"
        );
    }
}
