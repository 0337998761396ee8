from moemesh.shared.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer


def _stream(tok, ids, stop=()):
    d = IncrementalDetokenizer(tok, stop)
    parts = [d.add([i]) for i in ids]
    parts.append(d.flush())
    return parts, d


def test_streamed_text_equals_full_decode_and_never_splits_characters(tiny_model):
    tok = Tokenizer(tiny_model)
    text = "Ünïcode → 日本語 and emoji 🙂🙂 mixed with the model tokens"
    ids = tok.encode(text, add_special_tokens=False)
    parts, _ = _stream(tok, ids)
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)
    # byte-level tokens for a 4-byte emoji arrive one by one: nothing is released mid-character
    emoji = [i for i in tok.encode("🙂", add_special_tokens=False)]
    parts, _ = _stream(tok, emoji)
    assert parts[-2] == "🙂" or "".join(parts) == "🙂"
    assert all(p in ("", "🙂") for p in parts)


def test_stop_string_is_cut_and_nothing_after_is_released(tiny_model):
    tok = Tokenizer(tiny_model)
    ids = tok.encode("the model decode STOP cache layer", add_special_tokens=False)
    parts, d = _stream(tok, ids, stop=("STOP",))
    assert "".join(parts) == "the model decode "
    assert d.stopped


def test_partial_stop_prefix_is_held_until_ruled_out(tiny_model):
    tok = Tokenizer(tiny_model)
    ids = tok.encode("abc STO and more", add_special_tokens=False)
    parts, d = _stream(tok, ids, stop=("STOP",))
    assert "".join(parts) == "abc STO and more" and not d.stopped


def test_chat_template_and_specials(tiny_model):
    tok = Tokenizer(tiny_model)
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == "hi"


def test_the_byte_table_and_the_window_decode_give_the_same_text(tiny_model):
    # Random ids, specials and lone bytes of multi-byte characters included: streamed one
    # at a time through either way, the text is the library's decode of all of them.
    import random

    tok = Tokenizer(tiny_model)
    assert tok.byte_pieces(True) is not None  # the tiny model's tokenizer is byte-level
    rng = random.Random(0)
    for trial in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        for skip in (True, False):
            fast = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            slow = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            slow._pieces = None
            got = ["".join(d.add([i]) for i in ids) + d.flush() for d in (fast, slow)]
            assert got[0] == got[1] == tok.decode(ids, skip_special_tokens=skip), (trial, skip)


def test_each_gives_what_add_gives_one_id_at_a_time(tiny_model):
    # The gateway's chunk-per-token path: the same texts, stop strings or not.
    import random

    tok = Tokenizer(tiny_model)
    rng = random.Random(1)
    for stop in ((), ("e",)):
        ids = [rng.randrange(tok.vocab_size) for _ in range(200)]
        one, many = IncrementalDetokenizer(tok, stop), IncrementalDetokenizer(tok, stop)
        want = [one.add([i]) for i in ids]
        got = many.each(ids[:70]) + many.each(ids[70:71]) + many.each(ids[71:])
        assert got == want and one.flush() == many.flush()
