// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The module's kernel-independent core, compiled from the module's own
//! source files, for host tests (proptest now; loom model checking next).

#![allow(dead_code)]

#[path = "../../../src/coalesce.rs"]
pub mod coalesce;
#[path = "../../../src/lifecycle.rs"]
pub mod lifecycle;
#[path = "../../../src/range.rs"]
pub mod range;

#[cfg(test)]
mod loom_model;

#[cfg(test)]
mod tests {
    use super::{coalesce::*, lifecycle::*, range::*};
    use proptest::prelude::*;

    const G: u64 = GPU_PAGE_SIZE;

    proptest! {
        #[test]
        fn widen_covers_and_is_minimal(addr in 0u64..(1 << 60), size in 1u64..(1 << 40)) {
            let r = GpuRange::widen(addr, size, G).unwrap();
            prop_assert_eq!(r.start % G, 0);
            prop_assert_eq!(r.len % G, 0);
            prop_assert!(r.covers(addr, size));
            prop_assert!(addr - r.start < G);
            prop_assert!(r.start + r.len - (addr + size) < G);
        }

        #[test]
        fn widen_never_panics(addr in any::<u64>(), size in any::<u64>()) {
            if let Ok(r) = GpuRange::widen(addr, size, G) {
                prop_assert!(r.start.checked_add(r.len).is_some());
                prop_assert!(r.covers(addr, size));
            }
        }

        #[test]
        fn segments_partition_the_pages(runs in proptest::collection::vec((0u64..1000, 1u64..40), 1..20), max in 1u64..64) {
            let mut addrs = Vec::new();
            let mut base = 0u64;
            for (gap, n) in runs {
                base += gap * G;
                for _ in 0..n {
                    addrs.push(base);
                    base += G;
                }
            }
            let segs: Vec<Segment> = Coalescer::new(&addrs, G, max * G).collect();
            prop_assert_eq!(segs.len(), count(&addrs, G, max * G));
            prop_assert_eq!(segs.iter().map(|s| s.len).sum::<u64>(), addrs.len() as u64 * G);
            let mut i = 0;
            for s in &segs {
                prop_assert!(s.len <= max * G);
                for k in 0..s.len / G {
                    prop_assert_eq!(addrs[i], s.addr + k * G);
                    i += 1;
                }
            }
        }
    }

    #[test]
    fn one_gib_contiguous_is_one_segment() {
        let addrs: Vec<u64> = (0..16384).map(|i| 0x1_0000_0000 + i * G).collect();
        assert_eq!(count(&addrs, G, 2 << 30), 1);
        assert_eq!(count(&addrs, G, 64 << 10), 16384);
    }

    #[test]
    fn revoke_during_every_phase_keeps_provider_untouched() {
        for steps in 0..4 {
            let mut l = Lifecycle::new(true);
            let mut phase_ok = true;
            if steps >= 1 {
                l.start_pin().unwrap();
            }
            if steps >= 2 {
                phase_ok &= l.pin_succeeded() == Outcome::Done;
            }
            if steps >= 3 {
                l.start_map().unwrap();
                phase_ok &= l.map_succeeded() == Outcome::Done;
            }
            assert!(phase_ok);
            l.invalidate();
            assert!(!l.put_pages().unpin_provider);
            let t = l.release();
            assert!(!t.unpin_provider && !t.unmap_provider);
            assert!(!l.unpinned());
        }
    }
}
