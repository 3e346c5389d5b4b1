// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Command line.

use std::{path::PathBuf, time::Duration};

pub const HELP: &str = "\
peermem-stat: what nvidia_peermem and the RDMA core's peer-memory clients are doing,
and which GPUDirect RDMA detection paths NCCL, UCX, Open MPI, NVSHMEM and GDS
will see.

Usage: peermem-stat [OPTIONS]               module, counters, clients, detection
       peermem-stat paths [OPTIONS]         GPU x HCA paths (nvidia-smi topo -m)
       peermem-stat --by-gpu [OPTIONS]      registrations, pinned bytes per GPU
       peermem-stat --by-process [OPTIONS]  the same per process (tgid, comm)
       peermem-stat --prometheus [--root DIR]

Views:
  paths           matrix of GPUs (rows) by HCAs (columns), each cell the path
                  class: PIX one PCIe switch, PXB several switches, PHB through
                  the host bridge, NODE across host bridges in a NUMA node, SYS
                  across NUMA nodes, - not classified; marks: +A a bridge
                  redirects peer requests (ACS), +I the HCA's DMA is
                  IOMMU-translated; then per pair: registrations, path-policy
                  refusals, failures by errno
  --by-gpu        live registrations, pinned and most-ever pinned bytes per GPU
  --by-process    live registrations and pinned bytes per process that has some
  --prometheus    everything (counters, parameters, clients, paths, GPUs,
                  processes) in the Prometheus text format 0.0.4, metrics named
                  nvidia_peermem_*, for node_exporter's textfile collector:
                    peermem-stat --prometheus > DIR/peermem.prom.$$ &&
                    mv DIR/peermem.prom.$$ DIR/peermem.prom
                  always exits 0 when written (nvidia_peermem_up says 0 or 1)

Options:
  --json          one JSON object (with --watch: one object per line per frame);
                  with a view: that view's records (snake_case keys, numbers as
                  numbers, <view>_error when its file is unavailable)
  --all           show every counter, also failure counters that are zero
  --watch SECS    repeat every SECS seconds (fractions allowed), with rates of
                  registrations and invalidations since the previous frame
  --count N       with --watch: stop after N frames (default: run until killed)
  --root DIR      read sysfs and debugfs under DIR instead of / (for tests)
  -h, --help      this text
  -V, --version   the tool's version

Reads /sys/module/nvidia_peermem/{version,refcnt,parameters/*},
/sys/kernel/debug/nvidia_peermem/{stats,paths,gpus,processes} (debugfs, needs
root; paths, gpus and processes only from a module with path diagnostics: a
view whose file is missing says so in one line),
/sys/kernel/mm/memory_peers/*/ and /sys/module/nvidia/version.

Exit status: 0 ok, 1 usage error, 2 nothing found (nvidia_peermem not loaded
and no peer-memory client registered; never with --prometheus).
";

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

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Opts {
    pub root: PathBuf,
    pub view: View,
    pub prometheus: bool,
    pub json: bool,
    pub all: bool,
    pub watch: Option<Duration>,
    pub count: Option<u64>,
}

/// The command line's outcome.
#[derive(Debug, PartialEq)]
pub enum Cmd {
    Run(Opts),
    Help,
    Version,
}

/// Parses the arguments after the program name.
pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Cmd, String> {
    let mut o = Opts {
        root: PathBuf::from("/"),
        view: View::Overview,
        prometheus: false,
        json: false,
        all: false,
        watch: None,
        count: None,
    };
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        // Accept both `--opt value` and `--opt=value`.
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |what: &str| {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{name} needs {what}"))
        };
        match name.as_str() {
            "-h" | "--help" => return Ok(Cmd::Help),
            "-V" | "--version" => return Ok(Cmd::Version),
            "--json" | "--all" | "--by-gpu" | "--by-process" | "--prometheus"
                if inline.is_some() =>
            {
                return Err(format!("{name} takes no value"));
            }
            "paths" => view(&mut o, View::Paths, "paths")?,
            "--by-gpu" => view(&mut o, View::ByGpu, "--by-gpu")?,
            "--by-process" => view(&mut o, View::ByProcess, "--by-process")?,
            "--prometheus" => o.prometheus = true,
            "--json" => o.json = true,
            "--all" => o.all = true,
            "--root" => {
                let v = value("a directory")?;
                if v.is_empty() {
                    return Err("--root needs a directory".into());
                }
                o.root = PathBuf::from(v);
            }
            "--watch" => o.watch = Some(secs(&value("a number of seconds")?)?),
            "--count" => {
                let v = value("a number of frames")?;
                match v.parse::<u64>() {
                    Ok(n) if n > 0 => o.count = Some(n),
                    _ => return Err(format!("--count: '{v}' is not a positive integer")),
                }
            }
            _ => return Err(format!("unknown argument '{arg}'")),
        }
    }
    if o.count.is_some() && o.watch.is_none() {
        return Err("--count needs --watch".into());
    }
    if o.prometheus {
        if o.json {
            return Err("--prometheus and --json: choose one format".into());
        }
        if o.view != View::Overview {
            return Err("--prometheus shows everything: it takes no view".into());
        }
        if o.watch.is_some() {
            return Err(
                "--prometheus takes no --watch: run it from a timer and rename the file into place"
                    .into(),
            );
        }
    }
    Ok(Cmd::Run(o))
}

/// Sets the view; a second, different one is an error.
fn view(o: &mut Opts, v: View, name: &str) -> Result<(), String> {
    if o.view != View::Overview && o.view != v {
        return Err(format!(
            "{name}: one view at a time (paths, --by-gpu or --by-process)"
        ));
    }
    o.view = v;
    Ok(())
}

/// Seconds, fractions allowed: at least 1 ms, at most a day.
fn secs(v: &str) -> Result<Duration, String> {
    match v.parse::<f64>() {
        Ok(s) if (0.001..=86_400.0).contains(&s) => Ok(Duration::from_secs_f64(s)),
        _ => Err(format!(
            "--watch: '{v}' is not a number of seconds between 0.001 and 86400"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(a: &[&str]) -> Result<Cmd, String> {
        parse(a.iter().map(|s| s.to_string()))
    }

    #[test]
    fn defaults_and_options() {
        let Ok(Cmd::Run(o)) = p(&[]) else {
            panic!("no options")
        };
        assert_eq!(o.root, PathBuf::from("/"));
        assert!(!o.json && !o.all && o.watch.is_none() && o.count.is_none());
        assert!(o.view == View::Overview && !o.prometheus);
        for (args, view) in [
            (&["paths", "--json"][..], View::Paths),
            (&["--by-gpu", "--watch", "1"], View::ByGpu),
            (&["--by-process", "--by-process"], View::ByProcess),
        ] {
            let Ok(Cmd::Run(o)) = p(args) else {
                panic!("{args:?}")
            };
            assert_eq!(o.view, view);
        }
        let Ok(Cmd::Run(o)) = p(&["--prometheus", "--all"]) else {
            panic!("prometheus")
        };
        assert!(o.prometheus);
        let Ok(Cmd::Run(o)) = p(&[
            "--json",
            "--all",
            "--watch",
            "0.25",
            "--count=3",
            "--root=/x",
        ]) else {
            panic!("options")
        };
        assert!(o.json && o.all);
        assert_eq!(o.watch, Some(Duration::from_millis(250)));
        assert_eq!(o.count, Some(3));
        assert_eq!(o.root, PathBuf::from("/x"));
        assert_eq!(p(&["--json", "-h"]), Ok(Cmd::Help));
        assert_eq!(p(&["-V"]), Ok(Cmd::Version));
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
            &["--watch", "1", "--count", "0"],
            &["--watch", "1", "--count", "x"],
            &["--root"],
            &["--json=1"],
            &["--bogus"],
            &["stray"],
            &["path"],
            &["paths", "--by-gpu"],
            &["--by-gpu", "--by-process"],
            &["--by-gpu=1"],
            &["--prometheus", "--json"],
            &["--prometheus", "paths"],
            &["--prometheus", "--watch", "1"],
            &["--prometheus=x"],
        ] {
            assert!(p(bad).is_err(), "{bad:?} accepted");
        }
    }
}
