// SPDX-License-Identifier: GPL-2.0 OR MIT

//! What is known and counted per (GPU, peer) pair, per GPU and per process,
//! shown in sysfs (`stats/paths`, `stats/gpus`, `stats/processes`).
//!
//! Fixed tables of plain records under one kernel spinlock (`TABLES`), held
//! for a short scan or update: a registration looks up its route and is
//! charged (from inside its own lock) and released once each. The records
//! follow the PCI devices: a bus notifier frees the records of a device that
//! loses its driver (a GPU's once nothing is charged to it any more).

use core::fmt;

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
        Class,
        Path,
        Platform,
        Verdict, //
    },
    stats::{
        errno_name,
        Bdf, //
    },
};

pub(crate) use crate::params::PAIRS;
const GPUS: usize = 32;
const PROCS: usize = 256;
/// A process is counted in one shard of the process table, found by its id.
const PROCS_PER_SHARD: usize = 16;

/// The errnos a registration can fail with that are counted per pair, each
/// in a slot of its own; anything else counts in the last slot, `EOTHER`.
const ERRNOS: [i32; 7] = [14, 12, 95, 22, 5, 1, 16];
const ERRNO_SLOTS: usize = ERRNOS.len() + 1;

fn slot_name(i: usize) -> &'static str {
    ERRNOS
        .get(i)
        .map_or("EOTHER", |&e| errno_name(Error::from_errno(-e)))
}

pub(crate) fn errno_slot(errno: i32) -> usize {
    ERRNOS
        .iter()
        .position(|&e| e == errno)
        .unwrap_or(ERRNOS.len())
}

/// How the peer's DMA is translated by an IOMMU.
pub(crate) const IOMMU_NAMES: [&str; 5] = ["none", "identity", "dma", "dma-fq", "other"];

/// One pair; free while `gpu` and `peer` are 0.
#[derive(Clone, Copy)]
struct PairRec {
    gpu: u32,
    peer: u32,
    path: Path,
    iommu: u32,
    registrations: u64,
    policy_refusals: u64,
    failures: [u64; ERRNO_SLOTS],
    /// Errno slot + 1 of the last failure; 0: none.
    last_failure: u32,
    /// The driver's refusal was explained in the log.
    refusal_logged: bool,
}

/// One GPU; free while `bar_start` is 0.
#[derive(Clone, Copy)]
struct GpuRec {
    /// First and last byte of the BAR holding the GPU's pinned pages.
    bar_start: u64,
    bar_end: u64,
    id: u32,
    /// The GPU lost its driver: the record is freed once nothing is charged
    /// to it, and found by no lookup meanwhile.
    retired: bool,
    live: u64,
    pinned: u64,
    max_pinned: u64,
    /// The GPU driver's topology verdicts for this GPU's peers below a
    /// common bridge and not.
    gate: (Verdict, Verdict),
    /// The last failed question's errno and the questions failed in a row;
    /// the registrations to let pass before asking again.
    gate_err: i32,
    gate_fails: u32,
    gate_skip: u32,
    /// Questions recorded, so that one asked meanwhile is seen.
    gate_asked: u32,
    /// The platform observed when the driver could not be asked.
    platform: Platform,
    /// BAR1 bytes pinned, each run once (`bar1_charge`), their peak, and
    /// the pins the BAR1 guard refused.
    bar1_used: u64,
    bar1_max: u64,
    bar1_refused: u64,
}

/// One process with live registrations; free while `live` is 0.
#[derive(Clone, Copy)]
struct ProcRec {
    tgid: u32,
    live: u32,
    pinned: u64,
}

/// The records.
///
/// # Invariants
///
/// No pair at or past `pair_end`, and no GPU at or past `gpu_end`, is in use:
/// lookups scan only the slots that were ever used.
struct Tables {
    pairs: [PairRec; PAIRS],
    gpus: [GpuRec; GPUS],
    procs: [ProcRec; PROCS],
    pair_end: usize,
    gpu_end: usize,
    /// Every GPU's pinned BAR1 runs with their pins (`bar1_charge`).
    runs: Option<RBTree<RunKey, u32>>,
}

/// A pinned run of a GPU's BAR1: the GPU's slot, its first 64 KiB page in
/// the BAR, and its pages.
type RunKey = (u8, u32, u32);

const FREE_PAIR: PairRec = PairRec {
    gpu: 0,
    peer: 0,
    path: Path {
        class: Class::Sys,
        acs_redirect: false,
        shares_bridge: false,
    },
    iommu: 0,
    registrations: 0,
    policy_refusals: 0,
    failures: [0; ERRNO_SLOTS],
    last_failure: 0,
    refusal_logged: false,
};

const FREE_GPU: GpuRec = GpuRec {
    bar_start: 0,
    bar_end: 0,
    id: 0,
    retired: false,
    live: 0,
    pinned: 0,
    max_pinned: 0,
    gate: (Verdict::Unknown, Verdict::Unknown),
    gate_err: 0,
    gate_fails: 0,
    gate_skip: 0,
    gate_asked: 0,
    platform: Platform {
        over: 0,
        passthrough: false,
        flagged_chipset: false,
    },
    bar1_used: 0,
    bar1_max: 0,
    bar1_refused: 0,
};

const FREE_PROC: ProcRec = ProcRec {
    tgid: 0,
    live: 0,
    pinned: 0,
};

global_lock! {
    // SAFETY: initialised by `Watch::new`, at load, before any client is
    // registered, so before any record is used.
    unsafe(uninit) static TABLES: SpinLock<Tables> = Tables {
        pairs: [FREE_PAIR; PAIRS],
        gpus: [FREE_GPU; GPUS],
        procs: [FREE_PROC; PROCS],
        pair_end: 0,
        gpu_end: 0,
        runs: None,
    };
}

global_lock! {
    // SAFETY: initialised by `Watch::new`, at load, before any client is
    // registered, so before any registration asks the GPU driver.
    unsafe(uninit) static ASKING: Mutex<()> = ();
}

/// Runs `ask`, one question to the GPU driver about topology verdicts at a
/// time (see `topology::learn_gate`).
pub(crate) fn asking(ask: impl FnOnce()) {
    let _one = ASKING.lock();
    ask();
}

/// A GPU's record, as read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gpu {
    pub(crate) slot: usize,
    pub(crate) id: u32,
    /// The first byte of its BAR: which GPU the slot held when read.
    start: u64,
    /// The GPU driver's topology verdicts for this GPU's peers below a
    /// common bridge and not, and the errno of the last failed question.
    pub(crate) gate: (Verdict, Verdict),
    pub(crate) gate_err: i32,
    pub(crate) gate_asked: u32,
    /// The platform observed, where a verdict is [`Verdict::Unverified`].
    pub(crate) platform: Platform,
}

fn live_gpu(t: &Tables, slot: usize) -> Option<Gpu> {
    let g = &t.gpus[slot];
    (g.bar_start != 0 && !g.retired).then_some(Gpu {
        slot,
        id: g.id,
        start: g.bar_start,
        gate: g.gate,
        gate_err: g.gate_err,
        gate_asked: g.gate_asked,
        platform: g.platform,
    })
}

fn gpu_in(t: &Tables, phys: u64) -> Option<Gpu> {
    (0..t.gpu_end)
        .filter(|&i| (t.gpus[i].bar_start..=t.gpus[i].bar_end).contains(&phys))
        .find_map(|i| live_gpu(t, i))
}

fn pair_in(t: &Tables, gpu: u32, peer: u32) -> Option<(Pair, Class)> {
    let slot = t.pairs[..t.pair_end]
        .iter()
        .position(|p| (p.gpu, p.peer) == (gpu, peer))?;
    let path = t.pairs[slot].path;
    let pair = Pair {
        slot,
        shares_bridge: path.shares_bridge,
    };
    Some((pair, path.class))
}

/// The GPU whose BAR holds `phys`, if known.
pub(crate) fn gpu_by_phys(phys: u64) -> Option<Gpu> {
    gpu_in(&TABLES.lock(), phys)
}

/// The GPU whose BAR holds `phys` and its pair with the device `peer`, with
/// the pair's class, if both are known (one look at the tables).
pub(crate) fn known_pair(phys: u64, peer: u32) -> Option<(Gpu, Pair, Class)> {
    let t = TABLES.lock();
    let gpu = gpu_in(&t, phys)?;
    let (pair, class) = pair_in(&t, gpu.id, peer)?;
    Some((gpu, pair, class))
}

/// Records a GPU whose BAR is `[start, end]` (or finds it, recorded by
/// another thread meanwhile); `None` when the table is full.
pub(crate) fn add_gpu(id: u32, start: u64, end: u64) -> Option<Gpu> {
    let mut t = TABLES.lock();
    if let Some(g) =
        (0..t.gpu_end).find_map(|i| live_gpu(&t, i).filter(|_| t.gpus[i].bar_start == start))
    {
        return Some(g);
    }
    let slot = t.gpus.iter().position(|g| g.bar_start == 0)?;
    // INVARIANT: the slot in use is below the end.
    t.gpu_end = t.gpu_end.max(slot + 1);
    // A freed slot starts anew (a rebind may bring another BAR).
    t.gpus[slot] = GpuRec {
        bar_start: start,
        bar_end: end,
        id,
        ..FREE_GPU
    };
    Some(Gpu {
        slot,
        id,
        start,
        gate: FREE_GPU.gate,
        gate_err: 0,
        gate_asked: 0,
        platform: FREE_GPU.platform,
    })
}

/// Whether `gpu`'s topology verdicts are to be asked now: one is not
/// learnt, and the registrations to let pass after failed questions have.
pub(crate) fn gate_due(gpu: Gpu) -> bool {
    let mut t = TABLES.lock();
    let g = &mut t.gpus[gpu.slot];
    let learnt = g.gate.0 != Verdict::Unknown && g.gate.1 != Verdict::Unknown;
    if g.bar_start != gpu.start || learnt {
        return false;
    }
    if g.gate_skip > 0 {
        g.gate_skip -= 1;
        return false;
    }
    true
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
    let g = &mut t.gpus[gpu.slot];
    if g.bar_start != gpu.start {
        return;
    }
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

/// A pair's slot and what is known of its path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pair {
    pub(crate) slot: usize,
    /// An upstream bridge above both devices (`Path::shares_bridge`).
    pub(crate) shares_bridge: bool,
}

/// Records a classified pair in one of the first `pair_table_slots` slots.
/// Returns its slot and whether this call created it (the caller then logs
/// it once); `None` when those slots are full.
pub(crate) fn add_pair(gpu: u32, peer: u32, path: Path, iommu: u32) -> Option<(Pair, bool)> {
    let mut t = TABLES.lock();
    let slots = &mut t.pairs[..crate::params::pair_slots()];
    let (slot, new) = match slots.iter().position(|p| (p.gpu, p.peer) == (gpu, peer)) {
        Some(slot) => (slot, false),
        None => (slots.iter().position(|p| (p.gpu, p.peer) == (0, 0))?, true),
    };
    if new {
        // A reused slot starts with the new pair's own counts.
        slots[slot] = PairRec {
            gpu,
            peer,
            path,
            iommu,
            ..FREE_PAIR
        };
    }
    let shares_bridge = slots[slot].path.shares_bridge;
    // INVARIANT: the slot in use is below the end.
    t.pair_end = t.pair_end.max(slot + 1);
    Some((
        Pair {
            slot,
            shares_bridge,
        },
        new,
    ))
}

/// The PCI device `id` lost its driver: the pairs it is part of are
/// forgotten (no registration maps for it any more: the core keeps a peer
/// bound while it maps for it), and so is its GPU record once nothing is
/// charged to it (a rebind may bring another BAR, whose first registration
/// records it anew).
pub(crate) fn forget_device(id: u32) {
    let mut t = TABLES.lock();
    for p in t.pairs.iter_mut().filter(|p| p.gpu == id || p.peer == id) {
        *p = FREE_PAIR;
    }
    for g in t.gpus.iter_mut().filter(|g| g.bar_start != 0 && g.id == id) {
        g.retired = true;
        if g.live == 0 && g.bar1_used == 0 {
            *g = FREE_GPU;
        }
    }
}

impl Pair {
    /// A registration failed on this pair with `errno` (positive).
    pub(crate) fn failed(&self, errno: i32) {
        let i = errno_slot(errno);
        let mut t = TABLES.lock();
        t.pairs[self.slot].failures[i] += 1;
        t.pairs[self.slot].last_failure = i as u32 + 1;
    }

    /// The path policy refused a registration on this pair.
    pub(crate) fn refused_by_policy(&self) {
        TABLES.lock().pairs[self.slot].policy_refusals += 1;
        self.failed(1);
    }

    /// True the first time the GPU driver's refusal of this pair is explained.
    pub(crate) fn first_refusal(&self) -> bool {
        let mut t = TABLES.lock();
        !core::mem::replace(&mut t.pairs[self.slot].refusal_logged, true)
    }
}

/// What one mapped registration is counted under; released once.
///
/// # Invariants
///
/// Built only by [`charge`], which added exactly what [`Charge::release`]
/// subtracts when given the same byte count.
pub(crate) struct Charge {
    /// The GPU's slot + 1 (an `Option<Charge>` in every registration stays
    /// 4 bytes).
    gpu: core::num::NonZeroU16,
    /// The process's slot, or [`NO_PROC`].
    proc_slot: u16,
}

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
    let g = t.gpus[gpu.slot];
    let page = |b: u64| (b / crate::range::GPU_PAGE_SIZE) as u32;
    let key = (gpu.slot as u8, page(phys - g.bar_start), page(len));
    let bar = Bar1 {
        gpu: key.0,
        page: core::num::NonZeroU32::MIN.saturating_add(key.1),
    };
    let runs = t.runs.get_or_insert_with(RBTree::new);
    if let Some(pins) = runs.get_mut(&key) {
        *pins += 1;
        return Bar1Charged::Yes(bar);
    }
    if let Err(r) = t.gpus[gpu.slot].bar1_add(len, pct, node.is_ok()) {
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
            let gpu = self.id;
            return Err(Bar1Refusal {
                gpu,
                use_after,
                limit,
                size,
            });
        }
        self.bar1_used = use_after;
        self.bar1_max = self.bar1_max.max(use_after);
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
        let Some(runs) = t.runs.as_mut() else {
            return;
        };
        let Some(pins) = runs.get_mut(&key) else {
            return;
        };
        *pins -= 1;
        if *pins > 0 {
            return;
        }
        // Freed after the lock (the tree's node).
        let node = runs.remove_node(&key);
        let g = &mut t.gpus[usize::from(self.gpu)];
        g.bar1_used -= len;
        if g.retired && g.live == 0 && g.bar1_used == 0 {
            *g = FREE_GPU;
        }
        drop(guard);
        drop(node);
    }
}

/// No process slot was free: the process is not counted.
const NO_PROC: u16 = u16::MAX;

/// The slot of process `tgid` in its shard of [`PROCS_PER_SHARD`] slots: the
/// record that carries its id, else a free one (`None`: the shard is full).
/// A record keeps its process's id when its count drops to 0, until another
/// process takes the free slot: a process that registers again finds its
/// slot at once, and no two records carry one id.
fn proc_slot(t: &Tables, tgid: u32) -> Option<usize> {
    let first = tgid as usize % (PROCS / PROCS_PER_SHARD) * PROCS_PER_SHARD;
    let mut shard = first..first + PROCS_PER_SHARD;
    shard
        .clone()
        .find(|&i| t.procs[i].tgid == tgid)
        .or_else(|| shard.find(|&i| t.procs[i].live == 0))
}

/// Counts a mapped registration of `bytes` on `pair` and `gpu`, made by the
/// process `tgid`; `None` when `gpu`'s record was freed since it was read
/// (its device unbound, the slot maybe another GPU's now): nothing to count
/// it on.
pub(crate) fn charge(pair: Option<Pair>, gpu: Gpu, tgid: u32, bytes: u64) -> Option<Charge> {
    let mut t = TABLES.lock();
    if t.gpus[gpu.slot].bar_start != gpu.start {
        return None;
    }
    if let Some(pair) = pair {
        t.pairs[pair.slot].registrations += 1;
    }
    let g = &mut t.gpus[gpu.slot];
    g.live += 1;
    g.pinned += bytes;
    g.max_pinned = g.max_pinned.max(g.pinned);
    let slot = proc_slot(&t, tgid);
    if let Some(i) = slot {
        let p = &mut t.procs[i];
        (p.tgid, p.live, p.pinned) = (tgid, p.live + 1, p.pinned + bytes);
    }
    // INVARIANT: what `release` subtracts was added here.
    Some(Charge {
        gpu: core::num::NonZeroU16::MIN.saturating_add(gpu.slot as u16),
        proc_slot: slot.map_or(NO_PROC, |i| i as u16),
    })
}

impl Charge {
    /// The registration's pin ended; `bytes` is what it was charged with.
    pub(crate) fn release(self, bytes: u64) {
        let mut t = TABLES.lock();
        let g = &mut t.gpus[usize::from(self.gpu.get() - 1)];
        g.live -= 1;
        g.pinned -= bytes;
        if g.retired && g.live == 0 && g.bar1_used == 0 {
            *g = FREE_GPU;
        }
        if let Some(p) = t.procs.get_mut(usize::from(self.proc_slot)) {
            p.live -= 1;
            p.pinned -= bytes;
        }
    }
}

/// `dev` lost its driver (C shim, bus notifier).
#[no_mangle]
extern "C" fn peermem_device_unbound(dev: *mut kernel::bindings::device) {
    let (mut id, mut seg) = (0u32, 0);
    // SAFETY: the notifier's device, alive during the notification; valid
    // out-pointers.
    if !unsafe { crate::ffi::peermem_peer_of(dev, &mut id, &mut seg) }.is_null() {
        forget_device(id);
    }
}

/// Whether the PCI device `id` was a registration's `dma_device` (it has a
/// pair): an RDMA peer the GPU driver may be asked about (C shim,
/// `peermem_gate_candidate`).
#[no_mangle]
extern "C" fn peermem_known_peer(id: u32) -> bool {
    let t = TABLES.lock();
    t.pairs[..t.pair_end]
        .iter()
        .any(|p| p.peer == id && (p.gpu, p.peer) != (0, 0))
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
        unsafe { TABLES.init() };
        // SAFETY: as above.
        unsafe { ASKING.init() };
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

/// Writes the records of `table` that `used` says are in use, one at a
/// time, each copied out under the lock (writing may sleep).
fn show_each<R: Copy, const N: usize>(
    f: &mut fmt::Formatter<'_>,
    table: fn(&Tables) -> &[R; N],
    used: fn(&R) -> bool,
    mut line: impl FnMut(&mut fmt::Formatter<'_>, &R) -> fmt::Result,
) -> fmt::Result {
    for i in 0..N {
        let r = table(&TABLES.lock())[i];
        if used(&r) {
            line(f, &r)?;
        }
    }
    Ok(())
}

/// The `stats/paths` view.
pub(crate) fn show_paths(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    show_each(
        f,
        |t| &t.pairs,
        |p| p.gpu != 0 || p.peer != 0,
        |f, p| {
            let iommu = IOMMU_NAMES
                .get(p.iommu as usize)
                .copied()
                .unwrap_or("other");
            write!(
                f,
                "gpu={} hca={} class={} acs_redirect={} iommu={iommu} registrations={} failures=",
                Bdf(p.gpu),
                Bdf(p.peer),
                p.path.class.name(),
                u32::from(p.path.acs_redirect),
                p.registrations,
            )?;
            let mut sep = "";
            for (i, n) in p.failures.iter().enumerate().filter(|(_, n)| **n > 0) {
                write!(f, "{sep}{}:{n}", slot_name(i))?;
                sep = ",";
            }
            let last = match p.last_failure {
                0 => "-",
                i => slot_name(i as usize - 1),
            };
            let none = if sep.is_empty() { "-" } else { "" };
            writeln!(
                f,
                "{none} last_failure={last} policy_refusals={}",
                p.policy_refusals
            )
        },
    )
}

fn verdict_name(v: Verdict) -> &'static str {
    match v {
        Verdict::Unknown => "unknown",
        Verdict::Open => "open",
        Verdict::Refused => "refused",
        Verdict::Unverified => "unverified",
    }
}

/// The `stats/gpus` view.
pub(crate) fn show_gpus(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    show_each(
        f,
        |t| &t.gpus,
        |g| g.bar_start != 0 && !g.retired,
        |f, g| {
            let (near, far) = g.gate;
            writeln!(
            f,
            "gpu={} live={} pinned_bytes={} max_pinned_bytes={} gate_shared_bridge={} gate_other={} bar1_size={} bar1_used={} max_bar1_used={} bar1_refused={}",
            Bdf(g.id),
            g.live,
            g.pinned,
            g.max_pinned,
            verdict_name(near),
            verdict_name(far),
            g.bar_end - g.bar_start + 1,
            g.bar1_used,
            g.bar1_max,
            g.bar1_refused,
        )
        },
    )
}

/// The `stats/processes` view. The name is the process's when the file is read;
/// empty when it has exited (its registrations' pins wait for the GPU
/// driver's free callback).
pub(crate) fn show_processes(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    show_each(
        f,
        |t| &t.procs,
        |p| p.live != 0,
        |f, p| {
            write!(f, "tgid={} comm=", p.tgid)?;
            // No spaces: one record per line, fields split by spaces.
            for c in crate::compat::Comm::of(p.tgid).name().chars() {
                write!(f, "{}", if c.is_whitespace() { '_' } else { c })?;
            }
            writeln!(f, " live={} pinned_bytes={}", p.live, p.pinned)
        },
    )
}
