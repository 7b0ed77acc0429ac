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
//! dropping at thread exit, the static thread-local lends it ([`Lent`]), and an ordinary
//! thread-local owns it ([`ExitOwner`]): `stacks`' capture buffers. On other architectures the
//! macro declares an ordinary thread-local with the same interface.

use std::cell::Cell;
use std::thread::LocalKey;

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

/// A static thread-local's loan of a value its thread owns: null until the thread's first use,
/// then a box that the thread's [`ExitOwner`] owns and drops at the thread's exit, after marking
/// this pointer gone. While a use has the value the pointer says busy, so a use that interrupts
/// it on the same thread (a signal handler) gets none: the value is lent to one use at a time,
/// mutably. Read with [`StaticThreadLocal::lend`].
pub struct Lent<T>(Cell<*mut T>);

// SAFETY: all-zero bytes are the null pointer, "not made yet", the initial value; a pointer
// needs no drop.
unsafe impl<T> ZeroInit for Lent<T> {
    const ZERO: Self = Lent(Cell::new(std::ptr::null_mut()));
}

/// What a [`Lent`] holds while a use has the value: never a box's address (`T` is not
/// zero-sized).
fn busy<T>() -> *mut T {
    std::ptr::without_provenance_mut(1)
}

/// What a [`Lent`] holds once the thread's exit has dropped the value.
fn gone<T>() -> *mut T {
    std::ptr::without_provenance_mut(2)
}

impl<T: 'static> StaticThreadLocal<Lent<T>> {
    /// `f` of the calling thread's value, made by `make` and given to the thread's `owner` at
    /// its first use; `None` once the thread's exit has dropped it (or is under way), or while
    /// another use on this thread has it.
    #[inline]
    pub fn lend<R>(
        &'static self,
        owner: &'static LocalKey<ExitOwner<T>>,
        make: impl FnOnce() -> T,
        f: impl FnOnce(Option<&mut T>) -> R,
    ) -> R {
        self.with(|lent| {
            let mut value = lent.0.replace(busy());
            if value.is_null() {
                value = first_use(lent, owner, make);
            }
            let result = if value == busy() || value == gone() {
                f(None)
            } else {
                // SAFETY: `value` is this thread's box from `ExitOwner::own` (only `first_use`
                // stores one, and `lent` is this thread's own). Its owner drops it only at the
                // thread's exit, after setting `lent` to gone; while `f` runs `lent` says busy,
                // so no other use on this thread reaches it, and no other thread has it.
                f(Some(unsafe { &mut *value }))
            };
            lent.0.set(value);
            result
        })
    }
}

/// A thread's first use of a [`Lent`]: make its value and give it to the thread's owner; gone
/// if the owner is (the thread is exiting).
#[cold]
#[inline(never)]
fn first_use<T>(
    lent: &Lent<T>,
    owner: &'static LocalKey<ExitOwner<T>>,
    make: impl FnOnce() -> T,
) -> *mut T {
    owner
        .try_with(|owner| owner.own(lent, make()))
        .unwrap_or_else(|_| gone())
}

/// Owns the value a thread's [`Lent`] lends, and drops it at the thread's exit, after marking
/// the `Lent` gone. Declared in an ordinary `thread_local!` (which runs the drop).
pub struct ExitOwner<T> {
    owned: Cell<*mut T>,
    /// The thread's `Lent` in its static TLS block, which outlives its thread-local destructors.
    lent: Cell<*const Lent<T>>,
}

impl<T> ExitOwner<T> {
    /// An owner of nothing yet.
    #[allow(clippy::new_without_default)] // const, for `thread_local!`'s const initializer
    pub const fn new() -> ExitOwner<T> {
        ExitOwner {
            owned: Cell::new(std::ptr::null_mut()),
            lent: Cell::new(std::ptr::null()),
        }
    }

    fn own(&self, lent: &Lent<T>, value: T) -> *mut T {
        const {
            assert!(
                std::mem::size_of::<T>() > 0,
                "busy and gone are not boxes' addresses"
            )
        };
        debug_assert!(self.owned.get().is_null(), "owned once a thread");
        let owned = Box::into_raw(Box::new(value));
        self.owned.set(owned);
        self.lent.set(lent);
        owned
    }
}

impl<T> Drop for ExitOwner<T> {
    fn drop(&mut self) {
        let lent = self.lent.get();
        if !lent.is_null() {
            // SAFETY: `lent` is this thread's `Lent` (`own` is called on the thread whose
            // `Lent` it is), in the thread's static TLS block, which is freed only after the
            // thread's thread-local destructors, this one among them.
            unsafe { &*lent }.0.set(gone());
        }
        let owned = self.owned.replace(std::ptr::null_mut());
        if !owned.is_null() {
            // SAFETY: `owned` came from `Box::into_raw` in `own`, and nothing reaches it any
            // more: the thread's `Lent` says gone.
            drop(unsafe { Box::from_raw(owned) });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::{ExitOwner, Lent};

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

    /// What `a_lent_value_…` lends: it says when it is dropped.
    struct Owned(u32);

    static EVENTS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

    impl Drop for Owned {
        fn drop(&mut self) {
            EVENTS.lock().unwrap().push(format!("dropped {}", self.0));
        }
    }

    static_thread_local! {
        static LENT: Lent<Owned>, symbol "cachealloc_tls_test_lent";
    }

    /// A value is made at its thread's first use, lent to one use at a time, and dropped at
    /// the thread's exit, after which it is gone (a later destructor's use gets none, and no
    /// new value is made).
    #[test]
    fn a_lent_value_is_made_once_lent_once_at_a_time_and_gone_after_exit() {
        let event = |e: String| EVENTS.lock().unwrap().push(e);
        /// Used before `OWNER`, so destroyed after it (destructors run last registered first).
        struct Late;
        impl Drop for Late {
            fn drop(&mut self) {
                let seen = LENT.lend(&OWNER, || Owned(99), |v| v.map(|v| v.0));
                EVENTS.lock().unwrap().push(format!("late {seen:?}"));
            }
        }
        std::thread_local! {
            static OWNER: ExitOwner<Owned> = const { ExitOwner::new() };
            static LATE: Late = const { Late };
        }
        std::thread::spawn(move || {
            LATE.with(|_| ());
            let made = LENT.lend(&OWNER, || Owned(7), |v| v.map(|v| v.0));
            let again = LENT.lend(&OWNER, || Owned(8), |v| v.map(|v| v.0));
            let nested = LENT.lend(
                &OWNER,
                || Owned(9),
                |_| LENT.lend(&OWNER, || Owned(10), |v| v.is_some()),
            );
            event(format!("{made:?} {again:?} nested {nested}"));
        })
        .join()
        .unwrap();
        assert_eq!(
            *EVENTS.lock().unwrap(),
            ["Some(7) Some(7) nested false", "dropped 7", "late None"]
        );
    }
}
