//! Thread-locals that the allocation path reads without a call into the loader.
//!
//! *Note [Thread-locals in static TLS]*: a shared library's thread-locals use the
//! general-dynamic model: each access calls `__tls_get_addr`, which finds the library's block
//! through the thread's vector of modules. In a training step that path is cold: `perf` on the
//! H200 put ~0.1 ms of the Llama's step in the loader's `__tls_get_addr` for the trace's two
//! thread-locals (BENCHMARKS.md, sixteenth session), and `scripts/bench-cold-lines` counts its
//! lines (the call's code, the thread's control block, the vector, the block). Rust chooses the
//! model for the whole crate and stable Rust cannot ask for another, so the few thread-locals an
//! allocation reads are declared here, by `static_thread_local!`, in the *initial-exec* model
//! a C library would ask for with `__attribute__((tls_model("initial-exec")))`: the variable
//! lives in the thread's static TLS block, at an offset from the thread pointer that the loader
//! writes once into the library's GOT. An access reads the GOT's entry, the thread pointer
//! (`fs:0`, on the line every thread-local access of the process reads) and the variable, and
//! makes no call. Measured: 94.7 → 90.9 cache lines a traced call (`scripts/bench-cold-lines`);
//! on the H200, inside the noise of the trace's in-process ratio (BENCHMARKS.md, seventeenth
//! session).
//!
//! What that costs: the library is marked `STATIC_TLS`, so the loader must place its whole TLS
//! segment (a few hundred bytes) in the static block of every thread. Preloaded, it always can;
//! `dlopen`ed into a running process it takes from the loader's small reserve for such
//! libraries, which glibc keeps for exactly this (a library loaded that way is not how
//! cachealloc is used, and there the reserve suffices for its segment).
//!
//! A static thread-local starts as all-zero bytes in every thread (the loader zeroes `.tbss`)
//! and is never dropped: its type says so by implementing [`ZeroInit`]. Where something needs
//! dropping at thread exit, the static thread-local holds a pointer to it, and an ordinary
//! thread-local owns it, an [`ExitOwner`] (`stacks`' buffers, the trace's stages). On other architectures the macro declares an
//! ordinary thread-local with the same interface.

/// A type whose all-zero bytes are a valid value, the one a thread starts with, and which needs
/// no drop.
///
/// # Safety
/// All-zero bytes must be a valid value of the type and equal to [`ZeroInit::ZERO`], and the
/// type must not need dropping (checked when a static thread-local is declared).
pub unsafe trait ZeroInit: Sized {
    /// The value a thread starts with: all-zero bytes.
    const ZERO: Self;
}

/// Declares `static NAME: StaticThreadLocal<…>` of a [`ZeroInit`] type, read with `NAME.with`.
/// `symbol` names the variable in the library's symbol table (hidden: seen by the library's own
/// object files only; unique).
///
/// ```ignore
/// static_thread_local! {
///     /// What it is.
///     static COUNT: Cell<u32>, symbol "cachealloc_tls_count";
/// }
/// let n = COUNT.with(|c| c.get());
/// ```
macro_rules! static_thread_local {
    ($(#[$attr:meta])* $vis:vis static $name:ident: $ty:ty, symbol $symbol:literal;) => {
        #[cfg(target_arch = "x86_64")]
        std::arch::global_asm!(
            ".pushsection .tbss,\"awT\",@nobits",
            ".p2align {align}",
            // Global, for the codegen units that read it, and hidden: not exported.
            concat!(".globl ", $symbol),
            concat!(".hidden ", $symbol),
            concat!(".type ", $symbol, ",@object"),
            concat!(".size ", $symbol, ",{size}"),
            concat!($symbol, ":"),
            ".zero {size}",
            ".popsection",
            size = const std::mem::size_of::<$ty>(),
            align = const std::mem::align_of::<$ty>().trailing_zeros(),
        );

        $(#[$attr])*
        $vis static $name: $crate::ffi::static_tls::StaticThreadLocal<$ty> = {
            const _: () = assert!(
                !std::mem::needs_drop::<$ty>(),
                "a static thread-local is never dropped"
            );
            #[cfg(target_arch = "x86_64")]
            let address = || {
                let address: *const $ty;
                // SAFETY: the GOT entry holds the variable's offset from the thread pointer
                // (initial-exec model, written by the loader at load time), and `fs:0` holds
                // the thread pointer itself (the x86-64 TLS ABI); the sum is the calling
                // thread's instance of the `.tbss` variable declared above.
                unsafe {
                    std::arch::asm!(
                        concat!("mov {a}, qword ptr [rip + ", $symbol, "@GOTTPOFF]"),
                        "add {a}, qword ptr fs:[0]",
                        a = out(reg) address,
                        options(nostack, readonly, pure),
                    );
                }
                address
            };
            #[cfg(not(target_arch = "x86_64"))]
            let address = || {
                std::thread_local! {
                    static VALUE: $ty = const { <$ty as $crate::ffi::static_tls::ZeroInit>::ZERO };
                }
                VALUE.with(|v| v as *const $ty)
            };
            // SAFETY: `address` gives the calling thread's instance of a zero-initialized
            // variable of `$ty` (x86-64: in its static TLS block; elsewhere an ordinary
            // thread-local), and `ZeroInit` says all-zero bytes are a valid value.
            unsafe { $crate::ffi::static_tls::StaticThreadLocal::new(address) }
        };
    };
}
pub(crate) use static_thread_local;

/// A thread-local declared by `static_thread_local!`.
pub struct StaticThreadLocal<T: ZeroInit + 'static> {
    address: fn() -> *const T,
}

impl<T: ZeroInit + 'static> StaticThreadLocal<T> {
    /// # Safety
    /// `address` must return the calling thread's own instance of a `T`, valid for as long as
    /// the thread runs.
    #[doc(hidden)]
    pub const unsafe fn new(address: fn() -> *const T) -> StaticThreadLocal<T> {
        StaticThreadLocal { address }
    }

    /// `f` of the calling thread's value. Never fails: the value lives in the thread's static
    /// block, which outlives every thread-local destructor.
    #[inline(always)]
    pub fn with<R>(&'static self, f: impl FnOnce(&T) -> R) -> R {
        // SAFETY: `new`'s contract: the calling thread's instance, valid while it runs; the
        // reference does not leave `f`, which runs on this thread.
        f(unsafe { &*(self.address)() })
    }
}

// SAFETY: all-zero bytes are 0, the initial value; a `Cell<u32>` needs no drop.
unsafe impl ZeroInit for std::cell::Cell<u32> {
    const ZERO: Self = std::cell::Cell::new(0);
}

// SAFETY: all-zero bytes are the null pointer, the initial value; a pointer needs no drop.
unsafe impl<T> ZeroInit for std::cell::Cell<*mut T> {
    const ZERO: Self = std::cell::Cell::new(std::ptr::null_mut());
}

/// Owns a box for its thread, reached through a pointer in a static thread-local, and drops it
/// at the thread's exit after `forget` has set that pointer to say it is gone. Declared in an
/// ordinary `thread_local!` (which runs the drop); [`ExitOwner::own`] hands it the box.
pub struct ExitOwner<T> {
    owned: std::cell::Cell<*mut T>,
    forget: fn(),
}

impl<T> ExitOwner<T> {
    /// An owner of nothing yet; `forget` marks the static thread-local's pointer as gone.
    pub const fn new(forget: fn()) -> ExitOwner<T> {
        ExitOwner {
            owned: std::cell::Cell::new(std::ptr::null_mut()),
            forget,
        }
    }

    /// Take `value` (the owner owns nothing yet: a thread's first use); returns where it is,
    /// valid on this thread until its exit calls `forget`.
    pub fn own(&self, value: T) -> *mut T {
        debug_assert!(self.owned.get().is_null(), "owned once a thread");
        let owned = Box::into_raw(Box::new(value));
        self.owned.set(owned);
        owned
    }
}

impl<T> Drop for ExitOwner<T> {
    fn drop(&mut self) {
        (self.forget)();
        let owned = self.owned.replace(std::ptr::null_mut());
        if !owned.is_null() {
            // SAFETY: `owned` came from `Box::into_raw` in `own`, and nothing reaches it any
            // more: `forget` has marked the thread's pointer to it as gone.
            drop(unsafe { Box::from_raw(owned) });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::ExitOwner;

    static_thread_local! {
        static COUNT: Cell<u32>, symbol "cachealloc_tls_test_count";
    }
    static_thread_local! {
        static POINTER: Cell<*mut u64>, symbol "cachealloc_tls_test_pointer";
    }

    #[test]
    fn each_thread_starts_at_zero_and_keeps_its_own_value() {
        let bump = || {
            for _ in 0..5 {
                COUNT.with(|c| c.set(c.get() + 1));
            }
            COUNT.with(Cell::get)
        };
        assert_eq!(bump(), 5);
        let others: Vec<u32> = (0..3)
            .map(|_| std::thread::spawn(bump))
            .map(|t| t.join().unwrap())
            .collect();
        assert_eq!(others, [5, 5, 5]);
        assert_eq!(
            COUNT.with(Cell::get),
            5,
            "other threads left this one's alone"
        );
        assert!(POINTER.with(Cell::get).is_null());
    }

    #[test]
    fn two_variables_are_two_places() {
        let a = COUNT.with(|c| c as *const Cell<u32> as usize);
        let b = POINTER.with(|p| p as *const Cell<*mut u64> as usize);
        assert_ne!(a, b);
        let elsewhere = std::thread::spawn(|| COUNT.with(|c| c as *const Cell<u32> as usize))
            .join()
            .unwrap();
        assert_ne!(a, elsewhere);
    }

    /// An owner's thread exit marks the pointer gone, then drops what it owns, once.
    #[test]
    fn an_exit_owner_forgets_then_drops_at_the_threads_exit() {
        use std::sync::Mutex;
        static EVENTS: Mutex<Vec<&str>> = Mutex::new(Vec::new());
        struct Owned;
        impl Drop for Owned {
            fn drop(&mut self) {
                EVENTS.lock().unwrap().push("dropped");
            }
        }
        std::thread_local! {
            static OWNER: ExitOwner<Owned> =
                const { ExitOwner::new(|| EVENTS.lock().unwrap().push("forgotten")) };
        }
        std::thread::spawn(|| {
            let owned = OWNER.with(|o| o.own(Owned));
            assert!(!owned.is_null());
            EVENTS.lock().unwrap().push("used");
        })
        .join()
        .unwrap();
        assert_eq!(*EVENTS.lock().unwrap(), ["used", "forgotten", "dropped"]);
    }
}
