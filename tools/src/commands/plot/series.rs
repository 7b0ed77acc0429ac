//! `plot`'s timelines by category and by module (`--by category`, `--by module`): the
//! categories pass (`crate::categories::pass`) cut into time slices, each at its peak of
//! allocated memory, stacked by PyTorch's categories (in its colours) or by the
//! modules holding the most at the device's peak.

use std::collections::HashMap;

use crate::categories::pass::Outcome;
use crate::categories::slices::SliceRow;
use crate::categories::{Category, module_prefixes};

/// Modules shown by name in `--by module`; the rest are "other modules".
const TOP_MODULES: usize = 12;

/// A device's timeline by category or module.
#[derive(Debug, Default)]
pub struct Series {
    /// Series names, bottom to top.
    pub names: Vec<String>,
    /// Their colours (CSS), or empty for the page's palette.
    pub colors: Vec<String>,
    /// Per point: time (s), allocated and reserved bytes, bytes per series.
    pub t: Vec<f64>,
    /// Allocated bytes at each point.
    pub allocated: Vec<u64>,
    /// The most reserved bytes in each point's slice.
    pub reserved: Vec<u64>,
    /// Bytes per series at each point.
    pub values: Vec<Vec<u64>>,
}

/// The module path `name` cut to its first `depth` components.
fn cut(name: &str, depth: usize) -> &str {
    module_prefixes(name)
        .find(|p| p.split('.').count() <= depth)
        .unwrap_or(name)
}

/// Every device's timeline by category (`by_module` false) or by module path cut to
/// `module_depth` components, from a categories pass that cut slices (and by scope, for
/// modules) and found each device's peak.
pub fn timelines(outcome: &Outcome, by_module: bool, module_depth: usize) -> HashMap<u32, Series> {
    let mut out = HashMap::new();
    for (device, rows) in &outcome.slices {
        let mut series = Series::default();
        if by_module {
            let group = |scope: u32| -> String {
                if scope == 0 {
                    "(no module)".into()
                } else {
                    cut(&outcome.scope_name(scope), module_depth).to_string()
                }
            };
            // The groups holding the most at the peak, in path order; then the rest.
            let mut at_peak: HashMap<String, u64> = HashMap::new();
            if let Some(c) = outcome.at_instant.get(device) {
                for (scope, bytes) in &c.by_scope {
                    *at_peak.entry(group(*scope)).or_default() += bytes;
                }
            }
            let mut top: Vec<(String, u64)> = at_peak.into_iter().collect();
            top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            top.truncate(TOP_MODULES);
            series.names = top.into_iter().map(|(name, _)| name).collect();
            series.names.sort();
            series.names.push("other modules".into());
            let index: HashMap<String, usize> = series
                .names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.clone(), i))
                .collect();
            let other = series.names.len() - 1;
            let mut of_scope: HashMap<u32, usize> = HashMap::new();
            for row in rows {
                let mut values = vec![0; series.names.len()];
                for (scope, bytes) in &row.by_scope {
                    let i = *of_scope
                        .entry(*scope)
                        .or_insert_with(|| index.get(&group(*scope)).copied().unwrap_or(other));
                    values[i] += bytes;
                }
                push(&mut series, row, values);
            }
        } else {
            series.names = Category::ALL.iter().map(|c| c.name().to_string()).collect();
            series.colors = Category::ALL
                .iter()
                .map(|c| c.color().to_string())
                .collect();
            for row in rows {
                push(&mut series, row, row.by_category.to_vec());
            }
        }
        out.insert(*device, series);
    }
    out
}

fn push(series: &mut Series, row: &SliceRow, values: Vec<u64>) {
    series.t.push(row.t as f64 / 1e9);
    series.allocated.push(row.allocated);
    series.reserved.push(row.reserved);
    series.values.push(values);
}

#[cfg(test)]
mod tests {
    use super::cut;

    #[test]
    fn cutting_paths() {
        assert_eq!(
            cut("Llama.model.layers.3.mlp.down_proj", 4),
            "Llama.model.layers.3"
        );
        assert_eq!(cut("Net.head", 4), "Net.head");
        assert_eq!(cut("Net", 1), "Net");
    }
}
