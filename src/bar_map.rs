// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The client's own DMA mapping of pinned BAR pages for the peer device, used
//! for non-persistent pins instead of `nvidia_p2p_dma_map_pages`.
//!
//! Why: the core calls `dma_map` with the registration's mapping lock held,
//! and the GPU driver takes its API lock inside `nvidia_p2p_dma_map_pages`,
//! while it holds that same lock around the free callback, whose invalidate
//! waits for the mapping lock (real-driver-behaviour.md, facts 1-3, 12-13).
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

use core::ptr::NonNull;

use kernel::{
    bindings::device,
    prelude::*, //
};

use crate::{
    atomics::Relaxed,
    bar_window::Window,
    coalesce::{
        Runs,
        Segment, //
    },
    device_map::DeviceMap,
    ffi,
    p2p::PageView,
    peer_device::PeerDevice,
    range::GPU_PAGE_SIZE,
    sg::{
        SgSlot,
        SgTable, //
    },
    stats::STATS,
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
        let (d, addr) = (dev.as_ptr(), run.addr);
        // SAFETY: a live device; `run` stays pinned (caller).
        kernel::error::to_result(unsafe {
            match coherent {
                false => ffi::peermem_map_bar(d, addr, run.len, &mut iova),
                true => ffi::peermem_map_coherent(d, addr, run.len, &mut iova),
            }
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
        // SAFETY: mapped for `dev` by the call matching `coherent`, undone
        // once (type invariant).
        unsafe {
            match self.coherent {
                false => ffi::peermem_unmap_bar(d, self.iova, len),
                true => ffi::peermem_unmap_coherent(d, self.iova, len),
            }
        }
    }
}

/// The client's mappings of several BAR runs, with their scatterlist (BAR
/// pages that are not contiguous: rare, so kept in an allocation of its own,
/// out of every registration's size).
///
/// # Invariants
///
/// While `iovas` is `Some`, every entry of `sg` lies in one of its mappings
/// or in the pair's window;
/// once the device lost access (`iovas` taken), `sg` only holds addresses
/// that nobody may use any more.
pub(crate) struct BarMap {
    // Drop order: the scatterlist the core saw goes first, then the IOVAs.
    sg: SgTable,
    iovas: Option<KVec<RunIova>>,
}

/// Maps every page of `pages` for `peer`: one run, with its scatterlist
/// entry in `slot` (no allocation), or several. Runs inside `window` (the
/// pair's whole-BAR mapping, for an untranslated peer) take its addresses;
/// any other is mapped here, coherent memory always.
///
/// # Safety
///
/// `slot` is the registration's, and no other mapping of it uses the slot
/// while the returned one lives (see [`SgSlot::fill`] and
/// [`SgTable::new`]).
pub(crate) unsafe fn map(
    pages: &PageView<'_>,
    peer: &PeerDevice,
    slot: &SgSlot,
    window: Option<Window>,
) -> Result<DeviceMap> {
    let coherent = pages.coherent();
    // No BAR, so no window, behind coherent memory.
    let window = window.filter(|_| !coherent);
    let n = pages.len();
    let dev = NonNull::new(peer.dev()).ok_or(EINVAL)?;
    if n == 1 {
        // One page is one run (a page is never longer than a segment may
        // be): no scan.
        let run = Segment {
            addr: pages.physical_address(0).ok_or(EINVAL)?,
            len: GPU_PAGE_SIZE,
        };
        // SAFETY: BAR memory of the caller's pinned table, pinned as said
        // in `place`; the slot is this mapping's (caller).
        let (seg, own) = unsafe { place(dev, run, window, coherent) }?;
        // SAFETY: the slot is this mapping's (caller).
        return unsafe { one_run(slot, seg, own) };
    }
    // One pass: each run is mapped as soon as it is found; a page
    // without an address fails the whole mapping.
    let missing = core::cell::Cell::new(false);
    let addr = |i| {
        pages.physical_address(i).unwrap_or_else(|| {
            missing.set(true);
            0
        })
    };
    let mut first: Option<(Segment, Option<RunIova>)> = None;
    // Only for a second run: even an empty vector costs a call to the
    // allocator when dropped.
    let mut more: Option<(KVec<Segment>, KVec<RunIova>)> = None;
    let mut in_window = false;
    for run in Runs::new(n, addr, GPU_PAGE_SIZE, peer.max_segment()) {
        if missing.get() {
            return Err(EINVAL);
        }
        // SAFETY: BAR memory of the caller's pinned table, every page with
        // an address (checked above), pinned as said in `place`. On a later
        // failure the locals drop and unmap what was mapped.
        let (seg, own) = unsafe { place(dev, run, window, coherent) }?;
        in_window |= own.is_none();
        if let Some(f) = first.take() {
            let mut v = (KVec::new(), KVec::new());
            push_run(&mut v, f)?;
            more = Some(v);
        }
        match more.as_mut() {
            Some(v) => push_run(v, (seg, own))?,
            None => first = Some((seg, own)),
        }
    }
    if missing.get() {
        return Err(EINVAL);
    }
    if let Some((seg, own)) = first {
        // SAFETY: the slot is this mapping's (caller).
        return unsafe { one_run(slot, seg, own) };
    }
    // No page at all.
    let Some((segs, iovas)) = more else {
        return Err(EINVAL);
    };
    // SAFETY: as promised by the caller.
    let sg = unsafe { SgTable::new(slot, segs.len(), segs.iter().copied()) }?;
    // INVARIANT: the scatterlist was built from exactly these runs, those
    // outside the window mapped by `iovas`.
    let map = DeviceMap::Bar(KBox::new(
        BarMap {
            sg,
            iovas: Some(iovas),
        },
        GFP_KERNEL,
    )?);
    if in_window {
        STATS.window_maps.add(1, Relaxed);
    }
    Ok(map)
}

/// Where the device reaches the GPU bytes `run` (coherent memory if
/// `coherent`, else BAR memory): inside `window`, or through a mapping of its
/// own, made here.
///
/// # Safety
///
/// `run` must be memory of a pinned table, every page with an address,
/// which stays pinned until the returned mapping is dropped: the unpin comes
/// after `dma_unmap`/`release` dropped it, and a free callback drops it
/// before it returns (`take_device_access`). `dev` must be a device the core
/// keeps alive as long.
unsafe fn place(
    dev: NonNull<device>,
    run: Segment,
    window: Option<Window>,
    coherent: bool,
) -> Result<(Segment, Option<RunIova>)> {
    if let Some(seg) = window.and_then(|w| w.segment(run)) {
        return Ok((seg, None));
    }
    // SAFETY: as promised by the caller.
    let iova = unsafe { RunIova::map(dev, run, coherent) }?;
    Ok((iova.segment(), Some(iova)))
}

/// The map of a registration that is one run, placed at `seg` (inside the
/// window without `own`): its entry in `slot`.
///
/// # Safety
///
/// As for [`map`]: `slot` is the registration's, used by this map only.
unsafe fn one_run(slot: &SgSlot, seg: Segment, own: Option<RunIova>) -> Result<DeviceMap> {
    // SAFETY: the slot is this mapping's (caller).
    unsafe { slot.fill(seg) }?;
    // INVARIANT: the slot's entry is this run's.
    Ok(match own {
        Some(run) => DeviceMap::BarRun(Some(run)),
        None => {
            STATS.window_maps.add(1, Relaxed);
            DeviceMap::Window
        }
    })
}

/// Adds a run, with its own mapping if it has one, to the runs of a
/// mapping of several.
fn push_run(
    (segs, iovas): &mut (KVec<Segment>, KVec<RunIova>),
    (seg, own): (Segment, Option<RunIova>),
) -> Result {
    segs.push(seg, GFP_KERNEL)?;
    if let Some(o) = own {
        iovas.push(o, GFP_KERNEL)?;
    }
    Ok(())
}

impl BarMap {
    /// The device lost access (the core revoked its mkey): the mappings, to
    /// be undone by dropping them, outside any spinlock.
    ///
    /// The scatterlist itself stays until the core unmaps or releases: a core
    /// may still read it until then. OFED 4.x walks it between `dma_map` and
    /// arming the invalidation notifier, when a free callback only marks the
    /// registration and returns (real-driver-behaviour.md, OFED 4.x
    /// `mr_umem_get()` / `mlx5_ib_cont_pages()`); the ofed4 end-to-end mode
    /// uses it after the callback and KASAN reports it if it was freed.
    pub(crate) fn take_device_access(&mut self) -> Option<KVec<RunIova>> {
        // INVARIANT: from here on `sg` is memory only.
        self.iovas.take()
    }

    /// The scatterlist.
    pub(crate) fn sg(&self) -> &SgTable {
        &self.sg
    }
}
