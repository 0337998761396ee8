"""The `transformers` layout of `init-model`: tensors spelled as transformers'
`save_pretrained` writes them, which is what a user who saved a model has on disk.

The spelling comes from transformers itself: `revert_weight_conversion`, the function
`save_pretrained` calls to undo its load-time conversion (fused experts split back into
one tensor per expert, V4's names turned back into upstream leaf names under
transformers' prefixes). It is called one decoder layer at a time, on a model built on
the meta device, so a checkpoint of published size never sits in memory whole. The MTP
layer, which transformers does not build, goes through the same conversion: V2/V3's as
the layer after the last (`model.layers.{num_hidden_layers}`), V4's under `mtp.0.`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from itertools import groupby

import torch


def available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def layer_group(name: str) -> str:
    """Tensors that one conversion must see together: a decoder (or MTP) layer's. Callers
    of as_saved pass each group's tensors together."""
    parts = name.split(".")
    if parts[0] == "model" and len(parts) > 2 and parts[1] == "layers":
        return ".".join(parts[:3])
    if parts[0] == "mtp":
        return ".".join(parts[:2])
    return ""


def as_saved(raw_config: dict, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Args: the checkpoint's config.json as a dict; (name, tensor) under transformers'
    in-memory names, grouped by layer. Returns: (name, tensor) as save_pretrained writes them."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.for_model(**raw_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for _, group in groupby(tensors, key=lambda item: layer_group(item[0])):
        yield from revert_weight_conversion(model, dict(group)).items()
