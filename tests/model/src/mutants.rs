// SPDX-License-Identifier: GPL-2.0 OR MIT

//! What the loom models share to run their mutants: a mutant's failing
//! interleaving panics, and the test wants the panic's message, not its
//! report.

/// Runs `f`; the message of its panic, if it panicked.
pub(crate) fn caught<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe) -> Result<T, String> {
    std::panic::catch_unwind(f).map_err(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// Runs `f` with the panics of this thread silenced (loom runs a model's
/// threads on it), unless `PEERMEM_LOOM_SHOW_PANICS` is set; other threads'
/// panics are reported as before.
pub(crate) fn quietly<T>(f: impl FnOnce() -> T) -> T {
    let me = std::thread::current().id();
    let show = std::env::var_os("PEERMEM_LOOM_SHOW_PANICS").is_some();
    let prev = std::sync::Arc::new(std::panic::take_hook());
    let fwd = std::sync::Arc::clone(&prev);
    std::panic::set_hook(Box::new(move |info| {
        if show || std::thread::current().id() != me {
            fwd(info);
        }
    }));
    let r = f();
    let _ = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| prev(info)));
    r
}

/// A mutant's line of the report: how many interleavings it passed, or
/// after how many (`explored`) it was caught, and why.
pub(crate) fn outcome(r: &Result<usize, String>, explored: usize) -> String {
    match r {
        Ok(n) => format!("NOT caught: passed {n} interleavings"),
        Err(e) => format!(
            "caught after {explored} interleavings: {}",
            e.lines().next().unwrap_or("")
        ),
    }
}
