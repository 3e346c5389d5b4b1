// SPDX-License-Identifier: GPL-2.0 OR MIT

//! peermem-stat: what nvidia_peermem and the RDMA core's peer-memory clients
//! are doing, and which GPUDirect RDMA detection paths user space will see.

#![forbid(unsafe_code)]

pub mod args;
pub mod attempts;
pub mod detect;
pub mod diag;
pub mod doctor;
pub mod prom;
pub mod render;
pub mod snapshot;
pub mod sysfs;
pub mod views;

use std::{
    io::{self, Write},
    time::Instant,
};

use args::{Cli, Command, View};
use clap::{error::ErrorKind, CommandFactory};
use render::Rates;
use serde::Serialize;
use snapshot::Snapshot;
use sysfs::Sys;

pub const EXIT_OK: i32 = 0;
pub const EXIT_USAGE: i32 = 1;
pub const EXIT_NOTHING: i32 = 2;
pub const EXIT_FINDINGS: i32 = 3;

/// Runs the tool with `args` (without the program name); returns the exit
/// status. `tty`: stdout is a terminal (watch frames then clear the screen).
pub fn run<I: IntoIterator<Item = String>>(
    args: I,
    out: &mut dyn Write,
    err: &mut dyn Write,
    tty: bool,
) -> i32 {
    let opts = match args::parse(args) {
        Ok(o) => o,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            return finish(write!(out, "{}", e.render()), err);
        }
        Err(e) => {
            let _ = write!(err, "{}", e.render());
            return EXIT_USAGE;
        }
    };
    let sys = Sys::new(&opts.root);
    match &opts.command {
        Some(Command::Completions { shell }) => {
            let mut cmd = Cli::command();
            clap_complete::generate(*shell, &mut cmd, "peermem-stat", out);
            return finish(out.flush(), err);
        }
        Some(Command::Doctor { log }) => {
            let r = doctor::Report::new(&sys, log.as_deref());
            return match finish(r.write(out, err, opts.json), err) {
                EXIT_OK if !r.findings.is_empty() => EXIT_FINDINGS,
                code => code,
            };
        }
        _ => {}
    }
    if opts.prometheus {
        // Written for a textfile collector: "not loaded" is a value
        // (nvidia_peermem_up 0), not a failure that would keep a stale file.
        let snap = Snapshot::read(&sys);
        return finish(
            out.write_all(prom::prometheus(&snap).as_bytes())
                .and_then(|()| out.flush()),
            err,
        );
    }
    match frames(&opts, &sys, out, tty) {
        Ok(true) => EXIT_OK,
        Ok(false) => {
            let _ = writeln!(
                err,
                "peermem-stat: nothing found: nvidia_peermem is not loaded (no {}) and no \
                 peer-memory client is registered with the RDMA core (no {}/*).",
                sysfs::MODULE_DIR,
                sysfs::PEERS_DIR
            );
            EXIT_NOTHING
        }
        Err(e) => finish(Err(e), err),
    }
}

/// Exit status after writing output: a closed pipe (`| head`) is no error.
fn finish(r: io::Result<()>, err: &mut dyn Write) -> i32 {
    match r {
        Ok(()) => EXIT_OK,
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => EXIT_OK,
        Err(e) => {
            let _ = writeln!(err, "peermem-stat: writing output: {e}");
            EXIT_USAGE
        }
    }
}

/// Shows one frame, or frames every `--watch` interval; returns whether the
/// last frame found anything.
fn frames(o: &Cli, sys: &Sys, out: &mut dyn Write, tty: bool) -> io::Result<bool> {
    let start = Instant::now();
    let mut prev: Option<(Snapshot, Instant)> = None;
    let mut n = 0u64;
    loop {
        n += 1;
        let now = Instant::now();
        let snap = Snapshot::read(sys);
        let rates = prev
            .as_ref()
            .map(|(p, t)| Rates::between(p, &snap, now.duration_since(*t).as_secs_f64()));
        if o.json {
            match o.view() {
                View::Overview => json_line(out, &render::json(&snap, rates.as_ref()))?,
                View::Paths => json_line(out, &views::paths_json(&snap))?,
                View::ByGpu => json_line(out, &views::by_gpu_json(&snap))?,
                View::ByProcess => json_line(out, &views::by_process_json(&snap))?,
            }
        } else {
            if o.watch.is_some() {
                if tty {
                    // Home the cursor and clear the screen.
                    write!(out, "\x1b[H\x1b[2J")?;
                }
                writeln!(
                    out,
                    "--- frame {n} (+{:.2} s) ---",
                    now.duration_since(start).as_secs_f64()
                )?;
            }
            let text = match o.view() {
                View::Overview => render::table(&snap, o.all, rates.as_ref()),
                View::Paths => views::paths(&snap),
                View::ByGpu => views::by_gpu(&snap),
                View::ByProcess => views::by_process(&snap),
            };
            write!(out, "{text}")?;
            if o.watch.is_some() {
                writeln!(out)?;
            }
        }
        out.flush()?;
        let found = snap.found();
        let Some(every) = o.watch else {
            return Ok(found);
        };
        if o.count.is_some_and(|c| n >= c) {
            return Ok(found);
        }
        std::thread::sleep(every);
        prev = Some((snap, now));
    }
}

/// `v` as one line of JSON.
pub(crate) fn json_line(out: &mut dyn Write, v: &impl Serialize) -> io::Result<()> {
    serde_json::to_writer(&mut *out, v)?;
    writeln!(out)
}
