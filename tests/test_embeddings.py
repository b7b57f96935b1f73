"""Embeddings on the real server: all-MiniLM-L6-v2 (the packaged sentence-transformers model, a BERT encoder)
through the `openai` client (float and base64), SGLang's /encode, Ollama's /api/embed (truncating, as
sentence-transformers does) and the legacy /api/embeddings; cosine similarities equal sentence-transformers' own
on the same folder. The default decoder's last-token and mean pooling equal transformers' hidden states, from
the cache and not. Hostile inputs get a 4xx and the server keeps serving."""

from __future__ import annotations

import base64
import struct

import pytest
import torch

from plait.runtime.model_loader.packaged import fetch
from server_util import Server

TOL = 1e-3  # the bar; float32 gives ~1e-6
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
         "A man is riding a horse.", "Ein Mann isst Brot.", "x", ""]
LONG = "The history of the city begins with a small settlement on an island in the river. " * 30  # > 256 tokens


@pytest.fixture(scope="module")
def minilm() -> str:
    return str(fetch("all-minilm-l6-v2"))


@pytest.fixture(scope="module")
def reference(minilm):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm, device="cpu")
    return lambda texts: torch.tensor(model.encode(texts, convert_to_numpy=True))


@pytest.fixture(scope="module")
def server(minilm):
    srv = Server("--model-path", minilm, "--served-model-name", "minilm")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def _sims(v: torch.Tensor) -> torch.Tensor:
    v = torch.nn.functional.normalize(v.double(), dim=-1)
    return v @ v.T


def test_openai_client_matches_sentence_transformers(server, reference):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    ref = reference(TEXTS)
    for fmt in ({"encoding_format": "float"}, {}):  # unless told, the client asks for base64 and decodes it
        res = client.embeddings.create(model="minilm", input=TEXTS, **fmt)
        got = torch.tensor([d.embedding for d in sorted(res.data, key=lambda d: d.index)])
        assert got.shape == (len(TEXTS), 384)
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)  # unit vectors
        assert (_sims(got) - _sims(ref)).abs().max() < TOL
        assert res.usage.prompt_tokens == res.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float").data
    assert len(one) == 1 and torch.allclose(torch.tensor(one[0].embedding), got[0], atol=1e-5)


def test_token_ids_base64_and_native_routes_agree(http, minilm):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(minilm)(TEXTS[:3])["input_ids"]
    floats = http.post("/v1/embeddings", json={"input": TEXTS[:3]}).json()["data"]
    by_ids = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"}).json()["data"]
    for f, b in zip(floats, by_ids):
        raw = base64.b64decode(b["embedding"])
        assert torch.allclose(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)), torch.tensor(f["embedding"]),
                              atol=1e-6)
    single = http.post("/v1/embeddings", json={"input": ids[0]}).json()["data"]  # one list of ids: one input
    assert len(single) == 1
    native = http.post("/encode", json={"text": TEXTS[0]}).json()
    assert native["meta_info"]["prompt_tokens"] == len(ids[0])
    assert torch.allclose(torch.tensor(native["embedding"]), torch.tensor(floats[0]["embedding"]), atol=1e-6)
    batch = http.post("/encode", json={"input_ids": ids}).json()
    assert [len(b["embedding"]) for b in batch] == [384] * 3


def test_ollama_embed_truncates_as_sentence_transformers_does(http, reference):
    res = http.post("/api/embed", json={"model": "minilm", "input": [LONG, TEXTS[0]]}).json()
    ref = reference([LONG, TEXTS[0]])  # truncated to its max_seq_length, 256
    got = torch.tensor(res["embeddings"])
    short = http.post("/encode", json={"text": TEXTS[0]}).json()["meta_info"]["prompt_tokens"]
    assert res["prompt_eval_count"] == 256 + short
    assert (torch.nn.functional.cosine_similarity(got.double(), ref.double()) > 1 - TOL).all()
    refused = http.post("/api/embed", json={"model": "minilm", "input": LONG, "truncate": False})
    assert refused.status_code == 400 and "context length" in refused.json()["error"]
    assert http.post("/api/embed", json={"model": "minilm", "input": []}).json()["embeddings"] == []  # a load
    legacy = http.post("/api/embeddings", json={"model": "minilm", "prompt": TEXTS[0]}).json()["embedding"]
    assert torch.allclose(torch.tensor(legacy), got[1], atol=1e-5)
    shown = http.post("/api/show", json={"model": "minilm"}).json()
    assert shown["capabilities"] == ["embedding"]


@pytest.mark.parametrize("body, status, words", [
    ({"input": []}, 400, "not empty"),
    ({"input": 7}, 400, "input"),
    ({"input": {"text": "a"}}, 400, "input"),
    ({"input": ["a", 1]}, 400, "one kind"),
    ({"input": [[]]}, 400, "non-empty"),
    ({"input": [[1, 2], "a"]}, 400, "one kind"),
    ({"input": [10 ** 6]}, 400, "input_ids must be in"),
    ({"input": [-1]}, 400, "input_ids must be in"),
    ({"input": LONG}, 400, "context length"),
    ({"input": ["a"] * 2049}, 400, "at most 2048"),
    ({"input": "a", "dimensions": 100}, 400, "Matryoshka"),
    ({"input": "a", "dimensions": 0}, 400, "dimensions"),
    ({"input": "a", "dimensions": True}, 400, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "a", "pooling": "mean"}, 400, "pooling"),
    ({"input": "a", "model": "gpt-4"}, 404, "does not exist"),
    (b'{"input": "\\ud800"}', 400, "surrogate"),  # a lone surrogate, escaped as JSON allows
    ({}, 400, "input"),
])
def test_hostile_inputs_are_refused_and_the_server_keeps_serving(http, body, status, words):
    r = http.post("/v1/embeddings", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == status, r.text
    assert words.lower() in r.json()["error"]["message"].lower()
    assert http.post("/v1/embeddings", json={"input": "still here"}).status_code == 200


def test_an_encoder_refuses_to_generate(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "embeddings only" in r.json()["error"]["message"]
    assert http.post("/generate", json={"text": "hi"}).status_code == 400
    assert http.post("/api/generate", json={"model": "minilm", "prompt": "hi"}).status_code == 400
    huge = http.post("/encode", json={"text": "word " * 200_000})  # refused before it is tokenized
    assert huge.status_code == 400 and "context length" in huge.json()["error"]["message"]


def test_decoder_pooling_equals_transformers(engine, hf_model):
    """The default decoder in float32: last-token and mean pooling of its final (normed) hidden states, as
    transformers computes them; a second call reads the prefix from the cache and gives the same vectors."""
    texts = ["The capital of France is Paris.", "Dogs are loyal animals that love their owners."]
    last = torch.tensor(engine.embed(texts))
    mean = torch.tensor(engine.embed(texts, pooling="mean"))
    again = torch.tensor(engine.embed(texts))
    assert torch.allclose(again, last, atol=1e-5)
    for i, text in enumerate(texts):
        ids = torch.tensor([engine.tokenizer.encode(text)])
        with torch.no_grad():
            hidden = hf_model.model(ids).last_hidden_state[0].double()
        assert torch.dot(last[i].double(), torch.nn.functional.normalize(hidden[-1], dim=0)) > 1 - 1e-4
        assert torch.dot(mean[i].double(), torch.nn.functional.normalize(hidden.mean(0), dim=0)) > 1 - 1e-4
    with pytest.raises(ValueError, match="dimensions"):
        engine.embed("a", dimensions=10)


DOCS = {
    "zorblax.txt": "The zorblax is a fruit grown only on the island of Tembo. Its skin is bright purple and its "
                   "flesh tastes of lemon and pepper.\n\nFarmers on Tembo harvest zorblax fruit in early spring.",
    "trains.md": "# Mountain railways\n\nThe Kessel line climbs 1,200 metres in 14 kilometres using a rack-and-pinion "
                 "system built in 1893.",
    "cooking.txt": "To make a simple flatbread, mix flour, water and salt, rest the dough for twenty minutes, then "
                   "cook it in a hot dry pan.",
    "astronomy.txt": "Saturn's rings are made mostly of ice particles, with some rock and dust.",
}


def test_a_program_retrieves_then_generates_on_one_server(tmp_path, minilm):
    """examples/rag_folder.py on a runtime serving the default model with the embedding model beside it: `embed`
    in the program gives the same vector as the backend's batch call, the nearest passage is the right file, and
    the answer is generated from it; the main model embeds too when a program names it."""
    import pathlib
    import sys

    import plait as pl

    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    import rag_folder

    for name, text in DOCS.items():
        (tmp_path / name).write_text(text)
    backend = pl.Runtime(embedding_model_path=minilm, num_threads=1, log_level="warning", max_total_tokens=4096)
    try:
        index = rag_folder.Index(rag_folder.passages(str(tmp_path)), backend)
        assert len(index.items) == 4
        questions = {"What color is the zorblax fruit?": "zorblax.txt", "How do I make flatbread?": "cooking.txt",
                     "What are Saturn's rings made of?": "astronomy.txt", "How steep is the Kessel line?": "trains.md"}
        states = rag_folder.answer.run_batch([{"question": q, "index": index} for q in questions], backend=backend)
        for (question, source), s in zip(questions.items(), states):
            assert s["sources"][0] == source
            assert s["answer"].strip()
            assert torch.allclose(torch.tensor(s["question_vector"]), torch.tensor(backend.embed([question])[0]),
                                  atol=1e-5)

        @pl.function
        def program(s):
            s += "Hello world."
            s += pl.embed("so_far")  # the program's text so far
            s += pl.embed("many", ["a", "b"])
            s += pl.embed("by_main", "Hello world.", model=backend.get_model_name())

        s = program.run(backend=backend)
        assert torch.allclose(torch.tensor(s["so_far"]), torch.tensor(backend.embed(["Hello world."])[0]), atol=1e-5)
        assert len(s["many"]) == 2 and len(s["so_far"]) == 384 and len(s["by_main"]) == 576
    finally:
        backend.shutdown()


def test_one_server_chats_and_embeds_with_two_models(minilm):
    """--embedding-model-path beside the default model: requests naming no model (or the embedding model) get its
    vectors, naming the main model get the decoder's; both are listed to OpenAI's and Ollama's clients."""
    srv = Server("--embedding-model-path", minilm, "--max-total-tokens", "4096")
    try:
        with srv.client() as http:
            models = [m["id"] for m in http.get("/v1/models").json()["data"]]
            assert len(models) == 2 and models[1] == "all-minilm-l6-v2"
            dims = {name: len(http.post("/v1/embeddings", json={"input": "hi", **body}).json()["data"][0]["embedding"])
                    for name, body in {"none": {}, "embedder": {"model": models[1]}, "main": {"model": models[0]}}.items()}
            assert dims == {"none": 384, "embedder": 384, "main": 576}
            assert http.post("/v1/embeddings", json={"input": "hi", "model": "nope"}).status_code == 404
            tags = [m["name"] for m in http.get("/api/tags").json()["models"]]
            assert tags[1] == "all-minilm-l6-v2:latest"
            embed = http.post("/api/embed", json={"model": tags[1], "input": ["a", "b"]}).json()["embeddings"]
            assert [len(v) for v in embed] == [384, 384]
            assert http.post("/api/show", json={"model": tags[1]}).json()["capabilities"] == ["embedding"]
            chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 4})
            assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] > 0
    finally:
        assert srv.stop() == 0
