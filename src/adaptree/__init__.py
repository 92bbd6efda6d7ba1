"""adaptree: lossless LLM inference acceleration with EAGLE-3 speculative decoding and adaptive draft trees."""

__version__ = "0.1.0"
