"""onebit-bench --memory-limit --prompt-tokens/--ubatch: the flags, the prefill rows' names and fields, their
ratios and floor, the worker's ubatched prompt, the report (old ones still load), and one real prefill run."""

from __future__ import annotations

import glob
import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

from onebit_predict.checks import bench_memory, bench_prefill, worker
from onebit_predict.checks.bench_memory import memory_configs
from onebit_predict.checks.bench_prefill import (
    PrefillRow,
    expert_floor_mib,
    markdown_prefill,
    measure_prefill,
    prefill_plans,
    prefill_report,
    ubatches,
)
from onebit_predict.checks.rounds import BenchOptions, Config, Sample, prefill_args
from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import ENV_OUT, ENV_RUN_STATE, EXIT_OK, EXIT_USAGE, PREFILL_UBATCH_DEFAULT
from onebit_predict.costmodel.measured import DecodeSplit, load_measured
from onebit_predict.costmodel.row_config import PrefillConfig, RowConfig, from_name, prefill_from_name
from onebit_predict.llama.diskstats import ReadRequests
from onebit_predict.llama.evict import expert_spans

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"


def _no_build():
    raise AssertionError("the build was looked for")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-tokens", "64"], "--prompt-tokens is a dimension of --memory-limit runs: give --memory-limit too"),
        (["--ubatch", "16"], "--ubatch is a dimension of --memory-limit runs: give --memory-limit too"),
        (["--memory-limit", "64MiB", "--ubatch", "16"], "--ubatch is the prompt's ubatch: give --prompt-tokens too"),
        (["--memory-limit", "64MiB", "--prompt-tokens", "64,64"], "gives 64 twice (each value is a run of its own)"),
        (["--memory-limit", "64MiB", "--prompt-tokens", "64", "--ubatch", "16,016"], "gives 16 twice"),
        (["--memory-limit", "64MiB", "--prompt-tokens", "0"], "'0' is not a positive integer"),
        (["--memory-limit", "64MiB", "--prompt-tokens", "64", "--ubatch", "-16"], "'-16' is not a positive integer"),
        (["--memory-limit", "64MiB", "--prompt-tokens", "64,"], "has an empty item"),
    ],
)
def test_the_prefill_flags_are_checked_before_the_build(extra, message, monkeypatch, capsys):
    """Outside --memory-limit, --ubatch alone, a value twice or not positive: exit 2, one line, no build looked for."""
    monkeypatch.setattr("onebit_predict.commands.bench.build_info", _no_build)
    assert bench_main([str(MODEL), *extra]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


class _Build:
    def __init__(self, lib):
        self.lib_dir = lib


def _row(name: str, n: int = 64, u: int = 16, limit: int = 64 << 20, **kw) -> PrefillRow:
    pc = prefill_from_name(name)
    split = DecodeSplit(0.25, 0.5, "thread", "diskstats sda", 0.125, 96.0, expert_hit=kw.pop("hit", None))
    return PrefillRow(limit, name, n, u, 200.0, 180.0, 220.0, kw.pop("ratio", 1.0), 0.75, 0.5, 1.5, {}, pc.row, split)


def test_the_flags_reach_the_run_and_the_report_has_a_prefill_table(monkeypatch, capsys, tmp_path):
    """--prompt-tokens 64 --ubatch 16,64 go to run_memory with the model's expert bytes; the table gets the prefill
    table under the decode one, --json the prefill rows with their fields."""
    monkeypatch.setenv(ENV_RUN_STATE, str(tmp_path / "state"))
    monkeypatch.setattr("onebit_predict.commands.bench.build_info", lambda: _Build(tmp_path))
    seen = {}
    rows = [_row("patched off, prefill 64, ubatch 16"), _row("route, prefill 64, ubatch 16", ratio=0.5, hit=0.25)]

    def run_memory(model, opts, lib, limits, setting, *dims, expert_bytes=0):
        seen.update(dims=dims, expert_bytes=expert_bytes)
        return [], rows, prefill_report(rows, dims[5], ubatches(dims[5], dims[6])), "words"

    monkeypatch.setattr(bench_memory, "run_memory", run_memory)
    monkeypatch.setattr(bench_memory, "markdown_memory", lambda rows, header: "DECODE TABLE")
    argv = [str(MODEL), "--memory-limit", "64MiB", "--rounds", "1", "--prompt-tokens", "64", "--ubatch", "16,64"]
    assert bench_main(argv) == EXIT_OK
    assert seen["dims"][5:] == ([64], [16, 64]) and seen["expert_bytes"] == sum(s.size for s in expert_spans(MODEL))
    out = capsys.readouterr().out
    decode, prefill = out.split("DECODE TABLE")[1].split("| limit MiB | configuration | prompt tok/s")
    assert decode.strip() == ""  # the prefill table directly under the decode one
    assert "| 64 | route, prefill 64, ubatch 16 | 200.0 | 180.0 | 220.0 | 0.500 | 0.750 | 1.500 | 0.50 | 0.50 |" in out
    assert "| 0.250 | 0.500 | 0.125 | 96 | 25.0% |" in out
    assert bench_main([*argv, "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["prompt_tokens"] == [64] and doc["ubatch"] == [16, 64]
    got = doc["prefill_rows"][1]
    assert got["name"] == "route, prefill 64, ubatch 16" and got["prompt_tokens"] == 64 and got["ubatch"] == 16
    assert got["median_prompt_tok_s"] == 200.0 and got["expert_bytes_per_ubatch_mib"] == 1.5
    assert got["prefill"]["requests"] == 0.125 and got["prefill"]["request_kib_mean"] == 96.0
    assert RowConfig.from_fields(got["config"]) == RowConfig(route=True)


def test_without_prompt_tokens_the_report_is_as_before():
    assert ubatches(None, None) == [] and ubatches([64], None) == [PREFILL_UBATCH_DEFAULT]
    assert prefill_report([], [], []) == {} and markdown_prefill([]) == ""


def test_a_prefill_row_is_named_and_read_back():
    """The name: the row's, then ``prefill N, ubatch U``; the name and the report's fields give the same
    configuration back, and a decode row's reader does not take a prefill name for a decode row."""
    pc = PrefillConfig(RowConfig("block", "read", route=True, read_ahead_kb=128, drive="nvme"), 512, 128)
    assert pc.name == "block + read + route, readahead 128, nvme, prefill 512, ubatch 128"
    assert prefill_from_name(pc.name) == pc
    assert PrefillConfig(RowConfig(), 64, 16).name == "patched off, prefill 64, ubatch 16"
    assert prefill_from_name("patched off, prefill 64, ubatch 16") == PrefillConfig(RowConfig(), 64, 16)
    assert pc.predictor_off() == PrefillConfig(RowConfig(read_ahead_kb=128, drive="nvme"), 512, 128)
    row = PrefillRow(0, pc.name, 512, 128, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, {}, pc.row)
    back = json.loads(json.dumps(asdict(row)))
    assert PrefillConfig.from_fields(back) == pc == row.prefill_config
    assert pc.fields() == {k: back[k] for k in ("config", "prompt_tokens", "ubatch")}
    for bad in ("route, prefill 0, ubatch 4", "route, ubatch 4", "route, prefill 64", "route + x, prefill 4, ubatch 4",
                "route, prefill 4, ubatch four", "route, prefill -4, ubatch 4"):  # fmt: skip
        assert prefill_from_name(bad) is None, bad
    assert from_name(pc.name) is None  # not a decode row
    with pytest.raises(ValueError, match="ubatch 0 is not a positive integer"):
        PrefillConfig.from_fields({**back, "ubatch": 0}, "row 3")
    with pytest.raises(ValueError, match="prefill True is not"):
        PrefillConfig(RowConfig(), True, 4)


def test_prefill_runs_are_each_configuration_at_each_prompt_and_ubatch(tmp_path):
    """One run per (configuration, N, U), at each read_ahead_kb: the decode row's knobs without its trace, the
    oracle left out (its routing is the decode's tokens'), the worker told the prompt and the ubatch."""
    plans = prefill_plans(memory_configs(tmp_path, 4, [128, 8192], rows=("route", "oracle + advise")), [64, 256], [16])
    names = [p.name for p in plans]
    assert names[:4] == [
        "patched off, readahead 128, prefill 64, ubatch 16",
        "patched off, readahead 8192, prefill 64, ubatch 16",
        "route, readahead 128, prefill 64, ubatch 16",
        "route, readahead 8192, prefill 64, ubatch 16",
    ]
    assert len(names) == 8 and len(set(names)) == 8 and not any("oracle" in n for n in names)  # fmt: skip
    assert all(ENV_OUT not in p.run.env for p in plans)
    assert [p.run.read_ahead_kb for p in plans[:4]] == [128, 8192, 128, 8192]
    assert plans[2].run.env["ONEBIT_MOE_PREFETCH_ROUTE"] == "1"
    assert prefill_args(plans[7].run) == ["--prefill", "256", "--ubatch", "16"]
    assert prefill_args(Config("patched off", {})) == []  # a decode run's worker: as before


def test_the_ratios_and_the_floor(tmp_path, monkeypatch):
    """vs patched off at the same limit, read_ahead_kb, prompt and ubatch; bytes read per prompt token; the
    floor, the expert bytes once per ubatch over the prompt's tokens."""
    plans = prefill_plans(memory_configs(tmp_path, 4, [128, 8192], rows=("route",)), [64], [16, 64])
    limits = [64 << 20, 32 << 20]
    speed = {"patched off": 100.0, "route": 80.0}

    anon = {None: 8.0, 16: 24.0, 64: 72.0}  # MiB after one call: the decode's, then each ubatch's
    probed = []

    def probe_memory(model, cfg, lib, opts):
        probed.append((cfg.prompt_tokens, cfg.ubatch))
        return {"compute_mib": 1.0, "anon_mib": anon[cfg.ubatch]}

    def collect(model, runs, lib, pristine, opts):
        assert opts.memory_limit in limits and {r.prompt_tokens for r in runs} == {64}
        # each run's cgroup holds its memory's growth over a decode run's beyond the limit
        assert all(r.limit_extra == (anon[r.ubatch] - anon[None]) * 2**20 for r in runs)
        out = {}
        for r in runs:
            base = speed[r.name.split(",")[0]] * (2 if r.read_ahead_kb == 128 else 1) * (3 if r.ubatch == 64 else 1)
            base /= 1 if opts.memory_limit == limits[0] else 4
            reads = ReadRequests("diskstats sda", 32, 32 * 65536, 1.0, 512 * 1024, "max_sectors_kb")
            out[r.name] = [Sample(base * f, 0.0, 2, None, 64 << 20, 128, 0.64 / f, cpu_s=0.32, cpu_basis="thread",
                                  reads=reads) for f in (0.5, 1.0, 2.0)]  # fmt: skip
        return out

    monkeypatch.setattr(bench_prefill, "collect", collect)
    monkeypatch.setattr(bench_prefill, "probe_memory", probe_memory)
    rows = measure_prefill(MODEL, plans, tmp_path, BenchOptions(rounds=3), limits, 96 << 20)
    assert probed == [(None, None), (64, 16), (64, 64)]  # once each, not per limit or configuration
    assert {(r.ubatch, r.limit_extra_mib) for r in rows} == {(16, 16.0), (64, 64.0)}
    assert "| 64 + 16 | patched off, readahead 128, prefill 64, ubatch 16 |" in markdown_prefill(rows)
    assert len(rows) == 2 * len(plans) and [r.limit_bytes for r in rows] == [limits[0]] * 8 + [limits[1]] * 8
    got = {(r.limit_bytes, r.name): r for r in rows}
    for limit in limits:
        for kb in (128, 8192):
            for u in (16, 64):
                off = got[limit, f"patched off, readahead {kb}, prefill 64, ubatch {u}"]
                route = got[limit, f"route, readahead {kb}, prefill 64, ubatch {u}"]
                assert off.ratio_to_off == 1.0 and route.ratio_to_off == pytest.approx(0.8)
                want = speed["route"] * (2 if kb == 128 else 1) * (3 if u == 64 else 1)
                want /= 1 if limit == limits[0] else 4
                assert route.median_prompt_tok_s == pytest.approx(want)
                assert (route.min_prompt_tok_s, route.max_prompt_tok_s) == pytest.approx((want / 2, want * 2))
                assert route.expert_bytes_per_ubatch_mib == pytest.approx(96 * math.ceil(64 / u) / 64)
                assert route.read_mib_per_token == 1.0 and route.major_faults_per_token == 2.0
                assert route.config == RowConfig(route=True, read_ahead_kb=kb) and route.ubatch == u
    split = rows[0].prefill
    assert split.requests == 0.5 and split.request_kib_mean == 64.0 and split.compute_ms == 5.0
    assert split.wait_ms == pytest.approx(5.0)  # 10 ms per prompt token of wall (the median run's), 5 of it CPU


def test_resident_prefill_probes_no_memory(tmp_path, monkeypatch):
    """Resident runs have no cgroup: nothing is probed and nothing added to a limit."""
    plans = prefill_plans(memory_configs(tmp_path, 4, [128], rows=("route",)), [64], [16])

    def collect(model, runs, lib, pristine, opts):
        assert opts.memory_limit is None and all(r.limit_extra == 0 for r in runs)
        return {r.name: [Sample(10.0, 0.0, 2, None, 0, 0, 1.0)] for r in runs}

    monkeypatch.setattr(bench_prefill, "collect", collect)
    monkeypatch.setattr(bench_prefill, "probe_memory", _no_build)
    rows = measure_prefill(MODEL, plans, tmp_path, BenchOptions(rounds=1), [bench_memory.RESIDENT], 96 << 20)
    assert rows and all(r.limit_extra_mib == 0.0 for r in rows)
    assert markdown_prefill(rows).splitlines()[2].startswith("| resident | patched off")


def test_expert_floor():
    assert expert_floor_mib(64 << 20, 512, 128) == 0.5  # 4 ubatches of 64 MiB over 512 tokens
    assert expert_floor_mib(64 << 20, 500, 128) == pytest.approx(64 * 4 / 500)  # the last ubatch is short
    assert expert_floor_mib(64 << 20, 64, 2048) == 1.0  # one ubatch however large


class _Ctx:
    def __init__(self):
        self.calls = []

    def decode(self, tokens, pos, seq, want):
        self.calls.append((list(tokens), list(pos), list(seq), list(want)))


def test_the_worker_processes_the_prompt_in_ubatches(tmp_path):
    """ceil(N / U) decode calls of U tokens (the last one shorter), at consecutive positions, each wanting its
    last token's logits; the prompt from --text-file's bytes, repeated to its length."""
    text = tmp_path / "t.txt"
    text.write_bytes(b"abc")
    toks = worker.run_tokens(text, 10, 256)
    assert toks == list(b"abcabcabca")
    opts = worker.WorkerOptions(tmp_path / "m.gguf", {}, threads=1, pristine=True, prefill=10, ubatch=4)
    ctx = _Ctx()
    elapsed, clocks, counted = worker.timed_prefill(ctx, opts, toks)
    assert [c[1] for c in ctx.calls] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [c[0] for c in ctx.calls] == [toks[:4], toks[4:8], toks[8:]]
    assert [c[3] for c in ctx.calls] == [[False, False, False, True], [False, False, False, True], [False, True]]
    assert elapsed >= 0 and clocks.cpu >= 0 and clocks.basis == "thread"
    assert counted["read_bytes"] >= 0 and counted["route_missing_bytes"] is None
    assert len(worker.run_tokens(None, 7, 100)) == 7


def _memory_reports() -> list[str]:
    out = []
    for f in sorted(glob.glob(str(REPO / "docs" / "measured" / "*.json"))):
        d = json.loads(Path(f).read_text())
        if isinstance(d, dict) and d.get("rows") and ("memory_limits" in d or d.get("cold")):
            out.append(f)
    return out


def test_old_reports_still_load_and_have_no_prefill_rows(tmp_path):
    """Every memory and cold report of docs/measured loads: the old ones with no prefill rows, the newer ones
    with theirs; a report with prefill rows loads its decode rows as it would without them."""
    reports = _memory_reports()
    old = [f for f in reports if "prefill_rows" not in json.loads(Path(f).read_text())]
    assert old and len(old) < len(reports)  # the reports from before --prompt-tokens, and docs/results.md's since
    for f in reports:
        rows = json.loads(Path(f).read_text()).get("prefill_rows", [])
        assert [p.name for p in load_measured(f).prefill] == [r["name"] for r in rows], f
    doc = json.loads(Path(old[0]).read_text())
    rows = [_row("patched off, prefill 64, ubatch 16"), _row("route, readahead 128, prefill 64, ubatch 16", hit=0.5)]
    plain, with_prefill = tmp_path / "a.json", tmp_path / "b.json"
    plain.write_text(json.dumps(doc))
    with_prefill.write_text(json.dumps(doc | prefill_report(rows, [64], [16])))
    a, b = load_measured(plain), load_measured(with_prefill)
    assert a.rows == b.rows and a.limits == b.limits
    assert [p.name for p in b.prefill] == [r.name for r in rows]
    assert b.prefill[1].config == PrefillConfig(RowConfig(route=True, read_ahead_kb=128), 64, 16)
    assert b.prefill[1].prompt_tok_s == 200.0 and b.prefill[1].prefill.expert_hit == 0.5
    bad = doc | {"prefill_rows": [{"name": "x", "config": {}, "prompt_tokens": 0, "ubatch": 4}]}
    with_prefill.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="prefill row 0 .*not a positive integer"):
        load_measured(with_prefill)


@pytest.mark.needs_build
def test_a_real_prefill_row_under_a_cgroup(tmp_path, capsys):
    """A real run on the tiny model in a memory cgroup: --prompt-tokens 64 --ubatch 16,64 gives a prefill row per
    configuration and ubatch beside the decode rows, each with prompt tok/s, bytes read, the floor and where its
    time went (one thread: compute and waiting add up to the prompt's wall time per token)."""
    from test_bench_memory import _private_model, _require_cgroup

    _require_cgroup()
    model = _private_model(tmp_path)
    argv = [str(model), "--memory-limit", "64MiB", "--rounds", "1", "--generate", "4", "--prompt", "8", "--threads",
            "1", "--rows", "route", "--prompt-tokens", "64", "--ubatch", "16,64", "--json"]  # fmt: skip
    assert bench_main(argv) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in doc["rows"]] == ["patched off", "route"]  # the decode rows as before
    got = {r["name"]: r for r in doc["prefill_rows"]}
    assert list(got) == ["patched off, prefill 64, ubatch 16", "route, prefill 64, ubatch 16",
                         "patched off, prefill 64, ubatch 64", "route, prefill 64, ubatch 64"]  # fmt: skip
    expert_bytes = doc["expert_bytes"]
    # each cgroup held its run's memory beyond a decode run's (prompt 8): at least the compute buffer's growth
    extra = {r["ubatch"]: r["limit_extra_mib"] for r in got.values()}
    assert extra[16] >= 0 and extra[64] > 0, extra
    for name, r in got.items():
        assert r["prompt_tokens"] == 64 and r["ubatch"] in (16, 64) and r["limit_bytes"] == 64 << 20
        assert r["median_prompt_tok_s"] > 0 and r["read_mib_per_token"] >= 0 and r["major_faults_per_token"] >= 0
        assert r["expert_bytes_per_ubatch_mib"] == pytest.approx(expert_bytes * (64 // r["ubatch"]) / 64 / 2**20)
        assert r["ratio_to_off"] > 0 and (r["ratio_to_off"] == 1.0 or not name.startswith("patched off"))
        d = r["prefill"]
        wall_ms = 1e3 / r["median_prompt_tok_s"]
        assert d["compute_basis"] == "thread" and 0 < d["compute_ms"] <= 1.01 * wall_ms, (name, d)
        assert d["compute_ms"] + d["wait_ms"] == pytest.approx(wall_ms, rel=0.10), (name, d)
        if doc["device"] is not None:
            assert d["requests_from"].startswith("diskstats ") and d["requests"] >= 0, d
        assert "ONEBIT_MOE_PREDICT_OUT" not in r["env"]
    off, route = got["patched off, prefill 64, ubatch 16"], got["route, prefill 64, ubatch 16"]
    assert route["ratio_to_off"] == pytest.approx(route["median_prompt_tok_s"] / off["median_prompt_tok_s"])
    (tmp_path / "r.json").write_text(json.dumps(doc))
    m = load_measured(tmp_path / "r.json")
    assert len(m.rows) == 2 and [p.name for p in m.prefill] == list(got)
