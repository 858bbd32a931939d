//! Byte sizes: parsing budgets (`24GiB`, `80GB`) and printing sizes in IEC or SI units.

use std::fmt;

/// Error for a size that cannot be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseSizeError {
    /// The text as given.
    pub input: String,
    /// What was wrong with it.
    pub reason: &'static str,
}

impl fmt::Display for ParseSizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid size `{}`: {} (expected a number of bytes with an optional unit: K, M, G, T or KiB, MiB, GiB, TiB for powers of 1024; KB, MB, GB, TB for powers of 1000; any case)",
            self.input, self.reason
        )
    }
}

impl std::error::Error for ParseSizeError {}

/// `n` and a countable noun, singular for one: `count(1, "GPU")` is "1 GPU", `count(2, "GPU")`
/// "2 GPUs" (the plural adds `s`).
#[must_use]
pub fn count(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Reads a size in bytes: plain bytes (`1024`), IEC units (`KiB`, `MiB`, `GiB`, `TiB`, powers of
/// 1024) or SI units (`KB`, `MB`, `GB`, `TB`, powers of 1000), in any case (`24gb`, `24GIB`). A
/// bare letter is a power of 1024, as docker and most command-line tools read it: `24G` and
/// `24g` are 24 GiB, `24GB` is 24·10^9 bytes. A decimal fraction is allowed with a unit
/// (`1.5GiB`) and rounded down to whole bytes.
///
/// # Errors
/// An empty string, a negative or malformed number, an unknown unit, or a size over `u64::MAX`.
pub fn parse_size(text: &str) -> Result<u64, ParseSizeError> {
    let err = |reason| ParseSizeError {
        input: text.to_string(),
        reason,
    };
    let s = text.trim();
    if s.is_empty() {
        return Err(err("empty"));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    if number.is_empty() {
        return Err(err("no number"));
    }
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => 1 << 10,
        "m" | "mi" | "mib" => 1 << 20,
        "g" | "gi" | "gib" => 1 << 30,
        "t" | "ti" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(err("unknown unit")),
    };
    let (whole, frac) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if frac.contains('.') || (whole.is_empty() && frac.is_empty()) {
        return Err(err("malformed number"));
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| err("number too large"))?
    };
    let mut bytes = whole
        .checked_mul(multiplier)
        .ok_or_else(|| err("number too large"))?;
    if !frac.is_empty() {
        // Exact decimal arithmetic on at most 18 fractional digits: frac × multiplier / 10^digits.
        let digits = frac.len().min(18);
        let frac_val: u128 = frac[..digits]
            .parse()
            .map_err(|_| err("malformed number"))?;
        let scale = 10u128.pow(u32::try_from(digits).unwrap_or(18));
        let extra = frac_val * u128::from(multiplier) / scale;
        let extra = u64::try_from(extra).map_err(|_| err("number too large"))?;
        bytes = bytes
            .checked_add(extra)
            .ok_or_else(|| err("number too large"))?;
    }
    Ok(bytes)
}

/// Unit system for printing sizes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnitSystem {
    /// Powers of 1024: KiB, MiB, GiB, TiB (the default).
    #[default]
    Iec,
    /// Powers of 1000: kB, MB, GB, TB (`--si`).
    Si,
}

/// Formats a byte count for people: `512 B`, `97.5 MiB`, `1.23 GiB` (IEC) or `102.2 MB` (SI).
/// Three significant digits, at least one decimal for scaled units.
#[must_use]
pub fn format_bytes(bytes: u64, units: UnitSystem) -> String {
    let (base, names): (f64, [&str; 7]) = match units {
        UnitSystem::Iec => (1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]),
        UnitSystem::Si => (1000.0, ["B", "kB", "MB", "GB", "TB", "PB", "EB"]),
    };
    #[allow(clippy::cast_precision_loss)] // display only
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= base && unit < names.len() - 1 {
        value /= base;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else if value >= 100.0 {
        format!("{value:.1} {}", names[unit])
    } else {
        format!("{value:.2} {}", names[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_bytes() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("7B"), Ok(7));
    }

    #[test]
    fn iec_units() {
        assert_eq!(parse_size("24GiB"), Ok(24 * (1 << 30)));
        assert_eq!(parse_size("1KiB"), Ok(1024));
        assert_eq!(parse_size("1.5GiB"), Ok(1_610_612_736));
        assert_eq!(parse_size("2 TiB"), Ok(2 << 40));
    }

    #[test]
    fn si_units_read_as_written() {
        assert_eq!(parse_size("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_size("1.5MB"), Ok(1_500_000));
    }

    #[test]
    fn reads_units_as_people_write_them() {
        let gib = 24 * (1u64 << 30);
        for text in ["24G", "24g", "24GiB", "24GIB", "24gib", "24Gi", "24 G"] {
            assert_eq!(parse_size(text), Ok(gib), "{text}");
        }
        for text in ["24GB", "24gb", "24Gb"] {
            assert_eq!(parse_size(text), Ok(24_000_000_000), "{text}");
        }
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("1.5T"), Ok(3 << 39));
        assert_eq!(parse_size("2k"), Ok(2048));
        assert_eq!(parse_size("2kb"), Ok(2000));
    }

    #[test]
    fn rejects_bad_sizes() {
        for bad in [
            "",
            "12XB",
            "12GG",
            "12Gibs",
            "-3GiB",
            "GiB",
            "1.2.3GB",
            ".GB",
            "99999999999999999999",
            "20000000000TiB",
        ] {
            assert!(parse_size(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn formats_iec_and_si() {
        assert_eq!(format_bytes(512, UnitSystem::Iec), "512 B");
        assert_eq!(format_bytes(102_228_128, UnitSystem::Iec), "97.49 MiB");
        assert_eq!(format_bytes(102_228_128, UnitSystem::Si), "102.2 MB");
        assert_eq!(format_bytes(24 << 30, UnitSystem::Iec), "24.00 GiB");
        assert_eq!(format_bytes(3 << 50, UnitSystem::Iec), "3.00 PiB");
        assert_eq!(format_bytes(u64::MAX, UnitSystem::Iec), "16.00 EiB");
    }
}
