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
    Relaxed,
    Release, //
};

use kernel::{
    bindings,
    prelude::*, //
};

use crate::{ffi, reg_ref::RegRef, registration::Registration};

/// The queue, published while the module is loaded.
static QUEUE: Atomic<*mut bindings::workqueue_struct> = Atomic::new(ptr::null_mut());

/// Registrations whose free callback handed its reference over, each
/// carrying that reference; linked through [`ReapLink`], newest first.
/// Pushed by callbacks, emptied all at once by the module's work.
static REAP_LIST: Atomic<*mut Registration> = Atomic::new(ptr::null_mut());

/// A registration's link on the reap list, a field of the registration:
/// written once, by the free callback that hands its reference over.
pub(crate) struct ReapLink(Atomic<*mut Registration>);

impl ReapLink {
    /// Not on the list.
    pub(crate) const fn new() -> Self {
        Self(Atomic::new(ptr::null_mut()))
    }
}

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
            // Destroying drains the module's work, which empties the list.
            unsafe { ffi::peermem_wq_destroy(wq) };
        }
    }
}

/// Drops `owner` (a free callback's reference) from the module's queue.
pub(crate) fn defer(owner: RegRef) {
    let wq = QUEUE.load(Acquire);
    if wq.is_null() {
        // Unreachable while the registration holds a module reference.
        drop(owner);
        return;
    }
    // The reference is the list's from here on (see `peermem_reap_run`).
    let node = owner.into_raw().cast::<Registration>();
    let mut head = REAP_LIST.load(Relaxed);
    loop {
        // SAFETY: `node` is live (the reference forgotten above is now the
        // list's) and not on the list: a pin's callback runs once, and a
        // registration has one pin.
        unsafe { (*node).reap_link().0.store(head, Relaxed) };
        // Release: the link is written before the node is reachable.
        match REAP_LIST.cmpxchg(head, node, Release) {
            Ok(_) => break,
            Err(now) => head = now,
        }
    }
    // SAFETY: the queue lives until `ReapQueue` is dropped, which happens
    // only after the module reference that the node holds is gone. Queueing
    // work that is pending already is a no-op: the pending run will find the
    // node.
    unsafe { ffi::peermem_reap_kick(wq) };
}

/// The module's reap work: drops every reference on the list.
#[no_mangle]
pub(crate) extern "C" fn peermem_reap_run() {
    // Acquire: the links written before each push are visible.
    let mut node = REAP_LIST.xchg(ptr::null_mut(), Acquire);
    while !node.is_null() {
        // SAFETY: taken off the list above, with its reference; the link was
        // written before the push and is not written again.
        let next = unsafe { (*node).reap_link().0.load(Relaxed) };
        // SAFETY: each node carries one reference (see `defer`), taken back
        // once, here.
        drop(unsafe { RegRef::from_raw(node.cast()) });
        node = next;
    }
}
