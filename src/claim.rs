// SPDX-License-Identifier: GPL-2.0 OR MIT

//! A claim: exclusive access for users that do not wait for each other.
//!
//! One word, `FREE` or `HELD`: taken by one compare-and-exchange (acquire),
//! given back by one store (release), with no call into the kernel, no
//! preemption control and no lockdep class. It is for a state that only
//! one caller at a time is expected to use (see `access`): a caller that
//! finds it taken spins until it is free.
//!
//! Plain Rust over `crate::atomics`: the host tests compile this very file
//! against loom's atomics (`tests/model`, `claim_model.rs`), which explore
//! every interleaving of contending holders.

use crate::atomics::{
    spin_loop,
    Acquire,
    Atomic,
    Relaxed,
    Release, //
};

const FREE: u32 = 0;
const HELD: u32 = 1;

/// An exclusive claim.
///
/// # Invariants
///
/// The word is `HELD` exactly while a [`ClaimGuard`] of it exists.
pub(crate) struct Claim(Atomic<u32>);

impl Claim {
    /// A free claim.
    #[allow(clippy::new_without_default)]
    pub(crate) fn new() -> Self {
        Self(Atomic::new(FREE))
    }

    /// Takes the claim if it is free.
    #[inline(always)]
    pub(crate) fn try_hold(&self) -> Option<ClaimGuard<'_>> {
        // A guard is made only once the exchange succeeded: made and
        // dropped on failure, it would free the claim of its holder.
        match self.0.cmpxchg(FREE, HELD, Acquire) {
            // INVARIANT: the exchange made it `HELD`.
            Ok(_) => Some(ClaimGuard(self)),
            Err(_) => None,
        }
    }

    /// Takes the claim, spinning while another holder has it.
    #[cold]
    #[inline(never)]
    pub(crate) fn hold_contended(&self) -> ClaimGuard<'_> {
        loop {
            while self.0.load(Relaxed) != FREE {
                spin_loop();
            }
            if let Some(g) = self.try_hold() {
                return g;
            }
        }
    }

    /// Whether some [`ClaimGuard`] holds the claim now.
    #[allow(dead_code)]
    pub(crate) fn is_held(&self) -> bool {
        self.0.load(Relaxed) == HELD
    }
}

/// A held [`Claim`], given back on drop.
pub(crate) struct ClaimGuard<'a>(&'a Claim);

impl ClaimGuard<'_> {
    /// Gives the claim up for a moment and takes it back: what a holder does
    /// where a lock's holder would sleep until woken (nothing wakes a
    /// claim's holder; its caller rechecks its condition in a loop).
    #[allow(dead_code)]
    pub(crate) fn yield_once(&mut self) {
        let claim = self.0;
        claim.0.store(FREE, Release);
        spin_loop();
        // INVARIANT: `HELD` again, by this guard, before it is used.
        if claim.try_hold().map(core::mem::forget).is_none() {
            core::mem::forget(claim.hold_contended());
        }
    }
}

impl Drop for ClaimGuard<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        // Orders every access made under the claim before the next holder's
        // (which takes it with `Acquire`).
        self.0 .0.store(FREE, Release);
    }
}
