//! Line numbers from a code object's `co_linetable`, decoded once per code object.
//!
//! Two formats are in use across the supported versions:
//!
//! * **3.10** ("linetable"): pairs of bytes `(address delta, line delta)`; the address delta is
//!   unsigned in bytes of bytecode, the line delta signed, with -128 meaning "no line".
//! * **3.11+** (the location table of PEP 657): entries whose first byte has bit 7 set, bits 3–6
//!   a code and bits 0–2 the entry's length in code units minus one. Code 15: no location;
//!   14: long form (line delta as a signed varint, then end line and columns); 13: line delta as
//!   a signed varint, no columns; 10–12: the line delta is `code - 10` (then two column bytes);
//!   0–9: same line (one column byte). Varints are 6-bit little-endian groups with 0x40 as the
//!   continuation bit; signed ones keep the sign in bit 0.
//!
//! Both are turned into the same [`LineTable`]: sorted address ranges with their lines, searched
//! by byte offset. The decoders are checked against CPython's own `co_lines()` for every code
//! object of a few standard-library modules, under each installed version.

/// Which encoding `co_linetable` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Python 3.10.
    Pairs,
    /// Python 3.11 and later.
    Locations,
}

/// Address ranges (byte offsets into the bytecode) and their line numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LineTable {
    /// `(start, line)` per range, sorted by start; a range ends where the next starts. A line of
    /// -1 means "no line".
    starts: Vec<(u32, i32)>,
    /// Where the last range ends.
    end: u32,
}

impl LineTable {
    /// Decode `table` of a code object whose first line is `first_line`.
    pub fn decode(format: Format, table: &[u8], first_line: i32) -> LineTable {
        let mut out = LineTable::default();
        let mut line = first_line;
        let mut address: u32 = 0;
        match format {
            Format::Pairs => {
                for pair in table.chunks_exact(2) {
                    let delta = u32::from(pair[0]);
                    let line_delta = pair[1] as i8;
                    let this = if line_delta == -128 {
                        -1
                    } else {
                        line += i32::from(line_delta);
                        line
                    };
                    out.push(address, delta, this);
                    address += delta;
                }
            }
            Format::Locations => {
                let mut i = 0;
                while i < table.len() {
                    let first = table[i];
                    let code = (first >> 3) & 15;
                    let length = (u32::from(first & 7) + 1) * 2;
                    let delta = match code {
                        15 => 0,
                        13 | 14 => signed_varint(&table[i + 1..]),
                        10..=12 => i32::from(code) - 10,
                        _ => 0,
                    };
                    line += delta;
                    out.push(address, length, if code == 15 { -1 } else { line });
                    address += length;
                    // The next entry starts at the next byte with bit 7 set.
                    i += 1;
                    while i < table.len() && table[i] & 0x80 == 0 {
                        i += 1;
                    }
                }
            }
        }
        out.end = address;
        out
    }

    fn push(&mut self, start: u32, length: u32, line: i32) {
        if length == 0 {
            return;
        }
        match self.starts.last() {
            Some(&(_, last)) if last == line => {}
            _ => self.starts.push((start, line)),
        }
    }

    /// The line of the instruction at byte offset `offset`, or `None` where the table has none.
    pub fn line_at(&self, offset: u32) -> Option<i32> {
        if offset >= self.end {
            return None;
        }
        let i = self.starts.partition_point(|&(start, _)| start <= offset);
        let (_, line) = self.starts[i.checked_sub(1)?];
        (line >= 0).then_some(line)
    }
}

fn varint(bytes: &[u8]) -> u32 {
    let mut value = 0u32;
    let mut shift = 0;
    for &b in bytes {
        value |= u32::from(b & 63).checked_shl(shift).unwrap_or(0);
        if b & 64 == 0 {
            break;
        }
        shift += 6;
    }
    value
}

fn signed_varint(bytes: &[u8]) -> i32 {
    let v = varint(bytes);
    if v & 1 == 1 {
        -((v >> 1) as i32)
    } else {
        (v >> 1) as i32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_accumulate_lines_and_mark_gaps() {
        // 4 bytes at first+0, 6 bytes at first+2, 2 bytes with no line, 2 bytes at first+1.
        let table = [4, 0, 6, 2, 2, 0x80, 2, 0xff];
        let t = LineTable::decode(Format::Pairs, &table, 10);
        assert_eq!(t.line_at(0), Some(10));
        assert_eq!(t.line_at(3), Some(10));
        assert_eq!(t.line_at(4), Some(12));
        assert_eq!(t.line_at(9), Some(12));
        assert_eq!(t.line_at(10), None);
        assert_eq!(t.line_at(12), Some(11));
        assert_eq!(t.line_at(14), None, "past the end");
    }

    #[test]
    fn locations_decode_every_entry_form() {
        let table = [
            0x80 | (13 << 3) | 1,
            0x02, // no columns, line +1, 2 units
            0x80 | (11 << 3),
            5,
            9, // one-line form, +1, 1 unit
            0x80 | (14 << 3) | 2,
            0x05,
            0,
            1,
            2,                // long form, line -2, 3 units
            0x80 | (15 << 3), // no location, 1 unit
            0x80 | (3 << 3) | 1,
            7, // short form: same line, 2 units
            0x80 | (13 << 3),
            0x40 | 0x04,
            0x01, // varint over two bytes: 4 | (1 << 6) = 68 → +34
        ];
        let t = LineTable::decode(Format::Locations, &table, 100);
        assert_eq!(t.line_at(0), Some(101));
        assert_eq!(t.line_at(2), Some(101));
        assert_eq!(t.line_at(4), Some(102));
        assert_eq!(t.line_at(6), Some(100));
        assert_eq!(t.line_at(10), Some(100));
        assert_eq!(t.line_at(12), None);
        assert_eq!(t.line_at(14), Some(100));
        assert_eq!(t.line_at(16), Some(100));
        assert_eq!(t.line_at(18), Some(134));
        assert_eq!(t.line_at(20), None);
    }
}
