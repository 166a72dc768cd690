"""Building the torch model of a family and running it.

:func:`build_model` makes the transformers model from its tiny config (``_from_config``, seeded
random weights, the requested attention implementation) and wraps it so that it takes positional
tensors and returns ``last_hidden_state`` (the one graph output); :func:`torch_outputs` runs it on
NumPy feeds (the reference an exported or fused model is compared with).

torch and transformers are imported inside the functions only.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .families import ATTNS, check_choice, get_family


def wrapper_class():
    """The wrapper module class (made on first use: it subclasses ``torch.nn.Module``)."""
    import torch

    class Wrapped(torch.nn.Module):
        """Positional tensors in, ``last_hidden_state`` out (one graph output)."""

        def __init__(self, model, input_names, call_kwargs):
            super().__init__()
            self.model = model
            self.input_names = tuple(input_names)
            self.call_kwargs = dict(call_kwargs)

        def forward(self, *args):
            out = self.model(**dict(zip(self.input_names, args)), **self.call_kwargs)
            return out.last_hidden_state

    return Wrapped


def build_model(family: str, attn: str = "sdpa", seed: int = 0, **overrides: Any):
    """The wrapped torch module (eval mode, float32, weights from ``torch.manual_seed(seed)``).

    The caller's torch RNG state is left as it was. The returned module has ``.config``.
    """
    import torch
    import transformers

    fam = get_family(family)
    check_choice("attn", attn, ATTNS)
    config = fam.config(**overrides)
    cls = getattr(transformers, fam.model_class)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(config, attn_implementation=attn)
    got = model.config._attn_implementation
    if got != attn:
        raise RuntimeError(f"{fam.model_class} runs attn_implementation={got!r}, not the requested {attn!r}")
    wrapped = wrapper_class()(model.eval(), fam.inputs, fam.call_kwargs).eval()
    wrapped.config = model.config
    return wrapped


def torch_outputs(family: str, attn: str, feeds: Mapping[str, np.ndarray], seed: int = 0,
                  model=None, **overrides: Any) -> dict[str, np.ndarray]:
    """Run the torch model (rebuilt from family/attn/seed/overrides unless given) on NumPy feeds."""
    import torch

    fam = get_family(family)
    if model is None:
        model = build_model(family, attn, seed, **overrides)
    args = tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in fam.inputs)
    with torch.no_grad():
        out = model(*args)
    return {"last_hidden_state": out.detach().cpu().numpy()}
