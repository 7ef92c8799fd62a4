/* test_io_engine.c - the direct-I/O engine: round trips with many requests in flight, the
 * alignment check, short reads, the in-flight limit, a file system that refuses O_DIRECT,
 * open errors, and a write refused by the file-size limit (a full disk's path). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "io/engine.h"

enum { CHUNK = 64 * 1024, N_CHUNKS = 48, SLOTS = 16 };

static int zt_tmpdir(char *dir, size_t n) {
  snprintf(dir, n, "/tmp/zp_io_test_XXXXXX");
  return mkdtemp(dir) != NULL;
}

static unsigned char *zt_aligned(size_t n) {
  void *p = NULL;
  return posix_memalign(&p, ZP_IO_ALIGN, n) == 0 ? p : NULL;
}

/* N_CHUNKS requests through SLOTS slots, in `order` (1 forward, -1 backward), waiting for the
 * oldest when the engine is full. */
static void zt_stream(zp_io_engine *e, zp_io_op op, int fd, int direct, unsigned char *buf,
                      int order) {
  int64_t tickets[N_CHUNKS];
  for (int i = 0; i < N_CHUNKS; i++) {
    int k = order > 0 ? i : N_CHUNKS - 1 - i;
    if (i >= SLOTS) {
      int old = order > 0 ? i - SLOTS : N_CHUNKS - 1 - (i - SLOTS);
      CHECK_OK(zp_io_wait(e, tickets[old], -1));
    }
    CHECK_OK(zp_io_submit(e, op, fd, buf + (size_t)k * CHUNK, CHUNK, (int64_t)k * CHUNK, direct,
                          &tickets[k]));
  }
  for (int i = N_CHUNKS - SLOTS; i < N_CHUNKS; i++)
    CHECK_OK(zp_io_wait(e, tickets[order > 0 ? i : N_CHUNKS - 1 - i], -1));
}

void test_io_engine_round_trip(void) {
  char dir[64], path[128];
  if (!CHECK(zt_tmpdir(dir, sizeof dir)))
    return;
  snprintf(path, sizeof path, "%s/data", dir);
  size_t total = (size_t)CHUNK * N_CHUNKS;
  unsigned char *out = zt_aligned(total), *in = zt_aligned(total);
  zp_io_engine *e = NULL;
  if (!CHECK(out != NULL && in != NULL) || !CHECK_OK(zp_io_engine_create(4, SLOTS, &e)))
    goto done;
  zt_rng rng = zt_rng_seed(11);
  for (size_t i = 0; i < total; i++)
    out[i] = (unsigned char)(zt_next(&rng) >> 40);
  int fd = -1, direct = 0;
  if (!CHECK_OK(zp_io_open(path, 1, 1, 1, &fd, &direct)))
    goto done;
  zt_stream(e, ZP_IO_WRITE, fd, direct, out, 1);
  close(fd);
  if (!CHECK_OK(zp_io_open(path, 0, 0, 1, &fd, &direct)))
    goto done;
  zt_stream(e, ZP_IO_READ, fd, direct, in, -1);
  CHECK(memcmp(in, out, total) == 0);
  /* polled to completion instead of waited for */
  int64_t t;
  memset(in, 0, CHUNK);
  CHECK_OK(zp_io_submit(e, ZP_IO_READ, fd, in, CHUNK, 0, direct, &t));
  int finished = 0;
  for (int spins = 0; !finished && spins < 100000; spins++) {
    CHECK_OK(zp_io_poll(e, t, &finished));
    if (!finished)
      usleep(100);
  }
  CHECK(finished);
  CHECK_OK(zp_io_wait(e, t, 0));
  CHECK(memcmp(in, out, CHUNK) == 0);
  CHECK_FAILS(zp_io_wait(e, t, 0), ZP_ERR_INVALID); /* spent */
  close(fd);
done:
  zp_io_engine_destroy(e);
  unlink(path);
  rmdir(dir);
  free(out);
  free(in);
}

void test_io_engine_errors(void) {
  char dir[64], path[128];
  if (!CHECK(zt_tmpdir(dir, sizeof dir)))
    return;
  snprintf(path, sizeof path, "%s/data", dir);
  unsigned char *buf = zt_aligned(4 * ZP_IO_ALIGN);
  zp_io_engine *e = NULL;
  if (!CHECK(buf != NULL) || !CHECK_OK(zp_io_engine_create(2, 2, &e)))
    goto done;
  memset(buf, 7, 4 * ZP_IO_ALIGN);
  CHECK_FAILS(zp_io_engine_create(0, 4, &(zp_io_engine *){NULL}), ZP_ERR_INVALID);
  CHECK_FAILS(zp_io_engine_create(2, 0, &(zp_io_engine *){NULL}), ZP_ERR_INVALID);
  int fd = -1, direct = 0;
  if (!CHECK_OK(zp_io_open(path, 1, 1, 1, &fd, &direct)))
    goto done;
  int64_t t = -1, t2 = -1, t3 = -1;
  /* alignment: checked at submit when the descriptor is direct */
  CHECK_FAILS(zp_io_submit(e, ZP_IO_WRITE, fd, buf + 1, ZP_IO_ALIGN, 0, 1, &t), ZP_ERR_INVALID);
  CHECK(strstr(zp_last_error(), "multiples of 4096") != NULL);
  CHECK_FAILS(zp_io_submit(e, ZP_IO_WRITE, fd, buf, 100, 0, 1, &t), ZP_ERR_INVALID);
  CHECK_FAILS(zp_io_submit(e, ZP_IO_WRITE, fd, buf, ZP_IO_ALIGN, 512, 1, &t), ZP_ERR_INVALID);
  CHECK_FAILS(zp_io_submit(e, ZP_IO_WRITE, fd, buf, -1, 0, 0, &t), ZP_ERR_INVALID);
  CHECK_FAILS(zp_io_submit(e, ZP_IO_WRITE, fd, buf, 1, INT64_MAX, 0, &t), ZP_ERR_INVALID);
  CHECK_FAILS(zp_io_submit(e, (zp_io_op)5, fd, buf, 0, 0, 0, &t), ZP_ERR_INVALID);
  CHECK_FAILS(zp_io_wait(e, 12345, 0), ZP_ERR_INVALID); /* never submitted */
  /* two slots: a third submit is refused until one is waited for */
  CHECK_OK(zp_io_submit(e, ZP_IO_WRITE, fd, buf, 2 * ZP_IO_ALIGN, 0, direct, &t));
  CHECK_OK(zp_io_submit(e, ZP_IO_WRITE, fd, buf + 2 * ZP_IO_ALIGN, 2 * ZP_IO_ALIGN,
                        2 * ZP_IO_ALIGN, direct, &t2));
  CHECK_FAILS(zp_io_submit(e, ZP_IO_WRITE, fd, buf, ZP_IO_ALIGN, 0, direct, &t3), ZP_ERR_STATE);
  CHECK(strstr(zp_last_error(), "in flight") != NULL);
  CHECK_OK(zp_io_wait(e, t, -1));
  CHECK_OK(zp_io_wait(e, t2, -1));
  /* a read past the end of the 16 KiB file: a short read, named as such */
  CHECK_OK(zp_io_submit(e, ZP_IO_READ, fd, buf, 4 * ZP_IO_ALIGN, 2 * ZP_IO_ALIGN, direct, &t));
  CHECK_FAILS(zp_io_wait(e, t, -1), ZP_ERR_RANGE);
  CHECK(strstr(zp_last_error(), "short read") != NULL);
  close(fd);
  /* a write refused by the file-size limit (EFBIG: what a full disk's ENOSPC also takes) */
  struct rlimit old;
  if (getrlimit(RLIMIT_FSIZE, &old) == 0) {
    void (*previous)(int) = signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = {ZP_IO_ALIGN, old.rlim_max};
    if (CHECK(setrlimit(RLIMIT_FSIZE, &small) == 0) &&
        CHECK_OK(zp_io_open(path, 1, 1, 1, &fd, &direct))) {
      CHECK_OK(zp_io_submit(e, ZP_IO_WRITE, fd, buf, 2 * ZP_IO_ALIGN, 0, direct, &t));
      CHECK(zp_io_wait(e, t, -1) != ZP_OK);
      CHECK(strstr(zp_last_error(), "write") != NULL);
      close(fd);
    }
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, previous);
  }
  /* open errors name the path */
  CHECK_FAILS(zp_io_open("/nonexistent_zp_dir/x", 1, 1, 1, &fd, &direct), ZP_ERR_INVALID);
  CHECK(strstr(zp_last_error(), "/nonexistent_zp_dir/x") != NULL);
  /* without O_DIRECT (not asked, or a file system that refuses it: tmpfs before Linux 6.6):
   * a page-cache descriptor, said so by *direct, and unaligned requests are fine */
  if (CHECK_OK(zp_io_open(path, 1, 1, 0, &fd, &direct))) {
    CHECK(direct == 0);
    CHECK_OK(zp_io_submit(e, ZP_IO_WRITE, fd, buf + 3, 100, 3, 0, &t));
    CHECK_OK(zp_io_wait(e, t, -1));
    CHECK_OK(zp_io_submit(e, ZP_IO_READ, fd, buf + 200, 100, 3, 0, &t));
    CHECK_OK(zp_io_wait(e, t, -1));
    CHECK(memcmp(buf + 3, buf + 200, 100) == 0);
    close(fd);
  }
done:
  zp_io_engine_destroy(e);
  unlink(path);
  rmdir(dir);
  free(buf);
}
