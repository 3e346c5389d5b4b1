// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The scatterlist handed to the peer-memory core: one entry per
//! DMA-contiguous segment of GPU pages, set up, walked and freed by the
//! kernel's own `sg_init_table`, `sg_alloc_table`, `sg_next` and
//! `sg_free_table`. There are no `struct page`s behind GPU BAR memory: only
//! the entries' DMA fields (and length) are written.

use core::{
    mem::ManuallyDrop,
    ptr::NonNull, //
};

use kernel::{
    bindings,
    prelude::*,
    types::Opaque, //
};

use crate::coalesce::{
    Coalescer,
    Segment, //
};

/// The empty table.
const EMPTY: bindings::sg_table = bindings::sg_table {
    sgl: core::ptr::null_mut(),
    nents: 0,
    orig_nents: 0,
};

/// Describes the DMA range `addr`, `len` in the entry `sg`.
///
/// # Safety
///
/// `sg` must be an entry of a table the caller is filling, written by
/// nothing else meanwhile.
unsafe fn write_dma(sg: *mut bindings::scatterlist, addr: u64, len: u32) {
    // SAFETY: as promised by the caller.
    unsafe {
        (*sg).length = len;
        (*sg).dma_address = addr;
        (*sg).dma_length = len;
    }
}

/// What a slot holds: the entry of a one-entry table, or the header of an
/// allocated one ([`SlotTable`]).
#[repr(C)]
union SlotData {
    entry: ManuallyDrop<bindings::scatterlist>,
    table: ManuallyDrop<bindings::sg_table>,
}

/// Room inside a registration for a one-entry scatterlist, or for the
/// header of a longer one: a contiguous registration (the common case)
/// needs no allocation for its table, and a longer one only its entries'.
pub(crate) struct SgSlot(Opaque<SlotData>);

// SAFETY: the slot is written only through a table being built, and its
// owner serializes that (the `fill` and `coalesced` contracts); it is read by
// the core through the published header, and by nothing else.
unsafe impl Send for SgSlot {}
// SAFETY: as above.
unsafe impl Sync for SgSlot {}

impl SgSlot {
    /// An empty slot.
    pub(crate) fn new() -> Self {
        Self(Opaque::zeroed())
    }

    /// The slot as a one-entry table's entry.
    fn entry(&self) -> *mut bindings::scatterlist {
        // A `repr(C)` union: every field is at its start.
        self.0.get().cast()
    }

    /// The slot as an allocated table's header.
    fn header(&self) -> *mut bindings::sg_table {
        // As above.
        self.0.get().cast()
    }

    /// Makes the slot a one-entry table for `seg`.
    ///
    /// # Safety
    ///
    /// Nothing else may write or publish the slot until the caller's map
    /// that owns the entry is dropped (the registration's mapping, at most
    /// one at a time).
    pub(crate) unsafe fn fill(&self, seg: Segment) -> Result {
        let len = u32::try_from(seg.len).map_err(|_| EINVAL)?;
        let sg = self.entry();
        // SAFETY: the slot is ours to write (caller): a zeroed entry marked
        // as the list's end, then its DMA fields.
        unsafe {
            bindings::sg_init_table(sg, 1);
            write_dma(sg, seg.addr, len);
        }
        Ok(())
    }

    /// Builds an allocated table as [`SgTable::coalesced`] does and keeps
    /// its header in the slot.
    ///
    /// # Safety
    ///
    /// The slot must outlive the returned table, and nothing else may write
    /// or publish it while the returned table lives.
    pub(crate) unsafe fn coalesced(
        &self,
        cap: usize,
        addrs: &[u64],
        page: u64,
        max_seg: u64,
    ) -> Result<SlotTable> {
        let t = ManuallyDrop::new(SgTable::coalesced(cap, addrs, page, max_seg)?);
        // SAFETY: the slot is ours to write (caller); the header is a plain
        // value whose entries are elsewhere, now owned by the `SlotTable`.
        unsafe { self.header().write(t.table) };
        // INVARIANT: the slot holds the header of a table allocated by
        // `sg_alloc_table`, which nothing else frees (`t` is not dropped).
        Ok(SlotTable(NonNull::from(self)))
    }

    /// Hands the header of the one-entry table in the slot to the core's
    /// `head`; returns its number of entries (1).
    ///
    /// # Safety
    ///
    /// `head` must point to the core's table for this registration, and the
    /// slot must hold an entry written by [`SgSlot::fill`] for the mapping
    /// being published.
    pub(crate) unsafe fn publish(&self, head: *mut bindings::sg_table) -> u32 {
        let table = bindings::sg_table {
            sgl: self.entry(),
            nents: 1,
            orig_nents: 1,
        };
        // SAFETY: per the caller's guarantee.
        unsafe { *head = table };
        1
    }
}

/// An allocated scatterlist whose header is kept in a registration's
/// [`SgSlot`]; freed on drop.
///
/// # Invariants
///
/// The slot outlives this object and holds the header of a table set up by
/// `sg_alloc_table`, filled as an [`SgTable`]'s, that nothing else writes or
/// frees while this object lives; it is freed exactly once, on drop.
pub(crate) struct SlotTable(NonNull<SgSlot>);

// SAFETY: the table is plain memory owned by this object, its header in a
// slot only this object uses while it lives.
unsafe impl Send for SlotTable {}

impl SlotTable {
    /// Hands a copy of the header to the core's `head`; returns its number
    /// of entries.
    ///
    /// # Safety
    ///
    /// `head` must point to the core's table for this registration.
    pub(crate) unsafe fn publish(&self, head: *mut bindings::sg_table) -> u32 {
        // SAFETY: the slot is alive and holds the header (type invariant).
        let table = unsafe { *self.0.as_ref().header() };
        // SAFETY: per the caller's guarantee.
        unsafe { *head = table };
        table.nents
    }
}

impl Drop for SlotTable {
    fn drop(&mut self) {
        // SAFETY: the slot is alive and holds the header of a table from
        // `sg_alloc_table`, not freed before (type invariant; this runs once).
        unsafe { bindings::sg_free_table(self.0.as_ref().header()) };
    }
}

/// A scatterlist the client filled; the core holds a copy of its header
/// while the registration is mapped. An allocated table is freed on drop.
///
/// # Invariants
///
/// `table` has one entry (`orig_nents == 1`), in an [`SgSlot`] that outlives
/// this object and that nothing else writes while it lives; or was set up by
/// `sg_alloc_table` for `orig_nents` entries, two or more, and is freed
/// exactly once, on drop. Its first `nents` entries (at most `orig_nents`)
/// carry the DMA fields of the mapping, the others are empty.
pub(crate) struct SgTable {
    table: bindings::sg_table,
}

// SAFETY: the table is plain memory owned by this object (or, embedded, a
// slot only this object uses while it lives).
unsafe impl Send for SgTable {}

impl SgTable {
    /// A table of `n` entries, two or more, from `sg_alloc_table`.
    fn alloc(n: usize) -> Result<Self> {
        let n = u32::try_from(n).map_err(|_| EINVAL)?;
        if n < 2 {
            return Err(EINVAL);
        }
        let mut table = EMPTY;
        // SAFETY: `table` is a valid, empty table.
        kernel::error::to_result(unsafe {
            bindings::sg_alloc_table(&mut table, n, bindings::GFP_KERNEL)
        })?;
        // INVARIANT: set up by `sg_alloc_table`, freed on drop.
        Ok(Self { table })
    }

    /// Builds a table of exactly `n` entries from `segs`, which must yield
    /// `n` segments; one entry goes into `slot`, more are allocated.
    ///
    /// # Safety
    ///
    /// `slot` must outlive the returned table, and no other table may be
    /// built in it while the returned one lives.
    pub(crate) unsafe fn new(
        slot: &SgSlot,
        n: usize,
        mut segs: impl Iterator<Item = Segment>,
    ) -> Result<Self> {
        if n == 1 {
            let seg = segs.next().ok_or(EINVAL)?;
            if segs.next().is_some() {
                return Err(EINVAL);
            }
            // SAFETY: the slot outlives the table and nobody else writes it
            // meanwhile (caller).
            unsafe { slot.fill(seg) }?;
            let mut this = Self { table: EMPTY };
            // SAFETY: a valid header to write; the slot holds the entry.
            unsafe { slot.publish(&mut this.table) };
            // INVARIANT: one entry, in the caller's slot.
            return Ok(this);
        }
        let mut this = Self::alloc(n)?;
        if this.fill(segs)? != n {
            return Err(EINVAL);
        }
        Ok(this)
    }

    /// Builds an allocated table of at most `cap` entries (two or more) from
    /// the DMA addresses of consecutive pages of `page` bytes, one entry per
    /// run of contiguous pages (up to `segment_limit(max_seg, page)`
    /// bytes), in one pass: the number of runs is only known once they are
    /// found. The table's DMA view (`nents`) is the entries filled; the
    /// entries after them stay empty and are freed with the rest, as after
    /// `dma_map_sg` merged entries. The core reads `nents` entries.
    pub(crate) fn coalesced(cap: usize, addrs: &[u64], page: u64, max_seg: u64) -> Result<Self> {
        if addrs.is_empty() {
            return Err(EINVAL);
        }
        let mut this = Self::alloc(cap)?;
        let filled = this.fill(Coalescer::new(addrs, page, max_seg))?;
        // At most `cap`, which fits a `u32` (checked by `alloc`).
        this.table.nents = filled as u32;
        Ok(this)
    }

    /// Fills the table's entries in order with `segs`; refuses more than
    /// the table holds, or a segment an entry cannot describe. Returns the
    /// number of entries filled.
    fn fill(&mut self, segs: impl Iterator<Item = Segment>) -> Result<usize> {
        let (mut next, mut filled) = (self.table.sgl, 0usize);
        for seg in segs {
            let len = u32::try_from(seg.len).map_err(|_| EINVAL)?;
            if next.is_null() || filled == self.table.orig_nents as usize {
                return Err(EINVAL);
            }
            // SAFETY: an entry of this table (walked by `sg_next` from its
            // first), written once; only this walk writes the table.
            unsafe { write_dma(next, seg.addr, len) };
            filled += 1;
            // SAFETY: as above; `sg_next` follows the chain links that
            // `sg_alloc_table` made, and gives NULL after the last entry.
            next = unsafe { bindings::sg_next(next) };
        }
        Ok(filled)
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
        if self.table.orig_nents > 1 {
            // SAFETY: set up by `sg_alloc_table` and not freed before (type
            // invariant; this runs once).
            unsafe { bindings::sg_free_table(&mut self.table) };
        }
    }
}
