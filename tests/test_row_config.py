"""A benchmark row's configuration (costmodel/row_config.py): one frozen RowConfig gives the row's name,
its ONEBIT_* variables, the C API's settings and the report's fields; the reports written before
the fields (docs/measured/*.json) are read back from their names, and their env agrees."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from onebit_predict.checks.bench_cold import cold_configs
from onebit_predict.checks.bench_memory import chosen_rows, memory_rows, route_rows, rows_value
from onebit_predict.costmodel.measured import load_measured
from onebit_predict.costmodel.row_config import RowConfig, from_name, knob
from onebit_predict.llama.moe_api import moe_params

MEASURED = Path(__file__).resolve().parent.parent / "docs" / "measured"
REPORTS = sorted(p for p in MEASURED.glob("*.json") if p.name.startswith(("memory", "cold")))


def test_name_env_and_fields_come_from_the_configuration():
    deep = RowConfig("block", "advise", depth=16, room=0.0)
    assert deep.name == "block + advise, depth 16, room 0"
    assert deep.env() == {
        "ONEBIT_MOE_PREDICT": "block",
        "ONEBIT_MOE_PREFETCH": "advise",
        "ONEBIT_MOE_PREDICT_DEPTH": "16",
        "ONEBIT_MOE_PREFETCH_ROOM": "0",
    }
    assert RowConfig().name == "patched off" and RowConfig().env() == {}
    assert RowConfig("router").env() == {"ONEBIT_MOE_PREDICT": "router", "ONEBIT_MOE_PREFETCH": "off"}
    assert RowConfig("block", "advise", guard=4).name == "block + advise, guard 4"
    assert RowConfig("block", "advise", guard=0).name == "block + advise, no guard"
    assert RowConfig("router", "read", ahead=2, room=0.5).name == "router + read, ahead 2, room 0.5"
    oracle = RowConfig("router", "advise", oracle=True)
    assert oracle.name == "oracle + advise"  # the upper bound: neither rule nor guard
    assert oracle.env("/t/src.bin") == {
        "ONEBIT_MOE_PREDICT": "router",
        "ONEBIT_MOE_PREFETCH": "advise",
        "ONEBIT_MOE_PREFETCH_GUARD": "0",
        "ONEBIT_MOE_PREFETCH_ROOM": "0",
        "ONEBIT_MOE_PREFETCH_DEBUG_ORACLE": "/t/src.bin",
    }
    on_drives = [RowConfig("block", "advise", read_ahead_kb=128, drive="nvme"), RowConfig(drive="native")]
    for c in [*memory_rows(16), oracle, RowConfig("router", "read", ahead=2, room=0.5), *on_drives]:
        assert RowConfig.from_fields(json.loads(json.dumps(c.fields()))) == c
        assert from_name(c.name) == c
        assert c.consumer_off() == RowConfig(c.predictor, ahead=c.ahead, read_ahead_kb=c.read_ahead_kb, drive=c.drive)


def test_the_c_api_settings_leave_nothing_to_the_environment():
    knobs = RowConfig("block", "advise", depth=16).knobs()
    assert knobs["ONEBIT_MOE_PREDICT_DEPTH"] == "16" and knobs["ONEBIT_MOE_PREFETCH_ROOM"] is None
    p = moe_params(knobs)
    assert (p.predict, p.prefetch, p.depth) == (b"block", b"advise", b"16")
    assert (p.prefetch_room, p.prefetch_guard, p.predict_ahead, p.prefetch_debug_oracle) == (b"", b"", b"", b"")
    assert p.margin is None  # not a knob of the configuration: the environment's
    assert moe_params(RowConfig().knobs()).predict == b""  # off: the default, whatever ONEBIT_MOE_PREDICT says


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"predictor": "oracle"}, "unknown predictor"),
        ({"predictor": "router", "consumer": "touch"}, "unknown consumer"),
        ({"consumer": "advise"}, "needs a predictor or route"),
        ({"predictor": "block", "random": True}, "needs the consumer on"),
        ({"predictor": "block", "consumer": "advise", "oracle": True}, "the oracle"),
        ({"predictor": "router", "consumer": "advise", "room": -1.0}, "room -1.0 is not float >= 0"),
        ({"predictor": "router", "ahead": 0}, "ahead 0 is not int >= 1"),
        ({"route": True, "keep": "anon"}, "keep anon holds what pread reads at route time"),  # the default call
        ({"consumer": "read", "route": True, "keep": "anon"}, "needs pread \\+ route"),
        ({"predictor": "block", "consumer": "pread", "keep": "anon"}, "needs pread \\+ route"),
    ],
)
def test_a_configuration_is_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        RowConfig(**kw)


def test_route_time_configurations():
    """Route time (the peers' mechanism) alone and with a prediction: its name, its variables, its C API
    settings; the default set's rows keep their names, the route set's read back from theirs."""
    route = RowConfig(route=True)
    assert route.name == "route" and not route.speculative
    assert route.env() == {"ONEBIT_MOE_PREFETCH": "off", "ONEBIT_MOE_PREFETCH_ROUTE": "1"}  # the default call
    both = RowConfig("block", "read", route=True, workers=8)
    assert both.name == "block + read + route, workers 8" and both.speculative
    assert both.env() == {
        "ONEBIT_MOE_PREDICT": "block",
        "ONEBIT_MOE_PREFETCH": "read",
        "ONEBIT_MOE_PREFETCH_ROUTE": "1",
        "ONEBIT_MOE_PREFETCH_THREADS": "8",
    }
    exact = RowConfig(consumer="advise", route=True, random=True)
    assert exact.name == "advise + route, exact" and exact.env()["ONEBIT_MOE_PREFETCH_RANDOM"] == "1"
    p = moe_params(RowConfig("block", "read").knobs())
    assert (p.prefetch_route, p.prefetch_random) == (b"", b"")  # controlled: the default, not the environment's
    oracle = RowConfig("router", "read", oracle=True, route=True)
    assert oracle.name == "oracle + read + route" and oracle.consumer_off() == RowConfig("router")
    for c in [*route_rows(16), both, exact, oracle]:
        assert from_name(c.name) == c and RowConfig.from_fields(json.loads(json.dumps(c.fields()))) == c
    assert [c.name for c in memory_rows(16)][:3] == ["patched off", "router", "router + advise"]


def test_the_rows_option():
    assert rows_value("drives") == ("drives",) and chosen_rows(("drives",), 16) == route_rows(16)
    assert chosen_rows(None, 16) == memory_rows(16)
    named = chosen_rows(rows_value("route; block + read + route, workers 8; route"), 16)
    assert named == [RowConfig(), RowConfig(route=True), RowConfig("block", "read", route=True, workers=8)]
    for bad in ("block + touch", "route + route", "; ;", "advise"):
        with pytest.raises(ValueError, match="--rows"):
            rows_value(bad)


def test_names_that_are_no_configuration():
    names = ("patched off, warm", "router + trace", "block no-attn", "unpatched pin", "block, depth x")
    for name in (*names, "x + advise"):
        assert from_name(name) is None, name


def test_read_ahead_kb_is_a_knob_of_one_line():
    """read_ahead_kb (the drive's readahead, set on the device for a run: no ONEBIT_* variable) is the one
    knob() line the docstring asks for: the name, the fields and their reading follow; the environment
    and the C API settings are those without it; the baselines keep it."""
    c = RowConfig("block", "advise", read_ahead_kb=128)
    plain = RowConfig("block", "advise")
    assert c.name == "block + advise, readahead 128" and RowConfig(read_ahead_kb=0).name == "patched off, readahead 0"
    assert c.env() == plain.env() and c.knobs() == plain.knobs()
    assert c.fields()["read_ahead_kb"] == 128 and RowConfig.from_fields(c.fields()) == c
    assert from_name(c.name) == c and from_name("oracle + advise, readahead 8192").read_ahead_kb == 8192
    assert c.consumer_off() == RowConfig("block", read_ahead_kb=128)  # never a loss: at the same value
    assert c.predictor_off() == RowConfig(read_ahead_kb=128) and plain.predictor_off() == RowConfig()
    with pytest.raises(ValueError, match="readahead -1 is not int >= 0"):
        RowConfig(read_ahead_kb=-1)
    # a report written before the field: unknown, not this machine's 8192
    before = {k: v for k, v in c.fields().items() if k != "read_ahead_kb"}
    assert RowConfig.from_fields(before) == plain and RowConfig.from_fields(before).read_ahead_kb is None

    @dataclasses.dataclass(frozen=True)
    class Wider(RowConfig):
        threads: int | None = knob(None, "threads", int, low=1)

    w = Wider("block", "advise", read_ahead_kb=128, threads=2)
    assert w.name == "block + advise, readahead 128, threads 2" and Wider.from_fields(w.fields()) == w
    with pytest.raises(ValueError, match="unknown fields"):
        RowConfig.from_fields(w.fields())


def test_every_cold_row_is_its_configuration(tmp_path):
    plans = cold_configs(tmp_path)
    assert [p.name for p in plans][:2] == ["patched off, warm", "patched off"]
    for p in plans[1:]:
        assert p.name == p.config.name
        assert {k: v for k, v in p.env.items() if k.startswith(("ONEBIT_MOE_PREDICT", "ONEBIT_MOE_PREFETCH"))} == {
            **p.config.env(),
            **({"ONEBIT_MOE_PREFETCH_DEBUG_DRAIN": "1"} if not p.config.is_off else {}),
            "ONEBIT_MOE_PREDICT_OUT": p.env["ONEBIT_MOE_PREDICT_OUT"],
        }


@pytest.mark.parametrize("path", REPORTS, ids=[p.name for p in REPORTS])
def test_the_measured_reports_are_read_by_their_names(path, caplog):
    """Every report of docs/measured: each row but the warm one is a configuration, and where the
    report records env (since the room rule) it is the configuration's, to the byte."""
    with caplog.at_level(logging.WARNING, logger="onebit_predict"):
        m = load_measured(path)
    assert not caplog.records
    # written before the drive was recorded: its readahead is unknown (it was 8192), not guessed
    assert m.read_ahead_kb is None and all(r.read_ahead_kb is None for r in m.rows)
    assert all(r.drive is None for r in m.rows)  # ... and before --drive: the drive unknown, not "native"
    raw = json.loads(path.read_text())["rows"]
    for row, r in zip(m.rows, raw, strict=True):
        assert (row.config is None) == (row.name == "patched off, warm"), row.name
        if row.config is not None:
            assert row.config.name == row.name
        if r.get("env") is not None:
            assert row.config.env(r["env"].get("ONEBIT_MOE_PREFETCH_DEBUG_ORACLE")) == r["env"]


def test_the_read_path_knobs_name_their_rows_and_the_page_model_plays_them():
    """pread, the wait and the LRU are a row's call and knobs (its name, its environment, read back from
    the name); the page model plays route with each (costmodel/pages.py), and lists as not played what
    has nothing to play: the wait with advise (RowConfig refuses a wait or an LRU without route time)."""
    from onebit_predict.costmodel.page_check import playable
    from onebit_predict.costmodel.row_config import from_name

    cfg = RowConfig(consumer="pread", route=True, random=True, wait=1, keep="lru")
    assert cfg.name == "pread + route, exact, wait 1, keep lru"
    assert from_name(cfg.name) == cfg
    anon = from_name("pread + route, keep anon")
    assert anon.keep == "anon" and anon.env()["ONEBIT_MOE_PREFETCH_KEEP"] == "anon"
    assert anon.env()["ONEBIT_MOE_PREFETCH"] == "pread" and from_name(anon.name) == anon
    env = cfg.env()
    assert (env["ONEBIT_MOE_PREFETCH"], env["ONEBIT_MOE_PREFETCH_WAIT"], env["ONEBIT_MOE_PREFETCH_KEEP"]) == (
        "pread",
        "1",
        "lru",
    )
    knobs = RowConfig(route=True).knobs()
    assert (
        knobs["ONEBIT_MOE_PREFETCH_WAIT"] is None and knobs["ONEBIT_MOE_PREFETCH_KEEP"] is None
    )  # pinned, not inherited
    with pytest.raises(ValueError):
        RowConfig(route=True, keep="mru")
    for row in (
        cfg,
        RowConfig(route=True, wait=1),
        RowConfig(route=True, keep="lru"),
        RowConfig(consumer="pread", route=True),
    ):
        assert playable(row, None)  # the predictor off: decided before the trace is looked at
    for row in (RowConfig(consumer="advise", route=True, wait=1),):
        assert not playable(row, None)
    # the LRU in anonymous memory: played by costmodel/anon.py (test_pages_anon.py), not as the page cache's LRU
    assert playable(RowConfig(consumer="pread", route=True, keep="anon"), None)


def test_the_layers_ahead_name_their_rows_and_the_page_model_refuses_them():
    """Whole layers ahead and its hand-back control are a row's knobs (its name, its environment, read back
    from the name, pinned when not given); the page model plays decode, where a one-token ubatch never reads
    a layer ahead, so it lists such rows as not played rather than play them as route alone."""
    from onebit_predict.costmodel.page_check import playable
    from onebit_predict.costmodel.row_config import from_name

    cfg = RowConfig(route=True, keep="lru", order="hits", layers=2, handback="cold")
    assert cfg.name == "route, keep lru, order hits, layers 2, handback cold"
    assert from_name(cfg.name) == cfg
    env = cfg.env()
    assert (env["ONEBIT_MOE_PREFETCH_LAYERS"], env["ONEBIT_MOE_PREFETCH_DEBUG_HANDBACK"]) == ("2", "cold")
    knobs = RowConfig(route=True).knobs()
    assert knobs["ONEBIT_MOE_PREFETCH_LAYERS"] is None and knobs["ONEBIT_MOE_PREFETCH_DEBUG_HANDBACK"] is None
    with pytest.raises(ValueError):
        RowConfig(route=True, layers=-1)
    with pytest.raises(ValueError):
        RowConfig(route=True, layers=2, handback="drop")
    assert playable(RowConfig(route=True, keep="lru"), None)
    for row in (RowConfig(route=True, layers=2), RowConfig(route=True, layers=2, handback="none")):
        assert not playable(row, None)


def test_a_copy_is_the_a_a_control():
    """copy N runs a configuration again as a row of its own: named for it and read back from the name, with
    the same environment and C API settings as the first copy, and compared with the same baselines (the
    first copy of patched off is its own, so ``patched off, copy 2``'s ratio is the A/A spread)."""
    a = RowConfig(copy=2)
    assert a.name == "patched off, copy 2" and from_name(a.name) == a
    assert a.env() == RowConfig().env() and a.knobs() == RowConfig().knobs()
    assert a.predictor_off() == RowConfig() and a.consumer_off() == RowConfig()
    r = RowConfig(route=True, keep="lru", copy=3)
    assert (
        r.name == "route, keep lru, copy 3"
        and from_name(r.name) == r
        and r.env() == RowConfig(route=True, keep="lru").env()
    )
    assert RowConfig.from_fields(r.fields()) == r
    assert chosen_rows(["patched off, copy 2", "route"], 16) == [RowConfig(), RowConfig(copy=2), RowConfig(route=True)]
    with pytest.raises(ValueError, match="copy 1 is not int >= 2"):
        RowConfig(copy=1)
