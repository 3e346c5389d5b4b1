// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The scatterlist handed to the peer-memory core: one entry per
//! DMA-contiguous segment of GPU pages.

use kernel::{
    bindings,
    prelude::*,
    types::Opaque, //
};

use crate::coalesce::{
    segment_limit,
    Segment, //
};

/// `page_link` bits (include/linux/scatterlist.h): the entry is a link to
/// the next chunk of the table, or the table's last entry.
const SG_CHAIN: kernel::ffi::c_ulong = 0x1;
const SG_END: kernel::ffi::c_ulong = 0x2;

/// The entry after `sg` in its table: the kernel's `sg_next` for an entry
/// that is not the last, inline (the kernel's is a call per entry, through a
/// Rust helper on top, for tables of up to 16,384 entries).
///
/// # Safety
///
/// `sg` must be an entry of a table set up by `sg_alloc_table`, other than
/// its last.
#[inline(always)]
unsafe fn next(sg: *mut bindings::scatterlist) -> *mut bindings::scatterlist {
    // SAFETY: not the last entry, so the next slot of its chunk is an entry
    // or the link to the next chunk (`sg_alloc_table` reserves it).
    let following = unsafe { sg.add(1) };
    // SAFETY: as above.
    let link = unsafe { (*following).page_link };
    if link & SG_CHAIN != 0 {
        // The link holds the next chunk's first entry.
        (link & !(SG_CHAIN | SG_END)) as *mut bindings::scatterlist
    } else {
        following
    }
}

/// Describes `seg` in the entry `sg` (length and DMA fields only: there is
/// no `struct page` behind GPU BAR memory). Segments are bounded to
/// `u32::MAX` by their producers; a longer one is refused.
///
/// # Safety
///
/// `sg` must be a zeroed entry (`sg_alloc_table`'s, or a reset slot's) of a
/// table the caller is filling, written by nothing else meanwhile.
#[inline(always)]
unsafe fn set_dma(sg: *mut bindings::scatterlist, seg: Segment) -> Result {
    let len = u32::try_from(seg.len).map_err(|_| EINVAL)?;
    // SAFETY: as promised by the caller; `offset` is 0 already.
    unsafe {
        (*sg).length = len;
        (*sg).dma_address = seg.addr;
        (*sg).dma_length = len;
    }
    Ok(())
}

/// Where the next segment goes in a table being filled, and how many
/// entries are filled.
///
/// # Invariants
///
/// While `filled < cap`, `sg` is the table's entry after the `filled` first
/// ones; the table has `cap` zeroed entries (set up by `sg_alloc_table`, or
/// one in a reset slot) that only this cursor writes.
struct Cursor {
    sg: *mut bindings::scatterlist,
    filled: u32,
    cap: u32,
}

impl Cursor {
    /// A cursor at the first entry of `table`.
    ///
    /// # Safety
    ///
    /// `table` must have just been set up (its `orig_nents` entries zeroed)
    /// and be written by nothing else while the cursor is used.
    unsafe fn new(table: &bindings::sg_table) -> Self {
        // INVARIANT: nothing filled; `sgl` is the first of `orig_nents`
        // entries (caller).
        Self {
            sg: table.sgl,
            filled: 0,
            cap: table.orig_nents,
        }
    }

    /// Writes `seg` into the next entry and moves to the one after it.
    #[inline(always)]
    fn put(&mut self, seg: Segment) -> Result {
        if self.filled == self.cap {
            return Err(EINVAL);
        }
        // SAFETY: `filled < cap`, so `sg` is the next zeroed entry, ours to
        // write (type invariant).
        unsafe { set_dma(self.sg, seg) }?;
        // `filled < cap`: no overflow.
        self.filled = self.filled.wrapping_add(1);
        if self.filled < self.cap {
            // SAFETY: an entry of a table set up by `sg_alloc_table` (a
            // slot's table has one entry, so it never gets here), not its
            // last.
            // INVARIANT: the entry after the `filled` first ones.
            self.sg = unsafe { next(self.sg) };
        }
        Ok(())
    }
}

/// Room for a one-entry scatterlist inside a registration: a contiguous
/// registration (the common case) needs no allocation for its table.
pub(crate) struct SgSlot(Opaque<bindings::scatterlist>);

// SAFETY: the slot is written only through an `SgTable` being built, and its
// owner serializes that (the `SgTable::new` contract); it is read by the
// core through the published header, and by nothing else.
unsafe impl Send for SgSlot {}
// SAFETY: as above.
unsafe impl Sync for SgSlot {}

impl SgSlot {
    /// An empty slot.
    pub(crate) fn new() -> Self {
        Self(Opaque::zeroed())
    }

    /// Writes the one entry of a one-entry table for `seg` into the slot.
    ///
    /// # Safety
    ///
    /// Nothing else may write or publish the slot until the caller's map
    /// that owns the entry is dropped (the registration's mapping, at most
    /// one at a time).
    pub(crate) unsafe fn fill(&self, seg: Segment) -> Result {
        // SAFETY: the slot is ours to write (caller), and reset zeroes it.
        unsafe { set_dma(self.reset(), seg) }
    }

    /// Makes the slot an empty one-entry list and returns its entry.
    ///
    /// # Safety
    ///
    /// Nothing else may write or read the slot meanwhile.
    unsafe fn reset(&self) -> *mut bindings::scatterlist {
        let sg = self.0.get();
        // SAFETY: ours to write (caller); a zeroed entry with the end mark
        // (bit 1 of `page_link`, `sg_mark_end`) is a one-entry list.
        unsafe {
            sg.write(core::mem::zeroed());
            (*sg).page_link = SG_END;
        }
        sg
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
        // SAFETY: an all-zero `sg_table` is the empty table.
        let mut table: bindings::sg_table = unsafe { core::mem::zeroed() };
        table.sgl = self.0.get();
        table.nents = 1;
        table.orig_nents = 1;
        // SAFETY: per the caller's guarantee.
        unsafe { *head = table };
        1
    }
}

/// A scatterlist the client filled; the core holds a copy of its header
/// while the registration is mapped. An allocated table is freed on drop.
///
/// # Invariants
///
/// `table` is empty (all zero); or has one entry (`orig_nents == 1`), in an
/// [`SgSlot`] that outlives this object and that nothing else writes while
/// it lives; or was set up by `sg_alloc_table` for `orig_nents` entries, two
/// or more, and is freed exactly once, on drop. Its first `nents` entries
/// (at most `orig_nents`) carry the DMA fields of the mapping, the others
/// are empty (there are no `struct page`s behind GPU BAR memory).
pub(crate) struct SgTable {
    table: bindings::sg_table,
}

// SAFETY: the table is plain memory owned by this object (or, embedded, a
// slot only this object uses while it lives).
unsafe impl Send for SgTable {}

impl SgTable {
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
        segs: impl Iterator<Item = Segment>,
    ) -> Result<Self> {
        let nents = u32::try_from(n).map_err(|_| EINVAL)?;
        // SAFETY: an all-zero `sg_table` is the empty table.
        let mut table: bindings::sg_table = unsafe { core::mem::zeroed() };
        if n == 1 {
            // SAFETY: the slot outlives the table and nobody else writes it
            // meanwhile (caller).
            table.sgl = unsafe { slot.reset() };
            table.nents = 1;
            table.orig_nents = 1;
        } else {
            // SAFETY: `table` is a valid, empty table.
            kernel::error::to_result(unsafe {
                bindings::sg_alloc_table(&mut table, nents, bindings::GFP_KERNEL)
            })?;
        }
        // INVARIANT: one entry, in the caller's slot; or several, allocated
        // above and freed on drop (also on the errors below).
        let mut this = Self { table };
        if this.fill(segs)? != n {
            return Err(EINVAL);
        }
        Ok(this)
    }

    /// Builds an allocated table of at most `cap` entries (two or more) from
    /// the DMA addresses of consecutive pages of `page` bytes, one entry per
    /// run of contiguous pages (up to [`segment_limit`]`(max_seg, page)`
    /// bytes, as [`Coalescer`](crate::coalesce::Coalescer) makes them), in
    /// one pass: the number of runs is only known once they are found. The
    /// table's DMA view (`nents`) is the entries filled; the entries after
    /// them stay empty (zero length) and are freed with the rest
    /// (`orig_nents` is `cap`), as after `dma_map_sg` merged entries. The
    /// core reads `nents` entries (it stores the count `dma_map` returns in
    /// `nents`).
    pub(crate) fn coalesced(cap: usize, addrs: &[u64], page: u64, max_seg: u64) -> Result<Self> {
        let cap32 = u32::try_from(cap).map_err(|_| EINVAL)?;
        let (&first, rest) = addrs.split_first().ok_or(EINVAL)?;
        if cap < 2 {
            return Err(EINVAL);
        }
        let limit = segment_limit(max_seg, page);
        // SAFETY: an all-zero `sg_table` is the empty table.
        let mut table: bindings::sg_table = unsafe { core::mem::zeroed() };
        // SAFETY: `table` is a valid, empty table.
        kernel::error::to_result(unsafe {
            bindings::sg_alloc_table(&mut table, cap32, bindings::GFP_KERNEL)
        })?;
        // INVARIANT: allocated above, freed on drop (also on the errors
        // below).
        let mut this = Self { table };
        // SAFETY: just set up; only the cursor writes it.
        let mut at = unsafe { Cursor::new(&this.table) };
        // One compare per page that continues the run; an entry written per
        // run (this loop runs once per 64 KiB page of up to 1 GiB).
        let (mut addr, mut len) = (first, page);
        for &a in rest {
            if addr.checked_add(len) == Some(a) && len + page <= limit {
                len += page;
                continue;
            }
            at.put(Segment { addr, len })?;
            (addr, len) = (a, page);
        }
        at.put(Segment { addr, len })?;
        this.table.nents = at.filled;
        Ok(this)
    }

    /// Fills the table's entries in order from `segs`, which must not yield
    /// more than `orig_nents`; returns how many it filled.
    fn fill(&mut self, segs: impl Iterator<Item = Segment>) -> Result<usize> {
        // SAFETY: `new` just set the table up; only the cursor writes it.
        let mut at = unsafe { Cursor::new(&self.table) };
        for seg in segs {
            at.put(seg)?;
        }
        Ok(at.filled as usize)
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
        if self.table.orig_nents <= 1 {
            // Empty, or one entry in the registration's slot: nothing to free.
            return;
        }
        // SAFETY: allocated by `sg_alloc_table` and not freed before (type
        // invariant; this runs once).
        unsafe { bindings::sg_free_table(&mut self.table) };
    }
}
