//! The queue between the senders (every thread that allocates) and the recorder's worker: a
//! ring of cache-line slots that the senders only *store* to and the worker only *loads* from.
//!
//! *Note [The hand-off's cache lines]*: what a send costs the program is mostly the cache lines
//! it pulls from the worker's core. Crossbeam's bounded array channel, which this replaces,
//! loads each slot's stamp before claiming it, and the worker wrote that stamp when it took the
//! slot's previous record: one cross-core miss per record, ~100 ns on the GPU machine's Xeon
//! (design.md, "Where a traced allocation's time goes"). Its list channel writes only fresh
//! blocks, but allocates one (zeroed) per 31 records and takes a locked instruction per record on
//! each side: on the development VM it cost ~25 ns more a send than the array.
//!
//! Here a send claims an index with one `fetch_add` on the tail, then writes the record's words
//! and the slot's sequence number with plain stores (relaxed and release atomics compile to
//! plain moves on x86-64), and never loads a line the worker writes. The worker reads slots in
//! index order, each once its sequence number says it is written, and publishes how far it has
//! read once per batch.
//!
//! What is left is the sender's own part. On mlp, records claimed and stored into a second ring
//! that no thread reads cost the step as much as the whole hand-off (~0.5 %), the claim's locked
//! `fetch_add` at most ~0.1 % of it, and the worker's reading nothing measurable (design.md,
//! "mlp's trace, by half"; BENCHMARKS.md, thirty-fourth session). It was inferred (the GPU
//! machines have no hardware counters) to be the slot's line: last written one lap of the ring
//! earlier, it misses at every send, and the program's next locked instruction (most likely the
//! allocator's unlock) waits for the store. But prefetching the slot 16 or 2 sends ahead changed
//! nothing measurable (branches `prefetch-ahead`, `prefetch-near`; BENCHMARKS.md, thirty-fifth
//! session), so that reading is now the less likely one: what the sender's part costs is open.
//!
//! A send touches two lines of the queue: the *claims* line, which holds the tail, where the
//! slots are, and the worker's head as a sender last saw it, and the slot. In a real step the
//! program's own work evicts both between two records (`scripts/bench-cold-lines`), so each line
//! more is a miss a record. A sender checks for room against the head it last saw, on the line
//! it has just written; only when that says the ring may be full does it load the worker's own
//! head (another core's line) and write what it saw back — about once per ring's worth of
//! records. The worker keeps its own copy of where the slots are, so it never reads the claims
//! line while draining. The order of the trace is the order of the claims: records sent under
//! the allocator's lock stay in the lock's order.
//!
//! The hot kinds (allocations, frees, segments, scopes, tags) fit a slot's seven words. Any
//! other message (stack and frame definitions, annotations, checkpoints, flushes) is kept aside
//! under its slot's index, and the slot holds a token: the worker takes the message when it
//! reads the token, so it comes out in its place. (A sender never holds the side's lock while it
//! waits for room: the worker takes that lock to read a token.)

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::schema::{
    Alloc, FreeCompleted, FreeRequested, Record, ScopeEvent, SegmentEvent, TagEvent, kinds,
};

/// A slot's words beside its sequence number.
const WORDS: usize = 7;
/// The first word's kind for a message waiting in the side queue.
const SIDE: u8 = 0;

/// A record as words, or a message of the side queue. `M` is what the side queue carries.
pub(crate) enum Taken<M> {
    Record(Record),
    Side(M),
}

/// One record, on a cache line of its own. `seq` is the index it was written for, plus one.
#[repr(align(64))]
#[derive(Default)]
struct Slot {
    seq: AtomicU64,
    words: [AtomicU64; WORDS],
}

impl Slot {
    /// Write a record's words, then the slot's sequence number (release: a worker that sees the
    /// number reads the words).
    fn write(&self, index: usize, words: [u64; WORDS]) {
        for (word, value) in self.words.iter().zip(words) {
            word.store(value, Ordering::Relaxed);
        }
        self.seq.store(index as u64 + 1, Ordering::Release);
    }

    /// The record's words (after its sequence number said they are written).
    fn words(&self) -> [u64; WORDS] {
        std::array::from_fn(|i| self.words[i].load(Ordering::Relaxed))
    }
}

/// A counter on a cache line of its own.
#[repr(align(128))]
#[derive(Default)]
struct Padded(AtomicUsize);

/// Everything a send reads and writes besides its slot, on a line of its own (two, against the
/// adjacent-line prefetcher): the next index to claim, a lower bound of the worker's head, and
/// the slots.
#[repr(align(128))]
struct Claims {
    /// The next index to claim.
    tail: AtomicUsize,
    /// The worker's head as a sender last loaded it (only grows, and never passes the head):
    /// a send that finds room against it needs no other line.
    head_seen: AtomicUsize,
    slots: Arc<[Slot]>,
    mask: usize,
    /// Whether the worker is behind ([`Queue::congested`]): read by every allocation that
    /// would capture a stack, just before its send writes this line; written only when it
    /// changes.
    congested: AtomicBool,
    /// How many sends loaded the worker's head (the tests' window on the fast path).
    #[cfg(test)]
    head_loads: AtomicUsize,
}

/// The ring (see the module docs). `M`: the side queue's messages.
pub(crate) struct Queue<M> {
    /// The senders' line.
    claims: Claims,
    /// The worker's copy of `claims.slots`, on a line the senders do not write.
    slots: Arc<[Slot]>,
    mask: usize,
    /// The next index the worker reads: every slot before it is free to write again.
    head: Padded,
    /// The messages that do not fit a slot, by the index of their token.
    side: Mutex<HashMap<usize, M>>,
    /// No worker reads any more: senders stop waiting for room.
    stopped: AtomicBool,
    /// No sender will send any more: the worker stops once the queue is empty.
    closed: AtomicBool,
}

impl<M> Queue<M> {
    /// A ring of at least `capacity` slots (a power of two).
    pub(crate) fn new(capacity: usize) -> Queue<M> {
        let capacity = capacity.max(2).next_power_of_two();
        let slots: Arc<[Slot]> = (0..capacity).map(|_| Slot::default()).collect();
        Queue {
            claims: Claims {
                tail: AtomicUsize::new(0),
                head_seen: AtomicUsize::new(0),
                slots: slots.clone(),
                mask: capacity - 1,
                congested: AtomicBool::new(false),
                #[cfg(test)]
                head_loads: AtomicUsize::new(0),
            },
            slots,
            mask: capacity - 1,
            head: Padded::default(),
            side: Mutex::new(HashMap::new()),
            stopped: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }
    }

    /// How many records the ring holds.
    pub(crate) fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Queue `record`. `wait` is called, with a function that says whether the ring has room
    /// yet, when it had none: it returns once there is (or the worker stopped).
    pub(crate) fn send(&self, record: Record, wait: impl FnOnce(&dyn Fn() -> bool))
    where
        M: From<Record>,
    {
        match encode(&record) {
            Some(words) => {
                let index = self.claim(wait);
                self.fill(index, words);
            }
            None => self.send_side(M::from(record), wait),
        }
    }

    /// Queue a message that does not fit a slot, in order with the records.
    pub(crate) fn send_side(&self, message: M, wait: impl FnOnce(&dyn Fn() -> bool)) {
        let index = self.claim(wait);
        self.side
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(index, message);
        self.fill(index, [0; WORDS]);
    }

    fn claim(&self, wait: impl FnOnce(&dyn Fn() -> bool)) -> usize {
        let claims = &self.claims;
        let index = claims.tail.fetch_add(1, Ordering::Relaxed);
        // Acquire: the sender that saw this head loaded it with acquire, so the worker's reads
        // of the slot's previous record happen before this send's writes to it.
        if index.wrapping_sub(claims.head_seen.load(Ordering::Acquire)) <= claims.mask {
            return index;
        }
        self.claim_against_head(index, wait);
        index
    }

    /// The ring looked full against the head a sender last saw: look at the worker's own, and
    /// wait for room if there is none.
    #[cold]
    #[inline(never)]
    fn claim_against_head(&self, index: usize, wait: impl FnOnce(&dyn Fn() -> bool)) {
        let claims = &self.claims;
        let room = || {
            #[cfg(test)]
            claims.head_loads.fetch_add(1, Ordering::Relaxed);
            let head = self.head.0.load(Ordering::Acquire);
            claims.head_seen.fetch_max(head, Ordering::AcqRel);
            index.wrapping_sub(head) <= claims.mask || self.stopped.load(Ordering::Acquire)
        };
        if !room() {
            wait(&room);
        }
    }

    fn fill(&self, index: usize, words: [u64; WORDS]) {
        let claims = &self.claims;
        claims.slots[index & claims.mask].write(index, words);
    }

    /// Whether the worker is behind: set by the worker when it finds the ring more than three
    /// quarters full and by a send that finds it full, cleared by the worker.
    pub(crate) fn congested(&self) -> bool {
        self.claims.congested.load(Ordering::Relaxed)
    }

    /// Publish whether the worker is behind; a store only when that changes, so that the
    /// senders' line is not taken from them for nothing.
    pub(crate) fn set_congested(&self, congested: bool) {
        if self.claims.congested.load(Ordering::Relaxed) != congested {
            self.claims.congested.store(congested, Ordering::Relaxed);
        }
    }

    /// Records claimed and not yet read (approximate while senders are claiming).
    pub(crate) fn backlog(&self) -> usize {
        let head = self.head.0.load(Ordering::Relaxed);
        self.claims
            .tail
            .load(Ordering::Relaxed)
            .saturating_sub(head)
    }

    /// The worker: the message at `*head`, if it is written yet; advances `*head`. The slots
    /// read become free to write only at [`Queue::release`].
    pub(crate) fn take(&self, head: &mut usize) -> Option<Taken<M>> {
        loop {
            let index = *head;
            let slot = &self.slots[index & self.mask];
            if slot.seq.load(Ordering::Acquire) != index as u64 + 1 {
                return None;
            }
            let words = slot.words();
            *head += 1;
            if let Some(record) = decode(words) {
                return Some(Taken::Record(record));
            }
            let mut side = self.side.lock().unwrap_or_else(|p| p.into_inner());
            // Its sender put it there before it wrote the token.
            if let Some(message) = side.remove(&index) {
                return Some(Taken::Side(message));
            }
        }
    }

    /// The worker: every slot before `head` is read; senders may write them again.
    pub(crate) fn release(&self, head: usize) {
        if self.head.0.load(Ordering::Relaxed) != head {
            self.head.0.store(head, Ordering::Release);
        }
    }

    /// The worker has stopped: senders no longer wait for room (what they send is dropped).
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        // Nothing will read the side queue again.
        self.side.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Whether the worker has stopped.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }

    /// No more sends (the sending side was dropped).
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Whether [`Queue::close`] was called: what the queue holds then is all there will be.
    pub(crate) fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// The first word: the kind, a byte beside it, and a 32-bit field in the upper half.
fn head_word(kind: u8, byte: u8, high: u32) -> u64 {
    u64::from(kind) | u64::from(byte) << 8 | u64::from(high) << 32
}

/// Two 32-bit fields in one word.
fn pair(low: u32, high: u32) -> u64 {
    u64::from(low) | u64::from(high) << 32
}

fn halves(word: u64) -> (u32, u32) {
    (word as u32, (word >> 32) as u32)
}

/// `record` as a slot's words, for the kinds that fit.
fn encode(record: &Record) -> Option<[u64; WORDS]> {
    Some(match record {
        Record::Alloc(a) => [
            head_word(kinds::ALLOC, 0, a.thread),
            a.t,
            a.stream,
            a.address,
            a.requested,
            a.size,
            pair(a.device, a.stack),
        ],
        Record::FreeRequested(f) | Record::Free(f) => [
            head_word(record.kind(), 0, f.thread),
            f.t,
            f.stream,
            f.address,
            f.size,
            0,
            pair(f.device, f.stack),
        ],
        Record::FreeCompleted(f) => [
            head_word(kinds::FREE_COMPLETED, 0, 0),
            f.t,
            0,
            f.address,
            f.size,
            0,
            pair(f.device, 0),
        ],
        Record::SegmentAlloc(s)
        | Record::SegmentFree(s)
        | Record::SegmentMap(s)
        | Record::SegmentUnmap(s) => [
            head_word(record.kind(), s.pool, 0),
            s.t,
            0,
            s.address,
            s.size,
            0,
            pair(s.device, s.stack),
        ],
        Record::Scope(s) => [
            head_word(kinds::SCOPE, 0, s.thread),
            s.t,
            0,
            0,
            0,
            0,
            pair(0, s.scope),
        ],
        Record::Tag(g) => [
            head_word(kinds::TAG, g.category, 0),
            g.t,
            0,
            g.address,
            0,
            0,
            pair(g.device, 0),
        ],
        _ => return None,
    })
}

/// The record of a slot's words, or `None` for a side queue's token.
fn decode(w: [u64; WORDS]) -> Option<Record> {
    let (kind, byte, high) = (w[0] as u8, (w[0] >> 8) as u8, (w[0] >> 32) as u32);
    let (device, stack) = halves(w[6]);
    let free = || FreeRequested {
        t: w[1],
        device,
        stream: w[2],
        address: w[3],
        size: w[4],
        stack,
        thread: high,
    };
    let segment = || SegmentEvent {
        t: w[1],
        device,
        address: w[3],
        size: w[4],
        pool: byte,
        stack,
    };
    Some(match kind {
        SIDE => return None,
        kinds::ALLOC => Record::Alloc(Alloc {
            t: w[1],
            device,
            stream: w[2],
            address: w[3],
            requested: w[4],
            size: w[5],
            stack,
            thread: high,
        }),
        kinds::FREE_REQUESTED => Record::FreeRequested(free()),
        kinds::FREE => Record::Free(free()),
        kinds::FREE_COMPLETED => Record::FreeCompleted(FreeCompleted {
            t: w[1],
            device,
            address: w[3],
            size: w[4],
        }),
        kinds::SEGMENT_ALLOC => Record::SegmentAlloc(segment()),
        kinds::SEGMENT_FREE => Record::SegmentFree(segment()),
        kinds::SEGMENT_MAP => Record::SegmentMap(segment()),
        kinds::SEGMENT_UNMAP => Record::SegmentUnmap(segment()),
        kinds::SCOPE => Record::Scope(ScopeEvent {
            t: w[1],
            thread: high,
            scope: stack,
        }),
        kinds::TAG => Record::Tag(TagEvent {
            t: w[1],
            device,
            address: w[3],
            category: byte,
        }),
        _ => unreachable!("only the kinds `encode` writes are in the ring"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scope record of thread 1 at time `t`.
    fn scope_record(t: u64, scope: u32) -> Record {
        Record::Scope(ScopeEvent {
            t,
            thread: 1,
            scope,
        })
    }

    /// Every kind `encode` takes comes back from `decode` as it went in, with every field at
    /// its widest.
    #[test]
    fn the_hot_kinds_round_trip_through_a_slot() {
        let big = u64::MAX - 3;
        let free = FreeRequested {
            t: big,
            device: u32::MAX,
            stream: big - 1,
            address: big - 2,
            size: big - 3,
            stack: u32::MAX - 1,
            thread: u32::MAX - 2,
        };
        let segment = SegmentEvent {
            t: big,
            device: 7,
            address: big - 1,
            size: big - 2,
            pool: 255,
            stack: u32::MAX,
        };
        let records = [
            Record::Alloc(Alloc {
                t: big,
                device: u32::MAX,
                stream: big - 1,
                address: big - 2,
                requested: big - 3,
                size: big - 4,
                stack: u32::MAX - 1,
                thread: u32::MAX - 2,
            }),
            Record::FreeRequested(free),
            Record::Free(free),
            Record::FreeCompleted(FreeCompleted {
                t: big,
                device: 3,
                address: big - 1,
                size: big - 2,
            }),
            Record::SegmentAlloc(segment),
            Record::SegmentFree(segment),
            Record::SegmentMap(segment),
            Record::SegmentUnmap(segment),
            Record::Scope(ScopeEvent {
                t: big,
                thread: u32::MAX,
                scope: u32::MAX - 1,
            }),
            Record::Tag(TagEvent {
                t: big,
                device: u32::MAX,
                address: big - 1,
                category: 255,
            }),
        ];
        for record in records {
            let words = encode(&record).expect("a hot kind");
            assert_eq!(decode(words), Some(record));
        }
    }

    /// A send reads the worker's head only when the head it last saw says the ring may be
    /// full: once per ring's worth of records, not once a record.
    #[test]
    fn sends_look_at_the_workers_head_once_a_ring() {
        let queue = Queue::<Record>::new(8);
        let record = |i: u64| scope_record(i, 1);
        let loads = || queue.claims.head_loads.load(Ordering::Relaxed);
        let mut head = 0;
        let mut taken = 0;
        for i in 0..64u64 {
            queue.send(record(i), |_| panic!("the worker keeps up: no send waits"));
            // The worker keeps up: it reads each record at once and releases every fourth.
            while queue.take(&mut head).is_some() {
                taken += 1;
            }
            if head % 4 == 0 {
                queue.release(head);
            }
        }
        assert_eq!(taken, 64);
        // The first 8 sends fit against head 0; after that a send loads the head and then
        // finds room against it for as many records as the worker had released then (8 here),
        // never each time.
        assert!(loads() >= 1, "the ring filled past the first head seen");
        assert!(loads() <= 64 / 4, "{} head loads for 64 sends", loads());
    }

    /// Records and side messages come out in the order they were sent, across wrap-arounds,
    /// and a full ring makes the sender wait until the worker releases slots.
    #[test]
    fn the_ring_keeps_the_order_of_records_and_side_messages() {
        let queue = Queue::<Record>::new(4);
        let scope = |i: u64| scope_record(i, i as u32);
        let annotation = |i: u64| {
            Record::Annotation(Box::new(crate::schema::Annotation {
                t: i,
                name: format!("side {i}"),
                thread: 1,
            }))
        };
        let mut head = 0;
        let mut out = vec![];
        for i in 0..20u64 {
            let record = if i % 3 == 0 { annotation(i) } else { scope(i) };
            let mut waited = false;
            queue.send(record, |room| {
                waited = true;
                assert!(!room(), "no room: the four slots are unread");
                // What the worker does, late: read everything, release the slots.
                while let Some(taken) = queue.take(&mut head) {
                    out.push(taken);
                }
                queue.release(head);
                assert!(room(), "room once the worker released the slots");
            });
            // A ring of 4 that the worker empties only when asked: every fifth send waits.
            assert_eq!(waited, i >= 4 && i % 4 == 0, "send {i}");
        }
        while let Some(taken) = queue.take(&mut head) {
            out.push(taken);
        }
        let got: Vec<u64> = out
            .iter()
            .map(|t| match t {
                Taken::Record(Record::Scope(s)) => s.t,
                Taken::Side(Record::Annotation(a)) => a.t,
                _ => panic!("unexpected"),
            })
            .collect();
        assert_eq!(got, (0..20).collect::<Vec<_>>());
    }
}
