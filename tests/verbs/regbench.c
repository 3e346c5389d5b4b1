// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * verbs-regbench: ibv_reg_mr/ibv_dereg_mr latency through libibverbs, as an
 * unmodified RDMA program pays it, for `make bench` (scripts/bench, setting
 * "verbs"). The buffer is emulated GPU memory (mmap of /dev/nv_p2p_emu at
 * offset 0: a new allocation on GPU 0, as perftest --mmap gets it) or host
 * memory (anonymous, touched first): the same calls on host memory are the
 * verbs path's own share (uverbs, the core's pin_user_pages_fast path, rxe's
 * MR), which both peer clients pay on top of it.
 *
 * usage: verbs-regbench <device> gpu|host <bytes> <iterations> <impl> <cost> <size-name>
 * Prints `BENCH {...}` lines (scripts/bench-report): the median of the
 * iterations of each call, in microseconds (CLOCK_MONOTONIC around the call),
 * metrics verbs_register_us and verbs_deregister_us, key <gpu|host>/<size>.
 * Exits non-zero (and prints BENCH-FAIL) when a call fails.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

static double now_us(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, n, sizeof(*v), cmp);
	return v[n / 2];
}

int main(int argc, char **argv)
{
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	struct ibv_pd *pd;
	const char *dev, *kind, *impl, *cost, *name;
	size_t bytes;
	int iters, n, i, fd = -1;
	double *reg, *dereg;
	void *buf;
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

	if (argc != 8) {
		fprintf(stderr, "usage: %s <device> gpu|host <bytes> <iterations> <impl> <cost> <size-name>\n", argv[0]);
		return 2;
	}
	dev = argv[1], kind = argv[2], bytes = strtoull(argv[3], NULL, 0), iters = atoi(argv[4]);
	impl = argv[5], cost = argv[6], name = argv[7];
	if (iters < 1)
		iters = 1;
	list = ibv_get_device_list(&n);
	for (i = 0; list && i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), dev))
			ctx = ibv_open_device(list[i]);
	if (!ctx) {
		printf("BENCH-FAIL verbs-regbench: no device %s\n", dev);
		return 1;
	}
	pd = ibv_alloc_pd(ctx);
	if (!pd) {
		printf("BENCH-FAIL verbs-regbench: ibv_alloc_pd: %s\n", strerror(errno));
		return 1;
	}
	if (!strcmp(kind, "gpu")) {
		fd = open("/dev/nv_p2p_emu", O_RDWR);
		buf = fd < 0 ? MAP_FAILED : mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	} else {
		buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (buf != MAP_FAILED)
			memset(buf, 1, bytes);
	}
	if (buf == MAP_FAILED) {
		printf("BENCH-FAIL verbs-regbench: %s buffer of %zu bytes: %s\n", kind, bytes, strerror(errno));
		return 1;
	}
	reg = calloc(iters, sizeof(*reg));
	dereg = calloc(iters, sizeof(*dereg));
	/* One registration first, not timed (first-touch of the core's paths). */
	for (i = -1; i < iters; i++) {
		double t0 = now_us(), t1, t2;
		struct ibv_mr *mr = ibv_reg_mr(pd, buf, bytes, access);
		int err;

		t1 = now_us();
		if (!mr) {
			printf("BENCH-FAIL verbs-regbench: %s ibv_reg_mr of %zu bytes (%s): %s\n", impl, bytes, kind,
			       strerror(errno));
			return 1;
		}
		err = ibv_dereg_mr(mr);
		t2 = now_us();
		if (err) {
			printf("BENCH-FAIL verbs-regbench: %s ibv_dereg_mr: %s\n", impl, strerror(err));
			return 1;
		}
		if (i >= 0) {
			reg[i] = t1 - t0;
			dereg[i] = t2 - t1;
		}
	}
	printf("BENCH {\"impl\":\"%s\",\"cost\":\"%s\",\"metric\":\"verbs_register_us\",\"key\":\"%s/%s\",\"value\":%.1f}\n",
	       impl, cost, kind, name, median(reg, iters));
	printf("BENCH {\"impl\":\"%s\",\"cost\":\"%s\",\"metric\":\"verbs_deregister_us\",\"key\":\"%s/%s\",\"value\":%.1f}\n",
	       impl, cost, kind, name, median(dereg, iters));
	munmap(buf, bytes);
	if (fd >= 0)
		close(fd);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}
