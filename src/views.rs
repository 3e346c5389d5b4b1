// SPDX-License-Identifier: GPL-2.0 OR MIT

//! What the module shows operators, in sysfs under
//! `/sys/module/nvidia_peermem/stats/`: `counters` (and the parameters),
//! `paths` (per GPU/peer pair), `gpus`, `processes` and `waiting_for` (one
//! value: what the module waits for before its clients register). sysfs, not debugfs:
//! containers mount `/sys` without debugfs, and kernel lockdown closes
//! debugfs. The C shim declares the files; each read renders its view anew
//! and copies the window asked for.

use core::fmt::{
    self,
    Write, //
};

use kernel::prelude::*;

use crate::{
    accounting,
    binding,
    ffi,
    params,
    stats, //
};

/// The views, in the C shim's order (`PEERMEM_VIEW`).
const VIEWS: [fn(&mut fmt::Formatter<'_>) -> fmt::Result; 5] = [
    counters,
    accounting::show_paths,
    accounting::show_gpus,
    accounting::show_processes,
    binding::show_waiting,
];

/// `counters`: the counters, and the parameters (also in
/// /sys/module/nvidia_peermem/parameters/).
fn counters(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    stats::STATS.show(f)?;
    params::Param::ALL
        .iter()
        .try_for_each(|(p, name)| writeln!(f, "param_{name} {}", p.value()))
}

/// A view as `Display`.
struct Show(fn(&mut fmt::Formatter<'_>) -> fmt::Result);

impl fmt::Display for Show {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (self.0)(f)
    }
}

/// Text rendered into memory of our own.
struct Text(KVec<u8>);

impl Write for Text {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0
            .extend_from_slice(s.as_bytes(), GFP_KERNEL)
            .map_err(|_| fmt::Error)
    }
}

/// Renders view `which` and copies its bytes from `off` into `buf` (C shim,
/// a sysfs read); returns the number copied, 0 past the end.
///
/// # Safety
///
/// `buf` must be valid for writes of `count` bytes.
#[no_mangle]
unsafe extern "C" fn peermem_view_read(
    which: kernel::ffi::c_uint,
    buf: *mut u8,
    off: i64,
    count: usize,
) -> isize {
    let Some(view) = VIEWS.get(which as usize) else {
        return EINVAL.to_errno() as isize;
    };
    let mut text = Text(KVec::new());
    if write!(text, "{}", Show(*view)).is_err() {
        return ENOMEM.to_errno() as isize;
    }
    let bytes = usize::try_from(off)
        .ok()
        .and_then(|o| text.0.get(o..))
        .unwrap_or(&[]);
    let n = bytes.len().min(count);
    // SAFETY: `buf` holds `count` bytes (caller), `bytes` at least `n`, and
    // the two do not overlap (ours is freshly allocated).
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, n) };
    n as isize
}

/// The files in sysfs, from `new` until dropped.
///
/// # Invariants
///
/// The shim's attribute group is added from `new` until `drop`.
pub(crate) struct Views(());

impl Views {
    /// Adds the files; after the tables they show are ready.
    pub(crate) fn new() -> Result<Self> {
        kernel::error::to_result(ffi::peermem_views_add())?;
        // INVARIANT: added just above.
        Ok(Self(()))
    }
}

impl Drop for Views {
    fn drop(&mut self) {
        // Returns once no read runs any more.
        ffi::peermem_views_remove();
    }
}
