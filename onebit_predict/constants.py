"""Constants shared by the sidecar: environment names, trace layout, exit codes.

Every number that must match the C++ side (docs/trace-format.md, docs/policy.md) is
defined here once.
"""

from __future__ import annotations

# --- environment (docs/policy.md) -------------------------------------------------------
ENV_MODE = "ONEBIT_MOE_PREDICT"
ENV_DEPTH = "ONEBIT_MOE_PREDICT_DEPTH"
ENV_MARGIN = "ONEBIT_MOE_PREDICT_MARGIN"
ENV_MIN = "ONEBIT_MOE_PREDICT_MIN"
ENV_LAYERS = "ONEBIT_MOE_PREDICT_LAYERS"
ENV_NO_ATTN = "ONEBIT_MOE_PREDICT_NO_ATTN"
ENV_OUT = "ONEBIT_MOE_PREDICT_OUT"
ENV_STATS = "ONEBIT_MOE_PREDICT_STATS"
ENV_AHEAD = "ONEBIT_MOE_PREDICT_AHEAD"  # predict layer l+K from layer l
ENV_LEARNED = "ONEBIT_MOE_PREDICT_LEARNED"  # the learned predictor's GGUF sidecar (ONEBIT_MOE_PREDICT=learned)
# controls for checks, never for use (docs/policy.md)
ENV_DEBUG_SELF = "ONEBIT_MOE_PREDICT_DEBUG_SELF"
ENV_DEBUG_LEAK = "ONEBIT_MOE_PREDICT_DEBUG_LEAK"
DEBUG_LEAK_UNCHECKED = "1"  # the speculative block stores, the graph check is off: the output must differ
DEBUG_LEAK_CHECKED = "check"  # ... with the graph check on: the context must be refused

MODE_OFF = 0
MODE_ROUTER = 1
MODE_BLOCK = 2
MODE_LEARNED = 3  # a learned linear predictor from a GGUF sidecar (onebit_predict/learned.py)
MODE_NAMES = {MODE_OFF: "off", MODE_ROUTER: "router", MODE_BLOCK: "block", MODE_LEARNED: "learned"}

MAX_LAYERS = 512  # LLAMA_MAX_LAYERS, and the width of the trace's layer mask
AHEAD_MAX = 3  # ONEBIT_MOE_PREDICT_AHEAD is in [1, AHEAD_MAX]

# the prefetch consumer (docs/policy.md, "The prefetch consumer")
ENV_PREFETCH = "ONEBIT_MOE_PREFETCH"
ENV_PREFETCH_MAX_BYTES = "ONEBIT_MOE_PREFETCH_MAX_BYTES"
ENV_PREFETCH_THREADS = "ONEBIT_MOE_PREFETCH_THREADS"
ENV_PREFETCH_GUARD = "ONEBIT_MOE_PREFETCH_GUARD"  # tokens per probe of the guard, 0 = none (the default)
ENV_PREFETCH_ROOM = "ONEBIT_MOE_PREFETCH_ROOM"  # issue only while the page cache holds R x one token's weights
ENV_PREFETCH_ROUTE = "ONEBIT_MOE_PREFETCH_ROUTE"  # also read each layer's routed experts as soon as its router ran
ENV_PREFETCH_RANDOM = "ONEBIT_MOE_PREFETCH_RANDOM"  # readahead off on the expert tensors (MADV_RANDOM)
ENV_PREFETCH_WAIT = "ONEBIT_MOE_PREFETCH_WAIT"  # the route-time op waits for its layer's reads
ENV_PREFETCH_KEEP = "ONEBIT_MOE_PREFETCH_KEEP"  # what decides which experts stay cached: kernel or lru
ENV_PREFETCH_ORDER = "ONEBIT_MOE_PREFETCH_ORDER"  # the order of a layer's reads and expert matmuls: index or hits
ENV_PREFETCH_LAYERS = "ONEBIT_MOE_PREFETCH_LAYERS"  # whole layers a batch's route-time reads go ahead, 0 = off
# the MoE compensator's GGUF sidecar (docs/int2.md): changes the output, so never set by a bit-identity check
ENV_COMPENSATOR = "ONEBIT_MOE_COMPENSATOR"
# a benchmark control: every ubatch waits for its read-mode reads (onebit-bench --cold)
ENV_PREFETCH_DEBUG_DRAIN = "ONEBIT_MOE_PREFETCH_DEBUG_DRAIN"
# a benchmark control: the consumer reads the routing a trace of the same tokens recorded (the oracle)
ENV_PREFETCH_DEBUG_ORACLE = "ONEBIT_MOE_PREFETCH_DEBUG_ORACLE"
ENV_PREFETCH_DEBUG_KEEP_CAP = (
    "ONEBIT_MOE_PREFETCH_DEBUG_KEEP_CAP"  # checks only: the LRU holds N experts, whatever the room
)
# a benchmark control: with layers, what becomes of a layer that ran: none, cold (MADV_COLD) or pageout (the default)
ENV_PREFETCH_DEBUG_HANDBACK = "ONEBIT_MOE_PREFETCH_DEBUG_HANDBACK"

# every variable libllama reads: a check that must not inherit the caller's settings sets or
# clears each of them
ENV_ALL = (
    ENV_MODE,
    ENV_DEPTH,
    ENV_MARGIN,
    ENV_MIN,
    ENV_LAYERS,
    ENV_NO_ATTN,
    ENV_OUT,
    ENV_STATS,
    ENV_DEBUG_SELF,
    ENV_DEBUG_LEAK,
    ENV_PREFETCH,
    ENV_PREFETCH_MAX_BYTES,
    ENV_PREFETCH_THREADS,
    ENV_PREFETCH_DEBUG_DRAIN,
    ENV_AHEAD,
    ENV_PREFETCH_GUARD,
    ENV_PREFETCH_DEBUG_ORACLE,
    ENV_LEARNED,
    ENV_PREFETCH_ROOM,
    ENV_PREFETCH_ROUTE,
    ENV_PREFETCH_RANDOM,
    ENV_COMPENSATOR,
    ENV_PREFETCH_WAIT,
    ENV_PREFETCH_KEEP,
    ENV_PREFETCH_DEBUG_KEEP_CAP,
    ENV_PREFETCH_ORDER,
    ENV_PREFETCH_LAYERS,
    ENV_PREFETCH_DEBUG_HANDBACK,
)

PREFETCH_OFF = 0
PREFETCH_ADVISE = 1  # madvise(MADV_WILLNEED) on the predicted experts' pages
PREFETCH_READ = 2  # background workers touch those pages
PREFETCH_POPULATE = 3  # background workers madvise(MADV_POPULATE_READ) them (Linux 5.14)
PREFETCH_PREAD = 4  # background workers pread them through the model file (large requests, exact bytes)
PREFETCH_NAMES = {
    PREFETCH_OFF: "off",
    PREFETCH_ADVISE: "advise",
    PREFETCH_READ: "read",
    PREFETCH_POPULATE: "populate",
    PREFETCH_PREAD: "pread",
}
KEEP_KERNEL = 0  # the kernel's page reclaim decides which experts stay cached
KEEP_LRU = 1  # an LRU over whole experts sized to the room; the consumer pages out what it evicts
KEEP_ANON = 2  # the same LRU, its experts in anonymous memory of the consumer's own (pread, O_DIRECT)
KEEP_NAMES = {KEEP_KERNEL: "kernel", KEEP_LRU: "lru", KEEP_ANON: "anon"}
ORDER_INDEX = 0  # route reads expert by expert; ggml's matmuls take a layer's experts by index
ORDER_HITS = 1  # reads tensor by tensor as the matmuls use them; resident experts first (onebit-mmid-order.h)
ORDER_NAMES = {ORDER_INDEX: "index", ORDER_HITS: "hits"}
PREFETCH_ROUTE_CALL = PREFETCH_READ  # the call route-time reads make when ONEBIT_MOE_PREFETCH names none

PREFETCH_THREADS_DEFAULT = 8  # workers blocked in reads: a drive with queue depth serves several at once
PREFETCH_THREADS_MAX = 16
# keep anon: a routed slice is read in two or more chunks of at most this, one worker each (C ONEBIT_HOLD_CHUNK)
HOLD_CHUNK_BYTES = 1 << 20
PREFETCH_LAYERS_MAX = 8  # ONEBIT_MOE_PREFETCH_LAYERS is in [0, PREFETCH_LAYERS_MAX]
PREFETCH_MAX_BYTES_LIMIT = 1 << 40  # 1 TiB: larger caps are a typo
PREFETCH_GUARD_DEFAULT = 0  # tokens per probe: no guard unless asked
PREFETCH_GUARD_MAX = 64
PREFETCH_ROOM_DEFAULT = 1.0  # the room rule: page cache for one token's mapped weights
PREFETCH_ROOM_MAX = 64.0

# --- trace (docs/trace-format.md) -------------------------------------------------------
TRACE_MAGIC = b"OBMPTRC\x00"
TRACE_VERSION = 3  # what this package writes; 2 added the prefetch consumer's fields, 3 the distance
TRACE_VERSIONS_READ = (1, 2, 3)  # what it reads (1: no prefetch fields; 1, 2: every prediction is L+1)
TRACE_VERSION_DISTANCE = 3  # the first version whose records carry the lookahead distance (offset 18)
TRACE_HEADER_SIZE = 512
TRACE_RECORD_FIXED = 20  # bytes before the per-expert arrays
TRACE_FLAG_PREDICTED = 1 << 0
TRACE_FLAG_DECODE = 1 << 1
TRACE_HDR_FLAG_NO_ATTN = 1 << 0
TRACE_HDR_FLAG_STATS = 1 << 1
TRACE_HDR_FLAG_DEBUG_SELF = 1 << 2
TRACE_HDR_FLAG_PREFETCH_TOTALS = 1 << 3  # the consumer's totals were written (a clean close)
TRACE_HDR_FLAG_DEBUG_LEAK = 1 << 4  # the negative control was built into the context's graphs
TRACE_HDR_FLAG_UNCHECKED = 1 << 5  # ... with the graph check off (ONEBIT_MOE_PREDICT_DEBUG_LEAK=1)
TRACE_HDR_FLAG_OPEN = 1 << 6  # set when the context creates the trace, cleared when it frees it cleanly
TRACE_HDR_FLAG_INCOMPLETE = 1 << 7  # set when the context is freed: a write of records failed (full disk)
# version 3: two fields inside the flags word, and between them the consumer's bits 12..14
TRACE_HDR_AHEAD_SHIFT = 8  # bits 8..11: ONEBIT_MOE_PREDICT_AHEAD (1..3; 0 before version 3, meaning 1)
TRACE_HDR_AHEAD_MASK = 0xF << TRACE_HDR_AHEAD_SHIFT
TRACE_HDR_FLAG_ROUTE = 1 << 12  # the consumer read at route time (ONEBIT_MOE_PREFETCH_ROUTE)
TRACE_HDR_FLAG_RANDOM = 1 << 13  # readahead off on the expert tensors (ONEBIT_MOE_PREFETCH_RANDOM)
TRACE_HDR_FLAG_SPECULATIVE = 1 << 14  # the consumer read the predicted experts ahead (a call and a predictor)
TRACE_HDR_FLAG_WAIT = 1 << 15  # the route-time op waited for its layer's reads (ONEBIT_MOE_PREFETCH_WAIT)
TRACE_HDR_GUARD_SHIFT = 16  # bits 16..23: the consumer's guard window (ONEBIT_MOE_PREFETCH_GUARD; 0 none)
TRACE_HDR_GUARD_MASK = 0xFF << TRACE_HDR_GUARD_SHIFT
TRACE_ARCH_BYTES = 32  # NUL-padded
TRACE_MODEL_BYTES = 256  # NUL-padded, at most 255 bytes of text
TRACE_CHUNK_RECORDS = 1 << 14  # records a reader holds at once (bounded memory)
# bounds a reader enforces on the header (docs/trace-format.md, "Bounds a reader enforces")
TRACE_MAX_EXPERTS = (1 << 31) - 1  # n_expert: expert ids are i32 in the records and in the stats kernel
TRACE_MAX_DEPTH = 0xFFFF  # depth and n_expert_used: a record's n_read is a u16 (record_size stays < 1 MiB)
TRACE_HDR_FLAGS_KNOWN = (
    TRACE_HDR_FLAG_NO_ATTN
    | TRACE_HDR_FLAG_STATS
    | TRACE_HDR_FLAG_DEBUG_SELF
    | TRACE_HDR_FLAG_PREFETCH_TOTALS
    | TRACE_HDR_FLAG_DEBUG_LEAK
    | TRACE_HDR_FLAG_UNCHECKED
    | TRACE_HDR_FLAG_OPEN
    | TRACE_HDR_FLAG_INCOMPLETE
    | TRACE_HDR_AHEAD_MASK
    | TRACE_HDR_FLAG_ROUTE
    | TRACE_HDR_FLAG_RANDOM
    | TRACE_HDR_FLAG_SPECULATIVE
    | TRACE_HDR_FLAG_WAIT
    | TRACE_HDR_GUARD_MASK
)  # other header flag bits are refused
TRACE_MAX_DEPTH_REQUESTED = 999_999_999  # _DEPTH as parsed: at most 9 digits (policy.MAX_DIGITS)
TRACE_MAX_PREFETCH_TOTAL = (1 << 63) - 1  # each prefetch total fits an int64
TRACE_MAX_ERRNO = 4095  # an errno in prefetch_errors (Linux MAX_ERRNO)

# --- onebit-stats (onebit_predict/stats.py) ---------------------------------------------
STATS_ENGINE_C = "c"  # the compiled kernel (onebit_predict/stats_kernel.c): the default
STATS_ENGINE_NUMPY = "numpy"  # whole-array numpy passes: the reference, chosen explicitly
STATS_ENGINES = (STATS_ENGINE_C, STATS_ENGINE_NUMPY)

# --- the cache of built artefacts (build.sh, cffi modules) ------------------------------
ENV_CACHE = "ONEBIT_CACHE"  # the cache root; default ~/CACHE_DIR_DEFAULT
CACHE_DIR_DEFAULT = ".cache/onebit-predict"

# --- command exit codes (as llama.cpp tools) --------------------------------------------
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C): 128 + 2, as a shell reports a process it ended

# --- replay and simulate (docs/cost-model.md) -------------------------------------------
REPLAY_POLICIES = ("lru", "lfru", "belady")
REPLAY_PREFETCH_MODES = ("none", "trace", "protect")  # trace: charged prefetch; protect: free eviction hint
LFRU_WINDOW_DEFAULT = 32  # tokens of a layer over which LFRU counts an expert's uses
SIM_LATENCY_US_DEFAULT = 100.0  # per-read latency of the drive (NVMe random read, order of magnitude)
SIM_QUEUE_DEPTH_DEFAULT = 4  # reads the drive has in service at once (their latencies overlap)
SIM_ROUTE_AT_DEFAULT = 0.3  # fraction of a layer's compute done before its router (attention, norms)
SIM_PLOT_BANDWIDTHS = (0.5e9, 1e9, 2e9, 3e9, 5e9, 7e9, 10e9, 14e9, 20e9)  # bytes/s of the tok/s sweep
# the consumer's default workers before route-time reads (ONEBIT_PREFETCH_THREADS_DEFAULT was 2): the page
# model plays a report written then (its rows' config objects lack ``route``) with them
PREFETCH_THREADS_BEFORE_ROUTE = 2

# --- the GGUF sidecars (sidecar.py: learned.py, int2/compensator.py) --------------------
# the largest gain bound a sidecar's map may have per layer: ||up||_F * ||down||_F of a compensator
# layer, ||W||_F and max|b| of a learned predictor's layer (float64). F16's largest finite value: a
# map that can amplify a unit-norm input past it overflows the F16 K/V cache and F16 matmul inputs
# downstream. The patch series' C++ loaders refuse a sidecar above it with the same rule.
SIDECAR_MAX_GAIN = 65504.0

# --- what onebit-bench changes on the machine, recorded before it changes it (llama/run_state.py) ---
ENV_RUN_STATE = "ONEBIT_RUN_STATE_DIR"  # where each run keeps its state file (tests point it at a temporary one)
RUN_STATE_DIR = "/run/onebit-predict"  # as root; otherwise $XDG_RUNTIME_DIR/onebit-predict, else the temp dir's
RUN_OWNED_PREFIX = "onebit-"  # cgroups and temporary directories a later run may remove start with it
# --read-ahead-kb: KiB, a whole number of pages, at most 1 GiB (the kernel takes up to 2^32 - 1 on a block
# device, any unsigned long on a bdi, and reads back a value rounded down to pages; more than a GiB of
# readahead per fault is a typo, not a setting)
READ_AHEAD_KB_MAX = 1 << 20

# --- where a decoded token's time goes (checks/worker.py, llama/diskstats.py, costmodel/measured.py DecodeSplit) ---
COMPUTE_THREAD = "thread"  # --threads 1: the decoding thread's own CPU time (the split compute / waiting is exact)
COMPUTE_PROCESS = "process"  # more threads: the process's CPU over the decode, every thread's (no wait is separable)
PROC_DISKSTATS = "/proc/diskstats"
PROC_SCHEDSTAT = "/proc/thread-self/schedstat"  # the calling thread's CPU, run-queue wait (ns), slices
# a confined run's trace: in memory, where its dirty pages cannot stall the cgroup's reclaim (bench_memory.py)
TRACE_RAM_DIR = "/dev/shm"
DISKSTATS_SECTOR = 512  # /proc/diskstats counts 512-byte sectors, whatever the device's logical block size
LARGEST_CAP = "max_sectors_kb"  # a block device's largest request: its queue's cap, the largest possible
LARGEST_SEEN = "seen since mount"  # an emulated drive's largest request: the most its emulator served since mounted

# --- prompt processing under --memory-limit (onebit-bench --prompt-tokens, checks/bench_prefill.py) ---
PREFILL_UBATCH_DEFAULT = 512  # --ubatch when not given: llama.cpp's default n_ubatch (-ub)
PREFILL_CTX_SLACK = 8  # a prefill run's n_ctx: its prompt tokens and this
