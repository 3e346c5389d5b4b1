// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Interleavings (loom) of a persistent registration's claim (`src/claim.rs`,
//! compiled here against loom's atomics) under a core that breaks its
//! one-call-at-a-time order: one thread makes the registration (`get_pages`,
//! `dma_map`) while another unmaps it (`dma_unmap`, giving the claim up and
//! back once inside, as `Claimed::wait` does, then `put_pages`); `release`
//! comes last (the core frees the registration with it, so overlapping it
//! is beyond any lock).
//!
//! Checked in every interleaving: no two sections overlap (loom's
//! `UnsafeCell` panics on an access not ordered after the previous one), the
//! lifecycle is consistent at the end of every section, every mapping made
//! is undone exactly once, and the pin is unpinned exactly once. Two
//! mutants break what the claim relies on (an atomic exchange, acquire and
//! release ordering); each must make some interleaving fail.

use crate::{
    atomics::{
        set_mutant,
        Mutant, //
    },
    claim::Claim,
    lifecycle::{
        Lifecycle,
        Pin,
        Resources, //
    },
};
use loom::{cell::UnsafeCell, sync::Arc, thread};
use std::sync::atomic::{
    AtomicUsize,
    Ordering::Relaxed, //
};

struct Model;

impl Resources for Model {
    type Table = u32;
    type Token = ();
    type Map = u32;
}

const OWNER: u32 = 100;
const TABLE: u32 = 7;
const MAP: u32 = 9;
const CTX: u64 = 42;

/// What the claim guards: the lifecycle, and what was done with its objects.
struct Data {
    lc: Lifecycle<Model>,
    maps_made: u32,
    maps_undone: u32,
    unpins: u32,
}

struct Reg {
    claim: Claim,
    data: UnsafeCell<Data>,
}

impl Reg {
    /// One section under the claim, as `access::Claimed` enters it.
    fn section<T>(&self, f: impl FnOnce(&mut Data) -> T) -> T {
        let _g = self
            .claim
            .try_hold()
            .unwrap_or_else(|| self.claim.hold_contended());
        self.data.with_mut(|d| {
            // SAFETY: under the claim (what the model checks).
            let d = unsafe { &mut *d };
            let r = f(d);
            assert!(d.lc.consistent(), "inconsistent after a section");
            r
        })
    }

    /// A section that gives the claim up and back halfway (`Claimed::wait`).
    fn section_with_wait(&self, first: impl FnOnce(&mut Data), then: impl FnOnce(&mut Data)) {
        let mut g = self
            .claim
            .try_hold()
            .unwrap_or_else(|| self.claim.hold_contended());
        // SAFETY: under the claim (checked by loom).
        self.data.with_mut(|d| first(unsafe { &mut *d }));
        g.yield_once();
        // SAFETY: under the claim again.
        self.data.with_mut(|d| then(unsafe { &mut *d }));
        drop(g);
    }
}

static EXPLORED: AtomicUsize = AtomicUsize::new(0);

fn model(m: Mutant) -> usize {
    EXPLORED.store(0, Relaxed);
    set_mutant(m);
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(|| {
        EXPLORED.fetch_add(1, Relaxed);
        let reg = Arc::new(Reg {
            claim: Claim::new(),
            data: UnsafeCell::new(Data {
                lc: Lifecycle::with_pin(Pin {
                    table: TABLE,
                    token: None,
                    owner: OWNER,
                }),
                maps_made: 0,
                maps_undone: 0,
                unpins: 0,
            }),
        });
        let maker = {
            let reg = Arc::clone(&reg);
            thread::spawn(move || {
                // get_pages
                let bound = reg.section(|d| d.lc.bind(CTX).is_ok());
                if !bound {
                    return;
                }
                // dma_map: start, map outside the claim, publish.
                if !reg.section(|d| d.lc.start_map().is_ok()) {
                    return;
                }
                reg.section(|d| {
                    d.maps_made += 1;
                    if d.lc.map_succeeded(MAP).is_err() {
                        // Released meanwhile: `dma_map` undoes its own map.
                        d.maps_undone += 1;
                    }
                });
            })
        };
        // dma_unmap (giving the claim up and back once, as `Claimed::wait`
        // does), then put_pages, both racing the maker.
        reg.section_with_wait(
            |d| assert!(d.lc.consistent()),
            |d| {
                if d.lc.unmap().is_some() {
                    d.maps_undone += 1;
                }
            },
        );
        reg.section(|d| {
            if d.lc.put_pages().is_some() {
                d.maps_undone += 1;
            }
        });
        maker.join().unwrap();
        // release: after every other call (the core frees the registration
        // with it, so no core can overlap it with another call).
        reg.section(|d| {
            let r = d.lc.release(OWNER);
            if r.map.is_some() {
                d.maps_undone += 1;
            }
            if r.unpin.is_some() {
                assert!(r.ended, "a persistent pin ends at release");
                d.unpins += 1;
            }
            assert_eq!(
                d.maps_made, d.maps_undone,
                "a mapping leaked or was undone twice"
            );
            assert_eq!(d.unpins, 1, "the pin must end exactly once");
        });
        assert!(!reg.claim.is_held(), "the claim was left held");
    });
    set_mutant(Mutant::None);
    EXPLORED.load(Relaxed)
}

#[test]
fn claim_against_a_core_out_of_order() {
    let n = model(Mutant::None);
    println!("loom: claim: explored {n} interleavings (preemption bound 3)");
    assert!(n > 10, "the model explored too little: {n}");

    let mut report = Vec::new();
    let mut caught = 0;
    crate::mutants::quietly(|| {
        for m in [Mutant::SplitExchange, Mutant::RelaxedOnly] {
            let r = crate::mutants::caught(move || model(m));
            set_mutant(Mutant::None);
            let line = crate::mutants::outcome(&r, EXPLORED.load(Relaxed));
            report.push(format!("{m:?}: {line}"));
            caught += usize::from(r.is_err_and(|e| e.contains("Causality violation")));
        }
    });
    for line in &report {
        println!("loom: claim mutant {line}");
    }
    assert_eq!(caught, 2, "claim mutants not caught: {report:?}");
}
