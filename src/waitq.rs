// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The module's one wait queue, for the rare waits of a registration: a
//! `release` waiting for a free callback to leave the core, and a free
//! callback waiting for a `dma_map` to stop reading the page table.
//!
//! One queue for the module instead of one per registration: the waits only
//! happen when a free callback races the core, so every registration would
//! otherwise carry (and initialize) a wait queue it almost never uses. A
//! waker wakes every waiter of the module; each checks its own condition
//! under its registration's lock and sleeps again if it is not met.

use core::ptr;

use kernel::sync::atomic::{
    Acquire,
    Atomic,
    Release, //
};

use kernel::{
    new_condvar,
    prelude::*,
    sync::CondVar, //
};

/// The queue, published from `WaitQueue::new` until its drop.
static QUEUE: Atomic<*mut CondVar> = Atomic::new(ptr::null_mut());

/// Owns the module's wait queue.
///
/// # Invariants
///
/// `QUEUE` points to a pinned, initialized `CondVar` allocated by `new`,
/// from `new` until `drop`, which frees it.
pub(crate) struct WaitQueue(());

impl WaitQueue {
    /// Allocates and publishes the queue.
    pub(crate) fn new() -> Result<Self> {
        let cv = KBox::pin_init(new_condvar!("peermem::core_left"), GFP_KERNEL)?;
        // SAFETY: the box is never moved out of: it is turned back into a
        // pinned box only in `drop`.
        let raw = KBox::into_raw(unsafe { Pin::into_inner_unchecked(cv) });
        QUEUE.store(raw, Release);
        // INVARIANT: published above.
        Ok(Self(()))
    }
}

impl Drop for WaitQueue {
    fn drop(&mut self) {
        let raw = QUEUE.xchg(ptr::null_mut(), Acquire);
        if !raw.is_null() {
            // SAFETY: allocated by `new` and freed once. No registration is
            // left (each holds a module reference, and the module is
            // unloading), so nobody waits on it or wakes it any more.
            drop(unsafe { KBox::from_raw(raw) });
        }
    }
}

/// The module's queue, while published: a registration is made only then
/// (`Registration::acquire` checks), and the queue is freed only once every
/// registration is gone.
pub(crate) fn queue() -> Option<&'static CondVar> {
    let raw = QUEUE.load(Acquire);
    // SAFETY: published by `WaitQueue::new`, valid until its drop, which
    // happens only after the last registration (the only users) is gone.
    unsafe { raw.cast_const().as_ref() }
}
