"""Byte-level data: the embedded corpus and the (seed, step) -> batch sampler."""

import collections
import math

import numpy as np
import pytest
import torch

from shardfn.runtime import data


def test_embedded_corpus_is_deterministic_ascii_of_requested_size():
    a = data.embedded_corpus(50_000)
    assert len(a) == 50_000 and a == data.embedded_corpus(50_000)
    assert a != data.embedded_corpus(50_000, seed=1)
    assert max(a) < 128
    assert "plus" in a.decode() and "\n" in a.decode()


def test_embedded_corpus_is_learnable_beyond_unigrams():
    # Bigram entropy well below unigram entropy (and below 2.5 nats): there is structure to learn.
    text = data.embedded_corpus()
    uni = collections.Counter(text)
    bi = collections.Counter(zip(text, text[1:]))
    n = len(text)
    h_uni = -sum(c / n * math.log(c / n) for c in uni.values())
    h_bi = -sum(c / (n - 1) * math.log(c / (n - 1) / (uni[a] / n)) for (a, _), c in bi.items())
    assert h_uni < 3.2 and h_bi < 2.0


def test_batch_is_a_pure_function_of_seed_and_step():
    tokens = data.load_tokens(None)
    a = data.get_batch(tokens, 7, batch_size=4, seq_len=32, seed=3)
    b = data.get_batch(tokens, 7, batch_size=4, seq_len=32, seed=3)
    assert torch.equal(a["inputs"], b["inputs"]) and torch.equal(a["targets"], b["targets"])
    assert not torch.equal(a["inputs"], data.get_batch(tokens, 8, batch_size=4, seq_len=32, seed=3)["inputs"])
    assert not torch.equal(a["inputs"], data.get_batch(tokens, 7, batch_size=4, seq_len=32, seed=4)["inputs"])


def test_batch_shapes_and_shift():
    tokens = data.load_tokens(None)
    batch = data.get_batch(tokens, 0, batch_size=3, seq_len=16)
    assert batch["inputs"].shape == batch["targets"].shape == (3, 16)
    assert batch["inputs"].dtype == batch["targets"].dtype == torch.int64
    assert torch.equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


def test_rows_are_slices_of_the_global_batch():
    tokens = data.load_tokens(None)
    full = data.get_batch(tokens, 5, batch_size=8, seq_len=16, seed=1)
    half = data.get_batch(tokens, 5, batch_size=8, seq_len=16, seed=1, rows=slice(4, 8))
    assert torch.equal(half["inputs"], full["inputs"][4:8])


def test_resume_reproduces_the_stream():
    tokens = data.load_tokens(None)
    run = [b["inputs"] for _, b in data.batches(tokens, batch_size=2, seq_len=8, stop=6)]
    resumed = [b["inputs"] for _, b in data.batches(tokens, batch_size=2, seq_len=8, start=3, stop=6)]
    assert all(torch.equal(x, y) for x, y in zip(run[3:], resumed))


def test_text_file_bytes_are_tokens(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("héllo world\n")
    tokens = data.load_tokens(path)
    assert isinstance(tokens, np.ndarray) and tokens.dtype == np.uint8
    assert data.decode(tokens) == "héllo world\n"
    assert data.decode(data.encode("héllo")) == "héllo"
    batch = data.get_batch(tokens, 0, batch_size=2, seq_len=12)
    assert batch["inputs"].max() < data.VOCAB_SIZE


def test_errors_say_how_to_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path=null"):
        data.load_tokens(tmp_path / "missing.txt")
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ValueError, match="seq_len"):
        data.get_batch(data.load_tokens(short), 0, batch_size=1, seq_len=8)
