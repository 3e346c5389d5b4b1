// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Exact accounting per (GPU, peer) pair, per GPU and per process, readable in
//! debugfs (`paths`, `gpus`, `processes`).
//!
//! Lock-free on the hot path: fixed tables of atomics, looked up by a short
//! scan, filled by compare-and-swap. A new pair or GPU (rare) is classified
//! before its slot is claimed, so no racer ever waits for another; a process
//! slot is claimed and freed with one atomic word holding its tgid and its
//! live count together.

use core::fmt;

use crate::atomics::{
    fence,
    AcqRel,
    Acquire,
    Atomic,
    Relaxed,
    Release,
    SeqCst, //
};

use crate::path::{
    Class,
    Path,
    Verdict, //
};

/// Pairs of (GPU, peer) tracked; `bar_window` keeps one slot per pair.
pub(crate) const PAIRS: usize = 64;
const GPUS: usize = 32;
const PROC_SHARDS: usize = 16;
const PROCS_PER_SHARD: usize = 16;

/// The errnos a registration can fail with that are counted per pair, in the
/// order of [`ERRNO_NAMES`]; anything else counts as the last.
const ERRNOS: [i32; 8] = [14, 12, 95, 22, 5, 1, 16, 0];
const ERRNO_NAMES: [&str; 8] = [
    "EFAULT",
    "ENOMEM",
    "EOPNOTSUPP",
    "EINVAL",
    "EIO",
    "EPERM",
    "EBUSY",
    "EOTHER",
];

fn errno_slot(errno: i32) -> usize {
    ERRNOS[..7]
        .iter()
        .position(|&e| e == errno)
        .unwrap_or(ERRNOS.len() - 1)
}

/// Writes a PCI address (domain << 16 | bus << 8 | devfn).
pub(crate) struct Bdf(pub(crate) u32);

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.0;
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{}",
            v >> 16,
            (v >> 8) & 0xff,
            (v >> 3) & 0x1f,
            v & 7
        )
    }
}

impl kernel::fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// How the peer's DMA is translated by an IOMMU.
pub(crate) const IOMMU_NAMES: [&str; 5] = ["none", "identity", "dma", "dma-fq", "other"];

struct PairSlot {
    /// gpu << 32 | peer; 0: free.
    key: Atomic<u64>,
    ready: Atomic<u32>,
    class: Atomic<u32>,
    acs: Atomic<u32>,
    /// An upstream bridge above both devices (`Path::shares_bridge`).
    shares: Atomic<u32>,
    iommu: Atomic<u32>,
    registrations: Atomic<u64>,
    policy_refusals: Atomic<u64>,
    failures: [Atomic<u64>; ERRNOS.len()],
    /// Errno slot + 1 of the last failure; 0: none.
    last_failure: Atomic<u32>,
    /// The driver's refusal was explained in the log.
    refusal_logged: Atomic<u32>,
}

impl PairSlot {
    const fn new() -> Self {
        Self {
            key: Atomic::new(0),
            ready: Atomic::new(0),
            class: Atomic::new(0),
            acs: Atomic::new(0),
            shares: Atomic::new(0),
            iommu: Atomic::new(0),
            registrations: Atomic::new(0),
            policy_refusals: Atomic::new(0),
            failures: [const { Atomic::new(0) }; ERRNOS.len()],
            last_failure: Atomic::new(0),
            refusal_logged: Atomic::new(0),
        }
    }
}

struct GpuSlot {
    /// First byte of the BAR holding the GPU's pinned pages; 0: free.
    bar_start: Atomic<u64>,
    bar_end: Atomic<u64>,
    id: Atomic<u32>,
    /// Published: `bar_end` and `id` are valid.
    ready: Atomic<u32>,
    /// The GPU lost its driver: 1 until its last registration's charge is
    /// released, then 2 while the slot is freed.
    retired: Atomic<u32>,
    /// Live registrations << LIVE_SHIFT | pinned 64 KiB units: one atomic
    /// update per charge and per release.
    usage: Atomic<u64>,
    /// High-water mark of the pinned units.
    max_units: Atomic<u64>,
    /// The GPU driver's topology verdicts for this GPU's peers: below a
    /// common bridge (bits 0-1) and not (bits 2-3), as [`Verdict`]s, and
    /// [`GATE_LEARNT`] once asked.
    gate: Atomic<u32>,
    /// Attempts to learn `gate`.
    gate_tries: Atomic<u32>,
}

/// In a GPU's `gate` word: the driver was asked (whatever it answered).
const GATE_LEARNT: u32 = 1 << 4;

/// Where a GPU's live count starts in its `usage` word: 2^40 units of 64 KiB
/// (64 EiB) below it, 2^24 live registrations above.
const LIVE_SHIFT: u32 = 40;
const UNITS_MASK: u64 = (1 << LIVE_SHIFT) - 1;
const UNIT: u64 = 64 << 10;

/// What one registration of `bytes` adds to its GPU's `usage` word.
fn usage_step(bytes: u64) -> u64 {
    (1 << LIVE_SHIFT) | bytes.div_ceil(UNIT)
}

impl GpuSlot {
    const fn new() -> Self {
        Self {
            bar_start: Atomic::new(0),
            bar_end: Atomic::new(0),
            id: Atomic::new(0),
            ready: Atomic::new(0),
            retired: Atomic::new(0),
            usage: Atomic::new(0),
            max_units: Atomic::new(0),
            gate: Atomic::new(0),
            gate_tries: Atomic::new(0),
        }
    }
}

struct ProcSlot {
    /// tgid << 32 | live registrations; 0: free.
    owner: Atomic<u64>,
    pinned: Atomic<u64>,
}

impl ProcSlot {
    const fn new() -> Self {
        Self {
            owner: Atomic::new(0),
            pinned: Atomic::new(0),
        }
    }
}

static PAIR_TABLE: [PairSlot; PAIRS] = [const { PairSlot::new() }; PAIRS];
static GPU_TABLE: [GpuSlot; GPUS] = [const { GpuSlot::new() }; GPUS];
static PROC_TABLE: [ProcSlot; PROC_SHARDS * PROCS_PER_SHARD] =
    [const { ProcSlot::new() }; PROC_SHARDS * PROCS_PER_SHARD];

/// A GPU found by one of its BAR addresses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gpu {
    pub(crate) slot: usize,
    pub(crate) id: u32,
}

/// The GPU whose BAR holds `phys`, if known.
pub(crate) fn gpu_by_phys(phys: u64) -> Option<Gpu> {
    GPU_TABLE.iter().enumerate().find_map(|(slot, g)| {
        let start = g.bar_start.load(Acquire);
        (start != 0
            && g.ready.load(Acquire) != 0
            && phys >= start
            && phys <= g.bar_end.load(Relaxed))
        .then(|| Gpu {
            slot,
            id: g.id.load(Relaxed),
        })
    })
}

/// The first and last byte of `gpu`'s BAR.
pub(crate) fn gpu_bar(gpu: Gpu) -> (u64, u64) {
    let g = &GPU_TABLE[gpu.slot];
    (g.bar_start.load(Relaxed), g.bar_end.load(Relaxed))
}

/// The GPU driver's topology verdicts for `gpu`'s peers below a common
/// bridge and not.
pub(crate) fn gpu_gate(gpu: Gpu) -> (Verdict, Verdict) {
    let w = GPU_TABLE[gpu.slot].gate.load(Acquire);
    (Verdict::from_bits(w), Verdict::from_bits(w >> 2))
}

/// Counts one more attempt to learn `gpu`'s topology verdicts; returns the
/// count.
pub(crate) fn gate_attempt(gpu: Gpu) -> u32 {
    GPU_TABLE[gpu.slot].gate_tries.add(1, Relaxed);
    GPU_TABLE[gpu.slot].gate_tries.load(Relaxed)
}

/// Whether the GPU driver's topology verdicts for `gpu` were learnt.
pub(crate) fn gate_learnt(gpu: Gpu) -> bool {
    GPU_TABLE[gpu.slot].gate.load(Relaxed) & GATE_LEARNT != 0
}

/// Records the GPU driver's topology verdicts for `gpu`'s peers; what was not
/// asked counts as [`Verdict::Unverified`] from now on.
pub(crate) fn set_gate(gpu: Gpu, near: Verdict, far: Verdict) {
    let known = |v: Verdict| if v == Verdict::Unknown { Verdict::Unverified } else { v } as u32;
    GPU_TABLE[gpu.slot]
        .gate
        .store(GATE_LEARNT | known(far) << 2 | known(near), Release);
}

/// Records a GPU whose BAR is `[start, end]`; `None` when the table is full.
/// A record is handed out only once published, also to a racer that finds
/// it being made: a BAR window made from it then covers the whole BAR.
pub(crate) fn add_gpu(id: u32, start: u64, end: u64) -> Option<Gpu> {
    for (slot, g) in GPU_TABLE.iter().enumerate() {
        match g.bar_start.cmpxchg(0, start, Acquire) {
            Ok(_) => {
                // A freed slot starts anew (a rebind may bring another BAR).
                g.bar_end.store(end, Relaxed);
                g.id.store(id, Relaxed);
                g.gate.store(0, Relaxed);
                g.gate_tries.store(0, Relaxed);
                g.max_units.store(0, Relaxed);
                g.retired.store(0, Relaxed);
                g.ready.store(1, Release);
                return Some(Gpu { slot, id });
            }
            // Someone is recording this very BAR: its record, once published.
            Err(s) if s == start && g.retired.load(Acquire) == 0 => {
                return published(g, slot, start)
            }
            Err(_) => continue,
        }
    }
    None
}

/// How long a racer waits for another thread's record of the same GPU: the
/// recorder is a few stores from publishing it.
const PUBLISH_SPINS: u32 = 1 << 16;

/// `g`'s record once published, `None` if it is not within
/// [`PUBLISH_SPINS`] or it was retired meanwhile (the caller goes without).
fn published(g: &GpuSlot, slot: usize, start: u64) -> Option<Gpu> {
    for _ in 0..PUBLISH_SPINS {
        if g.bar_start.load(Acquire) != start {
            return None;
        }
        if g.ready.load(Acquire) != 0 {
            return Some(Gpu {
                slot,
                id: g.id.load(Relaxed),
            });
        }
        if g.retired.load(Acquire) != 0 {
            return None;
        }
        crate::atomics::spin_loop();
    }
    None
}

/// The GPU `id` lost its driver: its record is not found any more, and its
/// slot is freed once the last registration charged to it is released (a
/// rebind may bring another BAR, whose first registration records it anew).
pub(crate) fn retire_gpu(id: u32) {
    for g in GPU_TABLE.iter() {
        if g.bar_start.load(Acquire) == 0 || g.ready.load(Acquire) == 0 || g.id.load(Relaxed) != id
        {
            continue;
        }
        g.ready.store(0, Release);
        g.retired.store(1, Release);
        // Against `Charge::release`: one of the two sees the other's write.
        fence(SeqCst);
        free_if_idle(g);
    }
}

/// Frees a retired GPU's slot if nothing is charged to it (once). `retired`
/// is clear again before the slot is, so that the next recorder's slot
/// never reads as retired.
fn free_if_idle(g: &GpuSlot) {
    if g.retired.load(Acquire) == 1
        && g.usage.load(Acquire) == 0
        && g.retired.cmpxchg(1, 2, Acquire).is_ok()
    {
        g.retired.store(0, Relaxed);
        g.bar_start.store(0, Release);
    }
}

/// A pair's slot and what is known of its path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pair {
    pub(crate) slot: usize,
    /// An upstream bridge above both devices (`Path::shares_bridge`).
    pub(crate) shares_bridge: bool,
}

fn pair_key(gpu: u32, peer: u32) -> u64 {
    (u64::from(gpu) << 32) | u64::from(peer) | (1 << 63)
}

/// The pair's slot and class, if it was classified before.
pub(crate) fn find_pair(gpu: u32, peer: u32) -> Option<(Pair, Class)> {
    let key = pair_key(gpu, peer);
    PAIR_TABLE.iter().enumerate().find_map(|(slot, p)| {
        if p.key.load(Acquire) != key || p.ready.load(Acquire) == 0 {
            return None;
        }
        // Read after `ready` (Acquire): the fields of this pair, published
        // before it; the key checked again in case the slot was reused since.
        let pair = Pair {
            slot,
            shares_bridge: p.shares.load(Relaxed) != 0,
        };
        let class = Class::from_level(p.class.load(Relaxed))?;
        fence(Acquire);
        (p.key.load(Relaxed) == key).then_some((pair, class))
    })
}

/// Records a classified pair in one of the first `pair_table_slots` slots.
/// Returns its slot and whether this call created it (the caller then logs
/// it once); `None` when those slots are full.
pub(crate) fn add_pair(gpu: u32, peer: u32, path: Path, iommu: u32) -> Option<(Pair, bool)> {
    let key = pair_key(gpu, peer);
    let slots = crate::pair_slots_parameter();
    for (slot, p) in PAIR_TABLE.iter().enumerate().take(slots) {
        let pair = Pair {
            slot,
            shares_bridge: path.shares_bridge,
        };
        match p.key.cmpxchg(0, key, Acquire) {
            Ok(_) => {
                // A reused slot starts with the new pair's own counts.
                p.registrations.store(0, Relaxed);
                p.policy_refusals.store(0, Relaxed);
                for f in &p.failures {
                    f.store(0, Relaxed);
                }
                p.last_failure.store(0, Relaxed);
                p.refusal_logged.store(0, Relaxed);
                p.class.store(path.class as u32, Relaxed);
                p.acs.store(u32::from(path.acs_redirect), Relaxed);
                p.shares.store(u32::from(path.shares_bridge), Relaxed);
                p.iommu.store(iommu, Relaxed);
                p.ready.store(1, Release);
                return Some((pair, true));
            }
            Err(k) if k == key => return Some((pair, false)),
            Err(_) => continue,
        }
    }
    None
}

/// Frees the slots of the pairs that the PCI device `id` is part of, after
/// `retire(slot)` for each: the device lost its driver, so no registration
/// maps for it any more (the core keeps a peer bound while it maps for it),
/// and the next pairs may take the slots. A pair being recorded is left.
pub(crate) fn forget_pairs_of(id: u32, mut retire: impl FnMut(usize)) {
    for (slot, p) in PAIR_TABLE.iter().enumerate() {
        let key = p.key.load(Acquire);
        let (gpu, peer) = ((key >> 32) as u32 & 0x7fff_ffff, key as u32);
        if key == 0 || (gpu != id && peer != id) || p.ready.load(Acquire) == 0 {
            continue;
        }
        retire(slot);
        p.ready.store(0, Relaxed);
        p.key.store(0, Release);
    }
}

impl Pair {
    fn slot(&self) -> &'static PairSlot {
        &PAIR_TABLE[self.slot]
    }

    /// A registration failed on this pair with `errno` (positive).
    pub(crate) fn failed(&self, errno: i32) {
        let i = errno_slot(errno);
        self.slot().failures[i].add(1, Relaxed);
        self.slot().last_failure.store(i as u32 + 1, Relaxed);
    }

    /// The path policy refused a registration on this pair.
    pub(crate) fn refused_by_policy(&self) {
        self.slot().policy_refusals.add(1, Relaxed);
        self.failed(1);
    }

    /// True the first time the GPU driver's refusal of this pair is explained.
    pub(crate) fn first_refusal(&self) -> bool {
        self.slot().refusal_logged.xchg(1, Relaxed) == 0
    }
}

/// What one mapped registration is counted under; released once.
///
/// # Invariants
///
/// Built only by [`charge`], which added exactly what [`Charge::release`]
/// subtracts when given the same byte count.
///
/// Small (4 bytes, also as an `Option`): it lives in every registration,
/// which knows its byte count.
pub(crate) struct Charge {
    /// The GPU's slot + 1.
    gpu: core::num::NonZeroU16,
    /// The process's slot, or [`NO_PROC`].
    proc_slot: u16,
}

/// No process slot was free: the process is not counted.
const NO_PROC: u16 = u16::MAX;

// The slot numbers fit the compact charge.
const _: () = assert!(core::mem::size_of::<Option<Charge>>() == 4);
const _: () = assert!(GPUS < u16::MAX as usize && PROC_SHARDS * PROCS_PER_SHARD < NO_PROC as usize);

/// Adds one process's registration to its slot (made if needed).
///
/// A process first tries its home slot (one load and one compare-and-swap
/// when the slot is its own or free), then one pass over its shard. Two
/// slots can end up with the same process (its home slot was taken when it
/// claimed another, and freed since); `show_processes` adds them up.
#[inline(always)]
fn proc_add(tgid: u32, bytes: u64) -> Option<usize> {
    let shard = tgid as usize % PROC_SHARDS;
    let home = shard * PROCS_PER_SHARD + (tgid as usize / PROC_SHARDS) % PROCS_PER_SHARD;
    if proc_join(home, tgid, bytes, true) {
        return Some(home);
    }
    proc_add_elsewhere(tgid, bytes)
}

/// `proc_add` when the home slot is another process's: the process's slot
/// elsewhere in the shard, else the first free one.
#[cold]
#[inline(never)]
fn proc_add_elsewhere(tgid: u32, bytes: u64) -> Option<usize> {
    let shard = tgid as usize % PROC_SHARDS;
    let slots = shard * PROCS_PER_SHARD..(shard + 1) * PROCS_PER_SHARD;
    if let Some(i) = slots.clone().find(|&i| proc_join(i, tgid, bytes, false)) {
        return Some(i);
    }
    slots.clone().find(|&i| proc_join(i, tgid, bytes, true))
}

/// Adds a registration of `tgid` to slot `i` if the slot is the process's
/// (or free, with `free_too`).
#[inline(always)]
fn proc_join(i: usize, tgid: u32, bytes: u64, free_too: bool) -> bool {
    let s = &PROC_TABLE[i];
    let me = (u64::from(tgid) << 32) | 1;
    let mut cur = s.owner.load(Relaxed);
    loop {
        let next = match cur {
            0 if free_too => me,
            c if c != 0 && (c >> 32) as u32 == tgid => c + 1,
            _ => return false,
        };
        match s.owner.cmpxchg(cur, next, Acquire) {
            Ok(_) => {
                s.pinned.add(bytes, Relaxed);
                return true;
            }
            Err(now) => cur = now,
        }
    }
}

fn proc_remove(i: usize, bytes: u64) {
    let s = &PROC_TABLE[i];
    s.pinned.fetch_sub(bytes, Relaxed);
    let mut cur = s.owner.load(Relaxed);
    loop {
        // The last registration frees the slot in the same step.
        let next = if cur & 0xffff_ffff == 1 { 0 } else { cur - 1 };
        match s.owner.cmpxchg(cur, next, Release) {
            Ok(_) => return,
            Err(now) => cur = now,
        }
    }
}

/// Counts a mapped registration of `bytes` on `pair` and `gpu`, made by the
/// process `tgid`.
// One call site per client mode (`Route::charge` in each `dma_map`).
#[inline(always)]
pub(crate) fn charge(pair: Option<Pair>, gpu: Gpu, tgid: u32, bytes: u64) -> Charge {
    if let Some(pair) = pair {
        pair.slot().registrations.add(1, Relaxed);
    }
    let g = &GPU_TABLE[gpu.slot];
    let step = usage_step(bytes);
    let now = (g.usage.fetch_add(step, Relaxed) + step) & UNITS_MASK;
    let mut max = g.max_units.load(Relaxed);
    while now > max {
        match g.max_units.cmpxchg(max, now, Relaxed) {
            Ok(_) => break,
            Err(m) => max = m,
        }
    }
    let proc_slot = proc_add(tgid, bytes).map_or(NO_PROC, |i| i as u16);
    // INVARIANT: what `release` subtracts was added here.
    Charge {
        gpu: core::num::NonZeroU16::MIN.saturating_add(gpu.slot as u16),
        proc_slot,
    }
}

impl Charge {
    /// The registration's pin ended; `bytes` is what it was charged with.
    pub(crate) fn release(self, bytes: u64) {
        let g = &GPU_TABLE[usize::from(self.gpu.get() - 1)];
        let step = usage_step(bytes);
        if g.usage.fetch_sub(step, AcqRel) == step {
            // Against `retire_gpu`: one of the two sees the other's write.
            fence(SeqCst);
            free_if_idle(g);
        }
        if self.proc_slot != NO_PROC {
            proc_remove(usize::from(self.proc_slot), bytes);
        }
    }
}

/// debugfs `paths`.
pub(crate) fn show_paths(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    for p in PAIR_TABLE.iter() {
        let key = p.key.load(Acquire);
        if key == 0 || p.ready.load(Acquire) == 0 {
            continue;
        }
        let class = Class::from_level(p.class.load(Relaxed)).map_or("unknown", Class::name);
        let iommu = IOMMU_NAMES
            .get(p.iommu.load(Relaxed) as usize)
            .copied()
            .unwrap_or("other");
        write!(
            f,
            "gpu={} hca={} class={class} acs_redirect={} iommu={iommu} registrations={} failures=",
            Bdf((key >> 32) as u32 & 0x7fff_ffff),
            Bdf(key as u32),
            p.acs.load(Relaxed),
            p.registrations.load(Relaxed),
        )?;
        let mut any = false;
        for (i, name) in ERRNO_NAMES.iter().enumerate() {
            let n = p.failures[i].load(Relaxed);
            if n > 0 {
                write!(f, "{}{name}:{n}", if any { "," } else { "" })?;
                any = true;
            }
        }
        if !any {
            write!(f, "-")?;
        }
        let last = match p.last_failure.load(Relaxed) {
            0 => "-",
            i => ERRNO_NAMES.get(i as usize - 1).copied().unwrap_or("EOTHER"),
        };
        writeln!(
            f,
            " last_failure={last} policy_refusals={}",
            p.policy_refusals.load(Relaxed)
        )?;
    }
    Ok(())
}

fn verdict_name(v: Verdict) -> &'static str {
    match v {
        Verdict::Unknown => "unknown",
        Verdict::Open => "open",
        Verdict::Refused => "refused",
        Verdict::Unverified => "unverified",
    }
}

/// debugfs `gpus`.
pub(crate) fn show_gpus(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    for g in GPU_TABLE.iter() {
        if g.bar_start.load(Acquire) == 0 || g.ready.load(Acquire) == 0 {
            continue;
        }
        let usage = g.usage.load(Relaxed);
        let gate = g.gate.load(Acquire);
        writeln!(
            f,
            "gpu={} live={} pinned_bytes={} max_pinned_bytes={} gate_shared_bridge={} gate_other={}",
            Bdf(g.id.load(Relaxed)),
            usage >> LIVE_SHIFT,
            (usage & UNITS_MASK) * UNIT,
            g.max_units.load(Relaxed) * UNIT,
            verdict_name(Verdict::from_bits(gate)),
            verdict_name(Verdict::from_bits(gate >> 2)),
        )?;
    }
    Ok(())
}

/// debugfs `processes`. The name is the process's when the file is read;
/// empty when it has exited (its registrations' pins wait for the GPU
/// driver's free callback).
pub(crate) fn show_processes(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let tgid_of = |i: usize| {
        let owner = PROC_TABLE[i].owner.load(Acquire);
        (owner != 0).then_some((owner >> 32) as u32)
    };
    for i in 0..PROC_TABLE.len() {
        let Some(tgid) = tgid_of(i) else { continue };
        // One line per process: its first slot sums the others.
        if (0..i).any(|j| tgid_of(j) == Some(tgid)) {
            continue;
        }
        let (mut live, mut pinned) = (0u64, 0u64);
        for s in PROC_TABLE[i..].iter() {
            let owner = s.owner.load(Acquire);
            if owner != 0 && (owner >> 32) as u32 == tgid {
                live += owner & 0xffff_ffff;
                pinned += s.pinned.load(Relaxed);
            }
        }
        let comm = crate::compat::comm_of(tgid);
        let end = comm.iter().position(|&b| b == 0).unwrap_or(16);
        let name = core::str::from_utf8(&comm[..end]).unwrap_or("?");
        write!(f, "tgid={tgid} comm=")?;
        // No spaces: one record per line, fields split by spaces.
        for c in name.chars() {
            write!(f, "{}", if c.is_whitespace() { '_' } else { c })?;
        }
        writeln!(f, " live={live} pinned_bytes={pinned}")?;
    }
    Ok(())
}
