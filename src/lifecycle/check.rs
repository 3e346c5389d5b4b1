// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The lifecycle's test-only API (a child module of `src/lifecycle.rs`,
//! compiled only for the KUnit suites and the host model checker, which
//! the module does not ship): the
//! phase, the check of the type's invariant, and `start_pin`, which the
//! module folds into [`Lifecycle::pinning`].

use super::*;

impl<R: Resources> Lifecycle<R> {
    /// The current phase.
    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether the objects held match the phase (the type's invariant).
    pub(crate) fn consistent(&self) -> bool {
        let (table, core, map) = (self.table.is_some(), self.core != 0, self.map.is_some());
        let token = self.token.is_some();
        match self.phase {
            Phase::Acquired | Phase::Pinning | Phase::Released => !table && !token && !core && !map,
            Phase::Unpinning => !table && !core && !map,
            Phase::Pinned | Phase::Unusable => table && !core && !map,
            Phase::Bound | Phase::Mapping => table && !map,
            Phase::Mapped => table && map,
            Phase::Revoked => !table && !token && !core,
            Phase::Drained => table && token,
            Phase::Stranded => !table && token && !core && !map,
            Phase::Orphaned => table && token && !core && !map,
        }
    }

    /// Whether the provider still holds an armed callback's reference that
    /// this lifecycle tracks.
    pub(crate) fn callback_armed(&self) -> bool {
        self.token.is_some()
    }

    /// `acquire` is about to pin (the module makes its registrations with
    /// [`Lifecycle::pinning`] or [`Lifecycle::with_pin`] instead).
    pub(crate) fn start_pin(&mut self) -> Result<(), Refusal> {
        self.step(Phase::Acquired, Phase::Pinning)
    }
}
