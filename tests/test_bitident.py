"""The bit-identity check on every covered architecture, and its negative control.

Off vs router vs block must be byte-identical in every scenario and must have predicted;
with ONEBIT_MOE_PREDICT_DEBUG_LEAK=1 (block stores its speculative state) the same check
must fail, so a pass means something.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from onebit_predict.checks.bitident import (
    MODES,
    first_mismatch,
    keep_wait_problem,
    knob_problem,
    prediction_problem,
    reordered_problem,
    route_problem,
    run_env,
)
from onebit_predict.checks.modes import CONSUMERS, ModeSpec, mode_route, parse_mode, split_mode
from onebit_predict.commands.bitident import main as bitident_main
from onebit_predict.constants import (
    ENV_ALL,
    ENV_MODE,
    ENV_PREFETCH,
    ENV_PREFETCH_DEBUG_KEEP_CAP,
    ENV_PREFETCH_KEEP,
    ENV_PREFETCH_LAYERS,
    ENV_PREFETCH_ORDER,
    ENV_PREFETCH_RANDOM,
    ENV_PREFETCH_ROUTE,
    ENV_PREFETCH_WAIT,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    MODE_OFF,
    MODE_ROUTER,
    PREFETCH_PREAD,
    PREFETCH_READ,
    TRACE_HDR_FLAG_RANDOM,
    TRACE_HDR_FLAG_ROUTE,
    TRACE_HDR_FLAG_WAIT,
)
from onebit_predict.llama.tiny import TINY_ARCHS
from onebit_predict.trace import Trace, TraceHeader
from onebit_predict.trace_writer import TraceWriter

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_identical_and_predicted(arch, tiny_model, capsys):
    rc = bitident_main([str(tiny_model(arch)), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK, report
    assert report["identical"] is True
    scenarios = {r["scenario"] for r in report["results"]}
    assert scenarios == {
        "prefill+decode",
        "prefill+decode flash-attn",
        "prefill+decode 1 thread",
        "two sequences",
        "save+restore",
        "prompt in ubatches of 64",
        "a server's next request",
    }
    for r in report["results"]:
        assert r["mismatch"] is None and r["problem"] is None
        assert r["ran"] == r["mode"]  # block really ran block on every covered architecture
        assert r["predicted_rows"] > 0 or parse_mode(r["mode"]).predictor == "off"  # route time alone predicts nothing


@pytest.mark.needs_build
@pytest.mark.parametrize("name", ["qwen3moe-tiny", "qwen4exp-tiny", "olmoe-tiny"])
def test_trained_models_identical(name, capsys):
    """The bundled trained models hold F16 weights, which a CPU with AMX multiplies in its AMX
    buffer: the batched AMX path (the series' ggml-cpu AMX fix) broke the "two sequences" scenario on qwen4exp
    before it was fixed, while the F32 tiny random models never reach it."""
    model = REPO_ROOT / "models" / f"{name}.gguf"
    rc = bitident_main([str(model), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK, [r for r in report["results"] if not r["ok"]]
    assert len(report["results"]) == 7 * len(MODES)  # every scenario, every default mode
    assert {r["ran"] for r in report["results"]} == set(MODES)  # each at the distance asked for


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_leaky_block_is_caught(arch, tiny_model, capsys):
    scenarios = ("prefill+decode", "save+restore", "prompt in ubatches of 64")
    rc = bitident_main([str(tiny_model(arch)), "--debug-leak", "--scenarios", ",".join(scenarios), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == EXIT_CHECK_FAILED
    by_mode = {(r["scenario"], r["mode"]): r for r in report["results"]}
    for scenario in scenarios:
        assert by_mode[(scenario, "block")]["mismatch"] is not None  # the leak changed the bytes
        assert by_mode[(scenario, "router")]["mismatch"] is None  # the switch only touches block


def test_usage_errors(tmp_path, capsys):
    assert bitident_main([str(tmp_path / "missing.gguf")]) == EXIT_USAGE
    assert bitident_main([str(tmp_path), "--modes", "sideways"]) == EXIT_USAGE
    assert bitident_main([str(tmp_path), "--scenarios", "nope"]) == EXIT_USAGE
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    assert bitident_main([str(tmp_path / "junk.gguf")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "no such file" in err and "--modes" in err and "unknown scenario" in err
    assert "cannot read it as a GGUF" in err


def test_first_mismatch_reports_row_and_index():
    a = np.arange(6, dtype=np.float32)
    b = a.copy()
    b[4] = np.nextafter(b[4], np.float32(10))  # one ulp: a tolerance would call it equal
    rows_a = [a[:3].tobytes(), a[3:].tobytes()]
    rows_b = [b[:3].tobytes(), b[3:].tobytes()]
    m = first_mismatch(rows_a, rows_b)
    assert (m.row, m.vocab, m.off) == (1, 1, 4.0) and m.other != 4.0
    assert first_mismatch(rows_a, rows_a) is None
    assert first_mismatch(rows_a, rows_a[:1]).row == 1  # a missing row is a difference


def _trace(path, rows, layers_predicted):
    header = TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=2, mode=MODE_ROUTER, arch="qwen3moe")
    with TraceWriter(path, header) as w:
        for pos in range(rows):
            for layer in range(3):
                pred = [0, 1] if layer in layers_predicted else None
                w.add(
                    step=pos,
                    seq_id=0,
                    pos=pos,
                    layer=layer,
                    actual=[0, 1],
                    pred=pred,
                    logits=[1.0, 0.5] if pred else None,
                )
    return path


def test_prediction_problem_requires_every_row(tmp_path):
    full = _trace(tmp_path / "full.bin", 5, {1, 2})
    assert prediction_problem(full, 5)[1] is None
    assert "layer 1" in prediction_problem(full, 6)[1]  # a routed row without a record
    partial = _trace(tmp_path / "partial.bin", 5, {1})
    assert "layer 2: 0 predicted" in prediction_problem(partial, 5)[1]
    none = _trace(tmp_path / "none.bin", 5, set())
    assert "layer 1: 0 predicted" in prediction_problem(none, 5)[1]


@pytest.mark.parametrize("layer, mixer", [(2, "DeltaNet"), (3, "attention")])
def test_leak_caught_for_each_mixer(layer, mixer, tiny_model):
    """qwen3next alternates DeltaNet (layers 0, 2) and attention (1, 3): predicting one layer at a
    time, block is identical to off and its leaky twin is not, whichever mixer it runs."""
    from onebit_predict.llama.runner import Context, ContextSettings, Model

    def logits(env):
        with Model(tiny_model("qwen3next")) as m, Context(m, ContextSettings(n_ubatch=8), env) as ctx:
            toks = np.random.default_rng(1).integers(0, m.n_vocab, size=40).tolist()
            rows = ctx.decode(toks[:24], range(24), [0] * 24, [True] * 24)
            for i in range(16):
                rows += ctx.decode([toks[24 + i]], [24 + i], [0], [True])
            return rows

    base = {"ONEBIT_MOE_PREDICT": "block", "ONEBIT_MOE_PREDICT_LAYERS": str(layer)}
    off = logits({})
    assert logits(base) == off
    assert logits(base | {"ONEBIT_MOE_PREDICT_DEBUG_LEAK": "1"}) != off, mixer


# --- a check that proves what it claims (issue: checks as strict as their claims) -------------


def test_the_callers_environment_is_not_inherited(tiny_model, tmp_path, monkeypatch, capsys):
    """ONEBIT_* knobs set by the caller must reach neither the off reference (which must build the
    unpatched graph: no predictor at all) nor the mode under test (every knob at the check's value)."""
    from onebit_predict.checks.bitident import SCENARIOS, check_model, run_once
    from onebit_predict.llama.runner import Model

    for name, value in {
        "ONEBIT_MOE_PREDICT_NO_ATTN": "1",
        "ONEBIT_MOE_PREDICT_LAYERS": "3",
        "ONEBIT_MOE_PREDICT_STATS": "1",
        "ONEBIT_MOE_PREDICT_DEPTH": "3",
        "ONEBIT_MOE_PREFETCH": "read",
    }.items():
        monkeypatch.setenv(name, value)
    with Model(tiny_model("qwen3next")) as model:
        capsys.readouterr()
        run_once(model, SCENARIOS[0], "off", None, False, 0)
        assert "onebit" not in capsys.readouterr().err  # no predictor object in the reference
        results = check_model(model, SCENARIOS[:1], ["block"], trace_dir=tmp_path)
    assert [r.problem for r in results] == [None] and results[0].ok
    header = Trace.open(tmp_path / "prefill_decode-block.bin").header
    assert not header.no_attn and header.depth_requested == 0 and header.prefetch_name == "off"
    assert sorted(header.layer_mask) == list(range(1, header.n_layer))


def _record(model_path: Path, tmp_path: Path, mode: str, leak: bool = False) -> tuple[Path, int]:
    from onebit_predict.checks.bitident import SCENARIOS, run_once
    from onebit_predict.llama.runner import Model

    path = tmp_path / f"{mode}{'-leak' if leak else ''}.bin"
    with Model(model_path) as model:
        out = run_once(model, SCENARIOS[0], mode, path, leak, 0)
    return path, out.n_routed


def test_a_mode_that_did_not_run_as_asked_fails(tiny_model, tmp_path):
    """A trace that records router where block was asked for (block falls back where it cannot
    run), or a leak control that was not applied, fails with the reason, not as identical."""
    from onebit_predict.checks.bitident import run_problem

    router, n = _record(tiny_model("qwen3moe"), tmp_path, "router")
    assert run_problem(router, n, "router", leak=False)[1] is None
    problem = run_problem(router, n, "block", leak=False)[1]
    assert problem and "block was asked for, the trace records router" in problem
    block, n = _record(tiny_model("qwen3moe"), tmp_path, "block")
    problem = run_problem(block, n, "block", leak=True)[1]
    assert problem and "negative control was asked for and is not applied" in problem
    leaky, n = _record(tiny_model("qwen3moe"), tmp_path, "block", leak=True)
    header = Trace.open(leaky).header
    assert header.debug_leak and header.graph_check_off  # the control is recorded in the header
    assert run_problem(leaky, n, "block", leak=True)[1] is None
    assert "not asked for and is applied" in run_problem(leaky, n, "block", leak=False)[1]
    # a run one layer ahead where two were asked for
    problem = run_problem(router, n, "router@2", leak=False)[1]
    assert problem and "ahead 1, the check sets 2" in problem
    ahead, n = _record(tiny_model("qwen3moe"), tmp_path, "router@2")
    assert run_problem(ahead, n, "router@2", leak=False)[1] is None


def test_the_graph_check_refuses_a_leaking_block(tiny_model, capsys):
    """With the negative control and the graph check on, the context is refused with an error
    naming the speculative write (never an abort): for an attention and a DeltaNet model."""
    from onebit_predict.constants import DEBUG_LEAK_CHECKED, ENV_ALL, ENV_DEBUG_LEAK, ENV_MODE
    from onebit_predict.llama.runner import Context, ContextSettings, Model, RunError

    env = dict.fromkeys(ENV_ALL) | {ENV_MODE: "block", ENV_DEBUG_LEAK: DEBUG_LEAK_CHECKED}
    for arch in ("qwen3moe", "qwen3next"):
        with Model(tiny_model(arch)) as model, pytest.raises(RunError):
            Context(model, ContextSettings(), env)
        assert "refusing this graph" in capsys.readouterr().err


def test_a_one_token_prefill_tail_is_not_a_decode_row(tiny_model, tmp_path):
    """DECODE marks a sequence with one token in the whole llama_decode batch: the last ubatch of
    a 25-token prefill in ubatches of 8 holds one token and is still prefill."""
    from onebit_predict.checks.bitident import run_env
    from onebit_predict.constants import TRACE_FLAG_DECODE
    from onebit_predict.llama.runner import Context, ContextSettings, Model

    path = tmp_path / "tail.bin"
    with Model(tiny_model("qwen3moe")) as model:
        with Context(model, ContextSettings(n_ubatch=8), run_env("router", path, False)) as ctx:
            ctx.decode(list(range(25)), range(25), [0] * 25, [True] * 25)
            ctx.decode([3], [25], [0], [True])
    rows = np.concatenate(list(Trace.open(path).iter_chunks()))
    decode = (rows["flags"] & TRACE_FLAG_DECODE) != 0
    assert not decode[rows["pos"] < 25].any()  # pos 24 sits alone in the third ubatch
    assert decode[rows["pos"] == 25].all()


def test_without_extra_buffer_types(tiny_model, capsys):
    """--no-extra-bufts (the plain CPU kernels, for quantized weights whose AMX path faults on
    some VMs) runs the same check."""
    rc = bitident_main([str(tiny_model("qwen3moe")), "--no-extra-bufts", "--modes", "block+read", "--scenarios",
                        "two sequences", "--json"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK and report["identical"] and len(report["results"]) == 1


def test_route_modes_and_their_proof():
    """``route`` alone and ``PREDICTOR+CONSUMER+route`` are modes; a route mode passes only when the
    context's counters show route time at work."""
    assert split_mode("route") == ("off", None) and mode_route("route")
    assert split_mode("block+populate+route") == ("block", "populate") and mode_route("block+populate+route")
    assert not mode_route("block+read") and split_mode("off") == ("off", None)  # the reference itself
    assert split_mode("populate+route") == ("off", "populate")  # a call alone: route time, the predictor off
    for bad in ("off+route", "route+route", "block+route+read"):
        with pytest.raises(ValueError):
            split_mode(bad)
    routed = {"route": 1, "route_bytes": 0, "route_resident": 4096, "prefetch_failed": 0}
    assert route_problem(routed) is None
    assert "does not read at route time" in route_problem(None)
    assert "does not read at route time" in route_problem(routed | {"route": 0})
    assert "looked at no routed expert" in route_problem(routed | {"route_resident": 0})
    assert "failed" in route_problem(routed | {"prefetch_failed": 2})


# --- route time's qualifiers: +exact, +wait, +lru, and the pread call ----------------------------


@pytest.mark.parametrize(
    "mode, want",
    [
        ("pread+route+exact+wait", ModeSpec("off", 1, "pread", route=True, exact=True, wait=True)),
        ("route+lru", ModeSpec("off", 1, None, route=True, lru=True)),
        ("block+pread+route+wait+lru", ModeSpec("block", 1, "pread", route=True, wait=True, lru=True)),
        ("pread+route+exact+wait+lru", ModeSpec("off", 1, "pread", True, True, True, True)),
        ("router@2+route+exact", ModeSpec("router", 2, None, route=True, exact=True)),
        ("advise+route+exact", ModeSpec("off", 1, "advise", route=True, exact=True)),
        ("block+pread", ModeSpec("block", 1, "pread")),
        ("route+wait", ModeSpec("off", 1, None, route=True, wait=True)),  # route's own call (read) finishes
        ("pread+route+wait+anon", ModeSpec("off", 1, "pread", route=True, wait=True, anon=True)),
        (
            "block+pread+route+exact+wait+anon+hits",
            ModeSpec("block", 1, "pread", True, True, True, anon=True, hits=True),
        ),
    ],
)
def test_the_grammar_of_qualifiers(mode, want):
    spec = parse_mode(mode)
    assert spec == want
    assert spec.call == (want.consumer or ("read" if want.route else "off"))  # what the header must record


@pytest.mark.parametrize(
    "mode, words",
    [
        ("route+wait+exact", "in the order exact+wait+lru"),  # misplaced: the order is fixed
        ("route+lru+lru", "once each"),
        ("route+wait+anon", "+anon is the LRU in memory of its own: it reads with pread"),  # route's call is read
        ("pread+route+anon", "+anon waits for its reads"),  # the wait implied is recorded: the mode names it
        ("pread+route+wait+lru+anon", "is not +lru as well"),
        ("pread+route+lru+anon+hits", "is not +lru as well"),
        ("block+read+wait", "+wait qualifies route time: it comes after +route"),
        ("exact+route", "+exact qualifies route time"),
        ("block+route+pread", "the call pread is misplaced: it comes before +route"),
        ("route+sideways", "'sideways' is not a qualifier of +route"),
        ("pread", "the call pread without a predictor needs +route"),
        ("pread+exact", "+exact qualifies route time"),
        ("advise+route+wait", "+wait needs a call that finishes its reads"),
        ("block+advise+route+wait", "not advise"),
        ("block+read+pread+route", "one call at most"),
        ("off+route", "'off' is not a predictor"),
        ("block@4+route", "@4 is not a lookahead"),
        ("route+route", "+route twice"),
    ],
)
def test_bad_modes_say_why(mode, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_mode(mode)


def test_bad_modes_are_usage_errors(tmp_path, capsys):
    """A misplaced part is the command's exit 2, with parse_mode's reason."""
    assert bitident_main([str(tmp_path), "--modes", "route,route+wait+exact"]) == EXIT_USAGE
    assert "in the order exact+wait+lru" in capsys.readouterr().err
    assert bitident_main([str(tmp_path), "--modes", "off"]) == EXIT_USAGE
    assert "the reference" in capsys.readouterr().err


def test_the_default_modes_cover_the_qualifiers():
    specs = [parse_mode(m) for m in MODES]
    for want in (
        "pread+route+exact+wait",
        "route+lru+hits+layers",
        "block+pread+route+wait+lru",
        "pread+route+wait+anon",
    ):
        assert want in MODES
    assert any(s.exact for s in specs) and any(s.wait for s in specs) and any(s.lru for s in specs)
    assert any(s.hits and s.lru for s in specs)  # where the LRU's page-outs let the order be proved
    assert any(s.anon and s.wait for s in specs)  # anon's layer wait
    assert any(s.anon and s.hits and s.predictor != "off" for s in specs)  # its matmuls' wait, guesses in its room
    assert any(s.layers for s in specs)
    assert {s.consumer for s in specs} >= set(CONSUMERS)  # pread among every call


def test_every_qualifier_is_pinned_per_mode():
    """Each route-time knob is set by the mode that asks for it and cleared (None) by every other,
    so nothing reaches a run from the caller's environment."""
    knobs = (
        ENV_PREFETCH, ENV_PREFETCH_RANDOM, ENV_PREFETCH_WAIT, ENV_PREFETCH_KEEP, ENV_PREFETCH_DEBUG_KEEP_CAP,
        ENV_PREFETCH_ORDER, ENV_PREFETCH_LAYERS,
    )  # fmt: skip
    assert {k: run_env("route", None, False)[k] for k in knobs} == dict.fromkeys(knobs)
    env = run_env("pread+route+exact+wait+lru+hits+layers", None, False, keep_cap=6)
    assert set(env) == set(ENV_ALL)
    assert [env[k] for k in knobs] == ["pread", "1", "1", "lru", "6", "hits", "2"]
    assert env[ENV_MODE] is None and env[ENV_PREFETCH_ROUTE] == "1"
    env = run_env("block+pread+route+wait+lru", None, False, keep_cap=6)
    assert env[ENV_MODE] == "block" and env[ENV_PREFETCH_RANDOM] is None and env[ENV_PREFETCH_WAIT] == "1"
    for mode in MODES:
        env = run_env(mode, None, False, keep_cap=6)
        spec = parse_mode(mode)
        assert (env[ENV_PREFETCH_KEEP] == "lru") == spec.lru and (env[ENV_PREFETCH_KEEP] == "anon") == spec.anon
        assert spec.keeps == (env[ENV_PREFETCH_DEBUG_KEEP_CAP] is not None)
        assert (env[ENV_PREFETCH_RANDOM] == "1") == spec.exact and (env[ENV_PREFETCH_WAIT] == "1") == spec.wait
        assert (env[ENV_PREFETCH_ORDER] == "hits") == spec.hits
        assert (env[ENV_PREFETCH_LAYERS] == "2") == spec.layers
    with pytest.raises(ValueError, match="keep_cap"):
        run_env("route+lru", None, False)  # an LRU of no size would prove nothing


_ROUTED = {
    "route": 1, "route_bytes": 0, "route_resident": 4096, "prefetch_failed": 0,
    "wait": 0, "keep": 0, "keep_evicted": 0, "keep_capacity": -1, "spec_skipped": 0, "spec_unused": 0,
    "order": 0, "order_marked": 0, "order_reordered": 0, "order_waiting": 0,
}  # fmt: skip


def test_the_counters_prove_wait_and_lru():
    """+wait passes only with the counters' wait 1, +lru only with keep 1, an eviction and the
    capacity asked for; a mode that asks for neither fails where either is on."""
    wait, lru = parse_mode("pread+route+exact+wait"), parse_mode("route+lru")
    assert route_problem(_ROUTED, parse_mode("route")) is None
    assert route_problem(_ROUTED | {"wait": 1}, wait) is None
    assert "WAIT=1 was asked for, the context's counters show wait 0" in route_problem(_ROUTED, wait)
    assert "WAIT=1 was not asked for" in route_problem(_ROUTED | {"wait": 1}, parse_mode("route"))
    good = _ROUTED | {"keep": 1, "keep_evicted": 12, "keep_capacity": 6}
    assert route_problem(good, lru, 6) is None
    assert "KEEP=lru was asked for, the context's counters show keep 0" in route_problem(good | {"keep": 0}, lru, 6)
    assert "evicted nothing" in route_problem(good | {"keep_evicted": 0}, lru, 6)
    assert "held to 6 experts" in route_problem(good | {"keep_capacity": 40}, lru, 6)
    assert "KEEP=lru was not asked for" in route_problem(good, parse_mode("route"))
    assert keep_wait_problem(_ROUTED, parse_mode("block+read")) is None  # a mode without route time
    guessing = parse_mode("block+pread+route+wait+lru")
    assert "guesses never met the LRU's room" in route_problem(good | {"wait": 1}, guessing, 6)
    assert route_problem(good | {"wait": 1, "spec_unused": 3}, guessing, 6) is None
    assert route_problem(good | {"wait": 1, "spec_skipped": 1}, guessing, 6) is None
    assert "not asked for" in keep_wait_problem(_ROUTED | {"keep": 1}, parse_mode("block+read"))


def test_the_counters_prove_anon():
    """+anon passes only with the counters' keep 2 (the LRU in memory of its own), not 1 (the page
    cache's), with an eviction; +lru fails where the counters show anon."""
    anon, lru = parse_mode("pread+route+wait+anon"), parse_mode("pread+route+wait+lru")
    good = _ROUTED | {"wait": 1, "keep": 2, "keep_evicted": 5, "keep_capacity": 6}
    assert route_problem(good, anon, 6) is None
    assert "KEEP=anon was asked for, the context's counters show keep 1" in route_problem(good | {"keep": 1}, anon, 6)
    assert "KEEP=lru was asked for, the context's counters show keep 2" in route_problem(good, lru, 6)
    assert "KEEP=anon evicted nothing" in route_problem(good | {"keep_evicted": 0}, anon, 6)
    assert "KEEP=anon was not asked for" in route_problem(good, parse_mode("pread+route+wait"))
    env = run_env("pread+route+wait+anon", None, False, keep_cap=6)
    assert (env[ENV_PREFETCH_KEEP], env[ENV_PREFETCH_DEBUG_KEEP_CAP], env[ENV_PREFETCH_WAIT]) == ("anon", "6", "1")
    # with +hits each expert's matmul waits instead of the layer: ggml-cpu must have read the waiting mark
    anon_hits = parse_mode("pread+route+anon+hits")
    marked = good | {"wait": 0, "order": 1, "order_marked": 24}
    assert "no expert matmul read the waiting mark" in route_problem(marked, anon_hits, 6)
    assert route_problem(marked | {"order_waiting": 24}, anon_hits, 6) is None  # reordered or not: timing
    assert run_env("pread+route+anon+hits", None, False, keep_cap=6)[ENV_PREFETCH_WAIT] is None


def test_the_counters_prove_hits_first():
    """+hits passes only with the counters' order 1 and marked matmuls, and with +lru (whose page-outs
    leave routed experts being read as their matmuls start) only when ggml-cpu took a run out of index
    order: a mark ggml-cpu never read fails; a mode that does not ask for it fails where it is on."""
    hits, lru_hits = parse_mode("route+hits"), parse_mode("route+lru+hits")
    assert hits == ModeSpec("off", 1, None, route=True, hits=True)
    on = _ROUTED | {"order": 1, "order_marked": 24, "order_reordered": 0}
    assert route_problem(on, hits) is None  # resident, nothing to reorder: the marks prove the graph
    assert "ORDER=hits was asked for, the context's counters show order 0" in route_problem(_ROUTED, hits)
    assert "ran no expert matmul marked" in route_problem(on | {"order_marked": 0}, hits)
    assert "ORDER=hits was not asked for" in route_problem(on, parse_mode("route"))
    lru = on | {"keep": 1, "keep_evicted": 12, "keep_capacity": 6}
    # runs out of index order are counted over the scenarios, not per run (timing: a flash-attn run on the
    # tiny model read every expert before its matmuls once in two, and failed CI when judged alone)
    assert route_problem(lru, lru_hits, 6) is None
    assert "never took the experts out of index order in any scenario" in reordered_problem("route+lru+hits", 0)
    assert reordered_problem("route+lru+hits+layers", 3) is None
    assert reordered_problem("route+hits", 0) is None  # resident without the LRU: nothing to reorder
    assert run_env("route+lru+hits", None, False, keep_cap=6)[ENV_PREFETCH_ORDER] == "hits"
    assert run_env("route+lru", None, False, keep_cap=6)[ENV_PREFETCH_ORDER] is None
    with pytest.raises(ValueError, match="in the order exact\\+wait\\+lru\\+anon\\+hits"):
        parse_mode("route+hits+lru")


def test_the_counters_prove_layers_ahead():
    """+layers passes only with the counters' layers at the 2 it set; a mode that does not ask for it
    fails where it is on (the big prompt's ops that read ahead are checked by check_model, per scenario)."""
    layers = parse_mode("route+lru+hits+layers")
    assert layers == ModeSpec("off", 1, None, route=True, lru=True, hits=True, layers=True)
    on = _ROUTED | {"order": 1, "order_marked": 24, "order_reordered": 3, "keep": 1, "keep_evicted": 12}
    on |= {"keep_capacity": 6, "layers": 2, "layers_ops": 5}
    assert route_problem(on, layers, 6) is None
    assert "LAYERS=2 was asked for, the context's counters show layers 0" in route_problem(
        on | {"layers": 0}, layers, 6
    )
    assert "LAYERS=2 was asked for, the context's counters show layers 8" in route_problem(
        on | {"layers": 8}, layers, 6
    )
    assert "LAYERS was not asked for" in route_problem(on, parse_mode("route+lru+hits"), 6)
    assert run_env("route+layers", None, False)[ENV_PREFETCH_LAYERS] == "2"
    with pytest.raises(ValueError, match="in the order exact\\+wait\\+lru\\+anon\\+hits\\+layers"):
        parse_mode("route+layers+hits")


def test_the_header_proves_the_call_exact_and_wait():
    base = TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=2, mode=MODE_OFF, arch="qwen3moe")
    route = dataclasses.replace(base, prefetch_mode=PREFETCH_READ, flags=base.flags | TRACE_HDR_FLAG_ROUTE)
    assert knob_problem(route, parse_mode("route")) is None
    assert knob_problem(route, parse_mode("read+route")) is None
    asked = parse_mode("pread+route+exact+wait")
    assert "ONEBIT_MOE_PREFETCH=pread was asked for, the trace records read" in knob_problem(route, asked)
    pread = dataclasses.replace(route, prefetch_mode=PREFETCH_PREAD)
    assert "random (+exact) flag is clear, the mode asks for it" in knob_problem(pread, asked)
    exact = dataclasses.replace(pread, flags=pread.flags | TRACE_HDR_FLAG_RANDOM)
    assert "wait flag is clear, the mode asks for it" in knob_problem(exact, asked)
    both = dataclasses.replace(exact, flags=exact.flags | TRACE_HDR_FLAG_WAIT)
    assert knob_problem(both, asked) is None
    assert "wait flag is set, the mode does not ask for it" in knob_problem(both, parse_mode("pread+route+exact"))
    unrouted = dataclasses.replace(base, prefetch_mode=PREFETCH_READ)
    assert "route flag is clear" in knob_problem(unrouted, parse_mode("route"))


def test_a_route_mode_that_did_not_run_as_asked_fails(tiny_model, tmp_path):
    """Real traces and counters: route alone checked as pread+route+exact+wait or route+lru fails,
    and each passes on its own run, the mode it ran named in full."""
    from onebit_predict.checks.bitident import SCENARIOS, run_once, run_problem
    from onebit_predict.llama.runner import Model

    runs = {}
    with Model(tiny_model("qwen3moe")) as model:
        for mode in ("route", "pread+route+exact+wait", "route+lru"):
            path = tmp_path / f"{mode}.bin"
            runs[mode] = path, run_once(model, SCENARIOS[0], mode, path, False, 0)
    path, out = runs["route"]
    assert run_problem(path, out.n_routed, "route", False, out.stats) == (0, None, "route")
    problem = run_problem(path, out.n_routed, "pread+route+exact+wait", False)[1]
    assert "ONEBIT_MOE_PREFETCH=pread was asked for" in problem
    assert "keep 0" in route_problem(out.stats, parse_mode("route+lru"), 6)
    path, out = runs["pread+route+exact+wait"]
    mode = "pread+route+exact+wait"
    assert run_problem(path, out.n_routed, mode, False, out.stats) == (0, None, mode)
    assert route_problem(out.stats, parse_mode(mode)) is None
    assert out.stats["wait"] == 1 and out.keep_cap is None
    path, out = runs["route+lru"]
    assert run_problem(path, out.n_routed, "route+lru", False, out.stats) == (0, None, "route+lru")
    assert route_problem(out.stats, parse_mode("route+lru"), out.keep_cap) is None
    assert out.stats["keep"] == 1 and out.stats["keep_evicted"] > 0 and out.stats["keep_capacity"] == out.keep_cap
    assert "wait 0" in route_problem(out.stats, parse_mode("route+wait+lru"), out.keep_cap)
