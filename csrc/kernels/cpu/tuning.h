/* tuning.h - how the CPU kernels of this family run on this CPU: the instruction set of their
 * bodies, the software prefetch distance and the split across threads, picked per vendor and
 * overridable per call.
 *
 * Every choice here changes speed only, never bits: every body, distance and split gives the
 * same results (optim.h, convert.h). The environment is read at every call, so a test or a
 * benchmark can switch paths inside one process:
 *   ZP_CPU_ISA       "avx512", "avx2" or "scalar": use that body (capped by what the CPU runs);
 *                    unset or empty: the vendor's default below.
 *   ZP_CPU_PREFETCH  software prefetch distance per stream in bytes (0 turns it off, at most
 *                    ZP_CPU_PREFETCH_MAX), into L2; "<bytes>:l1" prefetches into L1 instead
 *                    (PREFETCHT0, as before this file existed); unset or empty: the default.
 *   ZP_CPU_SPLIT     "blocks" (default): threads take 64K-element blocks in turn, so a thread
 *                    slowed by another process or an SMT sibling does less of the work;
 *                    "static": one contiguous range per thread.
 *   ZP_CPU_STREAM    streaming (non-temporal) stores for a write-only output (a bf16/fp16
 *                    param_out, the bound's write streams) of at least this many bytes per
 *                    segment; 0: never. Default ZP_CPU_STREAM_DEFAULT: past L2, where the line
 *                    would not stay cached anyway, and the read before each write is saved.
 * Vendor defaults (measured and argued in benchmarks/RESULTS.md, "The CPU step on every x86"):
 *   Intel: AVX-512 bodies; prefetch 2 KiB ahead into L2.
 *   AMD:   AVX2 bodies (Zen 4 splits 512-bit operations into two 256-bit halves, so 512-bit
 *          bodies gain nothing there on a memory-bound pass); prefetch 2 KiB ahead into L2.
 *   other: the widest the CPU runs; prefetch 2 KiB ahead into L2.
 * The prefetch goes to L2 (PREFETCHT1), not L1: four or five page-aligned streams per thread,
 * twice over when two threads share a core (SMT), overfill an 8-way 32 KiB L1 (AMD's), and the
 * L1's own next-line prefetcher covers the last step from L2. */
#ifndef ZP_TUNING_H
#define ZP_TUNING_H

#include <stdint.h>

#include "kernels/cpu/convert.h" /* zp_isa, zp_isa_pick */

typedef enum { ZP_VENDOR_OTHER = 0, ZP_VENDOR_INTEL = 1, ZP_VENDOR_AMD = 2 } zp_cpu_vendor;

#define ZP_CPU_PREFETCH_DEFAULT 2048 /* bytes ahead per stream */
#define ZP_CPU_PREFETCH_MAX (1 << 20)
#define ZP_CPU_STREAM_DEFAULT (4 << 20) /* bytes of one segment's write-only output */

typedef struct {
  zp_isa isa;               /* the bodies to run; the CPU runs it */
  int32_t prefetch_bytes;   /* per stream, ahead of the element being read; 0: none */
  int32_t prefetch_l1;      /* 1: PREFETCHT0 (into L1); 0: PREFETCHT1 (into L2) */
  int32_t split_static;     /* 1: one range per thread (zp_parallel_for); 0: blocks in turn */
  int64_t stream_min_bytes; /* write-only outputs this large get streaming stores; 0: never */
  zp_cpu_vendor vendor;
} zp_cpu_tuning;

/* zp_cpu_tuning.split_static = 0: the block every thread takes at a time (elements), and the
 * least work per thread (as zp_parallel_for's min_per_thread) */
#define ZP_CPU_BLOCK (1 << 16)

/* The tuning for the next call: the vendor's defaults with the environment's overrides. */
zp_cpu_tuning zp_cpu_tuning_pick(void);

zp_cpu_vendor zp_cpu_vendor_id(void);
const char *zp_cpu_vendor_name(zp_cpu_vendor vendor);

#endif /* ZP_TUNING_H */
