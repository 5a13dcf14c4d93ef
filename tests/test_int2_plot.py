"""onebit-int2 plot: a quality --json report drawn as mean KLD over expert bytes per token (int2/plot.py):
the PNG, the table of every row (--json, --csv), a compensated row drawn with an arrow from its plain
row, F16's ~0 KLD at the axis floor and said so, and exit 2 on a missing file, bad JSON, a report
that is not a quality one, or no matplotlib.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
from pathlib import Path

import pytest

from onebit_predict.commands.int2 import main as int2_main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE
from onebit_predict.int2 import plot as int2_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMP = "/cache/comp-q2_k.gguf"


def row(variant: str, etype: str, ebt: int, kld: float, pm: float | None, comp: str | None = None) -> dict:
    """A row as int2/quality.py's Row.to_dict writes it (the figures that matter here, the rest kept)."""
    r = {
        "variant": variant,
        "compensator": comp,
        "compensator_sha256": None if comp is None else "c" * 64,
        "model": f"/cache/{variant}.gguf",
        "model_sha256": "b" * 64,
        "expert_type": etype,
        "expert_bytes_per_token": ebt,
        "chunks": 256,
        "scored_tokens": 32512,
        "kld_mean": kld,
        "kld_p99": max(kld, 0.0) * 5,
        "kld_max": 0.8,
        "kld_median": max(kld, 0.0) / 3,
        "top1_pct": 99.0,
        "top1_pct_pm": 0.03,
        "ppl": 4.92,
        "ppl_pm": 0.05,
        "ppl_base": 4.909171,
        "ppl_base_pm": 0.052498,
        "ln_ppl_ratio": 0.002,
        "ln_ppl_ratio_pm": float("nan"),
        "recovers_pct": None,
        "command": "llama-perplexity ...",
        "seconds": 50.0,
        "cached": True,
    }
    if pm is not None:
        r["kld_mean_pm"] = pm
    return r


REPORT = {  # modelled on what onebit-int2 quality models/qwen3moe-h256.gguf --json wrote
    "model": "/work/main/models/qwen3moe-h256.gguf",
    "model_sha256": "a" * 64,
    "text": {
        "split": "val",
        "n_tokens": 65536,
        "description": "CPython 3.11.7 stdlib held-out (validation) split, first 65536 tokens",
    },
    "ctx": 256,
    "scored_per_window": 127,
    "base": {"path": "/cache/kl-base.bin", "command": "llama-perplexity ...", "ppl": {"pm": 0.0525, "value": 4.9092}},
    "rows": [
        row("f16", "F16", 3145728, -0.0, 0.0),
        row("q8_0", "Q8_0", 1671168, 0.000219, 4.1e-05),
        row("q2_k", "Q2_K", 516096, 0.012963, 0.000206),
        row("iq2_xxs", "IQ2_XXS", 405504, 0.018757, 0.000233),
        row("q2_k", "Q2_K", 516096, 0.007, 0.00015, COMP) | {"recovers_pct": 46.0},
        row("iq2_xxs", "IQ2_XXS", 405504, 0.011, None, "/cache/comp-iq2_xxs.gguf") | {"recovers_pct": 41.4},
    ],
}


def write(tmp_path: Path, report: dict, name: str = "quality.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(report, indent=2))
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = int2_main(["plot", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def panel(ax) -> dict:
    """A panel's markers (marker, x, y), arrows ((x, y) from, to) and labels."""
    return {
        "markers": [
            (line.get_marker(), float(line.get_xdata()[0]), float(line.get_ydata()[0]))
            for line in ax.get_lines()
            if line.get_marker() in ("o", "D", "v")
        ],
        "arrows": [(t.xyann, t.xy) for t in ax.texts if not t.get_text() and t.arrow_patch is not None],
        "labels": [t.get_text() for t in ax.texts if t.get_text()],
        "ylim": ax.get_ylim(),
    }


@pytest.fixture
def drawn(monkeypatch) -> dict:
    """What plot_quality drew, read off the figure before it is saved: per panel (the first of every
    row, then the 2-bit types' where there is one) the markers, arrows and labels; the footnote."""
    seen: dict = {}
    save = int2_plot._save

    def record(fig, path):
        seen["panels"] = [panel(ax) for ax in fig.axes]
        seen["footnote"] = " ".join(t.get_text() for t in fig.texts)
        save(fig, path)

    monkeypatch.setattr(int2_plot, "_save", record)
    return seen


def test_png_and_table(capsys, tmp_path, drawn):
    pytest.importorskip("matplotlib")
    png = tmp_path / "kl-bytes.png"
    rc, out, err = run(capsys, write(tmp_path, REPORT), "--out", png)
    assert rc == EXIT_OK, err
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in tmp_path.iterdir() if ".partial" in p.name] == []  # written whole, atomically
    assert f"wrote {png}" in err
    assert "model: /work/main/models/qwen3moe-h256.gguf" in out and "first 65536 tokens" in out
    lines = out.splitlines()
    for name in ("f16", "q8_0", "q2_k", "iq2_xxs", "q2_k+comp-q2_k", "iq2_xxs+comp-iq2_xxs"):
        assert any(line.split()[:1] == [name] for line in lines), name
    comp_line = next(line for line in lines if line.split()[0] == "q2_k+comp-q2_k")
    assert comp_line.split()[1:5] == ["yes", "Q2_K", "516096", "0.00700"]
    f16_line = next(line for line in lines if line.split()[0] == "f16")
    assert f16_line.split()[1] == "no" and f16_line.endswith("at floor")
    # F16's KLD is not > 0: at the axis floor, and stderr and the footnote say so
    assert "f16: mean KLD -0.00000 is not > 0" in err and "marked at the axis floor" in err
    every, two = drawn["panels"]
    assert ("v", 3145728 / 1024, every["ylim"][0]) in every["markers"]
    assert "f16 (-0.00000)" in drawn["footnote"]
    # every row on the first panel; the 2-bit ones again, closer, on the second, labelled there
    assert len(every["markers"]) == 6 and len(two["markers"]) == 4
    assert {"f16", "q8_0", "the 2-bit types: right"} <= set(every["labels"])
    assert {"q2_k", "iq2_xxs", "q2_k+comp -46 %", "iq2_xxs+comp -41 %"} == set(two["labels"])


def test_one_panel_without_2bit_rows(capsys, tmp_path, drawn):
    pytest.importorskip("matplotlib")
    report = {**REPORT, "rows": REPORT["rows"][:2]}
    rc, _, err = run(capsys, write(tmp_path, report), "--out", tmp_path / "x.png")
    assert rc == EXIT_OK, err
    (only,) = drawn["panels"]
    assert set(only["labels"]) == {"f16", "q8_0"}


def test_compensated_row_drawn_with_its_plain_row(capsys, tmp_path, drawn):
    pytest.importorskip("matplotlib")
    rc, _, err = run(capsys, write(tmp_path, REPORT), "--out", tmp_path / "x.png")
    assert rc == EXIT_OK, err
    x, x2 = 516096 / 1024, 405504 / 1024
    for p in drawn["panels"]:
        assert ("o", x, 0.012963) in p["markers"]  # the plain q2_k row
        assert ("D", x, 0.007) in p["markers"]  # with its compensator: another marker
        assert ((x, 0.012963), (x, 0.007)) in p["arrows"]  # an arrow from the plain row to it
        assert ((x2, 0.018757), (x2, 0.011)) in p["arrows"]
        assert len(p["arrows"]) == 2
    assert "compensator's own bytes are not in the report" in drawn["footnote"]


def test_several_compensators_of_a_variant_are_named(capsys, tmp_path, drawn):
    pytest.importorskip("matplotlib")
    report = copy.deepcopy(REPORT)
    report["rows"].append(row("q2_k", "Q2_K", 516096, 0.009, 0.0002, "/cache/other.gguf"))
    rc, _, err = run(capsys, write(tmp_path, report), "--out", tmp_path / "x.png")
    assert rc == EXIT_OK, err
    two = drawn["panels"][1]
    assert {"q2_k+comp-q2_k -46 %", "q2_k+other", "iq2_xxs+comp -41 %"} <= set(two["labels"])
    assert len(two["arrows"]) == 3


def test_json_and_csv(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = write(tmp_path, REPORT)
    rc, out, _ = run(capsys, path, "--out", tmp_path / "a.png", "--json")
    assert rc == EXIT_OK
    data = json.loads(out)
    assert data["model"] == REPORT["model"] and data["text"].startswith("CPython")
    assert data["png"] == str(tmp_path / "a.png") and data["report"] == str(path)
    assert [r["row"] for r in data["rows"]] == [
        "f16",
        "q8_0",
        "q2_k",
        "iq2_xxs",
        "q2_k+comp-q2_k",
        "iq2_xxs+comp-iq2_xxs",
    ]
    assert [r["compensated"] for r in data["rows"]] == [False] * 4 + [True] * 2
    assert data["rows"][0]["on_plot"] == "at floor" and "log axis" in data["rows"][0]["why"]
    assert data["rows"][5]["kld_mean_pm"] is None and data["rows"][4]["compensator"] == COMP
    rc, out, _ = run(capsys, path, "--out", tmp_path / "b.png", "--csv")
    assert rc == EXIT_OK
    table = list(csv.DictReader(io.StringIO(out)))
    assert len(table) == 6 and table[2]["expert_bytes_per_token"] == "516096"


def test_a_row_not_drawn_is_named(capsys, tmp_path, drawn):
    pytest.importorskip("matplotlib")
    report = copy.deepcopy(REPORT)
    report["rows"].append(row("tq2_0", "TQ2_0", 405504, float("nan"), None))
    report["rows"][2]["kld_mean_pm"] = float("nan")  # a ± llama-perplexity could not compute: shown as none
    rc, out, err = run(capsys, write(tmp_path, report), "--out", tmp_path / "x.png")
    assert rc == EXIT_OK
    assert "tq2_0: mean KLD is nan" in err and "not drawn" in err
    assert any(line.split()[:1] == ["tq2_0"] and line.endswith("no") for line in out.splitlines())
    assert next(line.split() for line in out.splitlines() if line.split()[0] == "q2_k")[4:] == ["0.01296", "yes"]
    assert "Not drawn" in drawn["footnote"] and "tq2_0 (nan)" in drawn["footnote"]
    assert all(math.isfinite(y) for p in drawn["panels"] for _, _, y in p["markers"])


def test_missing_file_exits_2(capsys, tmp_path):
    rc, out, err = run(capsys, tmp_path / "missing.json", "--out", tmp_path / "x.png")
    assert rc == EXIT_USAGE and out == ""
    assert "missing.json: no such file" in err and "Traceback" not in err


def test_missing_file_is_said_before_matplotlib(capsys, tmp_path, no_matplotlib):
    rc, _, err = run(capsys, tmp_path / "missing.json", "--out", tmp_path / "x.png")
    assert rc == EXIT_USAGE and "no such file" in err and "matplotlib" not in err


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("{not json", "not JSON"),
        ("\xff\xfe", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"model": "m.gguf", "rows": []}), "no 'model' and 'text'"),
        (json.dumps({**REPORT, "rows": []}), "no rows"),
        (json.dumps({**REPORT, "rows": [{"variant": "f16", "compensator": None}]}), "expert_bytes_per_token"),
        (json.dumps({**REPORT, "rows": [{**REPORT["rows"][1], "kld_mean": "0.1"}]}), "kld_mean is not a number"),
        (json.dumps({**REPORT, "rows": [{**REPORT["rows"][1], "kld_mean_pm": [1]}]}), "kld_mean_pm is not a number"),
    ],
)
def test_not_a_quality_report_exits_2(capsys, tmp_path, text, said, no_matplotlib):
    path = tmp_path / "bad.json"
    path.write_bytes(text.encode("latin-1"))
    rc, out, err = run(capsys, path, "--out", tmp_path / "x.png")
    assert rc == EXIT_USAGE and out == "" and "Traceback" not in err
    assert said in err and str(path) in err
    assert "matplotlib" not in err  # the input is judged before the machine
    assert not (tmp_path / "x.png").exists()


def test_an_agreement_report_is_not_a_quality_report(capsys, tmp_path):
    agreement = {k: REPORT[k] for k in ("model", "model_sha256", "text")}
    agreement["rows"] = [{"variant": "f16", "compensator": None, "layers": [], "set_equal_mean": 1.0}]
    rc, out, err = run(capsys, write(tmp_path, agreement), "--out", tmp_path / "x.png")
    assert rc == EXIT_USAGE and out == ""
    assert "not an 'onebit-int2 quality --json' report" in err


def test_no_matplotlib_exits_2(capsys, tmp_path, no_matplotlib):
    png = tmp_path / "x.png"
    rc, out, err = run(capsys, write(tmp_path, REPORT), "--out", png)
    assert rc == EXIT_USAGE and out == ""
    assert "onebit-int2 plot needs matplotlib" in err and "onebit-predict[plot]" in err
    assert not png.exists()


def test_out_in_a_missing_directory_exits_2(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    rc, out, err = run(capsys, write(tmp_path, REPORT), "--out", tmp_path / "no" / "x.png")
    assert rc == EXIT_USAGE and out == "" and "Traceback" not in err


def test_out_is_required(capsys, tmp_path):
    rc, _, err = run(capsys, write(tmp_path, REPORT))
    assert rc == EXIT_USAGE and "--out" in err
