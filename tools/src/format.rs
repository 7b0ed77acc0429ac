//! Human-readable numbers.

/// Bytes in binary units, as PyTorch's `memory_summary` prints them (and the shim's reports):
/// `512 B`, `1.50 MiB`.
pub fn bytes(n: u64) -> String {
    cachealloc_core::format_bytes(n)
}

/// A trace time (ns since the base) as seconds with millisecond precision: `12.345 s`.
pub fn seconds(ns: u64) -> String {
    format!("{:.3} s", ns as f64 / 1e9)
}

/// A share as a percentage with one decimal.
pub fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1}%", part as f64 * 100.0 / whole as f64)
    }
}

/// Parse a time given on the command line: seconds (`12.5`, `12.5s`), milliseconds (`300ms`)
/// or nanoseconds (`5000ns`), since the trace's base.
pub fn parse_time(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ns") {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1e6)
    } else if let Some(n) = text.strip_suffix("us") {
        (n, 1e3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1e9)
    } else {
        (text, 1e9)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a time (examples: 12.5, 12.5s, 300ms, 5000ns)"))?;
    if value < 0.0 {
        return Err(format!("{text:?}: times are not negative"));
    }
    Ok((value * scale).round() as u64)
}

/// Parse a size given on the command line: bytes (`1048576`), or a number with a unit —
/// `KB`, `MB`, `GB`, `TB` (powers of 1000) or `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let units: [(&str, f64); 9] = [
        ("KiB", 1024.0),
        ("MiB", 1024.0 * 1024.0),
        ("GiB", 1024.0 * 1024.0 * 1024.0),
        ("TiB", 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("KB", 1e3),
        ("MB", 1e6),
        ("GB", 1e9),
        ("TB", 1e12),
        ("B", 1.0),
    ];
    let (number, scale) = units
        .iter()
        .find_map(|(unit, scale)| Some((t.strip_suffix(unit)?, *scale)))
        .unwrap_or((t, 1.0));
    match number.trim().parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok((v * scale).round() as u64),
        _ => Err(format!(
            "{text:?} is not a size (examples: 70GB, 64GiB, 512MiB, 1048576)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536 * 1024), "1.50 MiB");
        assert_eq!(seconds(12_345_678_900), "12.346 s");
        assert_eq!(parse_time("300ms").unwrap(), 300_000_000);
        assert_eq!(parse_time("1.5").unwrap(), 1_500_000_000);
        assert!(parse_time("soon").is_err());
        assert_eq!(parse_size("70GB").unwrap(), 70_000_000_000);
        assert_eq!(parse_size("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("-1GB").is_err() && parse_size("big").is_err());
    }
}
