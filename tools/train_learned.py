#!/usr/bin/env python3
"""Train the learned lookahead predictor (onebit_predict/learned.py) on a trained tiny model.

For one model of models/ (``--model qwen3moe-tiny``, ``qwen4exp-tiny``, ``olmoe-tiny``) this:

1. captures, with forward hooks on the transformers checkpoint ``models/NAME-hf/`` (float32,
   eager attention, eager experts: the reference ``train_tiny.py --check`` compares with
   llama.cpp), the FFN input ``x`` of every layer (the input of the MoE block
   ``layers[i].mlp``: after the post-attention norm, for qwen4exp after the hyper-connection
   mix) and the top-``n_used`` experts its router really selected (``mlp.gate``'s indices),
   for every token of 256-token passes of two training sources with the same token budget:

   - ``generation``: ``--tokens / 256`` prompts of 16 bytes from the TRAINING split of the
     corpus (seeded random positions), each greedily continued by the model itself to 256
     tokens (with its cache), then captured over the whole prompt+continuation in one pass;
   - ``chunks``: as many 256-token windows of the TRAINING split (seeded random positions),
     teacher-forced;

2. for K = 1, 2, 3 and every predicted layer l = K .. n_layer-1 fits ``W_l x_{l-K} + b_l``
   (W_l from layer l's router, b_l = 0) to layer l's actual sets with Adam on the listwise
   loss (numpy, ``onebit_predict.learned.train_layer``; lr 1e-2, 4 epochs, batch 256, chosen
   on a split of qwen3moe-tiny's TRAINING generations), once per source;

3. scores both, next to the plain router of layer l on x of layer l-K (the initialisation,
   what llama.cpp's ``router`` mode with ``AHEAD=K`` computes) and the previous-token
   baseline, on HELD-OUT text from the VALIDATION split (never trained on, neither by the
   model nor by the predictor): ``--eval-seqs`` prompts of 16 bytes at evenly spaced
   positions of the validation stream, greedily continued to 256 tokens (``heldout
   generation``), and the same 256-byte windows teacher-forced (``heldout chunks``); the rows
   scored are positions 16..255 (the decode rows), read recall at depth n_used and 2 n_used,
   micro-averaged over the predicted layers K..n_layer-1; also the held-out generation's rows
   whose 8-gram is new in their sequence (greedy loops repeat text; this leaves the loops out)
   and a static baseline (each layer's most frequent experts in the generation capture);

4. writes the generation-trained sidecars as ``models/NAME.learned-k{K}.gguf``, the
   chunk-trained ones under ``--chunks-dir`` (default /tmp/onebit-learned), each naming
   ``models/NAME.gguf`` (``learned.model_identity``: llama.cpp refuses it for another model), and
   the figures as JSON (``--json``, default ``/tmp/onebit-learned/NAME.json``), then prints the tables.

``--cost`` instead times the predictor's one matrix-vector product per predicted layer
(numpy and torch, one thread) for the three models' shapes.

Needs the ``train`` extra (torch, transformers). The figures in docs/learned.md came from:

    nice -n 19 python tools/train_learned.py --model qwen3moe-tiny --tokens 65536
    nice -n 19 python tools/train_learned.py --model qwen4exp-tiny --tokens 65536
    nice -n 19 python tools/train_learned.py --model olmoe-tiny --tokens 65536
    python tools/train_learned.py --cost
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")  # one thread everywhere (a shared 2-core machine; deterministic)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tools")]

from onebit_predict.atomic import atomic_write_text  # noqa: E402
from onebit_predict.learned import (  # noqa: E402
    LearnedLayer,
    LearnedPredictor,
    check_model,
    model_identity,
    prev_token_hits,
    read_learned,
    recall_hits,
    train_layer,
    write_learned,
)

MODELS = ("qwen3moe-tiny", "qwen4exp-tiny", "olmoe-tiny")
CTX = 256  # the models' training context
PROMPT = 16  # prompt bytes; positions PROMPT..CTX-1 are the decode rows scored
AHEADS = (1, 2, 3)
SOURCES = ("generation", "chunks")
EVAL_SETS = {  # capture -> what the table says
    "eval_generation": "held-out greedy generation (validation prompts)",
    "eval_chunks": "held-out text, teacher-forced (the same validation windows)",
    "eval_generation_novel": "held-out greedy generation, only the rows whose 8-gram is new in the sequence",
    "generation": "the generation TRAINING capture itself (fit, not held out)",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- the model and its hooks ---------------------------------------------------------------


def load_model(hf_dir: Path):
    import torch
    import transformers as tf
    from train_tiny import dense_qsa_fast_path

    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the reference train_tiny.py --check compares with llama.cpp
    model.eval()
    dense_qsa_fast_path(model)  # qwen4exp: exact while a query sees <= budget (256) tokens; else a no-op
    return model


def moe_blocks(model) -> list:
    """Each layer's MoE block (``layers[i].mlp``, with its router ``.gate``); an error if the arch differs."""
    blocks = [layer.mlp for layer in model.model.layers]
    for i, b in enumerate(blocks):
        gate = getattr(b, "gate", None)
        if gate is None or not hasattr(gate, "weight") or not hasattr(gate, "top_k"):
            raise SystemExit(f"train_learned: layer {i}'s mlp ({type(b).__name__}) has no top-k router .gate")
    return blocks


@contextmanager
def hooks(blocks: list, store: dict):
    """Record per layer the MoE block's input (``store['x'][i]``) and its router's top-k ids (``store['a'][i]``)."""
    handles = []
    for i, b in enumerate(blocks):

        def pre(mod, args, i=i):
            store["x"][i] = args[0].detach().float()

        def post(mod, args, out, i=i):
            store["a"][i] = out[2].detach()  # router_indices: the experts the block really runs

        handles.append(b.register_forward_pre_hook(pre))
        handles.append(b.gate.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def capture(model, seqs, batch: int = 16):
    """x (N, T, n_layer, n_embd) float32, actual (N, T, n_layer, k) int16 and the greedy argmax (N, T)
    of one teacher-forced pass over each row of ``seqs`` (N, T)."""
    import torch

    blocks = moe_blocks(model)
    n, t = seqs.shape
    nl, d, k = len(blocks), blocks[0].gate.weight.shape[1], blocks[0].gate.top_k
    xs = np.empty((n, t, nl, d), np.float32)
    acts = np.empty((n, t, nl, k), np.int16)
    amax = np.empty((n, t), np.int64)
    store: dict = {"x": {}, "a": {}}
    with torch.no_grad(), hooks(blocks, store):
        for s in range(0, n, batch):
            ids = seqs[s : s + batch]
            out = model(input_ids=ids, use_cache=False, output_router_logits=False)
            amax[s : s + len(ids)] = out.logits.argmax(-1).numpy()
            for i in range(nl):
                xs[s : s + len(ids), :, i] = store["x"][i].reshape(len(ids), t, d).numpy()
                acts[s : s + len(ids), :, i] = store["a"][i].reshape(len(ids), t, k).numpy()
    return xs, acts, amax


def generate(model, prompts, total: int, batch: int = 64):
    """Greedy continuation (the model's cache, argmax) of each prompt (N, P) to ``total`` tokens."""
    import torch

    out = []
    with torch.no_grad():
        for s in range(0, len(prompts), batch):
            ids = prompts[s : s + batch]
            res = model(input_ids=ids, use_cache=True, output_router_logits=False)
            seq = [ids]
            while sum(x.shape[1] for x in seq) < total:
                tok = res.logits[:, -1].argmax(-1, keepdim=True)
                seq.append(tok)
                if sum(x.shape[1] for x in seq) == total:
                    break
                res = model(input_ids=tok, cache=res.past_key_values, use_cache=True, output_router_logits=False)
            out.append(torch.cat(seq, dim=1))
    return torch.cat(out)


# --- training and scoring ------------------------------------------------------------------


def gate_weights(model, gguf_path: Path) -> list[np.ndarray]:
    """Each layer's router weight (n_expert, n_embd) float32, checked equal to the GGUF's ffn_gate_inp."""
    import gguf

    ws = [b.gate.weight.detach().float().numpy().copy() for b in moe_blocks(model)]
    tens = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    for i, w in enumerate(ws):
        g = np.array(tens[f"blk.{i}.ffn_gate_inp.weight"].data, dtype=np.float32).reshape(w.shape)
        if not np.array_equal(g, w):
            raise SystemExit(f"train_learned: layer {i}'s router differs between {gguf_path} and the checkpoint")
    return ws


def train_sidecars(
    xs, acts, gates, args, model_name: str, source: str, identity: tuple[str, int]
) -> dict[int, LearnedPredictor]:
    """One sidecar per K, trained on ``source``'s capture; ``identity``: the model GGUF's
    :func:`model_identity`, which the sidecar names (llama.cpp refuses it for another model)."""
    n, t, nl, d = xs.shape
    k = acts.shape[-1]
    out = {}
    for ahead in AHEADS:
        layers = {}
        for li in range(ahead, nl):
            r = train_layer(
                xs[:, :, li - ahead].reshape(-1, d),
                acts[:, :, li].reshape(-1, k),
                gates[li],
                epochs=args.epochs,
                lr=args.lr,
                batch=args.batch,
                seed=args.seed * 1000 + ahead * 100 + li,
            )
            layers[li] = LearnedLayer(r.weight, r.bias)
            log(f"  {source} K={ahead} layer {li}: loss {r.loss_before:.4f} -> {r.loss_after:.4f} ({r.steps} steps)")
        out[ahead] = LearnedPredictor(
            ahead=ahead,
            n_embd=d,
            n_expert=gates[0].shape[0],
            model_name=model_name,
            trained_on=source,
            tokens=n * t,
            model_arch=identity[0],
            router_hash=identity[1],
            layers=layers,
        )
    return out


def expert_counts(acts, n_expert: int) -> np.ndarray:
    """(n_layer, n_expert): how often each expert was selected in a capture (the static baseline's ranking)."""
    nl = acts.shape[2]
    return np.stack([np.bincount(acts[:, :, li].reshape(-1), minlength=n_expert) for li in range(nl)]).astype(
        np.float32
    )


def novel_rows(seqs, n: int = 8):
    """(N, T) bool: True where the ``n``-gram ending at the position did not occur earlier in its sequence
    (False for the first n-1 positions); the complement is the repeated text of a greedy loop."""
    rows = seqs.tolist()
    out = np.zeros((len(rows), len(rows[0])), dtype=bool)
    for i, row in enumerate(rows):
        seen = set()
        for p in range(n - 1, len(row)):
            gram = tuple(row[p - n + 1 : p + 1])
            out[i, p] = gram not in seen
            seen.add(gram)
    return out


def score(xs, acts, gates, preds: dict[str, dict[int, LearnedPredictor]], static: np.ndarray, scored=None) -> dict:
    """Read recall (%) at depth n_used and 2 n_used per K: router, each learned predictor, the static
    most-frequent experts of the generation training capture, previous token; on the rows ``scored``
    ((N, T) bool; default every position from PROMPT on, the decode rows)."""
    nl, k = xs.shape[2], acts.shape[-1]
    if scored is None:
        scored = np.zeros(xs.shape[:2], dtype=bool)
        scored[:, PROMPT:] = True
    res = {}
    for ahead in AHEADS:
        hits: dict[str, dict[int, int]] = {}
        total = 0
        prev = 0
        for li in range(ahead, nl):
            x = xs[:, :, li - ahead][scored]
            a = acts[:, :, li][scored]
            total += a.size
            prev += prev_token_hits(acts[:, :, li], scored)
            cands = {"router": x @ gates[li].T, "static": np.broadcast_to(static[li], (len(x), static.shape[1]))}
            for src, by_k in preds.items():
                cands[src] = by_k[ahead].logits(li, x)
            for name, z in cands.items():
                for depth in (k, 2 * k):
                    hits.setdefault(name, {}).setdefault(depth, 0)
                    hits[name][depth] += recall_hits(z, a, depth)
        res[ahead] = {name: {str(dp): 100.0 * h / total for dp, h in by_d.items()} for name, by_d in hits.items()}
        res[ahead]["prev_token"] = 100.0 * prev / total
        res[ahead]["rows"] = int(total // k)
    return res


def table(res: dict, k: int, title: str) -> str:
    lines = [
        f"{title}",
        "| K | depth | router (init) | learned, generation | learned, chunks | most frequent | previous token |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for ahead in AHEADS:
        r = res[str(ahead)] if str(ahead) in res else res[ahead]
        for depth in (k, 2 * k):
            d = str(depth)
            lines.append(
                f"| {ahead} | {depth} | {r['router'][d]:.1f} | {r['generation'][d]:.1f} | {r['chunks'][d]:.1f} "
                f"| {r['static'][d]:.1f} | {r['prev_token']:.1f} |"
            )
    return "\n".join(lines)


# --- the runs -------------------------------------------------------------------------------


def run(args) -> int:
    import gguf
    import torch
    from train_tiny import load_corpus

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    name = args.model
    gguf_path = REPO_ROOT / "models" / f"{name}.gguf"
    hf_dir = REPO_ROOT / "models" / f"{name}-hf"
    model_name = str(gguf.GGUFReader(gguf_path).fields["general.name"].contents())
    identity = model_identity(gguf_path)  # what every sidecar names: the model it is trained for
    n_seq = args.tokens // CTX
    if n_seq * CTX != args.tokens or n_seq < 1:
        raise SystemExit(f"train_learned: --tokens must be a positive multiple of {CTX}")
    t_all, c_all = time.time(), time.process_time()
    corpus = load_corpus()
    train_stream, val_stream = corpus["train"].long(), corpus["val"].long()
    model = load_model(hf_dir)
    gates = gate_weights(model, gguf_path)
    k = moe_blocks(model)[0].gate.top_k
    log(
        f"{name} ({model_name}): {len(gates)} layers, {gates[0].shape[0]} experts, {k} used, n_embd {gates[0].shape[1]}"
    )

    g = torch.Generator().manual_seed(args.seed)
    p_pos = torch.randint(0, len(train_stream) - CTX - 1, (n_seq,), generator=g)
    c_pos = torch.randint(0, len(train_stream) - CTX - 1, (n_seq,), generator=g)
    timing = {}
    t0 = time.time()
    gen_seqs = generate(model, torch.stack([train_stream[p : p + PROMPT] for p in p_pos.tolist()]), CTX)
    timing["generate_train_s"] = time.time() - t0
    chunk_seqs = torch.stack([train_stream[p : p + CTX] for p in c_pos.tolist()])
    step = (len(val_stream) - CTX) // args.eval_seqs
    v_pos = [i * step for i in range(args.eval_seqs)]
    t0 = time.time()
    ev_gen = generate(model, torch.stack([val_stream[p : p + PROMPT] for p in v_pos]), CTX)
    timing["generate_eval_s"] = time.time() - t0
    ev_chunks = torch.stack([val_stream[p : p + CTX] for p in v_pos])

    caps = {}
    agree = {}
    t0 = time.time()
    for key, seqs in (("generation", gen_seqs), ("chunks", chunk_seqs), ("eval_generation", ev_gen)):
        caps[key] = capture(model, seqs)
        if key.endswith("generation"):  # cached greedy decode vs the uncached pass: the same argmax?
            amax = caps[key][2]
            agree[key] = float(np.mean(amax[:, PROMPT - 1 : -1] == seqs[:, PROMPT:].numpy()))
    caps["eval_chunks"] = capture(model, ev_chunks)
    timing["capture_s"] = time.time() - t0
    log(f"captured; greedy argmax of the capture pass = the generated token: {agree}")

    t0 = time.time()
    preds = {src: train_sidecars(*caps[src][:2], gates, args, model_name, src, identity) for src in SOURCES}
    timing["train_s"] = time.time() - t0
    files = {}
    for src, by_k in preds.items():
        out_dir = args.out_dir if src == "generation" else args.chunks_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        for ahead, pred in by_k.items():
            suffix = f"learned-k{ahead}" if src == "generation" else f"learned-chunks-k{ahead}"
            path = out_dir / f"{name}.{suffix}.gguf"
            write_learned(path, pred)
            back = read_learned(path)  # round trip and the model check, as llama.cpp's side will
            check_model(back, gguf_path)
            files[f"{src}-k{ahead}"] = {"path": str(path), "bytes": path.stat().st_size}
    static = expert_counts(caps["generation"][1], gates[0].shape[0])
    novel = novel_rows(ev_gen)
    novel[:, :PROMPT] = False
    results = {key: score(caps[key][0], caps[key][1], gates, preds, static) for key in EVAL_SETS if key in caps}
    results["eval_generation_novel"] = score(*caps["eval_generation"][:2], gates, preds, static, novel)
    repeats = {
        key: round(float(100.0 * (1.0 - novel_rows(seqs)[:, PROMPT:].mean())), 2)
        for key, seqs in (("eval_generation", ev_gen), ("eval_chunks", ev_chunks), ("generation", gen_seqs))
    }
    log(f"share of the decode rows whose 8-gram occurred earlier in the sequence (%): {repeats}")
    timing["wall_s"] = time.time() - t_all
    timing["cpu_s"] = time.process_time() - c_all
    record = {
        "command": "python tools/train_learned.py " + " ".join(sys.argv[1:]),
        "model": name,
        "model_name": model_name,
        "n_used": k,
        "tokens_per_source": args.tokens,
        "eval_seqs": args.eval_seqs,
        "eval_rows_per_layer": args.eval_seqs * (CTX - PROMPT),
        "eval_novel_rows_per_layer": int(novel.sum()),
        "hyper": {"epochs": args.epochs, "lr": args.lr, "batch": args.batch, "seed": args.seed},
        "greedy_agreement": agree,
        "repeat_share_8gram": repeats,
        "files": files,
        "timing": {k2: round(v, 1) for k2, v in timing.items()},
        "results": results,
    }
    args.json = args.json or args.chunks_dir / f"{name}.json"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.json, json.dumps(record, indent=1) + "\n")
    for key, what in EVAL_SETS.items():
        print(table(results[key], k, f"\n{name}: read recall % on {what}"))
    print(f"\ntiming: {record['timing']}; JSON: {args.json}")
    return 0


def cost(args) -> int:
    """Time one predicted layer's product (n_expert x n_embd matrix times one token's x, plus the bias)."""
    import timeit

    shapes = {"qwen3moe-tiny": (16, 64), "qwen4exp-tiny": (16, 64), "olmoe-tiny": (64, 64), "OLMoE-1B-7B": (64, 2048)}
    rng = np.random.default_rng(0)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None
    rows = []
    for name, (e, d) in shapes.items():
        w, b = rng.standard_normal((e, d), dtype=np.float32), rng.standard_normal(e, dtype=np.float32)
        x = rng.standard_normal(d, dtype=np.float32)
        n = 20000
        t_np = min(timeit.repeat(lambda w=w, b=b, x=x: w @ x + b, number=n, repeat=5)) / n
        t_th = None
        if torch is not None:
            tw, tb, tx = torch.from_numpy(w), torch.from_numpy(b), torch.from_numpy(x)
            t_th = min(timeit.repeat(lambda tb=tb, tw=tw, tx=tx: torch.addmv(tb, tw, tx), number=n, repeat=5)) / n
        rows.append(
            {"model": name, "n_expert": e, "n_embd": d, "flops": 2 * e * d + e, "numpy_us": t_np * 1e6}
            | ({"torch_us": t_th * 1e6} if t_th is not None else {})
        )
    print("| shape | n_expert x n_embd | FLOPs / token / layer | numpy (us) | torch addmv (us) |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        th = f"{r['torch_us']:.2f}" if "torch_us" in r else "-"
        print(f"| {r['model']} | {r['n_expert']} x {r['n_embd']} | {r['flops']} | {r['numpy_us']:.2f} | {th} |")
    print(json.dumps(rows), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS)
    p.add_argument("--tokens", type=int, default=65536, help="training tokens per source (a multiple of 256)")
    p.add_argument("--eval-seqs", type=int, default=64, help="held-out prompts (validation split)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "models", help="the generation-trained sidecars")
    p.add_argument("--chunks-dir", type=Path, default=Path("/tmp/onebit-learned"), help="the chunk-trained ones")
    p.add_argument("--json", type=Path)
    p.add_argument("--cost", action="store_true", help="time the predictor's product per predicted layer")
    args = p.parse_args(argv)
    if args.cost:
        return cost(args)
    if not args.model:
        p.error("--model is required (or --cost)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
