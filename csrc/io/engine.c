/* engine.c - the direct-I/O engine (engine.h): a ring of request slots, a FIFO of queued
 * slots, and worker threads that run each request to the end with pread/pwrite.
 *
 * Invariant: slot k holds the request whose ticket t has t % capacity == k; a slot is FREE,
 * QUEUED, RUNNING or DONE, and goes back to FREE only when its ticket is waited for. One mutex
 * guards every slot and the queue; the transfers themselves run without it. */
#define _GNU_SOURCE /* O_DIRECT */
#include "io/engine.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { ZP_SLOT_FREE, ZP_SLOT_QUEUED, ZP_SLOT_RUNNING, ZP_SLOT_DONE };

typedef struct {
  int64_t ticket;
  int state;
  zp_io_op op;
  int fd;
  unsigned char *buf;
  int64_t bytes;
  int64_t offset;
  zp_status result;
  char message[256];
} zp_io_slot;

struct zp_io_engine {
  pthread_mutex_t lock;
  pthread_cond_t work;  /* a slot was queued, or stop */
  pthread_cond_t done;  /* a slot finished */
  zp_io_slot *slots;
  int capacity;
  int64_t *queue; /* tickets, FIFO ring of `capacity` */
  int queue_head, queue_len;
  int64_t next_ticket;
  int stop;
  int n_threads;
  pthread_t *threads;
};

/* Runs one request without the lock; the outcome goes into the slot. */
static void zp_io_run(zp_io_slot *s) {
  int64_t done = 0;
  s->result = ZP_OK;
  s->message[0] = '\0';
  while (done < s->bytes) {
    ssize_t n = s->op == ZP_IO_READ ? pread(s->fd, s->buf + done, (size_t)(s->bytes - done),
                                            (off_t)(s->offset + done))
                                    : pwrite(s->fd, s->buf + done, (size_t)(s->bytes - done),
                                             (off_t)(s->offset + done));
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0) {
      int err = errno;
      s->result = (err == EINVAL) ? ZP_ERR_INVALID : ZP_ERR_SYSTEM;
      snprintf(s->message, sizeof s->message, "%s of %lld bytes at offset %lld failed: %s%s",
               s->op == ZP_IO_READ ? "read" : "write", (long long)s->bytes,
               (long long)s->offset, strerror(err),
               err == ENOSPC ? " (the disk is full)" : err == EFBIG ? " (file size limit)" : "");
      return;
    }
    if (n == 0) {
      s->result = s->op == ZP_IO_READ ? ZP_ERR_RANGE : ZP_ERR_SYSTEM;
      snprintf(s->message, sizeof s->message,
               s->op == ZP_IO_READ
                   ? "short read: the file ends at offset %lld, %lld bytes before the end of "
                     "the request (%lld bytes at offset %lld)"
                   : "short write: the device took no more bytes at offset %lld, %lld bytes "
                     "before the end of the request (%lld bytes at offset %lld)",
               (long long)(s->offset + done), (long long)(s->bytes - done), (long long)s->bytes,
               (long long)s->offset);
      return;
    }
    done += n;
  }
}

static void *zp_io_worker(void *arg) {
  zp_io_engine *e = arg;
  pthread_mutex_lock(&e->lock);
  for (;;) {
    while (!e->stop && e->queue_len == 0)
      pthread_cond_wait(&e->work, &e->lock);
    if (e->stop)
      break;
    int64_t t = e->queue[e->queue_head];
    e->queue_head = (e->queue_head + 1) % e->capacity;
    e->queue_len--;
    zp_io_slot *s = &e->slots[t % e->capacity];
    s->state = ZP_SLOT_RUNNING;
    pthread_mutex_unlock(&e->lock);
    zp_io_run(s);
    pthread_mutex_lock(&e->lock);
    s->state = ZP_SLOT_DONE;
    pthread_cond_broadcast(&e->done);
  }
  pthread_mutex_unlock(&e->lock);
  return NULL;
}

zp_status zp_io_engine_create(int n_threads, int max_inflight, zp_io_engine **out) {
  if (out == NULL)
    return zp_fail(ZP_ERR_INVALID, "zp_io_engine_create: out is NULL");
  *out = NULL;
  if (n_threads < 1 || n_threads > 256)
    return zp_fail(ZP_ERR_INVALID, "io engine: n_threads must be in [1, 256], got %d", n_threads);
  if (max_inflight < 1 || max_inflight > 65536)
    return zp_fail(ZP_ERR_INVALID, "io engine: max_inflight must be in [1, 65536], got %d",
                   max_inflight);
  zp_io_engine *e = calloc(1, sizeof *e);
  if (e == NULL)
    return zp_fail(ZP_ERR_NOMEM, "io engine: out of memory");
  e->slots = calloc((size_t)max_inflight, sizeof *e->slots);
  e->queue = calloc((size_t)max_inflight, sizeof *e->queue);
  e->threads = calloc((size_t)n_threads, sizeof *e->threads);
  if (e->slots == NULL || e->queue == NULL || e->threads == NULL) {
    free(e->slots);
    free(e->queue);
    free(e->threads);
    free(e);
    return zp_fail(ZP_ERR_NOMEM, "io engine: out of memory for %d slots", max_inflight);
  }
  e->capacity = max_inflight;
  pthread_mutex_init(&e->lock, NULL);
  pthread_cond_init(&e->work, NULL);
  pthread_cond_init(&e->done, NULL);
  for (int i = 0; i < n_threads; i++) {
    int rc = pthread_create(&e->threads[i], NULL, zp_io_worker, e);
    if (rc != 0) {
      e->n_threads = i;
      zp_io_engine_destroy(e);
      return zp_fail(ZP_ERR_SYSTEM, "io engine: cannot start worker thread %d: %s", i,
                     strerror(rc));
    }
  }
  e->n_threads = n_threads;
  *out = e;
  return ZP_OK;
}

void zp_io_engine_destroy(zp_io_engine *e) {
  if (e == NULL)
    return;
  pthread_mutex_lock(&e->lock);
  e->stop = 1;
  pthread_cond_broadcast(&e->work);
  pthread_mutex_unlock(&e->lock);
  for (int i = 0; i < e->n_threads; i++)
    pthread_join(e->threads[i], NULL);
  pthread_mutex_destroy(&e->lock);
  pthread_cond_destroy(&e->work);
  pthread_cond_destroy(&e->done);
  free(e->slots);
  free(e->queue);
  free(e->threads);
  free(e);
}

zp_status zp_io_open(const char *path, int writable, int truncate, int want_direct, int *fd,
                     int *direct) {
  if (path == NULL || fd == NULL || direct == NULL)
    return zp_fail(ZP_ERR_INVALID, "zp_io_open: NULL argument");
  int flags = writable ? (O_RDWR | O_CREAT | (truncate ? O_TRUNC : 0)) : O_RDONLY;
  flags |= O_CLOEXEC;
  int f = want_direct ? open(path, flags | O_DIRECT, 0644) : -1;
  *direct = want_direct;
  if (!want_direct || (f < 0 && errno == EINVAL)) { /* not asked, or refused (tmpfs, ...) */
    f = open(path, flags, 0644);
    *direct = 0;
  }
  if (f < 0) {
    int err = errno;
    return zp_fail(err == ENOENT || err == EACCES || err == EROFS || err == ENOTDIR
                       ? ZP_ERR_INVALID
                       : ZP_ERR_SYSTEM,
                   "cannot open %s for %s: %s", path, writable ? "writing" : "reading",
                   strerror(err));
  }
  *fd = f;
  return ZP_OK;
}

zp_status zp_io_submit(zp_io_engine *e, zp_io_op op, int fd, void *buf, int64_t bytes,
                       int64_t offset, int direct, int64_t *ticket) {
  if (e == NULL || ticket == NULL)
    return zp_fail(ZP_ERR_INVALID, "zp_io_submit: NULL argument");
  if (op != ZP_IO_READ && op != ZP_IO_WRITE)
    return zp_fail(ZP_ERR_INVALID, "io submit: op must be read (0) or write (1), got %d",
                   (int)op);
  if (fd < 0 || bytes < 0 || offset < 0 || (buf == NULL && bytes > 0))
    return zp_fail(ZP_ERR_INVALID,
                   "io submit: needs fd >= 0, bytes >= 0, offset >= 0 and a buffer (fd %d, "
                   "bytes %lld, offset %lld)",
                   fd, (long long)bytes, (long long)offset);
  if (bytes > INT64_MAX - offset)
    return zp_fail(ZP_ERR_INVALID, "io submit: offset %lld + bytes %lld overflows",
                   (long long)offset, (long long)bytes);
  if (direct && (((uintptr_t)buf | (uint64_t)bytes | (uint64_t)offset) % ZP_IO_ALIGN) != 0)
    return zp_fail(ZP_ERR_INVALID,
                   "io submit: direct I/O needs the buffer address, the size and the offset "
                   "to be multiples of %d bytes (address %p, bytes %lld, offset %lld)",
                   ZP_IO_ALIGN, buf, (long long)bytes, (long long)offset);
  pthread_mutex_lock(&e->lock);
  int64_t t = e->next_ticket;
  zp_io_slot *s = &e->slots[t % e->capacity];
  if (s->state != ZP_SLOT_FREE) {
    pthread_mutex_unlock(&e->lock);
    return zp_fail(ZP_ERR_STATE,
                   "io submit: %d requests are in flight (the engine's max_inflight); wait for "
                   "the oldest before submitting more",
                   e->capacity);
  }
  *s = (zp_io_slot){.ticket = t, .state = ZP_SLOT_QUEUED, .op = op, .fd = fd, .buf = buf,
                    .bytes = bytes, .offset = offset};
  e->queue[(e->queue_head + e->queue_len) % e->capacity] = t;
  e->queue_len++;
  e->next_ticket++;
  pthread_cond_signal(&e->work);
  pthread_mutex_unlock(&e->lock);
  *ticket = t;
  return ZP_OK;
}

/* The slot of a live ticket, or NULL with the failure recorded (lock held by the caller). */
static zp_io_slot *zp_io_slot_of(zp_io_engine *e, int64_t ticket) {
  if (ticket < 0 || ticket >= e->next_ticket || e->slots[ticket % e->capacity].ticket != ticket ||
      e->slots[ticket % e->capacity].state == ZP_SLOT_FREE) {
    zp_fail(ZP_ERR_INVALID, "io: ticket %lld is not a request in flight (never submitted, or "
                            "already waited for)",
            (long long)ticket);
    return NULL;
  }
  return &e->slots[ticket % e->capacity];
}

zp_status zp_io_poll(zp_io_engine *e, int64_t ticket, int *done) {
  if (e == NULL || done == NULL)
    return zp_fail(ZP_ERR_INVALID, "zp_io_poll: NULL argument");
  pthread_mutex_lock(&e->lock);
  zp_io_slot *s = zp_io_slot_of(e, ticket);
  if (s != NULL)
    *done = s->state == ZP_SLOT_DONE;
  pthread_mutex_unlock(&e->lock);
  return s != NULL ? ZP_OK : ZP_ERR_INVALID;
}

zp_status zp_io_wait(zp_io_engine *e, int64_t ticket, int64_t timeout_ms) {
  if (e == NULL)
    return zp_fail(ZP_ERR_INVALID, "zp_io_wait: engine is NULL");
  struct timespec deadline;
  if (timeout_ms >= 0) {
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += (time_t)(timeout_ms / 1000);
    deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
      deadline.tv_sec++;
      deadline.tv_nsec -= 1000000000L;
    }
  }
  pthread_mutex_lock(&e->lock);
  zp_io_slot *s = zp_io_slot_of(e, ticket);
  if (s == NULL) {
    pthread_mutex_unlock(&e->lock);
    return ZP_ERR_INVALID;
  }
  while (s->state != ZP_SLOT_DONE) {
    if (e->stop) {
      pthread_mutex_unlock(&e->lock);
      return zp_fail(ZP_ERR_STATE, "io: the engine was stopped before request %lld ran",
                     (long long)ticket);
    }
    if (timeout_ms < 0) {
      pthread_cond_wait(&e->done, &e->lock);
    } else if (pthread_cond_timedwait(&e->done, &e->lock, &deadline) == ETIMEDOUT &&
               s->state != ZP_SLOT_DONE) {
      pthread_mutex_unlock(&e->lock);
      return zp_fail(ZP_ERR_STATE, "io: request %lld still runs after %lld ms", (long long)ticket,
                     (long long)timeout_ms);
    }
  }
  zp_status result = s->result;
  char message[sizeof s->message];
  memcpy(message, s->message, sizeof message);
  s->state = ZP_SLOT_FREE;
  pthread_mutex_unlock(&e->lock);
  return result == ZP_OK ? ZP_OK : zp_fail(result, "%s", message);
}
