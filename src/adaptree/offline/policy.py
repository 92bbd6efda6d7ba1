"""Small MLP policies as shipped files: what LTD and Re-SpS run at inference.

Training uses Stable-Baselines3 PPO (whose checkpoints are zip files of pickles: they stay in run
folders). What ships is the extracted actor, a plain torch MLP, in a folder with ``config.json``
(:class:`MLPPolicyConfig`; unknown fields refused) and ``model.safetensors`` (loaded strictly: a missing,
unexpected or mis-shaped tensor is an error that names it). No SB3 import on the inference path. The folder
format (:func:`save_policy`, :func:`load_policy`, :func:`load_strict`) is shared with RADAR's LSTM policy.

The network is ``Linear -> act -> ... -> Linear`` (SB3's ``mlp_extractor.policy_net`` followed by its
``action_net``), giving one logit per discrete action; :meth:`MLPPolicy.act` takes the argmax
(deterministic, as LTD runs its policies) or samples at a temperature (Re-SpS's max-entropy variant).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from adaptree.offline.runs import dataclass_from_dict, save_tensors, write_json

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


# ---- the folder format ------------------------------------------------------------------------------


def load_strict(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """``model.load_state_dict`` that names the first missing, unexpected or mis-shaped key."""
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected)")
    for k, v in own.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            raise ValueError(f"{where}: tensor {k!r} has shape {tuple(tensors[k].shape)}, the config needs "
                             f"{tuple(v.shape)}")
    model.load_state_dict(tensors, strict=True)


def save_policy(folder: str | os.PathLike, model: nn.Module, config: dict, training: dict | None = None,
                sort_keys: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    """Write a policy folder: ``config.json`` (``config``, plus ``training`` facts under ``training``) and
    ``model.safetensors`` (the state dict in ``dtype``; loading casts it to the module's), each atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    if training:
        cfg["training"] = training
    save_tensors({k: v.to(dtype) for k, v in model.state_dict().items()}, folder / WEIGHTS_NAME,
                 metadata={"format": "pt"})
    write_json(cfg, folder / CONFIG_NAME, sort_keys=sort_keys)
    return folder


def load_policy(folder: str | os.PathLike, build: Callable[[dict], nn.Module], what: str = "policy") -> nn.Module:
    """Load a folder written by :func:`save_policy`: ``build(config dict)`` makes the module (and refuses a
    config it cannot take), whose weights are then loaded strictly (:func:`load_strict`); in eval mode."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path, w_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"{what} file {str(p)!r} does not exist")
    model = build(json.loads(cfg_path.read_text()))
    load_strict(model, load_file(str(w_path)), str(w_path))
    return model.eval()


# ---- the MLP policy ---------------------------------------------------------------------------------


@dataclass
class MLPPolicyConfig:
    """Shape of an MLP policy and what its inputs and outputs mean."""

    kind: str
    """What the policy decides: ``ltd-depth``, ``ltd-size``, ``resps``, ... (checked by the controller)."""
    obs_dim: int
    """Length of the observation vector."""
    actions: list = field(default_factory=list)
    """The action set, one entry per logit (e.g. [STOP, CONTINUE], the V values, the (TT, d, k) triples)."""
    hidden: list[int] = field(default_factory=lambda: [1024])
    """Hidden layer widths of the actor."""
    activation: str = "tanh"
    """Activation between layers (SB3's default for PPO: tanh)."""
    observation: dict = field(default_factory=dict)
    """How the observation is built (the controller rebuilds it exactly; see each method's module)."""

    def __post_init__(self) -> None:
        if not self.kind:
            raise ValueError("kind must be a non-empty string")
        if int(self.obs_dim) < 1:
            raise ValueError(f"obs_dim must be >= 1, got {self.obs_dim}")
        if len(self.actions) < 2:
            raise ValueError(f"a policy needs at least 2 actions, got {len(self.actions)}")
        if any(int(h) < 1 for h in self.hidden):
            raise ValueError(f"hidden layer widths must be >= 1, got {self.hidden}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")
        self.hidden = [int(h) for h in self.hidden]
        self.actions = [a if isinstance(a, (int, float, str)) else list(a) for a in self.actions]

    @classmethod
    def from_dict(cls, d: dict) -> "MLPPolicyConfig":
        return dataclass_from_dict(cls, d, "policy", allowed=("version", "training"))


class MLPPolicy(nn.Module):
    """The actor network: observation ``[obs_dim]`` -> one logit per action."""

    def __init__(self, config: MLPPolicyConfig) -> None:
        super().__init__()
        self.config = c = config
        layers: list[nn.Module] = []
        width = c.obs_dim
        for h in c.hidden:
            layers += [nn.Linear(width, h), ACTIVATIONS[c.activation]()]
            width = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, len(c.actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(obs))

    @torch.inference_mode()
    def act(self, obs: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None) -> int:
        """Index of the chosen action: argmax at ``temperature`` 0, else a sample of softmax(logits / T)."""
        logits = self.forward(obs)
        if temperature <= 0.0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    @torch.inference_mode()
    def act_padded(self, head: torch.Tensor, pad_value: float, width: int, tail: torch.Tensor) -> int:
        """:meth:`act` (argmax) on the observation ``[head ; pad_value x (width - len(head)) ; tail]`` without
        multiplying the padding: its share of the first layer, ``b + pad_value * W[:, n:width].sum(1)``, is
        cached per head length n. For LTD's size policy the padding is most of the input (a depth-1 tree fills
        10 of 1,110 score slots). Equal to :meth:`act` up to float summation order."""
        n = head.numel()
        first = self.body[0] if len(self.body) else self.head
        if not isinstance(first, nn.Linear) or n > width or width + tail.numel() != first.in_features:
            raise ValueError(f"act_padded: head {n} + padding to {width} + tail {tail.numel()} does not make the "
                             f"policy's {self.config.obs_dim} inputs")
        cache = self.__dict__.setdefault("_pad_cache", {})
        key = (n, float(pad_value), width)
        if key not in cache:
            cache[key] = first.bias + pad_value * first.weight[:, n:width].sum(dim=1)
        w = first.weight
        x = cache[key] + w[:, :n] @ head + w[:, width:] @ tail
        rest = list(self.body)[1:] + [self.head] if len(self.body) else []
        for layer in rest:
            x = layer(x)
        return int(x.argmax())

    # ---- SB3 ------------------------------------------------------------------------------------------

    def _sb3_pairs(self, sb3_policy) -> list[tuple[nn.Linear, nn.Linear]]:
        """(SB3 actor layer, this policy's layer) pairs, shapes checked."""
        src = [m for m in sb3_policy.mlp_extractor.policy_net if isinstance(m, nn.Linear)] + [sb3_policy.action_net]
        dst = [m for m in self.body if isinstance(m, nn.Linear)] + [self.head]
        if len(src) != len(dst):
            raise ValueError(f"the SB3 actor has {len(src)} linear layers, the config needs {len(dst)}")
        for s, d in zip(src, dst):
            if s.weight.shape != d.weight.shape:
                raise ValueError(f"SB3 layer shape {tuple(s.weight.shape)} does not match {tuple(d.weight.shape)}")
        return list(zip(src, dst))

    @classmethod
    def from_sb3(cls, sb3_policy, config: MLPPolicyConfig) -> "MLPPolicy":
        """Copy the actor of an SB3 ``ActorCriticPolicy`` (``mlp_extractor.policy_net`` + ``action_net``)."""
        model = cls(config)
        with torch.no_grad():
            for s, d in model._sb3_pairs(sb3_policy):
                d.weight.copy_(s.weight.detach().cpu())
                d.bias.copy_(s.bias.detach().cpu())
        return model.eval()

    def into_sb3(self, sb3_policy) -> None:
        """Copy this actor into an SB3 ``ActorCriticPolicy`` (a warm start; its critic is left as it is)."""
        with torch.no_grad():
            for s, d in self._sb3_pairs(sb3_policy):
                s.weight.copy_(d.weight.to(s.weight.device))
                s.bias.copy_(d.bias.to(s.bias.device))

    # ---- files ----------------------------------------------------------------------------------------

    def save(self, folder: str | os.PathLike, training: dict | None = None) -> Path:
        """Write ``config.json`` (the config, plus ``training`` facts) and ``model.safetensors``."""
        return save_policy(folder, self, {"version": 1, **asdict(self.config)}, training)

    @classmethod
    def load(cls, folder: str | os.PathLike, kind: str | None = None) -> "MLPPolicy":
        """Load a folder written by :meth:`save`, strictly; ``kind`` (if given) must match the config's."""

        def build(d: dict) -> "MLPPolicy":
            config = MLPPolicyConfig.from_dict(d)
            if kind is not None and config.kind != kind:
                raise ValueError(f"{str(folder)!r} holds a {config.kind!r} policy, a {kind!r} policy is needed")
            return cls(config)

        return load_policy(folder, build)


def training_facts(folder: str | os.PathLike) -> dict:
    """The ``training`` section of a saved policy's config (empty if none)."""
    return json.loads((Path(folder) / CONFIG_NAME).read_text()).get("training", {})
