//! Reading the configuration's text: splitting `k:v,k:v` entries, each kind of value
//! (booleans, integers, fractions, sizes, the `roundup_power2_divisions` forms, named choices),
//! and the error text that names the key, the value and what it expects ([`super::KEYS`]).

use super::{ConfigError, ROUNDUP_INTERVALS, key_named};
use crate::sizes::Roundup;

/// The valid values of `key`, as [`super::KEYS`] describes them.
pub(super) fn expected(key: &str) -> &'static str {
    key_named(key).map_or("a valid value", |k| k.valid)
}

/// The error for a bad value: it names the key, the value and the valid values.
pub(super) fn bad(key: &str, value: &str) -> String {
    format!(
        "bad value '{value}' for key '{key}'; expected {}",
        expected(key)
    )
}

/// [`bad`], saying what in particular is wrong.
pub(super) fn bad_because(key: &str, value: &str, reason: &str) -> String {
    format!(
        "bad value '{value}' for key '{key}' ({reason}); expected {}",
        expected(key)
    )
}

/// Split `k:v,k:v` into pairs; commas inside `[...]` belong to the value.
pub(super) fn split_entries<'a>(
    text: &'a str,
    source_name: &str,
) -> Result<Vec<(&'a str, &'a str)>, ConfigError> {
    let err = |problem: String| ConfigError {
        source_name: source_name.to_string(),
        problem,
    };
    let mut entries = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    let bytes = text.as_bytes();
    for i in 0..=bytes.len() {
        let at_end = i == bytes.len();
        let c = if at_end { b',' } else { bytes[i] };
        match c {
            b'[' => depth += 1,
            b']' => {
                depth -= 1;
                if depth < 0 {
                    return Err(err(format!("unbalanced ']' at byte {i} of '{text}'")));
                }
            }
            b',' if depth == 0 => {
                let entry = text[start..i].trim();
                start = i + 1;
                if entry.is_empty() {
                    continue;
                }
                let Some((key, value)) = entry.split_once(':') else {
                    return Err(err(format!("entry '{entry}' is not of the form key:value")));
                };
                entries.push((key.trim(), value.trim()));
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(err(format!("unbalanced '[' in '{text}'")));
    }
    Ok(entries)
}

pub(super) fn choose<T: Copy>(key: &str, value: &str, choices: &[(&str, T)]) -> Result<T, String> {
    choices
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(value))
        .map(|(_, v)| *v)
        .ok_or_else(|| bad(key, value))
}

pub(super) fn parse_bool(key: &str, value: &str) -> Result<bool, String> {
    match value.to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        _ => Err(bad(key, value)),
    }
}

pub(super) fn parse_int(key: &str, value: &str, min: u64, max: u64) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(bad(key, value)),
    }
}

/// An octal file mode that keeps the owner's read and write and adds only read and write bits
/// (`0600` to `0666`; a leading `0` or `0o` is optional).
pub(super) fn parse_file_mode(value: &str) -> Option<u32> {
    let digits = value.strip_prefix("0o").unwrap_or(value);
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b))
    {
        return None;
    }
    let mode = u32::from_str_radix(digits, 8).ok()?;
    (mode & !0o666 == 0 && mode & 0o600 == 0o600).then_some(mode)
}

/// A process's share of device memory, `[0.0, 1.0]` as PyTorch's `per_process_memory_fraction`
/// (0.0: no memory at all, as `set_per_process_memory_fraction(0.0)`).
pub(super) fn parse_memory_fraction(key: &str, value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(bad(key, value)),
    }
}

pub(super) fn parse_fraction(key: &str, value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(f) if f > 0.0 && f < 1.0 => Ok(f),
        _ => Err(bad(key, value)),
    }
}

pub(super) fn parse_max_split(value: &str) -> Result<u64, String> {
    if value.eq_ignore_ascii_case("unlimited") {
        return Ok(u64::MAX);
    }
    let mib: u64 = value
        .parse()
        .map_err(|_| "an integer number of MiB above 20, or 'unlimited'".to_string())?;
    // PyTorch refuses values not above kLargeBuffer (20 MiB): smaller limits would make every
    // 20 MiB segment of the large pool unsplittable.
    if mib <= 20 {
        return Err(
            "an integer number of MiB above 20 (PyTorch's minimum), or 'unlimited'".to_string(),
        );
    }
    mib.checked_mul(1 << 20)
        .ok_or_else(|| "a number of MiB that fits in 64 bits".to_string())
}

pub(super) fn parse_divisions(text: &str) -> Result<u32, String> {
    match text.trim().parse::<u32>() {
        Ok(n) if n == 0 || n.is_power_of_two() => Ok(n),
        _ => Err("divisions that are powers of two (1, 2, 4, 8, …)".to_string()),
    }
}

/// Parse `roundup_power2_divisions`: one number, or `[size_mb:divisions,…,>:divisions]`, where
/// each size is a power of two in MiB; the first entry also covers every smaller size, `>`
/// covers every larger one (PyTorch's rules).
pub(super) fn parse_roundup(value: &str) -> Result<Roundup, String> {
    let Some(list) = value.strip_prefix('[') else {
        let n = parse_divisions(value)?;
        return Ok(if n <= 1 {
            Roundup::None
        } else {
            Roundup::Uniform(n)
        });
    };
    let list = list.strip_suffix(']').ok_or("a list closed by ']'")?;
    let mut table = [0u32; ROUNDUP_INTERVALS];
    let mut last_index: Option<usize> = None;
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (size, divisions) = entry
            .split_once(':')
            .ok_or("list entries of the form size_mb:divisions")?;
        let divisions = parse_divisions(divisions)?;
        if size.trim() == ">" {
            let from = last_index.map_or(0, |i| i + 1);
            table[from.min(ROUNDUP_INTERVALS)..].fill(divisions);
            continue;
        }
        let mib: u64 = size
            .trim()
            .parse()
            .map_err(|_| "interval sizes in MiB that are powers of two")?;
        if !mib.is_power_of_two() {
            return Err("interval sizes in MiB that are powers of two".to_string());
        }
        let index = (mib.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
        if last_index.is_none() {
            table[..index].fill(divisions);
        } else if last_index.is_some_and(|l| index <= l) {
            return Err("interval sizes in increasing order".to_string());
        }
        table[index] = divisions;
        last_index = Some(index);
    }
    if table.iter().all(|&d| d <= 1) {
        return Ok(Roundup::None);
    }
    Ok(Roundup::PerInterval(table.to_vec()))
}
