# SPDX-License-Identifier: GPL-2.0 OR MIT
#
# peermem-rs top-level Makefile.
#
#   make                 build every module (product + harness) for KDIR
#   make KDIR=<tree>     the same for any prepared 7.3 tree with Rust metadata
#   make test            everything: host tests, KUnit, end-to-end on both kernels
#   make demo            the stock Debian kernel in QEMU, doing the module's job
#   make bench           ours against NVIDIA's C module, one boot (not a test)
#   make profile         their own instructions, function by function (not a test)
#   make soak            the stress workload, 1,000,000 operations; KCSAN; the
#                        scenarios on a 64 KiB-page arm64 kernel
#   make deb             Debian packages nvidia-peermem-rs-dkms and peermem-stat
#                        in build/deb/
#   make clean | rust-analyzer | CLIPPY=1
#
# On a developer machine everything runs inside the build root that
# scripts/setup makes (first use sets it up). On a real node, pass
# PEERMEM_SYMVERS (OFED's or Ubuntu's Module.symvers and nvidia's) or
# PEERMEM_NATIVE=1 to build with the host's own toolchain.

TOP := $(abspath $(dir $(lastword $(MAKEFILE_LIST))))
PEERMEM_CACHE ?= $(HOME)/.cache/peermem-rs
export PEERMEM_CACHE
# The series' work folder (scripts/lib.sh passes it into the build root).
WORK := $(or $(PEERMEM_WORK),$(PEERMEM_CACHE)/work)

HOST_GOALS := all modules modules-all clean rust-analyzer fmt fmt-check test demo soak bench profile cargo-test e2e-bin deb
.DEFAULT_GOAL := all

ifeq ($(PEERMEM_IN_ROOT)$(PEERMEM_NATIVE)$(PEERMEM_SYMVERS)$(PEERMEM_PRODUCT_ONLY),)
# --- on the host: set up what is missing, then run the same goals in the root
FULL_SETUP := $(filter test soak,$(or $(MAKECMDGOALS),all))
.PHONY: $(or $(MAKECMDGOALS),all) peermem-delegate
$(or $(MAKECMDGOALS),all): peermem-delegate ; @:
peermem-delegate:
	@$(TOP)/scripts/setup $(if $(FULL_SETUP),,--no-debug)
	$(if $(filter test,$(MAKECMDGOALS)),@bash -c '. $(TOP)/scripts/lib.sh && build_other_flavours')
	$(if $(filter soak,$(MAKECMDGOALS)),@bash -c '. $(TOP)/scripts/lib.sh && start_soak64k_boot')
	$(if $(filter soak,$(MAKECMDGOALS)),@$(TOP)/scripts/build-kernel kcsan)
	@$(TOP)/scripts/in-root $(MAKE) --no-print-directory -C $(TOP) $(or $(MAKECMDGOALS),all) $(MAKEOVERRIDES)
else
# --- inside the build root (or natively on a real node) ------------------------
-include $(WORK)/versions.mk

KDIR ?= $(WORK)/distro
NVIDIA_SRC ?= $(NVIDIA_SRC_DEFAULT)
OUT ?= $(TOP)/build/$(notdir $(KDIR))
KCLANG := $(shell grep -qx 'CONFIG_CC_IS_CLANG=y' $(KDIR)/.config 2>/dev/null && echo LLVM=1)
# The tree's architecture, from its config; one other than the host's is
# cross-built with Debian's cross toolchain (arm64's prepare also builds the
# 32-bit compat vDSO: CROSS_COMPILE_COMPAT). ARCH/CROSS_COMPILE given on the
# command line win.
KARCH := $(shell sed -n 's/^CONFIG_ARM64=y$$/arm64/p; s/^CONFIG_X86_64=y$$/x86/p' $(KDIR)/.config 2>/dev/null)
HOST_KARCH := $(shell uname -m | sed 's/^x86_64$$/x86/; s/^aarch64$$/arm64/')
KCROSS := $(if $(filter-out $(HOST_KARCH),$(KARCH)),ARCH=$(KARCH) \
	$(if $(filter arm64,$(KARCH)),CROSS_COMPILE=aarch64-linux-gnu- CROSS_COMPILE_COMPAT=arm-linux-gnueabihf-,CROSS_COMPILE=x86_64-linux-gnu-))
KMAKE = $(MAKE) -C $(KDIR) M=$(TOP) MO=$(OUT) NVIDIA_SRC=$(NVIDIA_SRC) $(KCLANG) $(KCROSS) \
	$(if $(PEERMEM_SYMVERS)$(PEERMEM_PRODUCT_ONLY),PEERMEM_PRODUCT_ONLY=1)

.PHONY: all modules modules-all clean rust-analyzer fmt fmt-check test demo soak bench profile cargo-test e2e-bin deb check-kdir

all modules: check-kdir
	@mkdir -p $(OUT)
	$(KMAKE) -j$(shell nproc) modules

modules-all:
	$(MAKE) KDIR=$(WORK)/distro modules
	$(MAKE) KDIR=$(WORK)/debug modules

check-kdir:
	@test -f $(KDIR)/rust/libkernel.rmeta || test -f $(KDIR)/rust/kernel.o || \
		{ echo "error: $(KDIR) is not a prepared kernel tree with Rust metadata (scripts/prepare-kdir or scripts/setup make one)" >&2; exit 1; }
	@test -n "$(NVIDIA_SRC)" && test -f $(NVIDIA_SRC)/nv-p2p.h || \
		{ echo "error: NVIDIA_SRC ($(NVIDIA_SRC)) must hold nv-p2p.h and peer_mem.h" >&2; exit 1; }

# A real node's build (PEERMEM_PRODUCT_ONLY=1, or PEERMEM_SYMVERS from
# older configurations, now unused) needs no other module's Module.symvers:
# the module links none of the core's or the GPU driver's symbols (late
# binding, docs/design.md).

clean:
	rm -rf $(TOP)/build $(TOP)/target $(TOP)/rust-project.json

rust-analyzer: check-kdir
	@mkdir -p $(OUT)
	$(KMAKE) rust-analyzer
	@test -f $(OUT)/rust-project.json && cp $(OUT)/rust-project.json $(TOP)/ || true

fmt:
	rustfmt --edition 2021 --config-path $(KDIR)/.rustfmt.toml $(TOP)/src/peermem.rs

fmt-check:
	rustfmt --check --edition 2021 --config-path $(KDIR)/.rustfmt.toml $(TOP)/src/peermem.rs

cargo-test:
	cd $(TOP) && cargo test --locked --workspace

test:
	$(TOP)/scripts/run-tests

demo:
	$(TOP)/scripts/demo

bench:
	$(TOP)/scripts/bench

profile:
	$(TOP)/scripts/profile

soak:
	PEERMEM_STRESS_OPS=1000000 $(TOP)/scripts/run-tests --soak

deb:
	$(TOP)/scripts/build-deb
endif
