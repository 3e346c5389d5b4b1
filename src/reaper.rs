// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Where the GPU driver's free callback leaves its reference on a
//! registration: a queue of this module's, drained at exit.
//!
//! The callback's reference can be a registration's last one (after a release
//! in another process, or a failed unpin, only the callback is left). Its drop
//! then drops the registration's module reference; done by the callback
//! itself, a concurrent `rmmod` could unload the module while the callback
//! still runs module code. So the callback queues the drop to work of this
//! module's queue instead, and the module's exit drains that queue after the
//! clients are unregistered: the work (which holds the module reference until
//! it drops it) has returned before the module's memory goes.

use core::ptr;

use crate::atomics::{
    Acquire,
    Atomic,
    Release, //
};

use kernel::{
    bindings,
    prelude::*,
    sync::Arc,
    workqueue::Queue, //
};

use crate::{
    ffi,
    p2p::Reaper,
    registration::Registration, //
};

/// The queue, published while the module is loaded.
static QUEUE: Atomic<*mut bindings::workqueue_struct> = Atomic::new(ptr::null_mut());

/// The module's queue; destroying it drains it.
///
/// # Invariants
///
/// `QUEUE` holds the queue from `new` until `drop`, which destroys it.
pub(crate) struct ReapQueue(());

impl ReapQueue {
    /// Allocates and publishes the queue.
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: no preconditions.
        let wq = unsafe { ffi::peermem_wq_alloc() };
        if wq.is_null() {
            return Err(ENOMEM);
        }
        QUEUE.store(wq, Release);
        // INVARIANT: published above.
        Ok(Self(()))
    }
}

impl Drop for ReapQueue {
    fn drop(&mut self) {
        let wq = QUEUE.xchg(ptr::null_mut(), Acquire);
        if !wq.is_null() {
            // SAFETY: allocated in `new`, destroyed once; no one queues any
            // more (every registration is gone: the clients are unregistered
            // and no reference is left, or the module could not be unloading).
            unsafe { ffi::peermem_wq_destroy(wq) };
        }
    }
}

/// Drops registrations on the module's queue.
pub(crate) struct Deferred;

impl Reaper<Registration> for Deferred {
    fn reap(owner: Arc<Registration>) {
        let wq = QUEUE.load(Acquire);
        if wq.is_null() {
            // Unreachable while the registration holds a module reference.
            drop(owner);
            return;
        }
        // SAFETY: the queue lives until `ReapQueue` is dropped, which happens
        // only after the module reference that `owner` holds is gone.
        let queue = unsafe { Queue::from_raw(wq) };
        if let Err(owner) = queue.enqueue(owner) {
            // Already queued: impossible (a callback runs once per pin), but
            // never lose the reference.
            drop(owner);
        }
    }
}
