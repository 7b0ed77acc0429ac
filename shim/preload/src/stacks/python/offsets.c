/* Prints the CPython internals the frame walker reads, as `name offset` lines in the order and
 * format of `Layout::describe()` (layout.rs). Compiled against each installed CPython by the
 * test `python_layouts_match_headers`; not part of the library. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#if PY_VERSION_HEX < 0x030b0000
#include <frameobject.h>
#else
#include "internal/pycore_code.h"
#include "internal/pycore_frame.h"
#endif

#define P(name, value) printf("%s %zu\n", name, (size_t)(value))

int main(void) {
#if PY_VERSION_HEX < 0x030b0000
    P("tstate_frame", offsetof(PyThreadState, frame));
    P("frame_code", offsetof(PyFrameObject, f_code));
    P("frame_previous", offsetof(PyFrameObject, f_back));
    P("frame_instr", offsetof(PyFrameObject, f_lasti));
#else
#if PY_VERSION_HEX < 0x030d0000
    P("tstate_cframe", offsetof(PyThreadState, cframe));
    P("cframe_current_frame", offsetof(_PyCFrame, current_frame));
    P("frame_code", offsetof(_PyInterpreterFrame, f_code));
    P("frame_previous", offsetof(_PyInterpreterFrame, previous));
    P("frame_instr", offsetof(_PyInterpreterFrame, prev_instr));
#else
    P("tstate_current_frame", offsetof(PyThreadState, current_frame));
    P("frame_code", offsetof(_PyInterpreterFrame, f_executable));
    P("frame_previous", offsetof(_PyInterpreterFrame, previous));
    P("frame_instr", offsetof(_PyInterpreterFrame, instr_ptr));
#endif
    P("frame_owner", offsetof(_PyInterpreterFrame, owner));
    P("code_bytecode", offsetof(PyCodeObject, co_code_adaptive));
    P("code_firsttraceable", offsetof(PyCodeObject, _co_firsttraceable));
#endif
    P("code_filename", offsetof(PyCodeObject, co_filename));
#if PY_VERSION_HEX < 0x030b0000
    P("code_name", offsetof(PyCodeObject, co_name));
#else
    P("code_name", offsetof(PyCodeObject, co_qualname));
#endif
    P("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
    P("code_linetable", offsetof(PyCodeObject, co_linetable));
    P("object_type", offsetof(PyObject, ob_type));
    P("var_size", offsetof(PyVarObject, ob_size));
    P("bytes_data", offsetof(PyBytesObject, ob_sval));
    P("string_length", offsetof(PyASCIIObject, length));
    P("string_state", offsetof(PyASCIIObject, state));
    P("ascii_size", sizeof(PyASCIIObject));
    P("compact_size", sizeof(PyCompactUnicodeObject));
#if PY_VERSION_HEX >= 0x030b0000
    P("owned_by_generator", FRAME_OWNED_BY_GENERATOR);
#endif
#if PY_VERSION_HEX >= 0x030c0000
    P("owned_by_cstack", FRAME_OWNED_BY_CSTACK);
#endif
    P("code_unit", sizeof(_Py_CODEUNIT));
    return 0;
}
