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

/// Iterator over the segments of a page-address list.
///
/// Pages whose DMA addresses follow each other are merged, as long as a
/// segment stays within `max_seg` bytes (rounded down to whole pages, at least
/// one page) and within `u32::MAX` (the width of a scatterlist length).
pub(crate) struct Coalescer<'a> {
    addrs: &'a [u64],
    page: u64,
    max_seg: u64,
}

impl<'a> Coalescer<'a> {
    /// Segments of `addrs` (one bus address per page of `page` bytes) for a
    /// device whose segments may be `max_seg` bytes long.
    pub(crate) fn new(addrs: &'a [u64], page: u64, max_seg: u64) -> Self {
        Self {
            addrs,
            page,
            max_seg: segment_limit(max_seg, page),
        }
    }
}

impl Iterator for Coalescer<'_> {
    type Item = Segment;

    /// The first run of the pages left (see [`Runs`]), which leaves the
    /// pages after it.
    fn next(&mut self) -> Option<Segment> {
        let addrs = self.addrs;
        // `max_seg` is limited already.
        let mut runs = Runs {
            at: 0,
            n: addrs.len(),
            addr: |i| addrs[i],
            page: self.page,
            max_seg: self.max_seg,
        };
        let seg = runs.next()?;
        self.addrs = &addrs[runs.at..];
        Some(seg)
    }
}

/// Segments of `n` pages whose addresses a function gives (for tables whose
/// addresses are not laid out in one slice, such as the provider's page
/// pointers): the same merging rules as [`Coalescer`].
pub(crate) struct Runs<F: Fn(usize) -> u64> {
    at: usize,
    n: usize,
    addr: F,
    page: u64,
    max_seg: u64,
}

impl<F: Fn(usize) -> u64> Runs<F> {
    /// Segments of pages `0..n`, page `i` at `addr(i)`.
    pub(crate) fn new(n: usize, addr: F, page: u64, max_seg: u64) -> Self {
        Self {
            at: 0,
            n,
            addr,
            page,
            max_seg: segment_limit(max_seg, page),
        }
    }
}

impl<F: Fn(usize) -> u64> Iterator for Runs<F> {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        if self.at >= self.n {
            return None;
        }
        let mut seg = Segment {
            addr: (self.addr)(self.at),
            len: self.page,
        };
        self.at += 1;
        while self.at < self.n
            && seg.addr.checked_add(seg.len) == Some((self.addr)(self.at))
            && seg.len + self.page <= self.max_seg
        {
            seg.len += self.page;
            self.at += 1;
        }
        Some(seg)
    }
}
