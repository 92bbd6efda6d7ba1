"""Typed configuration of the Llama-family target models (Llama 2/3.x, Qwen2/2.5, Qwen3, SmolLM2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Field names follow Hugging Face's ``config.json`` so a config converts in both directions.
    """

    arch: str = "llama"
    """One of ``SUPPORTED_ARCHS``: llama (Llama 2/3.x, SmolLM2), qwen2 (QKV bias), qwen3 (q/k RMSNorm)."""
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    """Per-head width; ``hidden_size // num_attention_heads`` when None (Qwen3 sets it explicitly)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """Only the Llama-3 scheme (``rope_type: llama3``) and linear scaling are supported."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2 has it; o_proj never does in the supported families)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by "
                                 f"num_attention_heads ({self.num_attention_heads}); set head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = list(self.eos_token_id or [])
        if self.num_hidden_layers < 4:
            # EAGLE-3 taps layers 1, L//2-1 and L-4; fewer than 4 layers cannot provide them.
            raise ValueError(f"num_hidden_layers must be >= 4 for EAGLE-3 feature taps, got {self.num_hidden_layers}")

    @property
    def feature_layers(self) -> tuple[int, int, int]:
        """0-based indices of the decoder layers whose outputs are EAGLE-3's low/mid/high features."""
        n = self.num_hidden_layers
        return (1, n // 2 - 1, n - 4)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary; unknown architectures are refused."""
        model_type = cfg.get("model_type", "")
        archs = cfg.get("architectures") or []
        if model_type in ("llama", "mistral") or any(a.startswith("Llama") for a in archs):
            arch = "llama"
        elif model_type == "qwen2" or any(a.startswith("Qwen2") for a in archs):
            arch = "qwen2"
        elif model_type == "qwen3" or any(a.startswith("Qwen3") for a in archs):
            arch = "qwen3"
        else:
            raise ValueError(f"unsupported architecture: model_type={model_type!r}, architectures={archs!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
        if arch == "qwen3" and cfg.get("num_experts"):
            raise ValueError("Qwen3 mixture-of-experts models are not supported")
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 layout
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        eos = cfg.get("eos_token_id")
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim"),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[] if eos is None else eos,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` form of this config."""
        names = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM")}
        model_type, cls_name = names[self.arch]
        out: dict[str, Any] = {
            "model_type": model_type, "architectures": [cls_name],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        }
        if self.arch == "llama":
            out["attention_bias"] = self.attention_bias
        return out
