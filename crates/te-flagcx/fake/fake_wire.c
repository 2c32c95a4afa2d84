/*
 * Blocking socket helpers of the FAKE shim's loopback TCP protocol, used by the
 * target side (fake_target.c) and the initiator side (fake_conn.c).
 */
#include "fake_shim_internal.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

int send_all(int fd, const void *buf, uint64_t len) {
  const char *p = buf;
  while (len > 0) {
    size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
    ssize_t n = send(fd, p, chunk, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (uint64_t)n;
  }
  return 0;
}

int recv_all(int fd, void *buf, uint64_t len) {
  char *p = buf;
  while (len > 0) {
    size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
    ssize_t n = recv(fd, p, chunk, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (uint64_t)n;
  }
  return 0;
}

int drain(int fd, uint64_t len) {
  char scratch[65536];
  while (len > 0) {
    uint64_t n = len > sizeof scratch ? sizeof scratch : len;
    if (recv_all(fd, scratch, n) != 0)
      return -1;
    len -= n;
  }
  return 0;
}

void tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}
