# SPDX-License-Identifier: GPL-2.0 OR MIT
#
# The verbs boot (run as init's plan by scripts/qemu-run): Debian's
# unmodified perftest and ibverbs-utils over rdma_rxe, with our peer-aware
# ib_core/ib_uverbs (tests/verbs, scripts/build-verbs) in place of Debian's,
# the emulated GPU driver and nvidia_peermem. Every buffer is emulated GPU
# memory, got by `--mmap=/dev/nv_p2p_emu` (allocated on mmap). Prints
# `E2E ok|FAIL verbs/...` lines and one E2E-SUMMARY for qemu-run.
#
# Environment (set by the caller's first lines): MODES (e.g. "persistent
# invalidating"), REFERENCE (path of NVIDIA's C module, or empty).
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu
D=/sys/kernel/debug/nv_p2p_emu
P=/sys/module/ib_uverbs/parameters
R=/sys/module/rdma_rxe/parameters
RES=/tmp/verbs.results
: >$RES
ok() { echo "E2E ok verbs/$*" | tee -a $RES; }
fail() { echo "E2E FAIL verbs/$*" | tee -a $RES; }
info() { echo "VERBS $*"; }
# A counter's growth since a snapshot: cnt <file>; since <file> <old>
cnt() { cat "$1" 2>/dev/null || echo 0; }
# The md5 of <len> bytes of GPU <gpu>'s memory at <offset> (64 KiB units).
gpu_md5() { dd if=$D/gpu$1_mem bs=65536 skip=$(($2 / 65536)) count=$(($3 / 65536)) 2>/dev/null | md5sum | cut -d' ' -f1; }
# The last <n>th mmap allocation's field <name> (pid, gpu, bar_offset, size).
alloc_field() { tail -n "$1" $D/mmap_allocs | head -n1 | awk -v k="$2" '{for (i = 1; i < NF; i++) if ($i == k) print $(i + 1)}'; }
nallocs() { wc -l <$D/mmap_allocs; }

# The payload a writer's buffer holds (perftest --payload_file_path): bytes
# 0x00..0x0f over and over, little-endian words; never what rand() fills.
echo '0x03020100,0x07060504,0x0b0a0908,0x0f0e0d0c' >/tmp/payload.txt
printf '\000\001\002\003\004\005\006\007\010\011\012\013\014\015\016\017' >/tmp/p16
for i in 1 2 3 4 5 6 7 8 9 10 11 12; do cat /tmp/p16 /tmp/p16 >/tmp/p32; mv /tmp/p32 /tmp/p16; done
PAT=$(md5sum </tmp/p16 | cut -d' ' -f1)	# of 64 KiB of the payload

EDU=$(for d in /sys/bus/pci/devices/*; do
	[ "$(cat "$d/vendor"):$(cat "$d/device")" = "0x1234:0x11e8" ] && basename "$d"; done | head -n1)
# A tree without the UDP tunnel code (the debug tree) has it as modules
# from scripts/build-verbs; the stock kernel's own are loaded by init.
for m in udp_tunnel ip6_udp_tunnel; do
	[ ! -f /lib/verbs/$m.ko ] || insmod /lib/verbs/$m.ko || fail "load/$m: insmod failed"
done
for m in ib_core ib_uverbs_support ib_uverbs; do
	insmod /lib/verbs/$m.ko || fail "load/$m: insmod failed"
done
insmod /lib/verbs/rdma_rxe.ko peer_dma_device="$EDU" || fail "load/rdma_rxe: insmod failed"
insmod /lib/peermem/nv_p2p_emu.ko
ip link set lo up
if rdma link add rxe0 type rxe netdev lo && ibv_devices | grep -q rxe0; then
	ok "setup: rxe0 on lo, DMA identity $EDU: $(rdma link | head -n1)"
else
	fail "setup: no rxe0"
fi
cd /tmp || exit 1

# bw <tool> <server-args> -- <client-args>: a server and a client on rxe0,
# each buffer an mmap of /dev/nv_p2p_emu; SRV_RC, CLI_RC, /tmp/srv.out,
# /tmp/cli.out; SRV_OFF, CLI_OFF: their buffers' GPU 0 offsets; SIZE.
bw() {
	tool=$1
	shift
	sargs=
	while [ "$1" != -- ]; do sargs="$sargs $1"; shift; done
	shift
	n0=$(nallocs)
	# shellcheck disable=SC2086
	timeout 120 $tool -d rxe0 --mmap=/dev/nv_p2p_emu -F $sargs >/tmp/srv.out 2>&1 &
	spid=$!
	i=0
	# Listening on perftest's port 18515 (0x4853): its output is buffered.
	while ! grep -q ':4853 00000000:0000 0A' /proc/net/tcp /proc/net/tcp6 && [ $i -lt 100 ]; do
		sleep 0.2
		i=$((i + 1))
	done
	# shellcheck disable=SC2086
	timeout 120 $tool -d rxe0 --mmap=/dev/nv_p2p_emu -F "$@" 127.0.0.1 >/tmp/cli.out 2>&1
	CLI_RC=$?
	wait $spid
	SRV_RC=$?
	SRV_OFF= CLI_OFF= SIZE=
	if [ "$(nallocs)" -ge $((n0 + 2)) ]; then
		# The server mmaps first (after the client connects, before it does).
		SRV_OFF=$(alloc_field 2 bar_offset) CLI_OFF=$(alloc_field 1 bar_offset) SIZE=$(alloc_field 1 size)
	fi
}
# The result line of a bw run: "#bytes #iterations peak average msgrate".
bwline() { grep -E '^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+' "$1" | head -n1 | tr -s ' \t' ' '; }
show() { # perftest's own lines, for the log
	sed -n '/#bytes/,$p' "$1" | sed "s/^/VERBS $2| /"
}

# check_bytes <label> <half>: of the run's two buffers, the writer's holds the
# payload throughout (perftest --payload_file_path), the other's <half> (0:
# first 64 KiB, 1: second; perftest's rdma address is buf + size for writes
# and its local buffer for reads) must be the payload, read back from GPU
# memory by the CPU, and its other half perftest's own rand() fill.
check_bytes() {
	a0=$(gpu_md5 0 "$SRV_OFF" 65536) a1=$(gpu_md5 0 $((SRV_OFF + 65536)) 65536)
	b0=$(gpu_md5 0 "$CLI_OFF" 65536) b1=$(gpu_md5 0 $((CLI_OFF + 65536)) 65536)
	info "$1 bytes: GPU0+$SRV_OFF $a0 $a1, GPU0+$CLI_OFF $b0 $b1, payload $PAT"
	if [ "$a0 $a1" = "$PAT $PAT" ]; then t0=$b0 t1=$b1 toff=$CLI_OFF; else t0=$a0 t1=$a1 toff=$SRV_OFF; fi
	if [ "$2" = 0 ]; then got=$t0 other=$t1; else got=$t1 other=$t0; fi
	if [ -z "$SRV_OFF" ] || { [ "$a0 $a1" != "$PAT $PAT" ] && [ "$b0 $b1" != "$PAT $PAT" ]; }; then
		fail "$1/bytes: no buffer holds the payload (allocations: $(tail -n 2 $D/mmap_allocs | tr '\n' ';'))"
	elif [ "$got" = "$PAT" ] && [ "$other" != "$PAT" ]; then
		ok "$1/bytes: the target's GPU memory (GPU 0 + $((toff + $2 * 65536))) holds the 64 KiB payload (md5 $got), the rest of it perftest's fill ($other)"
	else
		fail "$1/bytes: target GPU 0 + $toff: half $2 md5 $got, other $other, payload $PAT"
	fi
}

# Until <file>'s value reaches <n> (10 s at most).
wait_for() {
	i=0
	while [ "$(cnt "$1")" -lt "$2" ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i + 1)); done
	[ "$(cnt "$1")" -ge "$2" ]
}

# bw_bg <tool> <args>: a server and a client started in the background
# (SPID, CPID: their timeout wrappers); returns once both registered.
bw_bg() {
	tool=$1
	shift
	n0=$(nallocs) mr0=$(cnt $R/peer_mrs)
	# shellcheck disable=SC2086
	timeout 120 $tool -d rxe0 --mmap=/dev/nv_p2p_emu -F "$@" >/tmp/srv.out 2>&1 &
	SPID=$!
	i=0
	while ! grep -q ':4853 00000000:0000 0A' /proc/net/tcp /proc/net/tcp6 && [ $i -lt 100 ]; do
		sleep 0.2
		i=$((i + 1))
	done
	# shellcheck disable=SC2086
	timeout 120 $tool -d rxe0 --mmap=/dev/nv_p2p_emu -F "$@" 127.0.0.1 >/tmp/cli.out 2>&1 &
	CPID=$!
	wait_for $R/peer_mrs $((mr0 + 2))
	SRV_OFF=$(alloc_field 2 bar_offset) FREE_PID=$(alloc_field 2 pid) OTHER_PID=$(alloc_field 1 pid)
}

run_mode() { # mode
	mode=$1
	case $mode in
	persistent) param=1 ;;
	invalidating) param=0 ;;
	esac
	insmod /lib/peermem/nvidia_peermem.ko persistent_api_support=$param || fail "$mode/load: insmod failed"

	# RDMA write, server's buffer the target: the client's payload lands
	# in the server's GPU memory.
	mr0=$(cnt $R/peer_mrs)
	bw ib_write_bw -n 100 -- -n 100 --payload_file_path=/tmp/payload.txt
	show /tmp/cli.out "$mode ib_write_bw client"
	line=$(bwline /tmp/cli.out)
	if [ $CLI_RC = 0 ] && [ $SRV_RC = 0 ] && [ -n "$line" ] && [ $(($(cnt $R/peer_mrs) - mr0)) = 2 ]; then
		ok "$mode/ib_write_bw: both exit 0, 2 MRs of GPU memory through rxe, result:$line"
	else
		fail "$mode/ib_write_bw: rc server $SRV_RC client $CLI_RC, MRs $(($(cnt $R/peer_mrs) - mr0)), result '$line'"
		tail -5 /tmp/srv.out /tmp/cli.out
	fi
	check_bytes "$mode/ib_write_bw" 1

	# RDMA read: the client reads the server's payload into its buffer.
	mr0=$(cnt $R/peer_mrs)
	bw ib_read_bw -n 100 --payload_file_path=/tmp/payload.txt -- -n 100
	show /tmp/cli.out "$mode ib_read_bw client"
	line=$(bwline /tmp/cli.out)
	if [ $CLI_RC = 0 ] && [ $SRV_RC = 0 ] && [ -n "$line" ] && [ $(($(cnt $R/peer_mrs) - mr0)) = 2 ]; then
		ok "$mode/ib_read_bw: both exit 0, 2 MRs of GPU memory through rxe, result:$line"
	else
		fail "$mode/ib_read_bw: rc server $SRV_RC client $CLI_RC, MRs $(($(cnt $R/peer_mrs) - mr0)), result '$line'"
		tail -5 /tmp/srv.out /tmp/cli.out
	fi
	check_bytes "$mode/ib_read_bw" 0

	# cudaFree of one buffer while ib_write_bw runs (the harness frees it
	# as its owner would). Invalidating: the free callback revokes the MR
	# through our core and rxe, the program gets an error completion.
	# Persistent: no callback, the memory stays pinned until the MR is
	# deregistered, and the run completes.
	rv0=$(cnt $R/peer_revoked) ref0=$(cnt $R/peer_refused) inv0=$(cnt $P/peer_invalidations)
	bw_bg ib_write_bw -D 8
	sleep 2
	echo "0 $SRV_OFF" >$D/cudafree
	# The free callbacks ran inside the write: what they revoked is known now
	# (the owners' exits revoke their own MRs afterwards: exit_mm comes
	# before the RDMA fd's release).
	rv_free=$(($(cnt $R/peer_revoked) - rv0)) inv_free=$(($(cnt $P/peer_invalidations) - inv0))
	freed=$(dmesg | grep 'cudaFree of GPU 0 offset' | tail -n1 | sed 's/.*: //')
	wait $CPID
	CLI_RC=$?
	wait $SPID
	SRV_RC=$?
	err=$(grep -hiE 'error|failed' /tmp/cli.out /tmp/srv.out | head -n2 | tr '\n\t' '  ')
	show /tmp/cli.out "$mode cudaFree client"
	grep -hiE 'error|failed' /tmp/srv.out | sed "s/^/VERBS $mode cudaFree server| /"
	rv=$(($(cnt $R/peer_revoked) - rv0)) inv=$(($(cnt $P/peer_invalidations) - inv0))
	if [ "$mode" = invalidating ]; then
		# One free callback (the freed buffer's MR); by the time the counters
		# are read the program that got the error may have exited too.
		if [ $rv_free -ge 1 ] && [ $inv_free -ge 1 ] && [ "$freed" = "1 free callback(s)" ] &&
			{ [ $CLI_RC != 0 ] || [ $SRV_RC != 0 ]; } && [ -n "$err" ]; then
			ok "$mode/cudafree_during_traffic: pid $FREE_PID's buffer freed ($freed), its MR revoked in the callback (rxe peer_revoked +$rv_free with the exits; $(($(cnt $R/peer_refused) - ref0)) accesses refused), rc server $SRV_RC client $CLI_RC: $err"
		else
			fail "$mode/cudafree_during_traffic: revoked at the free $rv_free, invalidations $inv_free, rc server $SRV_RC client $CLI_RC, '$err' ($freed)"
		fi
	else
		line=$(bwline /tmp/cli.out)
		if [ $rv = 0 ] && [ $inv = 0 ] && [ $CLI_RC = 0 ] && [ $SRV_RC = 0 ] && [ -n "$line" ] &&
			[ "$freed" = "0 free callback(s)" ]; then
			ok "$mode/cudafree_during_traffic: pid $FREE_PID's buffer freed ($freed), nothing revoked, both exit 0, result:$line"
		else
			fail "$mode/cudafree_during_traffic: revoked $rv, invalidations $inv, rc server $SRV_RC client $CLI_RC, '$line' ($freed)"
		fi
	fi

	# Both processes killed while their MRs are live: ib_uverbs tears the
	# MRs down, every peer umem goes, the module unloads.
	bw_bg ib_write_bw -D 30
	sleep 2
	kill -9 "$FREE_PID" "$OTHER_PID"
	wait $CPID
	wait $SPID
	i=0
	while [ "$(cnt $P/peer_umems)" != 0 ] && [ $i -lt 50 ]; do sleep 0.2; i=$((i + 1)); done
	if [ "$(cnt $P/peer_umems)" = 0 ] && rmmod nvidia_peermem; then
		ok "$mode/process_kill: pids $FREE_PID $OTHER_PID killed with live MRs, no peer umem left, nvidia_peermem unloads"
	else
		fail "$mode/process_kill: $(cnt $P/peer_umems) peer umems left"
		rmmod nvidia_peermem
	fi
}

# Without nvidia_peermem no client claims GPU memory: ibv_reg_mr fails with
# the pin's error, EFAULT, as on an OFED core.
u0=$(cnt $P/peer_unclaimed)
bw ib_write_bw -n 5 -- -n 5
if [ $SRV_RC != 0 ] && grep -q "Couldn't allocate MR" /tmp/srv.out /tmp/cli.out &&
	[ "$(cnt $P/peer_unclaimed)" -gt "$u0" ] && [ "$(cnt $P/peer_last_unclaimed_errno)" = -14 ]; then
	ok "no_module/ib_write_bw: registration refused, EFAULT ($(cnt $P/peer_last_unclaimed_errno)), perftest: $(grep -h "Couldn't allocate MR" /tmp/srv.out /tmp/cli.out | head -n1)"
else
	fail "no_module/ib_write_bw: rc $SRV_RC, unclaimed $(($(cnt $P/peer_unclaimed) - u0)), errno $(cnt $P/peer_last_unclaimed_errno)"
fi

for mode in $MODES; do run_mode "$mode"; done

# NVIDIA's C nvidia-peermem on the same stack (informational: its lines are
# VERBS-REFERENCE, not counted): one ib_write_bw pair on GPU memory, the
# bytes checked the same way.
if [ -n "${REFERENCE:-}" ]; then
	if insmod "$REFERENCE"; then
		mr0=$(cnt $R/peer_mrs)
		bw ib_write_bw -n 100 -- -n 100 --payload_file_path=/tmp/payload.txt
		sed -n '/#bytes/,$p' /tmp/cli.out | sed 's/^/VERBS-REFERENCE ib_write_bw client| /'
		echo "VERBS-REFERENCE ib_write_bw: rc server $SRV_RC client $CLI_RC, MRs $(($(cnt $R/peer_mrs) - mr0)), result:$(bwline /tmp/cli.out)"
		check_bytes reference/ib_write_bw 1 2>&1 | sed 's/^E2E \(ok\|FAIL\) verbs\//VERBS-REFERENCE \1 /'
		# check_bytes recorded its line in the counted results: take it out.
		grep -v 'verbs/reference/' $RES >$RES.tmp
		mv $RES.tmp $RES
		rmmod nvidia_peermem || echo "VERBS-REFERENCE rmmod failed"
	else
		echo "VERBS-REFERENCE insmod $REFERENCE failed"
	fi
fi

# The debug kernel: leaks reported by kmemleak fail the boot (qemu-run).
if [ -e /sys/kernel/debug/kmemleak ]; then
	echo scan >/sys/kernel/debug/kmemleak; sleep 6; echo scan >/sys/kernel/debug/kmemleak
	cat /sys/kernel/debug/kmemleak
	echo "kmemleak: scan done"
fi

p=$(grep -c '^E2E ok' $RES)
f=$(grep -c '^E2E FAIL' $RES)
echo "E2E-SUMMARY: $p passed, $f failed"
