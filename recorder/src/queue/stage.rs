//! A sending thread's *stage*: its records wait on lines its own core keeps and reach the ring
//! a batch at a time.
//!
//! *Note [Staged sends]*: a record written straight into the ring stores to a slot line that
//! is not in the sender's cache (the ring is 4 MiB, written a ring ago and read by the worker
//! since); the store waits in the store buffer and the program pays the miss at its next
//! locked instruction — PyTorch's reference counts take one every few nanoseconds. On the GPU
//! machine's Xeon that hand-off was ~0.6 % of an allocation-heavy step, ~100 ns a record
//! (design.md, "The trace's cost taken apart"). A stage is 16 slots a thread writes again and
//! again, so they stay in its core's caches; when it is full the thread copies the 16 records
//! into the ring at once, and their 16 misses are in flight together: about one miss a batch.
//!
//! The trace's single order is kept: a staged record still claims its ring index when it is
//! sent (under the allocator's lock, the lock's order); only its slot is written later. The
//! worker reads the ring in index order, so an index whose record is still staged holds it up.
//! A thread that stops sending (blocked in a synchronize, waiting for the backward pass, gone
//! idle) would hold it up for ever, so the worker *forwards* staged records itself: when the
//! ring has been held up at one index for a few polls (the recorder's `FORWARD_AFTER`), or at once
//! when a flush, a checkpoint or the shutdown waits behind it, when a sender waits for room, or
//! when the recorder is closed, it copies every registered stage's staged records into the
//! ring. (A sender that must wait for room publishes its own stage first.) The two sides agree through
//! the stage's lock (the owner holds it while it publishes a batch, the worker while it
//! forwards) and `forwarded`, how many of the staged records the worker has already copied:
//! every record reaches the ring exactly once, before the worker can read its index, so a slot
//! the worker has read and released is never written again for an old index.
//!
//! What a send costs the sender then: the claim (as before), stores to its stage's slot and to
//! the stage's count (lines its core owns unless the worker forwarded from them since), and
//! every 16th send the batch's copy under the stage's lock. A thread's stage is published when
//! its owner drops it (the thread's exit) and stays registered until then; the worker's forward
//! covers a thread that never drops it (the process's main thread at exit).
//!
//! The shim sends through stages only once they are turned on (`stages:on`,
//! `cachealloc_stages_pause(0)`): on the development VM they measure worse than direct sends,
//! and the GPU machine, whose misses they are for, has not measured them yet (design.md, "The
//! hand-off in batches").

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::{Queue, Slot};

/// Records a stage holds before its owner copies them into the ring.
pub(crate) const STAGE_SLOTS: usize = 16;

/// See the module docs. The counts and the lock share the first line; each slot has its own.
#[repr(C, align(128))]
#[derive(Default)]
pub(crate) struct Stage {
    /// Records staged since the last batch (the slots before it are written): stored by the
    /// owner after each slot, reset by the owner under `lock`, read by the worker under `lock`.
    staged: AtomicUsize,
    /// How many of the staged records the worker has copied into the ring: written by the
    /// worker, read and reset by the owner, both under `lock`.
    forwarded: AtomicUsize,
    /// Held by whoever copies this stage's records into the ring.
    lock: AtomicBool,
    /// The records; each slot's `seq` is its ring index plus one.
    slots: [Slot; STAGE_SLOTS],
}

impl Stage {
    fn lock(&self) {
        let mut spins = 0u32;
        while !self.try_lock() {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // The worker holds it for one copy of at most 16 records; it was descheduled.
                std::thread::yield_now();
            }
        }
    }

    fn try_lock(&self) -> bool {
        self.lock
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    fn unlock(&self) {
        self.lock.store(false, Ordering::Release);
    }
}

impl<M> Queue<M> {
    /// A stage for the calling thread, registered with the worker.
    pub(crate) fn new_stage(&self) -> Arc<Stage> {
        let stage = Arc::new(Stage::default());
        self.stages
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(stage.clone());
        stage
    }

    /// Queue `record` through `stage`, which only its owner's thread sends through: its index
    /// is claimed now, its slot in the ring written with its batch's. `wait` as in
    /// [`Queue::send`].
    pub(crate) fn send_staged(
        &self,
        stage: &Stage,
        record: crate::Record,
        wait: impl FnOnce(&dyn Fn() -> bool),
    ) where
        M: From<crate::Record>,
    {
        let Some(words) = super::encode(&record) else {
            return self.send_side(M::from(record), wait);
        };
        // A sender that must wait for room publishes its stage first: its own records may be
        // what holds the worker up.
        let index = self.claim(|room: &dyn Fn() -> bool| {
            self.publish(stage);
            wait(room);
        });
        // Only this thread writes `staged` outside the lock, and the worker only reads it.
        let n = stage.staged.load(Ordering::Relaxed);
        stage.slots[n].write(index, words, Ordering::Relaxed);
        // Release: a worker that reads the count under the lock reads the slot written.
        stage.staged.store(n + 1, Ordering::Release);
        if n + 1 == STAGE_SLOTS {
            self.publish(stage);
        }
    }

    /// The owner: copy the stage's records into the ring (those the worker has not) and
    /// empty it.
    pub(crate) fn publish(&self, stage: &Stage) {
        stage.lock();
        let from = stage.forwarded.load(Ordering::Relaxed);
        let to = stage.staged.load(Ordering::Relaxed);
        self.copy_to_ring(stage, from, to);
        stage.forwarded.store(0, Ordering::Relaxed);
        stage.staged.store(0, Ordering::Relaxed);
        stage.unlock();
    }

    /// The owner is done with `stage` (its thread exits): publish it and unregister it.
    pub(crate) fn retire_stage(&self, stage: &Arc<Stage>) {
        self.publish(stage);
        self.stages
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|s| !Arc::ptr_eq(s, stage));
    }

    /// The worker: copy every registered stage's staged records into the ring. A stage whose
    /// owner is publishing it is skipped (its records reach the ring that way).
    pub(crate) fn forward_stages(&self) {
        let stages = self.stages.lock().unwrap_or_else(|p| p.into_inner());
        for stage in stages.iter() {
            if !stage.try_lock() {
                continue;
            }
            let from = stage.forwarded.load(Ordering::Relaxed);
            let to = stage.staged.load(Ordering::Acquire);
            self.copy_to_ring(stage, from, to);
            stage.forwarded.store(to, Ordering::Relaxed);
            stage.unlock();
        }
    }

    /// Copy the stage's slots `from..to` into the ring, each to its index's slot (`forwarded`
    /// never passes `staged`: both are reset together, and the worker sets the one to the
    /// other). Each index was claimed and not yet read, so its ring slot is this record's to
    /// write.
    fn copy_to_ring(&self, stage: &Stage, from: usize, to: usize) {
        for slot in &stage.slots[from..to] {
            let index = slot.seq.load(Ordering::Relaxed) - 1;
            super::fill_slot(&self.slots, self.mask, index as usize, slot.words());
        }
    }

    /// How many stages are registered.
    #[cfg(test)]
    pub(crate) fn stages(&self) -> usize {
        self.stages.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::Taken;
    use crate::schema::{Record, ScopeEvent};

    fn record(t: u64) -> Record {
        Record::Scope(ScopeEvent {
            t,
            thread: 1,
            scope: 0,
        })
    }

    /// The times of everything the worker can read now, releasing the slots read.
    fn drain(queue: &Queue<Record>, head: &mut usize) -> Vec<u64> {
        let mut out = vec![];
        while let Some(taken) = queue.take(head) {
            match taken {
                Taken::Record(Record::Scope(s)) => out.push(s.t),
                _ => panic!("only scope records were sent"),
            }
        }
        queue.release(*head);
        out
    }

    fn no_wait(_: &dyn Fn() -> bool) {
        panic!("the ring has room in this test");
    }

    /// Staged records keep the places they claimed: a direct send after them waits behind
    /// them until they reach the ring, by the owner's batch or the worker's forward; a
    /// forwarded record is never copied again, even once its ring slot holds a newer record.
    #[test]
    fn staged_records_keep_their_places_and_reach_the_ring_once() {
        let queue = Queue::<Record>::new(16);
        let stage = queue.new_stage();
        let mut head = 0;
        for t in 0..3 {
            queue.send_staged(&stage, record(t), no_wait);
        }
        queue.send(record(3), no_wait);
        assert_eq!(
            drain(&queue, &mut head),
            [],
            "held up by the staged index 0"
        );
        queue.forward_stages();
        assert_eq!(drain(&queue, &mut head), [0, 1, 2, 3]);
        // Fill the ring once round, so that the forwarded records' slots hold newer ones.
        for t in 4..16 {
            queue.send(record(t), no_wait);
        }
        assert_eq!(drain(&queue, &mut head), (4..16).collect::<Vec<_>>());
        for t in 16..19 {
            queue.send(record(t), no_wait);
        }
        // The stage's next 13 records fill it (3 forwarded + 13): the owner publishes them.
        for t in 19..32 {
            queue.send_staged(&stage, record(t), no_wait);
        }
        assert_eq!(
            drain(&queue, &mut head),
            (16..32).collect::<Vec<_>>(),
            "the batch wrote its own 13 records and nothing over slots 0..3"
        );
    }

    /// A stage's owner publishes what it holds when it is done with it (its thread's exit),
    /// without the worker's forward, and the worker stops looking at it.
    #[test]
    fn a_retired_stage_is_published_and_unregistered() {
        let queue = Queue::<Record>::new(16);
        let stage = queue.new_stage();
        let other = queue.new_stage();
        queue.send_staged(&stage, record(0), no_wait);
        queue.send_staged(&stage, record(1), no_wait);
        assert_eq!(queue.stages(), 2);
        queue.retire_stage(&stage);
        let mut head = 0;
        assert_eq!(drain(&queue, &mut head), [0, 1]);
        assert_eq!(queue.stages(), 1);
        queue.retire_stage(&other);
        assert_eq!(queue.stages(), 0);
    }

    /// The worker's forward skips a stage its owner holds (publishing it), and the owner's
    /// batch then carries those records.
    #[test]
    fn the_forward_leaves_a_stage_its_owner_is_publishing() {
        let queue = Queue::<Record>::new(16);
        let stage = queue.new_stage();
        queue.send_staged(&stage, record(0), no_wait);
        assert!(stage.try_lock(), "the owner, in the middle of a batch");
        queue.forward_stages();
        let mut head = 0;
        assert_eq!(drain(&queue, &mut head), []);
        stage.unlock();
        queue.publish(&stage);
        assert_eq!(drain(&queue, &mut head), [0]);
    }
}
