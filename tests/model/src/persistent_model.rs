// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Interleavings (loom) of a persistent registration under a core that
//! breaks its one-call-at-a-time order: one thread makes the registration
//! (`get_pages`, `dma_map`) while another unmaps it (`dma_unmap`, then
//! `put_pages`); `release` comes last (the core frees the registration with
//! it, so overlapping it is beyond any lock). The module's own `lifecycle.rs`
//! is under a lock, as under the registration's kernel spinlock
//! (`registration::Registration::enter`); this model stands for that lock
//! with loom's mutex. It replaces the model of the claim the persistent
//! registrations had before they took the spinlock.
//!
//! Checked in every interleaving: no two sections overlap (loom's
//! `UnsafeCell` panics on an access not ordered after the previous one), the
//! lifecycle is consistent at the end of every section, every mapping made
//! is undone exactly once, and the pin is unpinned exactly once. A mutant
//! that enters a section without the lock must make some interleaving fail.

use crate::lifecycle::{
    Lifecycle,
    Pin,
    Resources, //
};
use loom::{
    cell::UnsafeCell,
    sync::{
        Arc,
        Mutex, //
    },
    thread,
};
use std::sync::atomic::{
    AtomicBool,
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

/// What the lock guards: the lifecycle, and what was done with its objects.
struct Data {
    lc: Lifecycle<Model>,
    maps_made: u32,
    maps_undone: u32,
    unpins: u32,
}

struct Reg {
    lock: Mutex<()>,
    data: UnsafeCell<Data>,
}

/// The mutant: sections entered without the lock.
static NO_LOCK: AtomicBool = AtomicBool::new(false);

impl Reg {
    /// One section under the lock, as `Registration::enter` takes it.
    fn section<T>(&self, f: impl FnOnce(&mut Data) -> T) -> T {
        let _g = (!NO_LOCK.load(Relaxed)).then(|| self.lock.lock().unwrap());
        self.data.with_mut(|d| {
            // SAFETY: under the lock (what the model checks).
            let d = unsafe { &mut *d };
            let r = f(d);
            assert!(d.lc.consistent(), "inconsistent after a section");
            r
        })
    }
}

/// The registration's maker: `get_pages`, then `dma_map` (start, map
/// outside the lock, publish).
fn make(reg: &Reg) {
    if !reg.section(|d| d.lc.bind(CTX).is_ok()) {
        return;
    }
    if !reg.section(|d| d.lc.start_map().is_ok()) {
        return;
    }
    reg.section(|d| {
        d.maps_made += 1;
        if d.lc.map_succeeded(MAP).is_err() {
            // Unmapped meanwhile: `dma_map` undoes its own map.
            d.maps_undone += 1;
        }
    });
}

/// `release`, after every other call: checks every mapping was undone once
/// and the pin unpinned once.
fn release(reg: &Reg) {
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
}

static EXPLORED: AtomicUsize = AtomicUsize::new(0);

fn model(no_lock: bool) -> usize {
    EXPLORED.store(0, Relaxed);
    NO_LOCK.store(no_lock, Relaxed);
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(|| {
        EXPLORED.fetch_add(1, Relaxed);
        let reg = Arc::new(Reg {
            lock: Mutex::new(()),
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
            thread::spawn(move || make(&reg))
        };
        // dma_unmap, then put_pages, both racing the maker.
        reg.section(|d| {
            if d.lc.unmap().is_some() {
                d.maps_undone += 1;
            }
        });
        reg.section(|d| {
            if d.lc.put_pages().is_some() {
                d.maps_undone += 1;
            }
        });
        maker.join().unwrap();
        release(&reg);
    });
    NO_LOCK.store(false, Relaxed);
    EXPLORED.load(Relaxed)
}

#[test]
fn persistent_registration_against_a_core_out_of_order() {
    let n = model(false);
    println!(
        "loom: persistent, core out of order: explored {n} interleavings (preemption bound 3)"
    );
    assert!(n > 10, "the model explored too little: {n}");

    let r = crate::mutants::quietly(|| crate::mutants::caught(|| model(true)));
    NO_LOCK.store(false, Relaxed);
    let line = crate::mutants::outcome(&r, EXPLORED.load(Relaxed));
    println!("loom: mutant NoLock (persistent, core out of order): {line}");
    assert!(
        r.is_err_and(|e| e.contains("Causality violation")),
        "a section without the lock was not caught: {line}"
    );
}
