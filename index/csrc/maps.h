/*
 * maps.h - open-addressing hash maps keyed by unsigned 64-bit ints, for kvgate's native
 * block table (a template: MAP_DEFINE(Name, ValueType) defines one map type; with
 * MAP_DEFINE_PACKED the value type carries the cell's ``used`` byte in its own padding).
 *
 * Linear probing at a load of at most 3/4, backward-shift deletion (no tombstones), and the
 * table halves once it is less than 1/8 full: a map shrinks as entries go, it never only
 * grows. Cells move on insertion and deletion, so a cell pointer is valid only until the
 * map's next insertion or deletion.
 *
 * Keys come from the network (engine hashes as sent, block keys a publisher can choose with
 * crafted token ids), so a key's home cell is a keyed mix: each map has a secret ``seed``
 * (random per table / key map, see kv_random_seed) and without it a publisher cannot choose
 * keys that pile up in one probe run (with a public mix, 300,000 chosen engine hashes took
 * 75 s to insert; linear probing turns a shared home cell into quadratic work).
 *
 * Cell arrays come zero-filled from calloc, or for large ones (>= 4 MiB, Linux) straight from
 * mmap, 2 MiB-aligned and advised for transparent huge pages: a growing index then takes one
 * page fault per 2 MiB instead of per 4 KiB (page faults were a third of the time of ingesting
 * into a growing table).
 */
#ifndef KVGATE_MAPS_H
#define KVGATE_MAPS_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __linux__
#include <sys/mman.h>
#include <sys/random.h>
#endif
#include <time.h>

#include "common.h"

#define KV_MAP_MIN_CAP 8
#define KV_HUGE_PAGE ((size_t)2 << 20)
#define KV_HUGE_MIN ((size_t)4 << 20)

static inline size_t kv_round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* Zero-filled memory for a cell array of ``bytes``; NULL when there is none. */
static KV_UNUSED void *kv_cells_alloc(size_t bytes)
{
#ifdef __linux__
    if (bytes >= KV_HUGE_MIN) {
        size_t len = kv_round_up(bytes, KV_HUGE_PAGE);
        char *raw = (char *)mmap(NULL, len + KV_HUGE_PAGE, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == (char *)MAP_FAILED)
            return NULL;
        char *start = (char *)kv_round_up((size_t)(uintptr_t)raw, KV_HUGE_PAGE);
        size_t head = (size_t)(start - raw), tail = KV_HUGE_PAGE - head;
        if (head)
            munmap(raw, head);
        if (tail)
            munmap(start + len, tail);
        (void)madvise(start, len, MADV_HUGEPAGE); /* a hint: without THP, 4 KiB pages */
        return start;
    }
#endif
    return calloc(1, bytes ? bytes : 1);
}

static KV_UNUSED void kv_cells_free(void *cells, size_t bytes)
{
    if (cells == NULL)
        return;
#ifdef __linux__
    if (bytes >= KV_HUGE_MIN) {
        munmap(cells, kv_round_up(bytes, KV_HUGE_PAGE));
        return;
    }
#endif
    (void)bytes;
    free(cells);
}

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
/* gcc 12 drops __builtin_prefetch of a cell address read from the map (seen at -O1 and up) */
#define KV_PREFETCH(address) __asm__ __volatile__("prefetcht0 %0" : : "m"(*(const char *)(address)))
#elif defined(__GNUC__) || defined(__clang__)
#define KV_PREFETCH(address) __builtin_prefetch(address)
#else
#define KV_PREFETCH(address) ((void)(address))
#endif

/* A secret for a map's key mix: from the OS, else (never seen on Linux) clock and address. */
static KV_UNUSED uint64_t kv_random_seed(void)
{
    uint64_t seed = 0;
#ifdef __linux__
    if (getrandom(&seed, sizeof(seed), GRND_NONBLOCK) == (ssize_t)sizeof(seed) && seed)
        return seed;
#endif
    struct timespec now;
    timespec_get(&now, TIME_UTC);
    seed ^= (uint64_t)now.tv_nsec * 0x9E3779B97F4A7C15ULL ^ (uint64_t)now.tv_sec;
    seed ^= (uint64_t)(uintptr_t)&seed * 0xC2B2AE3D27D4EB4FULL;
    return seed | 1;
}

/* Home cell of ``key``: a multiply between xorshifts (half of murmur3's finalizer) over the key
 * xor the map's secret. Without the secret the mix is invertible, so a publisher could choose
 * keys for any cell (bench/hostile.py's colliding_engine_hashes); with it, it cannot. */
static inline size_t kv_map_home(uint64_t key, uint64_t seed, size_t mask)
{
    key ^= seed;
    key ^= key >> 33;
    key *= 0xFF51AFD7ED558CCDULL;
    key ^= key >> 33;
    return (size_t)key & mask;
}

#define MAP_DEFINE(NAME, VTYPE) MAP_DEFINE_IMPL(NAME, VTYPE, uint8_t used;, used)
#define MAP_DEFINE_PACKED(NAME, VTYPE) MAP_DEFINE_IMPL(NAME, VTYPE, , val.used)

#define MAP_DEFINE_IMPL(NAME, VTYPE, USED_FIELD, USED)                                       \
    typedef struct {                                                                         \
        uint64_t key;                                                                        \
        VTYPE val;                                                                           \
        USED_FIELD                                                                           \
    } NAME##Cell;                                                                            \
                                                                                             \
    typedef struct {                                                                         \
        NAME##Cell *cells;                                                                   \
        size_t cap; /* a power of two, or 0 before the first insertion */                    \
        size_t len;                                                                          \
        uint64_t seed; /* the secret of the key mix (kept when the map is emptied) */        \
    } NAME;                                                                                  \
                                                                                             \
    static KV_UNUSED void NAME##_free(NAME *m)                                               \
    {                                                                                        \
        kv_cells_free(m->cells, m->cap * sizeof(NAME##Cell));                                \
        m->cells = NULL;                                                                     \
        m->cap = m->len = 0;                                                                 \
    }                                                                                        \
                                                                                             \
    static KV_UNUSED int NAME##_resize(NAME *m, size_t cap)                                  \
    {                                                                                        \
        NAME##Cell *old = m->cells;                                                          \
        size_t old_cap = m->cap;                                                             \
        NAME##Cell *cells = (NAME##Cell *)kv_cells_alloc(cap * sizeof(NAME##Cell));          \
        if (cells == NULL)                                                                   \
            return -1;                                                                       \
        for (size_t i = 0; i < old_cap; i++) {                                               \
            if (!old[i].USED)                                                                \
                continue;                                                                    \
            size_t j = kv_map_home(old[i].key, m->seed, cap - 1);                            \
            while (cells[j].USED)                                                            \
                j = (j + 1) & (cap - 1);                                                     \
            cells[j] = old[i];                                                               \
        }                                                                                    \
        kv_cells_free(old, old_cap * sizeof(NAME##Cell));                                    \
        m->cells = cells;                                                                    \
        m->cap = cap;                                                                        \
        return 0;                                                                            \
    }                                                                                        \
                                                                                             \
    static inline NAME##Cell *NAME##_find(const NAME *m, uint64_t key)                       \
    {                                                                                        \
        if (m->len == 0)                                                                     \
            return NULL;                                                                     \
        size_t mask = m->cap - 1;                                                            \
        for (size_t i = kv_map_home(key, m->seed, mask);; i = (i + 1) & mask) {              \
            NAME##Cell *cell = &m->cells[i];                                                 \
            if (!cell->USED)                                                                 \
                return NULL;                                                                 \
            if (cell->key == key)                                                            \
                return cell;                                                                 \
        }                                                                                    \
    }                                                                                        \
                                                                                             \
    /* A hint to fetch ``key``'s home cell: a batch of lookups then waits for memory once. */ \
    static inline void NAME##_prefetch(const NAME *m, uint64_t key)                          \
    {                                                                                        \
        if (m->cap)                                                                          \
            KV_PREFETCH(&m->cells[kv_map_home(key, m->seed, m->cap - 1)]);                   \
    }                                                                                        \
                                                                                             \
    /* The cell of ``key``, inserted zero-filled if missing (*created tells); NULL: no       \
     * memory. */                                                                            \
    static KV_UNUSED NAME##Cell *NAME##_insert(NAME *m, uint64_t key, int *created)          \
    {                                                                                        \
        if ((m->len + 1) * 4 > m->cap * 3) {                                                 \
            NAME##Cell *found = NAME##_find(m, key);                                         \
            if (found != NULL) {                                                             \
                *created = 0;                                                                \
                return found;                                                                \
            }                                                                                \
            if (NAME##_resize(m, m->cap ? m->cap * 2 : KV_MAP_MIN_CAP) < 0)                  \
                return NULL;                                                                 \
        }                                                                                    \
        size_t mask = m->cap - 1;                                                            \
        size_t i = kv_map_home(key, m->seed, mask);                                          \
        for (; m->cells[i].USED; i = (i + 1) & mask) {                                       \
            if (m->cells[i].key == key) {                                                    \
                *created = 0;                                                                \
                return &m->cells[i];                                                         \
            }                                                                                \
        }                                                                                    \
        NAME##Cell *cell = &m->cells[i];                                                     \
        memset(cell, 0, sizeof(*cell));                                                      \
        cell->key = key;                                                                     \
        cell->USED = 1;                                                                      \
        m->len++;                                                                            \
        *created = 1;                                                                        \
        return cell;                                                                         \
    }                                                                                        \
                                                                                             \
    /* Remove ``key``; its value goes to *out when given. Returns 1 if it was there. */      \
    static KV_UNUSED int NAME##_remove(NAME *m, uint64_t key, VTYPE *out)                    \
    {                                                                                        \
        NAME##Cell *cell = NAME##_find(m, key);                                              \
        if (cell == NULL)                                                                    \
            return 0;                                                                        \
        if (out != NULL)                                                                     \
            *out = cell->val;                                                                \
        size_t mask = m->cap - 1;                                                            \
        size_t hole = (size_t)(cell - m->cells);                                             \
        for (size_t j = (hole + 1) & mask; m->cells[j].USED; j = (j + 1) & mask) {           \
            size_t home = kv_map_home(m->cells[j].key, m->seed, mask);                       \
            /* the cell at j may move back to the hole unless its home lies in (hole, j] */  \
            int stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j); \
            if (!stays) {                                                                    \
                m->cells[hole] = m->cells[j];                                                \
                hole = j;                                                                    \
            }                                                                                \
        }                                                                                    \
        m->cells[hole].USED = 0;                                                             \
        m->len--;                                                                            \
        if (m->len == 0) {                                                                   \
            NAME##_free(m);                                                                  \
        } else if (m->cap > KV_MAP_MIN_CAP && m->len * 8 < m->cap) {                         \
            (void)NAME##_resize(m, m->cap / 2); /* on failure the map stays as it is */      \
        }                                                                                    \
        return 1;                                                                            \
    }

#endif /* KVGATE_MAPS_H */
