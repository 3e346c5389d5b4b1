// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The link back to the peer-memory core: the handle it returned for our
//! invalidating client and the invalidate hook it wrote at registration.

use core::cell::UnsafeCell;

use kernel::sync::atomic::{
    Acquire,
    Atomic,
    Release, //
};

use kernel::ffi::c_void;

use crate::ffi;

/// The invalidate hook of the (one) invalidating client.
pub(crate) static INVALIDATING: CoreLink = CoreLink {
    handle: Atomic::new(0),
    hook: UnsafeCell::new(None),
};

/// The core's invalidate hook for one client.
///
/// # Invariants
///
/// `hook` is written only by the core, inside `ib_register_peer_memory_client`,
/// before the handle is published with release ordering; it is read only after
/// the handle was observed non-zero with acquire ordering.
pub(crate) struct CoreLink {
    handle: Atomic<usize>,
    hook: UnsafeCell<ffi::invalidate_peer_memory>,
}

// SAFETY: see the type invariants: the one write happens-before every read.
unsafe impl Sync for CoreLink {}

impl CoreLink {
    /// Where the core writes its hook during registration.
    pub(crate) fn hook_slot(&self) -> *mut ffi::invalidate_peer_memory {
        self.hook.get()
    }

    /// Publishes the core's handle once registration returned it, if the
    /// core wrote its hook (during registration); whether it did.
    pub(crate) fn publish(&self, handle: *mut c_void) -> bool {
        // SAFETY: read by the registering thread after the core returned,
        // before the handle is published: no write races it (type
        // invariants).
        let written = unsafe { (*self.hook.get()).is_some() };
        if written {
            self.handle.store(handle as usize, Release);
        }
        written
    }

    /// Forgets the handle before unregistering.
    pub(crate) fn retract(&self) {
        self.handle.store(0, Release);
    }

    /// Whether registration completed (the hook may be used).
    pub(crate) fn ready(&self) -> bool {
        self.handle.load(Acquire) != 0
    }

    /// Asks the core to revoke the registration it knows as `core_context`.
    /// Sleeps (the core takes mutexes): call from the free callback or the
    /// drain only, never under a lock of ours.
    pub(crate) fn invalidate(&self, core_context: u64) {
        let handle = self.handle.load(Acquire);
        if handle == 0 {
            return;
        }
        // SAFETY: the handle is published, so the hook was written before
        // (type invariants) and is never written again; it is the core's own
        // hook, called with its own handle, and returns 0 for ids it does not
        // know.
        unsafe {
            if let Some(f) = *self.hook.get() {
                f(handle as *mut c_void, core_context);
            }
        }
    }
}
