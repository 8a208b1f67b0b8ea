"""Byte-level data: a token stream from any text file, or a generated corpus, and a batch sampler.

Tokens are bytes (vocabulary of 256), so any file works without a tokenizer. With no file the
embedded corpus is generated on the fly -- deterministically, with no download: short templated
English-like sentences (``the small fox sees a red ball near the river.``), counting and
arithmetic (``7 plus 5 is 12.``). A small byte-level model learns it quickly, which makes the
default run's loss curve a meaningful smoke test.

Batches are a pure function of ``(seed, step)``: every rank computes the same global batch without
communication, and resuming at step ``k`` reproduces the uninterrupted run exactly (the data
position *is* the step).

    tokens = load_tokens(None)                                    # the embedded corpus
    batch = get_batch(tokens, step=0, batch_size=8, seq_len=64)   # {"inputs", "targets"}: [8, 64]
"""

from __future__ import annotations

import functools
import os
import random
from typing import Iterator

import numpy as np
import torch

VOCAB_SIZE = 256
DEFAULT_CORPUS_BYTES = 262_144

# ----------------------------------------------------------------------------- embedded corpus

_NAMES = ["anna", "ben", "clara", "david", "ella", "frank", "grace", "henry", "iris", "jack"]
_ADJECTIVES = ["small", "big", "red", "green", "old", "young", "happy", "quiet", "fast", "brown"]
_NOUNS = ["cat", "dog", "fox", "bird", "horse", "fish", "child", "farmer", "teacher", "king"]
_OBJECTS = ["ball", "apple", "book", "box", "stone", "cake", "hat", "letter", "flower", "cup"]
_VERBS = ["sees", "finds", "takes", "likes", "holds", "wants", "brings", "paints", "drops", "keeps"]
_PLACES = ["garden", "house", "river", "forest", "market", "school", "field", "kitchen", "hill", "road"]
_PREPS = ["near", "in", "behind", "under", "beside"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _sentence(rng: random.Random) -> str:
    """One sentence from a small grammar; each template has a few word-level choice points."""
    pick = rng.choice
    kind = rng.randrange(6)
    if kind == 0:
        return f"the {pick(_ADJECTIVES)} {pick(_NOUNS)} {pick(_VERBS)} a {pick(_ADJECTIVES)} {pick(_OBJECTS)}."
    if kind == 1:
        return f"{pick(_NAMES)} {pick(_VERBS)} the {pick(_OBJECTS)} {pick(_PREPS)} the {pick(_PLACES)}."
    if kind == 2:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"{a} plus {b} is {a + b}."
    if kind == 3:
        n = rng.randrange(1, 10)
        return f"{pick(_NAMES)} has {_NUMBER_WORDS[n]} {pick(_OBJECTS)}{'s' if n > 1 else ''}."
    if kind == 4:
        start = rng.randrange(0, 6)
        return "count " + " ".join(_NUMBER_WORDS[start : start + 5]) + "."
    return f"the {pick(_NOUNS)} is {pick(_PREPS)} the {pick(_PLACES)} and the {pick(_NOUNS)} is not."


@functools.lru_cache(maxsize=4)
def embedded_corpus(n_bytes: int = DEFAULT_CORPUS_BYTES, seed: int = 0) -> bytes:
    """A deterministic English-like ASCII corpus of exactly ``n_bytes`` bytes.

    Args:
        n_bytes: corpus size in bytes.
        seed: generator seed (the same seed always gives the same bytes).

    Returns:
        Lines of 3-6 sentences each, ASCII-encoded.

    Example:
        text = embedded_corpus(1024).decode()
        text.splitlines()[0]  # e.g. 'the small fox sees a red ball. 7 plus 5 is 12. ...'
    """
    if n_bytes < 1:
        raise ValueError(f"n_bytes must be >= 1, got {n_bytes}")
    rng = random.Random(seed)
    lines, size = [], 0
    while size < n_bytes:
        line = " ".join(_sentence(rng) for _ in range(rng.randrange(3, 7))) + "\n"
        lines.append(line)
        size += len(line)
    return "".join(lines).encode("ascii")[:n_bytes]


# ----------------------------------------------------------------------------- tokens


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 token tensor.

    Example:
        encode("hi")  # tensor([104, 105])
    """
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens) -> str:
    """The text of a 1-d sequence of byte tokens (invalid UTF-8 is replaced).

    Example:
        decode(encode("hi"))  # 'hi'
    """
    values = tokens.tolist() if isinstance(tokens, (torch.Tensor, np.ndarray)) else list(tokens)
    return bytes(int(t) for t in values).decode("utf-8", errors="replace")


def load_tokens(path: str | os.PathLike | None = None, *, corpus_bytes: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """The token stream: the bytes of the file at ``path``, or the embedded corpus when ``None``.

    Files are memory-mapped, so a multi-gigabyte file costs no memory until batches touch it.

    Args:
        path: a file of any content (UTF-8 text is typical), or ``None`` for the embedded corpus.
        corpus_bytes: size of the embedded corpus (ignored when ``path`` is given).

    Returns:
        A 1-d ``uint8`` array of tokens.

    Example:
        tokens = load_tokens(None)          # the embedded corpus
        tokens = load_tokens("input.txt")   # any text file
    """
    if path is None:
        return np.frombuffer(embedded_corpus(corpus_bytes), dtype=np.uint8)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.path {path!r} is not a file; give a text file, or data.path=null "
                                "for the embedded corpus.")
    if os.path.getsize(path) == 0:
        raise ValueError(f"data.path {path!r} is empty")
    return np.memmap(path, dtype=np.uint8, mode="r")


def from_config(data_cfg) -> np.ndarray:
    """:func:`load_tokens` for a ``DataConfig`` (the ``data:`` section of a run config).

    Example:
        tokens = from_config(load_config().data)
    """
    return load_tokens(data_cfg.path, corpus_bytes=data_cfg.corpus_bytes)


# ----------------------------------------------------------------------------- batches


def get_batch(
    tokens: np.ndarray,
    step: int,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    rows: slice | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: ``batch_size`` random windows of ``seq_len + 1`` tokens.

    A pure function of ``(tokens, seed, step)``: each row starts at an offset drawn uniformly from
    a generator seeded with ``(seed, step)``; ``targets`` is ``inputs`` shifted by one token.

    Args:
        tokens: the 1-d token stream from :func:`load_tokens`.
        step: the training step (any non-negative int).
        batch_size: number of rows of the *global* batch.
        seq_len: tokens per row.
        seed: the run's seed.
        rows: optionally only these rows of the global batch (e.g. a data-parallel rank's slice);
            they are identical to the same rows of the full batch.
        device: where to put the tensors.

    Returns:
        ``{"inputs": [B, S] int64, "targets": [B, S] int64}``.

    Example:
        batch = get_batch(load_tokens(None), step=3, batch_size=8, seq_len=64, seed=0)
        batch["inputs"].shape  # torch.Size([8, 64])
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be >= 1")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    n_windows = len(tokens) - seq_len
    if n_windows < 1:
        raise ValueError(f"the data has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                         "use a longer file or a smaller train.seq_len.")
    rng = np.random.default_rng([int(seed), int(step)])
    offsets = rng.integers(0, n_windows, size=batch_size)
    if rows is not None:
        offsets = offsets[rows]
    windows = np.asarray(tokens[offsets[:, None] + np.arange(seq_len + 1)], dtype=np.int64)  # [B, S+1]
    windows = torch.from_numpy(windows).to(device)
    # each its own contiguous tensor, as a plan's stand-in batch is: a step traced on a slice of
    # the windows would copy it where it flattens the targets
    return {"inputs": windows[:, :-1].contiguous(), "targets": windows[:, 1:].contiguous()}


def batches(
    tokens: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    start: int = 0,
    stop: int | None = None,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """``(step, batch)`` for ``step`` in ``[start, stop)`` (forever when ``stop`` is None).

    Example:
        for step, batch in batches(tokens, batch_size=8, seq_len=64, start=100, stop=200):
            ...
    """
    step = start
    while stop is None or step < stop:
        yield step, get_batch(tokens, step, batch_size=batch_size, seq_len=seq_len, seed=seed, device=device)
        step += 1
