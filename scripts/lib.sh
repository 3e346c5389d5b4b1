# SPDX-License-Identifier: GPL-2.0 OR MIT
# Shared shell helpers for the peermem-rs scripts. Source it, do not run it.

# The one place that names the kernel series. Moving to the next series is this
# line plus whatever code the new series needs.
KERNEL_SERIES=7.3

# The Debian suite of the build root (its kernel comes from <suite>-backports).
ROOT_SUITE=trixie

TOP=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${PEERMEM_CACHE:-$HOME/.cache/peermem-rs}
ROOT=$CACHE/root-$ROOT_SUITE
WORK=$CACHE/work

die() { echo "error: $*" >&2; exit 1; }
say() { echo "==> $*" >&2; }

# Elapsed-time stamp for stage reports.
stage_start() { STAGE_T0=$(date +%s); say "$1"; }
stage_end() { say "$1 done in $(( $(date +%s) - STAGE_T0 )) s"; }

# Run a command inside the build root. The checkout and the cache's work folder
# appear at the same paths inside, in a private mount namespace that vanishes
# with the command, so nothing stays mounted.
in_root() {
	[ -f "$ROOT/.peermem-ready" ] || die "the build root is missing or half-made; run scripts/setup"
	mkdir -p "$WORK"
	unshare -m --propagation private bash -c '
		set -e
		r=$1 top=$2 work=$3 cwd=$4 cache=$5
		shift 5
		mount -t proc proc "$r/proc"
		mount --rbind /dev "$r/dev"
		mkdir -p "$r$top" "$r$work"
		mount --bind "$top" "$r$top"
		mount --bind "$work" "$r$work"
		# Trust what the host trusts (a proxy or corporate CA for the registries).
		ca=/etc/ssl/certs/ca-certificates.crt
		if [ -f "$ca" ] && [ -f "$r$ca" ]; then mount --bind -o ro "$ca" "$r$ca"; fi
		case "$cwd" in "$top"*|"$work"*) ;; *) cwd=$top ;; esac
		exec chroot "$r" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
			PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
			PEERMEM_IN_ROOT=1 PEERMEM_CACHE="$cache" \
			bash -c "cd \"\$0\" && exec \"\$@\"" "$cwd" "$@"
	' in_root "$ROOT" "$TOP" "$WORK" "$PWD" "$CACHE" "$@"
}
