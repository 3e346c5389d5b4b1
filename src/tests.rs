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
        count,
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
        assert_eq!(count(&a, P, 1 << 31), 2);
    }

    #[test]
    fn max_segment_bounds_runs() {
        let a = [0, P, 2 * P, 3 * P, 4 * P];
        assert_eq!(count(&a, P, 2 * P), 3);
        assert_eq!(count(&a, P, 2 * P + 1), 3);
        assert_eq!(count(&a, P, 1), 5);
    }

    #[test]
    fn one_gib_contiguous_is_one_segment_and_bounded_by_max_seg() {
        let mut a = KVec::with_capacity(16384, GFP_KERNEL).unwrap();
        for i in 0..16384u64 {
            a.push(0x1_0000_0000 + i * P, GFP_KERNEL).unwrap();
        }
        assert_eq!(count(&a, P, 1 << 31), 1);
        assert_eq!(count(&a, P, 1 << 28), 4);
        assert_eq!(count(&a, P, P), 16384);
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
        assert_eq!(count(&a, P, 1 << 31), 3);
    }

    #[test]
    fn single_page() {
        assert_eq!(count(&[0x4000_0000], P, 1 << 31), 1);
    }
}

#[kunit_tests(nvidia_peermem_lifecycle)]
mod lifecycle_tests {
    use crate::lifecycle::{
        Invalidate,
        Lifecycle,
        Outcome,
        Phase,
        Refusal,
        Teardown, //
    };

    fn mapped(invalidating: bool) -> Lifecycle {
        let mut l = Lifecycle::new(invalidating);
        l.start_pin().unwrap();
        assert_eq!(l.pin_succeeded(), Outcome::Done);
        l.start_map().unwrap();
        assert_eq!(l.map_succeeded(), Outcome::Done);
        l
    }

    #[test]
    fn persistent_full_life() {
        let mut l = mapped(false);
        assert_eq!(
            l.unmap(),
            Teardown {
                free_sg: true,
                unmap_provider: true,
                unpin_provider: false
            }
        );
        assert_eq!(l.unmap(), Teardown::default());
        assert_eq!(l.put_pages(), Teardown::default());
        assert_eq!(
            l.release(),
            Teardown {
                free_sg: false,
                unmap_provider: false,
                unpin_provider: true
            }
        );
        assert!(!l.unpinned());
        assert_eq!(l.release(), Teardown::default());
        l.released();
        assert_eq!(l.phase(), Phase::Released);
    }

    #[test]
    fn invalidating_unpin_reclaims_callback_ref_once() {
        let mut l = mapped(true);
        assert!(l.callback_armed());
        assert_eq!(
            l.unmap(),
            Teardown {
                free_sg: true,
                unmap_provider: false,
                unpin_provider: false
            }
        );
        assert_eq!(l.put_pages(), Teardown::default());
        assert_eq!(
            l.release(),
            Teardown {
                free_sg: false,
                unmap_provider: false,
                unpin_provider: true
            }
        );
        assert!(l.unpinned());
        assert!(!l.unpinned());
        assert_eq!(l.invalidate(), Invalidate::Quiet);
    }

    #[test]
    fn revoke_while_mapped_then_teardown_touches_nothing() {
        let mut l = mapped(true);
        assert_eq!(l.invalidate(), Invalidate::NotifyCore);
        assert!(!l.callback_armed());
        assert_eq!(
            l.unmap(),
            Teardown {
                free_sg: true,
                unmap_provider: false,
                unpin_provider: false
            }
        );
        assert_eq!(l.put_pages(), Teardown::default());
        assert!(!l.unpinned());
        assert_eq!(l.release(), Teardown::default());
    }

    #[test]
    fn revoke_while_pinning_fails_the_pin() {
        let mut l = Lifecycle::new(true);
        l.start_pin().unwrap();
        assert_eq!(l.invalidate(), Invalidate::NotifyCore);
        assert_eq!(l.pin_succeeded(), Outcome::Revoked);
        assert_eq!(l.start_map(), Err(Refusal::Revoked));
    }

    #[test]
    fn forbidden_orders() {
        let mut l = Lifecycle::new(false);
        assert_eq!(l.start_map(), Err(Refusal::Forbidden(Phase::Acquired)));
        l.start_pin().unwrap();
        assert_eq!(l.start_pin(), Err(Refusal::Forbidden(Phase::Pinning)));
        l.pin_failed();
        assert_eq!(l.phase(), Phase::Acquired);
        assert_eq!(l.release(), Teardown::default());
    }

    #[test]
    fn map_failure_returns_to_pinned_and_can_retry() {
        let mut l = Lifecycle::new(true);
        l.start_pin().unwrap();
        assert_eq!(l.pin_succeeded(), Outcome::Done);
        l.start_map().unwrap();
        assert_eq!(l.start_map(), Err(Refusal::Forbidden(Phase::Mapping)));
        l.map_failed();
        assert_eq!(l.phase(), Phase::Pinned);
        l.start_map().unwrap();
        assert_eq!(l.map_succeeded(), Outcome::Done);
        assert!(l.sg_owned());
    }

    #[test]
    fn revoke_while_mapping_refuses_the_map() {
        let mut l = Lifecycle::new(true);
        l.start_pin().unwrap();
        assert_eq!(l.pin_succeeded(), Outcome::Done);
        l.start_map().unwrap();
        assert_eq!(l.invalidate(), Invalidate::NotifyCore);
        assert_eq!(l.map_succeeded(), Outcome::Revoked);
        assert!(!l.sg_owned());
        assert_eq!(l.release(), Teardown::default());
    }

    #[test]
    fn revoke_after_unpin_is_quiet_and_keeps_callback_ref_with_callback() {
        let mut l = mapped(true);
        let t = l.release();
        assert!(t.unpin_provider);
        // The callback fired while the provider's unpin was in flight.
        assert_eq!(l.invalidate(), Invalidate::Quiet);
        assert!(!l.unpinned());
        assert!(l.callback_fired());
    }

    #[test]
    fn nothing_is_legal_after_release() {
        let mut l = mapped(false);
        l.release();
        l.released();
        assert_eq!(l.start_pin(), Err(Refusal::Forbidden(Phase::Released)));
        assert_eq!(l.start_map(), Err(Refusal::Forbidden(Phase::Released)));
        assert_eq!(l.unmap(), Teardown::default());
        assert_eq!(l.put_pages(), Teardown::default());
        assert_eq!(l.release(), Teardown::default());
        assert_eq!(l.invalidate(), Invalidate::Quiet);
    }

    /// A lifecycle brought to `phase` by legal steps.
    fn reach(phase: Phase, invalidating: bool) -> Lifecycle {
        let mut l = Lifecycle::new(invalidating);
        let steps: &[fn(&mut Lifecycle)] = match phase {
            Phase::Acquired => &[],
            Phase::Pinning => &[|l| l.start_pin().unwrap()],
            Phase::Pinned => &[
                |l| l.start_pin().unwrap(),
                |l| {
                    l.pin_succeeded();
                },
            ],
            Phase::Mapping => &[
                |l| l.start_pin().unwrap(),
                |l| {
                    l.pin_succeeded();
                },
                |l| l.start_map().unwrap(),
            ],
            Phase::Mapped => &[
                |l| l.start_pin().unwrap(),
                |l| {
                    l.pin_succeeded();
                },
                |l| l.start_map().unwrap(),
                |l| {
                    l.map_succeeded();
                },
            ],
            Phase::Revoked => &[
                |l| l.start_pin().unwrap(),
                |l| {
                    l.invalidate();
                },
            ],
            Phase::Unpinned => &[
                |l| l.start_pin().unwrap(),
                |l| {
                    l.pin_succeeded();
                },
                |l| {
                    l.release();
                },
            ],
            Phase::Released => &[
                |l| {
                    l.release();
                },
                |l| l.released(),
            ],
        };
        for s in steps {
            s(&mut l);
        }
        assert_eq!(l.phase(), phase);
        l
    }

    const PHASES: [Phase; 8] = [
        Phase::Acquired,
        Phase::Pinning,
        Phase::Pinned,
        Phase::Mapping,
        Phase::Mapped,
        Phase::Revoked,
        Phase::Unpinned,
        Phase::Released,
    ];

    #[test]
    fn every_phase_against_every_call() {
        for inv in [false, true] {
            for p in PHASES {
                // Pinning starts only from Acquired, mapping only from Pinned.
                let mut l = reach(p, inv);
                assert_eq!(l.start_pin().is_ok(), p == Phase::Acquired);
                let mut l = reach(p, inv);
                assert_eq!(l.start_map().is_ok(), p == Phase::Pinned);
                // A refused call leaves the phase alone.
                if p != Phase::Acquired {
                    let mut l = reach(p, inv);
                    let _ = l.start_pin();
                    assert_eq!(l.phase(), p);
                }
                // The provider is unpinned only by release, only from a pinned
                // phase, and never twice.
                let mut l = reach(p, inv);
                let t = l.release();
                let pinned = matches!(p, Phase::Pinned | Phase::Mapped);
                assert_eq!(t.unpin_provider, pinned);
                assert_eq!(l.release(), Teardown::default());
                // put_pages and dma_unmap never unpin, and are idempotent.
                let mut l = reach(p, inv);
                assert!(!l.put_pages().unpin_provider);
                assert!(!l.unmap().unpin_provider);
                assert_eq!(l.put_pages(), Teardown::default());
                // The provider mapping is undone only for persistent pins.
                let mut l = reach(p, inv);
                assert_eq!(l.unmap().unmap_provider, p == Phase::Mapped && !inv);
                // The free callback notifies the core only while pinned.
                let mut l = reach(p, inv);
                let notify = matches!(
                    p,
                    Phase::Pinning | Phase::Pinned | Phase::Mapping | Phase::Mapped
                );
                let notified = l.invalidate() == Invalidate::NotifyCore;
                assert_eq!(notified, notify);
                assert!(!l.callback_armed());
            }
        }
    }

    #[test]
    fn release_of_mapped_undoes_everything() {
        let mut l = mapped(false);
        assert_eq!(
            l.release(),
            Teardown {
                free_sg: true,
                unmap_provider: true,
                unpin_provider: true
            }
        );
    }
}

#[kunit_tests(nvidia_peermem_p2p)]
mod p2p_tests {
    use crate::p2p::{
        dma_mapping_version_ok,
        page_table_version_ok,
        provider_error, //
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

    #[test]
    fn provider_errors_never_leak_enotsupp() {
        assert_eq!(provider_error(-524), EOPNOTSUPP);
        assert_eq!(provider_error(-95), EOPNOTSUPP);
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
