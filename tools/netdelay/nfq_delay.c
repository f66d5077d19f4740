/*
 * nfq_delay: latency for a network namespace without netem. Packets that
 * nftables sends to an NFQUEUE (`queue num N bypass`) are held here and
 * handed back to the kernel (accepted, unchanged) after DELAY ± JITTER
 * milliseconds, drawn uniformly per packet.
 *
 *   nfq_delay --queue N --delay MS [--jitter MS] [--limit PACKETS]
 *             [--reorder] [--seed S] [--quiet]
 *
 * Only each packet's id is kept (the queue copies no payload to us), with
 * the time it is due. Bounded: at most --limit packets (default 4096) are
 * held; one more is accepted at once rather than held, and the kernel
 * accepts (fail-open) what it cannot queue for us. By default packets
 * leave in the order they came (a packet is never released before the one
 * queued ahead of it, so its delay may exceed its draw while a burst
 * passes); --reorder releases each at its own draw, so jitter reorders
 * packets, as netem's does.
 *
 * Prints "nfq_delay: ready ..." on stdout once it holds the queue. On
 * SIGTERM or SIGINT it accepts every packet it holds and exits 0; if it
 * dies otherwise, nft's `bypass` lets new packets through unqueued.
 * Part of the network-fault harness (tests/net/netlab.sh).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef SOL_NETLINK
#define SOL_NETLINK 270
#endif

struct held {
  uint64_t due_ns; /* CLOCK_MONOTONIC */
  uint64_t seq;    /* arrival order: ties leave in it */
  uint32_t id;     /* the kernel's packet id */
};

struct delay_state {
  struct nfq_q_handle *qh;
  struct held *heap; /* a min-heap by (due_ns, seq) */
  size_t n, cap;
  uint64_t delay_ns, jitter_ns;
  int reorder;
  uint64_t rng;
  uint64_t seq;
  uint64_t last_due_ns; /* in order: no packet is due before the last one */
  uint64_t queued, overflowed, verdict_errors;
};

static volatile sig_atomic_t g_stop = 0;

static void on_signal(int sig) {
  (void)sig;
  g_stop = 1;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* xorshift64*: plenty for drawing delays. */
static uint64_t next_random(uint64_t *s) {
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 2685821657736338717ull;
}

static int earlier(const struct held *a, const struct held *b) {
  return a->due_ns < b->due_ns || (a->due_ns == b->due_ns && a->seq < b->seq);
}

static void heap_push(struct delay_state *st, struct held h) {
  size_t i = st->n++;
  st->heap[i] = h;
  while (i > 0) {
    size_t parent = (i - 1) / 2;
    if (!earlier(&st->heap[i], &st->heap[parent])) break;
    struct held t = st->heap[i];
    st->heap[i] = st->heap[parent];
    st->heap[parent] = t;
    i = parent;
  }
}

static struct held heap_pop(struct delay_state *st) {
  struct held top = st->heap[0];
  st->heap[0] = st->heap[--st->n];
  size_t i = 0;
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < st->n && earlier(&st->heap[l], &st->heap[m])) m = l;
    if (r < st->n && earlier(&st->heap[r], &st->heap[m])) m = r;
    if (m == i) break;
    struct held t = st->heap[i];
    st->heap[i] = st->heap[m];
    st->heap[m] = t;
    i = m;
  }
  return top;
}

static void accept_packet(struct delay_state *st, uint32_t id) {
  if (nfq_set_verdict(st->qh, id, NF_ACCEPT, 0, NULL) < 0) st->verdict_errors++;
}

/* One queued packet: hold it until it is due (or accept it now when full). */
static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *data) {
  (void)qh;
  (void)msg;
  struct delay_state *st = data;
  const struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
  if (!ph) return 0;
  const uint32_t id = ntohl(ph->packet_id);
  st->queued++;
  if (st->n == st->cap) {
    st->overflowed++;
    accept_packet(st, id);
    return 0;
  }
  uint64_t d = st->delay_ns;
  if (st->jitter_ns > 0) {
    /* Uniform over [delay - jitter, delay + jitter], in microseconds. */
    const uint64_t span_us = 2 * (st->jitter_ns / 1000) + 1;
    const int64_t draw_ns = (int64_t)st->delay_ns - (int64_t)st->jitter_ns +
                            (int64_t)(next_random(&st->rng) % span_us) * 1000;
    d = draw_ns < 0 ? 0 : (uint64_t)draw_ns;
  }
  struct held h = {now_ns() + d, st->seq++, id};
  if (!st->reorder) {
    if (h.due_ns < st->last_due_ns) h.due_ns = st->last_due_ns;
    st->last_due_ns = h.due_ns;
  }
  heap_push(st, h);
  return 0;
}

/* Accepts every held packet due by `until` (UINT64_MAX: all). */
static void release_due(struct delay_state *st, uint64_t until) {
  while (st->n > 0 && st->heap[0].due_ns <= until) accept_packet(st, heap_pop(st).id);
}

static void usage(const char *why) {
  fprintf(stderr,
          "nfq_delay: %s\n"
          "usage: nfq_delay --queue N --delay MS [--jitter MS] [--limit PACKETS] [--reorder] [--seed S] [--quiet]\n",
          why);
  exit(2);
}

/* A number in [lo, hi] from `text`, or usage(). */
static double number_arg(const char *name, const char *text, double lo, double hi) {
  if (!text) usage("a value is missing");
  char *end = NULL;
  errno = 0;
  const double v = strtod(text, &end);
  if (errno != 0 || end == text || *end != '\0' || !(v >= lo && v <= hi)) {
    fprintf(stderr, "nfq_delay: %s wants a number from %g to %g, got '%s'\n", name, lo, hi, text);
    exit(2);
  }
  return v;
}

int main(int argc, char **argv) {
  int queue = -1;
  double delay_ms = -1, jitter_ms = 0;
  size_t limit = 4096;
  int reorder = 0, quiet = 0;
  uint64_t seed = ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid();
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--queue") == 0) {
      queue = (int)number_arg(a, v, 0, 65535);
      ++i;
    } else if (strcmp(a, "--delay") == 0) {
      delay_ms = number_arg(a, v, 0, 60000);
      ++i;
    } else if (strcmp(a, "--jitter") == 0) {
      jitter_ms = number_arg(a, v, 0, 60000);
      ++i;
    } else if (strcmp(a, "--limit") == 0) {
      limit = (size_t)number_arg(a, v, 1, 1 << 20);
      ++i;
    } else if (strcmp(a, "--seed") == 0) {
      seed = (uint64_t)number_arg(a, v, 0, 4294967295.0);
      ++i;
    } else if (strcmp(a, "--reorder") == 0) {
      reorder = 1;
    } else if (strcmp(a, "--quiet") == 0) {
      quiet = 1;
    } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage("delays the packets of an NFQUEUE");
    } else {
      fprintf(stderr, "nfq_delay: unknown argument '%s'\n", a);
      usage("see above");
    }
  }
  if (queue < 0 || delay_ms < 0) usage("--queue and --delay are required");
  if (jitter_ms > delay_ms) usage("--jitter must not exceed --delay");

  struct delay_state st;
  memset(&st, 0, sizeof st);
  st.cap = limit;
  st.heap = calloc(limit, sizeof *st.heap);
  st.delay_ns = (uint64_t)(delay_ms * 1e6);
  st.jitter_ns = (uint64_t)(jitter_ms * 1e6);
  st.reorder = reorder;
  st.rng = seed * 0x9E3779B97F4A7C15ull + 1;
  if (!st.heap) {
    fprintf(stderr, "nfq_delay: out of memory for %zu packets\n", limit);
    return 1;
  }

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal; /* no SA_RESTART: poll() returns at once */
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);

  struct nfq_handle *h = nfq_open();
  if (!h) {
    perror("nfq_delay: nfq_open (root, and the nfnetlink_queue module, are needed)");
    return 1;
  }
  /* Older kernels want the family bound; newer ones ignore this. */
  nfq_unbind_pf(h, AF_INET);
  nfq_bind_pf(h, AF_INET);
  st.qh = nfq_create_queue(h, (uint16_t)queue, on_packet, &st);
  if (!st.qh) {
    fprintf(stderr, "nfq_delay: cannot bind queue %d (is another program on it?)\n", queue);
    nfq_close(h);
    return 1;
  }
  if (nfq_set_mode(st.qh, NFQNL_COPY_META, 0) < 0) {
    fprintf(stderr, "nfq_delay: cannot set the queue's copy mode\n");
    nfq_destroy_queue(st.qh);
    nfq_close(h);
    return 1;
  }
  /* The kernel may queue a little more than we hold; past that it accepts. */
  nfq_set_queue_maxlen(st.qh, (uint32_t)(limit + 1024));
  const uint32_t flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO;
  if (nfq_set_queue_flags(st.qh, flags, flags) < 0) {
    fprintf(stderr, "nfq_delay: warning: the kernel refused fail-open/GSO queue flags\n");
  }
  const int fd = nfq_fd(h);
  nfnl_rcvbufsiz(nfq_nfnlh(h), 4u << 20);
  const int one = 1;
  /* A burst that overruns the socket must not end the program. */
  setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);

  printf("nfq_delay: ready on queue %d: %.3g ms +- %.3g ms, at most %zu packets held%s\n", queue, delay_ms, jitter_ms,
         limit, reorder ? ", reordering" : "");
  fflush(stdout);

  static char buf[65536] __attribute__((aligned));
  int rc = 0;
  while (!g_stop) {
    int timeout_ms = -1;
    if (st.n > 0) {
      const uint64_t now = now_ns();
      const uint64_t due = st.heap[0].due_ns;
      timeout_ms = due <= now ? 0 : (int)((due - now + 999999) / 1000000);
    }
    struct pollfd p = {fd, POLLIN, 0};
    const int r = poll(&p, 1, timeout_ms);
    if (r < 0 && errno != EINTR) {
      perror("nfq_delay: poll");
      rc = 1;
      break;
    }
    if (r > 0) {
      for (;;) {  /* drain what is there */
        const ssize_t len = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (len < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ENOBUFS) break;
          perror("nfq_delay: recv");
          rc = 1;
          g_stop = 1;
          break;
        }
        nfq_handle_packet(h, buf, (int)len);
      }
    }
    release_due(&st, now_ns());
  }
  const size_t left = st.n;
  release_due(&st, UINT64_MAX);
  if (!quiet) {
    fprintf(stderr,
            "nfq_delay: queue %d: %" PRIu64 " packets, %" PRIu64 " accepted at once (over %zu held), %zu released "
            "early at exit, %" PRIu64 " verdicts failed\n",
            queue, st.queued, st.overflowed, limit, left, st.verdict_errors);
  }
  nfq_destroy_queue(st.qh);
  nfq_close(h);
  free(st.heap);
  return rc;
}
