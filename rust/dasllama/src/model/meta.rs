//! A family's GGUF metadata, typed: every `<arch>.*` key as the file stores it (integers, floats,
//! booleans, strings and arrays of them), with readers that name the key when a value is missing,
//! of the wrong type, or out of range.

use crate::{Error, Result};
use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    fn describe(&self) -> String {
        match self {
            MetaValue::Bool(b) => format!("the boolean {b}"),
            MetaValue::Int(i) => format!("the integer {i}"),
            MetaValue::Float(f) => format!("the number {f}"),
            MetaValue::Str(s) => format!("the string {s:?}"),
            MetaValue::Array(a) => format!("an array of {} values", a.len()),
        }
    }
}

/// The `<arch>.`-prefixed keys of one file, stored without the prefix.
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    arch: String,
    map: HashMap<String, MetaValue>,
}

/// Sizes past this are nonsense for any model and would overflow the products built from them.
const MAX_SIZE: i64 = 1 << 24;

impl Metadata {
    pub fn new(arch: &str, map: HashMap<String, MetaValue>) -> Metadata {
        Metadata { arch: arch.into(), map }
    }

    /// The key as the file spells it, for messages.
    pub fn key(&self, key: &str) -> String {
        format!("{}.{key}", self.arch)
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.map.get(key)
    }

    fn bad(&self, key: &str, want: &str, got: &MetaValue) -> Error {
        Error::Gguf(format!("metadata key '{}' must be {want}, but the file holds {}", self.key(key), got.describe()))
    }

    fn size_of(&self, key: &str, v: &MetaValue) -> Result<usize> {
        match v {
            MetaValue::Int(i) if (0..=MAX_SIZE).contains(i) => Ok(*i as usize),
            other => Err(self.bad(key, &format!("an integer between 0 and {MAX_SIZE}"), other)),
        }
    }

    /// A size (a non-negative integer), if present.
    pub fn size(&self, key: &str) -> Result<Option<usize>> {
        self.get(key).map(|v| self.size_of(key, v)).transpose()
    }

    /// A size that must be present.
    pub fn req_size(&self, key: &str) -> Result<usize> {
        self.size(key)?.ok_or_else(|| Error::Gguf(format!("metadata key '{}' is missing", self.key(key))))
    }

    /// A size that must be present and at least 1.
    pub fn req_positive(&self, key: &str) -> Result<usize> {
        match self.req_size(key)? {
            0 => Err(Error::Gguf(format!("metadata key '{}' is 0; it must be at least 1", self.key(key)))),
            n => Ok(n),
        }
    }

    /// One size per layer: a scalar applies to every layer, an array gives each its own.
    pub fn sizes_per_layer(&self, key: &str, n_layers: usize) -> Result<Option<Vec<usize>>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(a)) => {
                if a.len() != n_layers {
                    return Err(Error::Gguf(format!("metadata key '{}' has {} values but the model has {n_layers} layers", self.key(key), a.len())));
                }
                a.iter().map(|v| self.size_of(key, v)).collect::<Result<Vec<_>>>().map(Some)
            }
            Some(v) => Ok(Some(vec![self.size_of(key, v)?; n_layers])),
        }
    }

    /// A finite number (an integer is taken as one), if present.
    pub fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Float(f)) if f.is_finite() => Ok(Some(*f)),
            Some(MetaValue::Int(i)) => Ok(Some(*i as f64)),
            Some(other) => Err(self.bad(key, "a finite number", other)),
        }
    }

    /// A finite number greater than 0, or `default` when absent.
    pub fn positive_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.float(key)? {
            None => Ok(default),
            Some(f) if f > 0.0 => Ok(f),
            Some(f) => Err(Error::Gguf(format!("metadata key '{}' is {f}; it must be greater than 0", self.key(key)))),
        }
    }

    pub fn flag(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.bad(key, "a boolean", other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_name_the_key_and_refuse_wrong_types() {
        let m = Metadata::new(
            "llama",
            [
                ("block_count".to_string(), MetaValue::Int(4)),
                ("neg".to_string(), MetaValue::Int(-1)),
                ("eps".to_string(), MetaValue::Float(f64::NAN)),
                ("arr".to_string(), MetaValue::Array(vec![MetaValue::Int(1), MetaValue::Int(2)])),
                ("name".to_string(), MetaValue::Str("x".into())),
            ]
            .into_iter()
            .collect(),
        );
        assert_eq!(m.req_positive("block_count").unwrap(), 4);
        assert!(m.req_size("missing").unwrap_err().to_string().contains("'llama.missing' is missing"));
        assert!(m.size("neg").unwrap_err().to_string().contains("'llama.neg'"));
        assert!(m.size("name").unwrap_err().to_string().contains("the string"));
        assert!(m.float("eps").is_err());
        assert_eq!(m.sizes_per_layer("arr", 2).unwrap(), Some(vec![1, 2]));
        assert!(m.sizes_per_layer("arr", 3).is_err());
        assert_eq!(m.sizes_per_layer("block_count", 3).unwrap(), Some(vec![4, 4, 4]));
    }
}
