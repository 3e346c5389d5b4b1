// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Command line (clap). Every option is global, so it may stand before or
//! after a subcommand, as before clap (`--json paths`, `paths --json`).

use std::{path::PathBuf, time::Duration};

use clap::{
    builder::{NonEmptyStringValueParser, TypedValueParser},
    error::ErrorKind,
    CommandFactory, Parser,
};

const AFTER_HELP: &str = "\
Reads /sys/module/nvidia_peermem/{version,refcnt,parameters/*}, the module's
views, one value per file: /sys/module/nvidia_peermem/stats/{counters/*,
gpus/*/*,paths/*/*} (world-readable: no root, no debugfs), and as root
/sys/kernel/debug/nvidia_peermem/processes (debugfs mounted); from earlier
releases, the tables stats/{counters,paths,gpus,processes}, or in the first
ones /sys/kernel/debug/nvidia_peermem/{stats,paths,gpus,processes} (debugfs
mounted, root); a view whose file is missing says why in one line),
/sys/kernel/mm/memory_peers/*/, /sys/module/nvidia/version, and for doctor
/dev/kmsg (or --log FILE).

--prometheus, for node_exporter's textfile collector:
  peermem-stat --prometheus > DIR/peermem.prom.$$ && mv DIR/peermem.prom.$$ DIR/peermem.prom

Exit status: 0 ok, 1 usage error, 2 nothing found (nvidia_peermem not loaded
and no peer-memory client registered; never with --prometheus), 3 doctor found
a problem.";

/// peermem-stat: what nvidia_peermem and the RDMA core's peer-memory clients
/// are doing, and which GPUDirect RDMA detection paths NCCL, UCX, Open MPI,
/// NVSHMEM and GDS will see.
///
/// Without a subcommand or view: module, counters, clients, detection.
#[derive(Parser, Debug)]
#[command(
    name = "peermem-stat",
    version,
    verbatim_doc_comment,
    after_help = AFTER_HELP,
    args_override_self = true,
    disable_help_subcommand = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// One JSON object (with --watch: one per line per frame)
    ///
    /// With a view: that view's records (snake_case keys, numbers as numbers,
    /// <view>_error when its file is unavailable).
    #[arg(long, global = true, verbatim_doc_comment)]
    pub json: bool,
    /// Show every counter, also failure counters that are zero
    #[arg(long, global = true)]
    pub all: bool,
    /// Repeat every SECS seconds (fractions allowed), with rates
    ///
    /// The rates are of registrations and invalidations since the previous
    /// frame.
    #[arg(long, global = true, value_name = "SECS", value_parser = secs, verbatim_doc_comment)]
    pub watch: Option<Duration>,
    /// With --watch: stop after N frames (default: run until killed)
    #[arg(long, global = true, value_name = "N", requires = "watch",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub count: Option<u64>,
    /// Read /sys, /proc and /dev/kmsg under DIR instead of / (tests)
    #[arg(long, global = true, value_name = "DIR", default_value = "/",
          value_parser = NonEmptyStringValueParser::new().map(PathBuf::from))]
    pub root: PathBuf,
    /// View: live registrations, pinned, most-ever pinned bytes per GPU
    #[arg(long, global = true, conflicts_with = "by_process")]
    pub by_gpu: bool,
    /// View: live registrations and pinned bytes per process that has some
    #[arg(long, global = true)]
    pub by_process: bool,
    /// Everything in the Prometheus text format, for node_exporter
    ///
    /// Counters, parameters, clients, paths, GPUs and processes in the text
    /// format 0.0.4, metrics named nvidia_peermem_*, for node_exporter's
    /// textfile collector; exits 0 when written (nvidia_peermem_up says 0
    /// or 1).
    #[arg(long, global = true, verbatim_doc_comment,
          conflicts_with_all = ["json", "watch", "by_gpu", "by_process"])]
    pub prometheus: bool,
}

#[derive(clap::Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// View: GPU x HCA path matrix (like nvidia-smi topo -m), then per pair
    ///
    /// GPUs are rows, HCAs columns, each cell the path class: PIX one PCIe
    /// switch, PXB several switches, PHB through the host bridge, NODE across
    /// host bridges in a NUMA node, SYS across NUMA nodes, - not classified;
    /// marks: +A a bridge redirects peer requests (ACS), +I the HCA's DMA is
    /// IOMMU-translated. Then per pair: registrations, path-policy refusals,
    /// failures and the last one's errno.
    #[command(verbatim_doc_comment)]
    Paths,
    /// Known failure modes found here, one line each with what to do
    ///
    /// Checks: the peer-memory core absent, a symbol version mismatch, the
    /// GPU driver absent, an unknown symbol, the module loaded but its client
    /// not registered, paths refused by policy or by the GPU driver's topology
    /// gate, pins held for exited processes. Prints "ok" and exits 0 when
    /// there is none, else exits 3. Load failures come from the kernel log
    /// (/dev/kmsg, needs root), read only while the module is not loaded.
    #[command(verbatim_doc_comment)]
    Doctor {
        /// Read the kernel log from FILE (saved dmesg or journalctl -k)
        ///
        /// Instead of /dev/kmsg; an absolute FILE is under --root.
        #[arg(long, value_name = "FILE", verbatim_doc_comment)]
        log: Option<PathBuf>,
    },
    /// Print a shell completion script
    ///
    /// For example:
    ///   peermem-stat completions bash > /etc/bash_completion.d/peermem-stat
    #[command(verbatim_doc_comment)]
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// What to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// Module, counters, clients, detection.
    Overview,
    /// `paths`: the GPU x HCA matrix.
    Paths,
    /// `--by-gpu`.
    ByGpu,
    /// `--by-process`.
    ByProcess,
}

impl Cli {
    pub fn view(&self) -> View {
        match (&self.command, self.by_gpu, self.by_process) {
            (Some(Command::Paths), ..) => View::Paths,
            (_, true, _) => View::ByGpu,
            (_, _, true) => View::ByProcess,
            _ => View::Overview,
        }
    }

    /// Combinations clap's attributes cannot express (a subcommand with
    /// global options).
    fn check(&self) -> Result<(), clap::Error> {
        let views = self.by_gpu || self.by_process;
        let why = match &self.command {
            None => return Ok(()),
            Some(Command::Paths) if views => {
                "paths: one view at a time (paths, --by-gpu or --by-process)"
            }
            Some(Command::Paths) if self.prometheus => {
                "--prometheus shows everything: it takes no view"
            }
            Some(Command::Paths) => return Ok(()),
            Some(_) if views || self.prometheus || self.watch.is_some() => {
                "doctor and completions take no view, --prometheus or --watch"
            }
            Some(_) => return Ok(()),
        };
        Err(Cli::command().error(ErrorKind::ArgumentConflict, why))
    }
}

/// Parses the arguments after the program name.
pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Cli, clap::Error> {
    let cli = Cli::try_parse_from(std::iter::once("peermem-stat".to_string()).chain(args))?;
    cli.check()?;
    Ok(cli)
}

/// Seconds, fractions allowed: at least 1 ms, at most a day.
fn secs(v: &str) -> Result<Duration, String> {
    match v.parse::<f64>() {
        Ok(s) if (0.001..=86_400.0).contains(&s) => Ok(Duration::from_secs_f64(s)),
        _ => Err("not a number of seconds between 0.001 and 86400".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn p(a: &[&str]) -> Result<Cli, clap::Error> {
        parse(a.iter().map(|s| s.to_string()))
    }

    #[test]
    fn clap_definition() {
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults_and_options() {
        let o = p(&[]).unwrap();
        assert_eq!(o.root, PathBuf::from("/"));
        assert!(!o.json && !o.all && o.watch.is_none() && o.count.is_none());
        assert!(o.view() == View::Overview && !o.prometheus);
        for (args, view) in [
            (&["paths", "--json"][..], View::Paths),
            (&["--json", "paths"], View::Paths),
            (&["--by-gpu", "--watch", "1"], View::ByGpu),
            (&["--by-process", "--by-process"], View::ByProcess),
        ] {
            assert_eq!(p(args).unwrap().view(), view, "{args:?}");
        }
        assert!(p(&["--prometheus", "--all"]).unwrap().prometheus);
        let o = p(&[
            "--json",
            "--all",
            "--watch",
            "0.25",
            "--count=3",
            "--root=/x",
        ])
        .unwrap();
        assert!(o.json && o.all);
        assert_eq!(o.watch, Some(Duration::from_millis(250)));
        assert_eq!(o.count, Some(3));
        assert_eq!(o.root, PathBuf::from("/x"));
        let o = p(&["--root", "/r", "doctor", "--log", "/k.log", "--json"]).unwrap();
        assert_eq!(
            o.command,
            Some(Command::Doctor {
                log: Some("/k.log".into())
            })
        );
        assert!(o.json && o.root == Path::new("/r"));
        assert!(p(&["completions", "zsh"]).is_ok());
        assert_eq!(
            p(&["--json", "-h"]).unwrap_err().kind(),
            ErrorKind::DisplayHelp
        );
        assert_eq!(p(&["-V"]).unwrap_err().kind(), ErrorKind::DisplayVersion);
    }

    #[test]
    fn usage_errors() {
        for bad in [
            &["--watch"][..],
            &["--watch", "0"],
            &["--watch", "abc"],
            &["--watch", "NaN"],
            &["--watch", "-1"],
            &["--count", "2"],
            &["paths", "--count", "2"],
            &["--watch", "1", "--count", "0"],
            &["--watch", "1", "--count", "x"],
            &["--root"],
            &["--root", ""],
            &["--json=1"],
            &["--bogus"],
            &["stray"],
            &["path"],
            &["paths", "--by-gpu"],
            &["--by-gpu", "paths"],
            &["--by-gpu", "--by-process"],
            &["--by-gpu=1"],
            &["--prometheus", "--json"],
            &["--prometheus", "paths"],
            &["--prometheus", "--by-gpu"],
            &["--prometheus", "--watch", "1"],
            &["--prometheus=x"],
            &["doctor", "--watch", "1"],
            &["doctor", "--by-gpu"],
            &["completions"],
            &["completions", "cmd.exe"],
        ] {
            let e = p(bad).err().unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(
                !matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion),
                "{bad:?}"
            );
        }
    }
}
