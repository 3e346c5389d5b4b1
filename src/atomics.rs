// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Inline atomics for this module's own counters, tables and published
//! pointers, with the API of `kernel::sync::atomic` (`load`, `store`, `add`,
//! `fetch_sub`, `cmpxchg`, `xchg`; `Relaxed`, `Acquire`, `Release`).
//!
//! Why not `kernel::sync::atomic` itself: it calls an out-of-line C helper
//! for every operation, even a relaxed load, and on kernels whose C is built
//! with GCC (Debian's) those helpers cannot be inlined into Rust. On the
//! registration path that was a third of the module's instructions (the
//! accounting's table scans, the statistics; measured with `make bench`'s
//! instruction count). The words here are read and written by this module's
//! Rust code only, never by C, so Rust's own atomics order them correctly;
//! they compile to the instructions the kernel's atomics use (plain loads and
//! stores, lock-prefixed read-modify-writes on x86-64, LSE or LL/SC on arm64).

use core::{
    cell::UnsafeCell,
    sync::atomic::{
        AtomicPtr,
        AtomicU32,
        AtomicU64,
        AtomicUsize,
        Ordering, //
    },
};

pub(crate) use core::sync::atomic::{
    fence,
    Ordering::{
        AcqRel,
        Acquire,
        Relaxed,
        Release,
        SeqCst, //
    },
};

/// What a spin loop runs between two reads of the word it waits on (the
/// CPU's pause instruction, as the kernel's `cpu_relax()`).
pub(crate) use core::hint::spin_loop;

/// An atomic `T`.
///
/// # Invariants
///
/// The value is accessed only through the atomic operations below.
#[repr(transparent)]
pub(crate) struct Atomic<T>(UnsafeCell<T>);

// SAFETY: every access is atomic (type invariant); a pointer is only
// published, as by `AtomicPtr`.
unsafe impl<T> Sync for Atomic<*mut T> {}

impl<T> Atomic<T> {
    /// A new atomic holding `v`.
    pub(crate) const fn new(v: T) -> Self {
        Self(UnsafeCell::new(v))
    }
}

macro_rules! integer {
    ($t:ty, $a:ty) => {
        // SAFETY: every access is atomic (type invariant).
        unsafe impl Sync for Atomic<$t> {}

        // Not every width uses every operation.
        #[allow(dead_code)]
        impl Atomic<$t> {
            fn get(&self) -> &$a {
                // SAFETY: the cell is valid and aligned for `$a` (same size
                // and alignment as `$t` on every 64-bit target) for as long
                // as `self`, and only accessed atomically (type invariant).
                unsafe { <$a>::from_ptr(self.0.get()) }
            }

            pub(crate) fn load(&self, o: Ordering) -> $t {
                self.get().load(o)
            }

            pub(crate) fn store(&self, v: $t, o: Ordering) {
                self.get().store(v, o)
            }

            /// Adds `v` (wrapping), returning nothing.
            pub(crate) fn add(&self, v: $t, o: Ordering) {
                self.get().fetch_add(v, o);
            }

            /// Adds `v` (wrapping), returning the old value.
            pub(crate) fn fetch_add(&self, v: $t, o: Ordering) -> $t {
                self.get().fetch_add(v, o)
            }

            /// Subtracts `v` (wrapping), returning the old value.
            pub(crate) fn fetch_sub(&self, v: $t, o: Ordering) -> $t {
                self.get().fetch_sub(v, o)
            }

            /// Replaces `old` by `new`; a failure is relaxed (as the kernel's).
            pub(crate) fn cmpxchg(&self, old: $t, new: $t, o: Ordering) -> Result<$t, $t> {
                self.get().compare_exchange(old, new, o, Relaxed)
            }

            pub(crate) fn xchg(&self, v: $t, o: Ordering) -> $t {
                self.get().swap(v, o)
            }
        }
    };
}

integer!(u32, AtomicU32);
integer!(u64, AtomicU64);
integer!(usize, AtomicUsize);

impl<T> Atomic<*mut T> {
    fn get(&self) -> &AtomicPtr<T> {
        // SAFETY: as for the integers: same size and alignment, atomic
        // accesses only.
        unsafe { AtomicPtr::from_ptr(self.0.get()) }
    }

    pub(crate) fn load(&self, o: Ordering) -> *mut T {
        self.get().load(o)
    }

    pub(crate) fn store(&self, v: *mut T, o: Ordering) {
        self.get().store(v, o)
    }

    pub(crate) fn xchg(&self, v: *mut T, o: Ordering) -> *mut T {
        self.get().swap(v, o)
    }

    pub(crate) fn cmpxchg(&self, old: *mut T, new: *mut T, o: Ordering) -> Result<*mut T, *mut T> {
        self.get().compare_exchange(old, new, o, Relaxed)
    }
}
