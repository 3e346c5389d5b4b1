// SPDX-License-Identifier: GPL-2.0 OR MIT

//! One frame: everything the files under a root prefix show, read by
//! `sysfs` (the files) and `diag` (the module's path diagnostics).

use crate::{
    detect::{self, RULES},
    diag::Diag,
    sysfs::{
        locate, parse_stats, read_dmabuf, read_module, read_peers, read_view, Counters, Detection,
        DmaBuf, Field, Module, Peer, Sys, Views, COUNTERS, MODULE_DIR, OSRELEASE, PEERS_DIR,
    },
};

/// Everything one frame shows.
#[derive(Debug)]
pub struct Snapshot {
    pub module: Module,
    /// Where the module's operator files are, or why there are none.
    pub views: Views,
    /// The module's counters, or why they are not shown.
    pub stats: Result<Counters, String>,
    /// The file the counters were read from ([`COUNTERS`] in sysfs, or in
    /// debugfs for an older peermem-rs).
    pub stats_file: Option<&'static str>,
    /// "peermem-rs" (our sysfs or debugfs views present), "other" (module
    /// loaded, no views in sysfs nor in a readable debugfs: NVIDIA's C
    /// module), None (not loaded or cannot tell).
    pub implementation: Option<&'static str>,
    pub peers: Vec<Peer>,
    /// memory_peers exists but could not be listed.
    pub peers_error: Option<String>,
    pub detection: Vec<Detection>,
    pub dmabuf: DmaBuf,
    /// The module's path diagnostics (paths, gpus, processes).
    pub diag: Diag,
}

impl Snapshot {
    pub fn read(sys: &Sys) -> Self {
        let mut module = read_module(sys);
        let (views, implementation) = locate(sys, &module);
        let counters = read_view(sys, &views, &COUNTERS);
        let stats_file = counters.as_ref().ok().map(|(_, file)| *file);
        let mut stats = counters.map(|(text, _)| parse_stats(&text));
        // Rust module parameters do not appear in /sys/module/*/parameters
        // (Linux 7.3); the module reports them as `param_<name>` lines.
        if let Ok(counters) = stats.as_mut() {
            counters.retain(|(name, value)| {
                let Some(param) = name.strip_prefix("param_") else {
                    return true;
                };
                if !module.parameters.iter().any(|(n, _)| n == param) {
                    let v = value.clone().map(|v| v.to_string());
                    module.parameters.push((param.to_string(), v));
                }
                false
            });
            module.parameters.sort_by(|a, b| a.0.cmp(&b.0));
        }
        let diag = Diag::read(sys, &views);
        let (peers, peers_error) = read_peers(sys);
        let detection = detect::stacks()
            .into_iter()
            .map(|stack| Detection {
                stack,
                matched: RULES
                    .iter()
                    .find(|r| r.stack == stack && sys.exists(r.path)),
            })
            .collect();
        Self {
            module,
            views,
            stats,
            stats_file,
            implementation,
            peers,
            peers_error,
            detection,
            dmabuf: read_dmabuf(sys),
            diag,
        }
    }

    /// Whether anything at all was found.
    pub fn found(&self) -> bool {
        self.module.loaded || !self.peers.is_empty()
    }

    /// One of the module's counters, if shown and valid.
    pub fn stat(&self, name: &str) -> Option<u64> {
        let stats = self.stats.as_ref().ok()?;
        stats
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_ref().ok().copied())
    }

    /// Every field that could not be read, as "where: why".
    pub fn errors(&self) -> Vec<String> {
        fn add<T>(out: &mut Vec<String>, at: String, f: &Option<Field<T>>) {
            if let Some(Err(e)) = f {
                out.push(format!("{at}: {e}"));
            }
        }
        let mut out = Vec::new();
        let m = &self.module;
        add(&mut out, format!("{MODULE_DIR}/version"), &m.version);
        add(&mut out, format!("{MODULE_DIR}/refcnt"), &m.refcnt);
        for (n, v) in &m.parameters {
            add(
                &mut out,
                format!("{MODULE_DIR}/parameters/{n}"),
                &Some(v.clone()),
            );
        }
        if let Ok(stats) = &self.stats {
            let file = self.stats_file.unwrap_or(COUNTERS.sysfs);
            for (n, v) in stats {
                if let Err(e) = v {
                    out.push(format!("{file}: {n}: {e}"));
                }
            }
        }
        if let Some(e) = &self.peers_error {
            out.push(format!("{PEERS_DIR}: {e}"));
        }
        for p in &self.peers {
            add(
                &mut out,
                format!("{PEERS_DIR}/{}/version", p.name),
                &p.version,
            );
            for (n, v) in &p.counters {
                if let Err(e) = v {
                    out.push(format!("{PEERS_DIR}/{}/{n}: {e}", p.name));
                }
            }
        }
        add(
            &mut out,
            format!("{}/version", detect::DMABUF.module),
            &self.dmabuf.nvidia_version,
        );
        add(&mut out, OSRELEASE.to_string(), &self.dmabuf.kernel);
        out.extend(self.diag.errors());
        out
    }
}
