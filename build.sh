#!/usr/bin/env bash
# build.sh: fetch the pinned llama.cpp, apply onebit-predict's patch series, build and test it,
# and move the series to another pin or a user's own llama.cpp checkout.
#
# ./build.sh help lists the subcommands. Everything slow is cached outside the checkout, under
# $ONEBIT_CACHE (default ~/.cache/onebit-predict), keyed by pin, series hash and build flags.
#
# exit codes: 0 ok, 1 a step failed (build, test, check, conflict), 2 usage or input error
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${ONEBIT_CACHE:-$HOME/.cache/onebit-predict}
PATCHES=$ROOT/patches
SERIES=$PATCHES/series
JOBS=${ONEBIT_JOBS:-$(nproc)}
PYTHON=${PYTHON:-python3}

# patches are applied and exported under a fixed identity and date, so the same series always
# yields the same commits and a byte-identical export
export GIT_COMMITTER_NAME=onebit-predict GIT_COMMITTER_EMAIL=onebit-predict@invalid
export GIT_COMMITTER_DATE="2000-01-01T00:00:00 +0000"
GIT=(git -c core.autocrlf=false -c core.abbrev=12 -c diff.noprefix=false -c diff.mnemonicPrefix=false
     -c diff.renames=true -c format.signature= -c commit.gpgsign=false -c am.threeWay=false -c init.defaultBranch=main
     -c advice.detachedHead=false)
PRISTINE_TAG=onebit-pristine
WORK_BRANCH=onebit

CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=ON
             -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
             -DGGML_NATIVE=ON -DGGML_CCACHE=OFF -DGGML_METAL=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF
             -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DGGML_RPC=ON)
TEST_TARGETS=(llama test-onebit-moe-policy test-onebit-moe-predict test-onebit-moe-slots test-amx-mul-mat-batched onebit-tiny-gguf test-onebit-rollback)
# llama.cpp's own tools, from the patched tree (./build.sh path prints the PATH line); the server's
# web UI is left out (no download at build time: the server answers its API, /metrics and /props);
# ggml-rpc-server (GGML_RPC above) serves layers to another machine's tools (--rpc HOST:PORT)
TOOL_TARGETS=(llama-cli llama-completion llama-server llama-bench llama-quantize llama-imatrix llama-perplexity ggml-rpc-server)
# the ctest of the series' upstream ggml fix carries upstream's label, not ours
CTEST_UPSTREAM_FIX=test-amx-mul-mat-batched

STEP=""
LOG=""

# --- output ---------------------------------------------------------------------------------
say()  { printf '%s\n' "$*" >&2; }
step() { STEP=$1; say "==> $1"; }
die()  { say "error: $1"; exit "${2:-1}"; }
usage_error() { say "error: $1"; say "run './build.sh help' for the subcommands"; exit 2; }

# run a command with its output in a log; on failure name the step, the log and what to do
run_logged() {
    local hint=$1; shift
    if ! "$@" >>"$LOG" 2>&1; then
        say "error: step '$STEP' failed; its log: $LOG"
        tail -n 25 "$LOG" | sed 's/^/    /' >&2
        say "what to do: $hint"
        exit 1
    fi
}

usage() {
    cat <<'EOF'
usage: ./build.sh [SUBCOMMAND] [OPTIONS]

  (none) | build      fetch the pinned sdist (sha256 checked), apply patches/series with git am -3,
                      build llama.cpp (shared libs, tests, CPU) and set up .venv with this package
  demo                build if needed, then trace router and block on the bundled trained model
                      and print their hit-rate table side by side (the README's main job)
  test                build if needed, then ctest -L onebit (and the upstream fix's ctest) and pytest
                      (the README's test command)
  check               lint the series and the patch headers, run ruff (check, format --check), apply
                      the series to a clean pristine tree without fuzz, re-export it and fail if the
                      export differs from patches/ by a byte, then compile the tree at every patch
                      (incremental, in $ONEBIT_CACHE/check-build; ONEBIT_CHECK_COMPILE=0 skips it)
  rebase --to VERSION apply the series to the llama.cpp of llama-cpp-python==VERSION
  rebase --tree DIR   apply the series to your own llama.cpp git checkout (current branch)
  export [--from DIR] regenerate patches/ from a work tree (default: the pinned work tree)
  pristine            build the unpatched pin too (for side-by-side benchmarks)
  path                build if needed, then print the line that puts the patched llama-cli,
                      llama-completion, llama-server, llama-bench, llama-quantize,
                      llama-imatrix, llama-perplexity and ggml-rpc-server on PATH
                      (eval "$(./build.sh path)")
  help                this text

environment: ONEBIT_CACHE (cache root, default ~/.cache/onebit-predict), ONEBIT_JOBS (build jobs),
             PYTHON (runs tools/series.py and makes .venv, default python3),
             ONEBIT_NO_APT=1 (build never runs apt-get: as root it installs the emulated drive's
             missing system packages, libfuse3-dev fuse3 fio pkg-config; otherwise it prints the
             command that would)
exit codes:  0 ok, 1 a step failed, 2 usage or input error
EOF
}

# --- the pin and the series -----------------------------------------------------------------
# read and linted by tools/series.py (standard library only, so the system's python3 runs it
# before .venv exists); it prints its errors itself and exits 2 on a missing or malformed
# patches/PIN or patches/series, 1 on lint problems
series_py() {
    "$PYTHON" "$ROOT/tools/series.py" --patches "$PATCHES" "$@"
}

pin_value() { series_py pin "$1"; }

# the patch files in series order; fails on a listed file that does not exist
series_files() { series_py files; }

series_hash() {
    local files paths=()
    files=$(series_files) || exit $?
    [[ -z $files ]] || mapfile -t paths <<<"$files"
    { cat "$SERIES"; [[ ${#paths[@]} -eq 0 ]] || cat "${paths[@]}"; } | sha256sum | cut -c1-16
}

flags_hash() {
    printf '%s\n' "${CMAKE_FLAGS[@]}" "${TEST_TARGETS[@]}" "${TOOL_TARGETS[@]}" | sha256sum | cut -c1-12
}

# --- the sdist and the pristine tree --------------------------------------------------------
sdist_path() { printf '%s/sdist/llama_cpp_python-%s.tar.gz' "$CACHE" "$1"; }

# fetch llama-cpp-python==VERSION's sdist with pip; verify it when a sha256 is given
fetch_sdist() {
    local version=$1 sha=$2 path
    path=$(sdist_path "$version")
    if [[ ! -f $path ]]; then
        step "fetch llama-cpp-python==$version (sdist)"
        mkdir -p "$CACHE/sdist"
        local tmp
        tmp=$(mktemp -d "$CACHE/sdist/.fetch.XXXXXX")
        run_logged "check the network to PyPI, or put the sdist at $path" \
            "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$version"
        mv "$tmp"/llama_cpp_python-"$version".tar.gz "$path"
        rm -rf "$tmp"
    fi
    step "verify the sdist"
    local actual
    actual=$(sha256sum "$path" | cut -d' ' -f1)
    if [[ -n $sha && $actual != "$sha" ]]; then
        say "error: $path has sha256 $actual"
        say "       patches/PIN expects    $sha"
        say "what to do: delete $path and run again to fetch it anew; if PyPI really serves another file, the pin must be reviewed"
        exit 1
    fi
    [[ -n $sha ]] || say "notice: llama-cpp-python==$version is not the pin: sha256 $actual (unverified)"
}

# a git repo of the sdist's vendored llama.cpp, one commit tagged onebit-pristine
pristine_tree() {
    local version=$1
    local dir=$CACHE/src/$version/pristine
    if [[ -f $dir/.onebit-ok ]]; then
        printf '%s' "$dir"
        return
    fi
    step "unpack the vendored llama.cpp of $version"
    rm -rf "$dir" "$dir.tmp"
    mkdir -p "$dir.tmp"
    run_logged "the sdist may be damaged: delete $(sdist_path "$version") and run again" \
        tar -xzf "$(sdist_path "$version")" -C "$dir.tmp" --strip-components=3 "llama_cpp_python-$version/vendor/llama.cpp"
    rm -f "$dir.tmp/.git" # a submodule pointer in the sdist
    (
        cd "$dir.tmp"
        run_logged "see the log" "${GIT[@]}" init -q
        run_logged "see the log" "${GIT[@]}" add -A -f
        GIT_AUTHOR_NAME=onebit-pristine GIT_AUTHOR_EMAIL=pristine@onebit.invalid \
            GIT_AUTHOR_DATE="2000-01-01T00:00:00 +0000" \
            run_logged "see the log" "${GIT[@]}" commit -q -m "pristine llama.cpp from llama-cpp-python $version"
        run_logged "see the log" "${GIT[@]}" tag "$PRISTINE_TAG"
    )
    touch "$dir.tmp/.onebit-ok"
    mv "$dir.tmp" "$dir"
    printf '%s' "$dir"
}

# the series file git am stopped at in TREE (rebase-apply/next counts the mails of FILES, one
# patch each), else the subject of the commit it was making
am_stopped_at() {
    local tree=$1 files=$2 dir n name
    dir=$("${GIT[@]}" -C "$tree" rev-parse --git-path rebase-apply 2>/dev/null) || return 0
    [[ $dir == /* ]] || dir=$tree/$dir
    n=$(cat "$dir/next" 2>/dev/null) || return 0
    name=$(printf '%s\n' "$files" | sed -n "${n}p")
    if [[ -n $name ]]; then basename "$name"; else head -n 1 "$dir/final-commit" 2>/dev/null || true; fi
}

# the pinned sdist, fetched and verified, and its pristine tree (the path is printed)
pinned_pristine() {
    local version sha
    version=$(pin_value version) || exit $?
    sha=$(pin_value sha256) || exit $?
    fetch_sdist "$version" "$sha"
    pristine_tree "$version"
}

# start the log of a subcommand
open_log() {
    mkdir -p "$CACHE/logs"
    LOG=$CACHE/logs/$1.log
    : >"$LOG"
}

# apply the series to a fresh clone of the pristine tree in DEST (atomically: only a fully
# patched tree ever appears at DEST); mode "-3" or "" (plain: no three-way, no fuzz)
apply_series() {
    local pristine=$1 dest=$2 mode=$3 files
    files=$(series_files)
    rm -rf "$dest" "$dest.tmp"
    mkdir -p "$(dirname "$dest")"
    run_logged "see the log" "${GIT[@]}" clone -q --no-hardlinks "$pristine" "$dest.tmp"
    run_logged "see the log" "${GIT[@]}" -C "$dest.tmp" checkout -q -b "$WORK_BRANCH" "$PRISTINE_TAG"
    if [[ -n $files ]]; then
        local paths=()
        mapfile -t paths <<<"$files"
        # shellcheck disable=SC2086 # $mode is empty or one flag
        if ! "${GIT[@]}" -C "$dest.tmp" am -q $mode --keep-cr "${paths[@]}" >>"$LOG" 2>&1; then
            local failed
            failed=$(am_stopped_at "$dest.tmp" "$files")
            say "error: the series does not apply to the pristine tree (patch: ${failed:-see log}); log: $LOG"
            tail -n 15 "$LOG" | sed 's/^/    /' >&2
            rm -rf "$dest.tmp"
            say "what to do: fix the patch in patches/ (or rebase it with ./build.sh rebase) and run again"
            exit 1
        fi
    fi
    touch "$dest.tmp/.onebit-ok"
    mv "$dest.tmp" "$dest"
}

export_series_from() {
    local tree=$1 base=$2 out=$3
    rm -rf "$out"
    mkdir -p "$out"
    "${GIT[@]}" -C "$tree" format-patch -q --zero-commit --no-signature --no-numbered -o "$out" "$base..HEAD" >>"$LOG" 2>&1
    (cd "$out" && ls -1 ./*.patch 2>/dev/null | sed 's|^\./||' >series)
}

# --- build ----------------------------------------------------------------------------------
current_env() {
    local key=$1 value=$2 file=$ROOT/build/current.env
    mkdir -p "$ROOT/build"
    touch "$file"
    sed -i "/^$key=/d" "$file"
    printf '%s=%s\n' "$key" "$value" >>"$file"
}

# build_tree TREE BDIR KEY TARGET... [-- TOOL_TARGET...]: the tools compile as a step of their own
build_tree() {
    local tree=$1 bdir=$2 key=$3
    shift 3
    local targets=() tools=()
    while [[ $# -gt 0 && $1 != -- ]]; do targets+=("$1"); shift; done
    [[ $# -eq 0 ]] || { shift; tools=("$@"); }
    # the policy cases are data, not part of the build key: refresh them on every run
    mkdir -p "$bdir/onebit"
    cp "$ROOT/ctest_port/cases.tsv" "$bdir/onebit/cases.tsv"
    if [[ -f $bdir/.onebit-stamp && $(cat "$bdir/.onebit-stamp") == "$key" ]]; then
        say "==> build $bdir is up to date"
        return
    fi
    rm -f "$bdir/.onebit-stamp"
    step "configure llama.cpp (CMake)"
    run_logged "install cmake and a C++17 compiler, then run again" \
        cmake -S "$tree" -B "$bdir" "${CMAKE_FLAGS[@]}" -DONEBIT_POLICY_CASES="$bdir/onebit/cases.tsv"
    step "compile ${targets[*]} ($JOBS jobs; the first build takes several minutes)"
    run_logged "read the compiler error in the log; if a patch is at fault, fix it in patches/" \
        cmake --build "$bdir" -j "$JOBS" --target "${targets[@]}"
    if [[ ${#tools[@]} -gt 0 ]]; then
        local started=$SECONDS
        step "compile llama.cpp's tools ${tools[*]} ($JOBS jobs)"
        run_logged "read the compiler error in the log" cmake --build "$bdir" -j "$JOBS" --target "${tools[@]}"
        say "==> the tools took $((SECONDS - started)) s"
    fi
    printf '%s' "$key" >"$bdir/.onebit-stamp"
}

lib_dir_of() {
    local so
    so=$(find "$1" -name 'libllama.so' -print -quit)
    [[ -n $so ]] || die "libllama.so not found under $1" 1
    dirname "$so"
}

venv_dir() {
    if [[ -n ${VIRTUAL_ENV:-} ]]; then
        printf '%s' "$VIRTUAL_ENV"
    else
        printf '%s' "$ROOT/.venv"
    fi
}

setup_python() {
    local version=$1 venv key
    venv=$(venv_dir)
    key="$version $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
    if [[ -f $venv/.onebit-stamp && $(cat "$venv/.onebit-stamp") == "$key" ]]; then
        say "==> python environment $venv is up to date"
        return
    fi
    if [[ ! -x $venv/bin/python ]]; then
        step "create the virtualenv $venv"
        run_logged "install python3-venv (Debian) and run again" "$PYTHON" -m venv "$venv"
    fi
    step "install llama-cpp-python==$version (Python part only, it loads the patched libllama)"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF" \
        run_logged "see the log; pip needs PyPI for scikit-build-core" \
        "$venv/bin/python" -m pip install -q "$(sdist_path "$version")"
    step "install onebit-predict (editable) and its test dependencies"
    run_logged "see the log" "$venv/bin/python" -m pip install -q -e "$ROOT[test]"
    printf '%s' "$key" >"$venv/.onebit-stamp"
}

# the emulated drive's system packages (onebit-drive, onebit-bench --drive and their tests): libfuse3's
# headers and pkg-config compile it, fuse3's fusermount3 mounts it as a user, fio measures it
DRIVE_PACKAGES=(libfuse3-dev fuse3 fio pkg-config)

# whether PACKAGE is here: dpkg-query says it is installed, or what the drive needs of it works
drive_package_present() {
    local pkg=$1
    if command -v dpkg-query >/dev/null 2>&1 \
        && [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null) == "install ok installed" ]]; then
        return 0
    fi
    case $pkg in
        libfuse3-dev) pkg-config --exists fuse3 >/dev/null 2>&1 ;;
        fuse3) command -v fusermount3 >/dev/null 2>&1 ;;
        *) command -v "$pkg" >/dev/null 2>&1 ;;
    esac
}

# a step of its own: as root with apt-get, install the DRIVE_PACKAGES this machine lacks; otherwise
# (or with ONEBIT_NO_APT=1, or when apt-get fails: no network) say the command and go on, since
# only the emulated drive needs them
system_packages() {
    local pkg missing=()
    [[ ${ONEBIT_NO_APT:-0} != 1 ]] || return 0
    for pkg in "${DRIVE_PACKAGES[@]}"; do
        drive_package_present "$pkg" || missing+=("$pkg")
    done
    [[ ${#missing[@]} -gt 0 ]] || return 0
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        say "notice: the emulated drive (onebit-drive, onebit-bench --drive) needs ${missing[*]}, not installed;" \
            "to install them: sudo apt-get install ${missing[*]}"
        return 0
    fi
    step "install the emulated drive's system packages: apt-get install ${missing[*]}"
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${missing[@]}"; } >>"$LOG" 2>&1; then
        say "notice: apt-get could not install ${missing[*]} (its log: $LOG); the emulated drive needs them:" \
            "apt-get install ${missing[*]}"
    fi
}

cmd_build() {
    local version shash tree bdir key pristine
    version=$(pin_value version)
    shash=$(series_hash)
    open_log "build-$version"
    pristine=$(pinned_pristine)
    key="$version-$shash-$(flags_hash)"
    tree=$CACHE/src/$version/work-$shash
    if [[ ! -f $tree/.onebit-ok ]]; then
        step "apply patches/series (git am -3)"
        apply_series "$pristine" "$tree" -3
    fi
    bdir=$CACHE/build/$key
    build_tree "$tree" "$bdir" "$key" "${TEST_TARGETS[@]}" -- "${TOOL_TARGETS[@]}"
    current_env LLAMA_TREE "$tree"
    current_env LLAMA_BUILD_DIR "$bdir"
    current_env LLAMA_LIB_DIR "$(lib_dir_of "$bdir")"
    system_packages
    setup_python "$version"
    say "==> done: patched libllama in $(lib_dir_of "$bdir")"
}

cmd_test() {
    cmd_build
    local bdir venv rc=0
    bdir=$(sed -n 's/^LLAMA_BUILD_DIR=//p' "$ROOT/build/current.env")
    venv=$(venv_dir)
    step "ctest -L onebit, and $CTEST_UPSTREAM_FIX"
    (cd "$bdir" && ctest -L onebit --output-on-failure && ctest -R "^$CTEST_UPSTREAM_FIX\$" --output-on-failure) || rc=1
    step "pytest"
    (cd "$ROOT" && "$venv/bin/python" -m pytest -q) || rc=1
    if [[ $rc -ne 0 ]]; then
        say "error: tests failed (see above)"
    fi
    return $rc
}

# the README's main job: the predictor on the bundled trained model, router vs block
DEMO_MODEL=$ROOT/models/qwen3moe-tiny.gguf
DEMO_PROMPT=$ROOT/models/heldout.txt

cmd_demo() {
    cmd_build
    local venv out
    venv=$(venv_dir)
    out=$CACHE/demo
    [[ -f $DEMO_MODEL ]] || die "the bundled model $DEMO_MODEL is missing" 2
    mkdir -p "$out"
    local mode
    for mode in router block; do
        step "onebit-trace $mode on $(basename "$DEMO_MODEL") (held-out text, decoded token by token)"
        "$venv/bin/onebit-trace" "$DEMO_MODEL" --mode "$mode" --out "$out/$mode.bin" --prompt-file "$DEMO_PROMPT" \
            --bytes --window 256 --prefill 16 --generate 0 --ctx 256 \
            || die "onebit-trace $mode failed (see above)" 1
    done
    step "onebit-stats: router vs block, with the previous-token baseline"
    "$venv/bin/onebit-stats" "$out/router.bin" "$out/block.bin"
}

cmd_check() {
    local version pristine venv name files listed=()
    open_log check

    step "lint patches/series"
    series_py lint || exit $? # 1: lint problems, 2: a listed patch or the series itself is missing
    files=$(series_files)
    while IFS= read -r name; do
        [[ -z $name ]] || listed+=("$(basename "$name")")
    done <<<"$files"

    version=$(pin_value version)
    pristine=$(pinned_pristine)
    setup_python "$version"
    venv=$(venv_dir)
    step "ruff check and ruff format --check"
    [[ -x $venv/bin/ruff ]] \
        || die "no ruff in $venv: it comes with the test extra (pip install -e '$ROOT[test]')" 1
    if ! "$venv/bin/ruff" check "$ROOT" >&2; then
        say "error: ruff check found problems (above); fix them, or run: $venv/bin/ruff check --fix $ROOT"
        exit 1
    fi
    if ! "$venv/bin/ruff" format --check "$ROOT" >&2; then
        say "error: ruff format would reformat the files above; run: $venv/bin/ruff format $ROOT"
        exit 1
    fi

    # a global: the EXIT trap also runs after cmd_check has returned, where a local is unset
    CHECK_TMP=$(mktemp -d "${TMPDIR:-/tmp}/onebit-check.XXXXXX")
    trap 'rm -rf "$CHECK_TMP"' EXIT
    local tmp=$CHECK_TMP
    step "apply the series to a clean pristine tree (git am, no three-way, no fuzz)"
    apply_series "$pristine" "$tmp/tree" ""
    step "re-export and compare with patches/"
    export_series_from "$tmp/tree" "$PRISTINE_TAG" "$tmp/export"
    if ! diff -u "$SERIES" "$tmp/export/series" >&2; then
        say "error: the re-exported series differs from patches/series"
        exit 1
    fi
    for name in "${listed[@]}"; do
        if ! cmp -s "$PATCHES/$name" "$tmp/export/$name"; then
            say "error: re-exporting $name differs from the committed file:"
            diff -u "$PATCHES/$name" "$tmp/export/$name" | head -n 40 >&2 || true
            exit 1
        fi
    done
    if [[ ${ONEBIT_CHECK_COMPILE:-1} == 0 ]]; then
        say "==> check passed: ${#listed[@]} patch(es) apply without fuzz and re-export byte-identically" \
            "(ONEBIT_CHECK_COMPILE=0: not compiled patch by patch)"
        return
    fi
    compile_each_patch "$tmp/tree" "$version"
    say "==> check passed: ${#listed[@]} patch(es) apply without fuzz, re-export byte-identically and each" \
        "compiles on its own"
}

# compile the tree at every patch of the series, so that each patch builds on its own and a fix
# cannot hide in a later one: the series is checked out patch by patch in one place,
# $CACHE/check-build/VERSION/src, and built in one build directory beside it (CMake wants the same
# source path every run; within a run each patch recompiles only what it changes, and ccache,
# when installed, makes the next run's unchanged objects free); at each patch the targets of
# TEST_TARGETS and TOOL_TARGETS that exist by then
compile_each_patch() {
    local tree=$1 version=$2 dir src n=0 total c subject available wanted=() launcher=() t
    dir=$CACHE/check-build/$version/build
    src=$CACHE/check-build/$version/src
    rm -rf "$src"
    mkdir -p "$dir"
    "${GIT[@]}" clone -q --no-checkout "$tree" "$src"
    if command -v ccache >/dev/null 2>&1; then
        launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    fi
    local commits=()
    mapfile -t commits < <("${GIT[@]}" -C "$tree" rev-list --reverse "$PRISTINE_TAG..HEAD")
    total=${#commits[@]}
    step "compile the tree at every patch ($total; build directory $dir${launcher:+, ccache})"
    for c in "${commits[@]}"; do
        n=$((n + 1))
        subject=$("${GIT[@]}" -C "$src" log -1 --format=%s "$c")
        say "    [$n/$total] $subject"
        "${GIT[@]}" -C "$src" checkout -q -f "$c"
        run_logged "patch $n ('$subject') does not configure on its own: fix it in its commit (docs/patches.md)" \
            cmake -S "$src" -B "$dir" "${CMAKE_FLAGS[@]}" "${launcher[@]}" -DONEBIT_POLICY_CASES="$dir/onebit/cases.tsv"
        available=$(cmake --build "$dir" --target help 2>/dev/null)
        wanted=()
        for t in "${TEST_TARGETS[@]}" "${TOOL_TARGETS[@]}"; do
            if grep -qE "^\.\.\. $t( |\$)" <<<"$available"; then
                wanted+=("$t")
            fi
        done
        run_logged "patch $n ('$subject') does not compile on its own: fix it in its commit (docs/patches.md)" \
            cmake --build "$dir" -j "$JOBS" --target "${wanted[@]}"
    done
}

# stop on a conflict with the patch, the files and the commands to finish
conflict_help() {
    local tree=$1 series=$2 patch files
    patch=$(am_stopped_at "$tree" "$series")
    files=$("${GIT[@]}" -C "$tree" diff --name-only --diff-filter=U 2>/dev/null || true)
    say "error: conflict while applying ${patch:-a patch} in $tree"
    say "git am output: $LOG"
    if [[ -n $files ]]; then
        say "conflicting files:"
        printf '%s\n' "$files" | sed 's/^/    /' >&2
    fi
    say "to resolve:"
    say "    cd $tree"
    say "    # edit the files, then:"
    say "    git add <files> && git am --continue      # or: git am --skip / git am --abort"
    say "to export the rebased series into patches/ afterwards:"
    say "    $ROOT/build.sh export --from $tree"
}

cmd_rebase() {
    local to="" tree_dir=""
    while [[ $# -gt 0 ]]; do
        case $1 in
            --to)   [[ $# -ge 2 ]] || usage_error "--to needs a VERSION"; to=$2; shift 2 ;;
            --tree) [[ $# -ge 2 ]] || usage_error "--tree needs a DIR"; tree_dir=$2; shift 2 ;;
            *) usage_error "rebase: unknown option '$1'" ;;
        esac
    done
    [[ -n $to || -n $tree_dir ]] || usage_error "rebase needs --to VERSION or --tree DIR"
    [[ -z $to || -z $tree_dir ]] || usage_error "rebase takes --to or --tree, not both"
    open_log rebase

    local files
    files=$(series_files)
    local target
    if [[ -n $to ]]; then
        [[ $to =~ ^[0-9]+(\.[0-9]+)*$ ]] || usage_error "--to '$to' is not a version number"
        local sha="" pinned_version
        pinned_version=$(pin_value version)
        [[ $to != "$pinned_version" ]] || sha=$(pin_value sha256)
        fetch_sdist "$to" "$sha"
        local pristine
        pristine=$(pristine_tree "$to")
        target=$CACHE/rebase/$to
        rm -rf "$target"
        mkdir -p "$(dirname "$target")"
        run_logged "see the log" "${GIT[@]}" clone -q --no-hardlinks "$pristine" "$target"
        run_logged "see the log" "${GIT[@]}" -C "$target" checkout -q -b "$WORK_BRANCH" "$PRISTINE_TAG"
    else
        [[ -d $tree_dir ]] || usage_error "--tree '$tree_dir' is not a directory"
        target=$(cd "$tree_dir" && pwd)
        "${GIT[@]}" -C "$target" rev-parse --git-dir >/dev/null 2>&1 || usage_error "--tree '$tree_dir' is not a git checkout"
        [[ -z $("${GIT[@]}" -C "$target" status --porcelain --untracked-files=no) ]] \
            || usage_error "--tree '$tree_dir' has uncommitted changes; commit or stash them first"
    fi
    # remember where the series starts, for ./build.sh export --from
    "${GIT[@]}" -C "$target" rev-parse HEAD >"$("${GIT[@]}" -C "$target" rev-parse --absolute-git-dir)/onebit-base"

    # git am -3 needs the blobs the patches were made against: bring the pinned pristine
    # tree's objects into the target (under a ref of ours, no branch or tag is touched)
    local pinned
    pinned=$(pinned_pristine)
    run_logged "see the log" "${GIT[@]}" -C "$target" fetch -q --no-tags "$pinned" "+refs/tags/$PRISTINE_TAG:refs/onebit/pinned-base"

    step "apply patches/series to $target (git am -3)"
    local paths=()
    [[ -z $files ]] || mapfile -t paths <<<"$files"
    if ! "${GIT[@]}" -C "$target" am -q -3 --keep-cr "${paths[@]}" >>"$LOG" 2>&1; then
        conflict_help "$target" "$files"
        exit 1
    fi
    say "==> the series applies to $target"
}

cmd_export() {
    local from=""
    while [[ $# -gt 0 ]]; do
        case $1 in
            --from) [[ $# -ge 2 ]] || usage_error "--from needs a DIR"; from=$2; shift 2 ;;
            *) usage_error "export: unknown option '$1'" ;;
        esac
    done
    open_log export
    if [[ -z $from ]]; then
        local version shash
        version=$(pin_value version)
        shash=$(series_hash)
        from=$CACHE/src/$version/work-$shash
    fi
    [[ -d $from ]] || usage_error "no work tree at '$from' (run ./build.sh first or pass --from DIR)"
    local gitdir base
    gitdir=$("${GIT[@]}" -C "$from" rev-parse --absolute-git-dir 2>/dev/null) || usage_error "'$from' is not a git checkout"
    if [[ -f $gitdir/onebit-base ]]; then
        base=$(cat "$gitdir/onebit-base")
    else
        base=$PRISTINE_TAG
    fi
    [[ ! -d $gitdir/rebase-apply ]] || die "'$from' is in the middle of git am: finish it (git am --continue) first" 1
    local tmp
    tmp=$(mktemp -d)
    export_series_from "$from" "$base" "$tmp"
    rm -f "$PATCHES"/*.patch
    cp "$tmp"/*.patch "$PATCHES"/
    cp "$tmp/series" "$SERIES"
    rm -rf "$tmp"
    say "==> exported $(grep -c . "$SERIES") patch(es) from $from into patches/"
}

# the PATH line for the patched tools, on stdout (everything else goes to stderr)
cmd_path() {
    cmd_build
    local bin
    bin=$(sed -n 's/^LLAMA_BUILD_DIR=//p' "$ROOT/build/current.env")/bin
    local tool
    for tool in "${TOOL_TARGETS[@]}"; do
        [[ -x $bin/$tool ]] || die "$bin/$tool was not built" 1
    done
    printf 'export PATH="%s:$PATH"\n' "$bin"
}

cmd_pristine() {
    local version pristine bdir key
    version=$(pin_value version)
    open_log "pristine-$version"
    pristine=$(pinned_pristine)
    key="$version-pristine-$(flags_hash)"
    bdir=$CACHE/build/$key
    # the pristine tree has no onebit tests: build the library alone
    build_tree "$pristine" "$bdir" "$key" llama
    current_env PRISTINE_LIB_DIR "$(lib_dir_of "$bdir")"
    say "==> done: unpatched libllama in $(lib_dir_of "$bdir")"
}

main() {
    local cmd=${1:-build}
    [[ $# -eq 0 ]] || shift
    case $cmd in
        build)    [[ $# -eq 0 ]] || usage_error "build takes no arguments"; cmd_build ;;
        demo)     [[ $# -eq 0 ]] || usage_error "demo takes no arguments"; cmd_demo ;;
        test)     [[ $# -eq 0 ]] || usage_error "test takes no arguments"; cmd_test ;;
        check)    [[ $# -eq 0 ]] || usage_error "check takes no arguments"; cmd_check ;;
        rebase)   cmd_rebase "$@" ;;
        export)   cmd_export "$@" ;;
        pristine) [[ $# -eq 0 ]] || usage_error "pristine takes no arguments"; cmd_pristine ;;
        path)     [[ $# -eq 0 ]] || usage_error "path takes no arguments"; cmd_path ;;
        help|-h|--help) usage ;;
        *) usage_error "unknown subcommand '$cmd'" ;;
    esac
}

# one line: bash reads a script as it runs it, so an edit made to this file meanwhile never runs; sourced
# (tests/test_build_sh.py calls its functions), it defines them and runs nothing
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then main "$@"; exit; fi
