// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The drain's registry: every registration object is on a kernel list (the
//! C shim's, under one spinlock) from its `acquire` until it is freed, so that
//! a drain finds the live ones; and the drain's flag, which new
//! registrations check.

use kernel::{
    bindings,
    ffi::c_void,
    prelude::*,
    sync::atomic::{
        Atomic,
        Relaxed, //
    },
    types::Opaque,
};

use super::{
    RegRef,
    Registration, //
};
use crate::ffi;

/// Set while a drain is requested: `acquire` and `get_pages` refuse.
static DRAINING: Atomic<u32> = Atomic::new(0);

/// Whether a drain is requested. A `get_pages` reads it under its
/// registration's lock, which the drain takes after setting it: either the
/// drain finds that registration bound, or the `get_pages` finds the flag.
pub(crate) fn draining() -> bool {
    DRAINING.load(Relaxed) != 0
}

/// Requests a drain, or ends one.
pub(crate) fn set_draining(on: bool) {
    DRAINING.store(u32::from(on), Relaxed);
}

/// `Err(EBUSY)` while a drain is requested. Checked again once a new
/// registration is on the registry: a drain that completes (counts none
/// under the registry's lock) before it was added set its flag before.
pub(crate) fn admit() -> Result {
    if draining() {
        return Err(EBUSY);
    }
    Ok(())
}

/// How many registration objects live.
pub(crate) fn live_count() -> usize {
    ffi::peermem_registry_live() as usize
}

/// Puts a registration just made on the registry.
pub(super) fn add(reg: RegRef) -> RegRef {
    // SAFETY: the link is the object's own, pinned, on no list yet; it
    // leaves the list when the object is dropped (`Registration`'s drop).
    unsafe { ffi::peermem_registry_add(reg.link.get()) };
    reg
}

/// Takes `link` (a registration being dropped) off the registry; completes
/// a drain when it was the last.
pub(super) fn remove(link: &Opaque<bindings::list_head>) {
    // SAFETY: the object is on the list (`add` runs right after its
    // initialisation, and it is dropped once).
    let left = unsafe { ffi::peermem_registry_del(link.get()) };
    if left == 0 && draining() {
        ffi::peermem_drain_kick();
    }
}

/// What a walk collects: references, within the capacity reserved before it
/// (nothing is allocated, or dropped, under the registry's spinlock).
struct Found {
    regs: KVec<RegRef>,
    full: bool,
}

/// The walk's visit of one object on the registry.
///
/// # Safety
///
/// `node` is the link of a registration on the registry, `arg` a `Found`;
/// called under the registry's lock.
unsafe extern "C" fn visit(node: *mut bindings::list_head, arg: *mut c_void) {
    let reg = kernel::container_of!(
        node.cast::<Opaque<bindings::list_head>>(),
        Registration,
        link
    );
    // SAFETY: the walk's (caller): `arg` is its `Found`, borrowed for the
    // walk; `node` is on the list, so its registration is not freed before
    // the lock is released (the free takes it off the list under the lock
    // first).
    let (found, reg) = unsafe { (&mut *arg.cast::<Found>(), &*reg) };
    if found.regs.len() == found.regs.capacity() {
        found.full = true;
        return;
    }
    if let Some(r) = RegRef::get_unless_zero(reg) {
        // Within the capacity (checked above): nothing is dropped here.
        let _ = found.regs.push_within_capacity(r);
    }
}

/// Every live registration, each with a reference of its own.
pub(crate) fn live() -> Result<KVec<RegRef>> {
    loop {
        let mut found = Found {
            regs: KVec::with_capacity(live_count() + 16, GFP_KERNEL)?,
            full: false,
        };
        // SAFETY: `visit` takes a `Found`, which lives for the walk.
        unsafe { ffi::peermem_registry_walk(visit, core::ptr::from_mut(&mut found).cast()) };
        if !found.full {
            return Ok(found.regs);
        }
    }
}
