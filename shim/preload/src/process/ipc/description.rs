//! The bytes that describe a shared block to the receiving process (see Note [IPC of pooled
//! memory] in `process::ipc`): opaque to PyTorch, which passes them between processes, and
//! decoded by our own receiver. Little-endian, one of two kinds:
//!
//! | kind | bytes |
//! |---|---|
//! | 1, a fixed segment's block (80 bytes) | kind `u8`, 7 zero bytes, the block's offset in the segment `u64`, the segment's `cudaIpcMemHandle_t` (64 bytes) |
//! | 2, an expandable segment's block (40 + 16 per chunk) | kind `u8`, 3 zero bytes, the sender's pid `u32`, its device `i32`, the number of chunks `u32`; where the covering range starts in the sender `u64` (with the pid, its identity), the range's size `u64`, the block's offset in it `u64`; then per chunk, in address order, its size `u64`, its file descriptor in the sender `i32`, 4 zero bytes |
//!
//! No description is 64 bytes long, so that one is never taken for a bare IPC handle.

/// A block of a fixed segment.
const FIXED: u8 = 1;
/// A block of an expandable segment.
const MAPPED: u8 = 2;
/// The most chunks a description may name (a range the size of a large GPU, in 2 MiB chunks).
const MAX_CHUNKS: usize = 1 << 20;

/// What the receiving process needs to map a shared block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shared {
    /// A block of a fixed segment: the segment's handle, and the shared address's offset in it.
    Segment {
        /// The segment's `cudaIpcMemHandle_t`.
        handle: [u8; 64],
        /// The shared address's offset in the segment.
        offset: u64,
    },
    /// A block of an expandable segment: the chunks of physical memory mapped over it.
    Mapped(MappedShare),
}

/// The memory mapped over a block of an expandable segment, exported by the sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappedShare {
    /// The sender's process id (its file descriptors are taken from it).
    pub pid: u32,
    /// The sender's device.
    pub device: i32,
    /// Where the covering range starts in the sender (with `pid`, its identity).
    pub start: u64,
    /// Each chunk of physical memory in address order: its size and its file descriptor in
    /// the sender.
    pub chunks: Vec<(u64, i32)>,
    /// The shared address's offset in the covering range.
    pub offset: u64,
}

impl MappedShare {
    /// The covering range's size.
    pub fn size(&self) -> u64 {
        self.chunks.iter().map(|&(size, _)| size).sum()
    }
}

impl Shared {
    /// The description's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Shared::Segment { handle, offset } => {
                out.push(FIXED);
                out.extend_from_slice(&[0; 7]);
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(handle);
            }
            Shared::Mapped(m) => {
                out.push(MAPPED);
                out.extend_from_slice(&[0; 3]);
                out.extend_from_slice(&m.pid.to_le_bytes());
                out.extend_from_slice(&m.device.to_le_bytes());
                out.extend_from_slice(&(m.chunks.len() as u32).to_le_bytes());
                out.extend_from_slice(&m.start.to_le_bytes());
                out.extend_from_slice(&m.size().to_le_bytes());
                out.extend_from_slice(&m.offset.to_le_bytes());
                for &(size, fd) in &m.chunks {
                    out.extend_from_slice(&size.to_le_bytes());
                    out.extend_from_slice(&fd.to_le_bytes());
                    out.extend_from_slice(&[0; 4]);
                }
            }
        }
        out
    }

    /// Read a description (from another process: every field is checked).
    pub fn decode(bytes: &[u8]) -> Result<Shared, String> {
        let u64_at = |at: usize| -> u64 {
            u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
        };
        let u32_at = |at: usize| -> u32 {
            u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
        };
        match bytes.first() {
            Some(&FIXED) if bytes.len() == 80 => {
                let mut handle = [0; 64];
                handle.copy_from_slice(&bytes[16..80]);
                Ok(Shared::Segment {
                    handle,
                    offset: u64_at(8),
                })
            }
            Some(&MAPPED) if bytes.len() >= 40 => {
                let n = u32_at(12) as usize;
                if n == 0 || n > MAX_CHUNKS || bytes.len() != 40 + 16 * n {
                    return Err(format!(
                        "an IPC description of {} bytes names {n} chunks",
                        bytes.len()
                    ));
                }
                let chunks: Vec<(u64, i32)> = (0..n)
                    .map(|i| (u64_at(40 + 16 * i), u32_at(48 + 16 * i) as i32))
                    .collect();
                let share = MappedShare {
                    pid: u32_at(4),
                    device: u32_at(8) as i32,
                    start: u64_at(16),
                    chunks,
                    offset: u64_at(32),
                };
                let size = share.size();
                if share.pid == 0
                    || size != u64_at(24)
                    || share.offset >= size
                    || share.chunks.iter().any(|&(s, fd)| s == 0 || fd < 0)
                {
                    return Err("an inconsistent IPC description".to_string());
                }
                Ok(Shared::Mapped(share))
            }
            _ => Err(format!(
                "not a cachealloc IPC description ({} bytes)",
                bytes.len()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptions_round_trip_and_bad_ones_are_refused() {
        let fixed = Shared::Segment {
            handle: [7; 64],
            offset: 4096,
        };
        assert_eq!(fixed.encode().len(), 80);
        assert_eq!(Shared::decode(&fixed.encode()), Ok(fixed));
        for n in 1..4 {
            let mapped = Shared::Mapped(MappedShare {
                pid: 42,
                device: 1,
                start: 0x7f00_0000_0000,
                chunks: (0..n).map(|i| (2 << 20, 10 + i)).collect(),
                offset: 512,
            });
            let bytes = mapped.encode();
            assert_ne!(bytes.len(), 64);
            assert_eq!(Shared::decode(&bytes), Ok(mapped));
            assert!(Shared::decode(&bytes[..bytes.len() - 1]).is_err());
        }
        let mut bad = Shared::Mapped(MappedShare {
            pid: 42,
            device: 0,
            start: 0,
            chunks: vec![(2 << 20, 3)],
            offset: 2 << 20,
        })
        .encode();
        assert!(Shared::decode(&bad).is_err(), "an offset past the range");
        bad[32] = 0;
        bad[34] = 0;
        assert!(Shared::decode(&bad).is_ok());
        bad[48] = 0xff;
        bad[51] = 0xff;
        assert!(Shared::decode(&bad).is_err(), "a negative file descriptor");
        assert!(Shared::decode(&[]).is_err());
        assert!(Shared::decode(&[3; 80]).is_err());
    }
}
