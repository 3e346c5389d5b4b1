// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The entry points of the peer-memory core and of the GPU driver, bound at
//! run time (`binding`) instead of linked at load: the module references
//! none of their symbols, so it loads without them and the loader checks no
//! CRC of theirs. Each table is written once, while nothing can call
//! through it yet (no client is registered), then published; callers go
//! through one load of the published flag and an indirect call.

use core::{
    cell::UnsafeCell,
    ptr::NonNull, //
};

use kernel::{
    bindings,
    ffi::c_char,
    prelude::*, //
};

use kernel::sync::atomic::{
    Acquire,
    Atomic,
    Release, //
};

use crate::ffi;

/// The GPU driver's p2p entry points (`nvidia_p2p_*`).
pub(crate) static P2P: Api<ffi::peermem_p2p_api> = Api::new();
/// The peer-memory core's entry points (`ib_(un)register_peer_memory_client`).
pub(crate) static CORE: Api<ffi::peermem_core_api> = Api::new();

/// A table of entry points, published once bound.
///
/// # Invariants
///
/// `table` is written only by [`Api::publish`], while `bound` is false and
/// under the binding lock; it is read only after `bound` was seen true with
/// acquire ordering, by calls that run only while a client is registered or
/// a registration lives (so never across [`Api::retract`], which a
/// completed drain calls when neither is true).
pub(crate) struct Api<T> {
    bound: Atomic<u32>,
    table: UnsafeCell<Option<T>>,
}

// SAFETY: see the type invariants: the one write happens-before every read.
unsafe impl<T: Sync> Sync for Api<T> {}

impl<T: Copy> Api<T> {
    const fn new() -> Self {
        Self {
            bound: Atomic::new(0),
            table: UnsafeCell::new(None),
        }
    }

    /// The table, once bound.
    #[inline]
    pub(crate) fn get(&self) -> Option<&T> {
        if self.bound.load(Acquire) == 0 {
            return None;
        }
        // SAFETY: published (type invariants): written before, never again.
        unsafe { (*self.table.get()).as_ref() }
    }

    /// Writes and publishes `table`.
    ///
    /// # Safety
    ///
    /// Called under the binding lock, while unpublished, before anything may
    /// call through the table: the module holds a reference to the module
    /// that exports every entry point in it until it retracts the table or
    /// exits.
    pub(crate) unsafe fn publish(&self, table: T) {
        // SAFETY: not yet published, and the binding lock is held (caller):
        // nobody reads or writes the table now.
        unsafe { *self.table.get() = Some(table) };
        self.bound.store(1, Release);
    }

    /// Unpublishes the table (a completed drain lets go of its module, once
    /// no client is registered and no registration lives): calls through it
    /// fail with `ENODEV` until it is published again.
    pub(crate) fn retract(&self) {
        self.bound.store(0, Release);
    }
}

/// A reference to a live module that exports entry points: the module
/// cannot be unloaded while it is held.
///
/// # Invariants
///
/// `module` is a module this value holds one reference to (`try_module_get`).
pub(crate) struct ModuleRef {
    module: NonNull<bindings::module>,
}

// SAFETY: a module reference may be dropped from any thread.
unsafe impl Send for ModuleRef {}

impl ModuleRef {
    /// Takes a reference to `module`, if it is not going away.
    ///
    /// # Safety
    ///
    /// `module` must be valid for the call (the module notifier's argument,
    /// or a module the caller holds a reference to).
    pub(crate) unsafe fn get(module: NonNull<bindings::module>) -> Option<Self> {
        // SAFETY: valid for the call (caller).
        // INVARIANT: the reference is held on success.
        unsafe { bindings::try_module_get(module.as_ptr()) }.then_some(Self { module })
    }

    /// Takes over the reference that [`ffi::peermem_exporter`] returned for
    /// the module exporting `name`, if one does.
    pub(crate) fn exporter(name: &CStr) -> Option<Self> {
        // SAFETY: `name` is NUL-terminated; the shim returns NULL or a module
        // with a reference for the caller.
        let module = unsafe { ffi::peermem_exporter(name.as_char_ptr()) };
        // INVARIANT: the reference is handed over.
        NonNull::new(module).map(|module| Self { module })
    }

    /// The address the module exports as `name`, or NULL.
    pub(crate) fn export(&self, name: &CStr) -> *mut kernel::ffi::c_void {
        // SAFETY: the module stays while referenced (type invariants).
        unsafe { ffi::peermem_module_export(self.module.as_ptr(), name.as_char_ptr()) }
    }

    /// The module's name.
    pub(crate) fn name(&self) -> &CStr {
        // SAFETY: the module stays while referenced; its name is a
        // NUL-terminated array that never changes.
        unsafe { CStr::from_char_ptr((*self.module.as_ptr()).name.as_ptr()) }
    }

    /// The module's `version=` (modinfo), if it has one.
    pub(crate) fn version(&self) -> Option<&CStr> {
        // SAFETY: the module stays while referenced; `version` is NULL or a
        // NUL-terminated string the loader set before the module went live,
        // freed with it.
        unsafe {
            let v: *const c_char = (*self.module.as_ptr()).version;
            (!v.is_null()).then(|| CStr::from_char_ptr(v))
        }
    }
}

impl Clone for ModuleRef {
    fn clone(&self) -> Self {
        // SAFETY: the module stays while referenced (type invariants), so
        // another reference may be taken unconditionally.
        unsafe { bindings::__module_get(self.module.as_ptr()) };
        // INVARIANT: the reference was taken above.
        Self {
            module: self.module,
        }
    }
}

impl Drop for ModuleRef {
    fn drop(&mut self) {
        // SAFETY: the reference taken in `get` or handed over (invariants).
        unsafe { bindings::module_put(self.module.as_ptr()) };
    }
}
