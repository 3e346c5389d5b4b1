// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The kernel crate's API where the supported series differ (see the README's
//! "Supported kernels"), in one place. Each item is written so that it
//! compiles on every listed series; a difference that cannot be written that
//! way gets a probe in `bindings/Kbuild.inc` (a `--cfg peermem_<feature>`
//! derived from the tree's own Rust sources) and is resolved here.
//!
//! - 7.3 has `kernel::module::this_module`; 7.2 only the C symbol.
//! - 7.3 has `Task::tgid`; 7.2 reaches it through the group leader.
//! - 7.3 names `EOPNOTSUPP` and `EPROTO` in `kernel::error::code`; 7.2 does
//!   not (and has no public `const` constructor for an `Error`).
//! - 7.3's pin-init initializes raw memory through `raw_try_init` (its
//!   `PinInit::__pinned_init` is gone), 7.2's through `__pinned_init`
//!   (probe `peermem_raw_try_init`).

use kernel::{
    bindings,
    prelude::*, //
};

/// This module's `struct module`.
pub(crate) fn this_module() -> *mut bindings::module {
    // The module's own `__this_module`, defined by modpost's `.mod.c`; only
    // its address is taken.
    #[cfg(MODULE)]
    return &raw mut bindings::__this_module;
    #[cfg(not(MODULE))]
    return core::ptr::null_mut();
}

/// The calling process's id (the thread group's), as the GPU driver keys
/// non-persistent pins by it.
pub(crate) fn current_tgid() -> u32 {
    current_ids().1
}

/// The calling thread's id, compared only (unique among live tasks), and
/// its process's id (one lookup of `current` for both).
pub(crate) fn current_ids() -> (core::num::NonZeroU32, u32) {
    let task = kernel::current!();
    // Only the idle tasks have id 0, and they never call into the module.
    let me = core::num::NonZeroU32::new(task.pid() as u32).unwrap_or(core::num::NonZeroU32::MIN);
    (me, task.group_leader().pid() as u32)
}

/// The name of a process, all zero once it has exited.
pub(crate) struct Comm([u8; 16]);

impl Comm {
    /// The name of the process `tgid` (as [`current_tgid`] gives it).
    pub(crate) fn of(tgid: u32) -> Self {
        let mut comm = [0; 16];
        crate::ffi::peermem_comm_of(tgid, &mut comm);
        Self(comm)
    }

    /// The name up to its NUL (empty once the process has exited; `?` if it
    /// is not UTF-8).
    pub(crate) fn name(&self) -> &str {
        let end = self.0.iter().position(|&b| b == 0).unwrap_or(self.0.len());
        core::str::from_utf8(&self.0[..end]).unwrap_or("?")
    }
}

/// A process as a log line names it: `<tgid> (<name>)`, the name empty once
/// it has exited.
pub(crate) struct Process(pub(crate) u32);

impl kernel::fmt::Display for Process {
    fn fmt(&self, f: &mut kernel::fmt::Formatter<'_>) -> kernel::fmt::Result {
        write!(f, "{} ({})", self.0, Comm::of(self.0).name())
    }
}

/// `-EOPNOTSUPP`.
pub(crate) fn eopnotsupp() -> Error {
    Error::from_errno(-(bindings::EOPNOTSUPP as i32))
}

/// `-EPROTO`.
pub(crate) fn eproto() -> Error {
    Error::from_errno(-(bindings::EPROTO as i32))
}

/// Initializes the pinned value at `slot` with `init`.
///
/// # Safety
///
/// `slot` must be valid, properly aligned memory for a `T`, uninitialized,
/// which does not move until the value is dropped; on `Err` it stays
/// uninitialized and may only be freed.
pub(crate) unsafe fn init_pinned<T, E>(slot: *mut T, init: impl PinInit<T, E>) -> Result<(), E> {
    // SAFETY: as promised by the caller.
    unsafe {
        #[cfg(peermem_raw_try_init)]
        return pin_init::raw_try_init(slot, init);
        #[cfg(not(peermem_raw_try_init))]
        return init.__pinned_init(slot);
    }
}
