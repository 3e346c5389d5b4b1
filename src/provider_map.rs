// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The GPU driver's DMA mapping of a persistent pin, with the scatterlist
//! built from it; undone through `nvidia_p2p_dma_unmap_pages` on drop.

use kernel::prelude::*;

use crate::{
    compat,
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

/// What `nvidia_p2p_dma_map_pages` gave for a persistent pin.
///
/// # Invariants
///
/// `table` aliases a persistent pin (no free callback can free it) that the
/// registration unpins only after dropping this mapping; `mapping` was made
/// from it for `peer` and is undone once, on drop.
pub(crate) struct ProviderMap {
    sg: SgTable,
    mapping: Option<DmaMapping>,
    peer: PeerDevice,
    table: PageTable,
}

// SAFETY: provider tokens and owned memory; the provider's API may be called
// from any thread.
unsafe impl Send for ProviderMap {}

impl ProviderMap {
    /// Maps `table` (pinned persistently, `entries` pages) for `peer`.
    ///
    /// # Safety
    ///
    /// `table` is an alias of a persistent pin that stays pinned until the
    /// returned mapping is dropped; `slot` is as for [`SgTable::new`].
    pub(crate) unsafe fn new(
        table: PageTable,
        entries: u32,
        peer: PeerDevice,
        slot: &SgSlot,
    ) -> Result<Self> {
        // SAFETY: the table is pinned (caller) and `peer` is live.
        let mapping = unsafe { table.dma_map(peer.pci()) }
            .map_err(|e| fail!(Cause::DmaMap, e, "nvidia_p2p_dma_map_pages failed"))?;
        // INVARIANT: the mapping was made for `peer` from `table`; from here
        // on an early return drops `this` and undoes it.
        let mut this = Self {
            sg: SgTable::empty(),
            mapping: Some(mapping),
            peer,
            table,
        };
        let built = match this.mapping.as_ref() {
            // SAFETY: the mapping is valid until dropped.
            Some(m) => match unsafe { m.addresses(entries) } {
                Err(m) => Err(fail!(
                    Cause::DmaMapping,
                    compat::eopnotsupp(),
                    "unsupported NVIDIA DMA mapping: {m:?}"
                )),
                // SAFETY: as promised by the caller.
                Ok(addrs) => unsafe {
                    SgTable::coalesced(slot, addrs, GPU_PAGE_SIZE, this.peer.max_segment())
                }
                .map_err(|e| fail!(Cause::NoMemory, e, "cannot allocate the scatterlist")),
            },
            None => Err(EINVAL),
        };
        this.sg = built?;
        Ok(this)
    }

    /// The scatterlist.
    pub(crate) fn sg(&self) -> &SgTable {
        &self.sg
    }
}

impl Drop for ProviderMap {
    fn drop(&mut self) {
        let Some(m) = self.mapping.take() else { return };
        // SAFETY: the table is still pinned (type invariant) and `m` was
        // made from it for `peer`.
        if let Err(e) = unsafe { self.table.dma_unmap(self.peer.pci(), m) } {
            // The table stays linked with the mapping; the unpin that follows
            // frees both at the provider.
            fail!(Cause::Unpin, e, "nvidia_p2p_dma_unmap_pages failed");
        }
    }
}
