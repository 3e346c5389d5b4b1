// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The device mapping behind the scatterlist the core holds, from one of two
//! back-ends: the client's own (non-persistent pins) or the GPU driver's
//! `nvidia_p2p_dma_map_pages` (persistent pins). Every registration carries
//! one in its lifecycle, so it is as small as the common case allows: one
//! segment keeps its mapping inline and its one scatterlist entry in the
//! registration's slot; several segments, of either back-end, share one
//! allocated representation.
//!
//! Why the client maps non-persistent pins itself: the core calls `dma_map`
//! with the registration's mapping lock held, and the GPU driver takes its
//! API lock inside `nvidia_p2p_dma_map_pages`, while it holds that same lock
//! around the free callback, whose invalidate waits for the mapping lock
//! (docs/driver-facts.md, facts 1-3, 12-13). Mapping the BAR pages ourselves
//! takes no lock of the GPU driver's, so a free racing a registration cannot
//! deadlock. It maps what the driver would (`dma_map_resource` of the BAR bus
//! addresses, fact 4), but one mapping per physically contiguous run, so a
//! translating IOMMU gives one IOVA range (and one scatterlist entry) per run
//! instead of one per 64 KiB page.
//!
//! Coherent (C2C) GPU memory (fact 6) is not behind a BAR: it is cacheable
//! system memory at the table's addresses. It is mapped as memory, not as
//! MMIO, and only where the device reaches it coherently with no bounce
//! buffer (`DMA_ATTR_REQUIRE_COHERENT`, meant for RDMA): the mapping fails
//! rather than hand the HCA a copy.

use core::{
    cell::Cell,
    ptr::NonNull, //
};

use kernel::{
    bindings::{
        self,
        device, //
    },
    prelude::*,
};

use crate::{
    coalesce::{
        Coalescer,
        Runs,
        Segment, //
    },
    compat, ffi,
    p2p::{
        DmaMapping,
        Mismatch,
        PageTable,
        PageView, //
    },
    peer_device::PeerDevice,
    range::GPU_PAGE_SIZE,
    sg::{
        self,
        SgSlot,
        SgTable, //
    },
    stats::{
        fail,
        At,
        Cause, //
    },
};

/// A registration's device mapping (the lifecycle's `Map`).
///
/// # Invariants
///
/// A `Run` or `Provider` map owns the registration's slot, which holds its
/// one entry from the map's construction until it is dropped.
pub(crate) enum DeviceMap {
    /// The client's own mapping of one BAR (or coherent) run; `None` once
    /// the device lost access (the entry stays for the core).
    Run(Option<RunIova>),
    /// The GPU driver's mapping of a persistent pin, in one segment.
    Provider { _run: ProviderRun },
    /// Several segments (rare: pages apart), in an allocation of their own,
    /// out of every registration's size.
    Several(KBox<Several>),
}

// One registration carries one inline (in an `Option`): keep it small.
const _: () = assert!(core::mem::size_of::<Option<DeviceMap>>() <= 24);

/// Several segments' mappings, of either back-end, with their scatterlist.
///
/// # Invariants
///
/// Every entry of `sg` lies in `_provider`'s mapping or, while `runs` is
/// `Some`, in one of its runs (a persistent pin's are none); once the device
/// lost access (`runs` taken), `sg` only holds addresses that nobody may use
/// any more.
pub(crate) struct Several {
    // Drop order: the scatterlist the core saw goes first, then the
    // mappings it names (nothing reads it meanwhile).
    sg: SgTable,
    runs: Option<KVec<RunIova>>,
    _provider: Option<ProviderRun>,
}

/// The device's access to revoked pages, undone by dropping it (outside any
/// spinlock).
pub(crate) enum DeviceAccess {
    /// One run.
    Run { _iova: RunIova },
    /// Several runs.
    Runs { _iovas: KVec<RunIova> },
}

impl DeviceMap {
    /// The map of the scatterlist `sg` (`None`: one segment, its entry in
    /// the registration's slot) and the mappings it was built from: the
    /// client's own of BAR `runs`, or the GPU driver's (`provider`).
    fn new(
        sg: Option<SgTable>,
        mut runs: KVec<RunIova>,
        provider: Option<ProviderRun>,
    ) -> Result<Self> {
        // INVARIANT: the slot holds the one segment's entry, or `sg` was
        // built from exactly these mappings.
        Ok(match (sg, provider) {
            (None, Some(_run)) => DeviceMap::Provider { _run },
            (None, None) => DeviceMap::Run(runs.pop()),
            (Some(sg), _provider) => {
                let runs = Some(runs);
                DeviceMap::Several(KBox::new(
                    Several {
                        sg,
                        runs,
                        _provider,
                    },
                    GFP_KERNEL,
                )?)
            }
        })
    }

    /// The scatterlist's header, to hand to the core; `slot` is the slot
    /// this map was built with.
    pub(crate) fn header(&self, slot: &SgSlot) -> bindings::sg_table {
        match self {
            DeviceMap::Several(s) => s.sg.header(),
            // The slot holds this map's entry (type invariant).
            DeviceMap::Run(_) | DeviceMap::Provider { .. } => slot.header(),
        }
    }

    /// After a revoke: the device's mappings, to undo now. The scatterlist
    /// itself stays until the core unmaps or releases: a core may still read
    /// it until then. OFED 4.x walks it between `dma_map` and arming the
    /// invalidation notifier, when a free callback only marks the
    /// registration and returns (docs/driver-facts.md, OFED 4.x
    /// `mr_umem_get()` / `mlx5_ib_cont_pages()`); the ofed4 end-to-end mode
    /// uses it after the callback and KASAN reports it if it was freed. A
    /// persistent pin has no free callback, so no revoke reaches its mapping.
    pub(crate) fn take_device_access(&mut self) -> Option<DeviceAccess> {
        match self {
            DeviceMap::Run(r) => r.take().map(|_iova| DeviceAccess::Run { _iova }),
            // INVARIANT: from here on `sg` is memory only.
            DeviceMap::Several(s) => s.runs.take().map(|_iovas| DeviceAccess::Runs { _iovas }),
            DeviceMap::Provider { .. } => None,
        }
    }
}

/// The client's DMA mapping of one BAR run for one device, undone on drop.
///
/// # Invariants
///
/// `[iova, iova + len)` is a live mapping for `dev`, by `dma_map_resource`
/// or, if `coherent`, by `dma_map_phys` as coherent memory, undone exactly
/// once, on drop, by the matching call; `dev` stays alive while the core
/// keeps the registration (it holds the device until it released the
/// registration, which waits for this mapping to be dropped).
pub(crate) struct RunIova {
    dev: NonNull<device>,
    iova: u64,
    len: u32,
    coherent: bool,
}

// SAFETY: the device pointer is only handed to the DMA API, callable from any
// thread.
unsafe impl Send for RunIova {}

impl Drop for RunIova {
    fn drop(&mut self) {
        let (d, len) = (self.dev.as_ptr(), u64::from(self.len));
        // SAFETY: mapped for `dev` as `coherent` says, undone once (type
        // invariant).
        unsafe { ffi::peermem_unmap_run(d, self.iova, len, self.coherent) };
    }
}

/// The runs of `pages` (at most `max_seg` bytes each); `Err` if a page has
/// no address.
pub(crate) fn runs<'a>(
    pages: &'a PageView<'_>,
    max_seg: u64,
    missing: &'a Cell<bool>,
) -> impl Iterator<Item = Result<Segment>> + 'a {
    let addr = move |i| {
        pages.physical_address(i).unwrap_or_else(|| {
            missing.set(true);
            0
        })
    };
    Runs::of(pages.len(), addr, GPU_PAGE_SIZE, max_seg).map(move |run| {
        if missing.get() {
            Err(EINVAL)
        } else {
            Ok(run)
        }
    })
}

impl DeviceMap {
    /// The client's own mapping of every page of `pages` for `peer`, one
    /// mapping per run (BAR pages as MMIO, coherent memory as memory), with
    /// their scatterlist: one run's entry in `slot`, several in an allocated
    /// table.
    ///
    /// # Safety
    ///
    /// The pages must stay pinned until the returned map is dropped: the
    /// unpin comes after `dma_unmap`/`release` dropped it, and a free
    /// callback drops the device's access before it returns
    /// (`take_device_access`). `peer` must be a device the core keeps alive
    /// as long. `slot` is the registration's, and no other map of it uses
    /// the slot while the returned one lives (see [`sg::build`]).
    pub(crate) unsafe fn bar(
        pages: &PageView<'_>,
        peer: &PeerDevice,
        slot: &SgSlot,
    ) -> Result<Self> {
        let dev = NonNull::new(peer.dev()).ok_or(EINVAL)?;
        let (coherent, missing) = (pages.coherent(), Cell::new(false));
        let (mut first, mut iovas) = (None, KVec::new());
        for run in runs(pages, peer.max_segment(), &missing) {
            let Segment { addr, len } = run?;
            // Runs are bounded to `u32::MAX` bytes (`Runs`).
            let len32 = u32::try_from(len).map_err(|_| EINVAL)?;
            let mut iova = 0u64;
            // SAFETY: a live device, memory of the caller's pinned table
            // (caller), every page with an address (checked by `runs`).
            kernel::error::to_result(unsafe {
                ffi::peermem_map_run(dev.as_ptr(), addr, len, coherent, &mut iova)
            })?;
            // INVARIANT: mapped just above; undone by `drop` on any failure.
            let run = RunIova {
                dev,
                iova,
                len: len32,
                coherent,
            };
            add(&mut first, &mut iovas, run)?;
        }
        let segs = Iterator::chain(first.iter(), &iovas).map(|r| Segment {
            addr: r.iova,
            len: u64::from(r.len),
        });
        let n = usize::from(first.is_some()) + iovas.len();
        // SAFETY: the slot is this map's (caller). No run: refused by `build`.
        let sg = unsafe { sg::build(slot, n, segs) }?;
        match first {
            // One run, one segment: its entry is in the slot (`sg` is `None`).
            Some(run) => Ok(DeviceMap::Run(Some(run))),
            None => Self::new(sg, iovas, None),
        }
    }
}

/// Adds `run` to the runs mapped so far: the first waits outside `rest` until
/// a second comes, so that one run (the common case) allocates nothing.
fn add(first: &mut Option<RunIova>, rest: &mut KVec<RunIova>, run: RunIova) -> Result {
    match first.take() {
        None if rest.is_empty() => *first = Some(run),
        f => {
            if let Some(f) = f {
                rest.push(f, GFP_KERNEL)?;
            }
            rest.push(run, GFP_KERNEL)?;
        }
    }
    Ok(())
}

/// What `nvidia_p2p_dma_map_pages` gave for a persistent pin, undone through
/// `nvidia_p2p_dma_unmap_pages` on drop.
///
/// # Invariants
///
/// `table` aliases a persistent pin (no free callback can free it) that the
/// registration unpins only after dropping this mapping; `mapping` was made
/// from it, passed [`DmaMapping::check`], and is undone once, on drop, for
/// the device it was made for.
pub(crate) struct ProviderRun {
    mapping: Option<DmaMapping>,
    table: PageTable,
}

// SAFETY: provider tokens; the provider's API may be called from any thread.
unsafe impl Send for ProviderRun {}

impl Drop for ProviderRun {
    fn drop(&mut self) {
        let Some(m) = self.mapping.take() else { return };
        // SAFETY: the table is still pinned and `m` was made from it and
        // checked (type invariant), so it names the device it was made for.
        if let Err(e) = unsafe { self.table.dma_unmap(m.peer(), m) } {
            // The table stays linked with the mapping; the unpin that follows
            // frees both at the provider.
            fail!(Cause::Unpin, e, "nvidia_p2p_dma_unmap_pages failed");
        }
    }
}

impl DeviceMap {
    /// The GPU driver's mapping of `table` (pinned persistently, `entries`
    /// pages) for `peer`, checked, with its scatterlist: its one entry in
    /// `slot`, or an allocated table of one entry per page at most, as many
    /// as the C module allocates.
    ///
    /// # Safety
    ///
    /// `table` is an alias of a persistent pin that stays pinned until the
    /// returned map is dropped; `slot` is as for [`sg::build`].
    pub(crate) unsafe fn persistent(
        table: PageTable,
        entries: u32,
        peer: &PeerDevice,
        slot: &SgSlot,
        at: At,
    ) -> Result<Self> {
        let pdev = peer.pci();
        // SAFETY: the table is pinned (caller) and `peer` is live.
        let mapping = unsafe { table.dma_map(pdev) }
            .map_err(|e| fail!(at at; Cause::DmaMap, e, "nvidia_p2p_dma_map_pages failed"))?;
        // SAFETY: made just now, valid until undone (below, or by the run);
        // its addresses are read only once it passed the check.
        let checked = unsafe { mapping.check(entries).map(|()| mapping.addresses()) };
        let sg = checked.map_err(|m| unsupported(at, m)).and_then(|addrs| {
            let segs = Coalescer::new(addrs, GPU_PAGE_SIZE, peer.max_segment());
            // SAFETY: the slot is this map's (caller).
            unsafe { sg::build(slot, entries as usize, segs) }
                .map_err(|e| fail!(at at; Cause::NoMemory, e, "cannot build the scatterlist"))
        });
        let sg = match sg {
            Ok(sg) => sg,
            Err(e) => {
                // SAFETY: made just now from the pinned table for `pdev`.
                if let Err(u) = unsafe { table.dma_unmap(pdev, mapping) } {
                    fail!(at at; Cause::Unpin, u, "nvidia_p2p_dma_unmap_pages failed");
                }
                return Err(e);
            }
        };
        // INVARIANT: made for `pdev` from `table` and checked.
        let run = ProviderRun {
            mapping: Some(mapping),
            table,
        };
        Self::new(sg, KVec::new(), Some(run))
            .map_err(|e| fail!(at at; Cause::NoMemory, e, "cannot allocate the scatterlist"))
    }
}

/// The error of a DMA mapping the module cannot read, counted and explained.
fn unsupported(at: At, m: Mismatch) -> Error {
    fail!(at at; Cause::DmaMapping, compat::eopnotsupp(), "unsupported NVIDIA DMA mapping: {m:?}")
}
