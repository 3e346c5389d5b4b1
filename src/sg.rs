// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The scatterlist handed to the peer-memory core: one entry per
//! DMA-contiguous segment of GPU pages.

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
    segment_limit,
    Segment, //
};

/// `page_link` bits (include/linux/scatterlist.h): the entry is a link to
/// the next chunk of the table, or the table's last entry.
const SG_CHAIN: kernel::ffi::c_ulong = 0x1;
const SG_END: kernel::ffi::c_ulong = 0x2;

/// The most entries `sg_alloc_table` puts in one chunk: a table of up to
/// this many is one array, not chained (`SG_MAX_SINGLE_ALLOC`,
/// include/linux/scatterlist.h; lib/scatterlist.c, `__sg_alloc_table`
/// chains only when more entries are left than a chunk holds).
const SG_MAX_SINGLE_ALLOC: usize =
    kernel::page::PAGE_SIZE / core::mem::size_of::<bindings::scatterlist>();

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
    // SAFETY: as promised by the caller.
    unsafe { write_dma(sg, seg.addr, len) };
    Ok(())
}

/// [`set_dma`] for a length already known to fit.
///
/// # Safety
///
/// As for [`set_dma`].
#[inline(always)]
unsafe fn write_dma(sg: *mut bindings::scatterlist, addr: u64, len: u32) {
    // SAFETY: as promised by the caller; `offset` is 0 already.
    unsafe {
        (*sg).length = len;
        (*sg).dma_address = addr;
        (*sg).dma_length = len;
    }
}

/// Calls `put` with each run of pages of `page` bytes at the DMA addresses
/// `addrs` that follow each other, in order, as
/// [`Coalescer`](crate::coalesce::Coalescer) makes them (up to
/// [`segment_limit`]`(max_seg, page)` bytes each, which a scatterlist
/// length holds): one compare per page that continues a run, one call per
/// run. Refuses an empty list and a page a scatterlist entry cannot
/// describe.
#[inline(always)]
fn for_each_run(
    addrs: &[u64],
    page: u64,
    max_seg: u64,
    mut put: impl FnMut(u64, u32) -> Result,
) -> Result {
    let (&first, rest) = addrs.split_first().ok_or(EINVAL)?;
    let limit = segment_limit(max_seg, page);
    // A run is at most `limit` bytes, which is at most `u32::MAX` unless a
    // page alone is longer: checked once here, not per run.
    u32::try_from(limit).map_err(|_| EINVAL)?;
    // The run so far is `addr..end`, `end` computed modulo 2^64: it is below
    // `addr` exactly when the run reaches past the address space, where the
    // checked sum of `Coalescer` fails and nothing follows. Its length,
    // `end - addr` (also modulo 2^64), and `limit` are whole pages, so one
    // more page fits while the length is below `limit`.
    let (mut addr, mut end) = (first, first.wrapping_add(page));
    for &a in rest {
        if a == end && end > addr && end - addr < limit {
            end = end.wrapping_add(page);
            continue;
        }
        // `len <= limit <= u32::MAX` (above).
        put(addr, end.wrapping_sub(addr) as u32)?;
        (addr, end) = (a, a.wrapping_add(page));
    }
    put(addr, end.wrapping_sub(addr) as u32)
}

/// The entries of a table that `sg_alloc_table` just set up, in order, a
/// chunk at a time: within a chunk the entries are one array, so the walk
/// looks for a link only at a chunk's end (the kernel's `sg_next` tests
/// every entry, in a call).
///
/// `__sg_alloc_table` (lib/scatterlist.c) allocates chunks of at most
/// [`SG_MAX_SINGLE_ALLOC`] entries; a chunk with more entries after it
/// holds one less, and its last slot is the link to the next chunk.
///
/// # Invariants
///
/// `cur..end` are zeroed entries of the table's current chunk that nothing
/// else writes; if `after` is not 0, `end` is the chunk's link slot and
/// `after` entries follow in later chunks.
struct Entries {
    cur: *mut bindings::scatterlist,
    end: *mut bindings::scatterlist,
    after: usize,
}

impl Entries {
    /// The entries of `table`.
    ///
    /// # Safety
    ///
    /// `table` must have just been set up by `sg_alloc_table` (or be a reset
    /// slot's one-entry table) and be written by nothing else while the
    /// walk is used.
    #[inline(always)]
    unsafe fn new(table: &bindings::sg_table) -> Self {
        let n = table.orig_nents as usize;
        let here = Self::in_chunk(n);
        // INVARIANT: the first chunk's entries (see the type's comment).
        Self {
            cur: table.sgl,
            // SAFETY: `here` entries of the first chunk, at `sgl`.
            end: unsafe { table.sgl.add(here) },
            after: n - here,
        }
    }

    /// The entries of a chunk with `left` entries from it to the table's
    /// end.
    #[inline(always)]
    fn in_chunk(left: usize) -> usize {
        if left > SG_MAX_SINGLE_ALLOC {
            SG_MAX_SINGLE_ALLOC - 1
        } else {
            left
        }
    }

    /// The next entry, `None` past the table's end.
    #[inline(always)]
    fn next(&mut self) -> Option<*mut bindings::scatterlist> {
        if self.cur == self.end {
            return self.next_chunk();
        }
        let e = self.cur;
        // SAFETY: `cur < end`, within the chunk (type invariant).
        self.cur = unsafe { self.cur.add(1) };
        Some(e)
    }

    /// Entries not returned yet.
    fn left(&self) -> usize {
        // SAFETY: `cur..end` is within one chunk (type invariant).
        let here = unsafe { self.end.offset_from(self.cur) } as usize;
        here + self.after
    }

    /// Moves to the next chunk and returns its first entry.
    #[cold]
    fn next_chunk(&mut self) -> Option<*mut bindings::scatterlist> {
        if self.after == 0 {
            return None;
        }
        // SAFETY: `end` is the current chunk's link slot (type invariant).
        let link = unsafe { (*self.end).page_link };
        if link & SG_CHAIN == 0 {
            // Not the layout `sg_alloc_table` makes: write nothing more.
            return None;
        }
        let first = (link & !(SG_CHAIN | SG_END)) as *mut bindings::scatterlist;
        let here = Self::in_chunk(self.after);
        // INVARIANT: the next chunk's entries, `here` of the `after` left.
        self.after -= here;
        // SAFETY: `here >= 1` entries of the chunk at `first`.
        self.cur = unsafe { first.add(1) };
        // SAFETY: as above.
        self.end = unsafe { first.add(here) };
        Some(first)
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
        // INVARIANT: the slot holds the header of an allocated table
        // (`coalesced` allocates at least two entries), which nothing else
        // frees (`t` is not dropped); it outlives the result (caller).
        Ok(SlotTable(NonNull::from(self)))
    }

    /// Makes the slot an empty one-entry list and returns its entry.
    ///
    /// # Safety
    ///
    /// Nothing else may write or read the slot meanwhile.
    unsafe fn reset(&self) -> *mut bindings::scatterlist {
        let sg = self.entry();
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
        table.sgl = self.entry();
        table.nents = 1;
        table.orig_nents = 1;
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
/// `sg_alloc_table` (or laid out as it does, by [`SgTable::coalesced_chunk`])
/// for two or more entries, filled as an [`SgTable`]'s,
/// that nothing else writes or frees while this object lives; it is freed
/// exactly once, on drop.
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
    #[inline]
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
        // SAFETY: the slot is alive, holds the header of an allocated table
        // not freed before (type invariant; this runs once).
        unsafe { free_table(self.0.as_ref().header()) };
    }
}

/// Frees an allocated table: what `sg_free_table` does, without its walk
/// for a table of one chunk, which is one `kmalloc`'d array
/// (lib/scatterlist.c: `sg_kmalloc` allocates a chunk of fewer than
/// `SG_MAX_SINGLE_ALLOC` entries with `kmalloc_array`, and `sg_kfree`
/// frees it with `kfree`).
///
/// # Safety
///
/// `table` must be the header of a table set up by `sg_alloc_table`, or by
/// [`SgTable::coalesced_chunk`], for `orig_nents` entries, two or more, not
/// freed before.
#[inline(always)]
unsafe fn free_table(table: *mut bindings::sg_table) {
    // SAFETY: a valid header (caller).
    let t = unsafe { &mut *table };
    if (t.orig_nents as usize) < SG_MAX_SINGLE_ALLOC {
        // SAFETY: one chunk, allocated with `kmalloc` (above, caller).
        unsafe { bindings::kfree(t.sgl.cast()) };
        t.sgl = core::ptr::null_mut();
    } else {
        // SAFETY: set up by `sg_alloc_table` (caller).
        unsafe { bindings::sg_free_table(t) };
    }
}

/// A scatterlist the client filled; the core holds a copy of its header
/// while the registration is mapped. An allocated table is freed on drop.
///
/// # Invariants
///
/// `table` is empty (all zero); or has one entry (`orig_nents == 1`), in an
/// [`SgSlot`] that outlives this object and that nothing else writes while
/// it lives; or was set up by `sg_alloc_table` (or laid out as it does, by
/// [`SgTable::coalesced_chunk`]) for `orig_nents` entries, two or more, and
/// is freed exactly once, on drop. Its first `nents` entries
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
        if cap < 2 || addrs.is_empty() {
            return Err(EINVAL);
        }
        if cap < SG_MAX_SINGLE_ALLOC {
            return Self::coalesced_chunk(cap32, addrs, page, max_seg);
        }
        // SAFETY: an all-zero `sg_table` is the empty table.
        let mut table: bindings::sg_table = unsafe { core::mem::zeroed() };
        // SAFETY: `table` is a valid, empty table.
        kernel::error::to_result(unsafe {
            bindings::sg_alloc_table(&mut table, cap32, bindings::GFP_KERNEL)
        })?;
        // INVARIANT: allocated above, freed on drop (also on the errors
        // below).
        let mut this = Self { table };
        // SAFETY: just set up; only this walk writes it.
        let mut free = unsafe { Entries::new(&this.table) };
        for_each_run(addrs, page, max_seg, |addr, len| {
            let e = free.next().ok_or(EINVAL)?;
            // SAFETY: a zeroed entry of the table, written once.
            unsafe { write_dma(e, addr, len) };
            Ok(())
        })?;
        // At most `cap`, which fits a `u32` (above).
        let filled = (cap - free.left()) as u32;
        this.table.nents = filled;
        Ok(this)
    }

    /// [`SgTable::coalesced`] for a table of one chunk (`cap` from 2 to
    /// `SG_MAX_SINGLE_ALLOC - 1` entries), laid out as `sg_alloc_table`
    /// makes it without its zeroing pass: one `kmalloc`'d array
    /// (lib/scatterlist.c: `sg_kmalloc` allocates such a chunk with
    /// `kmalloc_array`, and `sg_free_table` frees it with `kfree`, see
    /// `Drop`), each entry written whole as it is filled, the entries after
    /// the last run zeroed, the end mark on the array's last entry.
    #[inline(always)]
    fn coalesced_chunk(cap: u32, addrs: &[u64], page: u64, max_seg: u64) -> Result<Self> {
        let n = cap as usize;
        // SAFETY: a plain allocation of `n` entries, fewer than a page's
        // worth (`n < SG_MAX_SINGLE_ALLOC`).
        let sgl = unsafe { crate::ffi::peermem_sg_chunk_alloc(cap) };
        if sgl.is_null() {
            return Err(ENOMEM);
        }
        // SAFETY: an all-zero `sg_table` is the empty table.
        let mut table: bindings::sg_table = unsafe { core::mem::zeroed() };
        table.sgl = sgl;
        table.orig_nents = cap;
        // INVARIANT: one `kmalloc`'d chunk of `cap` entries, freed on drop
        // (also on the errors below, before any entry is read).
        let mut this = Self { table };
        let mut next = sgl;
        // SAFETY: `sgl + n` is the end of the allocation.
        let end = unsafe { sgl.add(n) };
        for_each_run(addrs, page, max_seg, |addr, len| {
            if next == end {
                return Err(EINVAL);
            }
            // SAFETY: an entry of the array, written whole once: a DMA-only
            // entry (no page) that is not the last of the list.
            unsafe {
                next.write(bindings::scatterlist {
                    length: len,
                    dma_address: addr,
                    dma_length: len,
                    ..core::mem::zeroed()
                });
                next = next.add(1);
            }
            Ok(())
        })?;
        // SAFETY: `next` is within the array or its end.
        let filled = unsafe { next.offset_from(sgl) } as usize;
        // SAFETY: the entries `filled..n` of the array, none written yet,
        // zeroed as `sg_init_table` would; then the end mark (bit 1 of
        // `page_link`, `sg_mark_end`) on the last one.
        unsafe {
            core::ptr::write_bytes(next, 0, n - filled);
            (*sgl.add(n - 1)).page_link |= SG_END;
        }
        this.table.nents = filled as u32;
        Ok(this)
    }

    /// Fills the table's entries in order from `segs`, which must not yield
    /// more than `orig_nents`; returns how many it filled.
    fn fill(&mut self, segs: impl Iterator<Item = Segment>) -> Result<usize> {
        // SAFETY: `new` just set the table up; only this walk writes it.
        let mut free = unsafe { Entries::new(&self.table) };
        let mut filled = 0;
        for seg in segs {
            let e = free.next().ok_or(EINVAL)?;
            // SAFETY: a zeroed entry of the table, written once.
            unsafe { set_dma(e, seg) }?;
            filled += 1;
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
        if self.table.orig_nents <= 1 {
            // Empty, or one entry in the registration's slot: nothing to free.
            return;
        }
        // SAFETY: allocated, two or more entries, and not freed before (type
        // invariant; this runs once).
        unsafe { free_table(&mut self.table) };
    }
}
