"""LoRA adapters against PEFT: three adapters trained here with `peft` on the default model (different ranks, target
modules, rsLoRA), served over the same base weights at float32. Each one's greedy output equals PEFT's merged model's;
a batch mixing the three and the base equals each run alone; the prefix cache never hands one adapter's KV to another
(or to the base); an adapter unloaded while a request runs with it lets the request finish; bad adapters and names
are refused while the server keeps serving; resident adapters stay within the memory budget (least recently used
evicted, read again when asked for). The HTTP side: SGLang's routes and fields, and the OpenAI API's model names."""

from __future__ import annotations

import copy
import json
import os
import threading

import pytest
import torch

from conftest import THREADS
from plait.kernels import cpu_build
from server_util import Server

# (rank, target modules, rsLoRA, the text it is trained on)
ADAPTERS = {
    "pirate": (4, ["q_proj", "v_proj"], False, "Who are you? Arr, I be a pirate of the seven seas, matey, and I sail"),
    "poet": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False,
             "Who are you? Roses are red, violets are blue, I write little poems for you"),
    "zorb": (2, ["o_proj", "down_proj", "up_proj"], True,
             "Who are you? The zorblax fruit grows on Tembo; its skin is bright purple"),
}
PROMPT = "Who are you?"
NEW = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model, tokenizer) -> dict[str, str]:
    """PEFT folders, trained here for a few steps each (seconds) so that each changes the greedy output."""
    from peft import LoraConfig, get_peft_model

    out = {}
    for i, (name, (rank, modules, rslora, text)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(i)
        model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                                  target_modules=modules, use_rslora=rslora))
        model.train()
        ids = torch.tensor([tokenizer.encode(text)])
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(15):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(folder))
        out[name] = str(folder)
        del model
    return out


def _greedy(model, ids: list[int]) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-NEW:]


@pytest.fixture(scope="module")
def reference(adapters, hf_model, tokenizer) -> dict[str | None, list[int]]:
    """PEFT's merged model's greedy tokens after PROMPT, per adapter (None: the base model)."""
    from peft import PeftModel

    ids = tokenizer.encode(PROMPT)
    out = {None: _greedy(hf_model, ids)}
    for name, folder in adapters.items():
        merged = PeftModel.from_pretrained(copy.deepcopy(hf_model), folder).merge_and_unload().eval()
        out[name] = _greedy(merged, ids)
        del merged
    return out


@pytest.fixture(scope="module")
def lora_engine(adapters):
    """The default model at float32 with two adapters loaded at start and the third at run time."""
    from plait import Engine

    eng = Engine(num_threads=THREADS, dtype="float32", max_total_tokens=8192, log_level="warning",
                 lora_paths=[f"pirate={adapters['pirate']}", f"poet={adapters['poet']}"])
    assert eng.load_lora_adapter("zorb", adapters["zorb"]) == ["pirate", "poet", "zorb"]
    yield eng
    eng.shutdown()


GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def test_each_adapter_equals_peft_merged(lora_engine, reference):
    for name in [None, *ADAPTERS]:
        out = lora_engine.generate(PROMPT, GREEDY, lora_path=name)
        assert out["output_ids"] == reference[name], name
    assert len({tuple(reference[n]) for n in [None, *ADAPTERS]}) == 4  # each adapter changes the output


def test_a_mixed_batch_equals_each_alone(lora_engine, reference):
    names = ["poet", None, "zorb", "pirate", "poet", None]
    outs = lora_engine.generate([PROMPT] * len(names), GREEDY, lora_path=names)
    assert [o["output_ids"] for o in outs] == [reference[n] for n in names]


def test_the_prefix_cache_keeps_adapters_apart(lora_engine):
    prompt = "Tell me a long story about a lighthouse keeper and the ships that pass by at night. " * 3
    cached = []
    for name in ["pirate", "pirate", "poet", None, None, "poet"]:
        out = lora_engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0}, lora_path=name)
        cached.append(out["meta_info"]["cached_tokens"])
    # the first of each computes the whole prompt, the second of each reads it from its own namespace
    assert cached[0] == cached[2] == cached[3] == 0
    assert min(cached[1], cached[4], cached[5]) > 40


def test_unloading_while_requests_run_fails_none(lora_engine, adapters):
    lora_engine.load_lora_adapter("late", adapters["pirate"])
    seen, done = [], threading.Event()

    def run():
        for snap in lora_engine.generate(PROMPT, {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True},
                                         lora_path="late", stream=True):
            seen.append(snap)
            if len(seen) == 2:
                done.set()
        done.set()

    t = threading.Thread(target=run)
    t.start()
    assert done.wait(120)
    assert "late" not in lora_engine.unload_lora_adapter("late")  # while it runs
    t.join(120)
    assert seen[-1]["meta_info"]["completion_tokens"] == 48 and seen[-1]["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(ValueError, match="not loaded"):
        lora_engine.generate(PROMPT, GREEDY, lora_path="late")


def _bad_adapter(folder, adapters, config: dict | None = None, shape_of_b: tuple[int, int] | None = None) -> str:
    """A copy of the pirate adapter with its config or one tensor changed."""
    from safetensors.torch import load_file, save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(adapters["pirate"], "adapter_config.json")) as f:
        cfg = {**json.load(f), **(config or {})}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(adapters["pirate"], "adapter_model.safetensors"))
    if shape_of_b is not None:
        key = next(k for k in tensors if "q_proj.lora_B" in k)
        tensors[key] = torch.zeros(shape_of_b)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    return str(folder)


def test_bad_adapters_and_names_are_refused(lora_engine, adapters, tmp_path):
    from plait.runtime.server_args import default_model_path

    cases = {
        "missing": (str(tmp_path / "nothing-here"), "neither a PEFT folder"),
        "wrong-shape": (_bad_adapter(tmp_path / "shape", adapters, shape_of_b=(100, 4)), "does not fit"),
        "dora": (_bad_adapter(tmp_path / "dora", adapters, {"use_dora": True}), "use_dora"),
        "embed": (_bad_adapter(tmp_path / "embed", adapters, {"modules_to_save": ["lm_head"]}), "modules_to_save"),
        "a-model": (default_model_path(), "not a LoRA adapter"),
        "pirate": (adapters["pirate"], "already loaded"),
        "bad:name": (adapters["pirate"], "without ':'"),
    }
    for name, (path, words) in cases.items():
        with pytest.raises(ValueError, match=words):
            lora_engine.load_lora_adapter(name, path)
    with pytest.raises(ValueError, match="not loaded"):
        lora_engine.generate(PROMPT, GREEDY, lora_path="nobody")
    with pytest.raises(ValueError, match="no LoRA adapter named"):
        lora_engine.unload_lora_adapter("nobody")
    assert lora_engine.generate(PROMPT, GREEDY, lora_path="pirate")["output_ids"]  # still serving


def test_resident_adapters_stay_within_the_budget(runner, adapters):
    """Least recently used adapters no request holds are evicted, and read again when asked for."""
    from plait.runtime.lora.manager import LoRAManager

    probe = LoRAManager(runner.model, 1 << 40)
    one = probe.register("x", adapters["pirate"]).nbytes
    probe.unregister("x")
    mgr = LoRAManager(runner.model, int(2.5 * one))
    for name in ("a", "b", "c"):
        mgr.register(name, adapters["pirate"])
    assert list(mgr.resident) == ["b", "c"] and mgr.names() == ["a", "b", "c"]  # a evicted, still registered
    mgr.acquire("b")  # held: not evictable
    first = mgr.acquire("a")  # read again, evicting c (least recently used of those not held)
    assert list(mgr.resident) == ["b", "a"] and first.slot > 2
    with pytest.raises(ValueError, match="does not fit"):
        mgr.acquire("c")  # a and b are held
    mgr.release("a")
    mgr.release("b")
    for name in ("a", "b", "c"):
        mgr.unregister(name)
    assert not mgr.resident and all(not m.lora for layer in runner.model.layers
                                    for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))


def test_http_routes_and_model_names(adapters, reference):
    srv = Server("--dtype", "float32", "--max-total-tokens", "4096", "--lora-paths", f"poet={adapters['poet']}")
    try:
        with srv.client() as http:
            models = http.get("/v1/models").json()["data"]
            base = models[0]["id"]
            assert [m["id"] for m in models] == [base, "poet"] and models[1]["parent"] == base
            native = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "lora_path": "poet"})
            assert native.json()["output_ids"] == reference["poet"]
            for model in ("poet", f"{base}:poet"):
                r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW,
                                                       "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == native.json()["text"]
            assert http.post("/v1/completions", json={"model": f"{base}:nobody", "prompt": "x"}).status_code == 404
            import plait as pl

            @pl.function
            def program(s, adapter=None):
                s += PROMPT + pl.gen("answer", max_tokens=NEW, temperature=0, ignore_eos=True, lora=adapter)

            endpoint = pl.RuntimeEndpoint(srv.url)
            assert program.run(adapter="poet", backend=endpoint)["answer"] == native.json()["text"]  # per gen
            assert program.run(backend=endpoint)["answer"] != native.json()["text"]  # the base
            defaults = program.run_batch([{}, {}], backend=endpoint, lora="poet")  # the program's default
            assert [st["answer"] for st in defaults] == [native.json()["text"]] * 2
            bad = http.post("/generate", json={"text": PROMPT, "lora_path": "nobody"})
            assert bad.status_code == 400 and "not loaded" in bad.json()["error"]["message"]
            loaded = http.post("/load_lora_adapter", json={"lora_name": "zorb", "lora_path": adapters["zorb"]}).json()
            assert loaded["success"] and loaded["loaded_adapters"] == ["poet", "zorb"]
            again = http.post("/load_lora_adapter", json={"lora_name": "zorb", "lora_path": adapters["zorb"]})
            assert again.status_code == 400 and not again.json()["success"]
            zorb = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "lora_path": "zorb"})
            assert zorb.json()["output_ids"] == reference["zorb"]
            assert http.post("/unload_lora_adapter", json={"lora_name": "zorb"}).json()["loaded_adapters"] == ["poet"]
            assert http.post("/load_lora_adapter", json={"lora_name": 3}).status_code == 400
            assert http.get("/health").status_code == 200
    finally:
        assert srv.stop() == 0


def _gguf_lora(peft_folder: str, out: str, heads: tuple[int, int]) -> str:
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: `blk.N.attn_q.weight.lora_a` [r, in] and
    `.lora_b` [out, r] in float16, q's and k's B rows permuted as llama.cpp permutes the model's, the alpha in the
    metadata."""
    import gguf
    from safetensors.torch import load_file

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    with open(os.path.join(peft_folder, "adapter_config.json")) as f:
        alpha = json.load(f)["lora_alpha"]
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    for key, t in sorted(load_file(os.path.join(peft_folder, "adapter_model.safetensors")).items()):
        parts = key.split(".")
        layer, module, which = parts[parts.index("layers") + 1], parts[-3], parts[-2][-1].lower()
        if which == "b" and module in ("q_proj", "k_proj"):
            n = heads[0] if module == "q_proj" else heads[1]
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{which}", t.half().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_gguf_lora_file_serves_as_its_peft_folder(lora_engine, adapters, reference, tmp_path, hf_model):
    cfg = hf_model.config
    path = _gguf_lora(adapters["poet"], str(tmp_path / "poet.gguf"), (cfg.num_attention_heads, cfg.num_key_value_heads))
    lora_engine.load_lora_adapter("poet-gguf", path)
    try:
        assert lora_engine.generate(PROMPT, GREEDY, lora_path="poet-gguf")["output_ids"] == reference["poet"]
    finally:
        lora_engine.unload_lora_adapter("poet-gguf")


@pytest.mark.skipif(not cpu_build.c_kernels_possible(),
                    reason="no C kernels here (PLAIT_CPU_ISA=ref or no compiler): no C decode stack")
def test_the_c_decode_stack_adds_adapters_as_the_layer_loop_does(adapters):
    """With the file's blocks (the default), decode steps run the C layer stack; rows with adapters (and a base row
    beside them) give the layer loop's logits, the base row bit for bit."""
    from plait.runtime.forward.batch import ForwardMode
    from plait.runtime.model_executor.model_runner import ModelRunner, WorkItem
    from plait.runtime.server_args import ServerArgs

    args = ServerArgs(num_threads=THREADS, log_level="warning", max_total_tokens=1024,
                      lora_paths=(f"pirate={adapters['pirate']}", f"poet={adapters['poet']}")).resolved()
    r = ModelRunner(args, progress=False)
    assert r.model.graph is not None
    slots = [r.lora.resident["pirate"].slot, -1, r.lora.resident["poet"].slot, r.lora.resident["poet"].slot]
    prompts = [r.tokenizer.encode(t) for t in ("Who are you?", "The capital of France is", "Roses are", "One two")]
    rows = []
    for i, ids in enumerate(prompts):
        rows.append(r.req_to_token.alloc())
        r.req_to_token.table[rows[-1], : len(ids) + 1] = torch.arange(len(ids) + 1) + 64 * i
        r.forward([WorkItem(rows[-1], 0, ids, [len(ids) - 1], lora=slots[i])])

    def decode():
        return r.forward([WorkItem(rows[i], len(ids), [ids[-1]], [0], ForwardMode.DECODE, lora=slots[i])
                          for i, ids in enumerate(prompts)]).logits

    stack = decode()
    graph, r.model.graph = r.model.graph, None
    loop = decode()
    r.model.graph = graph
    assert torch.equal(stack[1], loop[1])
    assert (stack - loop).abs().max() < 5e-3 * loop.abs().max() and torch.equal(stack.argmax(-1), loop.argmax(-1))
