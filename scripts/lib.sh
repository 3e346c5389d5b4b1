# SPDX-License-Identifier: GPL-2.0 OR MIT
# Shared shell helpers for the peermem-rs scripts. Source it, do not run it.

TOP=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${PEERMEM_CACHE:-$HOME/.cache/peermem-rs}

die() { echo "error: $*" >&2; exit 1; }
say() { echo "==> $*" >&2; }

# The supported kernel series are data: scripts/kernel-series. PEERMEM_SERIES
# selects one (default: the main series, the first line); everything below
# follows from it.
all_series() { awk '!/^#/ && NF >= 3 {print $1}' "$TOP/scripts/kernel-series"; }
MAIN_SERIES=$(all_series | head -n1)
PEERMEM_SERIES=${PEERMEM_SERIES:-$MAIN_SERIES}
read -r KERNEL_SERIES ROOT_SUITE KERNEL_SUITE < <(
	awk -v s="$PEERMEM_SERIES" '!/^#/ && $1 == s {print $1, $2, $3}' "$TOP/scripts/kernel-series") ||
	die "kernel series '$PEERMEM_SERIES' is not listed in scripts/kernel-series ($(all_series | tr '\n' ' '))"
export PEERMEM_SERIES
ROOT=$CACHE/root-$ROOT_SUITE
# The main series keeps the cache's work folder; others have one inside it.
series_work() { if [ "$1" = "$MAIN_SERIES" ]; then echo "$CACHE/work"; else echo "$CACHE/work/series-$1"; fi; }
# The flavours of each series are data too: scripts/kernel-flavours.
# PEERMEM_FLAVOUR selects one of the series (default: its first, the main
# flavour, which keeps the series' work folder; another has its own inside).
# It is not exported: a command for another flavour is given it explicitly.
series_flavours() { awk -v s="$1" '!/^#/ && NF >= 3 && $1 == s {print $3}' "$TOP/scripts/kernel-flavours"; }
# series/flavour of every flavour that is not its series' main one.
extra_flavours() {
	local s f
	for s in $(all_series); do
		for f in $(series_flavours "$s" | tail -n +2); do echo "$s/$f"; done
	done
}
MAIN_FLAVOUR=$(series_flavours "$KERNEL_SERIES" | head -n1)
[ -n "$MAIN_FLAVOUR" ] || die "kernel series $KERNEL_SERIES has no line in scripts/kernel-flavours"
PEERMEM_FLAVOUR=${PEERMEM_FLAVOUR:-$MAIN_FLAVOUR}
# shellcheck disable=SC2034 # DEB_ARCH: read by the scripts that source this
read -r FLAVOUR DEB_ARCH < <(awk -v s="$KERNEL_SERIES" -v f="$PEERMEM_FLAVOUR" \
	'!/^#/ && NF >= 3 && $1 == s && $3 == f {print $3, $2}' "$TOP/scripts/kernel-flavours") ||
	die "flavour '$PEERMEM_FLAVOUR' of series $KERNEL_SERIES is not listed in scripts/kernel-flavours ($(series_flavours "$KERNEL_SERIES" | tr '\n' ' '))"
# The first arm64 flavour (series/flavour): its series' source and build root
# make the 64 KiB-page arm64 tree of make soak (scripts/build-kernel
# arm64-64k), booted as that flavour's architecture (scripts/flavour-boot).
arm64_flavour() { awk '!/^#/ && NF >= 3 && $2 == "arm64" {print $1 "/" $3; exit}' "$TOP/scripts/kernel-flavours"; }
flavour_arch() { awk -v s="$1" -v f="$2" '!/^#/ && NF >= 3 && $1 == s && $3 == f {print $2}' "$TOP/scripts/kernel-flavours"; }
# The flavour's work folder; SERIES_WORK is its series' (the main flavour's).
flavour_work() { # series flavour
	if [ "$2" = "$(series_flavours "$1" | head -n1)" ]; then series_work "$1"; else echo "$(series_work "$1")/flavour-$2"; fi
}
SERIES_WORK=$(series_work "$KERNEL_SERIES")
WORK=$(flavour_work "$KERNEL_SERIES" "$FLAVOUR")
# What an output folder or log of this flavour is suffixed with: nothing for
# the main series' main flavour, -<series> for another series' main flavour,
# -<series>-<flavour> for any other flavour.
flavour_suffix() { # series flavour
	local sfx=
	[ "$1" = "$MAIN_SERIES" ] || sfx=-$1
	[ "$2" = "$(series_flavours "$1" | head -n1)" ] || sfx=-$1-$2
	echo "$sfx"
}

# Start scripts/flavour-boot for every flavour of another architecture than the
# host's, one after the other, in the background: their boots (mostly guest
# sleeps under TCG, not CPU) overlap the rest of make test, which waits for
# them (wait_boot) before counting. The -running marker is made here,
# before the start, and removed by flavour-boot when its results are written.
start_flavour_boots() {
	local sf list=()
	for sf in $(extra_flavours); do
		[ "$(flavour_arch "${sf%/*}" "${sf#*/}")" != "$(dpkg --print-architecture)" ] || continue
		mkdir -p "$TOP/build/test-logs"
		echo "$$" >"$TOP/build/test-logs/flavour-${sf%/*}-${sf#*/}-running"
		list+=("$sf")
	done
	[ ${#list[@]} -gt 0 ] || return 0
	(
		for sf in "${list[@]}"; do
			PEERMEM_SERIES=${sf%/*} PEERMEM_FLAVOUR=${sf#*/} "$TOP/scripts/flavour-boot"
		done
	) </dev/null >"$TOP/build/test-logs/flavour-boots.log" 2>&1 &
}
# make test's builds outside the main build root (scripts/series-build, each
# in its series' root): the flavours of another architecture first, their
# boots started as soon as they are built (start_flavour_boots: they overlap
# the rest of make test), then the other series and the host's flavours.
build_other_flavours() {
	local s sf host
	host=$(dpkg --print-architecture)
	for sf in $(extra_flavours); do
		[ "$(flavour_arch "${sf%/*}" "${sf#*/}")" != "$host" ] || continue
		PEERMEM_SERIES=${sf%/*} PEERMEM_FLAVOUR=${sf#*/} "$TOP/scripts/series-build" || return 1
	done
	start_flavour_boots
	for s in $(all_series | tail -n +2); do
		PEERMEM_SERIES=$s "$TOP/scripts/series-build" || return 1
	done
	for sf in $(extra_flavours); do
		[ "$(flavour_arch "${sf%/*}" "${sf#*/}")" = "$host" ] || continue
		PEERMEM_SERIES=${sf%/*} PEERMEM_FLAVOUR=${sf#*/} "$TOP/scripts/series-build" || return 1
	done
}
# make soak: the 64 KiB-page arm64 tree built (scripts/build-kernel
# arm64-64k) and booted (scripts/flavour-boot --kernel arm64-64k) in the
# background in the same way.
start_soak64k_boot() {
	local sf
	"$TOP/scripts/build-kernel" arm64-64k || return 1
	sf=$(arm64_flavour)
	mkdir -p "$TOP/build/test-logs"
	echo "$$" >"$TOP/build/test-logs/soak-arm64-64k-running"
	PEERMEM_SERIES=${sf%/*} PEERMEM_FLAVOUR=${sf#*/} "$TOP/scripts/flavour-boot" --kernel arm64-64k \
		</dev/null >"$TOP/build/test-logs/soak-arm64-64k-boot.log" 2>&1 &
}
# Wait (at most $2 s) for a boot started by start_flavour_boots
# (flavour-<series>-<flavour>) or start_soak64k_boot (soak-arm64-64k).
wait_boot() { # log-prefix seconds
	local i=0
	while [ -e "$TOP/build/test-logs/$1-running" ] && [ "$i" -lt "$2" ]; do
		sleep 5
		i=$((i + 5))
	done
	[ ! -e "$TOP/build/test-logs/$1-running" ]
}

# The kbuild arguments that cross-build for a tree (its .config) of another
# architecture than this machine's, with Debian's cross toolchain; nothing for
# a native tree (the Makefile does the same for the module and the harness).
kbuild_cross() { # config
	local karch host
	karch=$(sed -n 's/^CONFIG_ARM64=y$/arm64/p; s/^CONFIG_X86_64=y$/x86/p' "$1")
	case $(uname -m) in x86_64) host=x86 ;; aarch64) host=arm64 ;; *) host=$(uname -m) ;; esac
	[ -n "$karch" ] && [ "$karch" != "$host" ] || return 0
	case $karch in
	arm64) echo ARCH=arm64 CROSS_COMPILE=aarch64-linux-gnu- CROSS_COMPILE_COMPAT=arm-linux-gnueabihf- ;;
	x86) echo ARCH=x86 CROSS_COMPILE=x86_64-linux-gnu- ;;
	esac
}

# The end-to-end plan of a boot (run by the guest's init): the harness, the
# GPU driver's DMA mapping style, every scenario in the four modes.
MODES=persistent,invalidating,legacy,ofed4
plan() { # file dma-map-style extra-e2e-args
	cat >"$1" <<-SH
	insmod /lib/peermem/nv_p2p_emu.ko
	insmod /lib/peermem/peer_mem_core.ko
	echo $2 > /sys/kernel/debug/nv_p2p_emu/dma_map_style
	/bin/peermem-e2e --modes $MODES $3
	rmmod peer_mem_core
	rmmod nv_p2p_emu
	if [ -e /sys/kernel/debug/kmemleak ]; then
	  echo scan > /sys/kernel/debug/kmemleak; sleep 6; echo scan > /sys/kernel/debug/kmemleak
	  cat /sys/kernel/debug/kmemleak
	  echo "kmemleak: scan done"
	fi
	SH
}

# A run of a client that may deadlock or corrupt memory on the faithful
# testbed (the C reference): in the background, so that a deadlocked kernel
# thread cannot keep the plan from reporting.
bg_e2e() { # e2e-args
	cat <<-SH
	/bin/peermem-e2e $1 >/tmp/e2e.out 2>&1 &
	i=0; while [ \$i -lt 240 ]; do grep -q E2E-SUMMARY /tmp/e2e.out && break; sleep 1; i=\$((i+1)); done
	cat /tmp/e2e.out
	SH
}

# What the checkout holds now (commit and uncommitted changes): results made
# in another build root are only counted for the source they were made from.
source_stamp() { (cd "$TOP" && { git rev-parse HEAD; git status --porcelain; git diff; } 2>/dev/null | md5sum | cut -c1-16); }

# Elapsed-time stamp for stage reports.
stage_start() { STAGE_T0=$(date +%s); say "$1"; }
stage_end() { say "$1 done in $(( $(date +%s) - STAGE_T0 )) s"; }

# Run a command inside the build root. The checkout and the series' work folder
# (which holds its flavours') appear at the same paths inside, in a private mount namespace that vanishes
# with the command, so nothing stays mounted.
in_root() {
	[ -f "$ROOT/.peermem-ready" ] || die "the build root is missing or half-made; run scripts/setup"
	mkdir -p "$WORK"
	# The documented knobs (PEERMEM_BENCH_*, PEERMEM_STRESS_OPS, ...) reach
	# the command; nothing else of the host's environment does.
	local knobs=()
	while IFS= read -r kv; do knobs+=("$kv"); done < <(env | grep -E '^PEERMEM_(BENCH|STRESS|KCSAN|FUZZ)_[A-Z_]*=' || true)
	unshare -m --propagation private bash -c '
		set -e
		r=$1 top=$2 work=$3 cwd=$4 cache=$5 series=$6 flavour=$7 fwork=$8
		shift 8
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
			PEERMEM_IN_ROOT=1 PEERMEM_CACHE="$cache" PEERMEM_SERIES="$series" PEERMEM_FLAVOUR="$flavour" \
			PEERMEM_WORK="$fwork" \
			bash -c "cd \"\$0\" && exec \"\$@\"" "$cwd" "$@"
	' in_root "$ROOT" "$TOP" "$SERIES_WORK" "$PWD" "$CACHE" "$KERNEL_SERIES" "$FLAVOUR" "$WORK" /usr/bin/env "${knobs[@]}" "$@"
}
