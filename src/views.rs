// SPDX-License-Identifier: GPL-2.0 OR MIT

//! What the module shows operators, in sysfs under
//! `/sys/module/nvidia_peermem/stats/`: `counters` (and the parameters),
//! `paths` (per GPU/peer pair), `gpus`, `processes` and `waiting_for` (one
//! value: what the module waits for before its clients register). sysfs, not
//! debugfs:
//! containers mount `/sys` without debugfs, and debugfs is root's alone
//! (`/sys/kernel/debug` is mode 0700). The C shim declares the files; a read from the start renders
//! the view, and the reads that follow in the same open file copy from that
//! rendering (sysfs hands out at most a page per read: a view rendered
//! again per read would come out torn when the tables change between).

use core::fmt::{
    self,
    Write, //
};

use kernel::{
    prelude::*,
    sync::global_lock, //
};

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

/// A view's rendering for one open file.
struct Snapshot {
    /// The open file and the view, or 0 when free.
    reader: usize,
    which: usize,
    text: KVec<u8>,
}

const NO_SNAPSHOT: Snapshot = Snapshot {
    reader: 0,
    which: 0,
    text: KVec::new(),
};

/// Files read at once whose renderings are kept; a further one takes the
/// place of the one read least recently, which then renders anew.
const READERS: usize = 8;

/// The renderings, the one read least recently first.
struct Snapshots([Snapshot; READERS]);

global_lock! {
    // SAFETY: initialised by `Views::new`, at load, before the files exist.
    unsafe(uninit) static SNAPSHOTS: Mutex<Snapshots> = Snapshots([NO_SNAPSHOT; READERS]);
}

impl Snapshots {
    /// The rendering of view `which` for `reader`, made anew when `fresh`
    /// or none is kept; moved to the end (read most recently).
    fn of(&mut self, which: usize, reader: usize, fresh: bool) -> Result<&Snapshot> {
        let kept = self
            .0
            .iter()
            .position(|s| (s.which, s.reader) == (which, reader));
        let i = kept
            .or_else(|| self.0.iter().position(|s| s.reader == 0))
            .unwrap_or(0);
        self.0[i..].rotate_left(1);
        let last = &mut self.0[READERS - 1];
        if fresh || kept.is_none() {
            let mut text = Text(KVec::new());
            write!(text, "{}", Show(VIEWS[which])).map_err(|_| ENOMEM)?;
            *last = Snapshot {
                reader,
                which,
                text: text.0,
            };
        }
        Ok(last)
    }
}

/// Copies view `which` from `off` into `buf` for the open file `reader` (C
/// shim, a sysfs read), from the rendering made for `reader`'s read from
/// the start (rendered anew if it was not kept); returns the number copied,
/// 0 past the end.
///
/// # Safety
///
/// `buf` must be valid for writes of `count` bytes.
#[no_mangle]
unsafe extern "C" fn peermem_view_read(
    which: kernel::ffi::c_uint,
    reader: usize,
    buf: *mut u8,
    off: i64,
    count: usize,
) -> isize {
    let (which, Ok(off)) = (which as usize, usize::try_from(off)) else {
        return EINVAL.to_errno() as isize;
    };
    if which >= VIEWS.len() {
        return EINVAL.to_errno() as isize;
    }
    let mut snaps = SNAPSHOTS.lock();
    let snap = match snaps.of(which, reader, off == 0) {
        Ok(s) => s,
        Err(e) => return e.to_errno() as isize,
    };
    let bytes = snap.text.get(off..).unwrap_or(&[]);
    let n = bytes.len().min(count);
    // SAFETY: `buf` holds `count` bytes (caller), `bytes` at least `n`, and
    // the two do not overlap (ours is the module's own allocation).
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, n) };
    if n == 0 {
        // Read to the end: the memory goes.
        snaps.0[READERS - 1] = NO_SNAPSHOT;
    }
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
        // SAFETY: called once per load, before the files that read
        // `SNAPSHOTS` exist.
        unsafe { SNAPSHOTS.init() };
        kernel::error::to_result(ffi::peermem_views_add())?;
        // INVARIANT: added just above.
        Ok(Self(()))
    }
}

impl Drop for Views {
    fn drop(&mut self) {
        // Returns once no read runs any more.
        ffi::peermem_views_remove();
        // The statics are not dropped at unload.
        *SNAPSHOTS.lock() = Snapshots([NO_SNAPSHOT; READERS]);
    }
}
