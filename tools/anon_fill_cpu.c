// anon_fill_cpu: the CPU a keep=anon read costs per MiB (docs/results.md, "The workers' CPU and keep anon's
// fresh pages"). Each of N slices of SIZE bytes, at random MiB offsets of FILE, is read as patch 0028's
// workers read it: a fresh anonymous buffer, O_DIRECT preads of at most 1 MiB, mprotect, mremap over a
// range of a mapping of FILE, one byte read there, then FILE mapped back over it (the eviction).
//
//   cc -O2 -o anon_fill_cpu tools/anon_fill_cpu.c
//   ./anon_fill_cpu FILE SIZE MODE N    MODE 0: 4 KiB pages (patch 0028 before 2026-12-06)
//                                       MODE 1: the buffer advised MADV_HUGEPAGE (patch 0028 where memfd_create fails)
//                                       MODE 2: one buffer reused, never moved (the floor: no page allocated)
//                                       MODE 3: one memfd slot reused, mapped over the range with MAP_SHARED |
//                                               MAP_FIXED | MAP_POPULATE (patch 0028's slots since 2026-12-06)
//                                       MODE 4: as 1, the buffer's pages faulted in at once by
//                                               MADV_POPULATE_WRITE before the reads
//
// It prints the process's CPU (user + system) and the wall time per MiB read (one thread, one read at a
// time). Exit 0, 1 a system call failed, 2 usage.
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double cpu_s(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec / 1e6;
}

static double wall_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int fail(const char * what) {
    perror(what);
    return 1;
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s FILE SIZE MODE N\n", argv[0]);
        return 2;
    }
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    const size_t size = (size_t) strtoull(argv[2], NULL, 10) / page * page;
    const int    mode = atoi(argv[3]);
    const int    n    = atoi(argv[4]);
    const size_t span = 64ul << 20; // where the slices are placed: 8 places 8 MiB apart, 4 KiB in
    struct stat  st;
    const int    fd  = open(argv[1], O_RDONLY);
    const int    fdd = open(argv[1], O_RDONLY | O_DIRECT);
    if (size == 0 || mode < 0 || mode > 4 || n < 1) {
        fprintf(stderr, "%s: SIZE of at least a page, MODE 0 to 4, N at least 1\n", argv[0]);
        return 2;
    }
    if (fd < 0 || fdd < 0 || fstat(fd, &st) != 0) {
        return fail(argv[1]);
    }
    if ((size_t) st.st_size < span + size + (1ul << 20)) {
        fprintf(stderr, "%s: FILE must hold at least %zu MiB\n", argv[0], ((span + size) >> 20) + 1);
        return 2;
    }
    uint8_t * map = mmap(NULL, span, PROT_READ, MAP_SHARED, fd, 0);
    uint8_t * reuse = NULL;
    if (map == MAP_FAILED) {
        return fail("mmap");
    }
    if (mode == 2) {
        reuse = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (reuse == MAP_FAILED) {
            return fail("mmap");
        }
    }
    int mfd = -1;
    if (mode == 3) {
        mfd = memfd_create("slot", MFD_CLOEXEC);
        if (mfd < 0 || ftruncate(mfd, (off_t) size) != 0) {
            return fail("memfd");
        }
        reuse = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
        if (reuse == MAP_FAILED) {
            return fail("mmap");
        }
    }
    srand(1);
    const double c0 = cpu_s();
    const double w0 = wall_s();
    for (int i = 0; i < n; i++) {
        const off_t off = (off_t) (rand() % (int) ((st.st_size - size) >> 20)) << 20;
        uint8_t *   buf = reuse;
        if (buf == NULL) {
            buf = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (buf == MAP_FAILED) {
                return fail("mmap");
            }
            if (mode == 1 || mode == 4) {
                madvise(buf, size, MADV_HUGEPAGE);
            }
            if (mode == 4 && madvise(buf, size, MADV_POPULATE_WRITE) != 0) {
                return fail("madvise");
            }
        }
        for (size_t lo = 0; lo < size; lo += 1ul << 20) {
            const size_t len = size - lo < (1ul << 20) ? size - lo : (1ul << 20);
            if (pread(fdd, buf + lo, len, off + (off_t) lo) != (ssize_t) len) {
                return fail("pread");
            }
        }
        uint8_t * addr = map + page + (size_t) (i % 8) * (8ul << 20);
        if (mode == 3) {
            if (mmap(addr, size, PROT_READ, MAP_SHARED | MAP_FIXED | MAP_POPULATE, mfd, 0) == MAP_FAILED) {
                return fail("mmap");
            }
            volatile uint8_t x = addr[size / 2];
            (void) x;
            if (mmap(addr, size, PROT_READ, MAP_SHARED | MAP_FIXED, fd, (off_t) (addr - map)) == MAP_FAILED) {
                return fail("mmap");
            }
        } else if (reuse == NULL) {
            if (mprotect(buf, size, PROT_READ) != 0 ||
                mremap(buf, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, addr) == MAP_FAILED) {
                return fail("mremap");
            }
            volatile uint8_t x = addr[size / 2]; // the matmul reads it
            (void) x;
            if (mmap(addr, size, PROT_READ, MAP_SHARED | MAP_FIXED, fd, (off_t) (addr - map)) == MAP_FAILED) {
                return fail("mmap");
            }
        }
    }
    const double mib = (double) n * (double) size / 1048576.0;
    const double cpu = cpu_s() - c0;
    const double wall = wall_s() - w0;
    printf("mode %d, %zu-byte slices: %.3f ms of CPU and %.3f ms of wall time per MiB over %.1f MiB\n", mode, size,
           1e3 * cpu / mib, 1e3 * wall / mib, mib);
    return 0;
}
