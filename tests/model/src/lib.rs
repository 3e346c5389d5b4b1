// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The module's kernel-independent core, compiled from the module's own
//! source files, for host tests (proptest now; loom model checking next).

#![allow(dead_code)]

#[path = "../../../src/coalesce.rs"]
pub mod coalesce;
#[path = "../../../src/lifecycle.rs"]
pub mod lifecycle;
#[path = "../../../src/path.rs"]
pub mod path;
#[path = "../../../src/range.rs"]
pub mod range;

#[cfg(test)]
mod loom_model;
#[cfg(test)]
mod mutants;
#[cfg(test)]
mod persistent_model;

#[cfg(test)]
mod tests {
    use super::{coalesce::*, range::*};
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
        fn covers_is_containment(start in any::<u64>(), len in any::<u64>(), addr in any::<u64>(), size in any::<u64>()) {
            // Ranges are made by `widen`, whose end never overflows.
            let len = len.min(u64::MAX - start);
            let r = GpuRange { start, len };
            let inside = u128::from(addr) >= u128::from(start)
                && u128::from(addr) + u128::from(size) <= u128::from(start) + u128::from(len);
            prop_assert_eq!(r.covers(addr, size), inside);
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
            // As few segments as the contiguous runs allow: each run of
            // n pages in ceil(n / max) segments.
            let (mut want, mut run) = (0u64, 0u64);
            for (i, &a) in addrs.iter().enumerate() {
                if i > 0 && a == addrs[i - 1] + G {
                    run += 1;
                } else {
                    want += run.div_ceil(max);
                    run = 1;
                }
            }
            want += run.div_ceil(max);
            prop_assert_eq!(segs.len() as u64, want);
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
        assert_eq!(Coalescer::new(&addrs, G, 2 << 30).count(), 1);
        assert_eq!(Coalescer::new(&addrs, G, 64 << 10).count(), 16384);
    }
}

/// The lifecycle (`src/lifecycle.rs`) driven by random call sequences from
/// the core, the GPU driver and its free callback, with plain markers as the
/// provider's objects and a model of what the GPU driver does with them.
#[cfg(test)]
mod lifecycle_tests {
    use super::lifecycle::*;
    use proptest::prelude::*;
    use std::{
        cell::RefCell,
        collections::{HashMap, HashSet},
        rc::Rc,
    };

    const OWNER: u32 = 100;
    const OTHER: u32 = 200;
    const CTX: u64 = 7;

    /// The callback's reference of pin `pin`. Dropped without a reclaim, it
    /// stays with the GPU driver (which consumes it in the callback).
    struct Tok {
        pin: u32,
        dropped: Rc<RefCell<Vec<u32>>>,
        reclaimed: bool,
    }

    impl Tok {
        fn reclaim(mut self) -> u32 {
            self.reclaimed = true;
            self.pin
        }
    }

    impl Drop for Tok {
        fn drop(&mut self) {
            if !self.reclaimed {
                self.dropped.borrow_mut().push(self.pin);
            }
        }
    }

    struct H;

    impl Resources for H {
        /// The pin's id.
        type Table = u32;
        type Token = Tok;
        /// A mapping's id.
        type Map = u32;
    }

    #[derive(Clone, Copy, Debug)]
    enum Op {
        /// `acquire`: `start_pin`, then the provider is called.
        Acquire {
            ok: bool,
        },
        /// The provider's pin returns.
        PinReturns,
        /// `get_pages` accepts (`good`) or rejects the table.
        GetPages {
            good: bool,
        },
        /// `dma_map` starts mapping.
        DmaMap,
        /// The mapping ends.
        MapReturns {
            ok: bool,
        },
        Unmap,
        PutPages,
        Release {
            foreign: bool,
        },
        /// `nvidia_p2p_put_pages` returns.
        UnpinReturns {
            ok: bool,
        },
        /// The GPU driver frees the memory: the free callback.
        Callback,
        /// The core's invalidate returned to the callback.
        CallbackLeaves,
    }

    /// A provider call in flight (the core makes one call at a time).
    enum Call {
        Pin(Option<Pin<H>>),
        Map(u32),
        /// The table, and whether the lifecycle ended with the release
        /// (persistent pins: the unpin is not reported back).
        Unpin(u32, bool),
    }

    /// The GPU driver's record of one pin.
    #[derive(Default)]
    struct PinRec {
        linked: bool,
        table_freed: bool,
        put: bool,
        fired: bool,
        reclaimed: bool,
        ended: usize,
        leaked: bool,
    }

    struct Sim {
        persistent: bool,
        lc: Lifecycle<H>,
        dropped: Rc<RefCell<Vec<u32>>>,
        pins: HashMap<u32, PinRec>,
        next: u32,
        call: Option<Call>,
        /// The pin whose callback is inside the core's invalidate.
        in_core: Option<u32>,
        maps_made: HashSet<u32>,
        maps_back: HashSet<u32>,
        foreign_release: bool,
    }

    impl Sim {
        fn new(persistent: bool) -> Self {
            Self {
                persistent,
                lc: Lifecycle::new(),
                dropped: Rc::default(),
                pins: HashMap::new(),
                next: 1,
                call: None,
                in_core: None,
                maps_made: HashSet::new(),
                maps_back: HashSet::new(),
                foreign_release: false,
            }
        }

        fn live(&self, table: u32) -> bool {
            !self.pins[&table].table_freed
        }

        fn give_back(&mut self, m: u32) {
            assert!(self.maps_made.contains(&m), "unknown map {m}");
            assert!(self.maps_back.insert(m), "map {m} handed back twice");
        }

        fn apply(&mut self, op: Op) {
            let busy = self.call.is_some();
            match op {
                Op::Acquire { ok } if !busy => {
                    let before = self.lc.phase();
                    if self.lc.start_pin().is_err() {
                        assert_eq!(self.lc.phase(), before);
                        return;
                    }
                    if !ok {
                        self.call = Some(Call::Pin(None));
                        return;
                    }
                    let id = self.next;
                    self.next += 1;
                    self.pins.insert(
                        id,
                        PinRec {
                            linked: true,
                            ..PinRec::default()
                        },
                    );
                    let token = (!self.persistent).then(|| Tok {
                        pin: id,
                        dropped: Rc::clone(&self.dropped),
                        reclaimed: false,
                    });
                    self.call = Some(Call::Pin(Some(Pin {
                        table: id,
                        token,
                        owner: OWNER,
                    })));
                }
                Op::PinReturns => match self.call.take() {
                    Some(Call::Pin(None)) => {
                        self.lc.pin_failed();
                        assert_eq!(self.lc.phase(), Phase::Acquired);
                    }
                    Some(Call::Pin(Some(pin))) => {
                        let id = pin.table;
                        match self.lc.pin_succeeded(pin) {
                            Ok(()) => assert!(!self.pins[&id].fired, "kept a revoked pin"),
                            Err(back) => {
                                assert!(self.pins[&id].fired, "refused a live pin");
                                assert_eq!(back.table, id);
                            }
                        }
                    }
                    c => self.call = c,
                },
                Op::GetPages { good } if !busy => {
                    if let Ok(&t) = self.lc.pinned_table() {
                        assert!(self.live(t), "get_pages on a freed table");
                        if good {
                            assert_eq!(self.lc.bind(CTX), Ok(()));
                        } else {
                            self.lc.reject();
                        }
                    }
                }
                Op::DmaMap if !busy => {
                    if let Ok(&t) = self.lc.start_map() {
                        assert!(self.live(t), "dma_map on a freed table");
                        self.call = Some(Call::Map(t));
                    }
                }
                Op::MapReturns { ok } => match self.call.take() {
                    Some(Call::Map(t)) => {
                        // The core's invalidate waits for dma_map: the
                        // provider cannot free the table meanwhile.
                        assert!(self.live(t), "mapped a freed table");
                        if ok {
                            let m = self.next;
                            self.next += 1;
                            self.maps_made.insert(m);
                            if let Err(back) = self.lc.map_succeeded(m) {
                                assert_eq!(back, m);
                                self.give_back(back);
                            }
                        } else {
                            self.lc.map_failed();
                        }
                    }
                    c => self.call = c,
                },
                Op::Unmap | Op::PutPages if !busy => {
                    let m = match op {
                        Op::Unmap => self.lc.unmap(),
                        _ => self.lc.put_pages(),
                    };
                    if let Some(m) = m {
                        self.give_back(m);
                    }
                }
                // `release` waits while a callback is inside the core.
                Op::Release { foreign } if !busy && self.in_core.is_none() => {
                    let tgid = if foreign { OTHER } else { OWNER };
                    let r = self.lc.release(tgid);
                    if let Some(m) = r.map {
                        self.give_back(m);
                    }
                    if r.orphaned {
                        assert!(foreign && !self.persistent);
                        assert!(r.unpin.is_none());
                        self.foreign_release = true;
                    }
                    if let Some(t) = r.unpin {
                        let rec = self.pins.get_mut(&t).unwrap();
                        assert!(!rec.put, "table {t} unpinned twice");
                        rec.put = true;
                        // A non-persistent unpin from another process does
                        // nothing at the provider (fact 7); a persistent one
                        // on a freed table is a use after free (fact 9).
                        assert!(self.persistent || !foreign, "unpin from another process");
                        assert!(!self.persistent || !rec.table_freed);
                        // Only a persistent pin's release ends the lifecycle.
                        assert_eq!(r.ended, self.persistent);
                        if r.ended {
                            assert_eq!(self.lc.phase(), Phase::Released);
                        }
                        self.call = Some(Call::Unpin(t, r.ended));
                    }
                }
                Op::UnpinReturns { ok } => match self.call.take() {
                    Some(Call::Unpin(t, ended)) => {
                        let persistent = self.persistent;
                        let rec = self.pins.get_mut(&t).unwrap();
                        if ok && rec.linked {
                            rec.linked = false;
                            rec.table_freed = true;
                            rec.ended += 1;
                        }
                        if persistent && !ok {
                            rec.leaked = true;
                        }
                        if ended {
                            // Nothing to report: the lifecycle has ended,
                            // whatever the unpin did.
                            assert_eq!(self.lc.phase(), Phase::Released);
                            self.check();
                            return;
                        }
                        let (how, tok) = self.lc.unpinned(ok);
                        if let Some(tok) = tok {
                            assert_eq!(tok.reclaim(), t);
                            assert!(ok && !persistent);
                            assert!(!rec.fired, "reclaimed a reference the callback consumed");
                            assert!(!rec.reclaimed, "reclaimed twice");
                            assert!(!rec.linked, "reclaimed while the callback is armed");
                            rec.reclaimed = true;
                            assert_eq!(how, Unpinned::Reclaim);
                        }
                        match how {
                            Unpinned::Reclaim => assert!(rec.reclaimed),
                            Unpinned::Raced => assert!(rec.fired),
                            Unpinned::Stranded => assert!(!ok && !persistent && rec.linked),
                        }
                    }
                    c => self.call = c,
                },
                Op::Callback if self.in_core.is_none() && !self.persistent => {
                    let Some((&id, rec)) = self.pins.iter_mut().find(|(_, r)| r.linked && !r.fired)
                    else {
                        return;
                    };
                    assert!(!rec.reclaimed, "callback on a reclaimed reference");
                    rec.linked = false;
                    rec.fired = true;
                    rec.ended += 1;
                    let (action, table) = self.lc.invalidate();
                    if let Some(t) = table {
                        assert_eq!(t, id);
                    }
                    match action {
                        Invalidate::NotifyCore(ctx) => {
                            assert_eq!(ctx, CTX);
                            self.in_core = Some(id);
                        }
                        Invalidate::Reaped { orphaned } => {
                            assert_eq!(orphaned, self.foreign_release);
                            rec.table_freed = true;
                        }
                        Invalidate::Quiet => rec.table_freed = true,
                    }
                }
                // The core's invalidate waits for the mapping lock, held
                // across dma_map.
                Op::CallbackLeaves if !matches!(self.call, Some(Call::Map(_))) => {
                    if let Some(id) = self.in_core.take() {
                        // The device's access ends here; the map itself is
                        // handed back by the core's unmap or release.
                        let _ = self.lc.revoked_map_mut();
                        self.pins.get_mut(&id).unwrap().table_freed = true;
                    }
                }
                _ => (),
            }
            self.check();
        }

        /// The lifecycle holds a callback's reference exactly while the GPU
        /// driver keeps that callback armed and no provider call holds it.
        fn check(&self) {
            assert!(
                self.lc.consistent(),
                "phase {:?} holds objects it must not",
                self.lc.phase()
            );
            let in_flight = match &self.call {
                Some(Call::Pin(Some(p))) => Some(p.table),
                _ => None,
            };
            let armed = !self.persistent
                && self
                    .pins
                    .iter()
                    .any(|(&id, r)| r.linked && !r.fired && Some(id) != in_flight);
            assert_eq!(self.lc.callback_armed(), armed);
        }

        /// Everyone finishes: calls return, the core releases, the memory is
        /// freed (cudaFree or the owner's exit).
        fn finish(&mut self) {
            for _ in 0..3 {
                for op in [
                    Op::MapReturns { ok: true },
                    Op::PinReturns,
                    Op::UnpinReturns { ok: true },
                    Op::CallbackLeaves,
                    Op::Release { foreign: false },
                    Op::UnpinReturns { ok: true },
                    Op::Callback,
                    Op::CallbackLeaves,
                ] {
                    self.apply(op);
                }
            }
            assert!(self.call.is_none() && self.in_core.is_none());
            assert_eq!(self.lc.phase(), Phase::Released);
            assert!(!self.lc.callback_armed());
            assert_eq!(
                self.maps_made, self.maps_back,
                "a map was never handed back"
            );
            let dropped = self.dropped.borrow();
            for (id, r) in &self.pins {
                let drops = dropped.iter().filter(|&&p| p == *id).count();
                if r.leaked {
                    continue;
                }
                assert_eq!(r.ended, 1, "pin {id} ended {} times", r.ended);
                assert!(!r.linked);
                if !self.persistent {
                    // Consumed once: by the callback or by a reclaim.
                    assert!(r.fired != r.reclaimed);
                    assert_eq!(drops, usize::from(r.fired));
                }
            }
        }
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Acquire { ok: true }),
            1 => Just(Op::Acquire { ok: false }),
            4 => Just(Op::PinReturns),
            3 => Just(Op::GetPages { good: true }),
            1 => Just(Op::GetPages { good: false }),
            3 => Just(Op::DmaMap),
            3 => any::<bool>().prop_map(|ok| Op::MapReturns { ok }),
            1 => Just(Op::Unmap),
            1 => Just(Op::PutPages),
            1 => any::<bool>().prop_map(|foreign| Op::Release { foreign }),
            2 => any::<bool>().prop_map(|ok| Op::UnpinReturns { ok }),
            2 => Just(Op::Callback),
            2 => Just(Op::CallbackLeaves),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// Each table is unpinned at most once, a token is reclaimed at most
        /// once and never after the callback consumed it, a map is handed
        /// back at most once; and in the end every object had its one end.
        #[test]
        fn random_calls_keep_ownership(persistent in any::<bool>(), ops in proptest::collection::vec(op(), 0..48)) {
            let mut s = Sim::new(persistent);
            for op in ops {
                s.apply(op);
            }
            s.finish();
        }
    }

    /// Every way of reaching the end of a pin, run to completion.
    #[test]
    fn every_race_of_the_callback_completes() {
        use Op::*;
        let lives: &[&[Op]] = &[
            &[Acquire { ok: true }, Callback, PinReturns],
            &[Acquire { ok: true }, PinReturns, Callback],
            &[
                Acquire { ok: true },
                PinReturns,
                GetPages { good: false },
                Callback,
            ],
            &[
                Acquire { ok: true },
                PinReturns,
                GetPages { good: true },
                DmaMap,
                Callback,
                MapReturns { ok: true },
                CallbackLeaves,
            ],
            &[
                Acquire { ok: true },
                PinReturns,
                GetPages { good: true },
                DmaMap,
                MapReturns { ok: true },
                Callback,
                Unmap,
                CallbackLeaves,
            ],
            &[
                Acquire { ok: true },
                PinReturns,
                GetPages { good: true },
                Release { foreign: false },
                Callback,
                UnpinReturns { ok: true },
            ],
            &[
                Acquire { ok: true },
                PinReturns,
                GetPages { good: true },
                Release { foreign: false },
                Callback,
                UnpinReturns { ok: false },
            ],
            &[
                Acquire { ok: true },
                PinReturns,
                GetPages { good: true },
                Release { foreign: false },
                UnpinReturns { ok: false },
                Callback,
            ],
            &[
                Acquire { ok: true },
                PinReturns,
                GetPages { good: true },
                DmaMap,
                MapReturns { ok: true },
                Release { foreign: true },
                Callback,
            ],
            &[
                Acquire { ok: false },
                PinReturns,
                Acquire { ok: true },
                PinReturns,
                Release { foreign: false },
                UnpinReturns { ok: true },
            ],
        ];
        for persistent in [false, true] {
            for life in lives {
                let mut s = Sim::new(persistent);
                for &op in *life {
                    s.apply(op);
                }
                s.finish();
            }
        }
    }
}

#[cfg(test)]
mod path_tests {
    use super::path::*;

    fn hop(id: u32, kind: HopKind) -> Hop {
        Hop {
            id,
            kind,
            acs_redirect: false,
        }
    }

    const RP1: u32 = 0x08;
    const RP2: u32 = 0x10;
    const USP: u32 = 0x100;
    const DSP1: u32 = 0x200;
    const DSP2: u32 = 0x208;

    fn chain(hops: &[Hop]) -> Chain<'_> {
        Chain {
            root: 0,
            numa: 0,
            hops,
        }
    }

    #[test]
    fn one_switch_is_pix() {
        let a = [
            hop(DSP1, HopKind::SwitchDown),
            hop(USP, HopKind::SwitchUp),
            hop(RP1, HopKind::RootPort),
        ];
        let b = [
            hop(DSP2, HopKind::SwitchDown),
            hop(USP, HopKind::SwitchUp),
            hop(RP1, HopKind::RootPort),
        ];
        let p = classify(&chain(&a), &chain(&b));
        assert_eq!(p.class, Class::Pix);
        assert!(!p.acs_redirect);
        assert!(p.shares_bridge);
    }

    #[test]
    fn topology_gate() {
        use Verdict::*;
        let bare = Platform::default();
        let flagged = Platform {
            flagged_chipset: true,
            ..bare
        };
        for shares in [true, false] {
            for other in [Unknown, Open, Refused, Unverified] {
                let (near, far) = if shares { (Open, other) } else { (other, Open) };
                // The driver's word, learnt, is final.
                assert_eq!(gate(shares, near, far, flagged, false), Gate::Open);
                let (near, far) = if shares {
                    (Refused, other)
                } else {
                    (other, Refused)
                };
                assert_eq!(gate(shares, near, far, bare, true), Gate::Refused);
                // Not learnt yet, or not askable: the rule on the platform
                // observed, or the operator's word.
                for v in [Unknown, Unverified] {
                    let (near, far) = if shares { (v, other) } else { (other, v) };
                    assert_eq!(gate(shares, near, far, bare, false), Gate::Open);
                    let want = if shares { Gate::Open } else { Gate::Observed };
                    assert_eq!(gate(shares, near, far, flagged, false), want);
                    assert_eq!(gate(shares, near, far, flagged, true), Gate::Open);
                }
            }
        }
    }

    /// The GPU driver's rule (nv-pci.c, `nv_grdma_pci_topology_supported`,
    /// 580+, for a GPU that is not coherent), row by row as docs/design.md
    /// gives it: override, passthrough VM, flagged chipset, common bridge
    /// -> the driver maps.
    const DRIVER_RULE: &[(u32, bool, bool, bool, bool)] = &[
        (0, false, false, false, true),
        (0, false, false, true, true),
        (0, false, true, false, false),
        (0, false, true, true, true),
        (0, true, false, false, true),
        (0, true, false, true, true),
        (0, true, true, false, true),
        (0, true, true, true, true),
        (1, false, true, false, true),
        (1, true, true, false, true),
        (1, false, false, false, true),
        (2, false, false, false, false),
        (2, false, false, true, false),
        (2, true, false, true, false),
        (2, true, true, true, false),
        (3, false, true, false, false),
        (3, true, true, false, true),
    ];

    #[test]
    fn the_platform_rule_is_the_drivers() {
        for &(over, passthrough, flagged_chipset, shares, maps) in DRIVER_RULE {
            let p = Platform {
                over,
                passthrough,
                flagged_chipset,
            };
            assert_eq!(p.allows(shares), maps, "{p:?}, common bridge {shares}");
            // The module observing a VM or bare metal decides as the driver
            // does for either (both ways of the same row).
            let want = if maps { Gate::Open } else { Gate::Observed };
            assert_eq!(
                gate(shares, Verdict::Unverified, Verdict::Unverified, p, false),
                want
            );
        }
    }

    #[test]
    fn a_root_port_above_both_is_a_shared_bridge() {
        // Two switches below one root port: PHB, but the GPU driver's gate
        // finds the root port above both.
        let a = [
            hop(DSP1, HopKind::SwitchDown),
            hop(USP, HopKind::SwitchUp),
            hop(RP1, HopKind::RootPort),
        ];
        let b = [
            hop(0x400, HopKind::SwitchDown),
            hop(0x401, HopKind::SwitchUp),
            hop(RP1, HopKind::RootPort),
        ];
        let p = classify(&chain(&a), &chain(&b));
        assert_eq!(p.class, Class::Phb);
        assert!(p.shares_bridge);
    }

    #[test]
    fn nested_switches_are_pxb_and_acs_below_counts() {
        // a sits behind a second switch under DSP1; b on DSP2.
        let mut a = [
            hop(0x300, HopKind::SwitchDown),
            hop(0x301, HopKind::SwitchUp),
            hop(DSP1, HopKind::SwitchDown),
            hop(USP, HopKind::SwitchUp),
            hop(RP1, HopKind::RootPort),
        ];
        a[2].acs_redirect = true;
        let b = [
            hop(DSP2, HopKind::SwitchDown),
            hop(USP, HopKind::SwitchUp),
            hop(RP1, HopKind::RootPort),
        ];
        let p = classify(&chain(&a), &chain(&b));
        assert_eq!(p.class, Class::Pxb);
        assert!(p.acs_redirect);
    }

    #[test]
    fn root_ports_and_root_bus_are_phb() {
        let a = [hop(RP1, HopKind::RootPort)];
        let b = [hop(RP2, HopKind::RootPort)];
        assert_eq!(classify(&chain(&a), &chain(&b)).class, Class::Phb);
        assert_eq!(classify(&chain(&[]), &chain(&[])).class, Class::Phb);
        assert_eq!(classify(&chain(&a), &chain(&[])).class, Class::Phb);
        // Nothing above both: the GPU driver's gate finds no switch.
        assert!(!classify(&chain(&a), &chain(&b)).shares_bridge);
        assert!(!classify(&chain(&[]), &chain(&[])).shares_bridge);
        assert!(!classify(&chain(&a), &chain(&[])).shares_bridge);
    }

    #[test]
    fn host_bridges_and_numa_nodes() {
        let a = [hop(RP1, HopKind::RootPort)];
        let b = [hop(0x0020_0008, HopKind::RootPort)];
        let ca = Chain {
            root: 0,
            numa: 0,
            hops: &a,
        };
        let same_node = Chain {
            root: 0x20,
            numa: 0,
            hops: &b,
        };
        let other_node = Chain {
            root: 0x40,
            numa: 1,
            hops: &b,
        };
        let unknown = Chain {
            root: 0x40,
            numa: -1,
            hops: &b,
        };
        assert!(!classify(&ca, &same_node).shares_bridge);
        assert_eq!(classify(&ca, &same_node).class, Class::Node);
        assert_eq!(classify(&ca, &other_node).class, Class::Sys);
        assert_eq!(classify(&ca, &unknown).class, Class::Node);
    }

    #[test]
    fn classes_order_and_levels() {
        assert!(Class::Pix < Class::Pxb && Class::Phb < Class::Sys);
        for l in 1..=5 {
            assert_eq!(Class::from_level(l).unwrap() as u32, l);
        }
        assert!(Class::from_level(0).is_none() && Class::from_level(6).is_none());
        assert!(Class::Phb.through_root_complex() && !Class::Pxb.through_root_complex());
    }
}
