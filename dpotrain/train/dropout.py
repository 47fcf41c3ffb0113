"""The dropout a model applies in training, beyond TRL's reach.

TRL's `disable_dropout` (on by default) sets each `nn.Dropout`'s p to 0, but transformers models also drop out
functionally, at rates their modules copy from the config (`self.attention_dropout`; Seed-OSS's `residual_dropout`,
0.1 each): the policy trained with dropout while the reference, scored in eval mode, had none, step 1's loss was not
ln 2 and the health guard stopped the run blaming the reference. `disable` zeroes those rates too (the config, and so
the saved config.json, is left as it was); `active` is what the step1 guard reads where dropout is kept on purpose.
"""

import re

import torch

# A module attribute holding a dropout probability (`attention_dropout`, `residual_dropout`, `resid_pdrop`)
RATE_NAME = re.compile(r"dropout|pdrop")


def _rates(module) -> list[str]:
    """The names of `module`'s functional dropout rates above 0."""
    return [n for n, v in vars(module).items() if type(v) is float and v > 0 and RATE_NAME.search(n)]


def disable(model) -> None:
    """Every functional dropout rate of `model`'s modules set to 0 (TRL's disable_dropout does the Dropout modules)."""
    for module in model.modules():
        for name in _rates(module):
            setattr(module, name, 0.0)


def active(model) -> list[str]:
    """The dropout left on in training, each as 'name p': a Dropout module's (a LoRA adapter's among them) and a
    functional rate (`disable`'s)."""
    found = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            found.setdefault(f"{type(module).__name__} {module.p:g}", None)
        for name in _rates(module):
            found.setdefault(f"{name} {getattr(module, name):g}", None)
    return list(found)
