/* engine.h - the direct-I/O engine: reads and writes of whole buffers at file offsets, run by a
 * pool of threads, several requests in flight, completion polled or waited for by the caller.
 *
 * What NVMe offload and checkpoint files stream through. A request is (read or write, fd,
 * buffer, bytes, offset); a worker thread runs it to the end (retrying interrupted and partial
 * transfers) and records its outcome, which zp_io_wait hands to the caller as a status and a
 * message (a short read names the offset where the file ended; ENOSPC, EIO, EFBIG say so).
 * Files opened by zp_io_open use O_DIRECT where the file system allows it; then buffer
 * address, size and offset must be multiples of ZP_IO_ALIGN, which zp_io_submit checks.
 * Nothing here prints, exits or aborts. */
#ifndef ZP_IO_ENGINE_H
#define ZP_IO_ENGINE_H

#include <stdint.h>

#include "common/status.h"

/* Alignment of direct I/O: address, size and offset. 4096 covers the logical block size of
 * every disk in use (512 or 4096). */
#define ZP_IO_ALIGN 4096

typedef enum { ZP_IO_READ = 0, ZP_IO_WRITE = 1 } zp_io_op;

typedef struct zp_io_engine zp_io_engine;

/* An engine of `n_threads` workers (1..256) taking at most `max_inflight` requests (1..65536)
 * submitted and not yet waited for. */
zp_status zp_io_engine_create(int n_threads, int max_inflight, zp_io_engine **out);

/* Stops the workers after the requests they are running; requests still queued are dropped.
 * NULL is allowed. */
void zp_io_engine_destroy(zp_io_engine *engine);

/* Opens `path` for reading, or for writing (created, or truncated when `truncate`), with
 * O_DIRECT when `want_direct` and the file system takes it: *direct says whether it did (0: a
 * file system that refuses O_DIRECT, such as tmpfs before Linux 6.6; the descriptor then goes
 * through the page cache). */
zp_status zp_io_open(const char *path, int writable, int truncate, int want_direct, int *fd,
                     int *direct);

/* Queues one request and returns its ticket. `direct`: the fd was opened with O_DIRECT, so
 * buf, bytes and offset must be multiples of ZP_IO_ALIGN. Fails with ZP_ERR_STATE when
 * max_inflight requests are already submitted and not waited for. */
zp_status zp_io_submit(zp_io_engine *engine, zp_io_op op, int fd, void *buf, int64_t bytes,
                       int64_t offset, int direct, int64_t *ticket);

/* Waits for request `ticket` (at most timeout_ms; < 0: no limit) and returns its outcome; the
 * ticket is spent unless the wait timed out (ZP_ERR_STATE, the request still runs). */
zp_status zp_io_wait(zp_io_engine *engine, int64_t ticket, int64_t timeout_ms);

/* *done = 1 when request `ticket` has finished (zp_io_wait then returns at once). */
zp_status zp_io_poll(zp_io_engine *engine, int64_t ticket, int *done);

#endif /* ZP_IO_ENGINE_H */
