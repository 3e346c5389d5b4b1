// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * peer_mem_core: an emulated RDMA peer-memory core for the peermem-rs testbed.
 *
 * Exports ib_register_peer_memory_client / ib_unregister_peer_memory_client
 * with the ABI of the real peer_mem.h. User space registers through
 * /dev/peer_mem_core ("ibv_reg_mr"); the "HCA" is QEMU's edu device: it is the
 * dma_device handed to clients, and its DMA engine moves bytes through the DMA
 * addresses of an MR, refusing once the MR was invalidated or deregistered.
 *
 * Real behaviour modelled, and where it comes from (MLNX_OFED / DOCA OFED
 * mlnx-ofa_kernel; "4.x" is OFED 4.0/4.1, the rest is OFED >= 5.5):
 *
 *  - RLIMIT_MEMLOCK: the page count of the whole range is charged to
 *    mm->pinned_vm before pin_user_pages_fast and before any peer client is
 *    asked; no RLIMIT_MEMLOCK at all is -EPERM (can_do_mlock), over the limit
 *    is -ENOMEM, both unless CAP_IPC_LOCK. The owning mm is kept (mmgrab) and
 *    uncharged at release, whoever releases.
 *    [core/umem.c __ib_umem_get(), core/peer_mem.c ib_peer_umem_release()]
 *  - pin_user_pages_fast first; only when it fails are the peer clients
 *    asked, and if none claims the range the GUP error is returned.
 *    [core/umem.c __ib_umem_get()]
 *  - acquire under the global peer_memory_mutex, clients in registration
 *    order, invalidating clients skipped unless IB_PEER_MEM_INVAL_SUPP.
 *    [core/peer_mem.c ib_get_peer_client()]
 *  - core_context is an xa_alloc_cyclic id in [0, U32_MAX - 1] for
 *    invalidating clients, U32_MAX otherwise; the umem's mapping_lock is taken
 *    before get_pages and, for an invalidating umem, held until the HCA driver
 *    arms the notifier after creating its mkey (activate_delay_ms widens that
 *    window). [core/peer_mem.c ib_peer_umem_get(),
 *    ib_umem_activate_invalidation_notifier(); hw/mlx5/mr.c create_real_mr()]
 *  - get_page_size after dma_map and the first/last SGE fix-up, undone before
 *    the client sees the table again. [core/peer_mem.c fix_peer_sgls(),
 *    ib_unmap_peer_client()]
 *  - error unwinding: dma_map fails -> put_pages, erase id, release;
 *    get_pages fails -> erase id, release. [core/peer_mem.c ib_peer_umem_get()]
 *  - mkey creation failing after a successful map (debugfs fail_after_map):
 *    ib_umem_stop_invalidation_notifier() then the full release.
 *    [hw/mlx5/mr.c create_real_mr(); core/peer_mem.c]
 *  - invalidate: id looked up under xa_lock (unknown: return 0), kref, then
 *    mapping_lock; the client is read from the umem; the HCA hook revokes the
 *    mkey; then dma_unmap + put_pages under mapping_lock from inside the free
 *    callback, or, for PEER_MEM_INVALIDATE_UNMAPS clients, only the state
 *    change. [core/peer_mem.c ib_invalidate_peer_memory(),
 *    ib_peer_unmap_on_invalidate()]
 *  - dereg: revoke the mkey, stop the notifier (unmap under mapping_lock, or
 *    after it with INVALIDATE_UNMAPS), then release; release is never called
 *    under mapping_lock and clears the umem's client pointer, so an
 *    invalidate that still holds a kref reads NULL: reported here as a harness
 *    failure. [core/peer_mem.c ib_umem_stop_invalidation_notifier(),
 *    ib_peer_umem_release(); hw/mlx5/mr.c]
 *  - unregister blocks until every umem of the client is released.
 *    [core/peer_mem.c ib_unregister_peer_memory_client()]
 *  - /sys/kernel/mm/memory_peers/<name>/ statistics (OFED <= 23.10).
 *    [core/peer_mem.c]
 *  - variant=1, OFED 4.x, for clients without PEER_MEM_INVALIDATE_UNMAPS:
 *    core_context is a ticket counted from 1 (0: the caller has no
 *    IB_PEER_MEM_INVAL_SUPP), assigned under the per-client mutex;
 *    get_page_size is read before dma_map; mlx5 walks the client's
 *    scatterlist before arming the notifier; no mapping_lock: an invalidate
 *    before activation only marks the umem and activation then fails the
 *    registration (-EINVAL) through a normal release; the invalidate runs
 *    under the per-client mutex, waits for the MR to be created, and the HCA
 *    driver deregisters the MR inside it: dma_unmap, put_pages and release
 *    run inside the free callback, leaving a dead MR that a later dereg only
 *    frees; when a dereg won the race the invalidate waits for it to remove
 *    the ticket. [OFED 4.1 core/peer_mem.c ib_invalidate_peer_memory(),
 *    ib_peer_insert_context(), ib_peer_destroy_invalidation_ctx();
 *    core/umem.c peer_umem_get(), peer_umem_release(),
 *    ib_umem_activate_invalidation_notifier(); hw/mlx5/mr.c
 *    mlx5_invalidate_umem(), mlx5_ib_dereg_mr(), mlx5_ib_reg_user_mr()]
 *
 * Written in C: it exports C symbols by name, builds sysfs kobjects, and
 * uses xa_alloc_cyclic and pin_user_pages_fast, none of which the 7.3 Rust
 * kernel crate offers.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/capability.h>
#include <linux/completion.h>
#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/dma-mapping.h>
#include <linux/kernfs.h>
#include <linux/kobject.h>
#include <linux/kref.h>
#include <linux/lockdep.h>
#include <linux/log2.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/sysfs.h>
#include <linux/uaccess.h>
#include <linux/wait.h>
#include <linux/xarray.h>

#include "peer_mem.h"
#include "uapi.h"

/*
 * Time spent inside the client's callbacks, for make bench: minus the
 * provider's own time (nv_p2p_emu's provider_ns) it is the client's.
 */
static atomic64_t st_client_ns;

static int client_ns_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%lld\n", atomic64_read(&st_client_ns));
}

static const struct kernel_param_ops client_ns_ops = { .get = client_ns_get };
module_param_cb(client_ns, &client_ns_ops, NULL, 0444);
MODULE_PARM_DESC(client_ns, "nanoseconds spent inside peer-memory client callbacks");

/* Opt-in: clock reads are slow under TCG. */
static bool bench_timing;
module_param(bench_timing, bool, 0644);
MODULE_PARM_DESC(bench_timing, "account the time spent inside client callbacks (client_ns)");

static unsigned int activate_delay_ms;
module_param(activate_delay_ms, uint, 0644);
MODULE_PARM_DESC(activate_delay_ms,
		 "ms the HCA spends creating the mkey of an umem with a core_context (>= 5.5: mapping_lock held; 4.x: after activation)");

static unsigned int map_delay_ms;
module_param(map_delay_ms, uint, 0644);
MODULE_PARM_DESC(map_delay_ms,
		 "ms between get_pages and dma_map of an umem with a core_context (>= 5.5: mapping_lock held), to land a free in that window");

enum pmc_variant {
	PMC_OFED55 = 0,		/* OFED >= 5.5, Ubuntu SAUCE */
	PMC_OFED4 = 1,		/* OFED 4.x (peerdirect_support=1 users) */
};

static unsigned int core_variant;

static int variant_set(const char *val, const struct kernel_param *kp)
{
	return param_set_uint_minmax(val, kp, PMC_OFED55, PMC_OFED4);
}

static const struct kernel_param_ops variant_ops = {
	.set = variant_set,
	.get = param_get_uint,
};
module_param_cb(variant, &variant_ops, &core_variant, 0644);
MODULE_PARM_DESC(variant,
		 "0: OFED >= 5.5 core; 1: OFED 4.x core for clients without PEER_MEM_INVALIDATE_UNMAPS (read at each registration)");

static bool no_invalidate_hook;
module_param(no_invalidate_hook, bool, 0644);
MODULE_PARM_DESC(no_invalidate_hook,
		 "a core that takes an invalidating client without writing its invalidate hook (tests of nvidia_peermem's check)");

static bool memlock_ignore_cap;
module_param(memlock_ignore_cap, bool, 0644);
MODULE_PARM_DESC(memlock_ignore_cap,
		 "enforce RLIMIT_MEMLOCK even with CAP_IPC_LOCK (lets a root test hit the limit)");

static atomic64_t st_memlock_refusals, st_failed_after_map, st_activate_refusals;

static int stat_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%lld\n", atomic64_read(kp->arg));
}

static const struct kernel_param_ops stat_ops = { .get = stat_get };
module_param_cb(memlock_refusals, &stat_ops, &st_memlock_refusals, 0444);
MODULE_PARM_DESC(memlock_refusals, "registrations refused by RLIMIT_MEMLOCK (EPERM or ENOMEM)");
module_param_cb(failed_after_map, &stat_ops, &st_failed_after_map, 0444);
MODULE_PARM_DESC(failed_after_map, "registrations failed by fail_after_map after a successful dma_map");
module_param_cb(activate_refusals, &stat_ops, &st_activate_refusals, 0444);
MODULE_PARM_DESC(activate_refusals,
		 "OFED 4.x registrations failed because the peer invalidated before activation");

static u64 client_clock(void)
{
	return READ_ONCE(bench_timing) ? ktime_get_ns() : 0;
}

static void client_time(u64 t0)
{
	if (t0)
		atomic64_add(ktime_get_ns() - t0, &st_client_ns);
}

/*
 * Every call into the client goes through one of these: a frame of its own
 * per operation, so that an ftrace function_graph of the core's ioctls shows
 * exactly what each client callback costs (make bench's profile), whether
 * the client's own functions are traceable or not (Rust ones are not).
 */
static noinline int pmc_client_acquire(const struct peer_memory_client *ops, unsigned long addr,
				       size_t size, void **ctx)
{
	return ops->acquire(addr, size, NULL, NULL, ctx);
}

static noinline int pmc_client_get_pages(const struct peer_memory_client *ops, unsigned long addr,
					 size_t size, int write, int force, void *ctx,
					 u64 core_context)
{
	return ops->get_pages(addr, size, write, force, NULL, ctx, core_context);
}

static noinline int pmc_client_dma_map(const struct peer_memory_client *ops, struct sg_table *sgt,
				       void *ctx, struct device *dev, int *nmap)
{
	return ops->dma_map(sgt, ctx, dev, 0, nmap);
}

static noinline int pmc_client_dma_unmap(const struct peer_memory_client *ops,
					 struct sg_table *sgt, void *ctx, struct device *dev)
{
	return ops->dma_unmap(sgt, ctx, dev);
}

static noinline int pmc_client_put_pages(const struct peer_memory_client *ops,
					 struct sg_table *sgt, void *ctx)
{
	ops->put_pages(sgt, ctx);
	return 0;
}

static noinline unsigned long pmc_client_get_page_size(const struct peer_memory_client *ops,
						       void *ctx)
{
	return ops->get_page_size ? ops->get_page_size(ctx) : PAGE_SIZE;
}

static noinline int pmc_client_release(const struct peer_memory_client *ops, void *ctx)
{
	if (ops->release)
		ops->release(ctx);
	return 0;
}

#define CLIENT_CALL(expr) ({						\
	u64 __t0 = client_clock();					\
	typeof(expr) __r = (expr);					\
	client_time(__t0);						\
	__r;								\
})
#define CLIENT_CALL_VOID(expr) do {					\
	u64 __t0 = client_clock();					\
	expr;								\
	client_time(__t0);						\
} while (0)

enum ib_peer_mem_flags {
	IB_PEER_MEM_ALLOW = 1 << 0,
	IB_PEER_MEM_INVAL_SUPP = 1 << 1,
};

#define PEER_NO_INVALIDATION_ID U32_MAX
#define PEER_NO_TICKET 0		/* OFED 4.x */

enum umem_state {
	UMEM_NONE,
	UMEM_MAPPED = PMC_STATE_MAPPED,
	UMEM_INVALIDATED = PMC_STATE_INVALIDATED,
	UMEM_UNMAPPED = PMC_STATE_UNMAPPED,
};

struct peer_client {
	struct kobject kobj;		/* memory_peers/<name>; frees us */
	bool in_sysfs;
	struct list_head node;
	const struct peer_memory_client *ops;
	bool invalidation_required;
	bool unmaps;			/* extended with PEER_MEM_INVALIDATE_UNMAPS */
	atomic_t umems;			/* its umems, + 1 while registered */
	struct completion unused;	/* umems reached 0 */
	/* core_context -> umem: >= 5.5 ids and 4.x tickets, never equal */
	struct xarray umem_xa;
	u32 xa_next;
	struct mutex lock;		/* 4.x ib_peer_client->lock */
	u32 last_ticket;		/* 4.x: next ticket, from 1 */
	atomic64_t num_alloc_mrs, num_dealloc_mrs, num_reg_pages, num_dereg_pages;
	atomic64_t num_reg_bytes, num_dereg_bytes, num_free_callbacks;
};

struct pmc_umem {
	struct kref kref;
	struct mutex mapping_lock;	/* state, sgt, revoked; the registration */
	/*
	 * NULL once the client released it (fact 14): only the invalidate
	 * reads it after that, everything else keeps its own pointer.
	 */
	struct peer_client *client;
	/* the table called for it: its client's (fact 11) */
	const struct peer_memory_client *ops;
	char client_name[IB_PEER_MEMORY_NAME_MAX];
	void *ctx;
	u32 xa_id;			/* core_context: id, or 4.x ticket */
	enum pmc_variant variant;	/* of the core that made it */
	enum umem_state state;
	bool hook_armed;		/* the "mkey" is live */
	bool revoked;			/* the device can no longer reach it */
	int source;
	struct sg_table sgt;
	unsigned long page_size;
	u64 addr, len;
	struct device *dma_dev;
	/* first/last SGE originals saved by the fix-up */
	struct scatterlist *first_sg, *last_sg;
	dma_addr_t first_dma_address;
	unsigned int first_dma_length, first_length, last_dma_length, last_length;
	/* host memory pinned by pin_user_pages_fast */
	struct page **pages;
	unsigned long npages;
	/* RLIMIT_MEMLOCK charge; mm is NULL once uncharged */
	struct mm_struct *mm;
	unsigned long charged;
	/* 4.x: invalidation_ctx and mlx5_ib_peer_id, under client->lock */
	bool v4_func;			/* the notifier was activated */
	bool v4_peer_invalidated;	/* invalidated before activation */
	bool v4_inflight;		/* an invalidate waits for a dereg */
	bool v4_mr_live;		/* the MR was created */
	u64 v4_mtt_bytes;		/* what mr_umem_get counted in the table */
	atomic_t v4_invalidated;	/* mlx5 mr->invalidated */
	struct completion v4_mr_ready;	/* mlx5_ib_peer_id->comp */
	struct completion v4_dereg_done; /* mlx5 mr->invalidation_comp */
	struct completion v4_ticket_gone; /* invalidation_ctx->comp */
};

/*
 * Lockdep classes of mapping_lock. In the real core every umem's mapping_lock
 * shares one class. They are split here because a non-invalidating
 * (persistent) umem's mapping_lock may legitimately be held while the client
 * waits for the GPU driver's lock (get_pages/dma_map), which a free callback
 * never waits for (persistent pins have no callback); keeping one class would
 * make lockdep report an inversion between unrelated umems across test modes.
 * An invalidating umem's mapping_lock held while a client waits for the GPU
 * driver's lock IS the real ABBA (the free callback holds that lock and waits
 * for mapping_lock in the invalidate) and must still be reported: those umems
 * keep a class of their own. OFED 4.x has no mapping_lock at all; its umems
 * use it only to keep the harness's own DMA and queries away, under the
 * per-client mutex, so they get a third class.
 */
static struct lock_class_key mapping_lock_inval_key;
static struct lock_class_key mapping_lock_persist_key;
static struct lock_class_key mapping_lock_ofed4_key;

struct pmc_file {
	struct xarray umems;
};

static LIST_HEAD(peer_clients);
static DEFINE_MUTEX(peer_memory_mutex);
static struct kobject *peers_kobj;
static int nclients;
static atomic64_t st_live_umems, st_invalidations, st_dma_bytes;

/* --- the "HCA": QEMU edu ---------------------------------------------- */

#define EDU_SRC		0x80
#define EDU_DST		0x88
#define EDU_CNT		0x90
#define EDU_CMD		0x98
#define EDU_CMD_START	0x1
#define EDU_CMD_TO_RAM	0x2
#define EDU_BUF		0x40000
#define EDU_BUF_SIZE	4096

static struct {
	struct pci_dev *pdev;
	void __iomem *regs;
	void *buf;
	dma_addr_t buf_dma;
	struct mutex lock;		/* one DMA engine */
} hca;

static struct miscdevice pmc_misc;

static int edu_dma(u64 src, u64 dst, u64 n, bool to_ram)
{
	int i;

	writeq(src, hca.regs + EDU_SRC);
	writeq(dst, hca.regs + EDU_DST);
	writeq(n, hca.regs + EDU_CNT);
	writeq(EDU_CMD_START | (to_ram ? EDU_CMD_TO_RAM : 0), hca.regs + EDU_CMD);
	for (i = 0; i < 3000; i++) {
		if (!(readq(hca.regs + EDU_CMD) & EDU_CMD_START))
			return 0;
		usleep_range(500, 1000);
	}
	pr_err("edu DMA timed out\n");
	return -ETIMEDOUT;
}

/* --- sysfs statistics (memory_peers/<name>/) -------------------------- */

#define PMC_STAT(field)								\
static ssize_t field##_show(struct kobject *kobj, struct kobj_attribute *attr,	\
			    char *buf)						\
{										\
	struct peer_client *c = container_of(kobj, struct peer_client, kobj);	\
	return sysfs_emit(buf, "%lld\n", atomic64_read(&c->field));		\
}										\
static struct kobj_attribute field##_attr = __ATTR_RO(field)

PMC_STAT(num_alloc_mrs);
PMC_STAT(num_dealloc_mrs);
PMC_STAT(num_reg_pages);
PMC_STAT(num_dereg_pages);
PMC_STAT(num_reg_bytes);
PMC_STAT(num_dereg_bytes);
PMC_STAT(num_free_callbacks);

static ssize_t version_show(struct kobject *kobj, struct kobj_attribute *attr, char *buf)
{
	struct peer_client *c = container_of(kobj, struct peer_client, kobj);

	return sysfs_emit(buf, "%.*s\n", IB_PEER_MEMORY_VER_MAX, c->ops->version);
}
static struct kobj_attribute version_attr = __ATTR_RO(version);

static struct attribute *peer_attrs[] = {
	&version_attr.attr,
	&num_alloc_mrs_attr.attr,
	&num_dealloc_mrs_attr.attr,
	&num_reg_pages_attr.attr,
	&num_dereg_pages_attr.attr,
	&num_reg_bytes_attr.attr,
	&num_dereg_bytes_attr.attr,
	&num_free_callbacks_attr.attr,
	NULL,
};
ATTRIBUTE_GROUPS(peer);

static void peer_client_release(struct kobject *kobj)
{
	struct peer_client *c = container_of(kobj, struct peer_client, kobj);

	xa_destroy(&c->umem_xa);
	mutex_destroy(&c->lock);
	kfree(c);
}

static const struct kobj_type peer_ktype = {
	.release = peer_client_release,
	.sysfs_ops = &kobj_sysfs_ops,
	.default_groups = peer_groups,
};

/* --- client registration ----------------------------------------------- */

static int ib_invalidate_peer_memory(void *reg_handle, u64 core_context);

/*
 * /sys/kernel/mm: OFED and Ubuntu build the core into ib_core and use mm_kobj,
 * which the kernel does not export to modules. The directory's kernfs node
 * carries its kobject; /sys/kernel/mm lives as long as the kernel.
 */
static struct kobject *find_mm_kobj(void)
{
	struct kernfs_node *kn = kernfs_find_and_get(kernel_kobj->sd, "mm");
	struct kobject *kobj;

	if (!kn)
		return NULL;
	kobj = kn->priv;
	kernfs_put(kn);
	return kobj;
}

void *ib_register_peer_memory_client(const struct peer_memory_client *peer_client,
				     invalidate_peer_memory *invalidate_callback)
{
	struct peer_client *c;
	int err;

	if (!peer_client->acquire || !peer_client->get_pages || !peer_client->put_pages ||
	    !peer_client->dma_map || !peer_client->dma_unmap) {
		pr_err("client %.64s lacks a mandatory callback\n", peer_client->name);
		return NULL;
	}
	c = kzalloc(sizeof(*c), GFP_KERNEL);
	if (!c)
		return NULL;
	c->ops = peer_client;
	atomic_set(&c->umems, 1);
	init_completion(&c->unused);
	xa_init_flags(&c->umem_xa, XA_FLAGS_ALLOC);
	mutex_init(&c->lock);
	c->last_ticket = 1;
	if (peer_client->version[IB_PEER_MEMORY_VER_MAX - 1]) {
		const struct peer_memory_client_ex *ex =
			container_of(peer_client, const struct peer_memory_client_ex, client);

		if (ex->ex_size >= offsetofend(struct peer_memory_client_ex, flags) &&
		    (ex->flags & PEER_MEM_INVALIDATE_UNMAPS))
			c->unmaps = true;
	}
	if (invalidate_callback) {
		if (!no_invalidate_hook)
			*invalidate_callback = ib_invalidate_peer_memory;
		c->invalidation_required = true;
	}

	mutex_lock(&peer_memory_mutex);
	if (!peers_kobj) {
		struct kobject *mm = find_mm_kobj();

		peers_kobj = mm ? kobject_create_and_add("memory_peers", mm) : NULL;
		if (!peers_kobj) {
			mutex_unlock(&peer_memory_mutex);
			mutex_destroy(&c->lock);
			kfree(c);
			return NULL;
		}
	}
	err = kobject_init_and_add(&c->kobj, &peer_ktype, peers_kobj, "%.64s", peer_client->name);
	if (err) {
		/* A client of that name is registered (OFED's sysfs cores fail too). */
		pr_err("cannot register client %.64s: %d\n", peer_client->name, err);
		kobject_put(&c->kobj);
		if (!nclients) {
			kobject_put(peers_kobj);
			peers_kobj = NULL;
		}
		mutex_unlock(&peer_memory_mutex);
		return NULL;
	}
	c->in_sysfs = true;
	list_add_tail(&c->node, &peer_clients);
	nclients++;
	mutex_unlock(&peer_memory_mutex);
	pr_info("registered client %.64s (%s%s)\n", peer_client->name,
		c->invalidation_required ? "invalidating" : "non-invalidating",
		c->unmaps ? ", INVALIDATE_UNMAPS" : "");
	return c;
}
EXPORT_SYMBOL(ib_register_peer_memory_client);

static void client_put(struct peer_client *c)
{
	if (atomic_dec_and_test(&c->umems))
		complete(&c->unused);
}

void ib_unregister_peer_memory_client(void *reg_handle)
{
	struct peer_client *c = reg_handle;

	mutex_lock(&peer_memory_mutex);
	list_del(&c->node);
	nclients--;
	mutex_unlock(&peer_memory_mutex);
	/*
	 * Blocks until every umem made through this client is released. A
	 * completion, as OFED's kref + unload_comp: the last put's complete()
	 * is done with the client once it drops the completion's lock, which
	 * the wait takes before returning (a wait_event on the count could
	 * return, and free the client, before that put's wake_up ran).
	 */
	client_put(c);
	wait_for_completion(&c->unused);
	pr_info("unregistered client %.64s\n", c->ops->name);
	mutex_lock(&peer_memory_mutex);
	kobject_del(&c->kobj);
	kobject_put(&c->kobj);
	if (!nclients && peers_kobj) {
		kobject_put(peers_kobj);
		peers_kobj = NULL;
	}
	mutex_unlock(&peer_memory_mutex);
}
EXPORT_SYMBOL(ib_unregister_peer_memory_client);

/* ib_put_peer_client: release is optional. */
static void client_release(const struct peer_memory_client *ops, void *ctx)
{
	CLIENT_CALL_VOID(pmc_client_release(ops, ctx));
}

/* --- fault injection: the HCA fails to create the mkey ------------------ */

static DEFINE_SPINLOCK(fam_lock);
static unsigned int fam_left;		/* registrations still to fail */
static int fam_errno;
static struct dentry *dbg_dir;

static int fail_after_map_take(void)
{
	int err = 0;

	spin_lock(&fam_lock);
	if (fam_left) {
		fam_left--;
		err = fam_errno;
	}
	spin_unlock(&fam_lock);
	if (err) {
		atomic64_inc(&st_failed_after_map);
		pr_info("injecting %d: mkey creation fails after a successful dma_map\n", err);
	}
	return err;
}

/* "<count> <errno>", errno negative; "0 <errno>" cancels. */
static ssize_t fail_after_map_write(struct file *f, const char __user *ubuf, size_t n,
				    loff_t *pos)
{
	unsigned int count;
	char buf[64];
	int err;

	if (n >= sizeof(buf))
		return -EINVAL;
	if (copy_from_user(buf, ubuf, n))
		return -EFAULT;
	buf[n] = 0;
	if (sscanf(buf, "%u %d", &count, &err) != 2 || err >= 0 || err < -MAX_ERRNO) {
		pr_err("fail_after_map: expected \"<count> <negative errno>\", got \"%s\"\n",
		       strim(buf));
		return -EINVAL;
	}
	spin_lock(&fam_lock);
	fam_left = count;
	fam_errno = err;
	spin_unlock(&fam_lock);
	return n;
}

static ssize_t fail_after_map_read(struct file *f, char __user *ubuf, size_t n, loff_t *pos)
{
	unsigned int count;
	char buf[32];
	int err, len;

	spin_lock(&fam_lock);
	count = fam_left;
	err = fam_errno;
	spin_unlock(&fam_lock);
	len = scnprintf(buf, sizeof(buf), "%u %d\n", count, err);
	return simple_read_from_buffer(ubuf, n, pos, buf, len);
}

/*
 * hold_hca_lock_ms: the writer holds the HCA's device lock for that long, as
 * a driver core operation on it would (probe, unbind, reset): a client that
 * asks about the HCA meanwhile must not wait for it.
 */
static ssize_t hold_hca_lock_write(struct file *f, const char __user *ubuf, size_t n, loff_t *pos)
{
	unsigned int ms;
	int err = kstrtouint_from_user(ubuf, n, 0, &ms);

	if (err)
		return err;
	if (!hca.pdev || ms > 60000)
		return -EINVAL;
	device_lock(&hca.pdev->dev);
	msleep(ms);
	device_unlock(&hca.pdev->dev);
	return n;
}

static const struct file_operations hold_hca_lock_fops = {
	.owner = THIS_MODULE,
	.write = hold_hca_lock_write,
};

static const struct file_operations fail_after_map_fops = {
	.owner = THIS_MODULE,
	.read = fail_after_map_read,
	.write = fail_after_map_write,
	.llseek = default_llseek,
};

/* --- RLIMIT_MEMLOCK (ib_umem_get) -------------------------------------- */

static bool ipc_lock_capable(void)
{
	return !READ_ONCE(memlock_ignore_cap) && capable(CAP_IPC_LOCK);
}

/* Charge @npages to @mm->pinned_vm like __ib_umem_get(). */
static int memlock_charge(struct mm_struct *mm, unsigned long npages)
{
	unsigned long limit = rlimit(RLIMIT_MEMLOCK) >> PAGE_SHIFT;
	unsigned long pinned;

	/* can_do_mlock() */
	if (!rlimit(RLIMIT_MEMLOCK) && !ipc_lock_capable()) {
		atomic64_inc(&st_memlock_refusals);
		pr_info_ratelimited("registration refused (EPERM): RLIMIT_MEMLOCK is 0 (pid %d)\n",
				    task_pid_nr(current));
		return -EPERM;
	}
	pinned = atomic64_add_return(npages, &mm->pinned_vm);
	if (pinned > limit && !ipc_lock_capable()) {
		atomic64_sub(npages, &mm->pinned_vm);
		atomic64_inc(&st_memlock_refusals);
		pr_info_ratelimited("registration refused (ENOMEM): %lu pages would be pinned, RLIMIT_MEMLOCK allows %lu (pid %d)\n",
				    pinned, limit, task_pid_nr(current));
		return -ENOMEM;
	}
	return 0;
}

/* From the saved mm: the release may run in another process or a kthread. */
static void umem_uncharge(struct pmc_umem *u)
{
	if (!u->mm)
		return;
	atomic64_sub(u->charged, &u->mm->pinned_vm);
	mmdrop(u->mm);
	u->mm = NULL;
}

/* --- umems ------------------------------------------------------------- */

static void umem_free(struct kref *kref)
{
	struct pmc_umem *u = container_of(kref, struct pmc_umem, kref);

	umem_uncharge(u);	/* only failure paths get here still charged */
	mutex_destroy(&u->mapping_lock);
	kfree(u);
	atomic64_dec(&st_live_umems);
}

static struct pmc_umem *umem_alloc(u64 addr, u64 len, int source)
{
	struct pmc_umem *u = kzalloc(sizeof(*u), GFP_KERNEL);

	if (!u)
		return NULL;
	atomic64_inc(&st_live_umems);
	kref_init(&u->kref);
	mutex_init(&u->mapping_lock);
	u->source = source;
	u->addr = addr;
	u->len = len;
	atomic_set(&u->v4_invalidated, 0);
	init_completion(&u->v4_mr_ready);
	init_completion(&u->v4_dereg_done);
	init_completion(&u->v4_ticket_gone);
	return u;
}

static void fix_peer_sgls(struct pmc_umem *u)
{
	struct scatterlist *sg;
	unsigned int i;

	for_each_sgtable_dma_sg(&u->sgt, sg, i) {
		if (i == 0) {
			unsigned long off = ALIGN_DOWN(u->addr, PAGE_SIZE) -
					    ALIGN_DOWN(u->addr, u->page_size);

			u->first_sg = sg;
			u->first_dma_address = sg->dma_address;
			u->first_dma_length = sg_dma_len(sg);
			u->first_length = sg->length;
			sg->dma_address += off;
			sg_dma_len(sg) -= off;
			sg->length -= off;
		}
		if (i == u->sgt.nents - 1) {
			unsigned long trim = ALIGN(u->addr + u->len, u->page_size) -
					     ALIGN(u->addr + u->len, PAGE_SIZE);

			u->last_sg = sg;
			u->last_dma_length = sg_dma_len(sg);
			u->last_length = sg->length;
			sg_dma_len(sg) -= trim;
			sg->length -= trim;
		}
	}
}

/* The client always sees the table it built. */
static void unfix_peer_sgls(struct pmc_umem *u)
{
	if (u->last_sg) {
		sg_dma_len(u->last_sg) = u->last_dma_length;
		u->last_sg->length = u->last_length;
	}
	if (u->first_sg) {
		u->first_sg->dma_address = u->first_dma_address;
		sg_dma_len(u->first_sg) = u->first_dma_length;
		u->first_sg->length = u->first_length;
	}
	u->first_sg = u->last_sg = NULL;
}

static void unmap_client(struct pmc_umem *u, struct peer_client *c)
{
	unfix_peer_sgls(u);
	CLIENT_CALL(pmc_client_dma_unmap(u->ops, &u->sgt, u->ctx, u->dma_dev));
	CLIENT_CALL_VOID(pmc_client_put_pages(u->ops, &u->sgt, u->ctx));
	memset(&u->sgt, 0, sizeof(u->sgt));
}

static void release_stats(struct pmc_umem *u, struct peer_client *c)
{
	atomic64_inc(&c->num_dealloc_mrs);
	atomic64_add(u->sgt.nents, &c->num_dereg_pages);
	atomic64_add(u->len, &c->num_dereg_bytes);
}

/* The "HCA" takes the mkey away: no device DMA through this MR from now on. */
static void hca_revoke(struct pmc_umem *u)
{
	mutex_lock(&u->mapping_lock);
	u->revoked = true;
	mutex_unlock(&u->mapping_lock);
}

/* The time the HCA driver takes to create the mkey. */
static void hca_create_mkey_delay(void)
{
	unsigned int ms = READ_ONCE(activate_delay_ms);

	if (ms)
		msleep(ms);
}

/* --- the OFED 4.x core (variant 1) -------------------------------------- */

/* ib_peer_insert_context: the client's lock covers the ticket only. */
static int ofed4_insert_ticket(struct peer_client *c, struct pmc_umem *u)
{
	int err;

	mutex_lock(&c->lock);
	do {
		/* Skip ids a >= 5.5 umem of the same client holds. */
		u->xa_id = c->last_ticket++;
		if (c->last_ticket == PEER_NO_INVALIDATION_ID)
			c->last_ticket = 1;
		err = xa_insert(&c->umem_xa, u->xa_id, u, GFP_KERNEL);
	} while (err == -EBUSY);
	mutex_unlock(&c->lock);
	if (err)
		u->xa_id = PEER_NO_TICKET;
	return err;
}

/* ib_peer_destroy_invalidation_ctx: the lock is already held in a callback. */
static void ofed4_remove_ticket(struct peer_client *c, struct pmc_umem *u, bool in_callback)
{
	if (u->xa_id == PEER_NO_TICKET)
		return;
	if (!in_callback)
		mutex_lock(&c->lock);
	xa_erase(&c->umem_xa, u->xa_id);
	if (u->v4_inflight)
		complete_all(&u->v4_ticket_gone);
	if (!in_callback)
		mutex_unlock(&c->lock);
}

/*
 * 4.x peer_umem_release(): ticket, dma_unmap, put_pages, release, with no
 * lock of the core around the client's calls. In a free callback it runs
 * under the client's lock, from inside ib_invalidate_peer_memory.
 */
static void ofed4_umem_release(struct pmc_umem *u, struct peer_client *c, bool in_callback)
{
	bool was_mapped;

	ofed4_remove_ticket(c, u, in_callback);
	/* Keeps the harness's DMA and queries off the table. */
	mutex_lock(&u->mapping_lock);
	was_mapped = u->state == UMEM_MAPPED;
	u->state = UMEM_UNMAPPED;
	u->revoked = true;
	mutex_unlock(&u->mapping_lock);
	if (was_mapped)
		unmap_client(u, c);
	client_release(u->ops, u->ctx);
	WRITE_ONCE(u->client, NULL);
	release_stats(u, c);
	client_put(c);
	umem_uncharge(u);
}

/* 4.x ib_invalidate_peer_memory + mlx5_invalidate_umem. We hold a kref. */
static void ofed4_invalidate(struct peer_client *c, struct pmc_umem *u, u64 core_context)
{
	mutex_lock(&c->lock);
	/* ib_peer_search_context */
	if (xa_load(&c->umem_xa, core_context) != u)
		goto out;
	if (!u->v4_func) {
		/* Not activated yet: activation will fail the registration. */
		u->v4_peer_invalidated = true;
		goto out;
	}
	/* mlx5_invalidate_umem waits for the MR, under the client's lock. */
	wait_for_completion(&u->v4_mr_ready);
	if (!u->v4_mr_live)
		goto out;	/* the registration is failing; it releases */
	if (atomic_inc_return(&u->v4_invalidated) > 1) {
		/* A dereg is in flight: wait until it took the ticket away. */
		u->v4_inflight = true;
		mutex_unlock(&c->lock);
		wait_for_completion(&u->v4_ticket_gone);
		return;
	}
	/* mlx5_ib_invalidate_mr: destroy the mkey, then ib_umem_release. */
	atomic64_inc(&st_invalidations);
	ofed4_umem_release(u, c, true);
	complete_all(&u->v4_dereg_done);
out:
	mutex_unlock(&c->lock);
}

/* 4.x mlx5_ib_dereg_mr. Holds the handle's reference, which it drops. */
static void ofed4_dereg(struct pmc_umem *u)
{
	if (atomic_inc_return(&u->v4_invalidated) > 1) {
		/* The free callback deregistered it: a dead MR, core memory only. */
		wait_for_completion(&u->v4_dereg_done);
	} else {
		/* Read only now: a callback can no longer release the umem. */
		struct peer_client *c = u->client;

		hca_revoke(u);
		ofed4_umem_release(u, c, false);
	}
	kref_put(&u->kref, umem_free);
}

/*
 * 4.x peer_umem_get: no mapping_lock; get_page_size is read before dma_map
 * (4.x sets umem->page_shift from it). The SGE fix-up is kept so that the
 * harness's DMA works the same in both variants; its restore at release
 * writes the client's scatterlist, which a 4.x core only reads (see
 * ofed4_mr_umem_get): a client that frees its table in the free callback is
 * caught either way.
 */
static struct pmc_umem *ofed4_peer_umem_get(struct pmc_umem *u, struct peer_client *c,
					    u64 flags)
{
	void *ctx = u->ctx;
	int nmap = 0, err;

	u->variant = PMC_OFED4;
	u->xa_id = PEER_NO_TICKET;
	lockdep_set_class(&u->mapping_lock, &mapping_lock_ofed4_key);
	if (flags & PMC_REG_INVAL_SUPP) {
		err = ofed4_insert_ticket(c, u);
		if (err)
			goto err_umem;
	}
	err = CLIENT_CALL(pmc_client_get_pages(u->ops, u->addr, u->len, 1,
						     !!(flags & PMC_REG_READ_ONLY), ctx, u->xa_id));
	if (err)
		goto err_ticket;
	u->page_size = pmc_client_get_page_size(u->ops, ctx);
	if (!is_power_of_2(u->page_size) || u->page_size < PAGE_SIZE) {
		pr_err("client %.64s: get_page_size() before dma_map returned %lu\n",
		       c->ops->name, u->page_size);
		err = -EINVAL;
		goto err_pages;
	}
	err = CLIENT_CALL(pmc_client_dma_map(u->ops, &u->sgt, ctx, u->dma_dev, &nmap));
	if (err)
		goto err_pages;
	u->sgt.nents = nmap;
	if (u->page_size != PAGE_SIZE)
		fix_peer_sgls(u);
	u->state = UMEM_MAPPED;
	atomic64_inc(&c->num_alloc_mrs);
	atomic64_add(nmap, &c->num_reg_pages);
	atomic64_add(u->len, &c->num_reg_bytes);
	return u;

err_pages:
	CLIENT_CALL_VOID(pmc_client_put_pages(u->ops, &u->sgt, ctx));
err_ticket:
	ofed4_remove_ticket(c, u, false);
err_umem:
	client_release(u->ops, ctx);
	kref_put(&u->kref, umem_free);
	client_put(c);
	return ERR_PTR(err);
}

/*
 * 4.x mr_umem_get -> mlx5_ib_cont_pages: mlx5 walks the umem's scatterlist
 * to size the MTT before the notifier is armed, with no lock of the core's
 * held, so a free callback may run meanwhile and only mark the umem: the
 * client's table must still be readable after its callback returned, until
 * the core unmaps or releases. [OFED 4.1 hw/mlx5/mr.c mr_umem_get(),
 * hw/mlx5/mem.c mlx5_ib_cont_pages()]
 */
static void ofed4_mr_umem_get(struct pmc_umem *u)
{
	struct scatterlist *sg;
	unsigned int i;
	u64 bytes = 0;

	for_each_sg(u->sgt.sgl, sg, u->sgt.nents, i)
		bytes += sg_dma_len(sg);
	u->v4_mtt_bytes = bytes;
}

/*
 * 4.x mlx5_ib_reg_user_mr after the umem: activate the notifier (refused if
 * the peer invalidated meanwhile), create the mkey, then let a waiting
 * invalidate go on. On failure the umem goes through a normal release.
 */
static int ofed4_hca_reg_mr(struct pmc_umem *u)
{
	struct peer_client *c = u->client;
	int err = 0;

	ofed4_mr_umem_get(u);
	if (u->xa_id != PEER_NO_TICKET) {
		mutex_lock(&c->lock);
		if (u->v4_peer_invalidated)
			err = -EINVAL;
		else
			u->v4_func = true;
		mutex_unlock(&c->lock);
		if (err) {
			atomic64_inc(&st_activate_refusals);
			pr_err("ib_umem_activate_invalidation_notifier: pages were invalidated by peer (client %.64s, ticket %u)\n",
			       u->client_name, u->xa_id);
		} else {
			hca_create_mkey_delay();
		}
	}
	if (!err)
		err = fail_after_map_take();
	if (err) {
		complete_all(&u->v4_mr_ready);
		ofed4_umem_release(u, c, false);
		kref_put(&u->kref, umem_free);
		return err;
	}
	u->v4_mr_live = true;
	complete_all(&u->v4_mr_ready);
	return 0;
}

/* --- the OFED >= 5.5 core (variant 0) ----------------------------------- */

static int ib_invalidate_peer_memory(void *reg_handle, u64 core_context)
{
	struct peer_client *c = reg_handle, *uc;
	struct pmc_umem *u;

	atomic64_inc(&c->num_free_callbacks);
	xa_lock(&c->umem_xa);
	u = xa_load(&c->umem_xa, core_context);
	if (u)
		kref_get(&u->kref);
	xa_unlock(&c->umem_xa);
	if (!u)
		return 0;
	/*
	 * The harness's own bookkeeping outlives a client that unregisters
	 * while its callback is still in here.
	 */
	kobject_get(&c->kobj);

	if (u->variant == PMC_OFED4) {
		ofed4_invalidate(c, u, core_context);
		goto out;
	}

	mutex_lock(&u->mapping_lock);
	/* The real core reads the client from the umem, after mapping_lock. */
	uc = READ_ONCE(u->client);
	if (!uc) {
		pr_err("HARNESS FAILURE: invalidate after release cleared the client\n");
		WARN(1, "invalidate of core_context %llu (client %.64s) ran after the client's release(): the real core dereferences NULL here\n",
		     core_context, u->client_name);
		mutex_unlock(&u->mapping_lock);
		goto out;
	}
	WARN_ON_ONCE(uc != c);
	if (u->state == UMEM_MAPPED) {
		if (u->hook_armed) {
			/* mlx5: UMR-revoke the mkey; the device loses access. */
			u->revoked = true;
			atomic64_inc(&st_invalidations);
		}
		if (uc->unmaps) {
			unfix_peer_sgls(u);
			u->state = UMEM_INVALIDATED;
		} else {
			unmap_client(u, uc);
			u->state = UMEM_UNMAPPED;
		}
	}
	mutex_unlock(&u->mapping_lock);
out:
	kref_put(&u->kref, umem_free);
	kobject_put(&c->kobj);
	return 0;
}

/*
 * ib_peer_umem_get. For an invalidating client mapping_lock is still held on
 * success: ib_umem_activate_invalidation_notifier() or
 * ib_umem_stop_invalidation_notifier() drops it.
 */
static struct pmc_umem *peer_umem_get(u64 addr, u64 len, u64 flags, int gup_err)
{
	const struct peer_memory_client *ops;
	struct peer_client *c, *found = NULL;
	struct pmc_umem *u;
	void *ctx = NULL;
	int nmap = 0, err;

	mutex_lock(&peer_memory_mutex);
	list_for_each_entry(c, &peer_clients, node) {
		if (c->invalidation_required && !(flags & PMC_REG_INVAL_SUPP))
			continue;
		if (CLIENT_CALL(pmc_client_acquire(c->ops, addr, len, &ctx)) > 0) {
			found = c;
			atomic_inc(&c->umems);
			break;
		}
	}
	mutex_unlock(&peer_memory_mutex);
	if (!found)
		return ERR_PTR(gup_err);
	c = found;
	ops = c->ops;

	u = umem_alloc(addr, len, PMC_SRC_PEER);
	if (!u) {
		err = -ENOMEM;
		goto err_client;
	}
	u->client = c;
	u->ops = ops;
	strscpy(u->client_name, c->ops->name, sizeof(u->client_name));
	u->ctx = ctx;
	u->dma_dev = (flags & PMC_REG_NON_PCI_DEV) ? pmc_misc.this_device : &hca.pdev->dev;

	/* The variant applies to the clients a 4.x core would see as such. */
	if (READ_ONCE(core_variant) == PMC_OFED4 && !c->unmaps)
		return ofed4_peer_umem_get(u, c, flags);

	u->variant = PMC_OFED55;
	lockdep_set_class(&u->mapping_lock, c->invalidation_required ?
			  &mapping_lock_inval_key : &mapping_lock_persist_key);
	mutex_lock(&u->mapping_lock);
	if (c->invalidation_required) {
		err = xa_alloc_cyclic(&c->umem_xa, &u->xa_id, u,
				      XA_LIMIT(0, PEER_NO_INVALIDATION_ID - 1), &c->xa_next,
				      GFP_KERNEL);
		if (err < 0)
			goto err_umem;
	} else {
		u->xa_id = PEER_NO_INVALIDATION_ID;
	}
	err = CLIENT_CALL(pmc_client_get_pages(ops, addr, len, 1, !!(flags & PMC_REG_READ_ONLY),
						     ctx, u->xa_id));
	if (err)
		goto err_xa;
	if (c->invalidation_required && READ_ONCE(map_delay_ms))
		msleep(READ_ONCE(map_delay_ms));	/* mapping_lock held, as between the real calls */
	err = CLIENT_CALL(pmc_client_dma_map(ops, &u->sgt, ctx, u->dma_dev, &nmap));
	if (!err && (flags & PMC_REG_REMAP)) {
		/* A core that unmaps and maps the same pin again before use. */
		CLIENT_CALL_VOID(pmc_client_dma_unmap(ops, &u->sgt, ctx, u->dma_dev));
		err = CLIENT_CALL(pmc_client_dma_map(ops, &u->sgt, ctx, u->dma_dev, &nmap));
	}
	if (err)
		goto err_pages;
	u->sgt.nents = nmap;
	u->page_size = pmc_client_get_page_size(ops, ctx);
	if (u->page_size != PAGE_SIZE)
		fix_peer_sgls(u);
	u->state = UMEM_MAPPED;
	atomic64_inc(&c->num_alloc_mrs);
	atomic64_add(nmap, &c->num_reg_pages);
	atomic64_add(len, &c->num_reg_bytes);
	if (u->xa_id == PEER_NO_INVALIDATION_ID)
		mutex_unlock(&u->mapping_lock);
	return u;

err_pages:
	CLIENT_CALL_VOID(pmc_client_put_pages(ops, &u->sgt, ctx));
err_xa:
	if (u->xa_id != PEER_NO_INVALIDATION_ID)
		xa_erase(&c->umem_xa, u->xa_id);
err_umem:
	mutex_unlock(&u->mapping_lock);
	kref_put(&u->kref, umem_free);
err_client:
	client_release(ops, ctx);
	client_put(c);
	return ERR_PTR(err);
}

/* The HCA driver created its mkey: invalidations may now come through. */
static void ib_umem_activate_invalidation_notifier(struct pmc_umem *u)
{
	if (u->xa_id == PEER_NO_INVALIDATION_ID)
		return;
	u->hook_armed = true;
	/* Pairs with the lock in peer_umem_get(). */
	mutex_unlock(&u->mapping_lock);
}

/*
 * The HCA blocked DMA and will no longer handle invalidations. Before
 * activation (the mkey creation failed) mapping_lock is still held.
 */
static void ib_umem_stop_invalidation_notifier(struct pmc_umem *u)
{
	struct peer_client *c = u->client;
	enum umem_state cur;

	if (u->xa_id == PEER_NO_INVALIDATION_ID)
		return;		/* unmapped by ib_peer_umem_release */
	if (u->hook_armed) {
		mutex_lock(&u->mapping_lock);
		u->hook_armed = false;
	}
	if (!c->unmaps) {
		if (u->state == UMEM_MAPPED)
			unmap_client(u, c);
		u->state = UMEM_UNMAPPED;
		mutex_unlock(&u->mapping_lock);
	} else {
		/* Blocks ib_invalidate_peer_memory; unmap outside the lock. */
		cur = u->state;
		u->state = UMEM_UNMAPPED;
		mutex_unlock(&u->mapping_lock);
		if (cur == UMEM_MAPPED)
			unmap_client(u, c);
	}
}

/* ib_peer_umem_release. Never under mapping_lock. Drops the umem's reference. */
static void ib_peer_umem_release(struct pmc_umem *u)
{
	struct peer_client *c = u->client;
	bool was_mapped;

	WARN_ON(u->hook_armed);
	/* Non-invalidating umems: unmapped here, the client not under the lock. */
	mutex_lock(&u->mapping_lock);
	was_mapped = u->state == UMEM_MAPPED;
	if (was_mapped)
		u->state = UMEM_UNMAPPED;
	mutex_unlock(&u->mapping_lock);
	if (was_mapped)
		unmap_client(u, c);
	if (u->xa_id != PEER_NO_INVALIDATION_ID)
		xa_erase(&c->umem_xa, u->xa_id);
	client_release(u->ops, u->ctx);
	/* Newer cores clear it; an invalidate holding a kref reads it later. */
	WRITE_ONCE(u->client, NULL);
	release_stats(u, c);
	client_put(c);
	umem_uncharge(u);
	kref_put(&u->kref, umem_free);
}

/*
 * The HCA driver's reg_mr after the umem exists: create the mkey, then arm
 * the invalidation notifier; if the mkey cannot be created, stop the
 * notifier and release the umem (mlx5 create_real_mr()).
 */
static int hca_reg_mr(struct pmc_umem *u)
{
	int err;

	if (u->source != PMC_SRC_PEER)
		return 0;
	if (u->variant == PMC_OFED4)
		return ofed4_hca_reg_mr(u);
	if (u->xa_id != PEER_NO_INVALIDATION_ID)
		hca_create_mkey_delay();	/* mapping_lock held */
	err = fail_after_map_take();
	if (err) {
		ib_umem_stop_invalidation_notifier(u);
		ib_peer_umem_release(u);
		return err;
	}
	ib_umem_activate_invalidation_notifier(u);
	return 0;
}

/* The HCA driver's dereg_mr (or the owner's teardown). Drops the reference. */
static void umem_release(struct pmc_umem *u)
{
	if (u->source == PMC_SRC_HOST) {
		unpin_user_pages(u->pages, u->npages);
		kvfree(u->pages);
		umem_uncharge(u);
		kref_put(&u->kref, umem_free);
		return;
	}
	if (u->variant == PMC_OFED4) {
		ofed4_dereg(u);
		return;
	}
	/* Revoke the mkey, stop the notifier, release. */
	hca_revoke(u);
	ib_umem_stop_invalidation_notifier(u);
	ib_peer_umem_release(u);
}

/*
 * ib_umem_get: charge RLIMIT_MEMLOCK, try pin_user_pages_fast, then the peer
 * clients. On success the umem owns the charge.
 */
static struct pmc_umem *umem_get(u64 addr, u64 len, u64 flags)
{
	unsigned long first = addr & PAGE_MASK, npages;
	struct mm_struct *mm = current->mm;
	struct page **pages;
	struct pmc_umem *u;
	long pinned;
	int err;

	if (!len || addr + len < addr || PAGE_ALIGN(addr + len) < addr + len ||
	    len > (1ULL << 40))
		return ERR_PTR(-EINVAL);
	if (!mm)
		return ERR_PTR(-EFAULT);
	npages = (PAGE_ALIGN(addr + len) - first) >> PAGE_SHIFT;
	err = memlock_charge(mm, npages);
	if (err)
		return ERR_PTR(err);

	pages = kvmalloc_array(npages, sizeof(*pages), GFP_KERNEL);
	if (!pages) {
		err = -ENOMEM;
		goto err_uncharge;
	}
	pinned = pin_user_pages_fast(first, npages,
				     FOLL_LONGTERM | ((flags & PMC_REG_READ_ONLY) ? 0 : FOLL_WRITE),
				     pages);
	if (pinned == npages) {
		u = umem_alloc(addr, len, PMC_SRC_HOST);
		if (!u) {
			unpin_user_pages(pages, npages);
			kvfree(pages);
			err = -ENOMEM;
			goto err_uncharge;
		}
		u->pages = pages;
		u->npages = npages;
		u->state = UMEM_MAPPED;
	} else {
		if (pinned > 0)
			unpin_user_pages(pages, pinned);
		kvfree(pages);
		u = peer_umem_get(addr, len, flags, pinned < 0 ? pinned : -EFAULT);
		if (IS_ERR(u)) {
			err = PTR_ERR(u);
			goto err_uncharge;
		}
	}
	mmgrab(mm);
	u->mm = mm;
	u->charged = npages;
	return u;

err_uncharge:
	atomic64_sub(npages, &mm->pinned_vm);
	return ERR_PTR(err);
}

/* --- user interface ------------------------------------------------------ */

static struct pmc_umem *lookup(struct pmc_file *pf, u64 handle)
{
	struct pmc_umem *u;

	xa_lock(&pf->umems);
	u = xa_load(&pf->umems, handle);
	if (u)
		kref_get(&u->kref);
	xa_unlock(&pf->umems);
	return u;
}

static long pmc_reg(struct pmc_file *pf, struct pmc_reg __user *uarg)
{
	struct pmc_reg arg;
	struct pmc_umem *u;
	u32 id;
	int err;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags & ~(u64)(PMC_REG_INVAL_SUPP | PMC_REG_NON_PCI_DEV | PMC_REG_READ_ONLY |
			       PMC_REG_REMAP))
		return -EINVAL;
	if (!hca.pdev && !(arg.flags & PMC_REG_NON_PCI_DEV))
		return -ENODEV;
	u = umem_get(arg.addr, arg.len, arg.flags);
	if (IS_ERR(u))
		return PTR_ERR(u);
	err = hca_reg_mr(u);
	if (err)
		return err;
	err = xa_alloc(&pf->umems, &id, u, xa_limit_31b, GFP_KERNEL);
	if (err) {
		umem_release(u);
		return err;
	}
	arg.handle = id;
	if (copy_to_user(uarg, &arg, sizeof(arg))) {
		/* Leave it registered; it goes with the file. */
		return -EFAULT;
	}
	return 0;
}

static long pmc_dereg(struct pmc_file *pf, u64 __user *uh)
{
	struct pmc_umem *u;
	u64 h;

	if (get_user(h, uh))
		return -EFAULT;
	u = xa_erase(&pf->umems, h);
	if (!u)
		return -EINVAL;
	umem_release(u);
	return 0;
}

static long pmc_query(struct pmc_file *pf, struct pmc_query __user *uarg)
{
	struct pmc_query q;
	struct pmc_umem *u;
	struct scatterlist *sg;
	unsigned int i;

	if (copy_from_user(&q.handle, &uarg->handle, sizeof(q.handle)))
		return -EFAULT;
	u = lookup(pf, q.handle);
	if (!u)
		return -EINVAL;
	memset(&q, 0, sizeof(q));
	mutex_lock(&u->mapping_lock);
	q.source = u->source;
	q.state = u->state;
	q.revoked = u->revoked;
	if (u->source == PMC_SRC_PEER) {
		strscpy(q.client, u->client_name, sizeof(q.client));
		q.page_size = u->page_size;
		if (u->state == UMEM_MAPPED) {
			q.nmap = u->sgt.nents;
			for_each_sgtable_dma_sg(&u->sgt, sg, i) {
				if (i == 0) {
					q.first_dma = sg_dma_address(sg);
					q.first_len = sg_dma_len(sg);
				}
				q.last_len = sg_dma_len(sg);
				q.total_len += sg_dma_len(sg);
			}
		}
	}
	mutex_unlock(&u->mapping_lock);
	if (copy_from_user(&q.handle, &uarg->handle, sizeof(q.handle)))
		q.handle = 0;
	kref_put(&u->kref, umem_free);
	return copy_to_user(uarg, &q, sizeof(q)) ? -EFAULT : 0;
}

/* Copies the DMA scatterlist of a mapped peer MR (after the fix-up) out. */
static int sgl_snapshot(struct pmc_umem *u, struct pmc_sgl *a, struct pmc_sge *out)
{
	struct scatterlist *sg;
	unsigned int i;

	mutex_lock(&u->mapping_lock);
	if (u->source != PMC_SRC_PEER || u->state != UMEM_MAPPED) {
		mutex_unlock(&u->mapping_lock);
		return -EINVAL;
	}
	a->nents = u->sgt.nents;
	a->addr = u->addr;
	a->len = u->len;
	for_each_sgtable_dma_sg(&u->sgt, sg, i) {
		if (i >= a->capacity)
			break;
		out[i].dma = sg_dma_address(sg);
		out[i].len = sg_dma_len(sg);
	}
	mutex_unlock(&u->mapping_lock);
	return 0;
}

static long pmc_sgl(struct pmc_file *pf, struct pmc_sgl __user *uarg)
{
	struct pmc_sge *out;
	struct pmc_umem *u;
	struct pmc_sgl a;
	int err;

	if (copy_from_user(&a, uarg, sizeof(a)))
		return -EFAULT;
	if (a.capacity > (1U << 24))
		return -EINVAL;
	out = kvcalloc(max_t(u64, a.capacity, 1), sizeof(*out), GFP_KERNEL);
	if (!out)
		return -ENOMEM;
	u = lookup(pf, a.handle);
	err = u ? sgl_snapshot(u, &a, out) : -EINVAL;
	if (u)
		kref_put(&u->kref, umem_free);
	if (!err && copy_to_user(u64_to_user_ptr(a.entries), out,
				 min(a.nents, a.capacity) * sizeof(*out)))
		err = -EFAULT;
	if (!err && copy_to_user(uarg, &a, sizeof(a)))
		err = -EFAULT;
	kvfree(out);
	return err;
}

/* The bus address of MR byte @off and how many bytes follow it in its SGE. */
static int mr_dma_addr(struct pmc_umem *u, u64 off, dma_addr_t *dma, u64 *room)
{
	u64 pos = (u->addr + off) - ALIGN_DOWN(u->addr, PAGE_SIZE);
	struct scatterlist *sg;
	unsigned int i;

	for_each_sgtable_dma_sg(&u->sgt, sg, i) {
		if (pos < sg_dma_len(sg)) {
			*dma = sg_dma_address(sg) + pos;
			*room = sg_dma_len(sg) - pos;
			return 0;
		}
		pos -= sg_dma_len(sg);
	}
	return -EINVAL;
}

static long pmc_dma(struct pmc_file *pf, struct pmc_dma __user *uarg)
{
	struct pmc_dma arg;
	struct pmc_umem *u;
	u8 *tmp;
	u64 done = 0;
	long err = 0;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (!arg.len || arg.len > SZ_1M || (arg.dir != PMC_DMA_TO_MR && arg.dir != PMC_DMA_FROM_MR))
		return -EINVAL;
	if (!hca.pdev)
		return -ENODEV;
	u = lookup(pf, arg.handle);
	if (!u)
		return -EINVAL;
	if (arg.offset >= u->len || arg.len > u->len - arg.offset) {
		err = -EINVAL;
		goto out_put;
	}
	tmp = kvmalloc(arg.len, GFP_KERNEL);
	if (!tmp) {
		err = -ENOMEM;
		goto out_put;
	}
	/* User copies stay outside mapping_lock (no mmap_lock under it). */
	if (arg.dir == PMC_DMA_TO_MR && copy_from_user(tmp, u64_to_user_ptr(arg.buf), arg.len)) {
		err = -EFAULT;
		goto out_free;
	}
	mutex_lock(&u->mapping_lock);
	if (u->source != PMC_SRC_PEER) {
		err = -EOPNOTSUPP;
	} else if (u->state != UMEM_MAPPED || u->revoked) {
		err = -EACCES;	/* the mkey is gone: the device gets an error CQE */
	} else {
		mutex_lock(&hca.lock);
		while (done < arg.len && !err) {
			dma_addr_t mr;
			u64 room, n;

			err = mr_dma_addr(u, arg.offset + done, &mr, &room);
			if (err)
				break;
			n = min3(room, arg.len - done, (u64)EDU_BUF_SIZE);
			if (arg.dir == PMC_DMA_TO_MR) {
				memcpy(hca.buf, tmp + done, n);
				err = edu_dma(hca.buf_dma, EDU_BUF, n, false);
				if (!err)
					err = edu_dma(EDU_BUF, mr, n, true);
			} else {
				err = edu_dma(mr, EDU_BUF, n, false);
				if (!err)
					err = edu_dma(EDU_BUF, hca.buf_dma, n, true);
				if (!err)
					memcpy(tmp + done, hca.buf, n);
			}
			done += n;
		}
		mutex_unlock(&hca.lock);
	}
	mutex_unlock(&u->mapping_lock);
	if (!err) {
		atomic64_add(arg.len, &st_dma_bytes);
		if (arg.dir == PMC_DMA_FROM_MR && copy_to_user(u64_to_user_ptr(arg.buf), tmp, arg.len))
			err = -EFAULT;
	}
out_free:
	kvfree(tmp);
out_put:
	kref_put(&u->kref, umem_free);
	return err;
}

static long pmc_info(struct pmc_info __user *uarg)
{
	struct pmc_info info = {
		.hca_present = !!hca.pdev,
		.live_umems = atomic64_read(&st_live_umems),
		.invalidations = atomic64_read(&st_invalidations),
		.dma_bytes = atomic64_read(&st_dma_bytes),
	};

	mutex_lock(&peer_memory_mutex);
	info.clients = nclients;
	mutex_unlock(&peer_memory_mutex);
	return copy_to_user(uarg, &info, sizeof(info)) ? -EFAULT : 0;
}

static long pmc_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct pmc_file *pf = file->private_data;

	switch (cmd) {
	case PMC_IOC_REG:
		return pmc_reg(pf, (void __user *)arg);
	case PMC_IOC_DEREG:
		return pmc_dereg(pf, (u64 __user *)arg);
	case PMC_IOC_QUERY:
		return pmc_query(pf, (void __user *)arg);
	case PMC_IOC_DMA:
		return pmc_dma(pf, (void __user *)arg);
	case PMC_IOC_INFO:
		return pmc_info((void __user *)arg);
	case PMC_IOC_SGL:
		return pmc_sgl(pf, (void __user *)arg);
	}
	return -ENOTTY;
}

static int pmc_open(struct inode *inode, struct file *file)
{
	struct pmc_file *pf = kzalloc(sizeof(*pf), GFP_KERNEL);

	if (!pf)
		return -ENOMEM;
	xa_init_flags(&pf->umems, XA_FLAGS_ALLOC1);
	file->private_data = pf;
	return 0;
}

/* Process exit or close: every MR goes, like ib_uverbs' cleanup. */
static int pmc_release(struct inode *inode, struct file *file)
{
	struct pmc_file *pf = file->private_data;
	struct pmc_umem *u;
	unsigned long id;

	xa_for_each(&pf->umems, id, u) {
		xa_erase(&pf->umems, id);
		umem_release(u);
	}
	xa_destroy(&pf->umems);
	kfree(pf);
	return 0;
}

static const struct file_operations pmc_fops = {
	.owner = THIS_MODULE,
	.open = pmc_open,
	.release = pmc_release,
	.unlocked_ioctl = pmc_ioctl,
};

static struct miscdevice pmc_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "peer_mem_core",
	.fops = &pmc_fops,
	.mode = 0666,
};

static int edu_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	int err;

	if (hca.pdev)
		return -EBUSY;
	err = pcim_enable_device(pdev);
	if (err)
		return err;
	pci_set_master(pdev);
	err = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
	if (err)
		return err;
	/* Like mlx5: segments up to 2 GiB. */
	dma_set_max_seg_size(&pdev->dev, SZ_2G);
	hca.regs = pcim_iomap(pdev, 0, 0);
	if (!hca.regs)
		return -ENOMEM;
	hca.buf = dmam_alloc_coherent(&pdev->dev, EDU_BUF_SIZE, &hca.buf_dma, GFP_KERNEL);
	if (!hca.buf)
		return -ENOMEM;
	if ((readl(hca.regs) & 0xff) != 0xed) {
		dev_err(&pdev->dev, "not an edu device (id %#x)\n", readl(hca.regs));
		return -ENODEV;
	}
	hca.pdev = pdev;
	dev_info(&pdev->dev, "edu DMA engine is the emulated HCA\n");
	return 0;
}

static void edu_remove(struct pci_dev *pdev)
{
	hca.pdev = NULL;
}

static const struct pci_device_id edu_ids[] = {
	{ PCI_DEVICE(0x1234, 0x11e8) },
	{ }
};
MODULE_DEVICE_TABLE(pci, edu_ids);

static struct pci_driver edu_driver = {
	.name = "peer_mem_core_hca",
	.id_table = edu_ids,
	.probe = edu_probe,
	.remove = edu_remove,
};

static int __init pmc_init(void)
{
	int err;

	mutex_init(&hca.lock);
	err = pci_register_driver(&edu_driver);
	if (err)
		return err;
	err = misc_register(&pmc_misc);
	if (err) {
		pci_unregister_driver(&edu_driver);
		return err;
	}
	dbg_dir = debugfs_create_dir("peer_mem_core", NULL);
	debugfs_create_file("fail_after_map", 0600, dbg_dir, NULL, &fail_after_map_fops);
	debugfs_create_file("hold_hca_lock_ms", 0200, dbg_dir, NULL, &hold_hca_lock_fops);
	return 0;
}

static void __exit pmc_exit(void)
{
	debugfs_remove_recursive(dbg_dir);
	misc_deregister(&pmc_misc);
	pci_unregister_driver(&edu_driver);
}

module_init(pmc_init);
module_exit(pmc_exit);
MODULE_DESCRIPTION("peermem-rs testbed: emulated OFED peer-memory core with an edu-based HCA");
MODULE_LICENSE("Dual MIT/GPL");
