/* tuning.c - the CPU kernels' run-time choices (tuning.h): vendor from CPUID, instruction set
 * from __builtin_cpu_supports, prefetch and split; the environment overrides them at every
 * call. */
#include "kernels/cpu/tuning.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define ZP_X86 1
#endif

static zp_cpu_vendor zp_cpu_vendor_read(void) {
#ifdef ZP_X86
  unsigned eax, ebx, ecx, edx;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx)) {
    char id[13];
    memcpy(id, &ebx, 4), memcpy(id + 4, &edx, 4), memcpy(id + 8, &ecx, 4);
    id[12] = '\0';
    if (strcmp(id, "GenuineIntel") == 0)
      return ZP_VENDOR_INTEL;
    if (strcmp(id, "AuthenticAMD") == 0 || strcmp(id, "HygonGenuine") == 0)
      return ZP_VENDOR_AMD;
  }
#endif
  return ZP_VENDOR_OTHER;
}

/* CPUID traps to the hypervisor in a VM (microseconds): read it once. Threads that race here
 * store the same value. */
zp_cpu_vendor zp_cpu_vendor_id(void) {
  static _Atomic int cached = -1;
  int v = atomic_load_explicit(&cached, memory_order_relaxed);
  if (v < 0) {
    v = (int)zp_cpu_vendor_read();
    atomic_store_explicit(&cached, v, memory_order_relaxed);
  }
  return (zp_cpu_vendor)v;
}

const char *zp_cpu_vendor_name(zp_cpu_vendor vendor) {
  return vendor == ZP_VENDOR_INTEL ? "intel" : vendor == ZP_VENDOR_AMD ? "amd" : "other";
}

/* The widest body the CPU runs, capped at `want`. */
static zp_isa zp_isa_supported(zp_isa want) {
#ifdef ZP_X86
  __builtin_cpu_init();
  int has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
  if (want >= ZP_ISA_AVX512 && has2 && __builtin_cpu_supports("avx512f"))
    return ZP_ISA_AVX512;
  if (want >= ZP_ISA_AVX2 && has2)
    return ZP_ISA_AVX2;
#else
  (void)want;
#endif
  return ZP_ISA_SCALAR;
}

zp_isa zp_isa_pick(void) {
  const char *env = getenv("ZP_CPU_ISA");
  if (env != NULL && strcmp(env, "avx512") == 0)
    return zp_isa_supported(ZP_ISA_AVX512);
  if (env != NULL && strcmp(env, "avx2") == 0)
    return zp_isa_supported(ZP_ISA_AVX2);
  if (env != NULL && strcmp(env, "scalar") == 0)
    return ZP_ISA_SCALAR;
  /* unset, empty or unknown: the vendor's default */
  return zp_isa_supported(zp_cpu_vendor_id() == ZP_VENDOR_AMD ? ZP_ISA_AVX2 : ZP_ISA_AVX512);
}

zp_cpu_tuning zp_cpu_tuning_pick(void) {
  zp_cpu_tuning t = {zp_isa_pick(), ZP_CPU_PREFETCH_DEFAULT, 0, 0, ZP_CPU_STREAM_DEFAULT,
                     zp_cpu_vendor_id()};
  const char *stream = getenv("ZP_CPU_STREAM");
  if (stream != NULL && stream[0] != '\0') {
    char *end;
    long long v = strtoll(stream, &end, 10);
    if (*end == '\0' && v >= 0)
      t.stream_min_bytes = (int64_t)v;
  }
  const char *split = getenv("ZP_CPU_SPLIT");
  t.split_static = split != NULL && strcmp(split, "static") == 0;
  const char *env = getenv("ZP_CPU_PREFETCH");
  if (env != NULL && env[0] != '\0') {
    char *end;
    long v = strtol(env, &end, 10);
    int l1 = strcmp(end, ":l1") == 0;
    if ((*end == '\0' || l1 || strcmp(end, ":l2") == 0) && end != env && v >= 0 &&
        v <= ZP_CPU_PREFETCH_MAX) {
      t.prefetch_bytes = (int32_t)v;
      t.prefetch_l1 = l1;
    }
  }
  return t;
}
