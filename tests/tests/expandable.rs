//! End-to-end tests of expandable segments (`expandable_segments:True`) over fakecuda's
//! virtual memory API: programs are pooled by mapping memory (fakecuda counts physical
//! allocations, and no `cuMemAlloc`), the trace tells the maps and unmaps, the out-of-memory
//! ladder unmaps before it fails, IPC is refused, and a device without virtual memory falls
//! back to fixed segments with one message (the control: there, nothing is mapped).

use cachealloc_recorder::schema::kinds;
use cachealloc_tests::{Output, Run, count, read_trace};

const EXPANDABLE: &str = "expandable_segments:True";

/// fakecuda's report (`FAKECUDA_REPORT=1`) of the program: device allocations (`cuMemAlloc*`)
/// and physical allocations (`cuMemCreate`).
fn report(out: &Output) -> (u64, u64) {
    (
        out.fakecuda_count("device allocations"),
        out.fakecuda_count("physical creates"),
    )
}

fn run(name: &str, args: &[&str], conf: &str) -> Output {
    Run::c(name, args)
        .env("CACHEALLOC_CONF", conf)
        .env("FAKECUDA_REPORT", "1")
        .output()
}

#[test]
fn programs_are_pooled_by_mapping_memory() {
    for (name, args) in [
        ("basic", &[][..]),
        ("basic_static", &[]),
        ("threads", &["8", "200"]),
        ("load", &["4", "200", "1"]),
        ("stream_ordered", &[]),
        ("race", &["nonblocking"]),
        ("churn", &["20000"]),
    ] {
        let out = run(name, args, EXPANDABLE);
        let program = name.trim_end_matches("_static");
        out.assert_pooled(program);
        assert!(
            out.stderr.contains("maps into expandable segments"),
            "{name}: {}",
            out.stderr
        );
        let (device_allocations, physical) = report(&out);
        assert_eq!(device_allocations, 0, "{name}: {}", out.stderr);
        assert!(physical > 0, "{name}: {}", out.stderr);
    }
}

/// Note [Moving memory instead of unmapping it], end to end: recycling maps memory at a second
/// place (fakecuda counts such maps) instead of creating it, and every block keeps its bytes:
/// fakecuda's memory is shared between the places it is mapped at, so two live blocks on one
/// memory would overwrite each other's patterns, which `load` checks at every free. One thread
/// recycles the same way at every run; four threads race around the moves.
#[test]
fn recycling_moves_memory_and_every_block_keeps_its_bytes() {
    for (args, always_moves) in [
        (["1", "1000", "1"], true),
        (["1", "1000", "2"], true),
        (["4", "300", "3"], false),
    ] {
        let out = run("load", &args, EXPANDABLE);
        out.assert_pooled("load");
        let second_mappings = out.fakecuda_count("second mappings");
        assert!(
            second_mappings > 0 || !always_moves,
            "{args:?}: no memory moved: {}",
            out.stderr
        );
    }
}

#[test]
fn a_device_without_virtual_memory_gets_fixed_segments() {
    let out = Run::c("threads", &["4", "100"])
        .env("CACHEALLOC_CONF", EXPANDABLE)
        .env("FAKECUDA_REPORT", "1")
        .env("FAKECUDA_NO_VMM", "1")
        .output();
    out.assert_pooled("threads");
    assert_eq!(
        out.stderr
            .matches("expandable segments unavailable on device 0")
            .count(),
        1,
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("maps into expandable segments"),
        "{}",
        out.stderr
    );
    let (device_allocations, physical) = report(&out);
    assert!(device_allocations > 0 && physical == 0, "{}", out.stderr);
}

#[test]
fn the_trace_tells_every_map_and_unmap() {
    // oom fills a 64 MiB device, frees everything and asks for more than any cached block:
    // the ladder unmaps, then maps again.
    let out = Run::c("oom", &[])
        .env("CACHEALLOC_CONF", EXPANDABLE)
        .env("FAKECUDA_CAPACITY_MB", "64")
        .output();
    out.assert_pooled("oom");
    let (records, tears) = read_trace(&out.one_trace());
    assert!(tears.is_empty());
    let (maps, unmaps) = (
        count(&records, kinds::SEGMENT_MAP),
        count(&records, kinds::SEGMENT_UNMAP),
    );
    assert!(maps > 0 && unmaps > 0, "{maps} maps, {unmaps} unmaps");
    assert_eq!(count(&records, kinds::SEGMENT_ALLOC), 0, "no fixed segment");
    // The mapped bytes the trace tells never exceed the device.
    let mut mapped: i64 = 0;
    for r in &records {
        match r {
            cachealloc_recorder::Record::SegmentMap(s) => mapped += s.size as i64,
            cachealloc_recorder::Record::SegmentUnmap(s) => mapped -= s.size as i64,
            _ => {}
        }
        assert!((0..=64 << 20).contains(&mapped), "{mapped} bytes mapped");
    }
}

#[test]
fn ipc_handles_of_expandable_memory_are_the_shims() {
    // A handle of the shim's for every block, even one that is its segment's base (mapped
    // memory has no legacy handle); `cuda_ipc_handles.c` opens them in another process.
    run("ipc", &[], EXPANDABLE).assert_ok("ipc");
    run("ipc", &[], "").assert_ok("ipc");
}

/// Note [Peer access to mapped memory]: a device that enables peer access gets access to the
/// memory mapped before and after, through the runtime's call (the shared runtime's symbol)
/// and through the driver's (the static runtime's `cudaDeviceEnablePeerAccess`, and the
/// program's own `cuCtxEnablePeerAccess`); no device gets access before it enables it (the
/// program checks that first).
#[test]
fn a_device_that_enables_peer_access_can_use_the_mapped_memory() {
    for name in ["peer_access", "peer_access_static"] {
        let out = Run::c(name, &[])
            .env("CACHEALLOC_CONF", EXPANDABLE)
            .env("FAKECUDA_DEVICES", "2")
            .output();
        out.assert_ok("peer_access");
        assert!(!out.stdout.contains("skipped"), "{name}: {}", out.stdout);
    }
    // A MemPool's mapped memory too (its pool maps on a device of its own).
    let out = Run::c("peer_access", &["mempool"])
        .env("CACHEALLOC_CONF", EXPANDABLE)
        .env("FAKECUDA_DEVICES", "2")
        .output();
    out.assert_ok("peer_access");
    assert!(!out.stdout.contains("skipped"), "mempool: {}", out.stdout);
}

/// PyTorch's `cudaMallocAsync` route gives peer access by `cudaMemPoolSetAccess` on the owner's
/// default pool, and enables no context's peer access: the pool's memory (served by ours) must
/// then be usable all the same, mapped memory by access, `cudaMalloc`'s segments by the
/// contexts' peer access (the program sees it enabled). The shared runtime only: the shim
/// knows default pools through the runtime's `cudaDeviceGetDefaultMemPool`.
#[test]
fn access_to_a_default_pool_gives_access_to_the_pooled_memory() {
    for (mode, conf) in [("pool", EXPANDABLE), ("pool-fixed", "")] {
        let out = Run::c("peer_access", &[mode])
            .env("CACHEALLOC_CONF", conf)
            .env("FAKECUDA_DEVICES", "2")
            .output();
        out.assert_ok("peer_access");
        assert!(!out.stdout.contains("skipped"), "{mode}: {}", out.stdout);
    }
}

/// Note [Peer access to mapped memory]'s lock, end to end: two threads map, move and unmap on
/// device 0 while device 1 enables peer access; then every live block and every block allocated
/// next (on memory mapped before, during or after, parked places among it) is device 1's to use.
#[test]
fn peer_access_enabled_while_threads_map_reaches_every_block() {
    for name in ["peer_access", "peer_access_static"] {
        for _ in 0..3 {
            let out = Run::c(name, &["race"])
                .env("CACHEALLOC_CONF", EXPANDABLE)
                .env("FAKECUDA_DEVICES", "2")
                .env("FAKECUDA_REPORT", "1")
                .output();
            out.assert_ok("peer_access");
            // The race moved memory, so parked places were part of it.
            assert!(
                out.fakecuda_count("second mappings") > 0,
                "{name}: {}",
                out.stderr
            );
        }
    }
}

/// A free of a block carved from memory that another thread's allocation has mapped and not yet
/// returned from must find its block (found on two H200s: `cudaFree` answered "invalid
/// argument", the pools' address span being widened only when the mapping allocation
/// returned; now the device call that makes the memory widens it). `map_race` stages the
/// interleaving with fakecuda's slow memory calls, and checks that it was reached.
#[test]
fn a_block_of_memory_still_being_mapped_by_another_thread_can_be_freed() {
    for _ in 0..3 {
        Run::c("map_race", &[])
            .env("CACHEALLOC_CONF", EXPANDABLE)
            .env("FAKECUDA_SLOW_US", "10000")
            .output()
            .assert_ok("map_race");
    }
}

#[test]
fn private_pools_map_their_memory_and_keep_it_while_in_use() {
    // The graph and pool programs, whose private pools now grow by mapping (Note [Expandable
    // private pools]): captures into pools, checkpoints restored over mapped runs, MemPools
    // that keep their memory and lend it on OOM. No fixed segment is made for them, but the
    // one mem_pools' own allocator takes from CUDA for its pool.
    for (name, capacity, foreign) in [
        ("capture_pools", "1024", 0),
        ("pool_checkpoints", "1024", 0),
        ("mem_pools", "100", 1),
    ] {
        let out = Run::c(name, &[])
            .env("CACHEALLOC_CONF", EXPANDABLE)
            .env("EXACT_FREE", "1")
            .env("FAKECUDA_CAPACITY_MB", capacity)
            .env("FAKECUDA_REPORT", "1")
            .output();
        out.assert_pooled(name);
        assert!(
            !out.stderr.contains("cachealloc: error"),
            "{name}: {}",
            out.stderr
        );
        let (device_allocations, physical) = report(&out);
        assert!(
            physical > 0 && device_allocations == foreign,
            "{name}: {device_allocations} device allocations, {physical} physical creates: {}",
            out.stderr
        );
    }
}

#[test]
fn a_mem_pools_block_is_shared_with_another_process_until_the_receiver_lets_go() {
    // The sender's blocks in a MemPool: a private pool's mapped memory is exported from its own
    // device, and the block stays out of the pool until the receiver lets go. The control: a
    // MemPool of fixed segments (the default), by the 64-byte handle and by the description.
    for (conf, args) in [
        (EXPANDABLE, &["desc"][..]),
        (EXPANDABLE, &["desc", "big"][..]),
        ("", &[][..]),
        ("", &["desc"][..]),
    ] {
        let out = Run::c("ipc_share", args)
            .env("CACHEALLOC_CONF", conf)
            .env("MEMPOOL", "1")
            .env("EXACT_FDS", "1")
            .output();
        // Every allocation goes to the MemPool, which the exit summary does not count.
        out.assert_ok("ipc_share");
        assert!(
            !out.stderr.contains("cachealloc: error"),
            "{args:?}: {}",
            out.stderr
        );
        assert!(
            out.stdout.contains("OK ipc_share receiver"),
            "{args:?}: the receiving process did not finish: {}",
            out.stdout
        );
    }
}
