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
//! A request without `output` asks for no snapshot: the server begins following the trace
//! with those settings (the integration sends one when the program turns its memory history
//! on), so that the program's first snapshot, perhaps hours later, finds the walk done.
//!
//! Between requests the server goes on walking what the program writes ([`FOLLOW_EVERY`]), a
//! chunk of records at a time, so a request waits only for the records written since the last
//! look, and files the recorder rotates away later have been read. The walk keeps the live
//! state, the categories pass (`FollowedPass`) and the window of the last events; of the
//! allocations' categories it keeps only those the window's events and the live blocks show.
//! A request for more events than the window keeps, or whose history settings are not the
//! ones it has plus changes after its walk's time (`Cursor::extend`), starts the walk over.
//! The process ends at the end of its input.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use serde::Deserialize;

use super::history::{self, Cursor, Settings};
use super::texts::{EntryTexts, NO_COMPILE_CONTEXT, TextOverTime};
use super::window::WindowWalk;
use super::{every_category, write_pickle};
use crate::Error;
use crate::categories::pass::{FollowedPass, Plan};
use crate::walk::TraceWalk;

/// The events a window keeps at least: PyTorch's `_record_memory_history` keeps 100 000 unless
/// told otherwise, and a window smaller than the next request's would start the walk over.
const EVENTS_KEPT: usize = 100_000;

/// How often a server with nothing to do looks for records the program has written.
const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// Records walked between two looks for a request, while the walk is behind.
const CHUNK: usize = 65_536;

static EVERY_CATEGORY: LazyLock<Plan> = LazyLock::new(every_category);

/// One request (see the module docs).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Request {
    #[serde(default)]
    output: Option<PathBuf>,
    events: usize,
    #[serde(default)]
    history: Option<String>,
    #[serde(default)]
    metadata: Option<PathBuf>,
    #[serde(default)]
    compile_context: Option<PathBuf>,
}

impl Request {
    /// The program's history changes the request gives (none: it said nothing).
    fn history_changes(&self) -> Result<Vec<Settings>, Error> {
        self.history.as_deref().map_or(Ok(vec![]), history::parse)
    }
}

/// The walk kept between requests.
struct Followed {
    walk: TraceWalk,
    pass: FollowedPass,
    window: WindowWalk,
    /// The events the window keeps.
    events: usize,
    /// Whether the walk has reached what the trace had when last looked at.
    at_end: bool,
}

impl Followed {
    fn start(dir: &Path, request: &Request) -> Result<Followed, Error> {
        let changes = request.history_changes()?;
        let events = request.events.max(EVENTS_KEPT);
        Ok(Followed {
            walk: TraceWalk::follow(dir)?,
            pass: FollowedPass::new(&EVERY_CATEGORY),
            window: WindowWalk::new(events, Cursor::new(changes)),
            events,
            at_end: false,
        })
    }

    /// Take `request`'s settings, if the walk can answer it with them (else it starts over).
    fn takes(&mut self, request: &Request) -> Result<bool, Error> {
        let changes = request.history_changes()?;
        Ok(request.events <= self.events && self.window.extend_history(&changes))
    }

    /// Walk at most `most` records of what the trace has; true when none are left. At the end
    /// the walk looks again (the program may have written more, or begun a file).
    fn catch_up(&mut self, most: usize) -> Result<bool, Error> {
        if self.at_end {
            self.walk.refresh()?;
            self.at_end = false;
        }
        let mut walked = 0;
        while walked < most {
            let Some(step) = self.walk.step() else {
                self.at_end = true;
                break;
            };
            let step = step?;
            self.pass.step(&self.walk, &step);
            self.window.visit(&step);
            walked += 1;
        }
        if walked > 0 {
            let live = self.window.live_ordinals();
            (self.pass).forget_before(self.window.first_ordinal(), |o| live.contains(&o));
        }
        Ok(self.at_end)
    }

    /// Walk the records flushed since the last look, then write the snapshot.
    fn answer(&mut self, request: &Request, output: &Path) -> Result<(), Error> {
        // What the program flushed before asking is the least the snapshot must have.
        self.at_end = true;
        while !self.catch_up(usize::MAX)? {}
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
            output,
            &self.walk,
            window,
            categories,
            u64::MAX,
            request.events,
            &texts,
        )
    }
}

/// Answer the requests of `input` about the trace `dir`, following it between them (see the
/// module docs).
pub(super) fn serve(
    dir: &Path,
    input: impl Read + Send + 'static,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let (lines, requests) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(input).lines() {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut followed: Option<Followed> = None;
    loop {
        // Behind: a chunk more, unless a request waits. Caught up: wait for one, looking at
        // the trace again every `FOLLOW_EVERY`.
        let wait = match &followed {
            Some(f) if !f.at_end => Duration::ZERO,
            _ => FOLLOW_EVERY,
        };
        let line = match requests.recv_timeout(wait) {
            Ok(line) => line?,
            Err(RecvTimeoutError::Timeout) => {
                if let Some(f) = &mut followed
                    && f.catch_up(CHUNK).is_err()
                {
                    // The request that comes next will say what is wrong.
                    followed = None;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        };
        if line.trim().is_empty() {
            continue;
        }
        let answered = match serde_json::from_str::<Request>(&line) {
            Ok(request) => {
                let walk = match followed.take() {
                    Some(mut f) => match f.takes(&request) {
                        Ok(true) => Ok(f),
                        Ok(false) => Followed::start(dir, &request),
                        Err(e) => {
                            followed = Some(f);
                            Err(e)
                        }
                    },
                    None => Followed::start(dir, &request),
                };
                match walk {
                    Ok(walk) => {
                        let f = followed.insert(walk);
                        let answered = match &request.output {
                            Some(output) => f.answer(&request, output),
                            None => Ok(()),
                        };
                        if answered.is_err() {
                            // What the walk kept may be half-way through a record: start over.
                            followed = None;
                        }
                        answered
                    }
                    Err(e) => Err(e),
                }
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
}
