// SPDX-License-Identifier: GPL-2.0 OR MIT

//! What `src/claim.rs` takes from the module's `atomics.rs` (`Atomic<u32>`,
//! the orderings, `spin_loop`), over loom's atomics, so that loom explores
//! the module's own claim. A mutant switch breaks the primitives the claim
//! relies on, to check that the model notices.

use loom::sync::atomic::AtomicU32;
use std::{cell::Cell, marker::PhantomData, sync::atomic::Ordering};

pub(crate) use loom::hint::spin_loop;
pub(crate) use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

/// A broken primitive under the claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mutant {
    /// The atomics as they are.
    None,
    /// The compare-and-exchange is a load and a store: two callers can both
    /// see the claim free and both take it.
    SplitExchange,
    /// Every ordering is `Relaxed`: taking the claim does not see what the
    /// previous holder wrote.
    RelaxedOnly,
}

thread_local! {
    static MUTANT: Cell<Mutant> = const { Cell::new(Mutant::None) };
}

/// Sets the mutant for models run on this thread (loom runs a model's
/// threads on the thread that called `loom::model`).
pub(crate) fn set_mutant(m: Mutant) {
    MUTANT.with(|c| c.set(m));
}

fn order(o: Ordering) -> Ordering {
    if MUTANT.with(Cell::get) == Mutant::RelaxedOnly {
        Relaxed
    } else {
        o
    }
}

/// `atomics::Atomic<u32>` of the module, over loom.
pub(crate) struct Atomic<T>(AtomicU32, PhantomData<T>);

impl Atomic<u32> {
    pub(crate) fn new(v: u32) -> Self {
        Self(AtomicU32::new(v), PhantomData)
    }

    pub(crate) fn load(&self, o: Ordering) -> u32 {
        self.0.load(order(o))
    }

    pub(crate) fn store(&self, v: u32, o: Ordering) {
        self.0.store(v, order(o))
    }

    /// Replaces `old` by `new`; a failure is relaxed (as the module's).
    pub(crate) fn cmpxchg(&self, old: u32, new: u32, o: Ordering) -> Result<u32, u32> {
        if MUTANT.with(Cell::get) == Mutant::SplitExchange {
            let cur = self.0.load(order(o));
            if cur != old {
                return Err(cur);
            }
            self.0.store(new, Relaxed);
            return Ok(cur);
        }
        self.0.compare_exchange(old, new, order(o), Relaxed)
    }
}
