//! The fast path decodes exactly as rmp-serde does: the reader's decoding (fast path first, then
//! rmp-serde) is compared with rmp-serde alone over the writer's own bodies, bodies re-encoded in
//! every integer form and array header, mutated (truncated, flipped, extended) and random bodies,
//! and every record of the golden files. Equal means: both decode to the same record, or both
//! fail. Nothing may panic.

use proptest::prelude::*;

use super::decode_hot;
use crate::chunk::{FLAG_ZSTD, decode_payload, split_chunk};
use crate::schema::*;

/// The kinds the fast path takes.
const HOT: [u8; 11] = [
    kinds::ALLOC,
    kinds::FREE,
    kinds::FREE_REQUESTED,
    kinds::FREE_COMPLETED,
    kinds::SEGMENT_ALLOC,
    kinds::SEGMENT_FREE,
    kinds::SEGMENT_MAP,
    kinds::SEGMENT_UNMAP,
    kinds::STATS_SAMPLE,
    kinds::CHECKPOINT_SEGMENT,
    kinds::CHECKPOINT_BLOCK,
];

/// rmp-serde's decode of a body of a hot kind: the reference.
fn reference(kind: u8, body: &[u8]) -> Result<Record, String> {
    let e = |e: rmp_serde::decode::Error| e.to_string();
    Ok(match kind {
        kinds::ALLOC => Record::Alloc(rmp_serde::from_slice(body).map_err(e)?),
        kinds::FREE => Record::Free(rmp_serde::from_slice(body).map_err(e)?),
        kinds::FREE_REQUESTED => Record::FreeRequested(rmp_serde::from_slice(body).map_err(e)?),
        kinds::FREE_COMPLETED => Record::FreeCompleted(rmp_serde::from_slice(body).map_err(e)?),
        kinds::SEGMENT_ALLOC => Record::SegmentAlloc(rmp_serde::from_slice(body).map_err(e)?),
        kinds::SEGMENT_FREE => Record::SegmentFree(rmp_serde::from_slice(body).map_err(e)?),
        kinds::SEGMENT_MAP => Record::SegmentMap(rmp_serde::from_slice(body).map_err(e)?),
        kinds::SEGMENT_UNMAP => Record::SegmentUnmap(rmp_serde::from_slice(body).map_err(e)?),
        kinds::STATS_SAMPLE => Record::StatsSample(rmp_serde::from_slice(body).map_err(e)?),
        kinds::CHECKPOINT_SEGMENT => {
            Record::CheckpointSegment(rmp_serde::from_slice(body).map_err(e)?)
        }
        kinds::CHECKPOINT_BLOCK => Record::CheckpointBlock(rmp_serde::from_slice(body).map_err(e)?),
        _ => unreachable!("not a hot kind: {kind}"),
    })
}

/// The property: `decode` (fast path first) answers what rmp-serde answers (a record, or an
/// error).
fn same_as_rmp_serde(kind: u8, body: &[u8]) -> Result<(), TestCaseError> {
    let ours = match decode_hot(kind, body) {
        Some(record) => Ok(record),
        None => Record::decode(kind, body),
    }
    .map_err(|e| e.to_string());
    let theirs = reference(kind, body);
    match (&ours, &theirs) {
        (Ok(a), Ok(b)) => prop_assert_eq!(a, b, "kind {} body {:02x?}", kind, body),
        (Err(_), Err(_)) => {}
        _ => prop_assert!(
            false,
            "kind {kind} body {body:02x?}: ours {ours:?}, rmp-serde {theirs:?}"
        ),
    }
    if let Some(fast) = decode_hot(kind, body) {
        prop_assert_eq!(Ok(fast), theirs);
    }
    Ok(())
}

/// The fields of a hot kind's struct, as rmp-serde writes them (the writer's own encoding).
fn canonical(kind: u8, f: &[u64; 8]) -> Vec<u8> {
    let (a, b, c, d, e, g, h, i) = (f[0], f[1] as u32, f[2], f[3], f[4], f[5], f[6], f[7]);
    let free = FreeRequested {
        t: a,
        device: b,
        stream: c,
        address: d,
        size: e,
        stack: h as u32,
        thread: i as u32,
    };
    let seg = SegmentEvent {
        t: a,
        device: b,
        address: c,
        size: d,
        pool: e as u8,
        stack: h as u32,
    };
    let body = match kind {
        kinds::ALLOC => rmp_serde::to_vec(&Alloc {
            t: a,
            device: b,
            stream: c,
            address: d,
            requested: e,
            size: g,
            stack: h as u32,
            thread: i as u32,
        }),
        kinds::FREE | kinds::FREE_REQUESTED => rmp_serde::to_vec(&free),
        kinds::FREE_COMPLETED => rmp_serde::to_vec(&FreeCompleted {
            t: a,
            device: b,
            address: c,
            size: d,
        }),
        kinds::STATS_SAMPLE => rmp_serde::to_vec(&StatsSample {
            t: a,
            device: b,
            allocated: c,
            reserved: d,
            active: e,
            requested: g,
        }),
        kinds::CHECKPOINT_SEGMENT => rmp_serde::to_vec(&SegmentState {
            device: b,
            address: c,
            size: d,
            pool: e as u8,
            stack: h as u32,
        }),
        kinds::CHECKPOINT_BLOCK => rmp_serde::to_vec(&BlockState {
            device: b,
            address: c,
            size: d,
            requested: e,
            stack: h as u32,
            pending: i as u8,
        }),
        _ => rmp_serde::to_vec(&seg),
    };
    body.expect("plain structs encode")
}

/// Field values that exercise every integer width (small, at each boundary, huge).
fn value() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..200,
        prop::sample::select(vec![
            0x7f,
            0x80,
            0xff,
            0x100,
            0xffff,
            0x1_0000,
            0xffff_ffff,
            0x1_0000_0000,
            i64::MAX as u64,
            u64::MAX
        ]),
        any::<u64>(),
    ]
}

/// One integer in MessagePack, in `form` (0–4 unsigned: fixint, u8, u16, u32, u64; 5–8 signed:
/// i8, i16, i32, i64; 9 a negative fixint, 10 nil, 11 a float), widened where it does not fit.
fn write_int(out: &mut Vec<u8>, v: u64, form: u8) {
    match form {
        0 if v < 0x80 => out.push(v as u8),
        0 | 1 if v <= 0xff => out.extend([0xcc, v as u8]),
        0..=2 if v <= 0xffff => {
            out.push(0xcd);
            out.extend((v as u16).to_be_bytes());
        }
        0..=3 if v <= 0xffff_ffff => {
            out.push(0xce);
            out.extend((v as u32).to_be_bytes());
        }
        0..=4 => {
            out.push(0xcf);
            out.extend(v.to_be_bytes());
        }
        5 if v < 0x80 => out.extend([0xd0, v as u8]),
        5 | 6 if v < 0x8000 => {
            out.push(0xd1);
            out.extend((v as u16).to_be_bytes());
        }
        5..=7 if v < 0x8000_0000 => {
            out.push(0xd2);
            out.extend((v as u32).to_be_bytes());
        }
        5..=8 => {
            out.push(0xd3);
            out.extend(v.to_be_bytes());
        }
        9 => out.push(0xff),
        10 => out.push(0xc0),
        _ => {
            out.push(0xcb);
            out.extend((v as f64).to_be_bytes());
        }
    }
}

/// A body of `fields` integers under an array header of `header` form (0 fixarray, 1 array16,
/// 2 array32, 3 fixmap).
fn reencoded(header: u8, values: &[(u64, u8)]) -> Vec<u8> {
    let n = values.len();
    let mut out = match header {
        0 => vec![0x90 | n as u8],
        1 => vec![0xdc, 0, n as u8],
        2 => vec![0xdd, 0, 0, 0, n as u8],
        _ => vec![0x80 | n as u8],
    };
    for &(v, form) in values {
        write_int(&mut out, v, form);
    }
    out
}

/// Each hot kind's field count.
fn field_count(kind: u8) -> usize {
    match kind {
        kinds::ALLOC => 8,
        kinds::FREE | kinds::FREE_REQUESTED => 7,
        kinds::FREE_COMPLETED => 4,
        kinds::CHECKPOINT_SEGMENT => 5,
        _ => 6,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    /// The writer's own bodies: the fast path takes every one, and decodes it as rmp-serde does.
    #[test]
    fn writer_bodies_take_the_fast_path(kind in prop::sample::select(HOT.to_vec()),
                                        f in prop::array::uniform8(value())) {
        let body = canonical(kind, &f);
        prop_assert!(decode_hot(kind, &body).is_some(), "kind {} body {:02x?}", kind, body);
        same_as_rmp_serde(kind, &body)?;
    }

    /// Every integer form and array header, with a field too many or too few now and then.
    #[test]
    fn reencoded_bodies_decode_as_rmp_serde_does(
        kind in prop::sample::select(HOT.to_vec()),
        header in prop_oneof![4 => Just(0u8), 1 => 0u8..4],
        extra in prop_oneof![8 => Just(0i8), 1 => Just(-1i8), 1 => Just(1i8)],
        fields in prop::collection::vec((value(), prop_oneof![6 => 0u8..5, 1 => 5u8..12]), 9),
    ) {
        let n = (field_count(kind) as i8 + extra) as usize;
        same_as_rmp_serde(kind, &reencoded(header, &fields[..n]))?;
    }

    /// The writer's bodies truncated, with a byte changed, or with bytes after them.
    #[test]
    fn mutated_bodies_decode_as_rmp_serde_does(
        kind in prop::sample::select(HOT.to_vec()),
        f in prop::array::uniform8(value()),
        cut in any::<prop::sample::Index>(),
        flip in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        tail in prop::collection::vec(any::<u8>(), 1..4),
    ) {
        let body = canonical(kind, &f);
        same_as_rmp_serde(kind, &body[..cut.index(body.len())])?;
        let mut flipped = body.clone();
        flipped[flip.index(body.len())] = byte;
        same_as_rmp_serde(kind, &flipped)?;
        let mut longer = body;
        longer.extend(tail);
        same_as_rmp_serde(kind, &longer)?;
    }

    /// Random bytes.
    #[test]
    fn random_bodies_decode_as_rmp_serde_does(kind in prop::sample::select(HOT.to_vec()),
                                              body in prop::collection::vec(any::<u8>(), 0..48)) {
        same_as_rmp_serde(kind, &body)?;
    }

    /// A chunk's payload, cut or damaged anywhere, is an error or records, never a panic.
    #[test]
    fn damaged_payloads_do_not_panic(cut in any::<prop::sample::Index>(),
                                     flip in any::<prop::sample::Index>(),
                                     byte in any::<u8>()) {
        let mut payload = vec![];
        for (i, kind) in HOT.iter().enumerate() {
            let body = canonical(*kind, &[i as u64, 0, 1 << 40, 3, 1, 5, 6, 7]);
            payload.push(*kind);
            write_leb128(&mut payload, body.len() as u64);
            payload.extend(body);
        }
        prop_assert_eq!(decode_payload(&payload, 0).map(|r| r.len()), Ok(HOT.len()));
        let _ = decode_payload(&payload[..cut.index(payload.len())], 0);
        let i = flip.index(payload.len());
        payload[i] = byte;
        let _ = decode_payload(&payload, 0);
        let _ = decode_payload(&payload, FLAG_ZSTD);
    }
}

/// Every record of the golden files (format version 1, plain and zstd) of a hot kind decodes
/// through the fast path, to what rmp-serde decodes.
#[test]
fn golden_records_decode_as_rmp_serde_does() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/v1");
    let mut hot = 0;
    for variant in ["plain", "zstd"] {
        let bytes = std::fs::read(root.join(variant).join("trace-000000.cat")).expect("golden");
        let mut rest = &bytes[12..];
        while !rest.is_empty() {
            let (payload, flags, used) = split_chunk(rest).expect("a whole chunk");
            rest = &rest[used..];
            let data = if flags & FLAG_ZSTD != 0 {
                zstd::stream::decode_all(payload).expect("decompresses")
            } else {
                payload.to_vec()
            };
            let mut at = 0;
            while at < data.len() {
                let kind = data[at];
                let (len, used) = read_leb128(&data[at + 1..]).expect("a length");
                let body = &data[at + 1 + used..at + 1 + used + len as usize];
                at += 1 + used + len as usize;
                if HOT.contains(&kind) {
                    hot += 1;
                    let fast = decode_hot(kind, body).expect("the fast path takes it");
                    assert_eq!(Ok(fast), reference(kind, body));
                }
            }
        }
    }
    assert!(
        hot >= 2 * 10,
        "{hot} records of hot kinds in the golden files"
    );
}
