// SPDX-License-Identifier: GPL-2.0 OR MIT

//! What the module shows operators, in sysfs, one value per file
//! (Documentation/filesystems/sysfs.rst), under
//! `/sys/module/nvidia_peermem/stats/`: `counters/<name>`, `waiting_for`
//! (what the module waits for before its clients register),
//! `gpus/<gpu>/<file>` and `paths/<gpu>-<peer>/<file>` (PCI addresses). sysfs,
//! not debugfs: containers mount `/sys` without debugfs, and debugfs is
//! root's alone (`/sys/kernel/debug` is mode 0700). Nothing in sysfs names a
//! process: root reads them in debugfs, `nvidia_peermem/processes` (mode
//! 0400; a read-only debugfs file stays readable under lockdown).
//!
//! The C shim declares the files, named here, and the directories; a work
//! item makes the directories follow the tables ([`peermem_dirs_sync`]).

use core::fmt::{
    self,
    Write, //
};

use kernel::{
    bindings,
    ffi::c_void,
    prelude::*,
    str::{
        CString,
        Formatter, //
    },
    sync::global_lock, //
};

use crate::{
    accounting, ffi,
    stats::{
        Bdf,
        STATS, //
    },
};

/// The kinds of files, as the C shim passes them: `stats/counters/<name>`,
/// `stats/waiting_for`, `stats/gpus/<gpu>/<file>`,
/// `stats/paths/<gpu>-<peer>/<file>`.
const COUNTER: u32 = 0;
const WAITING: u32 = 1;
const GPU: u32 = 2;
const PAIR: u32 = 3;

/// The name of file `i` of kind `kind`; NULL past the last (C shim).
#[no_mangle]
extern "C" fn peermem_stat_file(kind: u32, i: u32) -> *const u8 {
    let i = i as usize;
    let name = match kind {
        COUNTER => STATS.counter(i).map(|c| c.0),
        WAITING => (i == 0).then_some(c"waiting_for"),
        GPU => accounting::GPU_FILES.get(i).map(|f| f.0),
        PAIR => accounting::PAIR_FILES.get(i).map(|f| f.0),
        _ => None,
    };
    name.map_or(core::ptr::null(), CStr::as_char_ptr)
}

/// A PCI address as [`Bdf`] writes it.
pub(crate) fn parse_bdf(s: &str) -> Result<u32> {
    let mut parts = s.split([':', '.']).map(|x| u32::from_str_radix(x, 16));
    let mut next = || parts.next().and_then(|p| p.ok()).ok_or(ENODEV);
    Ok(next()? << 16 | next()? << 8 | next()? << 3 | next()?)
}

/// Writes file `i` of kind `kind` in the directory `dir` into `f`.
fn show(kind: u32, dir: &str, i: usize, f: &mut dyn Write) -> Result {
    match kind {
        COUNTER => writeln!(f, "{}", STATS.counter(i).ok_or(EINVAL)?.1).map_err(|_| EINVAL),
        WAITING => writeln!(f, "{}", crate::binding::waiting()).map_err(|_| EINVAL),
        GPU => accounting::gpu_file(parse_bdf(dir)?, i, f),
        _ => {
            let (gpu, peer) = dir.split_once('-').ok_or(ENODEV)?;
            accounting::pair_file(parse_bdf(gpu)?, parse_bdf(peer)?, i, f)
        }
    }
}

/// Shows file `i` of kind `kind` in the directory named `dir` into the page
/// `buf` (C shim, a sysfs read): its length, or an errno (`ENODEV` once the
/// directory's record is gone).
///
/// # Safety
///
/// `buf` must be valid for writes of a page; `dir` a NUL-terminated string.
#[no_mangle]
unsafe extern "C" fn peermem_stat_show(kind: u32, dir: *const u8, i: u32, buf: *mut u8) -> isize {
    // SAFETY: `dir` is NUL-terminated and `buf` a page ours to write, both
    // during the call (caller).
    let (dir, page) = unsafe {
        (
            CStr::from_char_ptr(dir),
            core::slice::from_raw_parts_mut(buf, bindings::PAGE_SIZE),
        )
    };
    let dir = dir.to_str().unwrap_or("");
    let mut f = Formatter::new(page);
    match show(kind, dir, i as usize, &mut f) {
        Ok(()) => f.bytes_written() as isize,
        Err(e) => e.to_errno() as isize,
    }
}

/// A directory of `stats/gpus` or `stats/paths`: its kind and its record's
/// key (see `accounting::keys`, which names it); removed on drop.
///
/// # Invariants
///
/// `kobj` was made by `peermem_dir_add` and is removed only by `drop`.
struct Dir {
    key: (u32, u64),
    kobj: *mut bindings::kobject,
}

// SAFETY: a directory may be removed from any thread.
unsafe impl Send for Dir {}

impl Dir {
    fn new(key: (u32, u64)) -> Option<Self> {
        let (hi, lo) = (Bdf((key.1 >> 32) as u32), Bdf(key.1 as u32));
        let name = match key.0 {
            GPU => CString::try_from_fmt(fmt!("{lo}")),
            _ => CString::try_from_fmt(fmt!("{hi}-{lo}")),
        };
        // SAFETY: a NUL-terminated name, which the callee copies.
        let kobj = unsafe { ffi::peermem_dir_add(key.0, name.ok()?.as_char_ptr()) };
        // INVARIANT: made just above.
        (!kobj.is_null()).then_some(Self { key, kobj })
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        // SAFETY: made by `peermem_dir_add`, removed once, here (invariant).
        unsafe { bindings::kobject_put(self.kobj) };
    }
}

global_lock! {
    // SAFETY: initialised by `Views::new`, at load, before the work that
    // syncs the directories can run.
    unsafe(uninit) static DIRS: Mutex<KVec<Dir>> = KVec::new();
}

/// Makes the directories follow the tables (C shim, the work function
/// queued when a record was added or freed): stale ones go first (a record
/// freed and added again may have taken another slot; a name is made once),
/// then one is made for each record without (left for the next sync if it
/// cannot).
#[no_mangle]
extern "C" fn peermem_dirs_sync(_work: *mut bindings::work_struct) {
    let (gpus, pairs) = accounting::keys();
    let gpus = gpus.into_iter().map(|k| (GPU, k));
    let keys = Iterator::chain(gpus, pairs.into_iter().map(|k| (PAIR, k)));
    let mut dirs = DIRS.lock();
    dirs.retain(|d| keys.clone().any(|k| k == d.key));
    for key in keys.filter(|k| k.1 != 0) {
        if !dirs.iter().any(|d| d.key == key) {
            // A directory that cannot be kept is removed at once.
            let _ = Dir::new(key).map(|d| dirs.push(d, GFP_KERNEL));
        }
    }
}

/// A process's name as one word: white space becomes `_`.
struct Word<'a>(&'a str);

impl fmt::Display for Word<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0
            .chars()
            .try_for_each(|c| f.write_char(if c.is_whitespace() { '_' } else { c }))
    }
}

/// `nvidia_peermem/processes` in debugfs (C shim, its seq_file show, root
/// only): one line per process holding pins, `tgid=<id> comm=<name>
/// live=<pins> pinned_bytes=<bytes>`, from the drain's registry.
///
/// # Safety
///
/// `m` must be the seq_file of the show running.
#[no_mangle]
unsafe extern "C" fn peermem_processes_show(m: *mut bindings::seq_file, _v: *mut c_void) -> i32 {
    // SAFETY: valid during the show (caller).
    let m = unsafe { kernel::seq_file::SeqFile::from_raw(m) };
    let regs = crate::registration::registry::live();
    let Ok(held) = regs.and_then(|r| crate::drain::holders(&r)) else {
        return ENOMEM.to_errno();
    };
    for h in &held {
        m.call_printf(format_args!(
            "tgid={} comm={} live={} pinned_bytes={}\n",
            h.tgid,
            Word(crate::compat::Comm::of(h.tgid).name()),
            h.persistent.0 + h.pins.0,
            h.persistent.1 + h.pins.1
        ));
    }
    0
}

/// The files in sysfs and debugfs, from `new` until dropped.
///
/// # Invariants
///
/// The shim's files are added from `new` until `drop`.
pub(crate) struct Views(());

impl Views {
    /// Adds the files; after the tables they show are ready.
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: called once per load, before the work that uses `DIRS`
        // can be queued (`peermem_views_add` allows it).
        unsafe { DIRS.init() };
        kernel::error::to_result(ffi::peermem_views_add())?;
        // INVARIANT: added just above.
        Ok(Self(()))
    }
}

impl Drop for Views {
    fn drop(&mut self) {
        // No sync runs or is queued any more; then the directories go,
        // before their parents. Each removal returns once no read of it
        // runs any more.
        ffi::peermem_dirs_stop();
        *DIRS.lock() = KVec::new();
        ffi::peermem_views_remove();
    }
}
