#!/usr/bin/env python3
"""Train a tiny Mixture-of-Experts model on CPU and export it to GGUF.

Hit rates measured on random weights say nothing, so the figures this project publishes
come from small models whose routers learned to route. This script:

1. builds a small MoE model with the model code that ships in ``transformers``
   (``--arch qwen3moe``, ``olmoe``, ``qwen4exp``);
2. trains it on the CPython standard library sources (a real text corpus present on any
   machine with Python), byte-level: token id = byte value (0..255), id 256 = end of
   file (``EOD``); vocab 257;
3. rounds every weight to float16 (so the f16 GGUF holds exactly the weights the
   transformers model computes with) and saves the transformers checkpoint;
4. converts it with the pinned llama.cpp tree's ``convert_hf_to_gguf.py`` (its own
   ``gguf-py``), writing tokenizer model ``none`` plus ``{arch}.vocab_size``, then gives
   the GGUF the RWKV byte vocabulary of ``onebit_predict.grow.vocab`` (token ``i`` is
   byte ``i``, 256 the end-of-file control token, no BOS): llama.cpp's tokenizer maps text
   to exactly its bytes, the ids the model was trained on;
5. ``--check``: runs the GGUF through the patched llama.cpp and the checkpoint through
   transformers on the same held-out tokens and reports the logits' NMSE.

Dependencies: the ``train`` extra (``pip install -e .[train]``: torch 2.13.0 CPU,
transformers 5.24.0) and a patched llama.cpp build (``./build.sh``). The recipes of the
committed models (models/README.md has their curves, checks and sha256):

    python tools/train_tiny.py --arch qwen3moe --out models/qwen3moe-tiny.gguf --seed 1 --steps 500
    python tools/train_tiny.py --arch qwen4exp --out models/qwen4exp-tiny.gguf --seed 1 --steps 200 \
        --batch 8 --eval-every 25
    python tools/train_tiny.py --arch olmoe --out models/olmoe-tiny.gguf --seed 1 --steps 600
    python tools/train_tiny.py --arch qwen3moe256 --out models/qwen3moe-h256.gguf --seed 1 --steps 800
    python tools/train_tiny.py --check models/qwen3moe-tiny.gguf    # NMSE vs models/qwen3moe-tiny-hf/

Training writes ``NAME.gguf``, the float16 transformers checkpoint ``NAME-hf/``, the record
``NAME.json`` (command, curve, expert usage, check) and, once, ``heldout.txt`` (the held-out
snippet the check and tests/test_trained_models.py feed).

Everything is deterministic for a given seed, corpus (the CPython version's stdlib) and
thread count: the corpus files are read in sorted order, the validation split is a hash of
each file's relative path, the training windows come from a seeded generator and torch runs
single-threaded by default.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

# the corpus and its split live in the package (onebit_predict/corpus.py), shared with the 2-bit study
from onebit_predict.corpus import EOD, VOCAB, corpus_files, is_validation  # noqa: E402,F401 (after the path)
from onebit_predict.grow.verify import HELDOUT_SEQ_LEN  # noqa: E402 (after the path)

# --- corpus ------------------------------------------------------------------------------


def load_corpus() -> dict:
    """The train and validation token streams (lists of files joined by EOD) and a fingerprint."""
    import torch

    files = corpus_files()
    if not files:
        raise SystemExit("train_tiny: no stdlib sources found (sysconfig stdlib path)")
    fingerprint = hashlib.sha256()
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    names: dict[str, list[str]] = {"train": [], "val": []}
    for rel, path in files:
        data = path.read_bytes()
        fingerprint.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        split = "val" if is_validation(rel) else "train"
        parts[split].append(data)
        names[split].append(rel)

    def stream(chunks: list[bytes]) -> torch.Tensor:
        import numpy as np

        arrays = []
        for c in chunks:
            arrays.append(np.frombuffer(c, dtype=np.uint8).astype(np.int16))
            arrays.append(np.array([EOD], dtype=np.int16))
        return torch.from_numpy(np.concatenate(arrays))

    return {
        "train": stream(parts["train"]),
        "val": stream(parts["val"]),
        "val_files": names["val"],
        "n_files": {"train": len(names["train"]), "val": len(names["val"])},
        "fingerprint": fingerprint.hexdigest(),
        "python": sys.version.split()[0],
    }


def val_windows(val, ctx: int, n: int):
    """n fixed, evenly spaced windows of ctx+1 tokens from the validation stream."""
    import torch

    step = (len(val) - ctx - 1) // n
    return torch.stack([val[i * step : i * step + ctx + 1] for i in range(n)]).long()


# --- model configurations ----------------------------------------------------------------


def _common(ctx: int) -> dict:
    """The config fields every tiny model shares: the byte vocabulary, the context, the router loss."""
    return dict(
        vocab_size=VOCAB,
        max_position_embeddings=ctx,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=EOD,
        bos_token_id=None,
        pad_token_id=None,
        initializer_range=0.02,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )


def config_qwen3moe(ctx: int):
    """8 layers, all MoE; 16 experts, 4 used per token."""
    import transformers as tf

    return tf.Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        moe_intermediate_size=64,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **_common(ctx),
    )


def config_qwen3moe256(ctx: int):
    """The 2-bit study's model (docs/int2.md): 4 layers, all MoE; 8 experts, 2 used per token.

    Hidden 256 and expert FFN 256 because llama.cpp's 2-bit types (Q2_K, IQ2_*) quantize rows
    in blocks of 256: every expert matrix's rows (256 wide both ways) are one block. Kept as
    small as that allows: 4 layers, 4 heads of 64 (2 key/value heads), dense FFN unused.
    """
    import transformers as tf

    return tf.Qwen3MoeConfig(
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **_common(ctx),
    )


def config_olmoe(ctx: int):
    """OLMoE-1B-7B's shape, scaled down: 64 experts, 8 used per token, every layer MoE.

    12 layers (OLMoE-1B-7B has 16), hidden 64, expert FFN 32 (half the hidden size, as 1024
    is of 2048 there); full multi-head attention (4 heads of 16, q/k norm over the whole
    projection), no renormalisation of the top-8 gate weights (``norm_topk_prob=False``, as
    OLMoE). In OLMoE ``intermediate_size`` is the expert FFN width (there is no dense MLP).
    """
    import transformers as tf

    return tf.OlmoeConfig(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        **_common(ctx),
    )


def config_qwen4exp(ctx: int):
    """8 layers: Gated DeltaNet on 3 of 4, QSA-indexed full attention on layers 3 and 7;
    4 hyper-connection streams; PLE (hashed 2- and 3-gram embeddings) on layer 2 (1-based), a
    DeltaNet layer; a shared expert next to the 16 routed ones."""
    import transformers as tf

    return tf.Qwen4ExpTextConfig(
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(8)],
        hc_count=4,
        hc_lowrank=32,
        ple_layer_ids=[2],
        ple_embed_dim=64,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1009,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=1,
        seed=1234,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=256,
        indexer_compress_ratio=4,
        # llama.cpp's qwen4exp graph always gates the DeltaNet output with a sigmoid (build_norm_gated)
        output_gate_type="sigmoid",
        **_common(ctx),
    )


CONFIGS = {
    "qwen3moe": config_qwen3moe,
    "qwen3moe256": config_qwen3moe256,
    "olmoe": config_olmoe,
    "qwen4exp": config_qwen4exp,
}


def build_config(arch: str, ctx: int):
    """The transformers config of the tiny model for ``arch``."""
    if arch not in CONFIGS:
        raise SystemExit(f"train_tiny: unknown --arch {arch}")
    return CONFIGS[arch](ctx)


def dense_qsa_fast_path(model) -> int:
    """Skip the QSA indexer's per-query Python loop where it cannot drop a token.

    transformers' Qwen4-Exp indexer selects, per query, the ``budget/ratio`` best complete
    blocks of ``ratio`` visible tokens plus the incomplete tail, in a Python loop over every
    query of every sequence. When a query sees at most ``budget`` tokens that selection is every
    visible token, so the mask it returns is the causal mask itself; this returns exactly that
    without the loop (and falls back to the original otherwise). The selection is a boolean
    mask, so the indexer's own weights get no gradient either way. Training only: ``--check``
    runs the unmodified transformers code.
    """
    import torch

    patched = 0
    for mod in model.modules():
        if type(mod).__name__ != "Qwen4ExpTextQSAIndexer":
            continue
        orig = mod.forward

        def forward(hidden_states, position_embeddings, attention_mask, cache=None, _orig=orig, _mod=mod):
            if cache is None and attention_mask is not None and attention_mask.shape[-1] <= _mod.token_budget:
                return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            return _orig(hidden_states, position_embeddings, attention_mask, cache)

        mod.forward = forward
        patched += 1
    return patched


ARCH_CLASS = {
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen3moe256": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen4exp": "Qwen4ExpForCausalLM",
}


def build_model(arch: str, ctx: int):
    import transformers as tf

    config = build_config(arch, ctx)
    config._attn_implementation = "eager"
    return getattr(tf, ARCH_CLASS[arch])(config)


# --- training ----------------------------------------------------------------------------


def setup_torch(threads: int, seed: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def evaluate(model, windows, batch: int = 16) -> float:
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            w = windows[i : i + batch]
            out = model(input_ids=w[:, :-1], output_router_logits=False, use_cache=False)
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += w[:, 1:].numel()
    model.train()
    return total / count


def expert_usage(model, windows, top_k: int) -> list[list[int]]:
    """Per MoE layer, how many validation tokens each expert was selected for."""
    import torch

    counts = None
    model.eval()
    with torch.no_grad():
        for i in range(0, len(windows), 16):
            out = model(input_ids=windows[i : i + 16, :-1], output_router_logits=True, use_cache=False)
            rl = [r for r in out.router_logits if r is not None]
            if counts is None:
                counts = [torch.zeros(r.shape[-1], dtype=torch.long) for r in rl]
            for c, r in zip(counts, rl):
                idx = torch.topk(r.reshape(-1, r.shape[-1]).float(), top_k, dim=-1).indices
                c += torch.bincount(idx.reshape(-1), minlength=c.numel())
    model.train()
    return [c.tolist() for c in counts]


def balance_loss(router_logits, top_k: int):
    """Switch-Transformer load-balancing loss, per MoE layer, averaged over the layers.

    transformers' own ``load_balancing_loss_func`` pools the tokens of all layers, which
    lets single layers collapse onto a few experts; this one balances every layer. 1.0 is
    perfectly balanced.
    """
    import torch

    losses = []
    for r in router_logits:
        if r is None:
            continue
        r = r.reshape(-1, r.shape[-1]).float()
        probs = torch.softmax(r, dim=-1)
        n_exp = r.shape[-1]
        sel = torch.topk(r, top_k, dim=-1).indices
        frac = torch.zeros(n_exp).index_add_(0, sel.reshape(-1), torch.ones(sel.numel())) / sel.numel()
        losses.append(n_exp * torch.sum(frac * probs.mean(0)))
    return torch.stack(losses).mean()


def train(args) -> dict:
    import torch

    setup_torch(args.threads, args.seed)
    corpus = load_corpus()
    print(
        f"corpus: CPython {corpus['python']} stdlib, {corpus['n_files']['train']} train files "
        f"({len(corpus['train'])} tokens), {corpus['n_files']['val']} validation files "
        f"({len(corpus['val'])} tokens), fingerprint {corpus['fingerprint'][:16]}",
        flush=True,
    )
    model = build_model(args.arch, args.ctx)
    if hasattr(model, "set_experts_implementation"):
        try:  # same result as the default per-expert loop, faster on CPU
            model.set_experts_implementation("grouped_mm")
        except Exception as exc:  # noqa: BLE001 - keep the default
            print(f"grouped_mm experts unavailable ({exc}); using the default", flush=True)
    if dense_qsa_fast_path(model):
        assert args.ctx <= model.config.indexer_budget, "the QSA fast path needs --ctx <= indexer_budget"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.arch}, {n_params} parameters", flush=True)
    vwin = val_windows(corpus["val"], args.ctx, args.val_windows)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(args.seed)
    train_stream = corpus["train"]
    curve = []
    v0 = evaluate(model, vwin)
    print(f"step 0: val {v0:.4f}", flush=True)
    curve.append({"step": 0, "train": None, "val": v0})
    t0 = time.time()
    run_loss, run_n = 0.0, 0
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(train_stream) - args.ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([train_stream[s : s + args.ctx + 1] for s in starts.tolist()]).long()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
        lm = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1))
        aux = balance_loss(out.router_logits, model.config.num_experts_per_tok)
        loss = lm + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run_loss += lm.item()
        run_n += 1
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            v = evaluate(model, vwin)
            tr = run_loss / run_n
            run_loss, run_n = 0.0, 0
            curve.append({"step": step + 1, "train": tr, "val": v})
            print(
                f"step {step + 1}: train {tr:.4f} val {v:.4f} aux {aux.item():.3f} "
                f"lr {lr_at(step):.2e} ({time.time() - t0:.0f} s)",
                flush=True,
            )
    train_seconds = time.time() - t0

    # round every weight to float16: the f16 GGUF then holds exactly these weights
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    v_f16 = evaluate(model, vwin)
    usage = expert_usage(model, vwin, model.config.num_experts_per_tok)
    print(f"after rounding to f16: val {v_f16:.4f}", flush=True)
    for li, c in enumerate(usage):
        print(f"layer {li}: expert usage min {min(c)} max {max(c)} (uniform {sum(c) / len(c):.0f}) {c}")
    return {
        "model": model,
        "curve": curve,
        "val_f16": v_f16,
        "usage": usage,
        "n_params": n_params,
        "train_seconds": round(train_seconds),
        "corpus": {k: corpus[k] for k in ("n_files", "fingerprint", "python")},
    }


# --- export ------------------------------------------------------------------------------

_CONVERT = r"""
import sys
tree, hf_dir, out, outtype, name = sys.argv[1:6]
sys.path[:0] = [tree + "/gguf-py", tree]
import gguf
assert gguf.__file__.startswith(tree), f"gguf from {gguf.__file__}, not the pinned tree"
import convert_hf_to_gguf as conv

def byte_vocab(self):
    # token id = byte value, id 256 = end of file (models/README.md); convert() then replaces
    # "none" by the RWKV byte vocabulary (onebit_predict.grow.vocab)
    self.gguf_writer.add_tokenizer_model("none")
    key = gguf.Keys.LLM.VOCAB_SIZE.format(arch=self.gguf_writer.arch)
    if not any(key in kv for kv in self.gguf_writer.kv_data):
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])
    self.gguf_writer.add_eos_token_id(self.hparams["eos_token_id"])

import json
from conversion import get_model_class
arch = json.load(open(hf_dir + "/config.json"))["architectures"][0]
cls = get_model_class(arch)
cls.set_vocab = byte_vocab

# transformers >= 5 renames Qwen4-Exp's "full_attention" layers to "indexed_attention" when it
# loads the config (the converter reads hparams through AutoConfig), and the converter then
# writes compress_ratio 0 for every layer: llama.cpp would silently run dense attention where
# transformers runs QSA. Give the converter the names the released checkpoints use.
_orig_sgp = cls.set_gguf_parameters
def set_gguf_parameters(self):
    lt = self.hparams.get("layer_types")
    if lt:
        self.hparams["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in lt]
    _orig_sgp(self)
cls.set_gguf_parameters = set_gguf_parameters
sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype, "--model-name", name]
conv.main()
"""


def convert(hf_dir: Path, out: Path, outtype: str, name: str) -> None:
    """Convert with the pinned tree's converter (tokenizer model "none"), then add the byte vocabulary.

    The second step is ``python -m onebit_predict.grow.vocab``: it changes only the
    tokenizer keys (the converter's file is ``vocab.strip_vocab`` of the result, byte for byte).
    """
    from onebit_predict.grow.vocab import add_byte_vocab
    from onebit_predict.llama.paths import build_info

    tree = build_info().tree
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    plain = out.with_name(out.name + ".novocab.tmp")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CONVERT, str(tree), str(hf_dir), str(plain), outtype, name],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"train_tiny: convert_hf_to_gguf.py failed ({proc.returncode})")
        add_byte_vocab(plain, out)
    finally:
        plain.unlink(missing_ok=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- the transformers vs llama.cpp check --------------------------------------------------


def hf_logits(hf_dir: Path, seqs: list[list[int]]):
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the reference: transformers' plain per-expert loop
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(seqs), output_router_logits=False, use_cache=False).logits.float().numpy()


HELDOUT_SEQS, HELDOUT_OFFSET = 4, 1024
HELDOUT_LEN = HELDOUT_SEQ_LEN  # onebit_predict/grow/verify.py reads the snippet back in sequences of this length


def write_heldout(path: Path) -> list[str]:
    """Write the held-out snippet: bytes [1024, 1280) of the first four validation files (sorted)
    that are at least 2 KiB long, concatenated (4 x 256 bytes). Returns their relative paths.

    It is committed next to the models so the tests (which run without torch, on any Python)
    and ``--check`` feed exactly the same tokens; no byte of it was trained on.
    """
    chosen, data = [], b""
    for rel, p in corpus_files():
        if not is_validation(rel):
            continue
        raw = p.read_bytes()
        if len(raw) < HELDOUT_OFFSET + 1024:
            continue
        chosen.append(rel)
        data += raw[HELDOUT_OFFSET : HELDOUT_OFFSET + HELDOUT_LEN]
        if len(chosen) == HELDOUT_SEQS:
            break
    from onebit_predict.atomic import atomic_write_bytes

    atomic_write_bytes(path, data)
    return chosen


def check(gguf_path: Path, hf_dir: Path, threads: int = 1, heldout: Path | None = None) -> dict:
    """Logits of the GGUF (patched llama.cpp) against the checkpoint (transformers) on the held-out snippet."""
    import numpy as np

    setup_torch(threads, 0)
    from onebit_predict.grow.verify import heldout_sequences, llama_logits

    seqs = heldout_sequences(heldout or gguf_path.parent / "heldout.txt")
    a = llama_logits(gguf_path, seqs, threads)
    b = hf_logits(hf_dir, seqs)
    nmse = float(np.sum((a - b) ** 2) / np.sum(b**2))
    agree = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    tgt = np.array(seqs)[:, 1:]
    acc_llama = float(np.mean(a[:, :-1].argmax(-1) == tgt))
    acc_hf = float(np.mean(b[:, :-1].argmax(-1) == tgt))
    res = {
        "nmse": nmse,
        "max_abs_diff": float(np.max(np.abs(a - b))),
        "top1_agreement": agree,
        "top1_acc_llama": acc_llama,
        "top1_acc_hf": acc_hf,
        "tokens": int(a.shape[0] * a.shape[1]),
    }
    print(json.dumps(res, indent=1))
    return res


# --- CLI ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(ARCH_CLASS))
    p.add_argument("--out", type=Path, help="the GGUF to write (training mode)")
    p.add_argument("--hf-dir", type=Path, help="the transformers checkpoint (default: <out without .gguf>-hf/)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--aux-coef", type=float, default=0.01, help="per-layer load-balancing loss weight")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--val-windows", type=int, default=32)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: deterministic, and OpenMP spin-waits waste CPU on a busy machine)",
    )
    p.add_argument("--outtype", default="f16", choices=["f16", "f32"])
    p.add_argument(
        "--check", type=Path, metavar="GGUF", help="compare GGUF (llama.cpp) with its --hf-dir (transformers)"
    )
    args = p.parse_args(argv)

    if args.check:
        hf_dir = args.hf_dir or args.check.with_name(args.check.stem + "-hf")
        res = check(args.check, hf_dir, args.threads)
        return 0 if res["nmse"] < 1e-4 else 1

    if not args.arch or not args.out:
        p.error("--arch and --out are required (or --check GGUF)")
    hf_dir = args.hf_dir or args.out.with_name(args.out.stem + "-hf")
    cmd = "python tools/train_tiny.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res = train(args)
    model = res.pop("model")
    model.config.output_router_logits = False
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    model.half().save_pretrained(hf_dir, safe_serialization=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    heldout = args.out.parent / "heldout.txt"
    if not heldout.exists():
        print(f"held-out snippet from {write_heldout(heldout)}")
    convert(hf_dir, args.out, args.outtype, f"onebit-tiny-{args.arch}")
    record = {
        "command": cmd,
        "arch": args.arch,
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "ctx": args.ctx,
        "lr": args.lr,
        "threads": args.threads,
        "outtype": args.outtype,
        "gguf": args.out.name,
        "gguf_sha256": sha256(args.out),
        "gguf_bytes": args.out.stat().st_size,
        **res,
    }
    record["check"] = check(args.out, hf_dir, args.threads)
    from onebit_predict.atomic import atomic_write_text

    atomic_write_text(args.out.with_suffix(".json"), json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out} ({record['gguf_bytes']} bytes, sha256 {record['gguf_sha256']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
