//! A progress spinner on stderr for long passes (hidden when stderr is not a terminal).

use indicatif::{ProgressBar, ProgressStyle};

/// Progress of a pass over a trace, in records.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A spinner labelled `what`.
    pub fn new(what: &str) -> Progress {
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg}: {human_pos} records ({per_sec})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_message(what.to_string());
        Progress { bar }
    }

    /// No spinner (a pass among many, which its caller reports).
    pub fn hidden() -> Progress {
        Progress {
            bar: ProgressBar::hidden(),
        }
    }

    /// Records done so far.
    pub fn tick(&self, records: u64) {
        self.bar.set_position(records);
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}
