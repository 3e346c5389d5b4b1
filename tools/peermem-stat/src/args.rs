// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Command line.

use std::{path::PathBuf, time::Duration};

pub const HELP: &str = "\
peermem-stat: what nvidia_peermem and the RDMA core's peer-memory clients are doing,
and which GPUDirect RDMA detection paths NCCL, UCX, Open MPI, NVSHMEM and GDS
will see.

Usage: peermem-stat [OPTIONS]

Options:
  --json          one JSON object (with --watch: one object per line per frame)
  --all           show every counter, also failure counters that are zero
  --watch SECS    repeat every SECS seconds (fractions allowed), with rates of
                  registrations and invalidations since the previous frame
  --count N       with --watch: stop after N frames (default: run until killed)
  --root DIR      read sysfs and debugfs under DIR instead of / (for tests)
  -h, --help      this text
  -V, --version   the tool's version

Reads /sys/module/nvidia_peermem/{version,refcnt,parameters/*},
/sys/kernel/debug/nvidia_peermem/stats (debugfs, needs root),
/sys/kernel/mm/memory_peers/*/ and /sys/module/nvidia/version.

Exit status: 0 ok, 1 usage error, 2 nothing found (nvidia_peermem not loaded
and no peer-memory client registered).
";

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Opts {
    pub root: PathBuf,
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
            "--json" | "--all" if inline.is_some() => {
                return Err(format!("{name} takes no value"));
            }
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
    Ok(Cmd::Run(o))
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
        ] {
            assert!(p(bad).is_err(), "{bad:?} accepted");
        }
    }
}
