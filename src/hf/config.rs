//! Typed access to a config's fields, with errors that name the field.

use serde_json::{Map, Value};

use super::MAX_LAYERS;
use crate::error::Error;

/// Typed access to the config's fields, with errors that name the field.
pub(super) struct Cfg<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) model_type: &'a str,
}

impl<'a> Cfg<'a> {
    pub(super) fn err(&self, message: String) -> Error {
        Error::Setting(format!(
            "Hugging Face config (model_type {}): {message}",
            self.model_type
        ))
    }

    /// The value of the first of `keys` that is present and not null.
    pub(super) fn get<'k>(&self, keys: &[&'k str]) -> Option<(&'k str, &'a Value)> {
        keys.iter()
            .find_map(|k| self.map.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)))
    }

    pub(super) fn opt_u(&self, keys: &[&str]) -> Result<Option<u64>, Error> {
        match self.get(keys) {
            None => Ok(None),
            Some((k, v)) => match v.as_u64() {
                Some(n) => Ok(Some(n)),
                None => Err(self.err(format!("`{k}` must be a non-negative integer, got {v}"))),
            },
        }
    }

    /// A required size: present, an integer, positive.
    pub(super) fn req(&self, keys: &[&str]) -> Result<u64, Error> {
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
    pub(super) fn layers(&self, keys: &[&str]) -> Result<u64, Error> {
        let n = self.req(keys)?;
        if n > MAX_LAYERS {
            return Err(self.err(format!(
                "`{}` = {n} is more layers than memest traces (at most {MAX_LAYERS})",
                keys[0]
            )));
        }
        Ok(n)
    }

    pub(super) fn u_or(&self, keys: &[&str], default: u64) -> Result<u64, Error> {
        Ok(self.opt_u(keys)?.unwrap_or(default))
    }

    pub(super) fn f_or(&self, keys: &[&str], default: f64) -> Result<f64, Error> {
        match self.get(keys) {
            None => Ok(default),
            Some((k, v)) => v
                .as_f64()
                .ok_or_else(|| self.err(format!("`{k}` must be a number, got {v}"))),
        }
    }

    pub(super) fn b_or(&self, key: &str, default: bool) -> Result<bool, Error> {
        match self.get(&[key]) {
            None => Ok(default),
            Some((k, v)) => v
                .as_bool()
                .ok_or_else(|| self.err(format!("`{k}` must be true or false, got {v}"))),
        }
    }

    pub(super) fn s_or<'s>(&'s self, keys: &[&str], default: &'s str) -> Result<&'s str, Error> {
        match self.get(keys) {
            None => Ok(default),
            Some((k, v)) => v
                .as_str()
                .ok_or_else(|| self.err(format!("`{k}` must be a string, got {v}"))),
        }
    }

    /// The first entry of `architectures`, if any.
    pub(super) fn architecture(&self) -> Result<Option<String>, Error> {
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
    pub(super) fn num_labels(&self) -> Result<u64, Error> {
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
    pub(super) fn p_or(&self, keys: &[&str], default: f64) -> Result<f64, Error> {
        let p = self.f_or(keys, default)?;
        if (0.0..1.0).contains(&p) {
            Ok(p)
        } else {
            Err(self.err(format!("`{}` must be in [0, 1), got {p}", keys[0])))
        }
    }
}
