// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The GPU driver's DMA mapping of a persistent pin, with the scatterlist
//! built from it; undone through `nvidia_p2p_dma_unmap_pages` on drop.

use core::ptr::NonNull;

use kernel::{
    bindings::pci_dev,
    prelude::*, //
};

use crate::{
    coalesce::{
        Coalescer,
        Segment, //
    },
    compat,
    device_map::DeviceMap,
    p2p::{
        DmaMapping,
        PageTable, //
    },
    peer_device::PeerDevice,
    range::GPU_PAGE_SIZE,
    sg::{
        SgSlot,
        SgTable, //
    },
    stats::{
        fail,
        Cause, //
    },
};

/// What `nvidia_p2p_dma_map_pages` gave for a persistent pin, undone on
/// drop.
///
/// # Invariants
///
/// `table` aliases a persistent pin (no free callback can free it) that the
/// registration unpins only after dropping this mapping; `mapping` was made
/// from it for `pdev` and is undone once, on drop.
pub(crate) struct ProviderRun {
    mapping: Option<DmaMapping>,
    pdev: NonNull<pci_dev>,
    table: PageTable,
}

// SAFETY: provider tokens; the provider's API may be called from any thread.
unsafe impl Send for ProviderRun {}

impl Drop for ProviderRun {
    #[inline]
    fn drop(&mut self) {
        let Some(m) = self.mapping.take() else { return };
        // SAFETY: the table is still pinned (type invariant) and `m` was
        // made from it for `pdev`.
        if let Err(e) = unsafe { self.table.dma_unmap(self.pdev.as_ptr(), m) } {
            // The table stays linked with the mapping; the unpin that follows
            // frees both at the provider.
            fail!(Cause::Unpin, e, "nvidia_p2p_dma_unmap_pages failed");
        }
    }
}

impl ProviderRun {
    /// Hands the core the one-entry table of this mapping, in `slot`.
    ///
    /// # Safety
    ///
    /// As for [`SgSlot::publish`]: `slot` holds this mapping's entry.
    pub(crate) unsafe fn publish(
        &self,
        slot: &SgSlot,
        head: *mut kernel::bindings::sg_table,
    ) -> u32 {
        // SAFETY: as promised by the caller.
        unsafe { slot.publish(head) }
    }
}

/// The GPU driver's mapping with a scatterlist of several entries (pages
/// that are not contiguous behind an IOMMU), in an allocation of its own.
pub(crate) struct ProviderMap {
    // Drop order: the mapping is undone first, then the scatterlist freed.
    _run: ProviderRun,
    sg: SgTable,
}

impl ProviderMap {
    /// The scatterlist.
    pub(crate) fn sg(&self) -> &SgTable {
        &self.sg
    }
}

/// Maps `table` (pinned persistently, `entries` pages) for `peer` through
/// the GPU driver: one segment with its scatterlist entry in `slot`, or
/// several.
///
/// # Safety
///
/// `table` is an alias of a persistent pin that stays pinned until the
/// returned mapping is dropped; `slot` is as for [`SgSlot::fill`] and
/// [`SgTable::new`].
pub(crate) unsafe fn map(
    table: PageTable,
    entries: u32,
    peer: &PeerDevice,
    slot: &SgSlot,
) -> Result<DeviceMap> {
    let pdev = NonNull::new(peer.pci()).ok_or(EINVAL)?;
    // SAFETY: the table is pinned (caller) and `peer` is live.
    let mapping = unsafe { table.dma_map(pdev.as_ptr()) }
        .map_err(|e| fail!(Cause::DmaMap, e, "nvidia_p2p_dma_map_pages failed"))?;
    // INVARIANT: the mapping was made for `pdev` from `table`; from here
    // on an early return drops `run` and undoes it.
    let run = ProviderRun {
        mapping: Some(mapping),
        pdev,
        table,
    };
    let addrs = match run.mapping.as_ref() {
        // SAFETY: the mapping is valid until dropped.
        Some(m) => unsafe { m.addresses(entries) }.map_err(|m| {
            fail!(
                Cause::DmaMapping,
                compat::eopnotsupp(),
                "unsupported NVIDIA DMA mapping: {m:?}"
            )
        })?,
        None => return Err(EINVAL),
    };
    let max_seg = peer.max_segment();
    let first = match *addrs {
        // One page is one segment (a page is never longer than a segment
        // may be): no scan.
        [addr] => Segment {
            addr,
            len: GPU_PAGE_SIZE,
        },
        _ => Coalescer::new(addrs, GPU_PAGE_SIZE, max_seg)
            .next()
            .ok_or(EINVAL)?,
    };
    // Pages after the first segment: each starts at most one more segment.
    let rest = addrs.len() - (first.len / GPU_PAGE_SIZE) as usize;
    if rest == 0 {
        // SAFETY: the slot is this mapping's (caller).
        unsafe { slot.fill(first) }
            .map_err(|e| fail!(Cause::NoMemory, e, "cannot build the scatterlist"))?;
        return Ok(DeviceMap::ProviderRun(run));
    }
    // One pass over the addresses: the table is sized for one entry per
    // page left (as many as the C module allocates), filled as the
    // segments are found.
    let sg = SgTable::coalesced(rest + 1, addrs, GPU_PAGE_SIZE, max_seg)
        .map_err(|e| fail!(Cause::NoMemory, e, "cannot allocate the scatterlist"))?;
    Ok(DeviceMap::Provider(KBox::new(
        ProviderMap { _run: run, sg },
        GFP_KERNEL,
    )?))
}
