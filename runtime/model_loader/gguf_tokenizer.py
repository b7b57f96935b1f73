"""The tokenizer a GGUF file describes, built with the `tokenizers` library the way llama.cpp tokenizes.

Two vocabulary kinds (`tokenizer.ggml.model`):

  gpt2   byte-level BPE: the tokens are already in the byte alphabet, the merges are in the file; the
         text is first split by the pre-tokenizer regexes `tokenizer.ggml.pre` names (llama.cpp's
         table: each regex in turn splits every piece, keeping the text between matches)
  llama  SentencePiece BPE: spaces become U+2581 (and one is prepended when `add_space_prefix`);
         adjacent pieces merge into the vocabulary token of the highest score, which is a BPE whose
         merge ranks follow the merged tokens' scores; characters outside the vocabulary fall back to
         their <0xNN> byte tokens

Token types (`tokenizer.ggml.token_type`): control tokens (3) are special (matched whole, skipped when
decoding with skip_special_tokens), user-defined tokens (4) are matched whole in the raw text (Gemma's
runs of newlines and spaces), byte tokens (6) serve the fallback. The chat template is the file's own;
a file without one gets its architecture's from `FALLBACK_TEMPLATES` (llama.cpp does the same).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

logger = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# `tokenizer.ggml.pre` -> the regexes that split the text, in order (llama.cpp's pre-tokenizer types)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe", "chatglm-bpe"),
                    (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "grok-2"), (_QWEN2,)),
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "roberta-bpe", "jina-es",
                     "jina-de", "jina-v2-es", "jina-v2-de", "jina-v2-code", "gigachat"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (r"\p{N}", _GPT2)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
    "tekken": (_TEKKEN,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "default": _DEFAULT,
}
# llama.cpp's BPE takes a whole pre-token that is itself a token before merging (tokenizer.json's ignore_merges)
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}

# control tokens that end a turn besides the file's eos/eot/eom ids (llama.cpp's end-of-generation texts)
_END_OF_TURN_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                      "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>"}

_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}{% else %}{% set system = '' %}"
    "{% endif %}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' }}{% if loop.first and system %}{{ system + '\n\n' }}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# the template of a file that carries none, by architecture; chatml for the rest (as llama.cpp)
FALLBACK_TEMPLATES = {"gemma": _GEMMA_TEMPLATE, "gemma2": _GEMMA_TEMPLATE, "gemma3": _GEMMA_TEMPLATE}


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """A transformers `PreTrainedTokenizerFast` over the file's vocabulary, special tokens and chat template."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens: pass --tokenizer-path")
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    if kind == "gpt2":
        tok = _byte_level(metadata, tokens)
    elif kind == "llama":
        tok = _sentencepiece(metadata, tokens, types)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (gpt2 and llama are); pass --tokenizer-path")
    _add_special(tok, tokens, types)
    specials = {name: _token(metadata, tokens, key) for name, key in
                (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                 ("pad_token", "padding_token_id"))}
    _post_process(tok, metadata, tokens)
    template = metadata.get("tokenizer.chat_template") or FALLBACK_TEMPLATES.get(
        str(metadata.get("general.architecture")), _CHATML_TEMPLATE)
    return _wrap(tok, chat_template=template, **{k: v for k, v in specials.items() if v is not None})


def _wrap(backend: Tokenizer, **kwargs: Any) -> Any:
    """transformers' tokenizer API around `backend`, which it adopts as it is: given as `tokenizer_object`, it would
    deep-copy it (~100 MB more for a 150k vocabulary, in every process that loads the tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    class GGUFTokenizer(PreTrainedTokenizerFast):
        def __init__(self, **kw: Any):
            self._tokenizer = backend
            super().__init__(**kw)

    return GGUFTokenizer(**kwargs)


def stop_token_ids(metadata: dict[str, Any]) -> tuple[int, ...]:
    """Token ids that end generation: the file's eos, eot and eom ids, and control tokens whose text ends a
    turn in a known chat format (Gemma's <end_of_turn>, Qwen's <|endoftext|> beside <|im_end|>)."""
    ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None:
        ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in _END_OF_TURN_TEXTS]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None and 0 <= int(i) < len(tokens)))


def _token(metadata: dict[str, Any], tokens: list[str], key: str) -> str | None:
    i = metadata.get(f"tokenizer.ggml.{key}")
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None


def _byte_level(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        logger.warning("GGUF pre-tokenizer %r is unknown; splitting text with llama.cpp's default regexes", pre)
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre in _IGNORE_MERGES)
    tok = Tokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS.get(pre, _DEFAULT)]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    scores = [0.0] * len(tokens) if scores is None else [float(s) for s in scores]
    unk = _token(metadata, tokens, "unknown_token_id")
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, _merges_by_score(tokens, types, scores),
                     unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*decode, decoders.Strip(" ", 1, 0)] if space_prefix else decode)
    return tok


def _merges_by_score(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges SentencePiece's rule implies: (a, b) for every normal token a + b whose parts are tokens,
    ranked by the score of a + b (highest first; the lower id first among equal scores)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, UNKNOWN) or len(t) == 1}
    found = []
    for token, i in vocab.items():
        if types[i] != NORMAL:
            continue
        for k in range(1, len(token)):
            left, right = vocab.get(token[:k]), vocab.get(token[k:])
            if left is not None and right is not None:
                found.append((-scores[i], i, left, right))
    found.sort()
    return [(tokens[a], tokens[b]) for _, _, a, b in found]


def _add_special(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens (both matched whole)."""
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _post_process(tok: Tokenizer, metadata: dict[str, Any], tokens: list[str]) -> None:
    """BOS (and EOS) around each encoded text where the file asks for them."""
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = _token(metadata, tokens, "bos_token_id"), _token(metadata, tokens, "eos_token_id")
    pre = [bos] if add_bos and bos is not None else []
    post = [eos] if add_eos and eos is not None else []
    if not pre and not post:
        return
    single = " ".join([*pre, "$A", *post])
    pair = " ".join([*pre, "$A", *post, *pre, "$B", *post])
    special = [(t, tokens.index(t)) for t in dict.fromkeys(pre + post)]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
