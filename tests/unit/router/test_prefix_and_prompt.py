"""The router hashes and tokenizes prompts as the engine and the server do, without torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet_serving.engine.tokenizer import load_tokenizer
from tokenfleet_serving.router.prefix import block_hashes
from tokenfleet_serving.router.prompt import prompt_info


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=80), block_size=st.sampled_from([1, 2, 8, 16, 32]))
def test_block_hashes_equal_the_engines(ids, block_size):
    from tokenfleet_serving.engine.block_pool import hash_prefix_blocks

    assert block_hashes(ids, block_size) == tuple(h.hex() for h in hash_prefix_blocks(ids, block_size))


def test_block_hashes_spec_by_hand():
    import hashlib
    import struct

    ids = [1, 2, 3, 4, 5]
    b0 = hashlib.sha256(bytes(32) + struct.pack("<II", 1, 2)).digest()
    b1 = hashlib.sha256(b0 + struct.pack("<II", 3, 4)).digest()
    assert block_hashes(ids, 2) == (b0.hex(), b1.hex())  # the partial last block is not hashed
    assert block_hashes(ids, 2, max_blocks=1) == (b0.hex(),)
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(ids, 0)


def test_router_modules_do_not_import_torch(tiny_model):
    code = ("import sys; import tokenfleet_serving.router.main, tokenfleet_serving.router.app; "
            "from tokenfleet_serving.router.main import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "print('torch' in sys.modules, 'tokenfleet_serving.engine.engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model)], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


CHATS = [
    [{"role": "user", "content": "hello fleet"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the cost of a token?"},
     {"role": "assistant", "content": None}, {"role": "user", "content": [{"type": "text", "text": "one "},
                                                                         {"type": "text", "text": "two"}]}],
    [{"role": "user", "content": "naïve café ☕ " * 20, "name": "bob"}],
]
PROMPTS = ["the cache of the prefix block", "x" * 300, "naïve 日本語 ☕", " leading space"]


def test_prompt_tokens_equal_the_servers(tiny_model):
    from tokenfleet_serving.engine.loader import load_checkpoint
    from tokenfleet_serving.openai.prompt import prompt_token_ids
    from tokenfleet_serving.openai.protocol import parse_chat, parse_completion

    server_tok = load_checkpoint(tiny_model).tokenizer   # what `tokenfleet serve` loads
    router_tok = load_tokenizer(tiny_model)
    vocab = server_tok.vocab_size
    for messages in CHATS:
        body = {"model": "tiny", "messages": messages, "max_tokens": 5}
        expected = prompt_token_ids(server_tok, parse_chat(json.loads(json.dumps(body))), vocab)
        info = prompt_info("chat", body, router_tok)
        assert list(info.token_ids) == expected
        assert (info.num_tokens, info.max_tokens, info.model) == (len(expected), 5, "tiny")
    for prompt in [*PROMPTS, [PROMPTS[0]]]:  # a one-element list is one prompt too
        body = {"model": "tiny", "prompt": prompt}
        expected = prompt_token_ids(server_tok, parse_completion(body), vocab)
        info = prompt_info("completion", body, router_tok)
        assert list(info.token_ids) == expected
        assert info.max_tokens == 16  # OpenAI's default, as the server applies it
    ids = [5, 6, 7, 8]
    assert prompt_info("completion", {"model": "tiny", "prompt": [ids], "max_tokens": 3}, None).token_ids == tuple(ids)


def test_bos_is_added_as_the_server_adds_it(tiny_model, tmp_path):
    import shutil

    d = tmp_path / "bos"
    shutil.copytree(tiny_model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"add_bos_token": True}))
    tok = load_tokenizer(d)
    router_ids = prompt_info("completion", {"model": "m", "prompt": "hello world"}, tok).token_ids
    assert router_ids[0] == tok.token_id("<s>")
    assert list(router_ids[1:]) == load_tokenizer(tiny_model).encode("hello world")


def test_requests_the_router_cannot_tokenize_are_routed_without_prefix(tiny_model):
    tok = load_tokenizer(tiny_model)
    assert prompt_info("chat", {"messages": [{"role": "robot", "content": "x"}]}, tok).token_ids is None
    assert prompt_info("chat", {"messages": "hi"}, tok).token_ids is None
    assert prompt_info("completion", {"prompt": [1, -2]}, tok).token_ids is None
    assert prompt_info("completion", {"prompt": 7}, tok).token_ids is None
    assert prompt_info("completion", ["not", "an", "object"], tok).token_ids is None
    # without a tokenizer the length is estimated (4 characters a token), for difficulty routing
    info = prompt_info("completion", {"model": "m", "prompt": "a" * 400, "max_tokens": 8}, None)
    assert (info.token_ids, info.num_tokens, info.max_tokens) == (None, 101, 8)
    chat = prompt_info("chat", {"model": "m", "messages": [{"role": "user", "content": "b" * 40}],
                                "max_completion_tokens": 9}, None)
    assert (chat.token_ids, chat.num_tokens, chat.max_tokens) == (None, 11, 9)


def test_a_missing_or_broken_tokenizer_leaves_the_router_without_prefixes(tmp_path, caplog):
    from tokenfleet_serving.router.main import load_tokenizer as router_load

    assert router_load(str(tmp_path)) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert router_load(str(tmp_path)) is None
    text = caplog.text
    assert "tokenizer.json: file not found" in text and "tokenizer.json: cannot load tokenizer" in text
