// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The scatterlist handed to the peer-memory core: one entry per
//! DMA-contiguous segment of GPU pages.

use kernel::{
    bindings,
    prelude::*, //
};

use crate::coalesce::Segment;

/// A scatterlist the client allocated and filled; the core holds a copy of
/// its header while the registration is mapped. Freed on drop.
///
/// # Invariants
///
/// `table` is empty (all zero) or was set up by `sg_alloc_table`, and is freed
/// exactly once, on drop (`sg_free_table` ignores an empty table).
/// Its entries carry only DMA fields (there are no `struct page`s behind GPU
/// BAR memory).
pub(crate) struct SgTable {
    table: bindings::sg_table,
}

// SAFETY: the table is plain memory owned by this object.
unsafe impl Send for SgTable {}

impl SgTable {
    /// A table without entries.
    pub(crate) fn empty() -> Self {
        // INVARIANT: empty.
        Self {
            // SAFETY: an all-zero `sg_table` is the empty table.
            table: unsafe { core::mem::zeroed() },
        }
    }

    /// Builds a table of exactly `n` entries from `segs`, which must yield
    /// `n` segments.
    pub(crate) fn new(n: usize, segs: impl Iterator<Item = Segment>) -> Result<Self> {
        let nents = u32::try_from(n).map_err(|_| EINVAL)?;
        // SAFETY: an all-zero `sg_table` is the empty table.
        let mut table: bindings::sg_table = unsafe { core::mem::zeroed() };
        // SAFETY: `table` is a valid, empty table.
        kernel::error::to_result(unsafe {
            bindings::sg_alloc_table(&mut table, nents, bindings::GFP_KERNEL)
        })?;
        // INVARIANT: allocated above; freed on drop (also on the error below).
        let this = Self { table };
        let mut sg = this.table.sgl;
        let mut filled = 0;
        for seg in segs {
            if sg.is_null() {
                return Err(EINVAL);
            }
            // Segments are bounded to `u32::MAX` by their producers.
            let len = u32::try_from(seg.len).map_err(|_| EINVAL)?;
            // SAFETY: `sg` is one of the table's `nents` entries.
            unsafe {
                (*sg).offset = 0;
                (*sg).length = len;
                (*sg).dma_address = seg.addr;
                (*sg).dma_length = len;
                sg = bindings::sg_next(sg);
            }
            filled += 1;
        }
        if filled != n {
            return Err(EINVAL);
        }
        Ok(this)
    }

    /// Builds a table with the segments of `addrs` (one bus address per page
    /// of `page` bytes), merging contiguous pages up to `max_seg` bytes.
    pub(crate) fn coalesced(addrs: &[u64], page: u64, max_seg: u64) -> Result<Self> {
        let n = crate::coalesce::count(addrs, page, max_seg);
        Self::new(n, crate::coalesce::Coalescer::new(addrs, page, max_seg))
    }

    /// Number of entries.
    pub(crate) fn nents(&self) -> u32 {
        self.table.nents
    }

    /// Hands a copy of the header to the core's `sg_head`.
    ///
    /// # Safety
    ///
    /// `head` must point to the core's table for this registration.
    pub(crate) unsafe fn publish(&self, head: *mut bindings::sg_table) {
        // SAFETY: per the caller's guarantee.
        unsafe { *head = self.table };
    }
}

impl Drop for SgTable {
    fn drop(&mut self) {
        // SAFETY: allocated by `sg_alloc_table` and not freed before (type
        // invariant; this runs once).
        unsafe { bindings::sg_free_table(&mut self.table) };
    }
}
