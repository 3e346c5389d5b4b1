// SPDX-License-Identifier: GPL-2.0 OR MIT

//! peermem-stat: see `peermem-stat --help`.

#![forbid(unsafe_code)]

use std::io::IsTerminal;

fn main() {
    let stdout = std::io::stdout();
    let tty = stdout.is_terminal();
    let code = peermem_stat::run(
        std::env::args_os()
            .skip(1)
            .map(|a| a.to_string_lossy().into_owned()),
        &mut stdout.lock(),
        &mut std::io::stderr(),
        tty,
    );
    std::process::exit(code);
}
