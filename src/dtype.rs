//! Element types and their sizes.
//!
//! Sizes follow `torch.dtype.itemsize` (`torch.finfo`/`torch.iinfo`): a tensor of `numel`
//! elements of a dtype takes `ceil(numel × bits / 8)` bytes, rounded up once per tensor so that
//! sub-byte types (int4, nf4) are exact.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An element type, as PyTorch names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `torch.float64`, 8 bytes.
    Float64,
    /// `torch.float32`, 4 bytes.
    Float32,
    /// `torch.float16`, 2 bytes.
    Float16,
    /// `torch.bfloat16`, 2 bytes.
    Bfloat16,
    /// `torch.float8_e4m3fn`, 1 byte.
    Float8E4m3,
    /// `torch.float8_e5m2`, 1 byte.
    Float8E5m2,
    /// `torch.int64`, 8 bytes (token ids, labels, max-pool indices).
    Int64,
    /// `torch.int32`, 4 bytes.
    Int32,
    /// `torch.int16`, 2 bytes.
    Int16,
    /// `torch.int8`, 1 byte.
    Int8,
    /// `torch.uint8`, 1 byte.
    Uint8,
    /// `torch.bool`, 1 byte (dropout masks on CUDA).
    Bool,
    /// Packed 4-bit integers, two per byte.
    Int4,
}

impl DType {
    /// Every dtype, for listing valid names.
    pub const ALL: [DType; 13] = [
        DType::Float64,
        DType::Float32,
        DType::Float16,
        DType::Bfloat16,
        DType::Float8E4m3,
        DType::Float8E5m2,
        DType::Int64,
        DType::Int32,
        DType::Int16,
        DType::Int8,
        DType::Uint8,
        DType::Bool,
        DType::Int4,
    ];

    /// Bits per element.
    #[must_use]
    pub const fn bits(self) -> u64 {
        match self {
            DType::Float64 | DType::Int64 => 64,
            DType::Float32 | DType::Int32 => 32,
            DType::Float16 | DType::Bfloat16 | DType::Int16 => 16,
            DType::Float8E4m3 | DType::Float8E5m2 | DType::Int8 | DType::Uint8 | DType::Bool => 8,
            DType::Int4 => 4,
        }
    }

    /// Bytes taken by a tensor of `numel` elements: `ceil(numel × bits / 8)`.
    ///
    /// Returns `None` on overflow.
    #[must_use]
    pub fn bytes_for(self, numel: u64) -> Option<u64> {
        numel.checked_mul(self.bits()).map(|b| b.div_ceil(8))
    }

    /// Whether this is a floating-point type (gradients flow only through these).
    #[must_use]
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::Float64
                | DType::Float32
                | DType::Float16
                | DType::Bfloat16
                | DType::Float8E4m3
                | DType::Float8E5m2
        )
    }

    /// The canonical name, as accepted on the command line and printed in reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::Float64 => "float64",
            DType::Float32 => "float32",
            DType::Float16 => "float16",
            DType::Bfloat16 => "bfloat16",
            DType::Float8E4m3 => "float8_e4m3",
            DType::Float8E5m2 => "float8_e5m2",
            DType::Int64 => "int64",
            DType::Int32 => "int32",
            DType::Int16 => "int16",
            DType::Int8 => "int8",
            DType::Uint8 => "uint8",
            DType::Bool => "bool",
            DType::Int4 => "int4",
        }
    }

    /// A short name for per-layer breakdowns (`f32`, `bf16`, `i64`, …).
    #[must_use]
    pub const fn short(self) -> &'static str {
        match self {
            DType::Float64 => "f64",
            DType::Float32 => "f32",
            DType::Float16 => "f16",
            DType::Bfloat16 => "bf16",
            DType::Float8E4m3 => "fp8e4m3",
            DType::Float8E5m2 => "fp8e5m2",
            DType::Int64 => "i64",
            DType::Int32 => "i32",
            DType::Int16 => "i16",
            DType::Int8 => "i8",
            DType::Uint8 => "u8",
            DType::Bool => "bool",
            DType::Int4 => "i4",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// Error for a dtype name that memest does not know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DTypeParseError(pub String);

impl fmt::Display for DTypeParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = DType::ALL.iter().map(|d| d.as_str()).collect();
        write!(
            f,
            "unknown dtype `{}`, expected one of {}",
            self.0,
            names.join(", ")
        )
    }
}

impl std::error::Error for DTypeParseError {}

impl FromStr for DType {
    type Err = DTypeParseError;

    /// Accepts the canonical names and the usual aliases (`fp32`, `f32`, `float`, `half`,
    /// `bf16`, `fp16`, `double`, `long`, `int`, `fp8`, …), case-insensitively, with or
    /// without a `torch.` prefix.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        let name = lower.strip_prefix("torch.").unwrap_or(&lower);
        Ok(match name {
            "float64" | "f64" | "fp64" | "double" => DType::Float64,
            "float32" | "f32" | "fp32" | "float" => DType::Float32,
            "float16" | "f16" | "fp16" | "half" => DType::Float16,
            "bfloat16" | "bf16" => DType::Bfloat16,
            "float8_e4m3" | "float8_e4m3fn" | "fp8" | "fp8_e4m3" | "e4m3" => DType::Float8E4m3,
            "float8_e5m2" | "fp8_e5m2" | "e5m2" => DType::Float8E5m2,
            "int64" | "i64" | "long" => DType::Int64,
            "int32" | "i32" | "int" => DType::Int32,
            "int16" | "i16" | "short" => DType::Int16,
            "int8" | "i8" => DType::Int8,
            "uint8" | "u8" => DType::Uint8,
            "bool" => DType::Bool,
            "int4" | "i4" => DType::Int4,
            _ => return Err(DTypeParseError(s.to_string())),
        })
    }
}

impl Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for DType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_sizes() {
        // 1000 float32 elements = 4000 bytes; bfloat16 = 2000; int64 = 8000; bool = 1000.
        assert_eq!(DType::Float32.bytes_for(1000), Some(4000));
        assert_eq!(DType::Bfloat16.bytes_for(1000), Some(2000));
        assert_eq!(DType::Int64.bytes_for(1000), Some(8000));
        assert_eq!(DType::Bool.bytes_for(1000), Some(1000));
        assert_eq!(DType::Float64.bytes_for(3), Some(24));
    }

    #[test]
    fn sub_byte_rounds_up_per_tensor() {
        // 3 int4 elements = 12 bits = 2 bytes (rounded up once).
        assert_eq!(DType::Int4.bytes_for(3), Some(2));
        assert_eq!(DType::Int4.bytes_for(4), Some(2));
    }

    #[test]
    fn overflow_is_none() {
        assert_eq!(DType::Float64.bytes_for(u64::MAX), None);
    }

    #[test]
    fn serialized_names_parse_back() {
        for d in DType::ALL {
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.as_str()));
            assert_eq!(serde_json::from_str::<DType>(&json).unwrap(), d);
        }
    }

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.as_str().parse::<DType>(), Ok(d));
        }
        assert_eq!("bf16".parse::<DType>(), Ok(DType::Bfloat16));
        assert_eq!("torch.float16".parse::<DType>(), Ok(DType::Float16));
        assert!("float12".parse::<DType>().is_err());
    }
}
