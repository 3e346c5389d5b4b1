// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The lock of a registration's lifecycle: a kernel `spinlock_t`, taken with
//! one call into the kernel instead of two.
//!
//! `kernel::sync::SpinLock` locks through the Rust helper `spin_lock`, an
//! out-of-line C function (on kernels whose C is built with GCC it cannot
//! be inlined into Rust) that calls `_raw_spin_lock`; unlocking is the same.
//! A registration takes its lock five to eight times, so this backend calls
//! `_raw_spin_lock`/`_raw_spin_unlock` (what `spin_lock()` expands to outside
//! PREEMPT_RT) directly. It is the same lock: initialized by the kernel's
//! `__spin_lock_init` with a static lock class wherever spinlock debugging
//! or lockdep is built (elsewhere that function only stores the unlocked
//! value, which `init` stores itself), so lockdep, the spinlock debugging
//! and KCSAN see every acquisition as they would through `SpinLock`. The
//! lockdep assertion made on every acquisition is a call only where lockdep
//! is built in. On PREEMPT_RT, where a `spinlock_t` is a sleeping lock, it
//! falls back to the helpers.

use kernel::{
    bindings,
    sync::lock::{
        Backend,
        Lock, //
    },
};

/// A lock with [`RegLockBackend`].
pub(crate) type RegLock<T> = Lock<T, RegLockBackend>;

/// A `spinlock_t` locked by `_raw_spin_lock` (see the module).
pub(crate) struct RegLockBackend;

#[cfg(not(CONFIG_PREEMPT_RT))]
fn raw(ptr: *mut bindings::spinlock_t) -> *mut bindings::raw_spinlock_t {
    // Outside PREEMPT_RT a `spinlock_t` is a union whose member `rlock`, a
    // `raw_spinlock_t`, sits at offset 0 (include/linux/spinlock_types.h).
    ptr.cast()
}

// SAFETY: `lock` makes the caller the owner of the kernel spinlock until
// `unlock`, as `spin_lock`/`spin_unlock` do (they expand to these very calls
// outside PREEMPT_RT); the state is initialized by `__spin_lock_init` before
// any use (the `Lock` type guarantees `init` runs first).
unsafe impl Backend for RegLockBackend {
    type State = bindings::spinlock_t;
    type GuardState = ();

    #[inline]
    unsafe fn init(
        ptr: *mut Self::State,
        name: *const kernel::ffi::c_char,
        key: *mut bindings::lock_class_key,
    ) {
        // Without spinlock debugging and lockdep, `spin_lock_init` only
        // stores `__SPIN_LOCK_UNLOCKED`, whose one field is the architecture's
        // unlocked value, 0 for the queued spinlock of x86 and arm64
        // (spinlock_types.h, qspinlock_types.h): stored here, without the
        // helper's call (every registration initializes its lock).
        const PLAIN: bool = cfg!(all(
            not(any(
                CONFIG_DEBUG_SPINLOCK,
                CONFIG_LOCKDEP,
                CONFIG_PREEMPT_RT
            )),
            any(target_arch = "x86_64", target_arch = "aarch64")
        ));
        if PLAIN {
            // SAFETY: `ptr` is valid for writes (the trait's contract); an
            // all-zero `spinlock_t` is the unlocked lock in this
            // configuration (above).
            unsafe { ptr.write(core::mem::zeroed()) }
        } else {
            // SAFETY: `ptr` is valid for writes, `name` and `key` for reads
            // indefinitely (the trait's contract).
            unsafe { bindings::__spin_lock_init(ptr, name, key) }
        }
    }

    #[inline]
    unsafe fn lock(ptr: *mut Self::State) -> Self::GuardState {
        #[cfg(not(CONFIG_PREEMPT_RT))]
        // SAFETY: an initialized lock (the trait's contract); `raw` gives
        // its `raw_spinlock_t`.
        unsafe {
            bindings::_raw_spin_lock(raw(ptr))
        };
        #[cfg(CONFIG_PREEMPT_RT)]
        // SAFETY: an initialized lock (the trait's contract).
        unsafe {
            bindings::spin_lock(ptr)
        };
    }

    #[inline]
    unsafe fn unlock(ptr: *mut Self::State, _guard_state: &Self::GuardState) {
        #[cfg(not(CONFIG_PREEMPT_RT))]
        // SAFETY: the caller owns the lock (the trait's contract).
        unsafe {
            bindings::_raw_spin_unlock(raw(ptr))
        };
        #[cfg(CONFIG_PREEMPT_RT)]
        // SAFETY: the caller owns the lock (the trait's contract).
        unsafe {
            bindings::spin_unlock(ptr)
        };
    }

    unsafe fn try_lock(ptr: *mut Self::State) -> Option<Self::GuardState> {
        // SAFETY: an initialized lock (the trait's contract).
        (unsafe { bindings::spin_trylock(ptr) } != 0).then_some(())
    }

    /// Called on every acquisition (`Guard::new`): a lockdep check, so a
    /// call only where lockdep is built in (elsewhere `lockdep_assert_held`
    /// is empty).
    #[inline]
    unsafe fn assert_is_held(_ptr: *mut Self::State) {
        #[cfg(CONFIG_LOCKDEP)]
        // SAFETY: an initialized lock (the trait's contract).
        unsafe {
            bindings::spin_assert_is_held(_ptr)
        };
    }
}
