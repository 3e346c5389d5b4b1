// SPDX-License-Identifier: GPL-2.0 OR MIT

//! What is known and counted per (GPU, peer) pair and per GPU, shown in
//! sysfs one value per file (`stats/paths/<gpu>-<peer>/`, `stats/gpus/<gpu>/`,
//! see `views`).
//!
//! Fixed tables of plain records under one kernel spinlock (`TABLES`), held
//! for a short scan or update: a registration looks up its route and is
//! charged (from inside its own lock) and released once each. The records
//! follow the PCI devices: a bus notifier frees the records of a device that
//! loses its driver (a GPU's once nothing is charged to it any more). The
//! directories follow the records: adding or freeing one queues their sync
//! (`ffi::peermem_dirs_kick`; sysfs is not written under the spinlock).

use core::fmt::{
    self,
    Write, //
};

use kernel::{
    prelude::*,
    rbtree::{
        RBTree,
        RBTreeNodeReservation, //
    },
    sync::global_lock, //
};

use crate::{
    path::{
        Path,
        Platform,
        Verdict, //
    },
    stats::errno_name,
};

pub(crate) use crate::params::PAIRS;
const GPUS: usize = 32;
/// How the peer's DMA is translated by an IOMMU.
pub(crate) const IOMMU_NAMES: [&str; 5] = ["none", "identity", "dma", "dma-fq", "other"];

/// One pair.
#[derive(Clone, Copy)]
pub(crate) struct PairRec {
    gpu: u32,
    peer: u32,
    path: Path,
    iommu: u32,
    registrations: u64,
    policy_refusals: u64,
    failures: u64,
    /// The errno of the last failure; 0: none.
    last_failure: i32,
    /// The driver's refusal was explained in the log.
    refusal_logged: bool,
}

/// One GPU.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GpuRec {
    /// First and last byte of the BAR holding the GPU's pinned pages.
    bar_start: u64,
    bar_end: u64,
    pub(crate) id: u32,
    /// The GPU lost its driver: the record is freed once nothing is charged
    /// to it, and found by no lookup meanwhile.
    retired: bool,
    live: u64,
    pinned: u64,
    max_pinned: u64,
    /// The GPU driver's topology verdicts for this GPU's peers below a
    /// common bridge and not.
    pub(crate) gate: (Verdict, Verdict),
    /// The last failed question's errno and the questions failed in a row;
    /// the registrations to let pass before asking again.
    pub(crate) gate_err: i32,
    gate_fails: u32,
    gate_skip: u32,
    /// Questions recorded, so that one asked meanwhile is seen.
    pub(crate) gate_asked: u32,
    /// The platform observed, where a verdict is [`Verdict::Unverified`].
    pub(crate) platform: Platform,
    /// BAR1 bytes pinned, each run once (`bar1_charge`), and the pins the
    /// BAR1 guard refused.
    bar1_used: u64,
    bar1_refused: u64,
}

/// The records.
///
/// # Invariants
///
/// No pair at or past `pair_end`, and no GPU at or past `gpu_end`, is in use:
/// lookups scan only the slots that were ever used.
struct Tables {
    /// The records; `None`: a free slot.
    pairs: [Option<PairRec>; PAIRS],
    gpus: [Option<GpuRec>; GPUS],
    pair_end: usize,
    gpu_end: usize,
    /// Every GPU's pinned BAR1 runs with their pins (`bar1_charge`).
    runs: Option<RBTree<RunKey, u32>>,
}

/// A pinned run of a GPU's BAR1: the GPU's slot, its first 64 KiB page in
/// the BAR, and its pages.
type RunKey = (u8, u32, u32);

global_lock! {
    // SAFETY: initialised by `Watch::new`, at load, before any client is
    // registered, so before any record is used.
    unsafe(uninit) static TABLES: SpinLock<Tables> = Tables {
        pairs: [None; PAIRS],
        gpus: [None; GPUS],
        pair_end: 0,
        gpu_end: 0,
        runs: None,
    };
}

global_lock! {
    /// Held by a question to the GPU driver about topology verdicts: one at
    /// a time (see `topology::learn_gate`).
    // SAFETY: initialised by `Watch::new`, at load, before any client is
    // registered, so before any registration asks the GPU driver.
    pub(crate) unsafe(uninit) static ASKING: Mutex<()> = ();
}

/// A GPU's record as read, and its slot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gpu {
    pub(crate) slot: usize,
    pub(crate) rec: GpuRec,
}

impl GpuRec {
    /// Whether a topology verdict of the driver is still to be learnt.
    pub(crate) fn gate_unknown(&self) -> bool {
        self.gate.0 == Verdict::Unknown || self.gate.1 == Verdict::Unknown
    }
}

fn live_gpu(t: &Tables, slot: usize) -> Option<Gpu> {
    let rec = t.gpus[slot].filter(|g| !g.retired)?;
    Some(Gpu { slot, rec })
}

fn gpu_in(t: &Tables, phys: u64) -> Option<Gpu> {
    let holds = |g: &GpuRec| (g.bar_start..=g.bar_end).contains(&phys);
    (0..t.gpu_end)
        .filter(|&i| t.gpus[i].as_ref().is_some_and(holds))
        .find_map(|i| live_gpu(t, i))
}

/// `gpu`'s record, unless its slot was freed since `gpu` was read (the slot
/// maybe another GPU's now).
fn rec_of(t: &mut Tables, gpu: Gpu) -> Option<&mut GpuRec> {
    t.gpus[gpu.slot]
        .as_mut()
        .filter(|g| g.bar_start == gpu.rec.bar_start)
}

/// The slot of the pair (`gpu`, `peer`) in `pairs`, if recorded.
fn pair_slot(pairs: &[Option<PairRec>], gpu: u32, peer: u32) -> Option<usize> {
    let this = |p: &PairRec| (p.gpu, p.peer) == (gpu, peer);
    pairs.iter().position(|p| p.as_ref().is_some_and(this))
}

/// Frees `slot` once its GPU lost its driver and nothing is charged to it.
fn free_if_retired(slot: &mut Option<GpuRec>) {
    if slot.is_some_and(|g| g.retired && g.live == 0 && g.bar1_used == 0) {
        *slot = None;
    }
}

/// The GPU whose BAR holds `phys`, if known.
pub(crate) fn gpu_by_phys(phys: u64) -> Option<Gpu> {
    gpu_in(&TABLES.lock(), phys)
}

/// The GPU whose BAR holds `phys` and its pair with the device `peer`, with
/// the pair's path, if both are known (one look at the tables).
pub(crate) fn known_pair(phys: u64, peer: u32) -> Option<(Gpu, Pair, Path)> {
    let t = TABLES.lock();
    let gpu = gpu_in(&t, phys)?;
    let slot = pair_slot(&t.pairs[..t.pair_end], gpu.rec.id, peer)?;
    Some((gpu, Pair(slot), t.pairs[slot]?.path))
}

/// Records a GPU whose BAR is `[start, end]` (or finds it, recorded by
/// another thread meanwhile); `None` when the table is full.
pub(crate) fn add_gpu(id: u32, start: u64, end: u64) -> Option<Gpu> {
    let mut t = TABLES.lock();
    if let Some(g) = gpu_in(&t, start) {
        return Some(g);
    }
    let slot = t.gpus.iter().position(Option::is_none)?;
    // INVARIANT: the slot in use is below the end.
    t.gpu_end = t.gpu_end.max(slot + 1);
    // A freed slot starts anew (a rebind may bring another BAR).
    t.gpus[slot] = Some(GpuRec {
        bar_start: start,
        bar_end: end,
        id,
        ..Default::default()
    });
    let gpu = live_gpu(&t, slot);
    drop(t);
    crate::ffi::peermem_dirs_kick();
    gpu
}

/// Whether `gpu`'s topology verdicts are to be asked now: one is not
/// learnt, and the registrations to let pass after failed questions have.
pub(crate) fn gate_due(gpu: Gpu) -> bool {
    let mut t = TABLES.lock();
    let Some(g) = rec_of(&mut t, gpu).filter(|g| g.gate_unknown()) else {
        return false;
    };
    let due = g.gate_skip == 0;
    g.gate_skip = g.gate_skip.saturating_sub(1);
    due
}

/// Records what a question about `gpu`'s topology verdicts learnt: the
/// verdicts it got (`Unknown` leaves one as it was), the platform observed
/// where the driver could not be asked, and, with `again`, that a kind is
/// to be asked again: after a failure (its errno) or for want of a peer
/// (0). After `n` such questions in a row the next `2^(n-1) - 1`
/// registrations (at most 1023) do not ask.
pub(crate) fn gate_learnt(
    gpu: Gpu,
    near: Verdict,
    far: Verdict,
    seen: Option<Platform>,
    again: Option<i32>,
) {
    let mut t = TABLES.lock();
    let Some(g) = rec_of(&mut t, gpu) else {
        return;
    };
    if let Some(p) = seen {
        g.platform = p;
    }
    for (v, new) in [(&mut g.gate.0, near), (&mut g.gate.1, far)] {
        if *v == Verdict::Unknown {
            *v = new;
        }
    }
    g.gate_asked = g.gate_asked.wrapping_add(1);
    g.gate_err = again.unwrap_or(0);
    g.gate_fails = again.map_or(0, |_| g.gate_fails.saturating_add(1));
    g.gate_skip = (1u32 << g.gate_fails.saturating_sub(1).min(10)) - 1;
}

/// A pair's slot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pair(usize);

/// Records a classified pair in one of the first `pair_table_slots` slots.
/// Returns its slot and whether this call created it (the caller then logs
/// it once); `None` when those slots are full.
pub(crate) fn add_pair(gpu: u32, peer: u32, path: Path, iommu: u32) -> Option<(Pair, bool)> {
    let mut t = TABLES.lock();
    let slots = &mut t.pairs[..crate::params::pair_slots()];
    let (slot, new) = match pair_slot(slots, gpu, peer) {
        Some(slot) => (slot, false),
        None => (slots.iter().position(Option::is_none)?, true),
    };
    if new {
        // A reused slot starts with the new pair's own counts.
        slots[slot] = Some(PairRec {
            gpu,
            peer,
            path,
            iommu,
            registrations: 0,
            policy_refusals: 0,
            failures: 0,
            last_failure: 0,
            refusal_logged: false,
        });
    }
    // INVARIANT: the slot in use is below the end.
    t.pair_end = t.pair_end.max(slot + 1);
    drop(t);
    if new {
        crate::ffi::peermem_dirs_kick();
    }
    Some((Pair(slot), new))
}

/// The PCI device `id` lost its driver: the pairs it is part of are
/// forgotten (no registration maps for it any more: the core keeps a peer
/// bound while it maps for it), and so is its GPU record once nothing is
/// charged to it (a rebind may bring another BAR, whose first registration
/// records it anew).
pub(crate) fn forget_device(id: u32) {
    let mut t = TABLES.lock();
    let part = |p: &PairRec| p.gpu == id || p.peer == id;
    for p in t.pairs.iter_mut().filter(|p| p.as_ref().is_some_and(part)) {
        *p = None;
    }
    for slot in t.gpus.iter_mut() {
        if let Some(g) = slot.as_mut().filter(|g| g.id == id) {
            g.retired = true;
        }
        free_if_retired(slot);
    }
    drop(t);
    crate::ffi::peermem_dirs_kick();
}

impl Pair {
    /// A registration failed on this pair with `errno` (positive), refused
    /// by the path policy if `policy`. With `refusal` (the GPU driver's
    /// topology refusal), returns whether it is the pair's first, which the
    /// caller explains (once per pair).
    pub(crate) fn failed(&self, errno: i32, policy: bool, refusal: bool) -> bool {
        let mut t = TABLES.lock();
        let Some(p) = t.pairs[self.0].as_mut() else {
            return false;
        };
        p.failures += 1;
        p.last_failure = errno;
        p.policy_refusals += u64::from(policy);
        refusal && !core::mem::replace(&mut p.refusal_logged, true)
    }
}

/// What one mapped registration is counted under, released once: its GPU's
/// slot + 1 (an `Option<Charge>` in every registration stays 2 bytes).
///
/// # Invariants
///
/// Built only by [`charge`], which added exactly what [`Charge::release`]
/// subtracts when given the same byte count.
pub(crate) struct Charge(core::num::NonZeroU16);

/// A pin charged to its GPU's BAR1 use: the GPU's slot and the pin's first
/// 64 KiB page in that GPU's BAR (+1).
///
/// # Invariants
///
/// Made only by [`bar1_charge`], which counted one pin of the run
/// (`gpu`, `page - 1`, the pin's pages) that [`Bar1::release`] uncounts.
pub(crate) struct Bar1 {
    gpu: u8,
    page: core::num::NonZeroU32,
}

/// A pin the BAR1 guard refused: its GPU, the use it would have made, the
/// limit, the BAR's size.
pub(crate) struct Bar1Refusal {
    pub(crate) gpu: u32,
    pub(crate) use_after: u64,
    pub(crate) limit: u64,
    pub(crate) size: u64,
}

/// What [`bar1_charge`] did.
pub(crate) enum Bar1Charged {
    /// Charged (a run already pinned costs nothing more).
    Yes(Bar1),
    /// The pin would take the GPU's use past the limit: refused.
    Refused(Bar1Refusal),
    /// No record of a GPU whose BAR holds the pin: record it and retry.
    UnknownGpu,
}

/// Charges a pin of `len` bytes whose first page is at BAR address `phys`
/// to its GPU's BAR1 use, as the GPU driver spends it: a pin of pages it
/// mapped for the same owner already reuses that mapping (RM's
/// `_reuseThirdPartyP2PMappingExtent`, gpu/bus/p2p.c), so a run pinned
/// again (the same memory registered on another HCA) costs nothing more; another run of overlapping pages is counted again, so the
/// use can be over-counted by such overlaps (docs/design.md, "The BAR1
/// guard"). Refused when the use would pass `pct` percent of the BAR (0:
/// no limit).
pub(crate) fn bar1_charge(phys: u64, len: u64, pct: u64) -> Bar1Charged {
    // Allocated before the lock; unused when the run is pinned already.
    let node = RBTreeNodeReservation::new(GFP_KERNEL);
    let mut guard = TABLES.lock();
    let t = &mut *guard;
    let Some(gpu) = gpu_in(t, phys) else {
        return Bar1Charged::UnknownGpu;
    };
    let page = |b: u64| (b / crate::range::GPU_PAGE_SIZE) as u32;
    let key = (gpu.slot as u8, page(phys - gpu.rec.bar_start), page(len));
    let bar = Bar1 {
        gpu: key.0,
        page: core::num::NonZeroU32::MIN.saturating_add(key.1),
    };
    let runs = t.runs.get_or_insert_with(RBTree::new);
    if let Some(pins) = runs.get_mut(&key) {
        *pins += 1;
        return Bar1Charged::Yes(bar);
    }
    let g = t.gpus[gpu.slot].as_mut();
    if let Some(Err(r)) = g.map(|g| g.bar1_add(len, pct, node.is_ok())) {
        return Bar1Charged::Refused(r);
    }
    if let Ok(node) = node {
        runs.insert(node.into_node(key, 1));
    }
    Bar1Charged::Yes(bar)
}

impl GpuRec {
    /// Adds a new run of `len` bytes to the GPU's BAR1 use, unless that
    /// passes `pct` percent of its BAR (0: no limit), or the run cannot be
    /// recorded (`recordable` false: no memory for its node; refused with
    /// limit 0). A refusal is counted.
    fn bar1_add(&mut self, len: u64, pct: u64, recordable: bool) -> Result<(), Bar1Refusal> {
        let size = self.bar_end - self.bar_start + 1;
        let limit = match (recordable, pct) {
            (false, _) => 0,
            (true, 0) => size,
            (true, p) => size / 100 * p,
        };
        let use_after = self.bar1_used + len;
        if use_after > limit {
            self.bar1_refused += 1;
            return Err(Bar1Refusal {
                gpu: self.id,
                use_after,
                limit,
                size,
            });
        }
        self.bar1_used = use_after;
        Ok(())
    }
}

impl Bar1 {
    /// The pin ended; `len` is what it was charged with.
    pub(crate) fn release(self, len: u64) {
        let key = (
            self.gpu,
            self.page.get() - 1,
            (len / crate::range::GPU_PAGE_SIZE) as u32,
        );
        let mut guard = TABLES.lock();
        let t = &mut *guard;
        let Some(pins) = t.runs.as_mut().and_then(|r| r.get_mut(&key)) else {
            return;
        };
        *pins -= 1;
        if *pins > 0 {
            return;
        }
        // Freed after the lock (the tree's node).
        let node = t.runs.as_mut().and_then(|r| r.remove_node(&key));
        let slot = &mut t.gpus[usize::from(self.gpu)];
        if let Some(g) = slot.as_mut() {
            g.bar1_used -= len;
        }
        free_if_retired(slot);
        drop(guard);
        drop(node);
    }
}

/// Counts a mapped registration of `bytes` on `pair` and `gpu`; `None` when
/// `gpu`'s record was freed since it was read (its device unbound, the slot
/// maybe another GPU's now): nothing to count it on.
pub(crate) fn charge(pair: Option<Pair>, gpu: Gpu, bytes: u64) -> Option<Charge> {
    let mut t = TABLES.lock();
    let g = rec_of(&mut t, gpu)?;
    g.live += 1;
    g.pinned += bytes;
    g.max_pinned = g.max_pinned.max(g.pinned);
    if let Some(p) = pair.and_then(|p| t.pairs[p.0].as_mut()) {
        p.registrations += 1;
    }
    // INVARIANT: what `release` subtracts was added here.
    let slot = core::num::NonZeroU16::MIN.saturating_add(gpu.slot as u16);
    Some(Charge(slot))
}

impl Charge {
    /// The registration's pin ended; `bytes` is what it was charged with.
    pub(crate) fn release(self, bytes: u64) {
        let mut t = TABLES.lock();
        let slot = &mut t.gpus[usize::from(self.0.get() - 1)];
        if let Some(g) = slot.as_mut() {
            g.live -= 1;
            g.pinned -= bytes;
        }
        free_if_retired(slot);
    }
}

/// The PCI device `id` lost its driver (C shim, bus notifier).
#[no_mangle]
extern "C" fn peermem_device_unbound(id: u32) {
    forget_device(id);
}

/// Whether the PCI device `id` was a registration's `dma_device` (it has a
/// pair): an RDMA peer the GPU driver may be asked about (C shim,
/// `peermem_gate_candidate`).
#[no_mangle]
extern "C" fn peermem_known_peer(id: u32) -> bool {
    let t = TABLES.lock();
    t.pairs[..t.pair_end].iter().flatten().any(|p| p.peer == id)
}

/// The tables' records follow the PCI devices: watches them for the loss of
/// their driver from `new` until dropped.
///
/// # Invariants
///
/// The shim's bus notifier is registered from `new` until `drop`.
pub(crate) struct Watch(());

impl Watch {
    /// Readies the tables' lock and registers the bus notifier; called once,
    /// at load, before any client is registered.
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: called once per load, before `TABLES` and `ASKING` are
        // used (above).
        unsafe {
            TABLES.init();
            ASKING.init();
        }
        kernel::error::to_result(crate::ffi::peermem_watch_devices())?;
        // INVARIANT: registered just above.
        Ok(Self(()))
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Returns once no notification runs any more.
        crate::ffi::peermem_unwatch_devices();
    }
}

/// The records that have a directory in sysfs (`views`), by slot: each
/// GPU's PCI address, each pair's `gpu << 32 | peer`; 0 where none.
pub(crate) fn keys() -> ([u64; GPUS], [u64; PAIRS]) {
    let t = TABLES.lock();
    let gpu = |g: &Option<GpuRec>| g.filter(|g| !g.retired).map_or(0, |g| u64::from(g.id));
    let pair = |p: &Option<PairRec>| p.map_or(0, |p| u64::from(p.gpu) << 32 | u64::from(p.peer));
    (t.gpus.each_ref().map(gpu), t.pairs.each_ref().map(pair))
}

fn verdict(v: Verdict) -> &'static str {
    match v {
        Verdict::Unknown => "unknown",
        Verdict::Open => "open",
        Verdict::Refused => "refused",
        Verdict::Unverified => "unverified",
    }
}

/// A file of a record's directory: its name, and what writes its value.
pub(crate) type File<R> = (&'static CStr, fn(&R, &mut dyn Write) -> fmt::Result);

fn w(f: &mut dyn Write, v: impl fmt::Display) -> fmt::Result {
    writeln!(f, "{v}")
}

/// The files of a GPU's directory, `stats/gpus/<gpu>/`.
pub(crate) const GPU_FILES: [File<GpuRec>; 8] = [
    (c"live", |g, f| w(f, g.live)),
    (c"pinned_bytes", |g, f| w(f, g.pinned)),
    (c"max_pinned_bytes", |g, f| w(f, g.max_pinned)),
    (c"gate_shared_bridge", |g, f| w(f, verdict(g.gate.0))),
    (c"gate_other", |g, f| w(f, verdict(g.gate.1))),
    (c"bar1_size", |g, f| w(f, g.bar_end - g.bar_start + 1)),
    (c"bar1_used", |g, f| w(f, g.bar1_used)),
    (c"bar1_refused", |g, f| w(f, g.bar1_refused)),
];

/// The files of a pair's directory, `stats/paths/<gpu>-<peer>/`.
pub(crate) const PAIR_FILES: [File<PairRec>; 7] = [
    (c"class", |p, f| w(f, p.path.class.name())),
    (c"acs_redirect", |p, f| w(f, u8::from(p.path.acs_redirect))),
    (c"iommu", |p, f| w(f, IOMMU_NAMES[p.iommu as usize])),
    (c"registrations", |p, f| w(f, p.registrations)),
    (c"failures", |p, f| w(f, p.failures)),
    (c"last_failure", |p, f| match p.last_failure {
        0 => w(f, "-"),
        e => w(f, errno_name(Error::from_errno(-e))),
    }),
    (c"policy_refusals", |p, f| w(f, p.policy_refusals)),
];

/// Writes file `i` of `files` of the record `find` finds into `f`; `ENODEV`
/// once it is gone.
fn file<R>(
    files: &[File<R>],
    i: usize,
    f: &mut dyn Write,
    find: impl Fn(&Tables) -> Option<&R>,
) -> Result {
    let t = TABLES.lock();
    let record = find(&t).ok_or(ENODEV)?;
    (files.get(i).ok_or(EINVAL)?.1)(record, f).map_err(|_| EINVAL)
}

/// Writes file `i` of the directory of GPU `id` (see [`GPU_FILES`]).
pub(crate) fn gpu_file(id: u32, i: usize, f: &mut dyn Write) -> Result {
    let live = |g: &&GpuRec| g.id == id && !g.retired;
    file(&GPU_FILES, i, f, |t| t.gpus.iter().flatten().find(live))
}

/// Writes file `i` of the directory of the pair (`gpu`, `peer`) (see
/// [`PAIR_FILES`]).
pub(crate) fn pair_file(gpu: u32, peer: u32, i: usize, f: &mut dyn Write) -> Result {
    file(&PAIR_FILES, i, f, |t| {
        t.pairs[pair_slot(&t.pairs, gpu, peer)?].as_ref()
    })
}
