// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The client's own DMA mapping of pinned BAR pages for the peer device, used
//! for non-persistent pins instead of `nvidia_p2p_dma_map_pages`.
//!
//! Why: the core calls `dma_map` with the registration's mapping lock held,
//! and the GPU driver takes its API lock inside `nvidia_p2p_dma_map_pages`,
//! while it holds that same lock around the free callback, whose invalidate
//! waits for the mapping lock (docs/driver-facts.md, facts 1-3, 12-13).
//! Mapping the BAR pages ourselves takes no lock of the GPU driver's, so a
//! free racing a registration cannot deadlock. It maps what the driver would
//! (`dma_map_resource` of the BAR bus addresses, fact 4), but one mapping per
//! physically contiguous run, so a translating IOMMU gives one IOVA range (and
//! one scatterlist entry) per run instead of one per 64 KiB page.
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
        Runs,
        Segment, //
    },
    ffi,
    p2p::PageView,
    peer_device::PeerDevice,
    range::GPU_PAGE_SIZE,
    sg::{
        self,
        SgSlot,
        SgTable, //
    },
};

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

impl RunIova {
    /// Maps the GPU bytes `run` for `dev`: BAR memory, or coherent memory
    /// if `coherent`.
    ///
    /// # Safety
    ///
    /// `run` must be GPU memory of that kind that the GPU driver keeps pinned
    /// until the returned object is dropped, and `dev` a device the core
    /// keeps alive as long.
    unsafe fn map(dev: NonNull<device>, run: Segment, coherent: bool) -> Result<Self> {
        // Runs are bounded to `u32::MAX` bytes (`Runs`).
        let len = u32::try_from(run.len).map_err(|_| EINVAL)?;
        let mut iova = 0u64;
        // SAFETY: a live device; `run` stays pinned (caller).
        kernel::error::to_result(unsafe {
            ffi::peermem_map_run(dev.as_ptr(), run.addr, run.len, coherent, &mut iova)
        })?;
        // INVARIANT: mapped just above, undone by `drop`.
        Ok(Self {
            dev,
            iova,
            len,
            coherent,
        })
    }

    /// The mapped bus range, for the scatterlist.
    fn segment(&self) -> Segment {
        Segment {
            addr: self.iova,
            len: u64::from(self.len),
        }
    }
}

impl Drop for RunIova {
    fn drop(&mut self) {
        let (d, len) = (self.dev.as_ptr(), u64::from(self.len));
        // SAFETY: mapped for `dev` as `coherent` says, undone once (type
        // invariant).
        unsafe { ffi::peermem_unmap_run(d, self.iova, len, self.coherent) };
    }
}

/// The client's mapping of a registration's BAR (or coherent) pages.
///
/// # Invariants
///
/// A `Run` mapping owns the registration's slot, which holds its one entry
/// from the mapping's construction until it is dropped.
pub(crate) enum BarMapping {
    /// One run mapped for the device; `None` once the device lost access
    /// (the entry stays for the core).
    Run(Option<RunIova>),
    /// Several runs.
    Runs(KBox<BarMap>),
}

/// The device's access to revoked pages, undone by dropping it (outside any
/// spinlock).
pub(crate) enum DeviceAccess {
    /// One run.
    Run { _iova: RunIova },
    /// Several runs.
    Runs { _iovas: KVec<RunIova> },
}

impl BarMapping {
    /// The scatterlist's header, to hand to the core; `slot` is the slot
    /// this mapping was built with.
    pub(crate) fn header(&self, slot: &SgSlot) -> bindings::sg_table {
        match self {
            // The slot holds this mapping's entry (type invariant).
            BarMapping::Run(_) => slot.header(),
            BarMapping::Runs(m) => m.sg.header(),
        }
    }

    /// After a revoke: the device's mappings, to undo now. The scatterlist
    /// itself stays until the core unmaps or releases: a core may still read
    /// it until then. OFED 4.x walks it between `dma_map` and arming the
    /// invalidation notifier, when a free callback only marks the
    /// registration and returns (docs/driver-facts.md, OFED 4.x
    /// `mr_umem_get()` / `mlx5_ib_cont_pages()`); the ofed4 end-to-end mode
    /// uses it after the callback and KASAN reports it if it was freed.
    pub(crate) fn take_device_access(&mut self) -> Option<DeviceAccess> {
        match self {
            BarMapping::Run(r) => r.take().map(|_iova| DeviceAccess::Run { _iova }),
            // INVARIANT: from here on `sg` is memory only.
            BarMapping::Runs(m) => m.iovas.take().map(|_iovas| DeviceAccess::Runs { _iovas }),
        }
    }
}

/// The client's mappings of several BAR runs, with their scatterlist (BAR
/// pages that are not contiguous: rare, so kept in an allocation of its own,
/// out of every registration's size).
///
/// # Invariants
///
/// While `iovas` is `Some`, every entry of `sg` lies in one of its mappings;
/// once the device lost access (`iovas` taken), `sg` only holds addresses
/// that nobody may use any more.
pub(crate) struct BarMap {
    // Drop order: the scatterlist the core saw goes first, then the IOVAs.
    sg: SgTable,
    iovas: Option<KVec<RunIova>>,
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
    Runs::new(pages.len(), addr, GPU_PAGE_SIZE, max_seg).map(move |run| {
        if missing.get() {
            Err(EINVAL)
        } else {
            Ok(run)
        }
    })
}

/// Maps every page of `pages` for `peer`, one mapping per run: one run has
/// its scatterlist entry in `slot` (no allocation), several an allocated
/// table. Coherent memory is mapped as memory, BAR pages as MMIO.
///
/// # Safety
///
/// The pages must stay pinned until the returned mapping is dropped: the
/// unpin comes after `dma_unmap`/`release` dropped it, and a free callback
/// drops the device's access before it returns (`take_device_access`).
/// `peer` must be a device the core keeps alive as long. `slot` is the
/// registration's, and no other mapping of it uses the slot while the
/// returned one lives (see [`SgSlot::fill`]).
pub(crate) unsafe fn map(
    pages: &PageView<'_>,
    peer: &PeerDevice,
    slot: &SgSlot,
) -> Result<BarMapping> {
    let dev = NonNull::new(peer.dev()).ok_or(EINVAL)?;
    let missing = Cell::new(false);
    let (mut last, mut iovas) = (None, KVec::new());
    for run in runs(pages, peer.max_segment(), &missing) {
        // SAFETY: memory of the caller's pinned table, every page with an
        // address (checked by `runs`), pinned as long (caller). On a later
        // failure the locals drop and unmap what was mapped.
        let iova = unsafe { RunIova::map(dev, run?, pages.coherent()) }?;
        if let Some(earlier) = last.replace(iova) {
            iovas.push(earlier, GFP_KERNEL)?;
        }
    }
    // No page at all: no run.
    let last = last.ok_or(EINVAL)?;
    let segs = Iterator::chain(iovas.iter(), Some(&last)).map(RunIova::segment);
    // SAFETY: the slot is this mapping's (caller).
    let Some(sg) = unsafe { sg::build(slot, iovas.len() + 1, segs) }? else {
        // INVARIANT: the slot's entry is this run's.
        return Ok(BarMapping::Run(Some(last)));
    };
    iovas.push(last, GFP_KERNEL)?;
    let iovas = Some(iovas);
    // INVARIANT: the scatterlist was built from exactly these runs.
    let map = KBox::new(BarMap { sg, iovas }, GFP_KERNEL)?;
    Ok(BarMapping::Runs(map))
}
