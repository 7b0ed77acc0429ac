//! Tests of the delta pages' encoding.

use super::*;

/// A reader of the test's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        self.at += 1;
        self.bytes[self.at - 1]
    }
    fn uleb(&mut self) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let b = self.byte();
            v |= u64::from(b & 0x7f) << shift;
            shift += 7;
            if b & 0x80 == 0 {
                return v;
            }
        }
    }
    fn zigzag(&mut self) -> i64 {
        let v = self.uleb();
        ((v >> 1) as i64) ^ -((v & 1) as i64)
    }
}

/// Decode what `encode_delta` wrote (the format's reading, written from its spec).
fn decode_delta(bytes: &[u8], wide: bool) -> Vec<i64> {
    let mut r = Reader { bytes, at: 0 };
    let (block, minis, count) = (r.uleb() as usize, r.uleb() as usize, r.uleb() as usize);
    let mut out = vec![r.zigzag()];
    let per_mini = block / minis;
    while out.len() < count {
        let min = r.zigzag();
        let widths: Vec<usize> = (0..minis).map(|_| r.byte() as usize).collect();
        for w in widths {
            if out.len() >= count {
                break;
            }
            for i in 0..per_mini {
                let mut v: u64 = 0;
                for b in 0..w {
                    let bit = i * w + b;
                    v |= u64::from((bytes[r.at + bit / 8] >> (bit % 8)) & 1) << b;
                }
                if out.len() < count {
                    let prev = *out.last().unwrap();
                    let next = if wide {
                        prev.wrapping_add(min.wrapping_add(v as i64))
                    } else {
                        i64::from(
                            (prev as i32).wrapping_add((min as i32).wrapping_add(v as u32 as i32)),
                        )
                    };
                    out.push(next);
                }
            }
            r.at += per_mini * w / 8;
        }
    }
    assert_eq!(r.at, bytes.len(), "every byte read");
    out
}

fn decode_levels(bytes: &[u8], n: usize) -> Vec<i16> {
    let mut r = Reader { bytes, at: 0 };
    let mut out = vec![];
    while out.len() < n {
        let h = r.uleb();
        if h & 1 == 0 {
            let v = i16::from(r.byte());
            out.extend(std::iter::repeat_n(v, (h >> 1) as usize));
        } else {
            for _ in 0..(h >> 1) {
                let b = r.byte();
                for k in 0..8 {
                    out.push(i16::from((b >> k) & 1));
                }
            }
        }
    }
    assert_eq!(r.at, bytes.len(), "every byte read");
    out.truncate(n);
    out
}

/// A deterministic mix of runs, jumps and extremes.
fn values(n: usize, seed: u64) -> Vec<i64> {
    let mut x = seed;
    let mut v = 0i64;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v = match (x >> 60, i % 300 < 100) {
                (_, true) => v.wrapping_add(1),
                (0, _) => i64::MIN,
                (1, _) => i64::MAX,
                (2..=5, _) => v.wrapping_add((x >> 20) as i64),
                _ => v.wrapping_sub((x & 0xffff) as i64),
            };
            v
        })
        .collect()
}

#[test]
fn delta_round_trips_both_widths() {
    for n in [0, 1, 2, 31, 32, 33, 128, 129, 130, 257, 1000, 5000] {
        for seed in [1, 7, 99] {
            let wide = values(n, seed);
            let mut out = vec![];
            encode_delta(&wide, &mut out);
            let back = if n == 0 {
                vec![]
            } else {
                decode_delta(&out, true)
            };
            assert_eq!(back, wide, "i64, {n} values");
            let mut again = vec![];
            let stats = encode_delta_with::<i64, true>(&wide, &mut again);
            assert_eq!(again, out, "the same bytes with statistics");
            let expected = wide
                .iter()
                .min()
                .map(|&lo| (lo, *wide.iter().max().unwrap()));
            assert_eq!(stats, expected, "minimum and maximum");
            let narrow: Vec<i32> = wide.iter().map(|&v| v as i32).collect();
            let mut out = vec![];
            encode_delta(&narrow, &mut out);
            let back: Vec<i32> = if n == 0 {
                vec![]
            } else {
                decode_delta(&out, false)
                    .iter()
                    .map(|&v| v as i32)
                    .collect()
            };
            assert_eq!(back, narrow, "i32, {n} values");
        }
    }
}

#[test]
fn levels_round_trip() {
    let mut x = 5u64;
    for n in [1, 7, 8, 9, 64, 100, 1000, 20_000] {
        for mix in [0u64, 1, 3, 15] {
            let levels: Vec<i16> = (0..n)
                .map(|i| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    match mix {
                        0 => 1,
                        _ if (i / 37) % 2 == 0 => 1,
                        _ => i16::from((x >> 61) & mix != 0),
                    }
                })
                .collect();
            let mut out = vec![];
            let present = encode_levels(&levels, &mut out);
            assert_eq!(decode_levels(&out, n), levels, "{n} levels, mix {mix}");
            assert_eq!(present, levels.iter().filter(|&&l| l == 1).count());
        }
    }
    let mut out = vec![];
    encode_levels(&[1; 50_000], &mut out);
    assert_eq!(out.len(), 4, "one RLE run");
}
