//! Which capture a stream takes part in, asked of the driver.
//!
//! A capture begins on one stream, which the shim sees (`cudaStreamBeginCapture`); other
//! streams join it without a call the shim sees, by waiting on an event recorded on a capturing
//! stream (`s2.wait_stream(s1)` in PyTorch). Work enqueued on a joined stream is captured too,
//! so the shim asks the driver whenever a stream it does not know as capturing allocates, frees
//! or would take a fence event while a capture is under way (see Note [Capture pools] in the
//! shim's `process::private_pools::captures`).
//!
//! It also walks a capture's graph backwards ([`Ancestry`]): whether the work a stream would
//! enqueue next already follows given nodes, for reusing within a capture a block whose
//! recorded streams the capture has joined back (Note [Recorded streams] in the shim's
//! `process::recorded_streams`).

use std::collections::HashSet;
use std::ffi::c_void;
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::streams::Stream;

/// `cuStreamGetCaptureInfo_v3` and `_v2` share their first three parameters (the stream, the
/// status and the capture's id); the rest are optional outputs we pass as null.
type CaptureInfoV3 = unsafe extern "C" fn(
    sys::CUstream,
    *mut sys::CUstreamCaptureStatus,
    *mut u64,
    *mut c_void,
    *mut c_void,
    *mut c_void,
    *mut c_void,
) -> sys::CUresult;
type CaptureInfoV2 = unsafe extern "C" fn(
    sys::CUstream,
    *mut sys::CUstreamCaptureStatus,
    *mut u64,
    *mut c_void,
    *mut c_void,
    *mut c_void,
) -> sys::CUresult;

#[derive(Clone, Copy)]
enum CaptureInfo {
    V3(CaptureInfoV3),
    V2(CaptureInfoV2),
}

/// The driver function called `name`, if libcuda has it.
///
/// # Safety
/// `F` must be the driver's declaration (cuda.h) of the function of that versioned name.
unsafe fn driver_function<F: Copy>(name: &[u8]) -> Option<F> {
    // SAFETY: only dlopens libcuda (by cudarc's list of names); no code of it runs.
    if !unsafe { sys::is_culib_present() } {
        return None;
    }
    // SAFETY: the library is present (checked above); looking a symbol up runs no code, and
    // the type is the caller's promise.
    unsafe { sys::culib().get::<F>(name) }.ok().map(|f| *f)
}

/// The driver's capture-info function: `_v3` (CUDA 12.3 and later), else `_v2` (11.3 and
/// later); `None` with a driver that has neither (it has no capture to join either).
fn capture_info() -> Option<CaptureInfo> {
    static FUNCTION: OnceLock<Option<CaptureInfo>> = OnceLock::new();
    *FUNCTION.get_or_init(|| {
        // SAFETY: the types are cuda.h's declarations of these versioned functions.
        let v3 = unsafe { driver_function::<CaptureInfoV3>(b"cuStreamGetCaptureInfo_v3") };
        // SAFETY: as above.
        let v2 = || unsafe { driver_function::<CaptureInfoV2>(b"cuStreamGetCaptureInfo_v2") };
        v3.map(CaptureInfo::V3)
            .or_else(|| v2().map(CaptureInfo::V2))
    })
}

/// Where a stream stands with graph captures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureState {
    /// Not capturing (or the driver could not say: a destroyed stream, say).
    None,
    /// Capturing into the capture with this id (the driver's, unique in the process).
    Active(u64),
    /// Its capture failed and waits for `cudaStreamEndCapture`: work on it is refused.
    Invalidated,
}

/// Where `stream` stands with graph captures. Legal on a capturing stream and in every capture
/// mode (unlike a stream query).
pub fn capture_state(stream: Stream) -> CaptureState {
    let Some(function) = capture_info() else {
        return CaptureState::None;
    };
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    let handle = stream.0 as sys::CUstream;
    let null = ptr::null_mut();
    // SAFETY: valid out-pointers for the status and the id, null for the optional outputs; the
    // stream handle is the application's (a stale one gets an error code back).
    let result = unsafe {
        match function {
            CaptureInfo::V3(f) => f(handle, &mut status, &mut id, null, null, null, null),
            CaptureInfo::V2(f) => f(handle, &mut status, &mut id, null, null, null),
        }
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        return CaptureState::None;
    }
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureState::Active(id),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
            CaptureState::Invalidated
        }
        _ => CaptureState::None,
    }
}

/// Whether `stream` takes part in a capture (under way or invalidated): no event may be recorded
/// on it, nor may it be queried, for a fence.
pub fn is_capturing(stream: Stream) -> bool {
    capture_state(stream) != CaptureState::None
}

/// A node of a capture's graph (the driver's `CUgraphNode`, as an address).
pub type Node = usize;

/// The nodes that work enqueued next on `stream` would depend on: the stream's dependency set
/// in its capture (empty at the capture's start). `None` if the stream is not capturing or the
/// driver cannot say.
pub fn capture_dependencies(stream: Stream) -> Option<Vec<Node>> {
    let function = capture_info()?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    let mut nodes: *const sys::CUgraphNode = ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = ptr::null();
    let mut count = 0usize;
    let handle = stream.0 as sys::CUstream;
    let nodes_out = (&raw mut nodes).cast::<c_void>();
    let count_out = (&raw mut count).cast::<c_void>();
    // SAFETY: valid out-pointers for the status, the id, the dependency array's address, its
    // edge data's address (asked for, so that edges with data do not make the query fail) and
    // its length; null for the graph. The driver owns the array it points us to, valid until the
    // next call on the stream: it is copied below, before any.
    let result = unsafe {
        match function {
            CaptureInfo::V3(f) => f(
                handle,
                &mut status,
                &mut id,
                ptr::null_mut(),
                nodes_out,
                (&raw mut edges).cast::<c_void>(),
                count_out,
            ),
            CaptureInfo::V2(f) => f(
                handle,
                &mut status,
                &mut id,
                ptr::null_mut(),
                nodes_out,
                count_out,
            ),
        }
    };
    if result != sys::CUresult::CUDA_SUCCESS
        || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
    {
        return None;
    }
    if count == 0 || nodes.is_null() {
        return Some(Vec::new());
    }
    // SAFETY: the driver returned `count` nodes at `nodes` (checked non-null above).
    let slice = unsafe { std::slice::from_raw_parts(nodes, count) };
    Some(slice.iter().map(|&n| n as Node).collect())
}

/// `cuGraphNodeGetDependencies_v2` (CUDA 12.3 and later: with edge data) and the first version.
type NodeDependenciesV2 = unsafe extern "C" fn(
    sys::CUgraphNode,
    *mut sys::CUgraphNode,
    *mut sys::CUgraphEdgeData,
    *mut usize,
) -> sys::CUresult;
type NodeDependenciesV1 =
    unsafe extern "C" fn(sys::CUgraphNode, *mut sys::CUgraphNode, *mut usize) -> sys::CUresult;

#[derive(Clone, Copy)]
enum NodeDependencies {
    V2(NodeDependenciesV2),
    V1(NodeDependenciesV1),
}

fn node_dependencies_function() -> Option<NodeDependencies> {
    static FUNCTION: OnceLock<Option<NodeDependencies>> = OnceLock::new();
    *FUNCTION.get_or_init(|| {
        // SAFETY: the types are cuda.h's declarations of these versioned functions.
        let v2 = unsafe { driver_function::<NodeDependenciesV2>(b"cuGraphNodeGetDependencies_v2") };
        // SAFETY: as above.
        let v1 = || unsafe { driver_function::<NodeDependenciesV1>(b"cuGraphNodeGetDependencies") };
        v2.map(NodeDependencies::V2)
            .or_else(|| v1().map(NodeDependencies::V1))
    })
}

/// The nodes `node` depends on directly. `None` if the driver cannot say.
pub fn node_dependencies(node: Node) -> Option<Vec<Node>> {
    let function = node_dependencies_function()?;
    let handle = node as sys::CUgraphNode;
    let query =
        |nodes: *mut sys::CUgraphNode, edges: *mut sys::CUgraphEdgeData, count: &mut usize| {
            // SAFETY: `nodes` and `edges` are null (a count query) or hold `*count` entries; the
            // node is one the driver gave us for a capture under way (a stale one gets an error).
            let result = unsafe {
                match function {
                    NodeDependencies::V2(f) => f(handle, nodes, edges, count),
                    NodeDependencies::V1(f) => f(handle, nodes, count),
                }
            };
            result == sys::CUresult::CUDA_SUCCESS
        };
    let mut count = 0usize;
    if !query(ptr::null_mut(), ptr::null_mut(), &mut count) {
        return None;
    }
    if count == 0 {
        return Some(Vec::new());
    }
    let mut nodes: Vec<sys::CUgraphNode> = vec![ptr::null_mut(); count];
    let none = sys::CUgraphEdgeData {
        from_port: 0,
        to_port: 0,
        type_: 0,
        reserved: [0; 5],
    };
    let mut edges = vec![none; count];
    if !query(nodes.as_mut_ptr(), edges.as_mut_ptr(), &mut count) {
        return None;
    }
    nodes.truncate(count);
    Some(
        nodes
            .into_iter()
            .filter(|n| !n.is_null())
            .map(|n| n as Node)
            .collect(),
    )
}

/// What precedes one stream's next work in its capture's graph: the nodes found so far by
/// walking the graph back from the stream's dependencies, kept between questions (a capture
/// only adds nodes, and a stream's new work follows its earlier work, so what preceded it once
/// precedes it from then on; a program that replaces a stream's dependencies with
/// `cudaStreamUpdateCaptureDependencies` breaks that rule, and is not covered).
#[derive(Debug, Default)]
pub struct Ancestry {
    /// Nodes known to precede the stream's next work, each walked back already.
    known: HashSet<Node>,
}

impl Ancestry {
    /// Whether every one of `nodes` precedes (or is one of) the work `stream` would enqueue
    /// next. False when the driver cannot say.
    pub fn all_precede(&mut self, stream: Stream, nodes: &[Node]) -> bool {
        if nodes.iter().all(|n| self.known.contains(n)) {
            return true;
        }
        let Some(frontier) = capture_dependencies(stream) else {
            return false;
        };
        let mut to_walk: Vec<Node> = frontier
            .into_iter()
            .filter(|n| self.known.insert(*n))
            .collect();
        while let Some(node) = to_walk.pop() {
            let Some(parents) = node_dependencies(node) else {
                // Half a walk would leave nodes known whose parents are not: forget it all.
                self.known.clear();
                return false;
            };
            to_walk.extend(parents.into_iter().filter(|p| self.known.insert(*p)));
        }
        nodes.iter().all(|n| self.known.contains(n))
    }
}
