// SPDX-License-Identifier: GPL-2.0 OR MIT

//! KUnit suites of the module's internals (built only with CONFIG_KUNIT=y;
//! they run when the module is loaded).

use kernel::prelude::*;

#[kunit_tests(nvidia_peermem_range)]
mod range_tests {
    use crate::range::{
        granule,
        GpuRange,
        RangeError,
        GPU_PAGE_SIZE, //
    };

    const G: u64 = GPU_PAGE_SIZE;

    #[test]
    fn zero_length_is_refused() {
        assert_eq!(GpuRange::widen(0x1000, 0, G), Err(RangeError::Empty));
    }

    #[test]
    fn one_byte_widens_to_one_page() {
        assert_eq!(
            GpuRange::widen(0x12345, 1, G),
            Ok(GpuRange {
                start: 0x10000,
                len: G
            })
        );
    }

    #[test]
    fn exact_page_stays() {
        assert_eq!(
            GpuRange::widen(0x20000, G, G),
            Ok(GpuRange {
                start: 0x20000,
                len: G
            })
        );
    }

    #[test]
    fn unaligned_both_ends() {
        let r = GpuRange::widen(0x1_0001, 2 * G, G).unwrap();
        assert_eq!(
            r,
            GpuRange {
                start: 0x1_0000,
                len: 3 * G
            }
        );
        assert_eq!(r.pages(G), 3);
    }

    #[test]
    fn crossing_2_64_overflows() {
        assert_eq!(
            GpuRange::widen(u64::MAX - 10, 100, G),
            Err(RangeError::Overflow)
        );
    }

    #[test]
    fn last_page_of_address_space_overflows_on_end() {
        assert_eq!(
            GpuRange::widen(u64::MAX - G + 1, G, G),
            Err(RangeError::Overflow)
        );
    }

    #[test]
    fn granule_is_at_least_64k() {
        assert_eq!(granule(4096), G);
        assert_eq!(granule(1 << 16), G);
        assert_eq!(granule(1 << 18), 1 << 18);
    }
}

#[kunit_tests(nvidia_peermem_coalesce)]
mod coalesce_tests {
    use crate::coalesce::{
        Coalescer,
        Segment, //
    };
    use kernel::prelude::*;

    const P: u64 = 1 << 16;

    #[test]
    fn contiguous_run_is_one_segment() {
        let a = [0x1000_0000, 0x1001_0000, 0x1002_0000];
        let s: [Option<Segment>; 2] = {
            let mut it = Coalescer::new(&a, P, 1 << 31);
            [it.next(), it.next()]
        };
        assert_eq!(
            s[0],
            Some(Segment {
                addr: 0x1000_0000,
                len: 3 * P
            })
        );
        assert_eq!(s[1], None);
    }

    #[test]
    fn gap_splits() {
        let a = [0x1000_0000, 0x1001_0000, 0x2000_0000, 0x2001_0000];
        assert_eq!(Coalescer::new(&a, P, 1 << 31).count(), 2);
    }

    #[test]
    fn max_segment_bounds_runs() {
        let a = [0, P, 2 * P, 3 * P, 4 * P];
        assert_eq!(Coalescer::new(&a, P, 2 * P).count(), 3);
        assert_eq!(Coalescer::new(&a, P, 2 * P + 1).count(), 3);
        assert_eq!(Coalescer::new(&a, P, 1).count(), 5);
    }

    #[test]
    fn one_gib_contiguous_is_one_segment_and_bounded_by_max_seg() {
        let mut a = KVec::with_capacity(16384, GFP_KERNEL).unwrap();
        for i in 0..16384u64 {
            a.push(0x1_0000_0000 + i * P, GFP_KERNEL).unwrap();
        }
        assert_eq!(Coalescer::new(&a, P, 1 << 31).count(), 1);
        assert_eq!(Coalescer::new(&a, P, 1 << 28).count(), 4);
        assert_eq!(Coalescer::new(&a, P, P).count(), 16384);
    }

    #[test]
    fn run_ending_exactly_at_max_segment() {
        let a = [0, P, 2 * P, 3 * P];
        let mut it = Coalescer::new(&a, P, 2 * P);
        assert_eq!(
            it.next(),
            Some(Segment {
                addr: 0,
                len: 2 * P
            })
        );
        assert_eq!(
            it.next(),
            Some(Segment {
                addr: 2 * P,
                len: 2 * P
            })
        );
        assert_eq!(it.next(), None);
    }

    #[test]
    fn descending_addresses_do_not_merge() {
        let a = [3 * P, 2 * P, P];
        assert_eq!(Coalescer::new(&a, P, 1 << 31).count(), 3);
    }

    #[test]
    fn single_page() {
        assert_eq!(Coalescer::new(&[0x4000_0000], P, 1 << 31).count(), 1);
    }
}

#[kunit_tests(nvidia_peermem_lifecycle)]
mod lifecycle_tests {
    use crate::lifecycle::{
        Invalidate,
        Lifecycle,
        Phase,
        Pin,
        Refusal,
        Resources,
        Unpinned, //
    };
    use kernel::sync::atomic::{
        Atomic,
        Relaxed, //
    };

    /// The pinning process, and another one.
    const OWNER: u32 = 100;
    const OTHER: u32 = 200;
    const TABLE: u32 = 7;
    const MAP: u32 = 9;
    const CTX: u64 = 42;

    /// The callback's reference. Dropping it leaves the reference with the
    /// GPU driver (its callback consumes it): each drop is counted.
    struct Token {
        id: u32,
        drops: &'static Atomic<usize>,
    }

    impl Drop for Token {
        fn drop(&mut self) {
            self.drops.add(1, Relaxed);
        }
    }

    /// Plain markers as the provider's objects.
    struct Plain;

    impl Resources for Plain {
        type Table = u32;
        type Token = Token;
        type Map = u32;
    }

    type Lc = Lifecycle<Plain>;

    fn pin(persistent: bool, drops: &'static Atomic<usize>) -> Pin<Plain> {
        Pin {
            table: TABLE,
            token: if persistent {
                None
            } else {
                Some(Token { id: TABLE, drops })
            },
            owner: OWNER,
        }
    }

    /// Bound by `get_pages` (non-persistent unless `persistent`).
    fn bound(persistent: bool, drops: &'static Atomic<usize>) -> Lc {
        let mut l = Lc::new();
        let _ = l.start_pin();
        let _ = l.pin_succeeded(pin(persistent, drops));
        let _ = l.bind(CTX);
        l
    }

    fn mapped(persistent: bool, drops: &'static Atomic<usize>) -> Lc {
        let mut l = bound(persistent, drops);
        let _ = l.start_map();
        let _ = l.map_succeeded(MAP);
        l
    }

    fn token_id(t: &Option<Token>) -> Option<u32> {
        t.as_ref().map(|t| t.id)
    }

    #[test]
    fn persistent_full_life() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        let mut l = Lc::new();
        assert_eq!(l.start_pin(), Ok(()));
        assert!(l.pin_succeeded(pin(true, &DROPS)).is_ok());
        assert_eq!(l.pinned_table(), Ok(&TABLE));
        assert!(!l.callback_armed());
        assert_eq!(l.bind(CTX), Ok(()));
        assert_eq!(l.start_map(), Ok(&TABLE));
        assert_eq!(l.map_succeeded(MAP), Ok(()));
        assert_eq!(l.map(), Some(&MAP));
        assert_eq!(l.unmap(), Some(MAP));
        assert_eq!(l.unmap(), None);
        assert_eq!(l.put_pages(), None);
        assert_eq!(l.phase(), Phase::Bound);
        // Mapped again, then released with the mapping still there: from
        // another process, which may unpin a persistent pin.
        assert_eq!(l.start_map(), Ok(&TABLE));
        assert_eq!(l.map_succeeded(MAP + 1), Ok(()));
        // The release ends the lifecycle at once: no callback can race a
        // persistent unpin.
        let r = l.release(OTHER);
        assert_eq!(r.map, Some(MAP + 1));
        assert_eq!(r.unpin, Some(TABLE));
        assert!(!r.orphaned);
        assert!(r.ended);
        assert_eq!(l.phase(), Phase::Released);
        assert!(!l.callback_armed());
        // Nothing is left to report or to hand out again.
        let (how, tok) = l.unpinned(true);
        assert_eq!(how, Unpinned::Raced);
        assert!(tok.is_none());
        let r = l.release(OWNER);
        assert!(r.map.is_none() && r.unpin.is_none() && !r.ended);
        assert_eq!(l.phase(), Phase::Released);
        assert_eq!(DROPS.load(Relaxed), 0);
    }

    #[test]
    fn a_lifecycle_made_pinning_or_pinned_is_as_if_started() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        let mut made = Lc::with_pin(pin(true, &DROPS));
        let mut l = Lc::new();
        assert_eq!(l.start_pin(), Ok(()));
        assert!(l.pin_succeeded(pin(true, &DROPS)).is_ok());
        for l in [&mut made, &mut l] {
            assert_eq!(l.phase(), Phase::Pinned);
            assert_eq!(l.owner(), Some(OWNER));
            assert!(!l.callback_armed());
            assert_eq!(l.pinned_table(), Ok(&TABLE));
            assert_eq!(l.bind(CTX), Ok(()));
        }
        assert_eq!(DROPS.load(Relaxed), 0);
        // Made in Pinning: the same as started.
        let mut made = Lc::pinning();
        let mut l = Lc::new();
        assert_eq!(l.start_pin(), Ok(()));
        for l in [&mut made, &mut l] {
            assert_eq!(l.phase(), Phase::Pinning);
            assert_eq!(l.start_pin(), Err(Refusal::Forbidden(Phase::Pinning)));
            assert!(l.pin_succeeded(pin(false, &DROPS)).is_ok());
            assert!(l.callback_armed());
        }
    }

    #[test]
    fn a_non_persistent_release_leaves_the_unpin_to_report() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        let mut l = bound(false, &DROPS);
        let r = l.release(OWNER);
        assert_eq!(r.unpin, Some(TABLE));
        assert!(!r.ended);
        assert_eq!(l.phase(), Phase::Unpinning);
        assert!(l.callback_armed());
    }

    #[test]
    fn invalidating_unpin_by_the_owner_reclaims_the_token_once() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        let mut l = mapped(false, &DROPS);
        assert!(l.callback_armed());
        assert_eq!(l.unmap(), Some(MAP));
        assert_eq!(l.put_pages(), None);
        assert_eq!(l.phase(), Phase::Bound);
        let r = l.release(OWNER);
        assert_eq!(r.map, None);
        assert_eq!(r.unpin, Some(TABLE));
        assert!(!r.orphaned);
        assert_eq!(l.phase(), Phase::Unpinning);
        // Armed until the provider says the unpin is done.
        assert!(l.callback_armed());
        let (how, tok) = l.unpinned(true);
        assert_eq!(how, Unpinned::Reclaim);
        assert_eq!(token_id(&tok), Some(TABLE));
        // Handed out to be reclaimed, not dropped in the lifecycle.
        assert_eq!(DROPS.load(Relaxed), 0);
        drop(tok);
        assert_eq!(l.phase(), Phase::Released);
        assert!(!l.callback_armed());
        let (how, tok) = l.unpinned(true);
        assert_eq!(how, Unpinned::Raced);
        assert!(tok.is_none());
        assert_eq!(l.invalidate(), (Invalidate::Quiet, None));
        assert_eq!(DROPS.load(Relaxed), 1);
    }

    #[test]
    fn release_from_another_process_orphans_the_pin() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        let mut l = mapped(false, &DROPS);
        let r = l.release(OTHER);
        // The mapping is the client's own: undone now. The GPU driver would
        // not find the pin from this process (fact 7): nothing to unpin.
        assert_eq!(r.map, Some(MAP));
        assert_eq!(r.unpin, None);
        assert!(r.orphaned);
        assert_eq!(l.phase(), Phase::Orphaned);
        assert!(l.callback_armed());
        assert_eq!(DROPS.load(Relaxed), 0);
        // Nothing else ends an orphan.
        let r = l.release(OWNER);
        assert!(r.map.is_none() && r.unpin.is_none() && !r.orphaned);
        let (how, tok) = l.unpinned(true);
        assert_eq!(how, Unpinned::Raced);
        assert!(tok.is_none());
        assert_eq!(l.unmap(), None);
        assert_eq!(l.start_map(), Err(Refusal::Revoked));
        assert_eq!(l.phase(), Phase::Orphaned);
        assert_eq!(DROPS.load(Relaxed), 0);
        // The callback ends it, consuming its reference.
        assert_eq!(
            l.invalidate(),
            (Invalidate::Reaped { orphaned: true }, Some(TABLE))
        );
        assert_eq!(DROPS.load(Relaxed), 1);
        assert_eq!(l.phase(), Phase::Released);
        assert!(!l.callback_armed());
    }

    #[test]
    fn failed_unpin_strands_the_pin() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        let mut l = bound(false, &DROPS);
        assert_eq!(l.release(OWNER).unpin, Some(TABLE));
        let (how, tok) = l.unpinned(false);
        assert_eq!(how, Unpinned::Stranded);
        assert!(tok.is_none());
        assert_eq!(l.phase(), Phase::Stranded);
        // The callback stays armed (fact 8) with its reference.
        assert!(l.callback_armed());
        assert_eq!(DROPS.load(Relaxed), 0);
        let r = l.release(OWNER);
        assert!(r.map.is_none() && r.unpin.is_none() && !r.orphaned);
        let (how, tok) = l.unpinned(true);
        assert_eq!(how, Unpinned::Raced);
        assert!(tok.is_none());
        assert_eq!(l.phase(), Phase::Stranded);
        // The table went to the failed unpin: the callback has none.
        assert_eq!(
            l.invalidate(),
            (Invalidate::Reaped { orphaned: false }, None)
        );
        assert_eq!(DROPS.load(Relaxed), 1);
        assert_eq!(l.phase(), Phase::Released);
    }

    #[test]
    fn callback_racing_the_unpin_keeps_its_reference() {
        for ok in [true, false] {
            static DROPS: Atomic<usize> = Atomic::new(0);
            let before = DROPS.load(Relaxed);
            let mut l = bound(false, &DROPS);
            assert_eq!(l.release(OWNER).unpin, Some(TABLE));
            // The callback fired while the provider's unpin was in flight.
            assert_eq!(l.invalidate(), (Invalidate::Quiet, None));
            assert_eq!(l.phase(), Phase::Unpinning);
            assert!(!l.callback_armed());
            assert_eq!(DROPS.load(Relaxed), before + 1);
            let (how, tok) = l.unpinned(ok);
            assert_eq!(how, Unpinned::Raced);
            assert!(tok.is_none());
            assert_eq!(l.phase(), Phase::Released);
            assert_eq!(DROPS.load(Relaxed), before + 1);
        }
    }

    #[test]
    fn revoke_while_mapped_hands_the_map_back_once() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        // The core did not unmap from its invalidate: the callback does.
        let mut l = mapped(false, &DROPS);
        assert_eq!(l.invalidate(), (Invalidate::NotifyCore(CTX), Some(TABLE)));
        assert_eq!(DROPS.load(Relaxed), 1);
        assert_eq!(l.phase(), Phase::Revoked);
        assert!(!l.callback_armed());
        assert_eq!(l.map(), None);
        // The callback undoes the device's access; the map (its
        // scatterlist) stays for the core until it unmaps or releases.
        assert_eq!(l.revoked_map_mut().copied(), Some(MAP));
        assert_eq!(l.revoked_map_mut().copied(), Some(MAP));
        assert_eq!(l.unmap(), Some(MAP));
        assert_eq!(l.revoked_map_mut(), None);
        assert_eq!(l.put_pages(), None);
        let r = l.release(OWNER);
        assert!(r.map.is_none() && r.unpin.is_none() && !r.orphaned);
        assert_eq!(l.phase(), Phase::Released);

        // A legacy core unmaps from inside its invalidate.
        let mut l = mapped(false, &DROPS);
        assert_eq!(l.invalidate(), (Invalidate::NotifyCore(CTX), Some(TABLE)));
        assert_eq!(l.unmap(), Some(MAP));
        assert_eq!(l.put_pages(), None);
        assert_eq!(l.revoked_map_mut(), None);
        assert!(l.release(OWNER).map.is_none());

        // Released before anyone undid it: release hands it back.
        let mut l = mapped(false, &DROPS);
        assert_eq!(l.invalidate(), (Invalidate::NotifyCore(CTX), Some(TABLE)));
        let r = l.release(OWNER);
        assert_eq!(r.map, Some(MAP));
        assert!(r.unpin.is_none() && !r.orphaned);
        assert_eq!(l.revoked_map_mut(), None);
        assert_eq!(l.unmap(), None);
        assert_eq!(DROPS.load(Relaxed), 3);
    }

    #[test]
    fn revoke_while_mapping_fails_the_map() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        let mut l = bound(false, &DROPS);
        assert_eq!(l.start_map(), Ok(&TABLE));
        assert_eq!(l.invalidate(), (Invalidate::NotifyCore(CTX), Some(TABLE)));
        // The mapping made meanwhile comes back to be undone.
        assert_eq!(l.map_succeeded(MAP), Err(MAP));
        assert_eq!(l.phase(), Phase::Revoked);
        assert_eq!(l.map(), None);
        assert_eq!(l.revoked_map_mut(), None);
        assert_eq!(l.unmap(), None);
        l.map_failed();
        assert_eq!(l.phase(), Phase::Revoked);
        assert_eq!(l.start_map(), Err(Refusal::Revoked));
        let r = l.release(OWNER);
        assert!(r.map.is_none() && r.unpin.is_none() && !r.orphaned);
        assert_eq!(DROPS.load(Relaxed), 1);
    }

    #[test]
    fn revoke_while_pinning_fails_the_pin() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        let mut l = Lc::new();
        assert_eq!(l.start_pin(), Ok(()));
        assert_eq!(l.invalidate(), (Invalidate::Quiet, None));
        assert_eq!(l.phase(), Phase::Revoked);
        let back = l.pin_succeeded(pin(false, &DROPS)).err();
        assert!(back.is_some());
        if let Some(back) = back {
            assert_eq!(back.table, TABLE);
            assert_eq!(back.owner, OWNER);
            assert_eq!(token_id(&back.token), Some(TABLE));
            // The caller drops the handles: the callback consumed the
            // reference.
            drop(back);
        }
        assert_eq!(DROPS.load(Relaxed), 1);
        assert!(!l.callback_armed());
        assert_eq!(l.pinned_table(), Err(Refusal::Revoked));
        assert_eq!(l.bind(CTX), Err(Refusal::Revoked));
        assert_eq!(l.start_map(), Err(Refusal::Revoked));
        let r = l.release(OWNER);
        assert!(r.map.is_none() && r.unpin.is_none() && !r.orphaned);
        assert_eq!(l.phase(), Phase::Released);
    }

    /// Fix "dma_map after page-size mismatch": `dma_map` needs the table
    /// accepted by `get_pages`.
    #[test]
    fn dma_map_refused_before_bind_and_after_reject() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        for persistent in [false, true] {
            let mut l = Lc::new();
            assert_eq!(l.start_map(), Err(Refusal::Forbidden(Phase::Acquired)));
            assert_eq!(l.start_pin(), Ok(()));
            assert!(l.pin_succeeded(pin(persistent, &DROPS)).is_ok());
            assert_eq!(l.start_map(), Err(Refusal::Forbidden(Phase::Pinned)));
            assert_eq!(l.phase(), Phase::Pinned);
            // get_pages refused the table (page size, version, entries).
            l.reject();
            assert_eq!(l.phase(), Phase::Unusable);
            assert_eq!(l.start_map(), Err(Refusal::Forbidden(Phase::Unusable)));
            assert_eq!(l.pinned_table(), Err(Refusal::Forbidden(Phase::Unusable)));
            assert_eq!(l.bind(CTX), Err(Refusal::Forbidden(Phase::Unusable)));
            assert_eq!(l.phase(), Phase::Unusable);
            // Only release may use the pin: it unpins.
            let r = l.release(OWNER);
            assert_eq!(r.map, None);
            assert_eq!(r.unpin, Some(TABLE));
            assert!(!r.orphaned);
        }
    }

    #[test]
    fn map_failure_returns_to_bound_and_can_retry() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        let mut l = bound(false, &DROPS);
        assert_eq!(l.start_map(), Ok(&TABLE));
        assert_eq!(l.start_map(), Err(Refusal::Forbidden(Phase::Mapping)));
        l.map_failed();
        assert_eq!(l.phase(), Phase::Bound);
        assert_eq!(l.start_map(), Ok(&TABLE));
        assert_eq!(l.map_succeeded(MAP), Ok(()));
        assert_eq!(l.map(), Some(&MAP));
    }

    #[test]
    fn nothing_is_legal_after_release() {
        static DROPS: Atomic<usize> = Atomic::new(0);
        for persistent in [false, true] {
            let mut l = mapped(persistent, &DROPS);
            let r = l.release(OWNER);
            assert_eq!(r.ended, persistent);
            if !persistent {
                let _ = l.unpinned(true);
            }
            assert_eq!(l.phase(), Phase::Released);
            let gone = Refusal::Forbidden(Phase::Released);
            assert_eq!(l.start_pin(), Err(gone));
            assert!(l.pin_succeeded(pin(persistent, &DROPS)).is_err());
            assert_eq!(l.pinned_table(), Err(gone));
            assert_eq!(l.bind(CTX), Err(gone));
            assert_eq!(l.start_map(), Err(gone));
            assert_eq!(l.map_succeeded(MAP), Err(MAP));
            assert_eq!(l.map(), None);
            assert_eq!(l.unmap(), None);
            assert_eq!(l.put_pages(), None);
            assert_eq!(l.revoked_map_mut(), None);
            let r = l.release(OWNER);
            assert!(r.map.is_none() && r.unpin.is_none() && !r.orphaned);
            let (how, tok) = l.unpinned(true);
            assert_eq!(how, Unpinned::Raced);
            assert!(tok.is_none());
            assert_eq!(l.invalidate(), (Invalidate::Quiet, None));
            l.pin_failed();
            l.reject();
            l.map_failed();
            assert_eq!(l.phase(), Phase::Released);
            assert!(!l.callback_armed());
        }
    }

    const PHASES: [Phase; 13] = [
        Phase::Acquired,
        Phase::Pinning,
        Phase::Pinned,
        Phase::Unusable,
        Phase::Bound,
        Phase::Mapping,
        Phase::Mapped,
        Phase::Revoked,
        Phase::Drained,
        Phase::Unpinning,
        Phase::Stranded,
        Phase::Orphaned,
        Phase::Released,
    ];

    /// A lifecycle brought to `phase` by legal steps, or `None` where a
    /// persistent pin never goes (it has no callback, and its unpin is not
    /// process-keyed).
    fn reach(phase: Phase, persistent: bool, drops: &'static Atomic<usize>) -> Option<Lc> {
        let mut l = Lc::new();
        match phase {
            Phase::Acquired => return Some(l),
            Phase::Released => {
                let _ = l.release(OWNER);
                return Some(l);
            }
            _ => (),
        }
        let _ = l.start_pin();
        if phase == Phase::Pinning {
            return Some(l);
        }
        let _ = l.pin_succeeded(pin(persistent, drops));
        match phase {
            Phase::Pinned => return Some(l),
            Phase::Unusable => {
                l.reject();
                return Some(l);
            }
            _ => (),
        }
        reach_bound(l, phase, persistent)
    }

    /// [`reach`] for the phases from Bound on, from a pinned lifecycle `l`.
    fn reach_bound(mut l: Lc, phase: Phase, persistent: bool) -> Option<Lc> {
        let _ = l.bind(CTX);
        match phase {
            Phase::Bound => (),
            Phase::Mapping => {
                let _ = l.start_map();
            }
            Phase::Mapped => {
                let _ = l.start_map();
                let _ = l.map_succeeded(MAP);
            }
            Phase::Unpinning if !persistent => {
                let _ = l.release(OWNER);
            }
            Phase::Revoked if !persistent => {
                let _ = l.invalidate();
            }
            Phase::Drained if !persistent => {
                let _ = l.start_map();
                let _ = l.map_succeeded(MAP);
                assert_eq!(l.drain(), Some(CTX));
            }
            Phase::Stranded if !persistent => {
                let _ = l.release(OWNER);
                let _ = l.unpinned(false);
            }
            Phase::Orphaned if !persistent => {
                let _ = l.release(OTHER);
            }
            _ => return None,
        }
        Some(l)
    }

    /// The drops of the tokens made by [`Case::at`].
    static CASE_DROPS: Atomic<usize> = Atomic::new(0);

    fn drops() -> usize {
        CASE_DROPS.load(Relaxed)
    }

    /// `l` is in phase `want` and holds exactly that phase's objects.
    fn is_at(l: &Lc, want: Phase) {
        assert_eq!(l.phase(), want);
        assert!(l.consistent());
    }

    /// One phase (of a persistent pin or not), and what every call must find
    /// there.
    struct Case {
        p: Phase,
        persistent: bool,
        refusal: Refusal,
        /// The lifecycle holds the callback's reference from the pin until
        /// an unpin or the callback ends it.
        holds: bool,
        pinned: bool,
        mapped: bool,
    }

    impl Case {
        fn new(p: Phase, persistent: bool) -> Self {
            use Phase::*;
            let holds = matches!(
                p,
                Pinned
                    | Unusable
                    | Bound
                    | Mapping
                    | Mapped
                    | Drained
                    | Unpinning
                    | Stranded
                    | Orphaned
            );
            Self {
                p,
                persistent,
                refusal: if matches!(p, Revoked | Drained | Orphaned) {
                    Refusal::Revoked
                } else {
                    Refusal::Forbidden(p)
                },
                holds: !persistent && holds,
                pinned: matches!(p, Pinned | Unusable | Bound | Mapped | Drained),
                // A drained registration keeps its mapping for the core.
                mapped: matches!(p, Mapped | Drained),
            }
        }

        /// A lifecycle in this phase, holding exactly its objects.
        fn at(&self) -> Lc {
            let l = reach(self.p, self.persistent, &CASE_DROPS).unwrap_or_else(Lc::new);
            assert!(l.consistent());
            l
        }

        /// The phase after a call: `next` if it was legal, else this one.
        fn moved(&self, legal: bool, next: Phase) -> Phase {
            if legal {
                next
            } else {
                self.p
            }
        }

        /// The result of a call legal only when `ok`.
        fn refused<T>(&self, ok: bool, v: T) -> Result<T, Refusal> {
            if ok {
                Ok(v)
            } else {
                Err(self.refusal)
            }
        }

        /// start_pin / pin_failed / pin_succeeded: only while pinning.
        fn pin_calls(&self) {
            let mut l = self.at();
            let ok = self.p == Phase::Acquired;
            assert_eq!(l.start_pin(), self.refused(ok, ()));
            is_at(&l, self.moved(ok, Phase::Pinning));
            let mut l = self.at();
            l.pin_failed();
            is_at(&l, self.moved(self.p == Phase::Pinning, Phase::Acquired));
            let mut l = self.at();
            let ok = self.p == Phase::Pinning;
            assert_eq!(
                l.pin_succeeded(pin(self.persistent, &CASE_DROPS)).is_ok(),
                ok
            );
            is_at(&l, self.moved(ok, Phase::Pinned));
        }

        /// get_pages: reads the table, binds or rejects, only Pinned.
        fn get_pages_calls(&self) {
            let l = self.at();
            let ok = self.p == Phase::Pinned;
            assert_eq!(l.pinned_table(), self.refused(ok, &TABLE));
            let mut l = self.at();
            assert_eq!(l.bind(CTX), self.refused(ok, ()));
            is_at(&l, self.moved(ok, Phase::Bound));
            let mut l = self.at();
            l.reject();
            is_at(&l, self.moved(ok, Phase::Unusable));
        }

        /// dma_map: only once bound.
        fn dma_map_calls(&self) {
            let mut l = self.at();
            let ok = self.p == Phase::Bound;
            assert_eq!(l.start_map(), self.refused(ok, &TABLE));
            is_at(&l, self.moved(ok, Phase::Mapping));
            let mut l = self.at();
            l.map_failed();
            is_at(&l, self.moved(self.p == Phase::Mapping, Phase::Bound));
            let mut l = self.at();
            let ok = self.p == Phase::Mapping;
            let r = l.map_succeeded(MAP + 1);
            assert_eq!(r, if ok { Ok(()) } else { Err(MAP + 1) });
            is_at(&l, self.moved(ok, Phase::Mapped));
        }

        /// dma_unmap and put_pages: hand the map back once, never unpin.
        fn unmap_calls(&self) {
            let map = self.mapped.then_some(MAP);
            let drained = self.p == Phase::Drained;
            let mut l = self.at();
            assert_eq!(l.map().copied(), map.filter(|_| !drained));
            assert_eq!(l.unmap(), map);
            assert_eq!(l.unmap(), None);
            assert_eq!(l.put_pages(), None);
            let next = if drained {
                Phase::Drained
            } else {
                Phase::Bound
            };
            is_at(&l, self.moved(self.mapped, next));
            let mut l = self.at();
            assert_eq!(l.put_pages(), map);
            assert_eq!(l.revoked_map_mut(), None);
        }

        /// The drain: revokes a bound registration with a callback through
        /// the core (its id, once) and keeps the pin; nothing anywhere else.
        fn drain_calls(&self) {
            use Phase::*;
            let mut l = self.at();
            let ok = !self.persistent && matches!(self.p, Bound | Mapping | Mapped);
            assert_eq!(l.drain(), ok.then_some(CTX));
            assert_eq!(l.drain(), None);
            is_at(&l, self.moved(ok, Drained));
            assert_eq!(l.callback_armed(), self.holds);
            if ok {
                assert_eq!(l.owner(), Some(OWNER));
                assert_eq!(l.start_map(), Err(Refusal::Revoked));
                assert_eq!(l.bind(CTX), Err(Refusal::Revoked));
            }
        }

        /// What the free callback must do here, what it hands back, and the
        /// phase after it.
        fn invalidation(&self) -> (Invalidate, Option<u32>, Phase) {
            use Phase::*;
            match self.p {
                Acquired => (Invalidate::Quiet, None, Acquired),
                Pinning => (Invalidate::Quiet, None, Revoked),
                Pinned | Unusable => (Invalidate::Quiet, Some(TABLE), Revoked),
                Bound | Mapping | Mapped => (Invalidate::NotifyCore(CTX), Some(TABLE), Revoked),
                // The core is told again; the pin ends.
                Drained => (Invalidate::NotifyCore(CTX), Some(TABLE), Revoked),
                Stranded => (Invalidate::Reaped { orphaned: false }, None, Released),
                Orphaned => (Invalidate::Reaped { orphaned: true }, Some(TABLE), Released),
                p => (Invalidate::Quiet, None, p),
            }
        }

        /// The free callback: drops the reference it consumes.
        fn callback(&self) {
            let mut l = self.at();
            let (action, table, next) = self.invalidation();
            let before = drops();
            assert_eq!(l.invalidate(), (action, table));
            assert_eq!(drops() - before, usize::from(self.holds));
            is_at(&l, next);
            assert!(!l.callback_armed());
            let map = self.mapped.then_some(MAP);
            assert_eq!(l.revoked_map_mut().copied(), map);
            assert_eq!(l.revoked_map_mut().copied(), map);
            assert_eq!(l.invalidate(), (Invalidate::Quiet, None));
        }

        /// release, by the owner and by another process: unpins only a pin
        /// it holds, non-persistent ones only in the owner's process; never
        /// drops the reference.
        fn release_calls(&self, tgid: u32) {
            let mut l = self.at();
            let before = drops();
            let r = l.release(tgid);
            let (pinned, persistent) = (self.pinned, self.persistent);
            let orphan = pinned && !persistent && tgid == OTHER;
            assert_eq!(r.map, self.mapped.then_some(MAP));
            assert_eq!(r.unpin, (pinned && !orphan).then_some(TABLE));
            assert_eq!(r.orphaned, orphan);
            // A persistent pin's lifecycle ends with its release.
            assert_eq!(r.ended, pinned && persistent);
            let next = match self.p {
                _ if orphan => Phase::Orphaned,
                _ if pinned && persistent => Phase::Released,
                _ if pinned => Phase::Unpinning,
                Phase::Acquired | Phase::Revoked | Phase::Released => Phase::Released,
                p => p,
            };
            is_at(&l, next);
            assert_eq!(l.callback_armed(), self.holds);
            assert_eq!(drops(), before);
            let r = l.release(tgid);
            assert!(r.map.is_none() && r.unpin.is_none() && !r.orphaned);
        }

        /// The unpin's end: reclaims only after a successful unpin.
        fn unpinned_calls(&self, ok: bool) {
            let mut l = self.at();
            let before = drops();
            let (how, tok) = l.unpinned(ok);
            let unpinning = self.p == Phase::Unpinning;
            // Only a non-persistent pin is ever in Unpinning.
            assert!(!(unpinning && self.persistent));
            let (want, next) = match (unpinning, ok) {
                (false, _) => (Unpinned::Raced, self.p),
                (true, true) => (Unpinned::Reclaim, Phase::Released),
                (true, false) => (Unpinned::Stranded, Phase::Stranded),
            };
            assert_eq!(how, want);
            let reclaimed = want == Unpinned::Reclaim;
            assert_eq!(token_id(&tok), reclaimed.then_some(TABLE));
            assert_eq!(drops(), before);
            is_at(&l, next);
            assert_eq!(l.callback_armed(), self.holds && !reclaimed);
        }
    }

    #[test]
    fn every_phase_against_every_call() {
        for persistent in [false, true] {
            for p in PHASES {
                let Some(l) = reach(p, persistent, &CASE_DROPS) else {
                    continue;
                };
                // Every phase holds exactly its objects, before and after
                // every call.
                assert_eq!(l.phase(), p);
                drop(l);
                let case = Case::new(p, persistent);
                assert_eq!(case.at().callback_armed(), case.holds);
                case.pin_calls();
                case.get_pages_calls();
                case.dma_map_calls();
                case.unmap_calls();
                case.drain_calls();
                case.callback();
                for tgid in [OWNER, OTHER] {
                    case.release_calls(tgid);
                }
                for ok in [true, false] {
                    case.unpinned_calls(ok);
                }
            }
        }
    }
}

#[kunit_tests(nvidia_peermem_p2p)]
mod p2p_tests {
    use crate::compat;
    use crate::ffi;
    use crate::p2p::{
        dma_mapping_version_ok,
        page_table_version_ok,
        provider_error,
        PageTable,
        PageView, //
    };
    use kernel::prelude::*;

    #[test]
    fn page_table_versions() {
        assert!(page_table_version_ok(0x0001_0002));
        assert!(page_table_version_ok(0x0001_0003));
        assert!(page_table_version_ok(0x0002_0000));
        assert!(page_table_version_ok(0x0002_0007));
        assert!(!page_table_version_ok(0x0001_0001));
        assert!(!page_table_version_ok(0x0003_0000));
        assert!(!page_table_version_ok(0));
    }

    #[test]
    fn dma_mapping_versions() {
        assert!(dma_mapping_version_ok(0x0002_0003));
        assert!(dma_mapping_version_ok(0x0002_0004));
        assert!(!dma_mapping_version_ok(0x0002_0002));
        assert!(!dma_mapping_version_ok(0x0001_0003));
        assert!(!dma_mapping_version_ok(0x0003_0003));
    }

    const PAGE: u64 = 0x1_0000;

    /// Pages at `addrs` (0: a NULL page pointer), as the runs the client
    /// maps (`device_map::runs`, segments of at most `max_seg` bytes), or
    /// `None` when a page has no address.
    fn runs_of(addrs: &[u64], max_seg: u64) -> Result<Option<KVec<(u64, u64)>>> {
        let mut pages = KVec::with_capacity(addrs.len(), GFP_KERNEL)?;
        for &a in addrs {
            // SAFETY: an all-zero page is a valid value of the C struct.
            let mut p: ffi::nvidia_p2p_page = unsafe { core::mem::zeroed() };
            p.physical_address = a;
            pages.push(p, GFP_KERNEL)?;
        }
        let mut ptrs = KVec::with_capacity(addrs.len(), GFP_KERNEL)?;
        for (p, &a) in pages.iter().zip(addrs) {
            ptrs.push((a != 0).then_some(p), GFP_KERNEL)?;
        }
        let view = PageView::from_pages(&ptrs);
        let missing = core::cell::Cell::new(false);
        let mut out = KVec::new();
        for run in crate::device_map::runs(&view, max_seg, &missing) {
            match run {
                Ok(r) => out.push((r.addr, r.len), GFP_KERNEL)?,
                Err(_) => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    #[test]
    fn pages_that_follow_each_other_are_one_run() -> Result {
        let base = 0x38_0000_0000u64;
        let addrs: KVec<u64> = {
            let mut v = KVec::new();
            for i in 0..32 {
                v.push(base + i * PAGE, GFP_KERNEL)?;
            }
            v
        };
        let one = runs_of(&addrs, 1 << 31)?.ok_or(EINVAL)?;
        assert_eq!(&one[..], &[(base, 32 * PAGE)]);
        let one = runs_of(&[base], 1 << 31)?.ok_or(EINVAL)?;
        assert_eq!(&one[..], &[(base, PAGE)]);
        // The device's segment limit cuts a run.
        let cut = runs_of(&addrs[..4], 2 * PAGE)?.ok_or(EINVAL)?;
        assert_eq!(&cut[..], &[(base, 2 * PAGE), (base + 2 * PAGE, 2 * PAGE)]);
        Ok(())
    }

    #[test]
    fn a_gap_splits_and_a_missing_page_fails_the_runs() -> Result {
        let b = 0x38_0000_0000u64;
        // A gap, pages in the wrong order.
        let gap = runs_of(&[b, b + 2 * PAGE], 1 << 31)?.ok_or(EINVAL)?;
        assert_eq!(&gap[..], &[(b, PAGE), (b + 2 * PAGE, PAGE)]);
        let back = runs_of(&[b + PAGE, b], 1 << 31)?.ok_or(EINVAL)?;
        assert_eq!(&back[..], &[(b + PAGE, PAGE), (b, PAGE)]);
        // A page without a pointer, alone or in a run.
        assert!(runs_of(&[b, 0, b + 2 * PAGE], 1 << 31)?.is_none());
        assert!(runs_of(&[0], 1 << 31)?.is_none());
        // No page: no run.
        assert_eq!(runs_of(&[], 1 << 31)?.map(|r| r.len()), Some(0));
        // A run that would end past the address space is cut there.
        let top = runs_of(&[u64::MAX - PAGE + 1, 0x1_0000], 1 << 31)?.ok_or(EINVAL)?;
        assert_eq!(top.len(), 2);
        Ok(())
    }

    /// A page table of `version` whose word after the public fields (the
    /// v2 `flags`) holds `flags`, and whether its view says coherent.
    fn coherent_view(version: u32, flags: u32) -> bool {
        #[repr(C)]
        struct V2 {
            pt: ffi::nvidia_p2p_page_table,
            flags: u32,
        }
        // SAFETY: all-zero is a valid value of the C struct.
        let mut t: V2 = unsafe { core::mem::zeroed() };
        assert_eq!(
            core::mem::offset_of!(V2, flags),
            crate::p2p::PAGE_TABLE_V2_FLAGS_OFFSET
        );
        t.pt.version = version;
        t.flags = flags;
        // SAFETY: `t` outlives the token and its view, and is a table with
        // room for the v2 `flags` whatever its version says.
        let table = unsafe { PageTable::from_raw(core::ptr::NonNull::from(&mut t.pt)) };
        // SAFETY: as above.
        let view = unsafe { table.pages() };
        view.coherent()
    }

    #[test]
    fn only_a_v2_table_flagged_cpu_cacheable_is_coherent() {
        assert!(coherent_view(0x0002_0000, 1));
        assert!(coherent_view(0x0002_0007, 1 | 4));
        assert!(!coherent_view(0x0002_0000, 0));
        // Another flag is not CPU_CACHEABLE.
        assert!(!coherent_view(0x0002_0000, 2));
        // A version 1 table has no flags: the word after it is not read
        // as flags, whatever it holds.
        assert!(!coherent_view(0x0001_0002, 1));
        assert!(!coherent_view(0x0001_ffff, u32::MAX));
    }

    #[test]
    fn provider_errors_never_leak_enotsupp() {
        assert_eq!(provider_error(-524), compat::eopnotsupp());
        assert_eq!(provider_error(-95), compat::eopnotsupp());
        assert_eq!(provider_error(-12), ENOMEM);
        assert_eq!(provider_error(-22), EINVAL);
        assert_eq!(provider_error(-16), EBUSY);
        assert_eq!(provider_error(-19), ENODEV);
        // Anything unexpected becomes EIO, never a positive or odd value.
        assert_eq!(provider_error(-3), EIO);
        assert_eq!(provider_error(-4000), EIO);
        assert_eq!(provider_error(7), EIO);
    }
}

#[kunit_tests(nvidia_peermem_sg)]
mod sg_tests {
    use crate::coalesce::{
        Coalescer,
        Segment, //
    };
    use crate::sg::{
        self,
        SgSlot,
        SgTable, //
    };
    use kernel::{
        bindings,
        prelude::*, //
    };

    /// `sg_mark_end`'s bit in `page_link` (include/linux/scatterlist.h).
    const SG_END: kernel::ffi::c_ulong = 0x2;

    fn seg(addr: u64, len: u64) -> Segment {
        Segment { addr, len }
    }

    fn header(t: &SgTable) -> bindings::sg_table {
        t.header()
    }

    /// The allocated table `sg::build` makes of several segments (a slot of
    /// the call's own takes a single one, refused here).
    fn table(cap: usize, segs: impl Iterator<Item = Segment>) -> Result<SgTable> {
        let slot = SgSlot::new();
        // SAFETY: the slot is this call's alone.
        unsafe { sg::build(&slot, cap, segs) }?.ok_or(EINVAL)
    }

    fn coalesced(cap: usize, addrs: &[u64], page: u64, max_seg: u64) -> Result<SgTable> {
        table(cap, Coalescer::new(addrs, page, max_seg))
    }

    #[test]
    fn one_segment_lives_in_the_slot() -> Result {
        let slot = KBox::new(SgSlot::new(), GFP_KERNEL)?;
        let slot_ptr = core::ptr::from_ref(&*slot).cast::<bindings::scatterlist>();
        // SAFETY: nothing else writes the slot or reads its entry.
        unsafe { sg::build(&slot, 1, [seg(0x1_0000_0000, 0x1_0000)].into_iter()) }?;
        let h = slot.header();
        assert_eq!(h.sgl.cast_const(), slot_ptr);
        assert_eq!((h.nents, h.orig_nents), (1, 1));
        // SAFETY: `sgl` is the slot, alive.
        let e = unsafe { &*h.sgl };
        assert_eq!(e.page_link & 0x3, SG_END);
        assert_eq!(
            (e.dma_address, e.dma_length, e.length, e.offset),
            (0x1_0000_0000, 0x1_0000, 0x1_0000, 0)
        );
        // One segment is built in the slot: no table is allocated for it.
        let other = KBox::new(SgSlot::new(), GFP_KERNEL)?;
        // SAFETY: nothing else writes that slot or reads its entry.
        let one = unsafe { sg::build(&other, 4, [seg(0x2_0000, 0x1_0000)].into_iter()) }?;
        assert!(one.is_none());
        assert_eq!(other.header().nents, 1);
        // Building and dropping an allocated table leaves the slot alone
        // (KASAN reports a free of memory inside the box, and its bytes are
        // still the entry).
        let two = [seg(0x10_0000, 0x1_0000), seg(0x30_0000, 0x1_0000)];
        // SAFETY: as above.
        drop(unsafe { sg::build(&slot, 2, two.into_iter()) }?.ok_or(EINVAL)?);
        // SAFETY: the slot is alive and no table uses it.
        let e = unsafe { &*slot_ptr };
        assert_eq!(e.dma_address, 0x1_0000_0000);
        Ok(())
    }

    #[test]
    fn a_filled_slot_is_a_one_entry_table() -> Result {
        let slot = KBox::new(SgSlot::new(), GFP_KERNEL)?;
        let slot_ptr = core::ptr::from_ref(&*slot).cast::<bindings::scatterlist>();
        // A previous mapping's entry, with a chain bit left over: the fill
        // must rewrite the whole entry.
        // SAFETY: the slot is alive and nothing else uses it.
        unsafe {
            let e = slot_ptr.cast_mut();
            (*e).page_link = 0x1;
            (*e).offset = 0x80;
            (*e).dma_address = 0xdead_0000;
        }
        // SAFETY: nothing else writes the slot or reads its entry.
        unsafe { sg::build(&slot, 1, [seg(0x2_0000_0000, 0x20_0000)].into_iter()) }?;
        let h = slot.header();
        assert_eq!(h.sgl.cast_const(), slot_ptr);
        assert_eq!((h.nents, h.orig_nents), (1, 1));
        // SAFETY: the slot is alive.
        let e = unsafe { &*slot_ptr };
        assert_eq!(e.page_link & 0x3, SG_END);
        assert_eq!(
            (e.dma_address, e.dma_length, e.length, e.offset),
            (0x2_0000_0000, 0x20_0000, 0x20_0000, 0)
        );
        // A segment a scatterlist entry cannot describe is refused.
        let too_long = [seg(0, 1 << 32)].into_iter();
        // SAFETY: as above.
        assert_eq!(unsafe { sg::build(&slot, 1, too_long) }.err(), Some(EINVAL));
        Ok(())
    }

    #[test]
    fn a_coalesced_table_shows_the_runs_found() -> Result {
        const P: u64 = 0x1_0000;
        // A page alone, then two runs of three pages, each cut by the device's
        // two-page segment limit.
        let addrs = [
            0x50_0000, 0x10_0000, 0x11_0000, 0x12_0000, 0x20_0000, 0x21_0000, 0x22_0000,
        ];
        let segs = [
            seg(0x50_0000, P),
            seg(0x10_0000, 2 * P),
            seg(0x12_0000, P),
            seg(0x20_0000, 2 * P),
            seg(0x22_0000, P),
        ];
        let t = coalesced(7, &addrs, P, 2 * P)?;
        let h = header(&t);
        // The DMA view is what was filled; all seven entries are freed.
        assert_eq!((h.nents, h.orig_nents), (5, 7));
        let mut e = h.sgl;
        for i in 0..7 {
            assert!(!e.is_null());
            // SAFETY: one of the table's 7 entries.
            let r = unsafe { &*e };
            match segs.get(i) {
                Some(s) => assert_eq!((r.dma_address, u64::from(r.dma_length)), (s.addr, s.len)),
                None => assert_eq!((r.dma_length, r.length), (0, 0)),
            }
            let last = r.page_link & SG_END != 0;
            assert_eq!(last, i == 6);
            // SAFETY: `e` is an entry of a table set up by `sg_alloc_table`.
            e = unsafe { bindings::sg_next(e) };
        }
        assert!(e.is_null());
        Ok(())
    }

    #[test]
    fn a_coalesced_table_spans_chained_chunks() -> Result {
        const P: u64 = 0x1_0000;
        // Over 128 entries span chained chunks: 300 pages, none following
        // the one before.
        let mut many = KVec::new();
        for i in 0..300u64 {
            many.push(0x1000_0000 - i * P, GFP_KERNEL)?;
        }
        let t = coalesced(300, &many, P, 1 << 31)?;
        let h = header(&t);
        assert_eq!((h.nents, h.orig_nents), (300, 300));
        let mut e = h.sgl;
        for a in many.iter() {
            assert!(!e.is_null());
            // SAFETY: one of the table's entries.
            let r = unsafe { &*e };
            assert_eq!((r.dma_address, r.dma_length), (*a, P as u32));
            // SAFETY: as above.
            e = unsafe { bindings::sg_next(e) };
        }
        assert!(e.is_null());
        Ok(())
    }

    #[test]
    fn a_coalesced_table_stops_a_run_at_the_top_of_the_address_space() -> Result {
        const P: u64 = 0x1_0000;
        // A run may end at the top of the address space, and no page follows
        // it there: the page at 0 after it starts a run of its own, as in
        // `Coalescer`.
        let top = u64::MAX - P + 1;
        let wraps = [top - P, top, 0];
        assert_eq!(
            crate::coalesce::Coalescer::new(&wraps, P, 1 << 31).count(),
            2
        );
        let t = coalesced(3, &wraps, P, 1 << 31)?;
        let h = header(&t);
        assert_eq!(h.nents, 2);
        // SAFETY: the first of the table's 3 entries.
        let e = unsafe { &*h.sgl };
        assert_eq!((e.dma_address, e.dma_length), (top - P, 2 * P as u32));
        // SAFETY: the second, after the first of a table set up by
        // `sg_alloc_table`.
        let e = unsafe { &*bindings::sg_next(h.sgl) };
        assert_eq!((e.dma_address, e.dma_length), (0, P as u32));
        // More runs than the bound, or no page, or a bound under 2 are refused.
        assert!(coalesced(2, &[0, 2 * P, 4 * P], P, 1 << 31).is_err());
        assert!(coalesced(2, &[], P, 1 << 31).is_err());
        assert!(coalesced(1, &[0], P, 1 << 31).is_err());
        Ok(())
    }

    /// A persistent mapping of several runs (pages shuffled, as behind an
    /// IOMMU, then a run of two) in a table sized for one entry per page:
    /// the header handed out is the table built, and dropping the table
    /// frees its entries (kmemleak and KASAN on the debug kernel).
    #[test]
    fn a_coalesced_table_of_shuffled_pages() -> Result {
        const P: u64 = 0x1_0000;
        let addrs = [0x30_0000, 0x10_0000, 0x50_0000, 0x51_0000];
        for cap in [4usize, 300] {
            let t = coalesced(cap, &addrs, P, 1 << 31)?;
            let h = header(&t);
            assert_eq!((h.nents, h.orig_nents), (3, cap as u32));
            let mut e = h.sgl;
            for s in [seg(0x30_0000, P), seg(0x10_0000, P), seg(0x50_0000, 2 * P)] {
                // SAFETY: one of the table's first three entries.
                let r = unsafe { &*e };
                assert_eq!((r.dma_address, u64::from(r.dma_length)), (s.addr, s.len));
                // SAFETY: as above; not the last entry (`cap` > 3).
                e = unsafe { bindings::sg_next(e) };
            }
        }
        // A failed build leaves nothing behind: more runs than entries.
        assert!(coalesced(2, &addrs, P, 1 << 31).is_err());
        Ok(())
    }

    #[test]
    fn several_segments_are_allocated() -> Result {
        let segs = [
            seg(0x10_0000, 0x1_0000),
            seg(0x30_0000, 0x2_0000),
            seg(0x50_0000, 0x1_0000),
        ];
        let t = table(3, segs.iter().copied())?;
        let h = header(&t);
        assert_eq!((h.nents, h.orig_nents), (3, 3));
        let mut sg = h.sgl;
        for (i, s) in segs.iter().enumerate() {
            assert!(!sg.is_null());
            // SAFETY: one of the table's three entries.
            let e = unsafe { &*sg };
            assert_eq!((e.dma_address, u64::from(e.dma_length)), (s.addr, s.len));
            let last = e.page_link & SG_END != 0;
            assert_eq!(last, i == 2);
            // SAFETY: as above.
            sg = unsafe { bindings::sg_next(sg) };
        }
        assert!(sg.is_null());
        Ok(())
    }

    /// More entries than one page of them: the table is chained, and the
    /// module's inline walk must fill what the kernel's `sg_next` reads.
    #[test]
    fn chained_tables_are_filled_in_order() -> Result {
        const N: u64 = 300;
        let segs = (0..N).map(|i| seg(0x100_0000 + i * 0x2_0000, 0x1_0000));
        let t = table(N as usize, segs)?;
        let h = header(&t);
        assert_eq!(u64::from(h.nents), N);
        let mut sg = h.sgl;
        for i in 0..N {
            assert!(!sg.is_null());
            // SAFETY: one of the table's entries.
            let e = unsafe { &*sg };
            assert_eq!(e.dma_address, 0x100_0000 + i * 0x2_0000);
            assert_eq!(e.dma_length, 0x1_0000);
            // SAFETY: as above.
            sg = unsafe { bindings::sg_next(sg) };
        }
        assert!(sg.is_null());
        Ok(())
    }

    #[test]
    fn more_segments_than_entries_are_refused() -> Result {
        let three = [
            seg(0x10_0000, 0x1_0000),
            seg(0x30_0000, 0x1_0000),
            seg(0x50_0000, 0x1_0000),
        ];
        assert_eq!(table(1, three[..2].iter().copied()).err(), Some(EINVAL));
        assert_eq!(table(2, three.iter().copied()).err(), Some(EINVAL));
        let slot = SgSlot::new();
        // SAFETY: the slot is this test's alone.
        assert!(unsafe { sg::build(&slot, 2, core::iter::empty()) }.is_err());
        Ok(())
    }
}

#[kunit_tests(nvidia_peermem_abi)]
mod abi_tests {
    use crate::{
        client::{
            ClientTable,
            NV_MEM_INVALIDATING,
            NV_MEM_INVALIDATING_LEGACY,
            NV_MEM_NC,
            NV_MEM_PERSISTENT, //
        },
        ffi,
        stats::{
            errno_name,
            Bdf,
            STATS, //
        },
    };
    use kernel::{
        prelude::*,
        str::{
            CStr,
            CString, //
        },
    };

    /// A client table's name, version string, "extended" marker and flags.
    fn parts(t: &ClientTable) -> (KVec<u8>, KVec<u8>, u8, u64) {
        let c = &t.0.client;
        let text = |s: &[kernel::ffi::c_char]| -> KVec<u8> {
            let mut v = KVec::new();
            for &b in s.iter().take_while(|&&b| b != 0) {
                let _ = v.push(b, GFP_KERNEL);
            }
            v
        };
        let marker = c.version[ffi::IB_PEER_MEMORY_VER_MAX as usize - 1];
        (
            text(&c.name),
            text(&c.version),
            marker,
            u64::from(t.0.flags),
        )
    }

    #[test]
    fn client_tables_carry_their_name_version_and_flags() {
        let version = env!("PEERMEM_VERSION").as_bytes();
        let unmaps = u64::from(ffi::PEER_MEM_INVALIDATE_UNMAPS);
        let want: [(&ClientTable, &[u8], u8, u64); 4] = [
            (&NV_MEM_INVALIDATING, b"nv_mem", 1, unmaps),
            (&NV_MEM_INVALIDATING_LEGACY, b"nv_mem", 0, 0),
            (&NV_MEM_PERSISTENT, b"nv_mem", 0, 0),
            (&NV_MEM_NC, b"nv_mem_nc", 0, 0),
        ];
        for (t, name, marker, flags) in want {
            let (n, v, m, f) = parts(t);
            assert_eq!((&n[..], &v[..], m, f), (name, version, marker, flags));
            let c = &t.0.client;
            assert!(c.acquire.is_some() && c.get_pages.is_some() && c.dma_map.is_some());
            assert!(c.dma_unmap.is_some() && c.put_pages.is_some() && c.release.is_some());
            assert!(c.get_page_size.is_some());
            assert_eq!(
                t.0.ex_size,
                core::mem::size_of::<ffi::peer_memory_client_ex>()
            );
        }
    }

    /// Counters the stats file must name, each once.
    const COUNTERS: [&str; 19] = [
        "live_registrations",
        "pinned_bytes",
        "acquired",
        "declined",
        "registrations",
        "releases",
        "invalidations",
        "core_invalidations",
        "sg_entries",
        "foreign_releases",
        "orphaned_pins",
        "stranded_pins",
        "leaked_pins",
        "drain_revoked",
        "topology_probes",
        "fail_bad_range",
        "fail_topology",
        "fail_draining",
        "fail_bar1",
    ];

    #[test]
    fn the_stats_files_name_every_counter_once() -> Result {
        let n = (0..).take_while(|&i| STATS.counter(i).is_some()).count();
        let name = |i| {
            STATS
                .counter(i)
                .and_then(|c: (&CStr, u64)| c.0.to_str().ok())
        };
        for want in COUNTERS {
            let files = (0..n).filter(|&i| name(i) == Some(want));
            assert_eq!((want, files.count()), (want, 1));
        }
        assert_eq!(name(0), Some("live_registrations"));
        // Every file has a name, and none follows the last.
        assert!((0..n).all(|i| name(i).is_some_and(|n| !n.is_empty())));
        let fails = (0..n).filter(|&i| name(i).is_some_and(|n| n.starts_with("fail_")));
        assert_eq!(fails.count(), 14);
        Ok(())
    }

    #[test]
    fn pci_addresses_are_written_as_the_kernel_writes_them() -> Result {
        let s = CString::try_from_fmt(core::format_args!(
            "{} {}",
            Bdf(0x0001_8203),
            Bdf(0x00ff_ff07)
        ))?;
        assert_eq!(s.to_bytes(), b"0001:82:00.3 00ff:ff:00.7");
        let s =
            CString::try_from_fmt(core::format_args!("{}", Bdf((0x3a << 8) | (0x1f << 3) | 2)))?;
        assert_eq!(s.to_bytes(), b"0000:3a:1f.2");
        // Not known (the HCA before `dma_map`): a dash, one word in a log line.
        let s = CString::try_from_fmt(core::format_args!("{}", Bdf(0)))?;
        assert_eq!(s.to_bytes(), b"-");
        Ok(())
    }

    /// A GPU's or pair's directory is named by its PCI addresses as `Bdf`
    /// writes them; a read finds its record by parsing them back.
    #[test]
    fn directory_names_parse_back() -> Result {
        for v in [0x0001_8203, 0x00ff_ff07, (0x3a << 8) | (0x1f << 3) | 2] {
            let s = CString::try_from_fmt(core::format_args!("{}", Bdf(v)))?;
            let s = core::str::from_utf8(s.to_bytes()).map_err(|_| EINVAL)?;
            assert_eq!(crate::views::parse_bdf(s), Ok(v));
        }
        for bad in ["-", "", "0000:00:03", "0000:xx:03.0", "stats"] {
            assert_eq!(crate::views::parse_bdf(bad), Err(ENODEV));
        }
        Ok(())
    }

    /// Refusal lines name the errno as the kernel does, whatever
    /// `CONFIG_SYMBOLIC_ERRNAME` says; ENOTSUPP (kernel-internal) is named
    /// too, and an errno without a name is one word.
    #[test]
    fn errnos_are_named_in_the_kernels_words() {
        for (e, name) in [
            (EPERM, "EPERM"),
            (EFAULT, "EFAULT"),
            (ENOMEM, "ENOMEM"),
            (EINVAL, "EINVAL"),
            (EIO, "EIO"),
            (EBUSY, "EBUSY"),
            (ENODEV, "ENODEV"),
            (ENOTSUPP, "ENOTSUPP"),
            (crate::compat::eopnotsupp(), "EOPNOTSUPP"),
        ] {
            assert_eq!(errno_name(e), name);
        }
        assert_eq!(errno_name(Error::from_errno(-4000)), "EOTHER");
    }
}

#[kunit_tests(nvidia_peermem_accounting)]
mod accounting_tests {
    use crate::accounting;

    /// A charge read against a GPU record that its device's unbind freed,
    /// and another GPU took, between `Route::of` and the registration's
    /// `installed` lands nowhere. It used to count on the freed slot; the
    /// new GPU's record was then made over it, and the release underflowed
    /// that record's count (a panic with overflow checks).
    #[test]
    fn a_charge_never_lands_on_a_record_freed_meanwhile() {
        // Devices and BARs no real device has.
        let (id, start) = (0xfffe_0001u32, 0xffff_f000_0000_0000u64);
        let old = accounting::add_gpu(id, start, start + 0xffff).expect("a free GPU slot");
        accounting::forget_device(id);
        let new = accounting::add_gpu(id + 1, start + 0x10_0000, start + 0x10_ffff)
            .expect("a free GPU slot");
        assert_eq!(new.slot, old.slot);
        assert!(accounting::charge(None, old, 4096).is_none());
        let c = accounting::charge(None, new, 4096).expect("charged on its own record");
        c.release(4096);
        accounting::forget_device(id + 1);
        assert!(accounting::charge(None, new, 4096).is_none());
    }
}
