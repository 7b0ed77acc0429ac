//! The fast path writes exactly what rmp-serde writes: every hot kind's record, with integers
//! around each boundary of MessagePack's forms, encoded both ways.

use proptest::prelude::*;

use super::encode_hot;
use crate::schema::*;

/// rmp-serde's encoding of `record`: the reference.
fn reference(record: &Record) -> Vec<u8> {
    let body = match record {
        Record::Alloc(r) => rmp_serde::to_vec(r),
        Record::Free(r) | Record::FreeRequested(r) => rmp_serde::to_vec(r),
        Record::FreeCompleted(r) => rmp_serde::to_vec(r),
        Record::SegmentAlloc(r)
        | Record::SegmentFree(r)
        | Record::SegmentMap(r)
        | Record::SegmentUnmap(r) => rmp_serde::to_vec(r),
        Record::StatsSample(r) => rmp_serde::to_vec(r),
        Record::Scope(r) => rmp_serde::to_vec(r),
        Record::Phase(r) => rmp_serde::to_vec(r),
        Record::Tag(r) => rmp_serde::to_vec(r),
        Record::CheckpointSegment(r) => rmp_serde::to_vec(r),
        Record::CheckpointBlock(r) => rmp_serde::to_vec(r),
        other => panic!("not a hot kind: {other:?}"),
    }
    .unwrap();
    let mut out = vec![record.kind()];
    write_leb128(&mut out, body.len() as u64);
    out.extend_from_slice(&body);
    out
}

/// Integers on both sides of every boundary of MessagePack's unsigned forms, and anywhere.
fn int() -> impl Strategy<Value = u64> {
    let edges = [
        0u64,
        127,
        128,
        255,
        256,
        65_535,
        65_536,
        u32::MAX as u64,
        1 << 32,
        u64::MAX,
    ];
    prop_oneof![
        3 => proptest::sample::select(edges.to_vec()),
        3 => 0u64..300,
        2 => 0u64..70_000,
        2 => any::<u32>().prop_map(u64::from),
        2 => any::<u64>(),
    ]
}

fn record() -> impl Strategy<Value = Record> {
    let ints = proptest::collection::vec(int(), 8);
    (0usize..15, ints).prop_map(|(which, v)| {
        let (u32_, u8_) = (|i: usize| v[i] as u32, |i: usize| v[i] as u8);
        let free = FreeRequested {
            t: v[0],
            device: u32_(1),
            stream: v[2],
            address: v[3],
            size: v[4],
            stack: u32_(5),
            thread: u32_(6),
        };
        let segment = SegmentEvent {
            t: v[0],
            device: u32_(1),
            address: v[2],
            size: v[3],
            pool: u8_(4),
            stack: u32_(5),
        };
        match which {
            0 => Record::Alloc(Alloc {
                t: v[0],
                device: u32_(1),
                stream: v[2],
                address: v[3],
                requested: v[4],
                size: v[5],
                stack: u32_(6),
                thread: u32_(7),
            }),
            1 => Record::Free(free),
            2 => Record::FreeRequested(free),
            3 => Record::FreeCompleted(FreeCompleted {
                t: v[0],
                device: u32_(1),
                address: v[2],
                size: v[3],
            }),
            4 => Record::SegmentAlloc(segment),
            5 => Record::SegmentFree(segment),
            6 => Record::SegmentMap(segment),
            7 => Record::SegmentUnmap(segment),
            8 => Record::StatsSample(StatsSample {
                t: v[0],
                device: u32_(1),
                allocated: v[2],
                reserved: v[3],
                active: v[4],
                requested: v[5],
            }),
            9 => Record::Scope(ScopeEvent {
                t: v[0],
                thread: u32_(1),
                scope: u32_(2),
            }),
            10 => Record::Phase(PhaseEvent {
                t: v[0],
                phase: u8_(1),
                step: v[2],
            }),
            11 => Record::Tag(TagEvent {
                t: v[0],
                device: u32_(1),
                address: v[2],
                category: u8_(3),
            }),
            12 => Record::CheckpointSegment(SegmentState {
                device: u32_(0),
                address: v[1],
                size: v[2],
                pool: u8_(3),
                stack: u32_(4),
            }),
            _ => Record::CheckpointBlock(BlockState {
                device: u32_(0),
                address: v[1],
                size: v[2],
                requested: v[3],
                stack: u32_(4),
                pending: u8_(5),
            }),
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn the_fast_path_writes_what_rmp_serde_writes(record in record()) {
        let mut fast = vec![0xaa]; // appends, after what is there
        prop_assert!(encode_hot(&record, &mut fast));
        prop_assert_eq!(&fast[1..], &reference(&record)[..]);
        let mut through_encode = Vec::new();
        super::encode(&record, &mut through_encode);
        prop_assert_eq!(through_encode, reference(&record));
    }
}

#[test]
fn other_kinds_are_left_to_rmp_serde() {
    let mut out = Vec::new();
    let record = Record::StreamCreated(StreamEvent {
        t: 5,
        device: 0,
        stream: 7,
        flags: 1,
    });
    assert!(!encode_hot(&record, &mut out));
    assert!(out.is_empty());
    let mut reference = Vec::new();
    record.encode(&mut reference);
    super::encode(&record, &mut out);
    assert_eq!(out, reference);
}
