"""Incremental detokenization: multi-byte characters split across tokens, stop strings across tokens."""

from plait.runtime.launch.detokenizer import IncrementalDecoder


def _stream(tokenizer, ids, **kw):
    dec = IncrementalDecoder(tokenizer, **kw)
    pieces = [dec.feed([t]) for t in ids]
    pieces.append(dec.finish())
    return pieces, dec.text


def test_multibyte_utf8_never_shows_partial_characters(tokenizer):
    text = "Olá 世界 🙂 naïve café — 日本語"
    ids = tokenizer.encode(text)
    pieces, final = _stream(tokenizer, ids)
    assert "".join(pieces) == final == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_is_trimmed_and_never_streamed(tokenizer):
    text = "The answer is forty-two. THE END and more text"
    ids = tokenizer.encode(text)
    pieces, final = _stream(tokenizer, ids, stop=["THE END"])
    assert final == "The answer is forty-two. "
    assert "".join(pieces) == final
    pieces, final = _stream(tokenizer, ids, stop=["THE END"], no_stop_trim=True)
    assert final == "The answer is forty-two. THE END"
