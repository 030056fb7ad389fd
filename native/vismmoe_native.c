/*
 * vismmoe_native: page-cache mechanics for mmapped expert shards (notes/linux-io.md).
 *
 * A plain C shared object with no Python API: vismmoe_edge/pagecache.py loads it with ctypes, which
 * releases the GIL for the whole call. Every function returns 0 (or a count) on success and -errno on
 * failure. Ranges are (offset, length) byte pairs relative to a mapping base or a file start; hint,
 * residency and lock calls work on the page span of each range (start rounded down, end rounded up).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

/* Bumped whenever a signature changes; the loader refuses a stale build. */
#define VM_ABI_VERSION 1
/* mincore vector size per call: 64 Ki pages = 256 MiB of 4 KiB pages. */
#define VM_MINCORE_BATCH 65536u
/* Scratch buffer cap per thread for page-cache-only reads. */
#define VM_SCRATCH_MAX (8u << 20)

int vm_abi_version(void) { return VM_ABI_VERSION; }

static uint64_t vm_page(void) {
    static uint64_t page;
    if (page == 0) page = (uint64_t)sysconf(_SC_PAGESIZE);
    return page;
}

static uint64_t round_down(uint64_t x, uint64_t a) { return x - x % a; }
static uint64_t round_up(uint64_t x, uint64_t a) { return round_down(x + a - 1, a); }

/* The page span [*start, *end) of a byte range; empty for a zero length. */
static void page_span(uint64_t off, uint64_t len, uint64_t *start, uint64_t *end) {
    uint64_t p = vm_page();
    *start = round_down(off, p);
    *end = len ? round_up(off + len, p) : *start;
}

/* Chunk size rounded up to whole pages; 0 means "the whole span in one call". */
static uint64_t chunk_pages(uint64_t chunk) { return chunk ? round_up(chunk, vm_page()) : UINT64_MAX; }

/* ------------------------------------------------------------------------------------------------ */
/* Residency (mincore: page-cache residency for file VMAs; all-ones for non-owners, linux-io §4.1)   */
/* ------------------------------------------------------------------------------------------------ */

/* Per-page residency (0/1) of the page span of [offset, offset+length) into vec (one byte a page). */
int vm_residency_map(const void *base, uint64_t offset, uint64_t length, unsigned char *vec) {
    uint64_t start, end, p = vm_page();
    page_span(offset, length, &start, &end);
    uint64_t pages = (end - start) / p;
    if (pages && mincore((char *)base + start, end - start, vec) != 0) return -errno;
    for (uint64_t i = 0; i < pages; i++) vec[i] &= 1; /* only the LSB is defined */
    return 0;
}

/* Resident page count of each range's page span. */
int vm_residency_ranges(const void *base, const uint64_t *offsets, const uint64_t *lengths, int n,
                        int64_t *out_pages) {
    uint64_t p = vm_page();
    unsigned char *vec = malloc(VM_MINCORE_BATCH);
    if (!vec) return -ENOMEM;
    for (int i = 0; i < n; i++) {
        uint64_t start, end;
        int64_t count = 0;
        page_span(offsets[i], lengths[i], &start, &end);
        for (uint64_t s = start; s < end;) {
            uint64_t len = end - s < (uint64_t)VM_MINCORE_BATCH * p ? end - s : (uint64_t)VM_MINCORE_BATCH * p;
            if (mincore((char *)base + s, len, vec) != 0) {
                int err = errno;
                free(vec);
                return -err;
            }
            for (uint64_t k = 0; k < len / p; k++) count += vec[k] & 1;
            s += len;
        }
        out_pages[i] = count;
    }
    free(vec);
    return 0;
}

/* Single-range form: resident pages of [addr, addr+len). */
int vm_residency(const void *addr, size_t len, int *out_resident_pages) {
    uint64_t off = (uint64_t)(uintptr_t)addr % vm_page(), length = len;
    int64_t pages = 0;
    int rc = vm_residency_ranges((const char *)addr - off, &off, &length, 1, &pages);
    if (rc == 0) *out_resident_pages = (int)pages;
    return rc;
}

/* ------------------------------------------------------------------------------------------------ */
/* Hints: one call per chunk, since one WILLNEED reads at most max(read_ahead_kb, max_sectors_kb)     */
/* (force_page_cache_ra clamp, linux-io §3).                                                         */
/* ------------------------------------------------------------------------------------------------ */

int vm_advise_ranges(void *base, const uint64_t *offsets, const uint64_t *lengths, int n, int advice,
                     uint64_t chunk) {
    uint64_t step = chunk_pages(chunk);
    for (int i = 0; i < n; i++) {
        uint64_t start, end;
        page_span(offsets[i], lengths[i], &start, &end);
        for (uint64_t s = start; s < end; s += (end - s < step ? end - s : step)) {
            uint64_t len = end - s < step ? end - s : step;
            if (madvise((char *)base + s, len, advice) != 0) return -errno;
        }
    }
    return 0;
}

int vm_fadvise_ranges(int fd, const uint64_t *offsets, const uint64_t *lengths, int n, int advice,
                      uint64_t chunk) {
    uint64_t step = chunk_pages(chunk);
    for (int i = 0; i < n; i++) {
        uint64_t start, end;
        page_span(offsets[i], lengths[i], &start, &end);
        for (uint64_t s = start; s < end; s += (end - s < step ? end - s : step)) {
            uint64_t len = end - s < step ? end - s : step;
            int rc = posix_fadvise(fd, (off_t)s, (off_t)len, advice); /* returns the error, not -1 */
            if (rc != 0) return -rc;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* pread worker pool: ranges split into chunks so that several threads share one big expert.        */
/* ------------------------------------------------------------------------------------------------ */

struct vm_task {
    uint64_t offset;
    uint64_t length;
    char *dest; /* NULL: read into the thread's scratch buffer, only to fill the page cache */
};

struct vm_pool {
    int fd;
    struct vm_task *tasks;
    size_t ntasks;
    size_t next;  /* atomic: index of the next task to take */
    int error;    /* atomic: first -errno seen; workers stop once it is set */
    uint64_t scratch_size;
};

/* pread until done, retrying EINTR and short reads; an early EOF is -EIO. */
static int read_full(int fd, char *buf, uint64_t len, uint64_t off) {
    while (len) {
        ssize_t r = pread(fd, buf, len, (off_t)off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) return -EIO;
        buf += r;
        off += (uint64_t)r;
        len -= (uint64_t)r;
    }
    return 0;
}

static int run_task(struct vm_pool *pool, const struct vm_task *t, char **scratch) {
    if (t->dest) return read_full(pool->fd, t->dest, t->length, t->offset);
    if (!*scratch && posix_memalign((void **)scratch, vm_page(), pool->scratch_size) != 0) return -ENOMEM;
    for (uint64_t done = 0; done < t->length;) {
        uint64_t len = t->length - done < pool->scratch_size ? t->length - done : pool->scratch_size;
        int rc = read_full(pool->fd, *scratch, len, t->offset + done);
        if (rc) return rc;
        done += len;
    }
    return 0;
}

static void *worker(void *arg) {
    struct vm_pool *pool = arg;
    char *scratch = NULL;
    for (;;) {
        if (__atomic_load_n(&pool->error, __ATOMIC_RELAXED)) break;
        size_t i = __atomic_fetch_add(&pool->next, 1, __ATOMIC_RELAXED);
        if (i >= pool->ntasks) break;
        int rc = run_task(pool, &pool->tasks[i], &scratch);
        if (rc) {
            int expected = 0;
            __atomic_compare_exchange_n(&pool->error, &expected, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        }
    }
    free(scratch);
    return NULL;
}

/* Tasks for all ranges: each range split into chunk-byte pieces from its own start (0 = no split). */
static size_t build_tasks(const uint64_t *offsets, const uint64_t *lengths, int n, void **dests, uint64_t chunk,
                          struct vm_task *out) {
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        char *dest = dests ? dests[i] : NULL;
        uint64_t step = chunk ? chunk : (lengths[i] ? lengths[i] : 1);
        for (uint64_t done = 0; done < lengths[i]; done += step) {
            uint64_t len = lengths[i] - done < step ? lengths[i] - done : step;
            if (out) out[k] = (struct vm_task){offsets[i] + done, len, dest ? dest + done : NULL};
            k++;
        }
    }
    return k;
}

int vm_pread_ranges(int fd, const uint64_t *offsets, const uint64_t *lengths, int n, void **dests, int threads,
                    uint64_t chunk) {
    struct vm_pool pool = {.fd = fd};
    pool.ntasks = build_tasks(offsets, lengths, n, dests, chunk, NULL);
    if (pool.ntasks == 0) return 0;
    pool.tasks = malloc(pool.ntasks * sizeof *pool.tasks);
    if (!pool.tasks) return -ENOMEM;
    build_tasks(offsets, lengths, n, dests, chunk, pool.tasks);
    pool.scratch_size = chunk && chunk < VM_SCRATCH_MAX ? round_up(chunk, vm_page()) : VM_SCRATCH_MAX;

    size_t want = threads > 1 ? (size_t)threads : 1;
    if (want > pool.ntasks) want = pool.ntasks;
    pthread_t *ids = want > 1 ? calloc(want - 1, sizeof *ids) : NULL;
    size_t started = 0;
    for (; ids && started < want - 1; started++)
        if (pthread_create(&ids[started], NULL, worker, &pool) != 0) break; /* fewer threads is fine */
    worker(&pool); /* the calling thread works too */
    for (size_t i = 0; i < started; i++) pthread_join(ids[i], NULL);
    free(ids);
    free(pool.tasks);
    return pool.error;
}

/* ------------------------------------------------------------------------------------------------ */
/* RWF_NOWAIT residency probe: correct for non-owners; a miss starts an async read (linux-io §4.3).  */
/* ------------------------------------------------------------------------------------------------ */

/* out[i] = 1 if the page holding offsets[i] is cached, else 0. */
int vm_probe_nowait(int fd, const uint64_t *offsets, int n, unsigned char *out) {
#ifdef RWF_NOWAIT
    struct stat st;
    uint64_t p = vm_page();
    if (fstat(fd, &st) != 0) return -errno;
    char *buf;
    if (posix_memalign((void **)&buf, p, p) != 0) return -ENOMEM;
    for (int i = 0; i < n; i++) {
        uint64_t off = round_down(offsets[i], p);
        uint64_t want = (uint64_t)st.st_size > off ? (uint64_t)st.st_size - off : 0;
        if (want > p) want = p;
        struct iovec iov = {buf, p};
        ssize_t r = preadv2(fd, &iov, 1, (off_t)off, RWF_NOWAIT);
        if (r < 0 && errno != EAGAIN) {
            int err = errno;
            free(buf);
            return -err;
        }
        /* 5.9/5.10 may return 0 instead of EAGAIN: counted as a miss, which is the safe answer. */
        out[i] = r > 0 && (uint64_t)r >= want;
    }
    free(buf);
    return 0;
#else
    (void)fd, (void)offsets, (void)n, (void)out;
    return -ENOSYS;
#endif
}

/* ------------------------------------------------------------------------------------------------ */
/* mlock: bounded by RLIMIT_MEMLOCK unless CAP_IPC_LOCK (linux-io §6); ENOMEM when over the limit.   */
/* ------------------------------------------------------------------------------------------------ */

int vm_mlock(const void *addr, size_t len) {
    if (len == 0) return 0;
    uint64_t off = (uint64_t)(uintptr_t)addr % vm_page();
    return mlock((const char *)addr - off, round_up(len + off, vm_page())) ? -errno : 0;
}

int vm_munlock(const void *addr, size_t len) {
    if (len == 0) return 0;
    uint64_t off = (uint64_t)(uintptr_t)addr % vm_page();
    return munlock((const char *)addr - off, round_up(len + off, vm_page())) ? -errno : 0;
}
