// SPDX-License-Identifier: GPL-2.0 OR MIT
/*
 * C shim of nvidia_peermem: the parts the Rust side cannot express on 7.2
 * and 7.3, each C for the reason given; every decision (what to pin, map,
 * refuse, count or log) is taken in Rust, which calls these functions.
 *
 * - Kernel static inlines and macros: the DMA mapping calls with their
 *   attributes, dma_get_max_seg_size, device locks, refcount_inc_not_zero,
 *   the rate limit and the dynamic-debug call site (both macro-defined
 *   static state).
 * - Static kernel objects the kernel crate has no abstraction for, live
 *   before anything can use them and with nothing to pin: the module
 *   parameters (module_param: Rust module parameters have no sysfs file),
 *   the sysfs files (kobjects and attributes, one value per file; the
 *   kernel crate has none) and drain file, root's processes file and the
 *   test-only knob in debugfs, the PCI bus
 *   and module notifiers, the drain's registry (a kernel list under a
 *   spinlock) and its work, the registration cache (kmem_cache) and the reap
 *   list (llist) and its work.
 * - Kernel walks and reads the Rust bindings do not reach: the PCI device
 *   and bridge walks of the topology gate (for_each_pci_dev, ACS), the
 *   hypervisor the kernel detected (x86_hyper_type, dmi_walk), the GPU
 *   driver's params file, a process's name by pid (RCU).
 * - Late binding: a live module's export table, through the loader's own
 *   kernel-internal struct kernel_symbol (src/binding.rs).
 * - Compile-time checks of the shim's own structs that the Rust side mirrors
 *   (src/ffi.rs checks the same sizes and offsets, and the NVIDIA and
 *   peer-memory structs' x86_64 layout).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/debugfs.h>
#include <linux/device.h>
#include <linux/dmi.h>
#include <linux/fs.h>
#include <linux/iommu.h>
#include <linux/kobject.h>
#include <linux/llist.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/dynamic_debug.h>
#include <linux/dma-mapping.h>
#include <linux/pci.h>
#include <linux/pid.h>
#include <linux/pid_namespace.h>
#include <linux/rcupdate.h>
#include <linux/refcount.h>
#include <linux/sched.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/stddef.h>
#include <linux/sysfs.h>
#include <linux/workqueue.h>
#if defined(CONFIG_X86) && defined(CONFIG_HYPERVISOR_GUEST)
#include <asm/hypervisor.h>
#endif
/* The loader's struct kernel_symbol and kernel_symbol_value (late binding). */
#include <../kernel/module/internal.h>

struct pci_dev *peermem_peer_of(struct device *dev, u32 *id, unsigned int *max_seg);
bool peermem_dbg(const char *msg);
bool peermem_dbg_on(void);
int peermem_map_run(struct device *dev, u64 phys, u64 len, bool coherent, u64 *dma);
void peermem_unmap_run(struct device *dev, u64 dma, u64 len, bool coherent);
int peermem_reg_cache_create(size_t size, size_t align);
void peermem_reg_cache_destroy(void);
void *peermem_reg_alloc(void);
void peermem_reg_free(void *obj);
void peermem_reap_defer(struct llist_node *node);
void peermem_reap_flush(void);
void peermem_reap_one(struct llist_node *node);	/* Rust, src/registration/revoke.rs */
int peermem_watch_devices(void);
void peermem_unwatch_devices(void);
void peermem_device_unbound(u32 id);	/* Rust, src/accounting.rs */
bool peermem_known_peer(u32 id);	/* Rust, src/accounting.rs */

/* One bridge above a device, for the path classification in Rust. */
struct peermem_hop {
	u32 id;		/* domain << 16 | bus << 8 | devfn */
	u8 kind;	/* pci_pcie_type(): PCI_EXP_TYPE_*, 0 if not PCIe */
	u8 acs_redirect;
	u16 pad;
};

struct peermem_chain {
	u32 id;		/* the device itself */
	u32 root;	/* domain << 8 | root bus number: its host bridge */
	s32 numa;	/* NUMA node, or -1 */
	u32 nhops;
	struct peermem_hop hops[16];	/* nearest bridge first */
};

int peermem_gpu_by_phys(u64 phys, struct peermem_chain *out, u64 *bar_start, u64 *bar_end);
struct pci_dev *peermem_gate_candidate(u64 gpu_phys, bool near, unsigned int skip, bool *busy);
unsigned int peermem_platform(u64 gpu_phys);
int peermem_driver_override(void);
void peermem_gate_candidate_put(struct pci_dev *pdev);
bool peermem_ratelimit(void);
int peermem_chain_of(struct device *dev, struct peermem_chain *out);
void peermem_comm_of(u32 tgid, char *comm);
int peermem_param(unsigned int which);
int peermem_views_add(void);
void peermem_views_remove(void);
void peermem_dirs_kick(void);
void peermem_dirs_stop(void);
struct kobject *peermem_dir_add(unsigned int kind, const char *name);
/* Rust, src/views.rs */
const char *peermem_stat_file(unsigned int kind, unsigned int i);
ssize_t peermem_stat_show(unsigned int kind, const char *dir, unsigned int i, char *buf);
void peermem_dirs_sync(struct work_struct *work);
int peermem_processes_show(struct seq_file *m, void *v);
void peermem_module_live(struct module *mod);	/* Rust, src/binding.rs */
int peermem_drain_set(bool on);		/* Rust, src/drain.rs */
bool peermem_drain_requested(void);	/* Rust, src/drain.rs */
void peermem_drain_run(void);		/* Rust, src/drain.rs */
void peermem_registry_add(struct list_head *node);
unsigned long peermem_registry_del(struct list_head *node);
unsigned long peermem_registry_live(void);
void peermem_registry_walk(void (*visit)(struct list_head *node, void *arg), void *arg);
bool peermem_refcount_inc_not_zero(refcount_t *r);
void peermem_drain_kick(void);
void peermem_drain_cancel(void);
void *peermem_module_export(struct module *mod, const char *name);
struct module *peermem_exporter(const char *name);
int peermem_watch_modules(void);
void peermem_unwatch_modules(void);

/*
 * The module's parameters, with NVIDIA's names and meanings (560+). Declared
 * here so that each has its read-only file in
 * /sys/module/nvidia_peermem/parameters/, as NVIDIA's module does and as
 * operators and tools read them: Rust module parameters have none on 7.2
 * and 7.3. src/params.rs reads and checks them at load (peermem_param).
 * PEERMEM_PARAM: a read-only int parameter @name, @value unless given.
 */
#define PEERMEM_PARAM(name, value, desc)	\
	static int name = value;		\
	module_param(name, int, 0444);		\
	MODULE_PARM_DESC(name, desc)

PEERMEM_PARAM(persistent_api_support, 1, "1 [default]: one non-invalidating client nv_mem on persistent pins; 0: nv_mem invalidating on the free callback, plus nv_mem_nc non-invalidating");
PEERMEM_PARAM(peerdirect_support, 0, "0 [default]: extended client with PEER_MEM_INVALIDATE_UNMAPS; 1: legacy client for old cores (for example MLNX_OFED 4.9 LTS)");
PEERMEM_PARAM(path_policy, 0, "0 [default]: allow every GPU-peer PCIe path (paths through the root complex are logged as warnings); 1..5: refuse registrations whose path is worse than PIX, PXB, PHB, NODE, SYS (EPERM)");
PEERMEM_PARAM(allow_unverified_paths, 0, "0 [default]: where the GPU driver cannot be asked about a path (persistent pins refused: MIG, vGPU), the invalidating client applies the driver's topology rule to the platform it observes; 1: map every such path");
PEERMEM_PARAM(pair_table_slots, 64, "GPU-peer pairs tracked (1..64, default 64): per-pair counts in /sys/module/nvidia_peermem/stats/paths; a pair without a slot is classified at each registration");
PEERMEM_PARAM(path_accounting, 1, "1 [default]: count live registrations and pinned bytes per GPU-peer pair, GPU and process (/sys/module/nvidia_peermem/stats/paths, gpus, processes); 0: do not (path classification, its log line and path_policy stay)");

/* Writable by root at run time; 0..100 (param_set_uint_minmax). */
static unsigned int bar1_limit_pct = 80;

static int peermem_pct_set(const char *val, const struct kernel_param *kp)
{
	return param_set_uint_minmax(val, kp, 0, 100);
}

static const struct kernel_param_ops peermem_pct_ops = {
	.set = peermem_pct_set,
	.get = param_get_uint,
};
module_param_cb(bar1_limit_pct, &peermem_pct_ops, &bar1_limit_pct, 0644);
MODULE_PARM_DESC(bar1_limit_pct, "refuse a pin (ENOMEM) that would take a GPU's BAR1 use past this share of its BAR1 size, in percent (1..100, default 80: below the GPU driver's own reserve on a 256 MiB BAR1); 0: no limit");

/* The value of parameter @which, in the order of src/params.rs's Param. */
int peermem_param(unsigned int which)
{
	const int values[] = {
		persistent_api_support, peerdirect_support, path_policy,
		allow_unverified_paths, pair_table_slots, path_accounting,
		READ_ONCE(bar1_limit_pct),
	};

	return which < ARRAY_SIZE(values) ? values[which] : -1;
}

static u32 peermem_pci_id(struct pci_dev *pdev);

/*
 * The PCI device behind @dev, or NULL when @dev is not a PCI device; with its
 * PCI address (as in struct peermem_hop) and DMA segment limit
 * (dma_get_max_seg_size is static inline). One call per dma_map.
 */
struct pci_dev *peermem_peer_of(struct device *dev, u32 *id, unsigned int *max_seg)
{
	struct pci_dev *pdev;

	if (!dev || !dev_is_pci(dev))
		return NULL;
	pdev = to_pci_dev(dev);
	*id = peermem_pci_id(pdev);
	*max_seg = dma_get_max_seg_size(dev);
	return pdev;
}

/*
 * GPU BAR pages are MMIO: DMA-API debug's cacheline overlap accounting (for
 * kernel memory) does not apply, and many MRs on one GPU buffer legitimately
 * map the same BAR page many times.
 */
#ifdef DMA_ATTR_DEBUGGING_IGNORE_CACHELINES
#define PEERMEM_BAR_ATTRS DMA_ATTR_DEBUGGING_IGNORE_CACHELINES
#else
#define PEERMEM_BAR_ATTRS 0
#endif

/*
 * Coherent (C2C) GPU memory is cacheable system memory, not MMIO: mapped as
 * memory, never bounced through swiotlb nor left to cache maintenance that a
 * device accessing it at any time could not follow. DMA_ATTR_REQUIRE_COHERENT
 * (meant for RDMA) makes the mapping fail instead. Kernels without it refuse.
 */
#ifdef DMA_ATTR_REQUIRE_COHERENT
#define PEERMEM_C2C_ATTRS (DMA_ATTR_REQUIRE_COHERENT | DMA_ATTR_SKIP_CPU_SYNC | PEERMEM_BAR_ATTRS)
#endif

/*
 * Maps @len bytes at bus address @phys for DMA by @dev: a peer's BAR as the
 * GPU driver's nv_dma_map_peer() does (an IOVA under a translating IOMMU,
 * the bus address otherwise), or @coherent memory as memory. 0, -EIO, or
 * -EOPNOTSUPP for coherent memory on a kernel that cannot map it so.
 */
int peermem_map_run(struct device *dev, u64 phys, u64 len, bool coherent, u64 *dma)
{
	dma_addr_t a;

	if (!coherent)
		a = dma_map_resource(dev, phys, len, DMA_BIDIRECTIONAL, PEERMEM_BAR_ATTRS);
	else
#ifdef DMA_ATTR_REQUIRE_COHERENT
		a = dma_map_phys(dev, phys, len, DMA_BIDIRECTIONAL, PEERMEM_C2C_ATTRS);
#else
		return -EOPNOTSUPP;
#endif
	if (dma_mapping_error(dev, a))
		return -EIO;
	*dma = a;
	return 0;
}

void peermem_unmap_run(struct device *dev, u64 dma, u64 len, bool coherent)
{
#ifdef DMA_ATTR_REQUIRE_COHERENT
	if (coherent) {
		dma_unmap_phys(dev, dma, len, DMA_BIDIRECTIONAL, PEERMEM_C2C_ATTRS);
		return;
	}
#endif
	dma_unmap_resource(dev, dma, len, DMA_BIDIRECTIONAL, PEERMEM_BAR_ATTRS);
}

/*
 * The registration objects' cache and the reap list (src/registration/refs.rs).
 * The cache exists from the module's init, before its clients register, to
 * its exit, after every object is back: a plain static, set and cleared
 * where nothing else runs. A free callback that holds a registration's last
 * reference puts the object on the list instead of dropping it (the drop puts
 * a module reference, so it must not run in the callback); the work drops
 * them, and the module's exit flushes it once no callback can run.
 */
static struct kmem_cache *peermem_reg_cache;

int peermem_reg_cache_create(size_t size, size_t align)
{
	peermem_reg_cache = kmem_cache_create("nvidia_peermem_reg", size, align, 0, NULL);
	return peermem_reg_cache ? 0 : -ENOMEM;
}

void peermem_reg_cache_destroy(void)
{
	kmem_cache_destroy(peermem_reg_cache);
	peermem_reg_cache = NULL;
}

void *peermem_reg_alloc(void)
{
	return kmem_cache_alloc(peermem_reg_cache, GFP_KERNEL);
}

void peermem_reg_free(void *obj)
{
	kmem_cache_free(peermem_reg_cache, obj);
}

static LLIST_HEAD(peermem_reap_list);

static void peermem_reap_fn(struct work_struct *work)
{
	struct llist_node *node, *next;

	llist_for_each_safe(node, next, llist_del_all(&peermem_reap_list))
		peermem_reap_one(node);
}

static DECLARE_WORK(peermem_reap_work, peermem_reap_fn);

/* The first node on an empty list queues the work; it takes every node. */
void peermem_reap_defer(struct llist_node *node)
{
	if (llist_add(node, &peermem_reap_list))
		schedule_work(&peermem_reap_work);
}

/* Returns once the work neither runs nor is queued. */
void peermem_reap_flush(void)
{
	flush_work(&peermem_reap_work);
}

/*
 * A PCI device lost its driver: its records go (src/accounting.rs).
 * UNBOUND_DRIVER comes after the driver's remove; this notifier runs before
 * DMA-API debug's (priority 0), which reports mappings left at that point.
 */
static int peermem_bus_event(struct notifier_block *nb, unsigned long action, void *data)
{
	if (action == BUS_NOTIFY_UNBOUND_DRIVER)
		peermem_device_unbound(peermem_pci_id(to_pci_dev(data)));
	return NOTIFY_DONE;
}

static struct notifier_block peermem_bus_nb = {
	.notifier_call = peermem_bus_event,
	.priority = 1,
};

int peermem_watch_devices(void)
{
	return bus_register_notifier(&pci_bus_type, &peermem_bus_nb);
}

void peermem_unwatch_devices(void)
{
	bus_unregister_notifier(&pci_bus_type, &peermem_bus_nb);
}

/*
 * The operator's files, one value each (src/views.rs names them), in
 * /sys/module/nvidia_peermem/stats/: counters/<name> and waiting_for, and a
 * directory per GPU (gpus/<gpu>/) and per GPU/peer pair (paths/<gpu>-<peer>/),
 * made and removed by a work item (src/views.rs, peermem_dirs_sync) as the
 * records under the tables' spinlock come and go. Kinds: 0 counters,
 * 1 waiting_for, 2 a GPU's files, 3 a pair's. The kernel crate has no
 * kobject or sysfs attributes.
 */
struct peermem_attr {
	struct kobj_attribute ka;
	unsigned int kind, i;
};

static struct attribute_group peermem_groups[4] = { { .name = "counters" } };
static struct kobject *peermem_stats, *peermem_parents[2];	/* gpus, paths */
static bool peermem_dirs_on;

static DECLARE_WORK(peermem_dirs_work, peermem_dirs_sync);

/*
 * A read of a counter returns once the directories follow the records added
 * or freed before it: what reads the counters first lists them as they are.
 */
static ssize_t peermem_attr_show(struct kobject *kobj, struct kobj_attribute *ka, char *buf)
{
	struct peermem_attr *a = container_of(ka, struct peermem_attr, ka);

	if (a->kind == 0)
		flush_work(&peermem_dirs_work);
	return peermem_stat_show(a->kind, kobject_name(kobj), a->i, buf);
}

/* The files of each kind, as src/views.rs names them. */
static int peermem_groups_build(void)
{
	for (unsigned int k = 0; k < ARRAY_SIZE(peermem_groups); k++) {
		unsigned int n = 0;
		struct attribute **list;
		struct peermem_attr *a;

		while (peermem_stat_file(k, n))
			n++;
		/* The list, NULL-terminated, then the files. */
		list = kzalloc((n + 1) * sizeof(*list) + n * sizeof(*a), GFP_KERNEL);
		if (!list)
			return -ENOMEM;
		a = (struct peermem_attr *)(list + n + 1);
		for (unsigned int i = 0; i < n; i++) {
			a[i] = (struct peermem_attr){ .kind = k, .i = i, .ka = {
				.attr = { .name = peermem_stat_file(k, i), .mode = 0444 },
				.show = peermem_attr_show } };
			/* Lockdep: the counters' reads wait for the removal of the others. */
			if (k < 2)
				sysfs_attr_init(&a[i].ka.attr);
			else
				sysfs_attr_init(&a[i].ka.attr);
			list[i] = &a[i].ka.attr;
		}
		peermem_groups[k].attrs = list;
	}
	return 0;
}

void peermem_dirs_kick(void)
{
	if (smp_load_acquire(&peermem_dirs_on))
		queue_work(system_dfl_wq, &peermem_dirs_work);
}

void peermem_dirs_stop(void)
{
	disable_work_sync(&peermem_dirs_work);
}

struct kobject *peermem_dir_add(unsigned int kind, const char *name)
{
	struct kobject *k = kobject_create_and_add(name, peermem_parents[kind - 2]);

	if (k && sysfs_create_group(k, &peermem_groups[kind])) {
		kobject_put(k);
		k = NULL;
	}
	return k;
}

/* nvidia_peermem/processes in debugfs: root's (0400), readable under lockdown. */
DEFINE_SHOW_ATTRIBUTE(peermem_processes);

/*
 * Tests present the guest as bare metal (1) or a virtual machine (2) to the
 * topology rule (peermem_passthrough), which QEMU under TCG cannot show to
 * RM's detection; 0 [default]: observe. debugfs, root only.
 */
static u32 peermem_present_vm;
static struct dentry *peermem_debugfs;

/*
 * /sys/module/nvidia_peermem/drain (src/drain.rs): 1 drains the module
 * (root only), 0 resumes; reads as the last value written.
 */
static ssize_t peermem_drain_show(const struct module_attribute *attr, struct module_kobject *mk,
				  char *buf)
{
	return sysfs_emit(buf, "%d\n", peermem_drain_requested());
}

static ssize_t peermem_drain_store(const struct module_attribute *attr, struct module_kobject *mk,
				   const char *buf, size_t count)
{
	bool on;
	int err = kstrtobool(buf, &on);

	if (!err)
		err = peermem_drain_set(on);
	return err ? err : count;
}

static struct module_attribute peermem_drain_attr =
	__ATTR(drain, 0644, peermem_drain_show, peermem_drain_store);

int peermem_views_add(void)
{
	struct kobject *mod = &THIS_MODULE->mkobj.kobj;
	int err = peermem_groups_build();

	peermem_debugfs = debugfs_create_dir(KBUILD_MODNAME, NULL);
	debugfs_create_u32("present_vm", 0600, peermem_debugfs, &peermem_present_vm);
	debugfs_create_file("processes", 0400, peermem_debugfs, NULL, &peermem_processes_fops);
	peermem_stats = err ? NULL : kobject_create_and_add("stats", mod);
	if (peermem_stats) {
		peermem_parents[0] = kobject_create_and_add("gpus", peermem_stats);
		peermem_parents[1] = kobject_create_and_add("paths", peermem_stats);
	}
	if (!peermem_parents[0] || !peermem_parents[1] ||
	    sysfs_create_group(peermem_stats, &peermem_groups[0]) ||
	    sysfs_create_group(peermem_stats, &peermem_groups[1]) ||
	    sysfs_create_file(mod, &peermem_drain_attr.attr)) {
		peermem_views_remove();
		return err ?: -ENOMEM;
	}
	smp_store_release(&peermem_dirs_on, true);
	return 0;
}

/*
 * Returns once no read of a file or write of drain runs (kernfs drains them).
 * Also undoes a peermem_views_add that failed half-way (what it did not add
 * is NULL or absent).
 */
void peermem_views_remove(void)
{
	sysfs_remove_file(&THIS_MODULE->mkobj.kobj, &peermem_drain_attr.attr);
	for (int i = 0; i < ARRAY_SIZE(peermem_parents); i++)
		kobject_put(peermem_parents[i]);
	kobject_put(peermem_stats);	/* with its groups */
	for (int k = 0; k < ARRAY_SIZE(peermem_groups); k++)
		kfree(peermem_groups[k].attrs);
	debugfs_remove_recursive(peermem_debugfs);
}

/*
 * The drain's registry (src/registration/registry.rs): every registration
 * object is on one kernel list from its acquire until it is freed, so that a
 * drain can revoke the live ones and name their holders. One spinlock, one
 * O(1) section at each end of a registration; the walk calls back into Rust
 * under it, and the callback only takes references
 * (refcount_inc_not_zero: an object whose count reached zero is about to
 * leave the list). The work completes a drain once the last object left.
 */
static LIST_HEAD(peermem_regs);
static DEFINE_SPINLOCK(peermem_regs_lock);
static unsigned long peermem_regs_live;

void peermem_registry_add(struct list_head *node)
{
	spin_lock(&peermem_regs_lock);
	list_add_tail(node, &peermem_regs);
	peermem_regs_live++;
	spin_unlock(&peermem_regs_lock);
}

/* Returns how many objects are left on the list. */
unsigned long peermem_registry_del(struct list_head *node)
{
	unsigned long left;

	spin_lock(&peermem_regs_lock);
	list_del(node);
	left = --peermem_regs_live;
	spin_unlock(&peermem_regs_lock);
	return left;
}

/* Under the lock: an object put on the list before it is counted. */
unsigned long peermem_registry_live(void)
{
	unsigned long n;

	spin_lock(&peermem_regs_lock);
	n = peermem_regs_live;
	spin_unlock(&peermem_regs_lock);
	return n;
}

void peermem_registry_walk(void (*visit)(struct list_head *node, void *arg), void *arg)
{
	struct list_head *node;

	spin_lock(&peermem_regs_lock);
	list_for_each(node, &peermem_regs)
		visit(node, arg);
	spin_unlock(&peermem_regs_lock);
}

/* No Rust binding in 7.3 (rust/kernel/sync/refcount.rs). */
bool peermem_refcount_inc_not_zero(refcount_t *r)
{
	return refcount_inc_not_zero(r);
}

static void peermem_drain_fn(struct work_struct *work)
{
	peermem_drain_run();
}

static DECLARE_WORK(peermem_drain_work, peermem_drain_fn);

void peermem_drain_kick(void)
{
	schedule_work(&peermem_drain_work);
}

/* Returns once the work neither runs nor is queued. */
void peermem_drain_cancel(void)
{
	cancel_work_sync(&peermem_drain_work);
}

/*
 * Late binding (src/binding.rs): the peer-memory core's and the GPU driver's
 * entry points are taken from whichever module exports them, when it is live,
 * not linked at load. symbol_get() cannot do it: since 6.5 it takes only
 * EXPORT_SYMBOL_GPL symbols (__symbol_get, kernel/module/main.c), and both
 * export theirs with EXPORT_SYMBOL; the loader's find_symbol() and module
 * list are not exported. So the shim reads a live module's export table
 * itself, with the loader's own struct kernel_symbol (PREL32 offsets; a
 * kernel-internal header Rust cannot include). Modules loaded before this one
 * are found through /sys/module (the kset of our own kobject: module_kset is
 * not exported), later ones through a module notifier at MODULE_STATE_LIVE.
 * The offers are serialised in Rust (src/binding.rs's state lock).
 */
static const char *peermem_symbol_name(const struct kernel_symbol *sym)
{
#ifdef CONFIG_HAVE_ARCH_PREL32_RELOCATIONS
	return offset_to_ptr(&sym->name_offset);
#else
	return sym->name;
#endif
}

/* The address @mod exports as @name, or NULL. @mod must stay (a reference). */
void *peermem_module_export(struct module *mod, const char *name)
{
	unsigned int i;

	for (i = 0; i < mod->num_syms; i++)
		if (!strcmp(peermem_symbol_name(&mod->syms[i]), name))
			return (void *)kernel_symbol_value(&mod->syms[i]);
	return NULL;
}

/*
 * The live module (not this one) that exports @name, with a reference
 * (module_put), or NULL. Under the kset's lock a listed module's kobject is
 * not released, and free_module() waits for that release: the module stays
 * until try_module_get() succeeds or not.
 */
struct module *peermem_exporter(const char *name)
{
	struct kset *kset = THIS_MODULE->mkobj.kobj.kset;
	const struct kobj_type *ktype = THIS_MODULE->mkobj.kobj.ktype;
	struct module *found = NULL;
	struct kobject *k;

	spin_lock(&kset->list_lock);
	list_for_each_entry(k, &kset->list, entry) {
		struct module *mod = container_of(k, struct module_kobject, kobj)->mod;

		if (k->ktype != ktype || !mod || mod == THIS_MODULE ||
		    READ_ONCE(mod->state) != MODULE_STATE_LIVE || !peermem_module_export(mod, name))
			continue;
		if (try_module_get(mod))
			found = mod;
		break;
	}
	spin_unlock(&kset->list_lock);
	return found;
}

static int peermem_module_event(struct notifier_block *nb, unsigned long state, void *data)
{
	if (state == MODULE_STATE_LIVE && data != THIS_MODULE)
		peermem_module_live(data);
	return NOTIFY_DONE;
}

static struct notifier_block peermem_module_nb = {
	.notifier_call = peermem_module_event,
};

int peermem_watch_modules(void)
{
	return register_module_notifier(&peermem_module_nb);
}

/* Returns once no notification runs. */
void peermem_unwatch_modules(void)
{
	unregister_module_notifier(&peermem_module_nb);
}

static u32 peermem_pci_id(struct pci_dev *pdev)
{
	return (u32)pci_domain_nr(pdev->bus) << 16 | (u32)pdev->bus->number << 8 | pdev->devfn;
}

/* Whether @bridge redirects peer requests or completions upstream (ACS). */
static bool peermem_acs_redirect(struct pci_dev *bridge)
{
	int pos = pci_find_ext_capability(bridge, PCI_EXT_CAP_ID_ACS);
	u16 ctrl = 0;

	if (!pos)
		return false;
	pci_read_config_word(bridge, pos + PCI_ACS_CTRL, &ctrl);
	return ctrl & (PCI_ACS_RR | PCI_ACS_CR);
}

static void peermem_fill_chain(struct pci_dev *pdev, struct peermem_chain *out)
{
	struct pci_dev *up = pci_upstream_bridge(pdev);
	struct pci_bus *root = pdev->bus;

	while (root->parent)
		root = root->parent;
	out->id = peermem_pci_id(pdev);
	out->root = (u32)pci_domain_nr(root) << 8 | root->number;
	out->numa = dev_to_node(&pdev->dev);
	out->nhops = 0;
	for (; up && out->nhops < ARRAY_SIZE(out->hops); up = pci_upstream_bridge(up)) {
		struct peermem_hop *h = &out->hops[out->nhops++];

		h->id = peermem_pci_id(up);
		h->acs_redirect = peermem_acs_redirect(up);
		h->kind = pci_is_pcie(up) ? pci_pcie_type(up) : 0;
	}
}

/*
 * The PCI device one of whose memory BARs holds bus address @phys, with a
 * reference, and that BAR (if @bar); NULL if none.
 */
static struct pci_dev *peermem_pci_by_phys(u64 phys, struct resource **bar)
{
	struct pci_dev *pdev = NULL;

	for_each_pci_dev(pdev) {
		for (int i = 0; i < PCI_STD_NUM_BARS; i++) {
			struct resource *r = &pdev->resource[i];

			if (!(r->flags & IORESOURCE_MEM) || !r->start)
				continue;
			if (phys < r->start || phys > r->end)
				continue;
			if (bar)
				*bar = r;
			return pdev;
		}
	}
	return NULL;
}

/*
 * The PCI device one of whose memory BARs holds bus address @phys (a GPU's
 * BAR1 page), its upstream path, and the BAR's range. 0 or -ENODEV.
 */
int peermem_gpu_by_phys(u64 phys, struct peermem_chain *out, u64 *bar_start, u64 *bar_end)
{
	struct resource *bar;
	struct pci_dev *pdev = peermem_pci_by_phys(phys, &bar);

	if (!pdev)
		return -ENODEV;
	*bar_start = bar->start;
	*bar_end = bar->end;
	peermem_fill_chain(pdev, out);
	pci_dev_put(pdev);
	return 0;
}

/* What the GPU driver's gate asks (nv_pci_has_common_pci_switch, nv-pci.c). */
static bool peermem_common_bridge(struct pci_dev *a, struct pci_dev *b)
{
	for (struct pci_dev *x = pci_upstream_bridge(a); x; x = pci_upstream_bridge(x))
		for (struct pci_dev *y = pci_upstream_bridge(b); y; y = pci_upstream_bridge(y))
			if (x == y)
				return true;
	return false;
}

/*
 * Whether the DMA API may be used on @pdev, locked by the caller: a bound
 * bus master, not a bridge, whose driver does not own the device's IOMMU
 * domain itself (vfio).
 */
static bool peermem_dma_capable(struct pci_dev *pdev)
{
	const struct device_driver *drv = pdev->dev.driver;

	return drv && pdev->is_busmaster && !pci_is_bridge(pdev) &&
	       !to_pci_driver(drv)->driver_managed_dma;
}

static int peermem_is_rdma_device(struct device *dev, void *unused)
{
	return dev->class && !strcmp(dev->class->name, "infiniband");
}

/*
 * An RDMA peer: a device an RDMA driver registered an RDMA device on (its
 * parent in /sys/class/infiniband), or (pass 1) one the core handed to one
 * of our clients as a registration's dma_device.
 */
static bool peermem_rdma_peer(struct pci_dev *pdev, int pass)
{
	if (pass == 1)
		return peermem_known_peer(peermem_pci_id(pdev));
	return device_for_each_child(&pdev->dev, NULL, peermem_is_rdma_device);
}

struct pci_dev *peermem_gate_candidate(u64 gpu_phys, bool near, unsigned int skip, bool *busy)
{
	struct pci_dev *gpu = peermem_pci_by_phys(gpu_phys, NULL);

	if (!gpu)
		return NULL;
	for (int pass = 0; pass < 2; pass++) {
		struct pci_dev *pdev = NULL;

		for_each_pci_dev(pdev) {
			if (pdev == gpu || !peermem_rdma_peer(pdev, pass) ||
			    (pass == 1 && peermem_rdma_peer(pdev, 0)) ||
			    peermem_common_bridge(gpu, pdev) != near)
				continue;
			/* Its driver stays while the GPU driver maps for it. */
			if (!device_trylock(&pdev->dev)) {
				*busy = true;
				continue;
			}
			if (peermem_dma_capable(pdev) && skip-- == 0) {
				pci_dev_put(gpu);
				return pdev;	/* for_each_pci_dev's reference */
			}
			device_unlock(&pdev->dev);
		}
	}
	pci_dev_put(gpu);
	return NULL;
}

void peermem_gate_candidate_put(struct pci_dev *pdev)
{
	device_unlock(&pdev->dev);
	pci_dev_put(pdev);
}

/*
 * What the GPU driver's topology rule reads of the platform (src/path.rs
 * Platform), observed as RM observes it (docs/design.md, "The topology
 * gate"). Rust cannot reach x86_hyper_type's header, dmi_walk's callback
 * type or the PCI device walk.
 */
#define PEERMEM_PASSTHROUGH	1
#define PEERMEM_FLAGGED_CHIPSET	2

#ifdef CONFIG_ARM64
/* RM on arm64: SMBIOS type 0, BIOS characteristics extension byte 2, bit 4. */
static void peermem_dmi_vm(const struct dmi_header *dm, void *vm)
{
	if (dm->type == 0 && dm->length > 0x13 && (((const u8 *)dm)[0x13] & BIT(4)))
		*(bool *)vm = true;
}
#endif

/* RM's IS_PASSTHRU: a hypervisor it knows (hypervisor.c), the GPU no vGPU. */
static bool peermem_passthrough(void)
{
	bool vm = false;

	if (peermem_present_vm)
		return peermem_present_vm == 2;
#if defined(CONFIG_X86) && defined(CONFIG_HYPERVISOR_GUEST)
	/* The kernel's detection: the same CPUID signatures RM looks for. */
	switch (x86_hyper_type) {
	case X86_HYPER_KVM:
	case X86_HYPER_XEN_HVM:
	case X86_HYPER_XEN_PV:
	case X86_HYPER_MS_HYPERV:
	case X86_HYPER_VMWARE:
		vm = true;
		break;
	default:
		break;
	}
#elif defined(CONFIG_ARM64)
	dmi_walk(peermem_dmi_vm, &vm);
#endif
	return vm;
}

/*
 * Root complexes RM flags as unable to forward peer-to-peer traffic
 * (_checkP2pChipsetSupport, osinit.c, found by objClInitPcieChipset in the
 * GPU's PCI domain): NVIDIA Grace (TH500), Ampere Altra and AmpereOne.
 */
static const struct pci_device_id peermem_flagged_chipsets[] = {
	{ PCI_VDEVICE(NVIDIA, 0x22b1) }, { PCI_VDEVICE(NVIDIA, 0x22b2) },
	{ PCI_VDEVICE(NVIDIA, 0x22b3) }, { PCI_VDEVICE(NVIDIA, 0x22b4) },
	{ PCI_VDEVICE(NVIDIA, 0x22b8) }, { PCI_VDEVICE(NVIDIA, 0x22b9) },
	{ PCI_DEVICE(0x1def, 0xe000) }, { PCI_DEVICE(0x1def, 0xe00d) },
	{ PCI_DEVICE(0x1def, 0xe00e) }, { PCI_DEVICE(0x1def, 0xe010) },
	{ PCI_DEVICE(0x1def, 0xe100) }, { PCI_DEVICE(0x1def, 0xe110) },
	{ PCI_DEVICE(0x1def, 0xe200) }, { PCI_DEVICE(0x1def, 0xe201) },
	{ PCI_DEVICE(0x1def, 0xe202) }, { PCI_DEVICE(0x1def, 0xe203) },
	{ PCI_DEVICE(0x1def, 0xe204) }, { PCI_DEVICE(0x1def, 0xe205) },
	{ PCI_DEVICE(0x1def, 0xe206) }, { PCI_DEVICE(0x1def, 0xe207) },
	{ }
};

unsigned int peermem_platform(u64 gpu_phys)
{
	struct pci_dev *gpu = peermem_pci_by_phys(gpu_phys, NULL), *pdev = NULL;
	unsigned int seen = peermem_passthrough() ? PEERMEM_PASSTHROUGH : 0;

	if (!gpu)
		return seen;
	for_each_pci_dev(pdev) {
		if (pci_domain_nr(pdev->bus) == pci_domain_nr(gpu->bus) &&
		    pci_match_id(peermem_flagged_chipsets, pdev)) {
			seen |= PEERMEM_FLAGGED_CHIPSET;
			pci_dev_put(pdev);
			break;
		}
	}
	pci_dev_put(gpu);
	return seen;
}

/*
 * NVreg_GrdmaPciTopoCheckOverride: a module parameter of nvidia.ko without a
 * sysfs file and not exported; the driver shows it in its params file
 * (nv-procfs.c), the one place it can be read. -1 if it cannot.
 */
int peermem_driver_override(void)
{
	static const char key[] = "\nGrdmaPciTopoCheckOverride: ";
	const size_t size = 16384;
	struct file *f = filp_open("/proc/driver/nvidia/params", O_RDONLY, 0);
	loff_t pos = 0;
	ssize_t n, len = 1;
	char *buf, *at;
	unsigned int v;
	int ret = -1;

	if (IS_ERR(f))
		return -1;
	buf = kzalloc(size, GFP_KERNEL);
	if (buf) {
		buf[0] = '\n';	/* the key's newline, for the first line */
		while (len < size - 1 && (n = kernel_read(f, buf + len, size - 1 - len, &pos)) > 0)
			len += n;
		at = strstr(buf, key);
		if (at && sscanf(at + sizeof(key) - 1, "%u", &v) == 1)
			ret = min(v, (unsigned int)INT_MAX);
		kfree(buf);
	}
	filp_close(f, NULL);
	return ret;
}

bool peermem_ratelimit(void)
{
	static DEFINE_RATELIMIT_STATE(rs, DEFAULT_RATELIMIT_INTERVAL, DEFAULT_RATELIMIT_BURST);

	return __ratelimit(&rs);
}

/*
 * The name of process @tgid (a pid of the initial namespace, as task->pid),
 * TASK_COMM_LEN bytes, NUL-padded; all zero when it has exited.
 */
void peermem_comm_of(u32 tgid, char *comm)
{
	struct task_struct *t;

	memset(comm, 0, TASK_COMM_LEN);
	rcu_read_lock();
	t = pid_task(find_pid_ns(tgid, &init_pid_ns), PIDTYPE_TGID);
	if (t)
		strscpy_pad(comm, t->comm, TASK_COMM_LEN);
	rcu_read_unlock();
}

/*
 * The upstream path of the PCI device behind @dev, and how the IOMMU treats
 * its DMA: 0 none, 1 identity, 2 DMA, 3 DMA-FQ, 4 other; or -ENODEV.
 */
int peermem_chain_of(struct device *dev, struct peermem_chain *out)
{
	struct iommu_domain *d;

	if (!dev || !dev_is_pci(dev))
		return -ENODEV;
	peermem_fill_chain(to_pci_dev(dev), out);
	d = iommu_get_domain_for_dev(dev);
	if (!d)
		return 0;
	switch (d->type) {
	case IOMMU_DOMAIN_IDENTITY:
		return 1;
	case IOMMU_DOMAIN_DMA:
		return 2;
	case IOMMU_DOMAIN_DMA_FQ:
		return 3;
	default:
		return 4;
	}
}

/*
 * Per-registration detail goes through one dynamic-debug call site, so that
 * `echo 'module nvidia_peermem +p' > .../dynamic_debug/control` turns it on
 * (Rust's pr_debug! is compiled in only with debug assertions).
 */
#if defined(CONFIG_DYNAMIC_DEBUG) || \
	(defined(CONFIG_DYNAMIC_DEBUG_CORE) && defined(DYNAMIC_DEBUG_MODULE))
bool peermem_dbg(const char *msg)
{
	DEFINE_DYNAMIC_DEBUG_METADATA(site, "%s\n");

	if (!DYNAMIC_DEBUG_BRANCH(site))
		return false;
	if (msg)
		__dynamic_pr_debug(&site, pr_fmt("%s\n"), msg);
	return true;
}
#else
bool peermem_dbg(const char *msg)
{
	if (msg)
		pr_debug("%s\n", msg);
	return IS_ENABLED(DEBUG);
}
#endif

/* Whether the module's dynamic-debug call site is enabled. */
bool peermem_dbg_on(void)
{
	return peermem_dbg(NULL);
}

static_assert(sizeof(struct peermem_hop) == 8);
static_assert(sizeof(struct peermem_chain) == 16 + 16 * 8);
static_assert(offsetof(struct peermem_chain, hops) == 16);
