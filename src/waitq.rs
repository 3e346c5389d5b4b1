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
/// `QUEUE` points to the queue this value owns from `new` until `drop`,
/// which unpublishes it before it is freed.
pub(crate) struct WaitQueue {
    _queue: Pin<KBox<CondVar>>,
}

impl WaitQueue {
    /// Allocates and publishes the queue.
    pub(crate) fn new() -> Result<Self> {
        let cv = KBox::pin_init(new_condvar!("peermem::core_left"), GFP_KERNEL)?;
        QUEUE.store(ptr::from_ref(&*cv).cast_mut(), Release);
        // INVARIANT: published above; the box never moves its contents.
        Ok(Self { _queue: cv })
    }
}

impl Drop for WaitQueue {
    fn drop(&mut self) {
        // Freed once this returns. No registration is left (each holds a
        // module reference, and the module is unloading), so nobody waits on
        // it or wakes it any more.
        QUEUE.store(ptr::null_mut(), Release);
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
