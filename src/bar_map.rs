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

use core::ptr::NonNull;

use kernel::{
    bindings::device,
    prelude::*, //
};

use crate::{
    coalesce::{
        Runs,
        Segment, //
    },
    compat, ffi,
    p2p::PageView,
    peer_device::PeerDevice,
    range::GPU_PAGE_SIZE,
    sg::{
        SgSlot,
        SgTable, //
    },
};

/// The mapped runs: none yet, one inline (a contiguous registration, the
/// common case, costs no allocation), or a vector.
enum Mapped {
    None,
    One(Segment),
    Many(KVec<Segment>),
}

impl Mapped {
    fn as_slice(&self) -> &[Segment] {
        match self {
            Mapped::None => &[],
            Mapped::One(s) => core::slice::from_ref(s),
            Mapped::Many(v) => v,
        }
    }
}

/// DMA mappings of BAR runs for one device, undone on drop.
///
/// # Invariants
///
/// Each segment of `runs` is a live `dma_map_resource` mapping for `dev`,
/// undone exactly once, on drop; `dev` stays alive while the core keeps the
/// registration (it holds the device until it released the registration,
/// which waits for this mapping to be dropped).
pub(crate) struct Iovas {
    dev: NonNull<device>,
    runs: Mapped,
}

impl Iovas {
    /// No mappings yet.
    fn new(dev: NonNull<device>) -> Self {
        // INVARIANT: no segment, nothing to undo.
        Self {
            dev,
            runs: Mapped::None,
        }
    }

    /// Records `seg`: the first inline, more in a vector.
    fn record(&mut self, seg: Segment) -> Result {
        match &mut self.runs {
            Mapped::None => self.runs = Mapped::One(seg),
            Mapped::One(first) => {
                let mut v = KVec::with_capacity(4, GFP_KERNEL)?;
                v.push(*first, GFP_KERNEL)?;
                v.push(seg, GFP_KERNEL)?;
                self.runs = Mapped::Many(v);
            }
            Mapped::Many(v) => v.push(seg, GFP_KERNEL)?,
        }
        Ok(())
    }

    /// Maps the BAR bytes `run` for the device and keeps the mapping.
    ///
    /// # Safety
    ///
    /// `run` must be BAR memory that the GPU driver keeps pinned until this
    /// object is dropped.
    unsafe fn map(&mut self, run: Segment) -> Result {
        let mut dma = 0u64;
        // SAFETY: a live device (type invariant); `run` stays pinned (caller).
        kernel::error::to_result(unsafe {
            ffi::peermem_map_bar(self.dev.as_ptr(), run.addr, run.len, &mut dma)
        })?;
        let seg = Segment {
            addr: dma,
            len: run.len,
        };
        // INVARIANT: the new mapping is recorded, so `drop` undoes it; if it
        // cannot be (no memory), it is undone here instead.
        let recorded = self.record(seg);
        if recorded.is_err() {
            // SAFETY: mapped just above for this device, not recorded.
            unsafe { ffi::peermem_unmap_bar(self.dev.as_ptr(), dma, run.len) };
        }
        recorded
    }
}

impl Drop for Iovas {
    fn drop(&mut self) {
        for r in self.runs.as_slice() {
            // SAFETY: mapped for `dev` by `peermem_map_bar`, undone once
            // (type invariant).
            unsafe { ffi::peermem_unmap_bar(self.dev.as_ptr(), r.addr, r.len) };
        }
    }
}

/// A scatterlist over the client's own mappings of BAR pages.
///
/// # Invariants
///
/// While `iovas` is `Some`, every entry of `sg` lies in one of its mappings;
/// once the device lost access (`iovas` taken), `sg` only holds addresses
/// that nobody may use any more.
pub(crate) struct BarMap {
    // Drop order: the scatterlist the core saw goes first, then the IOVAs.
    sg: SgTable,
    iovas: Option<Iovas>,
}

// SAFETY: the device pointer is only handed to the DMA API, callable from any
// thread; the rest is owned memory.
unsafe impl Send for BarMap {}

impl BarMap {
    /// Maps every page of `pages` for `peer`, with a one-entry scatterlist
    /// in `slot`.
    ///
    /// # Safety
    ///
    /// As for [`SgTable::new`]: `slot` outlives the returned map and no
    /// other scatterlist is built in it while the map lives.
    pub(crate) unsafe fn new(
        pages: &PageView<'_>,
        peer: &PeerDevice,
        slot: &SgSlot,
    ) -> Result<Self> {
        if pages.coherent() {
            // No BAR behind coherent memory: only the GPU driver knows how
            // to map it, and it takes its lock to do so.
            return Err(compat::eopnotsupp());
        }
        let n = pages.len();
        let dev = NonNull::new(peer.dev()).ok_or(EINVAL)?;
        // One pass: each run is mapped as soon as it is found; a page
        // without an address fails the whole mapping.
        let missing = core::cell::Cell::new(false);
        let addr = |i| {
            pages.physical_address(i).unwrap_or_else(|| {
                missing.set(true);
                0
            })
        };
        let mut iovas = Iovas::new(dev);
        for run in Runs::new(n, addr, GPU_PAGE_SIZE, peer.max_segment()) {
            if missing.get() {
                return Err(EINVAL);
            }
            // SAFETY: `run` is BAR memory of the caller's pinned table (every
            // page of it has an address, checked just above), which stays
            // pinned until these mappings are undone: the unpin comes after
            // `dma_unmap`/`release` dropped them, and a free callback drops
            // them before it returns (`take_device_access`). On a later
            // failure `iovas` drops and unmaps what it mapped.
            unsafe { iovas.map(run) }?;
        }
        if missing.get() {
            return Err(EINVAL);
        }
        let count = iovas.runs.as_slice().len();
        // SAFETY: as promised by the caller.
        let sg = unsafe { SgTable::new(slot, count, iovas.runs.as_slice().iter().copied()) }?;
        // INVARIANT: the scatterlist was built from exactly these runs.
        Ok(Self {
            sg,
            iovas: Some(iovas),
        })
    }

    /// The device lost access (the core revoked its mkey): the mappings, to
    /// be undone by dropping them, outside any spinlock.
    ///
    /// The scatterlist itself stays until the core unmaps or releases: a core
    /// may still read it until then. OFED 4.x walks it between `dma_map` and
    /// arming the invalidation notifier, when a free callback only marks the
    /// registration and returns (real-driver-behaviour.md, OFED 4.x
    /// `mr_umem_get()` / `mlx5_ib_cont_pages()`); the ofed4 end-to-end mode
    /// uses it after the callback and KASAN reports it if it was freed.
    pub(crate) fn take_device_access(&mut self) -> Option<Iovas> {
        // INVARIANT: from here on `sg` is memory only.
        self.iovas.take()
    }

    /// The scatterlist.
    pub(crate) fn sg(&self) -> &SgTable {
        &self.sg
    }
}
