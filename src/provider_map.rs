// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The GPU driver's DMA mapping of a persistent pin, with the scatterlist
//! built from it; undone through `nvidia_p2p_dma_unmap_pages` on drop.

use kernel::prelude::*;

use crate::{
    coalesce::Coalescer,
    compat,
    p2p::{
        DmaMapping,
        PageTable, //
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

/// The GPU driver's mapping of a persistent pin, with its scatterlist.
///
/// # Invariants
///
/// A `Run` mapping owns the registration's slot, which holds its one entry.
pub(crate) enum ProviderMapping {
    /// One segment.
    Run { _run: ProviderRun },
    /// Several segments (rare: pages the driver mapped apart), in an
    /// allocation of their own, out of every registration's size.
    Runs(KBox<ProviderRuns>),
}

/// A mapping of several segments with its scatterlist.
pub(crate) struct ProviderRuns {
    // Drop order: the mapping is undone first, then the scatterlist freed.
    _run: ProviderRun,
    sg: SgTable,
}

impl ProviderMapping {
    /// The scatterlist's header, to hand to the core; `slot` is the slot
    /// this mapping was built with.
    pub(crate) fn header(&self, slot: &SgSlot) -> kernel::bindings::sg_table {
        match self {
            // The slot holds this mapping's entry (type invariant).
            ProviderMapping::Run { .. } => slot.header(),
            ProviderMapping::Runs(m) => m.sg.header(),
        }
    }
}

/// What `nvidia_p2p_dma_map_pages` gave for a persistent pin, undone on
/// drop.
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

impl ProviderRun {
    /// The mapping's bus addresses, one per 64 KiB page.
    fn addresses(&self) -> &[u64] {
        self.mapping
            .as_ref()
            // SAFETY: checked, and valid until this object undoes it (type
            // invariant), which the borrow outlasts.
            .map_or(&[], |m| unsafe { m.addresses() })
    }
}

/// The GPU driver's mapping of `table` (a persistent pin of `entries` pages)
/// for `peer`, checked.
///
/// # Safety
///
/// `table` must be pinned until the returned mapping is dropped.
unsafe fn driver_map(
    table: PageTable,
    entries: u32,
    peer: &PeerDevice,
    at: At,
) -> Result<ProviderRun> {
    let pdev = peer.pci();
    // SAFETY: the table is pinned (caller) and `peer` is live.
    let mapping = unsafe { table.dma_map(pdev) }
        .map_err(|e| fail!(at at; Cause::DmaMap, e, "nvidia_p2p_dma_map_pages failed"))?;
    // SAFETY: the mapping was just made, valid until undone.
    if let Err(m) = unsafe { mapping.check(entries) } {
        // SAFETY: made just now from the pinned table for `pdev`.
        if let Err(e) = unsafe { table.dma_unmap(pdev, mapping) } {
            fail!(at at; Cause::Unpin, e, "nvidia_p2p_dma_unmap_pages failed");
        }
        return Err(fail!(
            at at;
            Cause::DmaMapping,
            compat::eopnotsupp(),
            "unsupported NVIDIA DMA mapping: {m:?}"
        ));
    }
    // INVARIANT: made for `pdev` from `table` and checked; from here on an
    // early return drops the run and undoes it.
    Ok(ProviderRun {
        mapping: Some(mapping),
        table,
    })
}

/// Maps `table` (pinned persistently, `entries` pages) for `peer` through
/// the GPU driver, with the scatterlist in `slot`: its one entry (one
/// segment), or the header of an allocated table (several; the entries are
/// allocated, no other object is).
///
/// # Safety
///
/// `table` is an alias of a persistent pin that stays pinned until the
/// returned mapping is dropped; `slot` is as for [`SgSlot::fill`].
pub(crate) unsafe fn map(
    table: PageTable,
    entries: u32,
    peer: &PeerDevice,
    slot: &SgSlot,
    at: At,
) -> Result<ProviderMapping> {
    // SAFETY: pinned as long (caller).
    let run = unsafe { driver_map(table, entries, peer, at) }?;
    let segs = Coalescer::new(run.addresses(), GPU_PAGE_SIZE, peer.max_segment());
    // One entry per page at most, as many as the C module allocates.
    // SAFETY: the slot is this mapping's (caller).
    let sg = unsafe { sg::build(slot, entries as usize, segs) }
        .map_err(|e| fail!(at at; Cause::NoMemory, e, "cannot build the scatterlist"))?;
    let Some(sg) = sg else {
        return Ok(ProviderMapping::Run { _run: run });
    };
    let runs = KBox::new(ProviderRuns { _run: run, sg }, GFP_KERNEL).map_err(
        |e| fail!(at at; Cause::NoMemory, Error::from(e), "cannot allocate the scatterlist"),
    )?;
    Ok(ProviderMapping::Runs(runs))
}
