"""EAGLE heads: SGLang's layouts load strictly, the target's features are the right ones, the drafting path
(paged, on the target's request table) computes what the training path computes, and training learns."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from plait.runtime.forward.batch import FINAL_HIDDEN
from plait.runtime.speculative.eagle import EagleConfig, default_aux_layers, load_eagle_head, new_head, save_eagle_head
from plait.runtime.speculative.eagle_worker import DraftSeed, EagleDrafter, ExtendRun

SENTENCE = "The quick brown fox jumps over the lazy dog, and then the dog sleeps in the warm afternoon sun."


def _sglang_tensors(kind: str, cfg, h: int, draft_vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random head written by hand in SGLang's tensor names (not through plait's own saver)."""
    g = torch.Generator().manual_seed(seed)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, 96

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    if kind == "EAGLE":
        p, attn_in = "layers.0.", h
        out = {"fc.weight": r(h, 2 * h), "fc.bias": r(h)}
    else:
        p, attn_in = "midlayer.", 2 * h
        out = {"fc.weight": r(h, 3 * h), "norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": r(draft_vocab, h), p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               p + "hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "d2t": torch.arange(draft_vocab, dtype=torch.int64) * 7,  # draft id i is target id 8i
               "t2d": torch.zeros(cfg.vocab_size, dtype=torch.bool)}
    out.update({p + "self_attn.q_proj.weight": r(q, attn_in), p + "self_attn.k_proj.weight": r(kv, attn_in),
                p + "self_attn.v_proj.weight": r(kv, attn_in), p + "self_attn.o_proj.weight": r(h, q),
                p + "mlp.gate_proj.weight": r(inter, h), p + "mlp.up_proj.weight": r(inter, h),
                p + "mlp.down_proj.weight": r(h, inter),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    return out


def _write(folder, kind: str, cfg, tensors: dict, **config_changes) -> str:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3" if kind == "EAGLE3" else "LlamaForCausalLMEagle"],
              "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": 96, "num_hidden_layers": 1,
              "rms_norm_eps": 1e-5, "vocab_size": cfg.vocab_size, "max_position_embeddings": 2048}
    if kind == "EAGLE3":
        config["draft_vocab_size"] = 64
    config.update(config_changes)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return str(folder)


def _drafter(runner, head) -> EagleDrafter:
    return EagleDrafter(head, runner.req_to_token.table, runner.kv_pool.num_slots, 4, 4, 2048, torch.float32)


def _extend_and_draft(runner, head, ids: list[int], size: int) -> list[int]:
    """The head over a committed prompt (random features) in row 0, then a draft of `size` tokens."""
    drafter = _drafter(runner, head)
    n = len(ids) - 1
    runner.req_to_token.table[0, :n] = torch.arange(n)
    feats = torch.randn(n, head.cfg.feature_size, generator=torch.Generator().manual_seed(0))
    (out,) = drafter.extend([ExtendRun(0, 0, feats, ids[1:], True)])
    return drafter.draft([DraftSeed(0, n, *out)], [size])[0]


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_sglang_layout_heads_load_and_draft(runner, tmp_path, kind):
    tcfg = runner.config
    tensors = _sglang_tensors(kind, tcfg, tcfg.hidden_size, 64)
    head = load_eagle_head(_write(tmp_path / kind, kind, tcfg, tensors), tcfg, runner.model)
    assert head.cfg.kind == kind
    assert head.cfg.feature_size == tcfg.hidden_size * (3 if kind == "EAGLE3" else 1)
    if kind == "EAGLE3":
        assert head.cfg.aux_layer_ids == default_aux_layers(tcfg.num_layers)
        assert head.d2t[5] == 35
    ids = runner.tokenizer.encode(SENTENCE)
    draft = _extend_and_draft(runner, head, ids, 4)
    assert len(draft) == 4 and all(0 <= t < tcfg.vocab_size for t in draft)
    if kind == "EAGLE3":  # draft ids map through d2t into the target's vocabulary
        assert all(t % 8 == 0 for t in draft)
    # a "model." prefix on every name (how some checkpoints store them) loads the same head
    prefixed = {f"model.{k}": v for k, v in tensors.items()}
    again = load_eagle_head(_write(tmp_path / f"{kind}-prefixed", kind, tcfg, prefixed), tcfg, runner.model)
    assert torch.equal(again.qkv_proj.weight, head.qkv_proj.weight)


@pytest.mark.parametrize("change,match", [
    ("drop:midlayer.hidden_norm.weight", "missing.*midlayer.hidden_norm.weight"),
    ("add:midlayer.extra.weight", "leftover.*midlayer.extra.weight"),
    ("shape:fc.weight", "fc.weight"),
    ("shape:midlayer.self_attn.k_proj.weight", "midlayer.self_attn.k_proj.weight"),
    ("d2t", "d2t"),
    ("config:hidden_size", "hidden_size"),
    ("config:architectures", "architectures"),
])
def test_malformed_heads_are_refused_naming_the_tensor(runner, tmp_path, change, match):
    tcfg = runner.config
    tensors = _sglang_tensors("EAGLE3", tcfg, tcfg.hidden_size, 64)
    what, _, name = change.partition(":")
    extra = {}
    if what == "drop":
        del tensors[name]
    elif what == "add":
        tensors[name] = torch.zeros(4, dtype=torch.bfloat16)
    elif what == "shape":
        tensors[name] = tensors[name][:, :-1].contiguous()
    elif what == "d2t":
        tensors["d2t"] = torch.full((64,), tcfg.vocab_size, dtype=torch.int64)  # beyond the target's vocabulary
    elif name == "hidden_size":
        extra = {"hidden_size": tcfg.hidden_size * 2}
    else:
        extra = {"architectures": ["LlamaForCausalLM"]}
    folder = _write(tmp_path / "bad", "EAGLE3", tcfg, tensors, **extra)
    with pytest.raises(ValueError, match=match):
        load_eagle_head(folder, tcfg, runner.model)


def test_captured_features_are_the_targets_hidden_states(runner, hf_model):
    """The layers an EAGLE-3 head reads, and the last hidden state an EAGLE head reads, equal transformers'
    hidden states of the same model."""
    from plait.runtime.forward.batch import ForwardMode
    from plait.runtime.model_executor.model_runner import WorkItem

    ids = runner.tokenizer.encode(SENTENCE)
    n = len(ids)
    runner.req_to_token.table[0, :n] = torch.arange(n)
    aux = default_aux_layers(runner.config.num_layers)
    out = runner.forward([WorkItem(0, 0, ids, [n - 1], ForwardMode.EXTEND)], aux + (FINAL_HIDDEN,))
    logits, (feats,) = out.logits, out.features
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids]), output_hidden_states=True)
    h = runner.config.hidden_size
    for k, layer in enumerate(aux):
        torch.testing.assert_close(feats[:, k * h : (k + 1) * h], ref.hidden_states[layer + 1][0], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(feats[:, 3 * h :], ref.hidden_states[-1][0], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(logits[0], ref.logits[0, -1], atol=2e-3, rtol=1e-3)


def _train_args(**kw) -> argparse.Namespace:
    base = dict(kind="EAGLE3", draft_vocab_size=512, intermediate_size=128, ttt_steps=3, epochs=1.0, lr=3e-3,
                accumulate=1, max_len=128, holdout=0.34, seed=0, work_dir=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture(scope="module")
def tiny_data(runner):
    """Features and labels of three sequences, as train-eagle's feature phase makes them."""
    from plait.runtime.forward.batch import ForwardMode
    from plait.runtime.model_executor.model_runner import WorkItem

    texts = [SENTENCE, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
             "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy."]
    aux = default_aux_layers(runner.config.num_layers)
    tokens, feats, labels = [], [], []
    for text in texts:
        ids = runner.tokenizer.encode(text)
        runner.req_to_token.table[0, : len(ids)] = torch.arange(len(ids))
        (f,) = runner.forward([WorkItem(0, 0, ids, [len(ids) - 1], ForwardMode.EXTEND)], aux).features
        tokens.append(torch.tensor(ids))
        feats.append(f.to(torch.bfloat16))
        labels.append(torch.tensor(ids[1:] + [-1], dtype=torch.int32))
    return {"capture": aux, "tokens": tokens, "features": feats, "labels": labels, "target": None}


def test_feature_phase_labels_the_answer_only(runner, runner_args):
    """train-eagle's labels are the target's own picks: the tokens after the prompt; prompt positions get none
    (-1), nor does the last position. Features are the captured layers at every position."""
    from plait import train_eagle as train

    ids = runner.tokenizer.encode(SENTENCE)
    prompt_len = 9
    ns = _train_args(max_len=len(ids) - 2)  # cut: the last two tokens are dropped
    data = train._features(runner_args, [(ids, prompt_len), (ids[:5], 8)], ns)
    labels = data["labels"][0].tolist()
    kept = ids[: len(ids) - 2]
    assert labels == [-1] * (prompt_len - 1) + kept[prompt_len:] + [-1]
    assert data["features"][0].shape == (len(kept), 3 * runner.config.hidden_size)
    assert data["labels"][1].tolist() == [-1] * 5  # all prompt: nothing to learn (train() leaves it out)
    assert data["capture"] == default_aux_layers(runner.config.num_layers)


def test_drafting_computes_what_training_computes(runner, tiny_data):
    """Step 0 of the head over committed positions (paged, through the request table) equals the training
    path's step 0; the drafter's second draft token equals training-time test step 1 at the same position
    when the first draft token is the sequence's next token."""
    from plait.runtime.layers.rotary import RotaryEmbedding
    from plait import train_eagle as train

    tcfg = runner.config
    cfg = EagleConfig("EAGLE3", tcfg.hidden_size, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim, 128,
                      tcfg.rms_norm_eps, tcfg.rope_theta, tcfg.vocab_size, tcfg.vocab_size, tiny_data["capture"])
    head = new_head(cfg, runner.model, seed=3, std=0.05)
    tokens, feats = tiny_data["tokens"][0], tiny_data["features"][0].float()
    c = 12  # committed positions: the head read (feature p, token p + 1) for p < c
    drafter = _drafter(runner, head)
    runner.req_to_token.table[0, :c] = torch.arange(c)
    (out,) = drafter.extend([ExtendRun(0, 0, feats[:c], tokens[1 : c + 1].tolist(), True)])
    d1, d2 = drafter.draft([DraftSeed(0, c, *out)], [2])[0]
    rotary = RotaryEmbedding(tcfg.hf_config, cfg.head_dim, cfg.rope_theta, 256, torch.float32)
    seq = tokens[: c + 2].clone()
    seq[c + 1] = d1  # the draft's first token, taken as the sequence's next token
    head.training_mode = True
    positions = torch.arange(c + 1)
    cos, sin = rotary.tables(positions)
    with torch.no_grad():
        embeds = head.embed_tokens(seq[1:])
        hidden0 = head.fuse(torch.cat([feats[:c], feats[c - 1 : c]]))  # position c's feature is never read
        qkv0, res0 = head.layer_input(embeds, hidden0)
        out0 = head.layer_output(train._attend(head, [qkv0], positions, 0, cos, sin), res0)
        hidden1 = torch.cat([out0[:1], out0[:-1]])
        qkv1, res1 = head.layer_input(embeds, hidden1)
        out1 = head.layer_output(train._attend(head, [qkv0, qkv1], positions, 1, cos, sin), res1)
    torch.testing.assert_close(out0[c - 1], out[0], atol=1e-4, rtol=1e-4)
    assert int(head.logits(out0[c - 1 : c]).argmax()) == d1
    assert int(head.logits(out1[c : c + 1]).argmax()) == d2


def test_training_learns_the_targets_next_tokens(runner, tiny_data, tmp_path, monkeypatch):
    """A few hundred steps on two sequences: the head predicts the target's next token on them far above chance
    at every training-time-test step (the EAGLE losses and the step masks work together)."""
    from plait.runtime.model_loader import LoadedModel
    from plait import train_eagle as train

    monkeypatch.setattr("plait.runtime.model_loader.load_model",
                        lambda *a, **k: LoadedModel(runner.model, runner.config, None))
    data = dict(tiny_data, tokens=tiny_data["tokens"][:2] * 3, features=tiny_data["features"][:2] * 3,
                labels=tiny_data["labels"][:2] * 3)
    ns = _train_args(epochs=50.0, holdout=0.01, out=str(tmp_path / "out"), work_dir=str(tmp_path), ttt_steps=2)
    head = train.train(data, ns)  # one sequence held out: each of the two is still trained on twice
    meta = json.loads((tmp_path / "out" / "training.json").read_text())
    assert meta["steps"] == 250 and meta["ttt_steps"] == 2
    for i in (0, 1):
        acc = _heldout(head, data, ns, i)
        assert acc[0] > 0.6 and acc[1] > 0.3, acc
    save_eagle_head(head, str(tmp_path / "head"))
    again = load_eagle_head(str(tmp_path / "head"), runner.config, runner.model)
    assert torch.equal(again.d2t, head.d2t)


def _heldout(head, data, ns, i: int) -> list[float]:
    from plait.runtime.layers.rotary import RotaryEmbedding
    from plait.train_eagle import sequence_loss

    cfg = head.cfg
    rotary = RotaryEmbedding(None, cfg.head_dim, cfg.rope_theta, 256, torch.float32)
    t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.int64)
    ids = torch.arange(cfg.draft_vocab_size) + head.d2t
    t2d[ids] = torch.arange(cfg.draft_vocab_size)
    with torch.no_grad():
        _, stats = sequence_loss(head, data["tokens"][i], data["features"][i], data["labels"][i], t2d, ns.ttt_steps,
                                 rotary)
    return [c / n for c, n in stats]


def test_tree_verify_rows_see_their_ancestors_only(runner):
    """A draft tree verified in one forward: each node's logits equal those of its own path computed as a plain
    sequence (the tree mask over the paged KV lets a node see the prefix, its ancestors and itself)."""
    from plait.runtime.forward.batch import ForwardMode
    from plait.runtime.model_executor.model_runner import WorkItem

    ids = runner.tokenizer.encode(SENTENCE)
    c = 10  # positions < c are cached; the sampled token sits at c
    nodes, parents = ids[c + 1 : c + 6], [-1, 0, -1, 2, 1]  # two branches under the sampled token
    table = runner.req_to_token.table
    table[1, : c + 1 + len(nodes)] = torch.arange(c + 1 + len(nodes))
    runner.forward([WorkItem(1, 0, ids[:c], [], ForwardMode.EXTEND)])
    tree = runner.forward([WorkItem(1, c, [ids[c]] + nodes, list(range(len(nodes) + 1)), ForwardMode.TARGET_VERIFY,
                                    parents)]).logits
    for i in range(-1, len(nodes)):
        path, node = [], i
        while node >= 0:
            path.insert(0, nodes[node])
            node = parents[node]
        seq = ids[: c + 1] + path
        table[2, : len(seq)] = torch.arange(1000, 1000 + len(seq))
        ref = runner.forward([WorkItem(2, 0, seq, [len(seq) - 1], ForwardMode.EXTEND)]).logits
        torch.testing.assert_close(tree[i + 1], ref[0], atol=1e-3, rtol=1e-3)


def test_tree_drafts_keep_the_best_nodes_and_stay_a_tree():
    from plait.runtime.speculative.eagle_worker import _best_tree

    # (score, depth, token, parent candidate)
    cands = [(-0.1, 1, 10, -1), (-2.0, 1, 11, -1), (-0.3, 2, 12, 0), (-0.2, 2, 13, 0), (-2.1, 2, 14, 1),
             (-0.5, 3, 15, 3)]
    tokens, parents = _best_tree(cands, 4)
    assert tokens == [10, 13, 12, 15] and parents == [-1, 0, 0, 1]
    tokens, parents = _best_tree(cands, 6)
    assert sorted(tokens) == [10, 11, 12, 13, 14, 15]
    assert all(p < i for i, p in enumerate(parents))  # parents first


def test_draft_tree_of_width_one_is_the_chain(runner):
    """draft_tree with top-1 expansion drafts the chain draft() drafts; wider, its first level is the head's
    top-k after the sampled token."""
    tcfg = runner.config
    cfg = EagleConfig("EAGLE3", tcfg.hidden_size, tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim, 128,
                      tcfg.rms_norm_eps, tcfg.rope_theta, tcfg.vocab_size, 512, default_aux_layers(tcfg.num_layers))
    head = new_head(cfg, runner.model, seed=5, std=0.05, d2t=torch.arange(512) * 2)
    ids = runner.tokenizer.encode(SENTENCE)
    n = len(ids) - 1
    runner.req_to_token.table[0, :n] = torch.arange(n)
    feats = torch.randn(n, cfg.feature_size, generator=torch.Generator().manual_seed(0))
    drafter = EagleDrafter(head, runner.req_to_token.table, runner.kv_pool.num_slots, 4, 4, 2048, torch.float32,
                           topk=3)
    (out,) = drafter.extend([ExtendRun(0, 0, feats, ids[1:], True)])
    seed = DraftSeed(0, n, *out)
    chain = drafter.draft([seed], [4])[0]
    tokens, parents = drafter.draft_tree([seed], [4], [4], 1)[0]
    assert tokens == chain and parents == [-1, 0, 1, 2]
    tokens, parents = drafter.draft_tree([seed], [9], [4], 3)[0]
    top3 = set(head.to_target(out[1].topk(3).indices).tolist())
    assert {t for t, p in zip(tokens, parents) if p == -1} <= top3 and tokens[0] == chain[0]
    assert len(tokens) == 9 and all(p < i for i, p in enumerate(parents))
