//! Where CPython keeps what the frame walker reads, per minor version (3.10–3.13, 64-bit).
//!
//! These are `offsetof`s of internal structures (`PyThreadState`, the interpreter frame,
//! `PyCodeObject`, compact unicode objects), which change between minor versions but not within
//! one. They were taken from each version's headers by `offsets.c` (beside this file), and the
//! test `python_layouts_match_headers` (in `tests/`) compiles that program against every
//! installed CPython and compares its output with this table.

/// How a thread's frame chain is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// 3.10: `PyThreadState.frame` → `PyFrameObject`, linked by `f_back`, `f_lasti` an `int`
    /// index in code units (-1 before the first instruction).
    FrameObject,
    /// 3.11–3.12: `PyThreadState.cframe` → `_PyCFrame.current_frame` → `_PyInterpreterFrame`,
    /// linked by `previous`, with `prev_instr` pointing into the code object's bytecode.
    CFrame,
    /// 3.13: `PyThreadState.current_frame` → `_PyInterpreterFrame`, with `instr_ptr`.
    CurrentFrame,
}

/// The offsets the walker needs, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Major and minor version.
    pub version: (u32, u32),
    /// The shape of the frame chain.
    pub kind: FrameKind,
    /// `PyThreadState` → the frame pointer (3.10, 3.13) or the `_PyCFrame` pointer (3.11–3.12).
    pub tstate_frame: usize,
    /// `_PyCFrame.current_frame` (3.11–3.12 only).
    pub cframe_current_frame: usize,
    /// The frame's code object (`f_code`, `f_executable` in 3.13).
    pub frame_code: usize,
    /// The next-outer frame (`f_back`, `previous`).
    pub frame_previous: usize,
    /// The instruction: `f_lasti` (`int`, 3.10), `prev_instr` (3.11–3.12), `instr_ptr` (3.13).
    pub frame_instr: usize,
    /// `_PyInterpreterFrame.owner` (a `char`; 3.11+).
    pub frame_owner: usize,
    /// `co_filename`.
    pub code_filename: usize,
    /// `co_qualname` (3.11+) or `co_name` (3.10, which has no qualified name).
    pub code_name: usize,
    /// `co_firstlineno` (`int`).
    pub code_firstlineno: usize,
    /// `co_linetable` (a `bytes` object).
    pub code_linetable: usize,
    /// `co_code_adaptive`, where the bytecode starts (3.11+).
    pub code_bytecode: usize,
    /// `_co_firsttraceable` (`int`; 3.11+): frames before it have not started yet.
    pub code_firsttraceable: usize,
    /// `sizeof(PyASCIIObject)`: where a compact ASCII string's characters start.
    pub ascii_size: usize,
    /// `sizeof(PyCompactUnicodeObject)`: where other compact strings' characters start.
    pub compact_size: usize,
}

/// `PyObject.ob_type`.
pub const OBJECT_TYPE: usize = 8;
/// `PyVarObject.ob_size` (a `bytes` object's length).
pub const VAR_SIZE: usize = 16;
/// `PyBytesObject.ob_sval`.
pub const BYTES_DATA: usize = 32;
/// `PyASCIIObject.length` (in code points).
pub const STRING_LENGTH: usize = 16;
/// `PyASCIIObject.state`: `interned:2, kind:3, compact:1, ascii:1, …` in every version here.
pub const STRING_STATE: usize = 32;
/// `_PyInterpreterFrame.owner` of a frame owned by a generator (never "not started yet").
pub const OWNED_BY_GENERATOR: u8 = 1;
/// `_PyInterpreterFrame.owner` of the C-stack entry frames of 3.12+ (not Python code).
pub const OWNED_BY_CSTACK: u8 = 3;
/// Size of a bytecode unit (`_Py_CODEUNIT`).
pub const CODE_UNIT: usize = 2;

/// The layout of CPython `major.minor`, if supported. A `const fn`, so that the walker's loop
/// can be compiled once a version, with the offsets as constants.
pub const fn for_version(major: u32, minor: u32) -> Option<Layout> {
    if major != 3 {
        return None;
    }
    let layout = match minor {
        10 => Layout {
            version: (3, 10),
            kind: FrameKind::FrameObject,
            tstate_frame: 24,
            cframe_current_frame: 0,
            frame_code: 32,
            frame_previous: 24,
            frame_instr: 96,
            frame_owner: 0,
            code_filename: 104,
            code_name: 112,
            code_firstlineno: 40,
            code_linetable: 120,
            code_bytecode: 0,
            code_firsttraceable: 0,
            ascii_size: 48,
            compact_size: 72,
        },
        11 => Layout {
            version: (3, 11),
            kind: FrameKind::CFrame,
            tstate_frame: 56,
            cframe_current_frame: 8,
            frame_code: 32,
            frame_previous: 48,
            frame_instr: 56,
            frame_owner: 69,
            code_filename: 112,
            code_name: 128,
            code_firstlineno: 72,
            code_linetable: 136,
            code_bytecode: 184,
            code_firsttraceable: 168,
            ascii_size: 48,
            compact_size: 72,
        },
        12 => V3_12,
        // 3.13 moved the current frame into the thread state and grew the code object.
        13 => Layout {
            version: (3, 13),
            kind: FrameKind::CurrentFrame,
            tstate_frame: 72,
            code_bytecode: 200,
            code_firsttraceable: 184,
            ..V3_12
        },
        _ => return None,
    };
    Some(layout)
}

/// CPython 3.12's layout (3.13 starts from it).
const V3_12: Layout = Layout {
    version: (3, 12),
    kind: FrameKind::CFrame,
    tstate_frame: 56,
    cframe_current_frame: 0,
    frame_code: 0,
    frame_previous: 8,
    frame_instr: 56,
    frame_owner: 70,
    code_filename: 112,
    code_name: 128,
    code_firstlineno: 68,
    code_linetable: 136,
    code_bytecode: 192,
    code_firsttraceable: 176,
    ascii_size: 40,
    compact_size: 56,
};

impl Layout {
    /// The table as `name offset` lines, in the format `offsets.c` (beside this file) prints,
    /// so the test can compare the two.
    pub fn describe(&self) -> String {
        let mut lines = vec![];
        let mut put = |name: &str, value: usize| lines.push(format!("{name} {value}"));
        match self.kind {
            FrameKind::FrameObject => put("tstate_frame", self.tstate_frame),
            FrameKind::CFrame => {
                put("tstate_cframe", self.tstate_frame);
                put("cframe_current_frame", self.cframe_current_frame);
            }
            FrameKind::CurrentFrame => put("tstate_current_frame", self.tstate_frame),
        }
        put("frame_code", self.frame_code);
        put("frame_previous", self.frame_previous);
        put("frame_instr", self.frame_instr);
        if self.kind != FrameKind::FrameObject {
            put("frame_owner", self.frame_owner);
            put("code_bytecode", self.code_bytecode);
            put("code_firsttraceable", self.code_firsttraceable);
        }
        put("code_filename", self.code_filename);
        put("code_name", self.code_name);
        put("code_firstlineno", self.code_firstlineno);
        put("code_linetable", self.code_linetable);
        put("object_type", OBJECT_TYPE);
        put("var_size", VAR_SIZE);
        put("bytes_data", BYTES_DATA);
        put("string_length", STRING_LENGTH);
        put("string_state", STRING_STATE);
        put("ascii_size", self.ascii_size);
        put("compact_size", self.compact_size);
        if self.kind != FrameKind::FrameObject {
            put("owned_by_generator", OWNED_BY_GENERATOR.into());
        }
        if self.version >= (3, 12) {
            put("owned_by_cstack", OWNED_BY_CSTACK.into());
        }
        put("code_unit", CODE_UNIT);
        lines.join("\n") + "\n"
    }
}
