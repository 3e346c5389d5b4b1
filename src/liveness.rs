// SPDX-License-Identifier: GPL-2.0 OR MIT

//! A reference on this module per registration object: `rmmod` is refused
//! while any registration (or a free callback's reference on one) lives.

use kernel::{
    bindings,
    prelude::*, //
};

/// Holds a reference on this module for as long as it lives.
///
/// # Invariants
///
/// A reference on this module was taken by `try_module_get` and is dropped
/// exactly once, in `Drop`.
pub(crate) struct Liveness(());

impl Liveness {
    /// Takes a module reference; fails while the module is being removed
    /// (a registration then must not start: its callback could outlive the
    /// module's code).
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: THIS_MODULE is a valid module (we are running its code);
        // `try_module_get` refuses once it is going.
        if !unsafe { bindings::try_module_get(crate::this_module()) } {
            return Err(ENODEV);
        }
        // INVARIANT: the reference was taken above.
        Ok(Liveness(()))
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        // SAFETY: taken in `new` (type invariant). When this is the last
        // reference, the caller is the module's reap work or a core call,
        // both of which the module's exit waits for (see `reaper`).
        unsafe { bindings::module_put(crate::this_module()) };
    }
}
