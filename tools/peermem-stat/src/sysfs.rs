// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Reading sysfs (and, for a peermem-rs older than its sysfs views, debugfs)
//! and procfs under a root prefix (a [`crate::snapshot::Snapshot`] puts
//! them together). Nothing here panics on
//! what it reads: a bad file becomes an error for its field only.
//!
//! The module's views come in three layouts, each read into the same
//! `key=value` lines (parsed by [`parse_stats`] and `diag`): one value per
//! file (this release: `stats/counters/<name>`, `stats/gpus/<gpu>/<file>`,
//! `stats/paths/<gpu>-<hca>/<file>`, the processes in root's debugfs), one
//! table per sysfs file (`stats/counters`, `stats/gpus`, ...: earlier
//! releases), one table per debugfs file (the first releases).

use std::{
    fs,
    io::{self, Read},
    path::{Path, PathBuf},
};

use crate::detect;

pub const MODULE_DIR: &str = "/sys/module/nvidia_peermem";
/// The module's operator views: world-readable files that exist whenever
/// peermem-rs is loaded (no root, no debugfs; readable under lockdown and in
/// a container that mounts only /sys). The processes are not among them:
/// root reads them in debugfs ([`PROCESSES`]).
pub const VIEWS_DIR: &str = "/sys/module/nvidia_peermem/stats";
/// Where debugfs is mounted.
pub const DEBUGFS: &str = "/sys/kernel/debug";
/// Where a peermem-rs older than its sysfs views kept the same files
/// (debugfs: mounted, and root, needed).
pub const DEBUGFS_DIR: &str = "/sys/kernel/debug/nvidia_peermem";
pub const PEERS_DIR: &str = "/sys/kernel/mm/memory_peers";
pub const OSRELEASE: &str = "/proc/sys/kernel/osrelease";

/// A value read from one file; the error says what was wrong with it.
pub type Field<T> = Result<T, String>;

/// Named counters, in file order.
pub type Counters = Vec<(String, Field<u64>)>;

/// One of the module's operator files: where it is, where it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewFile {
    /// Its name under [`VIEWS_DIR`] (the Prometheus `file` label).
    pub name: &'static str,
    pub sysfs: &'static str,
    /// The same file in debugfs, from a peermem-rs older than its sysfs views.
    pub debugfs: &'static str,
    /// Why a module that has the other files would not have this one.
    missing: &'static str,
}

/// `name value` lines, `param_<name>` lines included.
pub const COUNTERS: ViewFile = ViewFile {
    name: "counters",
    sysfs: "/sys/module/nvidia_peermem/stats/counters",
    debugfs: "/sys/kernel/debug/nvidia_peermem/stats",
    missing: "counters unavailable",
};

/// One GPU/HCA pair per line.
pub const PATHS: ViewFile = ViewFile {
    name: "paths",
    sysfs: "/sys/module/nvidia_peermem/stats/paths",
    debugfs: "/sys/kernel/debug/nvidia_peermem/paths",
    missing: "this nvidia_peermem has no path diagnostics",
};

/// One GPU per line.
pub const GPUS: ViewFile = ViewFile {
    name: "gpus",
    sysfs: "/sys/module/nvidia_peermem/stats/gpus",
    debugfs: "/sys/kernel/debug/nvidia_peermem/gpus",
    missing: "this nvidia_peermem has no path diagnostics",
};

/// One process with live registrations per line (in sysfs before the one
/// value per file layout; in debugfs, root's, since).
pub const PROCESSES: ViewFile = ViewFile {
    name: "processes",
    sysfs: "/sys/module/nvidia_peermem/stats/processes",
    debugfs: "/sys/kernel/debug/nvidia_peermem/processes",
    missing: "this nvidia_peermem has no path diagnostics",
};

/// Why the processes are not shown with the one value per file layout.
const ROOTS_PROCESSES: &str =
    "the processes are root's: /sys/kernel/debug/nvidia_peermem/processes \
     (debugfs mounted, as root)";

/// Where this node's nvidia_peermem keeps its operator files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Views {
    /// [`VIEWS_DIR`]: a peermem-rs with sysfs views.
    Sysfs,
    /// [`DEBUGFS_DIR`]: a peermem-rs older than its sysfs views.
    Debugfs,
    /// Neither, with the one-line reason every view gives: the module is
    /// not loaded, is NVIDIA's C module (no counters), or is an older
    /// peermem-rs whose debugfs is not mounted or not readable.
    Unavailable(String),
}

/// Files are small; a larger one is cut here rather than read whole.
const MAX_FILE: u64 = 1 << 20;

/// The file system under a root prefix.
pub struct Sys {
    root: PathBuf,
}

impl Sys {
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
        }
    }

    /// `abs` (an absolute path of the live system) under the root.
    pub fn path(&self, abs: &str) -> PathBuf {
        self.root.join(abs.trim_start_matches('/'))
    }

    pub fn exists(&self, abs: &str) -> bool {
        self.path(abs).exists()
    }

    /// A path given by the user: an absolute one under the root, a relative
    /// one as it is.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        match p.strip_prefix("/") {
            Ok(rel) => self.root.join(rel),
            Err(_) => p.to_path_buf(),
        }
    }

    pub(crate) fn read(path: &Path) -> io::Result<String> {
        let mut buf = Vec::new();
        fs::File::open(path)?.take(MAX_FILE).read_to_end(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// Trimmed text of a file; None when it does not exist.
    fn text_at(path: &Path) -> Option<Field<String>> {
        match Self::read(path) {
            Ok(s) => Some(Ok(s.trim().to_string())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => Some(Err(e.to_string())),
        }
    }

    /// A decimal u64 file; None when it does not exist.
    fn num_at(path: &Path) -> Option<Field<u64>> {
        Self::text_at(path).map(|t| t.and_then(|s| parse_u64(&s)))
    }

    pub fn text(&self, abs: &str) -> Option<Field<String>> {
        Self::text_at(&self.path(abs))
    }

    pub fn num(&self, abs: &str) -> Option<Field<u64>> {
        Self::num_at(&self.path(abs))
    }

    /// Sorted (name, is_dir) of a directory's entries.
    fn list(&self, abs: &str) -> io::Result<Vec<(String, bool)>> {
        list_at(&self.path(abs))
    }
}

fn list_at(dir: &Path) -> io::Result<Vec<(String, bool)>> {
    let mut v = Vec::new();
    for e in fs::read_dir(dir)? {
        let e = e?;
        let is_dir = e.path().is_dir();
        v.push((e.file_name().to_string_lossy().into_owned(), is_dir));
    }
    v.sort();
    Ok(v)
}

/// A file of a record that went meanwhile (sysfs: ENODEV once the module
/// forgot it, ENOENT once its directory is gone).
fn vanished(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(19)
}

/// The table `f` as the earlier releases' file had it, put together from
/// the one-value files under `dir`: `counters/<name>` as `name value`
/// lines; each directory of `gpus/` or `paths/` as a `gpu=<bdf>
/// [hca=<bdf>] <file>=<value> ...` line (a record gone meanwhile is left
/// out).
pub fn from_files(f: &ViewFile, dir: &Path) -> io::Result<String> {
    let mut out = String::new();
    'records: for (name, is_dir) in list_at(dir)? {
        let p = dir.join(&name);
        if f.name == COUNTERS.name {
            out += &format!("{name} {}\n", Sys::read(&p)?.trim());
            continue;
        }
        let mut line = match name.split_once('-') {
            Some((gpu, hca)) if f.name == PATHS.name => format!("gpu={gpu} hca={hca}"),
            _ => format!("gpu={name}"),
        };
        let files = match list_at(&p) {
            Ok(files) if is_dir => files,
            Err(e) if !vanished(&e) => return Err(e),
            _ => continue,
        };
        for (file, _) in files {
            match Sys::read(&p.join(&file)) {
                Ok(v) => line += &format!(" {file}={}", v.trim()),
                Err(e) if vanished(&e) => continue 'records,
                Err(e) => return Err(e),
            }
        }
        out += &line;
        out.push('\n');
    }
    Ok(out)
}

/// Parses a decimal counter.
pub fn parse_u64(s: &str) -> Field<u64> {
    s.trim().parse::<u64>().map_err(|_| {
        let shown: String = s.chars().take(40).collect();
        format!("not a number: {shown:?}")
    })
}

/// `name value` lines, in file order. A line that is not `name u64` is kept
/// as an error under its first word; empty lines are skipped; a repeated
/// name keeps its first value.
pub fn parse_stats(text: &str) -> Counters {
    let mut out = Counters::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(name) = words.next() else {
            continue;
        };
        if out.iter().any(|(n, _)| n == name) {
            continue;
        }
        let value = match (words.next(), words.next()) {
            (Some(v), None) => parse_u64(v),
            (None, _) => Err("no value".to_string()),
            (Some(_), Some(_)) => Err(format!("malformed line {:?}", line.trim())),
        };
        out.push((name.to_string(), value));
    }
    out
}

/// /sys/module/nvidia_peermem.
#[derive(Debug, Default)]
pub struct Module {
    pub loaded: bool,
    pub version: Option<Field<String>>,
    /// Sorted by name.
    pub parameters: Vec<(String, Field<String>)>,
    pub refcnt: Option<Field<u64>>,
}

/// One peer-memory client of the RDMA core (memory_peers/<name>/).
#[derive(Debug)]
pub struct Peer {
    pub name: String,
    pub version: Option<Field<String>>,
    /// Every other file, sorted by name.
    pub counters: Counters,
}

impl Peer {
    pub fn get(&self, name: &str) -> Option<u64> {
        self.counters
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_ref().ok().copied())
    }

    fn live(&self, up: &str, down: &str) -> Option<u64> {
        // The files are read one after the other: a deallocation between
        // the two reads must not make "live" negative.
        Some(self.get(up)?.saturating_sub(self.get(down)?))
    }

    /// MRs allocated and not yet deallocated.
    pub fn live_mrs(&self) -> Option<u64> {
        self.live("num_alloc_mrs", "num_dealloc_mrs")
    }

    /// Bytes registered and not yet deregistered.
    pub fn live_bytes(&self) -> Option<u64> {
        self.live("num_reg_bytes", "num_dereg_bytes")
    }
}

/// The outcome of one detection stack.
#[derive(Debug)]
pub struct Detection {
    pub stack: &'static str,
    /// The first rule whose path exists.
    pub matched: Option<&'static detect::Rule>,
}

/// The dma-buf alternative.
#[derive(Debug)]
pub struct DmaBuf {
    pub nvidia_loaded: bool,
    pub nvidia_version: Option<Field<String>>,
    pub kernel: Option<Field<String>>,
    /// The driver's major version is new enough (None: unknown).
    pub driver_ok: Option<bool>,
    /// The kernel is new enough (None: unknown).
    pub kernel_ok: Option<bool>,
}

pub(crate) fn read_module(sys: &Sys) -> Module {
    if !sys.path(MODULE_DIR).is_dir() {
        return Module::default();
    }
    let parameters = match sys.list(&format!("{MODULE_DIR}/parameters")) {
        Ok(names) => names
            .into_iter()
            .filter(|(_, is_dir)| !is_dir)
            .map(|(n, _)| {
                let v = sys
                    .text(&format!("{MODULE_DIR}/parameters/{n}"))
                    .unwrap_or_else(|| Err("vanished".into()));
                (n, v)
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    Module {
        loaded: true,
        version: sys.text(&format!("{MODULE_DIR}/version")),
        parameters,
        refcnt: sys.num(&format!("{MODULE_DIR}/refcnt")),
    }
}

/// For a peermem-rs older than its sysfs views.
const HINT: &str = "mount -t debugfs none /sys/kernel/debug, as root";

/// The two modules [`VIEWS_DIR`]'s absence leaves possible.
const NO_VIEWS: &str =
    "NVIDIA's C module (it has no counters), or a peermem-rs older than its sysfs views";

/// Where the loaded module keeps its operator files, and which module it is.
pub fn locate(sys: &Sys, module: &Module) -> (Views, Option<&'static str>) {
    if !module.loaded {
        return (
            Views::Unavailable("nvidia_peermem is not loaded".into()),
            None,
        );
    }
    if sys.path(VIEWS_DIR).is_dir() {
        return (Views::Sysfs, Some("peermem-rs"));
    }
    let denied = |at: &str| {
        format!(
            "no {VIEWS_DIR}: {NO_VIEWS}, whose debugfs files need root \
             ({at}: permission denied)"
        )
    };
    let why = match fs::metadata(sys.path(DEBUGFS_DIR)) {
        Ok(m) if m.is_dir() => return (Views::Debugfs, Some("peermem-rs")),
        Ok(_) => format!("no {VIEWS_DIR}, and {DEBUGFS_DIR} is not a directory"),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => denied(DEBUGFS_DIR),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            match fs::read_dir(sys.path(DEBUGFS)).map(|mut d| d.next()) {
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => denied(DEBUGFS),
                // Missing or empty: nothing mounted there.
                Err(_) | Ok(None) => {
                    format!("no {VIEWS_DIR}: {NO_VIEWS} with debugfs not mounted ({HINT})")
                }
                // Debugfs readable, and no directory of ours in it.
                Ok(Some(_)) => {
                    let why = format!(
                        "no {VIEWS_DIR} nor {DEBUGFS_DIR}: NVIDIA's C module, which has no counters"
                    );
                    return (Views::Unavailable(why), Some("other"));
                }
            }
        }
        Err(e) => format!("no {VIEWS_DIR}, and {DEBUGFS_DIR}: {e}"),
    };
    (Views::Unavailable(why), None)
}

/// The text of one operator file and the file it came from: sysfs first,
/// then debugfs; or why it cannot be read, in one line.
pub fn read_view(sys: &Sys, views: &Views, f: &ViewFile) -> Result<(String, &'static str), String> {
    let (first, fallback) = match views {
        Views::Unavailable(why) => return Err(why.clone()),
        Views::Sysfs => (f.sysfs, Some(f.debugfs)),
        Views::Debugfs => (f.debugfs, None),
    };
    let at = sys.path(first);
    let read = match views == &Views::Sysfs && at.is_dir() {
        true => from_files(f, &at),
        false => Sys::read(&at),
    };
    match read {
        Ok(text) => return Ok((text, first)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(unreadable(first, &e)),
    }
    // One value per file: the processes are root's, in debugfs.
    let files = sys.path(COUNTERS.sysfs).is_dir();
    match fallback.map(|p| (p, Sys::read(&sys.path(p)))) {
        Some((p, Ok(text))) => Ok((text, p)),
        Some((p, Err(e))) if files && e.kind() != io::ErrorKind::NotFound => Err(unreadable(p, &e)),
        _ if files && f == &PROCESSES => Err(ROOTS_PROCESSES.into()),
        _ => Err(format!("no {first}: {}", f.missing)),
    }
}

/// Why an existing file could not be read.
fn unreadable(path: &str, e: &io::Error) -> String {
    match e.kind() {
        // Lockdown refuses only debugfs files that can be written.
        io::ErrorKind::PermissionDenied if path.starts_with(DEBUGFS) => {
            format!("{path}: permission denied (debugfs needs root)")
        }
        io::ErrorKind::PermissionDenied => format!("{path}: permission denied"),
        _ => format!("{path}: {e}"),
    }
}

pub(crate) fn read_peers(sys: &Sys) -> (Vec<Peer>, Option<String>) {
    let names = match sys.list(PEERS_DIR) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return (Vec::new(), None),
        Err(e) => return (Vec::new(), Some(e.to_string())),
    };
    let peers = names
        .into_iter()
        .filter(|(_, is_dir)| *is_dir)
        .map(|(name, _)| {
            let dir = format!("{PEERS_DIR}/{name}");
            let mut version = None;
            let mut counters = Vec::new();
            for (file, is_dir) in sys.list(&dir).unwrap_or_default() {
                if is_dir {
                    continue;
                }
                let abs = format!("{dir}/{file}");
                if file == "version" {
                    version = sys.text(&abs);
                } else if let Some(v) = sys.num(&abs) {
                    counters.push((file, v));
                }
            }
            Peer {
                name,
                version,
                counters,
            }
        })
        .collect();
    (peers, None)
}

/// The leading decimal numbers of a version string ("6.12.3-amd64" → [6, 12, 3]).
fn version_numbers(s: &str) -> Vec<u64> {
    s.split(|c: char| !c.is_ascii_digit())
        .take_while(|p| !p.is_empty())
        .map_while(|p| p.parse().ok())
        .collect()
}

pub(crate) fn read_dmabuf(sys: &Sys) -> DmaBuf {
    let rule = &detect::DMABUF;
    let nvidia_loaded = sys.path(rule.module).is_dir();
    let nvidia_version = sys.text(&format!("{}/version", rule.module));
    let kernel = sys.text(OSRELEASE);
    let driver_ok = match &nvidia_version {
        Some(Ok(v)) => version_numbers(v)
            .first()
            .map(|&major| major >= rule.min_driver_major),
        _ => None,
    };
    let kernel_ok = match &kernel {
        Some(Ok(k)) => match version_numbers(k)[..] {
            [major, minor, ..] => Some((major, minor) >= rule.min_kernel),
            _ => None,
        },
        _ => None,
    };
    DmaBuf {
        nvidia_loaded,
        nvidia_version,
        kernel,
        driver_ok,
        kernel_ok,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_lines() {
        let s = parse_stats("a 1\n\nb  22 \nc x\nd\ne 1 2\na 5\nf 18446744073709551615\n");
        let get = |n: &str| s.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        assert_eq!(s.len(), 6);
        assert_eq!(get("a"), Some(Ok(1)));
        assert_eq!(get("b"), Some(Ok(22)));
        assert!(get("c").unwrap().is_err());
        assert!(get("d").unwrap().is_err());
        assert!(get("e").unwrap().is_err());
        assert_eq!(get("f"), Some(Ok(u64::MAX)));
    }

    #[test]
    fn numbers() {
        assert_eq!(parse_u64(" 42\n"), Ok(42));
        assert!(parse_u64("-1").is_err());
        assert!(parse_u64("").is_err());
        assert!(parse_u64("18446744073709551616").is_err());
        assert_eq!(version_numbers("6.12.3-amd64"), [6, 12, 3]);
        assert_eq!(version_numbers("580.65.06"), [580, 65, 6]);
        assert!(version_numbers("x").is_empty());
    }
}
