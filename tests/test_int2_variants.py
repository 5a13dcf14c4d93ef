"""onebit_predict/int2: the variants' recipe and cache, the texts, llama-perplexity's output read strictly,
routing agreement and greedy divergence (int2/variants.py, quality.py, agreement.py, onebit-int2).

The tests marked needs_build make a q2_k variant of models/qwen3moe-h256.gguf with the patched
build's llama-quantize (a tiny imatrix) and run llama-perplexity on it; they are skipped, saying so,
while that model is not in models/ yet.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from onebit_predict.commands.int2 import main as int2_main
from onebit_predict.constants import ENV_COMPENSATOR, ENV_MODE, ENV_OUT
from onebit_predict.corpus import corpus_files, is_validation
from onebit_predict.int2 import agreement as ag
from onebit_predict.int2.quality import (
    Figure,
    PerplexityOutputError,
    Quality,
    parse_base,
    parse_kl,
    ppl_recovers,
    recovers,
)
from onebit_predict.int2.texts import EOD_TEXT, OUTSIDE, TextError, build_text, corpus_text, outside_files
from onebit_predict.int2.variants import (
    VARIANTS,
    Int2Error,
    Store,
    block_size,
    keep_patterns,
    read_manifest,
    recipe_key,
    tool_env,
    write_manifest,
)
from onebit_predict.llama.moe_api import FIELDS

REPO = Path(__file__).resolve().parent.parent
H256 = REPO / "models" / "qwen3moe-h256.gguf"


# a real llama-perplexity --kl-divergence output (qwen3moe-tiny, Q8_0 experts against F16, 31
# windows of 256; the per-window table's rows 2..29 left out), and the base run's end
KL_SAMPLE = """\
0.00.023.911 I kl_divergence: computing over 31 chunks, n_ctx=256, batch_size=2048, n_seq=8
0.00.257.201 I kl_divergence: 0.23 seconds per pass - ETA 0.00 minutes

chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1       8.6289 ±    1.3557      -0.00122 ±    0.00120       0.00007 ±    0.00004     0.329 ±  0.126 %    100.000 ±  0.000 %
  30       8.8168 ±    0.2717       0.00024 ±    0.00055       0.00056 ±    0.00007     0.642 ±  0.053 %    99.108 ±  0.152 %
  31       8.8220 ±    0.2693       0.00023 ±    0.00053       0.00055 ±    0.00007     0.633 ±  0.052 %    99.111 ±  0.150 %

====== Perplexity statistics ======
Mean PPL(Q)                   :   8.821991 ±   0.269262
Mean PPL(base)                :   8.819978 ±   0.269154
Cor(ln(PPL(Q)), ln(PPL(base))):  99.98%
Mean ln(PPL(Q)/PPL(base))     :   0.000228 ±   0.000531
Mean PPL(Q)/PPL(base)         :   1.000228 ±   0.000531
Mean PPL(Q)-PPL(base)         :   0.002013 ±   0.004682

====== KL divergence statistics ======
Mean    KLD:   0.000545 ±   0.000067
Maximum KLD:   0.114057
99.9%   KLD:   0.067671
99.0%   KLD:   0.012417
95.0%   KLD:   0.001005
90.0%   KLD:   0.000168
Median  KLD:   0.000022
10.0%   KLD:  -0.000001
 5.0%   KLD:  -0.000007
 1.0%   KLD:  -0.000021
 0.1%   KLD:  -0.000034
Minimum KLD:  -0.000035

====== Token probability statistics ======
Mean    Δp:  0.006 ± 0.010 %
Maximum Δp: 10.924%
99.9%   Δp:  7.292%
99.0%   Δp:  1.332%
95.0%   Δp:  0.310%
90.0%   Δp:  0.176%
75.0%   Δp:  0.039%
Median  Δp:  0.000%
25.0%   Δp: -0.038%
10.0%   Δp: -0.177%
 5.0%   Δp: -0.325%
 1.0%   Δp: -1.278%
 0.1%   Δp: -5.650%
Minimum Δp: -8.863%
RMS Δp    :  0.633 ± 0.052 %
Same top p: 99.111 ± 0.150 %

"""  # noqa: E501

BASE_SAMPLE = """\
0.00.022.998 I perplexity: calculating perplexity over 31 chunks, n_ctx=256, batch_size=2048, n_seq=8
0.00.223.248 I perplexity: 0.20 seconds per pass - ETA 0.00 minutes
[1]8.6395,[2]6.8198,[3]6.8532,[4]8.7757,[5]8.6375,[6]8.6959,[7]9.5318,[8]8.3076,[9]7.7091,[10]7.6605,[11]7.7650,[12]7.6526,[13]7.4446,[14]7.5645,[15]8.0283,[16]8.1914,[17]7.9086,[18]7.8924,[19]7.9478,[20]7.9777,[21]7.8858,[22]7.9255,[23]7.9373,[24]7.9839,[25]8.1493,[26]8.0949,[27]8.7194,[28]8.7196,[29]8.7827,[30]8.8147,[31]8.8200,
0.00.835.898 I Final estimate: PPL = 8.8200 +/- 0.26915
"""  # noqa: E501


# --- llama-perplexity's output --------------------------------------------------------------------


def test_parse_kl_reads_every_figure_of_a_real_output():
    f = parse_kl(KL_SAMPLE)
    assert f.chunks == 31 and f.scored_tokens == 31 * 127
    assert f.ppl == Figure(8.821991, 0.269262)
    assert f.ppl_base == Figure(8.819978, 0.269154)
    assert f.ln_ppl_ratio == Figure(0.000228, 0.000531)
    assert f.kld_mean == Figure(0.000545, 0.000067)
    assert f.kld_p99 == Figure(0.012417) and f.kld_max == Figure(0.114057) and f.kld_median == Figure(0.000022)
    assert f.top1 == Figure(99.111, 0.150)


def test_parse_base_reads_the_final_estimate():
    assert parse_base(BASE_SAMPLE) == (31, Figure(8.82, 0.26915))


@pytest.mark.parametrize(
    "line",
    ["99.0%   KLD:", "Mean    KLD:", "Same top p:", "Mean PPL(Q)", "Mean PPL(base)", "kl_divergence: computing"],
)
def test_a_missing_figure_raises(line):
    cut = "\n".join(x for x in KL_SAMPLE.splitlines() if not x.startswith(line) and line not in x)
    with pytest.raises(PerplexityOutputError, match="no lines"):
        parse_kl(cut)


def test_a_figure_printed_twice_or_mangled_raises():
    with pytest.raises(PerplexityOutputError, match="2 lines"):
        parse_kl(KL_SAMPLE + KL_SAMPLE)
    with pytest.raises(PerplexityOutputError):
        parse_kl(KL_SAMPLE.replace("99.0%   KLD:   0.012417", "99.0%   KLD:   n/a"))
    with pytest.raises(PerplexityOutputError):  # below 100 scored tokens llama.cpp prints no statistics
        parse_kl(KL_SAMPLE.split("====== Perplexity statistics")[0])
    with pytest.raises(PerplexityOutputError, match="n_ctx=512"):
        parse_kl(KL_SAMPLE.replace("n_ctx=256", "n_ctx=512"))
    with pytest.raises(PerplexityOutputError):
        parse_base(BASE_SAMPLE.replace("Final estimate", "Final"))


def test_a_nan_is_read_as_nan_not_as_a_number():
    f = parse_kl(KL_SAMPLE.replace("Mean    KLD:   0.000545 ±   0.000067", "Mean    KLD:       -nan ±       -nan"))
    assert math.isnan(f.kld_mean.value) and math.isnan(f.kld_mean.pm)


def test_a_run_whose_last_lines_were_lost_is_run_again(monkeypatch):
    from onebit_predict.int2 import quality
    from onebit_predict.int2.variants import ToolRun

    logs = [KL_SAMPLE.split("Same top p:")[0], KL_SAMPLE]  # llama.cpp's logger lost the last line once
    monkeypatch.setattr(quality, "run_tool", lambda cmd, what, out=None, env=None: ToolRun(cmd, logs.pop(0), 1.0))
    run, figures = quality.run_parsed(["llama-perplexity"], "kl", parse_kl)
    assert figures.top1 == Figure(99.111, 0.150) and logs == []
    logs[:] = [KL_SAMPLE.split("Same top p:")[0]] * quality.TRIES
    with pytest.raises(quality.LinesMissing):
        quality.run_parsed(["llama-perplexity"], "kl", parse_kl)
    assert logs == []


def test_recovers():
    assert recovers(0.2, 0.05) == pytest.approx(75.0)
    assert recovers(0.2, 0.3) == pytest.approx(-50.0)
    assert recovers(0.0, 0.0) is None


def test_ppl_recovers_is_the_seed_s_unit():
    # the seed's own figures (README_LEARNED.md of colibri-learned): fp16 6.73, int2 8.12, + compensator 7.94
    assert ppl_recovers(8.12, 7.94, 6.73) == pytest.approx(12.95, abs=0.01)  # not its "85 % recovered"
    assert ppl_recovers(5.2269, 5.2332, 5.2071) == pytest.approx(-31.8, abs=0.1)  # worse: negative
    assert ppl_recovers(4.9, 4.8, 4.9) is None  # no gap to close


# --- the recipe and the cache ------------------------------------------------------------------------


def test_recipe_key_is_the_recipe_canonically():
    a = {"what": "variant", "variant": "q2_k", "ftype": "Q2_K", "tensor_type": ["x=q2_K", ".*=f16"], "imatrix": None}
    b = dict(reversed(list(a.items())))
    assert recipe_key(a) == recipe_key(b) == "d78754331e35"  # the cache's names: a change here orphans it
    for key, value in [("variant", "iq2_s"), ("ftype", "IQ2_S"), ("tensor_type", [".*=f16", "x=q2_K"])]:
        assert recipe_key({**a, key: value}) != recipe_key(a)
    assert len({recipe_key({**a, "imatrix": v}) for v in (None, "0" * 64, "1" * 64)}) == 3


def test_a_cached_output_is_used_only_for_its_recipe_and_bytes(tmp_path):
    path, mpath = tmp_path / "q2_k-x.gguf", tmp_path / "q2_k-x.json"
    path.write_bytes(b"GGUF...")
    recipe = {"what": "variant", "variant": "q2_k"}
    write_manifest(
        mpath, {"version": 1, "recipe": recipe, "bytes": 7, "sha256": hashlib.sha256(b"GGUF...").hexdigest()}
    )
    assert read_manifest(path, mpath, recipe)["bytes"] == 7
    assert read_manifest(path, mpath, {**recipe, "variant": "iq2_s"}) is None
    path.write_bytes(b"GGUF..!")  # same size, other bytes
    assert read_manifest(path, mpath, recipe) is None
    assert read_manifest(tmp_path / "absent.gguf", mpath, recipe) is None


def _tensor(name, type_name, ndim=2):
    return SimpleNamespace(name=name, tensor_type=SimpleNamespace(name=type_name), shape=[256] * ndim)


def test_keep_patterns_hold_the_other_tensors_to_their_type():
    tensors = [
        _tensor("token_embd.weight", "F16"),
        _tensor("blk.0.attn_norm.weight", "F32", 1),
        _tensor("blk.0.ffn_gate_inp.weight", "F32"),
        _tensor("blk.0.attn_q.weight", "F16"),
        _tensor("blk.0.ffn_up_exps.weight", "F16", 3),
        _tensor("output.weight", "F16"),
    ]
    assert keep_patterns(SimpleNamespace(tensors=tensors)) == [r"^blk\.0\.ffn_gate_inp\.weight$=f32", ".*=f16"]
    assert keep_patterns(SimpleNamespace(tensors=tensors[:1])) == [".*=f16"]


def test_variant_table():
    assert list(VARIANTS) == ["f16", "q8_0", "q4_k_m", "q2_k", "iq2_xxs", "iq2_xs", "iq2_s", "tq2_0"]
    assert VARIANTS["q4_k_m"].expert_type == "q4_K" and VARIANTS["q4_k_m"].gguf_type == "Q4_K"
    assert all(VARIANTS[n].imatrix for n in ("q2_k", "iq2_xxs", "iq2_xs", "iq2_s"))


def test_tool_env_scrubs_the_knobs(monkeypatch):
    monkeypatch.setenv("ONEBIT_MOE_PREDICT", "block")
    monkeypatch.setenv(ENV_COMPENSATOR, "/elsewhere.gguf")
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "4096")
    env = tool_env({ENV_COMPENSATOR: "/mine.gguf"})
    assert not [k for k in env if k.startswith(("ONEBIT_", "LLAMA_ARG_")) and k != ENV_COMPENSATOR]
    assert env[ENV_COMPENSATOR] == "/mine.gguf" and env["PATH"] == os.environ["PATH"]


def test_runner_knobs_clear_everything_else(tmp_path):
    env = ag.knobs(tmp_path / "t.bin")
    assert set(env) == {var for _, var in FIELDS}
    assert env[ENV_MODE] == "router" and env[ENV_OUT] == str(tmp_path / "t.bin")
    assert [k for k, v in env.items() if v is not None] == [ENV_MODE, ENV_OUT] or set(
        k for k, v in env.items() if v is not None
    ) == {ENV_MODE, ENV_OUT}
    comp = tmp_path / "c.gguf"
    comp.write_bytes(b"x")
    assert ag.knobs(None, comp)[ENV_COMPENSATOR] == str(comp.resolve())
    with pytest.raises(Int2Error):
        ag.knobs(None, tmp_path / "absent.gguf")


# --- the texts -----------------------------------------------------------------------------------------


def _stdlib(tmp_path):
    """A stand-in stdlib: files on both sides of the split, one with a character cut by the budget."""
    root = tmp_path / "lib"
    names = [f"m{i}.py" for i in (*range(10), 90, 109)]  # m90.py and m109.py are validation files
    for i, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name} é\n" + "x = 1\n" * (i + 1))
    (root / "test").mkdir()
    (root / "test" / "t.py").write_text("left out\n")
    return root


def test_build_text_is_the_split_stream(tmp_path):
    root = _stdlib(tmp_path)
    files = corpus_files(root)
    assert "test/t.py" not in [r for r, _ in files]
    val = [(r, p) for r, p in files if is_validation(r)]
    train = [(r, p) for r, p in files if not is_validation(r)]
    assert val and train
    data, n, used, _ = build_text("train", 10_000, files)
    stream = b"".join(p.read_bytes() + EOD_TEXT for _, p in train)
    assert data == stream and used == [r for r, _ in train]
    assert n == sum(len(p.read_bytes()) + 1 for _, p in train)
    first = train[0][1].read_bytes()
    cut = first.index("é".encode()) + 1  # inside the two bytes of é
    data, n, used, _ = build_text("train", cut, files)
    assert data == first[: cut - 1] and n == cut - 1 and used == [train[0][0]]
    data, n, _, _ = build_text("train", len(first) + 1, files)
    assert data == first + EOD_TEXT and n == len(first) + 1
    data, n, used, _ = build_text("val", 10_000, files)
    assert used == [r for r, _ in val] and data.count(EOD_TEXT) == len(val)
    data, n, used, _ = build_text(OUTSIDE, 10_000, files)  # every file, whatever its split
    assert used == [r for r, _ in files] and data.count(EOD_TEXT) == len(files)
    (root / "zz.py").write_bytes(EOD_TEXT)  # the marker in a file the text does not reach: no matter
    files = corpus_files(root)
    assert build_text("train", 10, files)[1] == 10
    with pytest.raises(TextError, match="zz.py holds"):
        build_text(OUTSIDE, 100_000, files)


def test_the_outside_text_is_llama_cpp_python_s_own_sources(tmp_path):
    import importlib.metadata
    import importlib.util

    version = importlib.metadata.version("llama-cpp-python")  # importing llama_cpp would load its libllama
    text = corpus_text(OUTSIDE, 4096, tmp_path)
    files = outside_files()
    package_dir = Path(importlib.util.find_spec("llama_cpp").origin).parent
    assert files and all(p.is_relative_to(package_dir) for _, p in files)
    assert text.split == OUTSIDE and text.n_tokens == 4096 and text.files[0] == files[0][0]
    assert text.package == f"llama-cpp-python {version}"
    assert text.description.startswith(f"llama-cpp-python {version}'s own Python sources (outside")
    assert text.path.read_bytes().startswith(files[0][1].read_bytes())
    assert text.summary()["package"] == text.package
    from onebit_predict.corpus import stdlib_root

    assert not any(p.resolve().is_relative_to(stdlib_root().resolve()) for _, p in files)  # not the corpus


# --- agreement's arithmetic -----------------------------------------------------------------------------


def test_agreement_per_layer_and_greedy_divergence():
    keys = np.array([[0, p, layer] for p in range(4) for layer in range(2)], dtype=np.int64)
    ref = ag.Routing(keys, np.array([[0, 1]] * 8, dtype=np.int32))
    other = ag.Routing(keys, np.array([[0, 1], [0, 2], [0, 1], [3, 4], [0, 1], [0, 1], [0, 1], [1, 2]]))
    got = ag.agreement(ref, other)
    assert [(x.layer, x.tokens, x.set_equal, x.overlap) for x in got] == [(0, 4, 1.0, 1.0), (1, 4, 0.25, 0.5)]
    with pytest.raises(Int2Error):
        ag.agreement(ref, ag.Routing(keys[::-1].copy(), ref.experts))
    assert ag.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert ag.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert ag.mean_divergence([None, 0, 10], 64) == pytest.approx(74 / 3)
    assert [o for o, _ in ag.prompts(list(range(100)), 4, 16)] == [0, 28, 56, 84]
    assert ag.windows(list(range(600))) == [list(range(256)), list(range(256, 512))]


# --- the command's usage errors --------------------------------------------------------------------------


def test_cli_usage_errors(run_cli, tmp_path):
    rc, _, err = run_cli(int2_main, "variants", tmp_path / "absent.gguf")
    assert rc == 2 and "no such file" in err
    rc, _, err = run_cli(int2_main, "quality", tmp_path / "absent.gguf", "--types", "q3_k")
    assert rc == 2 and "q3_k" in err
    model = tmp_path / "m.gguf"
    model.write_bytes(b"not a gguf")
    rc, _, err = run_cli(int2_main, "quality", model, "--compensator", "q2_k")
    assert rc == 2 and "VARIANT=FILE" in err
    rc, _, err = run_cli(int2_main, "agreement", model, "--compensator", f"q2_k={tmp_path / 'absent'}")
    assert rc == 2 and "no such file" in err
    rc, _, err = run_cli(int2_main, "quality", model, "--text", "train")  # never the training text
    assert rc == 2 and "invalid choice: 'train'" in err


@pytest.mark.parametrize("text", ["val", "outside"])
def test_agreement_scores_the_text_asked_for(run_cli, tmp_path, monkeypatch, text):
    """--text reaches agreement's routing and greedy runs, and its report names that text."""
    import onebit_predict.commands.int2 as C

    seen = []

    def compare(store, tokens, pairs, *args):
        seen.append(list(tokens))
        return [], []

    monkeypatch.setattr(C, "compare", compare)
    argv = ["agreement", H256, "--types", "f16", "--text", text, "--heldout-tokens", "1024", "--json"]
    rc, out, err = run_cli(int2_main, *argv, "--cache-dir", tmp_path / "cache")
    assert rc == 0, err
    want = corpus_text(text, 1024, tmp_path / "cache" / "int2-root")
    assert json.loads(out)["text"]["split"] == text and seen == [want.tokens()]


# --- expert rows that the type's blocks do not divide: refused before any work --------------------------------

TINY = REPO / "models" / "qwen3moe-tiny.gguf"  # 64-wide expert rows: q8_0's blocks of 32 divide them, QK_K's not


@pytest.fixture
def no_tools(monkeypatch):
    """Any llama.cpp tool run, or the imatrix's text made, fails the test: nothing may start."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started: a tool or the training text was asked for")

    import onebit_predict.int2.variants as V

    monkeypatch.setattr(V, "tool_binary", refuse)
    monkeypatch.setattr(V, "corpus_text", refuse)


@pytest.mark.parametrize("types", ["q2_k", "q8_0,iq2_xxs", "tq2_0", "q4_k_m"])
def test_variants_refuses_rows_that_are_not_whole_blocks_first(run_cli, tmp_path, no_tools, types):
    rc, out, err = run_cli(int2_main, "variants", TINY, "--types", types, "--cache-dir", tmp_path / "cache")
    assert rc == 2, err
    bad = types.split(",")[-1]
    found = re.search(
        r": (blk\.0\.ffn_(gate|up|down)_exps\.weight) has rows of 64 values, not a multiple of 256: ", err
    )
    assert found and err.startswith(f"onebit-int2: ERROR: {TINY}: {found.group(1)}"), err
    assert f"not a multiple of 256: variant {bad} ({VARIANTS[bad].gguf_type}) " in err, err
    assert "stores whole blocks of 256 per row (QK_K); these rows take f16, q8_0" in err
    assert out == "" and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("cmd", ["quality", "agreement"])
def test_quality_and_agreement_refuse_them_too(run_cli, tmp_path, no_tools, cmd):
    rc, _, err = run_cli(int2_main, cmd, TINY, "--types", "q8_0", "--compensator", f"iq2_s={TINY}")
    assert rc == 2 and "variant iq2_s (IQ2_S) stores whole blocks of 256" in err, err


def test_check_rows_takes_the_types_whose_blocks_divide_the_rows(tmp_path):
    store = Store(TINY, tmp_path / "cache")
    store.check_rows(["f16", "q8_0"])
    with pytest.raises(Int2Error, match="rows of 64 values, not a multiple of 256"):
        store.variant("q2_k")
    Store(H256, tmp_path / "cache").check_rows(list(VARIANTS))  # 256-wide rows take every type
    assert {n: block_size(v) for n, v in VARIANTS.items()} == {
        "f16": 1, "q8_0": 32, "q4_k_m": 256, "q2_k": 256, "iq2_xxs": 256, "iq2_xs": 256, "iq2_s": 256, "tq2_0": 256,
    }  # fmt: skip


# --- with the patched build: a real q2_k variant of the 2-bit study's model --------------------------------


@pytest.fixture(scope="module")
def h256_store(tmp_path_factory):
    return Store(H256, tmp_path_factory.mktemp("int2"), threads=1, train_tokens=2048)


@pytest.mark.needs_build
def test_q2_k_variant_changes_only_the_experts(h256_store):
    import gguf

    made = h256_store.variant("q2_k")
    src, out = gguf.GGUFReader(H256), gguf.GGUFReader(made.path)
    a, b = {t.name: t for t in src.tensors}, {t.name: t for t in out.tensors}
    assert set(a) == set(b)
    experts = [n for n in a if n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))]
    assert len(experts) == 3 * 4
    for name, x in a.items():
        y = b[name]
        if name in experts:
            assert y.tensor_type.name == "Q2_K", name
        else:
            assert y.tensor_type == x.tensor_type, name
            assert np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)), name
    m = made.manifest
    assert m["imatrix"] and "--imatrix" in m["command"] and m["expert_types"]["ffn_down_exps"] == ["Q2_K"] * 4
    assert m["expert_bytes_per_token"] == 2 * 4 * 3 * (256 * 256 // 256 * 84)  # k=2, 4 layers, 3 matrices
    assert h256_store.variant("q2_k").cached  # the same recipe: found again


@pytest.mark.needs_build
def test_quality_f16_is_exact_and_q2_k_is_not(h256_store):
    q = Quality(h256_store, heldout_tokens=1024)  # 4 windows, 508 scored tokens
    rows = {r.variant: r for r in q.rows(["q2_k"], [])}
    f16, q2 = rows["f16"].figures, rows["q2_k"].figures
    assert f16.kld_mean.value < 1e-4 and f16.top1.value == 100.0 and f16.scored_tokens == 4 * 127
    assert q2.kld_mean.value > 1e-3 and q2.top1.value < 100.0
    assert q.rows(["q2_k"], [])[1].cached
    assert json.loads(json.dumps(rows["q2_k"].to_dict()))["expert_type"] == "Q2_K"


@pytest.mark.needs_build
def test_text_tokenizes_to_its_ids_and_routing_agrees_with_itself(h256_store):
    from onebit_predict.llama.runner import Model

    text = corpus_text("val", 512, h256_store.root)
    with Model(H256) as m:
        assert m.tokenize(text.path.read_text()) == text.tokens()
    found, plist = ag.compare(h256_store, text.tokens(), [("f16", None), ("q2_k", None)], 2, 16, 8)
    f16, q2 = found
    assert all(x.set_equal == 1.0 for x in f16.layers) and f16.firsts == [None, None]
    assert [x.layer for x in q2.layers] == [0, 1, 2, 3] and all(0 <= x.set_equal <= 1 for x in q2.layers)
