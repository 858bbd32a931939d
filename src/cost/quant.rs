//! Quantized-weight layouts: bytes of a weight with its scales and zero points.

/// Weight quantization of linear projections (norms, embeddings and the LM head keep the compute
/// dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Quant {
    /// bitsandbytes NF4: 4 bits per weight plus a float32 absmax per 64 weights; with double
    /// quantization the absmax values are 8-bit with a float32 scale per 256 of them.
    Nf4 {
        /// Double quantization of the absmax scales.
        double_quant: bool,
    },
    /// bitsandbytes LLM.int8(): 1 byte per weight plus a float32 scale per output row.
    Int8,
    /// GPTQ/AWQ-style int4: 4 bits per weight plus, per group, a float16 scale and a 4-bit zero point.
    Int4 {
        /// Weights per group (128 by default).
        group_size: u64,
    },
    /// FP8 weights (e4m3 or e5m2): 1 byte per weight plus one float32 scale per matrix.
    Fp8,
}

/// A weight as a batch of `[out, in]` matrices: `[out, in]` is one matrix, MoE experts'
/// `[experts, out, in]` are `experts` matrices (every leading dimension counts as a batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightShape {
    /// Matrices: the product of the leading dimensions (1 for `[out, in]`).
    pub matrices: u64,
    /// Output rows of one matrix.
    pub out: u64,
    /// Input columns of one matrix.
    pub inp: u64,
}

impl WeightShape {
    /// The matrices of a weight of dimensions `dims`; a vector `[n]` is read as `n` rows of
    /// one column. `None` when the leading dimensions' product overflows.
    #[must_use]
    pub fn of(dims: &[u64]) -> Option<WeightShape> {
        Some(match dims {
            [] => WeightShape {
                matrices: 1,
                out: 1,
                inp: 1,
            },
            [n] => WeightShape {
                matrices: 1,
                out: *n,
                inp: 1,
            },
            [lead @ .., out, inp] => WeightShape {
                matrices: lead.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?,
                out: *out,
                inp: *inp,
            },
        })
    }
}

impl Quant {
    /// The format's name (`nf4`, `int8`, `int4`, `fp8`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Quant::Nf4 { .. } => "nf4",
            Quant::Int8 => "int8",
            Quant::Int4 { .. } => "int4",
            Quant::Fp8 => "fp8",
        }
    }

    /// Bytes of a quantized weight of dimensions `dims` with its metadata, laid out per
    /// `[out, in]` matrix ([`WeightShape`]); with `n = out·in` per matrix:
    /// - NF4 (bitsandbytes `Params4bit`, blocksize 64): `ceil(n/2)` + a float32 absmax per 64
    ///   weights, or with double quantization an int8 absmax per 64 plus a float32 scale per
    ///   256 blocks;
    /// - int8 (LLM.int8(), `Int8Params`): `n` + a float32 scale per output row;
    /// - int4 (GPTQ/AWQ): `ceil(n/2)` + per group of `group_size` input weights of a row a
    ///   float16 scale and a packed 4-bit zero point;
    /// - fp8: `n` + one float32 scale.
    ///
    /// `None` on overflow.
    #[must_use]
    pub fn bytes(self, dims: &[u64]) -> Option<u64> {
        let WeightShape { matrices, out, inp } = WeightShape::of(dims)?;
        let n = out.checked_mul(inp)?;
        let one = match self {
            Quant::Nf4 { double_quant } => {
                let blocks = n.div_ceil(64);
                let meta = if double_quant {
                    blocks.checked_add(blocks.div_ceil(256).checked_mul(4)?)?
                } else {
                    blocks.checked_mul(4)?
                };
                n.div_ceil(2).checked_add(meta)?
            }
            Quant::Int8 => n.checked_add(out.checked_mul(4)?)?,
            Quant::Int4 { group_size } => {
                let groups = out.checked_mul(inp.div_ceil(group_size.max(1)))?;
                n.div_ceil(2)
                    .checked_add(groups.checked_mul(2)?)?
                    .checked_add(groups.div_ceil(2))?
            }
            Quant::Fp8 => n.checked_add(4)?,
        };
        one.checked_mul(matrices)
    }
}

impl std::str::FromStr for Quant {
    type Err = String;

    /// `nf4` (with double quantization), `int8`, `int4` (groups of 128) or `fp8`,
    /// case-insensitively. bitsandbytes' `fp4` is read as `nf4`: `quant_type` picks only the
    /// 16-entry code book, the storage is the same (4-bit codes in blocks of 64 with an absmax
    /// each, `bitsandbytes/functional.py`, `quantize_4bit`).
    fn from_str(s: &str) -> Result<Quant, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "nf4" | "fp4" => Quant::Nf4 { double_quant: true },
            "int8" => Quant::Int8,
            "int4" => Quant::Int4 { group_size: 128 },
            "fp8" => Quant::Fp8,
            _ => {
                return Err(format!(
                    "unknown quantization `{s}`, expected nf4, fp4, int8, int4 or fp8"
                ));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_d_layouts() {
        // [512, 1000]: 512,000 weights.
        let d = [512, 1000];
        // 256,000 + 8,000 int8 absmax + 32 blocks of 256 · 4 B = 264,128
        assert_eq!(Quant::Nf4 { double_quant: true }.bytes(&d), Some(264_128));
        // 256,000 + 8,000 · 4 B float32 absmax
        assert_eq!(
            Quant::Nf4 {
                double_quant: false
            }
            .bytes(&d),
            Some(288_000)
        );
        // 512,000 + 512 rows · 4 B
        assert_eq!(Quant::Int8.bytes(&d), Some(514_048));
        // 256,000 + 512 · 8 groups · 2 B scale + 4,096 groups / 2 B of zero points
        assert_eq!(
            Quant::Int4 { group_size: 128 }.bytes(&d),
            Some(256_000 + 8_192 + 2_048)
        );
        assert_eq!(Quant::Fp8.bytes(&d), Some(512_004));
    }

    /// Leading dimensions are a batch of matrices: `[8, 14336, 4096]` (Mixtral's experts) is
    /// eight `[14336, 4096]` weights, each with its own rows and groups.
    #[test]
    fn three_d_weights_are_a_batch_of_matrices() {
        let experts = [8, 14_336, 4_096];
        let one = [14_336, 4_096];
        for q in [
            Quant::Nf4 { double_quant: true },
            Quant::Int8,
            Quant::Int4 { group_size: 128 },
            Quant::Fp8,
        ] {
            assert_eq!(
                q.bytes(&experts),
                q.bytes(&one).map(|b| 8 * b),
                "{}",
                q.name()
            );
        }
        // int4: 14,336 rows · 32 groups = 458,752 groups per expert, 2.5 B each.
        let n = 8 * 14_336 * 4_096;
        assert_eq!(
            Quant::Int4 { group_size: 128 }.bytes(&experts),
            Some(n / 2 + 8 * 458_752 * 5 / 2)
        );
        // int8: a float32 scale per row of every expert.
        assert_eq!(Quant::Int8.bytes(&experts), Some(n + 8 * 14_336 * 4));
        assert_eq!(
            WeightShape::of(&experts),
            Some(WeightShape {
                matrices: 8,
                out: 14_336,
                inp: 4_096
            })
        );
    }

    #[test]
    fn overflow_is_none() {
        assert_eq!(Quant::Int8.bytes(&[u64::MAX, 2, 2]), None);
        assert_eq!(WeightShape::of(&[u64::MAX, 2, 2, 2]), None);
    }
}
