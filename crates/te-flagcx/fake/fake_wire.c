/*
 * Socket helpers of the FAKE shim's loopback TCP protocol, used by the target side
 * (fake_target.c) and the initiator side (fake_conn.c). With a timeout they give up
 * once the peer took (or sent) no byte for that long.
 */
#include "fake_shim_internal.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

/* Waits until fd is ready for `events`; -1 with errno ETIMEDOUT after timeout_ms. */
static int ready(int fd, short events, unsigned timeout_ms) {
  for (;;) {
    struct pollfd p = {fd, events, 0};
    int n = poll(&p, 1, (int)timeout_ms);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return -1;
    if (n == 0) {
      errno = ETIMEDOUT;
      return -1;
    }
    return 0;
  }
}

static int move_all(int fd, char *p, uint64_t len, int sending,
                    unsigned timeout_ms) {
  int flags = timeout_ms ? MSG_DONTWAIT : 0;
  while (len > 0) {
    size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
    ssize_t n = sending ? send(fd, p, chunk, MSG_NOSIGNAL | flags)
                        : recv(fd, p, chunk, flags);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && timeout_ms && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (ready(fd, sending ? POLLOUT : POLLIN, timeout_ms) != 0)
        return -1;
      continue;
    }
    if (n <= 0)
      return -1;
    p += n;
    len -= (uint64_t)n;
  }
  return 0;
}

int send_all(int fd, const void *buf, uint64_t len, unsigned timeout_ms) {
  return move_all(fd, (char *)buf, len, 1, timeout_ms);
}

int recv_all(int fd, void *buf, uint64_t len, unsigned timeout_ms) {
  return move_all(fd, buf, len, 0, timeout_ms);
}

int drain(int fd, uint64_t len, unsigned timeout_ms) {
  char scratch[65536];
  while (len > 0) {
    uint64_t n = len > sizeof scratch ? sizeof scratch : len;
    if (recv_all(fd, scratch, n, timeout_ms) != 0)
      return -1;
    len -= n;
  }
  return 0;
}

void tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}
