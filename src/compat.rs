// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The kernel crate's API where the supported series differ (see the README's
//! "Supported kernels"), in one place. Each item is written so that it
//! compiles on every listed series; a difference that cannot be written that
//! way gets a probe in `bindings/Kbuild.inc` (a `--cfg peermem_<feature>`
//! derived from the tree's own Rust sources) and is resolved here.
//!
//! - 7.3 has `kernel::module::this_module`; 7.2 only the C symbol.
//! - 7.3's module parameters return the value, 7.2's a reference to it.
//! - 7.3 has `Task::tgid`; 7.2 reaches it through the group leader.
//! - 7.3 names `EOPNOTSUPP` in `kernel::error::code`; 7.2 does not (and has
//!   no public `const` constructor for an `Error`).

use core::borrow::Borrow;

use kernel::{
    bindings,
    prelude::*, //
};

/// This module's `struct module`.
pub(crate) fn this_module() -> *mut bindings::module {
    #[cfg(MODULE)]
    {
        // The module's own `__this_module`, defined by modpost's `.mod.c`;
        // only its address is taken.
        &raw mut bindings::__this_module
    }
    #[cfg(not(MODULE))]
    {
        core::ptr::null_mut()
    }
}

/// A module parameter's value, whether the series returns it or a reference.
pub(crate) fn param<T: Copy>(v: impl Borrow<T>) -> T {
    *v.borrow()
}

/// The calling process's id (the thread group's), as the GPU driver keys
/// non-persistent pins by it.
pub(crate) fn current_tgid() -> u32 {
    current_ids().1
}

/// The calling task, compared only, and its process's id (one lookup of
/// `current` for both).
pub(crate) fn current_ids() -> (core::num::NonZeroUsize, u32) {
    let task = kernel::current!();
    // A task pointer is never NULL.
    let me = core::num::NonZeroUsize::new(task.as_ptr() as usize)
        .unwrap_or(core::num::NonZeroUsize::MIN);
    (me, task.group_leader().pid() as u32)
}

/// The name of the process `tgid` (as [`current_tgid`] gives it), all zero
/// when it has exited.
pub(crate) fn comm_of(tgid: u32) -> [u8; 16] {
    let mut comm = [0u8; 16];
    // SAFETY: a 16-byte buffer (TASK_COMM_LEN), written by the helper only.
    unsafe { crate::ffi::peermem_comm_of(tgid, comm.as_mut_ptr().cast()) };
    comm
}

/// `-EOPNOTSUPP`.
pub(crate) fn eopnotsupp() -> Error {
    Error::from_errno(-(bindings::EOPNOTSUPP as i32))
}
