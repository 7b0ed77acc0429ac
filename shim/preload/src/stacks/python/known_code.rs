//! The code objects a thread's walks have met, so that a frame whose code object is known costs
//! no read of it (Note [Known code objects]).

use std::ffi::c_int;

/// The code objects a thread's captures have found on its stack, with where each one's
/// traceable bytecode starts: a frame whose code object is known costs no read of it.
///
/// # Note [Known code objects]
///
/// A frame's code object is read twice per capture: its type (is it a code object at all?)
/// and its first traceable instruction (has the frame started?). Both lie in the code object,
/// two cache lines that a training step has long evicted between two allocations: on the
/// Llama's ~60-frame stacks they were among the capture's hottest misses. Their answers never
/// change while the object lives, so each thread keeps them by address, in a small table it
/// alone touches.
///
/// An address names one code object only while it lives, and the table is trusted only while
/// no code object has died: it belongs to one epoch of [Note [Code objects' deaths]](super::code_deaths),
/// read before the walk, and is emptied when a capture reads another. That suffices: an entry
/// was made, during this epoch, from a live frame's code object; if that object had died since,
/// its death would have ended the epoch. Where deaths are not heard (epoch 0: Python before
/// 3.12) the table is not used.
///
/// Most of a walk's frames are where the thread's last walk found them (the outer ones do not
/// change between two allocations), so each place in the chain also remembers the code object
/// the last walk met there: a frame whose code object is that one is answered by the next entry
/// of a short array, without the table's hash and its scattered line. Both belong to the epoch.
/// A place is one word, the code object's address (user-space addresses fit 48 bits) over its
/// first traceable instruction (16 bits), so that a 60-frame chain's places take 8 cache lines,
/// not 15; a code object that does not fit leaves its place empty and is found in the table.
#[derive(Debug)]
pub struct KnownCode {
    /// The epoch the entries belong to (0: none, and none are made).
    epoch: u64,
    /// `(code object's address, its first traceable instruction)`, by a hash of the address
    /// (direct-mapped: a collision replaces the older entry).
    slots: Box<[(usize, c_int)]>,
    /// The last walk's code object and first traceable instruction by place in the chain,
    /// innermost first, packed ([`KnownCode::pack`]; [`EMPTY`]: none).
    last_walk: Vec<u64>,
    /// The hidden code objects the entries were made with ([`HIDDEN`]).
    hidden: [usize; 4],
}

impl Default for KnownCode {
    fn default() -> Self {
        KnownCode {
            epoch: 0,
            slots: vec![(0, 0); KnownCode::SLOTS].into_boxed_slice(),
            last_walk: Vec::new(),
            hidden: [0; 4],
        }
    }
}

impl KnownCode {
    /// Entries: 8 KiB a thread, more than the code objects a model's stacks run through.
    const SLOTS: usize = 512;

    /// Before a walk in `epoch` with the code objects of `hidden` hidden: forget the entries
    /// of another epoch, or of another set of hidden code objects (it only grows, and rarely:
    /// the Python integration hides its wrappers once).
    pub fn begin(&mut self, epoch: u64, hidden: &[usize; 4]) {
        if epoch != self.epoch || *hidden != self.hidden {
            self.slots.fill((0, 0));
            self.last_walk.clear();
            self.epoch = epoch;
            self.hidden = *hidden;
        }
    }

    /// The first traceable instruction of `code` if the last walk met it at the chain's
    /// `place`-th frame (in this epoch: in epoch 0 no place is remembered).
    #[inline(always)]
    pub(super) fn at(&self, place: usize, code: usize) -> Option<c_int> {
        let packed = *self.last_walk.get(place)?;
        (packed >> 16 == code as u64).then_some(c_int::from(packed as u16 as i16))
    }

    /// A place's word for `code` and `first`: the address over the instruction, or `None`
    /// when either does not fit (an address above 48 bits, an instruction outside `i16`).
    fn pack(code: usize, first: c_int) -> Option<u64> {
        let first = i16::try_from(first).ok()?;
        (code as u64 >> 48 == 0).then_some((code as u64) << 16 | u64::from(first as u16))
    }

    /// What the chain's `place`-th frame's code object `code` was found to be, for the next
    /// walk.
    pub(super) fn note_at(&mut self, place: usize, code: usize, first: c_int) {
        if self.epoch == 0 {
            return;
        }
        let packed = Self::pack(code, first).unwrap_or(EMPTY);
        if place < self.last_walk.len() {
            self.last_walk[place] = packed;
        } else if place == self.last_walk.len() {
            self.last_walk.push(packed);
        }
    }

    fn slot(code: usize) -> usize {
        ((code as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 55) as usize % Self::SLOTS
    }

    /// The first traceable instruction of the code object at `code`, if known in this epoch.
    pub(super) fn get(&self, code: usize) -> Option<c_int> {
        if self.epoch == 0 {
            return None;
        }
        let (address, first) = self.slots[Self::slot(code)];
        (address == code).then_some(first)
    }

    /// `code` is a code object whose first traceable instruction is `first`.
    pub(super) fn put(&mut self, code: usize, first: c_int) {
        if self.epoch != 0 {
            self.slots[Self::slot(code)] = (code, first);
        }
    }
}

/// What [`KnownCode`] keeps, instead of a first traceable instruction, for a code object whose
/// frames stacks leave out.
pub(super) const HIDDEN: c_int = -1;

/// A place of [`KnownCode`] that holds no code object. It is compared with whatever a frame
/// holds, before that is checked: the address it would match (2⁴⁸ − 1) is not one a code
/// object can have, and its instruction is [`HIDDEN`], so that even a frame holding that
/// garbage has nothing read of it.
const EMPTY: u64 = u64::MAX;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_code_objects_belong_to_one_epoch() {
        let mut known = KnownCode::default();
        // Deaths not heard: nothing is kept.
        known.begin(0, &[0; 4]);
        known.put(0x7f00_0000_1000, 3);
        assert_eq!(known.get(0x7f00_0000_1000), None);
        // Within an epoch an entry stays; another epoch forgets it.
        known.begin(5, &[0; 4]);
        known.put(0x7f00_0000_1000, 3);
        known.begin(5, &[0; 4]);
        assert_eq!(known.get(0x7f00_0000_1000), Some(3));
        assert_eq!(known.get(0x7f00_0000_2000), None);
        known.begin(6, &[0; 4]);
        assert_eq!(known.get(0x7f00_0000_1000), None);
        // So does another set of hidden code objects.
        known.put(0x7f00_0000_1000, 3);
        known.begin(6, &[0x7f00_0000_9000, 0, 0, 0]);
        assert_eq!(known.get(0x7f00_0000_1000), None);
    }

    #[test]
    fn a_colliding_address_replaces_the_entry_and_never_reads_another_objects() {
        let mut known = KnownCode::default();
        known.begin(1, &[0; 4]);
        let first = 0x7f00_0000_1000usize;
        let other = (1..)
            .map(|i| first + 16 * i)
            .find(|&a| KnownCode::slot(a) == KnownCode::slot(first))
            .expect("a colliding address");
        known.put(first, 1);
        known.put(other, 2);
        assert_eq!(known.get(other), Some(2));
        assert_eq!(known.get(first), None);
    }

    #[test]
    fn a_place_remembers_its_last_code_object_within_the_epoch() {
        let mut known = KnownCode::default();
        known.begin(1, &[0; 4]);
        let (a, b) = (0x7f00_0000_1000usize, 0x7f00_0000_2000usize);
        // Learned at place 0 and 1 by the first walk.
        known.put(a, 3);
        known.note_at(0, a, 3);
        known.put(b, 4);
        known.note_at(1, b, 4);
        // Evict `a` from the table: the place still answers for it, and only for it.
        let colliding = (1..)
            .map(|i| a + 16 * i)
            .find(|&c| KnownCode::slot(c) == KnownCode::slot(a))
            .expect("a colliding address");
        known.put(colliding, 9);
        assert_eq!(known.get(a), None, "gone from the table");
        assert_eq!(known.at(0, a), Some(3), "the last walk's at place 0");
        assert_eq!(known.at(1, a), None, "place 1 had another one");
        assert_eq!(known.at(2, b), None, "a place not yet reached");
        known.note_at(2, b, 4);
        assert_eq!(known.at(2, b), Some(4));
        // A place takes the code object met there last.
        known.note_at(0, b, 4);
        assert_eq!(known.at(0, a), None);
        assert_eq!(known.at(0, b), Some(4));
        // Another epoch forgets the places too; epoch 0 keeps none.
        known.begin(2, &[0; 4]);
        assert_eq!(known.at(0, b), None);
        assert_eq!(known.at(1, b), None);
        known.begin(0, &[0; 4]);
        known.note_at(0, a, 3);
        assert_eq!(known.at(0, a), None, "no place is kept in epoch 0");
    }

    #[test]
    fn a_place_keeps_what_fits_its_word_and_nothing_else() {
        let mut known = KnownCode::default();
        known.begin(1, &[0; 4]);
        let a = 0x7fff_ffff_f000usize; // the highest 47-bit user-space page
        for (place, first) in [(0, 0), (1, HIDDEN), (2, 7), (3, c_int::from(i16::MAX))] {
            known.note_at(place, a, first);
            assert_eq!(known.at(place, a), Some(first), "first {first}");
            assert_eq!(known.at(place, a + 8), None, "another code object");
            assert_eq!(
                known.at(place, a - (1 << 16)),
                None,
                "an address a word apart"
            );
        }
        // What does not fit empties the place, and the places after it stay where they are.
        known.note_at(0, a, c_int::from(i16::MAX) + 1);
        assert_eq!(known.at(0, a), None, "an instruction beyond 16 bits");
        let high = 1usize << 48 | 0x1000;
        known.note_at(1, high, 3);
        assert_eq!(known.at(1, high), None, "an address beyond 48 bits");
        assert_eq!(known.at(1, 0x1000), None, "nor its low bits");
        known.note_at(4, high, 3);
        assert_eq!(
            known.at(4, 0),
            None,
            "an empty place is no null code object"
        );
        assert_eq!(known.at(4, (1 << 48) - 1), Some(HIDDEN), "nor one to read");
        known.note_at(5, a, 5);
        assert_eq!(known.at(5, a), Some(5), "the place after an empty one");
        assert_eq!(known.at(2, a), Some(7));
    }
}
