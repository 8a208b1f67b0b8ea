"""The files of an HF checkpoint directory: ``*.safetensors`` (with their index), read lazily.

    tensors = read_dir("Llama-3-8B/")
    tensors["model.embed_tokens.weight"].shape
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import torch

INDEX_FILE = "model.safetensors.index.json"




class SafetensorsDir(Mapping):
    """The tensors of an HF checkpoint directory, read lazily (one file handle per shard)."""

    def __init__(self, directory: str | os.PathLike):
        from safetensors import safe_open

        d = Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"train.init_from: {str(d)!r} is not a directory; give a directory of "
                                    f"Hugging Face *.safetensors files")
        self.directory = d
        index = d / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map' "
                                 f"of tensor name -> file): {e}") from None
            files = sorted(set(weight_map.values()))
            for name in files:
                if not (d / name).is_file():
                    key = next(k for k, v in weight_map.items() if v == name)
                    raise FileNotFoundError(f"{index} maps {key} to {name}, which is not in {d}")
        else:
            files = sorted(p.name for p in d.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"train.init_from: {str(d)!r} holds no *.safetensors files (and no "
                                        f"{INDEX_FILE})")
            weight_map = None
        self._handles = {}
        self._where: dict[str, str] = {}
        self.bytes_read = 0  # tensor bytes handed out so far (whole tensors and slices)
        for name in files:
            try:
                handle = self._handles[name] = safe_open(str(d / name), framework="pt")
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise ValueError(f"{d / name}: not a readable safetensors file ({e})") from None
            for key in handle.keys():
                if weight_map is None and key in self._where:
                    raise ValueError(f"{d}: tensor {key} is in both {self._where[key]} and {name}; "
                                     f"remove one, or add a {INDEX_FILE} saying which to use")
                if weight_map is None or weight_map.get(key) == name:
                    self._where[key] = name
        if weight_map is not None:
            for key, name in weight_map.items():
                if key not in self._where:
                    raise ValueError(f"{index} maps {key} to {name}, but {name} has no tensor {key}")

    def __getitem__(self, key: str) -> torch.Tensor:
        x = self._handles[self._where[key]].get_tensor(key)
        self.bytes_read += x.numel() * x.element_size()
        return x

    def get_slice(self, key: str) -> "TensorSlice":
        """``key``'s tensor, not yet read: its ``shape`` and ``dtype`` come from the file header,
        and ``[index]`` (one slice per dim) reads only that box.

        Example:
            part = read_dir("ckpt/").get_slice("model.embed_tokens.weight")[0:64, 128:256]
        """
        return TensorSlice(self, key, self._handles[self._where[key]].get_slice(key))

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def config(self) -> dict | None:
        """The directory's ``config.json``, or None."""
        path = self.directory / "config.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""The safetensors header's dtype names."""


class TensorSlice:
    """One tensor of a :class:`SafetensorsDir`, read only where indexed."""

    def __init__(self, owner: SafetensorsDir, key: str, handle):
        self._owner, self._key, self._handle = owner, key, handle

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._handle.get_shape())

    @property
    def dtype(self) -> torch.dtype:
        name = self._handle.get_dtype()
        if name not in SAFETENSORS_DTYPES:
            raise ValueError(f"{self._owner.directory}: {self._key} has safetensors dtype {name}, which the loader "
                             f"does not read ({', '.join(SAFETENSORS_DTYPES)})")
        return SAFETENSORS_DTYPES[name]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        x = self._handle[index]
        self._owner.bytes_read += x.numel() * x.element_size()
        return x


def read_dir(directory: str | os.PathLike) -> SafetensorsDir:
    """The HF tensors of ``directory`` as a lazy mapping ``{key: tensor}``.

    Example:
        sorted(read_dir("Llama-3-8B/"))[:2]  # ['lm_head.weight', 'model.embed_tokens.weight']
    """
    return SafetensorsDir(directory)
