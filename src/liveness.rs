// SPDX-License-Identifier: GPL-2.0 OR MIT

//! A reference on this module per live registration: `rmmod` is refused
//! while registrations live, and the debugfs count of them stays exact.

use kernel::{
    bindings,
    sync::atomic::Relaxed, //
};

use crate::stats::STATS;

/// Holds a reference on this module, and counts one live registration, for
/// as long as it lives.
pub(crate) struct Liveness(());

impl Liveness {
    pub(crate) fn new() -> Self {
        // SAFETY: THIS_MODULE is live (we are running its code); the count is
        // dropped in `Drop`.
        unsafe { bindings::__module_get(crate::this_module()) };
        STATS.live.add(1, Relaxed);
        Liveness(())
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        STATS.live.fetch_sub(1, Relaxed);
        // SAFETY: taken in `new`.
        unsafe { bindings::module_put(crate::this_module()) };
    }
}
