//! `cachealloc snapshot TRACE --serve`: the snapshots of a trace that its program is still
//! writing, one for each request read from standard input, each walking only the records the
//! program has flushed since the one before. The Python integration keeps one such process
//! beside a PyTorch program, so that a program asking for snapshots again and again through a
//! long run (`torch.cuda.memory_snapshot()` in graph trees' checks, a snapshot dumped every
//! thousand steps) pays for each record once, not once per snapshot.
//!
//! A request is a line of JSON: `{"output": PATH, "events": N}`, and optionally `"history"`
//! (the `--history` text), `"metadata"` and `"compile_context"` (the files of `--metadata` and
//! `--compile-context`). The snapshot is the one `cachealloc snapshot TRACE --events N
//! -o PATH …` would write of the trace as it is then; the answer is a line, `ok` or `error: …`.
//! The walk keeps the live state, the categories pass (`FollowedPass`) and the window of the
//! last events between requests; a request with other history settings, or for more events
//! than the window keeps, starts the walk over. The process ends at the end of its input.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use serde::Deserialize;

use super::history::{self, Cursor};
use super::texts::{EntryTexts, NO_COMPILE_CONTEXT, TextOverTime};
use super::window::WindowWalk;
use super::{every_category, write_pickle};
use crate::Error;
use crate::categories::pass::{FollowedPass, Plan};
use crate::walk::TraceWalk;

/// The events a window keeps at least: PyTorch's `_record_memory_history` keeps 100 000 unless
/// told otherwise, and a window smaller than the next request's would start the walk over.
const EVENTS_KEPT: usize = 100_000;

static EVERY_CATEGORY: LazyLock<Plan> = LazyLock::new(every_category);

/// One request (see the module docs).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Request {
    output: PathBuf,
    events: usize,
    #[serde(default)]
    history: Option<String>,
    #[serde(default)]
    metadata: Option<PathBuf>,
    #[serde(default)]
    compile_context: Option<PathBuf>,
}

/// The walk kept between requests.
struct Followed {
    walk: TraceWalk,
    pass: FollowedPass,
    window: WindowWalk,
    /// The events the window keeps.
    events: usize,
    /// The history settings it applies.
    history: Option<String>,
}

impl Followed {
    fn start(dir: &Path, request: &Request) -> Result<Followed, Error> {
        let changes = match &request.history {
            Some(spec) => history::parse(spec)?,
            None => vec![],
        };
        let events = request.events.max(EVENTS_KEPT);
        Ok(Followed {
            walk: TraceWalk::follow(dir)?,
            pass: FollowedPass::new(&EVERY_CATEGORY),
            window: WindowWalk::new(events, Cursor::new(changes)),
            events,
            history: request.history.clone(),
        })
    }

    /// Whether it can answer `request` (else the walk starts over).
    fn fits(&self, request: &Request) -> bool {
        request.events <= self.events && request.history == self.history
    }

    /// Walk the records flushed since the last request, then write the snapshot.
    fn answer(&mut self, request: &Request) -> Result<(), Error> {
        self.walk.refresh()?;
        while let Some(step) = self.walk.step() {
            let step = step?;
            self.pass.step(&self.walk, &step);
            self.window.visit(&step);
        }
        let mut texts = EntryTexts::default();
        if let Some(path) = &request.metadata {
            texts.metadata = TextOverTime::read(path, "")?;
        }
        if let Some(path) = &request.compile_context {
            texts.compile_context = TextOverTime::read(path, NO_COMPILE_CONTEXT)?;
        }
        let outcome = self.pass.outcome_now();
        let categories = outcome.has_context.then_some(&outcome);
        let window = self.window.now();
        write_pickle(
            &request.output,
            &self.walk,
            window,
            categories,
            u64::MAX,
            request.events,
            &texts,
        )
    }
}

/// Answer the requests of `input` about the trace `dir` (see the module docs).
pub(super) fn serve(dir: &Path, input: impl BufRead, out: &mut dyn Write) -> Result<(), Error> {
    let mut followed: Option<Followed> = None;
    for line in input.lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let answered = match serde_json::from_str::<Request>(&line) {
            Ok(request) => {
                let walk = match followed.take() {
                    Some(f) if f.fits(&request) => Ok(f),
                    _ => Followed::start(dir, &request),
                };
                let answered = walk.and_then(|walk| followed.insert(walk).answer(&request));
                if answered.is_err() {
                    // What the walk kept may be half-way through a record: start over.
                    followed = None;
                }
                answered
            }
            Err(e) => Err(Error::Message(format!(
                "not a snapshot request ({e}): {line}"
            ))),
        };
        match answered {
            Ok(()) => writeln!(out, "ok")?,
            Err(Error::Io(e)) => writeln!(out, "error: {e}")?,
            Err(Error::Message(m)) => writeln!(out, "error: {}", m.replace('\n', " "))?,
        }
        out.flush()?;
    }
    Ok(())
}
