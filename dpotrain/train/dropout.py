"""The dropout a model applies in training, beyond TRL's reach.

TRL's `disable_dropout` (on by default) sets each `nn.Dropout`'s p to 0, but transformers models also drop out
functionally, at rates their modules copy from the config (`self.attention_dropout`; Seed-OSS's `residual_dropout`,
0.1 each), or read from it at each forward (`self.config.attention_dropout`, `self.config.hidden_dropout`: Falcon,
GPT-Neo, GPT-J, Persimmon): the policy trained with dropout while the reference, scored in eval mode, had none, step 1's
loss was not ln 2 and the health guard stopped the run blaming the reference. `disable` zeroes those rates too (the
model's config, and so the saved config.json, is left as it was); `active` is what the step1 guard reads where dropout
is kept on purpose, and what the run records (`derived.dropout`) for a resume to compare.
"""

import re

import torch

# A module attribute holding a dropout probability (`attention_dropout`, `residual_dropout`, `resid_pdrop`)
RATE_NAME = re.compile(r"dropout|pdrop")


def _rates(module) -> list[str]:
    """The names of `module`'s functional dropout rates above 0."""
    return [n for n, v in vars(module).items() if type(v) is float and v > 0 and RATE_NAME.search(n)]


def config_rates(config) -> dict[str, float]:
    """The dropout rates above 0 that `config` gives (read through `ConfigWithoutDropout`: none)."""
    fields = vars(config.config if isinstance(config, ConfigWithoutDropout) else config)
    rates = {n: getattr(config, n) for n in fields if RATE_NAME.search(n)}
    return {n: v for n, v in rates.items() if type(v) is float and v > 0}


class ConfigWithoutDropout:
    """A module's view of the model's config with every dropout rate 0, for the modules that read a rate from the
    config at each forward: everything else (the attention kernel switched for samples, a field set) is the model's
    config itself, which the model and config.json keep as they were."""

    def __init__(self, config):
        object.__setattr__(self, "config", config)  # in its own __dict__: read before __getattr__

    def __getattr__(self, name):
        config = self.__dict__.get("config")
        if config is None or name.startswith("__"):  # unpickling or copying: before `config` is set
            raise AttributeError(name)
        value = getattr(config, name)
        return 0.0 if type(value) is float and RATE_NAME.search(name) else value

    def __setattr__(self, name, value):
        setattr(self.config, name, value)


def _module_configs(model):
    """The modules inside the model's PreTrainedModels that hold its config as their own attribute: not a
    PreTrainedModel (its config is the one saved), nor a wrapper around one (PEFT's PeftModel and LoraModel answer with
    the model's config, and the model card, the record and TRL read it there)."""
    from transformers import PretrainedConfig, PreTrainedModel

    seen = set()
    for outer in (m for m in model.modules() if isinstance(m, PreTrainedModel)):
        for module in outer.modules():
            config = vars(module).get("config")
            if id(module) in seen or isinstance(module, PreTrainedModel):
                continue
            seen.add(id(module))
            if isinstance(config, (PretrainedConfig, ConfigWithoutDropout)):
                yield module, config


def disable(model) -> None:
    """Every functional dropout rate of `model`'s modules set to 0 (TRL's disable_dropout does the Dropout modules),
    and a module that reads its rates from the config given a view of it without them."""
    for module in model.modules():
        for name in _rates(module):
            setattr(module, name, 0.0)
    for module, config in list(_module_configs(model)):
        if config_rates(config):
            module.config = ConfigWithoutDropout(config)


def active(model) -> list[str]:
    """The dropout left on in training, each as 'name p': a Dropout module's (a LoRA adapter's among them), a
    functional rate (`disable`'s) and a rate a module reads from the config."""
    found = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            found.setdefault(f"{type(module).__name__} {module.p:g}", None)
        for name in _rates(module):
            found.setdefault(f"{name} {getattr(module, name):g}", None)
    for _, config in _module_configs(model):
        for name, rate in config_rates(config).items():
            found.setdefault(f"{name} {rate:g}", None)
    return list(found)
