//! Which traces become which ranks of which job ([`plan_ranks`]: every header read before
//! anything is written), and the ranks exported in parallel, their results handed on in order
//! ([`for_each_exported`]).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;

use super::{RankExport, export_rank};
use crate::Error;
use crate::walk::TraceWalk;

/// A job name usable as a directory name and a partition value.
pub fn parse_job(value: &str) -> Result<String, String> {
    if value.is_empty()
        || value.len() > 200
        || !value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.+@:".contains(c))
        || value.starts_with('.')
    {
        return Err(format!(
            "'{value}' is not a job name: use letters, digits and - _ . + @ : (not first '.')"
        ));
    }
    Ok(value.to_string())
}

/// A host name as a job name: characters a partition value cannot hold become `_`.
fn job_from_host(host: &str) -> String {
    let job: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.+@:".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    match job.trim_start_matches('.') {
        "" => "job".to_string(),
        j => j.to_string(),
    }
}

/// One trace to export: where from, where to, and what its files say of it.
#[derive(Debug, Clone)]
pub struct RankPlan {
    /// The trace directory.
    pub dir: PathBuf,
    /// Its rank: the trace's `RANK`, else its position among the traces given.
    pub rank: i64,
    /// The job's name.
    pub job: String,
    /// The partition directory, `root/job=<job>/rank=<rank>`.
    pub part: PathBuf,
    /// The trace's first header.
    pub header: cachealloc_recorder::schema::Header,
}

/// Read every trace's header: each one's rank (two traces of one rank are refused) and
/// partition under `root`; the job is `job`, else named after the first trace's host.
pub fn plan_ranks(
    dirs: &[PathBuf],
    mut job: Option<String>,
    root: &Path,
) -> Result<Vec<RankPlan>, Error> {
    let mut seen: HashSet<i64> = HashSet::new();
    let mut plans = Vec::with_capacity(dirs.len());
    for (index, dir) in dirs.iter().enumerate() {
        let mut walk = TraceWalk::open(dir)?;
        let first = walk.step_ref().map(|s| s.map(|_| ()));
        let header = match (first, &walk.header) {
            (Some(Ok(())), Some(h)) => h.clone(),
            (Some(Err(e)), _) => return Err(Error::Message(e)),
            _ => {
                return Err(Error::Message(format!(
                    "{}: the trace has no readable header",
                    dir.display()
                )));
            }
        };
        let rank = if header.rank >= 0 {
            i64::from(header.rank)
        } else {
            index as i64
        };
        if !seen.insert(rank) {
            return Err(Error::Message(format!(
                "{}: a second trace of rank {rank} (export the runs of one rank under different --job names)",
                dir.display()
            )));
        }
        let job = job
            .get_or_insert_with(|| job_from_host(&header.host))
            .clone();
        let part = root.join(format!("job={job}")).join(format!("rank={rank}"));
        plans.push(RankPlan {
            dir: dir.clone(),
            rank,
            job,
            part,
            header,
        });
    }
    Ok(plans)
}

/// Export every plan with up to `jobs` threads, calling `done` with each result in the plans'
/// order as soon as it and those before it are written. The first error (in that order) stops
/// the export: ranks not yet begun are left, and it is returned.
pub fn for_each_exported(
    plans: &[RankPlan],
    jobs: usize,
    mut done: impl FnMut(&RankPlan, &RankExport) -> Result<(), Error>,
) -> Result<(), Error> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<(usize, Result<RankExport, Error>)>();
        for _ in 0..jobs.clamp(1, plans.len().max(1)) {
            let tx = tx.clone();
            let (next, stop) = (&next, &stop);
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= plans.len() || stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let result = export_rank(&plans[i]);
                    if tx.send((i, result)).is_err() {
                        return;
                    }
                }
            });
        }
        drop(tx);
        // Results arrive in any order; they are handed on in the plans' order.
        let mut waiting: Vec<Option<Result<RankExport, Error>>> =
            (0..plans.len()).map(|_| None).collect();
        let mut handed = 0;
        let mut outcome = Ok(());
        for (i, result) in rx {
            waiting[i] = Some(result);
            while outcome.is_ok()
                && let Some(result) = waiting.get_mut(handed).and_then(Option::take)
            {
                outcome = result.and_then(|r| done(&plans[handed], &r));
                handed += 1;
            }
            if outcome.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
        }
        outcome
    })
}
