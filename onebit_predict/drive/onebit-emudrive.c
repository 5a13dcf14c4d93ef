/*
 * onebit-emudrive: an emulated drive over FUSE (libfuse3, low-level API).
 *
 * Serves ONE file, read-only, from anonymous memory of this process (the file is read whole at
 * start), under a given name in the mount. Every read request the kernel sends goes through a
 * device model before it is answered:
 *
 *   - at most CHANNELS requests are in service at once; later ones wait for a channel (FIFO);
 *   - a request in service first takes LATENCY (requests in service overlap in it);
 *   - then its bytes cross a bus of BANDWIDTH bytes/s shared by all requests: transfers are
 *     served in the order their latency ends, one after another (the same throughput as a fair
 *     share, and each request's completion time is known when it arrives);
 *   - the reply is sent when the transfer ends (the worker thread sleeps until then).
 *
 * The schedule is computed in virtual time under one lock when a request arrives, so the host's
 * scheduling noise delays replies but never accumulates into the device's schedule. Only the
 * device is modelled: the page cache stays real (no direct_io, keep_cache on open, long attribute
 * timeouts, no automatic invalidation), so the kernel's faults, readahead, eviction and memory
 * cgroup charges behave as on a block device. The kernel's request size is capped by --max-read
 * (FUSE's max_read) and by the mount's bdi read_ahead_kb, which the caller sets.
 *
 * Stats: on SIGUSR1 a snapshot line, on exit the final line, to the --stats file (written under a
 * temporary name and renamed) or to stderr. Fields (key=value): seq, final, requests, bytes,
 * user_s and sys_s (getrusage of the whole process, loading included), serve_user_s and
 * serve_sys_s (since the mount came up), wall_s (since then), max_inflight (requests received and
 * not yet done in the device, the most seen at once), window_max_inflight (the same since the
 * previous stats line), queued (requests that waited for a channel),
 * queue_wait_s, max_request (bytes), residence_s (every request's time from its arrival to the end of
 * its transfer in the device's schedule, summed: /proc/diskstats' weighted time), busy_s (the time
 * at least one request was in the device: diskstats' io_ticks), and the configuration. Both are the
 * schedule's, known when a request arrives: a reply the host's scheduler delays is not in them.
 *
 * Exit codes: 0 ok (unmounted after SIGTERM, SIGINT or SIGHUP, or unmounted from outside),
 * 1 runtime failure (cannot read the file, cannot mount, a FUSE error), 2 usage.
 *
 * Build: cc -O2 -o onebit-emudrive onebit-emudrive.c $(pkg-config --cflags --libs fuse3)
 * (onebit_predict/drive/emudrive.py does this on first use). Needs libfuse >= 3.2; with
 * libfuse >= 3.12 build with -DFUSE_USE_VERSION=312 (the default) to raise the thread limit.
 */
#define _GNU_SOURCE
#ifndef FUSE_USE_VERSION
#define FUSE_USE_VERSION 312
#endif

#include <fuse_lowlevel.h>

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define EXIT_RUNTIME 1
#define EXIT_USAGE 2

#define ROOT_INO FUSE_ROOT_ID
#define FILE_INO 2
#define ATTR_TIMEOUT 86400.0 /* the file never changes: let the kernel cache its attributes */
#define MAX_READ_MIN 4096u
#define MAX_READ_MAX (1u << 20) /* the kernel's default fuse max_pages_limit: 256 pages */
#define CHANNELS_MAX 4096u

/* --- configuration ------------------------------------------------------------------------ */

struct config {
	double latency_us;
	double bandwidth; /* bytes/s, 0 = unlimited */
	unsigned channels;
	unsigned max_read;
	unsigned max_threads;
	unsigned max_background;
	const char *file;
	const char *mountpoint;
	const char *name;
	const char *stats_path;
	int die_with_parent;
	int debug;
};

static struct config cfg = {
	.latency_us = 0.0,
	.bandwidth = 0.0,
	.channels = 64,
	.max_read = 128u * 1024u,
	.max_threads = 256,
	.max_background = 64,
};

/* --- the served file ------------------------------------------------------------------------ */

static unsigned char *data;
static uint64_t data_size;
static struct timespec data_mtime;
static char name_buf[NAME_MAX + 1];

/* --- the device model and its counters --------------------------------------------------- */

struct device {
	pthread_mutex_t lock;
	int64_t latency_ns;
	double ns_per_byte; /* 0 = unlimited bandwidth */
	unsigned channels;
	int64_t *chan_free; /* CLOCK_MONOTONIC ns at which each channel is next free */
	int64_t bus_free;   /* ... and the bus */
	/* counters, under lock */
	uint64_t requests;
	uint64_t bytes;
	uint64_t queued;
	int64_t queue_wait_ns;
	uint64_t max_request;
	unsigned max_inflight;
	unsigned window_max_inflight; /* since the previous stats line */
	int64_t residence_ns; /* each request's arrival to its transfer's end, summed */
	int64_t busy_ns;      /* the union of those intervals */
	int64_t busy_until;   /* the end of the last of them */
	/* atomic */
	unsigned inflight;
};

static struct device dev = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void sleep_until(int64_t t_ns)
{
	struct timespec ts = {.tv_sec = t_ns / 1000000000LL, .tv_nsec = t_ns % 1000000000LL};
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
		;
}

/* Admit a request of n bytes arriving now: its completion time in the device's schedule. */
static int64_t device_schedule(uint64_t n, int64_t now)
{
	int64_t t0, lat_end, xfer_start, done;
	unsigned c, best = 0;
	unsigned inflight = __atomic_add_fetch(&dev.inflight, 1, __ATOMIC_RELAXED);

	pthread_mutex_lock(&dev.lock);
	for (c = 1; c < dev.channels; c++)
		if (dev.chan_free[c] < dev.chan_free[best])
			best = c;
	t0 = dev.chan_free[best] > now ? dev.chan_free[best] : now;
	if (t0 > now) {
		dev.queued++;
		dev.queue_wait_ns += t0 - now;
	}
	lat_end = t0 + dev.latency_ns;
	xfer_start = lat_end > dev.bus_free ? lat_end : dev.bus_free;
	done = xfer_start + (int64_t)((double)n * dev.ns_per_byte + 0.5);
	dev.bus_free = done;
	dev.chan_free[best] = done;
	dev.residence_ns += done - now;
	/* requests arrive in time order (up to the lock's), so the union grows at its end */
	if (done > dev.busy_until) {
		dev.busy_ns += done - (now > dev.busy_until ? now : dev.busy_until);
		dev.busy_until = done;
	}
	dev.requests++;
	dev.bytes += n;
	if (n > dev.max_request)
		dev.max_request = n;
	if (inflight > dev.max_inflight)
		dev.max_inflight = inflight;
	if (inflight > dev.window_max_inflight)
		dev.window_max_inflight = inflight;
	pthread_mutex_unlock(&dev.lock);
	return done;
}

/* --- stats ------------------------------------------------------------------------------ */

static struct rusage serve_ru0;
static int64_t serve_t0;
static unsigned stats_seq;
static pthread_mutex_t stats_lock = PTHREAD_MUTEX_INITIALIZER;

static double tv_s(struct timeval tv)
{
	return (double)tv.tv_sec + (double)tv.tv_usec / 1e6;
}

static void write_stats(int final)
{
	struct rusage ru;
	char line[1024];
	int len;

	pthread_mutex_lock(&stats_lock);
	getrusage(RUSAGE_SELF, &ru);
	pthread_mutex_lock(&dev.lock);
	len = snprintf(line, sizeof line,
		       "onebit-emudrive seq=%u final=%d requests=%" PRIu64 " bytes=%" PRIu64
		       " user_s=%.6f sys_s=%.6f serve_user_s=%.6f serve_sys_s=%.6f wall_s=%.6f"
		       " max_inflight=%u window_max_inflight=%u queued=%" PRIu64 " queue_wait_s=%.6f max_request=%" PRIu64
		       " residence_s=%.6f busy_s=%.6f"
		       " latency_us=%.3f bandwidth=%.0f channels=%u max_read=%u file_bytes=%" PRIu64 "\n",
		       ++stats_seq, final, dev.requests, dev.bytes, tv_s(ru.ru_utime), tv_s(ru.ru_stime),
		       serve_t0 ? tv_s(ru.ru_utime) - tv_s(serve_ru0.ru_utime) : 0.0,
		       serve_t0 ? tv_s(ru.ru_stime) - tv_s(serve_ru0.ru_stime) : 0.0,
		       serve_t0 ? (double)(now_ns() - serve_t0) / 1e9 : 0.0, dev.max_inflight,
		       dev.window_max_inflight, dev.queued,
		       (double)dev.queue_wait_ns / 1e9, dev.max_request, (double)dev.residence_ns / 1e9,
		       (double)dev.busy_ns / 1e9, cfg.latency_us, cfg.bandwidth,
		       cfg.channels, cfg.max_read, data_size);
	dev.window_max_inflight = __atomic_load_n(&dev.inflight, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&dev.lock);

	if (cfg.stats_path == NULL) {
		fputs(line, stderr);
		fflush(stderr);
	} else {
		char tmp[PATH_MAX];
		FILE *f;
		snprintf(tmp, sizeof tmp, "%s.tmp%d", cfg.stats_path, (int)getpid());
		f = fopen(tmp, "w");
		if (f == NULL || fwrite(line, 1, (size_t)len, f) != (size_t)len || fclose(f) != 0 ||
		    rename(tmp, cfg.stats_path) != 0) {
			fprintf(stderr, "onebit-emudrive: cannot write the stats to %s: %s\n%s", cfg.stats_path,
				strerror(errno), line);
		}
	}
	pthread_mutex_unlock(&stats_lock);
}

/* SIGUSR1 is blocked in every thread; this one waits for it and writes a snapshot. */
static void *stats_thread(void *arg)
{
	sigset_t set;
	int sig;
	(void)arg;
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	for (;;)
		if (sigwait(&set, &sig) == 0 && sig == SIGUSR1)
			write_stats(0);
	return NULL;
}

/* --- the file system ------------------------------------------------------------------------ */

static void fill_attr(fuse_ino_t ino, struct stat *st)
{
	memset(st, 0, sizeof *st);
	st->st_ino = ino;
	st->st_uid = getuid();
	st->st_gid = getgid();
	st->st_atim = st->st_mtim = st->st_ctim = data_mtime;
	if (ino == ROOT_INO) {
		st->st_mode = S_IFDIR | 0555;
		st->st_nlink = 2;
	} else {
		st->st_mode = S_IFREG | 0444;
		st->st_nlink = 1;
		st->st_size = (off_t)data_size;
		st->st_blksize = (blksize_t)cfg.max_read;
		st->st_blocks = (blkcnt_t)((data_size + 511) / 512);
	}
}

static void emu_init(void *userdata, struct fuse_conn_info *conn)
{
	(void)userdata;
	/* several reads of one file in flight at once */
	if (conn->capable & FUSE_CAP_ASYNC_READ)
		conn->want |= FUSE_CAP_ASYNC_READ;
	/* the page cache is invalidated only by the kernel's own reclaim and by the caller */
	conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;
	/* plain write(2) replies: no splice paths, whose cost differs between kernels */
	conn->want &= ~(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
	/* must equal the max_read mount option (libfuse checks) */
	conn->max_read = cfg.max_read;
	/* the kernel's cap on background (readahead) requests: the device, not FUSE, limits depth */
	conn->max_background = cfg.max_background;
	conn->congestion_threshold = cfg.max_background * 3 / 4;
}

static void emu_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
	struct fuse_entry_param e;
	if (parent != ROOT_INO || strcmp(name, name_buf) != 0) {
		fuse_reply_err(req, ENOENT);
		return;
	}
	memset(&e, 0, sizeof e);
	e.ino = FILE_INO;
	e.attr_timeout = ATTR_TIMEOUT;
	e.entry_timeout = ATTR_TIMEOUT;
	fill_attr(FILE_INO, &e.attr);
	fuse_reply_entry(req, &e);
}

static void emu_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	struct stat st;
	(void)fi;
	if (ino != ROOT_INO && ino != FILE_INO) {
		fuse_reply_err(req, ENOENT);
		return;
	}
	fill_attr(ino, &st);
	fuse_reply_attr(req, &st, ATTR_TIMEOUT);
}

static void emu_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	if (ino == ROOT_INO) {
		fuse_reply_err(req, EISDIR);
		return;
	}
	if (ino != FILE_INO) {
		fuse_reply_err(req, ENOENT);
		return;
	}
	if ((fi->flags & O_ACCMODE) != O_RDONLY) {
		fuse_reply_err(req, EROFS);
		return;
	}
	fi->keep_cache = 1; /* pages stay cached across opens */
	fi->direct_io = 0;  /* reads go through the page cache */
	fuse_reply_open(req, fi);
}

static void emu_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
	uint64_t n = 0;
	int64_t done;
	int cancel_state;
	(void)fi;
	if (ino != FILE_INO) {
		fuse_reply_err(req, ino == ROOT_INO ? EISDIR : ENOENT);
		return;
	}
	if (off >= 0 && (uint64_t)off < data_size)
		n = data_size - (uint64_t)off < size ? data_size - (uint64_t)off : size;

	/* finish this request even if the loop is told to stop meanwhile: a reply is always sent */
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel_state);
	done = device_schedule(n, now_ns());
	sleep_until(done);
	/* done in the device; the reply's copy into the kernel is the host's cost, not the device's */
	__atomic_sub_fetch(&dev.inflight, 1, __ATOMIC_RELAXED);
	fuse_reply_buf(req, n ? (const char *)data + off : NULL, (size_t)n);
	pthread_setcancelstate(cancel_state, NULL);
}

static void emu_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
	char buf[1024];
	size_t len = 0;
	struct stat st;
	const char *names[3] = {".", "..", name_buf};
	fuse_ino_t inos[3] = {ROOT_INO, ROOT_INO, FILE_INO};
	(void)fi;
	if (ino != ROOT_INO) {
		fuse_reply_err(req, ENOTDIR);
		return;
	}
	for (off_t i = off; i < 3; i++) {
		size_t need;
		memset(&st, 0, sizeof st);
		st.st_ino = inos[i];
		st.st_mode = i < 2 ? S_IFDIR : S_IFREG;
		need = fuse_add_direntry(req, buf + len, sizeof buf - len, names[i], &st, i + 1);
		if (need > sizeof buf - len || len + need > size)
			break;
		len += need;
	}
	fuse_reply_buf(req, buf, len);
}

static void emu_statfs(fuse_req_t req, fuse_ino_t ino)
{
	struct statvfs sv;
	(void)ino;
	memset(&sv, 0, sizeof sv);
	sv.f_bsize = cfg.max_read;
	sv.f_frsize = 4096;
	sv.f_blocks = (fsblkcnt_t)((data_size + 4095) / 4096);
	sv.f_files = 2;
	sv.f_namemax = NAME_MAX;
	sv.f_flag = ST_RDONLY;
	fuse_reply_statfs(req, &sv);
}

static const struct fuse_lowlevel_ops emu_ops = {
	.init = emu_init,
	.lookup = emu_lookup,
	.getattr = emu_getattr,
	.open = emu_open,
	.read = emu_read,
	.readdir = emu_readdir,
	.statfs = emu_statfs,
};

/* --- loading --------------------------------------------------------------------------------- */

static int load_file(const char *path)
{
	struct stat st;
	uint64_t got = 0;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		fprintf(stderr, "onebit-emudrive: cannot open %s: %s\n", path, strerror(errno));
		return -1;
	}
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		fprintf(stderr, "onebit-emudrive: %s is not a regular file\n", path);
		close(fd);
		return -1;
	}
	data_size = (uint64_t)st.st_size;
	data_mtime = st.st_mtim;
	if (data_size > 0) {
		void *p = mmap(NULL, data_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED) {
			fprintf(stderr, "onebit-emudrive: cannot allocate %" PRIu64 " bytes for %s: %s\n", data_size,
				path, strerror(errno));
			close(fd);
			return -1;
		}
		madvise(p, data_size, MADV_HUGEPAGE); /* fewer TLB misses when copying out; advisory */
		data = p;
	}
	while (got < data_size) {
		size_t chunk = data_size - got < (64u << 20) ? (size_t)(data_size - got) : (64u << 20);
		ssize_t r = pread(fd, data + got, chunk, (off_t)got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			fprintf(stderr, "onebit-emudrive: cannot read %s at %" PRIu64 ": %s\n", path, got,
				r < 0 ? strerror(errno) : "unexpected end of file");
			close(fd);
			return -1;
		}
		got += (uint64_t)r;
	}
	/* the bytes now live in this process: drop the source's page cache so they are not held twice */
	posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
	close(fd);
	return 0;
}

/* --- command line ---------------------------------------------------------------------------- */

static void usage(FILE *to)
{
	fprintf(to,
		"usage: onebit-emudrive [options] FILE MOUNTPOINT\n"
		"Serve FILE read-only from this process's memory at MOUNTPOINT/NAME through a device model.\n"
		"  --latency-us US       latency of each request, overlapping across requests (default 0)\n"
		"  --bandwidth B         bus bandwidth in bytes/s, shared by the requests in flight (0: unlimited)\n"
		"  --channels N          requests in service at once; later ones wait (default 64, 1..%u)\n"
		"  --max-read BYTES      FUSE's largest read request, a multiple of 4096 in %u..%u (default 131072)\n"
		"  --name NAME           the file's name in the mount (default: FILE's base name)\n"
		"  --stats PATH          stats line here (SIGUSR1: a snapshot; exit: the final line); default stderr\n"
		"  --max-threads N       FUSE worker threads at most (default 256)\n"
		"  --max-background N    the kernel's background (readahead) requests in flight at most (default 64)\n"
		"  --die-with-parent     exit (and unmount) when the parent process exits\n"
		"  --debug               libfuse's debug output on stderr\n"
		"Prints \"ready MOUNTPOINT\" on stdout once mounted. SIGTERM, SIGINT or SIGHUP unmount and exit.\n"
		"Exit: 0 ok, 1 runtime failure, 2 usage.\n",
		CHANNELS_MAX, MAX_READ_MIN, MAX_READ_MAX);
}

static int parse_double(const char *opt, const char *s, double lo, double hi, double *out)
{
	char *end;
	double v;
	errno = 0;
	v = strtod(s, &end);
	if (errno || end == s || *end || !isfinite(v) || v < lo || v > hi) {
		fprintf(stderr, "onebit-emudrive: %s wants a number in [%g, %g], got '%s'\n", opt, lo, hi, s);
		return -1;
	}
	*out = v;
	return 0;
}

static int parse_unsigned(const char *opt, const char *s, unsigned lo, unsigned hi, unsigned *out)
{
	char *end;
	unsigned long long v;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s || *end || *s == '-' || v < lo || v > hi) {
		fprintf(stderr, "onebit-emudrive: %s wants an integer in [%u, %u], got '%s'\n", opt, lo, hi, s);
		return -1;
	}
	*out = (unsigned)v;
	return 0;
}

enum {
	OPT_LATENCY = 256,
	OPT_BANDWIDTH,
	OPT_CHANNELS,
	OPT_MAX_READ,
	OPT_NAME,
	OPT_STATS,
	OPT_MAX_THREADS,
	OPT_MAX_BACKGROUND,
	OPT_DIE_WITH_PARENT,
	OPT_DEBUG,
};

static int parse_args(int argc, char **argv)
{
	static const struct option longopts[] = {
		{"latency-us", required_argument, NULL, OPT_LATENCY},
		{"bandwidth", required_argument, NULL, OPT_BANDWIDTH},
		{"channels", required_argument, NULL, OPT_CHANNELS},
		{"max-read", required_argument, NULL, OPT_MAX_READ},
		{"name", required_argument, NULL, OPT_NAME},
		{"stats", required_argument, NULL, OPT_STATS},
		{"max-threads", required_argument, NULL, OPT_MAX_THREADS},
		{"max-background", required_argument, NULL, OPT_MAX_BACKGROUND},
		{"die-with-parent", no_argument, NULL, OPT_DIE_WITH_PARENT},
		{"debug", no_argument, NULL, OPT_DEBUG},
		{"help", no_argument, NULL, 'h'},
		{NULL, 0, NULL, 0},
	};
	int c, bad = 0;
	const char *base;
	while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
		switch (c) {
		case OPT_LATENCY: bad |= parse_double("--latency-us", optarg, 0, 1e7, &cfg.latency_us); break;
		case OPT_BANDWIDTH: bad |= parse_double("--bandwidth", optarg, 0, 1e13, &cfg.bandwidth); break;
		case OPT_CHANNELS:
			bad |= parse_unsigned("--channels", optarg, 1, CHANNELS_MAX, &cfg.channels);
			break;
		case OPT_MAX_READ:
			bad |= parse_unsigned("--max-read", optarg, MAX_READ_MIN, MAX_READ_MAX, &cfg.max_read);
			if (!bad && cfg.max_read % 4096) {
				fprintf(stderr, "onebit-emudrive: --max-read must be a multiple of 4096\n");
				bad = 1;
			}
			break;
		case OPT_NAME: cfg.name = optarg; break;
		case OPT_STATS: cfg.stats_path = optarg; break;
		case OPT_MAX_THREADS: bad |= parse_unsigned("--max-threads", optarg, 2, 4096, &cfg.max_threads); break;
		case OPT_MAX_BACKGROUND:
			bad |= parse_unsigned("--max-background", optarg, 1, 65535, &cfg.max_background);
			break;
		case OPT_DIE_WITH_PARENT: cfg.die_with_parent = 1; break;
		case OPT_DEBUG: cfg.debug = 1; break;
		case 'h': usage(stdout); exit(0);
		default: bad = 1;
		}
	}
	if (bad)
		return -1;
	if (argc - optind != 2) {
		fprintf(stderr, "onebit-emudrive: want FILE and MOUNTPOINT, got %d arguments\n", argc - optind);
		return -1;
	}
	cfg.file = argv[optind];
	cfg.mountpoint = argv[optind + 1];
	base = strrchr(cfg.file, '/');
	base = cfg.name ? cfg.name : base ? base + 1 : cfg.file;
	if (!*base || strchr(base, '/') || !strcmp(base, ".") || !strcmp(base, "..") || strlen(base) > NAME_MAX) {
		fprintf(stderr, "onebit-emudrive: '%s' is not a valid file name in the mount\n", base);
		return -1;
	}
	strcpy(name_buf, base);
	return 0;
}

/* --- main -------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
	struct stat st;
	struct fuse_session *se;
	struct fuse_args args = FUSE_ARGS_INIT(0, NULL);
	char opts[256];
	sigset_t usr1, all, old;
	pthread_t stats_tid;
	int rc = 0;

	if (parse_args(argc, argv) != 0) {
		usage(stderr);
		return EXIT_USAGE;
	}
	if (stat(cfg.mountpoint, &st) != 0 || !S_ISDIR(st.st_mode)) {
		fprintf(stderr, "onebit-emudrive: the mountpoint %s is not a directory\n", cfg.mountpoint);
		return EXIT_USAGE;
	}
	if (cfg.die_with_parent) {
		pid_t parent = getppid();
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		if (getppid() != parent) /* the parent is already gone */
			return EXIT_RUNTIME;
	}
	/* sleeps end within about a microsecond of their deadline, not the default 50 us slack;
	 * threads inherit it */
	prctl(PR_SET_TIMERSLACK, 1UL);

	dev.latency_ns = (int64_t)llround(cfg.latency_us * 1000.0);
	dev.ns_per_byte = cfg.bandwidth > 0 ? 1e9 / cfg.bandwidth : 0.0;
	dev.channels = cfg.channels;
	dev.chan_free = calloc(cfg.channels, sizeof *dev.chan_free);
	if (dev.chan_free == NULL) {
		fprintf(stderr, "onebit-emudrive: out of memory\n");
		return EXIT_RUNTIME;
	}
	if (load_file(cfg.file) != 0)
		return EXIT_RUNTIME;

	/* SIGUSR1 goes to the stats thread only; it blocks everything else */
	sigemptyset(&usr1);
	sigaddset(&usr1, SIGUSR1);
	pthread_sigmask(SIG_BLOCK, &usr1, NULL);
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	if (pthread_create(&stats_tid, NULL, stats_thread, NULL) != 0) {
		fprintf(stderr, "onebit-emudrive: cannot start the stats thread\n");
		return EXIT_RUNTIME;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);

	snprintf(opts, sizeof opts, "ro,default_permissions,fsname=onebit-emudrive,subtype=emudrive,max_read=%u%s",
		 cfg.max_read, geteuid() == 0 ? ",allow_other" : "");
	if (fuse_opt_add_arg(&args, argv[0]) || fuse_opt_add_arg(&args, "-o") || fuse_opt_add_arg(&args, opts) ||
	    (cfg.debug && fuse_opt_add_arg(&args, "-d"))) {
		fprintf(stderr, "onebit-emudrive: out of memory\n");
		return EXIT_RUNTIME;
	}
	se = fuse_session_new(&args, &emu_ops, sizeof emu_ops, NULL);
	fuse_opt_free_args(&args);
	if (se == NULL) {
		fprintf(stderr, "onebit-emudrive: cannot create the FUSE session\n");
		return EXIT_RUNTIME;
	}
	if (fuse_set_signal_handlers(se) != 0) {
		fprintf(stderr, "onebit-emudrive: cannot install the signal handlers\n");
		fuse_session_destroy(se);
		return EXIT_RUNTIME;
	}
	if (fuse_session_mount(se, cfg.mountpoint) != 0) {
		fprintf(stderr, "onebit-emudrive: cannot mount at %s (is /dev/fuse there and usable, fusermount3 "
				"installed for a non-root user?)\n",
			cfg.mountpoint);
		fuse_remove_signal_handlers(se);
		fuse_session_destroy(se);
		return EXIT_RUNTIME;
	}

	getrusage(RUSAGE_SELF, &serve_ru0);
	serve_t0 = now_ns();
	printf("ready %s\n", cfg.mountpoint);
	fflush(stdout);

	{
#if FUSE_USE_VERSION >= 312
		struct fuse_loop_config *lc = fuse_loop_cfg_create();
		if (lc == NULL) {
			fprintf(stderr, "onebit-emudrive: out of memory\n");
			rc = -1;
		} else {
			fuse_loop_cfg_set_clone_fd(lc, 1);
			fuse_loop_cfg_set_max_threads(lc, cfg.max_threads);
			fuse_loop_cfg_set_idle_threads(lc, cfg.max_threads);
			rc = fuse_session_loop_mt(se, lc);
			fuse_loop_cfg_destroy(lc);
		}
#else
		struct fuse_loop_config lc = {.clone_fd = 1, .max_idle_threads = cfg.max_threads};
		rc = fuse_session_loop_mt(se, &lc);
#endif
	}

	fuse_session_unmount(se);
	fuse_remove_signal_handlers(se);
	fuse_session_destroy(se);
	write_stats(1);
	/* the loop returns the number of the signal that stopped it, or -errno on a failure */
	if (rc < 0) {
		fprintf(stderr, "onebit-emudrive: the FUSE loop failed: %s\n", strerror(-rc));
		return EXIT_RUNTIME;
	}
	return 0;
}
