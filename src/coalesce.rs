// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Coalescing of per-page DMA addresses into scatter-gather segments.
//!
//! Plain Rust without kernel types: the module and the host test crate compile
//! this very file.

/// One DMA-contiguous segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Bus address of the first byte.
    pub(crate) addr: u64,
    /// Length in bytes, a whole number of pages.
    pub(crate) len: u64,
}

/// The longest a segment may be for a device whose segments may be
/// `max_seg` bytes long: whole pages of `page` bytes (at least one), and no
/// more than `u32::MAX` (the width of a scatterlist length).
pub(crate) fn segment_limit(max_seg: u64, page: u64) -> u64 {
    let cap = core::cmp::min(max_seg, u64::from(u32::MAX));
    core::cmp::max(cap - cap % page, page)
}

/// Where the pages are: page `i` at `at(i)`.
pub(crate) trait PageAddrs {
    /// The bus address of page `i`.
    fn at(&self, i: usize) -> u64;
}

impl PageAddrs for &[u64] {
    fn at(&self, i: usize) -> u64 {
        self[i]
    }
}

/// For tables whose addresses are not laid out in one slice, such as the
/// provider's page pointers.
impl<F: Fn(usize) -> u64> PageAddrs for F {
    fn at(&self, i: usize) -> u64 {
        self(i)
    }
}

/// Iterator over the segments of `n` pages.
///
/// Pages whose DMA addresses follow each other are merged, as long as a
/// segment stays within `max_seg` bytes (rounded down to whole pages, at least
/// one page) and within `u32::MAX` (the width of a scatterlist length).
pub(crate) struct Runs<A: PageAddrs> {
    at: usize,
    n: usize,
    addrs: A,
    page: u64,
    max_seg: u64,
}

impl<A: PageAddrs> Runs<A> {
    /// Segments of pages `0..n` of `page` bytes at `addrs` for a device whose
    /// segments may be `max_seg` bytes long.
    pub(crate) fn of(n: usize, addrs: A, page: u64, max_seg: u64) -> Self {
        Self {
            at: 0,
            n,
            addrs,
            page,
            max_seg: segment_limit(max_seg, page),
        }
    }
}

/// The segments of a page-address list (one bus address per page).
pub(crate) type Coalescer<'a> = Runs<&'a [u64]>;

impl<'a> Coalescer<'a> {
    /// Segments of `addrs` (one bus address per page of `page` bytes) for a
    /// device whose segments may be `max_seg` bytes long.
    pub(crate) fn new(addrs: &'a [u64], page: u64, max_seg: u64) -> Self {
        Runs::of(addrs.len(), addrs, page, max_seg)
    }
}

impl<A: PageAddrs> Iterator for Runs<A> {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        if self.at >= self.n {
            return None;
        }
        let mut seg = Segment {
            addr: self.addrs.at(self.at),
            len: self.page,
        };
        self.at += 1;
        while self.at < self.n
            && seg.addr.checked_add(seg.len) == Some(self.addrs.at(self.at))
            && seg.len + self.page <= self.max_seg
        {
            seg.len += self.page;
            self.at += 1;
        }
        Some(seg)
    }
}
