//! The stacks a thread captured last, found again without the interner (Note [The thread's
//! recent stacks]).
//!
//! # Note [The thread's recent stacks]
//!
//! Once warm, a capture's cost is not the walk's arithmetic but memory: the interner's lock
//! (a line other threads write), the hash of the raw key — one multiply after another, each
//! waiting for the last, over two words a Python frame — the map's bucket and the stored key
//! compared word by word, both out of the CPU's caches after the program's own work between two
//! allocations (BENCHMARKS.md, "The trace on the CPU proxy, by symbol"). So each thread keeps a
//! small table of the stacks it captured last, indexed by a 128-bit hash of the raw key computed
//! in four independent lanes (a quarter of the dependent multiplies), from the walk's buffers
//! (no key is built for a hit); a hit is one line read (a set of two entries) and no lock.
//!
//! An entry holds the number of the [`Stacks`](super::Stacks) that interned it and the code
//! objects' epoch it was read in (Note [Code objects' deaths]): a hit is a stack of the same
//! interner, read while the same code objects lived, as the interner's own raw keys are. The
//! raw key itself is not kept, so two raw keys with equal 128-bit hashes would share a stack:
//! for a process's few thousand distinct stacks that has a probability of about 10⁻³¹. A
//! thread's entries are only ever ids the interner gave it, after their definitions were sent,
//! so its events still follow their stacks' definitions in the trace.

use super::python::RawFrame;

/// Sets a thread keeps (a power of two): 128 of two 32-byte entries, one cache line each, 8 KiB.
const SETS: usize = 128;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Entry {
    hash: (u64, u64),
    /// The interner's number ([`RecentStacks::get`]); 0 for an empty entry.
    interner: u32,
    stack: u32,
    epoch: u64,
}

/// The two places a hash may be in, one cache line: the one put last first. Two ways, because
/// with one a hash's place is a matter of chance (code objects' addresses move from run to
/// run), and two stacks a loop alternates between that fall on one place would evict each other
/// at every capture, for the rest of the process.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Set([Entry; 2]);

/// A thread's recent stacks: raw key's hash → stack id.
#[derive(Debug, Default)]
pub(super) struct RecentStacks {
    sets: Vec<Set>,
}

impl RecentStacks {
    /// The stack of the raw key whose hash is `hash`, as interner `interner` (non-zero) gave
    /// it in code epoch `epoch`.
    pub(super) fn get(&self, hash: (u64, u64), interner: u32, epoch: u64) -> Option<u32> {
        let set = self.sets.get(hash.0 as usize & (SETS - 1))?;
        (set.0.iter())
            .find(|e| e.hash == hash && e.interner == interner && e.epoch == epoch)
            .map(|e| e.stack)
    }

    /// Remember `stack` for the raw key whose hash is `hash`: first in its set, the entry that
    /// was first second (unless it was this hash's), the second one gone.
    pub(super) fn put(&mut self, hash: (u64, u64), interner: u32, epoch: u64, stack: u32) {
        if self.sets.is_empty() {
            self.sets = vec![Set::default(); SETS];
        }
        let set = &mut self.sets[hash.0 as usize & (SETS - 1)].0;
        if set[0].hash != hash {
            set[1] = set[0];
        }
        set[0] = Entry {
            hash,
            interner,
            stack,
            epoch,
        };
    }
}

/// A 128-bit hash of a raw key, taken from its parts where the walk left them (no key is
/// built for a capture that hits): the native frames' addresses, the Python frames (code object
/// and offset) and, where code objects' deaths are not heard, the words that identify each
/// code object (`checks`, four a frame). [`KeyHash`] takes the same parts one at a time.
pub(super) fn key_hash(native: &[u64], frames: &[RawFrame], checks: &[u64]) -> (u64, u64) {
    let mut hash = KeyHash::new(native);
    for &frame in frames {
        hash.frame(frame);
    }
    hash.finish(checks)
}

/// [`key_hash`] of a key whose Python frames are given as a walk finds them, so that a capture
/// whose stack the thread has seen writes none of them down (Note [A hit writes no frames]).
/// Four lanes: the native frames' addresses and the checks go a word a lane, four words a
/// round (so their multiplies overlap); a Python frame's code object and offset go to the
/// first two lanes, which then trade places with the other two, so that each lane's multiply
/// waits for the one two frames back, and a frame costs no branch (the walk's loop holds the
/// four lanes, and spills some: BENCHMARKS.md, "A hit writes no frames"). The lanes are mixed
/// into two words at the end with the parts' lengths.
pub(super) struct KeyHash {
    lanes: [u64; 4],
    native: u64,
    frames: u64,
}

impl KeyHash {
    /// A hash that starts with the native frames' addresses.
    #[inline(always)]
    pub(super) fn new(native: &[u64]) -> KeyHash {
        let mut lanes = K;
        words(&mut lanes, native);
        KeyHash {
            lanes,
            native: native.len() as u64,
            frames: 0,
        }
    }

    /// The next Python frame, innermost first.
    #[inline(always)]
    pub(super) fn frame(&mut self, frame: RawFrame) {
        let [a, b, c, d] = self.lanes;
        self.lanes = [
            c,
            d,
            (a ^ frame.code as u64).wrapping_mul(K[0]).rotate_left(29),
            (b ^ frame.offset as u64).wrapping_mul(K[1]).rotate_left(29),
        ];
        self.frames += 1;
    }

    /// The hash, with the code objects' `checks` last.
    #[inline(always)]
    pub(super) fn finish(mut self, checks: &[u64]) -> (u64, u64) {
        let lanes = &mut self.lanes;
        words(lanes, checks);
        let n = self.native | self.frames << 21 | (checks.len() as u64) << 42;
        let a = mix(lanes[0] ^ mix(lanes[1] ^ n));
        let b = mix(lanes[2] ^ mix(lanes[3].wrapping_add(n)));
        (a ^ b.rotate_left(17), mix(b ^ a))
    }
}

/// One round: each lane takes its word.
#[inline(always)]
fn round(lanes: &mut [u64; 4], words: [u64; 4]) {
    for i in 0..4 {
        lanes[i] = (lanes[i] ^ words[i]).wrapping_mul(K[i]).rotate_left(29);
    }
}

/// Rounds over `words`, four at a time, the last padded with zeros.
#[inline(always)]
fn words(lanes: &mut [u64; 4], words: &[u64]) {
    let mut chunks = words.chunks_exact(4);
    for c in &mut chunks {
        round(lanes, [c[0], c[1], c[2], c[3]]);
    }
    if !chunks.remainder().is_empty() {
        let mut tail = [0; 4];
        tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
        round(lanes, tail);
    }
}

const K: [u64; 4] = [
    0x9E37_79B9_7F4A_7C15,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0xD6E8_FEB8_6659_FD93,
];

/// splitmix64's finalizer: every bit of the input moves every bit of the output.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hit_needs_the_same_hash_interner_and_epoch() {
        let mut recent = RecentStacks::default();
        let h = key_hash(&[1, 2, 3], &[], &[]);
        assert_eq!(recent.get(h, 1, 0), None);
        recent.put(h, 1, 0, 7);
        assert_eq!(recent.get(h, 1, 0), Some(7));
        assert_eq!(recent.get(h, 2, 0), None, "another interner's stack");
        assert_eq!(
            recent.get(h, 1, 1),
            None,
            "a stack read before a code object died"
        );
        assert_eq!(
            recent.get((h.0, h.1 ^ 1), 1, 0),
            None,
            "half the hash is not enough"
        );
        recent.put(h, 1, 1, 9);
        assert_eq!(recent.get(h, 1, 1), Some(9), "read again after a death");
        assert_eq!(recent.get(h, 1, 0), None, "and only so");
    }

    #[test]
    fn two_stacks_on_one_place_both_stay_and_a_third_evicts_the_older() {
        // Three hashes of one set (the low bits pick it).
        let h = key_hash(&[1, 2, 3], &[], &[]);
        let same_set = |k: u64| (h.0.wrapping_add(k * SETS as u64), h.1 ^ k);
        let (a, b, c) = (same_set(0), same_set(1), same_set(2));
        let mut recent = RecentStacks::default();
        for round in 0..3 {
            // A loop alternating between two stacks that share a place: both keep hitting.
            recent.put(a, 1, 0, 10);
            recent.put(b, 1, 0, 11);
            assert_eq!(recent.get(a, 1, 0), Some(10), "round {round}");
            assert_eq!(recent.get(b, 1, 0), Some(11), "round {round}");
        }
        recent.put(c, 1, 0, 12);
        assert_eq!(recent.get(c, 1, 0), Some(12));
        assert_eq!(recent.get(b, 1, 0), Some(11), "the one put last stays");
        assert_eq!(recent.get(a, 1, 0), None, "the older one goes");
    }

    #[test]
    fn every_word_and_its_place_change_the_hash() {
        // The keys a capture makes: Python frames, often differing in one word, or in order,
        // or in length by a frame of zeros; native addresses before them; checks after.
        let base: Vec<RawFrame> = (0..23)
            .map(|i| RawFrame {
                code: 0x7f00_0000_0000 + i * 0x40,
                offset: 2 * i as i32,
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        assert!(seen.insert(key_hash(&[], &base, &[])));
        for i in 0..base.len() {
            let mut k = base.clone();
            k[i].code ^= 8;
            assert!(
                seen.insert(key_hash(&[], &k, &[])),
                "code object of frame {i}"
            );
            let mut k = base.clone();
            k[i].offset += 2;
            assert!(seen.insert(key_hash(&[], &k, &[])), "offset of frame {i}");
            let mut k = base.clone();
            k.swap(i, (i + 1) % base.len());
            assert!(seen.insert(key_hash(&[], &k, &[])), "swap at {i}");
            assert!(seen.insert(key_hash(&[], &base[..i], &[])), "prefix of {i}");
        }
        let mut longer = base.clone();
        longer.push(RawFrame::default());
        assert!(seen.insert(key_hash(&[], &longer, &[])), "a frame of zeros");
        // The same words in another part, or one more zero word in a part.
        let words = [0x40_1000u64, 0x40_2000, 0x40_3000];
        assert!(seen.insert(key_hash(&words, &base, &[])));
        assert!(seen.insert(key_hash(&words[..2], &base, &words[2..])));
        assert!(seen.insert(key_hash(&[], &base, &words)));
        assert!(seen.insert(key_hash(&[words[0], words[1], words[2], 0], &base, &[])));
        assert!(seen.insert(key_hash(&[], &base, &[words[0], words[1], words[2], 0])));
        assert!(seen.insert(key_hash(&words, &[], &[])));
        // Every word of the native addresses and of the checks counts, at equal lengths.
        let checks: Vec<u64> = (0..4 * base.len() as u64)
            .map(|i| 0x5500_0000 + i)
            .collect();
        assert!(seen.insert(key_hash(&words, &base, &checks)));
        for i in 0..words.len() {
            let mut w = words;
            w[i] ^= 1 << 12;
            assert!(seen.insert(key_hash(&w, &base, &checks)), "native word {i}");
        }
        for i in 0..checks.len() {
            let mut c = checks.clone();
            c[i] ^= 1 << 20;
            assert!(seen.insert(key_hash(&words, &base, &c)), "check word {i}");
        }
        // Both halves differ between any two of them.
        let firsts: std::collections::HashSet<u64> = seen.iter().map(|h| h.0).collect();
        let seconds: std::collections::HashSet<u64> = seen.iter().map(|h| h.1).collect();
        assert_eq!(firsts.len(), seen.len());
        assert_eq!(seconds.len(), seen.len());
    }
}
