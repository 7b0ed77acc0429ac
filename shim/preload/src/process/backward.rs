//! The Python thread in `backward()`: the autograd engine's threads, which have no Python
//! frames of their own, are given its stack (announced by the Python integration).

use super::Shim;

impl Shim {
    /// The calling Python thread enters `backward()` (announced by the Python integration):
    /// until [`Shim::backward_end`], threads without frames of their own — the autograd
    /// engine's — get its stack. Returns the stack it replaces.
    pub fn backward_begin(&self) -> u32 {
        let (Some(stacks), Ok(trace)) = (&self.stacks, &self.trace) else {
            return 0;
        };
        // The innermost Python frame is the integration's wrapper: leave it out.
        let stack = stacks.capture_skipping(trace, 1);
        stacks.set_backward(stack)
    }

    /// The `backward()` announced by [`Shim::backward_begin`] returned: put back `previous`.
    pub fn backward_end(&self, previous: u32) {
        if let Some(stacks) = &self.stacks {
            stacks.set_backward(previous);
        }
    }
}
