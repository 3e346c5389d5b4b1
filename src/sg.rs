// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The scatterlist handed to the peer-memory core: one entry per
//! DMA-contiguous segment of GPU pages, set up, walked and freed by the
//! kernel's own `sg_init_table`, `sg_alloc_table`, `sg_next` and
//! `sg_free_table`. There are no `struct page`s behind GPU BAR memory: only
//! the entries' DMA fields (and length) are written.
//!
//! The core is handed a copy of a table's header (`sg_table`, plain values);
//! the one place that writes it into the core's table is `dma_map`'s.

use kernel::{
    bindings,
    prelude::*,
    types::Opaque, //
};

use crate::coalesce::Segment;

/// Describes the DMA range `seg` in the entry `sg`.
fn write_dma(sg: &mut bindings::scatterlist, seg: Segment) -> Result {
    let len = u32::try_from(seg.len).map_err(|_| EINVAL)?;
    (sg.length, sg.dma_address, sg.dma_length) = (len, seg.addr, len);
    Ok(())
}

/// Room inside a registration for a one-entry scatterlist: a contiguous
/// registration (the common case) needs no allocation for its table.
pub(crate) struct SgSlot(Opaque<bindings::scatterlist>);

// SAFETY: the slot is written by `fill`, whose caller (the slot's owner)
// serializes it with every use of the entry, and by the core through the
// published header (OFED's first/last fix-up adjusts the entry's DMA address
// and length); the module never reads it back (a mapping is undone from its
// own record of what it mapped, `device_map::RunIova`).
unsafe impl Send for SgSlot {}
// SAFETY: as above.
unsafe impl Sync for SgSlot {}

impl SgSlot {
    /// An empty slot.
    pub(crate) fn new() -> Self {
        Self(Opaque::zeroed())
    }

    /// The header of the one-entry table in the slot, to hand to the core.
    pub(crate) fn header(&self) -> bindings::sg_table {
        bindings::sg_table {
            sgl: self.0.get(),
            nents: 1,
            orig_nents: 1,
        }
    }
}

/// A scatterlist of two or more entries from `sg_alloc_table`, freed on
/// drop; the core holds a copy of its header while the registration is
/// mapped.
///
/// # Invariants
///
/// `table` was set up by `sg_alloc_table` for `orig_nents` entries, two or
/// more, and is freed exactly once, on drop. Its first `nents` entries (at
/// most `orig_nents`) carry the DMA fields of the mapping, the others are
/// empty. While the core holds the header, OFED's core adjusts the first
/// and last entries' DMA address and lengths to the user's range (and
/// restores them before `dma_unmap`): nothing here reads an entry back, and
/// `sg_free_table` follows only the chain links, which it does not touch.
pub(crate) struct SgTable {
    table: bindings::sg_table,
}

// SAFETY: the table is plain memory owned by this object.
unsafe impl Send for SgTable {}

impl SgTable {
    /// A table of `n` entries (two or more) from `sg_alloc_table`, filled in
    /// order with `segs`; refuses more than it holds, or a segment an entry
    /// cannot describe. Its DMA view (`nents`) is the entries filled.
    fn new(n: usize, segs: impl Iterator<Item = Segment>) -> Result<Self> {
        let n = u32::try_from(n).ok().filter(|&n| n >= 2).ok_or(EINVAL)?;
        // No entries, no list.
        let mut table = bindings::sg_table::default();
        // SAFETY: `table` is a valid, empty table.
        kernel::error::to_result(unsafe {
            bindings::sg_alloc_table(&mut table, n, bindings::GFP_KERNEL)
        })?;
        // INVARIANT: set up by `sg_alloc_table`, freed on drop; none of its
        // entries is filled yet.
        let mut t = Self { table };
        let mut next = t.table.sgl;
        t.table.nents = 0;
        for seg in segs {
            if next.is_null() || t.table.nents == n {
                return Err(EINVAL);
            }
            // SAFETY: an entry of this table (walked by `sg_next` from its
            // first, which follows the chain links `sg_alloc_table` made and
            // gives NULL after the last entry), written once; only this walk
            // writes or reads the table.
            next = unsafe {
                write_dma(&mut *next, seg)?;
                bindings::sg_next(next)
            };
            t.table.nents += 1;
        }
        Ok(t)
    }

    /// The header, to hand to the core.
    pub(crate) fn header(&self) -> bindings::sg_table {
        self.table
    }
}

/// The scatterlist of `segs`, at most `cap` of them: one segment in `slot`
/// (`None`: nothing allocated), several in a table of `cap` entries (two or
/// more), found and filled in one pass. The table's DMA view (`nents`) is the
/// entries filled; the entries after them stay empty and are freed with the
/// rest, as after `dma_map_sg` merged entries. The core reads `nents` entries.
///
/// # Safety
///
/// Nothing else may write `slot`, nor the core read it, until the caller's
/// map built with it is dropped (the registration's mapping, at most one at a
/// time).
pub(crate) unsafe fn build(
    slot: &SgSlot,
    cap: usize,
    mut segs: impl Iterator<Item = Segment>,
) -> Result<Option<SgTable>> {
    let first = segs.next().ok_or(EINVAL)?;
    let mut segs = segs.peekable();
    if segs.peek().is_some() {
        return SgTable::new(cap, Iterator::chain(core::iter::once(first), segs)).map(Some);
    }
    let sg = slot.0.get();
    // SAFETY: the slot is ours to write, nothing else writes or reads it
    // meanwhile (caller): a zeroed entry marked as the list's end, then its
    // DMA fields.
    unsafe {
        bindings::sg_init_table(sg, 1);
        write_dma(&mut *sg, first)
    }
    .map(|()| None)
}

impl Drop for SgTable {
    fn drop(&mut self) {
        // SAFETY: set up by `sg_alloc_table` and not freed before (type
        // invariant; this runs once).
        unsafe { bindings::sg_free_table(&mut self.table) };
    }
}
