//! Texts the program set over time that PyTorch's snapshot puts on each entry of
//! `device_traces`: its memory metadata (`_set_memory_metadata`, as `user_metadata`) and the
//! compiled region it ran in (`compile_context`, Note [Compile regions] in the Python
//! integration's C++ allocator). The Python integration keeps each change with the trace's time
//! and passes them in a JSON file of `[[T, TEXT], …]`; an entry gets the text of the last change
//! at or before its time.

use std::path::Path;

use crate::Error;

/// One text over time: each change in force from its time until the next.
#[derive(Debug, Default)]
pub struct TextOverTime {
    changes: Vec<(u64, String)>,
    /// The text before the first change (and without a file).
    before: &'static str,
}

impl TextOverTime {
    /// No changes: `before` everywhere.
    pub fn constant(before: &'static str) -> Self {
        TextOverTime {
            changes: vec![],
            before,
        }
    }

    /// The changes in `path` (`[[T, TEXT], …]`), sorted by time here (a program's calls come in
    /// order anyway); `before` until the first.
    pub fn read(path: &Path, before: &'static str) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Message(format!("{}: {e}", path.display())))?;
        let mut changes: Vec<(u64, String)> = serde_json::from_str(&text).map_err(|e| {
            Error::Message(format!(
                "{}: not a list of [time, text] pairs: {e}",
                path.display()
            ))
        })?;
        changes.sort_by_key(|(t, _)| *t);
        Ok(TextOverTime { changes, before })
    }

    /// The text in force at `t`.
    pub fn at(&self, t: u64) -> &str {
        match self.changes.partition_point(|(at, _)| *at <= t) {
            0 => self.before,
            i => &self.changes[i - 1].1,
        }
    }
}

/// The texts of every entry: what `--metadata` and `--compile-context` gave.
#[derive(Debug)]
pub struct EntryTexts {
    /// `user_metadata`: "" before the program sets any.
    pub metadata: TextOverTime,
    /// `compile_context`: "N/A" outside any compiled region, as PyTorch writes it.
    pub compile_context: TextOverTime,
}

impl Default for EntryTexts {
    fn default() -> Self {
        EntryTexts {
            metadata: TextOverTime::constant(""),
            compile_context: TextOverTime::constant(NO_COMPILE_CONTEXT),
        }
    }
}

/// PyTorch's `compile_context` of an entry made outside any compiled region.
pub const NO_COMPILE_CONTEXT: &str = "N/A";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_time_gets_the_last_change_at_or_before_it() {
        let dir = std::env::temp_dir().join(format!("cachealloc-texts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("regions.json");
        std::fs::write(&path, r#"[[30, "N/A"], [10, "Torch-Compiled Region: 0/0"], [20, "Torch-Compiled Region: 1/0"]]"#).unwrap();
        let regions = TextOverTime::read(&path, NO_COMPILE_CONTEXT).unwrap();
        assert_eq!(regions.at(5), "N/A");
        assert_eq!(regions.at(10), "Torch-Compiled Region: 0/0");
        assert_eq!(regions.at(19), "Torch-Compiled Region: 0/0");
        assert_eq!(regions.at(25), "Torch-Compiled Region: 1/0");
        assert_eq!(regions.at(31), "N/A");
        std::fs::write(&path, "{}").unwrap();
        let err = format!("{:?}", TextOverTime::read(&path, "").unwrap_err());
        assert!(err.contains("not a list of [time, text] pairs"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
